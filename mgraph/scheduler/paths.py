"""The per-task values the builtin policies rank by (policies.py): path lengths, network levels,
waves and slots, and the push rotation tie-break. Each is one pass over the graph's tasks or
events, never over the successor lists (a traced layer's join events make 15M edges at 2x8).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..graph import TaskGraph
from ..kinds import Role

if TYPE_CHECKING:
    from .policies import PolicyInput

__all__ = [
    "critical_path_lengths",
    "path_lengths",
    "staged_keys",
    "network_levels",
    "network_waves",
    "network_slots",
    "push_rotation",
]


_NEVER = 1 << 30  # the wave of a task no network transfer depends on


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
    return path_lengths(facts, partial_waits)[0]


def path_lengths(facts: PolicyInput, partial_waits: bool = True) -> tuple[list[float], bool]:
    """``critical_path_lengths``, and whether each task's length is above every length it was
    computed from (False on graphs with partial waits, whose edges this does not track).

    True says more than it seems: each task waiting for all of an event's signals then has a
    shorter path than every signaler, so longest-path-first takes the tasks in an order the
    counters allow, and ``list_order`` by it would take them in plain rank order
    (policies.longest_path_order skips that simulation)."""
    partial = facts.partial if partial_waits else {}
    if not partial:
        length, descending, _ = _full_wait_pass(facts, None)
        return length, descending
    costs, pos, full = facts.costs, facts.pos, facts.full
    tasks = facts.graph.tasks
    length = list(costs)
    after: dict[int, float] = {}  # event -> the longest path from its full waiters
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
    return length, False


def _full_wait_pass(
    facts: PolicyInput, own: list[int] | None
) -> tuple[list[float], bool, list[int] | None]:
    """``path_lengths`` on a graph whose waits are all full ones, and with ``own`` also
    ``_earliest_downstream``'s values, in the same walk: critical_path on a multi-node graph
    reads both, and the walk over every task's signals is most of each pass's time."""
    costs, full = facts.costs, facts.full
    tasks = facts.graph.tasks
    length = list(costs)
    descending = True
    # event -> the longest path from its full waiters (None: not folded yet)
    known: list[float | None] = [None] * len(full)
    # an event with one full waiter (~60% of them at 2x8) takes its value without max()
    if own is None:
        for tid in reversed(facts.order):
            best = 0.0
            for e in tasks[tid].signals:
                v = known[e]
                if v is None:
                    waiters = full[e]
                    v = known[e] = (
                        length[waiters[0]] if len(waiters) == 1
                        else max(map(length.__getitem__, waiters), default=0.0)
                    )  # fmt: skip
                if v > best:
                    best = v
            x = length[tid] = costs[tid] + best
            if x <= best:  # a zero cost, or one lost to rounding: no strict descent
                descending = False
        return length, descending, None
    need = [_NEVER] * len(tasks)
    first: list[int] = [_NEVER] * len(full)  # event -> the smallest ``need`` of its full waiters
    for tid in reversed(facts.order):
        best = 0.0
        low = own[tid]
        for e in tasks[tid].signals:
            v = known[e]
            if v is None:
                waiters = full[e]
                if len(waiters) == 1:
                    v = known[e] = length[waiters[0]]
                    f = first[e] = need[waiters[0]]
                else:
                    v = known[e] = max(map(length.__getitem__, waiters), default=0.0)
                    f = first[e] = min(map(need.__getitem__, waiters), default=_NEVER)
            else:
                f = first[e]
            if v > best:
                best = v
            if f < low:
                low = f
        x = length[tid] = costs[tid] + best
        if x <= best:
            descending = False
        need[tid] = low
    return length, descending, need


def network_levels(graph: TaskGraph, facts: PolicyInput) -> list[int]:
    """For each task, the number of rdma tasks on the longest chain ending at it (itself
    included): 0 for what needs no network data, 1 for a first-wave send and for what waits on
    one (a rail reduce-scatter's sums), and so on."""
    return _levels(graph, facts)[0]


def _levels(graph: TaskGraph, facts: PolicyInput) -> tuple[list[int], list[int]]:
    """``network_levels``, and the rdma tasks' ids (in ``facts.order``), which the pass meets
    anyway: ``network_slots`` needs only those, not another pass over every task."""
    rdma = Role.RDMA.value
    sends: list[int] = []
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
                sends.append(tid)
            level[tid] = lv
            for e in t.signals:
                if reached[e] < lv:
                    reached[e] = lv
        return level, sends
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
            sends.append(tid)
        level[tid] = lv
        for e in t.signals:
            if reached[e] < lv:
                reached[e] = lv
    return level, sends


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
    if level is None:
        level, sends = _levels(graph, facts)
    else:
        rdma = Role.RDMA.value
        sends = [t.id for t in graph.tasks if t.role == rdma]
    return _earliest_downstream(graph, facts, _send_slots(graph, level, sends, lag))


def staged_keys(
    graph: TaskGraph, facts: PolicyInput
) -> tuple[list[float], bool, list[int], list[int]]:
    """``path_lengths``, then ``staged_order``'s two leading keys: the stage (minus
    ``network_levels``, 0 for rdma tasks, which go by slot alone) and ``network_slots`` with
    lag 1. What critical_path reads on a multi-node graph, in one pass forward and one back
    where every wait is a full one."""
    level, sends = _levels(graph, facts)
    own = _send_slots(graph, level, sends, 1)
    stage = [-x for x in level]
    for tid in sends:
        stage[tid] = 0
    if facts.partial:
        length, descending = path_lengths(facts)
        return length, descending, stage, _earliest_downstream(graph, facts, own)
    length, descending, slot = _full_wait_pass(facts, own)
    assert slot is not None
    return length, descending, stage, slot


def _send_slots(graph: TaskGraph, level: list[int], sends: list[int], lag: int | None) -> list[int]:
    """Each rdma task's slot in its rank's network order (``network_slots``), _NEVER for
    every other task; ``sends``: the rdma tasks' ids."""
    tasks = graph.tasks
    # an rdma task's wave is its own level: every rdma task that depends on it is a level up
    by_rank: dict[int, list[tuple[int, int]]] = {}
    for tid in sends:
        by_rank.setdefault(tasks[tid].rank, []).append((level[tid], tid))
    own = [_NEVER] * len(tasks)
    for queue in by_rank.values():
        queue.sort()  # by (wave, id): ``sends`` may list them in any order
        if lag is not None:
            index: dict[int, int] = {}  # wave -> its sends so far, in id order
            keyed = []
            for w, tid in queue:
                j = index.get(w, 0)
                index[w] = j + 1
                keyed.append((j + lag * (w - 1), w, tid))
            keyed.sort()
            queue = [(w, tid) for _, w, tid in keyed]
        for slot, (_, tid) in enumerate(queue):
            own[tid] = slot
    return own


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
        rank = t.rank
        writes = t.writes
        if len(writes) == 1:  # nearly every task: its one region's holder is the peer or not
            peer = holder[writes[0][0]]
            if peer == rank or peer // per_node != rank // per_node:
                continue
        else:
            peer = _single_peer(writes, rank, holder, per_node)
            if peer < 0:
                continue
        turn = (peer - rank - 1) % per_node
        if t.role == nvlink:
            k = seen.get((rank, peer), 0)
            seen[rank, peer] = k + 1
            turn += k * per_node
        out[t.id] = turn
    return out


def _single_peer(writes: list[Any], rank: int, holder: dict[str, int], per_node: int) -> int:
    """The one node peer ``writes`` go to from ``rank``: -1 for none, -2 for several."""
    peer = -1
    node = rank // per_node
    for w in writes:
        h = holder[w[0]]
        if h == rank or h == peer or h // per_node != node:
            continue
        if peer >= 0:  # a second peer: no single target
            return -2
        peer = h
    return peer
