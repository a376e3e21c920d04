"""Concat along the last dim: ``out = torch.cat([x, y], dim=-1)`` of two tensors whose leading
dims agree (rotary embeddings' ``rotate_half``, ``torch.cat((freqs, freqs), -1)``).

Like the tile ops in tilewise.py it moves no data between ranks: both inputs are held in one
layout that keeps whole rows (replicated, token rows, or a shard of a leading dim), so rank r's
buffer rows of ``x``, ``y`` and ``out`` are the same rows of the flat view, and one ``concat``
compute task per ``tile_rows`` buffer rows writes ``[x | y]``. The tracer lowers a concat along
another dim, or of more than two tensors, through relayouts and a chain of these.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..builder import GraphBuilder, split
from ..errors import ShapeError
from ..graph import Task
from ..kinds import Role, define_kind
from ..layout import check_layout, layout_runs, runs_pieces
from ..topology import Topology
from .abi import F_READ0, F_WRITE0, HAVE_TRITON
from .registry import OpDef
from .tilewise import parse_layout, parse_shape

__all__ = ["concat"]

OP = "concat"
concat = OpDef(OP, dims=("rows", "cols", "cols_y"), inputs=("x", "y"), outputs=("out",))
CONCAT = define_kind("concat", [Role.COMPUTE], "[x | y] of one row tile (cat along columns)")


def _check(topology: Topology, rows: int, cols: int, cols_y: int, shape, layout) -> tuple:
    for name, value in (("cols", cols), ("cols_y", cols_y)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ShapeError(f"{OP}: {name}={value!r} must be a positive int")
    nd = parse_shape(OP, rows, cols, shape)
    lay = parse_layout(layout)
    check_layout(nd, lay, topology.world_size, OP, "choose sizes divisible by the world size")
    if lay.kind == "shard" and lay.dim % len(nd) == len(nd) - 1:
        raise ShapeError(
            f"{OP}: the inputs cannot be sharded along the concatenated (last) dim",
            hint="replicate them, or shard a leading dim",
        )
    return nd, lay


@concat.shapes
def _shapes(
    topology: Topology,
    rows: int,
    cols: int,
    cols_y: int,
    shape: Sequence[int] | None = None,
    layout: Sequence | None = None,
    **_: object,
) -> dict[str, tuple]:
    _check(topology, rows, cols, cols_y, shape, layout)
    return {"x": (rows, cols), "y": (rows, cols_y), "out": (rows, cols + cols_y)}


@concat.reference
def _reference(x: torch.Tensor, y: torch.Tensor, **_: object) -> dict[str, torch.Tensor]:
    return {"out": torch.cat([x, y], dim=-1)}


@concat.lower
def _lower(
    b: GraphBuilder,
    rows: int,
    cols: int,
    cols_y: int,
    shape: list[int] | None = None,
    layout: list | None = None,
    tile_rows: int = 64,
) -> None:
    if isinstance(tile_rows, bool) or not isinstance(tile_rows, int) or tile_rows <= 0:
        raise ShapeError(f"{OP}: tile_rows={tile_rows!r} must be a positive int")
    nd, lay = _check(b.topo, rows, cols, cols_y, shape, layout)
    b.global_input("x", (rows, cols))
    b.global_input("y", (rows, cols_y))
    b.global_output("out", (rows, cols + cols_y))
    for r in b.topo.ranks:
        # Whole rows in every layout allowed here: the runs differ only in their columns.
        runs = layout_runs(nd, lay, r, b.world)
        row_pieces = [((r0, r1),) for r0, r1, _, _ in runs]
        x = b.bound_buffer("x", r, "x", runs_pieces(runs))
        y = b.bound_buffer("y", r, "y", tuple(p + ((0, cols_y),) for p in row_pieces))
        out_pieces = tuple(p + ((0, cols + cols_y),) for p in row_pieces)
        out = b.bound_buffer("out", r, "out", out_pieces, role="output")
        for t0, t1 in split(x.rows, tile_rows):
            b.task(
                r,
                Role.COMPUTE,
                CONCAT.name,
                [x.region((t0, t1)), y.region((t0, t1))],
                [out.region((t0, t1))],
                name=f"concat r{r} [{t0}:{t1}]",
            )


@CONCAT.cpu
def _concat_cpu(task: Task, reads: Sequence[torch.Tensor], writes: Sequence[torch.Tensor]) -> None:
    writes[0].copy_(torch.cat([reads[0], reads[1]], dim=1))


@CONCAT.flops
def _concat_flops(reads: Sequence[tuple[int, int]], writes: Sequence[tuple[int, int]], params):
    return 0.0


# -- megakernel tile body ------------------------------------------------------------------------
if HAVE_TRITON:
    import triton
    import triton.language as tl

    from .abi import load_region
    from .tilewise import copy_into, copy_vec, row_operand

    _READ0, _WRITE0 = tl.constexpr(F_READ0), tl.constexpr(F_WRITE0)

    @CONCAT.triton
    @triton.jit
    def concat_tile(tp, regions, bufaddr, bufcols, DT: tl.constexpr, RB_M: tl.constexpr,
                    RB_N: tl.constexpr):
        """out = [x | y] for the task's rows: x's columns, then y's after them (a plain copy,
        no rounding). When x, y and out all take 16-byte vectors (tilewise.row_operand; y's
        destination column, x's width, is then a multiple of 16 bytes too), copy_vec, in
        blocks four times taller for operands of at most RB_N / 4 columns (RoPE's halves);
        otherwise copy_into, element by element."""
        r0 = tl.load(tp + _READ0)
        w0 = tl.load(tp + _WRITE0)
        _s, xm0, xm1, xn0, xn1 = load_region(regions, r0)
        _t, ym0, ym1, yn0, yn1 = load_region(regions, r0 + 1)
        xa, xpitch, xvec = row_operand(regions, bufaddr, bufcols, r0, DT)
        ya, ypitch, yvec = row_operand(regions, bufaddr, bufcols, r0 + 1, DT)
        oa, opitch, ovec = row_operand(regions, bufaddr, bufcols, w0, DT)
        m = xm1 - xm0
        if xvec & yvec & ovec:
            ya_out = oa + (xn1 - xn0).to(tl.int64) * (DT.primitive_bitwidth // 8)
            if tl.maximum(xn1 - xn0, yn1 - yn0) <= RB_N // 4:
                copy_vec(xa, xpitch, oa, opitch, m, xn1 - xn0, DT, 4 * RB_M, RB_N // 4)
                copy_vec(ya, ypitch, ya_out, opitch, m, yn1 - yn0, DT, 4 * RB_M, RB_N // 4)
            else:
                copy_vec(xa, xpitch, oa, opitch, m, xn1 - xn0, DT, RB_M, RB_N)
                copy_vec(ya, ypitch, ya_out, opitch, m, yn1 - yn0, DT, RB_M, RB_N)
        else:
            # blocks of a quarter of the rows and half the columns: the int64 pointer tensors
            # of a full block spilled (255 registers, sm_90)
            copy_into(regions, bufaddr, bufcols, r0, w0, 0, DT, RB_M // 4, RB_N // 2)
            copy_into(regions, bufaddr, bufcols, r0 + 1, w0, xn1 - xn0, DT, RB_M // 4, RB_N // 2)
