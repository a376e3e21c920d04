"""Lowering: OpGraph -> ONE TaskGraph, every op lowered by its own registered lowering.

Ops compose without knowing it. Each op's lowering runs against an ``_OpScope``: a GraphBuilder
that shares the program's buffers, events and tasks, prefixes the op's buffer and task names
with the node name, and resolves the op's ``bound_buffer`` calls:

- an input request (the pieces the op wants on a rank, as a Binding would name them) returns a
  buffer already holding exactly those elements: a program input or parameter bound in that
  layout (the runtime shards it), an earlier op's output, or, when the value lives elsewhere or
  in another layout, a new buffer filled by explicit resharding tasks (resharding.py);
- an output request creates a scratch buffer and records which elements of the value it holds.

Readiness is added afterwards: every task of the op that reads an earlier op's buffer waits for
the tasks that wrote the rows it reads (tile-level, so an op starts on its first tiles while its
producer is still working on the last ones). Program outputs become output buffers bound to
global tensors, in whatever layout they ended in; the runtime gathers them.
"""

from __future__ import annotations

import json
from bisect import bisect_left, bisect_right
from itertools import chain
from typing import Any

import torch

from .builder import GraphBuilder
from .errors import MgraphError
from .graph import Binding, Buffer, Region, Task, TaskGraph, TensorSpec, gc_paused
from .kinds import Role, TaskKind
from .layout import REPLICATE, Run, binding_runs, flat_shape, layout_runs, runs_pieces
from .ops import get_op
from .resharding import Holding, Resharder
from .trace.opgraph import OpGraph, OpNode, Value

__all__ = ["lower"]


def lower(opgraph: OpGraph) -> TaskGraph:
    """The TaskGraph of a traced program (validated by the caller)."""
    ctx = _Lowering(opgraph)
    # Lowerings run thousands of torch ops on tensors of a few hundred elements (relayout's
    # tile maps): a second intra-op thread only spins on them, which at 2x8 cost ~1 s of CPU
    # and held the other core of a 2-core machine. The caller's setting is restored.
    threads = torch.get_num_threads()
    if threads != 1:
        torch.set_num_threads(1)
    try:
        with gc_paused():  # see mgraph.graph.gc_paused: a graph is many small objects
            for node in opgraph.nodes:
                ctx.lower_node(node)
            ctx.bind_outputs()
            ctx.note_remote(ctx.b.tasks[ctx.scanned :])  # the output copies
            return ctx.b.finish(ctx.remote)
    finally:
        if threads != 1:
            torch.set_num_threads(threads)


