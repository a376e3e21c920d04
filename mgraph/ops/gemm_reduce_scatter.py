"""GEMM + ReduceScatter: ``out = a @ b`` with ``a`` and ``b`` sharded along K, ``out`` along M.

Every rank computes the full partial product of its K shard; rank r ends up with rows
``[r*M/W, (r+1)*M/W)`` of the sum over all ranks. Reductions of early tiles run while later
tiles are still being computed: every stage waits per tile (or per network chunk), never per rank.

Hierarchical movement (default), for a destination d = (node j, local l):
1. node reduce (nvlink): on every node n, the rail peer (n, l) pulls d's rows from the node's G
   partials and sums them (with one node this sum is final and lands in ``out``);
2. rail send (rdma): every (n, l) with n != j sends its node sum of d's rows, in chunks, to d;
3. final reduce (compute): d adds its own node sum and the N-1 received ones into ``out``.
RDMA bytes sent per node = D (N-1)/N for D output bytes: each node's contribution to a row
crosses the network once. With one GPU per node the node sum IS the partial, so stage 1 vanishes.

``hierarchical=False`` is the baseline that ignores the hierarchy: a rail reduce-scatter over the
FULL partials first (every GPU sends node j's rows to its rail peer on node j, which adds the N-1
arrivals to its own), then a node reduce on node j delivers each GPU its rows over NVLink. Every
GPU's partial crosses the network, G times the bytes of the hierarchical variant.

Tile order: every GPU of node n computes the rows of the other nodes first (n+1, n+2, ...) and its
own node's last, so the network starts early; within a node's rows the G destinations are
interleaved tile by tile, so all G node reducers get work at once. On one node, each GPU computes
destination by destination (in L2-friendly bands of tile rows), starting with the next GPU's rows
and ending with its own, and each
GEMM epilogue stores its tile straight into the destination's receive buffer (the push rides on
the tile: collectives.push_reduce), so all GPUs push to different peers at any moment.
"""

from __future__ import annotations

from ..builder import GraphBuilder, edge_tile, piece, require_divisible, shard_range
from ..errors import UnknownNameError
from ..graph import ITEMSIZE, Buffer, Region, Task
from ..kinds import Role, TaskKind
from ..topology import Topology
from .collectives import (
    Tile,
    bounding,
    check_options,
    default_chunk_bytes,
    gemm_tasks,
    group_chunks,
    grouped,
    push_reduce,
    rotated,
    shift,
    tile_grid,
    tile_region,
    unique_tasks,
)
from .registry import OpDef
from .tiles import matmul_reference

OP = "gemm_reduce_scatter"
ALGORITHMS = ("auto", "accumulate", "push")
gemm_reduce_scatter = OpDef(OP, dims=("M", "N", "K"), inputs=("a", "b"), outputs=("out",))

GEMM, REDUCE, COPY = TaskKind.GEMM.value, TaskKind.REDUCE.value, TaskKind.COPY.value
_new = tuple.__new__  # a Region without NamedTuple.__new__ (collectives.tile_region's, inlined)


