"""The megakernel tile bodies of the MoE kinds (moe_route, moe_move, moe_expert, moe_combine):
the Triton side of moe_tiles.py, which holds the kinds, their CPU bodies and costs, and imports
this module at its end, so that importing either registers the bodies."""

from __future__ import annotations

from .abi import F_READ0, F_WRITE0, HAVE_TRITON
from .moe_tiles import COMBINE, EXPERT, MOVE, ROUTE

# -- megakernel tile bodies ----------------------------------------------------------------------
# Every body addresses the data regions (x, logits, send/recv rows, weights, hidden, outputs) in
# the graph's dtype DT and the routing regions (meta, counts, picks) as float32, whatever DT is:
# the lowering declares those float32. A routed tile has data-dependent rows and the edges of
# any block are masked (or, through TMA, zero-filled on load and clipped on store), so no dim
# needs to be a multiple of a block. Each body checks at run time whether its rows are whole
# 16-byte units (_fits16) and then runs its fast path: 16-byte vector loads and stores (route,
# move, combine; the check made visible to Triton's alignment analysis by _vec16/_whole16) or
# TMA descriptors and wgmma (expert); otherwise element-wise pointer accesses, the same
# arithmetic. Each body picks its own block sizes (module constants).
if HAVE_TRITON:
    import triton
    import triton.language as tl

    from mgraph.runtime.megakernel.sync import bulk_store_fence

    from .abi import buffer_base, load_region, param_i32

    _READ0, _WRITE0 = tl.constexpr(F_READ0), tl.constexpr(F_WRITE0)
    _F32 = tl.constexpr(tl.float32)
    _BIG = tl.constexpr(2**30)  # past any expert index
    # route: tokens per block, experts of the group per step, logits per scan step, rows and
    # columns per row copy
    _TB, _GB, _EB = tl.constexpr(64), tl.constexpr(16), tl.constexpr(128)
    _RB, _HB = tl.constexpr(32), tl.constexpr(256)
    _EK = tl.constexpr(64)  # expert, TMA path: K step (its tiles: expert_tile)
    _PM = tl.constexpr(32)  # expert, pointer path: rows (and columns) per block
    _CT, _CN = tl.constexpr(32), tl.constexpr(256)  # combine: tokens, columns

    @triton.jit
    def _corner(regions, bufaddr, bufcols, index, DTYPE: tl.constexpr):
        """(typed pointer to region ``index``'s first element, row stride, rows, cols)."""
        s, r0, r1, c0, c1 = load_region(regions, index)
        cols = tl.load(bufcols + s).to(tl.int64)
        return buffer_base(bufaddr, s, DTYPE) + r0.to(tl.int64) * cols + c0, cols, r1 - r0, c1 - c0

    @triton.jit
    def _fits16(p, stride, cols, DTYPE: tl.constexpr):
        """Whether rows of ``cols`` elements at ``p`` (row stride ``stride``) split into whole
        16-byte units: the corner 16-byte aligned, the stride and the row a multiple of 16
        bytes. Then the loads can be 16-byte vectors and TMA can address the rows."""
        per16 = 128 // DTYPE.primitive_bitwidth
        return (
            (p.to(tl.int64, bitcast=True) % 16 == 0) & (stride % per16 == 0) & (cols % per16 == 0)
        )

    @triton.jit
    def _vec16(p, DTYPE: tl.constexpr):
        """``p``, which the caller checked is 16-byte aligned, in a form Triton's alignment
        analysis sees (it sees no runtime check, and no hint through an int-to-pointer cast: the
        hint sits on the cast)."""
        a = p.to(tl.int64, bitcast=True) // 16 * 16
        return tl.multiple_of(a.to(tl.pointer_type(DTYPE), bitcast=True), 16)

    @triton.jit
    def _whole16(n, DTYPE: tl.constexpr):
        """``n``, which the caller checked is a whole number of 16-byte units, visibly so."""
        per16 = 128 // DTYPE.primitive_bitwidth
        return n // per16 * per16

    @triton.jit
    def _dot(a, b, acc, GPU: tl.constexpr):
        """acc + a @ b (fp32 accumulate). Triton's interpreter computes a bf16 dot on the raw
        bits, so there the operands go up to fp32 first (exact: fp32 holds every bf16)."""
        if GPU:
            return tl.dot(a, b, acc)
        else:
            return tl.dot(a.to(tl.float32), b.to(tl.float32), acc)

    @triton.jit
    def _thresholds(lp, l_stride, E, ot64, tok, top_k):
        """Per token of the block: its k-th pick (value, index) in the ranking order, its
        largest logit (the softmax's shift; 0 past the last token: no inf - inf) and the softmax
        denominator over its k picks. top_k passes over the logits, each finding the best
        logit ranked below the previous pass's pick."""
        pv = tl.full(ot64.shape, float("inf"), tl.float32)  # the previous pick: value, index
        pi = tl.full(ot64.shape, -1, tl.int32)
        top = tl.zeros(ot64.shape, dtype=tl.float32)
        z = tl.zeros(ot64.shape, dtype=tl.float32)
        for p in range(top_k):
            bv = tl.full(ot64.shape, float("-inf"), tl.float32)
            bi = tl.full(ot64.shape, _BIG, tl.int32)
            for c in range(0, tl.cdiv(E, _EB)):  # counts chunks: c * _EB is visibly aligned
                oe = c * _EB + tl.arange(0, _EB)
                ok = tok[:, None] & (oe < E)[None, :]
                lg = tl.load(
                    lp + ot64[:, None] * l_stride + oe[None, :], mask=ok, other=float("-inf")
                ).to(tl.float32)
                below = (lg < pv[:, None]) | ((lg == pv[:, None]) & (oe[None, :] > pi[:, None]))
                cand = ok & below
                lv = tl.where(cand, lg, float("-inf"))
                cv = tl.max(lv, 1)
                ci = tl.min(tl.where(cand & (lv == cv[:, None]), oe[None, :], _BIG), 1)
                take = (cv > bv) | ((cv == bv) & (ci < bi))
                bv = tl.where(take, cv, bv)
                bi = tl.where(take, ci, bi)
            top = tl.where(p == 0, tl.where(tok, bv, 0.0), top)
            z += tl.exp(bv - top)
            pv = bv
            pi = bi
        return pv, pi, top, z

    @triton.jit
    def _keys16(lp, l_stride, E, ot64, tok, oe):
        """Int32 keys of the 16-bit logits of columns ``oe`` whose order is the ranking's: the
        logit's bits made order-preserving (negative values' magnitude bits flipped; -0.0
        taken as +0.0, which compares equal to it) in the high half, 65535 minus the expert
        index in the low half (a tie goes to the lower index). Past the block: the least
        int32, which no pass picks."""
        ok = tok[:, None] & (oe < E)[None, :]
        v = tl.load(lp + ot64[:, None] * l_stride + oe[None, :], mask=ok, other=0.0)
        bits = (v.to(tl.float32) + 0.0).to(tl.int32, bitcast=True)
        mono = bits ^ ((bits >> 31) & 0x7FFFFFFF)
        key = ((mono >> 16) << 16) | (65535 - oe)[None, :]
        return tl.where(ok, key, -(2**31))

    @triton.jit
    def _key_value(key):
        """The logit (float32) of a _keys16 key: its high half, made a float again."""
        mono = (key >> 16) << 16
        return (mono ^ ((mono >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)

    @triton.jit
    def _thresholds16(lp, l_stride, E, ot64, tok, top_k):
        """_thresholds for 16-bit logits of at most 2 * _EB experts: the block's logits are
        read once, as ranking keys held in registers (_keys16), and each of the top_k passes is
        one compare, one select and one max over them (_thresholds: two chunk loads, two
        reductions and a dozen operations per logit and pass)."""
        k0 = _keys16(lp, l_stride, E, ot64, tok, tl.arange(0, _EB))
        k1 = _keys16(lp, l_stride, E, ot64, tok, tl.arange(0, _EB) + _EB)
        prev = tl.full(ot64.shape, 2**31 - 1, tl.int32)
        top = tl.zeros(ot64.shape, dtype=tl.float32)
        z = tl.zeros(ot64.shape, dtype=tl.float32)
        for p in range(top_k):
            best = tl.maximum(
                tl.max(tl.where(k0 < prev[:, None], k0, -(2**31)), 1),
                tl.max(tl.where(k1 < prev[:, None], k1, -(2**31)), 1),
            )
            v = _key_value(best)
            top = tl.where(p == 0, tl.where(tok, v, 0.0), top)
            z += tl.where(tok, tl.exp(v - top), 0.0)
            prev = best
        return _key_value(prev), 65535 - (prev & 65535), top, z

    @triton.jit
    def _denominator(lp, l_stride, E, ot64, tok, top):
        """Per token of the block: the softmax denominator over all E logits (shifted by its
        largest, ``top``): the routing without renormalisation (route_topk's normalize=False)."""
        z = tl.zeros(ot64.shape, dtype=tl.float32)
        for c in range(0, tl.cdiv(E, _EB)):
            oe = c * _EB + tl.arange(0, _EB)
            ok = tok[:, None] & (oe < E)[None, :]
            lg = tl.load(
                lp + ot64[:, None] * l_stride + oe[None, :], mask=ok, other=float("-inf")
            ).to(tl.float32)
            z += tl.sum(tl.where(ok, tl.exp(lg - top[:, None]), 0.0), 1)
        return z

    @triton.jit
    def _route_picks(lp, l_stride, T, E, top_k, normalize, per_rank, first, cap, G, mp,
                     m_stride, rp, r_stride, wp, w_stride, cp, dp,
                     KEYS16: tl.constexpr):  # fmt: skip
        """Pass 1 of the route body: per step of _GB experts of the group, per block of _TB
        tokens, which tokens pick which expert (a [tokens, experts] tile), their rows (running
        counts in registers plus a cumsum down the block), the metadata rows, the picks map's
        entries; then the step's counts and drops. No barrier, no scalar loop per expert.
        A pick's weight is exp(logit - top) / z: z sums the k picks (renormalised), or, with
        ``normalize`` 0, all E logits (_denominator, one more scan)."""
        for g0 in range(0, G, _GB):
            og = g0 + tl.arange(0, _GB)
            gok = og < G
            e = first + og
            n = tl.zeros((_GB,), dtype=tl.int32)  # running counts of the step's segments
            lost = tl.zeros((_GB,), dtype=tl.int32)  # and the picks they dropped
            for t0 in range(0, T, _TB):
                ot = t0 + tl.arange(0, _TB)
                tok = ot < T
                ot64 = ot.to(tl.int64)
                if KEYS16:
                    pv, pi, top, z = _thresholds16(lp, l_stride, E, ot64, tok, top_k)
                else:
                    pv, pi, top, z = _thresholds(lp, l_stride, E, ot64, tok, top_k)
                if normalize == 0:  # one value per task: every thread takes the same branch
                    z = _denominator(lp, l_stride, E, ot64, tok, top)
                both = tok[:, None] & gok[None, :]
                le = tl.load(
                    lp + ot64[:, None] * l_stride + e[None, :], mask=both, other=float("-inf")
                ).to(tl.float32)
                picked = both & ((le > pv[:, None]) | ((le == pv[:, None]) & (e <= pi[:, None])))
                hit = picked.to(tl.int32)
                pos = n[None, :] + tl.cumsum(hit, 0) - hit
                # the drop policy: picks past the segment's capacity are not sent nor mapped
                kept = picked & (pos < cap)
                weight = tl.exp(le - top[:, None]) / tl.where(tok, z, 1.0)[:, None]
                row = (og[None, :] * cap + pos).to(tl.int64)  # in the group's rows
                tl.store(
                    mp + row * m_stride, (ot[:, None] + 0 * og[None, :]).to(tl.float32), mask=kept
                )
                tl.store(mp + row * m_stride + 1, weight, mask=kept)
                tl.store(
                    mp + row * m_stride + 2,
                    (e % per_rank + 0 * ot[:, None]).to(tl.float32),
                    mask=kept,
                )
                back_row = tl.where(kept, (e[None, :] * cap + pos).to(tl.float32), -1.0)
                tl.store(rp + ot64[:, None] * r_stride + og[None, :], back_row, mask=both)
                tl.store(
                    wp + ot64[:, None] * w_stride + og[None, :],
                    tl.where(kept, weight, 0.0),
                    mask=both,
                )
                filled = tl.sum(kept.to(tl.int32), 0)
                n += filled
                lost += tl.sum(hit, 0) - filled
            tl.store(cp + og, n.to(tl.float32), mask=gok)
            tl.store(dp + og, lost.to(tl.float32), mask=gok)

    @triton.jit
    def _route_copy(xp, x_stride, H, sp, s_stride, mp, m_stride, cp, G, cap):
        """Pass 2 of the route body: each segment's filled rows, _RB at a time, gathered from
        x by the token index of their metadata row (only filled rows are touched)."""
        for j in range(G):
            n = tl.load(cp + j).to(tl.int32)
            for i0 in range(0, n, _RB):
                oi = i0 + tl.arange(0, _RB)
                rok = oi < n
                row = (j * cap + oi).to(tl.int64)
                token = tl.load(mp + row * m_stride, mask=rok, other=0.0).to(tl.int64)
                for c in range(0, tl.cdiv(H, _HB)):
                    oh = c * _HB + tl.arange(0, _HB)
                    mask = rok[:, None] & (oh < H)[None, :]
                    v = tl.load(xp + token[:, None] * x_stride + oh[None, :], mask=mask)
                    tl.store(sp + row[:, None] * s_stride + oh[None, :], v, mask=mask)

    @ROUTE.triton
    @triton.jit
    def route_tile(tp, params, regions, bufaddr, bufcols, DT: tl.constexpr):
        """Pass 1 (_route_picks): per block of tokens, top_k passes over the logits find each
        token's k-th pick (value, index) and the softmax denominator over its k picks (over all
        E logits when the task's ``normalize`` param is 0); a token picks expert e of the group
        when its logit ranks at or above that threshold; its row in
        e's segment is the running count plus its exclusive prefix among the block's picks; a
        row at or past the segment's capacity is dropped (the module docstring's policy) and
        counted in e's entry of the dropped region. Pass 2 (_route_copy), after a barrier: the
        filled rows' x rows into the send rows. Each pass runs with 16-byte vector loads when
        its rows allow (_fits16), else element-wise; 16-bit logits of at most 256 experts in
        such rows are ranked through packed int32 keys held in registers (_thresholds16)."""
        r0 = tl.load(tp + _READ0)
        w0 = tl.load(tp + _WRITE0)
        top_k = param_i32(params, tp, 0)
        per_rank = param_i32(params, tp, 1)
        first = param_i32(params, tp, 2)
        cap = param_i32(params, tp, 3)
        normalize = param_i32(params, tp, 4)
        xp, x_stride, T, H = _corner(regions, bufaddr, bufcols, r0, DT)
        lp, l_stride, _nl, E = _corner(regions, bufaddr, bufcols, r0 + 1, DT)
        sp, s_stride, _ns, _hs = _corner(regions, bufaddr, bufcols, w0, DT)
        mp, m_stride, _nm, _cm = _corner(regions, bufaddr, bufcols, w0 + 1, _F32)
        cp, _c_stride, _nc, G = _corner(regions, bufaddr, bufcols, w0 + 2, _F32)
        rp, r_stride, _nr, _gr = _corner(regions, bufaddr, bufcols, w0 + 3, _F32)
        wp, w_stride, _nw, _gw = _corner(regions, bufaddr, bufcols, w0 + 4, _F32)
        dp, _d_stride, _nd, _gd = _corner(regions, bufaddr, bufcols, w0 + 5, _F32)
        if _fits16(lp, l_stride, E, DT):
            lv, lv_stride, Ev = _vec16(lp, DT), _whole16(l_stride, DT), _whole16(E, DT)
            if DT.primitive_bitwidth == 16:
                if E <= 2 * _EB:  # the packed keys (_thresholds16)
                    _route_picks(lv, lv_stride, T, Ev, top_k, normalize, per_rank, first, cap,
                                 G, mp, m_stride, rp, r_stride, wp, w_stride, cp, dp,
                                 True)  # fmt: skip
                else:
                    _route_picks(lv, lv_stride, T, Ev, top_k, normalize, per_rank, first, cap,
                                 G, mp, m_stride, rp, r_stride, wp, w_stride, cp, dp,
                                 False)  # fmt: skip
            else:
                _route_picks(lv, lv_stride, T, Ev, top_k, normalize, per_rank, first, cap, G,
                             mp, m_stride, rp, r_stride, wp, w_stride, cp, dp,
                             False)  # fmt: skip
        else:
            _route_picks(lp, l_stride, T, E, top_k, normalize, per_rank, first, cap, G, mp,
                         m_stride, rp, r_stride, wp, w_stride, cp, dp, False)  # fmt: skip
        tl.debug_barrier()  # pass 2 reads the counts and metadata rows other threads stored
        if _fits16(xp, x_stride, H, DT) & _fits16(sp, s_stride, H, DT):
            _route_copy(_vec16(xp, DT), _whole16(x_stride, DT), _whole16(H, DT), _vec16(sp, DT),
                        _whole16(s_stride, DT), mp, m_stride, cp, G, cap)  # fmt: skip
        else:
            _route_copy(xp, x_stride, H, sp, s_stride, mp, m_stride, cp, G, cap)

    @triton.jit
    def _move_rows(
        tp,
        params,
        regions,
        bufaddr,
        bufcols,
        DTYPE: tl.constexpr,
        RB_M: tl.constexpr,
        RB_N: tl.constexpr,
    ):
        r0 = tl.load(tp + _READ0)
        seg = param_i32(params, tp, 0)
        sp, s_stride, _ns, C = _corner(regions, bufaddr, bufcols, r0, DTYPE)
        cp, _c_stride, _nc, S = _corner(regions, bufaddr, bufcols, r0 + 1, _F32)
        dp, d_stride, _nd, _cd = _corner(regions, bufaddr, bufcols, tl.load(tp + _WRITE0), DTYPE)
        # 16-byte vectors when the rows allow (the data rows; the metadata's 12-byte rows do
        # not): element-wise, a 64 x 256 block held 64-bit addresses the registers could not
        if _fits16(sp, s_stride, C, DTYPE) & _fits16(dp, d_stride, C, DTYPE):
            _move_segments(
                _vec16(sp, DTYPE),
                _whole16(s_stride, DTYPE),
                _vec16(dp, DTYPE),
                _whole16(d_stride, DTYPE),
                _whole16(C, DTYPE),
                cp,
                S,
                seg,
                RB_M,
                RB_N,
            )
        else:
            _move_segments(sp, s_stride, dp, d_stride, C, cp, S, seg, RB_M, RB_N)

    @triton.jit
    def _move_segments(
        sp, s_stride, dp, d_stride, C, cp, S, seg, RB_M: tl.constexpr, RB_N: tl.constexpr
    ):
        """The first counts[j] rows of each segment j (``seg`` rows) from ``sp`` to ``dp``."""
        for j in range(S):
            n = tl.load(cp + j).to(tl.int32)
            for i0 in range(0, n, RB_M):
                oi = i0 + tl.arange(0, RB_M)
                om = (j * seg + oi).to(tl.int64)
                for c in range(0, tl.cdiv(C, RB_N)):  # counts chunks: c * RB_N is visibly aligned
                    oc = c * RB_N + tl.arange(0, RB_N)
                    mask = (oi < n)[:, None] & (oc < C)[None, :]
                    v = tl.load(sp + om[:, None] * s_stride + oc[None, :], mask=mask)
                    tl.store(dp + om[:, None] * d_stride + oc[None, :], v, mask=mask)

    @MOVE.triton
    @triton.jit
    def move_tile(tp, params, regions, bufaddr, bufcols, DT: tl.constexpr,
                  RB_M: tl.constexpr, RB_N: tl.constexpr):  # fmt: skip
        """The filled rows of each segment (its count, read from the counts region) to the
        destination, usually a peer's buffer: an empty segment moves nothing."""
        if param_i32(params, tp, 1) != 0:
            _move_rows(tp, params, regions, bufaddr, bufcols, tl.float32, RB_M, RB_N)
        else:
            _move_rows(tp, params, regions, bufaddr, bufcols, DT, RB_M, RB_N)

    @triton.jit
    def _pass1_tma(xp, x_stride, n, H, gp, g_stride, up, u_stride, F, hp, h_stride,
                   DT: tl.constexpr, EM: tl.constexpr, EF: tl.constexpr, ES: tl.constexpr,
                   USE_TIMER: tl.constexpr):  # fmt: skip
        """The expert body's pass 1, fast path: hidden = silu(x @ w_gate) * (x @ w_up) over
        ``n`` rows and ``F`` hidden columns (a task's slice, or all), every operand through a
        TMA descriptor over its region (rows past ``n`` and columns past a block's edge read as
        zeros, stores stop at the region's edge), so the K loop holds no pointer tensor and
        Triton's pipeliner prefetches the next blocks; wgmma on EM x EF tiles. Each hidden
        block is stored by TMA (the caller fences). The row blocks are the inner loop, so a
        later row block reads a block of weight columns again one K loop after the first: from
        L2 only while it is still there. The K loop is software-pipelined by Triton, ES stages
        (tl.range): the loads of ES - 1 steps in flight while a step's wgmma run."""
        n32 = n.to(tl.int32)
        xd = tl.make_tensor_descriptor(xp, [n32, H], [x_stride, 1], [EM, _EK])
        gd = tl.make_tensor_descriptor(gp, [H, F], [g_stride, 1], [_EK, EF])
        ud = tl.make_tensor_descriptor(up, [H, F], [u_stride, 1], [_EK, EF])
        hs = tl.make_tensor_descriptor(hp, [n32, F], [h_stride, 1], [EM, EF])
        for f in range(0, tl.cdiv(F, EF)):
            f0 = f * EF
            for i in range(0, tl.cdiv(n32, EM)):
                i0 = i * EM
                g = tl.zeros((EM, EF), dtype=tl.float32)
                u = tl.zeros((EM, EF), dtype=tl.float32)
                for k in tl.range(0, tl.cdiv(H, _EK), num_stages=ES):
                    k0 = k * _EK
                    x = xd.load([i0, k0])
                    g = _dot(x, gd.load([k0, f0]), g, USE_TIMER)
                    u = _dot(x, ud.load([k0, f0]), u, USE_TIMER)
                hs.store([i0, f0], (g / (1.0 + tl.exp(-g)) * u).to(DT))

    @triton.jit
    def _pass2_tma(hp, h_stride, n, F, dp, d_stride, H, yp, y_stride, DT: tl.constexpr,
                   EM: tl.constexpr, EN: tl.constexpr, ES: tl.constexpr,
                   USE_TIMER: tl.constexpr):  # fmt: skip
        """The expert body's pass 2, fast path: y = hidden @ w_down over ``n`` rows and ``H``
        output columns (a task's slice, or all), as _pass1_tma: TMA descriptors, wgmma on
        EM x EN tiles, ES stages, y stored by TMA (the caller fences). The hidden rows must be
        visible to TMA loads: stored by TMA and fenced, then ordered (a barrier in this
        program, or the signal and wait between tasks)."""
        n32 = n.to(tl.int32)
        hd = tl.make_tensor_descriptor(hp, [n32, F], [h_stride, 1], [EM, _EK])
        dd = tl.make_tensor_descriptor(dp, [F, H], [d_stride, 1], [_EK, EN])
        yd = tl.make_tensor_descriptor(yp, [n32, H], [y_stride, 1], [EM, EN])
        for c in range(0, tl.cdiv(H, EN)):
            c0 = c * EN
            for i in range(0, tl.cdiv(n32, EM)):
                i0 = i * EM
                acc = tl.zeros((EM, EN), dtype=tl.float32)
                for k in tl.range(0, tl.cdiv(F, _EK), num_stages=ES):
                    k0 = k * _EK
                    acc = _dot(hd.load([i0, k0]), dd.load([k0, c0]), acc, USE_TIMER)
                yd.store([i0, c0], acc.to(DT))

    @triton.jit
    def _pass1_pair(xp, x_stride, n, H, gp, g_stride, up, u_stride, F, hp, h_stride,
                    DT: tl.constexpr, EB: tl.constexpr, EF: tl.constexpr, ES: tl.constexpr,
                    USE_TIMER: tl.constexpr):  # fmt: skip
        """Pass 1 on 128 + EB rows (rows [0, 128) and [128, 128 + EB), past ``n`` zero-filled)
        in ONE K loop: each step's gate and up blocks feed both row blocks, so the weights are
        streamed once for all of them (two row blocks in turn would stream them twice: the
        second finds them in L2 only by luck). Accumulators (128 + EB) x EF twice: at EB = 64,
        EF = 64, 96 fp32 registers a thread at 8 warps, a step 3.1 MFLOP for 40 KB of loads
        (16 KB of weights)."""
        n32 = n.to(tl.int32)
        xa = tl.make_tensor_descriptor(xp, [n32, H], [x_stride, 1], [128, _EK])
        xb = tl.make_tensor_descriptor(xp, [n32, H], [x_stride, 1], [EB, _EK])
        gd = tl.make_tensor_descriptor(gp, [H, F], [g_stride, 1], [_EK, EF])
        ud = tl.make_tensor_descriptor(up, [H, F], [u_stride, 1], [_EK, EF])
        ha = tl.make_tensor_descriptor(hp, [n32, F], [h_stride, 1], [128, EF])
        hb = tl.make_tensor_descriptor(hp, [n32, F], [h_stride, 1], [EB, EF])
        for f in range(0, tl.cdiv(F, EF)):
            f0 = f * EF
            ga = tl.zeros((128, EF), dtype=tl.float32)
            ua = tl.zeros((128, EF), dtype=tl.float32)
            gb = tl.zeros((EB, EF), dtype=tl.float32)
            ub = tl.zeros((EB, EF), dtype=tl.float32)
            for k in tl.range(0, tl.cdiv(H, _EK), num_stages=ES):
                k0 = k * _EK
                wg = gd.load([k0, f0])
                wu = ud.load([k0, f0])
                x = xa.load([0, k0])
                ga = _dot(x, wg, ga, USE_TIMER)
                ua = _dot(x, wu, ua, USE_TIMER)
                x = xb.load([128, k0])
                gb = _dot(x, wg, gb, USE_TIMER)
                ub = _dot(x, wu, ub, USE_TIMER)
            ha.store([0, f0], (ga / (1.0 + tl.exp(-ga)) * ua).to(DT))
            hb.store([128, f0], (gb / (1.0 + tl.exp(-gb)) * ub).to(DT))

    @triton.jit
    def _pass2_pair(hp, h_stride, n, F, dp, d_stride, H, yp, y_stride, DT: tl.constexpr,
                    EB: tl.constexpr, EN: tl.constexpr, ES: tl.constexpr,
                    USE_TIMER: tl.constexpr):  # fmt: skip
        """Pass 2 on 128 + EB rows in one K loop, as _pass1_pair: each step's block of w_down
        feeds both row blocks (at EB = 64, EN = 128: 96 fp32 registers a thread, a step 3.1
        MFLOP for 40 KB of loads, 16 KB of weights)."""
        n32 = n.to(tl.int32)
        ha = tl.make_tensor_descriptor(hp, [n32, F], [h_stride, 1], [128, _EK])
        hb = tl.make_tensor_descriptor(hp, [n32, F], [h_stride, 1], [EB, _EK])
        dd = tl.make_tensor_descriptor(dp, [F, H], [d_stride, 1], [_EK, EN])
        ya = tl.make_tensor_descriptor(yp, [n32, H], [y_stride, 1], [128, EN])
        yb = tl.make_tensor_descriptor(yp, [n32, H], [y_stride, 1], [EB, EN])
        for c in range(0, tl.cdiv(H, EN)):
            c0 = c * EN
            acc_a = tl.zeros((128, EN), dtype=tl.float32)
            acc_b = tl.zeros((EB, EN), dtype=tl.float32)
            for k in tl.range(0, tl.cdiv(F, _EK), num_stages=ES):
                k0 = k * _EK
                w = dd.load([k0, c0])
                acc_a = _dot(ha.load([0, k0]), w, acc_a, USE_TIMER)
                acc_b = _dot(hb.load([128, k0]), w, acc_b, USE_TIMER)
            ya.store([0, c0], acc_a.to(DT))
            yb.store([128, c0], acc_b.to(DT))

    @triton.jit(noinline=True)
    def _pass1_pointer(xp, x_stride, n, H, gp, g_stride, up, u_stride, F, hp, h_stride,
                       DT: tl.constexpr, USE_TIMER: tl.constexpr):  # fmt: skip
        """Pass 1 for rows TMA cannot address (a corner or row not in whole 16-byte units):
        masked pointer loads in _PM x _PM blocks. A function of its own (scalar arguments)
        whose 32-row dots are mma.sync: ptxas allocates its registers apart from the fast
        path's wgmma loops (a noinline callee on wgmma would serialise the caller's)."""
        for i0 in range(0, n, _PM):
            om = i0 + tl.arange(0, _PM)
            rok = om < n
            om64 = om.to(tl.int64)
            for f0 in range(0, F, _PM):
                of = f0 + tl.arange(0, _PM)
                fok = of < F
                g = tl.zeros((_PM, _PM), dtype=tl.float32)
                u = tl.zeros((_PM, _PM), dtype=tl.float32)
                for k0 in range(0, H, _PM):
                    ok = k0 + tl.arange(0, _PM)
                    kok = ok < H
                    ok64 = ok.to(tl.int64)
                    x = tl.load(
                        xp + om64[:, None] * x_stride + ok64[None, :],
                        mask=rok[:, None] & kok[None, :],
                        other=0.0,
                    )
                    wmask = kok[:, None] & fok[None, :]
                    wg = tl.load(gp + ok64[:, None] * g_stride + of[None, :], mask=wmask, other=0.0)
                    wu = tl.load(up + ok64[:, None] * u_stride + of[None, :], mask=wmask, other=0.0)
                    g = _dot(x, wg, g, USE_TIMER)
                    u = _dot(x, wu, u, USE_TIMER)
                h = g / (1.0 + tl.exp(-g)) * u
                tl.store(
                    hp + om64[:, None] * h_stride + of[None, :],
                    h.to(DT),
                    mask=rok[:, None] & fok[None, :],
                )

    @triton.jit(noinline=True)
    def _pass2_pointer(hp, h_stride, n, F, dp, d_stride, H, yp, y_stride, DT: tl.constexpr,
                       USE_TIMER: tl.constexpr):  # fmt: skip
        """Pass 2 for rows TMA cannot address, as _pass1_pointer."""
        for i0 in range(0, n, _PM):
            om = i0 + tl.arange(0, _PM)
            rok = om < n
            om64 = om.to(tl.int64)
            for c0 in range(0, H, _PM):
                oc = c0 + tl.arange(0, _PM)
                cok = oc < H
                acc = tl.zeros((_PM, _PM), dtype=tl.float32)
                for k0 in range(0, F, _PM):
                    ok = k0 + tl.arange(0, _PM)
                    kok = ok < F
                    ok64 = ok.to(tl.int64)
                    h = tl.load(
                        hp + om64[:, None] * h_stride + ok64[None, :],
                        mask=rok[:, None] & kok[None, :],
                        other=0.0,
                    )
                    wd = tl.load(
                        dp + ok64[:, None] * d_stride + oc[None, :],
                        mask=kok[:, None] & cok[None, :],
                        other=0.0,
                    )
                    acc = _dot(h, wd, acc, USE_TIMER)
                tl.store(
                    yp + om64[:, None] * y_stride + oc[None, :],
                    acc.to(DT),
                    mask=rok[:, None] & cok[None, :],
                )

    @EXPERT.triton
    @triton.jit
    def expert_tile(
        tp, params, regions, bufaddr, bufcols, DT: tl.constexpr, USE_TIMER: tl.constexpr
    ):
        """SwiGLU over the tile's filled rows (the segment's count past ``row0``), nothing when
        there are none; the task's ``part`` says which passes (moe_tiles.EXPERT_PARTS: 0 both,
        1 pass 1 on a slice of hidden columns, 2 pass 2 on a slice of output columns; the
        regions per part are listed there). Pass 1: hidden = silu(x @ w_gate) * (x @ w_up) in
        blocks of hidden columns, stored in DT; pass 2: y = hidden @ w_down in blocks of output
        columns. Through TMA (_pass1_tma, _pass2_tma) when every operand's rows are whole
        16-byte units (the usual case: H and F multiples of 8 in bf16), else by pointers."""
        r0 = tl.load(tp + _READ0)
        w0 = tl.load(tp + _WRITE0)
        row0 = param_i32(params, tp, 1)
        part = param_i32(params, tp, 2)
        # Region indexes by part; a pass a part does not run points at a region the part has
        # (its corner is read, never used), so every table read stays inside the task's rows.
        if part == 2:
            xi, gi, ui, hi, di, yi = r0, r0 + 3, r0 + 3, r0, r0 + 3, w0
        elif part == 1:
            xi, gi, ui, hi, di, yi = r0, r0 + 3, r0 + 4, w0, r0 + 3, w0
        else:
            xi, gi, ui, hi, di, yi = r0, r0 + 3, r0 + 4, w0 + 1, r0 + 5, w0
        xp, x_stride, rows, xc = _corner(regions, bufaddr, bufcols, xi, DT)
        cp, _c_stride, _nc, _cc = _corner(regions, bufaddr, bufcols, r0 + 2, _F32)
        n = tl.minimum(tl.load(cp).to(tl.int32) - row0, rows)
        if n > 0:
            gp, g_stride, _ng, _fg = _corner(regions, bufaddr, bufcols, gi, DT)
            up, u_stride, _nu, _fu = _corner(regions, bufaddr, bufcols, ui, DT)
            dp, d_stride, _nd, _hd = _corner(regions, bufaddr, bufcols, di, DT)
            yp, y_stride, _ny, yc = _corner(regions, bufaddr, bufcols, yi, DT)
            hp, h_stride, _nh, F = _corner(regions, bufaddr, bufcols, hi, DT)
            # H: x's columns (pass 1's K) where pass 1 runs, else y's (a slice of them)
            H = tl.where(part == 2, yc, xc)
            # Pass 2's K is always the hidden's full width; pass 1's hidden columns are the
            # hidden region's (a slice in part 1)
            tma = (
                _fits16(xp, x_stride, xc, DT)
                & _fits16(gp, g_stride, F, DT)
                & _fits16(up, u_stride, F, DT)
                & _fits16(dp, d_stride, yc, DT)
                & _fits16(yp, y_stride, yc, DT)
                & _fits16(hp, h_stride, F, DT)
            )
            if tma:
                # Tiles of (rows, hidden columns, output columns, K-loop stages). The 128-row
                # tile does the GEMM segment's step (kernel.py's 128 x 256 x 64 at 3 stages:
                # 4.2 MFLOP for 48 KB; gate and up 128 columns each); the 64-row tile (at most
                # 64 filled rows) half that work for 40 KB, one more step of loads in flight (4
                # stages; 192 KB of shared memory in pass 2); the pair tile (129-192 rows) 128 +
                # 64 rows against one block of weights (3.1 MFLOP for 40 KB, 16 KB of them
                # weights). tests/test_moe_expert_pipeline.py pins them. Every chunk of rows reads the task's weights once (a later chunk
                # finds them in L2 only by luck) and its rows once per block of hidden (output)
                # columns.
                if DT.primitive_bitwidth == 16:
                    # chunks of up to 192 rows, each one weight stream: 129-192 rows in the
                    # pair tile (128 + 64 rows in one K loop), 65-128 in the 128-row tile, 1-64
                    # in the 64-row one (moe_tiles.expert_row_blocks mirrors the rule); a
                    # chunk's rows start o rows in: still whole 16-byte units
                    if part != 2:
                        for o in range(0, n, 192):
                            r = tl.minimum(n - o, 192)
                            # x_stride and h_stride are int64: so are the offsets
                            xo, ho = xp + o * x_stride, hp + o * h_stride
                            if r > 128:
                                _pass1_pair(xo, x_stride, r, H, gp, g_stride, up, u_stride, F,
                                            ho, h_stride, DT, 64, 64, 4, USE_TIMER)  # fmt: skip
                            elif r > 64:
                                _pass1_tma(xo, x_stride, r, H, gp, g_stride, up, u_stride, F, ho,
                                           h_stride, DT, 128, 128, 3, USE_TIMER)  # fmt: skip
                            else:
                                _pass1_tma(xo, x_stride, r, H, gp, g_stride, up, u_stride, F, ho,
                                           h_stride, DT, 64, 128, 4, USE_TIMER)  # fmt: skip
                    if part == 0:
                        # pass 2 reads hidden blocks other threads' TMA stores wrote
                        bulk_store_fence(USE_TIMER)
                        tl.debug_barrier()
                    if part != 1:
                        for o in range(0, n, 192):
                            r = tl.minimum(n - o, 192)
                            ho, yo = hp + o * h_stride, yp + o * y_stride
                            if r > 128:
                                _pass2_pair(ho, h_stride, r, F, dp, d_stride, H, yo, y_stride,
                                            DT, 64, 128, 4, USE_TIMER)  # fmt: skip
                            elif r > 64:
                                _pass2_tma(ho, h_stride, r, F, dp, d_stride, H, yo, y_stride, DT,
                                           128, 256, 3, USE_TIMER)  # fmt: skip
                            else:
                                _pass2_tma(ho, h_stride, r, F, dp, d_stride, H, yo, y_stride, DT,
                                           64, 256, 4, USE_TIMER)  # fmt: skip
                else:  # float32: half the columns, to stay in an H200 block's shared memory
                    if part != 2:
                        _pass1_tma(xp, x_stride, n, H, gp, g_stride, up, u_stride, F, hp,
                                   h_stride, DT, 64, 64, 3, USE_TIMER)  # fmt: skip
                    if part == 0:
                        bulk_store_fence(USE_TIMER)
                        tl.debug_barrier()
                    if part != 1:
                        _pass2_tma(hp, h_stride, n, F, dp, d_stride, H, yp, y_stride, DT, 64,
                                   128, 3, USE_TIMER)  # fmt: skip
                # the kernel's signal after this body publishes hidden or y: its TMA stores
                # must have landed
                bulk_store_fence(USE_TIMER)
            else:
                if part != 2:
                    _pass1_pointer(xp, x_stride, n, H, gp, g_stride, up, u_stride, F, hp,
                                   h_stride, DT, USE_TIMER)  # fmt: skip
                if part == 0:
                    tl.debug_barrier()  # pass 2 reads hidden columns other threads stored
                if part != 1:
                    _pass2_pointer(hp, h_stride, n, F, dp, d_stride, H, yp, y_stride, DT,
                                   USE_TIMER)  # fmt: skip

    @triton.jit
    def _combine_rows(
        bp, b_stride, C, rp, r_stride, wp, w_stride, T, E, op, o_stride, top_k, DT: tl.constexpr
    ):
        """The combine body's loops: per block of _CT tokens and _CN columns, top_k passes each
        find every token's next picked expert (a scan of its row of the picks map) and add
        weight * that expert's row of back."""
        for t0 in range(0, T, _CT):
            ot = t0 + tl.arange(0, _CT)
            tok = ot < T
            ot64 = ot.to(tl.int64)
            for cc in range(0, tl.cdiv(C, _CN)):  # counts chunks: cc * _CN is visibly aligned
                oc = cc * _CN + tl.arange(0, _CN)
                cok = oc < C
                acc = tl.zeros((_CT, _CN), dtype=tl.float32)
                prev = tl.full((_CT,), -1, tl.int32)
                for _p in range(top_k):
                    nxt = tl.full((_CT,), _BIG, tl.int32)
                    for ec in range(0, tl.cdiv(E, _EB)):
                        oe = ec * _EB + tl.arange(0, _EB)
                        ok = tok[:, None] & (oe < E)[None, :]
                        pr = tl.load(
                            rp + ot64[:, None] * r_stride + oe[None, :], mask=ok, other=-1.0
                        )
                        cand = (pr >= 0) & (oe[None, :] > prev[:, None])
                        nxt = tl.minimum(nxt, tl.min(tl.where(cand, oe[None, :], _BIG), 1))
                    found = tok & (nxt < E)
                    row = tl.load(rp + ot64 * r_stride + nxt, mask=found, other=0.0).to(tl.int64)
                    weight = tl.load(wp + ot64 * w_stride + nxt, mask=found, other=0.0)
                    y = tl.load(
                        bp + row[:, None] * b_stride + oc[None, :],
                        mask=found[:, None] & cok[None, :],
                        other=0.0,
                    )
                    acc += weight[:, None] * y.to(tl.float32)
                    prev = nxt
                tl.store(
                    op + ot64[:, None] * o_stride + oc[None, :],
                    acc.to(DT),
                    mask=tok[:, None] & cok[None, :],
                )

    @COMBINE.triton
    @triton.jit
    def combine_tile(tp, params, regions, bufaddr, bufcols, DT: tl.constexpr):
        """out[t] = sum of weight * back[row] over token t's k picks in ascending expert order
        (a gather through the picks map: each pass finds every token's next picked expert).
        With 16-byte vector loads and stores when back, out and the picks map allow them
        (_fits16), else element-wise."""
        r0 = tl.load(tp + _READ0)
        top_k = param_i32(params, tp, 0)
        bp, b_stride, _nb, C = _corner(regions, bufaddr, bufcols, r0, DT)
        rp, r_stride, T, E = _corner(regions, bufaddr, bufcols, r0 + 1, _F32)
        wp, w_stride, _nw, _ew = _corner(regions, bufaddr, bufcols, r0 + 2, _F32)
        op, o_stride, _no, _co = _corner(regions, bufaddr, bufcols, tl.load(tp + _WRITE0), DT)
        if (
            _fits16(bp, b_stride, C, DT)
            & _fits16(op, o_stride, C, DT)
            & _fits16(rp, r_stride, E, tl.float32)
        ):
            _combine_rows(_vec16(bp, DT), _whole16(b_stride, DT), _whole16(C, DT),
                          _vec16(rp, tl.float32), _whole16(r_stride, tl.float32), wp, w_stride, T,
                          _whole16(E, tl.float32), _vec16(op, DT), _whole16(o_stride, DT), top_k,
                          DT)  # fmt: skip
        else:
            _combine_rows(bp, b_stride, C, rp, r_stride, wp, w_stride, T, E, op,
                          o_stride, top_k, DT)  # fmt: skip
