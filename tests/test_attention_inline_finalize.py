"""attention / ring_attention's ``inline_finalize`` (on by default): each q block's last
attn_block writes ``acc / l`` into the output itself (param ``final``), so no attn_finalize task
is emitted; ``inline_finalize=False`` emits one per q block instead. Checked: the default task
lists against the ``inline_finalize=False`` ones (the last task of every chain and only it is
final and writes the rows that chain's attn_finalize writes, nothing else writes them, the cost
sums as before), the results against torch SDPA on random inputs on the reference runtime
(masks, grouped-query heads, causal chains of several KV blocks, left padding, rings over 1x2
and 2x2). The Triton bodies both ways, under TRITON_INTERPRET=1: test_triton_attention.py."""

from __future__ import annotations

import pytest
import torch

import mgraph as mg
from helpers import check_graph, rel_err, written_once


def _chains(g: mg.TaskGraph) -> dict[tuple, list[mg.graph.Task]]:
    chains: dict[tuple, list] = {}
    for t in g.tasks:
        if t.kind == "attn_block":
            chains.setdefault((t.rank, tuple(t.writes[:2])), []).append(t)
    return chains


def check_inline(inline: mg.TaskGraph, plain: mg.TaskGraph) -> None:
    """``inline`` (the default) is ``plain`` (``inline_finalize=False``) without its
    attn_finalize tasks, each chain's last attn_block writing the rows that chain's
    attn_finalize wrote."""
    assert not [t for t in inline.tasks if t.kind == "attn_finalize"]
    finals = {(t.rank, tuple(t.reads)): t.writes[0] for t in plain.tasks
              if t.kind == "attn_finalize"}  # fmt: skip
    chains = _chains(inline)
    assert len(chains) == len(finals)
    for (rank, state), chain in chains.items():
        *rest, last = chain
        assert last.params.get("final") is True, last.name
        assert [tuple(w) for w in last.writes] == [*state, tuple(finals[(rank, state)])]
        assert all("final" not in t.params and len(t.writes) == 2 for t in rest)
    # attn_finalize's cost (rows x D) moved into the final tasks
    assert sum(t.flops for t in inline.tasks) == sum(t.flops for t in plain.tasks)
    assert len(inline.tasks) == len(plain.tasks) - len(finals)


ATTENTION = [
    dict(B=2, H=4, S=96, D=8, block=16, kv_block=32, kv_heads=2, causal=True),
    dict(B=1, H=2, S=80, D=8, block=16, causal=False, mask_shape=[1, 2, 80, 80]),
    dict(B=2, H=2, S=64, D=8, block=16, kv_block=16, causal=True, mask_shape=[2, 1, 1, 64],
         mask_kind="boolean"),
]  # fmt: skip


@pytest.mark.parametrize("dims", ATTENTION)
def test_attention_inline_finalize_tasks_and_values(dims):
    kw = dict(topology="1x2", layout=["shard", 1, False], **dims)
    g = mg.ops.attention(**kw)
    plain = mg.ops.attention(inline_finalize=False, **kw)
    check_inline(g, plain)
    check_inline(mg.ops.attention(inline_finalize=True, **kw), plain)
    for graph in (g, plain):
        check_graph(graph, tol=1e-5)
        written_once(graph, "out")


@pytest.mark.parametrize(
    "topology, causal, kv_block", [("1x2", True, 8), ("2x2", True, None), ("2x2", False, 8)]
)
def test_ring_inline_finalize_tasks_and_values(topology, causal, kv_block):
    kw = dict(topology=topology, B=1, H=4, S=128, D=8, block=8, kv_heads=2, causal=causal,
              kv_block=kv_block)  # fmt: skip
    g = mg.ops.ring_attention(**kw)
    plain = mg.ops.ring_attention(inline_finalize=False, **kw)
    check_inline(g, plain)
    for graph in (g, plain):
        check_graph(graph, tol=1e-5)
        written_once(graph, "out")


def test_inline_finalize_left_padding_rows_are_zero():
    """A padded query under a causal mask sees no key: its final task writes 0 (l = 0), as
    SDPA and attn_finalize do, not 0 / 0."""
    B, H, S, D, pad = 2, 2, 96, 8, 21
    g = mg.ops.attention(topology="1x1", B=B, H=H, S=S, D=D, block=16, kv_block=32, causal=True,
                         kv_heads=1, mask_shape=[B, 1, 1, S], mask_kind="boolean")  # fmt: skip
    x = mg.ops.get_op("attention").random_inputs(g, seed=7)
    real = torch.ones(B, 1, 1, S, dtype=torch.bool)
    real[1, ..., :pad] = False
    x["mask"] = real.float().reshape(g.inputs["mask"].shape)
    got = mg.run(mg.schedule(g), x).outputs["out"]
    k, v = (x[n].repeat_interleave(H, dim=1) for n in "kv")
    shown = real & torch.ones(S, S, dtype=torch.bool).tril()
    want = torch.nn.functional.scaled_dot_product_attention(x["q"], k, v, attn_mask=shown)
    assert bool(got[1, :, :pad].eq(0).all()) and bool(got.isfinite().all())
    assert rel_err(got, want) < 1e-5


def test_inline_finalize_is_a_checked_option():
    with pytest.raises(mg.errors.OptionError):
        mg.ops.ring_attention(topology="1x1", B=1, H=1, S=64, D=8, inline_finalize="yes")
