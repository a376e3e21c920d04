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

Measured (one H200, Triton 3.6, benchmarks/bench_gemm_rows.py; results in
benchmarks/results/v19/gemm_rows): correct, and slow. Per task, against the TMA path on the
shape rounded up to 16-byte rows: a 128-row router task of 4 experts (K 4096) 370 us against 39
at 8 experts; GPT-2's lm_head (K 768) 168 us a 128 x 256 task against 17.7 at 50264 columns (a
2048-token call 4.13 ms against 0.56, cuBLAS 1.73 at 50257 columns); K 4095: 794 us a 128 x 256
task against 48. A K step of 128 (_PK) took 18-31% off the first form's 32. The TMA GEMMs of a
kernel that compiles this path keep their speed (49.9 against 50.8 us a 128 x 256 task). Every
load and store is 2 bytes here (Triton cannot prove a row aligned): 16-byte loads of the
operand whose rows are whole units (A of a router or an lm_head, B where only K is odd) are the
next step.
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
    # Output rows and columns per block, K per step: 32 rows keep the dots mma.sync (module
    # docstring); 128 columns per A block read; 128-deep K steps (32 made every task 1.2-1.5x
    # slower: the loop waits on its loads each step)
    _PM, _PN, _PK = tl.constexpr(32), tl.constexpr(128), tl.constexpr(128)

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
    def _block_dot(a, a_pitch, om, rok, b, b_pitch, bn, nok, ksize):
        """fp32 A[om, :ksize] @ B[:ksize, bn] by masked pointer loads (``a``, ``b``: the
        regions' corners; rows past ``rok`` and columns past ``nok`` read zeros)."""
        acc = tl.zeros((_PM, _PN), dtype=tl.float32)
        arow = om.to(tl.int64)[:, None] * a_pitch
        for k0 in range(0, ksize, _PK):
            ok = k0 + tl.arange(0, _PK)
            kok = ok < ksize
            x = tl.load(a + arow + ok[None, :], mask=rok[:, None] & kok[None, :], other=0.0)
            y = tl.load(b + ok.to(tl.int64)[:, None] * b_pitch + bn[None, :],
                        mask=kok[:, None] & nok[None, :], other=0.0)
            acc = tl.dot(x, y, acc)
        return acc

    @triton.jit(noinline=True)
    def gemm_pointers(tp, params, regions, bufaddr, bufcols, DT: tl.constexpr, BN: tl.constexpr,
                      USE_TIMER: tl.constexpr, GLU: tl.constexpr):
        """The task whose row is ``tp`` (a gemm or gemm_glu task): its output region in blocks
        of _PM x _PN, each stored into every write (module docstring)."""
        r0 = tl.load(tp + _READ0)
        a_slot, am0, am1, ak0, ak1 = load_region(regions, r0)
        b_slot, bk0, _bk1, bn0, _bn1 = load_region(regions, r0 + 1)
        a_pitch = tl.load(bufcols + a_slot).to(tl.int64)
        b_pitch = tl.load(bufcols + b_slot).to(tl.int64)
        a = buffer_base(bufaddr, a_slot, DT) + am0.to(tl.int64) * a_pitch + ak0
        b = buffer_base(bufaddr, b_slot, DT) + bk0.to(tl.int64) * b_pitch + bn0
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
        for i0 in range(0, rows, _PM):
            om = i0 + tl.arange(0, _PM)
            rok = om < rows
            for j0 in range(0, cols, _PN):
                on = j0 + tl.arange(0, _PN)
                nok = on < cols
                if glu:
                    # output column c: packed column c // H * 2H + c % H (gate), + H (up)
                    HALF: tl.constexpr = BN // 2
                    bn = on // HALF * BN + on % HALF
                    gate = _block_dot(a, a_pitch, om, rok, b, b_pitch, bn, nok, ksize)
                    up = _block_dot(a, a_pitch, om, rok, b, b_pitch, bn + HALF, nok, ksize)
                    out = (gate * tl.sigmoid(gate) * up).to(DT)
                else:
                    out = _block_dot(a, a_pitch, om, rok, b, b_pitch, on, nok, ksize).to(DT)
                mask = rok[:, None] & nok[None, :]
                for q in range(nwrite):  # write 0, then the epilogue's peer stores
                    c_slot, qm0, _qm1, qn0, _qn1 = load_region(regions, w0 + q)
                    c_pitch = tl.load(bufcols + c_slot).to(tl.int64)
                    c = (buffer_base(bufaddr, c_slot, DT) + qm0.to(tl.int64) * c_pitch + qn0
                         + om.to(tl.int64)[:, None] * c_pitch + on[None, :])
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
