"""The persistent megakernel: one launch per rank runs that rank's whole schedule.

Grid = the rank's worker programs (<= SMs, all resident: they spin on each other). Program p has
role ``roles[p]``. This module is the template of the kernel: runtime.py launches a generated
copy (dispatch.megakernel_for).

The data path (v2): communication rides the compute tiles. The compute queue starts with its
wait-free GEMM tasks (the "static prefix", cut into segments by encode.py): position j of it runs
on compute program j mod P in one software-pipelined persistent loop per segment, exactly like a
plain persistent TMA GEMM (no atomics, waits or fences inside: STYLE rule 15), and each tile's
epilogue stores it through TMA into its task's writes 0 and 1, which may be a node peer's
receive buffer (the epilogue push). The signals of all these tasks go out once per program,
after its last tile (one bulk-store fence, one barrier, a release per signal), so a consumer
polls flags that are raised per program, not per tile.

Then each program takes the next task of its role's queue with an atomic fetch-add on the
queue head, waits for the task's events, runs the kind's tile body, then signals. The dispatch
is not written here: dispatch.py generates it from the kinds that have a Triton body (one branch
per kind the schedule runs, each body called with the kernel values its parameter names name)
into a copy of this module; the rdma push (``push_commands``) is dispatched the same way. Every
argument is passed by name (runtime.py), tables have named fields (mgraph/ops/abi.py) and a task
carries its kind's declared params in a row of ``params``. Heads are never reset:
launch ``epoch`` sees each head start at ``(epoch - 1) * (dynamic length + workers)`` (every
worker takes one ticket past the end), and event targets are ``(epoch - 1) * signals per launch +
count``. Program 0 finally waits for the rank's "exit events": events only peers raise and no
local task waits for (peers' stores into this rank's outputs), so a finished launch is complete.

Before any task, an entry barrier across the node's ranks: program 0 raises every peer's start
flag and waits for all peers' raises of this epoch; the others wait for program 0's go. A peer
that has started launch k has finished launch k-1 (one stream), so nobody overwrites a buffer a
peer is still reading from the previous launch.

A wait that times out (or sees the abort flag) records (rank, program, task, event slot, value,
target) in ``err`` (first error wins), raises the abort flag, and the program stops taking tasks.

Multi-node graphs (HAS_NET, netplan.py): an rdma task's worker pushes the task's FIFO commands
into pinned host memory (hostfifo.py) for the rank's proxy; events the proxies raise are summed
from net words; program 0 also pushes a start SIGNAL to every remote peer and waits for theirs
before the go, and after its queue waits until every net word of the rank reached its count for
this launch (all sends done, all arrivals landed). Error records use task -1 for the node
barrier, -3 for a remote start (slot: index), -2 for the exit wait (slot: index), -4 for an
exit event (slot: event slot), -5 for a segment's hoisted wait (slot: event slot), and slot -2 for a push that found the FIFO full (value: ticket,
target: tail seen).
"""

from __future__ import annotations

import triton
import triton.language as tl

from mgraph.ops.abi import (
    F_CMD0,
    F_GID,
    F_KIND,
    F_NCMD,
    F_NSIG,
    F_NWAIT,
    F_READ0,
    F_SIG0,
    F_WAIT0,
    F_WRITE0,
    G_SLOT,
    G_SYS,
    P_AM,
    P_BK,
    P_BN,
    P_TASK,
    P_W0M,
    P_W0N,
    P_W1M,
    P_W1N,
    POS_FIELDS,
    Q_LEN,
    Q_OFF,
    Q_STATIC,
    Q_WORKERS,
    QINFO_FIELDS,
    REGION_FIELDS,
    S_A,
    S_B,
    S_K0,
    S_K1,
    S_LEN,
    S_NWAIT,
    S_START,
    S_W0,
    S_W1,
    S_WAIT0,
    SEG_FIELDS,
    SIGNAL_FIELDS,
    TASK_FIELDS,
    W_COUNT,
    W_SLOT,
    W_SYS,
    W_TOTAL,
    WAIT_FIELDS,
    buffer_base,
)

