"""MoE dispatch + experts + combine with expert parallelism (Mixtral-style top-k SwiGLU layer).

Tokens ``x [T, H]`` and ``router_logits [T, E]`` are sharded along T (rank r holds T_loc = T/W
rows); expert weights are sharded along E (rank r owns E_loc = E/W experts). ``out [T, H]`` is
sharded like ``x``. Per token: weights, experts = softmax over its top_k logits; out = sum of
weight * SwiGLU_expert(x). With ``normalize=False`` a pick's weight is instead its softmax
probability over all E logits, not renormalised over the k (Qwen2-MoE's and Qwen3-MoE's
``norm_topk_prob=False``); the picks are the same. A second output, ``dropped [W, E]`` (float32, row r on rank r), counts
the picks of rank r's tokens for expert e that the drop policy dropped (see "Capacity"): its sum
is the number of dropped picks, 0 when ``out`` equals a dense MoE's.

Lowering (a static graph; the CONTENTS of its buffers are data-dependent, see moe_tiles.py).
Experts go in groups of ``expert_group`` consecutive experts of one rank: the unit of routing
and of waiting, so work on a group starts as soon as every source's rows of that group are
there.
1. route (compute, source s, one task per group): top-k, then pack ``x`` rows into ``send[s]``,
   one segment of C rows per global expert (the segment capacity, see "Capacity"), plus
   fp32 metadata rows, the group's entries of ``counts[s]`` [W, E_loc] (the filled rows of each
   segment; row d: destination d's experts) and its columns of the picks map (``pick_rows`` /
   ``pick_weights`` [T_loc, E]: where each token's outputs will land in ``back[s]``, and their
   weights) and of s's row of ``dropped`` (picks past a segment's capacity). Segments of
   destination d's experts are contiguous: one block per (s, d) pair.
2. dispatch: d's row of the counts, then each group's rows and metadata, go to ``recv[d]`` (slot
   of s). Inside a node: NVLink ``moe_move`` tasks that copy only the filled rows of each
   segment, one task per expert for the rows (a group's rows move on several NVLink workers
   at once) and one per group for the metadata. Across nodes: RDMA to s's rail peer on d's
   node (the only peers a rail network joins), which forwards over NVLink (a ``moe_move``
   reading the count that landed at d), or lands directly when that rail peer is d. The RDMA
   legs move whole group regions: the proxy encodes its WRITEs at launch from static regions,
   so a count-sized WRITE needs the proxy to read the count.
3. experts (compute, d): one task per (source, local expert, row tile) computes the SwiGLU expert
   on the tile's filled rows (its segment's count); a tile past the count exits at once. Tiles
   start when their group's rows from every source arrived, and the tiles of all sources on
   one expert's weights (or one slice of them, below) follow each other in the queue under
   the builtin policies (see ``_Lowering.run``), so the programs that take them at about the
   same time can share the weights' reads through L2 instead of streaming them once per
   source (``moe_tiles.weight_streams`` with the queues; not yet measured on a GPU). With
   ``expert_cols_f`` and ``expert_cols_h``,
   a tile is instead pass-1 tasks on slices of ``expert_cols_f`` hidden columns, then (after
   all of them) pass-2 tasks on slices of ``expert_cols_h`` output columns: several programs
   work on one expert at once, each streaming its own slice of the weights while the tile's
   rows, read by all of them, can come from L2. Options left None take :func:`auto_tiles`'s
   values (one H200, issue 17's size, benchmarks/NOTES.md v13: its choice there, 512 expert
   rows, groups of 8 and the 128/512 split, ran 9.3 ms; 64-row tiles, groups of 1 and no
   split, the defaults before, 14.6 ms). The SwiGLU hidden goes to a scratch region of
   ``hidden[d]``. Rows of d's own tokens never leave d: their tiles read ``send[d]`` and write
   ``back[d]``.
4. return: ``ret[d]``'s slot of s goes back to ``back[s]`` by the reverse path, in the pieces of
   the dispatch (one move per expert inside a node, each after every source's tiles of that
   expert; per group across nodes), filled rows only on NVLink legs (which read s's own
   counts).
5. combine (compute, s, one task per token tile and column tile): out[token] = the sum of weight
   * y over the token's k rows of ``back[s]``, found through the picks map.

No host synchronisation: counts are data in the graph's buffers. Buffers stay capacity-sized
(static regions); traffic follows the routing.

Capacity. A source rank sends at most T_loc * top_k rows in all, and at most T_loc to one
expert (a token picks an expert once); so T_loc rows per (source, expert) segment never drops a
token, but it sizes every exchange buffer at E * T_loc rows per rank: E / top_k times what can
ever be routed (1048576 rows of 7168 bf16 per buffer at T_loc=4096, E=256, top_k=8 on 2 ranks;
57 GiB per rank with the weights). Segments are static regions because every tile task has
static regions (the graph's race check proves that tiles running in parallel write disjoint
rows); a packed layout with offsets from device-side prefix sums would make each expert tile's
region the whole block. So
segments keep a fixed size, bounded by the ``capacity_factor`` option:
C = min(T_loc, ceil(capacity_factor * T_loc * top_k / E)) rounded up to whole expert tiles. The
default 4.0 is four times the mean load of an expert (C = 512 rows at the shape above, where a
uniform router sends 128 +- 11: a drop is beyond reach; a router that sends one expert more than
four times its share of a rank's tokens drops). A ``capacity_factor`` >= E / top_k gives C =
T_loc: nothing is ever dropped. Drop policy, identical on every backend and in the reference:
per (source rank, expert), the first C picks in ascending token order are kept; a dropped pick
contributes nothing to its token's output and the token's other weights are not renormalised
(Switch/GShard token dropping). The op's drops are not silent: the route tiles count the picks
they drop in ``dropped`` and the reference returns the same counts (from ``kept_picks``, which
says which picks a routing drops, from the logits alone). Inside a traced Program the op's node
has one output, the module's, so there ``dropped`` is a scratch buffer per rank, written and not
returned: ExpertParallel keeps every token by default (capacity_factor E / top_k), but a plan
that bounds it with ``options`` does not see its drops. With B = E_loc * C rows per (source,
destination) block and R relay slots per rank ((nodes - 1) * (gpus_per_node - 1)), the buffers
of one rank hold (2W + 2(W - 1) + 2R) * B rows of H (send, back, recv, ret, relay, relay_ret),
W * B rows of F (hidden), (2W - 1 + R) * B rows of META_COLS fp32, the picks map (2 * T_loc * E
fp32), the rank's row of ``dropped`` (E fp32), the counts and the rank's shards of the inputs,
weights and output (``rank_bytes``).

The graph's params record ``world_size``: the reference needs it (the drop policy is per source
rank).

Cost hints: an expert tile's flops use the EXPECTED routed rows (T_loc * top_k / E per source and
expert, packed at the front of the segment as the route tile packs them), not its capacity. Tasks
whose bytes follow the routing carry ``params["expected_fill"]``: the expected fraction of their
region bytes that is really touched (T_loc * top_k / E of a segment's C rows; a combine tile
touches top_k rows per token of a ``back`` that holds E * C rows). It is an expectation for a
uniform router, not a measurement: the simulator has no data (runtime/sim/model.py reads it).
"""

