from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import mgraph as mg
from mgraph.builder import GraphBuilder
from mgraph.kinds import Role
from mgraph.scheduler import DAMPING, balance_workers, role_work, static_partition, task_costs
from mgraph.scheduler.balance import _ticks
from mgraph.scheduler.controller import RoleProgress, decide

costs = st.one_of(
    st.floats(0, 1e6, allow_nan=False),
    st.sampled_from([0.0, 1e-9, 1e300, math.inf]),
)
totals = st.integers(1, 256)
remaining = st.integers(0, 10_000)


def rule(total, rp, cp, rs, cs):
    """The rule written out plainly for finite, non-degenerate inputs."""
    return total * rs * cs / (rp * cp + rs * cs)


@st.composite
def windows(draw):
    total = draw(totals)
    rp, rs = draw(remaining), draw(remaining)
    if rp and rs and total < 2:
        total = 2
    return dict(
        total=total,
        compute_remaining=rp,
        compute_cost=draw(costs),
        comm_remaining=rs,
        comm_cost=draw(costs),
    )


@settings(max_examples=400, deadline=None)
@given(windows())
def test_range_and_roles_with_work_keep_a_worker(w):
    comm = balance_workers(**w)
    assert isinstance(comm, int) and 0 <= comm <= w["total"]
    if w["comm_remaining"] == 0:
        assert comm == 0
    elif w["compute_remaining"] == 0:
        assert comm == w["total"]
    else:
        assert 1 <= comm <= w["total"] - 1


@settings(max_examples=300, deadline=None)
@given(
    st.integers(2, 256),
    st.integers(1, 10_000),
    st.floats(1e-9, 1e3),
    st.integers(1, 10_000),
    st.floats(1e-9, 1e3),
)
def test_matches_the_formula(total, rp, cp, rs, cs):
    """The rule's target, clamped so each role keeps a worker and gets no more than its tasks."""
    got = balance_workers(
        total, compute_remaining=rp, compute_cost=cp, comm_remaining=rs, comm_cost=cs
    )
    x = rule(total, rp, cp, rs, cs)
    lo, hi = max(1, total - rp), min(total - 1, rs)
    want = math.floor(x + 0.5)
    want = min(max(want, hi), lo) if lo > hi else min(max(want, lo), hi)
    # Costs become integer ticks (the larger one 2**24 - 1): only a .5 tie, or a cost ratio
    # beyond 2**24 (the smaller saturates at one tick), can move the result, by one worker.
    ratio = max(cp, cs) / min(cp, cs)
    assert abs(got - want) <= 1
    assert got == want or abs(x % 1 - 0.5) < 1e-4 or ratio > 2**23


@settings(max_examples=300, deadline=None)
@given(st.integers(2, 256), remaining, costs, st.integers(1, 10_000), costs, st.integers(1, 100))
def test_more_comm_work_never_means_fewer_comm_workers(total, rp, cp, rs, cs, extra):
    kw = dict(compute_remaining=rp, compute_cost=cp, comm_cost=cs)
    assert balance_workers(total, comm_remaining=rs + extra, **kw) >= balance_workers(
        total, comm_remaining=rs, **kw
    )


