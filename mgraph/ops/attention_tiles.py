"""Megakernel (Triton) tile bodies of ``attn_block`` and ``attn_finalize``, and a standalone
launcher of them (:func:`run_chains`).

The CPU bodies in ring_attention.py are the meaning; both ring_attention and attention lower to
these two kinds (attn_block alone by default: ``inline_finalize``, param ``final`` below). ``attn_block`` folds one KV block into the fp32 state of one q block:
acc [rows, D] and ml [rows, 2] = (running max m, running denominator l), the first block of a
chain initialising it. The fast path walks the q block in sub-blocks of ``_QB`` rows and the
KV block in chunks of ``_KB`` keys (flash attention's inner loop): per chunk the scores go
through exp2 with the scale folded into a log2(e) factor, the running max and sum are rescaled,
and acc is rescaled and accumulated. Whole chunks at or before every row's diagonal run a plain
loop with no mask; one masked loop covers the chunks the causal diagonal crosses and the
block's partial last chunk. The fast path (head size up to ``ATTN_D``, a 16-bit dtype, q/k/v
regions TMA can address: 16-byte aligned corners and row strides) loads q, k and v through TMA
descriptors over the task's regions and keeps q and acc in registers for the whole KV block; acc
starts at 0 and the state's acc is added after the loops, scaled by their rescales. ``ATTN_D``
is a constexpr per kernel (:func:`attn_head_size`: the largest head size of the kernel's 16-bit
attn_block tasks up to 256, rounded up to 128 or 256; else 0) and only its fast path is compiled
(none at 0): at 128, ``_DB``-column q, k, v and acc over ``_KB``-key chunks; at 256, q, k, v and
acc 256 columns wide over ``_KB_WIDE``-key chunks, 2 stages (shared memory), where a smaller
head in the same kernel costs the 256-column work (TMA fills the columns past D with zeros). A
mask tile rides along when it can be read in 16-byte vectors (its corner, row stride and key
count in whole 16-byte units; a broadcast row has stride 0): its loops are compiled apart from
the unmasked ones, load the tile by pointers the compiler can prove aligned (cp.async into
shared memory, 2 pipeline stages instead of 3 to stay in shared memory) and apply either mask
kind by a select, keeping the scores in one register layout. Every other task (a head size past
ATTN_D, float32 data, unaligned regions or mask tile) takes the pointer path: ``_PB``-row
sub-blocks, ``_PB``-key chunks, D in ``_PB``-column chunks, acc updated in the state buffer
chunk by chunk; it is many times slower (pointer loads, mma.sync on 32-row tiles).

Every path sits in one function (the megakernel's, or chains_kernel's), and ptxas gives a
function one budget of 255 registers at 8 warps: where any point of it runs out, ptxas
serialises every wgmma of the function (each waits for the previous one), the fast loops'
included. So the fast loops hold no index tensors (plain loop) or few (masked), strides are
int32, acc never enters a loop from a runtime branch (that alone serialised them: C7515),
attn_finalize works in small tiles, and the pointer path is a function of its own
(``noinline``, scalar arguments) on mma.sync, which ptxas allocates apart: a noinline callee
using wgmma would serialise the caller's (C7510). Both fast paths in one function ran it out
of registers (C7512) whatever else was done, hence ATTN_D; and the 256-column path with acc in
two 128-column halves was serialised by itself (C7513: non-wgmma instructions defining a
wgmma's input registers inside its pipeline stage), hence one 128 x 256 acc. Compiled for
sm_90 (tests/test_attention_compile.py), the ring megakernel's fast loops at ATTN_D 128 and 256
are wgmma fed by TMA, pipelined, and the plain loop is spill-free (benchmarks/NOTES.md has the
numbers).

Variants. The megakernel compiles the 128-column fast path in one shape, that of
:data:`DEFAULT_VARIANT` ("plain": 128-row sub-blocks, 128-key chunks, the plain loop above,
whose SASS is the 30-line probe's but for 6 instructions an iteration, sm_90). chains_kernel
takes the shape as constexprs (PIPE, QB, KB) and run_chains / bench_attention.py pick it by
name from :data:`TILE_VARIANTS`, so others can be timed beside it in one run: ``pipe-kb64``,
the plain loop one chunk ahead (:func:`_fold_pipelined`) over 64-key chunks; ``q64-kb64-w4``,
64-row sub-blocks at 4 warps, which fit two programs on an SM (the megakernel launches one of
8 warps, so it can take only an 8-warp shape). Measured on one H200 (benchmarks/NOTES.md v13,
S 8192-16384, causal and full): plain 0.64-0.67x of cuDNN, pipe-kb64 0.61-0.63x, q64-kb64-w4
0.59-0.66x: plain stays the default.
Triton's warp specialisation (``tl.range(..., warp_specialize=True)``: a TMA producer and
consumer warpgroups, what cuDNN-class kernels do) is not used: compiled for sm_90, Triton 3.6's
Hopper pass leaves the loop plain unless the function runs exactly 4 warps (the megakernel runs
8) and no ``if`` in it has an else block holding an op besides its yield (these bodies and the
megakernel hold many), and past those checks it fails the compilation on any ``while`` (the
megakernel's queue loop and spin waits) or on a flash loop continuing another's state (the plain
then masked loops here): benchmarks/ws_rule_probe.py, tests/test_attention_ws.py.
bench_attention.py's ``--flat`` times what it buys a flat kernel: 0.89-0.90x of cuDNN with it,
0.77-0.84x without (NOTES v13).

Params (the task's row of the params table, in :data:`ATTN_PARAMS` order): ``q_start`` /
``k_start`` (global positions of the blocks' first rows, for the causal mask), ``mask`` (a
causal block that reaches past the diagonal: hide keys after the query; chunks wholly below the
diagonal skip the mask, chunks wholly above it are not computed), ``first`` (initialise the
state; the task then reads no acc/ml), ``scale`` (float), ``bias`` (a mask tile is the task's
last read, one row wide when it broadcasts over the queries: 1 = additive, added to the scores;
2 = boolean, nonzero = attend), ``final`` (the chain's last task finalises inline: its third
write is the out rows). The 128-column fast path writes them from its registers, ``acc / l``
in ``DT`` (0 where l = 0) through a TMA descriptor over the out rows, and stores no state (no
task reads a final task's state): in a one-task chain (every q block of a causal layer at S <=
8192) that drops a 64 KB fp32 store, a CTA barrier and a reload of it. Stored through pointer
tensors instead, the out rows raised the traced block's megakernel's spill loads by a fifth
and put one more in the GEMM's K loop (sm_90, test_gpu_compile's block-sp); by TMA its spill
loads fell (708 -> 653 SASS LDL), the GEMM's K loop is the same instructions, and the attention
plain loop reloads 4 spilled registers an iteration against 3. Out rows TMA cannot address (corner or row stride not in 16-byte units), the wide
path and the pointer path store the state as every task does, wait for the program's threads
(a CTA barrier: other threads stored it) and do attn_finalize's work on it while the rows are
in L2. The ``plain-state`` variant (``OUT`` off) is the default shape finalising that way, for
bench_attention.py to time both in one run. A row still fully
masked keeps m = -inf and is shifted by 0, so
exp2 gives 0 rather than NaN, as the CPU body does. m is stored in the CPU body's units
(natural-log scores) so the state means the same on both backends.

Dtypes. q, k, v, out and the mask are in the graph's dtype ``DT``; the state (acc, ml) is always
float32: both lowerings declare those buffers float32, and these bodies address them as float32
whatever ``DT`` is, so they need no per-slot dtype code (both kinds are ``own_dtypes``: the
megakernel runs them on bf16 graphs with fp32 state). Scores and p @ v accumulate in fp32;
p is rounded to ``DT`` before the p @ v dot, as flash attention does in bf16. Under Triton's
interpreter (``USE_TIMER`` false) the dot operands are widened to float32 first: Triton 3.9's
interpreter multiplies bf16 operands' raw bits.

Grouped-query attention is a property of the lowering, not of these kinds: a q block of head h
reads the KV rows of head h // (H / kv_heads), whichever rows its regions name. So is the token-
major form (attention's ``token_major``): a region may be one head's D columns of a
``[tokens, heads * D]`` buffer, and every load and store here (TMA descriptors included) takes
the region's corner and its buffer's row stride, so the bodies and their compiled code are the
same for both forms.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from ..graph import ITEMSIZE
from ..kinds import TaskKind, kind_spec
from .abi import F_KIND, F_NREAD, F_NWRITE, F_READ0, F_WRITE0, HAVE_TRITON, TASK_FIELDS

if TYPE_CHECKING:
    import torch

    from ..graph import TaskGraph

__all__ = ["ATTN_PARAMS", "BIAS_NONE", "BIAS_ADD", "BIAS_BOOL", "DEFAULT_VARIANT",
           "FAST_HEAD_SIZES", "TILE_VARIANTS", "attn_head_size", "run_chains"]

ATTN_BLOCK = kind_spec(TaskKind.ATTN_BLOCK)
ATTN_FINALIZE = kind_spec(TaskKind.ATTN_FINALIZE)
ATTN_PARAMS = ("q_start", "k_start", "mask", "first", "scale", "bias", "final", "softcap")
# The builtin kinds are defined in mgraph/kinds.py without params; the params a body reads are
# declared beside the body that reads them (the encoder packs them in this order). ``final``
# (finalise inline) is set only on the tasks that do: 0 for every other task and for graphs
# built before it existed.
ATTN_BLOCK.params = ATTN_PARAMS
ATTN_BLOCK.param_defaults = {"final": 0, "softcap": 0.0}  # softcap 0: off (attention.py)
# Each operand's dtype is fixed by the lowerings (data in DT, state float32) and addressed so by
# the bodies: the megakernel may run them on graphs whose buffers differ in dtype.
ATTN_BLOCK.own_dtypes = ATTN_FINALIZE.own_dtypes = True
BIAS_NONE, BIAS_ADD, BIAS_BOOL = 0, 1, 2  # the ``bias`` param: what the task's last read is
# The head sizes a fast path is compiled for (attn_head_size rounds up to one of them).
FAST_HEAD_SIZES = (128, 256)
# Shapes of the 128-column fast path (run_chains' ``variant``, bench_attention.py's
# ``--variants``): PIPE (the plain loop one chunk ahead: _fold_pipelined), QB q rows a
# sub-block, KB keys a chunk, OUT (a final task writes the out rows from registers, not
# through the stored state), and the launch's warps and stages. DEFAULT_VARIANT is the
# megakernel's shape and chains_kernel's default; it must be one of 8 warps and 3 stages, the
# megakernel's launch (runtime/megakernel). At 4 warps, 64 rows and 64-key chunks in 2 stages,
# a program needs 91 KB of shared memory and 255 registers a thread (sm_90, Triton 3.6), so
# two programs share an SM and each one's softmax can overlap the other's wgmma; one program
# of 8 warps keeps its two warpgroups in step (a CTA barrier around each chunk's TMA loads).
TILE_VARIANTS = {
    "plain": dict(PIPE=False, QB=128, KB=128, num_warps=8, num_stages=3, OUT=True),
    "pipe-kb64": dict(PIPE=True, QB=128, KB=64, num_warps=8, num_stages=3, OUT=True),
    "q64-kb64-w4": dict(PIPE=False, QB=64, KB=64, num_warps=4, num_stages=2, OUT=True),
    "q64-kb64-w4-pipe": dict(PIPE=True, QB=64, KB=64, num_warps=4, num_stages=2, OUT=True),
    "plain-state": dict(PIPE=False, QB=128, KB=128, num_warps=8, num_stages=3, OUT=False),
}
DEFAULT_VARIANT = "plain"
_MEGA = TILE_VARIANTS[DEFAULT_VARIANT]
assert (_MEGA["num_warps"], _MEGA["num_stages"]) == (8, 3), "the megakernel launches 8 warps"


def attn_head_size(graph: TaskGraph, task_ids: Iterable[int]) -> int:
    """The ``ATTN_D`` constexpr of a kernel that runs ``task_ids`` of ``graph``: the largest
    head size of their attn_block tasks that a fast path takes, rounded up to 128 or 256; 0
    when there is none (no attn_block task, or only heads past 256 or q in float32, which take
    the pointer path). attn_block_tile compiles only the fast path of that width: ptxas gives a function
    one register budget, and the 256-column path beside the 128-column one ran it out and
    serialised every wgmma of the kernel (benchmarks/NOTES.md)."""
    widest = 0
    for tid in task_ids:
        t = graph.tasks[tid]
        if t.kind == ATTN_BLOCK.name:
            q = t.reads[0]
            d = q.col1 - q.col0  # the q region's columns: the head size
            if d <= FAST_HEAD_SIZES[-1] and ITEMSIZE[graph.buffers[q.buffer].dtype] == 2:
                widest = max(widest, d)
    return next((w for w in FAST_HEAD_SIZES if widest <= w), 0) if widest else 0

if HAVE_TRITON:
    import triton
    import triton.language as tl

    from .abi import buffer_base, load_region, param_f32, param_i32

    _READ0, _NREAD = tl.constexpr(F_READ0), tl.constexpr(F_NREAD)
    _WRITE0, _NWRITE = tl.constexpr(F_WRITE0), tl.constexpr(F_NWRITE)
    # q rows, keys, head columns per step: the 128 x 128 x 128 tile the probe measured fastest
    # (tl.dot needs each >= 16). Shorter blocks and head sizes are handled by masks.
    _QB, _KB, _DB = tl.constexpr(128), tl.constexpr(128), tl.constexpr(128)
    # rows, keys and head columns per step of the pointer path (32 rows: mma.sync, not wgmma,
    # which needs 64) and of attn_finalize
    _PB, _FB = tl.constexpr(32), tl.constexpr(64)
    _LOG2E = tl.constexpr(1.4426950408889634)
    _F32 = tl.constexpr(tl.float32)
    _BIAS_NONE, _BIAS_BOOL = tl.constexpr(BIAS_NONE), tl.constexpr(BIAS_BOOL)
    # Pipeline stages of the fold loop that also loads a mask tile: q (32 KB) and 2 stages of
    # k, v and the mask tile (32 KB each) hold 224 KB of shared memory, what 3 stages of k and
    # v alone do; 3 stages with the mask (288 KB) exceed an H200 block's 227 KB.
    _BIAS_STAGES = tl.constexpr(2)
    # A head size up to 2 _DB (compiled only when ATTN_D is 256) is folded with a 128 x 256
    # fp32 acc (128 registers a thread at 8 warps) over chunks of 64 keys, 2 stages: q (64 KB)
    # and k, v (32 KB each a stage) hold 192 KB of shared memory, 224 KB with the mask tile;
    # 128-key chunks would need 320 KB.
    _KB_WIDE = tl.constexpr(64)
    # the megakernel's shape of the 128-column fast path (DEFAULT_VARIANT)
    _MEGA_PIPE = tl.constexpr(_MEGA["PIPE"])
    _MEGA_QB, _MEGA_KB = tl.constexpr(_MEGA["QB"]), tl.constexpr(_MEGA["KB"])
    _MEGA_OUT = tl.constexpr(_MEGA["OUT"])
    _WIDE_STAGES = tl.constexpr(2)

    @triton.jit
    def _rows_cols(regions, bufaddr, bufcols, index, DT: tl.constexpr):
        """(typed base pointer of region ``index``'s corner, row stride, rows, cols). The row
        stride is int32 (offsets inside a region fit; the corner's is 64-bit): 64-bit strides
        doubled the registers the attention loops' surroundings hold (sm_90)."""
        s, r0, r1, c0, c1 = load_region(regions, index)
        cols = tl.load(bufcols + s)
        base = buffer_base(bufaddr, s, DT) + r0.to(tl.int64) * cols + c0
        return base, cols, r1 - r0, c1 - c0

    @triton.jit
    def _operand(x, USE_TIMER: tl.constexpr):
        """A dot operand: as loaded on a GPU; widened to float32 under the interpreter, whose
        bf16 tl.dot multiplies raw bits. One return: the compiler types every return statement
        it reaches, also one after a taken constexpr branch (bf16 vs float32 fails to compile)."""
        if not USE_TIMER:
            x = x.to(tl.float32)
        return x

    @triton.jit
    def _tile(p, stride, rows, cols, n_rows, n_cols):
        """Load p[rows][:, cols] (row stride ``stride``), zeros outside [n_rows, n_cols)."""
        return tl.load(p + rows[:, None] * stride + cols[None, :],
                       mask=(rows < n_rows)[:, None] & (cols < n_cols)[None, :], other=0.0)

    @triton.jit
    def _tma_ok(p, stride, DT: tl.constexpr):
        """Whether a TMA descriptor can address rows of ``stride`` elements from ``p``: the
        corner 16-byte aligned and the row stride a multiple of 16 bytes."""
        per16 = 128 // DT.primitive_bitwidth
        return (p.to(tl.int64, bitcast=True) % 16 == 0) & (stride % per16 == 0)

    @triton.jit
    def _bias_tile(regions, bufaddr, bufcols, index, DT: tl.constexpr):
        """(pointer to mask tile ``index``'s corner, its row stride: 0 for a tile one row wide,
        which every query row reads). Built once per task, outside the key loop."""
        s, r0, r1, c0, c1 = load_region(regions, index)
        cols = tl.load(bufcols + s)
        base = buffer_base(bufaddr, s, DT) + r0.to(tl.int64) * cols + c0
        return base, cols * (r1 - r0 > 1).to(tl.int32)

    @triton.jit
    def _scores(s, ok, om, b_rows, nk, lim, qk_scale, bp, b_stride, b_bool,
                MASKED: tl.constexpr, BIAS: tl.constexpr):
        """Scaled scores in log2 units with the mask applied: -inf where a key is hidden. With
        ``MASKED``, keys past the block (``ok >= nk``) and keys after the query (``ok - om >
        lim``: lim = q_start - k_start under a causal mask, 2^30 without one) are hidden. Only
        with ``BIAS`` is there a mask tile to read (at ``bp``, row stride ``b_stride``, the rows
        ``b_rows`` of it; masked-off entries add 0); its kind is a select, not a branch
        (``b_bool``: nonzero = attend, else added): a runtime branch on s in the loop made the
        compiler carry s in three register layouts at once and spill (sm_90)."""
        s = s * qk_scale
        if BIAS:
            b = tl.load(bp + om[:, None] * b_stride + ok[None, :],
                        mask=b_rows[:, None] & (ok < nk)[None, :], other=0.0).to(tl.float32)
            s += tl.where(b_bool, tl.where(b != 0.0, 0.0, float("-inf")), b * _LOG2E)
        if MASKED:
            # one comparison an element against a per-row bound (the last key the row sees)
            last = tl.minimum(om + lim, nk - 1)
            s = tl.where(ok[None, :] > last[:, None], float("-inf"), s)
        return s

    @triton.jit
    def _fold(acc, m_i, l_i, q, kd, vd, c_lo, c_hi, om, row_ok, nk, lim, qk_scale, bp,
              b_stride, b_bool, MASKED: tl.constexpr, BIAS: tl.constexpr, KB: tl.constexpr,
              STAGES: tl.constexpr, DT: tl.constexpr, USE_TIMER: tl.constexpr,
              PIPE: tl.constexpr = False):
        """Fold key chunks [c_lo, c_hi) (KB keys each) into (acc, m, l) held in registers:  the
        head's columns in q and acc (up to _DB). k and v come by TMA through the descriptors ``kd`` / ``vd`` over the task's KV
        regions (zeros past the region's rows and the head size), so the loop has no pointer
        tensors for them and Triton's pipeliner prefetches the next chunks. Without ``MASKED``
        or ``BIAS`` (whole chunks below the diagonal: most of the work) the loop is the plain
        flash loop (a plain Triton flash-attention tile), scale folded into one FMA per score and no
        key or row index held: the index tensors a mask compares cost registers that the wgmma
        pipeline needs. With ``BIAS`` the mask tile comes by pointer loads which the caller has
        made provably 16-byte aligned; the pipeliner stages them in shared memory beside k and
        v, so ``STAGES`` (None: the kernel's num_stages) bounds what the loop holds there. The
        loop counts chunks, not keys, so that each chunk's first key is visibly a multiple of
        KB to the alignment analysis.

        ``PIPE`` (the plain loop only: :func:`_fold_pipelined`) issues the next chunk's
        scores before this chunk's softmax."""
        if PIPE and not (MASKED or BIAS):
            acc, m_i, l_i = _fold_pipelined(acc, m_i, l_i, q, kd, vd, c_lo, c_hi, qk_scale, KB,
                                            DT, USE_TIMER)
        else:
            for c in tl.range(c_lo, c_hi, num_stages=STAGES):
                j0 = c * KB
                s = tl.dot(q, tl.trans(_operand(kd.load([j0, 0]), USE_TIMER)))
                if MASKED or BIAS:
                    s = _scores(s, j0 + tl.arange(0, KB), om, row_ok, nk, lim, qk_scale, bp,
                                b_stride, b_bool, MASKED, BIAS)
                    m_new = tl.maximum(m_i, tl.max(s, 1))
                    # a row with every key so far hidden keeps m = -inf: shift by 0, not -inf
                    shift = tl.where(m_new == float("-inf"), 0.0, m_new)
                    p = tl.math.exp2(s - shift[:, None])
                else:  # every score is finite, so is the new max
                    m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
                    shift = m_new
                    p = tl.math.exp2(s * qk_scale - shift[:, None])
                alpha = tl.math.exp2(m_i - shift)
                l_i = l_i * alpha + tl.sum(p, 1)
                acc = tl.dot(_operand(p.to(DT), USE_TIMER),
                             _operand(vd.load([j0, 0]), USE_TIMER), acc * alpha[:, None])
                m_i = m_new
        return acc, m_i, l_i

    @triton.jit
    def _fold_pipelined(acc, m_i, l_i, q, kd, vd, c_lo, c_hi, qk_scale, KB: tl.constexpr,
                        DT: tl.constexpr, USE_TIMER: tl.constexpr):
        """The plain loop of :func:`_fold` with the scores one chunk ahead (flash attention 3's
        overlap within a warpgroup): iteration c issues the wgmma of chunk c + 1's q k^T, then
        does chunk c's softmax and p @ v, so that the tensor cores can work on the next scores
        while the warps compute exp2. Whether they do is up to ptxas: Triton 3.6 waits for the
        look-ahead wgmma right after issuing it, and ptxas moved the softmax above that wait in
        the 30-line probe at 128-key chunks but only its first max reductions in chains_kernel
        at 64-key chunks (sm_90); a GPU run decides. At 128-key chunks in chains_kernel it
        needs 262 KB of shared memory at 3 stages and spills 80 registers an iteration, hence
        64-key chunks in TILE_VARIANTS. The last iteration's look-ahead reloads the last chunk
        (clamped), and a range without chunks still computes chunk c_lo's scores, which no
        iteration reads: one QB x KB dot a sub-block, for a loop with no runtime branch around
        it (acc entering a loop from one serialised every wgmma, C7515)."""
        s = tl.dot(q, tl.trans(_operand(kd.load([c_lo * KB, 0]), USE_TIMER)))
        for c in tl.range(c_lo + 1, c_hi + 1):
            ahead = tl.minimum(c, c_hi - 1) * KB
            s_next = tl.dot(q, tl.trans(_operand(kd.load([ahead, 0]), USE_TIMER)))
            m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)  # finite: nothing is masked
            p = tl.math.exp2(s * qk_scale - m_new[:, None])
            alpha = tl.math.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = tl.dot(_operand(p.to(DT), USE_TIMER),
                         _operand(vd.load([(c - 1) * KB, 0]), USE_TIMER), acc * alpha[:, None])
            m_i = m_new
            s = s_next
        return acc, m_i, l_i

    @triton.jit
    def _key_chunks(i0, nq, nk, q_start, k_start, causal, ROWS: tl.constexpr,
                    KB: tl.constexpr):
        """For the ROWS query rows from i0, in KB-key chunks: (c_plain, c_end, lim). Chunks
        [0, c_plain) are whole and at or before every row's diagonal: nothing to mask. Chunks
        [c_plain, c_end) need the mask: the block's partial last chunk, and under a causal mask
        the chunks the diagonal crosses. Chunks from c_end follow every row: not computed.
        lim: a key j is hidden from row i when j - i > lim (no key is, without causal)."""
        last = tl.minimum(q_start + i0 + ROWS, q_start + nq)  # one past the last row's key
        j_end = tl.where(causal != 0, tl.minimum(tl.maximum(last - k_start, 0), nk), nk)
        j_plain = tl.where(causal != 0, tl.maximum(q_start + i0 + 1 - k_start, 0), nk)
        c_end = tl.cdiv(j_end, KB)
        c_plain = tl.minimum(tl.minimum(j_plain, nk) // KB, c_end)
        lim = tl.where(causal != 0, q_start - k_start, 1 << 30)
        return c_plain, c_end, lim

    @triton.jit
    def _load_ml(first, smp, sm_stride, om, row_ok):
        """(m in log2 units, l) of rows ``om`` from the state read, or a chain's start."""
        if first != 0:
            m_i = tl.full(om.shape, float("-inf"), tl.float32)
            l_i = tl.zeros(om.shape, dtype=tl.float32)
        else:
            m_i = tl.load(smp + om * sm_stride, mask=row_ok, other=0.0) * _LOG2E
            l_i = tl.load(smp + om * sm_stride + 1, mask=row_ok, other=0.0)
        return m_i, l_i

    @triton.jit
    def _store_state(ap, a_stride, mp, m_stride, om, od, row_ok, cmask, acc, m_i, l_i):
        """Store the fast path's state: acc (rows ``om``, columns ``od``), then (m, l)."""
        tl.store(ap + om[:, None] * a_stride + od[None, :], acc, mask=cmask)
        _store_ml(mp, m_stride, om, row_ok, m_i, l_i)

    @triton.jit
    def _store_ml(mp, m_stride, om, row_ok, m_i, l_i):
        """Store (m, l), m in the CPU body's natural-log units."""
        tl.store(mp + om * m_stride, m_i / _LOG2E, mask=row_ok)
        tl.store(mp + om * m_stride + 1, l_i, mask=row_ok)

    @triton.jit
    def _fast_rows(qp, q_stride, nq, kp, k_stride, vp, v_stride, nk, D, ap, a_stride, sap,
                   sa_stride, mp, m_stride, smp, sm_stride, first, i0, q_start, k_start, causal,
                   qk_scale, has_bias, bp, b_stride, b_bool, DT: tl.constexpr,
                   USE_TIMER: tl.constexpr, DB: tl.constexpr, KB: tl.constexpr,
                   STAGES: tl.constexpr, BIAS_STAGES: tl.constexpr, PIPE: tl.constexpr = False,
                   QB: tl.constexpr = _QB, tp=None, params=None, regions=None, bufaddr=None,
                   bufcols=None, OUT: tl.constexpr = False):
        """The fast path for the QB-row sub-block at row i0 (head size up to DB columns; KB-key
        chunks; STAGES / BIAS_STAGES pipeline stages for the loops without / with the mask
        tile, None: the kernel's): q and acc in registers, the plain chunks, then the masked
        ones, each range by a loop without the mask tile or, when the task has one, a loop
        with it. Reads the state's rows and writes them, or, with ``OUT`` in a final task
        whose out rows TMA can address, writes the out rows instead (from registers, by TMA)
        and returns 1 (else 0). Nothing but scalars and row vectors is live across the loops. Columns past D are zeros (TMA fills them), so a head smaller
        than DB is correct here too, at DB's cost."""
        qd = tl.make_tensor_descriptor(qp, [nq, D], [q_stride, 1], [QB, DB])
        kd = tl.make_tensor_descriptor(kp, [nk, D], [k_stride, 1], [KB, DB])
        vd = tl.make_tensor_descriptor(vp, [nk, D], [v_stride, 1], [KB, DB])
        om = i0 + tl.arange(0, QB)
        row_ok = om < nq
        m_old, l_old = _load_ml(first, smp, sm_stride, om, row_ok)
        c_plain, c_end, lim = _key_chunks(i0, nq, nk, q_start, k_start, causal, QB, KB)
        q = _operand(qd.load([i0, 0]), USE_TIMER)
        # The loops start from acc = 0 and the state's acc is folded in after them, scaled by
        # the product of their rescales (exp2(m_old - m)): an acc that entered the loop from a
        # runtime branch (zeros, or the state's) made ptxas serialise every wgmma of the
        # kernel (C7515, sm_90).
        acc = tl.zeros((QB, DB), dtype=tl.float32)
        if has_bias == _BIAS_NONE:
            # the loops compiled without the mask tile's loads (no bias, no branch)
            acc, m_i, l_i = _fold(acc, m_old, l_old, q, kd, vd, 0, c_plain, om, row_ok, nk, lim,
                                  qk_scale, bp, b_stride, b_bool, False, False, KB, STAGES, DT,
                                  USE_TIMER, PIPE)
            acc, m_i, l_i = _fold(acc, m_i, l_i, q, kd, vd, c_plain, c_end, om, row_ok, nk, lim,
                                  qk_scale, bp, b_stride, b_bool, True, False, KB, STAGES, DT,
                                  USE_TIMER)
        else:
            # what the caller checked (corner, row stride and key count in whole 16-byte
            # units), in a form the compiler sees: 16-byte loads
            per16 = 128 // DT.primitive_bitwidth
            vbp = _aligned16(bp, DT)
            vb_stride = b_stride // per16 * per16
            vnk = nk // per16 * per16
            acc, m_i, l_i = _fold(acc, m_old, l_old, q, kd, vd, 0, c_plain, om, row_ok, vnk,
                                  lim, qk_scale, vbp, vb_stride, b_bool, False, True, KB,
                                  BIAS_STAGES, DT, USE_TIMER)
            acc, m_i, l_i = _fold(acc, m_i, l_i, q, kd, vd, c_plain, c_end, om, row_ok, vnk, lim,
                                  qk_scale, vbp, vb_stride, b_bool, True, True, KB,
                                  BIAS_STAGES, DT, USE_TIMER)
        od = tl.arange(0, DB)
        cmask = row_ok[:, None] & (od < D)[None, :]
        if first == 0:
            # (m_old = -inf: nothing folded before, the state's acc is 0)
            keep = tl.where(m_old == float("-inf"), 0.0, tl.math.exp2(m_old - m_i))
            acc += keep[:, None] * tl.load(sap + om[:, None] * sa_stride + od[None, :],
                                           mask=cmask, other=0.0)
        wrote = 0
        if OUT:
            # (the task's row read again here: nothing more is live through the loops; a task
            # that is not final names its first write, never stored to)
            final = param_i32(params, tp, 6) != 0
            w_out = tl.load(tp + _WRITE0) + 2 * final.to(tl.int32)
            op, o_stride, n_out, _do = _rows_cols(regions, bufaddr, bufcols, w_out, DT)
            wrote = (final & _tma_ok(op, o_stride, DT)).to(tl.int32)
            if wrote != 0:
                # the chain's last task: out = acc / l from registers, in DT (0 where l = 0, as
                # _finalize), stored by TMA (no pointer tensors: pointer stores here spilled
                # the kernel's other loops, the GEMM's included); the state is not stored,
                # since no task reads it after this one
                inv = tl.where(l_i == 0.0, 0.0, 1.0 / tl.where(l_i == 0.0, 1.0, l_i))
                outd = tl.make_tensor_descriptor(op, [n_out, D], [o_stride, 1], [QB, DB])
                outd.store([i0, 0], (acc * inv[:, None]).to(DT))
            else:
                _store_state(ap, a_stride, mp, m_stride, om, od, row_ok, cmask, acc, m_i, l_i)
        else:
            _store_state(ap, a_stride, mp, m_stride, om, od, row_ok, cmask, acc, m_i, l_i)
        return wrote

    @triton.jit
    def _finalize(regions, bufaddr, bufcols, state, out_index, DT: tl.constexpr):
        """out = acc / l, with acc and ml regions ``state`` and ``state + 1`` and out region
        ``out_index``, cast once to the output's dtype; 0 in a row whose every key was hidden
        (l = 0: left padding), as SDPA returns it, where acc / l would be 0 / 0. In _FB x _FB
        tiles: its pointer tensors then take 16 elements a thread (at 128 x 128 they pushed the
        kernel past 255 registers)."""
        ap, a_stride, n, D = _rows_cols(regions, bufaddr, bufcols, state, _F32)
        mp, m_stride, _nm, _dm = _rows_cols(regions, bufaddr, bufcols, state + 1, _F32)
        op, o_stride, _no, _do = _rows_cols(regions, bufaddr, bufcols, out_index, DT)
        for i0 in range(0, n, _FB):
            om = i0 + tl.arange(0, _FB)
            l_i = tl.load(mp + om * m_stride + 1, mask=om < n, other=1.0)
            hidden = (l_i == 0.0)[:, None]
            l_i = tl.where(l_i == 0.0, 1.0, l_i)  # never computes 0 / 0
            for d0 in range(0, D, _FB):
                od = d0 + tl.arange(0, _FB)
                mask = (om < n)[:, None] & (od < D)[None, :]
                acc = tl.load(ap + om[:, None] * a_stride + od[None, :], mask=mask, other=0.0)
                out = tl.where(hidden, 0.0, acc / l_i[:, None])
                tl.store(op + om[:, None] * o_stride + od[None, :], out.to(DT), mask=mask)

    @triton.jit(noinline=True)
    def _pointer_rows(qp, q_stride, nq, kp, k_stride, vp, v_stride, nk, D, ap, a_stride, sap,
                      sa_stride, mp, m_stride, smp, sm_stride, first, i0, q_start, k_start,
                      causal, qk_scale, has_bias, bp, b_stride, b_bool, softcap,
                      DT: tl.constexpr, USE_TIMER: tl.constexpr):
        """The pointer path for the _PB-row sub-block at row i0 (any head size, dtype and
        alignment): chunks of _PB keys, scores over D in _PB-column chunks, acc rescaled and
        accumulated in the state's write chunk by chunk. A noinline function (scalar
        arguments only) whose 32-row dots are mma.sync, not wgmma: ptxas allocates its
        registers apart from the fast loops', which it would otherwise serialise."""
        om = i0 + tl.arange(0, _PB)
        row_ok = om < nq
        m_i, l_i = _load_ml(first, smp, sm_stride, om, row_ok)
        _c_plain, c_end, lim = _key_chunks(i0, nq, nk, q_start, k_start, causal, _PB, _PB)
        # without a mask tile the bias loads are masked off and add 0: one loop for both
        # (a comparison, not row_ok & a scalar: the interpreter cannot mask with that)
        b_rows = om < nq * (has_bias != _BIAS_NONE).to(tl.int32)
        fresh = first != 0
        if fresh & (c_end == 0):  # a first task with nothing to fold must still write zeros
            for d0 in range(0, D, _PB):
                od = d0 + tl.arange(0, _PB)
                tl.store(ap + om[:, None] * a_stride + od[None, :],
                         tl.zeros((_PB, _PB), dtype=tl.float32),
                         mask=row_ok[:, None] & (od < D)[None, :])
        for c in range(0, c_end):
            ok = c * _PB + tl.arange(0, _PB)
            s = tl.zeros((_PB, _PB), dtype=tl.float32)
            for d0 in range(0, D, _PB):
                od = d0 + tl.arange(0, _PB)
                q = _operand(_tile(qp, q_stride, om, od, nq, D), USE_TIMER)
                k = _operand(_tile(kp, k_stride, ok, od, nk, D), USE_TIMER)
                s = tl.dot(q, tl.trans(k), s)
            if softcap > 0.0:  # a Gemma2 task (only this path takes them): cap the scaled
                # scores, softcap * tanh(s * scale / softcap), in the raw units _scores scales
                x = s * (qk_scale / _LOG2E) / softcap
                s = softcap * (1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)) * (_LOG2E / qk_scale)
            s = _scores(s, ok, om, b_rows, nk, lim, qk_scale, bp, b_stride, b_bool, True, True)
            m_new = tl.maximum(m_i, tl.max(s, 1))
            shift = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.math.exp2(s - shift[:, None])
            alpha = tl.math.exp2(m_i - shift)
            l_i = l_i * alpha + tl.sum(p, 1)
            pv = _operand(p.to(DT), USE_TIMER)
            # acc's previous value: zero for a chain's first chunk, the state read for a later
            # task's first chunk, else what the previous chunk stored
            if c == 0:
                src, src_stride = sap, sa_stride
            else:
                src, src_stride = ap, a_stride
            for d0 in range(0, D, _PB):
                od = d0 + tl.arange(0, _PB)
                cmask = row_ok[:, None] & (od < D)[None, :]
                v = _operand(_tile(vp, v_stride, ok, od, nk, D), USE_TIMER)
                if fresh & (c == 0):
                    acc = tl.zeros((_PB, _PB), dtype=tl.float32)
                else:
                    acc = tl.load(src + om[:, None] * src_stride + od[None, :], mask=cmask,
                                  other=0.0)
                acc = tl.dot(pv, v, acc * alpha[:, None])
                tl.store(ap + om[:, None] * a_stride + od[None, :], acc, mask=cmask)
            m_i = m_new
        _store_ml(mp, m_stride, om, row_ok, m_i, l_i)

    @triton.jit
    def _pointer_block(qp, q_stride, nq, kp, k_stride, vp, v_stride, nk, D, ap, a_stride, sap,
                       sa_stride, mp, m_stride, smp, sm_stride, first, q_start, k_start, causal,
                       qk_scale, has_bias, bp, b_stride, b_bool, softcap, DT: tl.constexpr,
                       USE_TIMER: tl.constexpr):
        """The whole q block by the pointer path, _PB rows a call."""
        for i0 in range(0, nq, _PB):
            _pointer_rows(qp, q_stride, nq, kp, k_stride, vp, v_stride, nk, D, ap, a_stride, sap,
                          sa_stride, mp, m_stride, smp, sm_stride, first, i0, q_start, k_start,
                          causal, qk_scale, has_bias, bp, b_stride, b_bool, softcap, DT,
                          USE_TIMER)

    @triton.jit
    def _aligned16(p, DT: tl.constexpr):
        """Pointer ``p`` rounded down to 16 bytes, with the hint that says so: ``p`` itself
        where the caller has checked that it is aligned, and then a fact Triton's alignment
        analysis can see (it sees no runtime check, and no hint through an int-to-pointer
        cast: the hint sits on the cast)."""
        a = p.to(tl.int64, bitcast=True) // 16 * 16
        return tl.multiple_of(a.to(tl.pointer_type(DT), bitcast=True), 16)

    @ATTN_BLOCK.triton
    @triton.jit
    def attn_block_tile(tp, params, regions, bufaddr, bufcols, ATTN_D: tl.constexpr,
                        DT: tl.constexpr, USE_TIMER: tl.constexpr):
        """attn_block in the megakernel: :func:`_attn_block` in the fast-path shape of
        :data:`DEFAULT_VARIANT` (the megakernel's dispatch passes only ABI values)."""
        _attn_block(tp, params, regions, bufaddr, bufcols, ATTN_D, DT, USE_TIMER, _MEGA_PIPE,
                    _MEGA_QB, _MEGA_KB, _MEGA_OUT)

    @triton.jit
    def _attn_block(tp, params, regions, bufaddr, bufcols, ATTN_D: tl.constexpr,
                    DT: tl.constexpr, USE_TIMER: tl.constexpr, PIPE: tl.constexpr,
                    QB: tl.constexpr, KB: tl.constexpr, OUT: tl.constexpr):
        """The attn_block body (module docstring). The 128-column fast path's shape: ``PIPE``,
        its plain loop issues the next chunk's scores before this chunk's softmax
        (_fold_pipelined); QB rows a sub-block, KB keys a chunk (the megakernel's: _QB, _KB)."""
        r0 = tl.load(tp + _READ0)
        nread = tl.load(tp + _NREAD)
        w0 = tl.load(tp + _WRITE0)
        q_start = param_i32(params, tp, 0)
        k_start = param_i32(params, tp, 1)
        causal = param_i32(params, tp, 2)
        first = param_i32(params, tp, 3)
        qk_scale = param_f32(params, tp, 4) * _LOG2E  # scores in log2 units: exp2 below
        has_bias = param_i32(params, tp, 5)
        softcap = param_f32(params, tp, 7)  # 0: off; else the pointer path (attention.py)
        b_bool = has_bias == _BIAS_BOOL
        qp, q_stride, nq, D = _rows_cols(regions, bufaddr, bufcols, r0, DT)
        kp, k_stride, nk, _dk = _rows_cols(regions, bufaddr, bufcols, r0 + 1, DT)
        vp, v_stride, _nv, _dv = _rows_cols(regions, bufaddr, bufcols, r0 + 2, DT)
        ap, a_stride, _na, _da = _rows_cols(regions, bufaddr, bufcols, w0, _F32)
        mp, m_stride, _nm, _dm = _rows_cols(regions, bufaddr, bufcols, w0 + 1, _F32)
        # the mask tile is the last read (without one, this names another region, never read)
        bp, b_stride = _bias_tile(regions, bufaddr, bufcols, r0 + nread - 1, DT)
        # the state read: the chain's acc/ml (the same rows as the writes, but read as declared);
        # a first task has no such reads, so it names its writes (never loaded)
        s0 = r0 + 3 + (first != 0).to(tl.int32) * (w0 - r0 - 3)
        sap, sa_stride, _nsa, _dsa = _rows_cols(regions, bufaddr, bufcols, s0, _F32)
        smp, sm_stride, _nsm, _dsm = _rows_cols(regions, bufaddr, bufcols, s0 + 1, _F32)
        # The fast path: a head size up to ATTN_D in a 16-bit dtype whose q, k, v regions TMA
        # can address (fp32 tiles would not fit the pipeline stages in shared memory), and no
        # mask tile or one read in whole 16-byte vectors (corner, row stride and key count in
        # 16-byte units). ATTN_D (0, 128 or 256, per graph: attn_head_size) picks the one fast
        # path compiled: both in one function ran it out of registers, which serialised every
        # wgmma of it (C7512). Anything else takes the pointer path (any D), a call: its
        # registers are not the fast loops' (see _pointer_rows).
        inline_out = tl.full([], 0, tl.int32)  # 1: the fast path wrote the out rows itself
        if ATTN_D > 0:
            per16 = 128 // DT.primitive_bitwidth
            vec_bias = _tma_ok(bp, b_stride, DT) & (nk % per16 == 0)
            fast = ((D <= ATTN_D) & (DT.primitive_bitwidth == 16)
                    & _tma_ok(qp, q_stride, DT) & _tma_ok(kp, k_stride, DT)
                    & _tma_ok(vp, v_stride, DT) & ((has_bias == _BIAS_NONE) | vec_bias)
                    & (softcap == 0.0))
            if fast:
                # one stage: Triton's pipeliner otherwise hoists the out rows' TMA store
                # buffer (32 KB) out of this loop, live beside the fast loops' shared memory
                for i0 in tl.range(0, nq, QB if ATTN_D <= _DB else _QB, num_stages=1):
                    if ATTN_D > _DB:  # one acc 2 _DB wide (two halves: ptxas serialised
                        # every wgmma, C7513), _KB_WIDE-key chunks, 2 stages (shared memory)
                        _fast_rows(qp, q_stride, nq, kp, k_stride, vp, v_stride, nk, D, ap,
                                   a_stride, sap, sa_stride, mp, m_stride, smp, sm_stride, first,
                                   i0, q_start, k_start, causal, qk_scale, has_bias, bp,
                                   b_stride, b_bool, DT, USE_TIMER, 2 * _DB, _KB_WIDE,
                                   _WIDE_STAGES, _WIDE_STAGES)
                    else:  # (every sub-block's out corner and stride pass or fail alike)
                        wrote = _fast_rows(
                                   qp, q_stride, nq, kp, k_stride, vp, v_stride, nk, D, ap,
                                   a_stride, sap, sa_stride, mp, m_stride, smp, sm_stride, first,
                                   i0, q_start, k_start, causal, qk_scale, has_bias, bp,
                                   b_stride, b_bool, DT, USE_TIMER, _DB, KB, None,
                                   _BIAS_STAGES, PIPE, QB, tp, params, regions, bufaddr,
                                   bufcols, OUT)
                        if OUT:
                            inline_out = wrote
            else:
                _pointer_block(qp, q_stride, nq, kp, k_stride, vp, v_stride, nk, D, ap,
                               a_stride, sap, sa_stride, mp, m_stride, smp, sm_stride, first,
                               q_start, k_start, causal, qk_scale, has_bias, bp, b_stride,
                               b_bool, softcap, DT, USE_TIMER)
        else:  # no fast path compiled: a graph without a head size it could take
            _pointer_block(qp, q_stride, nq, kp, k_stride, vp, v_stride, nk, D, ap, a_stride,
                           sap, sa_stride, mp, m_stride, smp, sm_stride, first, q_start, k_start,
                           causal, qk_scale, has_bias, bp, b_stride, b_bool, softcap, DT,
                           USE_TIMER)
        if (param_i32(params, tp, 6) != 0) & (inline_out == 0):
            # final, not done by the fast path: attn_finalize's work on the state just stored,
            # by every thread of the program (hence the barrier), its regions read again from
            # the task's row rather than held through the loops; the out rows are the third
            # write
            tl.debug_barrier()
            w_state = tl.load(tp + _WRITE0)
            _finalize(regions, bufaddr, bufcols, w_state, w_state + 2, DT)

    @ATTN_FINALIZE.triton
    @triton.jit
    def attn_finalize_tile(tp, regions, bufaddr, bufcols, DT: tl.constexpr):
        """out = acc / l from the state it reads (:func:`_finalize`)."""
        _finalize(regions, bufaddr, bufcols, tl.load(tp + _READ0), tl.load(tp + _WRITE0), DT)

    _FIELDS, _KIND = tl.constexpr(TASK_FIELDS), tl.constexpr(F_KIND)
    __all__ += ["chains_kernel"]

    @triton.jit
    def chains_kernel(tasks, order, starts, param_table, regions, bufaddr, bufcols,
                       BLOCK_ID: tl.constexpr, DT: tl.constexpr, USE_TIMER: tl.constexpr,
                       ATTN_D: tl.constexpr = 128, PIPE: tl.constexpr = _MEGA_PIPE,
                       QB: tl.constexpr = _MEGA_QB, KB: tl.constexpr = _MEGA_KB,
                       OUT: tl.constexpr = _MEGA_OUT):
        """Program c runs chain c: its attn_block tasks in order, then its attn_finalize if
        it has one (with ``inline_finalize``, the default, its last attn_block finalises).
        ``ATTN_D`` as the megakernel's (attn_head_size; run_chains passes it, 128 when a
        launch leaves it out: benchmarks/bench_attention.py's, whose head size is 128).
        ``PIPE``, ``QB``, ``KB``: the 128-column fast path's shape (_attn_block; by default
        the megakernel's: bench_attention.py's ``--variants`` times others beside it)."""
        c = tl.program_id(0)
        for i in range(tl.load(starts + c), tl.load(starts + c + 1)):
            tp = tasks + tl.load(order + i) * _FIELDS
            if tl.load(tp + _KIND) == BLOCK_ID:
                # (not named ``params``: Triton 3.6's argument binder shadows that name)
                _attn_block(tp, param_table, regions, bufaddr, bufcols, ATTN_D, DT, USE_TIMER,
                            PIPE, QB, KB, OUT)
            else:
                attn_finalize_tile(tp, regions, bufaddr, bufcols, DT)


def run_chains(schedule, inputs: dict[str, torch.Tensor], *, device: str = "cpu",
               variant: str = DEFAULT_VARIANT) -> dict[str, torch.Tensor]:
    """Run an attention schedule's tasks through these bodies outside the megakernel: one
    program per q block runs that block's attn_block chain and its attn_finalize, if any
    (chains are independent: each owns its state rows); every rank's copy tasks (the KV ring's
    movement) run first on the host, since they read only the k/v inputs and what earlier copies wrote.
    Each buffer is its own tensor in its own dtype (bf16 data, fp32 state). It times the tile
    without the megakernel's queues and waits (benchmarks/bench_attention.py) and tests the
    bodies in isolation. ``variant``: the fast path's shape and launch (:data:`TILE_VARIANTS`).
    Returns the global outputs. Under TRITON_INTERPRET=1 ``device`` is "cpu"."""
    import torch

    from ..errors import OptionError

    if variant not in TILE_VARIANTS:
        raise OptionError(f"run_chains: unknown variant {variant!r}",
                          hint=f"one of {', '.join(TILE_VARIANTS)}")
    shape = TILE_VARIANTS[variant]

    from mgraph.runtime.megakernel.encode import encode_rank, kind_id
    from mgraph.runtime.megakernel.runtime import _tl_dtype
    from mgraph.runtime.memory import allocate, gather_outputs, region_view, shard_inputs

    graph = schedule.graph
    mem = allocate(graph, device)
    shard_inputs(graph, {n: t.to(device) for n, t in inputs.items()}, mem)
    for tid in schedule.order():
        t = graph.tasks[tid]
        if t.kind == TaskKind.COPY.value:
            src = region_view(mem, t.reads[0])
            for w in t.writes:
                region_view(mem, w).copy_(src)
    interpret = device == "cpu"
    if not interpret:
        import triton

        # the fast path builds its TMA descriptors on the device, in memory from this allocator
        triton.set_allocator(
            lambda size, align, stream: torch.empty(size, dtype=torch.int8, device=device)
        )
    for rank in graph.topology.ranks:
        tables = encode_rank(schedule, rank, single_program=True)
        chains: dict[tuple[str, int], list[int]] = {}
        for i, tid in enumerate(tables.local_tasks):
            t = graph.tasks[tid]
            if t.kind in (ATTN_BLOCK.name, ATTN_FINALIZE.name):
                state = t.writes[0] if t.kind == ATTN_BLOCK.name else t.reads[0]
                chains.setdefault((state.buffer, state.row0), []).append(i)
        if not chains:
            continue
        order = [i for chain in chains.values() for i in chain]
        starts = [0]
        for chain in chains.values():
            starts.append(starts[-1] + len(chain))

        def dev(x: torch.Tensor) -> torch.Tensor:
            return x.to(device).contiguous()

        addr = torch.tensor([mem[s].data_ptr() for s in tables.slots], dtype=torch.int64)
        cols = torch.tensor([mem[s].shape[1] for s in tables.slots], dtype=torch.int32)
        chains_kernel[(len(chains),)](
            dev(tables.tasks), dev(torch.tensor(order, dtype=torch.int32)),
            dev(torch.tensor(starts, dtype=torch.int32)), dev(tables.params),
            dev(tables.regions), dev(addr), dev(cols), BLOCK_ID=kind_id(ATTN_BLOCK.name),
            DT=_tl_dtype(graph.dtype), USE_TIMER=not interpret,
            ATTN_D=attn_head_size(graph, tables.local_tasks), PIPE=shape["PIPE"],
            QB=shape["QB"], KB=shape["KB"], OUT=shape["OUT"], num_warps=shape["num_warps"],
            num_stages=shape["num_stages"],
        )
    return gather_outputs(graph, mem)
