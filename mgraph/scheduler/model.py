"""The Schedule: what every runtime executes (DESIGN: Roles, queues).

Per rank: how many workers each role gets (the SM partition), ONE queue of task ids per role in an
order consistent with one topological order of the graph, and the rank's rdma queue cut into proxy
batches. The schedule carries its graph, so a runtime needs nothing else; its JSON embeds the
graph's JSON and round-trips losslessly.

Constructing a Schedule checks nothing (tests build broken ones on purpose, to see a runtime's
watchdog fire); ``check()`` runs every check, and ``mgraph.schedule`` always calls it.
"""

from __future__ import annotations

import json

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..errors import ScheduleError
from ..graph import TaskGraph
from ..hardware import HardwareProfile
from ..kinds import ROLES

__all__ = ["RankSchedule", "Schedule", "FORMAT"]

FORMAT = "mgraph.schedule/1"

_ROLE_NAMES = tuple(r.value for r in ROLES)


class RankSchedule(BaseModel):
    """One rank's part of a schedule."""

    model_config = ConfigDict(extra="forbid")

    rank: int
    # role value ("compute"/"nvlink"/"rdma") -> workers (SMs); every role with tasks gets >= 1
    workers: dict[str, int]
    # role -> task ids in execution order; all three roles present, each task once
    queues: dict[str, list[int]]
    # this rank's rdma task ids in queue order, grouped into proxy batches (<= proxy_batch each)
    batches: list[list[int]]


class _Envelope(BaseModel):
    model_config = ConfigDict(extra="forbid")

    format: str
    hardware: HardwareProfile
    policy: str
    ranks: list[RankSchedule]


class Schedule(BaseModel):
    """A TaskGraph plus, per rank, its SM partition, role queues and proxy batches."""

    model_config = ConfigDict(arbitrary_types_allowed=True, extra="forbid")

    graph: TaskGraph = Field(exclude=True)
    hardware: HardwareProfile
    policy: str
    ranks: list[RankSchedule]

    # -- checks and views --------------------------------------------------------------------
    def check(self) -> Schedule:
        """Raise ScheduleError unless the queues, workers and batches are runnable; return self."""
        from .checks import check_schedule

        check_schedule(self)
        return self

    def order(self) -> list[int]:
        """One global order of all task ids consistent with every queue (for tooling: timelines,
        sequential replays). Raises ScheduleError if the queues deadlock."""
        from .checks import check_queues

        return check_queues(self.graph, self.ranks)

    def queue(self, rank: int, role: str) -> list[int]:
        return self.ranks[rank].queues[str(role)]

    def summary(self) -> list[dict[str, int]]:
        """One row per rank: workers and queued tasks per role, and the number of proxy batches.

        Keys: rank, <role>_workers, <role>_tasks for each role, batches, sms.
        """
        rows = []
        for rs in self.ranks:
            row = {"rank": rs.rank}
            for role in _ROLE_NAMES:
                row[f"{role}_workers"] = rs.workers.get(role, 0)
            for role in _ROLE_NAMES:
                row[f"{role}_tasks"] = len(rs.queues.get(role, ()))
            row["batches"] = len(rs.batches)
            row["sms"] = self.hardware.sms
            rows.append(row)
        return rows

    # -- JSON --------------------------------------------------------------------------------
    def to_json(self) -> str:
        head = json.dumps({"format": FORMAT, **self.model_dump(mode="json")}, separators=(",", ":"))
        # Splice the graph's own JSON in rather than parse and re-dump megabytes of it.
        return head[:-1] + ',"graph":' + self.graph.to_json() + "}"

    @classmethod
    def from_json(cls, text: str) -> Schedule:
        try:
            doc = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ScheduleError(f"not a valid mgraph schedule JSON: {exc}") from None
        if not isinstance(doc, dict) or "graph" not in doc:
            raise ScheduleError("not a valid mgraph schedule JSON: no embedded graph")
        graph = TaskGraph.from_json(json.dumps(doc.pop("graph")))
        try:
            env = _Envelope.model_validate(doc)
        except ValidationError as exc:
            raise ScheduleError(f"not a valid mgraph schedule JSON: {exc}") from None
        if env.format != FORMAT:
            raise ScheduleError(
                f"schedule JSON format {env.format!r}; this mgraph reads {FORMAT!r}"
            )
        return cls(graph=graph, hardware=env.hardware, policy=env.policy, ranks=env.ranks)

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            f.write(self.to_json())

    @classmethod
    def load(cls, path: str) -> Schedule:
        with open(path) as f:
            return cls.from_json(f.read())

    def __repr__(self) -> str:
        return (
            f"Schedule(op={self.graph.op!r}, topology={self.graph.topology}, "
            f"policy={self.policy!r}, hardware={self.hardware.name!r}, ranks={len(self.ranks)})"
        )
