"""What the simulated 2x8 configurations (benchmarks/simulate_mkernel.py) rest on, checked on
small 2x8 graphs: the default policy staggers each GPU's first pushes over its node (no NVLink
incast), the simulator pushes exactly the commands the megakernel's network plan encodes (one
per RDMA write), and the default policy takes the staged order where its network model predicts
it faster (GEMM+AR) and longest_path's where not (AG+GEMM). The node broadcast split per
(chunk, peer): tests/test_node_broadcast_split.py."""

from __future__ import annotations

import pytest
import torch

import mgraph as mg
from mgraph.runtime.megakernel.netplan import net_plan
from mgraph.runtime.sim import simulate
from mgraph.scheduler import Schedule

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


# -- the default policy's choice on graphs with RDMA tasks ---------------------------------------
AR_STAGED = dict(M=4096, N=4096, K=4096, tile=[128, 256], chunk_bytes=1 << 20,
                 broadcast_bytes=1 << 18)  # fmt: skip  # simulated.md's 4096x256x4096
AG_PLAIN = dict(M=4096, N=4096, K=4096, tile=[128, 256], chunk_bytes=1 << 18)


def cut(g: mg.TaskGraph, order: list[int]) -> list[dict[str, list[int]]]:
    queues = [{"compute": [], "nvlink": [], "rdma": []} for _ in g.topology.ranks]
    for t in order:
        queues[g.tasks[t].rank][g.tasks[t].role].append(t)
    return queues


def staged_and_plain(g: mg.TaskGraph):
    from mgraph.scheduler import policy_input, static_partition, task_costs
    from mgraph.scheduler.policies import critical_path_lengths, push_rotation, staged_order

    part = static_partition(g, mg.H200)
    facts = policy_input(g, task_costs(g, mg.H200), workers=[part[r] for r in g.topology.ranks],
                         hardware=mg.H200)  # fmt: skip
    staged = staged_order(g, facts, critical_path_lengths(facts), push_rotation(g))
    return cut(g, staged), [r.queues for r in mg.schedule(g, policy="longest_path").ranks]


def test_default_policy_stages_the_network_where_it_predicts_a_gain():
    """2x8 GEMM+AR (simulated.md's 4096x256x4096 row): critical_path takes the staged order,
    which network_makespan predicts shorter than longest_path's. Its compute queues run rail
    sums between GEMM tiles, its RDMA queues interleave the rail gathers one send behind the
    rail sends, and the simulator agrees: faster than longest_path's and network_first's."""
    g = graph("gemm_allreduce", **AR_STAGED)
    staged, plain = staged_and_plain(g)
    sched = mg.schedule(g)
    assert [r.queues for r in sched.ranks] == staged != plain
    names = [g.tasks[t].name.split()[0] for t in sched.ranks[0].queues["compute"]]
    last_tile = max(i for i, n in enumerate(names) if n == "gemm")
    assert names.index("rail-reduce") < last_tile
    sends = [g.tasks[t].name.split()[0] for t in sched.ranks[0].queues["rdma"]]
    assert sends[:3] == ["rail-send", "rail-send", "rail-gather"], sends
    times = {p: simulate(mg.schedule(g, policy=p), baselines=False).predicted_s
             for p in ("longest_path", "network_first")}  # fmt: skip
    default = simulate(sched, baselines=False).predicted_s
    assert default < 0.95 * min(times.values()), (default, times)


def test_default_policy_keeps_longest_path_where_staging_would_block_tiles():
    """2x8 AG+GEMM: staging would queue the tiles of gathered rows ahead of the local ones (a
    tile whose rows cross the network holds its worker for the transfer); network_makespan
    predicts it slower, so critical_path keeps longest_path's order, and the simulator agrees."""
    g = graph("allgather_gemm", **AG_PLAIN)
    staged, plain = staged_and_plain(g)
    sched = mg.schedule(g)
    assert [r.queues for r in sched.ranks] == plain != staged
    kept = simulate(sched, baselines=False).predicted_s
    ranks = [r.model_copy(update={"queues": q}) for r, q in zip(sched.ranks, staged, strict=True)]
    other = Schedule(graph=g, hardware=sched.hardware, policy="staged", ranks=ranks)
    assert kept < simulate(other, baselines=False).predicted_s