from __future__ import annotations

import torch

from ..builder import GraphBuilder, pick_tile, piece, shard_range, split
from ..errors import GraphError, OptionError, ShapeError
from ..graph import ITEMSIZE, Buffer, Region, Task, torch_dtype
from ..kinds import Role, TaskKind
from ..topology import Topology
from .moe_sizes import (  # noqa: F401  (auto_tiles, rank_bytes: the op's public sizing rules)
    AUTO_COLS,
    AUTO_GROUP,
    AUTO_ROWS,
    auto_tiles,
    kept_picks,
    rank_bytes,
    segment_capacity,
)
from .moe_tiles import META_COLS, combine_flops, expert_flops, swiglu
from .moe_transport import Counted, move
from .registry import OpDef

__all__ = ["kept_picks", "rank_bytes", "segment_capacity"]

moe_dispatch_combine = OpDef(
    "moe_dispatch_combine",
    dims=("T", "H", "E", "top_k", "F"),
    inputs=("x", "router_logits", "w_gate", "w_up", "w_down"),
    outputs=("out", "dropped"),
)

OP = "moe_dispatch_combine"
ROUTE, EXPERT, COMBINE = (
    TaskKind.MOE_ROUTE.value,
    TaskKind.MOE_EXPERT.value,
    TaskKind.MOE_COMBINE.value,
)


@moe_dispatch_combine.shapes
def _shapes(
    topology: Topology, T: int, H: int, E: int, top_k: int, F: int, **_: object
) -> dict[str, tuple]:
    world = topology.world_size
    if T % world:
        raise ShapeError(
            f"{OP}: T={T} is not divisible by the world size {world}",
            hint=f"tokens are sharded over all ranks: choose T as a multiple of {world}",
        )
    if E % world:
        raise ShapeError(
            f"{OP}: E={E} is not divisible by the world size {world}",
            hint=f"experts are sharded over all ranks: choose E as a multiple of {world}",
        )
    if not 0 < top_k <= E:
        raise ShapeError(
            f"{OP}: top_k={top_k} must be between 1 and the number of experts E={E}",
            hint="each token picks top_k distinct experts",
        )
    return {
        "x": (T, H),
        "router_logits": (T, E),
        "w_gate": (E, H, F),
        "w_up": (E, H, F),
        "w_down": (E, F, H),
        "out": (T, H),
        "dropped": (world, E),
    }