class _Lowering:
    def __init__(self, opgraph: OpGraph) -> None:
        self.og = opgraph
        self.b = GraphBuilder(
            f"program:{opgraph.name}",
            opgraph.topology,
            opgraph.dtype,
            {"module": opgraph.name, "nodes": len(opgraph.nodes)},
        )
        self.world = opgraph.topology.world_size
        self.reshard = Resharder(self.b)
        self.bound: dict[tuple[str, int], int] = {}  # (input, rank) -> bound buffers so far
        self._writer_index: dict[str, _WriterIndex] = {}  # buffer -> its writers by rows
        # the buffers tasks of other ranks read or write (GraphBuilder.finish's ``remote``),
        # found as each op's tasks are noted; tasks before ``scanned`` are counted in it
        self.remote: set[str] = set()
        self.scanned = 0

    # -- values -------------------------------------------------------------------------------
    def acquire(self, value: Value, rank: int, runs: tuple[Run, ...]) -> Buffer:
        """A buffer on ``rank`` holding exactly ``runs`` of ``value``."""
        root = value.root()
        found = self.reshard.find(root.name, rank, runs)
        if found is not None:
            return found.buffer
        if root.free:
            return self._bind_input(root, rank, runs)
        if not self.reshard.held(root.name):
            raise MgraphError(
                f"value {root.name!r} is read before any op produced it",
                hint="this is a tracer bug: report the module that triggers it",
            )
        return self.reshard.reshard(root.name, rank, runs).buffer

    def _bind_input(self, root: Value, rank: int, runs: tuple[Run, ...]) -> Buffer:
        """A program input or parameter, bound in the layout its consumer asks for."""
        b = self.b
        if root.name not in b.inputs:
            b.inputs[root.name] = TensorSpec(flat_shape(root.shape), root.dtype)
        k = self.bound.get((root.name, rank), 0)
        self.bound[(root.name, rank)] = k + 1
        name = root.name if k == 0 else f"{root.name}#{k}"
        rows = sum(r[1] - r[0] for r in runs)
        buf = b.buffer(
            name,
            rank,
            rows,
            runs[0][3] - runs[0][2],
            role="input",
            dtype=root.dtype,
            binding=Binding(root.name, runs_pieces(runs), 0),
        )
        self.reshard.add(root.name, rank, Holding(buf, runs))
        return buf

    # -- nodes --------------------------------------------------------------------------------
    def lower_node(self, node: OpNode) -> None:
        opdef = get_op(node.op)
        params = json.loads(json.dumps({**opdef.options, **node.params}))
        try:
            opdef.check_params(self.og.topology, params)
            scope = _OpScope(self, node, params)
            start = len(self.b.tasks)
            assert opdef.lower_fn is not None
            opdef.lower_fn(scope, **params)
        except MgraphError as e:
            raise type(e)(f"{node.where()}: {e.message}", hint=e.hint) from e
        new = self.b.tasks[start:]
        self._add_readiness(new)
        for value in node.outputs.values():
            if not all(self.reshard.on(value.name, r) for r in range(self.world)):
                raise MgraphError(
                    f"{node.where()}: op {node.op} left output {value.name!r} unbound"
                )
        # Resharder.note_writer's append, inlined: once per write (~80k at 2x8); and the
        # buffers other ranks write, which GraphBuilder.finish would find in a pass of its own
        # (those they read, _add_readiness found in its pass over the reads)
        writers = self.reshard.writers
        buffers = self.b.buffers
        remote = self.remote
        # a rank's tiles mostly write one buffer in a row: its writer list and rank are
        # looked up when the buffer changes, not per write
        last_bid, noted, holder = None, None, -1
        for t in new:
            rank = t.rank
            for w in t.writes:
                bid = w[0]
                if bid != last_bid:
                    last_bid, noted, holder = bid, writers[bid], buffers[bid].rank
                noted.append((w, t))
                if holder != rank:
                    remote.add(bid)
        self.scanned = len(self.b.tasks)

    def note_remote(self, tasks: list[Task]) -> None:
        """Adds the buffers of ``tasks``' regions held by other ranks to ``remote``."""
        buffers = self.b.buffers
        for t in tasks:
            for r in chain(t.reads, t.writes):
                if buffers[r[0]].rank != t.rank:
                    self.remote.add(r[0])

    def _add_readiness(self, tasks: list[Task]) -> None:
        """Each task that reads an earlier op's buffer waits for the writers of what it reads;
        the buffers of other ranks that ``tasks`` read are added to ``remote`` on the way."""
        writers = self.reshard.writers
        remote = self.remote
        index = self._writer_index
        after = self.b.after
        # Many tasks read the same regions (every column tile of a GEMM row reads one A tile):
        # the producers of a region, and the waits of a rank on a set of regions, are found once.
        # Nothing is noted as written until the op's tasks all have their waits.
        of_region: dict[Region, list[Task]] = {}
        all_tasks = self.b.tasks  # a task's id is its index
        buffers = self.b.buffers
        # The waits of a rank on producer lists, keyed by the lists' ids: _WriterIndex hands
        # out one list per distinct set of writers, so the 16-row tiles of an elementwise op
        # that all read inside one 128-row GEMM band share their waits (of_region keeps every
        # list alive for the call, so no id is reused).
        waits_of: dict[tuple, list[tuple[int, int]]] = {}
        ids_of: dict[int, list[int]] = {}  # a producer list's task ids, for keys of 2+ lists
        # A rank's tiles of one relayout (~40k tasks at 2x8) all read the same input: a task
        # reading what the task before it read, on the same rank, gets the same waits.
        last_rank, last_reads, last_waits = -1, None, None
        for t in tasks:
            reads = t.reads
            rank = t.rank
            if rank == last_rank and reads == last_reads:
                if last_waits:
                    t.waits.extend(last_waits)
                continue
            last_rank, last_reads, last_waits = rank, reads, None
            # the producer lists of the regions t reads, in order: the first, and all of them
            # once there are two (most tasks read one earlier op's buffer: no list, no tuple())
            first = lists = None
            for r in reads:
                bid = r[0]  # regions are (buffer, row0, row1, col0, col1)
                buf = buffers[bid]
                if buf.rank != rank:
                    remote.add(bid)
                # a buffer nothing has written yet (a parameter, the op's own scratch) is
                # skipped before the region is hashed: half the reads of a GEMM op's tasks
                ws = writers.get(bid)
                if not ws:
                    continue
                found = of_region.get(r)
                if found is None:
                    if r[1] == 0 and r[3] == 0 and r[2] == buf.rows and r[4] == buf.cols:
                        # all of the buffer (attention's k and v of a head, a relayout's
                        # input): every writer overlaps it, no index needed
                        found = [w[1] for w in ws]
                    else:
                        idx = index.get(bid)
                        if idx is None or idx.size != len(ws):
                            idx = index[bid] = _WriterIndex(ws)
                        found = idx.overlapping(r)
                    of_region[r] = found
                if found:
                    if first is None:
                        first = found
                    elif lists is None:
                        lists = [first, found]
                    else:
                        lists.append(found)
            if first is None:
                continue
            key = (rank, id(first)) if lists is None else (rank, *[id(f) for f in lists])
            waits = waits_of.get(key)
            if waits is None:
                # the producers of all its regions, each once, in the order first met (a
                # list has no repeats). Attention's q blocks each read all of k and v (~10^3
                # producers): the ids are merged by dict.fromkeys, not a loop.
                if lists is None:
                    producers = first
                else:
                    merged = []
                    for found in lists:
                        ids = ids_of.get(id(found))
                        if ids is None:
                            ids = ids_of[id(found)] = [p.id for p in found]
                        merged.append(ids)
                    producers = [all_tasks[i] for i in dict.fromkeys(chain.from_iterable(merged))]
                waits = waits_of[key] = after(rank, producers)
            last_waits = waits
            t.waits.extend(waits)

    # -- outputs ------------------------------------------------------------------------------
    def bind_outputs(self) -> None:
        b = self.b
        taken: set[str] = set()
        for name, value in zip(self.og.output_names, self.og.outputs, strict=True):
            root = value.root()
            b.outputs[name] = TensorSpec(flat_shape(value.shape), value.dtype)
            for rank in range(self.world):
                if not self.reshard.on(root.name, rank):
                    self.acquire(root, rank, layout_runs(root.shape, REPLICATE, rank, self.world))
                held = self.reshard.primary(root.name, rank)
                if held.buffer.role != "scratch" or held.buffer.id in taken:
                    held = self._local_copy(root.name, rank, held, name)
                taken.add(held.buffer.id)
                held.buffer.role = "output"
                held.buffer.binding = Binding(name, runs_pieces(held.runs), 0)

    def _local_copy(self, value: str, rank: int, held: Holding, label: str) -> Holding:
        """A fresh buffer with the same rows: an input returned as is, or one value returned
        twice, still gets an output buffer of its own."""
        b = self.b
        buf = b.buffer(f"{label}~copy", rank, held.buffer.rows, held.buffer.cols)
        task = b.task(
            rank,
            Role.COMPUTE,
            TaskKind.COPY.value,
            [held.buffer.region()],
            [buf.region()],
            waits=b.after(rank, self.reshard.producers(held.buffer.region())),
            name=f"output copy {label} r{rank}",
        )
        copy = Holding(buf, held.runs)
        self.reshard.add(value, rank, copy)
        self.reshard.note_writer(buf.region(), task)
        return copy


