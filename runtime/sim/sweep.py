"""What-if over the SM split: the same schedule (same queues) with N nvlink workers on every rank.

The default split is the scheduler's (``static_partition``: the work-balance rule of
mgraph/scheduler/balance.py on cost estimates); a sweep simulates the alternatives, so the rule's
choice can be checked against the best static split the model finds.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from mgraph.errors import ScheduleError
from mgraph.hardware import HardwareProfile
from mgraph.scheduler import RankSchedule, Schedule, check_workers

__all__ = ["SweepPoint", "with_comm_sms", "sweep_comm_sms", "DEFAULT_COMM_SMS"]

DEFAULT_COMM_SMS = (1, 2, 4, 6, 8, 10, 12, 14, 16, 20, 24, 32, 48, 64)


@dataclass(frozen=True)
class SweepPoint:
    comm_sms: int
    predicted_s: float
    busy_by_role: dict[str, float]


def with_comm_sms(schedule: Schedule, comm_sms: int) -> Schedule:
    """``schedule`` with ``comm_sms`` nvlink workers, one rdma worker where there are rdma
    tasks, and every other SM computing, on every rank. Queues and batches are unchanged."""
    hw = schedule.hardware
    ranks = []
    for rs in schedule.ranks:
        rdma = 1 if rs.queues["rdma"] else 0
        compute = hw.sms - comm_sms - rdma
        if comm_sms < 0 or compute < (1 if rs.queues["compute"] else 0):
            raise ScheduleError(
                f"--comm-sms {comm_sms}: leaves {compute} compute SMs of {hw.sms} on rank "
                f"{rs.rank}",
                hint=f"choose between 1 and {hw.sms - rdma - 1} communication SMs",
            )
        workers = {"compute": compute, "nvlink": comm_sms, "rdma": rdma}
        ranks.append(RankSchedule(rank=rs.rank, workers=workers, queues=rs.queues,
                                  batches=rs.batches))  # fmt: skip
    check_workers(schedule.graph, ranks, hw)
    return Schedule(graph=schedule.graph, hardware=hw, policy=schedule.policy, ranks=ranks)


def sweep_comm_sms(
    schedule: Schedule,
    values: Sequence[int] | None = None,
    *,
    hardware: HardwareProfile | None = None,
    adaptive: bool = False,
    **options: Any,
) -> list[SweepPoint]:
    """Predicted time for each nvlink worker count in ``values`` (default: 1..64, coarser
    upwards, as far as the SMs allow), in the order given; ``options`` go to ``simulate``."""
    from . import simulate

    sms = schedule.hardware.sms
    values = [v for v in (values or DEFAULT_COMM_SMS) if 1 <= v <= sms - 2]
    out = []
    for v in values:
        res = simulate(
            with_comm_sms(schedule, v), hardware=hardware, adaptive=adaptive, baselines=False,
            **options,
        )  # fmt: skip
        out.append(SweepPoint(v, res.predicted_s, res.busy_by_role))
    return out
