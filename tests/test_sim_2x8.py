"""What the simulated 2x8 configurations (benchmarks/simulate_mkernel.py) rest on, checked on
small 2x8 graphs: the default policy staggers each GPU's first pushes over its node (no NVLink
incast), and the simulator pushes exactly the commands the megakernel's network plan encodes (one
per RDMA write). The node broadcast split per (chunk, peer): tests/test_node_broadcast_split.py."""

from __future__ import annotations

import pytest
import torch

import mgraph as mg
from mgraph.runtime.megakernel.netplan import net_plan
from mgraph.runtime.sim import simulate

AR = dict(M=1024, N=1024, K=1024, tile=[64, 128], chunk_bytes=32768)
RS = dict(M=1024, N=1024, K=1024, tile=[64, 128], chunk_bytes=32768)


def graph(op: str, **kw) -> mg.TaskGraph:
    return mg.ops.get_op(op)(topology="2x8", dtype=torch.bfloat16, **kw)


def peers_written(g: mg.TaskGraph, tid: int) -> set[int]:
    t = g.tasks[tid]
    node = set(g.topology.node_ranks(g.topology.node_of(t.rank)))
    return ({g.buffers[w.buffer].rank for w in t.writes} - {t.rank}) & node


@pytest.mark.parametrize(("op", "kw"), [("gemm_allreduce", AR), ("gemm_reduce_scatter", RS)])
def test_first_pushes_rotate_over_the_node(op, kw):
    """Each GPU's first epilogue pushes go to its node's next GPU (rank r -> r+1 mod 8), so the
    8 GPUs start writing into 8 different GPUs: a permutation, no incast on one GPU's ingress."""
    g = graph(op, **kw)
    sched = mg.schedule(g)
    for node in range(2):
        firsts = []
        for rank in g.topology.node_ranks(node):
            queue = sched.ranks[rank].queues["compute"]
            first = next(t for t in queue if len(peers_written(g, t)) == 1)
            firsts.append(peers_written(g, first).pop())
        ranks = list(g.topology.node_ranks(node))
        assert firsts == ranks[1:] + ranks[:1], firsts


@pytest.mark.parametrize(("op", "kw"), [("gemm_allreduce", AR), ("gemm_reduce_scatter", RS)])
def test_one_proxy_command_per_rdma_write_as_netplan_encodes(op, kw):
    """The simulator's proxy executes the commands the megakernel pushes (netplan): at 2x8 one
    WRITE per rdma task, whose one arrival flag serves every event it signals."""
    g = graph(op, **kw)
    plan = net_plan(g)
    res = simulate(mg.schedule(g), baselines=False)
    rdma = [t for t in g.tasks if t.role == "rdma"]
    encoded = sum(len(plan.commands[t.id]) for t in rdma)
    assert res.stats["commands"] == encoded == len(rdma)


# -- the network_first policy ---------------------------------------------------------------------
def ref_slots(g: mg.TaskGraph, facts) -> list[int]:
    """network_slots over explicit successor lists (PolicyInput.succ)."""
    from mgraph.scheduler.policies import network_waves

    never = 1 << 30
    waves = network_waves(g, facts)
    own = {}
    for rank in g.topology.ranks:
        sends = sorted((waves[t.id], t.id) for t in g.tasks if t.rank == rank and t.role == "rdma")
        own.update({tid: slot for slot, (_, tid) in enumerate(sends)})
    need = [never] * len(g.tasks)
    for tid in reversed(facts.order):
        need[tid] = min([own.get(tid, never)] + [need[s] for s in facts.succ[tid]])
    return need


@pytest.mark.parametrize("op", ["gemm_allreduce", "gemm_reduce_scatter", "allgather_gemm"])
@pytest.mark.parametrize("topology", ["1x2", "2x2", "2x4"])
def test_network_slots_match_their_definition(op, topology):
    from test_scheduler import SMALL, build

    from mgraph.scheduler import policy_input, task_costs
    from mgraph.scheduler.policies import network_slots

    g = build(op, topology) if op in SMALL else graph(op, **AR)
    facts = policy_input(g, task_costs(g, mg.H200))
    assert network_slots(g, facts) == ref_slots(g, facts)


@pytest.mark.parametrize("op", ["gemm_allreduce", "gemm_reduce_scatter", "allgather_gemm"])
def test_network_first_is_critical_path_on_one_node(op):
    """No RDMA task, no slot: the single-node schedules stay critical_path's (pinned in
    test_schedule_pin.py)."""
    g = mg.ops.get_op(op)(topology="1x2", dtype=torch.bfloat16, M=512, N=1024, K=512,
                          tile=[64, 128])  # fmt: skip
    a, b = mg.schedule(g, policy="critical_path"), mg.schedule(g, policy="network_first")
    assert [r.queues for r in a.ranks] == [r.queues for r in b.ranks]


def test_network_first_starts_node_sums_and_sends_during_the_gemm():
    """critical_path queues the GEMM tiles in blocks by path length (the tiles that push into a
    peer first: longer by their own push), half of them before the first node sum; network_first
    puts chunk c's node sum right after chunk c's tiles, and keeps each rank's RDMA queue
    wave-major (every rail send before any rail gather)."""
    g = graph("gemm_allreduce", **AR)

    def first_sum(policy: str) -> int:
        q = mg.schedule(g, policy=policy).ranks[0].queues["compute"]
        names = [g.tasks[t].name for t in q]
        return next(i for i, n in enumerate(names) if n.startswith("node-reduce"))

    crit, first = first_sum("critical_path"), first_sum("network_first")
    assert crit == 64 and first == 16
    sched = mg.schedule(g, policy="network_first")
    for rs in sched.ranks:
        kinds = [g.tasks[t].name.split()[0] for t in rs.queues["rdma"]]
        sends = kinds.count("rail-send")
        assert sends and kinds[:sends] == ["rail-send"] * sends, kinds
    crit = simulate(mg.schedule(g, policy="critical_path"), baselines=False).predicted_s
    first = simulate(sched, baselines=False).predicted_s
    assert first <= crit


def test_several_rdma_workers_stalled_on_a_full_fifo_all_resume():
    """Each rdma worker whose push finds the FIFO full waits in line; the proxy's freed slots
    resume them in order (the simulator once kept one stalled push per rank and lost the
    others: "simulation stalled" at 2x8 with 2+ rdma workers)."""
    from mgraph.settings import Settings

    g = graph("gemm_allreduce", **AR)
    sched = mg.schedule(g, workers={"compute": 100, "nvlink": 16, "rdma": 4})
    res = simulate(sched, settings=Settings(fifo_slots=2), baselines=False)
    rdma = [t for t in g.tasks if t.role == "rdma"]
    assert res.stats["commands"] == len(rdma)
    assert sorted(r.task for r in res.trace.records) == list(range(len(g.tasks)))
    one = simulate(mg.schedule(g), settings=Settings(fifo_slots=2), baselines=False)
    assert one.stats["commands"] == len(rdma)
