"""TaskGraph validation: structure, transfers, progress (cycles, unsatisfiable waits) and races.

Ordering ("happens-before") is what the synchronisation protocol guarantees: task B is ordered
after task A when B waits on an event with a count equal to ALL its signals and A is one of the
signalers, and transitively so. A wait for fewer than all signals orders B after none of them in
particular, so it orders nothing here (conservative: a race it hides would be a real race).
"""

from __future__ import annotations

import struct
from array import array
from collections import defaultdict
from collections.abc import Iterable
from itertools import chain

import torch

from .errors import CycleError, GraphError, RaceError, TransferError, UnsatisfiableWaitError
from .graph import Region, Task, TaskGraph, gc_paused
from .kinds import KINDS, Role, TaskKind

__all__ = ["validate", "topo_order", "CounterOrder", "order_edges", "Reachability"]


def validate(graph: TaskGraph) -> list[int]:
    """Raise a GraphError subclass naming the offending tasks; return the counter order of the
    tasks (``topo_order``), which mg.compile hands on to scheduling instead of computing it
    again. TaskGraph.validate() calls this."""
    # The checks allocate ~10^5 small sets and tuples next to a graph of ~10^6 live objects
    # (mgraph.graph.gc_paused says why the collector stays off).
    with gc_paused():
        # and the transfers, in the same pass over the tasks, which also collects what the
        # counter simulation and the race check start from (each pass over every task and
        # region of a 2x8 layer costs ~20-30 ms of its own)
        seen = _check_structure(graph)
        order = _simulate(graph, seen.waiters, seen.missing)
        _check_races(graph, order, seen)
    return order


# -- structure ---------------------------------------------------------------------------------
def _where(t: Task) -> str:
    return f"task {t.name!r} (id {t.id}, rank {t.rank})"


class _Seen:
    """What ``_check_structure``'s pass collects for the later checks: the accumulating tasks
    (``adds``), each event's waiters by count and each task's number of waits (``_simulate``'s
    tables), each event's signalers, every region's accesses (``_check_races``' groups) and the
    groups' regions' fields (``_overlaps``')."""

    __slots__ = ("adds", "waiters", "missing", "signalers", "groups", "fields")

    def __init__(self, ntasks: int, nevents: int) -> None:
        self.adds: set[int] = set()
        self.waiters: dict[int, dict[int, list[int]]] = defaultdict(dict)
        self.missing = [0] * ntasks
        self.signalers: list[list[int]] = [[] for _ in range(nevents)]
        self.groups: dict[Region, int | list[int]] = {}
        self.fields: list[str | int] = []


