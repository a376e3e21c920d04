"""The megakernel tile body of the ``ewise`` kind: the Triton side of elementwise.py, which holds
the kind, the chain bytecode and its CPU body, and imports this module at its end, so that
importing either registers the body.

Per ``_EW_M x _EW_N`` block of the task's row tile the body interprets the bytecode over fp32
register tiles (REGISTERS of them, loop-carried): LOAD reads an operand (a row or column
operand broadcast, a ``bcast:`` operand through its row map), ROT reads one rotated by half
the last dim, CONST fills a register, and the fns compute; the result register is stored once
in DT. Two paths: a fast one when every operand and the output take 16-byte vectors (and a
rotation moves whole vectors), the first four operands loaded a block ahead; a general one with
a pointer per element.
"""

from __future__ import annotations

from .abi import F_NREAD, F_READ0, F_WRITE0, HAVE_TRITON
from .elementwise import CONST, EWISE, LOAD, ROT

if HAVE_TRITON:
    import triton
    import triton.language as tl

    from .abi import load_region, param_i32
    from .tilewise import row_operand, tile_ptrs, vec_cols, vec_ptr

    _READ0, _NREAD = tl.constexpr(F_READ0), tl.constexpr(F_NREAD)
    _WRITE0 = tl.constexpr(F_WRITE0)
    _LOAD, _CONST, _ROT = tl.constexpr(LOAD), tl.constexpr(CONST), tl.constexpr(ROT)
    # Params after the bytecode words: half, maps, row0, then (A, M, lo) per map.
    _P_HALF = tl.constexpr(EWISE.params.index("half"))
    _P_MAP = tl.constexpr(EWISE.params.index("map1_a"))
    # The sub-block each pass of the interpreter loop computes: REGISTERS tiles of it stay live
    # (6 x 16 x 128 fp32 = 48 KiB over the program's threads: 24 registers each at 8 warps), well
    # under what the GEMM body already needs, so the megakernel's register budget is unchanged.
    _EW_M, _EW_N = tl.constexpr(16), tl.constexpr(128)

    @triton.jit
    def _tanh(x):
        # no tanh in triton.language's core: 1 - 2 / (e^2x + 1) saturates cleanly at +-1
        return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)

    @triton.jit
    def _pow(a, b):
        # |a|^b through exp2/log2, with torch's signs: a negative base keeps its sign for an odd
        # integer exponent and gives NaN for a non-integer one; b == 0 gives 1 (0^0 included)
        mag = tl.exp2(b * tl.log2(tl.abs(a)))
        whole = b == tl.floor(b)
        odd = whole & (b - 2.0 * tl.floor(b * 0.5) == 1.0)
        neg = tl.where(odd, -mag, tl.where(whole, mag, float("nan")))
        out = tl.where(a < 0.0, neg, mag)
        return tl.where(b == 0.0, 1.0, out)

    @triton.jit
    def _ewise_math(code, x, a, b):
        """The fn ``CODES[code]``: unary fns of ``x``, binary ones of ``(a, b)``."""
        y = x
        if code == 0:
            y = -x
        elif code == 1:
            y = x / (1.0 + tl.exp(-x))
        elif code == 2:
            y = 0.5 * x * (1.0 + tl.erf(x * 0.7071067811865476))
        elif code == 3:
            y = 0.5 * x * (1.0 + _tanh(0.7978845608028654 * (x + 0.044715 * x * x * x)))
        elif code == 4:
            y = tl.maximum(x, 0.0)
        elif code == 5:
            y = 1.0 / (1.0 + tl.exp(-x))
        elif code == 6:
            y = _tanh(x)
        elif code == 7:
            y = tl.exp(x)
        elif code == 8:
            y = tl.log(x)
        elif code == 9:
            y = tl.sqrt(x)
        elif code == 10:
            y = tl.rsqrt(x)
        elif code == 11:
            y = tl.abs(x)
        elif code == 13:
            y = a + b
        elif code == 14:
            y = a - b
        elif code == 15:
            y = a * b
        elif code == 16:
            y = a / b
        elif code == 17:
            y = _pow(a, b)
        elif code == 18:
            y = tl.maximum(a, b)
        elif code == 19:
            y = tl.minimum(a, b)
        return y  # code 12: identity

    @triton.jit
    def _pick(i, v0, v1, v2, v3, v4, v5):
        """Register ``i`` (a uniform branch: every thread reads the same index)."""
        v = v0
        if i == 1:
            v = v1
        elif i == 2:
            v = v2
        elif i == 3:
            v = v3
        elif i == 4:
            v = v4
        elif i == 5:
            v = v5
        return v

    @triton.jit
    def _put(i, y, v0, v1, v2, v3, v4, v5):
        """The registers with register ``i`` set to ``y``."""
        if i == 0:
            v0 = y
        elif i == 1:
            v1 = y
        elif i == 2:
            v2 = y
        elif i == 3:
            v3 = y
        elif i == 4:
            v4 = y
        elif i == 5:
            v5 = y
        return v0, v1, v2, v3, v4, v5

    @triton.jit
    def _rows_of(params, tp, maps, k, row0, om):
        """Rows of input ``k``'s region that the tile's rows ``om`` read: ``om`` itself, or,
        for a broadcast operand, ``(g // A) * M + g % M - lo`` of their global rows ``g``."""
        code = (maps >> (2 * k)) & 3
        rows = om
        if code != 0:
            a = param_i32(params, tp, _P_MAP + 3 * (code - 1))
            m = param_i32(params, tp, _P_MAP + 3 * (code - 1) + 1)
            lo = param_i32(params, tp, _P_MAP + 3 * (code - 1) + 2)
            g = row0 + om
            rows = (g // a) * m + g % m - lo
        return rows

    @triton.jit
    def _rot_cols(on, half):
        """rotate_half's columns: column j reads j + half (negated) in the first half, j - half
        in the second."""
        return tl.where(on < half, on + half, on - half)

    @triton.jit
    def _vblock(blk, nbj, m, n, VEC: tl.constexpr):
        """Rows, columns and mask of block ``blk`` (row-major over ``nbj`` column blocks); a
        block past the last one is all masked."""
        om = (blk // nbj) * _EW_M + tl.arange(0, _EW_M)
        on = vec_cols((blk % nbj) * _EW_N, _EW_N, VEC)
        return om, on, (om < m)[:, None] & (on < n)[None, :]

    @triton.jit
    def _vload(addr, pitch, om, on, mask, DT: tl.constexpr):
        """A fast-path operand's [_EW_M, _EW_N] block at rows ``om``, in DT (row_operand's
        address and pitch, its ``vec`` checked: 16-byte vectors, int32 offsets; ``on`` in runs
        of VEC columns starting on multiples of VEC)."""
        VEC: tl.constexpr = 128 // DT.primitive_bitwidth
        p = vec_ptr(addr, DT) + (om * (pitch // VEC * VEC))[:, None] + on[None, :]
        return tl.load(p, mask=mask, other=1.0)  # 1: masked lanes finite through log, 1/x

    @triton.jit
    def _ewise_vec(tp, params, regions, bufaddr, bufcols, r0, nread, w0, m, n, DT: tl.constexpr):
        """The fast path: every operand and the output take 16-byte vectors (and half of a
        rotation is a multiple of them, so its columns move in whole vectors). The first four
        operands of block b + 1 are loaded before block b's bytecode runs (in flight together
        and behind its math, where the interpreter's LOADs waited one after another); a LOAD
        of a later operand, or a ROT, reads it then. Region lookups are hoisted out of the
        block loop."""
        VEC: tl.constexpr = 128 // DT.primitive_bitwidth
        nops = param_i32(params, tp, 0)
        result = param_i32(params, tp, 1)
        half = param_i32(params, tp, _P_HALF)
        maps = param_i32(params, tp, _P_HALF + 1)
        row0 = param_i32(params, tp, _P_HALF + 2)
        last = r0 + nread - 1  # operand k of a task with fewer reads: not loaded (the index
        a0, p0, _v0 = row_operand(regions, bufaddr, bufcols, r0, DT)  # only stays in range)
        a1, p1, _v1 = row_operand(regions, bufaddr, bufcols, tl.minimum(r0 + 1, last), DT)
        a2, p2, _v2 = row_operand(regions, bufaddr, bufcols, tl.minimum(r0 + 2, last), DT)
        a3, p3, _v3 = row_operand(regions, bufaddr, bufcols, tl.minimum(r0 + 3, last), DT)
        oa, opitch, _vo = row_operand(regions, bufaddr, bufcols, w0, DT)
        out_p = vec_ptr(oa, DT)
        opitch = opitch // VEC * VEC
        n = n // VEC * VEC
        half = half // VEC * VEC  # a multiple of VEC here (ewise_tile checked it)
        nbj = tl.cdiv(n, _EW_N)
        raw = tl.zeros((_EW_M, _EW_N), dtype=DT)
        om, on, mask = _vblock(0, nbj, m, n, VEC)
        t0 = _vload(a0, p0, om, on, mask, DT)
        t1 = raw
        t2 = raw
        t3 = raw
        if nread > 1:
            t1 = _vload(a1, p1, _rows_of(params, tp, maps, 1, row0, om), on, mask, DT)
        if nread > 2:
            t2 = _vload(a2, p2, _rows_of(params, tp, maps, 2, row0, om), on, mask, DT)
        if nread > 3:
            t3 = _vload(a3, p3, _rows_of(params, tp, maps, 3, row0, om), on, mask, DT)
        for blk in range(0, tl.cdiv(m, _EW_M) * nbj):
            nm, nn, nmask = _vblock(blk + 1, nbj, m, n, VEC)
            u0 = _vload(a0, p0, nm, nn, nmask, DT)
            u1 = raw
            u2 = raw
            u3 = raw
            if nread > 1:
                u1 = _vload(a1, p1, _rows_of(params, tp, maps, 1, row0, nm), nn, nmask, DT)
            if nread > 2:
                u2 = _vload(a2, p2, _rows_of(params, tp, maps, 2, row0, nm), nn, nmask, DT)
            if nread > 3:
                u3 = _vload(a3, p3, _rows_of(params, tp, maps, 3, row0, nm), nn, nmask, DT)
            om, on, mask = _vblock(blk, nbj, m, n, VEC)
            zero = tl.zeros((_EW_M, _EW_N), dtype=tl.float32)
            v0 = zero
            v1 = zero
            v2 = zero
            v3 = zero
            v4 = zero
            v5 = zero
            for k in range(0, nops):
                op = param_i32(params, tp, 2 + 4 * k)
                dst = param_i32(params, tp, 3 + 4 * k)
                a = param_i32(params, tp, 4 + 4 * k)
                b = param_i32(params, tp, 5 + 4 * k)
                if op == _LOAD:
                    if a < 4:
                        y = _pick(a, t0, t1, t2, t3, t3, t3).to(tl.float32)
                    else:
                        ak, pk, _vk = row_operand(regions, bufaddr, bufcols, r0 + a, DT)
                        rows = _rows_of(params, tp, maps, a, row0, om)
                        y = _vload(ak, pk, rows, on, mask, DT).to(tl.float32)
                elif op == _ROT:
                    ak, pk, _vk = row_operand(regions, bufaddr, bufcols, r0 + a, DT)
                    rows = _rows_of(params, tp, maps, a, row0, om)
                    # runs of VEC columns stay runs: half is a multiple of VEC
                    cols = tl.max_contiguous(tl.multiple_of(_rot_cols(on, half), VEC), VEC)
                    y = _vload(ak, pk, rows, cols, mask, DT).to(tl.float32)
                    y = tl.where((on < half)[None, :], -y, y)
                elif op == _CONST:
                    y = zero + b.to(tl.float32, bitcast=True)
                else:
                    xa = _pick(a, v0, v1, v2, v3, v4, v5)
                    xb = _pick(b, v0, v1, v2, v3, v4, v5)
                    y = _ewise_math(op, xa, xa, xb)
                v0, v1, v2, v3, v4, v5 = _put(dst, y, v0, v1, v2, v3, v4, v5)
            out = _pick(result, v0, v1, v2, v3, v4, v5)
            tl.store(out_p + (om * opitch)[:, None] + on[None, :], out.to(DT), mask=mask)
            t0 = u0
            t1 = u1
            t2 = u2
            t3 = u3

    @triton.jit
    def _ewise_general(tp, params, regions, bufaddr, bufcols, r0, w0, m, n, DT: tl.constexpr):
        """The general path: any operand forms and widths, pointers per element (tile_ptrs)."""
        nops = param_i32(params, tp, 0)
        result = param_i32(params, tp, 1)
        half = param_i32(params, tp, _P_HALF)
        maps = param_i32(params, tp, _P_HALF + 1)
        row0 = param_i32(params, tp, _P_HALF + 2)
        for i in range(0, m, _EW_M):
            for j in range(0, n, _EW_N):
                om = i + tl.arange(0, _EW_M)
                on = j + tl.arange(0, _EW_N)
                mask = (om < m)[:, None] & (on < n)[None, :]
                zero = tl.zeros((_EW_M, _EW_N), dtype=tl.float32)
                v0 = zero
                v1 = zero
                v2 = zero
                v3 = zero
                v4 = zero
                v5 = zero
                for k in range(0, nops):
                    op = param_i32(params, tp, 2 + 4 * k)
                    dst = param_i32(params, tp, 3 + 4 * k)
                    a = param_i32(params, tp, 4 + 4 * k)
                    b = param_i32(params, tp, 5 + 4 * k)
                    if op == _LOAD:
                        rows = _rows_of(params, tp, maps, a, row0, om)
                        y = tl.load(
                            tile_ptrs(regions, bufaddr, bufcols, r0 + a, rows, on, DT),
                            mask=mask,
                            other=1.0,  # masked lanes stay finite through log, 1/x
                        ).to(tl.float32)
                    elif op == _ROT:
                        rows = _rows_of(params, tp, maps, a, row0, om)
                        cols = _rot_cols(on, half)
                        y = tl.load(
                            tile_ptrs(regions, bufaddr, bufcols, r0 + a, rows, cols, DT),
                            mask=mask,
                            other=1.0,
                        ).to(tl.float32)
                        y = tl.where((on < half)[None, :], -y, y)
                    elif op == _CONST:
                        y = zero + b.to(tl.float32, bitcast=True)
                    else:
                        xa = _pick(a, v0, v1, v2, v3, v4, v5)
                        xb = _pick(b, v0, v1, v2, v3, v4, v5)
                        y = _ewise_math(op, xa, xa, xb)
                    v0, v1, v2, v3, v4, v5 = _put(dst, y, v0, v1, v2, v3, v4, v5)
                out = _pick(result, v0, v1, v2, v3, v4, v5)
                tl.store(
                    tile_ptrs(regions, bufaddr, bufcols, w0, om, on, DT), out.to(DT), mask=mask
                )

    @EWISE.triton
    @triton.jit
    def ewise_tile(tp, params, regions, bufaddr, bufcols, DT: tl.constexpr):
        """The task's chain over its row tile, in _EW_M x _EW_N blocks: per block, the bytecode
        runs over fp32 register tiles (LOAD reads region ``read0 + a``, broadcasting a row or
        column operand and mapping a broadcast operand's rows; ROT reads it rotated), and the
        result register is stored once, cast to DT. Tasks whose operands and output all take
        16-byte vectors (tilewise.row_operand: full, row and broadcast operands of 16-byte
        rows; a rotation by a multiple of 16 bytes) run _ewise_vec; others (a column operand,
        odd widths) _ewise_general."""
        VEC: tl.constexpr = 128 // DT.primitive_bitwidth
        r0 = tl.load(tp + _READ0)
        nread = tl.load(tp + _NREAD)
        w0 = tl.load(tp + _WRITE0)
        _s, xm0, xm1, xn0, xn1 = load_region(regions, r0)
        _oa, _op, fast = row_operand(regions, bufaddr, bufcols, w0, DT)
        for k in range(0, nread):
            _a, _p, vec = row_operand(regions, bufaddr, bufcols, r0 + k, DT)
            fast = fast & vec
        fast = fast & (param_i32(params, tp, _P_HALF) % VEC == 0)
        if fast:
            _ewise_vec(tp, params, regions, bufaddr, bufcols, r0, nread, w0, xm1 - xm0,
                       xn1 - xn0, DT)
        else:
            _ewise_general(tp, params, regions, bufaddr, bufcols, r0, w0, xm1 - xm0, xn1 - xn0,
                           DT)