from .control import C_TARGET, account, maybe_decide, reset_at_exit
from .hostfifo import CMD_WORDS, push
from .sync import (
    bulk_store_fence,
    fence_proxy_async,
    load_uniform,
    now,
    now_uniform,
    signal,
    wait,
    wait_sum,
)

__all__ = ["megakernel", "ERR_FIELDS"]

ERR_FIELDS = 8  # flag, rank, program, task, event slot, value, target, epoch

# jit code may only read globals that are constexpr objects
_GID, _KIND, _NSIG, _NWAIT = tl.constexpr(F_GID), tl.constexpr(F_KIND), tl.constexpr(F_NSIG), tl.constexpr(F_NWAIT)
_SIG0, _WAIT0, _FIELDS = tl.constexpr(F_SIG0), tl.constexpr(F_WAIT0), tl.constexpr(TASK_FIELDS)
_CMD0, _NCMD = tl.constexpr(F_CMD0), tl.constexpr(F_NCMD)
_WF, _WSLOT, _WCOUNT = tl.constexpr(WAIT_FIELDS), tl.constexpr(W_SLOT), tl.constexpr(W_COUNT)
_WTOTAL, _WSYS = tl.constexpr(W_TOTAL), tl.constexpr(W_SYS)
_GF, _GSLOT, _GSYS = tl.constexpr(SIGNAL_FIELDS), tl.constexpr(G_SLOT), tl.constexpr(G_SYS)
_READ0, _WRITE0, _RF = tl.constexpr(F_READ0), tl.constexpr(F_WRITE0), tl.constexpr(REGION_FIELDS)
_QF, _QOFF, _QLEN = tl.constexpr(QINFO_FIELDS), tl.constexpr(Q_OFF), tl.constexpr(Q_LEN)
_CTARGET = tl.constexpr(C_TARGET)
_QWORKERS, _QSTATIC = tl.constexpr(Q_WORKERS), tl.constexpr(Q_STATIC)
_SF, _SSTART, _SLEN = tl.constexpr(SEG_FIELDS), tl.constexpr(S_START), tl.constexpr(S_LEN)
_SA, _SB, _SK0, _SK1 = tl.constexpr(S_A), tl.constexpr(S_B), tl.constexpr(S_K0), tl.constexpr(S_K1)
_SW0, _SW1 = tl.constexpr(S_W0), tl.constexpr(S_W1)
_SWAIT0, _SNWAIT = tl.constexpr(S_WAIT0), tl.constexpr(S_NWAIT)
_PF, _PAM, _PBK, _PBN = tl.constexpr(POS_FIELDS), tl.constexpr(P_AM), tl.constexpr(P_BK), tl.constexpr(P_BN)
_PW0M, _PW0N, _PW1M = tl.constexpr(P_W0M), tl.constexpr(P_W0N), tl.constexpr(P_W1M)
_PW1N, _PTASK = tl.constexpr(P_W1N), tl.constexpr(P_TASK)



@triton.jit
def _entry_barrier(pid, start_flags, peer_flags, npeers, go, epoch, limit, abort, err, rank,
                   ring, dhead, tail, capacity, cmds, start_cmds, startaddr,
                   USE_TIMER: tl.constexpr, HAS_NET: tl.constexpr):
    if pid == 0:
        for p in range(npeers):
            peer = tl.load(peer_flags + p).to(tl.pointer_type(tl.int32))
            tl.atomic_add(peer, 1, sem="release", scope="sys")
        if HAS_NET:  # remote peers hear of our start through our proxy
            for c in range(start_cmds):
                ticket, seen = push(ring, dhead, tail, capacity, cmds + c * CMD_WORDS, epoch,
                                    limit, abort, USE_TIMER)
                if ticket - seen >= capacity:
                    _record(err, abort, rank, pid, -3, -2, ticket, seen, epoch)
        target = epoch * npeers
        v = wait(start_flags, target, limit, abort, USE_TIMER)
        if v < target:
            _record(err, abort, rank, pid, -1, -1, v, target, epoch)
        if HAS_NET:
            for s in range(start_cmds):
                flag = tl.load(startaddr + s).to(tl.pointer_type(tl.int32))
                v = wait(flag, epoch, limit, abort, USE_TIMER, True)
                if v < epoch:
                    _record(err, abort, rank, pid, -3, s, v, epoch, epoch)
        tl.atomic_xchg(go, epoch, sem="release", scope="gpu")
    v = wait(go, epoch, limit, abort, USE_TIMER)


