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

from collections.abc import Callable, Sequence

import torch

from ..builder import GraphBuilder, piece, shard_range
from ..errors import ShapeError
from ..graph import Buffer
from ..kinds import Role, TaskKind
from ..layout import Layout, check_layout, layout_runs, runs_pieces
from ..topology import Topology
from .collectives import check_options, tile_grid, tile_region
from .registry import OpDef
from .tilewise import parse_shape

__all__ = ["matmul", "check_linear", "bind_linear"]

OP = "matmul"
matmul = OpDef(OP, dims=("M", "N", "K"), inputs=("a", "b"), outputs=("out",))
GEMM = TaskKind.GEMM.value


def check_linear(
    op: str,
    topology: Topology,
    M: int,
    N: int,
    K: int,
    shard: str,
    shape: Sequence[int] | None,
    layout: Sequence | None,
    tile: Sequence[int],
    k_hint: str,
) -> None:
    """The layouts a local linear takes (module docstring), checked for op ``op``; ``k_hint``:
    what to do instead when ``a`` is sharded along K."""
    world = topology.world_size
    check_options(op, tile, 1)
    nd = parse_shape(op, M, K, shape)
    lay = Layout.from_json(layout)
    if shard == "cols":
        if N % world:
            raise ShapeError(
                f"{op}: N={N} is not divisible by the world size {world}",
                hint=f"a column-parallel linear shards its output features: use a multiple of {world}",
            )
    elif shard == "none":
        check_layout(nd, lay, world, op, "choose the token count as a multiple of the world size")
        if lay.kind == "shard" and lay.dim == len(nd) - 1:
            raise ShapeError(f"{op}: a is sharded along K, so every rank holds a partial product",
                             hint=k_hint)
    else:
        raise ShapeError(f"{op}: shard={shard!r} must be 'none' or 'cols'")


def bind_linear(
    b: GraphBuilder,
    r: int,
    op: str,
    M: int,
    N: int,
    K: int,
    shard: str,
    shape: list[int] | None,
    layout: list | None,
    bind_weight: Callable[[int, tuple[int, int] | None], Buffer],
) -> tuple[Buffer, Buffer, Buffer]:
    """Rank ``r``'s ``a``, weight and ``out`` buffers of a local linear, bound in that order;
    ``bind_weight(r, cols)`` binds the weight for the rank's output columns (``shard="cols"``;
    None: all of them)."""
    if shard == "cols":
        cols = shard_range(N, r, b.world)
        a = b.bound_buffer("a", r, "a", [piece((M, K))])
        w = bind_weight(r, cols)
        out = b.bound_buffer("out", r, "out", [piece((M, N), d1=cols)], role="output")
        return a, w, out
    runs = layout_runs(parse_shape(op, M, K, shape), Layout.from_json(layout), r, b.world)
    a = b.bound_buffer("a", r, "a", runs_pieces(runs))
    w = bind_weight(r, None)
    out_pieces = tuple(((r0, r1), (0, N)) for r0, r1, _, _ in runs)
    return a, w, b.bound_buffer("out", r, "out", out_pieces, role="output")


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
    check_linear(OP, topology, M, N, K, shard, shape, layout, tile,
                 "a row-parallel linear (RowwiseParallel) reduces it: gemm_allreduce")
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
    b.global_input("a", (M, K))
    b.global_input("b", (K, N))
    b.global_output("out", (M, N))
    def weight(r: int, cols: tuple[int, int] | None) -> Buffer:
        return b.bound_buffer("b", r, "b", [piece((K, N), **({"d1": cols} if cols else {}))])

    for r in b.topo.ranks:
        a, w, out = bind_linear(b, r, OP, M, N, K, shard, shape, layout, weight)
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