def _check_structure(graph: TaskGraph) -> _Seen:
    """Raise on the first structure error, then on the first transfer error; return what the
    pass collected for the later checks (``_Seen``)."""
    # Hot at 10^5 tasks: per-rank and per-kind facts are looked up in tables built once, and a
    # task's description is formatted only when it is wrong.
    world = graph.topology.world_size
    node_of = [graph.topology.node_of(r) for r in range(world)]
    events = graph.events
    nevents = len(events)
    for i, ev in enumerate(events):
        if ev.id != i or not 0 <= ev.rank < world:
            raise GraphError(f"event {ev.name!r} has id {ev.id} / rank {ev.rank}; expected id {i}")
    event_node = [node_of[ev.rank] for ev in events]
    buffers = graph.buffers
    for buf in buffers.values():
        if not 0 <= buf.rank < world or buf.rows <= 0 or buf.cols <= 0:
            raise GraphError(f"buffer {buf.id} has rank {buf.rank} / shape {buf.shape}")
    # buffer id -> (rows, cols), and -> node
    dims = {bid: (buf.rows, buf.cols) for bid, buf in buffers.items()}
    node_of_buffer = {bid: node_of[buf.rank] for bid, buf in buffers.items()}
    roles_of = {name: {r.value for r in spec.roles} for name, spec in KINDS.items()}
    same_shape = (TaskKind.COPY.value, TaskKind.REDUCE.value)
    reduce = TaskKind.REDUCE.value
    dtype_of = {bid: buf.dtype for bid, buf in buffers.items()}
    rdma = Role.RDMA.value
    # The transfer checks (``_transfer_error``) run in this pass too, on each task once its
    # structure is checked. The first transfer error is raised after the pass, so a structure
    # error anywhere still comes first, as when these were two passes.
    transfer: TransferError | None = None
    seen = _Seen(len(graph.tasks), nevents)
    adds = seen.adds
    waiters, missing, signalers = seen.waiters, seen.missing, seen.signalers
    # region -> its accesses (``_check_races``' groups): an access is the int 2 * task +
    # is_write; a region accessed once (~80k of ~110k at 2x8) keeps that int, not a list
    groups = seen.groups
    # one hash of the region per access: setdefault inserts the access of a new region and
    # returns it (the same int object), or returns the region's accesses so far
    setdefault = groups.setdefault
    ngroups = 0
    # every group's region's five fields, in group order, for _overlaps: put in while the
    # region is at hand (walking the groups' regions again afterwards took ~15 ms at 2x8)
    fields = seen.fields.extend
    # the task before's waits, and what their checks found (see their uses)
    last_waits: list[tuple[int, int]] | None = None
    last_wait_node, last_lists = -1, []
    last_kind = last_role = None  # the task before's, checked (kind names are shared strings)
    for i, t in enumerate(graph.tasks):
        if t.id != i:
            raise GraphError(f"{_where(t)}: id should be its position {i}")
        if not 0 <= t.rank < world:
            raise GraphError(f"{_where(t)}: rank outside topology {graph.topology}")
        if t.kind is not last_kind or t.role is not last_role:
            roles = roles_of.get(t.kind)
            if roles is None:
                raise GraphError(f"{_where(t)}: unknown kind {t.kind!r}",
                                 hint="define it with define_kind")
            if t.role not in roles:
                raise GraphError(
                    f"{_where(t)}: kind {t.kind!r} cannot run in role {t.role!r}",
                    hint=f"allowed roles: {', '.join(sorted(roles))}",
                )
            last_kind, last_role = t.kind, t.role
        rank = t.rank
        node = node_of[rank]
        reads, writes = t.reads, t.writes
        near = True  # every region on the task's node
        # The task's accesses into the race check's groups (its writes, then the reads it does
        # not also write). A region's bounds are checked when its group is made: one check per
        # distinct region (~50k of ~115k accesses at 2x8), and the one hash the group costs
        # anyway; a region already grouped passed them. A bad one is named by _region_error,
        # in the order reads, then writes, as when every access was checked.
        code = 2 * i
        wcode = code + 1
        try:
            for w in writes:
                acc = setdefault(w, wcode)
                if acc is wcode:  # a new group, or this task's own write again
                    if len(groups) > ngroups:
                        ngroups += 1
                        bid, r0, r1, c0, c1 = w
                        dim = dims.get(bid)
                        if dim is None or not (0 <= r0 < r1 <= dim[0] and 0 <= c0 < c1 <= dim[1]):
                            _region_error(graph, t, dims)
                        fields(w)
                elif acc.__class__ is int:
                    groups[w] = [acc, wcode]
                else:
                    acc.append(wcode)
                if node_of_buffer[w[0]] != node:
                    near = False
            for r in reads:
                acc = setdefault(r, code)
                if acc is code:  # a new group, or this task's own read again
                    if len(groups) > ngroups:
                        ngroups += 1
                        bid, r0, r1, c0, c1 = r
                        dim = dims.get(bid)
                        if dim is None or not (0 <= r0 < r1 <= dim[0] and 0 <= c0 < c1 <= dim[1]):
                            _region_error(graph, t, dims)
                        fields(r)
                elif acc.__class__ is int:
                    # a region this task writes holds its write last (it went in just now):
                    # ``r not in writes`` without comparing regions
                    if acc != wcode:
                        groups[r] = [acc, code]
                elif acc[-1] != wcode:
                    acc.append(code)
                if node_of_buffer[r[0]] != node:
                    near = False
        except (TypeError, ValueError):
            # a region that is no 5-tuple of ints: the error the checks meet first in
            # their own order (reads, then writes)
            _region_error(graph, t, dims)
            raise
        params = t.params
        if "accumulate" in params and params["accumulate"]:  # no call for the tasks without
            adds.add(i)
            plain = [w for w in t.writes if not buffers[w.buffer].zeroed]
            if plain:
                raise GraphError(
                    f"{_where(t)} accumulates into {plain[0]}, whose buffer is not zeroed",
                    hint="create the buffer with zeroed=True (runtimes zero it every launch)",
                )
        waits = t.waits
        missing[i] = len(waits)
        if waits == last_waits and node == last_wait_node:
            # the waits of the task before it (a rank's relayout tiles, and tiles reading one
            # band): checked already, and its waiter lists are known
            for waiting in last_lists:
                waiting.append(i)
        else:
            last_lists = []
            for e, count in waits:
                if not 0 <= e < nevents or count <= 0:
                    raise GraphError(f"{_where(t)}: bad wait (event {e}, count {count})")
                if event_node[e] != node:
                    ev = events[e]
                    raise GraphError(
                        f"{_where(t)} waits on event {ev.name!r} of rank {ev.rank}, on another "
                        "node",
                        hint="a task can only spin on counters of its own node",
                    )
                waiting = waiters[e].setdefault(count, [])
                waiting.append(i)
                last_lists.append(waiting)
            last_waits, last_wait_node = waits, node
        far_signal = False
        for e in t.signals:
            if not 0 <= e < nevents:
                raise GraphError(f"{_where(t)}: signals unknown event {e}")
            if event_node[e] != node:
                far_signal = True
            signalers[e].append(i)
        if transfer is None:
            if t.kind in same_shape:
                # _same_shapes_error's test inline (~9k copies and reduces at 2x8, most of
                # them node-local, which need nothing else); the error itself is built by it
                ref = t.writes[0] if t.kind == reduce else t.reads[0]
                rows, cols = ref[2] - ref[1], ref[4] - ref[3]
                dtype = dtype_of[t.reads[0][0]]
                for regions in (t.reads, t.writes):
                    for r in regions:
                        if r[2] - r[1] != rows or r[4] - r[3] != cols or dtype_of[r[0]] != dtype:
                            transfer = _same_shapes_error(graph, t)
                if transfer is None and (not near or far_signal or t.role == rdma):
                    transfer = _transfer_error(graph, t, node_of, near and not far_signal)
            elif not near or far_signal or t.role == rdma:
                transfer = _transfer_error(graph, t, node_of, near and not far_signal)
    if transfer is not None:
        raise transfer
    return seen


