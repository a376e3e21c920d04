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
from .paths import (
    critical_path_lengths,
    network_levels,
    network_slots,
    network_waves,
    path_lengths,
    push_rotation,
    staged_keys,
)
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
    "longest_path_order",
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
    waiters, missing = _counter_tables(graph, facts)
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


def _counter_tables(
    graph: TaskGraph, facts: PolicyInput | None
) -> tuple[dict[int, dict[int, list[int]]], list[int]]:
    """event -> count -> waiters, and each task's number of waits (a copy: the simulation
    counts it down). A signal visits only the waiters its new count releases (a join event of
    a traced layer has ~100 signalers and as many waiters)."""
    if facts is not None and facts.released is not None and facts.waits is not None:
        return facts.released, list(facts.waits)
    waiters: dict[int, dict[int, list[int]]] = {}
    missing = [0] * len(graph.tasks)
    for t in graph.tasks:
        missing[t.id] = len(t.waits)
        for e, c in t.waits:
            waiters.setdefault(e, {}).setdefault(c, []).append(t.id)
    return waiters, missing


_RDMA = Role.RDMA.value

# critical_path takes the order placed on the workers only when the queue model predicts it
# shorter than longest_path's by more than this fraction
PLACED_MARGIN = 0.01


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
    _, _, stage, slot = staged_keys(graph, facts)
    return list_order(graph, Columns(stage, slot, then=Columns([-x for x in length], turn)), facts)


def longest_path_order(
    graph: TaskGraph, facts: PolicyInput, by_length: Columns, descending: bool
) -> list[int]:
    """``list_order(graph, by_length, facts)``: longest_path's order from its priority
    (``Columns([-x for x in length], turn)``) and ``path_lengths``' flag, which, when True,
    proves the ranking itself an order the counters allow (each task after the signalers of
    every event it waits on), so it is the order the simulation would take, without the
    simulation (~25 ms at 2x8). The proof holds only for lengths computed over an order of
    validation's own simulation, whose tables ``list_order`` would simulate with anyway."""
    order = facts.order
    if (
        descending
        and facts.graph is graph
        and not facts.partial
        and isinstance(order, CounterOrder)
        and facts.released is order.released
    ):
        return SimulatedOrder(list(by_length.ranked()), graph)
    return list_order(graph, by_length, facts)


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
    rdma = any(t.role == _RDMA for t in graph.tasks)
    if (
        rdma
        and graph.topology.gpus_per_node > 1
        and facts.workers is not None
        and facts.hardware is not None
    ):
        return _network_choice(graph, facts)
    length, descending = path_lengths(facts)
    by_length = Columns([-x for x in length], push_rotation(graph))
    plain_order = longest_path_order(graph, facts, by_length, descending)
    if facts.workers is None or rdma:
        return plain_order
    # the backward schedule breaks ties as the mirror of longest_path's order, so tasks it
    # cannot tell apart keep that order (a lowering's tile bands, push_rotation)
    rank = [0] * len(graph.tasks)
    for i, tid in enumerate(by_length.ranked()):
        rank[tid] = i
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


def _network_choice(graph: TaskGraph, facts: PolicyInput) -> list[int]:
    """``critical_path`` on a graph with RDMA tasks: longest_path's order or ``staged_order``,
    whichever ``network_makespan`` predicts shorter (staged only by more than the margin)."""
    assert facts.workers is not None and facts.hardware is not None
    costs = facts.costs
    length, descending, stage, slot = staged_keys(graph, facts)
    by_length = Columns([-x for x in length], push_rotation(graph))
    plain = longest_path_order(graph, facts, by_length, descending)
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
    steps = list_order_steps(graph, Columns(stage, slot, then=by_length), facts, staged)
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
    length, descending = path_lengths(facts)
    by_length = Columns([-x for x in length], push_rotation(graph))
    return longest_path_order(graph, facts, by_length, descending)


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
