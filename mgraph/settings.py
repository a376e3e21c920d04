"""Run-time settings, read from the environment in ONE place (never at import time)."""

from __future__ import annotations

import os

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

    @classmethod
    def from_env(cls, **overrides: object) -> Settings:
        env = {
            "watchdog_s": os.environ.get("MGRAPH_WATCHDOG_S"),
            "threads_per_role": os.environ.get("MGRAPH_THREADS_PER_ROLE"),
            "proxy_batch": os.environ.get("MGRAPH_PROXY_BATCH"),
            "fifo_slots": os.environ.get("MGRAPH_FIFO_SLOTS"),
        }
        values = {k: v for k, v in env.items() if v is not None}
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)