def _region_error(graph: TaskGraph, t: Task, dims: dict) -> None:
    """Raise the error of task ``t``'s first bad region, reads before writes, if it has one."""
    for r in chain(t.reads, t.writes):
        bid, r0, r1, c0, c1 = r
        try:
            dim = dims[bid]
        except KeyError:
            raise GraphError(f"{_where(t)}: region {r} names an unknown buffer") from None
        if not (0 <= r0 < r1 <= dim[0] and 0 <= c0 < c1 <= dim[1]):
            buf = graph.buffers[bid]
            raise GraphError(f"{_where(t)}: region {r} is outside buffer {buf.id} {buf.shape}")


# -- transfers ---------------------------------------------------------------------------------
def _transfer_error(
    graph: TaskGraph, t: Task, node_of: list[int], local: bool
) -> TransferError | None:
    """The TransferError of task ``t`` (one whose structure is valid), or None. _check_structure
    asks only for tasks that may have one: an rdma task, a copy or reduce, or a task touching
    memory or events of another node. ``local``: every region and signalled event of ``t`` is
    on its own node."""
    if t.kind in (TaskKind.COPY.value, TaskKind.REDUCE.value):
        error = _same_shapes_error(graph, t)
        if error is not None:
            return error
    if local and t.role != Role.RDMA.value:
        return None  # a node-local copy or reduce (most of them): nothing else to check
    topo = graph.topology
    bufs = graph.buffers
    events = graph.events
    node = node_of[t.rank]
    if t.role != Role.RDMA.value:
        # A compute tile may read or write peers' memory over NVLink (its epilogue stores the
        # tile into a peer's buffer; a GEMM may load a peer's shard with TMA), never across
        # nodes: that is an rdma task's job.
        far = [r for r in (*t.reads, *t.writes) if node_of[bufs[r.buffer].rank] != node]
        if far:
            ranks = sorted({bufs[r.buffer].rank for r in far})
            if t.role == Role.COMPUTE.value:
                return TransferError(
                    f"{_transfer_where(t)} touches memory of rank(s) {ranks} on another node",
                    hint="compute tasks reach node peers only; cross nodes with an rdma task",
                )
            return TransferError(
                f"{_transfer_where(t)} reaches rank(s) {ranks} on another node over NVLink",
                hint="cross-node traffic goes through an rdma task to the rail peer",
            )
        for e in t.signals:
            if node_of[events[e].rank] != node:
                ev = events[e]
                return TransferError(
                    f"{_transfer_where(t)} signals event {ev.name!r} on rank {ev.rank}, "
                    "another node",
                    hint="only rdma tasks raise events across nodes",
                )
        return None
    where = _transfer_where(t)
    read_ranks = {bufs[r.buffer].rank for r in t.reads}
    write_ranks = {bufs[w.buffer].rank for w in t.writes}
    event_ranks = {events[e].rank for e in t.signals}
    if read_ranks != {t.rank}:
        return TransferError(
            f"{where} reads rank(s) {sorted(read_ranks)}: an RDMA write sends local data",
            hint="run the rdma task on the rank that holds the source region",
        )
    if len(write_ranks) != 1:
        return TransferError(f"{where} writes to ranks {sorted(write_ranks)}; need one")
    (dst,) = write_ranks
    if topo.link(t.rank, dst) != "rdma":
        return TransferError(
            f"{where} writes rank {dst} on the same node",
            hint="use an nvlink task inside a node",
        )
    if topo.local_of(dst) != topo.local_of(t.rank):
        return TransferError(
            f"{where} writes rank {dst}, which is not a rail peer of rank {t.rank}",
            hint=f"send to rank {topo.rail_peer(t.rank, topo.node_of(dst))}, "
            "then forward over NVLink",
        )
    if event_ranks - {t.rank, dst}:
        return TransferError(
            f"{where} signals events on ranks {sorted(event_ranks - {t.rank, dst})}",
            hint="an RDMA write raises events on its source or its destination only",
        )
    return None


