"""Checks that a schedule can run on its graph and hardware; each failure is a ScheduleError
naming the rank, role, task and event involved.

The queue check is the one that matters for progress. A worker takes the next task of its role's
queue and blocks until that task's waits are met, so the queues are safe exactly when they can
be merged into one order the counters allow. Counters only grow, so a task that is ready stays
ready, and greedily running any ready queue head finds such a merge whenever one exists.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from typing import TYPE_CHECKING

from ..errors import ScheduleError
from ..graph import TaskGraph
from ..hardware import HardwareProfile
from ..kinds import ROLES

if TYPE_CHECKING:
    from .model import RankSchedule, Schedule

__all__ = [
    "check_queues",
    "check_workers",
    "check_batches",
    "check_schedule",
    "check_cut_schedule",
    "cut_queues",
    "SimulatedOrder",
    "rdma_destination",
]

_ROLE_NAMES = tuple(r.value for r in ROLES)


def check_schedule(schedule: Schedule) -> list[int]:
    """All checks; returns the merged global order of the queues."""
    order = check_queues(schedule.graph, schedule.ranks)
    check_workers(schedule.graph, schedule.ranks, schedule.hardware)
    check_batches(schedule.graph, schedule.ranks, schedule.hardware)
    return order


def check_cut_schedule(schedule: Schedule, order: Sequence[int]) -> None:
    """``check_schedule`` for a schedule whose queues were cut from ``order``, in one pass.

    When ``order`` lists every task once, each after the signals its waits count (a counter
    order), and every queue is ``order``'s tasks of that rank and role in sequence, ``order`` is
    itself a merge of the queues the counters allow: exactly what ``check_queues`` searches for,
    so the queues are safe without its simulation (and membership holds: each task once, in its
    own queue). Otherwise this runs ``check_schedule``, which names the problem. At 2x8 the
    queue simulation was ~0.24 s of scheduling; this pass takes ~0.1 s.
    """
    if not _is_cut_counter_order(schedule.graph, schedule.ranks, order):
        check_schedule(schedule)
        return
    check_workers(schedule.graph, schedule.ranks, schedule.hardware)
    check_batches(schedule.graph, schedule.ranks, schedule.hardware)


class SimulatedOrder(list):
    """A counter order of ``graph`` as a counter simulation made it (policies.list_order: each
    task once, each after the signals its waits count), or as policies.longest_path_order
    proved the ranking the simulation would take, with a private copy of it: while the
    list still equals the copy (one C-level comparison), ``cut_queues`` knows it is a counter
    order without walking the waits and signals again (~25 ms of a 2x8 layer's schedule). A
    policy that changes the list afterwards gets the full check."""

    __slots__ = ("graph", "made")

    def __init__(self, order: list[int], graph: TaskGraph) -> None:
        super().__init__(order)
        self.graph = graph
        self.made = order  # the simulation's own list, no longer handed to anyone


def cut_queues(graph: TaskGraph, order: Sequence[int]) -> tuple[list[dict[str, list[int]]], bool]:
    """Per rank, role -> ``order``'s tasks of that rank and role in sequence (the schedule's
    queues), and whether ``order`` is a counter order of ``graph`` (each task once, each after
    the signals its waits count), checked in the same pass: then the queues are safe, as
    ``check_cut_schedule`` argues, and its queue check is done; False says nothing either way.
    A ``SimulatedOrder`` of ``graph`` as it was made is one without the check.
    """
    tasks = graph.tasks
    n = len(tasks)
    world = graph.topology.world_size
    queues: list[dict[str, list[int]]] = [{r: [] for r in _ROLE_NAMES} for _ in range(world)]
    if (
        order.__class__ is SimulatedOrder
        and order.graph is graph
        and len(order) == n
        and order == order.made
    ):
        for tid in order:
            t = tasks[tid]
            queues[t.rank][t.role].append(tid)
        return queues, True
    ok = len(order) == n
    seen = bytearray(n)
    count = [0] * len(graph.events)
    for tid in order:
        t = tasks[tid]
        queues[t.rank][t.role].append(tid)
        if not ok:
            continue
        # _is_cut_counter_order's tests; the queue position holds by construction
        if tid.__class__ is not int or not 0 <= tid < n or seen[tid] or not 0 <= t.rank < world:
            ok = False
            continue
        seen[tid] = 1
        try:
            for e, c in t.waits:
                if count[e] < c:
                    ok = False
                    break
            else:
                for e in t.signals:
                    count[e] += 1
        except IndexError:  # an event id outside the graph (an unvalidated graph)
            ok = False
    return queues, ok


def _is_cut_counter_order(
    graph: TaskGraph, ranks: Sequence[RankSchedule], order: Sequence[int]
) -> bool:
    """True when ``order`` is a counter order of ``graph`` and every queue of ``ranks`` is its
    cut by rank and role (see check_cut_schedule); False says nothing either way."""
    tasks = graph.tasks
    n = len(tasks)
    world = graph.topology.world_size
    if len(order) != n or [rs.rank for rs in ranks] != list(range(world)):
        return False
    # queue index of (rank, role): rank * len(roles) + the role's index, plain ints per task
    role_index = {role: i for i, role in enumerate(_ROLE_NAMES)}
    queues: list[list[int]] = []
    for rs in ranks:
        if set(rs.queues) != set(_ROLE_NAMES):
            return False
        queues.extend(rs.queues[role] for role in _ROLE_NAMES)
    head = [0] * len(queues)
    seen = bytearray(n)
    count = [0] * len(graph.events)
    stride = len(_ROLE_NAMES)
    try:
        for tid in order:
            if tid.__class__ is not int or not 0 <= tid < n or seen[tid]:
                return False
            seen[tid] = 1
            t = tasks[tid]
            role = role_index.get(t.role)
            if role is None or not 0 <= t.rank < world:
                return False
            qi = t.rank * stride + role
            i = head[qi]
            q = queues[qi]
            if i >= len(q) or q[i] != tid:
                return False
            head[qi] = i + 1
            for e, c in t.waits:
                if count[e] < c:
                    return False
            for e in t.signals:
                count[e] += 1
    except IndexError:  # an event id outside the graph (an unvalidated graph): the full check
        return False
    return all(h == len(q) for h, q in zip(head, queues, strict=True))


def check_queues(graph: TaskGraph, ranks: Sequence[RankSchedule]) -> list[int]:
    """Every task once, in its own rank's role queue, and all queues consistent with one
    topological order. Returns that order (ready queue heads taken by smallest task id)."""
    _check_membership(graph, ranks)
    tasks = graph.tasks
    queues = [rs.queues[role] for rs in ranks for role in _ROLE_NAMES]
    head = [0] * len(queues)
    queue_of = [0] * len(tasks)
    for qi, q in enumerate(queues):
        for tid in q:
            queue_of[tid] = qi
    # event -> count -> waiters: a signal looks up whom its new count releases (no scan of
    # every waiter of an event with many signals)
    waiters: dict[int, dict[int, list[int]]] = {}
    missing = [0] * len(tasks)
    for t in tasks:
        missing[t.id] = len(t.waits)
        for e, c in t.waits:
            waiters.setdefault(e, {}).setdefault(c, []).append(t.id)
    count = [0] * len(graph.events)
    ready = [q[0] for q in queues if q and missing[q[0]] == 0]
    heapq.heapify(ready)
    order: list[int] = []
    while ready:
        tid = heapq.heappop(ready)
        order.append(tid)
        qi = queue_of[tid]
        head[qi] += 1
        q = queues[qi]
        if head[qi] < len(q) and missing[q[head[qi]]] == 0:
            heapq.heappush(ready, q[head[qi]])
        for e in tasks[tid].signals:
            count[e] += 1
            by_count = waiters.get(e)
            if by_count is None:
                continue
            for w in by_count.get(count[e], ()):
                missing[w] -= 1
                # A task becomes runnable only at its queue's head: the worker is in order.
                if missing[w] == 0 and queues[queue_of[w]][head[queue_of[w]]] == w:
                    heapq.heappush(ready, w)
    if len(order) < len(tasks):
        _explain_blocked(graph, ranks, queues, head, count, set(order))
    return order


def _check_membership(graph: TaskGraph, ranks: Sequence[RankSchedule]) -> None:
    world = graph.topology.world_size
    if [rs.rank for rs in ranks] != list(range(world)):
        raise ScheduleError(
            f"schedule ranks {[rs.rank for rs in ranks]} do not match topology "
            f"{graph.topology} (ranks 0..{world - 1}, in order)",
            hint="a schedule has one RankSchedule per rank of its graph",
        )
    n = len(graph.tasks)
    seen = [False] * n
    for rs in ranks:
        if set(rs.queues) != set(_ROLE_NAMES):
            raise ScheduleError(
                f"rank {rs.rank}: queues for roles {sorted(rs.queues)}; need exactly "
                f"{', '.join(_ROLE_NAMES)}",
                hint="give every role a queue, an empty list when it has no tasks",
            )
        for role, queue in rs.queues.items():
            for pos, tid in enumerate(queue):
                where = f"rank {rs.rank} {role} queue position {pos}"
                if not 0 <= tid < n:
                    raise ScheduleError(f"{where}: no task {tid} (the graph has {n})")
                t = graph.tasks[tid]
                if t.rank != rs.rank or t.role != role:
                    raise ScheduleError(
                        f"{where}: task {t.name!r} runs on rank {t.rank} as {t.role}",
                        hint=f"put it in rank {t.rank}'s {t.role} queue",
                    )
                if seen[tid]:
                    raise ScheduleError(f"{where}: task {t.name!r} is queued twice")
                seen[tid] = True
    if not all(seen):
        absent = [graph.tasks[i].name for i in range(n) if not seen[i]]
        raise ScheduleError(
            f"{len(absent)} task(s) are in no queue: {absent[:8]}",
            hint="every task of the graph must be queued once, on its rank in its role",
        )


def _explain_blocked(
    graph: TaskGraph,
    ranks: Sequence[RankSchedule],
    queues: list[list[int]],
    head: list[int],
    count: list[int],
    done: set[int],
) -> None:
    signalers = graph.signalers()
    where: dict[int, str] = {}
    for rs in ranks:
        for role in _ROLE_NAMES:
            for pos, tid in enumerate(rs.queues[role]):
                where[tid] = f"rank {rs.rank} {role} queue position {pos}"
    lines = []
    for qi, q in enumerate(queues):
        if head[qi] >= len(q):
            continue
        t = graph.tasks[q[head[qi]]]
        for e, c in t.waits:
            if count[e] >= c:
                continue
            ev = graph.events[e]
            pending = [s for s in signalers[e] if s not in done]
            by = ", ".join(f"{graph.tasks[s].name!r} ({where[s]})" for s in pending[:3])
            lines.append(
                f"{t.name!r} ({where[t.id]}) waits on event {ev.name!r} (rank {ev.rank}) for "
                f"{c}, has {count[e]}; "
                + (f"still to signal: {by}" if pending else "no remaining task signals it")
            )
            break
        if len(lines) == 4:
            break
    raise ScheduleError(
        f"the queues deadlock after {len(done)} of {len(graph.tasks)} tasks: no queue head can "
        "run.\n  " + "\n  ".join(lines),
        hint="a queue must list a task after every task it waits on, directly or through other "
        "queues: cut the queues from one topological order (mgraph.validate.topo_order)",
    )


def check_workers(
    graph: TaskGraph, ranks: Sequence[RankSchedule], hardware: HardwareProfile
) -> None:
    """Every role with tasks on a rank has a worker; no rank uses more workers than SMs."""
    for rs in ranks:
        unknown = set(rs.workers) - set(_ROLE_NAMES)
        if unknown:
            raise ScheduleError(
                f"rank {rs.rank}: workers for unknown role(s) {sorted(unknown)}",
                hint=f"roles are {', '.join(_ROLE_NAMES)}",
            )
        for role in _ROLE_NAMES:
            n = rs.workers.get(role, 0)
            if n < 0:
                raise ScheduleError(f"rank {rs.rank}: {n} {role} workers")
            if rs.queues[role] and n < 1:
                raise ScheduleError(
                    f"rank {rs.rank} has {len(rs.queues[role])} {role} task(s) but no {role} "
                    "worker",
                    hint="every role with tasks needs at least one worker, or its queue never "
                    "drains",
                )
        total = sum(rs.workers.values())
        if total > hardware.sms:
            raise ScheduleError(
                f"rank {rs.rank} uses {total} workers ({rs.workers}); {hardware.name} has "
                f"{hardware.sms} SMs",
                hint="the persistent kernel's workers must all be resident: one per SM at most",
            )


def rdma_destination(graph: TaskGraph, tid: int) -> int:
    """The rank an rdma task writes to (validate.py: exactly one)."""
    return graph.buffers[graph.tasks[tid].writes[0].buffer].rank


def check_batches(
    graph: TaskGraph, ranks: Sequence[RankSchedule], hardware: HardwareProfile
) -> None:
    """A rank's batches are its rdma queue cut into runs of 1..proxy_batch commands."""
    for rs in ranks:
        flat = [tid for batch in rs.batches for tid in batch]
        if flat != rs.queues["rdma"]:
            raise ScheduleError(
                f"rank {rs.rank}: proxy batches {rs.batches[:4]}... do not list the rdma queue "
                "in order",
                hint="batches cut the rdma queue into consecutive runs",
            )
        for i, batch in enumerate(rs.batches):
            if not 1 <= len(batch) <= hardware.proxy_batch:
                raise ScheduleError(
                    f"rank {rs.rank}: proxy batch {i} has {len(batch)} commands; "
                    f"{hardware.name} allows 1..{hardware.proxy_batch}",
                    hint="split the batch",
                )