@triton.jit
def _exit_wait(pid, exitaddr, exitcount, nexit, epoch, limit, abort, err, rank,
               USE_TIMER: tl.constexpr):
    if pid == 0:  # net words: every send of this launch completed, every arrival landed
        for x in range(nexit):
            flag = tl.load(exitaddr + x).to(tl.pointer_type(tl.int32))
            target = epoch * tl.load(exitcount + x)
            v = wait(flag, target, limit, abort, USE_TIMER, True)
            if v < target:
                _record(err, abort, rank, pid, -2, x, v, target, epoch)


@triton.jit
def _record(err, abort, rank, pid, task, slot, value, target, epoch):
    # The abort flag doubles as the "first error" claim: the winner writes the record.
    if tl.atomic_cas(abort, 0, 1) == 0:
        tl.store(err, 1)
        tl.store(err + 1, rank)
        tl.store(err + 2, pid)
        tl.store(err + 3, task)
        tl.store(err + 4, slot)
        tl.store(err + 5, value)
        tl.store(err + 6, target)
        tl.store(err + 7, epoch)


@triton.jit
def _segment_waits(pid, segwaits, w0, nwait, evaddr, epoch, limit, abort, err, rank,
                   USE_TIMER: tl.constexpr):
    """A segment's hoisted waits, once per program before its loop (their signallers wait for
    nothing, encode._Prefix), then the proxy fence: peers wrote the data with plain stores and
    the segment reads it through TMA."""
    for q in range(nwait):
        wp = segwaits + (w0 + q) * _WF
        slot = tl.load(wp + _WSLOT)
        target = (epoch - 1) * tl.load(wp + _WTOTAL) + tl.load(wp + _WCOUNT)
        flag = tl.load(evaddr + slot).to(tl.pointer_type(tl.int32))
        if tl.load(wp + _WSYS) != 0:
            v = wait(flag, target, limit, abort, USE_TIMER, True)
        else:
            v = wait(flag, target, limit, abort, USE_TIMER, False)
        if v < target:
            _record(err, abort, rank, pid, -5, slot, v, target, epoch)
    fence_proxy_async(USE_TIMER)


@triton.jit
def push_commands(tp, cmds, ring, dhead, tail, capacity, epoch, limit, abort, err, rank, pid,
                  USE_TIMER: tl.constexpr):
    """The body of an rdma task (kind id encode.PUSH_ID, dispatched like any other kind): push
    its precomputed FIFO commands into pinned host memory for the rank's proxy."""
    c0 = tl.load(tp + _CMD0)
    for c in range(tl.load(tp + _NCMD)):
        ticket, seen = push(ring, dhead, tail, capacity, cmds + (c0 + c) * CMD_WORDS, epoch,
                            limit, abort, USE_TIMER)
        if ticket - seen >= capacity:
            _record(err, abort, rank, pid, tl.load(tp + _GID), -2, ticket, seen, epoch)


@triton.jit
def _tma_pitch(cols, DT: tl.constexpr, ROUND: tl.constexpr):
    """``cols`` as a descriptor's row pitch: rounded up to whole 16-byte units when ROUND."""
    if ROUND:
        per16: tl.constexpr = 128 // DT.primitive_bitwidth
        return tl.cdiv(cols, per16) * per16
    else:
        return cols


