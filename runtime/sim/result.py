"""What a simulation returns: a RunResult (so every tool that reads the reference runtime's
results reads these), plus the predicted time, busy fractions, bytes per link class, the RDMA
transfers and the baselines modelled on the same hardware."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mgraph.errors import UnknownNameError
from mgraph.hardware import HardwareProfile
from mgraph.kinds import ROLES

from ..reference import RunResult
from .baselines import BaselineResult
from .engine import TransferRecord

__all__ = ["SimResult"]

_ROLE_NAMES = (*(r.value for r in ROLES), "proxy", "nic")
_NIC_LANE = 1_000_000  # Chrome thread ids of NIC lanes: past any SM index


@dataclass
class SimResult(RunResult):
    """``wall_s`` is the PREDICTED time (kernel launch + makespan); trace times start at the
    kernel's start. ``busy[rank][role]``: busy seconds over the SM-seconds the role held; also
    ``proxy`` (the host proxy executing commands) and ``nic`` (some write on the wire from this
    rank), over the makespan."""

    predicted_s: float = 0.0
    makespan_s: float = 0.0
    hardware: HardwareProfile | None = None
    workers: list[dict[str, int]] = field(default_factory=list)
    busy: list[dict[str, float]] = field(default_factory=list)
    bytes_by_link: dict[str, int] = field(default_factory=dict)
    transfers: list[TransferRecord] = field(default_factory=list)
    baselines: dict[str, BaselineResult] = field(default_factory=dict)
    adaptive: bool = False

    @property
    def busy_by_role(self) -> dict[str, float]:
        """Mean over the ranks that ran the role of its busy fraction."""
        out = {}
        for role in _ROLE_NAMES:
            vals = [b[role] for b in self.busy if role in b]
            out[role] = sum(vals) / len(vals) if vals else 0.0
        return out

    def baseline(self, name: str = "sequential") -> BaselineResult:
        if name not in self.baselines:
            raise UnknownNameError(
                f"no baseline {name!r} for this op; available: "
                f"{', '.join(sorted(self.baselines)) or 'none (op has no baseline model)'}"
            )
        return self.baselines[name]

    def speedup(self, baseline: str = "sequential") -> float:
        """Baseline time over the predicted fused time."""
        return self.baseline(baseline).time_s / self.predicted_s

    def to_chrome(self) -> dict:
        """The trace's Chrome JSON plus one lane per (source rank, destination) NIC queue pair
        holding the RDMA writes on the wire."""
        doc = self.trace.to_chrome()
        events = doc["traceEvents"]
        named: set[tuple[int, int]] = set()
        for tr in sorted(self.transfers, key=lambda t: (t.src, t.dst, t.start)):
            tid = _NIC_LANE + tr.dst
            if (tr.src, tr.dst) not in named:
                named.add((tr.src, tr.dst))
                events.append({"ph": "M", "name": "thread_name", "pid": tr.src, "tid": tid,
                               "args": {"name": f"nic -> rank {tr.dst}"}})  # fmt: skip
            events.append({
                "ph": "X", "name": f"rdma write {tr.bytes} B", "cat": "rdma_wire", "pid": tr.src,
                "tid": tid, "ts": tr.start * 1e6, "dur": max(tr.end - tr.start, 0.0) * 1e6,
                "args": {"task": tr.task, "posted_us": tr.posted * 1e6,
                         "arrive_us": tr.arrive * 1e6},
            })  # fmt: skip
        doc["otherData"].update(
            predicted_ms=self.predicted_s * 1e3,
            hardware=self.hardware.name if self.hardware else None,
        )
        return doc

    def save_timeline(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_chrome()))

    def summary(self) -> dict[str, Any]:
        """JSON-ready numbers: times in ms, busy fractions, bytes, baselines, speedups."""
        out: dict[str, Any] = {
            "predicted_ms": self.predicted_s * 1e3,
            "makespan_ms": self.makespan_s * 1e3,
            "adaptive": self.adaptive,
            "busy_by_role": self.busy_by_role,
            "bytes_by_link": dict(self.bytes_by_link),
            "workers_rank0": self.workers[0] if self.workers else {},
            "stats": dict(self.stats),
            "baselines": {k: v.to_dict() for k, v in self.baselines.items()},
        }
        out["speedup"] = {k: v.time_s / self.predicted_s for k, v in self.baselines.items()}
        return out
