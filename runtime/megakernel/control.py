"""The adaptive controller inside the megakernel (``Settings(adaptive=True)``; issue 18).

Programs of the compute and nvlink roles form one pool. After each dynamic task a program adds
to its role's counters (tasks done, run time, time blocked on waits; %globaltimer ns), and once
per window one program (the winner of a compare-and-swap on the window start) reads the
counters and the tickets left in both queues, runs the rule, and publishes a target number of
nvlink programs. A program takes its next task from the role the target gives its index in the
pool (the first ``pool - target`` programs compute), and from the other role when that queue is
empty. So roles change only at task boundaries.

:func:`decide` is ``mgraph.scheduler.controller.decide_mirror`` line by line (the rule's one
definition is ``controller.decide``; tests hold the mirror to it). Control words, int64 (``ctl``):
"""

from __future__ import annotations

import triton
import triton.language as tl

from mgraph.scheduler.controller import (
    COST_CAP,
    DAMP_DEN,
    DAMP_NUM,
    LEFT_CAP,
    STALL_DEN,
    STALL_NUM,
    TIME_CAP,
)

from .sync import load_uniform

__all__ = ["CTL_WORDS", "C_FINISHED", "C_TARGET", "C_WINDOW", "C_DONE", "C_PREVIOUS", "C_PRIOR",
           "C_INITIAL", "C_DECISIONS", "decide", "account", "maybe_decide", "reset_at_exit"]

CTL_WORDS = 16
C_FINISHED = 0  # programs that finished this launch (the last one resets the words)
C_TARGET = 1  # the published number of nvlink programs
C_WINDOW = 2  # the current window's start, ns
C_DONE = 3  # + 3 * role: tasks done, +1 run ns, +2 wait ns (role 0 compute, 1 nvlink)
C_PREVIOUS = 9  # the last decision (-1: none yet this launch)
C_PRIOR = 10  # + role: the cost model's ns per task, before anything is measured
C_INITIAL = 12  # the schedule's nvlink programs: the target at every launch's start
C_DECISIONS = 13  # decisions made (all launches; read by tests)

_LEFT_CAP, _COST_CAP, _TIME_CAP = tl.constexpr(LEFT_CAP), tl.constexpr(COST_CAP), tl.constexpr(TIME_CAP)
_DAMP_NUM, _DAMP_DEN = tl.constexpr(DAMP_NUM), tl.constexpr(DAMP_DEN)
_STALL_NUM, _STALL_DEN = tl.constexpr(STALL_NUM), tl.constexpr(STALL_DEN)
_FIN, _TGT, _WIN, _DONE = tl.constexpr(C_FINISHED), tl.constexpr(C_TARGET), tl.constexpr(C_WINDOW), tl.constexpr(C_DONE)
_PREV, _PRIOR, _INIT, _DEC = tl.constexpr(C_PREVIOUS), tl.constexpr(C_PRIOR), tl.constexpr(C_INITIAL), tl.constexpr(C_DECISIONS)


