"""Path lengths on the workers a schedule has: the backward list schedule behind ``critical_path``.

A task's critical path length (its longest chain of successors, by cost) assumes a worker for
every task. A megakernel has a fixed number per role, so a stage of N tiles behind a task takes
about N x cost / workers, not one tile's cost: the unconstrained length undervalues every task
whose consumers form a wide stage, and overvalues the tail of a chain whose stage behind it
can start on part of its rows. On the traced Llama layer (one rank, 132 programs;
benchmarks/replay_layer.py) it queued every attention block before the first o-projection tile
(the last query rows' chains are the longest) and all 3584 gate/up tiles before the first
SwiGLU task (a gate tile's path is longer than the SwiGLU's by the tile's own cost), so
programs holding the next stage's first tasks waited for the previous stage's last ones.

``constrained_lengths`` list-schedules the REVERSED graph on each rank's workers per role (the
tasks at the end of the graph first, a task once everything after it has run, the free worker
taking the ready task with the longest path from the graph's start): a task's end time there is
the latest-start view of how much time the schedule still needs once it starts, with the stages
after it spread over the workers. With unlimited workers it is exactly the critical path length.
Ordered by it, v12's lowering of the layer (12,864 tasks) had its o-projection start on the
query rows whose attention was done (in the replay with v12's measured kind times, at 1.05 ms
instead of 1.49), the second RMSNorm follow the residual add row by row, and the SwiGLU tasks
start among the last ~300 gate/up tiles instead of after all of them; each SwiGLU task was a
64-row tile over all 14336 columns there, and the down projection still waited for the last
ones (traced elementwise ops tile wide rows down to 16 rows since).

Event-level like policies.py's passes (never the 15M task-to-task edges of a traced layer at
2x8): a task is released in the backward schedule when, for every event it signals, all of the
event's full waiters have run, and each partial waiter (a wait for fewer than all signals) that
comes after it in the topological order has. RDMA tasks are delays, not workers' time (their
worker only posts a command; the cost is the transfer's latency and wire time), so their role
gets no worker limit.

``queue_times`` is the forward check: the megakernel's queues taken in order by their workers
with head-of-line blocking, on the same costs. ``critical_path`` keeps the placed order only
where it predicts it shorter than the unconstrained one by ``policies.PLACED_MARGIN``, and only
on graphs without RDMA tasks: the model knows neither bandwidth sharing nor the network's
proxies (runtime/sim, which models both, ranked 2-node GEMM+AR orders the other way round when
this model saw them 0.2% apart). ``network_makespan`` adds each rank's proxy and NIC to the
forward check: ``critical_path`` judges its two orders of a multi-node graph with RDMA tasks by it
(policies.staged_order).
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Mapping, Sequence
from operator import getitem

from ..graph import TaskGraph
from ..hardware import HardwareProfile
from ..kinds import Role

__all__ = [
    "Pools",
    "top_levels",
    "constrained_lengths",
    "queue_times",
    "queue_makespan",
    "network_makespan",
]

_RDMA = Role.RDMA.value


class Pools:
    """What both passes read, built once per schedule: each event's signallers and signal
    count, the events waited on for fewer than all signals, and each task's pool (its rank's
    workers of its role) with the pools' sizes (0: RDMA, no limit).

    ``total`` and ``partial`` (the signals per event, the events with a partial waiter) are
    PolicyInput's when the caller has them: critical_path passes them, so a 2x8 layer's
    150k waits and 100k signals are not walked again. The signallers lists, which only
    ``constrained_lengths`` reads, are built on first read."""

    def __init__(
        self,
        graph: TaskGraph,
        workers: Sequence[Mapping[str, int]],
        total: Sequence[int] | None = None,
        partial: Iterable[int] | None = None,
    ) -> None:
        tasks = graph.tasks
        self._graph = graph
        self._signalers: list[list[int]] | None = None
        if total is None:
            total = [len(s) for s in self.signalers]
        self.total = total
        # role -> rank -> pool: a pool for every rank up to the last with tasks in each role
        # the tasks have, looked up by C-level maps over the tasks' roles and ranks (~38k at
        # 2x8), no (rank, role) pair made and hashed per task
        ranks = [t.rank for t in tasks]
        roles = [t.role for t in tasks]
        last = max(ranks, default=-1)
        size: list[int] = []
        pools_of: dict[str, list[int]] = {}
        for role in dict.fromkeys(roles):
            pools_of[role] = list(range(len(size), len(size) + last + 1))
            size.extend(
                0 if role == _RDMA else max(1, workers[rank].get(role, 0))
                for rank in range(last + 1)
            )
        of = list(map(getitem, map(pools_of.__getitem__, roles), ranks))
        self.size = size
        self.of = of
        # events some task waits on for fewer than all signals
        if partial is None:
            partial = {e for t in tasks for e, c in t.waits if c < total[e]}
        self.partial = set(partial)

    @property
    def signalers(self) -> list[list[int]]:
        """event -> the ids of the tasks that signal it, in id order."""
        if self._signalers is None:
            signalers: list[list[int]] = [[] for _ in self._graph.events]
            for t in self._graph.tasks:
                for e in t.signals:
                    signalers[e].append(t.id)
            self._signalers = signalers
        return self._signalers


def top_levels(graph: TaskGraph, costs: Sequence[float], order: Sequence[int]) -> list[float]:
    """Longest path from the graph's start to the end of each task, its own cost included."""
    tasks = graph.tasks
    top = [0.0] * len(tasks)
    reached = [0.0] * len(graph.events)  # the latest top level among the event's signallers
    for tid in order:
        t = tasks[tid]
        best = 0.0
        for e, _ in t.waits:
            if reached[e] > best:
                best = reached[e]
        v = top[tid] = best + costs[tid]
        for e in t.signals:
            if v > reached[e]:
                reached[e] = v
    return top


