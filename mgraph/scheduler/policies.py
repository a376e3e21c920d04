"""Ordering policies: plain functions with one signature, chosen by name (STYLE rule 4).

    policy(graph, facts) -> order

``facts`` (PolicyInput) holds what every policy needs and nobody should compute twice: the cost
of each task on one worker, one topological order of the graph, and each task's successors
(built on first read; the builtin policies walk the events instead).
``order`` is ONE global order of all task ids that the counters allow; the scheduler cuts it into
the per-rank, per-role queues, so every queue is a subsequence of one topological order and a
single worker per role can never deadlock (DESIGN: Roles, queues). ``check_queues`` verifies it
for any policy, including user ones.

The builtin policies differ in the priority a ready task gets; ``list_order`` turns a
priority into an order by simulating the counters and always taking the best ready task.
``critical_path`` (the default) also places the tasks of a graph without RDMA tasks on the
schedule's workers (placement.py): by their ends in a backward list schedule, kept only where
the queue model predicts that order at least ``PLACED_MARGIN`` shorter than ``longest_path``'s.
``critical_path``, ``longest_path``, ``network_first`` and ``remote_first`` break ties between
equally urgent tasks by ``push_rotation``: a task writing into one node peer (an epilogue push,
an NVLink copy) on rank r goes first to its node's GPU r+1, then r+2, ..., so the GPUs of a node
do not all start by writing into the same peer (an NVLink incast: 7 senders sharing one GPU's
ingress while the other links idle), whatever order the lowering emitted the tiles in. A rank's
NVLink copies into one peer are ranked by their count first (a lowering's chunks), so its NVLink
queue goes chunk by chunk, each chunk's copies from the next GPU on, not every chunk's copy to
r+1 before any to r+2.

``network_first`` orders first by ``network_slots``: the earliest RDMA transfer (in each rank's
wave-major send order) that needs a task, then as ``critical_path``. Longest-path alone puts every
GEMM tile before the node sums and rail sends waiting on them (a tile's path is longer by its own
cost), so on several nodes the network starts only when the GEMM ends (simulated 2x8 GEMM+AR
32768x2048x32768: the first node sum at 9.0 of 9.2 ms of GEMM). With no RDMA tasks (one node)
its order is ``critical_path``'s.

On graphs with RDMA tasks and nodes of several GPUs, ``critical_path`` (the default) chooses
between longest_path's order and ``staged_order`` (rail sums and broadcasts as soon as the
counters allow, tiles by network slot with the waves interleaved one send apart) by the
prediction of ``placement.network_makespan``; the simulated 2x8 GEMM+AR and GEMM+RS take the
staged order, ring attention, AG+GEMM and MoE keep longest_path's (benchmarks/simulated.md).
Caveat for a GPU: the megakernel runs only the compute queue's leading GEMM tasks as its static
prefix and signals them once, after the prefix (runtime/megakernel/encode.py), so the node and
rail sums the staged order (like network_first) interleaves cut that prefix to the first
chunk's tiles; the simulator models neither the prefix nor its late signals.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from ..errors import RegistrationError, UnknownNameError
from ..graph import TaskGraph
from ..hardware import HardwareProfile
from ..kinds import Role
from ..validate import CounterOrder, topo_order
from .checks import SimulatedOrder
from .placement import Pools, constrained_lengths, network_makespan, queue_makespan

__all__ = [
    "PolicyInput",
    "Policy",
    "POLICIES",
    "policy_input",
    "get_policy",
    "register_policy",
    "list_order",
    "list_order_steps",
    "Columns",
    "critical_path_lengths",
    "network_levels",
    "network_waves",
    "network_slots",
    "staged_order",
    "push_rotation",
    "topological",
    "critical_path",
    "longest_path",
    "network_first",
    "remote_first",
]


@dataclass(frozen=True)
class PolicyInput:
    """What a policy may read besides the graph.

    ``succ`` (each task's successors) is built on first read: a traced layer's join events
    have many signalers and many waiters (15M edges for 148k waits at 2x8), so the builtin
    policies walk the events instead (``full``, ``partial``) and never build it.
    """

    costs: list[float]  # seconds on one worker of the task's role (costmodel.task_costs)
    order: list[int]  # one topological order (mgraph.validate.topo_order)
    graph: TaskGraph = field(repr=False)
    pos: list[int] = field(repr=False)  # pos[tid]: the task's index in ``order``
    # event -> the tasks waiting for all of its signals (every signaler runs before them)
    full: list[list[int]] = field(repr=False)
    # event -> the tasks waiting for fewer than all (only signalers earlier in ``order`` count)
    partial: dict[int, list[int]] = field(repr=False)
    # event -> count -> the tasks that wait for the event to reach that count, and per task
    # its number of waits: ``list_order``'s counter simulation, built in the pass above
    released: dict[int, dict[int, list[int]]] | None = field(default=None, repr=False)
    waits: list[int] | None = field(default=None, repr=False)
    # event -> its number of signals (None only for a PolicyInput made by hand)
    total: list[int] | None = field(default=None, repr=False)
    # rank -> role -> workers (the schedule's SM partition); None: unknown, and the policies
    # that place tasks on workers (``critical_path``) assume a worker for every task
    workers: list[dict[str, int]] | None = field(default=None, repr=False)
    # the profile ``costs`` come from; None: unknown, and ``critical_path`` does not predict
    # the network (it keeps longest_path's order on graphs with RDMA tasks)
    hardware: HardwareProfile | None = field(default=None, repr=False)

    @cached_property
    def succ(self) -> list[list[int]]:
        """Tasks that wait on an event the task signals, later in ``order``, by id."""
        pos, signalers = self.pos, self.graph.signalers()
        succ: list[list[int]] = [[] for _ in self.graph.tasks]
        for t in self.graph.tasks:
            tid, tpos = t.id, pos[t.id]
            for e, _ in t.waits:
                for s in signalers[e]:
                    # A wait for fewer than all signals can be met before some signaler runs:
                    # only the signalers earlier in the order are predecessors (keeps the
                    # edges acyclic).
                    if pos[s] < tpos:
                        lst = succ[s]
                        if not lst or lst[-1] != tid:
                            lst.append(tid)
        return succ


Policy = Callable[[TaskGraph, PolicyInput], list[int]]

POLICIES: dict[str, Policy] = {}


def register_policy(name: str) -> Callable[[Policy], Policy]:
    """Decorator: make ``fn`` selectable as ``schedule(..., policy=name)``."""

    def attach(fn: Policy) -> Policy:
        if name in POLICIES:
            raise RegistrationError(
                f"scheduling policy {name!r} is already registered", hint="pick another name"
            )
        POLICIES[name] = fn
        return fn

    return attach


def get_policy(name: str) -> Policy:
    try:
        return POLICIES[name]
    except (KeyError, TypeError):
        raise UnknownNameError(
            f"unknown scheduling policy {name!r}; valid policies: {', '.join(sorted(POLICIES))}",
            hint="register your own with mgraph.scheduler.register_policy",
        ) from None


def policy_input(
    graph: TaskGraph,
    costs: list[float],
    order: list[int] | None = None,
    workers: list[dict[str, int]] | None = None,
    hardware: HardwareProfile | None = None,
) -> PolicyInput:
    """What the policies read; ``order`` is ``topo_order(graph)`` when the caller has it,
    ``workers`` each rank's workers per role (``schedule`` passes its SM partition),
    ``hardware`` the profile ``costs`` come from (``schedule`` passes its own)."""
    if order is None:
        order = topo_order(graph)  # raises CycleError / UnsatisfiableWaitError for broken graphs
    pos = [0] * len(graph.tasks)
    for i, tid in enumerate(order):
        pos[tid] = i
    if (
        isinstance(order, CounterOrder)
        and len(order.waits) == len(graph.tasks)
        and len(order.total) == len(graph.events)
    ):
        # topo_order's simulation built the waiters by count, the waits per task and the
        # signals per event already (mg.compile hands validation's order on)
        total, released, waits = order.total, order.released, order.waits
    else:
        total, released, waits = _counters(graph)
    full: list[list[int]] = [[] for _ in graph.events]
    partial: dict[int, list[int]] = {}
    # Where every wait is for all of its event's signals (the common case: a partial wait is
    # a lowering's choice, e.g. MoE's routed arrivals), each event's full waiters are
    # ``released``'s one list for that count, already in task order: no pass over every
    # wait (~150k at 2x8).
    if all(len(by_count) == 1 and total[e] in by_count for e, by_count in released.items()):
        for e, by_count in released.items():
            full[e] = by_count[total[e]]
    else:
        for t in graph.tasks:
            tid = t.id
            for e, c in t.waits:
                if c >= total[e]:
                    full[e].append(tid)
                else:
                    partial.setdefault(e, []).append(tid)
    return PolicyInput(
        costs=costs,
        order=order,
        graph=graph,
        pos=pos,
        full=full,
        partial=partial,
        released=released,
        waits=waits,
        total=total,
        workers=workers,
        hardware=hardware,
    )


def _counters(graph: TaskGraph) -> tuple[list[int], dict[int, dict[int, list[int]]], list[int]]:
    """Signals per event, each event's waiters by count, and waits per task: what a
    CounterOrder carries, for an order given as a plain list."""
    total = [0] * len(graph.events)
    for t in graph.tasks:
        for e in t.signals:
            total[e] += 1
    released: dict[int, dict[int, list[int]]] = {}
    waits = [0] * len(graph.tasks)
    for t in graph.tasks:
        waits[t.id] = len(t.waits)
        for e, c in t.waits:
            released.setdefault(e, {}).setdefault(c, []).append(t.id)
    return total, released, waits


class Columns(Sequence[tuple[Any, ...]]):
    """A priority given column by column: ``self[id]`` is ``(columns[0][id], columns[1][id],
    ...)``. ``list_order`` ranks it by one stable sort per column, from the last, which gives
    the order one sort of the tuples gives (ties by id) in about half the time at 10^5 tasks."""

    def __init__(self, *columns: Sequence[Any], then: Columns | None = None) -> None:
        # ``then``: a priority whose columns follow these (the tie-break), ranked once for both
        # (critical_path's staged order breaks its ties by the plain order's columns)
        self.columns = columns + then.columns if then is not None else columns
        self._then = then
        self._ranked: list[int] | None = None

    def __getitem__(self, tid: int) -> tuple[Any, ...]:  # type: ignore[override]
        return tuple(c[tid] for c in self.columns)

    def __len__(self) -> int:
        return len(self.columns[0])

    def ranked(self) -> list[int]:
        """Task ids by (columns[0][id], columns[1][id], ..., id). Made once, then shared (the
        caller must not change it)."""
        if self._ranked is None:
            then = self._then
            if then is not None:  # stable sorts from the tie-break's ranking: the same ids
                ids = list(then.ranked())
                own = self.columns[: len(self.columns) - len(then.columns)]
            else:
                ids = list(range(len(self)))
                own = self.columns
            for column in reversed(own):
                ids.sort(key=column.__getitem__)
            self._ranked = ids
        return self._ranked


def list_order(
    graph: TaskGraph, priority: Sequence[Any], facts: PolicyInput | None = None
) -> list[int]:
    """The counter simulation of ``topo_order``, taking the ready task with the smallest
    ``(priority[id], id)`` first. Any priority gives a valid topological order. ``facts``
    (policy_input's, for ``graph``) supplies the waiters by event and count instead of a
    second pass over every wait."""
    order: list[int] = []
    for _ in list_order_steps(graph, priority, facts, order):
        pass
    if facts is not None and facts.graph is not graph:
        return order  # simulated on another graph's counters: cut_queues checks it
    return SimulatedOrder(order, graph)


def list_order_steps(
    graph: TaskGraph, priority: Sequence[Any], facts: PolicyInput | None, order: list[int]
) -> Iterator[int]:
    """``list_order`` one task at a time: yields each task as it is taken, after appending it
    to ``order``. A caller that judges the order as it comes (``_network_choice``'s queue
    model) can stop before the rest is simulated."""
    tasks = graph.tasks
    n = len(tasks)
    # Rank the keys once so the heap holds plain ints (40k+ tasks per schedule); the sort is
    # stable, so equal priorities keep id order.
    if isinstance(priority, Columns):
        by_rank = priority.ranked()
    else:
        by_rank = sorted(range(n), key=priority.__getitem__)
    rank_of = [0] * n
    for i, tid in enumerate(by_rank):
        rank_of[tid] = i
    # event -> count -> waiters: a signal visits only the waiters its new count releases (a
    # join event of a traced layer has ~100 signalers and as many waiters)
    if facts is not None and facts.released is not None and facts.waits is not None:
        waiters = facts.released
        missing = list(facts.waits)
    else:
        waiters = {}
        missing = [0] * n
        for t in tasks:
            missing[t.id] = len(t.waits)
            for e, c in t.waits:
                waiters.setdefault(e, {}).setdefault(c, []).append(t.id)
    count = [0] * len(graph.events)
    # Where the ranking is itself an order the counters allow (longest_path's, when every
    # task costs time: a task's path is longer than each successor's), the simulation takes
    # the tasks in rank order: the task of the smallest rank not yet taken is ready, so it is
    # the best ready one. Taken so while that holds, without the heap; from the first task
    # that is not ready, the heap resumes with the tasks ready then, exactly where the plain
    # simulation would be (the 2x8 layer's longest_path order: all 78k tasks in rank order).
    for tid in by_rank:
        if missing[tid]:
            break
        order.append(tid)
        yield tid
        for e in tasks[tid].signals:
            count[e] += 1
            by_count = waiters.get(e)
            if by_count is None:
                continue
            for w in by_count.get(count[e], ()):
                missing[w] -= 1
    taken = len(order)
    if taken == n:
        return
    heap = [rank_of[tid] for tid in by_rank[taken:] if not missing[tid]]
    heapq.heapify(heap)
    while heap:
        tid = by_rank[heapq.heappop(heap)]
        order.append(tid)
        yield tid
        for e in tasks[tid].signals:
            count[e] += 1
            by_count = waiters.get(e)
            if by_count is None:
                continue
            for w in by_count.get(count[e], ()):
                missing[w] -= 1
                if missing[w] == 0:
                    heapq.heappush(heap, rank_of[w])
    assert len(order) == n, "policy_input's topo_order already proved every task can run"


# The passes below walk the events, not the successor lists: every task waiting for all of an
# event's signals runs after each of its signalers, so one fold of the event's full waiters
# serves all its signalers; a partial waiter counts only for the signalers earlier in ``order``
# (the edges ``succ`` holds, the same maxima and minima).
def critical_path_lengths(facts: PolicyInput, partial_waits: bool = True) -> list[float]:
    """Cost of the longest path from each task to the end of the graph, the task included.
    A partial wait (a count below the event's total) counts as an edge from each of its
    earlier signalers: a priority, not a bound, since any of them may be the one it needs.
    ``partial_waits=False`` leaves those edges out: then each value is a lower bound on the
    time from the task's start to the end in the queue model."""
    costs, pos, full = facts.costs, facts.pos, facts.full
    partial = facts.partial if partial_waits else {}
    tasks = facts.graph.tasks
    length = list(costs)
    after: dict[int, float] = {}  # event -> the longest path from its full waiters
    if not partial:
        # the loop below without the partial waiters' lookup per signal, the events' values
        # in a list
        known: list[float | None] = [None] * len(full)
        for tid in reversed(facts.order):
            best = 0.0
            for e in tasks[tid].signals:
                v = known[e]
                if v is None:
                    v = known[e] = max(map(length.__getitem__, full[e]), default=0.0)
                if v > best:
                    best = v
            length[tid] = costs[tid] + best
        return length
    for tid in reversed(facts.order):
        best = 0.0
        for e in tasks[tid].signals:
            v = after.get(e)
            if v is None:
                v = after[e] = max(map(length.__getitem__, full[e]), default=0.0)
            if v > best:
                best = v
            for w in partial.get(e, ()):
                if pos[tid] < pos[w] and length[w] > best:
                    best = length[w]
        length[tid] = costs[tid] + best
    return length


_RDMA = Role.RDMA.value

# critical_path takes the order placed on the workers only when the queue model predicts it
# shorter than longest_path's by more than this fraction
PLACED_MARGIN = 0.01

_NEVER = 1 << 30  # the wave of a task no network transfer depends on


def network_levels(graph: TaskGraph, facts: PolicyInput) -> list[int]:
    """For each task, the number of rdma tasks on the longest chain ending at it (itself
    included): 0 for what needs no network data, 1 for a first-wave send and for what waits on
    one (a rail reduce-scatter's sums), and so on."""
    rdma = Role.RDMA.value
    tasks, pos, partial = graph.tasks, facts.pos, facts.partial
    signalers = graph.signalers() if partial else {}
    partial_waits = {(e, w) for e, waiters in partial.items() for w in waiters}
    level = [0] * len(tasks)
    reached = [0] * len(graph.events)  # the highest level among an event's signalers so far
    if not partial_waits:
        # every wait is a full one (the common case): the loop below without the per-wait
        # membership test, a one-wait task (nearly all of them) read directly
        for tid in facts.order:
            t = tasks[tid]
            waits = t.waits
            if len(waits) == 1:
                lv = reached[waits[0][0]]
            else:
                lv = 0
                for e, _ in waits:
                    if reached[e] > lv:
                        lv = reached[e]
            if t.role == rdma:
                lv += 1
            level[tid] = lv
            for e in t.signals:
                if reached[e] < lv:
                    reached[e] = lv
        return level
    for tid in facts.order:
        t = tasks[tid]
        lv = 0
        for e, _ in t.waits:
            if (e, tid) in partial_waits:
                for s in signalers[e]:
                    if pos[s] < pos[tid] and level[s] > lv:
                        lv = level[s]
            elif reached[e] > lv:  # a full wait: every signaler already ran
                lv = reached[e]
        if t.role == rdma:
            lv += 1
        level[tid] = lv
        for e in t.signals:
            if reached[e] < lv:
                reached[e] = lv
    return level


def network_waves(graph: TaskGraph, facts: PolicyInput) -> list[int]:
    """For each task, the earliest network wave that needs it (``_NEVER`` if none).

    An rdma task's wave is its ``network_levels`` value: wave 1 sends data produced locally,
    wave 2 sends what wave 1 made possible (a reduce-scatter's all-gather), and so on. A task's
    wave is the smallest wave among the rdma tasks that depend on it: the lower, the sooner the
    network waits for it.
    """
    rdma = Role.RDMA.value
    level = network_levels(graph, facts)
    return _earliest_downstream(
        graph, facts, [level[t.id] if t.role == rdma else _NEVER for t in graph.tasks]
    )


def _earliest_downstream(graph: TaskGraph, facts: PolicyInput, own: list[int]) -> list[int]:
    """For each task, the smallest ``own`` value among itself and the tasks that depend on it
    (through full waits, and partial waits that come after it in the order)."""
    tasks, pos, full, partial = graph.tasks, facts.pos, facts.full, facts.partial
    need = [_NEVER] * len(tasks)
    first: dict[int, int] = {}  # event -> the smallest value among its full waiters
    if not partial:
        # the loop below without the partial waiters' lookup per signal, the events' values
        # in a list
        known: list[int | None] = [None] * len(full)
        for tid in reversed(facts.order):
            best = own[tid]
            for e in tasks[tid].signals:
                v = known[e]
                if v is None:
                    v = known[e] = min(map(need.__getitem__, full[e]), default=_NEVER)
                if v < best:
                    best = v
            need[tid] = best
        return need
    for tid in reversed(facts.order):
        best = own[tid]
        for e in tasks[tid].signals:
            v = first.get(e)
            if v is None:
                v = first[e] = min(map(need.__getitem__, full[e]), default=_NEVER)
            if v < best:
                best = v
            for w in partial.get(e, ()):
                if pos[tid] < pos[w] and need[w] < best:
                    best = need[w]
        need[tid] = best
    return need


def network_slots(
    graph: TaskGraph,
    facts: PolicyInput,
    lag: int | None = None,
    level: list[int] | None = None,
) -> list[int]:
    """For each task, the earliest slot among the RDMA tasks that depend on it (itself
    included; ``_NEVER`` if none), where a rank's RDMA tasks take slots in (network wave, id)
    order: every first-wave send of the rank, then the second wave (a reduce-scatter's
    all-gather), and so on.

    Ordering by it, chunk c's tiles, node sums and send come before chunk c+1's, so each send
    leaves while later tiles compute. Wave-major, so the one RDMA worker's queue never holds a
    send behind a second-wave task that waits a network round trip (slots in id order
    interleave them: simulated 2x8 GEMM+AR 4096x256x4096 0.81 ms against 0.58 wave-major).

    With ``lag`` k the waves interleave instead, k sends apart: the j-th send (in id order) of
    wave w takes the slot after the (j + k)-th of wave w - 1, so a later wave's send follows
    k more sends of the wave before it (``staged_order``: k = 1). Wave-major put every tile
    of a chunk that only a second-wave send needs (the chunks a rank reduces for its own node)
    after every first-wave chunk, so nothing of the node broadcast could start before half of
    the GEMM had run (simulated 2x8 GEMM+AR 32768x2048x32768: first broadcast at 5.8 ms).
    ``level``: ``network_levels(graph, facts)`` when the caller has it.
    """
    rdma = Role.RDMA.value
    if level is None:
        level = network_levels(graph, facts)
    # an rdma task's wave is its own level: every rdma task that depends on it is a level up
    by_rank: dict[int, list[tuple[int, int]]] = {}
    for t in graph.tasks:
        if t.role == rdma:
            by_rank.setdefault(t.rank, []).append((level[t.id], t.id))
    own = [_NEVER] * len(graph.tasks)
    for sends in by_rank.values():
        sends.sort()
        if lag is not None:
            index: dict[int, int] = {}  # wave -> its sends so far, in id order
            keyed = []
            for w, tid in sends:
                j = index.get(w, 0)
                index[w] = j + 1
                keyed.append((j + lag * (w - 1), w, tid))
            keyed.sort()
            sends = [(w, tid) for _, w, tid in keyed]
        for slot, (_, tid) in enumerate(sends):
            own[tid] = slot
    return _earliest_downstream(graph, facts, own)


def staged_order(
    graph: TaskGraph, facts: PolicyInput, length: list[float], turn: list[int]
) -> list[int]:
    """``critical_path``'s candidate order for a graph with RDMA tasks: the compute and NVLink
    tasks by ``network_levels`` descending first (a rail sum, or a broadcast of network data,
    as soon as the counters allow, before any tile that needs no network data), then every
    task by ``network_slots`` with the waves one send apart (lag 1), then by ``length``
    (critical_path_lengths) and ``turn`` (push_rotation). RDMA tasks skip the level key, so a
    rank's sends go by slot: a later wave's send one send of the wave before it behind.

    Simulated 2x8 GEMM+AR (simulated.md's options) against the wave-major ``network_first``:
    4096x256x4096 0.296 -> 0.266 ms, 8192x512x8192 0.817 -> 0.750, 16384x1024x16384 3.337 ->
    2.996, 32768x2048x32768 16.56 -> 14.24 (the node broadcast runs beside the GEMM instead
    of after it). On graphs whose compute waits on network data for most of its tiles it loses
    (a tile placed as soon as its counters allow holds its worker for a network transfer):
    2x8 ring attention S=12288 3.2 -> 6.6 ms, AG+GEMM 4096 0.38 -> 0.52 ms. ``critical_path``
    keeps it only where ``network_makespan`` predicts it shorter."""
    return list_order(graph, _staged_priority(graph, facts, length, turn), facts)


def _staged_priority(
    graph: TaskGraph,
    facts: PolicyInput,
    length: list[float],
    turn: list[int],
    plain: Columns | None = None,
) -> Columns:
    """``plain``: ``Columns([-x for x in length], turn)`` when the caller ranked it already."""
    rdma = Role.RDMA.value
    level = network_levels(graph, facts)
    stage = [0 if t.role == rdma else -level[t.id] for t in graph.tasks]
    slot = network_slots(graph, facts, lag=1, level=level)
    return Columns(stage, slot, then=plain or Columns([-x for x in length], turn))


def push_rotation(graph: TaskGraph) -> list[int]:
    """The tie-break of the builtin policies for tasks that write into exactly one node peer:
    how far that peer is from the task's GPU, starting at the next one, (peer - gpu - 1) mod
    gpus_per_node. 0 for tasks writing no peer or several (a broadcast loads all links alike),
    and for every task on nodes of 1 or 2 GPUs (one peer: nothing to rotate).

    An NVLink-role task adds ``k * gpus_per_node``, k being how many NVLink tasks of its rank
    into the same peer come before it in id order (its chunk, where a lowering splits a copy per
    (chunk, peer): gemm_allreduce's node broadcast, allgather_gemm's and ring attention's pushes
    and forwards). Those copies are of equal path length, and by peer alone a rank's NVLink queue
    held every chunk's copy to r+1 before any to r+2: a worker blocked on a late chunk's copy
    while other chunks' copies were ready (simulated 2x8 GEMM+AR 16384: 3.837 -> 3.518 ms;
    AG+GEMM 16384: 4.648 -> 4.312 ms). With k first they go chunk by chunk, each chunk's from
    the next GPU on, whatever peer order the lowering emitted them in."""
    topo = graph.topology
    per_node = topo.gpus_per_node
    holder = {bid: b.rank for bid, b in graph.buffers.items()}
    out = [0] * len(graph.tasks)
    if per_node <= 2:
        return out
    nvlink = Role.NVLINK.value
    seen: dict[tuple[int, int], int] = {}  # (rank, peer) -> NVLink tasks so far, in id order
    for t in graph.tasks:
        peer = -1
        rank = t.rank
        node = rank // per_node
        for w in t.writes:
            h = holder[w[0]]
            if h == rank or h == peer or h // per_node != node:
                continue
            if peer >= 0:  # a second peer: no single target
                peer = -2
                break
            peer = h
        if peer < 0:
            continue
        turn = (peer - rank - 1) % per_node
        if t.role == nvlink:
            k = seen.get((rank, peer), 0)
            seen[rank, peer] = k + 1
            turn += k * per_node
        out[t.id] = turn
    return out


# -- the builtin policies ----------------------------------------------------------------------
@register_policy("topological")
def topological(graph: TaskGraph, facts: PolicyInput) -> list[int]:
    """Ready tasks in id order: the program order the lowering emitted them in."""
    return list_order(graph, range(len(graph.tasks)), facts)


@register_policy("critical_path")
def critical_path(graph: TaskGraph, facts: PolicyInput) -> list[int]:
    """Longest remaining path first, the path's tasks placed on the schedule's workers
    (``facts.workers``; placement.py): each task by its end time in a backward list schedule of
    the graph on each rank's workers per role, ties by the unconstrained path length, then
    ``push_rotation``, then id. It starts the tiles whose results still have the longest way to
    go, counting that a wide stage behind a task takes its tiles over the workers' count.

    It is ``longest_path``'s order with ``facts.workers`` None (a caller that knows no
    partition), with a worker for every task. Graphs with RDMA tasks are not placed: the
    queue model that judges the placed order knows no network (runtime/sim ranked 2-node
    GEMM+AR orders the other way round), and on a 2x8 layer (80k tasks) the placing doubled
    the schedule's time (0.3 -> 0.75 s; issue 16's compile target is < 3 s cold there).
    There, on nodes of several GPUs and given ``facts.workers`` and ``facts.hardware``, it
    takes ``staged_order`` (the network's later waves interleaved with the tiles) where
    ``network_makespan`` (the queue model with each rank's proxy and NIC) predicts it shorter
    than ``longest_path``'s order by ``PLACED_MARGIN``, else ``longest_path``'s order: a
    prediction, no timing run. Nodes of one GPU (2x1, what bench_emulated measures on 2 GPUs)
    keep longest_path's order: the simulator predicts the staged one faster there too
    (GEMM+AR 8192x8192x4096 per rank, 256 KiB chunks: 9.43 -> 8.80 ms), but it cuts the
    megakernel's static GEMM prefix (runtime/megakernel/encode.py: the compute queue's leading
    GEMM tasks) from 2048 tiles to 4 there, which the simulator does not model, so the measured
    schedules stay until a GPU run compares."""
    length = critical_path_lengths(facts)
    turn = push_rotation(graph)
    rdma = any(t.role == _RDMA for t in graph.tasks)
    if (
        rdma
        and graph.topology.gpus_per_node > 1
        and facts.workers is not None
        and facts.hardware is not None
    ):
        return _network_choice(graph, facts, length, turn)
    if facts.workers is None or rdma:
        return list_order(graph, Columns([-x for x in length], turn), facts)
    # the backward schedule breaks ties as the mirror of longest_path's order, so tasks it
    # cannot tell apart keep that order (a lowering's tile bands, push_rotation)
    rank = [0] * len(graph.tasks)
    for i, tid in enumerate(Columns([-x for x in length], turn).ranked()):
        rank[tid] = i
    plain_order = list_order(graph, rank, facts)  # longest_path's
    pools = Pools(graph, facts.workers, facts.total, facts.partial)
    plain = queue_makespan(graph, pools, plain_order, facts.costs)
    # Nothing to gain where longest_path's order is predicted within the margin of the bound
    # (the longest path; each pool's work over its workers), e.g. a fused GEMM's tile loop:
    # skipping the backward schedule there changes no choice, as no order beats the bound
    # (the bound's paths leave partial waits out: through one, a path is a priority, not a
    # bound, and the placed order could beat it)
    bound_length = critical_path_lengths(facts, False) if facts.partial else length
    if plain <= _bound(bound_length, pools, facts.costs) * (1.0 + PLACED_MARGIN):
        return plain_order
    placed = constrained_lengths(
        graph, pools, facts.costs, facts.order, facts.pos, facts.full, facts.partial, rank
    )
    # By latest end first, ties in plain_order: a topological order without a counter
    # simulation, since a task's backward end is at least each successor's plus its own cost
    # (equal only at cost 0, where plain_order puts the predecessor first)
    at = [0] * len(graph.tasks)
    for i, tid in enumerate(plain_order):
        at[tid] = i
    placed_order = Columns([-x for x in placed], at).ranked()
    if placed_order == plain_order:
        return plain_order
    # Keep longest_path's order unless the queue model predicts the placed one shorter by the
    # margin (float noise, and what the queue model does not model: module docstring)
    better = queue_makespan(graph, pools, placed_order, facts.costs)
    return placed_order if better < plain * (1.0 - PLACED_MARGIN) else plain_order


def _network_choice(
    graph: TaskGraph, facts: PolicyInput, length: list[float], turn: list[int]
) -> list[int]:
    """``critical_path`` on a graph with RDMA tasks: longest_path's order or ``staged_order``,
    whichever ``network_makespan`` predicts shorter (staged only by more than the margin)."""
    assert facts.workers is not None and facts.hardware is not None
    costs = facts.costs
    by_length = Columns([-x for x in length], turn)
    plain = list_order(graph, by_length, facts)
    pools = Pools(graph, facts.workers, facts.total, facts.partial)
    before = network_makespan(graph, pools, plain, costs, facts.hardware)
    need = before * (1.0 - PLACED_MARGIN)
    # The staged order is simulated in the queue model as the list simulation takes its
    # tasks, and both stop once it cannot beat ``need``: a task ending at t leaves at least
    # the longest path after it to run (without partial waits, ``length`` less the task's
    # cost is a bound: critical_path's note on _bound). The 2x8 layer's staged order
    # (predicted 36.9 ms against 19.4) stops after 14k of its 78k tasks. An order equal to
    # the plain one predicts the same, so it is never taken, as before.
    tail = None if facts.partial else [x - c for x, c in zip(length, costs, strict=True)]
    staged: list[int] = []
    steps = list_order_steps(
        graph, _staged_priority(graph, facts, length, turn, by_length), facts, staged
    )
    after = network_makespan(graph, pools, steps, costs, facts.hardware, limit=need, tail=tail)
    return staged if after < need else plain


def _bound(length: list[float], pools: Pools, costs: list[float]) -> float:
    """A lower bound on any order's makespan in the queue model: the longest path, and each
    pool's work over its workers."""
    work = [0.0] * len(pools.size)
    for tid, p in enumerate(pools.of):
        work[p] += costs[tid]
    spread = max((w / k for w, k in zip(work, pools.size, strict=True) if k), default=0.0)
    return max(max(length, default=0.0), spread)


@register_policy("longest_path")
def longest_path(graph: TaskGraph, facts: PolicyInput) -> list[int]:
    """Longest remaining path (by estimated cost, a worker for every task) first, ties by
    ``push_rotation`` then id: the classic list-scheduling priority, ``critical_path``'s order
    before it counted the workers (kept to compare against)."""
    length = critical_path_lengths(facts)
    turn = push_rotation(graph)
    return list_order(graph, Columns([-x for x in length], turn), facts)


@register_policy("network_first")
def network_first(graph: TaskGraph, facts: PolicyInput) -> list[int]:
    """``critical_path`` after ``network_slots``: the tasks the earliest RDMA transfers need come
    first (module docstring). The same order as ``critical_path`` on one node."""
    length = critical_path_lengths(facts)
    turn = push_rotation(graph)
    slot = network_slots(graph, facts)
    return list_order(graph, Columns(slot, [-x for x in length], turn), facts)


@register_policy("remote_first")
def remote_first(graph: TaskGraph, facts: PolicyInput) -> list[int]:
    """Tasks whose outputs the earliest network transfers need first, then by critical path.

    The network is the slowest link: producing first the tiles that must cross it starts the
    transfers early and hides them behind the rest of the compute.
    """
    waves = network_waves(graph, facts)
    length = critical_path_lengths(facts)
    turn = push_rotation(graph)
    return list_order(graph, Columns(waves, [-x for x in length], turn), facts)
