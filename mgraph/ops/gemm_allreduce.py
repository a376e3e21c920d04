"""GEMM + AllReduce: ``out = a @ b`` on every rank, with ``a`` and ``b`` sharded along K.

Every rank computes partial output tiles from its K shard; the partial sums are all-reduced while
later tiles are still being computed.

Hierarchical movement (default): the output tiles are cut into G x N contiguous slots (G GPUs per
node, N nodes); slot (l, j) belongs to local GPU l on every node and is finally reduced on node j.
1. node reduce: on every node, the other GPUs push their partials of GPU l's slot tiles to it
   over NVLink and GPU l adds the G tiles (compute);
2. rail reduce-scatter (rdma): node sums of slot (l, j) go, in chunks, to the rail peer (j, l),
   which adds the N node sums (compute);
3. rail all-gather (rdma): (j, l) sends the finished chunks back to its rail peers;
4. node broadcast (nvlink): GPU l of each node pushes the finished tiles to its node peers, one
   copy task per (piece, peer); a piece is ``broadcast_bytes`` of consecutive tiles (default:
   ``chunk_bytes`` on one node, at most 256 KiB on several, where ``chunk_bytes``, the network
   chunk, is 1 MiB by default: collectives.default_chunk_bytes).
RDMA bytes sent per node = 2 D (N-1)/N for D output bytes: exactly D on 2 nodes. ``hierarchical=
False`` runs the rail stages on the full partials first (every GPU's partial crosses the network)
and the node stages after, moving G times more over RDMA: the baseline the design improves on.
"""

from __future__ import annotations

from ..builder import GraphBuilder, edge_tile, piece, require_divisible, shard_range
from ..errors import UnknownNameError
from ..graph import ITEMSIZE, Buffer, Task
from ..kinds import Role, TaskKind
from ..topology import Topology
from .collectives import (
    NODE_CHUNK_BYTES,
    Tile,
    bounding,
    default_chunk_bytes,
    gemm_task,
    group_chunks,
    grouped,
    partition,
    push_reduce,
    tile_grid,
    tile_region,
    unique_tasks,
)
from .registry import OpDef
from .tiles import matmul_reference

gemm_allreduce = OpDef("gemm_allreduce", dims=("M", "N", "K"), inputs=("a", "b"), outputs=("out",))

GEMM, REDUCE, COPY = TaskKind.GEMM.value, TaskKind.REDUCE.value, TaskKind.COPY.value


@gemm_allreduce.shapes
def _shapes(topology: Topology, M: int, N: int, K: int, **_: object) -> dict[str, tuple]:
    world = topology.world_size
    require_divisible("gemm_allreduce", "K", K, world, "a and b are sharded along K")
    return {"a": (M, K), "b": (K, N), "out": (M, N)}


gemm_allreduce.reference(matmul_reference)