@moe_dispatch_combine.reference
def _reference(
    x: torch.Tensor,
    router_logits: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    T: int,
    E: int,
    top_k: int,
    expert_rows: int = 64,
    capacity_factor: float = 4.0,
    world_size: int | None = None,
    normalize: bool = True,
    **_: object,
) -> dict[str, torch.Tensor]:
    if world_size is None:
        raise GraphError(
            f"{OP}: the params lack world_size: the reference cannot apply the drop policy",
            hint="pass the params of a graph built by moe_dispatch_combine (they record it)",
        )
    T_loc = T // world_size
    capacity = segment_capacity(T_loc, E, top_k, capacity_factor, min(expert_rows, T_loc))
    weights, experts, kept = kept_picks(router_logits, top_k, T_loc, capacity, normalize)
    lost = torch.zeros(T, E, dtype=torch.float32, device=x.device)
    lost.scatter_(1, experts, (~kept).float())  # a token picks an expert at most once
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in range(w_gate.shape[0]):
        token, slot = ((experts == e) & kept).nonzero(as_tuple=True)
        if token.numel():
            y = swiglu(x[token], w_gate[e], w_up[e], w_down[e])
            out.index_add_(0, token, y * weights[token, slot, None])
    return {"out": out.to(x.dtype), "dropped": lost.view(world_size, T_loc, E).sum(1)}


@moe_dispatch_combine.make_inputs
def _make_inputs(graph, gen: torch.Generator) -> dict[str, torch.Tensor]:
    # Unit-variance activations through the expert MLP: weights scaled by 1/sqrt(fan-in).
    p = graph.params
    H, F = p["H"], p["F"]
    scale = {"x": 1.0, "router_logits": 1.0, "w_gate": H**-0.5, "w_up": H**-0.5, "w_down": F**-0.5}
    return {
        name: (torch.randn(spec.shape, generator=gen) * scale[name]).to(torch_dtype(spec.dtype))
        for name, spec in graph.inputs.items()
    }


@moe_dispatch_combine.lower
def _lower(
    b: GraphBuilder,
    T: int,
    H: int,
    E: int,
    top_k: int,
    F: int,
    expert_rows: int | None = None,
    combine_cols: int = 256,
    combine_rows: int = 64,
    expert_group: int | None = None,
    capacity_factor: float = 4.0,
    expert_cols_f: int | None = None,
    expert_cols_h: int | None = None,
    expert_split: bool | None = None,
    normalize: bool = True,
) -> None:
    if normalize:  # unrecorded when default: graphs built before the flag keep their digests
        b.params.pop("normalize", None)
    if not capacity_factor > 0:
        raise OptionError(
            f"{OP}: capacity_factor={capacity_factor!r} must be positive",
            hint=f"a segment holds capacity_factor times an expert's mean load; {E / top_k:g} "
            "(E / top_k) or more never drops a token",
        )
    if expert_split is False and expert_cols_f is not None:
        raise OptionError(
            f"{OP}: expert_split=False with expert_cols_f={expert_cols_f}: the column split "
            "is off, so its slice widths mean nothing",
            hint="drop expert_cols_f / expert_cols_h, or drop expert_split=False",
        )
    auto = auto_tiles(T // b.world, H, E // b.world, E, top_k, F, capacity_factor,
                      expert_rows, expert_split)  # fmt: skip
    expert_rows = auto["expert_rows"] if expert_rows is None else expert_rows
    expert_group = auto["expert_group"] if expert_group is None else expert_group
    if expert_cols_f is None and expert_cols_h is None and expert_split is not False:
        expert_cols_f, expert_cols_h = auto["expert_cols_f"], auto["expert_cols_h"]
        if expert_split and expert_cols_f is None:
            raise OptionError(
                f"{OP}: expert_split=True, but F={F} and H={H} do not divide into slices of "
                f"{AUTO_COLS[0]} and {AUTO_COLS[1]} columns",
                hint="pass expert_cols_f and expert_cols_h (divisors of F and H)",
            )
    # the resolved values, so the reference and a reader of the graph see what ran
    b.params.update(expert_rows=expert_rows, expert_group=expert_group,
                    expert_cols_f=expert_cols_f, expert_cols_h=expert_cols_h)  # fmt: skip
    tiles = {"expert_rows": expert_rows, "combine_cols": combine_cols,
             "combine_rows": combine_rows, "expert_group": expert_group}  # fmt: skip
    for name, value in tiles.items():
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ShapeError(f"{OP}: {name}={value!r} must be a positive int")
    split = {"expert_cols_f": expert_cols_f, "expert_cols_h": expert_cols_h}
    for name, value in split.items():
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or value <= 0):  # fmt: skip
            raise ShapeError(f"{OP}: {name}={value!r} must be a positive int or None")
    if (expert_cols_f is None) != (expert_cols_h is None):
        raise OptionError(
            f"{OP}: expert_cols_f={expert_cols_f} and expert_cols_h={expert_cols_h}: set both "
            "or neither",
            hint="both set: each expert tile becomes pass-1 tasks of expert_cols_f hidden "
            "columns and pass-2 tasks of expert_cols_h output columns; neither: one task",
        )
    tiles.update({k: v or 0 for k, v in split.items()})
    b.params["world_size"] = b.world  # the reference's drop policy is per source rank
    _Lowering(b, T, H, E, top_k, F, tiles, capacity_factor, normalize).run()