class _WriterIndex:
    """The writers of one buffer (Resharder.writers) indexed by row range, so a read finds the
    tiles it overlaps by bisection instead of a scan of every writer: a 4096-row activation
    written in 128-row tiles is read by thousands of tiles of the next op."""

    __slots__ = ("size", "row0s", "rows", "span", "memo")

    def __init__(self, writers: list[tuple[Region, Task]]) -> None:
        self.size = len(writers)
        by_rows: dict[tuple[int, int], list[tuple[int, Region, Task]]] = {}
        for i, (w, t) in enumerate(writers):
            key = (w[1], w[2])  # (row0, row1): indexing, not the NamedTuple's properties
            group = by_rows.get(key)
            if group is None:
                by_rows[key] = [(i, w, t)]
            else:
                group.append((i, w, t))
        self.rows = sorted(by_rows.items())  # ((row0, row1), writers), by row0
        self.row0s = [k[0] for k, _ in self.rows]
        self.span = max(r1 - r0 for r0, r1 in by_rows)  # the tallest writer
        self.memo: dict[tuple, list[Task]] = {}  # (row bands, col0, col1) -> overlapping()

    def overlapping(self, r: Region) -> list[Task]:
        """The writers overlapping ``r``, in the order they were noted (as
        Resharder.producers lists them). Regions meeting the same row bands in the same
        columns get the same list object (callers only read it)."""
        rows = self.rows
        # a writer starting at or before r.row0 - span ends before r.row0
        _, r0, r1, c0, c1 = r
        lo = bisect_right(self.row0s, r0 - self.span)
        hi = bisect_left(self.row0s, r1)
        bands = tuple([k for k in range(lo, hi) if rows[k][0][1] > r0])
        key = (bands, c0, c1)
        found = self.memo.get(key)
        if found is not None:
            return found
        hits: dict[int, Task] = {}
        for k in bands:
            for i, w, t in rows[k][1]:
                if w[3] < c1 and c0 < w[4]:
                    hits[i] = t
        found = self.memo[key] = [hits[i] for i in sorted(hits)]
        return found


