"""Grouped-query attention with heads sharded over more ranks than there are KV heads (16 ranks,
32 heads, 8 KV heads at 2x8): each rank binds the KV heads its query heads share, nothing
repeats them. Checked on the reference runtime against torch SDPA on random inputs, head-major
and token-major, including ranks whose heads span two KV groups, and that each rank's k and v
hold only those heads."""

from __future__ import annotations

import pytest

import mgraph as mg
from helpers import check_graph
from mgraph.ops.attention import kv_box


def test_kv_box_maps_a_ranks_heads_to_the_kv_heads_they_share():
    box = ((0, 1), (4, 6), (0, 64), (0, 16))
    assert kv_box(box, 32, 8) == ((0, 1), (1, 2), (0, 64), (0, 16))  # heads 4, 5: group 1
    assert kv_box(((0, 2), (2, 5)), 6, 3) == ((0, 2), (1, 3))  # heads 2-4: groups 1 and 2
    assert kv_box(((0, 1), (0, 8)), 8, 1) == ((0, 1), (0, 1))  # multi-query: the one head


@pytest.mark.parametrize(("topology", "H", "kv_heads"), [
    ("1x8", 8, 4),  # two ranks a KV head
    ("1x4", 4, 1),  # multi-query: every rank reads the one head
    ("1x2", 6, 3),  # 3 heads a rank, groups of 2: rank 0 spans groups 0-1, rank 1 groups 1-2
])  # fmt: skip
@pytest.mark.parametrize("token_major", [None, ["q", "k", "v", "out"]])
@pytest.mark.parametrize("causal", [False, True])
def test_heads_sharded_past_the_kv_heads_match_torch(topology, H, kv_heads, token_major, causal):
    S, D = 32, 8
    g = mg.ops.attention(topology=topology, B=2, H=H, S=S, D=D, block=16, kv_heads=kv_heads,
                         causal=causal, layout=["shard", 1, False],
                         token_major=token_major)  # fmt: skip
    check_graph(g, seed=H + kv_heads + causal)
    world = g.topology.world_size
    rep = H // kv_heads
    per_rank = H // world
    for r in range(world):
        groups = (r * per_rank + per_rank - 1) // rep - (r * per_rank) // rep + 1
        for name in ("k", "v"):
            (buf,) = [b for b in g.buffers.values() if b.rank == r and b.name == name]
            assert buf.rows * buf.cols == 2 * groups * S * D, (r, name, buf.shape)
