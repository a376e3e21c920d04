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
from .abi import F_NREAD, F_READ0, F_WRITE0, HAVE_TRITON
from .registry import OpDef
from .tilewise import lower_tilewise, tile_shapes

__all__ = ["layer_norm"]

layer_norm = OpDef(
    "layer_norm", dims=("rows", "cols"), inputs=("x", "weight", "bias"), outputs=("out",)
)
LAYER_NORM = define_kind("layer_norm", [Role.COMPUTE], "LayerNorm of whole rows (params: eps)",
                         params=("eps", "weight", "bias"))


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
        # eps a float and the flags bools: the GPU body reads float32 bits and int words
        params={"eps": float(eps), "weight": bool(has_weight), "bias": bool(has_bias)},
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


# -- megakernel tile body ------------------------------------------------------------------------
if HAVE_TRITON:
    import triton
    import triton.language as tl

    from .abi import load_region, param_f32, param_i32
    from .tilewise import block_ptrs, row_operand, vec_width

    _READ0, _NREAD, _WRITE0 = tl.constexpr(F_READ0), tl.constexpr(F_NREAD), tl.constexpr(F_WRITE0)

    @triton.jit
    def _layer_norm_rows(xa, xpitch, wa, ba, oa, opitch, m_rows, n, eps, has_w, has_b,
                         DT: tl.constexpr, RB_M: tl.constexpr, RB_N: tl.constexpr,
                         FAST: tl.constexpr):
        n = vec_width(n, DT, FAST)
        nf = n.to(tl.float32)
        zero = tl.zeros((1,), dtype=tl.int32)  # the weight and bias: one row, read by every row
        for i in range(0, m_rows, RB_M):
            om = i + tl.arange(0, RB_M)
            rmask = om < m_rows
            total = tl.zeros((RB_M,), dtype=tl.float32)
            for j in range(0, n, RB_N):
                on = j + tl.arange(0, RB_N)
                mask = rmask[:, None] & (on < n)[None, :]
                x = tl.load(block_ptrs(xa, xpitch, om, on, DT, FAST), mask=mask,
                            other=0.0).to(tl.float32)
                total += tl.sum(x, axis=1)
            mean = total / nf
            sq = tl.zeros((RB_M,), dtype=tl.float32)
            for j in range(0, n, RB_N):
                on = j + tl.arange(0, RB_N)
                mask = rmask[:, None] & (on < n)[None, :]
                x = tl.load(block_ptrs(xa, xpitch, om, on, DT, FAST), mask=mask,
                            other=0.0).to(tl.float32)
                d = tl.where(mask, x - mean[:, None], 0.0)
                sq += tl.sum(d * d, axis=1)
            rstd = tl.rsqrt(sq / nf + eps)
            for j in range(0, n, RB_N):
                on = j + tl.arange(0, RB_N)
                mask = rmask[:, None] & (on < n)[None, :]
                x = tl.load(block_ptrs(xa, xpitch, om, on, DT, FAST), mask=mask,
                            other=0.0).to(tl.float32)
                y = (x - mean[:, None]) * rstd[:, None]
                if has_w != 0:
                    y = y * tl.load(block_ptrs(wa, 0, zero, on, DT, FAST), mask=(on < n)[None, :],
                                    other=0.0).to(tl.float32)
                if has_b != 0:
                    y = y + tl.load(block_ptrs(ba, 0, zero, on, DT, FAST), mask=(on < n)[None, :],
                                    other=0.0).to(tl.float32)
                tl.store(block_ptrs(oa, opitch, om, on, DT, FAST), y.to(DT), mask=mask)

    @LAYER_NORM.triton
    @triton.jit
    def layer_norm_tile(tp, params, regions, bufaddr, bufcols, DT: tl.constexpr,
                        RB_M: tl.constexpr, RB_N: tl.constexpr):
        """(x - mean) * rsqrt(var + eps) * weight + bias. Assumes the task's x region holds whole
        rows (the tilewise lowering guarantees it): per RB_M-row block, three passes over the
        row in RB_N-column blocks: the mean, the variance around it (no E[x^2] - mean^2
        cancellation), then the normalised store. The weight and bias reads follow x when the
        params say they exist. By 16-byte vectors when every operand allows it
        (tilewise.row_operand), element by element otherwise."""
        r0 = tl.load(tp + _READ0)
        w0 = tl.load(tp + _WRITE0)
        eps = param_f32(params, tp, 0)
        has_w = param_i32(params, tp, 1)
        has_b = param_i32(params, tp, 2)
        _s, xm0, xm1, xn0, xn1 = load_region(regions, r0)
        xa, xpitch, xvec = row_operand(regions, bufaddr, bufcols, r0, DT)
        # an absent weight or bias: x's region again (region r0 + 1 may not be this task's)
        wa, _wp, wvec = row_operand(regions, bufaddr, bufcols, r0 + has_w, DT)
        ba, _bp, bvec = row_operand(regions, bufaddr, bufcols, r0 + (has_w + has_b) * has_b, DT)
        oa, opitch, ovec = row_operand(regions, bufaddr, bufcols, w0, DT)
        if xvec & wvec & bvec & ovec:
            _layer_norm_rows(xa, xpitch, wa, ba, oa, opitch, xm1 - xm0, xn1 - xn0, eps, has_w,
                             has_b, DT, RB_M, RB_N, True)
        else:
            # half the rows a block: the general path's int64 pointer tensors at full blocks
            # spilled under Triton 3.6 (3 reloads an iteration of its last pass)
            _layer_norm_rows(xa, xpitch, wa, ba, oa, opitch, xm1 - xm0, xn1 - xn0, eps, has_w,
                             has_b, DT, RB_M // 2, RB_N, False)