def _transfer_where(t: Task) -> str:
    return f"task {t.name!r} (rank {t.rank}, role {t.role})"


def _same_shapes_error(graph: TaskGraph, t: Task) -> TransferError | None:
    ref = t.writes[0] if t.kind == TaskKind.REDUCE.value else t.reads[0]
    bufs = graph.buffers
    ref_dtype = bufs[t.reads[0][0]].dtype
    rows, cols = ref[2] - ref[1], ref[4] - ref[3]  # regions are (buffer, row0, row1, col0, col1)
    for regions in (t.reads, t.writes):
        for r in regions:
            if r[2] - r[1] != rows or r[4] - r[3] != cols:
                return TransferError(
                    f"{_transfer_where(t)}: region {r} has shape {r.shape}, the transfer moves "
                    f"{ref.shape}",
                    hint="both ends of a copy/reduce must be the same tile shape",
                )
            dtype = bufs[r[0]].dtype
            if dtype != ref_dtype:
                return TransferError(
                    f"{_transfer_where(t)}: region {r} is {dtype}, source is {ref_dtype}"
                )
    return None


# -- progress ----------------------------------------------------------------------------------
class CounterOrder(list):
    """``topo_order``'s result: the task ids in order, and what its simulation built, which
    scheduling (``policy_input``) reads instead of building it again: ``released`` (event ->
    count -> the tasks waiting for the event to reach that count, in id order), ``waits`` (per
    task its number of waits) and ``total`` (per event its number of signals)."""

    __slots__ = ("released", "waits", "total")

    released: dict[int, dict[int, list[int]]]
    waits: list[int]
    total: list[int]


def topo_order(graph: TaskGraph) -> CounterOrder:
    """Task ids in an order the counters allow (by simulation); raise if some can never run."""
    tasks = graph.tasks
    # event -> count -> waiters: a signal looks up the waiters its new count releases instead of
    # scanning every waiter (a join event of a traced layer has ~100 signals and many waiters)
    waiters: dict[int, dict[int, list[int]]] = defaultdict(dict)
    missing = [0] * len(tasks)
    for t in tasks:
        missing[t.id] = len(t.waits)
        for e, c in t.waits:
            waiters[e].setdefault(c, []).append(t.id)
    return _simulate(graph, waiters, missing)


