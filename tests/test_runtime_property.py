"""Property test: random DAGs on random topologies, random worker counts and random queue orders
consistent with a topological order never deadlock, and the reference runtime's memory equals a
sequential topological execution."""

from __future__ import annotations

import random

import pytest
import torch

import mgraph as mg
from mgraph.builder import GraphBuilder
from mgraph.hardware import H200
from mgraph.kinds import Role
from mgraph.runtime.reference import ReferenceRuntime
from mgraph.runtime.sequential import execute_sequential
from mgraph.scheduler import RankSchedule, Schedule, check_schedule
from mgraph.settings import Settings
from mgraph.validate import order_edges

CASES = 500
TOPOLOGIES = ["1x1", "1x2", "2x1", "2x2", "1x3", "3x1"]


def random_graph(rng: random.Random) -> mg.TaskGraph:
    topo = mg.Topology.parse(rng.choice(TOPOLOGIES))
    n, cols = rng.randint(2, 20), rng.randint(1, 4)
    world = topo.world_size
    b = GraphBuilder("random_dag", topo, "float32", {})
    b.global_input("x", (world * n, cols))
    x = [b.bound_buffer("x", r, "x", [((r * n, (r + 1) * n), (0, cols))]) for r in topo.ranks]
    val = [b.buffer("val", r, n, cols) for r in topo.ranks]
    written: list[tuple[mg.Task, int, int]] = []  # (writer, rank of the row, row)
    for i in range(n):
        rank = rng.randrange(world)
        node = topo.node_of(rank)
        roles = [Role.COMPUTE, Role.NVLINK] + ([Role.RDMA] if topo.nodes > 1 else [])
        role = rng.choice(roles)
        if role is Role.RDMA:
            dst = topo.rail_peer(rank, rng.choice([m for m in range(topo.nodes) if m != node]))
            local = [w for w in written if w[1] == rank]
            src = rng.choice(local) if local and rng.random() < 0.7 else None
            read = val[rank].region((src[2], src[2] + 1)) if src else x[rank].region((i, i + 1))
            producers = [src[0]] if src else []
            reads, kind = [read], "copy"
        else:
            dst = rank if role is Role.COMPUTE else rng.choice(topo.node_ranks(node))
            reach = (
                [w for w in written if w[1] == rank]
                if role is Role.COMPUTE
                else [w for w in written if topo.node_of(w[1]) == node]
            )
            sources = rng.sample(reach, min(len(reach), rng.randint(0, 3)))
            reads = [x[rank].region((i, i + 1))]
            reads += [val[w[1]].region((w[2], w[2] + 1)) for w in sources]
            producers = [w[0] for w in sources]
            kind = "reduce"
        # Extra ordering-only dependencies on tasks this rank can hear from (same node).
        audible = [
            w[0] for w in written
            if topo.node_of(w[0].rank) == node
            and (w[0].role != "rdma" or topo.node_of(w[1]) == node)
        ]
        producers += rng.sample(audible, min(len(audible), rng.randint(0, 2)))
        producers = list({p.id: p for p in producers}.values())
        task = b.task(rank, role, kind, reads, [val[dst].region((i, i + 1))],
                      waits=b.after(rank, producers), name=f"t{i}")
        written.append((task, dst, i))
    return b.finish()


def random_schedule(graph: mg.TaskGraph, rng: random.Random) -> Schedule:
    """Queues cut from a random topological order (random choice among ready tasks)."""
    succ = order_edges(graph)
    indeg = [0] * len(graph.tasks)
    for outs in succ:
        for s in outs:
            indeg[s] += 1
    ready = [t.id for t in graph.tasks if indeg[t.id] == 0]
    order = []
    while ready:
        tid = ready.pop(rng.randrange(len(ready)))
        order.append(tid)
        for s in succ[tid]:
            indeg[s] -= 1
            if indeg[s] == 0:
                ready.append(s)
    assert len(order) == len(graph.tasks)
    ranks = []
    for r in graph.topology.ranks:
        queues = {role.value: [t for t in order if graph.tasks[t].rank == r and graph.tasks[t].role == role.value] for role in Role}
        workers = {role: (rng.randint(1, 3) if q else 0) for role, q in queues.items()}
        ranks.append(RankSchedule(rank=r, workers=workers, queues=queues,
                                  batches=[[t] for t in queues["rdma"]]))
    sched = Schedule(graph=graph, hardware=H200, policy="random", ranks=ranks)
    check_schedule(sched)
    return sched


def test_random_dags_never_deadlock_and_match_sequential():
    for case in range(CASES):
        rng = random.Random(case)
        graph = random_graph(rng)
        graph.validate()
        sched = random_schedule(graph, rng)
        inputs = {"x": torch.randn(graph.inputs["x"].shape, generator=torch.Generator().manual_seed(case))}
        want = execute_sequential(graph, inputs)
        settings = Settings(watchdog_s=5.0, threads_per_role=rng.randint(1, 3), fifo_slots=rng.choice([2, 4, 64]))
        rt = ReferenceRuntime(sched, settings)
        rt.run(inputs)
        for buf_id, tensor in want.items():
            got = rt.memory[buf_id]
            assert torch.equal(got.isnan(), tensor.isnan()), f"case {case}: {buf_id} written differently"
            assert torch.equal(got.nan_to_num(), tensor.nan_to_num()), f"case {case}: {buf_id} differs"


@pytest.mark.parametrize("case", range(3))
def test_random_graph_generator_is_not_trivial(case):
    rng = random.Random(1000 + case)
    kinds = set()
    for _ in range(50):
        g = random_graph(rng)
        kinds |= {(t.role, t.kind) for t in g.tasks}
    assert {("compute", "reduce"), ("nvlink", "reduce"), ("rdma", "copy")} <= kinds
