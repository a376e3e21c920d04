"""Softmax over the last dim, in fp32: one ``softmax`` compute task per row tile (whole rows)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..builder import GraphBuilder
from ..graph import Task
from ..kinds import Role, define_kind
from ..topology import Topology
from .registry import OpDef
from .tilewise import lower_tilewise, tile_shapes

__all__ = ["softmax"]

softmax = OpDef("softmax", dims=("rows", "cols"), inputs=("x",), outputs=("out",))
SOFTMAX = define_kind("softmax", [Role.COMPUTE], "softmax of whole rows")


@softmax.shapes
def _shapes(
    topology: Topology,
    rows: int,
    cols: int,
    shape: Sequence[int] | None = None,
    layout: Sequence | None = None,
    **_: object,
) -> dict[str, tuple]:
    return tile_shapes("softmax", topology, rows, cols, shape, layout, {}, whole_rows=True)


@softmax.reference
def _reference(x: torch.Tensor, **_: object) -> dict[str, torch.Tensor]:
    return {"out": torch.softmax(x.float(), dim=-1).to(x.dtype)}


@softmax.lower
def _lower(
    b: GraphBuilder,
    rows: int,
    cols: int,
    shape: list[int] | None = None,
    layout: list | None = None,
    tile_rows: int = 64,
) -> None:
    lower_tilewise(
        b,
        SOFTMAX.name,
        rows=rows,
        cols=cols,
        shape=shape,
        layout=layout,
        operands={},
        tile_rows=tile_rows,
    )


@SOFTMAX.cpu
def _softmax_cpu(task: Task, reads: Sequence[torch.Tensor], writes: Sequence[torch.Tensor]) -> None:
    writes[0].copy_(torch.softmax(reads[0].float(), dim=-1))


@SOFTMAX.flops
def _softmax_flops(
    reads: Sequence[tuple[int, int]], writes: Sequence[tuple[int, int]], params: dict
):
    rows, cols = writes[0]
    return 4.0 * rows * cols
