"""Plain GEMM, data parallel: ``out = a @ b`` with ``a`` and ``out`` sharded along M and ``b``
replicated. No communication: it is how the megakernel's tile GEMM is measured against cuBLAS,
and the smallest graph every backend must run."""

from __future__ import annotations

from ..builder import GraphBuilder, edge_tile, piece, require_divisible, shard_range
from ..kinds import Role, TaskKind
from ..topology import Topology
from .collectives import grouped, tile_grid, tile_region
from .registry import OpDef
from .tiles import matmul_reference

gemm = OpDef("gemm", dims=("M", "N", "K"), inputs=("a", "b"), outputs=("out",))


@gemm.shapes
def _shapes(topology: Topology, M: int, N: int, K: int, **_: object) -> dict[str, tuple]:
    require_divisible("gemm", "M", M, topology.world_size, "a and out are sharded along M")
    return {"a": (M, K), "b": (K, N), "out": (M, N)}


gemm.reference(matmul_reference)


@gemm.lower
def _lower(b: GraphBuilder, M: int, N: int, K: int, tile: list[int] = (128, 256)) -> None:
    world = b.world
    rows = M // world
    bm, bn = edge_tile(rows, tile[0]), edge_tile(N, tile[1])  # edge tiles are short, masked
    b.global_input("a", (M, K))
    b.global_input("b", (K, N))
    b.global_output("out", (M, N))
    for r in b.topo.ranks:
        shard = shard_range(M, r, world)
        a = b.bound_buffer("a", r, "a", [piece((M, K), d0=shard)])
        w = b.bound_buffer("b", r, "b", [piece((K, N))])
        out = b.bound_buffer("out", r, "out", [piece((M, N), d0=shard)], role="output")
        for t in grouped(tile_grid(rows, N, bm, bn)):  # L2-friendly queue order
            b.task(
                r, Role.COMPUTE, TaskKind.GEMM.value,
                [a.region((t[0], t[1]), (0, K)), w.region((0, K), (t[2], t[3]))],
                [tile_region(out, t)],
                name=f"gemm r{r} [{t[0]}:{t[1]},{t[2]}:{t[3]}]",
            )
