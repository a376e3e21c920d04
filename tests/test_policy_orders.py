"""The builtin scheduling policies give the same orders (so the same queues) as their plain
definitions over explicit successor lists: the reference below is the policies' code before
they read the graph's events instead of materialising every signaler-waiter edge (a traced
2x8 layer has 15M such edges for 148k waits)."""

from __future__ import annotations

import heapq

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from test_scheduler import SMALL, build, builtin_ops, random_graphs

import mgraph as mg
from mgraph.scheduler import policies, task_costs
from mgraph.validate import topo_order

BUILTIN = ["topological", "critical_path", "remote_first"]


# -- the reference: explicit successor lists ------------------------------------------------------
def ref_succ(graph: mg.TaskGraph, order: list[int]) -> list[list[int]]:
    pos = [0] * len(graph.tasks)
    for i, tid in enumerate(order):
        pos[tid] = i
    signalers = graph.signalers()
    succ: list[list[int]] = [[] for _ in graph.tasks]
    for t in graph.tasks:
        for e, _ in t.waits:
            for s in signalers[e]:
                if pos[s] < pos[t.id] and (not succ[s] or succ[s][-1] != t.id):
                    succ[s].append(t.id)
    return succ


def ref_lengths(costs: list[float], order: list[int], succ: list[list[int]]) -> list[float]:
    length = list(costs)
    for tid in reversed(order):
        best = 0.0
        for s in succ[tid]:
            best = max(best, length[s])
        length[tid] = costs[tid] + best
    return length


def ref_waves(graph: mg.TaskGraph, order: list[int], succ: list[list[int]]) -> list[int]:
    rdma, tasks, never = "rdma", graph.tasks, 1 << 30
    level = [0] * len(tasks)
    for tid in order:
        level[tid] += tasks[tid].role == rdma
        for s in succ[tid]:
            level[s] = max(level[s], level[tid])
    need = [never] * len(tasks)
    for tid in reversed(order):
        best = level[tid] if tasks[tid].role == rdma else never
        for s in succ[tid]:
            best = min(best, need[s])
        need[tid] = best
    return need


def ref_list_order(graph: mg.TaskGraph, priority) -> list[int]:
    tasks = graph.tasks
    keyed = sorted(range(len(tasks)), key=lambda t: (priority[t], t))
    rank_of = {tid: i for i, tid in enumerate(keyed)}
    count = [0] * len(graph.events)
    missing = {t.id: len(t.waits) for t in tasks}
    heap = [rank_of[t.id] for t in tasks if not t.waits]
    heapq.heapify(heap)
    order = []
    while heap:
        tid = keyed[heapq.heappop(heap)]
        order.append(tid)
        for e in tasks[tid].signals:
            count[e] += 1
            for w in tasks:
                for e2, c in w.waits:
                    if e2 == e and count[e] == c:
                        missing[w.id] -= 1
                        if missing[w.id] == 0:
                            heapq.heappush(heap, rank_of[w.id])
    return order


def ref_orders(graph: mg.TaskGraph) -> dict[str, list[int]]:
    costs = task_costs(graph, mg.H200)
    order = topo_order(graph)
    succ = ref_succ(graph, order)
    length = ref_lengths(costs, order, succ)
    turn = policies.push_rotation(graph)
    waves = ref_waves(graph, order, succ)
    return {
        "topological": ref_list_order(graph, range(len(graph.tasks))),
        "critical_path": ref_list_order(
            graph, [(-x, r) for x, r in zip(length, turn, strict=True)]
        ),
        "remote_first": ref_list_order(
            graph, [(w, -x, r) for w, x, r in zip(waves, length, turn, strict=True)]
        ),
    }


def check_same(graph: mg.TaskGraph) -> None:
    want = ref_orders(graph)
    costs = task_costs(graph, mg.H200)
    facts = policies.policy_input(graph, costs)
    assert facts.order == topo_order(graph)
    assert facts.succ == ref_succ(graph, facts.order)  # what a user policy may read
    for name in BUILTIN:
        assert policies.get_policy(name)(graph, facts) == want[name], name
        s = mg.schedule(graph, policy=name)
        for r in s.ranks:
            for role, queue in r.queues.items():
                assert queue == [
                    t
                    for t in want[name]
                    if graph.tasks[t].rank == r.rank and graph.tasks[t].role == role
                ]


@pytest.mark.parametrize("topology", ["1x2", "2x2", "2x4"])
def test_builtin_ops_keep_their_orders(topology):
    for op in builtin_ops():
        if op in SMALL:
            check_same(build(op, topology))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(random_graphs())
def test_random_graphs_with_partial_waits_keep_their_orders(g):
    check_same(g)


def test_traced_block_keeps_its_orders():
    """A traced decoder block under TP+SP: join events with many signalers and waiters."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).parent.parent / "examples" / "llama_block.py"
    spec = importlib.util.spec_from_file_location("llama_block_orders", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    torch.manual_seed(0)
    block = mod.DecoderBlock(hidden=64, heads=4, kv_heads=2, ffn=128)
    prog = mg.compile(block, (torch.randn(1, 32, 64),), plan=mod.block_plan(), topology="2x2")
    check_same(prog.graph)


def test_a_ranks_nvlink_copies_go_chunk_by_chunk_from_the_next_gpu():
    """Each rank of a 1x4 node copies 3 chunks into every peer, emitted peer by peer from GPU 0
    (every chunk's copy to one peer before any to the next), none waiting on anything: under the
    path-length policies every copy ties, and push_rotation ranks a rank's copies into one peer
    by their count first, so rank r's NVLink queue moves chunk by chunk, each chunk's copies
    from GPU r+1 on (by peer alone it held all three chunks' copies to r+1 first; by id, the
    program's peer order from GPU 0)."""
    from mgraph.builder import GraphBuilder
    from mgraph.kinds import Role

    b = GraphBuilder("hand", mg.Topology.parse("1x4"), "float32", {})
    src = [b.buffer("x", r, 96, 64) for r in range(4)]
    dst = {(r, p): b.buffer(f"y{r}", p, 96, 64) for r in range(4) for p in range(4) if p != r}
    for r in range(4):
        for p in range(4):
            for c in range(3):
                if p != r:
                    rows = (32 * c, 32 * c + 32)
                    b.task(r, Role.NVLINK, "copy", [src[r].region(rows)],
                           [dst[r, p].region(rows)])  # fmt: skip
    g = b.finish().validate()

    def queued(s, r):  # (chunk, peer) of each copy in rank r's NVLink queue
        return [(g.tasks[t].writes[0].row0 // 32, g.buffers[g.tasks[t].writes[0].buffer].rank)
                for t in s.ranks[r].queues["nvlink"]]  # fmt: skip

    for policy in ("critical_path", "network_first", "remote_first"):
        s = mg.schedule(g, policy=policy)
        for r in range(4):
            want = [(c, (r + i) % 4) for c in range(3) for i in (1, 2, 3)]
            assert queued(s, r) == want, (policy, r)
    s = mg.schedule(g, policy="topological")
    assert queued(s, 1) == [(c, p) for p in (0, 2, 3) for c in range(3)]