@triton.jit
def _tile_add(desc, m, n, c, DT: tl.constexpr, USE_TIMER: tl.constexpr):
    """TMA reduce-add of tile ``c`` at (m, n): each element added atomically where it lives
    (this GPU's memory or a peer's). The interpreter has no descriptor reduce; it runs one
    program at a time, so a load, add and store is the same there."""
    if USE_TIMER:
        desc.atomic_add([m, n], c)
    else:
        desc.store([m, n], (desc.load([m, n]).to(tl.float32) + c.to(tl.float32)).to(DT))


@triton.jit
def _gemm_segments(pid, segs, nseg, segpos, segwaits, regions, bufaddr, bufrows, bufcols,
                   evaddr, epoch, limit, abort, err, rank, trace, seg_p,
                   SEG_K: tl.constexpr, DT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                   BK: tl.constexpr, SEG_NW: tl.constexpr, SEG_ADD: tl.constexpr,
                   SEG_WAITS: tl.constexpr, FLATTEN: tl.constexpr, USE_TIMER: tl.constexpr,
                   TRACE: tl.constexpr):
    """The static GEMM prefix of this program's queue: position j of it runs on program
    j mod seg_p (the compute programs), in one software-pipelined persistent loop per segment
    (no atomics, no waits, no fences: STYLE rule 15). SEG_K, when not 0, is every segment's K
    range, compile-time as in a plain persistent GEMM; seg_p is a runtime value, so a sweep
    over the NVLink workers reuses one compiled kernel (the loop's step is a register: the
    SASS of the loop is unchanged, runtime.py's module docstring has the counts). Each position's coordinates are one row of ``segpos``, so the
    loop reads one 32-byte row per tile, not a chain of table lookups. Each tile's epilogue
    stores it through TMA into write 0 (and write 1: a node peer's receive buffer, the epilogue
    push) of its task."""
    for s in range(nseg):
        sp = segs + s * _SF
        start = tl.load(sp + _SSTART)
        end = start + tl.load(sp + _SLEN)
        k0 = tl.load(sp + _SK0)
        if SEG_K > 0:
            ksize = SEG_K
        else:
            ksize = tl.load(sp + _SK1) - k0
        if SEG_WAITS:  # compiled in only where a segment has hoisted waits (AG's gather)
            nwait = tl.load(sp + _SNWAIT)
            if nwait > 0:
                _segment_waits(pid, segwaits, tl.load(sp + _SWAIT0), nwait, evaddr, epoch,
                               limit, abort, err, rank, USE_TIMER)
        # Descriptors built inline (not returned from a helper): portable across Triton versions.
        sa, sb, s0 = tl.load(sp + _SA), tl.load(sp + _SB), tl.load(sp + _SW0)
        ca, cb, c0 = tl.load(bufcols + sa), tl.load(bufcols + sb), tl.load(bufcols + s0)
        ad = tl.make_tensor_descriptor(buffer_base(bufaddr, sa, DT), [tl.load(bufrows + sa), ca],
                                       [ca, 1], [BM, BK])
        bd = tl.make_tensor_descriptor(buffer_base(bufaddr, sb, DT), [tl.load(bufrows + sb), cb],
                                       [cb, 1], [BK, BN])
        cd0 = tl.make_tensor_descriptor(buffer_base(bufaddr, s0, DT), [tl.load(bufrows + s0), c0],
                                        [c0, 1], [BM, BN])
        if SEG_NW > 1:
            s1 = tl.load(sp + _SW1)
            c1 = tl.load(bufcols + s1)
            cd1 = tl.make_tensor_descriptor(buffer_base(bufaddr, s1, DT),
                                            [tl.load(bufrows + s1), c1], [c1, 1], [BM, BN])
        first = start + ((pid - start) % seg_p + seg_p) % seg_p
        for j in tl.range(first, end, seg_p, flatten=FLATTEN):
            pos = segpos + j * _PF
            am0 = tl.load(pos + _PAM)
            bk0 = tl.load(pos + _PBK)
            bn0 = tl.load(pos + _PBN)
            if TRACE:
                t_start = now(USE_TIMER)
            acc = tl.zeros((BM, BN), dtype=tl.float32)
            for kk in range(0, ksize, BK):
                acc = tl.dot(ad.load([am0, k0 + kk]), bd.load([bk0 + kk, bn0]), acc)
            c = acc.to(DT)
            w0m, w0n = tl.load(pos + _PW0M), tl.load(pos + _PW0N)
            if SEG_ADD:  # reduce-add into zeroed outputs (this GPU's and a peer's)
                _tile_add(cd0, w0m, w0n, c, DT, USE_TIMER)
                if SEG_NW > 1:
                    _tile_add(cd1, tl.load(pos + _PW1M), tl.load(pos + _PW1N), c, DT, USE_TIMER)
            else:
                cd0.store([w0m, w0n], c)
                if SEG_NW > 1:
                    cd1.store([tl.load(pos + _PW1M), tl.load(pos + _PW1N)], c)
            if TRACE:
                t = tl.load(pos + _PTASK)  # (its waits were hoisted: ready at its start)
                tl.store(trace + t * 4, t_start)
                tl.store(trace + t * 4 + 1, t_start)
                tl.store(trace + t * 4 + 2, now(USE_TIMER))
                tl.store(trace + t * 4 + 3, pid)


