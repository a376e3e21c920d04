"""MoE dispatch + experts + combine with expert parallelism (Mixtral-style top-k SwiGLU layer).

Tokens ``x [T, H]`` and ``router_logits [T, E]`` are sharded along T (rank r holds T_loc = T/W
rows); expert weights are sharded along E (rank r owns E_loc = E/W experts). ``out [T, H]`` is
sharded like ``x``. Per token: weights, experts = softmax over its top_k logits; out = sum of
weight * SwiGLU_expert(x).

Lowering (a static graph; the CONTENTS of its buffers are data-dependent, see moe_tiles.py):
1. route (compute, source s): top-k, then pack ``x`` rows into ``send[s]``, one segment of T_loc
   rows per global expert (worst-case capacity: nothing is dropped), plus fp32 metadata rows and
   ``counts[s]`` [W, E_loc], the filled rows of each segment (row d: destination d's experts).
   Segments of destination d's experts are contiguous: one block per (s, d) pair.
2. dispatch: d's row of the counts, then the block and its metadata, go to ``recv[d]`` (slot of
   s). Inside a node: an NVLink ``moe_move`` that copies only the filled rows of each segment.
   Across nodes: RDMA to s's rail peer on d's node (the only peers a rail network joins), which
   forwards over NVLink (a ``moe_move`` reading the count that landed at d), or lands directly
   when that rail peer is d. The RDMA legs move whole blocks: the proxy encodes its WRITEs at
   launch from static regions, so a count-sized WRITE needs the proxy to read the count.
3. experts (compute, d): one task per (source, local expert, row tile) computes the SwiGLU expert
   on the tile's filled rows (its segment's count); a tile past the count returns at once. Tiles
   of one source start as soon as that source's block arrived. Rows of d's own tokens never
   leave d: their tiles read ``send[d]`` and write ``back[d]``.
4. return: ``ret[d]`` slot of s goes back to ``back[s]`` by the reverse path (filled rows only on
   NVLink legs, which read s's own counts).
5. combine (compute, s, one task per column tile): out[token] += weight * y over the token's k
   rows: the filled rows of s's segments (its counts) and s's own metadata.

No host synchronisation: counts are data in the graph's buffers. Buffers stay capacity-sized
(static regions); traffic follows the routing.

Cost hints: an expert tile's flops use the EXPECTED routed rows (T_loc * top_k / E per source and
expert, packed at the front of the segment as the route tile packs them), not its capacity. Tasks
whose bytes follow the routing carry ``params["expected_fill"]``: the expected fraction of their
region bytes that is really touched (top_k / E of a capacity block). It is an expectation for a
uniform router, not a measurement: the simulator has no data (runtime/sim/model.py reads it).
"""

from __future__ import annotations

import torch

from ..builder import GraphBuilder, pick_tile, piece, shard_range, split
from ..errors import ShapeError
from ..graph import ITEMSIZE, Buffer, Region, Task, torch_dtype
from ..kinds import Role, TaskKind
from ..topology import Topology
from .moe_tiles import META_COLS, combine_flops, expert_flops, route_topk, swiglu
from .moe_transport import Counted, move
from .registry import OpDef

moe_dispatch_combine = OpDef(
    "moe_dispatch_combine",
    dims=("T", "H", "E", "top_k", "F"),
    inputs=("x", "router_logits", "w_gate", "w_up", "w_down"),
    outputs=("out",),
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
    }