def _simulate(
    graph: TaskGraph, waiters: dict[int, dict[int, list[int]]], missing: list[int]
) -> CounterOrder:
    """``topo_order`` from its tables (``waiters``: event -> count -> waiting task ids, in id
    order; ``missing``: each task's number of waits), which it consumes."""
    tasks = graph.tasks
    waits = missing.copy()
    count = [0] * len(graph.events)
    # the order is the queue too: a for loop over a list reaches the tasks appended meanwhile,
    # in the order a deque would hand them out
    order = [tid for tid, n in enumerate(waits) if not n]  # no pass over the tasks
    released = waiters.get
    for tid in order:
        for e in tasks[tid].signals:
            c = count[e] = count[e] + 1
            by_count = released(e)
            if by_count is None:
                continue
            for w in by_count.get(c, ()):
                n = missing[w] = missing[w] - 1
                if not n:
                    order.append(w)
    if len(order) < len(tasks):
        _explain_stuck(graph, set(range(len(tasks))) - set(order))
    out = CounterOrder(order)
    out.released = dict(waiters)
    out.waits = waits
    out.total = count  # every task ran, so every signal was counted
    return out


def _explain_stuck(graph: TaskGraph, stuck: set[int]) -> None:
    total = [0] * len(graph.events)
    for t in graph.tasks:
        for e in t.signals:
            total[e] += 1
    signalers = graph.signalers()
    for tid in sorted(stuck):
        t = graph.tasks[tid]
        for e, c in t.waits:
            if total[e] < c:
                ev = graph.events[e]
                names = [graph.tasks[s].name for s in signalers[e]][:8]
                raise UnsatisfiableWaitError(
                    f"task {t.name!r} (rank {t.rank}) waits for event {ev.name!r} (rank "
                    f"{ev.rank}) to reach {c}, but only {total[e]} task(s) signal it: {names}",
                    hint="lower the wait count or add the missing signal",
                )
    # Every wait is satisfiable by count, so the stuck tasks wait on each other.
    import networkx as nx

    g = nx.DiGraph()
    for tid in stuck:
        for e, _ in graph.tasks[tid].waits:
            for s in signalers[e]:
                if s in stuck:
                    g.add_edge(s, tid)
    cycle = nx.find_cycle(g)
    names = " -> ".join(repr(graph.tasks[a].name) for a, _ in cycle)
    names += f" -> {graph.tasks[cycle[0][0]].name!r}"
    raise CycleError(
        f"tasks wait on each other in a cycle: {names}",
        hint="one of these tasks must not wait for a later one; check the events they signal",
    )


# -- races -------------------------------------------------------------------------------------
def order_edges(graph: TaskGraph) -> list[list[int]]:
    """succ[a] = tasks ordered directly after a (they wait on ALL signals of an event a raises)."""
    total = [0] * len(graph.events)
    for t in graph.tasks:
        for e in t.signals:
            total[e] += 1
    signalers = graph.signalers()
    succ: list[list[int]] = [[] for _ in graph.tasks]
    for t in graph.tasks:
        for e, c in t.waits:
            if c >= total[e]:
                for s in set(signalers[e]):
                    succ[s].append(t.id)
    return succ


