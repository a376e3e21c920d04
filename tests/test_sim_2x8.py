"""What the simulated 2x8 configurations (benchmarks/simulate_mkernel.py) rest on, checked on
small 2x8 graphs: the default policy staggers each GPU's first pushes over its node (no NVLink
incast), the simulator pushes exactly the commands the megakernel's network plan encodes (one
per RDMA write), and the split-broadcast what-if moves the same bytes."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import mgraph as mg
from mgraph.runtime.megakernel.netplan import net_plan
from mgraph.runtime.sim import simulate

ROOT = Path(__file__).resolve().parents[1]
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


def test_split_broadcast_what_if_moves_the_same_bytes():
    """simulate_mkernel's what-if: each 7-peer broadcast becomes 7 one-peer tasks with its
    waits; every other task is kept; the NVLink and RDMA bytes do not change."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from simulate_mkernel import split_broadcasts
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    g = graph("gemm_allreduce", **AR)
    split = split_broadcasts(g)
    wide = [t for t in g.tasks if t.role == "nvlink" and len(t.writes) > 1]
    assert wide and all(len(t.writes) == 7 for t in wide)
    assert len(split.tasks) == len(g.tasks) + 6 * len(wide)
    assert all(len(t.writes) == 1 for t in split.tasks if t.role == "nvlink")
    assert split.stats().bytes_by_link == g.stats().bytes_by_link
    a = simulate(mg.schedule(g), baselines=False, fill=lambda t: 1.0)
    b = simulate(mg.schedule(split), baselines=False, fill=lambda t: 1.0)
    assert a.bytes_by_link == b.bytes_by_link
