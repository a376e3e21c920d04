"""The default KV block of attention and ring_attention (issue 17): a task folds the largest
multiple of the q block that divides the sequence (ring: a segment, S/W or the zigzag chunk
S/(2W)), at most 8192 keys, since every task reads and writes the fp32 state once. Checked:
the task lists (no key lost or folded twice, no task whose keys all follow its queries, the
causal mask flag exactly on the blocks reaching past the first query, the cost counting only
the pairs a causal block shows) and the results against torch SDPA on random inputs, on the
reference runtime and, under TRITON_INTERPRET=1, through the Triton bodies (run_chains)."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest
import torch

import mgraph as mg
from helpers import check_graph, rel_err, run_interpreted, written_once
from mgraph.ops.ring_attention import KV_KEYS, default_kv_block

HERE = Path(__file__).parent


def test_default_kv_block_is_the_largest_multiple_of_the_q_block_up_to_8192():
    assert KV_KEYS == 8192
    assert default_kv_block(24576, 128) == 8192  # S = 98304 causal over 2 GPUs: S/(2W)
    assert default_kv_block(49152, 128) == 8192  # ... and non-causal: S/W
    assert default_kv_block(4096, 128) == 4096  # the layer's S: one task per q block
    assert default_kv_block(16384, 128) == 8192
    assert default_kv_block(512, 128) == 512  # the whole segment when it is shorter
    assert default_kv_block(128 * 96, 128) == 6144  # 96 blocks: 48 divide them, 64 do not
    assert default_kv_block(128 * 7 * 11, 128) == 128 * 11  # 77 blocks > 64: 11 of them
    assert default_kv_block(128 * 1031, 128) == 128  # a prime count of blocks: one per task
    assert default_kv_block(10000, 8) == 5000  # 1250 blocks of 8: 625 of them
    assert default_kv_block(32768, 16384) == 16384  # never below the q block


def _kv_rows(t: mg.graph.Task) -> int:
    return t.reads[1].row1 - t.reads[1].row0


def check_tasks(g: mg.TaskGraph, S: int, segment: int, causal: bool) -> None:
    """Every chain (one q block) folds each key it may see exactly once, in blocks of the
    default size, none wholly after its last query, and its last task writes the output
    (inline_finalize, the default); the mask flag and the cost follow the causal diagonal."""
    blk = g.params.get("block", 128)
    blk = min(blk, segment)
    kvb = default_kv_block(segment, blk)
    chains: dict[tuple, list] = {}
    for t in g.tasks:
        if t.kind == "attn_block":
            chains.setdefault((t.rank, tuple(t.writes[:2])), []).append(t)  # (acc, ml)
    assert chains and not [t for t in g.tasks if t.kind == "attn_finalize"]
    B, H, D = g.params["B"], g.params["H"], g.params["D"]
    assert len(chains) * blk == B * H * S  # every query row of every (b, h) in one chain
    flops = 0.0
    for chain in chains.values():
        q_start = chain[0].params["q_start"]
        q_last = q_start + blk - 1
        starts = sorted(t.params["k_start"] for t in chain)
        assert all(_kv_rows(t) == kvb for t in chain)
        # the blocks (each starting at a multiple of kvb) are exactly those with a key the
        # block's last query may see: nothing lost, nothing twice, nothing wholly hidden
        want = [k for k in range(0, S, kvb) if not causal or k <= q_last]
        assert starts == want, (q_start, starts)
        for t in chain:
            p = t.params
            assert p["mask"] == (causal and p["k_start"] + kvb - 1 > q_start), t.name
            if causal:  # a multiple of the q block: every row of the task sees a key
                assert p["k_start"] <= q_start, t.name
        assert [t.params["first"] for t in chain] == [True] + [False] * (len(chain) - 1)
        finals = [bool(t.params.get("final")) for t in chain]
        assert finals == [False] * (len(chain) - 1) + [True], q_start
        flops += sum(t.flops for t in chain)
    pairs = S * (S + 1) // 2 if causal else S * S  # the (query, key) pairs the mask shows
    # ... plus the finalize's rows x D, done by each chain's last task
    assert flops == 4.0 * B * H * pairs * D + B * H * S * D


def _random_shapes(seed: int, n: int) -> list[dict]:
    """(q block, q blocks per segment); every third segment is longer than KV_KEYS, so its
    chains hold several default KV blocks."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        if i % 3 == 2:
            block = rng.choice([64, 128])
            blocks = rng.choice([96, 130, 154]) * 128 // block
            assert block * blocks > KV_KEYS
        else:
            block = rng.choice([16, 32, 64, 128])
            blocks = rng.choice([3, 5, 6, 8, 10, 12, 16, 20, 24])
        out.append(dict(block=block, blocks=blocks))
    return out


