"""RMSNorm over the last dim: ``out = x * rsqrt(mean(x^2) + eps) * weight``.

One ``rms_norm`` compute task per row tile, whole rows each, in the layout of ``x`` (replicated
under tensor parallelism, token-sharded under sequence parallelism: see tilewise.py).
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

__all__ = ["rms_norm"]

rms_norm = OpDef("rms_norm", dims=("rows", "cols"), inputs=("x", "weight"), outputs=("out",))
RMS_NORM = define_kind("rms_norm", [Role.COMPUTE], "RMSNorm of whole rows (params: eps)",
                       params=("eps",))


def _operands(weight: bool) -> dict[str, str]:
    return {"weight": "row"} if weight else {}


@rms_norm.shapes
def _shapes(
    topology: Topology,
    rows: int,
    cols: int,
    has_weight: bool = True,
    shape: Sequence[int] | None = None,
    layout: Sequence | None = None,
    **_: object,
) -> dict[str, tuple]:
    return tile_shapes(
        "rms_norm", topology, rows, cols, shape, layout, _operands(has_weight), whole_rows=True
    )


@rms_norm.reference
def _reference(
    x: torch.Tensor, weight: torch.Tensor | None = None, eps: float = 1e-6, **_: object
) -> dict[str, torch.Tensor]:
    w = None if weight is None else weight.float().reshape(-1)
    return {"out": F.rms_norm(x.float(), (x.shape[-1],), w, eps).to(x.dtype)}


@rms_norm.lower
def _lower(
    b: GraphBuilder,
    rows: int,
    cols: int,
    eps: float = 1e-6,
    has_weight: bool = True,
    shape: list[int] | None = None,
    layout: list | None = None,
    tile_rows: int = 64,
) -> None:
    lower_tilewise(
        b,
        RMS_NORM.name,
        rows=rows,
        cols=cols,
        shape=shape,
        layout=layout,
        operands=_operands(has_weight),
        params={"eps": float(eps)},  # a float: the GPU body reads float32 bits
        tile_rows=tile_rows,
    )


@RMS_NORM.cpu
def _rms_norm_cpu(
    task: Task, reads: Sequence[torch.Tensor], writes: Sequence[torch.Tensor]
) -> None:
    x = reads[0].float()
    w = reads[1].float().reshape(-1) if len(reads) > 1 else None
    writes[0].copy_(F.rms_norm(x, (x.shape[-1],), w, task.params["eps"]))


@RMS_NORM.flops
def _rms_norm_flops(
    reads: Sequence[tuple[int, int]], writes: Sequence[tuple[int, int]], params: dict
):
    rows, cols = writes[0]
    return 4.0 * rows * cols


# -- megakernel tile body ------------------------------------------------------------------------
if HAVE_TRITON:
    import triton
    import triton.language as tl

    from .abi import load_region, param_f32
    from .tilewise import (
        pack2,
        row_operand,
        tile_ptrs,
        unpack_hi,
        unpack_lo,
        vec_cols,
        vec_ptr,
        word_ptr,
    )

    _READ0, _NREAD, _WRITE0 = tl.constexpr(F_READ0), tl.constexpr(F_NREAD), tl.constexpr(F_WRITE0)

    # Whole rows (_rms_rows): _RW 32-bit words a row (4096 bf16 columns, 2048 fp32) in blocks
    # of _RR rows, 32 KiB; the loop over them software-pipelined _RS deep by Triton (the
    # blocks' loads become asynchronous copies to shared memory issued _RS - 1 blocks ahead:
    # 96 KiB a program in flight, no registers held for them).
    _RW: tl.constexpr = tl.constexpr(2048)
    _RR: tl.constexpr = tl.constexpr(4)
    _RS: tl.constexpr = tl.constexpr(4)

    @triton.jit
    def _rms_block(x, om, ow, m, nw, n, eps, wlo, whi, op, opitch, DT: tl.constexpr):
        """One _RR-row block of whole rows (``x``: its words) normalised and stored."""
        lo = unpack_lo(x, DT)
        ss = lo * lo
        if DT.primitive_bitwidth < 32:
            hi = unpack_hi(x, DT)
            ss += hi * hi
        rstd = tl.rsqrt(tl.sum(ss, axis=1) / n.to(tl.float32) + eps)[:, None]
        ylo = lo * rstd * wlo
        yhi = ylo
        if DT.primitive_bitwidth < 32:
            yhi = hi * rstd * whi
        mask = (om < m)[:, None] & (ow < nw)[None, :]
        tl.store(op + (om * opitch)[:, None] + ow[None, :], pack2(ylo, yhi, DT), mask=mask)

    @triton.jit
    def _rms_rows(xa, xpitch, wa, oa, opitch, m, n, eps, has_w, DT: tl.constexpr):
        """The fast path for rows of up to _RW words: each row read once, whole, as 16-byte
        loads of 32-bit words (tilewise.unpack_lo) in blocks of _RR rows, reduced, scaled and
        stored; the loop pipelined _RS deep (v13's loop read each row twice, 1,024 columns at
        a time, the next block loaded into registers a block ahead: ptxas waited for it at
        the iteration's end, one memory latency a block). The weight is read once a task."""
        EPW: tl.constexpr = 32 // DT.primitive_bitwidth  # elements a word
        WV: tl.constexpr = 4  # words a 16-byte vector
        xp = word_ptr(xa, DT)
        op = word_ptr(oa, DT)
        xpitch = xpitch // (EPW * WV) * WV  # words, provably multiples of WV
        opitch = opitch // (EPW * WV) * WV
        nw = n // (EPW * WV) * WV
        ow = vec_cols(0, _RW, WV)
        wlo = tl.full((1, _RW), 1.0, tl.float32)
        whi = wlo
        if has_w:  # the weight: a row operand, read once, broadcast over the rows
            w = tl.load(word_ptr(wa, DT) + ow, mask=ow < nw, other=0)[None, :]
            wlo = unpack_lo(w, DT)
            if DT.primitive_bitwidth < 32:
                whi = unpack_hi(w, DT)
        for i in tl.range(0, m, _RR, num_stages=_RS):
            om = tl.arange(0, _RR) + i
            x = tl.load(xp + (om * xpitch)[:, None] + ow[None, :],
                        mask=(om < m)[:, None] & (ow < nw)[None, :], other=0)
            _rms_block(x, om, ow, m, nw, n, eps, wlo, whi, op, opitch, DT)

    @triton.jit
    def _rms_vec(xa, xpitch, wa, oa, opitch, m, n, eps, has_w, DT: tl.constexpr,
                 RB_M: tl.constexpr, RB_N: tl.constexpr):
        """The fast path: every operand 16-byte aligned (row_operand's ``vec``), int32
        offsets, blocks of RB_M / 4 rows and RB_N * 4 columns (a traced layer's task is 32 rows
        of 4096: whole 64-row blocks were half masked), the squares summed in a block-shaped
        accumulator reduced once per row block (a cross-thread reduction per column block cost
        as much as its loads). In both passes the next column block's loads are issued before
        this block's arithmetic (v13: the body moved ~8.5 GB/s a program, latency-bound);
        only loaded values are carried, columns are recomputed (their 16-byte hints)."""
        VEC: tl.constexpr = 128 // DT.primitive_bitwidth
        BM: tl.constexpr = RB_M // 4
        BN: tl.constexpr = RB_N * 4
        xp = vec_ptr(xa, DT)
        wp = vec_ptr(wa, DT)
        op = vec_ptr(oa, DT)
        xpitch = xpitch // VEC * VEC  # as they are here, provably multiples of VEC
        opitch = opitch // VEC * VEC
        n = n // VEC * VEC
        for i in range(0, m, BM):
            om = i + tl.arange(0, BM)
            rmask = (om < m)[:, None]
            xrow = (om * xpitch)[:, None]
            acc = tl.zeros((BM, BN), dtype=tl.float32)
            on = vec_cols(0, BN, VEC)
            x = tl.load(xp + xrow + on[None, :], mask=rmask & (on < n)[None, :], other=0.0)
            for j in range(0, n, BN):
                on = vec_cols(j + BN, BN, VEC)  # the next block (past n: all masked)
                x_next = tl.load(xp + xrow + on[None, :], mask=rmask & (on < n)[None, :],
                                 other=0.0)
                xf = x.to(tl.float32)
                acc += xf * xf
                x = x_next
            rstd = tl.rsqrt(tl.sum(acc, axis=1) / n.to(tl.float32) + eps)[:, None]
            orow = (om * opitch)[:, None]
            on = vec_cols(0, BN, VEC)
            x = tl.load(xp + xrow + on[None, :], mask=rmask & (on < n)[None, :], other=0.0)
            for j in range(0, n, BN):
                on = vec_cols(j + BN, BN, VEC)
                x_next = tl.load(xp + xrow + on[None, :], mask=rmask & (on < n)[None, :],
                                 other=0.0)
                on = vec_cols(j, BN, VEC)
                y = x.to(tl.float32) * rstd
                if has_w:  # the weight: a row operand, broadcast over the rows
                    y = y * tl.load(wp + on, mask=on < n, other=0.0).to(tl.float32)[None, :]
                tl.store(op + orow + on[None, :], y.to(DT), mask=rmask & (on < n)[None, :])
                x = x_next

    @triton.jit
    def _rms_general(tp, regions, bufaddr, bufcols, r0, nread, w0, eps, DT: tl.constexpr,
                     RB_M: tl.constexpr, RB_N: tl.constexpr):
        """The general path: any widths and corners, pointers per element (tile_ptrs)."""
        _s, xm0, xm1, xn0, xn1 = load_region(regions, r0)
        n = xn1 - xn0
        for i in range(0, xm1 - xm0, RB_M):
            om = i + tl.arange(0, RB_M)
            rmask = om < xm1 - xm0
            ss = tl.zeros((RB_M,), dtype=tl.float32)
            for j in range(0, n, RB_N):
                on = j + tl.arange(0, RB_N)
                mask = rmask[:, None] & (on < n)[None, :]
                x = tl.load(tile_ptrs(regions, bufaddr, bufcols, r0, om, on, DT), mask=mask,
                            other=0.0).to(tl.float32)
                ss += tl.sum(x * x, axis=1)
            rstd = tl.rsqrt(ss / n.to(tl.float32) + eps)
            for j in range(0, n, RB_N):
                on = j + tl.arange(0, RB_N)
                mask = rmask[:, None] & (on < n)[None, :]
                x = tl.load(tile_ptrs(regions, bufaddr, bufcols, r0, om, on, DT), mask=mask,
                            other=0.0).to(tl.float32)
                y = x * rstd[:, None]
                if nread > 1:  # the weight: a row operand, broadcast over the rows
                    y = y * tl.load(tile_ptrs(regions, bufaddr, bufcols, r0 + 1, om, on, DT),
                                    mask=mask, other=0.0).to(tl.float32)
                tl.store(tile_ptrs(regions, bufaddr, bufcols, w0, om, on, DT), y.to(DT), mask=mask)

    @RMS_NORM.triton
    @triton.jit
    def rms_norm_tile(tp, params, regions, bufaddr, bufcols, DT: tl.constexpr,
                      RB_M: tl.constexpr, RB_N: tl.constexpr):
        """x * rsqrt(mean(x^2) + eps) * weight. Assumes the task's x region holds whole rows
        (the tilewise lowering guarantees it). Rows of whole 16-byte vectors up to _RW words
        wide (4096 bf16 columns) take _rms_rows (each row read once, whole); wider ones
        _rms_vec: per row block, one pass over the row in column blocks sums the squares, a
        second one scales and stores; others the general path (tile_ptrs, element by
        element)."""
        r0 = tl.load(tp + _READ0)
        nread = tl.load(tp + _NREAD)
        w0 = tl.load(tp + _WRITE0)
        eps = param_f32(params, tp, 0)
        _s, xm0, xm1, xn0, xn1 = load_region(regions, r0)
        xa, xpitch, xvec = row_operand(regions, bufaddr, bufcols, r0, DT)
        # without a weight, region r0 + 1 is not this task's: read x's again instead
        wa, _wpitch, wvec = row_operand(regions, bufaddr, bufcols, tl.where(nread > 1, r0 + 1, r0),
                                        DT)
        oa, opitch, ovec = row_operand(regions, bufaddr, bufcols, w0, DT)
        n = xn1 - xn0
        if xvec & wvec & ovec & (n <= _RW * (32 // DT.primitive_bitwidth)):
            _rms_rows(xa, xpitch, wa, oa, opitch, xm1 - xm0, n, eps, nread > 1, DT)
        elif xvec & wvec & ovec:
            _rms_vec(xa, xpitch, wa, oa, opitch, xm1 - xm0, n, eps, nread > 1, DT, RB_M, RB_N)
        else:
            # (a quarter of the rows: int64 pointers per element; at whole RB_M x RB_N blocks
            # ptxas spilled them beside _rms_vec's blocks)
            _rms_general(tp, regions, bufaddr, bufcols, r0, nread, w0, eps, DT, RB_M // 4, RB_N)
