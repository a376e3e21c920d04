"""The GEMM body's path for rows TMA cannot address: masked pointer loads and stores.

TMA needs a buffer's row pitch in whole 16-byte units. Real models have GEMM operands whose rows
are not: a MoE router ``Linear(H, E)`` with E = 4 or 60 experts in bf16 (8- and 120-byte rows),
GPT-2's ``lm_head`` (50257 columns), any odd width. The GEMM body (tiles.gemm_tile, for gemm and
gemm_glu tasks) runs such a task here: A and B are read and the output written through masked
pointers, in blocks of _PM x _PN outputs and _PK-deep K steps, so no dim needs to divide by a
block and every edge is masked. Which tasks come here is decided per task from the buffers' row
widths (:func:`gemm_tma_rows` on the device, encode.gemm_by_pointers on the host: A's or B's
rows, or a reduce-add's writes, not whole 16-byte units); the others keep the TMA path.

Why a function of its own, with 32-row dots: its dots are mma.sync (Triton uses wgmma only for
64-row multiples), which ptxas allocates apart from the caller's wgmma loops; a wgmma in a
noinline callee would serialise the caller's (moe_bodies' pointer passes do the same). And it
is compiled into the kernel only where the kernel runs such a task (the kernel's constexpr
GEMM_PTR, dispatch.body_constexprs): a kernel whose GEMMs all take TMA compiles to the code it
had before this path existed.

The arithmetic is the TMA path's: fp32 accumulation over the task's K range, one rounding to
the graph's dtype DT, then plain stores into every write, or (``accumulate``) an add into each
(a per-element atomic add of the DT value on a GPU, as the TMA reduce-add; the interpreter,
which runs one program at a time, loads, adds in fp32 and stores). gemm_glu tasks compute the
gate and up products of each block from their packed columns (matmul_glu.pack_glu: blocks of
BN/2 gate columns, then the same of up) and store silu(gate) * up.

Two block shapes, chosen per task at run time (:func:`_vectors`), two copies of the block loop
in the function. Their registers are the kernel's business too (sm_90, Triton 3.6, ptxas
12.8): the more this function needs, the fewer ptxas leaves the caller, whose TMA GEMM K loop
then reloads spilled values every step. A third shape (B's rows in vectors, for an odd K)
cost 4 reloads a step there, the 2-byte shape at its first size (32 x 128, K steps of 128)
beside the vector one 2; the sizes below cost none (a RMSNorm + Linear + 4-expert router
kernel: 6 more local loads per task in the dispatch loop, none in any body's loop):

- A's rows in whole 16-byte vectors (its address, pitch, first column and K range multiples of
  16 bytes: routers and lm_heads, whose x has K a multiple of 8 and whose narrow rows are B's
  and the output's). The block is computed transposed, B^T A^T: 32 output columns (the dot's
  rows, so still mma.sync) by 128 output rows, 128-deep K steps. A^T's loads are 16-byte
  vectors (Triton sees the alignment through :func:`_corner`), B's 2-byte loads are made
  once per 128 rows (the other shape: once per 32) and A's vectors once per 32 columns (they
  hit L2). A router of 4 experts reads its B (4 columns) as 32: the waste is in the dot, not
  in memory.
- Otherwise (A's rows narrow: an odd K, or both operands'): 32 x 64 blocks, 64-deep K steps,
  every load 2 bytes (Triton cannot prove a row aligned).

Neither loop is pipelined (``num_stages=1``): the kernel's 3 stages made A's vector loads
asynchronous copies to shared memory and the function ran out of registers.

Measured before the vector shape (one H200, Triton 3.6, benchmarks/bench_gemm_rows.py; results
in benchmarks/results/v19/gemm_rows): correct, and slow. Per task, against the TMA path on the
shape rounded up to 16-byte rows: a 128-row router task of 4 experts (K 4096) 370 us against 39
at 8 experts; GPT-2's lm_head (K 768) 168 us a 128 x 256 task against 17.7 at 50264 columns (a
2048-token call 4.13 ms against 0.56, cuBLAS 1.73 at 50257 columns); K 4095: 794 us a 128 x 256
task against 48. A K step of 128 (_PK) took 18-31% off the first form's 32. The TMA GEMMs of a
kernel that compiles this path keep their speed (49.9 against 50.8 us a 128 x 256 task).
"""