@triton.jit
def _signal_segments(pid, nprog, segpos, nstatic, tasks, signals, evaddr,
                     USE_TIMER: tl.constexpr):
    """Raise the signals of every static task this program ran, once, after all of them: the
    TMA stores complete (bulk_store_fence), one CTA barrier, then one release per signal (the
    first one at sys scope drains the peer stores; the rest find nothing to wait for)."""
    bulk_store_fence(USE_TIMER)
    tl.debug_barrier()
    for j in range(pid, nstatic, nprog):
        tp = tasks + tl.load(segpos + j * _PF + _PTASK) * _FIELDS
        s0 = tl.load(tp + _SIG0)
        for q in range(tl.load(tp + _NSIG)):
            sp = signals + (s0 + q) * _GF
            flag = tl.load(evaddr + tl.load(sp + _GSLOT)).to(tl.pointer_type(tl.int32))
            if tl.load(sp + _GSYS) != 0:
                tl.atomic_add(flag, 1, sem="release", scope="sys")
            else:
                tl.atomic_add(flag, 1, sem="release", scope="gpu")


@triton.jit
def _ticket(pid, role, heads, qinfo, base, ctl, pool, ADAPTIVE: tl.constexpr):
    """(index into the role's queue, role) of this program's next task; index -1: none left.
    With the controller, a program of the compute/nvlink pool takes the role the published
    target gives its place in the pool, or the other one when that queue has no task left."""
    movable = False
    if ADAPTIVE:
        movable = pid < pool
    if movable:
        # (load_uniform: every warp must pick the same queue, sync.py "Uniform control flow")
        want = (pid >= pool - load_uniform(ctl + _CTARGET)).to(tl.int32)
        i = tl.atomic_add(heads + want, 1) + tl.load(qinfo + want * _QF + _QSTATIC)
        role = want
        if i >= tl.load(qinfo + want * _QF + _QLEN):
            role = 1 - want
            i = tl.atomic_add(heads + role, 1) + tl.load(qinfo + role * _QF + _QSTATIC)
    else:
        i = tl.atomic_add(heads + role, 1) - base + tl.load(qinfo + role * _QF + _QSTATIC)
    if i >= tl.load(qinfo + role * _QF + _QLEN):
        i = -1
    return i, role