class Reachability:
    """Answers "is b ordered after a".

    ``preds(b)``: the tasks b is ordered directly after, the signalers of the events it waits
    for with their full count (one shared set per event: the readiness waits of a traced layer
    are ~10^7 edges, too many to store per task). ``before`` tries that set, then searches
    backwards from b, pruned with topological positions."""

    def __init__(
        self, graph: TaskGraph, order: list[int], signalers: list[list[int]] | None = None
    ) -> None:
        tasks = self.tasks = graph.tasks
        pos = self.pos = [0] * len(tasks)
        for i, tid in enumerate(order):
            pos[tid] = i
        if signalers is None:  # else each event's signaling task ids, in id order
            signalers = [[] for _ in graph.events]
            for t in tasks:
                tid = t.id
                for e in t.signals:
                    signalers[e].append(tid)
        total = self.total = [len(s) for s in signalers]  # signals per event
        self.signalers = signalers
        # Every task's direct predecessors, made in one pass (the race check asks for nearly
        # every task's, ~80k at 2x8): one shared set per event, and a task with one full
        # wait (almost all of them) takes its event's set as it is.
        event_set = [frozenset(s) for s in signalers]
        empty: frozenset[int] = frozenset()
        preds: list[frozenset[int]] = []
        add = preds.append
        for t in tasks:
            waits = t.waits
            if len(waits) == 1:
                e, c = waits[0]
                add(event_set[e] if c >= total[e] else empty)
            else:
                sets = [event_set[e] for e, c in waits if c >= total[e]]
                add(sets[0] if len(sets) == 1 else empty.union(*sets))
        self.preds_of = preds
        self.cache: dict[tuple[int, int], bool] = {}

    def preds(self, b: int) -> frozenset[int]:
        return self.preds_of[b]

    def before(self, a: int, b: int) -> bool:
        if a == b:
            return True
        pos = self.pos
        floor = pos[a]
        if floor > pos[b]:
            return False
        preds = self.preds_of
        if a in preds[b]:
            return True
        key = (a, b)
        hit = self.cache.get(key)
        if hit is not None:
            return hit
        seen = {b}
        stack = [b]
        found = False
        while stack and not found:
            for p in preds[stack.pop()]:
                if p == a:
                    found = True
                    break
                if p not in seen and pos[p] > floor:
                    seen.add(p)
                    stack.append(p)
        self.cache[key] = found
        return found

    def ordered(self, a: int, b: int) -> bool:
        return self.before(a, b) or self.before(b, a)


def _check_races(graph: TaskGraph, order: list[int], seen: _Seen) -> None:
    """Every two accesses of overlapping regions, one of them a write, are ordered.

    Accesses of one exact region form a group. Inside a group, sorted in topological order, it
    is enough that every access is ordered after the group's last write before it, and every
    write after the reads since that write: the other pairs follow by transitivity (an earlier
    write is ordered before the last one, an earlier read before the write that followed it).
    So a region that many tiles read and rewrite (a chain of attention blocks accumulating into
    one state tile) costs a pass, not a pass per pair.

    Across groups, each access is checked against the writers of every other group overlapping
    its region at once: those writers, less the tasks it directly waits for (one set difference),
    are usually none; the rest are checked one by one. A GEMM tile reading a row of ~100
    elementwise tiles is one set operation, not 100 searches. The overlapping pairs of groups
    are found by one sort of all regions (``_overlapping_pairs``), not a sweep per buffer.

    The groups, and the signalers and accumulating tasks, are what _check_structure's pass
    collected (``seen``). Writes that accumulate (atomic adds into a zeroed buffer) commute
    with each other: two of them on one region are no race; against a plain write or a read
    they still are.
    """
    reach = Reachability(graph, order, seen.signalers)
    _check_groups(graph, seen, reach)