from __future__ import annotations

from .abi import F_KIND, F_NWRITE, F_READ0, F_WRITE0, HAVE_TRITON

__all__: list[str] = []

if HAVE_TRITON:
    import triton
    import triton.language as tl

    from ..kinds import KINDS, TaskKind
    from .abi import buffer_base, load_region, param_i32

    __all__ += ["gemm_tma_rows", "gemm_pointers"]

    _READ0, _WRITE0, _NWRITE = tl.constexpr(F_READ0), tl.constexpr(F_WRITE0), tl.constexpr(F_NWRITE)
    _KIND = tl.constexpr(F_KIND)
    _GEMM_KIND = tl.constexpr(list(KINDS).index(TaskKind.GEMM.value))
    # Output rows and columns per block, K per step (module docstring). 2-byte loads: 32 rows
    # keep the dots mma.sync; 32 x 64 blocks, K steps of 64 (24 loads a thread a step; the
    # first form's 32 x 128 and 128-deep steps, 80, beside the vector shape left the kernel's
    # own code fewer registers: 2 reloads a step in the TMA GEMM's K loop)
    _PM, _PN, _PK = tl.constexpr(32), tl.constexpr(64), tl.constexpr(64)
    # A's rows in vectors: transposed blocks of 128 output rows x 32 columns
    _TM, _TN, _TK = tl.constexpr(128), tl.constexpr(32), tl.constexpr(128)

    @triton.jit
    def _rows16(bufcols, slot, DT: tl.constexpr):
        """Whether buffer ``slot``'s rows are whole 16-byte units of DT."""
        return tl.load(bufcols + slot) % (128 // DT.primitive_bitwidth) == 0

    @triton.jit
    def _accumulates(tp, params, GLU: tl.constexpr):
        """The task's ``accumulate`` param; 0 for a gemm_glu task (GLU: the kernel runs some),
        which declares no params."""
        is_gemm = True
        if GLU:
            is_gemm = tl.load(tp + _KIND) == _GEMM_KIND
        accumulate = 0
        if is_gemm:
            accumulate = param_i32(params, tp, 0)
        return accumulate

    @triton.jit
    def gemm_tma_rows(tp, params, regions, bufcols, DT: tl.constexpr, GLU: tl.constexpr):
        """Whether the TMA path can run the task whose row is ``tp``: A's and B's rows are
        whole 16-byte units, and so are a reduce-add's writes' (encode.gemm_by_pointers)."""
        r0 = tl.load(tp + _READ0)
        a_slot, _am0, _am1, _ak0, _ak1 = load_region(regions, r0)
        b_slot, _bk0, _bk1, _bn0, _bn1 = load_region(regions, r0 + 1)
        ok = _rows16(bufcols, a_slot, DT) & _rows16(bufcols, b_slot, DT)
        if _accumulates(tp, params, GLU) != 0:
            w0 = tl.load(tp + _WRITE0)
            for q in range(tl.load(tp + _NWRITE)):
                c_slot, _cm0, _cm1, _cn0, _cn1 = load_region(regions, w0 + q)
                ok = ok & _rows16(bufcols, c_slot, DT)
        return ok

    @triton.jit
    def _offsets(rows, cols, pitch, TRANS: tl.constexpr):
        """Element offsets ``rows[i] * pitch + cols[j]`` of a row-major block, laid out
        [rows, cols], or [cols, rows] where TRANS."""
        if TRANS:
            return rows.to(tl.int64)[None, :] * pitch + cols[:, None]
        else:
            return rows.to(tl.int64)[:, None] * pitch + cols[None, :]

    @triton.jit
    def _both(row_ok, col_ok, TRANS: tl.constexpr):
        """The mask of the block :func:`_offsets` lays out from the same rows and columns."""
        if TRANS:
            return row_ok[None, :] & col_ok[:, None]
        else:
            return row_ok[:, None] & col_ok[None, :]

    @triton.jit
    def _block_dot(a, a_pitch, om, rok, b, b_pitch, bn, nok, ksize, PM: tl.constexpr,
                   PN: tl.constexpr, PK: tl.constexpr, TRANS: tl.constexpr):
        """fp32 A[om, :ksize] @ B[:ksize, bn] by masked pointer loads (``a``, ``b``: the
        regions' corners; rows past ``rok`` and columns past ``nok`` read zeros), as a PM x PN
        block, or (TRANS) its transpose B^T A^T, PN x PM."""
        if TRANS:
            acc = tl.zeros((PN, PM), dtype=tl.float32)
        else:
            acc = tl.zeros((PM, PN), dtype=tl.float32)
        # not pipelined (module docstring)
        for k0 in tl.range(0, ksize, PK, num_stages=1):
            ok = k0 + tl.arange(0, PK)
            kok = ok < ksize
            x = tl.load(a + _offsets(om, ok, a_pitch, TRANS), mask=_both(rok, kok, TRANS),
                        other=0.0)
            y = tl.load(b + _offsets(ok, bn, b_pitch, TRANS), mask=_both(kok, nok, TRANS),
                        other=0.0)
            if TRANS:
                acc = tl.dot(y, x, acc)
            else:
                acc = tl.dot(x, y, acc)
        return acc

    @triton.jit
    def _corner(addr, r0, c0, pitch, DT: tl.constexpr, VEC: tl.constexpr):
        """(typed pointer to element (r0, c0) of the buffer at byte address ``addr`` whose rows
        are ``pitch`` elements, the pitch). VEC > 1: the caller checked that the address is a
        multiple of 16 bytes and pitch and c0 of VEC elements; rounded down to those multiples
        they keep their values and Triton sees the alignment (its analysis cannot see a loaded
        value's), so loads along the rows become 16-byte vectors."""
        base = addr.to(tl.pointer_type(DT))
        if VEC > 1:
            # the analysis stops at an integer's cast to a pointer: the hint is on the pointer,
            # made from the rounded address, so true of any value (a hint on the loaded value
            # would mark the op that loaded it, which the other shape's branch may share)
            base = tl.multiple_of((addr // 16 * 16).to(tl.pointer_type(DT)), 16)
            pitch = pitch // VEC * VEC
            c0 = c0 // VEC * VEC
        return base + r0.to(tl.int64) * pitch + c0, pitch

    @triton.jit
    def _blocks(regions, bufaddr, bufcols, a_slot, am0, ak0, ksize, b_slot, bk0, bn0,
                w0, nwrite, rows, cols, accumulate, glu, DT: tl.constexpr, BN: tl.constexpr,
                USE_TIMER: tl.constexpr, PM: tl.constexpr, PN: tl.constexpr, PK: tl.constexpr,
                TRANS: tl.constexpr, VA: tl.constexpr):
        """The task's output region in blocks of PM x PN (TRANS: computed transposed,
        :func:`_block_dot`), each stored into every write. VA > 1: A's rows are read in
        VA-element vectors (:func:`_corner`; the caller checked that they can be)."""
        a, a_pitch = _corner(tl.load(bufaddr + a_slot), am0, ak0,
                             tl.load(bufcols + a_slot).to(tl.int64), DT, VA)
        b, b_pitch = _corner(tl.load(bufaddr + b_slot), bk0, bn0,
                             tl.load(bufcols + b_slot).to(tl.int64), DT, 1)
        if VA > 1:  # the K mask constant over VA columns: K in whole vectors
            ksize = ksize // VA * VA
        for i0 in range(0, rows, PM):
            om = i0 + tl.arange(0, PM)
            rok = om < rows
            for j0 in range(0, cols, PN):
                on = j0 + tl.arange(0, PN)
                nok = on < cols
                if glu:
                    # output column c: packed column c // H * 2H + c % H (gate), + H (up)
                    HALF: tl.constexpr = BN // 2
                    bn = on // HALF * BN + on % HALF
                    gate = _block_dot(a, a_pitch, om, rok, b, b_pitch, bn, nok, ksize, PM, PN,
                                      PK, TRANS)
                    up = _block_dot(a, a_pitch, om, rok, b, b_pitch, bn + HALF, nok, ksize, PM,
                                    PN, PK, TRANS)
                    out = (gate * tl.sigmoid(gate) * up).to(DT)
                else:
                    out = _block_dot(a, a_pitch, om, rok, b, b_pitch, on, nok, ksize, PM, PN, PK,
                                     TRANS).to(DT)
                mask = _both(rok, nok, TRANS)
                for q in range(nwrite):  # write 0, then the epilogue's peer stores
                    c_slot, qm0, _qm1, qn0, _qn1 = load_region(regions, w0 + q)
                    c_pitch = tl.load(bufcols + c_slot).to(tl.int64)
                    c = (buffer_base(bufaddr, c_slot, DT) + qm0.to(tl.int64) * c_pitch + qn0
                         + _offsets(om, on, c_pitch, TRANS))
                    if accumulate != 0:
                        if USE_TIMER:
                            # relaxed: the task's signal after the body releases its writes;
                            # sys scope: the write may be a peer's memory
                            tl.atomic_add(c, out, mask=mask, sem="relaxed", scope="sys")
                        else:
                            tl.store(c, (tl.load(c, mask=mask, other=0.0).to(tl.float32)
                                         + out.to(tl.float32)).to(DT), mask=mask)
                    else:
                        tl.store(c, out, mask=mask)

    @triton.jit
    def _vectors(bufaddr, bufcols, slot, c0, width, VEC: tl.constexpr):
        """Whether a region of buffer ``slot`` from column ``c0``, ``width`` columns wide, can
        be read in whole VEC-element (16-byte) vectors: the buffer's address is a multiple of
        16 bytes, its pitch, c0 and the width of VEC elements (encode.gemm_a_vectors)."""
        return ((tl.load(bufaddr + slot) % 16 == 0) & (tl.load(bufcols + slot) % VEC == 0)
                & (c0 % VEC == 0) & (width % VEC == 0))

    @triton.jit(noinline=True)
    def gemm_pointers(tp, params, regions, bufaddr, bufcols, DT: tl.constexpr, BN: tl.constexpr,
                      USE_TIMER: tl.constexpr, GLU: tl.constexpr):
        """The task whose row is ``tp`` (a gemm or gemm_glu task), in the block shape for A's
        rows in vectors where they can be, else in 2-byte loads (module docstring)."""
        r0 = tl.load(tp + _READ0)
        a_slot, am0, _am1, ak0, ak1 = load_region(regions, r0)
        b_slot, bk0, _bk1, bn0, _bn1 = load_region(regions, r0 + 1)
        ksize = ak1 - ak0
        w0 = tl.load(tp + _WRITE0)
        nwrite = tl.load(tp + _NWRITE)
        _c, cm0, cm1, cn0, cn1 = load_region(regions, w0)
        rows = cm1 - cm0
        cols = cn1 - cn0
        accumulate = _accumulates(tp, params, GLU)
        glu = False
        if GLU:
            glu = tl.load(tp + _KIND) != _GEMM_KIND
        VEC: tl.constexpr = 128 // DT.primitive_bitwidth
        # gemm_glu tasks never take the vector shape: their B (the packed weight, N a multiple
        # of 128) has whole rows, so they come here for A's, and its copy of the gated unit
        # would be dead code
        if _vectors(bufaddr, bufcols, a_slot, ak0, ksize, VEC) & (glu == 0):
            _blocks(regions, bufaddr, bufcols, a_slot, am0, ak0, ksize, b_slot, bk0, bn0,
                    w0, nwrite, rows, cols, accumulate, False, DT, BN, USE_TIMER,
                    _TM, _TN, _TK, True, VEC)
        else:
            _blocks(regions, bufaddr, bufcols, a_slot, am0, ak0, ksize, b_slot, bk0, bn0,
                    w0, nwrite, rows, cols, accumulate, glu, DT, BN, USE_TIMER,
                    _PM, _PN, _PK, False, 1)
