"""LayerNorm over the last dim: ``out = (x - mean) / sqrt(var + eps) * weight + bias``.

One ``layer_norm`` compute task per row tile, whole rows each, in the layout of ``x``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from ..builder import GraphBuilder
from ..graph import Task
from ..kinds import Role, define_kind
from ..topology import Topology
from .registry import OpDef
from .tilewise import lower_tilewise, tile_shapes

__all__ = ["layer_norm"]

layer_norm = OpDef(
    "layer_norm", dims=("rows", "cols"), inputs=("x", "weight", "bias"), outputs=("out",)
)
LAYER_NORM = define_kind("layer_norm", [Role.COMPUTE], "LayerNorm of whole rows (params: eps)")


def _operands(weight: bool, bias: bool) -> dict[str, str]:
    out = {"weight": "row"} if weight else {}
    if bias:
        out["bias"] = "row"
    return out


@layer_norm.shapes
def _shapes(
    topology: Topology,
    rows: int,
    cols: int,
    has_weight: bool = True,
    has_bias: bool = True,
    shape: Sequence[int] | None = None,
    layout: Sequence | None = None,
    **_: object,
) -> dict[str, tuple]:
    return tile_shapes(
        "layer_norm",
        topology,
        rows,
        cols,
        shape,
        layout,
        _operands(has_weight, has_bias),
        whole_rows=True,
    )


def _norm(x: torch.Tensor, w: torch.Tensor | None, b: torch.Tensor | None, eps: float):
    w = None if w is None else w.float().reshape(-1)
    b = None if b is None else b.float().reshape(-1)
    return F.layer_norm(x.float(), (x.shape[-1],), w, b, eps)


@layer_norm.reference
def _reference(
    x: torch.Tensor,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
    **_: object,
) -> dict[str, torch.Tensor]:
    return {"out": _norm(x, weight, bias, eps).to(x.dtype)}


@layer_norm.lower
def _lower(
    b: GraphBuilder,
    rows: int,
    cols: int,
    eps: float = 1e-5,
    has_weight: bool = True,
    has_bias: bool = True,
    shape: list[int] | None = None,
    layout: list | None = None,
    tile_rows: int = 64,
) -> None:
    lower_tilewise(
        b,
        LAYER_NORM.name,
        rows=rows,
        cols=cols,
        shape=shape,
        layout=layout,
        operands=_operands(has_weight, has_bias),
        params={"eps": eps, "weight": has_weight, "bias": has_bias},
        tile_rows=tile_rows,
    )


@LAYER_NORM.cpu
def _layer_norm_cpu(
    task: Task, reads: Sequence[torch.Tensor], writes: Sequence[torch.Tensor]
) -> None:
    p = task.params
    rest = list(reads[1:])
    w = rest.pop(0) if p["weight"] else None
    b = rest.pop(0) if p["bias"] else None
    writes[0].copy_(_norm(reads[0], w, b, p["eps"]))


@LAYER_NORM.flops
def _layer_norm_flops(
    reads: Sequence[tuple[int, int]], writes: Sequence[tuple[int, int]], params: dict
):
    rows, cols = writes[0]
    return 6.0 * rows * cols
