"""Hardware profiles: the ONE set of numbers the scheduler, the simulator and the controller use.

The H200 profile is data, not code: ``mgraph/profiles/h200.json`` (package data), written by
``benchmarks/calibrate.py`` on the GPU machine. Every value carries its provenance in
``sources`` (field name -> where the number comes from: a calibration run, a committed benchmark
result, GPU.md, the team's record of probes on the lent 2x H200 machines, or "estimate" where
nothing was measured). Users describe their own clusters with ``HardwareProfile.load(path)`` or
``H200.model_copy(update={...})``.

Who reads what: the scheduler's cost model (mgraph/scheduler/costmodel.py) and the simulator
(runtime/sim/model.py) both cost an NVLink worker's reads from a peer at ``nvlink_worker_gbps``
(pull), its writes into a peer at ``nvlink_worker_push_gbps`` (push), both measured with no
compute on the GPU and scaled by ``nvlink_beside_compute`` while compute runs beside the worker
(the scheduler: on every rank of a graph with compute tasks; the simulator: while that GPU has
compute tasks not finished, runtime/sim/engine.py), and a GEMM epilogue's peer stores at ``epilogue_peer_gbps`` (measured beside
its own GEMM, so not scaled again); the static partition and the controller (simulator, reference
runtime) cap NVLink workers at ``nvlink_max_sms``; the proxy costs ``proxy_command_us`` per
command in both.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = ["HardwareProfile", "H200", "PROFILES", "load_profile"]

# Fields older profile JSON used, and what replaced them: an old file still loads.
_RENAMED = {"nvlink_task_gbps": "nvlink_worker_gbps"}
# ``nvlink_push_sms`` was a second NVLink worker cap (16, the simulator's controller) beside
# ``nvlink_max_sms`` (32, the static partition): one cap now, so the old value is dropped.
_DROPPED = ("nvlink_push_sms",)
# Profiles saved before pushes and pulls were costed apart had one NVLink worker rate: it stays
# the rate of both directions when ``nvlink_worker_push_gbps`` is absent.
_ONE_RATE = ("nvlink_worker_gbps", "nvlink_worker_push_gbps")


class HardwareProfile(BaseModel):
    """One GPU model in one cluster fabric. Bandwidths in GB/s (1e9 B/s), rates in TFLOP/s."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    sms: int = Field(gt=0, description="streaming multiprocessors per GPU")
    tile_gemm_tflops: float = Field(gt=0, description="dense bf16 GEMM rate on all SMs")
    attention_tflops: float = Field(gt=0, description="flash-attention forward rate on all SMs")
    hbm_gbps: float = Field(gt=0, description="device memory bandwidth")
    nvlink_gbps: float = Field(gt=0, description="NVLink per GPU per direction, link rate")
    nvlink_push_gbps: float = Field(gt=0, description="NVLink per direction that SM stores reach")
    rdma_gbps: float = Field(gt=0, description="inter-node bandwidth per GPU (its NIC)")
    rdma_latency_us: float = Field(ge=0, description="one RDMA write, post to remote visibility")
    proxy_command_us: float = Field(ge=0, description="host proxy cost per FIFO command")
    chunk_bytes: int = Field(gt=0, description="smallest network chunk worth a proxy command")
    proxy_batch: int = Field(gt=0, description="most commands the proxy submits at once")
    # -- simulator constants (runtime/sim/). Defaults are the H200 values before calibration,
    # so profile JSON saved before a field existed still loads. --
    grouped_gemm_tflops: float = Field(600.0, gt=0, description="MoE grouped expert GEMM rate")
    launch_us: float = Field(4.0, ge=0, description="one kernel launch, host call to first SM")
    multi_gpu_launch_us: float = Field(
        0.0, ge=0, description="added to a launch spanning several GPUs: entry barrier, exit wait"
    )
    nvlink_latency_us: float = Field(1.0, ge=0, description="a flag store seen by a peer GPU")
    fifo_push_us: float = Field(1.0, ge=0, description="GPU writes one command to host FIFO")
    rdma_chunk_us: float = Field(0.5, ge=0, description="NIC cost per RDMA write (+ flag)")
    copy_engine_gbps: float = Field(
        92.0, gt=0, description="copy-engine copy into a node peer (the emulated wire, uncapped)"
    )
    nccl_nvlink_gbps: float = Field(259.0, gt=0, description="NCCL bus bandwidth over NVLink")
    nccl_rdma_efficiency: float = Field(
        0.92, gt=0, le=1, description="fraction of NIC bandwidth NCCL reaches"
    )
    nccl_base_us: float = Field(8.4, ge=0, description="NCCL fixed latency per collective")
    nccl_nvlink_step_us: float = Field(3.4, ge=0, description="NCCL latency per NVLink step")
    nccl_net_step_us: float = Field(9.6, ge=0, description="NCCL latency per network step")
    nccl_sms: int = Field(16, ge=0, description="SMs NCCL kernels occupy while they run")
    # -- the megakernel as measured; the scheduler's partition and the simulator both use them --
    nvlink_worker_gbps: float = Field(
        3.0,
        gt=0,
        description="bytes/s one megakernel NVLink worker reads from peers in tasks (pull)",
    )
    nvlink_worker_push_gbps: float = Field(
        3.0,
        gt=0,
        description="bytes/s one megakernel NVLink worker writes into peers in tasks (push)",
    )
    nvlink_beside_compute: float = Field(
        1.0,
        gt=0,
        le=1,
        description="fraction of the alone NVLink worker rates a worker gets while compute tiles "
        "run on its GPU's other SMs (1: no contention)",
    )
    nvlink_max_sms: int = Field(
        32, gt=0, description="most SMs NVLink tasks get (static partition and controller)"
    )
    epilogue_peer_gbps: float = Field(
        8.8, gt=0, description="bytes/s of peer stores a GEMM epilogue retires while its SM waits"
    )
    sources: dict[str, str] = Field(
        default_factory=dict, description="field name -> where its value comes from"
    )

    @model_validator(mode="before")
    @classmethod
    def _migrate(cls, data: Any) -> Any:
        if isinstance(data, dict) and any(k in data for k in (*_RENAMED, *_DROPPED)):
            data = {_RENAMED.get(k, k): v for k, v in data.items() if k not in _DROPPED}
        pull, push = _ONE_RATE
        if isinstance(data, dict) and pull in data and push not in data:
            data = {**data, push: data[pull]}
            sources = data.get("sources")
            if isinstance(sources, dict) and pull in sources and push not in sources:
                data["sources"] = {**sources, push: f"the profile's one rate: {sources[pull]}"}
        return data

    @model_validator(mode="after")
    def _sources_name_fields(self) -> HardwareProfile:
        unknown = sorted(set(self.sources) - set(type(self).model_fields))
        if unknown:
            raise ValueError(f"sources names fields the profile does not have: {unknown}")
        return self

    @property
    def nvlink_push_sms(self) -> int:
        """The NVLink worker cap under its old name (the simulator's controller reads it):
        ``nvlink_max_sms``, the one cap."""
        return self.nvlink_max_sms

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.model_dump_json(indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> HardwareProfile:
        return cls.model_validate_json(Path(path).read_text())

    def sm_share(self, sms: int) -> float:
        """Fraction of the full-chip compute rate that ``sms`` compute SMs deliver."""
        return max(0, min(sms, self.sms)) / self.sms

    def source(self, field: str) -> str:
        """Where ``field``'s value comes from ("not recorded" when the profile does not say)."""
        if field not in type(self).model_fields:
            raise KeyError(f"HardwareProfile has no field {field!r}")
        return self.sources.get(field, "not recorded")


PROFILES = ("h200",)  # the profiles shipped in mgraph/profiles/<name>.json


def load_profile(name: str) -> HardwareProfile:
    """A shipped profile by name (see ``PROFILES``)."""
    if name not in PROFILES:
        from .errors import UnknownNameError

        raise UnknownNameError(
            f"no shipped hardware profile {name!r}; shipped: {', '.join(PROFILES)}",
            hint="load your own with HardwareProfile.load(path)",
        )
    text = resources.files("mgraph").joinpath("profiles", f"{name}.json").read_text()
    return HardwareProfile.model_validate_json(text)


H200 = load_profile("h200")
