"""The megakernel tile body of the ``ewise`` kind: the Triton side of elementwise.py, which holds
the kind, the chain bytecode and its CPU body, and imports this module at its end, so that
importing either registers the body.

Per ``_EW_M x _EW_N`` block of the task's row tile the body interprets the bytecode over fp32
register tiles (REGISTERS of them, loop-carried): LOAD reads an operand (a row or column
operand broadcast, a ``bcast:`` operand through its row map, a ``gather:`` operand from its
source buffer through the relayout's gather map: relayout._digit_sum and _digits, the same
index arithmetic as the relayout body), ROT reads one rotated by half the last dim, CONST fills
a register, and the fns compute; the result register is stored once in DT. Two paths: a fast
one when every operand and the output take 16-byte vectors (and a rotation moves whole
vectors; a gather operand's map passes relayout's fast-path gate: its innermost column digit a
stride-1 run of whole vectors, every other stride and its base multiples of them), operands
0 and 1 of 8 blocks (4 in fp32; in a tile of half that or fewer, RoPE's, also operand 2 and
operand 0 rotated) loaded together before the bytecode runs over them (_ewise_vec); a general
one with a pointer per element.
"""

from __future__ import annotations

from .abi import F_NREAD, F_READ0, F_WRITE0, HAVE_TRITON
from .elementwise import CONST, EWISE, GATHER, LOAD, ROT

