"""Run-time settings, read from the environment in ONE place (never at import time)."""

from __future__ import annotations

import os
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .errors import SettingsError

__all__ = ["Settings", "ENV_VARS"]

# field -> environment variable; from_env reads exactly these, errors name the variable.
ENV_VARS: dict[str, str] = {
    "watchdog_s": "MGRAPH_WATCHDOG_S",
    "threads_per_role": "MGRAPH_THREADS_PER_ROLE",
    "proxy_batch": "MGRAPH_PROXY_BATCH",
    "fifo_slots": "MGRAPH_FIFO_SLOTS",
    "proxy": "MGRAPH_PROXY",
    "transport": "MGRAPH_TRANSPORT",
    "tcp_host": "MGRAPH_TCP_HOST",
    "nic_gbps": "MGRAPH_NIC_GBPS",
    "gpu_flags": "MGRAPH_GPU_FLAGS",
    "proxy_streams": "MGRAPH_PROXY_STREAMS",
    "proxy_copy_kernel_bytes": "MGRAPH_PROXY_COPY_KERNEL_BYTES",
    "net_report": "MGRAPH_NET_REPORT",
    "max_tasks": "MGRAPH_MAX_TASKS",
    "max_bytes": "MGRAPH_MAX_BYTES",
    "ewise_chains": "MGRAPH_EWISE_CHAINS",
}


class Settings(BaseModel):
    """Knobs of the runtimes. ``Settings.from_env()`` reads MGRAPH_* variables."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    watchdog_s: float = Field(
        5.0, gt=0, allow_inf_nan=False, description="bound on every wait (CPU runtime)"
    )
    threads_per_role: int = Field(
        2, ge=1, description="CPU runtime: at most this many threads per (rank, role)"
    )
    proxy_batch: int = Field(8, ge=1, description="most FIFO commands the proxy takes at once")
    fifo_slots: int = Field(64, ge=2, description="command FIFO capacity (a power of two)")
    proxy: Literal["native", "python"] = Field(
        "native",
        description="host proxy drain loop: the C++ one (GIL released), or the Python one; "
        "there is no silent fallback from one to the other",
    )
    transport: Literal["auto", "inprocess", "tcp", "verbs"] = Field(
        "auto", description="CPU runtime network: inprocess when one process holds every rank, "
        "tcp between processes (auto picks); verbs (RDMA) when asked for: the Python proxy in the "
        "CPU runtime, the native proxy's verbs backend in the megakernel, whose network otherwise "
        "uses cuda_ipc on GPUs and inprocess under the interpreter",
    )
    tcp_host: str = Field("127.0.0.1", description="address the tcp transport listens on")
    nic_gbps: float = Field(
        0.0, ge=0, allow_inf_nan=False, description="native proxy: pace writes like a NIC of this many GB/s (0: off)"
    )
    gpu_flags: Literal["copy", "memop"] = Field(
        "copy", description="how the native proxy raises GPU flag words: a copy-engine copy from "
        "pinned memory, or cuStreamWriteValue32 (slower while persistent kernels run)",
    )
    proxy_streams: int = Field(
        1, ge=1, le=8, description="native proxy: copy streams on a GPU (1..8); a command's "
        "lane (netplan.py) picks stream lane mod streams, so each flag word keeps one writer",
    )
    proxy_copy_kernel_bytes: int = Field(
        0, ge=0, description="native proxy, one copy stream: WRITEs of at most this many bytes "
        "go out as one launch of a one-CTA copy-and-flag kernel instead of a copy then a flag "
        "operation (runtime/proxy/native/copy_kernel.h); it needs an SM no persistent kernel "
        "holds, so 0 (off) unless the megakernel leaves SMs free",
    )
    net_report: bool = Field(
        False, description="megakernel, multi-node: a watchdog timeout's message also gives the "
        "network's state (the FIFO's tickets and tail, the proxy's counters, every net word "
        "short of its count, and what this process's proxy issued for it; "
        "runtime/megakernel/net_report.py). Diagnostic: it waits 2 s to read the words again",
    )

    adaptive: bool = Field(
        False, description="each rank's compute and nvlink workers change role at task "
        "boundaries as the controller (mgraph.scheduler.controller.decide) says: threads in the "
        "CPU reference runtime, programs in the Triton megakernel (runtime/megakernel/control.py; "
        "on 2 H200 correct for GEMM+AR and GEMM+RS, benchmarks/NOTES.md v9; AG+GEMM hung there, "
        "and its fix, docs/controller.md, is interpreter-tested, not yet run on a GPU); off: "
        "each keeps its role",
    )
    adaptive_window_us: float = Field(
        200.0, gt=0, allow_inf_nan=False, description="adaptive: least time between two of a "
        "rank's controller decisions (taken when a task ends; the megakernel's clock is "
        "%globaltimer, the interpreter's decides after every task)",
    )
    ewise_chains: int = Field(
        6, ge=0, le=32, description="megakernel: the most elementwise chains a kernel gets "
        "straight-line code for (mgraph/ops/elementwise_special.py), those with the most tasks "
        "first; other chains, and all with 0, run the bytecode interpreter",
    )

    max_tasks: int = Field(
        1_000_000, ge=1, description="size guard: building a graph with more tasks than this "
        "stops early with SizeLimitError (a 2x8 GEMM+AllReduce at 8192^2x4096 has ~45k)",
    )
    max_bytes: int = Field(
        64 << 30, ge=1, description="size guard: the bytes of all ranks' buffers together (what "
        "the CPU reference runtime allocates); above it, SizeLimitError before anything is built",
    )

    def __init__(self, **values: object) -> None:
        try:
            super().__init__(**values)
        except ValidationError as exc:
            error = _settings_error(exc, values, from_env=False)
            error.validation = exc  # from_env re-words it with the variables' names
            raise error from None

    @classmethod
    def from_env(cls, **overrides: object) -> Settings:
        """Settings from the MGRAPH_* variables (``ENV_VARS``); ``overrides`` win over them."""
        env = {field: os.environ.get(var) for field, var in ENV_VARS.items()}
        values: dict[str, object] = {k: v for k, v in env.items() if v is not None}
        values.update({k: v for k, v in overrides.items() if v is not None})
        try:
            return cls(**values)
        except SettingsError as exc:
            raise _settings_error(
                exc.validation, values, from_env=True, overridden=set(overrides)
            ) from None


def _settings_error(
    exc: ValidationError, values: dict, *, from_env: bool, overridden: set[str] = frozenset()
) -> SettingsError:
    """One line per bad field, naming the environment variable it came from."""
    lines = []
    for err in exc.errors():
        field = str(err["loc"][0]) if err["loc"] else "?"
        given = values.get(field, err.get("input"))
        if from_env and field in ENV_VARS and field not in overridden:
            where = f"environment variable {ENV_VARS[field]}={given!s}"
        else:
            where = f"Settings({field}={given!r})"
        lines.append(f"{where}: {err['msg']}")
    fields = Settings.model_fields
    help_lines = [
        f"{ENV_VARS.get(f, f)}: {fields[f].description}" for f in
        dict.fromkeys(str(e["loc"][0]) for e in exc.errors() if e["loc"] and e["loc"][0] in fields)
    ]
    return SettingsError(
        "invalid mgraph settings: " + "; ".join(lines),
        hint=("unset the variable for the default, or give a valid value ("
        + "; ".join(help_lines) + ")") if help_lines else "see mgraph.settings.Settings",
    )