# Not specialised by Triton (which compiles one kernel per int == 1, per int or address % 16 ==
# 0): seg_p, the only value that changes with the split of programs between roles, and
# start_flags, an address after the events in the flag array (its alignment follows the event
# count, so the chunk size). A sweep over NVLink workers and chunks at one shape reuses one kernel.
@triton.jit(do_not_specialize=["seg_p", "start_flags"])
def megakernel(
    tasks, regions, waits, signals, param_table, bufaddr, bufrows, bufcols, bufdt, evaddr,
    queues, qinfo, roles, heads, segs, nseg, segpos, segwaits, epoch_ptr, rank, limit, err, abort,
    go,
    start_flags, peer_flags, npeers, trace, a0_slot, b0_slot,
    ring, dhead, tail, capacity, cmds, start_cmds, startaddr, netaddr, netfirst, netn,
    exitaddr, exitcount, nexit, exitev, exittotal, nexitev,
    ctl, window_ns, max_comm, pool, seg_p,
    DT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    RB_M: tl.constexpr, RB_N: tl.constexpr,
    NEED_AB: tl.constexpr,
    USE_TIMER: tl.constexpr, TRACE: tl.constexpr, BARRIER: tl.constexpr,
    HAS_NET: tl.constexpr,
    HAS_SEGS: tl.constexpr, SEG_NW: tl.constexpr, SEG_ADD: tl.constexpr,
    SEG_WAITS: tl.constexpr, SEG_K: tl.constexpr, FLATTEN: tl.constexpr,
    ADAPTIVE: tl.constexpr, GEMM_PTR: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    # Bodies name it ``params``; the argument may not be called that (Triton 3.6's generated
    # argument binder keeps its own dict in a local named ``params``).
    params = param_table  # noqa: F841 - read by the generated dispatch
    # The launch's epoch lives on the device (a CUDA graph replay increments it before the
    # kernel), so the kernel's arguments never change between launches.
    epoch = tl.load(epoch_ptr)
    if BARRIER:
        _entry_barrier(pid, start_flags, peer_flags, npeers, go, epoch, limit, abort, err, rank,
                       ring, dhead, tail, capacity, cmds, start_cmds, startaddr, USE_TIMER,
                       HAS_NET)
        # Peers' inputs (written before their launch) may be read through TMA: order the
        # barrier's acquire before this program's async-proxy loads.
        fence_proxy_async(USE_TIMER)
    if NEED_AB:  # the rank's usual A and B: one descriptor each per launch, not per tile
        # (GEMM_PTR: where every GEMM of the rank runs by pointers, tiles.gemm_pointers, the
        # slots' rows may not be whole 16-byte units, which a descriptor's pitch must be: the
        # pitch is rounded up to them; such a descriptor is never used.)
        a_cols = tl.load(bufcols + a0_slot)
        ad0 = tl.make_tensor_descriptor(buffer_base(bufaddr, a0_slot, DT),  # noqa: F841 - read by the generated dispatch
                                        [tl.load(bufrows + a0_slot), a_cols],
                                        [_tma_pitch(a_cols, DT, GEMM_PTR), 1], [BM, BK])
        b_cols = tl.load(bufcols + b0_slot)
        bd0 = tl.make_tensor_descriptor(buffer_base(bufaddr, b0_slot, DT),  # noqa: F841 - read by the generated dispatch
                                        [tl.load(bufrows + b0_slot), b_cols],
                                        [_tma_pitch(b_cols, DT, GEMM_PTR), 1], [BK, BN])
    role = tl.load(roles + pid)
    qp = qinfo + role * _QF
    qoff = tl.load(qp + _QOFF)
    qlen = tl.load(qp + _QLEN)
    nworkers = tl.load(qp + _QWORKERS)
    nstatic = tl.load(qp + _QSTATIC)
    if HAS_SEGS:
        if nstatic > 0:  # only the compute role (or the interpreter's one program) has some
            # compute programs come first, so pid is the program's index in its role
            _gemm_segments(pid, segs, nseg, segpos, segwaits, regions, bufaddr, bufrows,
                           bufcols, evaddr, epoch, limit, abort, err, rank, trace, seg_p, SEG_K,
                           DT, BM, BN, BK, SEG_NW, SEG_ADD, SEG_WAITS, FLATTEN, USE_TIMER, TRACE)
            _signal_segments(pid, seg_p, segpos, nstatic, tasks, signals, evaddr, USE_TIMER)
    # Tickets: without the controller a role's programs are fixed, so each launch hands out
    # (its dynamic tasks + one failing ticket per program) and the base follows the epoch; with
    # it, programs move between roles, and the last program to finish resets the heads.
    if ADAPTIVE:
        base = 0
    else:
        base = (epoch - 1) * (qlen - nstatic + nworkers)
    i, role = _ticket(pid, role, heads, qinfo, base, ctl, pool, ADAPTIVE)
    stop = load_uniform(abort)
    while (i >= 0) & (stop == 0):
        qoff = tl.load(qinfo + role * _QF + _QOFF)
        t = tl.load(queues + qoff + i)
        tp = tasks + t * _FIELDS
        t_start = now(USE_TIMER)
        w0 = tl.load(tp + _WAIT0)
        ok = 1
        nwait = tl.load(tp + _NWAIT)
        for q in range(nwait):
            wp = waits + (w0 + q) * _WF
            slot = tl.load(wp + _WSLOT)
            target = (epoch - 1) * tl.load(wp + _WTOTAL) + tl.load(wp + _WCOUNT)
            flag = tl.load(evaddr + slot).to(tl.pointer_type(tl.int32))
            nnet = 0
            if HAS_NET:
                nnet = tl.load(netn + slot)
            if nnet > 0:
                net = netaddr + tl.load(netfirst + slot)  # the words' addresses
                v = wait_sum(flag, net, nnet, target, limit, abort, USE_TIMER, True)
            elif tl.load(wp + _WSYS) != 0:
                v = wait(flag, target, limit, abort, USE_TIMER, True)
            else:
                v = wait(flag, target, limit, abort, USE_TIMER, False)
            if v < target:
                if ok == 1:
                    _record(err, abort, rank, pid, tl.load(tp + _GID), slot, v, target, epoch)
                ok = 0
        t_waited = now(USE_TIMER)  # noqa: F841 - read by the controller and the trace
        if ok == 1:
            if nwait > 0:  # data peers stored (generic proxy) may be read through TMA
                fence_proxy_async(USE_TIMER)
            kind = tl.load(tp + _KIND)  # noqa: F841 - read by the generated dispatch
            # <dispatch> runtime/megakernel/dispatch.py replaces this block, in a generated copy
            # of this module, with one branch per kind the schedule runs, each calling that
            # kind's Triton body with the ABI values its parameters name (dispatch.ABI_NAMES).
            pass
            # </dispatch>
            s0 = tl.load(tp + _SIG0)
            for q in range(tl.load(tp + _NSIG)):
                sp = signals + (s0 + q) * _GF
                flag = tl.load(evaddr + tl.load(sp + _GSLOT)).to(tl.pointer_type(tl.int32))
                if tl.load(sp + _GSYS) != 0:
                    signal(flag, True)
                else:
                    signal(flag, False)
            if TRACE:
                tl.store(trace + t * 4, t_start)
                tl.store(trace + t * 4 + 1, t_waited)  # its waits met: work starts
                tl.store(trace + t * 4 + 2, now(USE_TIMER))
                tl.store(trace + t * 4 + 3, pid)
            if ADAPTIVE:
                if pid < pool:
                    t_end = now_uniform(USE_TIMER)  # the window test branches on it
                    account(ctl, role, t_end - t_start, t_waited - t_start)
                    maybe_decide(ctl, heads, qinfo, tl.load(qinfo + _QSTATIC), t_end, pool,
                                 window_ns, max_comm, _QF, _QLEN)
        i, role = _ticket(pid, role, heads, qinfo, base, ctl, pool, ADAPTIVE)
        stop = load_uniform(abort)
    if pid == 0:  # bytes peers store into this rank's outputs, which no local task waits for
        for x in range(nexitev):
            slot = tl.load(exitev + x)
            flag = tl.load(evaddr + slot).to(tl.pointer_type(tl.int32))
            target = epoch * tl.load(exittotal + x)
            v = wait(flag, target, limit, abort, USE_TIMER, True)
            if v < target:
                _record(err, abort, rank, pid, -4, slot, v, target, epoch)
    if HAS_NET:
        _exit_wait(pid, exitaddr, exitcount, nexit, epoch, limit, abort, err, rank, USE_TIMER)
    if ADAPTIVE:
        reset_at_exit(ctl, heads, 3)
