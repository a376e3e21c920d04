from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

import mgraph as mg
from helpers import TOPOLOGIES, check_graph, rel_err, written_once
from mgraph.graph import Task
from mgraph.kinds import TaskKind, kind_spec

B, H, S, D = 2, 2, 64, 16
BLOCK = 4  # 4 rows x 16 cols x 4 bytes = 256 B per fp32 block
SMALL = dict(B=B, H=H, S=S, D=D, block=BLOCK, chunk_bytes=1000)  # 4 blocks per chunk


def build(topology: str, causal: bool, **kw) -> mg.TaskGraph:
    return mg.ops.ring_attention(topology=topology, **{**SMALL, "causal": causal, **kw})


def attn_tasks(g: mg.TaskGraph) -> list[Task]:
    return [t for t in g.tasks if t.kind == "attn_block"]


def source_of(g: mg.TaskGraph, t: Task) -> int:
    """Which rank's KV slice an attn_block reads (its own input, or a slot of a gather buffer)."""
    k_read = t.reads[1]
    buf = g.buffers[k_read.buffer]
    if buf.name == "k":
        return buf.rank
    return k_read.row0 // g.buffers[f"k@{t.rank}"].rows


@pytest.mark.parametrize("topology", TOPOLOGIES)
@pytest.mark.parametrize("causal", [False, True])
def test_matches_torch(topology, causal):
    g = build(topology, causal)
    check_graph(g)
    written_once(g, "out")


def test_single_gpu_and_large_block():
    g = mg.ops.ring_attention(B=1, H=2, S=32, D=16, causal=True, topology="1x1")  # block 128 > S
    check_graph(g)
    assert g.stats().bytes_by_link == {"nvlink": 0, "rdma": 0}


def test_bf16():
    g = build("2x2", True, dtype=torch.bfloat16)
    assert {b.dtype for b in g.buffers.values() if b.name in ("q", "k", "v", "out")} == {"bfloat16"}
    assert {b.dtype for b in g.buffers.values() if b.name.startswith("attn_")} == {"float32"}
    check_graph(g, tol=1e-2)


