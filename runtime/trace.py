"""Execution traces: one record per task (rank, role, worker, start, end), Chrome/Perfetto JSON."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["TaskRecord", "Trace"]


@dataclass(slots=True)
class TaskRecord:
    task: int
    name: str
    kind: str
    rank: int
    role: str
    worker: int
    start: float  # seconds from the run's start
    end: float
    # when the task's waits were met (its work began); None where the runtime does not record
    # it (the megakernel does: end - ready is the body's time, ready - start its waiting)
    ready: float | None = None


@dataclass
class Trace:
    """What ran where and when. Times are seconds from the start of the run."""

    records: list[TaskRecord] = field(default_factory=list)
    backend: str = "reference"

    @property
    def makespan(self) -> float:
        return max((r.end for r in self.records), default=0.0)

    def busy(self, rank: int, role: str) -> float:
        return sum(r.end - r.start for r in self.records if r.rank == rank and r.role == role)

    def to_chrome(self) -> dict:
        """Chrome trace-event format: one process per rank, one thread per (role, worker)."""
        events = []
        threads: dict[tuple[int, str, int], int] = {}
        for r in sorted(self.records, key=lambda r: (r.rank, r.role, r.worker, r.start)):
            key = (r.rank, r.role, r.worker)
            if key not in threads:
                threads[key] = len(threads)
                events.append(
                    {"ph": "M", "name": "thread_name", "pid": r.rank, "tid": threads[key],
                     "args": {"name": f"{r.role} {r.worker}"}}
                )
            events.append(
                {"ph": "X", "name": r.name, "cat": r.kind, "pid": r.rank, "tid": threads[key],
                 "ts": r.start * 1e6, "dur": max(r.end - r.start, 0.0) * 1e6,
                 "args": {"task": r.task, "role": r.role}}
            )
        for rank in sorted({r.rank for r in self.records}):
            events.append({"ph": "M", "name": "process_name", "pid": rank, "args": {"name": f"rank {rank}"}})
        return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"backend": self.backend}}

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_chrome()))
