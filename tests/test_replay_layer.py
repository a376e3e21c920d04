"""benchmarks/replay_layer.py: the queue model that replays a schedule with measured per-kind
task times, checked on a hand-built graph whose times are worked out below, against the
scheduler's own queue model on a traced layer, and end to end on a small layer."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

import mgraph as mg
from mgraph.builder import GraphBuilder
from mgraph.kinds import Role
from mgraph.scheduler import RankSchedule, Schedule
from mgraph.scheduler.placement import Pools, queue_times

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "replay_layer.py"
SMALL = dict(hidden=128, heads=4, kv_heads=2, ffn=256, seq=128, dtype="float32")


def _load():
    spec = importlib.util.spec_from_file_location("replay_layer", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["replay_layer"] = module  # its dataclass looks its module up
    spec.loader.exec_module(module)
    return module


rl = _load()


@pytest.fixture(scope="module")
def small_layer():
    return rl.layer_program(**SMALL)


def hand_schedule() -> tuple[Schedule, list[float]]:
    """Two workers, queue a b c d: a (3 us) and b (1 us) wait for nothing, c (2 us) waits for
    a, d (1 us) for b and c.

    t=0: worker 0 takes a, worker 1 takes b. t=1: worker 1 frees, takes c, waits for a until
    3, runs to 5. t=3: worker 0 frees, takes d, waits for c until 5, runs to 6."""
    b = GraphBuilder("hand", mg.Topology.parse("1x1"), "float32", {})
    src = b.buffer("src", 0, 4, 4)
    dst = b.buffer("dst", 0, 4, 4)

    def task(i, name, producers):
        return b.task(
            0,
            Role.COMPUTE,
            "copy",
            [src.region((i, i + 1))],
            [dst.region((i, i + 1))],
            waits=b.after(0, producers),
            name=f"{name}: copy r0 [{i}]",
        )

    ta = task(0, "a", [])
    tb = task(1, "b", [])
    tc = task(2, "c", [ta])
    td = task(3, "d", [tb, tc])
    g = b.finish().validate()
    queues = {"compute": [ta.id, tb.id, tc.id, td.id], "nvlink": [], "rdma": []}
    s = Schedule(
        graph=g,
        hardware=mg.H200,
        policy="hand",
        ranks=[RankSchedule(rank=0, workers={"compute": 2}, queues=queues, batches=[])],
    )
    s.check()
    return s, [3e-6, 1e-6, 2e-6, 1e-6]


def test_replay_of_a_hand_built_schedule():
    s, times = hand_schedule()
    rep = rl.replay(s, times)
    us = lambda xs: [round(x * 1e6, 9) for x in xs]  # noqa: E731
    assert us(rep.take) == [0, 0, 1, 3]
    assert us(rep.ready) == [0, 0, 3, 5]
    assert us(rep.end) == [3, 1, 5, 6]
    assert rep.program == [0, 1, 1, 0]
    assert rep.makespan == pytest.approx(6e-6)
    assert rep.wait == {"copy": pytest.approx(4e-6)}  # c waited 2 us, d 2 us
    # each wait is charged to the signaller met last: c to a, d to c (b was done at 1)
    rows = rl.boundaries(s.graph, rep)
    assert [(r["waiter"], r["waits_for"], r["tasks"], r["wait_ms"]) for r in rows] == [
        ("c: copy", "a: copy", 1, 0.002),
        ("d: copy", "c: copy", 1, 0.002),
    ]
    # worker 1 ends at 5, worker 0 at 6: 1 us idle after the last task
    assert rl.tail_idle(s, rep) == pytest.approx(1e-6)
    s.ranks[0].workers["compute"] = 3  # a third worker that never ran anything: 6 us more
    assert rl.tail_idle(s, rep) == pytest.approx(7e-6)


def test_stage_names():
    assert rl.stage("linear_4: matmul r0 [0:128,0:256]") == "linear_4: matmul"
    assert rl.stage("scaled_dot_product_attention: attn r12 bh0 q3968 k0") == (
        "scaled_dot_product_attention: attn"
    )
    assert rl.stage("mul_4: silu*mul r0 [0:64]") == "mul_4: silu*mul"
    assert rl.stage("plain") == "plain"


def test_task_times_scale_each_kind_to_its_measured_mean(small_layer):
    g = small_layer.graph
    kinds = {t.kind for t in g.tasks}
    measured = {k: 10.0 + 7 * i for i, k in enumerate(sorted(kinds - {"ewise"}))}
    times = rl.task_times(g, measured)
    costs = mg.scheduler.task_costs(g, mg.H200)
    for kind in kinds:
        ids = [t.id for t in g.tasks if t.kind == kind]
        mean = sum(times[i] for i in ids) / len(ids)
        if kind in measured:
            assert mean == pytest.approx(measured[kind] * 1e-6)
            # within a kind the cost model's proportions stay
            ratio = times[ids[0]] / costs[ids[0]]
            assert all(times[i] == pytest.approx(costs[i] * ratio) for i in ids)
        else:  # no measurement: the cost model's time
            assert all(times[i] == costs[i] for i in ids)


def test_replay_is_the_schedulers_queue_model_on_a_traced_layer(small_layer):
    """The replay (queues merged by which program frees first) and the scheduler's queue model
    (placement.queue_times, one pass in the order the queues were cut from) are two codings
    of one model: on the traced layer they give every task the same times. And the replay is
    a schedule: no program runs two tasks at once, no task starts before its inputs end."""
    g, s = small_layer.graph, small_layer.schedule
    times = rl.task_times(g, rl.kind_times_us())
    rep = rl.replay(s, times)
    (rs,) = s.ranks
    order = rs.queues["compute"]  # one rank, compute only: the global order itself
    assert sum(len(q) for q in rs.queues.values()) == len(order) == len(g.tasks)
    take, ready, end = queue_times(g, Pools(g, [rs.workers]), order, times)
    assert rep.take == pytest.approx(take) and rep.ready == pytest.approx(ready)
    assert rep.end == pytest.approx(end)
    by_program: dict[int, list[tuple[float, float]]] = {}
    for t in g.tasks:
        by_program.setdefault(rep.program[t.id], []).append((rep.take[t.id], rep.end[t.id]))
    for spans in by_program.values():
        spans.sort()
        assert all(a[1] <= b[0] + 1e-15 for a, b in zip(spans, spans[1:], strict=False))
    signalers = g.signalers()
    for t in g.tasks:
        for e, _ in t.waits:
            assert all(rep.ready[t.id] >= rep.end[x] for x in signalers[e])
    assert len(by_program) <= rs.workers["compute"]


def test_main_writes_the_report(tmp_path, capsys):
    sizes = [f"--{k.replace('_', '-')}={v}" for k, v in SMALL.items()]
    assert rl.main([*sizes, "--ewise-us", "15", "--oracle", "--sim", "--out", str(tmp_path)]) == 0
    out = json.loads((tmp_path / "replay_layer.json").read_text())
    assert [c["ewise_us"] for c in out["cases"]] == [80.38, 15.0]
    for case in out["cases"]:
        names = [r["policy"] for r in case["rows"]]
        assert names == ["longest_path", "critical_path", "critical_path (oracle costs)"]
        for row in case["rows"]:
            # a program per task at best: never below the work spread over all programs
            assert row["makespan_ms"] >= case["work_bound_ms"] - 1e-3
            assert row["wait_ms"] == pytest.approx(sum(row["wait_ms_per_kind"].values()), abs=0.05)
            assert row["sim_ms"] > 0
    printed = capsys.readouterr().out
    assert "ewise at 15 us a task" in printed and "waits for" in printed