@pytest.mark.parametrize("topology", ["2x1", "2x4", "4x2", "3x2"])
@pytest.mark.parametrize("causal", [False, True])
def test_kv_crosses_each_node_boundary_once(topology, causal):
    topo = mg.Topology.parse(topology)
    n, G, W = topo.nodes, topo.gpus_per_node, topo.world_size
    s = S if topology != "3x2" else 96
    g = build(topology, causal, S=s)
    st = g.stats()
    slice_kv = 2 * B * H * (s // W) * D * 4  # k and v of one rank, fp32
    node_kv = G * slice_kv
    assert st.rdma_sent_per_node == [(n - 1) * node_kv] * n
    assert st.rdma_received_per_node == [(n - 1) * node_kv] * n
    # NVLink: each slice reaches the G-1 other GPUs of every node once (push or forward).
    assert sum(st.nvlink_per_node) == W * n * (G - 1) * slice_kv
    # Only the owner sends its slice over RDMA (nothing is re-forwarded across nodes), and each
    # slot of a rail peer's gather buffer is written over RDMA exactly once.
    covered: Counter = Counter()
    for t in g.tasks:
        if t.role != "rdma":
            continue
        src_buf = g.buffers[t.reads[0].buffer]
        assert src_buf.name in ("k", "v") and src_buf.rank == t.rank, t.name
        (w,) = t.writes
        for row in range(w.row0, w.row1):
            covered[(w.buffer, row)] += 1
    assert set(covered.values()) == {1}
    assert len(covered) == 2 * W * (n - 1) * (B * H * s // W)


def test_rdma_chunks_hold_at_least_chunk_bytes():
    # kv_block=4 named: chunks are whole KV blocks, and the default (a whole 20-row slice
    # here) would make every chunk one slice
    g = mg.ops.ring_attention(
        topology="2x2", B=1, H=2, S=80, D=16, block=4, kv_block=4, chunk_bytes=1000
    )
    slot_rows = g.buffers["k@0"].rows  # 1 * 2 * 20 = 40 rows: chunks of 16, 16 and 8 rows
    sizes = [(t.writes[0], g.region_bytes(t.writes[0])) for t in g.tasks if t.role == "rdma"]
    assert sizes
    for region, nbytes in sizes:
        last = region.row1 % slot_rows == 0  # a slice's last chunk may be shorter
        assert nbytes >= 1000 or last, (region, nbytes)
    assert Counter(n for _, n in sizes) == Counter({1024: 2 * 4 * 2, 512: 2 * 4})


@pytest.mark.parametrize("causal", [False, True])
def test_ring_consumption_order_and_chains(causal):
    g = build("2x4", causal)
    topo = g.topology
    chains: dict[tuple[int, tuple], list[Task]] = {}
    for t in attn_tasks(g):  # keyed by the state (acc, ml): the final task writes out too
        chains.setdefault((t.rank, tuple(t.writes[:2])), []).append(t)
    assert len(chains) == sum(1 for t in attn_tasks(g) if t.params.get("final"))
    for (rank, _), chain in chains.items():
        assert [t.params["first"] for t in chain] == [True] + [False] * (len(chain) - 1)
        assert [bool(t.params.get("final")) for t in chain] == [False] * (len(chain) - 1) + [True]
        order = []
        for t in chain:
            if not order or order[-1] != source_of(g, t):
                order.append(source_of(g, t))
        node, local = topo.node_of(rank), topo.local_of(rank)
        # down the node from its own local index (the order the node's pushes reach it), then
        # the other node from the rail peer down
        down = [(local - i) % 4 for i in range(4)]
        expected = [topo.rank(n, g) for n in (node, 1 - node) for g in down]
        assert order == [s for s in expected if s in order], (rank, order)
        assert order[0] == rank
        if not causal:
            assert order == expected
    first = next(c for (r, _), c in chains.items() if r == 5)
    if not causal:
        kvb = first[0].reads[1].row1 - first[0].reads[1].row0  # the default: a whole slice
        assert [source_of(g, t) for t in first][:: (S // 8) // kvb] == [5, 4, 7, 6, 1, 0, 3, 2]


@pytest.mark.parametrize("topology", ["2x4", "4x2"])
def test_each_block_waits_only_on_its_rows(topology):
    g = build(topology, False)
    signalers = g.signalers()
    for t in attn_tasks(g):
        k_read, v_read = t.reads[1], t.reads[2]
        comm = [
            g.tasks[s] for e, _ in t.waits for s in signalers[e] if g.tasks[s].role != "compute"
        ]
        compute = [
            g.tasks[s] for e, _ in t.waits for s in signalers[e] if g.tasks[s].role == "compute"
        ]
        assert len(compute) == (0 if t.params["first"] else 1), t.name
        if g.buffers[k_read.buffer].name == "k":
            assert not comm, t.name  # its own slice: no transfer to wait for
            continue
        assert len(comm) == 2, t.name  # the chunk of k and the chunk of v holding these rows
        for read in (k_read, v_read):
            holders = [
                w
                for p in comm
                for w in p.writes
                if w.buffer == read.buffer and w.row0 <= read.row0 and read.row1 <= w.row1
            ]
            assert len(holders) == 1, (t.name, read)


def test_causal_skips_blocks_and_is_balanced():
    # kv_block=BLOCK named (square tasks: the masked ones are exactly the diagonal); the
    # default's longer KV blocks are checked by test_attention_kv_blocks.py
    for topology in ("2x4", "4x2", "1x2"):
        W = mg.Topology.parse(topology).world_size
        full = build(topology, False, kv_block=BLOCK)
        causal = build(topology, True, kv_block=BLOCK)
        nblk = S // BLOCK
        assert len(attn_tasks(full)) == B * H * nblk * nblk
        assert len(attn_tasks(causal)) == B * H * nblk * (nblk + 1) // 2
        per_rank = Counter(t.rank for t in attn_tasks(causal))
        assert len(set(per_rank.values())) == 1 and len(per_rank) == W, per_rank
        flops = causal.stats().flops_per_rank
        assert max(flops) == min(flops)
        masked = [t for t in attn_tasks(causal) if t.params["mask"]]
        assert len(masked) == B * H * nblk
        assert all(t.params["q_start"] == t.params["k_start"] for t in masked)
        assert all(
            t.params["k_start"] < t.params["q_start"]
            for t in attn_tasks(causal)
            if not t.params["mask"]
        )
        assert not any(t.params["mask"] for t in attn_tasks(full))


def test_flops_and_facets():
    for kind in (TaskKind.ATTN_BLOCK, TaskKind.ATTN_FINALIZE):
        spec = kind_spec(kind)
        assert spec.cpu_body is not None and spec.flops_fn is not None
    g = build("2x2", False, inline_finalize=False)
    attn = sum(t.flops for t in attn_tasks(g))
    assert attn == 4 * B * H * S * S * D
    final = sum(t.flops for t in g.tasks if t.kind == "attn_finalize")
    assert final == B * H * S * D
    # the default: each chain's last attn_block does attn_finalize's work too
    assert sum(t.flops for t in attn_tasks(build("2x2", False))) == attn + final


def test_block_body_any_order_with_fully_masked_rows():
    """The online softmax is order-independent and safe when a row has nothing unmasked yet."""
    gen = torch.Generator().manual_seed(1)
    rows, keys, d = 4, 12, 8
    q, k, v = (torch.randn(n, d, generator=gen) for n in (rows, keys, keys))
    scale = 1 / math.sqrt(d)
    q_start = 4  # q positions 4..7; key blocks at 8 (fully masked), 0 (unmasked), 4 (diagonal)
    acc, ml = torch.full((rows, d), float("nan")), torch.full((rows, 2), float("nan"))
    body = kind_spec(TaskKind.ATTN_BLOCK).cpu_body
    for i, k_start in enumerate((8, 0, 4)):
        sl = slice(k_start, k_start + 4)
        params = dict(q_start=q_start, k_start=k_start, mask=True, first=i == 0, scale=scale)
        task = Task(0, "t", 0, "compute", "attn_block", [], [], params=params)
        state = [] if i == 0 else [acc, ml]
        body(task, [q, k[sl], v[sl], *state], [acc, ml])
    out = torch.empty(rows, d)
    kind_spec(TaskKind.ATTN_FINALIZE).cpu_body(task, [acc, ml], [out])
    mask = torch.arange(keys)[None, :] <= (q_start + torch.arange(rows))[:, None]
    want = torch.softmax((q @ k.T * scale).masked_fill(~mask, float("-inf")), dim=1) @ v
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "kw, err, topology",
    [
        (dict(S=63), mg.ShapeError, "1x2"),  # S not divisible by W
        (dict(S=66, causal=True), mg.ShapeError, "1x2"),  # divisible by W, not by 2W
        (dict(S=64, block=12), mg.ShapeError, "1x2"),  # S/W = 32 not a multiple of the block
        (dict(S=64, block=12, causal=True), mg.ShapeError, "1x2"),  # S/(2W) = 16
        (dict(D=0), mg.ShapeError, "1x2"),
        (dict(D=-16), mg.ShapeError, "1x2"),
        (dict(block=0), mg.ShapeError, "1x2"),
        (dict(chunk_bytes=0), mg.ShapeError, "1x2"),
        (dict(S=60), mg.ShapeError, "2x4"),
        (dict(blocks=4), mg.UnknownNameError, "1x2"),
    ],
)
def test_bad_input(kw, err, topology):
    with pytest.raises(err) as info:
        mg.ops.ring_attention(topology=topology, **{**dict(B=1, H=2, S=64, D=16), **kw})
    assert "ring_attention" in str(info.value)


def test_causal_only_needs_2w():
    mg.ops.ring_attention(topology="1x2", B=1, H=1, S=66, D=8, block=33)  # fine without causal


@pytest.mark.parametrize("topology", ["1x2", "2x2"])
@pytest.mark.parametrize("causal", [False, True])
def test_grouped_query_heads_and_kv_blocks_match_torch(topology, causal):
    # 2 q heads per KV head; 8-key tasks folded into 4-row q blocks (causal: some straddle the
    # diagonal, the body hides the keys after each query)
    g = build(topology, causal, H=4, kv_heads=2, kv_block=8 if not causal else 4 * 2)
    assert g.inputs["k"].shape == (B, 2, S, D) and g.inputs["q"].shape == (B, 4, S, D)
    check_graph(g)
    written_once(g, "out")


def test_grouped_query_ring_moves_only_kv_heads():
    full = build("2x2", False, H=4).stats()
    gqa = build("2x2", False, H=4, kv_heads=1).stats()
    assert gqa.rdma_sent_per_node == [n // 4 for n in full.rdma_sent_per_node]
    assert sum(gqa.nvlink_per_node) * 4 == sum(full.nvlink_per_node)


@pytest.mark.parametrize("kw", [dict(kv_heads=3), dict(kv_heads=0), dict(kv_block=3),
                                dict(kv_block=0)])
def test_bad_kv_heads_or_kv_block_is_a_shape_error(kw):
    with pytest.raises(mg.errors.ShapeError):
        build("1x2", False, **kw)


@pytest.mark.parametrize("mask_kind", ["additive", "boolean"])
def test_attention_gqa_with_masks_matches_torch(mask_kind):
    g = mg.ops.attention(topology="1x2", B=2, H=4, S=32, D=8, block=8, kv_block=16, kv_heads=2,
                         mask_shape=[2, 1, 1, 32], mask_kind=mask_kind, causal=True,
                         layout=["shard", 1, False])
    check_graph(g)
    with pytest.raises(mg.errors.ShapeError):
        mg.ops.attention(topology="1x1", B=1, H=2, S=32, D=8, mask_shape=[1, 1, 1, 32],
                         mask_kind="bool")


@pytest.mark.parametrize("mask_kind", ["additive", "boolean"])
def test_attention_rows_with_every_key_hidden_are_zero_as_in_sdpa(mask_kind):
    """Left padding under a causal mask: a pad query sees no key at all. SDPA returns 0 in such
    a row; so does attn_finalize (l = 0), where acc / l would be 0 / 0 = NaN."""
    B, H, S, D, pad = 2, 4, 32, 8, 5
    dims = dict(B=B, H=H, S=S, D=D, block=8, kv_heads=2, causal=True)
    g = mg.ops.attention(
        topology="1x2", mask_shape=[B, 1, 1, S], mask_kind=mask_kind, layout=["shard", 1, False],
        **dims,
    )
    x = mg.ops.get_op("attention").random_inputs(g, seed=3)
    real = torch.ones(B, 1, 1, S, dtype=torch.bool)
    real[1, ..., :pad] = False
    hidden = torch.zeros(B, 1, 1, S).masked_fill(~real, float("-inf"))
    mask = real.float() if mask_kind == "boolean" else hidden
    x["mask"] = mask.reshape(g.inputs["mask"].shape)
    got = mg.run(mg.schedule(g), x).outputs["out"]
    k, v = (x[n].repeat_interleave(2, dim=1) for n in "kv")
    shown = real & torch.ones(S, S, dtype=torch.bool).tril()
    want = torch.nn.functional.scaled_dot_product_attention(x["q"], k, v, attn_mask=shown)
    assert bool(want[1, :, :pad].eq(0).all())  # what torch returns there
    assert bool(got[1, :, :pad].eq(0).all()) and bool(got.isfinite().all())
    assert rel_err(got, want) < 1e-5
