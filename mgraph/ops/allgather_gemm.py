"""AllGather + GEMM: ``out = a @ b`` with ``a`` sharded along M, ``b`` and ``out`` along N.

Rank r holds rows ``[r*M/W, (r+1)*M/W)`` of ``a`` and columns ``[r*N/W, (r+1)*N/W)`` of ``b``; it
gathers all of ``a`` into a scratch buffer and computes its columns of ``out`` from it. GEMM tiles
start as soon as the rows they read have arrived: each tile waits only for the network chunks of
``a`` it reads, so the gather hides behind the GEMM.

Hierarchical movement (default): a shard crosses the network once per destination node. The owner
(n, l) pushes each chunk of its shard over NVLink to its node peers, and over RDMA to its rail
peer (n', l) on every other node, which forwards the chunk over NVLink to its own node peers.
Every NVLink push or forward is one copy task per (chunk, peer), starting with the next GPU.
RDMA bytes sent per node = A (N-1)/N for A bytes of ``a``. A rank's own shard is read straight
from its input buffer, never copied.

``gather="peer"``: GEMM tiles read a node peer's shard straight from the peer's input buffer
with TMA over NVLink (no copy, no wait; the entry barrier orders the peer's input before the
reads); ``"copy"`` (default) has NVLink workers copy it into ``a_gathered`` first.

``hierarchical=False`` is the baseline that ignores the hierarchy: the owner sends one copy per
destination GPU of each other node to its rail peer there (G copies cross each node boundary),
and the rail peer forwards each copy to its destination over NVLink: G times the RDMA bytes.

Tile order on rank r: its own shard first (no waiting), then its node peers' shards (NVLink,
fast), then the remote shards by node (n+1, n+2, ...), the rail peer's shard first in each node
(it lands on r directly, one hop earlier than the forwarded ones). Within a node the order runs
down from r's local index l (l-1, l-2, ...): every GPU pushes and forwards to l+1 first.
"""

from __future__ import annotations

from collections.abc import Iterator

from ..builder import GraphBuilder, edge_tile, piece, require_divisible, shard_range
from ..errors import UnknownNameError
from ..graph import ITEMSIZE, Buffer, Region, Task
from ..kinds import Role, TaskKind
from ..topology import Topology
from .collectives import (
    check_options,
    gemm_flops,
    grouped,
    rotated,
    row_chunks,
    tile_grid,
    unique_tasks,
)
from .registry import OpDef
from .tiles import matmul_reference

OP = "allgather_gemm"
GATHERS = ("copy", "peer")
allgather_gemm = OpDef(OP, dims=("M", "N", "K"), inputs=("a", "b"), outputs=("out",))

GEMM, COPY = TaskKind.GEMM.value, TaskKind.COPY.value
_COMPUTE, _NVLINK = Role.COMPUTE.value, Role.NVLINK.value  # plain strings for the hot loops
_new = tuple.__new__  # a Region without NamedTuple.__new__ (3x slower)

Rows = tuple[int, int]  # a row range of one shard, in the shard's local rows


