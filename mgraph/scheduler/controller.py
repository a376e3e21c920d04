"""The adaptive controller's rule: how a rank's compute and NVLink workers are re-split while a
launch runs (DESIGN: Controller).

``decide`` is the ONE definition of the rule. Who calls it today:

- the simulator, ``simulate(..., adaptive=True)`` (runtime/sim/engine.py), once per rank every
  ``period_us`` of simulated time;
- the CPU reference runtime with ``Settings(adaptive=True)`` (runtime/reference.py), when a worker
  finishes a task and ``Settings.adaptive_window_us`` has passed since the rank's last decision;
- the static SM partition (``balance.balance_workers``, used by ``static_partition``): the same
  rule with nothing measured yet, on the cost model's estimates;
- the Triton megakernel with ``Settings(adaptive=True)``: ``runtime/megakernel/control.py``
  transcribes ``decide_mirror``, the rule in the flat, branch-free int64 form a Triton program
  executes; when a program of the pool finishes a dynamic task and ``Settings.adaptive_window_us``
  has passed since the last decision, that program runs it and publishes the split. Tests hold
  ``decide_mirror`` equal to ``decide`` on recorded progress traces and on random inputs.

The rule, for one rank's pool of ``P`` = compute + comm workers (rdma workers are not pooled: they
only push proxy commands). All inputs are integers, times in one unit of the caller's choice (the
runtimes use ns), so the kernel can follow it exactly (Triton's fp32 division is approximate):

1. A role with no task left to take gets no worker, the other gets the whole pool, at once (there
   is nothing to damp: the finished role's workers would idle). Both finished: the split stays.
2. Otherwise each role keeps at least one worker, comm at most ``max_comm``, and no role gets more
   workers than it has tasks left to take (the rest would idle): comm in ``[lo, hi]``, lo = max(1,
   P - Lp), hi = min(P - 1, Ls, max_comm). If lo > hi, too few tasks are left to matter: every
   split in [hi, lo] serves the remaining tasks as well as any other, so the split moves only as
   far as it must to get into that range (no damping: this is a count, not a noisy measurement;
   with no previous decision it takes the target of step 3, clamped into the range).
3. The target: comm = floor(P * Ws / (Wp + Ws) + 1/2) clamped to [lo, hi], W = L * C, L tasks
   left (saturated at ``LEFT_CAP``), C time per task: measured ``run // done`` once a task
   finished (at least 1), else the ``prior`` estimate, saturated at ``COST_CAP``. A role with
   neither (C = 0) is costed like the other one; if neither has one, by task counts alone.
4. A stalled role, whose workers spent at least half of the window blocked on waits (remote data
   not there yet), may lose workers but gains none: more workers would only wait with them.
5. Damping: from the previous decision the split moves by half the gap (floor), at least one
   worker, so it converges and never overshoots. With no previous decision it jumps to the target.

Bounds: with ``LEFT_CAP``, ``COST_CAP`` < 2**24 and ``MAX_WORKERS`` = 2**12, every product stays
below 2**62, so int64 never overflows.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import NamedTuple

from ..errors import ScheduleError

__all__ = [
    "COST_CAP",
    "DAMP_DEN",
    "DAMP_NUM",
    "LEFT_CAP",
    "MAX_WORKERS",
    "STALL_DEN",
    "STALL_NUM",
    "TIME_CAP",
    "RoleProgress",
    "Split",
    "Window",
    "decide",
    "decide_mirror",
]

DAMP_NUM, DAMP_DEN = 1, 2  # fraction of the gap closed per decision
STALL_NUM, STALL_DEN = 1, 2  # blocked fraction of a role's worker-time that counts as stalled
LEFT_CAP = (1 << 24) - 1  # tasks left, saturated (a rank has far fewer)
COST_CAP = (1 << 24) - 1  # time per task, saturated (16.7 ms at ns: long tasks tie)
TIME_CAP = (1 << 40) - 1  # window length and time waited per window (1100 s at ns)
MAX_WORKERS = 1 << 12  # workers in a pool (an H200 has 132 SMs)
_INT_CAP = 1 << 62  # any counter: an int64 on the GPU


@dataclass(frozen=True, slots=True)
class RoleProgress:
    """One role's progress on one rank, as the runtime sees it at a window's end.

    ``left``: tasks of the role's queue no worker has taken yet. ``done``: tasks finished since
    the launch began; ``run``: their summed time from waits met to end. ``wait``: time the role's
    workers spent blocked on waits during the window. ``workers``: workers in the role now.
    ``prior``: estimated time per task, used until one has finished (0: no estimate).
    """

    left: int
    done: int
    run: int
    wait: int
    workers: int
    prior: int = 0


class Split(NamedTuple):
    """Workers per role, the rule's output."""

    compute: int
    comm: int


