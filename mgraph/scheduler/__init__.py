"""The scheduler: TaskGraph -> Schedule (DESIGN: Roles, queues; Controller).

Four steps, each its own module:
1. cost    (costmodel.py): seconds per task on one worker, from the graph's cost hints;
2. order   (policies.py):  one global topological order by a named policy, cut per rank and
   role into the queues;
3. SM partition (balance.py): workers per role from the work-balance rule (or an override);
4. proxy batches (batches.py): each rank's rdma queue in groups the proxy submits at once.
Then every check of checks.py runs, so a returned Schedule cannot deadlock a runtime (the
queue check as one pass over the order they were cut from, when that order proves them safe).
"""

from __future__ import annotations

from collections.abc import Mapping

from ..errors import ScheduleError, UnknownNameError
from ..graph import TaskGraph, gc_paused
from ..hardware import H200, HardwareProfile
from ..kinds import ROLES, Role
from .balance import DAMPING, balance_workers, static_partition
from .batches import proxy_batches
from .checks import (
    check_batches,
    check_cut_schedule,
    check_queues,
    check_schedule,
    check_workers,
    cut_queues,
)
from .costmodel import role_work, task_cost, task_costs
from .model import RankSchedule, Schedule
from .policies import POLICIES, Policy, PolicyInput, get_policy, policy_input, register_policy

__all__ = [
    "schedule",
    "Schedule",
    "RankSchedule",
    "POLICIES",
    "Policy",
    "PolicyInput",
    "get_policy",
    "register_policy",
    "policy_input",
    "balance_workers",
    "static_partition",
    "DAMPING",
    "proxy_batches",
    "check_queues",
    "check_workers",
    "check_batches",
    "check_schedule",
    "check_cut_schedule",
    "task_cost",
    "task_costs",
    "role_work",
]

_ROLE_NAMES = tuple(r.value for r in ROLES)


def schedule(
    graph: TaskGraph,
    hardware: HardwareProfile = H200,
    policy: str = "critical_path",
    workers: Mapping[str | Role, int] | None = None,
    *,
    order: list[int] | None = None,
) -> Schedule:
    """Schedule ``graph`` for ``hardware`` with the ordering ``policy`` (see ``POLICIES``).

    ``workers`` overrides the SM partition on every rank: role -> workers, where a role left
    out gets none; it must give each role with tasks at least one and use at most
    ``hardware.sms`` in total. ``order`` is ``mgraph.validate.topo_order(graph)`` when the
    caller already has it (mg.compile: what validation returned), so it is not simulated twice.
    """
    # Like lower and validate: scheduling allocates ~10^6 small containers next to a graph of
    # ~10^6 live objects (mgraph.graph.gc_paused).
    with gc_paused():
        return _schedule(graph, hardware, policy, workers, order)


def _schedule(
    graph: TaskGraph,
    hardware: HardwareProfile,
    policy: str,
    workers: Mapping[str | Role, int] | None,
    topo: list[int] | None,
) -> Schedule:
    choose = get_policy(policy)  # an unknown name fails before any work
    override = None if workers is None else _check_override(graph, hardware, workers)
    costs = task_costs(graph, hardware)
    world = graph.topology.world_size
    # the partition first: critical_path places the tasks on these workers to order them
    partition = static_partition(graph, hardware, costs) if override is None else None
    workers = [dict(override) if override is not None else partition[r] for r in range(world)]
    order = choose(graph, policy_input(graph, costs, topo, workers, hardware))
    # the queues cut from ``order``, and check_cut_schedule's queue check, in one pass
    queues, counter_order = cut_queues(graph, order)
    ranks = [
        RankSchedule(
            rank=r,
            workers=workers[r],
            queues=queues[r],
            batches=proxy_batches(graph, queues[r][Role.RDMA.value], hardware),
        )
        for r in range(world)
    ]
    result = Schedule(graph=graph, hardware=hardware, policy=policy, ranks=ranks)
    if counter_order:  # check_cut_schedule's verdict, without its pass
        check_workers(graph, result.ranks, hardware)
        check_batches(graph, result.ranks, hardware)
    else:
        check_schedule(result)  # names the problem
    return result


def _check_override(
    graph: TaskGraph, hardware: HardwareProfile, workers: Mapping[str | Role, int]
) -> dict[str, int]:
    out = {r: 0 for r in _ROLE_NAMES}
    for role, n in workers.items():
        name = str(role)
        if name not in out:
            raise UnknownNameError(
                f"schedule(workers=...): unknown role {name!r}; valid roles: "
                f"{', '.join(_ROLE_NAMES)}"
            )
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ScheduleError(
                f"schedule(workers=...): {name}={n!r} must be a non-negative int",
                hint='e.g. workers={"compute": 112, "nvlink": 16, "rdma": 1}',
            )
        out[name] = n
    total = sum(out.values())
    if total > hardware.sms:
        raise ScheduleError(
            f"schedule(workers=...): {total} workers ({out}) but {hardware.name} has "
            f"{hardware.sms} SMs",
            hint="the persistent kernel runs one worker per SM at most: lower the counts",
        )
    used = {(t.rank, t.role) for t in graph.tasks}
    for rank, role in sorted(used):
        if out[role] < 1:
            raise ScheduleError(
                f"schedule(workers=...): rank {rank} has {role} tasks but {role}=0 workers",
                hint=f"give every role with tasks at least one worker: roles with tasks here are "
                f"{', '.join(sorted({r for _, r in used}))}",
            )
    return out
