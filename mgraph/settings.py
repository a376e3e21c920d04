"""Run-time settings, read from the environment in ONE place (never at import time)."""

from __future__ import annotations

import os
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["Settings"]


class Settings(BaseModel):
    """Knobs of the runtimes. ``Settings.from_env()`` reads MGRAPH_* variables."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    watchdog_s: float = Field(5.0, gt=0, description="bound on every wait (CPU runtime)")
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
        "tcp between processes (auto picks); verbs (RDMA, Python proxy) when asked for",
    )
    tcp_host: str = Field("127.0.0.1", description="address the tcp transport listens on")
    nic_gbps: float = Field(
        0.0, ge=0, description="native proxy: pace writes like a NIC of this many GB/s (0: off)"
    )
    gpu_flags: Literal["copy", "memop"] = Field(
        "copy", description="how the native proxy raises GPU flag words: a copy-engine copy from "
        "pinned memory, or cuStreamWriteValue32 (slower while persistent kernels run)",
    )

    @classmethod
    def from_env(cls, **overrides: object) -> Settings:
        env = {
            "watchdog_s": os.environ.get("MGRAPH_WATCHDOG_S"),
            "threads_per_role": os.environ.get("MGRAPH_THREADS_PER_ROLE"),
            "proxy_batch": os.environ.get("MGRAPH_PROXY_BATCH"),
            "fifo_slots": os.environ.get("MGRAPH_FIFO_SLOTS"),
            "proxy": os.environ.get("MGRAPH_PROXY"),
            "transport": os.environ.get("MGRAPH_TRANSPORT"),
            "tcp_host": os.environ.get("MGRAPH_TCP_HOST"),
            "nic_gbps": os.environ.get("MGRAPH_NIC_GBPS"),
            "gpu_flags": os.environ.get("MGRAPH_GPU_FLAGS"),
        }
        values = {k: v for k, v in env.items() if v is not None}
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)