@moe_dispatch_combine.reference
def _reference(
    x: torch.Tensor,
    router_logits: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    top_k: int,
    **_: object,
) -> dict[str, torch.Tensor]:
    weights, experts = route_topk(router_logits, top_k)
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in range(w_gate.shape[0]):
        token, slot = (experts == e).nonzero(as_tuple=True)
        if token.numel():
            y = swiglu(x[token], w_gate[e], w_up[e], w_down[e])
            out.index_add_(0, token, y * weights[token, slot, None])
    return {"out": out.to(x.dtype)}


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
    expert_rows: int = 64,
    combine_cols: int = 256,
) -> None:
    for name, value in (("expert_rows", expert_rows), ("combine_cols", combine_cols)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ShapeError(f"{OP}: {name}={value!r} must be a positive int")
    _Lowering(b, T, H, E, top_k, F, expert_rows, combine_cols).run()


class _Lowering:
    """The five stages of the module docstring, sharing the per-rank buffers."""

    def __init__(
        self, b: GraphBuilder, T: int, H: int, E: int, top_k: int, F: int, rows: int, cols: int
    ) -> None:
        self.b, self.topo, self.world = b, b.topo, b.world
        self.H, self.E, self.F, self.top_k = H, E, F, top_k
        self.T_loc, self.E_loc = T // self.world, E // self.world
        self.tile_rows = pick_tile(OP, "T/W", self.T_loc, rows)
        self.tile_cols = pick_tile(OP, "H", H, cols)
        self.block = self.E_loc * self.T_loc  # rows one (source, destination) pair exchanges
        self.fill = top_k / E  # expected filled rows / capacity rows of a segment

    def run(self) -> None:
        self.declare()
        routes = [self.route(r) for r in self.topo.ranks]
        arrivals = {
            (s, d): self.dispatch(s, d, routes[s])
            for s in self.topo.ranks
            for d in self.topo.ranks
            if s != d
        }
        finished: list[list[Task]] = [[] for _ in self.topo.ranks]  # writers of back[s]
        for d in self.topo.ranks:
            for s in self._sources(d):
                ready = [routes[d]] if s == d else arrivals[(s, d)]
                tiles = self.experts(d, s, ready)
                finished[s] += tiles if s == d else [self.give_back(d, s, tiles)]
        for s in self.topo.ranks:
            self.combine(s, finished[s])

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

    def _expected_fill(self, whole: list[Region], routed: list[Region]) -> float:
        """Expected touched fraction of a task's bytes: ``whole`` regions are touched entirely,
        ``routed`` ones (capacity-sized) by ``self.fill``."""
        fixed = sum(self._nbytes(r) for r in whole)
        varying = sum(self._nbytes(r) for r in routed)
        return (fixed + varying * self.fill) / (fixed + varying)

    def _sources(self, d: int) -> list[int]:
        """Sources in expected arrival order: own rows, then node peers, then remote ranks."""
        topo, node = self.topo, self.topo.node_of(d)
        peers = [s for s in topo.ranks if s != d and topo.node_of(s) == node]
        return [d, *peers, *(s for s in topo.ranks if topo.node_of(s) != node)]

    # -- stages -------------------------------------------------------------------------------
    def route(self, s: int) -> Task:
        reads = [self.x[s].region(), self.logits[s].region()]
        packed = [self.send[s].region(), self.send_meta[s].region()]
        counts = self.counts[s].region()
        return self.b.task(
            s,
            Role.COMPUTE,
            ROUTE,
            reads,
            [*packed, counts],
            name=f"route r{s}",
            params={
                "top_k": self.top_k,
                "experts_per_rank": self.E_loc,
                "expected_fill": self._expected_fill([*reads, counts], packed),
            },
        )

    def dispatch(self, s: int, d: int, route: Task) -> list[Task]:
        """The tasks after which d's block from s (counts, rows, metadata) is in recv[d]."""
        src_rows, dst_rows = self._slot_rows(d), self._peer_slot(d, s)
        at_src = self.counts[s].region((d, d + 1))
        at_dst = self.recv_counts[d].region((self._peer_index(d, s), self._peer_index(d, s) + 1))
        count = self.move(
            at_src, at_dst, self.relay_counts, [route], f"dispatch-counts r{s}->r{d}", unit=1
        )
        counts = (at_src, at_dst, [count])
        return [
            count,
            self.move(
                self.send[s].region(src_rows),
                self.recv[d].region(dst_rows),
                self.relay,
                [route],
                f"dispatch r{s}->r{d}",
                counts=counts,
            ),
            self.move(
                self.send_meta[s].region(src_rows),
                self.recv_meta[d].region(dst_rows),
                self.relay_meta,
                [route],
                f"dispatch-meta r{s}->r{d}",
                counts=counts,
            ),
        ]

    def experts(self, d: int, s: int, ready: list[Task]) -> list[Task]:
        """Expert tiles on d for the rows s sent; they write back[d] (own) or ret[d]."""
        T_loc, H, F = self.T_loc, self.H, self.F
        if s == d:
            rows, meta, out, base = self.send[d], self.send_meta[d], self.back[d], d * self.block
            counts, slot = self.counts[d], d
        else:
            rows, meta, out = self.recv[d], self.recv_meta[d], self.ret[d]
            base = self._peer_slot(d, s)[0]
            counts, slot = self.recv_counts[d], self._peer_index(d, s)
        expected = T_loc * self.top_k / self.E  # per (source, expert); <= T_loc as top_k <= E
        waits = self.b.after(d, ready)
        tiles = []
        for j in range(self.E_loc):
            weights = [
                self.w_gate[d].region((j * H, (j + 1) * H)),
                self.w_up[d].region((j * H, (j + 1) * H)),
                self.w_down[d].region((j * F, (j + 1) * F)),
            ]
            count = counts.region((slot, slot + 1), cols=(j, j + 1))
            for r0, r1 in split(T_loc, self.tile_rows):
                # The route tile packs routed rows at the front of a segment.
                rows_expected = min(max(expected - r0, 0.0), float(r1 - r0))
                span = (base + j * T_loc + r0, base + j * T_loc + r1)
                tiles.append(
                    self.b.task(
                        d,
                        Role.COMPUTE,
                        EXPERT,
                        [rows.region(span), meta.region(span), count, *weights],
                        [out.region(span)],
                        waits=waits,
                        name=f"expert r{d} e{d * self.E_loc + j} from r{s} [{r0}:{r1}]",
                        params={"local_expert": j, "row0": r0, "expected_rows": rows_expected},
                        flops=expert_flops(rows_expected, H, F),
                    )
                )
        return tiles

    def give_back(self, d: int, s: int, tiles: list[Task]) -> Task:
        """The expert outputs d computed for s, back into s's ``back`` buffer."""
        i = self._peer_index(d, s)
        # The counts are at both ends already: d received them, s wrote them.
        counts = (self.recv_counts[d].region((i, i + 1)), self.counts[s].region((d, d + 1)), [])
        return self.move(
            self.ret[d].region(self._peer_slot(d, s)),
            self.back[s].region(self._slot_rows(d)),
            self.relay_ret,
            tiles,
            f"return r{d}->r{s}",
            counts=counts,
        )

    def combine(self, s: int, finished: list[Task]) -> None:
        waits = self.b.after(s, finished)
        expected = self.T_loc * self.top_k  # routed rows of s's tokens, wherever they are
        for c0, c1 in split(self.H, self.tile_cols):
            routed = [self.back[s].region(cols=(c0, c1)), self.send_meta[s].region()]
            whole = [self.counts[s].region(), self.out[s].region(cols=(c0, c1))]
            self.b.task(
                s,
                Role.COMPUTE,
                COMBINE,
                [*routed, whole[0]],
                [whole[1]],
                waits=waits,
                name=f"combine r{s} [:,{c0}:{c1}]",
                params={
                    "expected_rows": expected,
                    "expected_fill": self._expected_fill(whole, routed),
                },
                flops=combine_flops(expected, c1 - c0),
            )

    def move(self, src: Region, dst: Region, relay: list[Buffer] | None, ready: list[Task],
             name: str, *, unit: int | None = None,
             counts: tuple[Region, Region, list[Task]] | None = None) -> Task:  # fmt: skip
        """moe_transport.move with this layout's slots (``unit`` rows, default a block) and,
        given ``counts`` (at the source, at the destination, tasks landing the latter), NVLink
        legs that move only the filled rows of each segment."""
        counted = None if counts is None else Counted(*counts, self.T_loc, self.fill)
        return move(self.b, src, dst, relay, ready, name, unit or self.block, counted)