@dataclass(frozen=True, slots=True)
class Window:
    """One decision as a runtime made it: its inputs and the split it applied (for logs and the
    recorded traces the tests replay)."""

    rank: int
    time: int  # since the launch began, in the inputs' unit
    compute: RoleProgress
    comm: RoleProgress
    window: int
    previous: int | None
    max_comm: int
    split: Split

    def to_json(self) -> dict:
        return {
            "rank": self.rank,
            "time": self.time,
            "compute": asdict(self.compute),
            "comm": asdict(self.comm),
            "window": self.window,
            "previous": self.previous,
            "max_comm": self.max_comm,
            "split": list(self.split),
        }

    @classmethod
    def from_json(cls, doc: dict) -> Window:
        return cls(
            rank=doc["rank"],
            time=doc["time"],
            compute=RoleProgress(**doc["compute"]),
            comm=RoleProgress(**doc["comm"]),
            window=doc["window"],
            previous=doc["previous"],
            max_comm=doc["max_comm"],
            split=Split(*doc["split"]),
        )

    def replay(self) -> Split:
        """The rule's decision on this window's inputs."""
        return decide(
            self.compute,
            self.comm,
            window=self.window,
            previous=self.previous,
            max_comm=self.max_comm,
        )


def decide(
    compute: RoleProgress,
    comm: RoleProgress,
    *,
    window: int,
    previous: int | None = None,
    max_comm: int = MAX_WORKERS,
) -> Split:
    """The target split of ``compute.workers + comm.workers`` workers (the module docstring's
    rule). ``window``: the window's length (0: none, so no role counts as stalled).
    ``previous``: the comm workers of the last decision (None: no history, no damping)."""
    _check(compute, comm, window, previous, max_comm)
    pool = compute.workers + comm.workers
    lp, ls = min(compute.left, LEFT_CAP), min(comm.left, LEFT_CAP)
    # 1. A role finished.
    if lp == 0 and ls == 0:
        held = comm.workers if previous is None else previous
        return Split(pool - held, held)
    if ls == 0:
        return Split(pool, 0)
    if lp == 0:
        return Split(0, pool)
    lo = max(1, pool - lp)
    hi = min(pool - 1, ls, max_comm)
    # 3. The target (computed first: step 2 uses it when there is no previous decision).
    cp, cs = _cost(compute), _cost(comm)
    if cp == 0:
        cp = cs
    if cs == 0:
        cs = cp
    if cp == 0:
        cp = cs = 1
    wp, ws = lp * cp, ls * cs
    target = (2 * pool * ws + wp + ws) // (2 * (wp + ws))
    # 2. Too few tasks left to matter.
    if lo > hi:
        held = target if previous is None else previous
        c = min(max(held, hi), lo)
        return Split(pool - c, c)
    target = min(max(target, lo), hi)
    current = min(max(comm.workers if previous is None else previous, lo), hi)
    # 4. A stalled role gains no workers.
    if _stalled(comm, window):
        target = min(target, current)
    if _stalled(compute, window):
        target = max(target, current)
    if previous is None:
        return Split(pool - target, target)
    # 5. Damping.
    gap = target - current
    if gap == 0:
        return Split(pool - current, current)
    step = max(1, abs(gap) * DAMP_NUM // DAMP_DEN)
    c = current + step if gap > 0 else current - step
    return Split(pool - c, c)


def _cost(role: RoleProgress) -> int:
    """Time per task: measured once a task finished (a finished task took some time: >= 1),
    else the estimate; saturated."""
    if role.done:
        return min(max(role.run // role.done, 1), COST_CAP)
    return min(role.prior, COST_CAP)


def _stalled(role: RoleProgress, window: int) -> bool:
    wait = min(role.wait, TIME_CAP)
    return window > 0 and role.workers > 0 and wait * STALL_DEN >= role.workers * window * STALL_NUM


def _check(
    compute: RoleProgress, comm: RoleProgress, window: int, previous: int | None, max_comm: int
) -> None:
    def bad(what: str, hint: str) -> ScheduleError:
        return ScheduleError(f"controller.decide: {what}", hint=hint)

    def whole(name: str, value: object, cap: int = _INT_CAP) -> None:
        if isinstance(value, bool) or not isinstance(value, int):
            raise bad(f"{name}={value!r} must be an int", "pass whole counts and integer times")
        if not 0 <= value < cap:
            raise bad(f"{name}={value}", f"must be in 0..{cap - 1}")

    for role_name, role in (("compute", compute), ("comm", comm)):
        if not isinstance(role, RoleProgress):
            raise bad(f"{role_name}={role!r}", "pass a RoleProgress")
        for field in ("left", "done", "run", "wait", "workers", "prior"):
            whole(f"{role_name}.{field}", getattr(role, field))
    whole("window", window, TIME_CAP + 1)
    pool = compute.workers + comm.workers
    if pool > MAX_WORKERS:
        raise bad(f"{pool} workers", f"a pool has at most {MAX_WORKERS} workers")
    if compute.left and comm.left and pool < 2:
        raise bad(
            f"{pool} worker(s), but compute ({compute.left}) and comm ({comm.left}) both have "
            "tasks left",
            "each role with tasks left needs its own worker: pool at least 2",
        )
    whole("max_comm", max_comm, MAX_WORKERS + 1)
    if max_comm < 1:
        raise bad("max_comm=0", "comm needs at least one worker while it has tasks")
    if previous is not None:
        whole("previous", previous, pool + 1)


# -- the kernel's form ---------------------------------------------------------------------------
def _where(cond: bool, a: int, b: int) -> int:
    """tl.where on scalars."""
    return a if cond else b


def decide_mirror(
    c_left: int,
    c_done: int,
    c_run: int,
    c_wait: int,
    c_workers: int,
    c_prior: int,
    s_left: int,
    s_done: int,
    s_run: int,
    s_wait: int,
    s_workers: int,
    s_prior: int,
    window: int,
    previous: int,
    max_comm: int,
) -> tuple[int, int]:
    """``decide`` as a Triton program computes it: int64 scalars, every case evaluated and the
    answer selected with where (no early return, no branch on data), no division by zero in any
    lane. ``c_*``: compute, ``s_*``: comm; ``previous`` < 0 means none. Returns (compute, comm).
    Inputs are assumed valid (the host checks ``decide``'s bounds once); min/max are
    tl.minimum/tl.maximum, // on non-negative int64 is Triton's //."""
    pool = c_workers + s_workers
    lp = min(c_left, LEFT_CAP)
    ls = min(s_left, LEFT_CAP)
    has_prev = previous >= 0
    # time per task: measured, else the estimate; a role with neither takes the other's
    cp_meas = min(max(c_run // max(c_done, 1), 1), COST_CAP)
    cs_meas = min(max(s_run // max(s_done, 1), 1), COST_CAP)
    cp = _where(c_done > 0, cp_meas, min(c_prior, COST_CAP))
    cs = _where(s_done > 0, cs_meas, min(s_prior, COST_CAP))
    cp0 = _where(cp == 0, cs, cp)
    cs0 = _where(cs == 0, cp, cs)
    cp1 = _where(cp0 == 0, 1, cp0)
    cs1 = _where(cs0 == 0, 1, cs0)
    wp = lp * cp1
    ws = ls * cs1
    den = max(2 * (wp + ws), 1)
    target = (2 * pool * ws + wp + ws) // den
    lo = max(1, pool - lp)
    hi = min(min(pool - 1, ls), max_comm)
    # too few tasks left to matter: the nearest split in [hi, lo]
    held_few = _where(has_prev, previous, target)
    few = min(max(held_few, hi), lo)
    # the damped move inside [lo, hi]
    t0 = min(max(target, lo), hi)
    cur = min(max(_where(has_prev, previous, s_workers), lo), hi)
    stalled_s = (
        (window > 0)
        & (s_workers > 0)
        & (min(s_wait, TIME_CAP) * STALL_DEN >= s_workers * window * STALL_NUM)
    )
    stalled_c = (
        (window > 0)
        & (c_workers > 0)
        & (min(c_wait, TIME_CAP) * STALL_DEN >= c_workers * window * STALL_NUM)
    )
    t1 = _where(stalled_s, min(t0, cur), t0)
    t2 = _where(stalled_c, max(t1, cur), t1)
    gap = t2 - cur
    mag = _where(gap < 0, -gap, gap)
    step = max(mag * DAMP_NUM // DAMP_DEN, 1)
    moved = _where(gap > 0, cur + step, _where(gap < 0, cur - step, cur))
    damped = _where(has_prev, moved, t2)
    # select the case, last rule first
    comm = _where(lo > hi, few, damped)
    comm = _where(lp == 0, pool, comm)
    comm = _where(ls == 0, 0, comm)
    comm = _where((lp == 0) & (ls == 0), _where(has_prev, previous, s_workers), comm)
    return pool - comm, comm
