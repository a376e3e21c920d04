"""Shared lowering of the layout-following tile ops: elementwise math, norms, softmax, row
reductions and user-registered ops.

These ops move no data: each rank computes the rows it holds, in whatever layout its main input
``x`` has (the op's ``layout`` option, set by the tracer), one compute task per block of
``tile_rows`` buffer rows spanning every column. Row-wise ops (norms, softmax) need whole rows,
so their ``x`` is never sharded along the last dim. Other operands come in one of four forms:

- ``full``: same shape as ``x``, held in the same layout (same buffer rows);
- ``row``: a vector over the last dim (a norm weight, a bias), read whole by every tile (only its
  columns of a column-sharded ``x``);
- ``col``: one value per row (shape ``[..., 1]``), held in the rows of ``x``;
- scalars travel as task params.

Shapes: dims are the flat 2-D view ``rows x cols`` of ``x``; option ``shape`` is its N-D shape
(default ``[rows, cols]``), which the layout refers to.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..builder import GraphBuilder, split
from ..errors import ShapeError
from ..graph import Buffer
from ..kinds import Role
from ..layout import Layout, check_layout, flat_shape, layout_runs, runs_pieces
from ..topology import Topology

__all__ = [
    "OPERAND_FORMS", "parse_shape", "parse_layout", "tile_shapes", "lower_tilewise",
    "traced_norm_rows",
]

OPERAND_FORMS = ("full", "row", "col")


# Row tile of a traced norm (rms_norm, layer_norm): 64 rows, 32 where rows have 4096 columns or
# more. The Llama layer's norms (4096 rows of 4096) made 64 tasks of 1 MiB for 132 programs: the
# GEMM tasks behind them waited while half the programs had nothing to do (benchmarks/NOTES.md
# v15, call 3); a 32-row task of those rows still moves 256 KiB in bf16, far above what a task's
# dispatch costs (~2 us, ~64 KiB at a program's memory rate).
def traced_norm_rows(cols: int) -> int:
    return 32 if cols >= 4096 else 64


def parse_shape(op: str, rows: int, cols: int, shape: Sequence[int] | None) -> tuple[int, ...]:
    if shape is None:
        return (rows, cols)
    shape = tuple(int(n) for n in shape)
    if flat_shape(shape) != (rows, cols):
        raise ShapeError(
            f"{op}: shape={list(shape)} does not flatten to rows x cols = {rows} x {cols}",
            hint="rows is the product of all dims but the last, cols the last dim",
        )
    return shape


def parse_layout(layout: Sequence | None) -> Layout:
    return Layout.from_json(layout)


def tile_shapes(
    op: str,
    topology: Topology,
    rows: int,
    cols: int,
    shape: Sequence[int] | None,
    layout: Sequence | None,
    operands: dict[str, str],
    out_cols: int | None = None,
    *,
    whole_rows: bool = False,
) -> dict[str, tuple]:
    """Global shapes (flat 2-D) of ``x``, the operands and ``out``; checks the layout."""
    nd = parse_shape(op, rows, cols, shape)
    lay = parse_layout(layout)
    check_layout(nd, lay, topology.world_size, op, "choose sizes divisible by the world size")
    if whole_rows and lay.kind == "shard" and lay.dim == len(nd) - 1:
        raise ShapeError(
            f"{op}: works on whole rows; its input cannot be sharded along the last dim",
            hint="replicate the input, or shard it along another dim",
        )
    out = {"x": (rows, cols), "out": (rows, cols if out_cols is None else out_cols)}
    for name, form in operands.items():
        if form not in OPERAND_FORMS:
            raise ShapeError(f"{op}: operand {name!r} has unknown form {form!r}")
        out[name] = {"full": (rows, cols), "row": (1, cols), "col": (rows, 1)}[form]
    return out


def lower_tilewise(
    b: GraphBuilder,
    kind: str,
    *,
    rows: int,
    cols: int,
    shape: Sequence[int] | None,
    layout: Sequence | None,
    operands: dict[str, str],
    out_cols: int | None = None,
    params: dict[str, Any] | None = None,
    tile_rows: int = 64,
    label: str | None = None,
) -> None:
    """Emit ``kind`` tiles: reads ``[x, *operands in order]``, writes ``[out]``."""
    if isinstance(tile_rows, bool) or not isinstance(tile_rows, int) or tile_rows <= 0:
        raise ShapeError(f"{kind}: tile_rows={tile_rows!r} must be a positive int")
    nd = parse_shape(kind, rows, cols, shape)
    lay = parse_layout(layout)
    world = b.world
    out_cols = cols if out_cols is None else out_cols
    b.global_input("x", (rows, cols))
    for name, form in operands.items():
        b.global_input(name, {"full": (rows, cols), "row": (1, cols), "col": (rows, 1)}[form])
    b.global_output("out", (rows, out_cols))
    label = label or kind
    for r in b.topo.ranks:
        runs = layout_runs(nd, lay, r, world)
        x = b.bound_buffer("x", r, "x", runs_pieces(runs))
        c0, c1 = runs[0][2], runs[0][3]
        reads: list[tuple[Buffer, str]] = []
        for name, form in operands.items():
            if form == "full":
                pieces = runs_pieces(runs)
            elif form == "row":
                pieces = (((0, 1), (c0, c1)),)
            else:
                pieces = tuple(((r0, r1), (0, 1)) for r0, r1, _, _ in runs)
            reads.append((b.bound_buffer(name, r, name, pieces), form))
        if out_cols == cols:
            out_pieces = runs_pieces(runs)
        else:
            assert (c0, c1) == (0, cols), "a row op changing the width needs whole rows"
            out_pieces = tuple(((r0, r1), (0, out_cols)) for r0, r1, _, _ in runs)
        out = b.bound_buffer("out", r, "out", out_pieces, role="output")
        for t0, t1 in split(x.rows, tile_rows):
            regions = [x.region((t0, t1))]
            for buf, form in reads:
                regions.append(buf.region() if form == "row" else buf.region((t0, t1)))
            b.task(
                r,
                Role.COMPUTE,
                kind,
                regions,
                [out.region((t0, t1))],
                name=f"{label} r{r} [{t0}:{t1}]",
                params=dict(params or {}),
            )


# -- helpers of the row-tile Triton bodies (elementwise, norms, softmax, row_reduce, concat) -----
from .abi import HAVE_TRITON  # noqa: E402  (after the CPU side: triton is optional)

if HAVE_TRITON:
    import triton
    import triton.language as tl

    from .abi import buffer_base, load_region

    @triton.jit
    def tile_ptrs(regions, bufaddr, bufcols, index, om, on, DT: tl.constexpr):
        """Pointers into region ``index`` at its rows ``om`` and columns ``on`` (offsets from
        the region's corner). A region one row or one column wide is broadcast along that dim
        (stride 0): a ``row`` operand (a weight) is read by every row of the tile, a ``col``
        operand by every column, as torch broadcasts them in the CPU bodies."""
        s, r0, r1, c0, c1 = load_region(regions, index)
        base = buffer_base(bufaddr, s, DT)
        cols = tl.load(bufcols + s).to(tl.int64)
        rs = (r1 - r0 > 1).to(tl.int64)
        cs = (c1 - c0 > 1).to(tl.int64)
        return base + (r0 + om.to(tl.int64) * rs)[:, None] * cols + (c0 + on.to(tl.int64) * cs)[None, :]

    @triton.jit
    def row_operand(regions, bufaddr, bufcols, index, DT: tl.constexpr):
        """Region ``index`` for the vectorised fast paths: (address of its corner as an int64,
        its row pitch in elements: 0 for a region one row wide, read by every row, and
        ``vec``: whether 16-byte vectors may read it, i.e. it is more than one column wide
        and its corner, pitch and width are multiples of 16 bytes, its base 16-byte aligned
        (encode.ALIGN guarantees 256) and its offsets fit int32).

        A body makes its pointer from the address inside the branch that checked ``vec``,
        then hints it (tl.multiple_of marks the op that defines its argument: a pointer made
        before the branch would carry the hint into the general path too)."""
        s, r0, r1, c0, c1 = load_region(regions, index)
        addr = tl.load(bufaddr + s)
        cols = tl.load(bufcols + s)
        corner = r0.to(tl.int64) * cols + c0
        pitch = tl.where(r1 - r0 > 1, cols, 0)
        vec = (c1 - c0 > 1) & ((corner | pitch | (c1 - c0)) % (128 // DT.primitive_bitwidth) == 0)
        vec = vec & (addr % 16 == 0) & ((r1 - r0).to(tl.int64) * cols < 2**31)
        return addr + corner * (DT.primitive_bitwidth // 8), pitch, vec

    @triton.jit
    def vec_ptr(addr, DT: tl.constexpr):
        """The typed, 16-byte aligned pointer of a row_operand address (call it inside the
        branch that checked ``vec``)."""
        return tl.multiple_of(addr.to(tl.pointer_type(DT)), 16)

    @triton.jit
    def vec_cols(j, BLOCK: tl.constexpr, VEC: tl.constexpr):
        """Columns ``j .. j + BLOCK`` of a fast path, hinted as runs of VEC that start on a
        multiple of VEC (``j`` is one: the loops step by the block)."""
        return tl.multiple_of(j + tl.arange(0, BLOCK), VEC)

    @triton.jit
    def word_ptr(addr, DT: tl.constexpr):
        """A row_operand address (its ``vec`` checked) as a 16-byte aligned pointer to 32-bit
        words: two elements each in a 16-bit DT, one in fp32. Loads through it return
        uint32 tiles; see unpack_lo."""
        return tl.multiple_of(addr.to(tl.pointer_type(tl.uint32)), 16)

    @triton.jit
    def unpack_lo(w, DT: tl.constexpr):
        """The first element (the lower address) of each 32-bit word ``w`` of DT, in fp32; the
        element itself in fp32.

        Why words: a loaded DT tile carried across a loop's back edge (loads issued one block
        ahead) was a phi of 16-bit values, and ptxas unpacked each 16-byte load's registers
        (PRMT) at the end of the iteration: a wait for the loads just issued, so each block
        paid the whole memory latency after its arithmetic (sm_90 SASS of the generated ewise
        loop and of rms_norm's). A uint32 tile's registers are the loads' own: the carry
        costs no instruction and the wait moves to the first use."""
        if DT.primitive_bitwidth == 32:
            y = w.to(DT, bitcast=True).to(tl.float32)
        elif DT == tl.bfloat16:
            y = (w << 16).to(tl.float32, bitcast=True)  # bf16 -> fp32 is exact: a shift
        else:
            y = (w & 0xFFFF).to(tl.uint16).to(DT, bitcast=True).to(tl.float32)
        return y

    @triton.jit
    def unpack_hi(w, DT: tl.constexpr):
        """The second element of each 32-bit word ``w`` of a 16-bit DT, in fp32 (unused for
        fp32 words)."""
        if DT == tl.bfloat16:
            y = ((w >> 16) << 16).to(tl.float32, bitcast=True)
        else:
            y = (w >> 16).to(tl.uint16).to(DT, bitcast=True).to(tl.float32)
        return y

    @triton.jit
    def pack2(lo, hi, DT: tl.constexpr):
        """fp32 tiles ``lo`` and ``hi`` rounded to DT and packed as the words unpack_lo and
        unpack_hi read (``lo`` alone for fp32)."""
        if DT.primitive_bitwidth == 32:
            w = lo.to(DT).to(tl.uint32, bitcast=True)
        else:
            a = lo.to(DT).to(tl.uint16, bitcast=True).to(tl.uint32)
            b = hi.to(DT).to(tl.uint16, bitcast=True).to(tl.uint32)
            w = a | (b << 16)
        return w

    @triton.jit
    def one_word(DT: tl.constexpr):
        """The word of DT 1.0s (masked lanes' fill: finite through log and 1/x)."""
        if DT.primitive_bitwidth == 32:
            v = tl.full((), 1.0, tl.float32).to(DT).to(tl.uint32, bitcast=True)
        else:
            h = tl.full((), 1.0, tl.float32).to(DT).to(tl.uint16, bitcast=True).to(tl.uint32)
            v = h | (h << 16)
        return v

    @triton.jit
    def block_ptrs(addr, pitch, om, on, DT: tl.constexpr, FAST: tl.constexpr):
        """Pointers to rows ``om`` and columns ``on`` of a row_operand region (a region more
        than one column wide, or one whose single column is all ``on`` reaches). FAST (the
        region's ``vec`` checked, the call inside that branch, ``on`` starting on a multiple of
        VEC): int32 offsets from a 16-byte aligned corner, contiguity Triton can prove;
        otherwise int64 offsets, element by element."""
        if FAST:
            VEC: tl.constexpr = 128 // DT.primitive_bitwidth
            rows = om * (pitch // VEC * VEC)  # == om * pitch here, provably a multiple of VEC
            return vec_ptr(addr, DT) + rows[:, None] + tl.multiple_of(on, VEC)[None, :]
        else:
            return addr.to(tl.pointer_type(DT)) + om.to(tl.int64)[:, None] * pitch + on[None, :]

    @triton.jit
    def vec_width(n, DT: tl.constexpr, FAST: tl.constexpr):
        """``n`` (a FAST region's width, a multiple of VEC) with that made provable, so that
        masks ``on < n`` stay constant over each vector; unchanged otherwise."""
        if FAST:
            VEC: tl.constexpr = 128 // DT.primitive_bitwidth
            n = n // VEC * VEC
        return n

    @triton.jit
    def copy_vec(sa, spitch, da, dpitch, m, n, DT: tl.constexpr, BLK_M: tl.constexpr,
                 BLK_N: tl.constexpr):
        """``m`` x ``n`` elements from ``sa`` to ``da`` (row_operand addresses, pitches in
        elements) when both regions take 16-byte vectors (row_operand's ``vec``; ``da`` already at the
        destination column): int32 offsets, 16-byte loads and stores. The fast path of concat
        and of the NVLink copies (tiles.copy_tile)."""
        VEC: tl.constexpr = 128 // DT.primitive_bitwidth
        src = vec_ptr(sa, DT)
        dst = vec_ptr(da, DT)
        spitch = spitch // VEC * VEC  # as they are here, provably multiples of VEC
        dpitch = dpitch // VEC * VEC
        n = n // VEC * VEC
        for i in range(0, m, BLK_M):
            om = i + tl.arange(0, BLK_M)
            for j in range(0, n, BLK_N):
                on = vec_cols(j, BLK_N, VEC)
                mask = (om < m)[:, None] & (on < n)[None, :]
                x = tl.load(src + (om * spitch)[:, None] + on[None, :], mask=mask)
                tl.store(dst + (om * dpitch)[:, None] + on[None, :], x, mask=mask)

    @triton.jit
    def copy_into(regions, bufaddr, bufcols, src, dst, col0, DT: tl.constexpr,
                   RB_M: tl.constexpr, RB_N: tl.constexpr):
        """Region ``src`` stored into region ``dst`` from its column ``col0`` on, element by
        element (int64 pointers: regions off 16-byte boundaries; callers pass blocks smaller than
        copy_vec's, whose int64 pointer tensors would spill)."""
        _s, m0, m1, n0, n1 = load_region(regions, src)
        for i in range(0, m1 - m0, RB_M):
            for j in range(0, n1 - n0, RB_N):
                om = i + tl.arange(0, RB_M)
                on = j + tl.arange(0, RB_N)
                mask = (om < m1 - m0)[:, None] & (on < n1 - n0)[None, :]
                x = tl.load(tile_ptrs(regions, bufaddr, bufcols, src, om, on, DT), mask=mask)
                tl.store(tile_ptrs(regions, bufaddr, bufcols, dst, om, col0 + on, DT), x,
                         mask=mask)

    __all__ += ["tile_ptrs", "row_operand", "vec_ptr", "vec_cols", "word_ptr", "unpack_lo",
                "unpack_hi", "pack2", "one_word", "block_ptrs", "vec_width", "copy_vec",
                "copy_into"]
