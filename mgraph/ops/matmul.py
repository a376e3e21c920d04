"""Local matmul: ``out = a @ b`` with no communication, in one of two layouts.

- ``shard="cols"`` (a column-parallel linear): ``a`` replicated, ``b`` and ``out`` sharded along
  N. Every rank computes its output columns.
- ``shard="none"``: ``b`` replicated; ``a`` in any layout that keeps whole rows (``layout``,
  referring to ``a``'s N-D ``shape``: replicated, token-sharded under sequence or context
  parallelism); ``out`` keeps the rows of ``a``. An unplanned ``nn.Linear`` lowers to this.

Tiles cover each rank's output rows (its buffer rows) by ``tile`` blocks; a GEMM tile reads the
whole K extent. A linear's input sharded along K needs a reduction: that is gemm_allreduce or
gemm_reduce_scatter, not this op.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..builder import GraphBuilder, piece, shard_range
from ..errors import ShapeError
from ..kinds import Role, TaskKind
from ..layout import Layout, check_layout, layout_runs, runs_pieces
from ..topology import Topology
from .collectives import check_options, tile_grid, tile_region
from .registry import OpDef
from .tilewise import parse_shape

__all__ = ["matmul"]

OP = "matmul"
matmul = OpDef(OP, dims=("M", "N", "K"), inputs=("a", "b"), outputs=("out",))
GEMM = TaskKind.GEMM.value


@matmul.shapes
def _shapes(
    topology: Topology,
    M: int,
    N: int,
    K: int,
    shard: str = "none",
    shape: Sequence[int] | None = None,
    layout: Sequence | None = None,
    tile: list[int] = (128, 256),
    **_: object,
) -> dict[str, tuple]:
    world = topology.world_size
    check_options(OP, tile, 1)
    nd = parse_shape(OP, M, K, shape)
    lay = Layout.from_json(layout)
    if shard == "cols":
        if N % world:
            raise ShapeError(
                f"{OP}: N={N} is not divisible by the world size {world}",
                hint=f"a column-parallel linear shards its output features: use a multiple of {world}",
            )
    elif shard == "none":
        check_layout(nd, lay, world, OP, "choose the token count as a multiple of the world size")
        if lay.kind == "shard" and lay.dim == len(nd) - 1:
            raise ShapeError(
                f"{OP}: a is sharded along K, so every rank holds a partial product",
                hint="a row-parallel linear (RowwiseParallel) reduces it: gemm_allreduce",
            )
    else:
        raise ShapeError(f"{OP}: shard={shard!r} must be 'none' or 'cols'")
    return {"a": (M, K), "b": (K, N), "out": (M, N)}


@matmul.reference
def _reference(a: torch.Tensor, b: torch.Tensor, **_: object) -> dict[str, torch.Tensor]:
    return {"out": (a.float() @ b.float()).to(a.dtype)}


@matmul.lower
def _lower(
    b: GraphBuilder,
    M: int,
    N: int,
    K: int,
    shard: str = "none",
    shape: list[int] | None = None,
    layout: list | None = None,
    tile: list[int] = (128, 256),
) -> None:
    world = b.world
    b.global_input("a", (M, K))
    b.global_input("b", (K, N))
    b.global_output("out", (M, N))
    nd = parse_shape(OP, M, K, shape)
    lay = Layout.from_json(layout)
    for r in b.topo.ranks:
        if shard == "cols":
            cols = shard_range(N, r, world)
            a = b.bound_buffer("a", r, "a", [piece((M, K))])
            w = b.bound_buffer("b", r, "b", [piece((K, N), d1=cols)])
            out = b.bound_buffer("out", r, "out", [piece((M, N), d1=cols)], role="output")
        else:
            runs = layout_runs(nd, lay, r, world)
            a = b.bound_buffer("a", r, "a", runs_pieces(runs))
            w = b.bound_buffer("b", r, "b", [piece((K, N))])
            out_pieces = tuple(((r0, r1), (0, N)) for r0, r1, _, _ in runs)
            out = b.bound_buffer("out", r, "out", out_pieces, role="output")
        bm, bn = min(tile[0], out.rows), min(tile[1], out.cols)
        for t in tile_grid(out.rows, out.cols, bm, bn):
            b.task(
                r,
                Role.COMPUTE,
                GEMM,
                [a.region((t[0], t[1]), (0, K)), w.region((0, K), (t[2], t[3]))],
                [tile_region(out, t)],
                name=f"matmul r{r} [{t[0]}:{t[1]},{t[2]}:{t[3]}]",
            )
