"""`mgraph compile --profile`: the time of each stage of mg.compile, cold and warm. Speed itself
is measured, not asserted (benchmarks, not tests): these tests check the report is there, names
every stage and adds up."""

from __future__ import annotations

import json
import random
from pathlib import Path

import mgraph.program
from mgraph.builder import GraphBuilder
from mgraph.cli import main
from mgraph.errors import ScheduleError
from mgraph.graph import TaskGraph
from mgraph.hardware import H200
from mgraph.kinds import Role
from mgraph.scheduler import RankSchedule, Schedule, check_cut_schedule, check_schedule
from mgraph.scheduler.checks import _is_cut_counter_order, cut_queues
from mgraph.topology import Topology

EXAMPLE = str(Path(__file__).parent.parent / "examples" / "llama_block.py")


def test_compile_profile_reports_every_stage_and_adds_up(tmp_path, capsys):
    out = tmp_path / "times.json"
    before = (mgraph.program.lower, mgraph.program.trace, TaskGraph.validate)
    argv = ["compile", f"{EXAMPLE}:DecoderBlock", "--set", "hidden=64", "--set", "ffn=128",
            "--input", "1,32,64", "--plan", "block_plan", "--topology", "1x2", "--repeat", "2",
            "--profile", "--json", str(out)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    for stage in ("trace", "lower", "validate", "schedule", "total"):
        assert stage in printed, printed
    report = json.loads(out.read_text())
    assert [r["run"] for r in report["runs"]] == ["cold", "warm"]
    for run in report["runs"]:
        stages = run["stages"]
        assert {"trace", "lower", "validate", "schedule"} <= set(stages), stages
        assert run["tasks"] > 0
        assert all(v["wall_s"] >= 0 and v["cpu_s"] >= 0 for v in stages.values())
        # the stages run one after another inside the compile: together no longer than it
        assert sum(v["wall_s"] for v in stages.values()) <= run["wall_s"] + 1e-6
        assert sum(v["cpu_s"] for v in stages.values()) <= run["cpu_s"] + 1e-3
    # the timing wrappers are gone afterwards
    assert (mgraph.program.lower, mgraph.program.trace, TaskGraph.validate) == before


# -- checks skipped by construction: each skip is pinned to the check it replaces ---------------
def _random_counter_graph(rng: random.Random) -> TaskGraph:
    """Tasks on two nodes' ranks and roles with random signals and waits, counts from 1 to past
    the signals an event gets (partial waits, unmeetable ones): no builder discipline at all."""
    topo = Topology.parse(rng.choice(["1x2", "2x2", "2x1"]))
    n = rng.randint(1, 12)
    b = GraphBuilder("random_counters", topo, "float32", {})
    bufs = [b.buffer("x", r, n, 2) for r in topo.ranks]
    events = [b.event(rng.randrange(topo.world_size), f"e{i}") for i in range(rng.randint(1, 5))]
    for i in range(n):
        rank = rng.randrange(topo.world_size)
        roles = [Role.COMPUTE, Role.NVLINK] + ([Role.RDMA] if topo.nodes > 1 else [])
        role = rng.choice(roles)
        dst = topo.rail_peer(rank, 1 - topo.node_of(rank)) if role is Role.RDMA else rank
        b.task(rank, role, "copy", [bufs[rank].region((i, i + 1))],
               [bufs[dst].region((i, i + 1))], signals=rng.sample(events, rng.randint(0, min(2, len(events)))))
    signals = {e: 0 for e in events}
    for t in b.tasks:
        for e in t.signals:
            signals[e] += 1
    for t in b.tasks:
        for e in rng.sample(events, rng.randint(0, min(1, len(events)))):
            over = rng.random() < 0.1  # sometimes a count the event never reaches
            t.waits.append((e, rng.randint(1, max(1, signals[e]) + over)))
    return b.finish()


def _counter_order(graph: TaskGraph, rng: random.Random) -> list[int]:
    """A random order of the tasks: a random greedy run of the counters (taking ready tasks in
    random order, then the stuck ones), sometimes with two neighbours swapped."""
    left = list(range(len(graph.tasks)))
    count = [0] * len(graph.events)
    order: list[int] = []
    while left:
        ready = [i for i in left if all(count[e] >= c for e, c in graph.tasks[i].waits)]
        tid = rng.choice(ready or left)
        left.remove(tid)
        order.append(tid)
        for e in graph.tasks[tid].signals:
            count[e] += 1
    if len(order) > 1 and rng.random() < 0.3:
        i = rng.randrange(len(order) - 1)
        order[i], order[i + 1] = order[i + 1], order[i]
    return order


def _cut(graph: TaskGraph, order: list[int]) -> Schedule:
    ranks = []
    for r in graph.topology.ranks:
        queues = {role.value: [t for t in order if graph.tasks[t].rank == r
                               and graph.tasks[t].role == role.value] for role in Role}
        ranks.append(RankSchedule(rank=r, workers={k: 1 for k in queues}, queues=queues,
                                  batches=[[t] for t in queues["rdma"]]))
    return Schedule(graph=graph, hardware=H200, policy="test", ranks=ranks)


def test_cut_schedule_check_skips_the_queue_simulation_only_when_it_would_pass():
    """mg.schedule checks its queues with one pass over the order they were cut from
    (check_cut_schedule) instead of check_queues' simulation. The pass accepts exactly the
    counter orders (every wait met by the signals of the tasks before it: checked here by
    counting, quadratically) whose cut the queues are, and check_queues passes on every queue
    set it accepts; whatever it rejects goes to check_schedule, which names the problem."""
    accepted = rejected = 0
    for case in range(400):
        rng = random.Random(case)
        graph = _random_counter_graph(rng)
        order = _counter_order(graph, rng)
        sched = _cut(graph, order)
        spoil = rng.random()  # queues that are not the order's cut
        if spoil < 0.15:
            q = next((q for rs in sched.ranks for q in rs.queues.values() if len(q) > 1), None)
            if q is not None:
                q.reverse()
        elif spoil < 0.25:  # a task queued twice, at the end of a queue
            q = next(q for rs in sched.ranks for q in rs.queues.values() if q)
            q.append(q[0])
        cut = all(
            rs.queues[role.value] == [t for t in order if graph.tasks[t].rank == rs.rank
                                      and graph.tasks[t].role == role.value]
            for rs in sched.ranks for role in Role
        )
        met = all(
            sum(graph.tasks[s].signals.count(e) for s in order[:i]) >= c
            for i, tid in enumerate(order) for e, c in graph.tasks[tid].waits
        )
        fast = _is_cut_counter_order(graph, sched.ranks, order)
        assert fast == (met and cut), case
        try:
            check_schedule(sched)
            full = None
        except ScheduleError as e:
            full = str(e)
        if fast:
            assert full is None, (case, full)
            accepted += 1
        else:
            rejected += 1
        try:
            check_cut_schedule(sched, order)
            assert full is None, case
        except ScheduleError as e:
            assert str(e) == full, case
    assert accepted > 100 and rejected > 100, (accepted, rejected)


def test_cut_queues_check_as_the_cut_schedule_check_does():
    """mg.schedule cuts its queues from the policy's order and checks that order in the same
    pass (cut_queues): the same queues as cutting it plainly, and the same verdict as
    _is_cut_counter_order on them, also for orders that repeat or leave out a task."""
    verdicts = set()
    for case in range(300):
        rng = random.Random(case)
        graph = _random_counter_graph(rng)
        order = _counter_order(graph, rng)
        spoil = rng.random()
        if spoil < 0.1:
            order = order + order[:1]  # a task twice
        elif spoil < 0.2 and len(order) > 1:
            order = order[1:]  # a task left out
        queues, ok = cut_queues(graph, order)
        sched = _cut(graph, order)
        assert queues == [rs.queues for rs in sched.ranks], case
        assert ok == _is_cut_counter_order(graph, sched.ranks, order), case
        verdicts.add(ok)
    assert verdicts == {True, False}


def test_cut_queues_trusts_a_list_order_only_as_it_was_made():
    """list_order's result (a SimulatedOrder) skips cut_queues' counter check while it is the
    list the simulation made: the same queues and verdict True as the full check; changed
    afterwards (two tasks swapped, one repeated), or for another graph, it is checked in
    full: the same verdict as _is_cut_counter_order."""
    from mgraph.errors import MgraphError
    from mgraph.scheduler.checks import SimulatedOrder
    from mgraph.scheduler.policies import list_order, policy_input
    from mgraph.validate import topo_order

    runnable = changed = 0
    for case in range(300):
        rng = random.Random(case)
        graph = _random_counter_graph(rng)
        try:
            topo = topo_order(graph)
        except MgraphError:
            continue
        runnable += 1
        priority = [rng.random() for _ in graph.tasks]
        facts = policy_input(graph, [1.0] * len(graph.tasks), topo)
        order = list_order(graph, priority, facts if case % 2 else None)
        assert order.__class__ is SimulatedOrder, case
        queues, ok = cut_queues(graph, order)
        assert ok and queues == [rs.queues for rs in _cut(graph, list(order)).ranks], case
        if len(order) > 1:
            i = rng.randrange(len(order) - 1)
            if rng.random() < 0.5:
                order[i], order[i + 1] = order[i + 1], order[i]
            else:
                order.append(order[i])
            changed += 1
            queues, ok = cut_queues(graph, order)
            sched = _cut(graph, list(order))
            assert queues == [rs.queues for rs in sched.ranks], case
            assert ok == _is_cut_counter_order(graph, sched.ranks, order), case
        other = _random_counter_graph(random.Random(case + 1000))
        if len(other.tasks) == len(graph.tasks):
            _, ok = cut_queues(other, SimulatedOrder(list(range(len(other.tasks))), graph))
            sched = _cut(other, list(range(len(other.tasks))))
            assert ok == _is_cut_counter_order(other, sched.ranks, list(range(len(other.tasks))))
    assert runnable > 50 and changed > 30, (runnable, changed)


def test_structure_check_of_tasks_like_the_one_before():
    """_check_structure checks a region's bounds once (when its race group is made) and keeps
    the waits' verdict for the next task on its rank with equal waits (a relayout's tiles): a
    bad write of a task like the one before is still found, and equal waits on a rank of
    another node are still refused."""
    import pytest

    from mgraph.errors import GraphError

    def build(second_rank: int, bad_write: bool) -> TaskGraph:
        b = GraphBuilder("like_before", Topology.parse("2x1"), "float32", {})
        x = [b.buffer("x", r, 8, 8) for r in range(2)]
        y = [b.buffer("y", r, 8, 8) for r in range(2)]
        ev = b.event(0, "e")
        first = b.task(0, Role.COMPUTE, "copy", [x[0].region((0, 1))], [x[0].region((1, 2))],
                       signals=[ev])
        for i in range(3):  # tiles on rank 0 reading the same region, with the same waits
            b.task(0, Role.COMPUTE, "copy", [x[0].region((1, 2))], [y[0].region((i, i + 1))],
                   waits=[(ev, 1)])
        b.task(second_rank, Role.COMPUTE, "copy", [x[second_rank].region((1, 2))],
               [y[second_rank].region((5, 6))], waits=[(ev, 1)])
        graph = b.finish()
        if bad_write:
            w = graph.tasks[3].writes[0]
            graph.tasks[3].writes[0] = type(w)(w[0], 7, 9, 0, 1)  # rows past the buffer
        assert first.id == 0
        return graph

    build(0, False).validate()
    with pytest.raises(GraphError, match="outside buffer"):
        build(0, True).validate()
    with pytest.raises(GraphError, match="another node"):
        build(1, False).validate()


def test_task_costs_of_a_traced_layer_are_each_tasks_task_cost():
    """task_costs sums remote bytes in its own pass (reads only for nvlink tasks): on a traced
    2x2 layer (gemm, attention, elementwise, norm, relayout, copy and rdma tasks) every cost is
    the same float as task_cost gives that task alone."""
    import runpy

    import torch

    import mgraph as mg
    from mgraph.scheduler import task_cost, task_costs

    ns = runpy.run_path(EXAMPLE, run_name="mgraph_costs")
    torch.manual_seed(0)
    module = ns["DecoderBlock"](hidden=128, heads=4, kv_heads=2, ffn=256).eval()
    prog = mg.compile(module, (torch.randn(1, 64, 128),), plan=ns["block_plan"](),
                      topology="2x2")
    g = prog.graph
    assert {t.role for t in g.tasks} == {"compute", "nvlink", "rdma"}
    assert task_costs(g, H200) == [task_cost(t, H200, g) for t in g.tasks]