if HAVE_TRITON:
    import triton
    import triton.language as tl

    from .abi import F_PARAM0, load_region, param_i32
    from .relayout import DIGITS, _digit_sum, _digits
    from .tilewise import row_operand, tile_ptrs, vec_cols, vec_ptr

    _READ0, _NREAD = tl.constexpr(F_READ0), tl.constexpr(F_NREAD)
    _WRITE0 = tl.constexpr(F_WRITE0)
    _LOAD, _CONST, _ROT = tl.constexpr(LOAD), tl.constexpr(CONST), tl.constexpr(ROT)
    # Params after the bytecode words: half, maps, row0, then (A, M, lo) per map.
    _P_HALF = tl.constexpr(EWISE.params.index("half"))
    _P_MAP = tl.constexpr(EWISE.params.index("map1_a"))
    # a gather operand's map: base, then (radix, stride) per row digit, then per column digit
    _P_G = tl.constexpr(EWISE.params.index("g_base"))
    _P_GC = tl.constexpr(EWISE.params.index("g_c0n"))
    _GATHER, _PARAM0 = tl.constexpr(GATHER), tl.constexpr(F_PARAM0)
    _DIGITS = tl.constexpr(DIGITS)
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
    def _gather_at(params, tp, regions, bufaddr, index):
        """A gather operand (region ``index``): its buffer's address (an int64: the map's
        positions count from the buffer's start, not the region's) and the task's gather map
        ``pp`` (base, then radix and stride per digit: relayout._digit_sum's layout)."""
        s, _r0, _r1, _c0, _c1 = load_region(regions, index)
        return tl.load(bufaddr + s), params + tl.load(tp + _PARAM0) + _P_G

    @triton.jit
    def _gather_src(params, tp, regions, bufaddr, bufcols, index, DT: tl.constexpr):
        """A gather operand (region ``index``): (its buffer's address as an int64, the task's
        gather map ``pp`` for _digit_sum, ``vec``: relayout_tile's fast-path gate: the
        innermost column digit a stride-1 run of whole 16-byte vectors, the base and every
        other stride multiples of them, the base 16-byte aligned and the positions the region
        spans int32)."""
        VEC: tl.constexpr = 128 // DT.primitive_bitwidth
        s, _r0, r1, _c0, _c1 = load_region(regions, index)
        addr, pp = _gather_at(params, tp, regions, bufaddr, index)
        odd = tl.load(pp) | tl.load(pp + 1 + 2 * _DIGITS)  # the base, the run's length
        for k in tl.static_range(_DIGITS):
            odd = odd | tl.load(pp + 2 + 2 * k)  # row strides
        for k in tl.static_range(1, _DIGITS):
            odd = odd | tl.load(pp + 2 + 2 * _DIGITS + 2 * k)  # outer column strides
        vec = (tl.load(pp + 2 + 2 * _DIGITS) == 1) & (odd % VEC == 0) & (addr % 16 == 0)
        vec = vec & (r1.to(tl.int64) * tl.load(bufcols + s) < 2**31)
        return addr, pp, vec

    @triton.jit
    def _gload(addr, pp, om, on, mask, DT: tl.constexpr):
        """A fast-path gather operand's block at the tile's rows ``om`` and columns ``on`` (in
        runs of VEC from multiples of VEC): the map's positions in int32, each run one
        16-byte vector (_gather_src's ``vec`` checked)."""
        VEC: tl.constexpr = 128 // DT.primitive_bitwidth
        rpos = tl.multiple_of(tl.load(pp) + _digit_sum(om, pp + 1, VEC, 1), VEC)
        cpos = _digit_sum(on, pp + 1 + 2 * _DIGITS, VEC, VEC)  # runs of VEC from multiples of VEC
        p = vec_ptr(addr, DT) + rpos[:, None] + cpos[None, :]
        return tl.load(p, mask=mask, other=1.0)

    @triton.jit
    def _gptrs(params, tp, regions, bufaddr, index, om, on, DT: tl.constexpr):
        """Pointers of a gather operand (region ``index``) at the tile's rows ``om`` and
        columns ``on``, in int64 (relayout._gather's arithmetic)."""
        addr, _pp = _gather_at(params, tp, regions, bufaddr, index)
        pos = param_i32(params, tp, _P_G).to(tl.int64) + _digits(params, tp, _P_G + 1, om)[
            :, None] + _digits(params, tp, _P_GC, on)[None, :]
        return addr.to(tl.pointer_type(DT)) + pos

    @triton.jit
    def _vread(params, tp, regions, bufaddr, bufcols, index, k, maps, row0, addr, pitch, om,
               on, mask, DT: tl.constexpr):
        """Fast-path operand ``k`` (region ``index``; row_operand's ``addr`` and ``pitch``) at
        the tile's rows ``om``, columns ``on``: through the gather map or a row map."""
        if (maps >> (2 * k)) & 3 == _GATHER:
            ga, pp = _gather_at(params, tp, regions, bufaddr, index)
            y = _gload(ga, pp, om, on, mask, DT)
        else:
            y = _vload(addr, pitch, _rows_of(params, tp, maps, k, row0, om), on, mask, DT)
        return y

    @triton.jit
    def _rot_cols(on, half):
        """rotate_half's columns: column j reads j + half (negated) in the first half, j - half
        in the second."""
        return tl.where(on < half, on + half, on - half)

    @triton.jit
    def _vload(addr, pitch, om, on, mask, DT: tl.constexpr):
        """A fast-path operand's [_EW_M, _EW_N] block at rows ``om``, in DT (row_operand's
        address and pitch, its ``vec`` checked: 16-byte vectors, int32 offsets; ``on`` in runs
        of VEC columns starting on multiples of VEC)."""
        VEC: tl.constexpr = 128 // DT.primitive_bitwidth
        p = vec_ptr(addr, DT) + (om * (pitch // VEC * VEC))[:, None] + on[None, :]
        return tl.load(p, mask=mask, other=1.0)  # 1: masked lanes finite through log, 1/x

    @triton.jit
    def _pick4(i, v0, v1, v2, v3):
        """Value ``i`` of four (a uniform branch, as _pick)."""
        v = v0
        if i == 1:
            v = v1
        elif i == 2:
            v = v2
        elif i == 3:
            v = v3
        return v

    @triton.jit
    def _slot(q, x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15):
        """Slot ``q`` of a batch (two levels of _pick4: a uniform branch)."""
        v = x0
        if q < 4:
            v = _pick4(q, x0, x1, x2, x3)
        elif q < 8:
            v = _pick4(q - 4, x4, x5, x6, x7)
        elif q < 12:
            v = _pick4(q - 8, x8, x9, x10, x11)
        else:
            v = _pick4(q - 12, x12, x13, x14, x15)
        return v

    @triton.jit
    def _vslot(S: tl.constexpr, K: tl.constexpr, nread, blk0, nbj, m, n, params, tp, regions,
               bufaddr, bufcols, r0, maps, row0, addr, pitch, DT: tl.constexpr):
        """Operand K (row_operand's ``addr`` and ``pitch``) of block ``blk0 + S`` (row-major over
        ``nbj`` column blocks), loaded and not waited for. A block past the tile, or a task
        without operand K: all masked, the region index kept in range (not a branch around
        the load: Triton 3.9 merged such a branch with a copy that waits for the load)."""
        VEC: tl.constexpr = 128 // DT.primitive_bitwidth
        blk = blk0 + S
        om = blk // nbj * _EW_M + tl.arange(0, _EW_M)
        on = vec_cols(blk % nbj * _EW_N, _EW_N, VEC)
        mask = (om < tl.where(nread > K, m, 0))[:, None] & (on < n)[None, :]
        index = tl.minimum(r0 + K, r0 + nread - 1)
        return _vread(params, tp, regions, bufaddr, bufcols, index, K, maps, row0, addr, pitch,
                      om, on, mask, DT)

    @triton.jit
    def _vslot_hi(S: tl.constexpr, K: tl.constexpr, HALF: tl.constexpr, wide, rot, nread, blk0,
                  nbj, m, n, half, params, tp, regions, bufaddr, bufcols, r0, maps, row0,
                  a0, p0, a1, p1, a2, p2, DT: tl.constexpr):
        """Slot (S, K) as _vslot; but in the upper half (S >= HALF) of a ``wide`` batch (a
        tile of HALF blocks or fewer: RoPE's 64 x 128) block ``S - HALF``'s operand 2 (K = 0)
        or operand 0 rotated by ``half`` (K = 1; ``rot``: the chain rotates operand 0): what
        RoPE's bytecode reads besides operands 0 and 1, in flight with them."""
        VEC: tl.constexpr = 128 // DT.primitive_bitwidth
        if S < HALF:  # a lower slot (bf16's blocks 2 and 3): _vslot's
            wide = nread < 0
        blk = blk0 + S - tl.where(wide, HALF, 0)
        om = blk // nbj * _EW_M + tl.arange(0, _EW_M)
        on = vec_cols(blk % nbj * _EW_N, _EW_N, VEC)
        if K == 0:
            k = tl.where(wide, 2, 0)
            addr = tl.where(wide, a2, a0)
            pitch = tl.where(wide, p2, p0)
            cols = on
            live = nread > k
        else:
            k = tl.where(wide, 0, 1)
            addr = tl.where(wide, a0, a1)
            pitch = tl.where(wide, p0, p1)
            # runs of VEC columns stay runs: half is a multiple of VEC
            cols = tl.max_contiguous(tl.multiple_of(tl.where(wide, _rot_cols(on, half), on), VEC),
                                     VEC)
            live = tl.where(wide, rot, nread > 1)
        mask = (om < tl.where(live, m, 0))[:, None] & (on < n)[None, :]
        index = tl.minimum(r0 + k, r0 + nread - 1)
        return _vread(params, tp, regions, bufaddr, bufcols, index, k, maps, row0, addr, pitch,
                      om, cols, mask, DT)

    @triton.jit
    def _ewise_vec(tp, params, regions, bufaddr, bufcols, r0, nread, w0, m, n, DT: tl.constexpr):
        """The fast path: every operand and the output take 16-byte vectors (and half of a
        rotation is a multiple of them, so its columns move in whole vectors).

        The tile's _EW_M x _EW_N blocks (row-major over its column blocks) go in batches of
        SUB consecutive ones: a batch first loads operands 0 and 1 of its blocks (the two of
        SwiGLU and of a residual add, most of the bytes a layer's chains move) into 2 x SUB
        slots, all in flight together: 64 KiB a program in either dtype; then the bytecode
        runs block by block over them (a LOAD of a later operand, or a ROT, reads its block
        then) and stores each block. A tile of HALF blocks or fewer (``wide``: RoPE's 64 x
        128 in bf16) is one batch whose upper slots hold operand 2 and operand 0 rotated
        (_vslot_hi): RoPE's four reads a block all in flight together. The loop this replaces
        loaded one block ahead (4 KiB an operand) and waited for it at the next iteration's
        head, as the copy that carried it there waits for the load: latency-bound. No load
        result is carried from one iteration to the next here. Region lookups are hoisted
        out of the loops."""
        VEC: tl.constexpr = 128 // DT.primitive_bitwidth
        # 2 x SUB slots of one block: 64 registers a thread in either dtype
        SUB: tl.constexpr = 8 if DT.primitive_bitwidth <= 16 else 4
        HALF: tl.constexpr = SUB // 2
        nops = param_i32(params, tp, 0)
        result = param_i32(params, tp, 1)
        half = param_i32(params, tp, _P_HALF)
        maps = param_i32(params, tp, _P_HALF + 1)
        row0 = param_i32(params, tp, _P_HALF + 2)
        # operand 1 of a task with one read: not loaded (the index only stays in range)
        a0, p0, _v0 = row_operand(regions, bufaddr, bufcols, r0, DT)
        a1, p1, _v1 = row_operand(regions, bufaddr, bufcols, tl.minimum(r0 + 1, r0 + nread - 1),
                                  DT)
        a2, p2, _v2 = row_operand(regions, bufaddr, bufcols, tl.minimum(r0 + 2, r0 + nread - 1),
                                  DT)
        oa, opitch, _vo = row_operand(regions, bufaddr, bufcols, w0, DT)
        out_p = vec_ptr(oa, DT)
        opitch = opitch // VEC * VEC
        n = n // VEC * VEC
        half = half // VEC * VEC  # a multiple of VEC here (ewise_tile checked it)
        raw = tl.zeros((_EW_M, _EW_N), dtype=DT)
        nbj = tl.cdiv(n, _EW_N)
        nblk = tl.cdiv(m, _EW_M) * nbj
        # a tile of HALF blocks or fewer (RoPE's): its upper slots hold operand 2 and operand 0
        # rotated (_vslot_hi), where the chain reads them
        wide = nblk <= HALF
        rot = nops < 0  # whether the chain rotates operand 0
        for k in range(0, nops):
            rot = rot | ((param_i32(params, tp, 2 + 4 * k) == _ROT) & (
                param_i32(params, tp, 4 + 4 * k) == 0))
        for blk0 in range(0, nblk, SUB):
            x0 = _vslot(0, 0, nread, blk0, nbj, m, n, params, tp, regions, bufaddr,
                        bufcols, r0, maps, row0, a0, p0, DT)
            x1 = _vslot(0, 1, nread, blk0, nbj, m, n, params, tp, regions, bufaddr,
                        bufcols, r0, maps, row0, a1, p1, DT)
            x2 = _vslot(1, 0, nread, blk0, nbj, m, n, params, tp, regions, bufaddr,
                        bufcols, r0, maps, row0, a0, p0, DT)
            x3 = _vslot(1, 1, nread, blk0, nbj, m, n, params, tp, regions, bufaddr,
                        bufcols, r0, maps, row0, a1, p1, DT)
            x4 = _vslot_hi(2, 0, HALF, wide, rot, nread, blk0, nbj, m, n, half, params,
                           tp, regions, bufaddr, bufcols, r0, maps, row0, a0, p0, a1, p1,
                           a2, p2, DT)
            x5 = _vslot_hi(2, 1, HALF, wide, rot, nread, blk0, nbj, m, n, half, params,
                           tp, regions, bufaddr, bufcols, r0, maps, row0, a0, p0, a1, p1,
                           a2, p2, DT)
            x6 = _vslot_hi(3, 0, HALF, wide, rot, nread, blk0, nbj, m, n, half, params,
                           tp, regions, bufaddr, bufcols, r0, maps, row0, a0, p0, a1, p1,
                           a2, p2, DT)
            x7 = _vslot_hi(3, 1, HALF, wide, rot, nread, blk0, nbj, m, n, half, params,
                           tp, regions, bufaddr, bufcols, r0, maps, row0, a0, p0, a1, p1,
                           a2, p2, DT)
            x8, x9, x10, x11 = raw, raw, raw, raw
            x12, x13, x14, x15 = raw, raw, raw, raw
            if SUB > 4:
                x8 = _vslot_hi(4, 0, HALF, wide, rot, nread, blk0, nbj, m, n, half, params,
                               tp, regions, bufaddr, bufcols, r0, maps, row0, a0, p0, a1, p1,
                               a2, p2, DT)
                x9 = _vslot_hi(4, 1, HALF, wide, rot, nread, blk0, nbj, m, n, half, params,
                               tp, regions, bufaddr, bufcols, r0, maps, row0, a0, p0, a1, p1,
                               a2, p2, DT)
                x10 = _vslot_hi(5, 0, HALF, wide, rot, nread, blk0, nbj, m, n, half, params,
                                tp, regions, bufaddr, bufcols, r0, maps, row0, a0, p0, a1, p1,
                                a2, p2, DT)
                x11 = _vslot_hi(5, 1, HALF, wide, rot, nread, blk0, nbj, m, n, half, params,
                                tp, regions, bufaddr, bufcols, r0, maps, row0, a0, p0, a1, p1,
                                a2, p2, DT)
                x12 = _vslot_hi(6, 0, HALF, wide, rot, nread, blk0, nbj, m, n, half, params,
                                tp, regions, bufaddr, bufcols, r0, maps, row0, a0, p0, a1, p1,
                                a2, p2, DT)
                x13 = _vslot_hi(6, 1, HALF, wide, rot, nread, blk0, nbj, m, n, half, params,
                                tp, regions, bufaddr, bufcols, r0, maps, row0, a0, p0, a1, p1,
                                a2, p2, DT)
                x14 = _vslot_hi(7, 0, HALF, wide, rot, nread, blk0, nbj, m, n, half, params,
                                tp, regions, bufaddr, bufcols, r0, maps, row0, a0, p0, a1, p1,
                                a2, p2, DT)
                x15 = _vslot_hi(7, 1, HALF, wide, rot, nread, blk0, nbj, m, n, half, params,
                                tp, regions, bufaddr, bufcols, r0, maps, row0, a0, p0, a1, p1,
                                a2, p2, DT)
            for s in range(0, tl.minimum(SUB, nblk - blk0)):
                om = (blk0 + s) // nbj * _EW_M + tl.arange(0, _EW_M)
                on = vec_cols((blk0 + s) % nbj * _EW_N, _EW_N, VEC)
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
                        if a < 2:
                            y = _slot(2 * s + a, x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10,
                                      x11, x12, x13, x14, x15).to(tl.float32)
                        elif wide & (a == 2):
                            y = _slot(2 * (s + HALF), x0, x1, x2, x3, x4, x5, x6, x7, x8, x9,
                                      x10, x11, x12, x13, x14, x15).to(tl.float32)
                        else:
                            ak, pk, _vk = row_operand(regions, bufaddr, bufcols, r0 + a, DT)
                            y = _vread(params, tp, regions, bufaddr, bufcols, r0 + a, a, maps,
                                       row0, ak, pk, om, on, mask, DT).to(tl.float32)
                    elif op == _ROT:
                        if wide & (a == 0):
                            y = _slot(2 * (s + HALF) + 1, x0, x1, x2, x3, x4, x5, x6, x7, x8, x9,
                                      x10, x11, x12, x13, x14, x15).to(tl.float32)
                        else:
                            ak, pk, _vk = row_operand(regions, bufaddr, bufcols, r0 + a, DT)
                            # runs of VEC columns stay runs: half is a multiple of VEC
                            cols = tl.max_contiguous(tl.multiple_of(_rot_cols(on, half), VEC),
                                                     VEC)
                            y = _vread(params, tp, regions, bufaddr, bufcols, r0 + a, a, maps,
                                       row0, ak, pk, om, cols, mask, DT).to(tl.float32)
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

    @triton.jit(noinline=True)
    def _ewise_general(tp, params, regions, bufaddr, bufcols, r0, w0, m, n, DT: tl.constexpr):
        """The general path: any operand forms and widths, pointers per element (tile_ptrs).
        A function of its own (noinline): the fallback of ewise_tile and of every generated
        chain (elementwise_special.py), one copy in the kernel instead of one per chain."""
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
                    if (op == _LOAD) | (op == _ROT):
                        cols = on
                        if op == _ROT:
                            cols = _rot_cols(on, half)
                        if (maps >> (2 * a)) & 3 == _GATHER:
                            ptrs = _gptrs(params, tp, regions, bufaddr, r0 + a, om, cols, DT)
                        else:
                            rows = _rows_of(params, tp, maps, a, row0, om)
                            ptrs = tile_ptrs(regions, bufaddr, bufcols, r0 + a, rows, cols, DT)
                        # masked lanes stay finite through log, 1/x
                        y = tl.load(ptrs, mask=mask, other=1.0).to(tl.float32)
                        if op == _ROT:
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

    @triton.jit
    def ewise_gate(tp, params, regions, bufaddr, bufcols, DT: tl.constexpr):
        """(fast, read0, nread, write0, rows, cols) of the task whose row is ``tp``: ``fast``
        when its operands and output all take 16-byte vectors (tilewise.row_operand: full,
        row and broadcast operands of 16-byte rows; a rotation by a multiple of 16 bytes; a
        gather operand whose map passes _gather_src's gate). ewise_tile's choice between
        _ewise_vec and _ewise_general, and the generated chains' (elementwise_special.py)."""
        VEC: tl.constexpr = 128 // DT.primitive_bitwidth
        r0 = tl.load(tp + _READ0)
        nread = tl.load(tp + _NREAD)
        w0 = tl.load(tp + _WRITE0)
        _s, xm0, xm1, xn0, xn1 = load_region(regions, w0)  # x may be a gather operand
        _oa, _op, fast = row_operand(regions, bufaddr, bufcols, w0, DT)
        maps = param_i32(params, tp, _P_HALF + 1)
        for k in range(0, nread):
            _a, _p, vec = row_operand(regions, bufaddr, bufcols, r0 + k, DT)
            if (maps >> (2 * k)) & 3 == _GATHER:
                _ga, _pp, vec = _gather_src(params, tp, regions, bufaddr, bufcols, r0 + k, DT)
            fast = fast & vec
        fast = fast & (param_i32(params, tp, _P_HALF) % VEC == 0)
        return fast, r0, nread, w0, xm1 - xm0, xn1 - xn0

    @EWISE.triton
    @triton.jit
    def ewise_tile(tp, params, regions, bufaddr, bufcols, DT: tl.constexpr):
        """The task's chain over its row tile, in _EW_M x _EW_N blocks: per block, the bytecode
        runs over fp32 register tiles (LOAD reads region ``read0 + a``, broadcasting a row or
        column operand and mapping a broadcast operand's rows; ROT reads it rotated), and the
        result register is stored once, cast to DT. Tasks that pass ewise_gate run _ewise_vec;
        others (a column operand, odd widths) _ewise_general."""
        fast, r0, nread, w0, m, n = ewise_gate(tp, params, regions, bufaddr, bufcols, DT)
        if fast:
            _ewise_vec(tp, params, regions, bufaddr, bufcols, r0, nread, w0, m, n, DT)
        else:
            _ewise_general(tp, params, regions, bufaddr, bufcols, r0, w0, m, n, DT)

    @triton.jit(noinline=True)
    def ewise_other(tp, params, regions, bufaddr, bufcols, DT: tl.constexpr):
        """ewise_tile as a function of its own: the fallback of a kernel's generated chains
        (elementwise_special.py) for a task whose chain has none, one call site apart from
        them (noinline), so Triton's layout pass and ptxas see it once, on its own."""
        ewise_tile(tp, params, regions, bufaddr, bufcols, DT)