@settings(max_examples=200, deadline=None)
@given(windows(), st.integers(1, 300))
def test_is_the_controller_rule_with_nothing_measured(w, cap):
    """balance_workers is controller.decide at window 0 (no damping, no stall), whatever split
    the workers stand at (it has no previous decision to start from)."""
    total = w["total"]
    got = balance_workers(
        total,
        compute_remaining=w["compute_remaining"],
        compute_cost=w["compute_cost"],
        comm_remaining=w["comm_remaining"],
        comm_cost=w["comm_cost"],
        max_comm=cap,
    )
    tp, ts = _ticks(w["compute_cost"], w["comm_cost"])
    for comm_now in {1, total - 1, total // 2}:
        if not 0 <= comm_now <= total:
            continue
        split = decide(
            RoleProgress(w["compute_remaining"], 0, 0, 0, total - comm_now, tp),
            RoleProgress(w["comm_remaining"], 0, 0, 0, comm_now, ts),
            window=0,
            max_comm=min(cap, total),
        )
        if w["compute_remaining"] or w["comm_remaining"]:  # both finished: the split stays
            assert split.comm == got
    rp, rs = w["compute_remaining"], w["comm_remaining"]
    if rp and rs and max(1, total - rp) <= min(total - 1, rs, cap):
        assert 1 <= got <= min(cap, rs) and total - got <= rp


def test_one_role_without_work():
    kw = dict(compute_cost=1.0, comm_cost=1.0)
    assert balance_workers(10, compute_remaining=0, comm_remaining=5, **kw) == 10
    assert balance_workers(10, compute_remaining=5, comm_remaining=0, **kw) == 0
    assert balance_workers(10, compute_remaining=0, comm_remaining=0, **kw) == 0


def test_stalled_role():
    kw = dict(compute_remaining=100, comm_remaining=100)
    # Communication never finishes (infinite cost): the rule's limit gives it all but one.
    assert balance_workers(16, compute_cost=1e-6, comm_cost=math.inf, **kw) == 15
    assert balance_workers(16, compute_cost=math.inf, comm_cost=1e-6, **kw) == 1
    # A huge finite estimate decides as infinity does.
    assert balance_workers(16, compute_cost=1e-6, comm_cost=1e300, **kw) == 15
    assert balance_workers(16, compute_cost=1e308, comm_cost=1e308, **kw) == 8
    # Both infinite, or nothing estimated: split by remaining tasks.
    assert balance_workers(16, compute_cost=math.inf, comm_cost=math.inf, **kw) == 8
    assert (
        balance_workers(
            16, compute_cost=0.0, comm_cost=0.0, compute_remaining=300, comm_remaining=100
        )
        == 4
    )
    # One cost zero is no estimate: that role is costed like the other (split by counts).
    assert balance_workers(16, compute_cost=0.0, comm_cost=1.0, **kw) == 8
    assert (
        balance_workers(
            16, compute_cost=2e-6, comm_cost=0.0, compute_remaining=300, comm_remaining=100
        )
        == 4
    )


def test_tiny_windows():
    kw = dict(compute_cost=1.0, comm_cost=1.0)
    for rp, rs in [(1, 1), (1000, 1), (1, 1000)]:
        assert balance_workers(2, compute_remaining=rp, comm_remaining=rs, **kw) == 1
    assert balance_workers(3, compute_remaining=1000, comm_remaining=1, **kw) == 1
    assert balance_workers(3, compute_remaining=1, comm_remaining=1000, **kw) == 2
    assert balance_workers(3, compute_remaining=1, comm_remaining=1, **kw) == 2  # 1.5 rounds up
    assert balance_workers(1, compute_remaining=0, comm_remaining=3, **kw) == 1
    assert balance_workers(1, compute_remaining=3, comm_remaining=0, **kw) == 0


def test_no_role_gets_more_workers_than_tasks():
    # Comm costs 100x compute but has 3 tasks: 3 workers serve them, 125 compute.
    kw = dict(compute_remaining=5000, compute_cost=1e-6, comm_cost=1e-4)
    assert balance_workers(128, comm_remaining=3, **kw) == 3
    assert balance_workers(128, comm_remaining=3, max_comm=2, **kw) == 2
    # Too few tasks in all to matter: 4 compute and 2 comm tasks on 128 workers.
    got = balance_workers(
        128, compute_remaining=4, compute_cost=1.0, comm_remaining=2, comm_cost=1.0
    )
    assert 2 <= got <= 124 and got == math.floor(128 * 2 / 6 + 0.5)
    assert DAMPING == 0.5


@pytest.mark.parametrize(
    "kw",
    [
        dict(total=0),
        dict(total=-3),
        dict(total=1),  # both roles have work: needs 2
        dict(total=2.0),
        dict(total=True),
        dict(compute_remaining=-1),
        dict(comm_remaining=1.5),
        dict(compute_cost=math.nan),
        dict(comm_cost=-1.0),
        dict(comm_cost="1"),
        dict(max_comm=0),
        dict(max_comm=2.0),
    ],
)
def test_invalid_arguments(kw):
    args = dict(total=8, compute_remaining=3, compute_cost=1.0, comm_remaining=3, comm_cost=1.0)
    args.update(kw)
    with pytest.raises(mg.ScheduleError) as info:
        balance_workers(args.pop("total"), **args)
    assert "balance_workers" in str(info.value) and info.value.hint


# -- the static partition ----------------------------------------------------------------------
def test_static_partition_follows_the_rule():
    # 128 NVLink tasks per rank: more than the rule gives them, so neither cap binds
    g = mg.ops.gemm_allreduce(M=512, N=512, K=64, topology="2x2", tile=[32, 32], chunk_bytes=4096)
    hw = mg.H200.model_copy(update={"nvlink_max_sms": 200})  # no cap: the rule alone
    part = static_partition(g, hw)
    work = role_work(g, task_costs(g, hw))
    for rank, workers in part.items():
        wp, ws = work[rank]["compute"][1], work[rank]["nvlink"][1]
        pool = hw.sms - 1
        want = min(max(math.floor(pool * ws / (wp + ws) + 0.5), 1), pool - 1)
        assert work[rank]["nvlink"][0] > want
        assert workers == {"compute": pool - want, "nvlink": want, "rdma": 1}


def test_static_partition_gives_nvlink_at_most_one_worker_per_task():
    """4 NVLink tasks per rank beside 14 compute tasks: the rule's too-few-tasks case would give
    NVLink 44 of 131 SMs; the partition keeps 4 (the rest would idle) and computes on the rest.
    A rank with NVLink tasks only gets one worker per task, not every SM."""
    g = mg.ops.gemm_allreduce(M=64, N=128, K=64, topology="2x2", tile=[32, 32], chunk_bytes=4096)
    hw = mg.H200.model_copy(update={"nvlink_max_sms": 200})
    work = role_work(g, task_costs(g, hw))
    for rank, workers in static_partition(g, hw).items():
        assert work[rank]["nvlink"][0] == 4
        assert workers == {"compute": hw.sms - 1 - 4, "nvlink": 4, "rdma": 1}
    b = GraphBuilder("copies", mg.Topology.parse("1x2"), "float32", {})
    for src in range(2):  # 3 NVLink copies on each rank into the other, no compute
        x, y = b.buffer("x", src, 96, 32), b.buffer("y", 1 - src, 96, 32)
        for c in range(3):
            rows = (32 * c, 32 * (c + 1))
            b.task(src, Role.NVLINK, "copy", [x.region(rows)], [y.region(rows)])
    for workers in static_partition(b.finish().validate(), mg.H200).values():
        assert workers == {"compute": 0, "nvlink": 3, "rdma": 0}


def test_static_partition_caps_and_tiny_chips():
    g = mg.ops.gemm_allreduce(M=64, N=128, K=64, topology="2x2", tile=[32, 32], chunk_bytes=4096)
    for w in static_partition(g, mg.H200).values():
        assert w["nvlink"] <= mg.H200.nvlink_max_sms and w["rdma"] == 1
        assert sum(w.values()) == mg.H200.sms
    tiny = mg.H200.model_copy(update={"sms": 3})
    assert all(
        w == {"compute": 1, "nvlink": 1, "rdma": 1} for w in static_partition(g, tiny).values()
    )
    s = mg.schedule(g, hardware=tiny)
    assert all(sum(rs.workers.values()) == 3 for rs in s.ranks)
    with pytest.raises(mg.ScheduleError, match="3 roles"):
        static_partition(g, mg.H200.model_copy(update={"sms": 2}))
