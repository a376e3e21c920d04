from __future__ import annotations

import time

import pytest
import torch

import mgraph as mg
from helpers import TOPOLOGIES, check_graph, written_once


@pytest.mark.parametrize("topology", TOPOLOGIES)
@pytest.mark.parametrize("hierarchical", [True, False])
def test_matches_torch(topology, hierarchical):
    g = mg.ops.gemm_allreduce(
        M=64, N=96, K=32, topology=topology, tile=[16, 32], chunk_bytes=2048,
        hierarchical=hierarchical,
    )
    check_graph(g)
    written_once(g, "out")


@pytest.mark.parametrize("topology", ["2x4", "4x2", "2x1", "3x2"])
def test_rdma_bytes_hierarchical(topology):
    topo = mg.Topology.parse(topology)
    M, N = 128, 256
    D = M * N * 4
    kw = dict(M=M, N=N, K=96, topology=topo, tile=[16, 32], chunk_bytes=4096)
    hier = mg.ops.gemm_allreduce(**kw).stats()
    flat = mg.ops.gemm_allreduce(**kw, hierarchical=False).stats()
    n = topo.nodes
    # Bandwidth-optimal all-reduce over the nodes: 2 D (n-1)/n per node, which is D on 2 nodes.
    assert sum(hier.rdma_sent_per_node) == n * 2 * D * (n - 1) // n
    if n == 2:
        assert hier.rdma_sent_per_node == [D, D]
    assert sum(flat.rdma_sent_per_node) == topo.gpus_per_node * sum(hier.rdma_sent_per_node)


def test_stats_structure_2x4():
    g = mg.ops.gemm_allreduce(M=64, N=64, K=64, topology="2x4", tile=[32, 32])
    st = g.stats()
    kinds = st.by_role_kind()
    assert kinds[("compute", "gemm")] == 8 * 4  # every rank computes every tile's partial
    assert kinds[("compute", "reduce")] == 2 * 4 + 4  # node reduce per tile and node, + rail
    # The node reduce's 3 pushes per tile and node ride on the GEMM epilogues (a GEMM tile of
    # a non-owner stores its partial straight into the owner): only the broadcasts are copies,
    # one per (chunk, node peer): 8 owners x 1 chunk x 3 peers.
    assert kinds[("nvlink", "copy")] == 8 * 3
    pushed = [t for t in g.tasks if t.kind == "gemm"
              and g.buffers[t.writes[0].buffer].rank != t.rank]
    assert len(pushed) == 2 * 4 * 3
    assert all(len(t.writes) == 1 for t in pushed)
    gemm_flops = [sum(t.flops for t in g.tasks_on(r) if t.kind == "gemm") for r in range(8)]
    assert gemm_flops == [2 * 64 * 64 * 8] * 8  # K=64 sharded 8 ways
    assert all(f > 2 * 64 * 64 * 8 for f in st.flops_per_rank)  # plus the reductions
    assert st.bytes_by_link["rdma"] == 2 * 64 * 64 * 4


def test_bf16_graph_and_dtype_names():
    g = mg.ops.gemm_allreduce(M=64, N=64, K=64, topology="1x2", dtype=torch.bfloat16, tile=[32, 32])
    assert g.dtype == "bfloat16"
    assert all(b.dtype == "bfloat16" for b in g.buffers.values())
    check_graph(g, tol=1e-2)


def test_build_time_2x8_large():
    start = time.perf_counter()
    g = mg.ops.gemm_allreduce(M=8192, N=8192, K=4096, topology="2x8", dtype=torch.bfloat16)
    elapsed = time.perf_counter() - start
    assert len(g.tasks) > 16 * 2048
    st = g.stats()
    assert st.rdma_sent_per_node == [8192 * 8192 * 2] * 2
    print(f"2x8 gemm_allreduce 8192x8192x4096: {len(g.tasks)} tasks built in {elapsed:.3f} s")


@pytest.mark.parametrize(
    "kw, err",
    [
        (dict(M=64, N=64, K=63), mg.ShapeError),  # K not divisible by the world size
        (dict(M=0, N=64, K=64), mg.ShapeError),
        (dict(M=-4, N=64, K=64), mg.ShapeError),
        (dict(M=64, N=64), mg.ShapeError),  # missing K
        (dict(M=64, N=64, K=64, tiles=[8, 8]), mg.UnknownNameError),
    ],
)
def test_bad_input(kw, err):
    with pytest.raises(err) as info:
        mg.ops.gemm_allreduce(topology="1x2", tile=[32, 32], **kw)
    assert "gemm_allreduce" in str(info.value)


def test_sizes_not_multiple_of_the_tile_have_short_edge_tiles():
    g = mg.ops.gemm_allreduce(M=100, N=72, K=64, topology="2x2", tile=[32, 32])
    assert {t.writes[0].shape for t in g.tasks if t.kind == "gemm"} == {
        (32, 32), (32, 8), (4, 32), (4, 8)}
    check_graph(g)
