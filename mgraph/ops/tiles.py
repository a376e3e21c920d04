"""Tile bodies of the generic kinds every collective uses: gemm, reduce, copy.

CPU bodies are the meaning of each kind (the reference runtimes execute them); they accumulate in
fp32 and cast once on the store, as the GPU tile bodies (the Triton functions at the end, run by
the megakernel) do.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch

from ..graph import Task
from ..kinds import KINDS, TaskKind, kind_spec
from .abi import F_KIND, F_NREAD, F_NWRITE, F_READ0, F_WRITE0, HAVE_TRITON

if HAVE_TRITON:
    from .abi import buffer_base, load_region, param_i32
    from .gemm_pointers import gemm_pointers, gemm_tma_rows
    from .tilewise import block_ptrs, copy_into, copy_vec, row_operand, vec_cols, vec_ptr, vec_width

def matmul_reference(a: torch.Tensor, b: torch.Tensor, **_: object) -> dict[str, torch.Tensor]:
    """The meaning of every GEMM-based fused op on GLOBAL tensors: out = a @ b, fp32 accumulate."""
    return {"out": (a.float() @ b.float()).to(a.dtype)}


GEMM = kind_spec(TaskKind.GEMM)
REDUCE = kind_spec(TaskKind.REDUCE)
COPY = kind_spec(TaskKind.COPY)


# Accumulating tasks from several CPU worker threads add into one region: one lock makes each
# add atomic, as the GPU's TMA reduce-add is per element.
_ADD_LOCK = threading.Lock()


@GEMM.cpu
def _gemm_cpu(task: Task, reads: Sequence[torch.Tensor], writes: Sequence[torch.Tensor]) -> None:
    a, b = reads
    c = a.float() @ b.float()
    if task.params.get("accumulate"):
        # Round the tile to the buffer's dtype first, then add in that dtype, as the GPU's
        # reduce-add does: from zero, a + b == b + a bit for bit, so replicas agree.
        for w in writes:
            part = c.to(w.dtype)
            with _ADD_LOCK:
                w.add_(part)
        return
    for w in writes:  # writes past the first: the epilogue's stores into peers' buffers
        w.copy_(c)


@GEMM.flops
def _gemm_flops(reads: Sequence[tuple[int, int]], writes: Sequence[tuple[int, int]], params: dict):
    (m, k), (_, n) = reads[0], reads[1]
    return 2.0 * m * n * k


@REDUCE.cpu
def _reduce_cpu(task: Task, reads: Sequence[torch.Tensor], writes: Sequence[torch.Tensor]) -> None:
    acc = reads[0].float().clone()
    for r in reads[1:]:
        acc += r.float()
    for w in writes:  # writes past the first: the sum also stored into peers' buffers
        w.copy_(acc)


@REDUCE.flops
def _reduce_flops(reads: Sequence[tuple[int, int]], writes: Sequence[tuple[int, int]], params: dict):
    m, n = writes[0]
    return float(m * n * (len(reads) - 1))


@COPY.cpu
def _copy_cpu(task: Task, reads: Sequence[torch.Tensor], writes: Sequence[torch.Tensor]) -> None:
    for w in writes:
        w.copy_(reads[0])


@COPY.flops
def _copy_flops(reads: Sequence[tuple[int, int]], writes: Sequence[tuple[int, int]], params: dict):
    return 0.0


# -- megakernel tile bodies ----------------------------------------------------------------------
# Each body reads its task's row ``tp`` of the task table and the region and buffer tables;
# constexpr dtype and block sizes come from the kernel. These bodies run the tasks a worker takes
# one at a time (after waits); they store with plain stores, so the release right after the task
# publishes them. The kernel's static GEMM prefix (kernel.py) stores through TMA instead and
# publishes once per program, after completing its bulk stores.
if HAVE_TRITON:
    import triton
    import triton.language as tl

    # jit code may only read globals that are constexpr objects
    _READ0, _NREAD = tl.constexpr(F_READ0), tl.constexpr(F_NREAD)
    _WRITE0, _NWRITE = tl.constexpr(F_WRITE0), tl.constexpr(F_NWRITE)
    # the task row's kind field holds the kind's registry position (encode.kind_id)
    _KIND, _GEMM_KIND = tl.constexpr(F_KIND), tl.constexpr(list(KINDS).index(GEMM.name))

    @GEMM.triton
    @triton.jit
    def gemm_tile(tp, params, regions, bufaddr, bufrows, bufcols, ad0, bd0, a0_slot, b0_slot,
                  DT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                  USE_TIMER: tl.constexpr, GLU: tl.constexpr, GEMM_PTR: tl.constexpr = False):
        """C = A @ B over the task's K range. ``ad0``/``bd0`` are descriptors the kernel built once
        for the rank's usual A and B buffers: building one costs a global-memory write and a
        fence, so a task only builds its own when it reads another buffer.

        Also the body of gemm_glu tasks (mgraph/ops/matmul_glu.py registers it for its kind, and
        the dispatch gives kinds of one body one branch): their B is the packed [gate | up]
        weight, so their block is this one, and only the epilogue differs (``glu_unit``). One
        body keeps ONE copy of the pipelined K loop in the kernel: a second one (gemm_glu's own
        body, the same loop inlined at its own call) ran ptxas out of registers and serialised
        every wgmma of the kernel (C7512), slowing every GEMM and attention loop by ~25%.
        ``GLU`` (the kernel runs gemm_glu tasks) compiles that epilogue only where it runs.

        A task whose operands' rows TMA cannot address (not whole 16-byte units: a 4-expert
        router, an odd vocabulary) runs by masked pointers instead (gemm_pointers.py), a path
        ``GEMM_PTR`` (the kernel runs such tasks) compiles in only where it runs."""
        r0 = tl.load(tp + _READ0)
        a_slot, am0, am1, ak0, ak1 = load_region(regions, r0)
        b_slot, bk0, bk1, bn0, bn1 = load_region(regions, r0 + 1)
        tma = True
        if GEMM_PTR:
            tma = gemm_tma_rows(tp, params, regions, bufcols, DT, GLU)
        if not tma:
            gemm_pointers(tp, params, regions, bufaddr, bufcols, DT, BN, USE_TIMER, GLU)
        else:
            if a_slot == a0_slot:
                ad = ad0
            else:
                a_cols = tl.load(bufcols + a_slot)
                ad = tl.make_tensor_descriptor(buffer_base(bufaddr, a_slot, DT),
                                               [tl.load(bufrows + a_slot), a_cols], [a_cols, 1], [BM, BK])
            if b_slot == b0_slot:
                bd = bd0
            else:
                b_cols = tl.load(bufcols + b_slot)
                bd = tl.make_tensor_descriptor(buffer_base(bufaddr, b_slot, DT),
                                               [tl.load(bufrows + b_slot), b_cols], [b_cols, 1], [BK, BN])
            ksize = ak1 - ak0
            w0 = tl.load(tp + _WRITE0)
            nwrite = tl.load(tp + _NWRITE)
            glu = False
            if GLU:  # any kind here but gemm is gemm_glu
                glu = tl.load(tp + _KIND) != _GEMM_KIND
            accumulate = 0
            if not glu:  # gemm_glu declares no params: its row has none to read
                accumulate = param_i32(params, tp, 0)
            # A task may cover several blocks (a region wider or taller than BM x BN: fewer, larger
            # tasks pay the per-task costs, ticket, waits and signals, once for all of them). Each
            # block is one pass of the pipelined K loop and its own epilogue.
            nbn = tl.cdiv(bn1 - bn0, BN)
            for blk in range(0, tl.cdiv(am1 - am0, BM) * nbn):
                sm = (blk // nbn) * BM  # the block's offset inside the task's region
                sn = (blk % nbn) * BN
                acc = gemm_block_acc(ad, bd, am0 + sm, ak0, bk0, bn0 + sn, ksize, DT, BM, BN, BK)
                # Rows past the region's end and columns past its last column were computed from
                # whatever the loads returned (other tiles' rows, or TMA's zeros past the buffer):
                # the store masks them off, so a short edge block writes exactly its region.
                if glu:  # BN packed columns are BN/2 outputs: the block's at sn/2 in the region
                    unit = glu_unit(acc, DT, BM, BN)
                    for q in range(nwrite):
                        _, um0, um1, un0, un1 = load_region(regions, w0 + q)
                        store_block(regions, bufaddr, bufcols, w0 + q, sm, sn // 2, um1 - um0,
                                    un1 - un0, unit, DT, BM, BN // 2)
                else:
                    out = acc.to(DT)
                    for q in range(nwrite):  # write 0, then the epilogue's peer stores
                        c_slot, cm0, cm1, cn0, cn1 = load_region(regions, w0 + q)
                        if accumulate != 0:
                            # Reduce-add into a zeroed output (this GPU's or a peer's), as the GEMM
                            # prefix does: a TMA reduce, exact because the runtime admits only
                            # tasks whose blocks are whole or end their buffers (encode.tma_exact).
                            # The interpreter runs one program at a time: a load, add and store is
                            # the same.
                            c_cols = tl.load(bufcols + c_slot)
                            cd = tl.make_tensor_descriptor(buffer_base(bufaddr, c_slot, DT),
                                                           [tl.load(bufrows + c_slot), c_cols],
                                                           [c_cols, 1], [BM, BN])
                            if USE_TIMER:
                                cd.atomic_add([cm0 + sm, cn0 + sn], out)
                            else:
                                cd.store([cm0 + sm, cn0 + sn],
                                         (cd.load([cm0 + sm, cn0 + sn]).to(tl.float32)
                                          + out.to(tl.float32)).to(DT))
                        else:
                            store_block(regions, bufaddr, bufcols, w0 + q, sm, sn, cm1 - cm0,
                                        cn1 - cn0, out, DT, BM, BN)

    @triton.jit
    def glu_unit(acc, DT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
        """silu(gate) * up of a gemm_glu block's fp32 accumulator, in DT: its columns [0, BN/2)
        are the gate's products, [BN/2, BN) the up's (matmul_glu.pack_glu's blocks). The split
        keeps each thread's registers (no layout conversion in the sm_90 code)."""
        gate, up = tl.split(tl.permute(tl.reshape(acc, (BM, 2, BN // 2)), (0, 2, 1)))
        return (gate * tl.sigmoid(gate) * up).to(DT)

    @triton.jit
    def gemm_block_acc(ad, bd, am, ak0, bk0, bn, ksize, DT: tl.constexpr, BM: tl.constexpr,
                       BN: tl.constexpr, BK: tl.constexpr):
        """A[am:am+BM, ak0:ak0+ksize] @ B[bk0:bk0+ksize, bn:bn+BN] in fp32, through the TMA
        descriptors ``ad`` and ``bd``: the pipelined loop of whole K steps, then the short last
        one. TMA zero-fills only past a buffer's end; the region may end inside it (or the
        buffer hold NaN there), so that step masks both operands to K. (gemm_tile's block, of
        gemm tasks and of gemm_glu's over their packed weight.)"""
        kfull = ksize - ksize % BK
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for kk in range(0, kfull, BK):  # whole K steps: no mask in the loop
            acc = tl.dot(ad.load([am, ak0 + kk]), bd.load([bk0 + kk, bn]), acc)
        if kfull < ksize:
            kin = tl.arange(0, BK) < ksize - kfull
            x = tl.where(kin[None, :], ad.load([am, ak0 + kfull]), 0.0)
            y = tl.where(kin[:, None], bd.load([bk0 + kfull, bn]), 0.0)
            acc = tl.dot(x.to(DT), y.to(DT), acc)
        return acc

    @triton.jit
    def store_block(regions, bufaddr, bufcols, index, sm, sn, rows, cols, out, DT: tl.constexpr,
                    BM: tl.constexpr, BN: tl.constexpr):
        """``out`` (BM x BN) into region ``index`` at block offset (sm, sn), masked to the
        region's ``rows`` x ``cols``: a short edge block writes exactly its region. 16-byte
        stores where the region allows (2-byte ones otherwise: the table's address and pitch
        carry no alignment Triton can see); sm * pitch and sn (a multiple of BN) keep the
        corner 16-byte aligned."""
        ca, cpitch, cvec = row_operand(regions, bufaddr, bufcols, index, DT)
        ca = ca + (sm.to(tl.int64) * cpitch + sn) * (DT.primitive_bitwidth // 8)
        om = tl.arange(0, BM)
        on = tl.arange(0, BN)
        if cvec:
            tl.store(block_ptrs(ca, cpitch, om, on, DT, True), out,
                     mask=(om < rows - sm)[:, None]
                     & (on < vec_width(cols - sn, DT, True))[None, :])
        else:
            tl.store(block_ptrs(ca, cpitch, om, on, DT, False), out,
                     mask=(om < rows - sm)[:, None] & (on < cols - sn)[None, :])

    @REDUCE.triton
    @triton.jit
    def reduce_tile(tp, regions, bufaddr, bufcols, DT: tl.constexpr, RB_M: tl.constexpr,
                    RB_N: tl.constexpr):
        """write 0 (and the peers' copies after it) = the sum of the reads, in fp32. When every
        region takes 16-byte vectors (tilewise.row_operand), _reduce_vec; otherwise element by
        element through int64 pointers (2-byte loads and stores on sm_90)."""
        r0 = tl.load(tp + _READ0)
        nread = tl.load(tp + _NREAD)
        w0 = tl.load(tp + _WRITE0)
        nwrite = tl.load(tp + _NWRITE)
        _w, wm0, wm1, wn0, wn1 = load_region(regions, w0)
        fast = wm1 > wm0  # a tensor, as the loop's ANDs make it (a non-empty region: true)
        for q in range(nread):
            _a, _p, v = row_operand(regions, bufaddr, bufcols, r0 + q, DT)
            fast = fast & v
        for q in range(nwrite):
            _a, _p, v = row_operand(regions, bufaddr, bufcols, w0 + q, DT)
            fast = fast & v
        if fast:
            _reduce_vec(regions, bufaddr, bufcols, r0, nread, w0, nwrite, wm1 - wm0, wn1 - wn0,
                        DT, RB_M, RB_N)
        else:
            _reduce_general(regions, bufaddr, bufcols, r0, nread, w0, nwrite, wm1 - wm0,
                            wn1 - wn0, DT, RB_M // 4, RB_N // 2)

    @triton.jit
    def _reduce_vec(regions, bufaddr, bufcols, r0, nread, w0, nwrite, m, n, DT: tl.constexpr,
                    BLK_M: tl.constexpr, BLK_N: tl.constexpr):
        """The sum stored into write 0, then copied from there into the others (the peers'
        copies): the destination pointer made once, before the loops. Made per destination
        inside them, Triton 3.6 lost its alignment and stored the sum 2 bytes at a time."""
        VEC: tl.constexpr = 128 // DT.primitive_bitwidth
        n = n // VEC * VEC  # as it is here: provably whole vectors, so masks hold per vector
        da, dp, _v = row_operand(regions, bufaddr, bufcols, w0, DT)
        dst = vec_ptr(da, DT)
        dpitch = dp // VEC * VEC
        for i in range(0, m, BLK_M):
            om = i + tl.arange(0, BLK_M)
            for j in range(0, n, BLK_N):
                on = vec_cols(j, BLK_N, VEC)
                mask = (om < m)[:, None] & (on < n)[None, :]
                acc = tl.zeros((BLK_M, BLK_N), dtype=tl.float32)
                for q in range(nread):
                    sa, sp, _v = row_operand(regions, bufaddr, bufcols, r0 + q, DT)
                    src = vec_ptr(sa, DT) + (om * (sp // VEC * VEC))[:, None] + on[None, :]
                    acc += tl.load(src, mask=mask).to(tl.float32)
                tl.store(dst + (om * dpitch)[:, None] + on[None, :], acc.to(DT), mask=mask)
        if nwrite > 1:
            tl.debug_barrier()  # every thread's stores into write 0 before any thread reads them
            for q in range(1, nwrite):
                qa, qp, _v = row_operand(regions, bufaddr, bufcols, w0 + q, DT)
                copy_vec(da, dp, qa, qp, m, n, DT, BLK_M, BLK_N)

    @triton.jit
    def _reduce_general(regions, bufaddr, bufcols, r0, nread, w0, nwrite, m, n,
                        DT: tl.constexpr, RB_M: tl.constexpr, RB_N: tl.constexpr):
        for i in range(0, m, RB_M):
            for j in range(0, n, RB_N):
                om = i + tl.arange(0, RB_M)
                on = j + tl.arange(0, RB_N)
                mask = (om < m)[:, None] & (on < n)[None, :]
                acc = tl.zeros((RB_M, RB_N), dtype=tl.float32)
                for q in range(nread):
                    s, sm0, sm1, sn0, sn1 = load_region(regions, r0 + q)
                    src = buffer_base(bufaddr, s, DT)
                    s_cols = tl.load(bufcols + s).to(tl.int64)
                    ptrs = src + (sm0 + om)[:, None].to(tl.int64) * s_cols + (sn0 + on)[None, :]
                    acc += tl.load(ptrs, mask=mask).to(tl.float32)
                out = acc.to(DT)
                for q in range(nwrite):
                    d, dm0, dm1, dn0, dn1 = load_region(regions, w0 + q)
                    dst = buffer_base(bufaddr, d, DT)
                    d_cols = tl.load(bufcols + d).to(tl.int64)
                    tl.store(dst + (dm0 + om)[:, None].to(tl.int64) * d_cols + (dn0 + on)[None, :],
                             out, mask=mask)

    @COPY.triton
    @triton.jit
    def copy_tile(tp, regions, bufaddr, bufcols, bufdt, DT: tl.constexpr, RB_M: tl.constexpr,
                  RB_N: tl.constexpr):
        # float32 slots (partials, MoE counts) are copied as float32; the runtime checks that a
        # copy's source and destinations share one dtype
        if tl.load(bufdt + tl.load(regions + tl.load(tp + _READ0) * 5)) == 1:
            _copy_regions(tp, regions, bufaddr, bufcols, tl.float32, RB_M, RB_N)
        else:
            _copy_regions(tp, regions, bufaddr, bufcols, DT, RB_M, RB_N)

    @triton.jit
    def _copy_regions(tp, regions, bufaddr, bufcols, DT: tl.constexpr, RB_M: tl.constexpr,
                      RB_N: tl.constexpr):
        """The read region into each write region. Where both take 16-byte vectors (whole
        rows of a shard, a chunk of a tile row: every NVLink copy of the lowerings), copy_vec:
        the general path's int64 per-element pointers compile to 2-byte loads and stores,
        which held an NVLink worker to 7-9 GB/s (calibrate.py). The source is re-read per
        destination: local HBM, cheap beside the NVLink store, and most copies have one."""
        r0 = tl.load(tp + _READ0)
        _s, sm0, sm1, sn0, sn1 = load_region(regions, r0)
        w0 = tl.load(tp + _WRITE0)
        nwrite = tl.load(tp + _NWRITE)
        sa, spitch, svec = row_operand(regions, bufaddr, bufcols, r0, DT)
        for q in range(nwrite):
            da, dpitch, dvec = row_operand(regions, bufaddr, bufcols, w0 + q, DT)
            if svec & dvec:
                copy_vec(sa, spitch, da, dpitch, sm1 - sm0, sn1 - sn0, DT, RB_M, RB_N)
            else:
                # blocks a quarter as tall and half as wide (as concat's general path)
                copy_into(regions, bufaddr, bufcols, r0, w0 + q, 0, DT, RB_M // 4, RB_N // 2)