@gemm_allreduce.min_tasks
def _min_tasks(topology: Topology, M: int, N: int, K: int, tile: list[int] = (128, 256),
               **_: object) -> int:
    """Every rank computes a partial of every output tile."""
    return topology.world_size * -(-M // tile[0]) * -(-N // tile[1])


@gemm_allreduce.lower
def _lower(
    b: GraphBuilder,
    M: int,
    N: int,
    K: int,
    tile: list[int] = (128, 256),
    hierarchical: bool = True,
    chunk_bytes: int | None = None,
    algorithm: str = "auto",
    broadcast_bytes: int | None = None,
) -> None:
    topo, world = b.topo, b.world
    algorithm = node_algorithm(topo, M, N, K, ITEMSIZE[b.dtype], algorithm)
    bm, bn = edge_tile(M, tile[0]), edge_tile(N, tile[1])  # edge tiles are short, masked
    b.global_input("a", (M, K))
    b.global_input("b", (K, N))
    b.global_output("out", (M, N))
    a = [b.bound_buffer("a", r, "a", [piece((M, K), d1=shard_range(K, r, world))]) for r in topo.ranks]
    w = [b.bound_buffer("b", r, "b", [piece((K, N), d0=shard_range(K, r, world))]) for r in topo.ranks]
    out = [b.bound_buffer("out", r, "out", [piece((M, N))], role="output") for r in topo.ranks]
    tiles = tile_grid(M, N, bm, bn)
    itemsize = ITEMSIZE[b.dtype]
    ks = K // world
    if world == 1:  # nothing to reduce: the GEMM's tiles are the output (no partial, no copy)
        for t in grouped(tiles):
            gemm_task(b, 0, a[0], w[0], ks, t, out[0])
        return
    part = [b.buffer("partial", r, M, N) for r in topo.ranks]

    gemms: list[dict[Tile, Task]] = []
    slots = partition(tiles, topo.gpus_per_node)  # the node-reduce owners' slots
    for r in topo.ranks:
        row: dict[Tile, Task] = {}
        # Emission order is queue order among equals. Rank r starts with the slot of the next
        # GPU of its node, so the first pushes of a node's G GPUs go to G different owners (all
        # starting at slot 0 made them incast on GPU 0: the simulator's finding), and each slot
        # in grouped order for L2 reuse.
        local = topo.local_of(r)
        order = [t for i in range(1, len(slots) + 1)
                 for t in grouped(slots[(local + i) % len(slots)])]
        for t in order:
            row[t] = gemm_task(b, r, a[r], w[r], ks, t, part[r])
        gemms.append(row)
    chunk_bytes = default_chunk_bytes(topo, chunk_bytes)
    # The node broadcast is NVLink work: on several nodes its pieces stay at most node-sized
    # while the network moves larger chunks (simulated 2x8, NOTES v14: 1.53x over sequential at
    # 4096 against 1.28x with 1 MiB pieces); on one node they follow chunk_bytes, as measured.
    if broadcast_bytes is None:
        broadcast_bytes = chunk_bytes if topo.nodes == 1 else min(chunk_bytes, NODE_CHUNK_BYTES)
    lower = _Stages(b, tiles, itemsize, chunk_bytes, broadcast_bytes)
    if topo.nodes == 1 and algorithm == "accumulate":
        lower.accumulate(part, gemms, out)
    elif topo.nodes == 1 and algorithm == "oneshot":
        lower.oneshot(part, gemms, out)
    elif hierarchical:
        node_sums = lower.node_reduce(part, gemms, "nodesum" if topo.nodes > 1 else None, out)
        if topo.nodes == 1:
            lower.fused_broadcast(out, node_sums)
        else:
            finished = lower.rail_allreduce(node_sums.buffers, node_sums.ready, out, by_local=True)
            lower.node_broadcast(out, finished)
    else:
        railsum = [b.buffer("railsum", r, M, N) for r in topo.ranks]
        rail = lower.rail_allreduce(part, gemms, railsum, by_local=False)
        sums = lower.node_reduce(railsum, rail.ready, None, out)
        lower.node_broadcast(out, sums)


ALGORITHMS = ("auto", "accumulate", "oneshot", "twoshot")


def node_algorithm(topo: Topology, M: int, N: int, K: int, itemsize: int, algorithm: str) -> str:
    """The node stage's algorithm on one node:

    - ``accumulate``: every GEMM epilogue reduce-adds its partial tile (TMA reduce-add) into the
      zeroed output of every GPU of the node, its own included: no sum pass and no wait at all
      after the GEMM, G-1 copies of the output cross NVLink per GPU. With 2 GPUs the sum is the
      same bits on both (0 + a + b == 0 + b + a); with more the order of the adds varies.
    - ``oneshot``: every GEMM epilogue stores its partial into every node peer; every rank then
      sums all partials of every tile (in rank order: replicas agree bit for bit).
    - ``twoshot``: each tile's partials go to its owner only; the owner sums and stores the
      result into every peer: 2 (G-1)/G copies of the output per GPU.

    ``auto`` (no timing run): accumulate on 2 GPUs; otherwise oneshot when its pushes hide
    behind the GEMM on an H200 (hardware.py: NVLink push rate vs the GEMM rate), else twoshot."""
    if algorithm not in ALGORITHMS:
        raise UnknownNameError(
            f"gemm_allreduce: algorithm={algorithm!r}; choose one of {', '.join(ALGORITHMS)}",
            hint="auto picks oneshot when its NVLink pushes hide behind the GEMM",
        )
    if algorithm != "auto":
        return algorithm
    from ..hardware import H200

    G = topo.gpus_per_node
    if G == 2:
        return "accumulate"
    gemm_s = 2.0 * M * N * (K // topo.world_size) / (H200.tile_gemm_tflops * 1e12)
    push_s = (G - 1) * M * N * itemsize / (H200.nvlink_push_gbps * 1e9)
    return "oneshot" if push_s <= gemm_s else "twoshot"


class _Result:
    """Where each tile of a stage's output lives and which task finishes it there."""

    def __init__(self, buffers: list[Buffer]) -> None:
        self.buffers = buffers
        self.ready: list[dict[Tile, Task]] = [{} for _ in buffers]
        self.owned: list[list[Tile]] = [[] for _ in buffers]  # tiles whose owner is this rank


class _Stages:
    def __init__(self, b: GraphBuilder, tiles: list[Tile], itemsize: int, chunk_bytes: int,
                 broadcast_bytes: int):  # fmt: skip
        self.b = b
        self.topo = b.topo
        self.tiles = tiles
        self.itemsize = itemsize
        self.chunk_bytes = chunk_bytes
        self.broadcast_bytes = broadcast_bytes

    def chunks(self, tiles: list[Tile]) -> list[list[Tile]]:
        return group_chunks(tiles, self.itemsize, self.chunk_bytes)

    def node_reduce(self, src, src_ready, scratch_name, out) -> _Result:
        """GPU l of every node reduces its slot of tiles over the node's G source buffers.

        The other GPUs push their tile to the owner, which adds them (collectives.push_reduce).
        With one node the sum is final and lands in
        ``out``; otherwise in a ``scratch_name`` buffer. Slots: with hierarchical movement a
        tile's owner must also own it in the rail stage, so the slot index is l * nodes + j.
        """
        b, topo = self.b, self.topo
        G = topo.gpus_per_node
        dst = out if scratch_name is None else [b.buffer(scratch_name, r, *out[r].shape) for r in topo.ranks]
        res = _Result(dst)
        recv: dict[tuple[int, int], Buffer] = {}
        for node in range(topo.nodes):
            members = topo.node_ranks(node)
            for local, owned in enumerate(partition(self.tiles, G)):
                owner = members[local]
                res.owned[owner] = owned
                for t in owned:
                    res.ready[owner][t] = push_reduce(
                        b, owner, {p: (tile_region(src[p], t), src_ready[p][t]) for p in members},
                        tile_region(dst[owner], t), recv, "node-reduce",
                    )
        return res

    def accumulate(self, part: list[Buffer], gemms: list[dict[Tile, Task]],
                   out: list[Buffer]) -> None:
        """One node: every GEMM tile reduce-adds into the zeroed ``out`` of every GPU of the
        node (write 0: its own), and raises one ``landed`` event per peer, which that peer's
        kernel waits for before it ends. The partial buffers are not needed."""
        b, topo = self.b, self.topo
        members = topo.node_ranks(0)
        for r in members:
            out[r].zeroed = True
            del b.buffers[part[r].id]
        landed = {(q, p): b.event(q, f"landed r{p}->r{q}") for q in members for p in members
                  if q != p}
        for p in members:
            peers = [q for q in members if q != p]
            for t, task in gemms[p].items():
                task.writes = [tile_region(out[q], t) for q in [p, *peers]]
                task.params["accumulate"] = True
                task.signals += [landed[(q, p)] for q in peers]

    def oneshot(self, part: list[Buffer], gemms: list[dict[Tile, Task]], out: list[Buffer]) -> None:
        """One node, one shot: every GEMM tile's epilogue also stores the partial into each node
        peer's receive buffer (same coordinates); every rank sums its own partial and the G-1
        received ones of each tile into its ``out``. The sum waits for one event per tile that
        the G GEMM tiles raise (the peers' from their epilogues)."""
        b, topo = self.b, self.topo
        members = topo.node_ranks(0)
        recv = {
            (r, p): b.buffer(f"partial_from{p}", r, *part[r].shape)
            for r in members for p in members if p != r
        }
        for p in members:
            for t, task in gemms[p].items():
                task.writes += [tile_region(recv[(r, p)], t) for r in members if r != p]
        for r in members:
            for t in self.tiles:
                # Partials in rank order on every rank: the same fp32 sum in the same order, so
                # every replica of the output holds the same bytes (as one owner's would).
                reads = [tile_region(part[r] if p == r else recv[(r, p)], t) for p in members]
                b.task(r, Role.COMPUTE, REDUCE, reads, [tile_region(out[r], t)],
                       waits=b.after(r, [gemms[p][t] for p in members]),
                       name=f"sum r{r} [{t[0]}:{t[1]},{t[2]}:{t[3]}]")

    def fused_broadcast(self, out: list[Buffer], done: _Result) -> None:
        """One node, two shot: the owner's sum of a tile also stores the result into every node
        peer's ``out`` from its epilogue (no NVLink copy task), and raises one ``landed`` event
        per peer, which that peer's kernel waits for before it ends (nothing else waits on the
        finished output)."""
        b, topo = self.b, self.topo
        members = topo.node_ranks(0)
        landed = {(p, o): b.event(p, f"landed r{o}->r{p}") for p in members for o in members
                  if p != o}
        for owner in members:
            peers = [p for p in members if p != owner]
            for t in done.owned[owner]:
                task = done.ready[owner][t]
                task.writes += [tile_region(out[p], t) for p in peers]
                task.signals += [landed[(p, owner)] for p in peers]

    def node_broadcast(self, out: list[Buffer], done: _Result) -> None:
        """Every owner pushes its finished tiles to its node peers over NVLink: one task per
        (piece, peer), a piece being ``broadcast_bytes`` of consecutive tiles. One task per
        piece into all G-1 peers would be one worker moving G-1 pieces in a row after the last
        rail arrival (at 2x8 the simulator's largest gap); per peer, the SM partition and the
        controller can give the G-1 copies G-1 workers. Pieces smaller than the network chunk
        spread one chunk's copies over more workers (the NVLink worker rate was calibrated on
        256 KiB copies).

        Each copy raises the peer's ``broadcast r{owner}->r{peer}`` event (one per (owner,
        peer): as many signals as the owner has pieces), which that peer's kernel waits for
        before it ends: nothing else in this op reads the finished output (a later op's reads
        wait for the copy that wrote them, through the builder's joins)."""
        b, topo = self.b, self.topo
        G = topo.gpus_per_node
        if G == 1:
            return
        for owner in topo.ranks:
            members = topo.node_ranks(topo.node_of(owner))
            local = topo.local_of(owner)
            # From the next GPU on: the G owners of a node start on G different peers (no incast).
            peers = [members[(local + i) % G] for i in range(1, G)]
            landed = {p: b.event(p, f"broadcast r{owner}->r{p}") for p in peers}
            for part in group_chunks(done.owned[owner], self.itemsize, self.broadcast_bytes):
                box = bounding(part)
                where = f"[{box[0]}:{box[1]},{box[2]}:{box[3]}]"
                waits = b.after(owner, unique_tasks(done.ready[owner][t] for t in part))
                for p in peers:
                    b.task(
                        owner,
                        Role.NVLINK,
                        COPY,
                        [tile_region(out[owner], box)],
                        [tile_region(out[p], box)],
                        waits=waits,
                        signals=[landed[p]],
                        name=f"broadcast r{owner}->r{p} {where}",
                    )

    def rail_allreduce(self, src, src_ready, out, *, by_local: bool) -> _Result:
        """All-reduce over each rail group (GPUs with one local index), reduce-scatter then
        all-gather, chunk by chunk over RDMA.

        ``by_local``: each GPU holds only its node-reduce slot (hierarchical); its slot is split
        over the nodes. Otherwise every GPU holds all tiles and splits them over the nodes.
        """
        b, topo = self.b, self.topo
        N, G = topo.nodes, topo.gpus_per_node
        res = _Result(out)
        recv: dict[tuple[int, int], Buffer] = {}
        local_slots = partition(self.tiles, G) if by_local else [self.tiles] * G
        for local in range(G):
            rail = [topo.rank(n, local) for n in range(N)]
            for j, slot in enumerate(partition(local_slots[local], N)):
                final = rail[j]
                for chunk in self.chunks(slot):
                    box = bounding(chunk)
                    where = f"[{box[0]}:{box[1]},{box[2]}:{box[3]}]"
                    sends = []
                    for n, r in enumerate(rail):
                        if n == j:
                            continue
                        key = (final, n)
                        if key not in recv:
                            recv[key] = b.buffer(f"from_node{n}", final, *out[final].shape)
                        sends.append(
                            b.task(
                                r,
                                Role.RDMA,
                                COPY,
                                [tile_region(src[r], box)],
                                [tile_region(recv[key], box)],
                                waits=b.after(r, unique_tasks(src_ready[r][t] for t in chunk)),
                                name=f"rail-send r{r}->r{final} {where}",
                            )
                        )
                    reduces = []
                    for t in chunk:
                        reads = [tile_region(src[final], t)]
                        reads += [tile_region(recv[(final, n)], t) for n in range(N) if n != j]
                        reduces.append(
                            b.task(
                                final,
                                Role.COMPUTE,
                                REDUCE,
                                reads,
                                [tile_region(out[final], t)],
                                waits=b.after(final, [src_ready[final][t], *sends]),
                                name=f"rail-reduce r{final} [{t[0]}:{t[1]},{t[2]}:{t[3]}]",
                            )
                        )
                        res.ready[final][t] = reduces[-1]
                        res.owned[final].append(t)
                    for n, r in enumerate(rail):
                        if n == j:
                            continue
                        back = b.task(
                            final,
                            Role.RDMA,
                            COPY,
                            [tile_region(out[final], box)],
                            [tile_region(out[r], box)],
                            waits=b.after(final, reduces),
                            name=f"rail-gather r{final}->r{r} {where}",
                        )
                        for t in chunk:
                            res.ready[r][t] = back
                            res.owned[r].append(t)
        for owned in res.owned:
            owned.sort()
        return res

