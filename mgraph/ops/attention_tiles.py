"""Megakernel (Triton) tile bodies of ``attn_block`` and ``attn_finalize``.

The CPU bodies in ring_attention.py are the meaning; both ring_attention and attention lower to
these two kinds. ``attn_block`` folds one KV block into the fp32 state of one q block:
acc [rows, D] and ml [rows, 2] = (running max m, running denominator l), the first block of a
chain initialising it. It walks the q block in sub-blocks of ``_QB`` rows and the KV block in
chunks of ``_KB`` keys (flash attention's inner loop): per chunk the scores go through exp2 with
the scale folded into a log2(e) factor, the running max and sum are rescaled, and the partial
acc is rescaled and accumulated. ``D`` is walked in chunks of ``_DB`` columns (any head size), so
acc is updated in the state buffer itself, chunk by chunk, rather than held whole in registers.

Params (the task's row of the params table, in :data:`ATTN_PARAMS` order): ``q_start`` /
``k_start`` (global positions of the blocks' first rows, for the causal mask), ``mask`` (the
diagonal block of a causal attention: hide keys after the query), ``first`` (initialise the
state; the task then reads no acc/ml), ``scale`` (float), ``bias`` (an additive mask tile is the
last read; one row wide when it broadcasts over the queries). A row still fully masked keeps
m = -inf and is shifted by 0, so exp2 gives 0 rather than NaN, as the CPU body does. m is stored
in the CPU body's units (natural-log scores) so the state means the same on both backends.

Dtypes. q, k, v, out and the bias are in the graph's dtype ``DT``; the state (acc, ml) is always
float32: both lowerings declare those buffers float32, and these bodies address them as float32
whatever ``DT`` is. Today the megakernel runs one dtype per graph (runtime.py ``_check_graph``),
so only float32 graphs run here. For bf16 data with fp32 partials the ABI needs per-buffer
dtypes: the runtime must accept graphs whose buffers differ in dtype, lay each buffer out in the
arena by its own itemsize and alignment, and keep the 16-byte row rule per buffer (ml's rows are
8 bytes: no TMA on it). Nothing in these bodies changes: the state pointers are already float32,
p is cast to ``DT`` before the p @ v dot (fp32 accumulate), as flash attention does in bf16.

Grouped-query attention is not a property of these kinds: q, k and v blocks have the same head
layout (the tracer expands k/v heads with a relayout before the attention), so no GQA indexing
exists here to follow.
"""

from __future__ import annotations

from ..kinds import TaskKind, kind_spec
from .abi import F_NREAD, F_NWRITE, F_READ0, F_WRITE0, HAVE_TRITON

__all__ = ["ATTN_PARAMS"]

ATTN_BLOCK = kind_spec(TaskKind.ATTN_BLOCK)
ATTN_FINALIZE = kind_spec(TaskKind.ATTN_FINALIZE)
ATTN_PARAMS = ("q_start", "k_start", "mask", "first", "scale", "bias")
# The builtin kinds are defined in mgraph/kinds.py without params; the params a body reads are
# declared beside the body that reads them (the encoder packs them in this order).
ATTN_BLOCK.params = ATTN_PARAMS