def _tile_sizes(topology: Topology, M: int, N: int, tile: list[int]) -> tuple[int, int]:
    """Tiles of one rank's output rows; the last tile row and column may be short (masked)."""
    return edge_tile(M // topology.world_size, tile[0]), edge_tile(N, tile[1])


@gemm_reduce_scatter.shapes
def _shapes(
    topology: Topology,
    M: int,
    N: int,
    K: int,
    tile: list[int] = (128, 256),
    chunk_bytes: int | None = None,
    **_: object,
) -> dict[str, tuple]:
    world = topology.world_size
    require_divisible(OP, "K", K, world, "a and b are sharded along K over all ranks")
    require_divisible(OP, "M", M, world, "the output is scattered along M over all ranks")
    _tile_sizes(topology, M, N, list(check_options(OP, tile, chunk_bytes)))
    return {"a": (M, K), "b": (K, N), "out": (M, N)}


gemm_reduce_scatter.reference(matmul_reference)


@gemm_reduce_scatter.min_tasks
def _min_tasks(topology: Topology, M: int, N: int, K: int, tile: list[int] = (128, 256),
               **_: object) -> int:
    """Every rank computes a partial of every output tile (tiles are at most ``tile``)."""
    return topology.world_size * -(-M // tile[0]) * -(-N // tile[1])


@gemm_reduce_scatter.lower
def _lower(
    b: GraphBuilder,
    M: int,
    N: int,
    K: int,
    tile: list[int] = (128, 256),
    hierarchical: bool = True,
    chunk_bytes: int | None = None,
    algorithm: str = "auto",
) -> None:
    topo, world = b.topo, b.world
    if algorithm not in ALGORITHMS:
        raise UnknownNameError(
            f"{OP}: algorithm={algorithm!r}; choose one of {', '.join(ALGORITHMS)}",
            hint="accumulate: GEMM epilogues reduce-add into the owner's output; push: they "
            "store into the owner's receive buffer and the owner sums",
        )
    if algorithm == "auto":  # bit-identical sums need a fixed order: 2 GPUs add commutatively
        algorithm = "accumulate" if topo.nodes == 1 and topo.gpus_per_node == 2 else "push"
    bm, bn = _tile_sizes(topo, M, N, tile)
    b.global_input("a", (M, K))
    b.global_input("b", (K, N))
    b.global_output("out", (M, N))
    a = [
        b.bound_buffer("a", r, "a", [piece((M, K), d1=shard_range(K, r, world))])
        for r in topo.ranks
    ]
    w = [
        b.bound_buffer("b", r, "b", [piece((K, N), d0=shard_range(K, r, world))])
        for r in topo.ranks
    ]
    out = [
        b.bound_buffer("out", r, "out", [piece((M, N), d0=shard_range(M, r, world))], role="output")
        for r in topo.ranks
    ]
    plan = _Plan(b, M // world, N, (bm, bn), default_chunk_bytes(topo, chunk_bytes))
    ks = K // world
    if topo.nodes == 1 and algorithm == "accumulate":
        plan.accumulate(a, w, out, ks)
        return
    if world == 1:  # nothing to reduce: the GEMM's tiles are the output (no partial, no copy)
        gemm_tasks(b, 0, a[0], w[0], ks, plan.gemm_order(0), out[0])
        return
    part = [b.buffer("partial", r, M, N) for r in topo.ranks]
    gemms = [gemm_tasks(b, r, a[r], w[r], ks, plan.gemm_order(r), part[r]) for r in topo.ranks]
    if topo.nodes == 1:
        plan.node_reduce(part, gemms, out)
    elif hierarchical:
        plan.hierarchical(part, gemms, out)
    else:
        plan.flat(part, gemms, out)


class _Plan:
    """The stages of one reduce-scatter; tiles are kept in GLOBAL output rows, and shifted into
    a buffer's local rows where the buffer holds only part of them."""

    def __init__(
        self, b: GraphBuilder, rows: int, cols: int, tile: tuple[int, int], chunk_bytes: int
    ) -> None:
        self.b = b
        self.topo = b.topo
        self.rows = rows  # M / W: output rows per rank
        self.cols = cols
        self.tile = tile
        self.shard_tiles = tile_grid(rows, cols, *tile)  # one rank's rows, local coordinates
        self.itemsize = ITEMSIZE[b.dtype]
        self.chunk_bytes = chunk_bytes
        self.recv: dict[tuple[int, int], Buffer] = {}  # push_reduce's receive buffers
        self._tiles_of: dict[int, list[Tile]] = {}
        self._orders: dict[int, list[Tile]] = {}  # node -> gemm_order of its ranks (>1 node)

    def tiles_of(self, dest: int) -> list[Tile]:
        """Rank ``dest``'s output tiles in global rows (one list per rank: callers only read
        it, and every rank's GEMM order and reduces walk it)."""
        tiles = self._tiles_of.get(dest)
        if tiles is None:
            tiles = self._tiles_of[dest] = [shift(t, dest * self.rows) for t in self.shard_tiles]
        return tiles

    def chunks(self, tiles: list[Tile]) -> list[list[Tile]]:
        return group_chunks(tiles, self.itemsize, self.chunk_bytes)

    def gemm_order(self, rank: int) -> list[Tile]:
        """Other nodes' rows first (rotated), own node's last; destinations interleaved."""
        topo = self.topo
        home = topo.node_of(rank)
        order: list[Tile] = []
        if topo.nodes == 1:
            # Destination by destination, starting with the next GPU's rows and ending with
            # the rank's own: every GPU pushes to a different peer at any moment, and the
            # megakernel runs each destination's tiles as one segment (one TMA descriptor for
            # the store into that peer's receive buffer).
            # Within a destination, bands of 8 tile rows column by column (collectives.grouped,
            # as gemm and gemm_allreduce order theirs): row-major, the tiles running at once
            # spanned every B column block, which no longer fit in L2 at large K (v11: GEMM+RS
            # at 8192x8192x14336 spent 2.97 ms in its GEMM phase, the grouped GEMM alone 2.47).
            members = topo.node_ranks(home)
            local = topo.local_of(rank)
            band = grouped(self.shard_tiles)
            for i in range(1, len(members) + 1):
                d = members[(local + i) % len(members)]
                order.extend(shift(t, d * self.rows) for t in band)
            return order
        # the same for every rank of the node: built once (callers only read it)
        cached = self._orders.get(home)
        if cached is not None:
            return cached
        for j in rotated(topo.nodes, home + 1):
            # tile by tile, the node's destinations interleaved
            for same in zip(*[self.tiles_of(d) for d in topo.node_ranks(j)], strict=True):
                order.extend(same)
        self._orders[home] = order
        return order

    # -- one node, accumulate: GEMM epilogues reduce-add into the owner's output -------------
    def accumulate(self, a: list[Buffer], w: list[Buffer], out: list[Buffer], ks: int) -> None:
        """Every GEMM tile reduce-adds its partial straight into the zeroed output of the rank
        that owns its rows (its own rows: locally) and raises that rank's ``landed`` event; the
        owner's kernel waits for its peers' adds before it ends. No partial, receive or sum."""
        b, topo, rows = self.b, self.topo, self.rows
        for r in topo.ranks:
            out[r].zeroed = True
        landed = {(d, r): b.event(d, f"landed r{r}->r{d}") for d in topo.ranks for r in topo.ranks
                  if d != r}
        for r in topo.ranks:
            for t in self.gemm_order(r):
                d = t[0] // rows
                b.task(
                    r, Role.COMPUTE, GEMM,
                    [a[r].region((t[0], t[1]), (0, ks)), w[r].region((0, ks), (t[2], t[3]))],
                    [tile_region(out[d], shift(t, -d * rows))],
                    signals=[landed[(d, r)]] if d != r else [],
                    params={"accumulate": True},
                    name=f"gemm r{r} [{t[0]}:{t[1]},{t[2]}:{t[3]}] -> r{d}",
                )

    # -- one node: the node reduce is the whole reduce-scatter --------------------------------
    def node_reduce(
        self, src: list[Buffer], ready: list[dict[Tile, Task]], out: list[Buffer]
    ) -> None:
        """Every rank pulls its rows from the node's G source buffers (global rows) into out."""
        b, topo = self.b, self.topo
        for d in topo.ranks:
            members = topo.node_ranks(topo.node_of(d))
            for t in self.tiles_of(d):
                push_reduce(
                    b, d, {p: (tile_region(src[p], t), ready[p][t]) for p in members},
                    tile_region(out[d], shift(t, -d * self.rows)), self.recv, "node-reduce",
                )

    # -- hierarchical: node reduce, then one rail send per (node, destination) ----------------
    def hierarchical(
        self, part: list[Buffer], gemms: list[dict[Tile, Task]], out: list[Buffer]
    ) -> None:
        b, topo, rows = self.b, self.topo, self.rows
        N, G = topo.nodes, topo.gpus_per_node
        # sums[q] holds node(q)'s sum for each destination on q's rail: slot j = rows of (j, l).
        # With G == 1 a node's sum is the partial itself: no copy, the sends read the partial.
        sums = (
            part if G == 1 else [b.buffer("nodesum", q, N * rows, part[q].cols) for q in topo.ranks]
        )
        sum_ready: dict[tuple[int, int], dict[Tile, Task]] = {}  # (holder, dest) -> tile -> task

        def slot(q: int, d: int, t: Tile) -> Tile:
            """Where node(q)'s sum of d's tile ``t`` (global rows) lives in sums[q]."""
            if G == 1:
                return t
            return shift(t, (topo.node_of(d) - d) * rows)

        for q in topo.ranks:
            node, local = topo.node_of(q), topo.local_of(q)
            # per member: its partial's id and GEMM tasks, looked up once (~1k tiles a rank)
            members = [(p, part[p].id, gemms[p]) for p in topo.node_ranks(node)]
            for j in rotated(N, node + 1):
                d = topo.rank(j, local)
                ready = sum_ready[(q, d)] = {}
                if G == 1:
                    for t in self.tiles_of(d):
                        ready[t] = gemms[q][t]
                    continue
                label = f"node-reduce for r{d}"
                sid, off = sums[q].id, (topo.node_of(d) - d) * rows  # slot(q, d, t), hoisted
                for t in self.tiles_of(d):
                    t0, t1, c0, c1 = t
                    ready[t] = push_reduce(
                        b, q, {p: (_new(Region, (pid, *t)), done[t]) for p, pid, done in members},
                        _new(Region, (sid, t0 + off, t1 + off, c0, c1)), self.recv, label,
                    )
        recv: dict[tuple[int, int], Buffer] = {}  # (dest, source node) -> landing buffer
        arrived: dict[tuple[int, int], dict[Tile, Task]] = {}  # (dest, source node) -> tile -> send
        for q in topo.ranks:
            node, local = topo.node_of(q), topo.local_of(q)
            for j in rotated(N, node + 1)[:-1]:  # every node but q's own
                d = topo.rank(j, local)
                recv[(d, node)] = b.buffer(f"from_node{node}", d, rows, out[d].cols)
                landed = arrived[(d, node)] = {}
                for chunk in self.chunks(self.tiles_of(d)):
                    box = bounding(chunk)
                    send = b.task(
                        q,
                        Role.RDMA,
                        COPY,
                        [tile_region(sums[q], slot(q, d, box))],
                        [tile_region(recv[(d, node)], shift(box, -d * rows))],
                        waits=b.after(q, unique_tasks(sum_ready[(q, d)][t] for t in chunk)),
                        name=f"rail-send r{q}->r{d} [{box[0]}:{box[1]},{box[2]}:{box[3]}]",
                    )
                    for t in chunk:
                        landed[t] = send
        for d in topo.ranks:
            home = topo.node_of(d)
            others = [n for n in rotated(N, home + 1) if n != home]
            for t in self.tiles_of(d):
                local_t = shift(t, -d * rows)
                b.task(
                    d,
                    Role.COMPUTE,
                    REDUCE,
                    [tile_region(sums[d], slot(d, d, t))]
                    + [tile_region(recv[(d, n)], local_t) for n in others],
                    [tile_region(out[d], local_t)],
                    waits=b.after(d, [sum_ready[(d, d)][t], *(arrived[(d, n)][t] for n in others)]),
                    name=f"final-reduce r{d} [{t[0]}:{t[1]},{t[2]}:{t[3]}]",
                )

    # -- flat baseline: rail reduce-scatter of the full partials, then node reduce ------------
    def flat(self, part: list[Buffer], gemms: list[dict[Tile, Task]], out: list[Buffer]) -> None:
        b, topo, rows = self.b, self.topo, self.rows
        N, G = topo.nodes, topo.gpus_per_node
        node_rows = G * rows

        def of_node(j: int) -> list[Tile]:
            # The node's rows tiled rank by rank, as the GEMMs are: with a short last tile row
            # per rank, tiling the node's rows as one block would cut different tiles.
            return [t for d in topo.node_ranks(j) for t in self.tiles_of(d)]

        recv: dict[tuple[int, int], Buffer] = {}
        arrived: dict[tuple[int, int], dict[Tile, Task]] = {}  # (rail peer, source node) -> tile
        for r in topo.ranks:
            node, local = topo.node_of(r), topo.local_of(r)
            for j in rotated(N, node + 1)[:-1]:
                q = topo.rank(j, local)
                recv[(q, node)] = b.buffer(f"from_node{node}", q, node_rows, part[q].cols)
                landed = arrived[(q, node)] = {}
                for chunk in self.chunks(of_node(j)):
                    box = bounding(chunk)
                    send = b.task(
                        r,
                        Role.RDMA,
                        COPY,
                        [tile_region(part[r], box)],
                        [tile_region(recv[(q, node)], shift(box, -j * node_rows))],
                        waits=b.after(r, unique_tasks(gemms[r][t] for t in chunk)),
                        name=f"rail-send r{r}->r{q} [{box[0]}:{box[1]},{box[2]}:{box[3]}]",
                    )
                    for t in chunk:
                        landed[t] = send
        # The rail sum of node j's rows on (j, l); with G == 1 that is d's final rows already.
        railsum = (
            out if G == 1 else [b.buffer("railsum", q, node_rows, part[q].cols) for q in topo.ranks]
        )
        rail_done: list[dict[Tile, Task]] = [{} for _ in topo.ranks]
        for q in topo.ranks:
            home = topo.node_of(q)
            others = [n for n in rotated(N, home + 1) if n != home]
            for t in of_node(home):
                local_t = shift(t, -home * node_rows)
                rail_done[q][t] = b.task(
                    q,
                    Role.COMPUTE,
                    REDUCE,
                    [tile_region(part[q], t)]
                    + [tile_region(recv[(q, n)], local_t) for n in others],
                    [tile_region(railsum[q], local_t)],
                    waits=b.after(q, [gemms[q][t], *(arrived[(q, n)][t] for n in others)]),
                    name=f"rail-reduce r{q} [{t[0]}:{t[1]},{t[2]}:{t[3]}]",
                )
        if G == 1:
            return
        for d in topo.ranks:
            home = topo.node_of(d)
            members = topo.node_ranks(home)
            for t in self.tiles_of(d):
                push_reduce(
                    b, d,
                    {p: (tile_region(railsum[p], shift(t, -home * node_rows)), rail_done[p][t])
                     for p in members},
                    tile_region(out[d], shift(t, -d * rows)), self.recv, "node-reduce",
                )
