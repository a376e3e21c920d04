"""Softmax over the last dim, in fp32: one ``softmax`` compute task per row tile (whole rows)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..builder import GraphBuilder
from ..graph import Task
from ..kinds import Role, define_kind
from ..topology import Topology
from .abi import F_NREAD, F_READ0, F_WRITE0, HAVE_TRITON
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


# -- megakernel tile body ------------------------------------------------------------------------
if HAVE_TRITON:
    import triton
    import triton.language as tl

    from .abi import load_region
    from .tilewise import block_ptrs, row_operand, vec_width

    _READ0, _NREAD, _WRITE0 = tl.constexpr(F_READ0), tl.constexpr(F_NREAD), tl.constexpr(F_WRITE0)

    @triton.jit
    def _softmax_rows(xa, xpitch, oa, opitch, m_rows, n, DT: tl.constexpr, RB_M: tl.constexpr,
                      RB_N: tl.constexpr, FAST: tl.constexpr):
        n = vec_width(n, DT, FAST)
        for i in range(0, m_rows, RB_M):
            om = i + tl.arange(0, RB_M)
            rmask = om < m_rows
            m = tl.full((RB_M,), float("-inf"), dtype=tl.float32)
            total = tl.zeros((RB_M,), dtype=tl.float32)
            for j in range(0, n, RB_N):
                on = j + tl.arange(0, RB_N)
                mask = rmask[:, None] & (on < n)[None, :]
                x = tl.load(block_ptrs(xa, xpitch, om, on, DT, FAST), mask=mask,
                            other=float("-inf")).to(tl.float32)
                m_new = tl.maximum(m, tl.max(x, axis=1))
                # rows past the tile stay -inf (NaN here): never stored
                total = total * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new[:, None]), axis=1)
                m = m_new
            for j in range(0, n, RB_N):
                on = j + tl.arange(0, RB_N)
                mask = rmask[:, None] & (on < n)[None, :]
                x = tl.load(block_ptrs(xa, xpitch, om, on, DT, FAST), mask=mask,
                            other=float("-inf")).to(tl.float32)
                y = tl.exp(x - m[:, None]) / total[:, None]
                tl.store(block_ptrs(oa, opitch, om, on, DT, FAST), y.to(DT), mask=mask)

    @SOFTMAX.triton
    @triton.jit
    def softmax_tile(tp, regions, bufaddr, bufcols, DT: tl.constexpr, RB_M: tl.constexpr,
                     RB_N: tl.constexpr):
        """exp(x - max) / sum over whole rows, in fp32. Assumes the task's x region holds whole
        rows (the tilewise lowering guarantees it): per RB_M-row block, one pass over the row in
        RB_N-column blocks keeps a running max and a sum rescaled to it (online softmax), a
        second one stores the normalised exponentials. By 16-byte vectors when x and out allow
        it (tilewise.row_operand), element by element otherwise."""
        r0 = tl.load(tp + _READ0)
        w0 = tl.load(tp + _WRITE0)
        _s, xm0, xm1, xn0, xn1 = load_region(regions, r0)
        xa, xpitch, xvec = row_operand(regions, bufaddr, bufcols, r0, DT)
        oa, opitch, ovec = row_operand(regions, bufaddr, bufcols, w0, DT)
        if xvec & ovec:
            _softmax_rows(xa, xpitch, oa, opitch, xm1 - xm0, xn1 - xn0, DT, RB_M, RB_N, True)
        else:
            _softmax_rows(xa, xpitch, oa, opitch, xm1 - xm0, xn1 - xn0, DT, RB_M, RB_N, False)
