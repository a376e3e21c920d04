"""The work-balance rule (DESIGN: Controller) and the static SM partition derived from it.

``balance_workers`` is the ONE definition of how workers are split between compute and
communication. Today the simulator's adaptive mode (``simulate(..., adaptive=True)``) and the
static partition below call it; the CPU reference runtime and the Triton megakernel do not run a
controller yet (their split is the schedule's, fixed per launch). It is written with only what a
kernel has (+, *, /, floor, min, max; rounding half up, never Python's banker's round) so that a
GPU controller can follow it line by line, and be tested against it, once one is built.

    comm = N * Rs*Cs / (Rp*Cp + Rs*Cs)

R: tasks remaining, C: measured cost per task, p: compute, s: communication. The target is
rounded, clamped so every role with work keeps a worker, and approached from the previous value
by at most a ``damping`` fraction of the gap per step (at least one worker, so it converges).
A role with no work left gets 0 at once: its workers are idle, so there is nothing to damp.
"""

from __future__ import annotations

import math

from ..errors import ScheduleError
from ..graph import TaskGraph
from ..hardware import HardwareProfile
from ..kinds import Role
from .costmodel import role_work, task_costs

__all__ = ["DAMPING", "balance_workers", "static_partition"]

DAMPING = 0.5  # fraction of the gap closed per controller step

_COMPUTE, _NVLINK, _RDMA = Role.COMPUTE.value, Role.NVLINK.value, Role.RDMA.value


def balance_workers(
    total: int,
    *,
    compute_remaining: int,
    compute_cost: float,
    comm_remaining: int,
    comm_cost: float,
    previous: int | None = None,
    damping: float = DAMPING,
) -> int:
    """Communication workers out of ``total``; the other ``total - result`` compute.

    ``*_cost`` is seconds per task (``math.inf`` for a stalled role: no task finished, rate 0).
    ``previous`` is the last decision (None: no history, jump to the target).
    """
    _check_args(
        total, compute_remaining, compute_cost, comm_remaining, comm_cost, previous, damping
    )
    if comm_remaining == 0:
        return 0
    if compute_remaining == 0:
        return total
    # Both roles have work: each keeps at least one worker.
    lo, hi = 1, total - 1
    comm_share = _comm_share(compute_remaining, compute_cost, comm_remaining, comm_cost)
    target = math.floor(total * comm_share + 0.5)  # round half up, as the kernel does
    target = min(max(target, lo), hi)
    if previous is None:
        return target
    current = min(max(previous, lo), hi)
    gap = target - current
    if gap == 0:
        return current
    step = max(1, math.floor(damping * abs(gap)))  # >= 1 so it always converges
    return current + step if gap > 0 else current - step


def _comm_share(rp: int, cp: float, rs: int, cs: float) -> float:
    """Rs*Cs / (Rp*Cp + Rs*Cs) without overflow, inf/inf or 0/0 (both rp, rs > 0)."""
    if math.isinf(cp) or math.isinf(cs):
        if math.isinf(cp) and math.isinf(cs):
            cp = cs = 1.0  # both stalled: nothing measured tells them apart but the task counts
        else:
            # The limit of the rule as one cost grows without bound: that role gets everything
            # (the clamp leaves the other one worker). A huge finite cost decides the same way.
            return 1.0 if math.isinf(cs) else 0.0
    scale = max(cp, cs)
    if scale == 0.0:
        cp = cs = 1.0  # nothing measured yet: split by task counts
    else:
        cp, cs = cp / scale, cs / scale  # <= 1, so R*C cannot overflow
    wp, ws = rp * cp, rs * cs
    return ws / (wp + ws)


def _check_args(
    total: int,
    rp: int,
    cp: float,
    rs: int,
    cs: float,
    previous: int | None,
    damping: float,
) -> None:
    def bad(what: str, hint: str) -> ScheduleError:
        return ScheduleError(f"balance_workers: {what}", hint=hint)

    for name, value in (("total", total), ("compute_remaining", rp), ("comm_remaining", rs)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise bad(f"{name}={value!r} must be an int", "pass whole counts of workers and tasks")
    if total < 1:
        raise bad(f"total={total} workers", "the window needs at least one worker")
    if rp < 0 or rs < 0:
        raise bad(f"remaining tasks compute={rp}, comm={rs}", "remaining counts cannot be negative")
    if rp > 0 and rs > 0 and total < 2:
        raise bad(
            f"total={total} workers, but compute ({rp}) and communication ({rs}) both have tasks",
            "each role with work left needs its own worker: give the window at least 2",
        )
    for name, value in (("compute_cost", cp), ("comm_cost", cs)):
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise bad(f"{name}={value!r} must be a number", "pass seconds per task")
        if math.isnan(value) or value < 0:
            raise bad(f"{name}={value!r}", "a cost is >= 0 seconds per task (inf when stalled)")
    if previous is not None:
        if isinstance(previous, bool) or not isinstance(previous, int):
            raise bad(f"previous={previous!r} must be an int or None", "pass the last decision")
        if not 0 <= previous <= total:
            raise bad(f"previous={previous} is outside 0..{total}", "pass the last decision")
    if not (isinstance(damping, (int, float)) and 0.0 < damping <= 1.0):
        raise bad(f"damping={damping!r}", "damping is the fraction of the gap closed: (0, 1]")


def static_partition(
    graph: TaskGraph, hardware: HardwareProfile, costs: list[float] | None = None
) -> dict[int, dict[str, int]]:
    """rank -> role -> workers, before anything is measured: the balance rule on the cost hints.

    rdma gets one worker when it has tasks (it only pushes proxy commands); compute and nvlink
    split the remaining SMs by ``balance_workers`` with C = mean estimated cost per task, and
    nvlink keeps at most ``hardware.nvlink_max_sms`` (measured: more stop paying off).
    """
    if costs is None:
        costs = task_costs(graph, hardware)
    out: dict[int, dict[str, int]] = {}
    for rank, work in role_work(graph, costs).items():
        n_comp, w_comp = work[_COMPUTE]
        n_nvl, w_nvl = work[_NVLINK]
        n_rdma = work[_RDMA][0]
        needed = sum(1 for n in (n_comp, n_nvl, n_rdma) if n)
        if needed > hardware.sms:
            raise ScheduleError(
                f"rank {rank} has tasks in {needed} roles but {hardware.name} has "
                f"{hardware.sms} SM(s)",
                hint="every role with tasks needs one worker: use a profile with more SMs",
            )
        rdma = 1 if n_rdma else 0
        pool = hardware.sms - rdma
        if n_comp == 0 and n_nvl == 0:
            nvlink = 0
        else:
            nvlink = balance_workers(
                pool,
                compute_remaining=n_comp,
                compute_cost=w_comp / n_comp if n_comp else 0.0,
                comm_remaining=n_nvl,
                comm_cost=w_nvl / n_nvl if n_nvl else 0.0,
            )
            nvlink = min(nvlink, hardware.nvlink_max_sms)
        compute = pool - nvlink if n_comp else 0
        out[rank] = {_COMPUTE: compute, _NVLINK: nvlink, _RDMA: rdma}
    return out
