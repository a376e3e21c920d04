"""The static SM partition: workers per role before anything is measured.

``static_partition`` splits each rank's SMs between compute and NVLink workers with the
controller's rule (``controller.decide``, the ONE definition of it) applied to the cost model's
estimates: window 0, nothing measured, no previous decision, so no damping and no stall.
``balance_workers`` is that call for float costs in seconds. Who else calls ``decide``: the
simulator's adaptive mode and the CPU reference runtime with ``Settings(adaptive=True)``; the
Triton megakernel keeps this static split for the whole launch unless `Settings(adaptive=True)`,
when its programs re-read their role from the on-GPU controller (runtime/megakernel/control.py).
"""

from __future__ import annotations

import math

from ..errors import ScheduleError
from ..graph import TaskGraph
from ..hardware import HardwareProfile
from ..kinds import ROLES, Role
from .controller import COST_CAP, DAMP_DEN, DAMP_NUM, LEFT_CAP, RoleProgress, decide
from .costmodel import task_costs

__all__ = ["DAMPING", "balance_workers", "static_partition"]

DAMPING = DAMP_NUM / DAMP_DEN  # fraction of the gap the controller closes per decision

_COMPUTE, _NVLINK, _RDMA = Role.COMPUTE.value, Role.NVLINK.value, Role.RDMA.value


def balance_workers(
    total: int,
    *,
    compute_remaining: int,
    compute_cost: float,
    comm_remaining: int,
    comm_cost: float,
    max_comm: int | None = None,
) -> int:
    """Communication workers out of ``total`` by ``controller.decide`` with nothing measured:
    the other ``total - result`` compute.

    ``*_cost``: estimated seconds per task (``math.inf``: a role that never finishes; 0: no
    estimate, costed like the other role). The costs are scaled so the larger maps to
    ``COST_CAP`` ticks (the rule only compares them) and the smaller keeps at least one tick
    when positive. ``max_comm``: most comm workers while compute has tasks (default: no cap).
    """
    _check_args(total, compute_remaining, compute_cost, comm_remaining, comm_cost, max_comm)
    cp, cs = _ticks(compute_cost, comm_cost)
    if compute_remaining and comm_remaining:
        comm_workers = min(max(total // 2, 1), total - 1)  # any split: no previous decision
    else:
        comm_workers = total if comm_remaining else 0
    split = decide(
        RoleProgress(min(compute_remaining, LEFT_CAP), 0, 0, 0, total - comm_workers, cp),
        RoleProgress(min(comm_remaining, LEFT_CAP), 0, 0, 0, comm_workers, cs),
        window=0,
        max_comm=total if max_comm is None else max(1, min(max_comm, total)),
    )
    return split.comm


def _ticks(cp: float, cs: float) -> tuple[int, int]:
    """Two float costs as integers in [0, COST_CAP] with their ratio kept (inf -> the cap)."""
    if math.isinf(cp) or math.isinf(cs):
        return (
            COST_CAP if math.isinf(cp) else (1 if cp > 0 else 0),
            COST_CAP if math.isinf(cs) else (1 if cs > 0 else 0),
        )
    scale = max(cp, cs)
    if scale == 0.0:
        return 0, 0

    def tick(c: float) -> int:
        return max(1, math.floor(c / scale * COST_CAP + 0.5)) if c > 0 else 0

    return tick(cp), tick(cs)


def _check_args(total: int, rp: int, cp: float, rs: int, cs: float, max_comm: int | None) -> None:
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
            raise bad(f"{name}={value!r}", "a cost is >= 0 seconds per task (inf: never ends)")
    if max_comm is not None and (
        isinstance(max_comm, bool) or not isinstance(max_comm, int) or max_comm < 1
    ):
        raise bad(f"max_comm={max_comm!r}", "an int >= 1, or None for no cap")


def static_partition(
    graph: TaskGraph, hardware: HardwareProfile, costs: list[float] | None = None
) -> dict[int, dict[str, int]]:
    """rank -> role -> workers, before anything is measured: the balance rule on the cost hints.

    rdma gets one worker when it has tasks (it only pushes proxy commands); compute and nvlink
    split the remaining SMs by ``balance_workers`` with C = mean estimated cost per task, raised
    to what NVLink tasks need to finish while the compute that waits for none of them runs
    (``_gather_deadline``: AG+GEMM's gather), and nvlink keeps at most ``hardware.nvlink_max_sms`` (measured: more stop paying off) and at
    most one worker per NVLink task of the rank (a worker without a task only idles; the rule
    alone gives a rank with no compute tasks, or too few to matter, every SM).
    """
    if costs is None:
        costs = task_costs(graph, hardware)
    works, free_compute = _work_and_free_compute(graph, costs)
    out: dict[int, dict[str, int]] = {}
    for rank, work in works.items():
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
            nvlink = max(nvlink, _gather_deadline(pool, w_nvl, free_compute.get(rank, 0.0)))
            nvlink = min(nvlink, hardware.nvlink_max_sms, n_nvl)
        compute = pool - nvlink if n_comp else 0
        out[rank] = {_COMPUTE: compute, _NVLINK: nvlink, _RDMA: rdma}
    return out


def nvlink_events(graph: TaskGraph) -> set[int]:
    """The events NVLink tasks signal (compute that waits on one waits for a copy)."""
    return {e for t in graph.tasks if t.role == _NVLINK for e in t.signals}


def _work_and_free_compute(
    graph: TaskGraph, costs: list[float]
) -> tuple[dict[int, dict[str, tuple[int, float]]], dict[int, float]]:
    """``role_work``, and per rank the summed cost of its compute tasks that wait for no NVLink
    task (AG+GEMM: the tiles of the rank's own rows, while the gather brings the peers'), in
    one pass over the tasks (hot: 10^5 tasks; each sum added up in task order)."""
    by_nvlink = nvlink_events(graph)
    work = {r: {role.value: [0, 0.0] for role in ROLES} for r in graph.topology.ranks}
    # per rank: the sum (None until its first such task) in a list, no dict call per task
    free_of: list[float | None] = [None] * graph.topology.world_size
    compute = _COMPUTE
    for t in graph.tasks:
        cost = costs[t.id]
        cell = work[t.rank][t.role]
        cell[0] += 1
        cell[1] += cost
        if t.role == compute:
            for e, _ in t.waits:
                if e in by_nvlink:
                    break
            else:
                so_far = free_of[t.rank]
                free_of[t.rank] = (0.0 if so_far is None else so_far) + cost  # as dict.get's
    free = {r: v for r, v in enumerate(free_of) if v is not None}
    return {r: {role: (n, c) for role, (n, c) in roles.items()} for r, roles in work.items()}, free


def _gather_deadline(pool: int, nvlink_work: float, free_compute: float) -> int:
    """Workers the NVLink tasks need to finish while the compute tasks that do not wait for
    them run: nvlink_work / n <= free_compute / (pool - n). Compute that waits on NVLink data
    starves unless its data arrives by then; the balance rule alone, which shares out total
    work, gives the gather too few SMs (v8: 11 NVLink workers at 1.17 ms; 24 at 0.94 ms)."""
    if nvlink_work <= 0.0:
        return 0
    if free_compute <= 0.0:
        return pool - 1
    return min(pool - 1, math.ceil(pool * nvlink_work / (nvlink_work + free_compute)))
