"""TaskGraph validation: structure, transfers, progress (cycles, unsatisfiable waits) and races.

Ordering ("happens-before") is what the synchronisation protocol guarantees: task B is ordered
after task A when B waits on an event with a count equal to ALL its signals and A is one of the
signalers, and transitively so. A wait for fewer than all signals orders B after none of them in
particular, so it orders nothing here (conservative: a race it hides would be a real race).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from itertools import chain
from typing import TYPE_CHECKING

from .errors import CycleError, GraphError, TransferError, UnsatisfiableWaitError
from .graph import Region, Task, TaskGraph, gc_paused
from .kinds import KINDS, Role, TaskKind
from .races import Reachability, check_races, order_edges, region_table

if TYPE_CHECKING:
    import torch

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
        check_races(graph, order, seen)
    return order


# -- structure ---------------------------------------------------------------------------------
def _where(t: Task) -> str:
    return f"task {t.name!r} (id {t.id}, rank {t.rank})"


class _Seen:
    """What ``_check_structure``'s pass collects for the later checks: the accumulating tasks
    (``adds``), each event's waiters by count and each task's number of waits (``_simulate``'s
    tables), each event's signalers, every region's accesses (``check_races``' groups), the
    groups' regions' fields and the int64 table made of them (``races.region_table``)."""

    __slots__ = ("adds", "waiters", "missing", "signalers", "groups", "fields", "table")

    def __init__(self, ntasks: int, nevents: int) -> None:
        self.adds: set[int] = set()
        self.waiters: dict[int, dict[int, list[int]]] = defaultdict(dict)
        self.missing = [0] * ntasks
        self.signalers: list[list[int]] = [[] for _ in range(nevents)]
        self.groups: dict[Region, int | list[int]] = {}
        self.fields: list[str | int] = []
        self.table: torch.Tensor | Exception | None = None


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
    # region -> its accesses (``check_races``' groups): an access is the int 2 * task +
    # is_write; a region accessed once (~80k of ~110k at 2x8) keeps that int, not a list
    groups = seen.groups
    # one hash of the region per access: setdefault inserts the access of a new region and
    # returns it (the same int object), or returns the region's accesses so far
    setdefault = groups.setdefault
    ngroups = 0
    # every group's region's five fields, in group order, for region_table: put in while the
    # region is at hand (walking the groups' regions again afterwards took ~15 ms at 2x8)
    fields = seen.fields.extend
    # the task before's waits, and what their checks found (see their uses)
    last_waits: list[tuple[int, int]] | None = None
    last_wait_node, last_lists = -1, []
    last_kind = last_role = None  # the task before's, checked (kind names are shared strings)
    upto = 0  # tasks[:upto]: those whose regions any failure checks first (see its use)
    try:
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
            # The task's accesses into the race check's groups (its writes, then the reads it
            # does not also write), the one hash a region costs. Bounds are checked after the
            # pass, every distinct region's at once (``races.region_table``); a failure before
            # that checks the regions of the tasks up to ``upto`` first, this one's included
            # from here on, so the first bad region in task order is still the error raised.
            upto = i + 1
            code = 2 * i
            wcode = code + 1
            for w in writes:
                acc = setdefault(w, wcode)
                if acc is wcode:  # a new group, or this task's own write again
                    if len(groups) > ngroups:
                        ngroups += 1
                        fields(w)
                elif acc.__class__ is int:
                    groups[w] = [acc, wcode]
                else:
                    acc.append(wcode)
                if node_of_buffer[w[0]] != node:  # (a KeyError: an unknown buffer)
                    near = False
            for r in reads:
                acc = setdefault(r, code)
                if acc is code:  # a new group, or this task's own read again
                    if len(groups) > ngroups:
                        ngroups += 1
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
    except Exception:
        # any error, also a TypeError or KeyError from a malformed region: a bad region of an
        # earlier task (or of this one, once its accesses are reached) was the error before
        _first_region_error(graph, graph.tasks[:upto], dims)
        raise
    table, inside = region_table(seen.fields, ngroups, dims)
    if not inside:
        _first_region_error(graph, graph.tasks, dims)
    seen.table = table
    if transfer is not None:
        raise transfer
    return seen


def _first_region_error(graph: TaskGraph, tasks: Iterable[Task], dims: dict) -> None:
    """Raise the error of the first bad region of ``tasks``, in task order, if there is one."""
    for t in tasks:
        _region_error(graph, t, dims)


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