class _OpScope(GraphBuilder):
    """The program's builder as one op's lowering sees it (see the module docstring)."""

    def __init__(self, ctx: _Lowering, node: OpNode, params: dict[str, Any]) -> None:
        # Deliberately no super().__init__(): the containers are the program builder's own.
        base = ctx.b
        self.op = node.op
        self.topo = base.topo
        self.world = base.world
        self.dtype = base.dtype
        self.params = params
        self.inputs: dict[str, TensorSpec] = {}
        self.outputs: dict[str, TensorSpec] = {}
        self.buffers = base.buffers
        self.events = base.events
        self.tasks = base.tasks
        self._joins = base._joins
        self._itemsize = base._itemsize
        # task names read "<node>: <name>" (GraphBuilder.task prepends it; no wrapper per task)
        self.label_prefix = f"{node.name}: "
        self.budget = base.budget  # one size guard for the whole program's graph
        self.ctx = ctx
        self.node = node

    def _value(self, tensor: str, role: str) -> Value:
        table = self.node.inputs if role == "input" else self.node.outputs
        value = table.get(tensor)
        spec = (self.inputs if role == "input" else self.outputs).get(tensor)
        if value is None or spec is None:
            raise MgraphError(
                f"{self.node.where()}: op {self.op} binds {role} {tensor!r}, which the node "
                f"does not provide (node {role}s: {sorted(table)})"
            )
        if flat_shape(spec.shape) != flat_shape(value.shape):
            raise MgraphError(
                f"{self.node.where()}: op {self.op} sees {tensor!r} as {list(spec.shape)}, "
                f"the traced tensor {value.name!r} is {list(value.shape)}",
                hint="the op's shape must flatten to the same rows x cols as the tensor",
            )
        return value

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
    ) -> Buffer:
        return GraphBuilder.buffer(self, f"{self.node.name}/{name}", rank, rows, cols, dtype=dtype)

    def bound_buffer(
        self,
        name: str,
        rank: int,
        tensor: str,
        pieces,
        *,
        cat_dim: int = 0,
        role: str = "input",
    ) -> Buffer:
        value = self._value(tensor, role)
        spec = (self.inputs if role == "input" else self.outputs)[tensor]
        runs = binding_runs(spec.shape, pieces, cat_dim)
        if role == "input":
            return self.ctx.acquire(value, rank, runs)
        rows = sum(r[1] - r[0] for r in runs)
        buf = self.buffer(name, rank, rows, runs[0][3] - runs[0][2], dtype=spec.dtype)
        self.ctx.reshard.add(value.name, rank, Holding(buf, runs))
        return buf