def constrained_lengths(
    graph: TaskGraph,
    pools: Pools,
    costs: Sequence[float],
    order: Sequence[int],
    pos: Sequence[int],
    full: Sequence[Sequence[int]],
    partial: Mapping[int, Sequence[int]],
    tie: Sequence[int],
) -> list[float]:
    """Each task's end time in the backward list schedule of the module docstring, on
    ``pools``' workers. ``order``/``pos``/``full``/``partial`` are PolicyInput's (a
    topological order, positions in it, each event's full and partial waiters). Ready tasks
    of equal top level go by ``tie`` descending: the mirror of a forward order, so that tasks
    the backward schedule cannot tell apart come out of it in that forward order."""
    tasks = graph.tasks
    n = len(tasks)
    signalers, total, pool_of = pools.signalers, pools.total, pools.of
    # A task's backward predecessors: the events it signals that have full waiters (one
    # release each, when the last full waiter has run), plus its partial waiters after it.
    missing = [0] * n
    for t in tasks:
        for e in t.signals:
            if full[e]:
                missing[t.id] += 1
    for e, waiters in partial.items():
        for w in waiters:
            for s in signalers[e]:
                if pos[s] < pos[w]:
                    missing[s] += 1
    full_left = [len(f) for f in full]
    top = top_levels(graph, costs, order)
    # One int per task for the ready heaps: its rank by (top level, tie), both descending
    by_rank = sorted(range(n), key=lambda t: (-top[t], -tie[t]))
    rank_of = [0] * n
    for i, tid in enumerate(by_rank):
        rank_of[tid] = i
    size = pools.size
    idle = list(size)  # free workers per pool (a pool of size 0 has no limit)
    ready: list[list[int]] = [[] for _ in size]  # per pool: ready tasks' ranks (a heap)
    end = [0.0] * n
    running: list[tuple[float, int]] = []  # (end time, task)
    heappush, heappop = heapq.heappush, heapq.heappop

    def dispatch(p: int, now: float) -> None:
        """The pool's free workers take its best ready tasks."""
        heap = ready[p]
        while heap and (idle[p] or not size[p]):
            tid = by_rank[heappop(heap)]
            if size[p]:
                idle[p] -= 1
            t_end = end[tid] = now + costs[tid]
            heappush(running, (t_end, tid))

    for tid in by_rank:  # the sinks, in priority order (ascending ranks: already heaps)
        if missing[tid] == 0:
            ready[pool_of[tid]].append(rank_of[tid])
    for p in range(len(size)):
        dispatch(p, 0.0)
    done = 0
    # One ended task at a time, in (end, id) order: it releases its backward successors, then
    # its pool and theirs hand their free workers the best ready tasks.
    while running:
        now, tid = heappop(running)
        done += 1
        p = pool_of[tid]
        if size[p]:
            idle[p] += 1
        touched = [p]
        for e, c in tasks[tid].waits:
            if c < total[e]:  # a partial wait (policy_input's rule)
                released = [s for s in signalers[e] if pos[s] < pos[tid]]
            else:
                full_left[e] -= 1
                if full_left[e]:
                    continue
                released = signalers[e]
            for s in released:
                missing[s] -= 1
                if missing[s] == 0:
                    q = pool_of[s]
                    heappush(ready[q], rank_of[s])
                    if q != p:
                        touched.append(q)
        for q in touched:
            dispatch(q, now)
    assert done == n, "a topological order exists, so the backward schedule places every task"
    return end


