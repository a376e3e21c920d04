from __future__ import annotations

from collections import Counter, defaultdict

import pytest
import torch

import mgraph as mg
from helpers import TOPOLOGIES, check_graph, written_once
from mgraph.ops.allgather_gemm import gemm_shard_order

# 8 rows of a per rank on 8 ranks, 2 row tiles each; a chunk is 2 rows (a fraction of a tile).
SMALL = dict(M=64, N=64, K=48, tile=[4, 8], chunk_bytes=2 * 48 * 4)


@pytest.mark.parametrize("topology", TOPOLOGIES)
@pytest.mark.parametrize("hierarchical", [True, False])
def test_matches_torch(topology, hierarchical):
    g = mg.ops.allgather_gemm(topology=topology, hierarchical=hierarchical, **SMALL)
    check_graph(g)
    written_once(g, "out")
    _gathered_once(g)


@pytest.mark.parametrize("topology", ["1x1", "3x2", "2x3"])
@pytest.mark.parametrize("hierarchical", [True, False])
def test_odd_topologies(topology, hierarchical):
    world = mg.Topology.parse(topology).world_size
    kw = {**SMALL, "M": 8 * world, "N": 8 * world}
    g = mg.ops.allgather_gemm(topology=topology, hierarchical=hierarchical, **kw)
    check_graph(g, seed=1)
    written_once(g, "out")
    _gathered_once(g)


def _gathered_once(g):
    """Every rank's gather holds each foreign row of a exactly once, its own rows never."""
    world = g.topology.world_size
    rows = g.inputs["a"].shape[0] // world
    for r in range(world):
        count = torch.zeros(g.buffers[f"a_gathered@{r}"].shape, dtype=torch.int32)
        for t in g.tasks:
            for w in t.writes:
                if w.buffer == f"a_gathered@{r}":
                    count[w.row0 : w.row1, w.col0 : w.col1] += 1
        own = count[r * rows : (r + 1) * rows]
        assert int(own.max()) == 0, f"rank {r} copied its own shard"
        foreign = torch.cat([count[: r * rows], count[(r + 1) * rows :]])
        if foreign.numel():
            assert int(foreign.min()) == 1 and int(foreign.max()) == 1, r


def _rdma_by_shard(g):
    """(source shard, destination node) -> (bytes, rows covered per row) over all rdma tasks."""
    topo = g.topology
    nbytes: Counter = Counter()
    rows: dict[tuple[int, int], Counter] = defaultdict(Counter)
    for t in g.tasks:
        if t.role != "rdma":
            continue
        (src,) = t.reads
        assert src.buffer == f"a@{t.rank}"  # only owners send, straight from their input
        dst_node = topo.node_of(g.buffers[t.writes[0].buffer].rank)
        nbytes[(t.rank, dst_node)] += g.region_bytes(t.writes[0])
        rows[(t.rank, dst_node)].update(range(src.row0, src.row1))
    return nbytes, rows