def _check_groups(graph: TaskGraph, seen: _Seen, reach: Reachability) -> None:
    """_check_races on the regions' accesses (``_Seen.groups``)."""
    groups, adds = seen.groups, seen.adds
    regions = list(groups)
    codes_of = list(groups.values())
    written = bytearray(len(regions))  # group i has a writer
    pos = reach.pos
    before = reach.before
    preds = reach.preds_of
    for i, codes in enumerate(codes_of):
        if codes.__class__ is int:
            written[i] = codes & 1  # one access: nothing to order inside the group
            continue
        if len(codes) == 2:
            # The common multi-access group (~20k at 2x8: a tile written once and read once
            # by another task), _check_group's two-access case without building its list.
            a, b = codes
            if a & 1 or b & 1:
                written[i] = 1
                ta, tb = a >> 1, b >> 1
                if not ((a & 1 and ta in adds) or (b & 1 and tb in adds)):
                    if ta != tb:
                        x, y = (a, b) if pos[ta] <= pos[tb] else (b, a)
                        # before()'s direct-predecessor test first, without the call (the
                        # reader of a tile almost always waits on its writer's event)
                        if x >> 1 not in preds[y >> 1] and not before(x >> 1, y >> 1):
                            r = regions[i]
                            _race(graph, x >> 1, r, x & 1 == 1, y >> 1, r, y & 1 == 1)
                    continue
            else:
                continue
        for c in codes:
            if c & 1:
                written[i] = 1
                accesses = [(c >> 1, c & 1 == 1) for c in codes]
                _check_group(graph, reach, regions[i], accesses, adds)
                break
    # i -> the writers of the other groups overlapping group i: the one group's writers list
    # itself (shared, never changed) while there is one such group (most of them), a set of
    # several groups' writers once there are more
    others: dict[int, list[int] | set[int]] = {}
    writers_of: dict[int, list[int]] = {}
    # Once per overlapping pair and direction (~10^5 at 2x8): the two directions written out
    # rather than looped over.
    for i, j in _overlapping_pairs(seen.fields, written):
        if written[j]:
            ws = writers_of.get(j)
            if ws is None:
                codes = codes_of[j]
                ws = writers_of[j] = (
                    [codes >> 1] if codes.__class__ is int else [c >> 1 for c in codes if c & 1]
                )
            over = others.get(i)
            if over is None:
                others[i] = ws
            elif over.__class__ is list:
                over = others[i] = set(over)
                over.update(ws)
            else:
                over.update(ws)
        if written[i]:
            ws = writers_of.get(i)
            if ws is None:
                codes = codes_of[i]
                ws = writers_of[i] = (
                    [codes >> 1] if codes.__class__ is int else [c >> 1 for c in codes if c & 1]
                )
            over = others.get(j)
            if over is None:
                others[j] = ws
            elif over.__class__ is list:
                over = others[j] = set(over)
                over.update(ws)
            else:
                over.update(ws)
    preds = reach.preds_of
    for i in sorted(others):
        over = others[i]
        region = regions[i]
        codes = codes_of[i]
        # Tasks reading one region usually wait on one event whose signalers are all the
        # writers it overlaps (a gather reading a whole 512-tile activation from 1024 tiles):
        # one subset test per distinct predecessor set, not per access (15M -> 0.2M
        # membership tests at 2x8).
        covered = None  # a predecessor set known to hold every writer in ``over``
        for c in (codes,) if codes.__class__ is int else codes:
            tid, is_write = c >> 1, c & 1 == 1
            direct = preds[tid]
            if direct is covered:
                continue
            if direct.issuperset(over):  # no set made for the answer of nearly every access
                covered = direct
                continue
            left = set(over).difference(direct)
            left.discard(tid)
            for w in left:
                if is_write and tid in adds and w in adds:
                    continue
                if not reach.ordered(w, tid):
                    theirs = _region_of(graph, w, region)
                    if w < tid:  # named in task order
                        _race(graph, w, theirs, True, tid, region, is_write)
                    _race(graph, tid, region, is_write, w, theirs, True)


def _overlapping_pairs(fields: list[str | int], written: bytearray) -> Iterable[tuple[int, int]]:
    """Index pairs (i, j) of distinct groups whose regions overlap, one of them ``written``.

    All regions sorted by (buffer, row0): the regions whose rows can meet region i's are the
    ones after it up to the first starting at or past its row1 (a binary search), so the
    candidate pairs are those of a per-buffer row sweep, found by a few tensor ops rather than
    a Python loop over ~10^5 regions (torch, not numpy: numpy is no dependency of mgraph).
    ``fields``: the groups' regions' fields one after the other (``_Seen.fields``)."""
    n = len(written)
    if n < 2:
        return []
    # One intra-op thread: on ~10^5 elements a second one costs more than it brings, and on a
    # busy machine it waits for a core (the sort: 5 ms on one thread, 50-100 ms on two).
    threads = torch.get_num_threads()
    if threads != 1:
        torch.set_num_threads(1)
    try:
        return _overlaps(fields, written)
    finally:
        if threads != 1:
            torch.set_num_threads(threads)


