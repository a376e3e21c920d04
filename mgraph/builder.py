"""GraphBuilder: what an op's lowering uses to emit buffers, events and tile tasks.

The builder fills in what is derivable so lowerings cannot get it wrong: task ids, byte counts,
flop hints (from the kind's ``flops`` facet) and which buffers peers touch (``symmetric``).
It is hot: the 2x8 GEMM+AllReduce at 8192x8192x4096 emits ~45k tasks, so it stays plain.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from .errors import ShapeError, SizeLimitError
from .graph import ITEMSIZE, Binding, Buffer, Event, Region, Task, TaskGraph, TensorSpec
from .kinds import KINDS, Role
from .settings import Settings
from .topology import Topology

__all__ = ["GraphBuilder", "SizeBudget", "split", "pick_tile", "edge_tile", "shard_range", "piece", "require_divisible"]


def split(size: int, tile: int) -> list[tuple[int, int]]:
    """[0, size) cut into consecutive ranges of ``tile`` (the last one may be shorter)."""
    # whole tiles without a min() each (a relayout cuts ~1k tiles per rank), then the rest
    whole = size - size % tile
    out = [(s, s + tile) for s in range(0, whole, tile)]
    if 0 <= whole < size:
        out.append((whole, size))
    return out


def shard_range(size: int, index: int, parts: int) -> tuple[int, int]:
    """The ``index``-th of ``parts`` equal ranges of [0, size); size must divide evenly."""
    step = size // parts
    return (index * step, (index + 1) * step)


def piece(shape: Sequence[int], **ranges: tuple[int, int]) -> tuple[tuple[int, int], ...]:
    """A Binding piece: full ranges on every dim except the ones given as ``d<i>=(lo, hi)``."""
    out = [(0, n) for n in shape]
    for key, rng in ranges.items():
        out[int(key.removeprefix("d"))] = rng
    return tuple(out)


def require_divisible(op: str, dim: str, size: int, parts: int, why: str) -> None:
    """ShapeError unless ``size`` splits into ``parts`` equal shards; ``why`` says what is sharded
    (e.g. "a and b are sharded along K over all ranks")."""
    if size % parts:
        raise ShapeError(
            f"{op}: {dim}={size} is not divisible by the world size {parts}",
            hint=f"{why}: choose {dim} as a multiple of {parts}",
        )


def edge_tile(size: int, preferred: int) -> int:
    """The tile size for one dimension of a GEMM-based op: ``preferred``, or the whole dim when
    it is smaller. The dim need not be a multiple: the last tile is short (its region ends at the
    true bound) and every backend masks it, never pads (the GPU's TMA clips loads and stores)."""
    return min(size, preferred)


def pick_tile(op: str, dim: str, size: int, preferred: int, *, multiple_of: int = 1) -> int:
    """The tile size for one dimension of an op whose blocks must be whole (attention and ring
    attention blocks, MoE row tiles): ``preferred``, or the whole dim when it is smaller.

    A dim larger than the tile must be a multiple of it there. GEMM-based ops use ``edge_tile``.
    """
    if size <= preferred:
        return size
    if size % preferred:
        raise ShapeError(
            f"{op}: {dim}={size} is not a multiple of the tile size {preferred}",
            hint=f"choose {dim} as a multiple of {preferred}, or pass a tile size that divides it",
        )
    assert preferred % multiple_of == 0
    return preferred


_RDMA = Role.RDMA.value  # hot loops compare plain strings, not enum members


class SizeBudget:
    """The size guard of one graph being built: limits from Settings, bytes so far. Shared by
    every builder that adds to the same graph (mg.compile's per-op scopes)."""

    __slots__ = ("max_tasks", "max_bytes", "bytes")

    def __init__(self, limits: Settings) -> None:
        self.max_tasks = limits.max_tasks
        self.max_bytes = limits.max_bytes
        self.bytes = 0


class GraphBuilder:
    """Accumulates one TaskGraph; ``finish()`` hands it over."""

    def __init__(
        self,
        op: str,
        topology: Topology,
        dtype: str,
        params: dict[str, Any],
        *,
        limits: Settings | None = None,
    ) -> None:
        self.op = op
        # The size guard: checked per task and per buffer, so a graph too large to hold stops
        # within the limit instead of growing until the process is killed.
        self.budget = SizeBudget(limits if limits is not None else Settings.from_env())
        self.topo = topology
        self.world = topology.world_size
        self.dtype = dtype
        self.params = params
        self.inputs: dict[str, TensorSpec] = {}
        self.outputs: dict[str, TensorSpec] = {}
        self.buffers: dict[str, Buffer] = {}
        self.events: list[Event] = []
        self.tasks: list[Task] = []
        self._joins: dict[tuple[int, tuple[int, ...]], int] = {}
        # buffer id -> bytes per element, kept by ``buffer`` for ``task``'s byte counts
        self._itemsize: dict[str, int] = {}
        # prepended to every task name given to ``task`` (an op's node name when lowering a
        # traced program; see lower.py's _OpScope)
        self.label_prefix = ""

    # -- declarations -------------------------------------------------------------------------
    def global_input(self, name: str, shape: Sequence[int], dtype: str | None = None) -> None:
        self.inputs[name] = TensorSpec(tuple(shape), dtype or self.dtype)

    def global_output(self, name: str, shape: Sequence[int], dtype: str | None = None) -> None:
        self.outputs[name] = TensorSpec(tuple(shape), dtype or self.dtype)

    def buffer(
        self,
        name: str,
        rank: int,
        rows: int,
        cols: int,
        *,
        role: str = "scratch",
        dtype: str | None = None,
        binding: Binding | None = None,
        zeroed: bool = False,
    ) -> Buffer:
        buf = Buffer(name, rank, rows, cols, dtype or self.dtype, role, binding, zeroed=zeroed)
        assert buf.id not in self.buffers, f"buffer {buf.id} defined twice"
        budget = self.budget
        budget.bytes += rows * cols * ITEMSIZE[buf.dtype]
        if budget.bytes > budget.max_bytes:
            raise SizeLimitError(
                f"{self.op}: the buffers of all ranks would take more than "
                f"{budget.max_bytes / 2**30:.3g} GiB (at buffer {buf.id}, {rows}x{cols} {buf.dtype})",
                hint="use smaller sizes or fewer ranks, or raise the limit: MGRAPH_MAX_BYTES or "
                "Settings(max_bytes=...)",
            )
        self.buffers[buf.id] = buf
        self._itemsize[buf.id] = ITEMSIZE[buf.dtype]
        return buf

    def bound_buffer(
        self,
        name: str,
        rank: int,
        tensor: str,
        pieces: Sequence[tuple[tuple[int, int], ...]],
        *,
        cat_dim: int = 0,
        role: str = "input",
    ) -> Buffer:
        """A buffer holding pieces of a global input/output, its 2-D shape derived."""
        spec = (self.inputs if role == "input" else self.outputs)[tensor]
        cols = spec.shape[-1]
        numel = 0
        for p in pieces:
            n = 1
            for lo, hi in p:
                n *= hi - lo
            numel += n
        assert all(p[-1] == pieces[0][-1] for p in pieces), "pieces must share the last dim"
        cols = pieces[0][-1][1] - pieces[0][-1][0]
        binding = Binding(tensor, tuple(tuple(p) for p in pieces), cat_dim)
        return self.buffer(
            name, rank, numel // cols, cols, role=role, dtype=spec.dtype, binding=binding
        )

    def event(self, rank: int, name: str) -> int:
        ev = Event(len(self.events), rank, name)
        self.events.append(ev)
        return ev.id

    def after(self, rank: int, producers: Sequence[Task], name: str | None = None):
        """Waits that order a task on ``rank`` after all ``producers``.

        Creates (or reuses, for the same producer set) one event on ``rank`` that every producer
        signals, and returns ``[(event, len(producers))]`` for the consumer's ``waits``. Events
        live on the waiting rank, so consumers spin on local memory.
        """
        if not producers:
            return []
        # An RDMA arrival can only be raised on its source or destination rank: a consumer on
        # another GPU of the destination node waits on the destination's counter over NVLink.
        # Hot (once per distinct read set of a traced layer's tiles, ~80k at 2x8): the common
        # case, every producer's event on ``rank``, is one join without grouping.
        rdma = _RDMA
        for p in producers:
            if p.role == rdma and p.rank != rank:
                break
        else:
            return [self._join(rank, producers, name)]
        groups: dict[int, list[Task]] = {}
        for p in producers:
            where = rank
            if p.role == rdma and rank != p.rank:
                dst = self.buffers[p.writes[0].buffer].rank
                if rank != dst:
                    where = dst
            groups.setdefault(where, []).append(p)
        return [self._join(where, group, name) for where, group in groups.items()]

    def _join(self, where: int, group: Sequence[Task], name: str | None) -> tuple[int, int]:
        """(event, count): the event on rank ``where`` that exactly the tasks of ``group``
        signal, created on first use (for the same set of tasks, the same event)."""
        if len(group) == 1:
            key = (where, (group[0].id,))
        else:
            ids = [p.id for p in group]
            ids.sort()
            key = (where, tuple(ids))
        ev = self._joins.get(key)
        if ev is None:
            label = name or f"after:{group[0].name}" + ("+" if len(group) > 1 else "")
            events = self.events  # self.event inlined: once per join (~10k at 2x8)
            ev = len(events)
            events.append(Event(ev, where, label))
            self._joins[key] = ev
            for p in group:
                p.signals.append(ev)
        return (ev, len(group))

    # -- tasks --------------------------------------------------------------------------------
    def task(
        self,
        rank: int,
        role: Role,
        kind: str,
        reads: Sequence[Region],
        writes: Sequence[Region],
        *,
        waits: Iterable[tuple[int, int]] = (),
        signals: Iterable[int] = (),
        name: str | None = None,
        params: dict[str, Any] | None = None,
        flops: float | None = None,
    ) -> Task:
        # Hot: once per task (~140k for a traced 2x8 layer), so the byte count reads each
        # buffer's item size from a table kept by ``buffer`` instead of two lookups per region.
        # One pass over the regions counts their bytes and, when the kind's flops facet needs
        # them, takes their shapes.
        params = params or {}
        item = self._itemsize
        nbytes = 0
        flops_fn = KINDS[kind].flops_fn if flops is None else None
        if flops_fn is not None:
            read_shapes: list[tuple[int, int]] = []
            write_shapes: list[tuple[int, int]] = []
            for r in reads:  # regions are (buffer, row0, row1, col0, col1)
                rows, cols = r[2] - r[1], r[4] - r[3]
                read_shapes.append((rows, cols))
                nbytes += rows * cols * item[r[0]]
            for r in writes:
                rows, cols = r[2] - r[1], r[4] - r[3]
                write_shapes.append((rows, cols))
                nbytes += rows * cols * item[r[0]]
            flops = flops_fn(read_shapes, write_shapes, params)
        else:
            for r in reads:
                nbytes += (r[2] - r[1]) * (r[4] - r[3]) * item[r[0]]
            for r in writes:
                nbytes += (r[2] - r[1]) * (r[4] - r[3]) * item[r[0]]
            if flops is None:
                flops = 0.0
        tasks = self.tasks
        tid = len(tasks)
        if tid >= self.budget.max_tasks:
            raise self._too_many_tasks(kind, rank)
        if name is None:
            name = f"{kind}#{tid}"
        elif self.label_prefix:
            name = self.label_prefix + name
        task = Task(
            tid,
            name,
            rank,
            role._value_ if role.__class__ is Role else role,  # not .value: a Python property
            kind,
            list(reads),
            list(writes),
            [(e, c) for e, c in waits if c > 0] if waits else [],
            list(signals) if signals else [],
            float(flops),
            nbytes,
            params,
        )
        tasks.append(task)
        return task

    def _too_many_tasks(self, kind: str, rank: int) -> SizeLimitError:
        return SizeLimitError(
            f"{self.op}: the graph would have more than {self.budget.max_tasks} tasks (stopped "
            f"building at task {kind!r} on rank {rank})",
            hint="use larger tiles (--set tile=...), smaller sizes or fewer ranks, or raise "
            "the limit: MGRAPH_MAX_TASKS or Settings(max_tasks=...)",
        )

    def tasks_made(
        self,
        rank: int,
        role: str,
        kind: str,
        specs: Iterable[tuple[list[Region], list[Region], Sequence[tuple[int, int]], str, float]],
    ) -> list[Task]:
        """One task per ``(reads, writes, waits, name, flops)`` of ``specs``, all on ``rank`` in
        ``role`` (a plain string) doing ``kind``, with no signals or params: what ``task`` makes
        of the same arguments, without its per-call keyword handling and flops facet call, for
        lowerings that emit a rank's GEMM tiles in bulk (~20k tasks of a 2x8 layer). The caller
        computes ``flops`` (from the kind's facet, once per tile shape) and hands over fresh
        ``reads`` and ``writes`` lists, which become the tasks' own; ``waits`` is copied."""
        item = self._itemsize
        prefix = self.label_prefix
        tasks = self.tasks
        limit = self.budget.max_tasks
        made = []
        for reads, writes, waits, name, flops in specs:
            tid = len(tasks)
            if tid >= limit:
                raise self._too_many_tasks(kind, rank)
            nbytes = 0
            for r in reads:
                nbytes += (r[2] - r[1]) * (r[4] - r[3]) * item[r[0]]
            for r in writes:
                nbytes += (r[2] - r[1]) * (r[4] - r[3]) * item[r[0]]
            task = Task(
                tid, prefix + name if prefix else name, rank, role, kind, reads, writes,
                [(e, c) for e, c in waits if c > 0] if waits else [], [], float(flops), nbytes, {},
            )  # fmt: skip
            tasks.append(task)
            made.append(task)
        return made

    def tasks_alike(
        self,
        rank: int,
        role: Role | str,
        kind: str,
        reads: Sequence[Region],
        tiles: Iterable[tuple[Region, str, dict[str, Any]]],
        *,
        flops: float,
    ) -> None:
        """One task per (write region, name, params) of ``tiles``, all on ``rank`` in ``role``
        doing ``kind`` to the same ``reads`` with the same ``flops`` hint and no waits or
        signals, the role's name worked out once. For ops that emit a rank's row tiles of one
        input in bulk (relayout: ~40k tasks of a traced 2x8 layer), whose tiles GATHER: each
        reads only as many elements as it writes, of the write's dtype, from somewhere in
        ``reads``, so its bytes hint is twice its write's, not all of ``reads`` (which the
        cost model would charge every tile: a 2x8 layer's head split, 8 MiB a 128-row tile)."""
        item = self._itemsize
        role = role._value_ if role.__class__ is Role else role
        prefix = self.label_prefix
        tasks = self.tasks
        limit = self.budget.max_tasks
        flops = float(flops)
        for w, name, params in tiles:
            tid = len(tasks)
            if tid >= limit:
                raise self._too_many_tasks(kind, rank)
            nbytes = 2 * (w[2] - w[1]) * (w[4] - w[3]) * item[w[0]]
            tasks.append(
                Task(tid, prefix + name if prefix else name, rank, role, kind, list(reads), [w],
                     [], [], flops, nbytes, params or {})  # fmt: skip
            )

    def finish(self, remote: set[str] | None = None) -> TaskGraph:
        """The graph; ``remote``: the ids of the buffers that tasks of other ranks read or
        write, when the caller found them while building (mgraph.lower does, in passes it
        makes anyway), else found here."""
        bufs = self.buffers
        if remote is None:
            # one pass over every region (~240k at 2x8) with plain lookups; flags set afterwards
            holder = {bid: buf.rank for bid, buf in bufs.items()}
            remote = set()
            add = remote.add
            for t in self.tasks:
                rank = t.rank
                for r in t.reads:
                    if holder[r[0]] != rank:
                        add(r[0])
                for r in t.writes:
                    if holder[r[0]] != rank:
                        add(r[0])
        for bid in remote:
            bufs[bid].symmetric = True
        return TaskGraph(
            op=self.op,
            topology=self.topo,
            dtype=self.dtype,
            params=dict(self.params),
            inputs=dict(self.inputs),
            outputs=dict(self.outputs),
            buffers=bufs,
            events=self.events,
            tasks=self.tasks,
        )