def _tile_sizes(topology: Topology, M: int, N: int, tile: list[int]) -> tuple[int, int]:
    """Tiles of one shard's rows x one rank's columns; the last tile row and column may be
    short (masked)."""
    world = topology.world_size
    return edge_tile(M // world, tile[0]), edge_tile(N // world, tile[1])


@allgather_gemm.shapes
def _shapes(
    topology: Topology,
    M: int,
    N: int,
    K: int,
    tile: list[int] = (128, 256),
    chunk_bytes: int = 1024 * 1024,
    **_: object,
) -> dict[str, tuple]:
    world = topology.world_size
    require_divisible(OP, "M", M, world, "a is sharded along M over all ranks")
    require_divisible(OP, "N", N, world, "b and out are sharded along N over all ranks")
    _tile_sizes(topology, M, N, list(check_options(OP, tile, chunk_bytes)))
    return {"a": (M, K), "b": (K, N), "out": (M, N)}


allgather_gemm.reference(matmul_reference)


@allgather_gemm.min_tasks
def _min_tasks(topology: Topology, M: int, N: int, K: int, tile: list[int] = (128, 256),
               **_: object) -> int:
    """Every output tile is computed once, by the rank owning its columns."""
    return -(-M // tile[0]) * -(-N // tile[1])


@allgather_gemm.lower
def _lower(
    b: GraphBuilder,
    M: int,
    N: int,
    K: int,
    tile: list[int] = (128, 256),
    hierarchical: bool = True,
    chunk_bytes: int = 1024 * 1024,
    gather: str = "copy",
) -> None:
    topo, world = b.topo, b.world
    if gather not in GATHERS:
        raise UnknownNameError(
            f"{OP}: gather={gather!r}; choose one of {', '.join(GATHERS)}",
            hint="copy: NVLink workers copy node peers' shards; peer: GEMM tiles load them "
            "from the peer's memory through TMA",
        )
    bm, bn = _tile_sizes(topo, M, N, tile)
    rows, cols = M // world, N // world
    b.global_input("a", (M, K))
    b.global_input("b", (K, N))
    b.global_output("out", (M, N))
    a = [
        b.bound_buffer("a", r, "a", [piece((M, K), d0=shard_range(M, r, world))])
        for r in topo.ranks
    ]
    w = [
        b.bound_buffer("b", r, "b", [piece((K, N), d1=shard_range(N, r, world))])
        for r in topo.ranks
    ]
    out = [
        b.bound_buffer("out", r, "out", [piece((M, N), d1=shard_range(N, r, world))], role="output")
        for r in topo.ranks
    ]
    # Global rows of a; the rows of the rank's own shard stay unwritten (read from ``a``).
    gathered = [b.buffer("a_gathered", r, M, K) for r in topo.ranks]
    chunks = row_chunks(rows, K * ITEMSIZE[b.dtype], bm, chunk_bytes)
    mover = _Gather(b, rows, chunks, a, gathered)
    if gather == "copy":
        mover.node_push()
    if hierarchical:
        mover.rail_hierarchical()
    else:
        mover.rail_flat()
    shard_tiles = tile_grid(rows, cols, bm, bn)  # one shard's rows x one rank's columns
    # The node's shards in L2-friendly bands of tile rows (collectives.grouped, gemm's order):
    # row-major, the tiles running at once spanned every B column block, which no longer fit
    # in L2 at large K (v11: AG+GEMM 8192x8192x14336, 0.86x). Other nodes' shards stay
    # row-major: they arrive chunk by chunk over the network, and a band would wait for 8.
    banded = grouped(shard_tiles)
    for r in topo.ranks:
        b.tasks_made(r, _COMPUTE, GEMM, _gemm_specs(b, r, K, rows, a, w, out, gathered, mover, gather,
                                                    banded, shard_tiles))  # fmt: skip


def _gemm_specs(
    b: GraphBuilder,
    r: int,
    K: int,
    rows: int,
    a: list[Buffer],
    w: list[Buffer],
    out: list[Buffer],
    gathered: list[Buffer],
    mover: _Gather,
    gather: str,
    banded: list[tuple[int, int, int, int]],
    shard_tiles: list[tuple[int, int, int, int]],
) -> Iterator[tuple[list[Region], list[Region], list[tuple[int, int]], str, float]]:
    """Rank ``r``'s GEMM tiles, shard by shard, as GraphBuilder.tasks_made's specs: hot (~15k
    tiles in a 2x8 layer), so regions are made directly (validation checks their bounds) and
    the flops hint once per tile shape (as collectives.gemm_tasks does)."""
    topo = b.topo
    cost: dict[tuple[int, int], float] = {}
    wid, oid = w[r].id, out[r].id
    for s in gemm_shard_order(topo, r):
        # gather="peer": a node peer's shard is read where it lies (its input buffer,
        # written before the launch: the entry barrier orders it), no copy and no wait.
        direct = s == r or (gather == "peer" and topo.node_of(s) == topo.node_of(r))
        src = a[s].id if direct else gathered[r].id
        offset = 0 if direct else s * rows
        base = s * rows  # the shard's first row of out
        # the waits of a row band, joined once for its column tiles (b.after gives the same
        # event for the same arrivals; each task copies the list)
        band_waits: dict[tuple[int, int], list[tuple[int, int]]] = {}
        for t0, t1, c0, c1 in banded if topo.node_of(s) == topo.node_of(r) else shard_tiles:
            waits = ()
            if not direct:
                waits = band_waits.get((t0, t1))
                if waits is None:
                    waits = band_waits[(t0, t1)] = b.after(
                        r, unique_tasks(mover.arrivals(r, s, (t0, t1)))
                    )
            flops = cost.get((t1 - t0, c1 - c0))
            if flops is None:
                flops = cost[(t1 - t0, c1 - c0)] = gemm_flops(t1 - t0, c1 - c0, K)
            yield (
                [_new(Region, (src, offset + t0, offset + t1, 0, K)),
                 _new(Region, (wid, 0, K, c0, c1))],
                [_new(Region, (oid, base + t0, base + t1, c0, c1))],
                waits,
                f"gemm r{r} shard {s} [{base + t0}:{base + t1},{c0}:{c1}]",
                flops,
            )  # fmt: skip


def gemm_shard_order(topo: Topology, rank: int) -> list[int]:
    """The shards of ``a`` in the order rank ``rank`` consumes them: own, node-local, remote;
    within a node from local index l down (l-1, l-2, ...), the order the copies arrive in: the
    scheduler's push rotation queues every GPU's copies to l+1 before those to l+2 (at 2x8
    M=K=32768 folding upwards simulated at 22.7 ms, downwards at 20.0 ms)."""
    node, local, G = topo.node_of(rank), topo.local_of(rank), topo.gpus_per_node
    down = [(local - i) % G for i in range(G)]
    order = [topo.rank(node, g) for g in down]
    for n in rotated(topo.nodes, node + 1)[:-1]:
        order += [topo.rank(n, g) for g in down]
    return order


class _Gather:
    """Emits the movement of every shard's chunks and remembers which task lands each chunk on
    each rank, so a GEMM tile waits for exactly the chunks it reads."""

    def __init__(
        self,
        b: GraphBuilder,
        rows: int,
        chunks: list[Rows],
        a: list[Buffer],
        gathered: list[Buffer],
    ) -> None:
        self.b = b
        self.topo = b.topo
        self.rows = rows
        self.chunks = chunks
        self.a = a
        self.gathered = gathered
        self.landed: dict[tuple[int, int, Rows], Task] = {}  # (rank, shard, chunk) -> writer

    def arrivals(self, rank: int, shard: int, rows: Rows) -> list[Task]:
        """The tasks that land the chunks of ``shard`` overlapping ``rows`` on ``rank``."""
        return [
            self.landed[(rank, shard, c)] for c in self.chunks if c[0] < rows[1] and rows[0] < c[1]
        ]

    def _global(self, shard: int, chunk: Rows) -> Rows:
        return (shard * self.rows + chunk[0], shard * self.rows + chunk[1])

    def _forward(
        self,
        src: Buffer,
        src_rows: Rows,
        via: Task,
        to: list[int],
        shard: int,
        chunk: Rows,
        label: str,
    ) -> None:
        """One NVLink copy per ``to`` rank, on ``src``'s rank, of a landed chunk into that rank's
        gather (see :meth:`node_push` for why per peer)."""
        b = self.b
        if not to:
            return
        dst_rows = self._global(shard, chunk)
        waits = b.after(src.rank, [via])
        region = src.region(src_rows)  # one region object, read by every copy
        for p in to:
            self.landed[(p, shard, chunk)] = b.task(
                src.rank,
                _NVLINK,
                COPY,
                [region],
                [self.gathered[p].region(dst_rows)],
                waits=waits,
                name=f"{label} r{src.rank} shard {shard} rows {dst_rows[0]}:{dst_rows[1]}"
                + _to(p, to),
            )

    def node_push(self) -> None:
        """Every owner pushes each chunk of its shard to its node peers (input: no wait), one
        NVLink copy per (chunk, peer). One copy into all G-1 peers was one worker moving G-1
        chunks in a row (at 2x8 every NVLink task wrote 7 peers); per peer, the SM partition
        and the controller can give the G-1 copies G-1 workers, and a peer's GEMM tile waits
        only for the copy that lands its rows there (``b.after`` on that peer joins that copy
        alone). Owner l starts with peer l+1, so a node's owners start on different peers."""
        b, topo = self.b, self.topo
        if topo.gpus_per_node == 1:
            return
        for s in topo.ranks:
            node, local = topo.node_of(s), topo.local_of(s)
            peers = [topo.rank(node, g) for g in rotated(topo.gpus_per_node, local)[1:]]
            for c in self.chunks:
                rows = self._global(s, c)
                src = self.a[s].region(c)  # one region object, read by every peer's copy
                for p in peers:
                    self.landed[(p, s, c)] = b.task(
                        s,
                        _NVLINK,
                        COPY,
                        [src],
                        [self.gathered[p].region(rows)],
                        name=f"node-push r{s} shard {s} rows {rows[0]}:{rows[1]}" + _to(p, peers),
                    )

    def _send(self, s: int, c: Rows, dst: Buffer, dst_rows: Rows, why: str) -> Task:
        return self.b.task(
            s,
            Role.RDMA,
            COPY,
            [self.a[s].region(c)],
            [dst.region(dst_rows)],
            name=f"rail-send r{s}->r{dst.rank} shard {s} rows {dst_rows[0]}:{dst_rows[1]}{why}",
        )

    def rail_hierarchical(self) -> None:
        """Each chunk goes once to the owner's rail peer on every other node, which forwards it
        to its node peers. Chunk-major, so every node receives the first rows first."""
        topo = self.topo
        sends: list[tuple[int, Rows, int, Task]] = []
        for s in topo.ranks:
            node, local = topo.node_of(s), topo.local_of(s)
            for c in self.chunks:
                for n in rotated(topo.nodes, node + 1)[:-1]:
                    peer = topo.rank(n, local)
                    send = self._send(s, c, self.gathered[peer], self._global(s, c), "")
                    self.landed[(peer, s, c)] = send
                    sends.append((s, c, peer, send))
        for s, c, peer, send in sends:
            node, local = topo.node_of(peer), topo.local_of(peer)
            to = [topo.rank(node, g) for g in rotated(topo.gpus_per_node, local)[1:]]
            self._forward(self.gathered[peer], self._global(s, c), send, to, s, c, "forward")

    def rail_flat(self) -> None:
        """One copy per destination GPU crosses the network: the rail peer keeps its own copy
        and forwards each other one, from a relay buffer per destination, over NVLink."""
        b, topo = self.b, self.topo
        relay: dict[tuple[int, int], Buffer] = {}  # (rail peer, destination local) -> buffer
        sends: list[tuple[int, Rows, int, Task]] = []
        for s in topo.ranks:
            node, local = topo.node_of(s), topo.local_of(s)
            for c in self.chunks:
                for n in rotated(topo.nodes, node + 1)[:-1]:
                    peer = topo.rank(n, local)
                    for g in rotated(topo.gpus_per_node, local):
                        dest = topo.rank(n, g)
                        if dest == peer:
                            send = self._send(s, c, self.gathered[peer], self._global(s, c), "")
                            self.landed[(peer, s, c)] = send
                            continue
                        key = (peer, g)
                        if key not in relay:
                            # Indexed by global rows of a, like the gather, for plain bookkeeping;
                            # only the rows of shards relayed to ``dest`` are used.
                            relay[key] = b.buffer(f"relay_to{g}", peer, *self.gathered[peer].shape)
                        rows = self._global(s, c)
                        sends.append(
                            (s, c, dest, self._send(s, c, relay[key], rows, f" for r{dest}"))
                        )
        for s, c, dest, send in sends:
            src = send.writes[0]
            peer = self.b.buffers[src.buffer]
            self._forward(peer, (src.row0, src.row1), send, [dest], s, c, "relay")


def _to(peer: int, peers: list[int]) -> str:
    """The destination named in a copy's name where the chunk goes to several peers; with one
    peer (1x2) the name stays what the pinned single-node schedules hash
    (tests/test_schedule_pin.py)."""
    return f" -> r{peer}" if len(peers) > 1 else ""