if HAVE_TRITON:
    import triton
    import triton.language as tl

    from .abi import buffer_base, load_region, param_f32, param_i32
    from .tilewise import tile_ptrs

    _READ0, _NREAD = tl.constexpr(F_READ0), tl.constexpr(F_NREAD)
    _WRITE0, _NWRITE = tl.constexpr(F_WRITE0), tl.constexpr(F_NWRITE)
    # Sub-block sizes: q rows, keys, head columns per step (tl.dot needs each >= 16). A q block
    # or a head size that is not a multiple of them is handled by masks.
    _QB, _KB, _DB = tl.constexpr(64), tl.constexpr(64), tl.constexpr(128)
    _LOG2E = tl.constexpr(1.4426950408889634)
    _F32 = tl.constexpr(tl.float32)

    @triton.jit
    def _rows_cols(regions, bufaddr, bufcols, index, DT: tl.constexpr):
        """(typed base pointer of region ``index``'s corner, row stride, rows, cols)."""
        s, r0, r1, c0, c1 = load_region(regions, index)
        cols = tl.load(bufcols + s).to(tl.int64)
        base = buffer_base(bufaddr, s, DT) + r0.to(tl.int64) * cols + c0
        return base, cols, r1 - r0, c1 - c0

    @triton.jit
    def _scores(qp, q_stride, kp, k_stride, om, ok, nq, nk, D, DT: tl.constexpr):
        """q[om] @ k[ok]^T over every head column (fp32 accumulate); zeros off the edges."""
        s = tl.zeros((_QB, _KB), dtype=tl.float32)
        for d0 in range(0, D, _DB):
            od = d0 + tl.arange(0, _DB)
            q = tl.load(qp + om.to(tl.int64)[:, None] * q_stride + od[None, :],
                        mask=(om < nq)[:, None] & (od < D)[None, :], other=0.0)
            k = tl.load(kp + ok.to(tl.int64)[:, None] * k_stride + od[None, :],
                        mask=(ok < nk)[:, None] & (od < D)[None, :], other=0.0)
            s = tl.dot(q, tl.trans(k), s)
        return s

    @ATTN_BLOCK.triton
    @triton.jit
    def attn_block_tile(tp, params, regions, bufaddr, bufcols, DT: tl.constexpr):
        r0 = tl.load(tp + _READ0)
        nread = tl.load(tp + _NREAD)
        w0 = tl.load(tp + _WRITE0)
        q_start = param_i32(params, tp, 0)
        k_start = param_i32(params, tp, 1)
        causal = param_i32(params, tp, 2)
        first = param_i32(params, tp, 3)
        qk_scale = param_f32(params, tp, 4) * _LOG2E  # scores in log2 units: exp2 below
        has_bias = param_i32(params, tp, 5)
        qp, q_stride, nq, D = _rows_cols(regions, bufaddr, bufcols, r0, DT)
        kp, k_stride, nk, _dk = _rows_cols(regions, bufaddr, bufcols, r0 + 1, DT)
        vp, v_stride, _nv, _dv = _rows_cols(regions, bufaddr, bufcols, r0 + 2, DT)
        ap, a_stride, _na, _da = _rows_cols(regions, bufaddr, bufcols, w0, _F32)
        mp, m_stride, _nm, _dm = _rows_cols(regions, bufaddr, bufcols, w0 + 1, _F32)
        # the state read: the chain's acc/ml (the same rows as the writes, but read as declared);
        # a first task has no such reads, so it names its writes (never loaded, see ``fresh``)
        s0 = r0 + 3 + (first != 0).to(tl.int32) * (w0 - r0 - 3)
        sap, sa_stride, _nsa, _dsa = _rows_cols(regions, bufaddr, bufcols, s0, _F32)
        smp, sm_stride, _nsm, _dsm = _rows_cols(regions, bufaddr, bufcols, s0 + 1, _F32)
        for i0 in range(0, nq, _QB):
            om = i0 + tl.arange(0, _QB)
            row_ok = om < nq
            om64 = om.to(tl.int64)
            if first != 0:
                m_i = tl.full((_QB,), float("-inf"), tl.float32)  # log2 units
                l_i = tl.zeros((_QB,), dtype=tl.float32)
            else:
                m_i = tl.load(smp + om64 * sm_stride, mask=row_ok, other=0.0) * _LOG2E
                l_i = tl.load(smp + om64 * sm_stride + 1, mask=row_ok, other=0.0)
            for j0 in range(0, nk, _KB):
                ok = j0 + tl.arange(0, _KB)
                s = _scores(qp, q_stride, kp, k_stride, om, ok, nq, nk, D, DT) * qk_scale
                if has_bias != 0:
                    bias = tl.load(tile_ptrs(regions, bufaddr, bufcols, r0 + nread - 1, om, ok, DT),
                                   mask=row_ok[:, None] & (ok < nk)[None, :], other=0.0)
                    s += bias.to(tl.float32) * _LOG2E
                hide = (ok >= nk)[None, :] & (om >= 0)[:, None]  # keys past the block
                if causal != 0:
                    hide = hide | ((k_start + ok)[None, :] > (q_start + om)[:, None])
                s = tl.where(hide, float("-inf"), s)
                m_new = tl.maximum(m_i, tl.max(s, 1))
                shift = tl.where(m_new == float("-inf"), 0.0, m_new)
                p = tl.math.exp2(s - shift[:, None])
                alpha = tl.math.exp2(m_i - shift)
                l_i = l_i * alpha + tl.sum(p, 1)
                pv = p.to(DT)
                # acc's previous value: zero on the chain's first chunk, the declared state read
                # on a later task's first chunk, then what the previous chunk stored
                fresh = (first != 0) & (j0 == 0)
                if j0 == 0:
                    src, src_stride = sap, sa_stride
                else:
                    src, src_stride = ap, a_stride
                for d0 in range(0, D, _DB):
                    od = d0 + tl.arange(0, _DB)
                    cmask = row_ok[:, None] & (od < D)[None, :]
                    v = tl.load(vp + ok.to(tl.int64)[:, None] * v_stride + od[None, :],
                                mask=(ok < nk)[:, None] & (od < D)[None, :], other=0.0)
                    if fresh:
                        acc = tl.zeros((_QB, _DB), dtype=tl.float32)
                    else:
                        acc = tl.load(src + om64[:, None] * src_stride + od[None, :], mask=cmask,
                                      other=0.0)
                    acc = tl.dot(pv, v, acc * alpha[:, None])
                    tl.store(ap + om64[:, None] * a_stride + od[None, :], acc, mask=cmask)
                m_i = m_new
            tl.store(mp + om64 * m_stride, m_i / _LOG2E, mask=row_ok)
            tl.store(mp + om64 * m_stride + 1, l_i, mask=row_ok)

    @ATTN_FINALIZE.triton
    @triton.jit
    def attn_finalize_tile(tp, regions, bufaddr, bufcols, DT: tl.constexpr):
        """out = acc / l, cast once to the output's dtype."""
        r0 = tl.load(tp + _READ0)
        ap, a_stride, n, D = _rows_cols(regions, bufaddr, bufcols, r0, _F32)
        mp, m_stride, _nm, _dm = _rows_cols(regions, bufaddr, bufcols, r0 + 1, _F32)
        op, o_stride, _no, _do = _rows_cols(regions, bufaddr, bufcols, tl.load(tp + _WRITE0), DT)
        for i0 in range(0, n, _QB):
            om = (i0 + tl.arange(0, _QB)).to(tl.int64)
            l_i = tl.load(mp + om * m_stride + 1, mask=om < n, other=1.0)
            for d0 in range(0, D, _DB):
                od = d0 + tl.arange(0, _DB)
                mask = (om < n)[:, None] & (od < D)[None, :]
                acc = tl.load(ap + om[:, None] * a_stride + od[None, :], mask=mask, other=0.0)
                tl.store(op + om[:, None] * o_stride + od[None, :], (acc / l_i[:, None]).to(DT),
                         mask=mask)