def _overlaps(flat: list[str | int], written: bytearray) -> Iterable[tuple[int, int]]:
    n = len(written)
    # The fields become ONE int64 buffer viewed as five columns, the buffer ids replaced by
    # ints. struct.pack, not array("q", flat): array converts each int through PyArg_Parse
    # (~500 instructions an int, ~6% of validate at 2x8).
    buffer_ids = flat[0::5]
    index = {b: i for i, b in enumerate(dict.fromkeys(buffer_ids))}
    flat[0::5] = map(index.__getitem__, buffer_ids)  # (made for this call only)
    packed = bytearray(8 * len(flat))
    try:
        struct.pack_into(f"{len(flat)}q", packed, 0, *flat)
    except struct.error:
        array("q", flat)  # a field that is no int64: the error array gave here before
        raise
    buf, row0, row1, col0, col1 = torch.frombuffer(packed, dtype=torch.int64).view(-1, 5).unbind(1)
    wrote = torch.frombuffer(bytearray(written), dtype=torch.uint8).bool()
    key = (buf << 32) | row0
    by_key = torch.argsort(key, stable=True)
    # in sorted order, the first region of the same buffer starting at or after row1
    # (index_select, not t[idx]: ~4x faster on CPU, and ~2x10^5 candidates are gathered)
    end = torch.searchsorted(
        key.index_select(0, by_key), ((buf << 32) | row1).index_select(0, by_key), side="left"
    )
    counts = (end - torch.arange(1, n + 1)).clamp_(min=0)
    total = int(counts.sum())
    if total == 0:
        return []
    # expand each sorted position p into its candidates p+1 .. end[p]-1
    left = torch.repeat_interleave(torch.arange(n), counts)
    starts = torch.cumsum(counts, 0) - counts
    right = left + 1 + (torch.arange(total) - starts.index_select(0, left))
    i, j = by_key.index_select(0, left), by_key.index_select(0, right)
    keep = (
        (col0.index_select(0, i) < col1.index_select(0, j))
        & (col0.index_select(0, j) < col1.index_select(0, i))
        & (wrote.index_select(0, i) | wrote.index_select(0, j))
    )
    # pairs made as the caller walks them, not held as a list of ~10^5 tuples first
    return zip(i[keep].tolist(), j[keep].tolist(), strict=True)


def _region_of(graph: TaskGraph, tid: int, near: Region) -> Region:
    """The write of task ``tid`` that overlaps ``near`` (for the race message)."""
    return next(w for w in graph.tasks[tid].writes if w.overlaps(near))


def _check_group(graph: TaskGraph, reach: Reachability, region: Region,
                 accesses: list[tuple[int, bool]], adds: set[int]) -> None:
    """The accesses of one exact region (see _check_races), in topological order."""
    pos = reach.pos
    if len(accesses) == 2:
        # The common multi-access group (a tile written once and read once): the chain below
        # reduces to one check, that the first access (by position) is ordered before the second.
        (a, wa), (b, wb) = accesses
        if (wa and a in adds) or (wb and b in adds):
            pass  # fall through to the pairwise check
        else:
            if a != b and (wa or wb):
                x, wx, y, wy = (a, wa, b, wb) if pos[a] <= pos[b] else (b, wb, a, wa)
                if not reach.before(x, y):
                    _race(graph, x, region, wx, y, region, wy)
            return
    if any(tid in adds for tid, w in accesses if w):
        # Accumulating writers need not be ordered among themselves, which breaks the chain
        # argument: check these (few) groups pair by pair.
        for i, (a, wa) in enumerate(accesses):
            for b, wb in accesses[i + 1 :]:
                if a == b or not (wa or wb) or (wa and wb and a in adds and b in adds):
                    continue
                x, y = (a, b) if pos[a] < pos[b] else (b, a)
                if not reach.before(x, y):
                    _race(graph, a, region, wa, b, region, wb)
        return
    last_write = -1
    reads: list[int] = []
    for tid, is_write in sorted(accesses, key=lambda acc: pos[acc[0]]):
        if last_write >= 0 and last_write != tid and not reach.before(last_write, tid):
            _race(graph, last_write, region, True, tid, region, is_write)
        if is_write:
            for r in reads:
                if r != tid and not reach.before(r, tid):
                    _race(graph, r, region, False, tid, region, True)
            last_write, reads = tid, []
        else:
            reads.append(tid)


def _race(graph, a: int, ra: Region, wa: bool, b: int, rb: Region, wb: bool) -> None:
    ta, tb = graph.tasks[a], graph.tasks[b]
    what = "write/write" if wa and wb else "read/write"
    raise RaceError(
        f"{what} race: task {ta.name!r} ({'writes' if wa else 'reads'} {ra}) and task "
        f"{tb.name!r} ({'writes' if wb else 'reads'} {rb}) are not ordered",
        hint="make one wait (with the full count) on an event the other signals",
    )