@pytest.mark.parametrize("topology", ["2x4", "4x2", "3x2", "2x1"])
def test_each_shard_crosses_each_node_boundary_once(topology):
    topo = mg.Topology.parse(topology)
    G, world = topo.gpus_per_node, topo.world_size
    kw = {**SMALL, "M": 8 * world, "N": 8 * world}
    g = mg.ops.allgather_gemm(topology=topo, **kw)
    flat = mg.ops.allgather_gemm(topology=topo, hierarchical=False, **kw)
    shard_rows = 8
    shard_bytes = shard_rows * kw["K"] * 4
    hier_bytes, hier_rows = _rdma_by_shard(g)
    flat_bytes, flat_rows = _rdma_by_shard(flat)
    want = {
        (s, n): shard_bytes for s in range(world) for n in range(topo.nodes) if n != topo.node_of(s)
    }
    assert dict(hier_bytes) == want
    assert all(set(c.values()) == {1} and len(c) == shard_rows for c in hier_rows.values())
    assert dict(flat_bytes) == {k: G * v for k, v in want.items()}
    assert all(set(c.values()) == {G} for c in flat_rows.values())
    A = kw["M"] * kw["K"] * 4
    n = topo.nodes
    assert g.stats().rdma_sent_per_node == [A * (n - 1) // n] * n
    assert flat.stats().rdma_sent_per_node == [G * A * (n - 1) // n] * n


@pytest.mark.parametrize("hierarchical", [True, False])
def test_tiles_wait_only_for_the_chunks_they_read(hierarchical):
    g = mg.ops.allgather_gemm(topology="2x4", hierarchical=hierarchical, **SMALL)
    signalers = g.signalers()
    writers = defaultdict(list)
    for t in g.tasks:
        for w in t.writes:
            if g.buffers[w.buffer].name == "a_gathered":
                writers[w.buffer].append((w, t.id))
    waited = 0
    for t in g.tasks:
        if t.kind != "gemm":
            continue
        a_read = t.reads[0]
        waited_on = {s for e, _ in t.waits for s in signalers[e]}
        if g.buffers[a_read.buffer].name == "a":  # own shard: straight from the input
            assert not t.waits
            continue
        wrote = {tid for w, tid in writers[a_read.buffer] if w.overlaps(a_read)}
        assert waited_on == wrote and len(wrote) == 2, t.name  # a 4-row tile = two 2-row chunks
        waited += 1
    assert waited == 8 * 7 * 2 * 1  # 8 ranks x 7 foreign shards x 2 row tiles x 1 column tile


def test_gemm_order_own_then_node_then_remote():
    g = mg.ops.allgather_gemm(topology="2x4", **SMALL)
    topo = g.topology
    rows = SMALL["M"] // topo.world_size
    for r in topo.ranks:
        shards = [t.writes[0].row0 // rows for t in g.tasks_on(r) if t.kind == "gemm"]
        order = list(dict.fromkeys(shards))
        assert order == gemm_shard_order(topo, r)
        assert shards == [s for s in order for _ in range(2)]  # each shard's tiles together
        node = topo.node_of(r)
        assert order[0] == r
        assert {topo.node_of(s) for s in order[:4]} == {node}
        assert {topo.node_of(s) for s in order[4:]} == {1 - node}
        assert order[4] == topo.rail_peer(r, 1 - node)  # arrives first: no NVLink hop


def test_stats_structure_2x4():
    M, N, K = 64, 64, 32
    kw = dict(M=M, N=N, K=K, topology="2x4", tile=[4, 8], chunk_bytes=1 << 20)
    g = mg.ops.allgather_gemm(**kw)
    chunks = 1  # a whole 8-row shard fits one chunk
    assert g.stats().by_role_kind() == {
        ("compute", "gemm"): 8 * (M // 4),  # every rank: all row tiles x its one column tile
        # owner push + rail peer's forward on the other node, one copy per node peer each
        ("nvlink", "copy"): 8 * chunks * 2 * 3,
        ("rdma", "copy"): 8 * chunks,  # one copy per shard per other node
    }
    for t in g.tasks:
        if t.role == "nvlink":
            assert len(t.writes) == 1  # to one node peer
    for r in range(8):
        assert sum(t.flops for t in g.tasks_on(r)) == 2 * M * (N // 8) * K
    flat = mg.ops.allgather_gemm(**kw, hierarchical=False)
    assert flat.stats().by_role_kind() == {
        ("compute", "gemm"): 8 * (M // 4),
        # owner push (one copy per node peer) + one relay per remote GPU but one
        ("nvlink", "copy"): 8 * chunks * (3 + 3),
        ("rdma", "copy"): 8 * chunks * 4,  # one copy per destination GPU
    }


def test_bf16_graph():
    g = mg.ops.allgather_gemm(
        M=64, N=64, K=64, topology="2x4", dtype=torch.bfloat16, tile=[4, 8], chunk_bytes=256
    )
    assert g.dtype == "bfloat16"
    assert all(b.dtype == "bfloat16" for b in g.buffers.values())
    check_graph(g, tol=1e-2)


@pytest.mark.parametrize(
    "kw, err, words",
    [
        (dict(M=60, N=64, K=32), mg.ShapeError, "M=60"),  # M not divisible by 8 ranks
        (dict(M=64, N=68, K=32), mg.ShapeError, "N=68"),  # N not divisible by 8 ranks
        (dict(M=64, N=64, K=32, tile=[8, 0]), mg.ShapeError, "tile"),
        (dict(M=64, N=64, K=32, chunk_bytes=-1), mg.ShapeError, "chunk_bytes"),
        (dict(M=64, N=64, K=0), mg.ShapeError, "K=0"),
        (dict(M=64, N=64, K=32, hierarchy=False), mg.UnknownNameError, "hierarchy"),
    ],
)
def test_bad_input(kw, err, words):
    kw = {"tile": [8, 16], **kw}
    with pytest.raises(err) as info:
        mg.ops.allgather_gemm(topology="2x4", **kw)
    assert "allgather_gemm" in str(info.value)
    assert words in str(info.value)
    if err is mg.ShapeError:
        assert info.value.hint


def test_sizes_not_multiple_of_the_tile_have_short_edge_tiles():
    """12 rows per shard over tile 8, 24 columns per rank over tile 16: short last tiles."""
    for hierarchical in (True, False):
        g = mg.ops.allgather_gemm(M=96, N=192, K=32, topology="2x4", tile=[8, 16],
                                  chunk_bytes=256, hierarchical=hierarchical)
        assert {t.writes[0].shape for t in g.tasks if t.kind == "gemm"} == {
            (8, 16), (8, 8), (4, 16), (4, 8)}
        check_graph(g)