@pytest.mark.parametrize("causal", [False, True])
def test_attention_task_lists_on_random_shapes(causal):
    for shape in _random_shapes(1 + causal, 12):
        block, S = shape["block"], shape["block"] * shape["blocks"]
        g = mg.ops.attention(topology="1x2", B=2, H=4, S=S, D=8, block=block, kv_heads=2,
                             causal=causal, layout=["shard", 1, False])  # fmt: skip
        check_tasks(g, S, S, causal)


@pytest.mark.parametrize("topology", ["1x2", "2x2"])
@pytest.mark.parametrize("causal", [False, True])
def test_ring_task_lists_on_random_shapes(topology, causal):
    W = mg.Topology.parse(topology).world_size
    for shape in _random_shapes(3 + causal, 8):
        block = shape["block"]
        segment = block * shape["blocks"]
        S = segment * (2 * W if causal else W)
        g = mg.ops.ring_attention(topology=topology, B=1, H=2, S=S, D=8, block=block,
                                  kv_heads=1, causal=causal)  # fmt: skip
        check_tasks(g, S, segment, causal)
        # zigzag keeps the ranks' work equal with long KV blocks too
        flops = g.stats().flops_per_rank
        assert max(flops) == min(flops), (shape, flops)


def test_traced_sdpa_gets_the_default():
    """The op traced SDPA lowers to names no kv_block: it takes the default."""
    S, D = 1536, 8
    model = _Sdpa()
    x = torch.randn(1, 2, S, D)
    prog = mg.compile(model, (x, x, x), topology="1x1")
    (att,) = [n for n in prog.opgraph.nodes if n.op == "attention"]
    assert "kv_block" not in att.params
    keys = {_kv_rows(t) for t in prog.graph.tasks if t.kind == "attn_block"}
    assert keys == {1536}  # 12 q blocks of 128: all of them in one task
    got = prog(x, x, x)
    assert (
        rel_err(got, torch.nn.functional.scaled_dot_product_attention(x, x, x, is_causal=True))
        < 1e-5
    )


class _Sdpa(torch.nn.Module):
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)


@pytest.mark.parametrize(
    "dims",
    [
        # 12 q blocks: one 1536-key task per q block, straddling the diagonal
        dict(B=1, H=4, S=1536, D=8, block=128, kv_heads=2, causal=True),
        # 96 q blocks: 6144-key tasks (48 q blocks each), chains of one or two
        dict(B=1, H=2, S=12288, D=8, block=128, causal=True),
        dict(B=2, H=2, S=640, D=8, block=32, causal=False, mask_shape=[2, 1, 640, 640]),
        dict(
            B=2,
            H=2,
            S=640,
            D=8,
            block=32,
            causal=True,
            mask_shape=[1, 2, 1, 640],
            mask_kind="boolean",
        ),
    ],
)
def test_attention_default_kv_blocks_match_torch(dims):
    g = mg.ops.attention(topology="1x2", layout=["shard", 1, False], **dims)
    assert max(_kv_rows(t) for t in g.tasks if t.kind == "attn_block") > dims["block"]
    check_graph(g, tol=1e-5)
    written_once(g, "out")


@pytest.mark.parametrize(
    "topology, causal, S",
    [("1x2", True, 5120), ("2x2", True, 3072), ("2x2", False, 4608), ("1x2", False, 16896)],
)
def test_ring_default_kv_blocks_match_torch(topology, causal, S):
    H = 1 if S > 8192 else 2
    # 1x2 causal: zigzag chunks of 1280 = 10 q blocks, one task each; 2x2 causal: chunks of
    # 384 = 3 q blocks; 2x2 non-causal: slices of 1152 = 9 q blocks; 1x2 non-causal past the
    # cap: slices of 8448 = 66 q blocks, 4224-key tasks (two per slice; one head, for time)
    g = mg.ops.ring_attention(topology=topology, B=1, H=H, S=S, D=8, block=128, kv_heads=1,
                              causal=causal)  # fmt: skip
    assert max(_kv_rows(t) for t in g.tasks if t.kind == "attn_block") > 128
    check_graph(g, tol=1e-5)
    written_once(g, "out")


