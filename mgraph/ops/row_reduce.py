"""Reduction over the last dim with the dim kept: ``out[..., 0] = fn(x[..., :])``.

``fn`` is mean, sum, amax or amin. One ``row_reduce`` compute task per row tile (whole rows); the
result has one column, held in the rows of ``x``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..builder import GraphBuilder
from ..errors import UnknownNameError
from ..graph import Task
from ..kinds import Role, define_kind
from ..topology import Topology
from .registry import OpDef
from .tilewise import lower_tilewise, tile_shapes

__all__ = ["row_reduce", "REDUCTIONS"]

row_reduce = OpDef("row_reduce", dims=("rows", "cols"), inputs=("x",), outputs=("out",))
ROW_REDUCE = define_kind("row_reduce", [Role.COMPUTE], "reduce whole rows to one column (fn)")

REDUCTIONS = {
    "mean": lambda x: x.mean(dim=-1, keepdim=True),
    "sum": lambda x: x.sum(dim=-1, keepdim=True),
    "amax": lambda x: x.amax(dim=-1, keepdim=True),
    "amin": lambda x: x.amin(dim=-1, keepdim=True),
}


@row_reduce.shapes
def _shapes(
    topology: Topology,
    rows: int,
    cols: int,
    fn: str = "mean",
    shape: Sequence[int] | None = None,
    layout: Sequence | None = None,
    **_: object,
) -> dict[str, tuple]:
    if fn not in REDUCTIONS:
        raise UnknownNameError(
            f"row_reduce: unknown fn {fn!r}; valid: {', '.join(sorted(REDUCTIONS))}"
        )
    return tile_shapes("row_reduce", topology, rows, cols, shape, layout, {}, 1, whole_rows=True)


@row_reduce.reference
def _reference(x: torch.Tensor, fn: str = "mean", **_: object) -> dict[str, torch.Tensor]:
    return {"out": REDUCTIONS[fn](x.float()).to(x.dtype)}


@row_reduce.lower
def _lower(
    b: GraphBuilder,
    rows: int,
    cols: int,
    fn: str = "mean",
    shape: list[int] | None = None,
    layout: list | None = None,
    tile_rows: int = 64,
) -> None:
    lower_tilewise(
        b,
        ROW_REDUCE.name,
        rows=rows,
        cols=cols,
        shape=shape,
        layout=layout,
        operands={},
        out_cols=1,
        params={"fn": fn},
        tile_rows=tile_rows,
        label=f"row-{fn}",
    )


@ROW_REDUCE.cpu
def _row_reduce_cpu(
    task: Task, reads: Sequence[torch.Tensor], writes: Sequence[torch.Tensor]
) -> None:
    writes[0].copy_(REDUCTIONS[task.params["fn"]](reads[0].float()))


@ROW_REDUCE.flops
def _row_reduce_flops(
    reads: Sequence[tuple[int, int]], writes: Sequence[tuple[int, int]], params: dict
):
    rows, cols = reads[0]
    return float(rows * cols)
