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
from .abi import F_NREAD, F_READ0, F_WRITE0, HAVE_TRITON
from .registry import OpDef
from .tilewise import lower_tilewise, tile_shapes

__all__ = ["row_reduce", "REDUCTIONS"]

row_reduce = OpDef("row_reduce", dims=("rows", "cols"), inputs=("x",), outputs=("out",))
# GPU param: the fn as its index in REDUCTIONS (mean, sum, amax, amin)
ROW_REDUCE = define_kind("row_reduce", [Role.COMPUTE], "reduce whole rows to one column (fn)",
                         params=("code",))

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
        params={"fn": fn, "code": list(REDUCTIONS).index(fn)},
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


# -- megakernel tile body ------------------------------------------------------------------------
if HAVE_TRITON:
    import triton
    import triton.language as tl

    from .abi import buffer_base, load_region, param_i32
    from .tilewise import block_ptrs, row_operand, vec_width

    _READ0, _NREAD, _WRITE0 = tl.constexpr(F_READ0), tl.constexpr(F_NREAD), tl.constexpr(F_WRITE0)

    @triton.jit
    def _reduce_rows(xa, xpitch, dst, d_cols, dm0, dn0, m_rows, n, code, DT: tl.constexpr,
                     RB_M: tl.constexpr, RB_N: tl.constexpr, FAST: tl.constexpr):
        n = vec_width(n, DT, FAST)
        # the reduction's identity: masked elements never change the result
        init = tl.where(code == 2, float("-inf"), tl.where(code == 3, float("inf"), 0.0))
        for i in range(0, m_rows, RB_M):
            om = i + tl.arange(0, RB_M)
            rmask = om < m_rows
            acc = tl.zeros((RB_M,), dtype=tl.float32) + init
            for j in range(0, n, RB_N):
                on = j + tl.arange(0, RB_N)
                mask = rmask[:, None] & (on < n)[None, :]
                x = tl.load(block_ptrs(xa, xpitch, om, on, DT, FAST), mask=mask,
                            other=0.0).to(tl.float32)
                x = tl.where(mask, x, init)
                if code == 2:
                    acc = tl.maximum(acc, tl.max(x, axis=1))
                elif code == 3:
                    acc = tl.minimum(acc, tl.min(x, axis=1))
                else:
                    acc = acc + tl.sum(x, axis=1)
            if code == 0:
                acc = acc / n.to(tl.float32)
            tl.store(dst + (dm0 + om).to(tl.int64) * d_cols + dn0, acc.to(DT), mask=rmask)

    @ROW_REDUCE.triton
    @triton.jit
    def row_reduce_tile(tp, params, regions, bufaddr, bufcols, DT: tl.constexpr,
                        RB_M: tl.constexpr, RB_N: tl.constexpr):
        """out[:, 0] = mean/sum/amax/amin of each row (code 0-3), fp32. Assumes the task's x
        region holds whole rows (the tilewise lowering guarantees it): one pass over the row in
        RB_N-column blocks per RB_M-row block, then one column stored. x is read by 16-byte
        vectors when it allows it (tilewise.row_operand), element by element otherwise."""
        r0 = tl.load(tp + _READ0)
        code = param_i32(params, tp, 0)
        _s, xm0, xm1, xn0, xn1 = load_region(regions, r0)
        d, dm0, dm1, dn0, dn1 = load_region(regions, tl.load(tp + _WRITE0))
        dst = buffer_base(bufaddr, d, DT)
        d_cols = tl.load(bufcols + d).to(tl.int64)
        xa, xpitch, xvec = row_operand(regions, bufaddr, bufcols, r0, DT)
        if xvec:
            _reduce_rows(xa, xpitch, dst, d_cols, dm0, dn0, xm1 - xm0, xn1 - xn0, code, DT, RB_M,
                         RB_N, True)
        else:
            _reduce_rows(xa, xpitch, dst, d_cols, dm0, dn0, xm1 - xm0, xn1 - xn0, code, DT, RB_M,
                         RB_N, False)