@pytest.mark.parametrize("mask_kind", ["additive", "boolean"])
def test_left_padding_rows_are_zero_with_long_kv_blocks(mask_kind):
    """A padded query under a causal mask sees no key of its (1536-key) task: 0, as SDPA."""
    B, H, S, D, pad = 2, 2, 1536, 8, 133  # pad rows reach into the second q block
    g = mg.ops.attention(topology="1x1", B=B, H=H, S=S, D=D, causal=True, kv_heads=1,
                         mask_shape=[B, 1, 1, S], mask_kind=mask_kind)  # fmt: skip
    x = mg.ops.get_op("attention").random_inputs(g, seed=5)
    real = torch.ones(B, 1, 1, S, dtype=torch.bool)
    real[1, ..., :pad] = False
    hidden = torch.zeros(B, 1, 1, S).masked_fill(~real, float("-inf"))
    x["mask"] = (real.float() if mask_kind == "boolean" else hidden).reshape(g.inputs["mask"].shape)
    got = mg.run(mg.schedule(g), x).outputs["out"]
    k, v = (x[n].repeat_interleave(H, dim=1) for n in "kv")
    shown = real & torch.ones(S, S, dtype=torch.bool).tril()
    want = torch.nn.functional.scaled_dot_product_attention(x["q"], k, v, attn_mask=shown)
    assert bool(want[1, :, :pad].eq(0).all())
    assert bool(got[1, :, :pad].eq(0).all()) and bool(got.isfinite().all())
    assert rel_err(got, want) < 1e-5


_INTERP = """
import json, sys, torch
sys.path.insert(0, {here!r})
import mgraph as mg
from megakernel_attention_interp import compare, _inputs, _sdpa
bf16 = torch.bfloat16
# attention, causal, GQA, a left-padded batch: 256-key tasks (the default) over 64-row q blocks
B, S, pad = 2, 256, 70
g = mg.ops.attention(topology="1x1", B=B, H=2, S=S, D=32, block=64, kv_heads=1, causal=True,
                     mask_shape=[B, 1, 1, S], mask_kind="boolean", dtype=bf16)
x = _inputs(g, seed=31, dtype=bf16)
real = torch.ones(B, 1, 1, S, dtype=torch.bool)
real[1, ..., :pad] = False
x["mask"] = real.to(bf16).reshape(g.inputs["mask"].shape)
tril = torch.ones(S, S, dtype=torch.bool).tril()
compare("attention-causal-padded", g, x, _sdpa(x, mask=real & tril), chains=True)
# ring, zigzag over two ranks: 128-key tasks (a whole chunk) over 32-row q blocks
g = mg.ops.ring_attention(topology="1x2", B=1, H=2, S=512, D=32, block=32, causal=True,
                          dtype=bf16)
x = _inputs(g, seed=32, dtype=bf16)
compare("ring-zigzag", g, x, _sdpa(x, True), chains=True)
"""


def test_triton_bodies_with_default_kv_blocks_under_the_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(HERE))
    proc = run_interpreted(["-c", _INTERP.format(here=str(HERE))], env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    rows = {r["case"]: r for r in lines}
    assert set(rows) == {"attention-causal-padded", "ring-zigzag"}, rows
    for case, r in rows.items():
        # bf16 in and out, p rounded to bf16 (tests/test_triton_attention.py's TOL_BF16)
        assert r["error_ref"] < 1.5e-2 and r["error_sdpa"] < 1.5e-2, (case, r)
        assert r["tile_error"] < 1.5e-2 and r["nans"] == 0 and r["nan_match"], (case, r)
    assert rows["attention-causal-padded"]["zero_rows"] == 2 * 70  # 2 heads x the pad rows
    assert rows["ring-zigzag"]["zero_rows"] == 0