def queue_times(
    graph: TaskGraph, pools: Pools, order: Sequence[int], costs: Sequence[float]
) -> tuple[list[float], list[float], list[float]]:
    """The megakernel's queue model of a schedule cut from ``order`` (a topological order):
    per rank and role, the queue taken in order by its workers, the one that frees first
    taking the next task and holding it until its waits are met (head-of-line blocking), then
    busy for its cost. Returns per task the time it was taken, its waits met, and its end.

    RDMA tasks are delays (no worker limit), as in ``constrained_lengths``. A wait for fewer
    than all of an event's signals is met by the signals of tasks earlier in ``order``."""
    tasks = graph.tasks
    n = len(tasks)
    total, pool_of, size, partial = pools.total, pools.of, pools.size, pools.partial
    take, ready, end = [0.0] * n, [0.0] * n, [0.0] * n
    free = [[0.0] * k for k in size]  # per pool: its workers' free times (a heap)
    latest = [0.0] * len(graph.events)  # the latest signal so far (what a full wait needs)
    signals: dict[int, list[float]] = {e: [] for e in partial}  # every signal's time
    for tid in order:
        t = tasks[tid]
        met = 0.0
        for e, c in t.waits:
            at = latest[e] if c >= total[e] else sorted(signals[e])[c - 1]
            if at > met:
                met = at
        p = pool_of[tid]
        at = heapq.heappop(free[p]) if size[p] else met
        take[tid] = at
        start = ready[tid] = at if at > met else met
        done = end[tid] = start + costs[tid]
        if size[p]:
            heapq.heappush(free[p], done)
        for e in t.signals:
            if done > latest[e]:
                latest[e] = done
            if e in signals:
                signals[e].append(done)
    return take, ready, end


def queue_makespan(
    graph: TaskGraph,
    pools: Pools,
    order: Iterable[int],
    costs: Sequence[float],
    hardware: HardwareProfile | None = None,
    limit: float = float("inf"),
    tail: Sequence[float] | None = None,
) -> float:
    """``max(queue_times(...)[2])``, in about half the time (critical_path runs it twice per
    schedule): one heapreplace per task, and per-signal work only for events with partial
    waits. With ``hardware``, the network too (``network_makespan``).

    ``limit``: for a caller that only asks whether the order beats it. Once the makespan is
    sure to pass it, the rest of ``order`` is not simulated (nor taken from it, when it is an
    iterator) and a value above ``limit`` is returned, not the makespan: the makespan so far
    only grows, and a task ending at t leaves at least ``tail[task]`` to run after it (the
    longest path of full waits behind it: each of those tasks starts after the one before it
    ends). ``tail`` values are sums of costs taken in another order than the model's, so the
    bound must pass ``limit`` by more than their rounding (1e-9 relative) to stop."""
    tasks = graph.tasks
    total, pool_of, size = pools.total, pools.of, pools.size
    free = [[0.0] * k for k in size]
    if hardware is not None:
        command = hardware.proxy_command_us * 1e-6
        wire = hardware.rdma_gbps * 1e9
        nic = [0.0] * graph.topology.world_size  # when each rank's proxy and NIC are free
    latest = [0.0] * len(graph.events)
    signals: dict[int, list[float]] = {e: [] for e in pools.partial}
    heapreplace = heapq.heapreplace
    last = 0.0
    beyond = limit * (1.0 + 1e-9)
    for tid in order:
        t = tasks[tid]
        met = 0.0
        for e, c in t.waits:
            at = latest[e] if c >= total[e] else sorted(signals[e])[c - 1]
            if at > met:
                met = at
        p = pool_of[tid]
        if size[p]:
            heap = free[p]
            at = heap[0]
            done = (at if at > met else met) + costs[tid]
            heapreplace(heap, done)
        elif hardware is not None:
            # one RDMA worker per rank posts in queue order, so a write starts no earlier than
            # the proxy and NIC are free from the one before it (costmodel: bytes / 2 on the wire)
            at = nic[t.rank]
            start = at if at > met else met
            nic[t.rank] = start + max(command, t.bytes / 2 / wire)
            done = start + costs[tid]
        else:
            done = met + costs[tid]
        if done > last:
            last = done
            if last > limit:
                return last
        if tail is not None and done + tail[tid] > beyond:
            return done + tail[tid]
        for e in t.signals:
            if done > latest[e]:
                latest[e] = done
        if signals:
            for e in t.signals:
                if e in signals:
                    signals[e].append(done)
    return last


def network_makespan(
    graph: TaskGraph,
    pools: Pools,
    order: Iterable[int],
    costs: Sequence[float],
    hardware: HardwareProfile,
    limit: float = float("inf"),
    tail: Sequence[float] | None = None,
) -> float:
    """``queue_makespan`` with a network: each rank's writes leave in its RDMA queue's order
    through the rank's one host proxy and NIC, a write holding them for the larger of one proxy
    command and its wire time (the proxy encodes the next command while the NIC sends) and
    landing its cost (costmodel: command + latency + wire) after it starts. Enough to see what
    ``queue_makespan`` cannot: a send queued behind one that waits a network round trip holds
    every later send, and sends compete for the rank's NIC. ``critical_path`` compares its two
    orders of a graph with RDMA tasks by it. ``limit``, ``tail``: as ``queue_makespan``'s."""
    return queue_makespan(graph, pools, order, costs, hardware, limit, tail)
