from __future__ import annotations

import pytest
import torch

import mgraph as mg
from helpers import TOPOLOGIES, check_graph, written_once


@pytest.mark.parametrize("topology", TOPOLOGIES)
@pytest.mark.parametrize("hierarchical", [True, False])
def test_matches_torch(topology, hierarchical):
    # 2 row tiles per rank, 3 column tiles, 2 tiles per network chunk.
    g = mg.ops.gemm_reduce_scatter(
        M=128,
        N=96,
        K=32,
        topology=topology,
        tile=[8, 32],
        chunk_bytes=2048,
        hierarchical=hierarchical,
    )
    check_graph(g)
    written_once(g, "out")
    world = g.topology.world_size
    assert all(b.shape == (128 // world, 96) for b in g.buffers.values() if b.name == "out")


@pytest.mark.parametrize("topology", ["1x1", "3x2", "2x3"])
@pytest.mark.parametrize("hierarchical", [True, False])
def test_odd_topologies(topology, hierarchical):
    world = mg.Topology.parse(topology).world_size
    g = mg.ops.gemm_reduce_scatter(
        M=16 * world, N=64, K=8 * world, topology=topology, tile=[8, 32], chunk_bytes=1024,
        hierarchical=hierarchical,
    )  # fmt: skip
    check_graph(g, seed=1)
    written_once(g, "out")


@pytest.mark.parametrize("topology", ["2x4", "4x2", "2x1", "3x2", "1x4"])
def test_rdma_bytes_per_node(topology):
    topo = mg.Topology.parse(topology)
    M, N = 96, 64
    D = M * N * 4
    kw = dict(M=M, N=N, K=48, topology=topo, tile=[4, 32], chunk_bytes=1024)
    hier = mg.ops.gemm_reduce_scatter(**kw).stats()
    flat = mg.ops.gemm_reduce_scatter(**kw, hierarchical=False).stats()
    n, G = topo.nodes, topo.gpus_per_node
    # Each node's contribution to every row crosses the network once: D (n-1)/n per node.
    assert hier.rdma_sent_per_node == [D * (n - 1) // n] * n
    assert hier.rdma_received_per_node == [D * (n - 1) // n] * n
    # The flat baseline sends every GPU's full partial: exactly G times more.
    assert flat.rdma_sent_per_node == [G * x for x in hier.rdma_sent_per_node]


def test_stats_structure_2x4():
    M, N, K = 64, 64, 64
    g = mg.ops.gemm_reduce_scatter(M=M, N=N, K=K, topology="2x4", tile=[8, 32])
    kinds = g.stats().by_role_kind()
    tiles = (M // 8) * (N // 32)  # 16 output tiles, 2 per rank
    assert kinds == {
        ("compute", "gemm"): 8 * tiles,  # every rank computes a partial of every tile
        ("compute", "reduce"): 2 * tiles + tiles,  # node sums, then each tile finished once
        ("rdma", "copy"): 8,  # one chunk (both tiles of a rank's rows) from the other node
    }
    # the node reduce's pushes ride on the GEMM epilogues: 3 peers store each tile's partial
    # straight into its summer's receive buffer (no NVLink copy task)
    pushed = [t for t in g.tasks if t.kind == "gemm" and g.buffers[t.writes[0].buffer].rank != t.rank]
    assert len(pushed) == 2 * tiles * 3
    for r in range(8):
        gemm_flops = sum(t.flops for t in g.tasks_on(r) if t.kind == "gemm")
        assert gemm_flops == 2 * M * N * (K // 8)
    for t in g.tasks:
        if t.role == "compute" and t.kind == "reduce":
            # a node sum adds 4 GPUs' partials; a final reduce its node sum + the other node's
            assert len(t.reads) == (4 if t.name.startswith("node-reduce") else 2)
    flat = mg.ops.gemm_reduce_scatter(
        M=M, N=N, K=K, topology="2x4", tile=[8, 32], hierarchical=False
    )
    assert flat.stats().by_role_kind() == {
        ("compute", "gemm"): 8 * tiles,
        ("rdma", "copy"): 8 * 4,  # each GPU sends the other node's 4 tile rows, one chunk each
        ("compute", "reduce"): 8 * tiles // 2 + tiles,  # rail sums, then node sums per tile
        ("nvlink", "copy"): tiles * 3,  # node reduce: 3 peers push each tile to its owner
    }


def test_one_node_reduces_straight_into_out():
    g = mg.ops.gemm_reduce_scatter(M=64, N=64, K=32, topology="1x4", tile=[8, 32])
    assert not any(b.name in ("nodesum", "railsum") for b in g.buffers.values())
    reduces = [t for t in g.tasks if t.kind == "reduce"]
    assert {t.role for t in reduces} == {"compute"}  # peers push, the owner adds locally
    assert all(g.buffers[t.writes[0].buffer].name == "out" for t in reduces)
    assert all(len(t.reads) == 4 for t in reduces)
    check_graph(g)


def test_gemm_order_remote_rows_first():
    g = mg.ops.gemm_reduce_scatter(M=64, N=32, K=32, topology="4x2", tile=[8, 32])
    rows_per_node = 64 // 4  # 2 ranks x 1 tile of 8 rows each
    for r in range(8):
        node = r // 2
        nodes = [t.writes[0].row0 // rows_per_node for t in g.tasks_on(r) if t.kind == "gemm"]
        assert nodes == [(node + 1 + i) % 4 for i in range(4) for _ in range(2)]


def test_bf16_graph():
    g = mg.ops.gemm_reduce_scatter(
        M=64, N=64, K=64, topology="2x4", dtype=torch.bfloat16, tile=[8, 32], chunk_bytes=512
    )
    assert g.dtype == "bfloat16"
    assert all(b.dtype == "bfloat16" for b in g.buffers.values())
    check_graph(g, tol=1e-2)


@pytest.mark.parametrize(
    "kw, err, words",
    [
        (dict(M=64, N=64, K=36), mg.ShapeError, "K=36"),  # K not divisible by 8 ranks
        (dict(M=60, N=64, K=64), mg.ShapeError, "M=60"),  # M not divisible by 8 ranks
        (dict(M=64, N=64, K=64, tile=[8]), mg.ShapeError, "tile"),
        (dict(M=64, N=64, K=64, chunk_bytes=0), mg.ShapeError, "chunk_bytes"),
        (dict(M=64, N=64), mg.ShapeError, "K"),
        (dict(M=64, N=64, K=64, chunk=4), mg.UnknownNameError, "chunk"),
    ],
)
def test_bad_input(kw, err, words):
    kw = {"tile": [8, 32], **kw}
    with pytest.raises(err) as info:
        mg.ops.gemm_reduce_scatter(topology="2x4", **kw)
    assert "gemm_reduce_scatter" in str(info.value)
    assert words in str(info.value)
    if err is mg.ShapeError:
        assert info.value.hint


def test_sizes_not_multiple_of_the_tile_have_short_edge_tiles():
    """12 rows per rank over tile 8, N=48 over tile 32: the last tiles are 4 rows, 16 columns."""
    for hierarchical in (True, False):
        g = mg.ops.gemm_reduce_scatter(M=96, N=48, K=64, topology="2x4", tile=[8, 32],
                                       hierarchical=hierarchical)
        assert {t.writes[0].shape for t in g.tasks if t.kind == "gemm"} == {
            (8, 32), (8, 16), (4, 32), (4, 16)}
        check_graph(g)