@triton.jit
def decide(c_left, c_done, c_run, c_wait, c_workers, c_prior, s_left, s_done, s_run, s_wait,
           s_workers, s_prior, window, previous, max_comm):
    """controller.decide_mirror: returns the number of nvlink (comm) programs."""
    pool = c_workers + s_workers
    lp = tl.minimum(c_left, _LEFT_CAP)
    ls = tl.minimum(s_left, _LEFT_CAP)
    has_prev = previous >= 0
    cp_meas = tl.minimum(tl.maximum(c_run // tl.maximum(c_done, 1), 1), _COST_CAP)
    cs_meas = tl.minimum(tl.maximum(s_run // tl.maximum(s_done, 1), 1), _COST_CAP)
    cp = tl.where(c_done > 0, cp_meas, tl.minimum(c_prior, _COST_CAP))
    cs = tl.where(s_done > 0, cs_meas, tl.minimum(s_prior, _COST_CAP))
    cp0 = tl.where(cp == 0, cs, cp)
    cs0 = tl.where(cs == 0, cp, cs)
    cp1 = tl.where(cp0 == 0, 1, cp0)
    cs1 = tl.where(cs0 == 0, 1, cs0)
    wp = lp * cp1
    ws = ls * cs1
    den = tl.maximum(2 * (wp + ws), 1)
    target = (2 * pool * ws + wp + ws) // den
    lo = tl.maximum(pool - lp, 1)
    hi = tl.minimum(tl.minimum(pool - 1, ls), max_comm)
    held_few = tl.where(has_prev, previous, target)
    few = tl.minimum(tl.maximum(held_few, hi), lo)
    t0 = tl.minimum(tl.maximum(target, lo), hi)
    cur = tl.minimum(tl.maximum(tl.where(has_prev, previous, s_workers), lo), hi)
    stalled_s = ((window > 0) & (s_workers > 0)
                 & (tl.minimum(s_wait, _TIME_CAP) * _STALL_DEN >= s_workers * window * _STALL_NUM))
    stalled_c = ((window > 0) & (c_workers > 0)
                 & (tl.minimum(c_wait, _TIME_CAP) * _STALL_DEN >= c_workers * window * _STALL_NUM))
    t1 = tl.where(stalled_s, tl.minimum(t0, cur), t0)
    t2 = tl.where(stalled_c, tl.maximum(t1, cur), t1)
    gap = t2 - cur
    mag = tl.where(gap < 0, -gap, gap)
    step = tl.maximum(mag * _DAMP_NUM // _DAMP_DEN, 1)
    moved = tl.where(gap > 0, cur + step, tl.where(gap < 0, cur - step, cur))
    damped = tl.where(has_prev, moved, t2)
    comm = tl.where(lo > hi, few, damped)
    comm = tl.where(lp == 0, pool, comm)
    comm = tl.where(ls == 0, 0, comm)
    comm = tl.where((lp == 0) & (ls == 0), tl.where(has_prev, previous, s_workers), comm)
    return comm


@triton.jit
def account(ctl, role, run_ns, wait_ns):
    """A finished dynamic task of ``role`` (0 compute, 1 nvlink): its counters."""
    p = ctl + _DONE + 3 * role
    tl.atomic_add(p, 1, sem="relaxed")
    tl.atomic_add(p + 1, run_ns, sem="relaxed")
    tl.atomic_add(p + 2, wait_ns, sem="relaxed")


@triton.jit
def maybe_decide(ctl, heads, qinfo, c_static, t_now, pool, window_ns, max_comm,
                 QF: tl.constexpr, QLEN: tl.constexpr):
    """Once per window, by the program that wins the window: run the rule and publish.
    ``t_now`` must be the same in every warp (sync.now_uniform), and so is every word read here
    (sync.load_uniform, atomics): the window test and the compare-and-swap are branches, and
    the atomics inside them hold CTA barriers (sync.py, "Uniform control flow")."""
    start = load_uniform(ctl + _WIN)
    if t_now - start >= window_ns:
        if tl.atomic_cas(ctl + _WIN, start, t_now) == start:
            window = t_now - start
            c_left = tl.maximum(tl.load(qinfo + QLEN) - c_static - load_uniform(heads), 0)
            s_left = tl.maximum(tl.load(qinfo + QF + QLEN) - load_uniform(heads + 1), 0)
            tgt = load_uniform(ctl + _TGT)
            comm = decide(c_left.to(tl.int64), load_uniform(ctl + _DONE),
                          load_uniform(ctl + _DONE + 1),
                          tl.atomic_xchg(ctl + _DONE + 2, 0), (pool - tgt).to(tl.int64),
                          tl.load(ctl + _PRIOR), s_left.to(tl.int64),
                          load_uniform(ctl + _DONE + 3),
                          load_uniform(ctl + _DONE + 4),
                          tl.atomic_xchg(ctl + _DONE + 5, 0), tgt.to(tl.int64),
                          tl.load(ctl + _PRIOR + 1), window, load_uniform(ctl + _PREV),
                          max_comm.to(tl.int64))
            tl.store(ctl + _PREV, comm)
            tl.atomic_xchg(ctl + _TGT, comm)
            tl.atomic_add(ctl + _DEC, 1)


@triton.jit
def reset_at_exit(ctl, heads, nroles):
    """The launch's last program to finish resets the queue heads and the control words, so the
    next launch starts from ticket 0 however many tickets each role handed out (roles moved)."""
    if tl.atomic_add(ctl + _FIN, 1, sem="acq_rel") == tl.num_programs(0) - 1:
        for r in range(nroles):
            tl.store(heads + r, 0)
        for w in range(_DONE, _DONE + 6):
            tl.store(ctl + w, 0)
        tl.store(ctl + _PREV, -1)
        tl.store(ctl + _WIN, 0)
        tl.store(ctl + _TGT, tl.load(ctl + _INIT))
        tl.store(ctl + _FIN, 0)
