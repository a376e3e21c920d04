from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import mgraph as mg
from mgraph.scheduler import DAMPING, balance_workers, role_work, static_partition, task_costs

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
    prev = draw(st.one_of(st.none(), st.integers(0, total)))
    damping = draw(st.floats(0.01, 1.0))
    return dict(
        total=total,
        compute_remaining=rp,
        compute_cost=draw(costs),
        comm_remaining=rs,
        comm_cost=draw(costs),
        previous=prev,
        damping=damping,
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


@settings(max_examples=400, deadline=None)
@given(windows())
def test_damping_moves_a_bounded_step_toward_the_target(w):
    if not (w["compute_remaining"] and w["comm_remaining"]) or w["previous"] is None:
        return
    target = balance_workers(**{**w, "previous": None})
    prev = min(max(w["previous"], 1), w["total"] - 1)
    got = balance_workers(**w)
    gap = target - prev
    assert min(prev, target) <= got <= max(prev, target)  # never overshoots
    assert abs(got - prev) <= max(1, math.floor(w["damping"] * abs(gap)))
    if gap:
        assert got != prev  # always moves, so it converges


@settings(max_examples=200, deadline=None)
@given(windows())
def test_converges_to_the_undamped_target(w):
    target = balance_workers(**{**w, "previous": None})
    comm = w["previous"]
    for _ in range(w["total"] + 1):
        comm = balance_workers(**{**w, "previous": comm})
    assert comm == target


@settings(max_examples=300, deadline=None)
@given(
    st.integers(2, 256),
    st.integers(1, 10_000),
    st.floats(1e-9, 1e3),
    st.integers(1, 10_000),
    st.floats(1e-9, 1e3),
)
def test_matches_the_formula(total, rp, cp, rs, cs):
    got = balance_workers(
        total, compute_remaining=rp, compute_cost=cp, comm_remaining=rs, comm_cost=cs
    )
    want = min(max(math.floor(rule(total, rp, cp, rs, cs) + 0.5), 1), total - 1)
    # The scaled evaluation may differ from the plain one only in the last bit of a .5 tie.
    assert abs(got - want) <= 1
    assert got == want or abs(rule(total, rp, cp, rs, cs) % 1 - 0.5) < 1e-9


@settings(max_examples=300, deadline=None)
@given(st.integers(2, 256), remaining, costs, st.integers(1, 10_000), costs, st.integers(1, 100))
def test_more_comm_work_never_means_fewer_comm_workers(total, rp, cp, rs, cs, extra):
    kw = dict(compute_remaining=rp, compute_cost=cp, comm_cost=cs)
    assert balance_workers(total, comm_remaining=rs + extra, **kw) >= balance_workers(
        total, comm_remaining=rs, **kw
    )


def test_one_role_without_work():
    kw = dict(compute_cost=1.0, comm_cost=1.0)
    assert balance_workers(10, compute_remaining=0, comm_remaining=5, **kw) == 10
    assert balance_workers(10, compute_remaining=5, comm_remaining=0, **kw) == 0
    assert balance_workers(10, compute_remaining=0, comm_remaining=0, **kw) == 0
    # No damping when a role runs dry: its workers go to the other at once.
    assert balance_workers(10, compute_remaining=0, comm_remaining=5, previous=1, **kw) == 10
    assert balance_workers(10, compute_remaining=5, comm_remaining=0, previous=9, **kw) == 0


def test_stalled_role():
    kw = dict(compute_remaining=100, comm_remaining=100)
    # Communication stalled (its measured rate is zero): the rule's limit gives it all but one.
    assert balance_workers(16, compute_cost=1e-6, comm_cost=math.inf, **kw) == 15
    assert balance_workers(16, compute_cost=math.inf, comm_cost=1e-6, **kw) == 1
    # A huge finite estimate decides as infinity does, so a kernel's float mirror agrees.
    assert balance_workers(16, compute_cost=1e-6, comm_cost=1e300, **kw) == 15
    assert balance_workers(16, compute_cost=1e308, comm_cost=1e308, **kw) == 8
    # Both stalled, or nothing measured yet: split by remaining tasks.
    assert balance_workers(16, compute_cost=math.inf, comm_cost=math.inf, **kw) == 8
    assert (
        balance_workers(
            16, compute_cost=0.0, comm_cost=0.0, compute_remaining=300, comm_remaining=100
        )
        == 4
    )
    # One cost zero: that role is done as soon as it starts; the other keeps all but one.
    assert balance_workers(16, compute_cost=0.0, comm_cost=1.0, **kw) == 15


def test_tiny_windows():
    kw = dict(compute_cost=1.0, comm_cost=1.0)
    for rp, rs in [(1, 1), (1000, 1), (1, 1000)]:
        assert balance_workers(2, compute_remaining=rp, comm_remaining=rs, **kw) == 1
    assert balance_workers(3, compute_remaining=1000, comm_remaining=1, **kw) == 1
    assert balance_workers(3, compute_remaining=1, comm_remaining=1000, **kw) == 2
    assert balance_workers(3, compute_remaining=1, comm_remaining=1, **kw) == 2  # 1.5 rounds up
    assert balance_workers(1, compute_remaining=0, comm_remaining=3, **kw) == 1
    assert balance_workers(1, compute_remaining=3, comm_remaining=0, **kw) == 0


def test_damping_sequence():
    kw = dict(compute_remaining=10, compute_cost=1.0, comm_remaining=90, comm_cost=1.0)
    steps, comm = [], 1
    while True:
        nxt = balance_workers(100, previous=comm, **kw)
        if nxt == comm:
            break
        steps.append(nxt)
        comm = nxt
    assert comm == 90
    assert steps[:3] == [45, 67, 78]  # half the gap each step (DAMPING = 0.5)
    assert DAMPING == 0.5
    assert balance_workers(100, previous=1, damping=1.0, **kw) == 90


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
        dict(previous=9),
        dict(previous=-1),
        dict(previous=2.5),
        dict(damping=0.0),
        dict(damping=1.5),
        dict(damping=math.nan),
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
    g = mg.ops.gemm_allreduce(M=64, N=128, K=64, topology="2x2", tile=[32, 32], chunk_bytes=4096)
    hw = mg.H200.model_copy(update={"nvlink_max_sms": 200})  # no cap: the rule alone
    part = static_partition(g, hw)
    work = role_work(g, task_costs(g, hw))
    for rank, workers in part.items():
        wp, ws = work[rank]["compute"][1], work[rank]["nvlink"][1]
        pool = hw.sms - 1
        want = min(max(math.floor(pool * ws / (wp + ws) + 0.5), 1), pool - 1)
        assert workers == {"compute": pool - want, "nvlink": want, "rdma": 1}


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