def _binds(b: GraphBuilder, output: str) -> bool:
    """Whether this lowering has a place for ``output``. An op inside a traced Program is
    lowered through lower._OpScope, which binds only the outputs its node has, and the tracer
    gives a node one, the module's result: there ``dropped`` stays a scratch buffer (still
    written, read by nobody)."""
    node = getattr(b, "node", None)  # lower._OpScope's traced node; a plain builder has none
    return node is None or output in node.outputs


class _Lowering:
    """The five stages of the module docstring, sharing the per-rank buffers."""

    def __init__(
        self,
        b: GraphBuilder,
        T: int,
        H: int,
        E: int,
        top_k: int,
        F: int,
        tiles: dict[str, int],
        capacity_factor: float,
        normalize: bool = True,
    ) -> None:
        self.b, self.topo, self.world = b, b.topo, b.world
        self.normalize = normalize
        self.H, self.E, self.F, self.top_k = H, E, F, top_k
        self.T_loc, self.E_loc = T // self.world, E // self.world
        self.tile_rows = pick_tile(OP, "T/W", self.T_loc, tiles["expert_rows"])
        self.tile_cols = pick_tile(OP, "H", H, tiles["combine_cols"])
        self.combine_rows = pick_tile(OP, "T/W", self.T_loc, tiles["combine_rows"])
        self.group = tiles["expert_group"]
        self.cols_f, self.cols_h = tiles.get("expert_cols_f", 0), tiles.get("expert_cols_h", 0)
        if self.E_loc % self.group:
            raise ShapeError(
                f"{OP}: expert_group={self.group} does not divide the experts per rank "
                f"E/W={self.E_loc}",
                hint="a group of experts belongs to one rank: pick a divisor of E/W",
            )
        self.groups = self.E_loc // self.group  # groups per rank
        # rows of one (source, expert) segment
        self.seg = segment_capacity(self.T_loc, E, top_k, capacity_factor, self.tile_rows)
        self.block = self.E_loc * self.seg  # rows one (source, destination) pair exchanges
        self.expected = self.T_loc * top_k / E  # routed rows of a segment, uniform router
        self.fill = min(1.0, self.expected / self.seg)  # expected filled / capacity rows

    def run(self) -> None:
        self.declare()
        routes = [self.route(r) for r in self.topo.ranks]  # [s][d * groups + g]
        arrivals = {
            (s, d): self.dispatch(s, d, routes[s])
            for s in self.topo.ranks
            for d in self.topo.ranks
            if s != d
        }
        finished: list[list[Task]] = [[] for _ in self.topo.ranks]  # writers of back[s]
        for d in self.topo.ranks:
            sources = self._sources(d)
            mine = routes[d][d * self.groups : (d + 1) * self.groups]
            # A group's tiles start when every source's rows of the group are there
            ready = [[t, *(x for s in sources[1:] for x in arrivals[(s, d)][g])]
                     for g, t in enumerate(mine)]  # fmt: skip
            tiles = self.experts(d, ready)
            finished[d] += sum(tiles[d], [])
            # Each return of an expert's rows waits for every source's tiles of the expert, d's
            # own rows' too. Without that (and without the joint wait above), a remote
            # source's tiles have the longer path (the return, then the combine) and the
            # scheduler queued them, every expert's, before any tile of d's own rows (or,
            # placing tasks on workers, the own rows first, as they are there earlier): d
            # streamed each expert's weights once per source. With both, the tiles of all
            # sources on one weight slice wait for the same tasks and are waited for by the
            # same tasks: equally urgent under any policy, they queue side by side (experts
            # emits them so, and ties go by id). The cost: an expert's rows go back when all
            # its sources' tiles are done, which that queue makes about the same time.
            together = [sum((tiles[s][j] for s in sources), []) for j in range(self.E_loc)]
            for s in sources[1:]:
                finished[s] += self.give_back(d, s, together)
        for s in self.topo.ranks:
            self.combine(s, finished[s] + routes[s])

    # -- buffers ------------------------------------------------------------------------------
    def declare(self) -> None:
        """Global tensors, their per-rank shards, and the exchange buffers (worst-case sized)."""
        b, topo, T_loc = self.b, self.topo, self.T_loc
        T, H, E, F, W = T_loc * self.world, self.H, self.E, self.F, self.world
        for name, shape in (("x", (T, H)), ("router_logits", (T, E))):
            b.global_input(name, shape)
        for name, shape in (("w_gate", (E, H, F)), ("w_up", (E, H, F)), ("w_down", (E, F, H))):
            b.global_input(name, shape)
        b.global_output("out", (T, H))
        if _binds(b, "dropped"):
            b.global_output("dropped", (W, E), dtype="float32")
        by_token = {r: shard_range(T, r, W) for r in topo.ranks}
        by_expert = {r: shard_range(E, r, W) for r in topo.ranks}

        def bind(name: str, rank: int, rng: tuple[int, int], role: str = "input") -> Buffer:
            spec = (b.inputs if role == "input" else b.outputs)[name]
            return b.bound_buffer(name, rank, name, [piece(spec.shape, d0=rng)], role=role)

        self.x = [bind("x", r, by_token[r]) for r in topo.ranks]
        self.logits = [bind("router_logits", r, by_token[r]) for r in topo.ranks]
        self.w_gate = [bind("w_gate", r, by_expert[r]) for r in topo.ranks]
        self.w_up = [bind("w_up", r, by_expert[r]) for r in topo.ranks]
        self.w_down = [bind("w_down", r, by_expert[r]) for r in topo.ranks]
        self.out = [bind("out", r, by_token[r], role="output") for r in topo.ranks]
        # Rank r's row of dropped: the picks its route tiles dropped, per expert.
        self.dropped = [
            bind("dropped", r, (r, r + 1), role="output")
            if "dropped" in b.outputs
            else b.buffer("dropped", r, 1, E, dtype="float32")
            for r in topo.ranks
        ]

        def data(name: str, slots: int) -> list[Buffer]:
            return [b.buffer(name, r, slots * self.block, H) for r in topo.ranks]

        def meta(name: str, slots: int) -> list[Buffer]:
            rows = slots * self.block
            return [b.buffer(name, r, rows, META_COLS, dtype="float32") for r in topo.ranks]

        def counts(name: str, slots: int) -> list[Buffer]:
            # One row per slot: the filled rows of that slot's E_loc segments (fp32 is exact).
            return [b.buffer(name, r, slots, self.E_loc, dtype="float32") for r in topo.ranks]

        self.send, self.send_meta = data("send", W), meta("send_meta", W)
        self.counts = counts("counts", W)
        self.back = data("back", W)
        # The picks map: per (token, global expert) its row in back (-1: not picked), its weight.
        self.pick_rows, self.pick_weights = (
            [b.buffer(name, r, T_loc, E, dtype="float32") for r in topo.ranks]
            for name in ("pick_rows", "pick_weights")
        )
        # The SwiGLU hidden of every expert tile (scratch): the slot of the tile's source.
        self.hidden = [b.buffer("hidden", r, W * self.block, F) for r in topo.ranks]
        # recv/ret: one slot per OTHER rank (own tokens stay in send/back).
        if W > 1:
            self.recv, self.recv_meta = data("recv", W - 1), meta("recv_meta", W - 1)
            self.recv_counts = counts("recv_counts", W - 1)
            self.ret = data("ret", W - 1)
        # Relay staging on a rail peer: one slot per (remote rail source, node peer destination).
        relays = (topo.nodes - 1) * (topo.gpus_per_node - 1)
        self.relay: list[Buffer] | None = None
        self.relay_meta: list[Buffer] | None = None
        self.relay_ret: list[Buffer] | None = None
        self.relay_counts: list[Buffer] | None = None
        if relays:
            self.relay, self.relay_meta = data("relay", relays), meta("relay_meta", relays)
            self.relay_ret = data("relay_ret", relays)
            self.relay_counts = counts("relay_counts", relays)

    def _slot_rows(self, slot: int) -> tuple[int, int]:
        return (slot * self.block, (slot + 1) * self.block)

    def _peer_index(self, holder: int, other: int) -> int:
        """Index of ``other``'s slot in ``holder``'s recv/ret/recv_counts buffers."""
        return other if other < holder else other - 1

    def _peer_slot(self, holder: int, other: int) -> tuple[int, int]:
        """Rows of ``other``'s slot in ``holder``'s recv/ret buffers."""
        return self._slot_rows(self._peer_index(holder, other))

    def _nbytes(self, region: Region) -> int:
        buf = self.b.buffers[region.buffer]
        return (region.row1 - region.row0) * (region.col1 - region.col0) * ITEMSIZE[buf.dtype]

    def _expected_fill(
        self, whole: list[Region], routed: list[Region], fill: float | None = None
    ) -> float:
        """Expected touched fraction of a task's bytes: ``whole`` regions are touched entirely,
        ``routed`` ones (capacity-sized) by ``fill`` (default ``self.fill``)."""
        fixed = sum(self._nbytes(r) for r in whole)
        varying = sum(self._nbytes(r) for r in routed)
        return (fixed + varying * (self.fill if fill is None else fill)) / (fixed + varying)

    def _sources(self, d: int) -> list[int]:
        """Sources in expected arrival order: own rows, then node peers, then remote ranks."""
        topo, node = self.topo, self.topo.node_of(d)
        peers = [s for s in topo.ranks if s != d and topo.node_of(s) == node]
        return [d, *peers, *(s for s in topo.ranks if topo.node_of(s) != node)]

    # -- stages -------------------------------------------------------------------------------
    def _group_rows(self, slot: int, g: int) -> tuple[int, int]:
        """Rows of group ``g`` (of the slot's rank) inside ``slot``."""
        r0 = slot * self.block + g * self.group * self.seg
        return (r0, r0 + self.group * self.seg)

    def _group_cols(self, g: int) -> tuple[int, int]:
        """Columns of group ``g`` in a row of counts (E_loc entries)."""
        return (g * self.group, (g + 1) * self.group)

    def route(self, s: int) -> list[Task]:
        """One route task per group of experts, all ranks' groups: index ``d * groups + g``."""
        reads = [self.x[s].region(), self.logits[s].region()]
        tasks = []
        for d in self.topo.ranks:
            for g in range(self.groups):
                rows, cols = self._group_rows(d, g), self._group_cols(g)
                expert0 = d * self.E_loc + g * self.group
                picks = (expert0, expert0 + self.group)
                packed = [self.send[s].region(rows), self.send_meta[s].region(rows)]
                whole = [
                    self.counts[s].region((d, d + 1), cols=cols),
                    self.pick_rows[s].region(cols=picks),
                    self.pick_weights[s].region(cols=picks),
                    self.dropped[s].region(cols=picks),
                ]
                task = self.b.task(
                    s,
                    Role.COMPUTE,
                    ROUTE,
                    reads,
                    [*packed, *whole],
                    name=f"route r{s} e{picks[0]}:{picks[1]}",
                    params={
                        "top_k": self.top_k,
                        "experts_per_rank": self.E_loc,
                        "expert0": expert0,
                        "capacity": self.seg,
                        "expected_fill": self._expected_fill([*reads, *whole], packed),
                        # set only when off: a renormalising op's tasks are as before the flag
                        **({} if self.normalize else {"normalize": 0}),
                    },
                )
                tasks.append(task)
        return tasks

    def dispatch(self, s: int, d: int, routes: list[Task]) -> list[list[Task]]:
        """Per group of d's experts, the tasks after which that group's rows from s (counts,
        rows, metadata) are in recv[d]."""
        i = self._peer_index(d, s)
        mine = routes[d * self.groups : (d + 1) * self.groups]
        count = self.move(
            self.counts[s].region((d, d + 1)),
            self.recv_counts[d].region((i, i + 1)),
            self.relay_counts,
            mine,
            f"dispatch-counts r{s}->r{d}",
            unit=1,
        )
        arrived = []
        for g in range(self.groups):
            tag = f"r{s}->r{d} g{g}"
            rows = [
                self.move(self.send[s].region(self._expert_rows(d, j0, j1)),
                          self.recv[d].region(self._expert_rows(i, j0, j1)), self.relay,
                          [mine[g]], f"dispatch {tag} {self._experts_tag(d, j0, j1)}",
                          counts=(*self._counts(s, d, j0, j1), [count]), offset=j0 * self.seg)
                for j0, j1 in self._pieces(s, d, g)
            ]  # fmt: skip
            cols = self._group_cols(g)
            src, dst = self._expert_rows(d, *cols), self._expert_rows(i, *cols)
            meta = self.move(self.send_meta[s].region(src), self.recv_meta[d].region(dst),
                             self.relay_meta, [mine[g]], f"dispatch-meta {tag}",
                             counts=(*self._counts(s, d, *cols), [count]),
                             offset=cols[0] * self.seg)  # fmt: skip
            arrived.append([count, *rows, meta])
        return arrived

    def _counts(self, s: int, d: int, j0: int, j1: int) -> tuple[Region, Region]:
        """The counts of d's local experts [j0, j1) in s's rows: where s wrote them, where d
        received them."""
        i = self._peer_index(d, s)
        return (self.counts[s].region((d, d + 1), cols=(j0, j1)),
                self.recv_counts[d].region((i, i + 1), cols=(j0, j1)))  # fmt: skip

    def _expert_rows(self, slot: int, j0: int, j1: int) -> tuple[int, int]:
        """Rows of the slot's local experts [j0, j1) inside ``slot``."""
        return (slot * self.block + j0 * self.seg, slot * self.block + j1 * self.seg)

    def _experts_tag(self, d: int, j0: int, j1: int) -> str:
        """Rank d's local experts [j0, j1) in a task's name, by their global indices."""
        return f"e{d * self.E_loc + j0}:{d * self.E_loc + j1}"

    def _pieces(self, a: int, z: int, g: int) -> list[tuple[int, int]]:
        """The local experts each move of group ``g``'s rows from rank ``a`` to ``z`` carries.
        Over NVLink, one expert: a move is one NVLink worker's task, so a move per group put
        each group on one worker (at issue 17's size on 2 GPUs, 16 groups of ~15 MB at the
        expected fill, each at one worker's rate, all landing at about the same time); a move
        per expert spreads each group over the workers, and the NVLink queue takes the groups
        in order, so the first groups' tiles start sooner (the simulator: the first tiles at
        2.6 ms, not 6.2, and the returns, after the tiles of their expert, also spread).
        Across nodes, the group: one RDMA write (the proxy's ~17 us a command)."""
        j0, j1 = self._group_cols(g)
        if self.topo.link(a, z) != "nvlink":
            return [(j0, j1)]
        return [(j, j + 1) for j in range(j0, j1)]

    def experts(self, d: int, ready: list[list[Task]]) -> dict[int, list[list[Task]]]:
        """Expert tiles on d for the rows each source s sent, per source and local expert (each
        after ``ready[group]``); they write back[d] (own) or ret[d].

        The tiles of every source on one (expert, row tile, weight slice) are emitted one after
        another: they read the same weights, and run() makes them equally urgent, so the
        scheduler (ties by id) queues them side by side, where the programs that take them at
        about the same time can share the slice's reads through L2 instead of each streaming
        it from HBM."""
        seg, H, F = self.seg, self.H, self.F
        sources = self._sources(d)
        io = {s: self._tile_io(d, s) for s in sources}
        expected = self.expected  # per (source, expert); <= T_loc as top_k <= E
        by_expert: dict[int, list[list[Task]]] = {s: [] for s in sources}
        for j in range(self.E_loc):
            if j % self.group == 0:
                waits = self.b.after(d, ready[j // self.group])
            for s in sources:
                by_expert[s].append([])
            weights = [
                self.w_gate[d].region((j * H, (j + 1) * H)),
                self.w_up[d].region((j * H, (j + 1) * H)),
                self.w_down[d].region((j * F, (j + 1) * F)),
            ]
            for r0, r1 in split(seg, self.tile_rows):
                # The route tile packs routed rows at the front of a segment.
                rows_expected = min(max(expected - r0, 0.0), float(r1 - r0))
                # source -> (head, span, out, meta, count, params, name)
                tile: dict[int, tuple] = {}
                for s in sources:
                    rows, meta, out, base, counts, slot = io[s]
                    span = (base + j * seg + r0, base + j * seg + r1)
                    count = counts.region((slot, slot + 1), cols=(j, j + 1))
                    # source and capacity: for moe_tiles.weight_streams (not encoded)
                    params = {"local_expert": j, "row0": r0, "expected_rows": rows_expected,
                              "source": s, "capacity": seg}  # fmt: skip
                    name = f"expert r{d} e{d * self.E_loc + j} from r{s} [{r0}:{r1}]"
                    head = [rows.region(span), meta.region(span), count]
                    tile[s] = (head, span, out, meta, count, params, name)
                scratch = {s: s * self.block + j * seg for s in sources}
                rows_s = {s: (scratch[s] + r0, scratch[s] + r1) for s in sources}
                if not self.cols_f:
                    for s in sources:
                        head, span, out, _, _, params, name = tile[s]
                        hidden = self.hidden[d].region(rows_s[s])
                        by_expert[s][-1].append(
                            self.b.task(
                                d,
                                Role.COMPUTE,
                                EXPERT,
                                [*head, *weights],
                                [out.region(span), hidden],
                                waits=waits,
                                name=name,
                                params={**params, "part": 0},
                                flops=expert_flops(rows_expected, H, F),
                            )
                        )
                    continue
                # The column split: pass-1 tasks on slices of hidden columns, then pass-2 tasks
                # on slices of output columns, each reading the whole hidden rows. The slices
                # of one tile run on several programs at once, so they read the tile's rows
                # (x, then hidden) from L2 while each streams its own slice of the weights.
                first: dict[int, list[Task]] = {s: [] for s in sources}
                for f0, f1 in split(F, self.cols_f):
                    for s in sources:
                        head, _, _, _, _, params, name = tile[s]
                        first[s].append(
                            self.b.task(
                                d,
                                Role.COMPUTE,
                                EXPERT,
                                [
                                    *head,
                                    self.w_gate[d].region((j * H, (j + 1) * H), (f0, f1)),
                                    self.w_up[d].region((j * H, (j + 1) * H), (f0, f1)),
                                ],
                                [self.hidden[d].region(rows_s[s], (f0, f1))],
                                waits=waits,
                                name=f"{name} hidden[{f0}:{f1}]",
                                params={**params, "part": 1},
                                flops=4.0 * rows_expected * H * (f1 - f0),
                            )
                        )
                ready_hidden = {s: self.b.after(d, first[s]) for s in sources}
                for c0, c1 in split(H, self.cols_h):
                    for s in sources:
                        _, span, out, meta, count, params, name = tile[s]
                        hidden = self.hidden[d].region(rows_s[s])
                        by_expert[s][-1].append(
                            self.b.task(
                                d,
                                Role.COMPUTE,
                                EXPERT,
                                [
                                    hidden,
                                    meta.region(span),
                                    count,
                                    self.w_down[d].region((j * F, (j + 1) * F), (c0, c1)),
                                ],
                                [out.region(span, cols=(c0, c1))],
                                waits=ready_hidden[s],
                                name=f"{name} y[{c0}:{c1}]",
                                params={**params, "part": 2},
                                flops=2.0 * rows_expected * F * (c1 - c0),
                            )
                        )
        return by_expert

    def _tile_io(self, d: int, s: int) -> tuple[Buffer, Buffer, Buffer, int, Buffer, int]:
        """Where d's expert tiles for source s read rows and metadata, write outputs, the first
        row of s's slot there, and where s's counts are (buffer, row)."""
        if s == d:
            return self.send[d], self.send_meta[d], self.back[d], d * self.block, self.counts[d], d
        i = self._peer_index(d, s)
        return (self.recv[d], self.recv_meta[d], self.ret[d], self._peer_slot(d, s)[0],
                self.recv_counts[d], i)  # fmt: skip

    def give_back(self, d: int, s: int, tiles: list[list[Task]]) -> list[Task]:
        """The expert outputs d computed for s, back into s's ``back`` buffer, in the pieces
        of ``_pieces`` (each after ``tiles`` of its experts, ``tiles[j]`` for local expert j)."""
        i = self._peer_index(d, s)
        moves = []
        for g in range(self.groups):
            for j0, j1 in self._pieces(d, s, g):
                # The counts are at both ends already: s wrote them, d received them.
                at_s, at_d = self._counts(s, d, j0, j1)
                moves.append(self.move(self.ret[d].region(self._expert_rows(i, j0, j1)),
                                       self.back[s].region(self._expert_rows(d, j0, j1)),
                                       self.relay_ret, sum(tiles[j0:j1], []),
                                       f"return r{d}->r{s} g{g} {self._experts_tag(d, j0, j1)}",
                                       counts=(at_d, at_s, []), offset=j0 * self.seg))  # fmt: skip
        return moves

    def combine(self, s: int, finished: list[Task]) -> None:
        waits = self.b.after(s, finished)
        k = self.top_k
        for t0, t1 in split(self.T_loc, self.combine_rows):
            # back holds E * seg rows; a token tile touches k of them per token
            fill = min(1.0, k * (t1 - t0) / (self.E * self.seg))
            for c0, c1 in split(self.H, self.tile_cols):
                routed = [self.back[s].region(cols=(c0, c1))]
                picks = [self.pick_rows[s].region((t0, t1)), self.pick_weights[s].region((t0, t1))]
                out = self.out[s].region((t0, t1), cols=(c0, c1))
                self.b.task(
                    s,
                    Role.COMPUTE,
                    COMBINE,
                    [*routed, *picks],
                    [out],
                    waits=waits,
                    name=f"combine r{s} [{t0}:{t1},{c0}:{c1}]",
                    params={
                        "top_k": k,
                        "expected_rows": k * (t1 - t0),
                        "expected_fill": self._expected_fill([*picks, out], routed, fill),
                    },
                    flops=combine_flops(k * (t1 - t0), c1 - c0),
                )

    def move(self, src: Region, dst: Region, relay: list[Buffer] | None, ready: list[Task],
             name: str, *, unit: int | None = None, offset: int = 0,
             counts: tuple[Region, Region, list[Task]] | None = None) -> Task:  # fmt: skip
        """moe_transport.move with this layout's slots (``unit`` rows, default a block; ``src``
        starts ``offset`` rows into its slot) and, given ``counts`` (at the source, at the
        destination, tasks landing the latter), NVLink legs that move only the filled rows of
        each segment."""
        counted = None if counts is None else Counted(*counts, self.seg, self.fill)
        return move(self.b, src, dst, relay, ready, name, unit or self.block, counted, offset)
