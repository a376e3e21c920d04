"""Model code as libraries write it traces and matches eager torch on random inputs: rotary
embeddings broadcasting over the heads, grouped-query attention (repeat_kv and enable_gqa),
boolean and additive masks, causal masks built from torch.triu/arange, chunk/split/cat."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import mgraph as mg
from helpers import check_graph, rel_err
from mgraph.graph import ITEMSIZE


# -- Llama-style attention, written as transformers writes it --------------------------------
def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim: int = 1):
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def repeat_kv(hidden: torch.Tensor, n_rep: int) -> torch.Tensor:
    batch, kv_heads, slen, head_dim = hidden.shape
    if n_rep == 1:
        return hidden
    hidden = hidden[:, :, None, :, :].expand(batch, kv_heads, n_rep, slen, head_dim)
    return hidden.reshape(batch, kv_heads * n_rep, slen, head_dim)


class RotaryEmbedding(nn.Module):
    def __init__(self, dim: int, base: float = 10000.0) -> None:
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor):
        inv = self.inv_freq[None, :, None].float().expand(position_ids.shape[0], -1, 1)
        freqs = (inv @ position_ids[:, None, :].float()).transpose(1, 2)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


class Attention(nn.Module):
    """``gqa``: "repeat" (repeat_kv) or "sdpa" (enable_gqa); ``mask``: "triu", "arange",
    "window" (a sliding window from arange: folded, not causal), "input" (a mask argument),
    "causal" (is_causal=True); ``rope``: "inside" (from arange positions) or "input"."""

    def __init__(self, hidden=64, heads=8, kv_heads=4, gqa="repeat", mask="triu", rope="inside"):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, hidden // heads
        self.gqa, self.mask, self.rope = gqa, mask, rope
        self.q_proj = nn.Linear(hidden, heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(heads * self.head_dim, hidden, bias=False)
        self.rotary_emb = RotaryEmbedding(self.head_dim)

    def forward(self, x, *extra):
        B, S, _ = x.shape
        shape = (B, S, -1, self.head_dim)
        q = self.q_proj(x).view(shape).transpose(1, 2)
        k = self.k_proj(x).view(shape).transpose(1, 2)
        v = self.v_proj(x).view(shape).transpose(1, 2)
        if self.rope == "input":
            cos, sin = extra[:2]
            extra = extra[2:]
        else:
            cos, sin = self.rotary_emb(x, torch.arange(S)[None].expand(B, S))
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        mask, causal = None, False
        if self.mask == "triu":
            mask = ~torch.triu(torch.ones(S, S, dtype=torch.bool), diagonal=1)
        elif self.mask == "arange":
            pos = torch.arange(S)
            mask = pos[:, None] >= pos[None, :]
        elif self.mask == "window":
            pos = torch.arange(S)
            mask = (pos[:, None] >= pos[None, :]) & (pos[:, None] - pos[None, :] < 4)
        elif self.mask == "input":
            mask = extra[0]
        else:
            causal = True
        n_rep = self.heads // self.kv_heads
        if self.gqa == "repeat":
            k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)
        else:
            o = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=True
            )
        return self.o_proj(o.transpose(1, 2).reshape(B, S, -1))


TP = {
    "q_proj": mg.ColwiseParallel(),
    "k_proj": mg.ColwiseParallel(),
    "v_proj": mg.ColwiseParallel(),
    "o_proj": mg.RowwiseParallel(),
}


def compiled_matches(model, args, plan=TP, topology="2x2", tol=1e-5):
    model = model.eval()
    prog = mg.compile(model, args, plan=plan, topology=topology)
    with torch.no_grad():
        want = model(*args)
    got = prog(*args)
    assert rel_err(got, want) < tol, rel_err(got, want)
    return prog


def ops(prog) -> list[str]:
    return [n.op for n in prog.opgraph.nodes]


def kv_repeats(prog) -> list:
    """Relayouts that repeat KV heads: an expand to [B, Hkv, rep, S, D] (repeat_kv's form)."""
    return [
        n
        for n in prog.opgraph.nodes
        if n.op == "relayout" and any(s[0] == "expand" and len(s[1]) == 5 for s in n.params["steps"])
    ]


@pytest.mark.parametrize("gqa", ["repeat", "sdpa"])
@pytest.mark.parametrize("topology", ["1x2", "2x2"])
def test_gqa_rope_and_causal_triu_mask(gqa, topology):
    torch.manual_seed(0)
    x = torch.randn(2, 16, 64)
    prog = compiled_matches(Attention(gqa=gqa), (x,), topology=topology)
    att = [n for n in prog.opgraph.nodes if n.op == "attention"]
    # The folded triu mask IS the causal mask: no mask tensor, blocks above the diagonal skipped.
    assert len(att) == 1 and att[0].params["causal"] and "mask" not in att[0].inputs
    # Heads stay sharded (1 or 2 KV heads per rank): no resharding around attention.
    assert att[0].params["layout"] == ["shard", 1, False]
    # rotate_half is a pointwise step of the RoPE chain (tests/test_rope_fusion.py), no concat
    assert "concat" not in ops(prog)
    # enable_gqa and repeat_kv alike: the op shares each of the 4 KV heads among 2 query heads,
    # nothing repeats them
    assert att[0].params["kv_heads"] == 4 and att[0].inputs["k"].shape == (2, 4, 16, 8)
    assert not kv_repeats(prog)


@pytest.mark.parametrize("gqa", ["repeat", "sdpa"])
def test_gqa_ring_moves_only_the_kv_heads(gqa):
    """Under ContextParallel the ring pushes each rank's k and v slices of the 4 KV heads, not
    of 8 repeated ones: half the bytes."""
    torch.manual_seed(7)
    B, S, W = 2, 16, 2
    x = torch.randn(B, S, 64)
    plan = {"": mg.ContextParallel()}
    prog = compiled_matches(Attention(gqa=gqa, mask="causal"), (x,), plan=plan, topology="1x2")
    (att,) = [n for n in prog.opgraph.nodes if n.op == "ring_attention"]
    assert att.params["kv_heads"] == 4 and not kv_repeats(prog)
    g = prog.graph
    pushed = sum(
        (r.row1 - r.row0) * (r.col1 - r.col0) * ITEMSIZE[g.buffers[r.buffer].dtype]
        for t in g.tasks
        if t.kind == "copy" and (": push k[" in t.name or ": push v[" in t.name)
        for r in t.reads[:1]
    )
    assert pushed == W * 2 * (B * 4 * (S // W) * 8) * 4  # ranks x (k, v) x one fp32 slice


def test_gqa_heads_sharded_past_the_kv_heads_share_them():
    """8 query heads and 4 KV heads on 8 ranks: no rank holds a KV head of its own, yet nothing
    repeats them: each rank binds the one KV head its query head shares (two ranks read each),
    and it still matches."""
    torch.manual_seed(8)
    x = torch.randn(1, 16, 64)
    for gqa in ("repeat", "sdpa"):
        prog = compiled_matches(Attention(gqa=gqa, mask="causal"), (x,), topology="1x8")
        (att,) = [n for n in prog.opgraph.nodes if n.op == "attention"]
        assert att.params["kv_heads"] == 4 and not kv_repeats(prog)
        g = prog.graph
        for t in g.tasks:  # each rank's k and v: one KV head (16 tokens x 8), not 2 or 4
            if t.kind == "attn_block":
                assert [g.buffers[r.buffer].shape for r in t.reads[1:3]] == [(16, 8)] * 2, t


class ReadsRepeatedK(Attention):
    """repeat_kv's k is read again after attention: its repeat stays (other ops need it)."""

    def forward(self, x):
        B, S, _ = x.shape
        k = self.k_proj(x).view(B, S, -1, self.head_dim).transpose(1, 2)
        k = repeat_kv(k, self.heads // self.kv_heads)
        o = F.scaled_dot_product_attention(k, k, k, is_causal=True)
        return self.o_proj(o.transpose(1, 2).reshape(B, S, -1)) + k.transpose(1, 2).reshape(
            B, S, -1
        )


def test_repeat_kv_read_elsewhere_stays_repeated():
    torch.manual_seed(9)
    prog = compiled_matches(ReadsRepeatedK(), (torch.randn(2, 16, 64),), plan={}, topology="1x2")
    (att,) = [n for n in prog.opgraph.nodes if n.op == "attention"]
    assert "kv_heads" not in att.params and len(kv_repeats(prog)) == 1


@pytest.mark.parametrize("mask", ["arange", "window", "causal"])
def test_masks_built_in_forward(mask):
    torch.manual_seed(1)
    x = torch.randn(1, 16, 64)
    prog = compiled_matches(Attention(mask=mask, gqa="sdpa"), (x,))
    (att,) = [n for n in prog.opgraph.nodes if n.op == "attention"]
    assert att.params["causal"] == (mask != "window")
    assert ("mask" in att.inputs) == (mask == "window")  # a non-causal one stays a constant
    if mask == "window":  # boolean, read as SDPA reads it (1 = attend), no -inf constant
        assert att.params["mask_kind"] == "boolean"
        const = prog.opgraph.constants[att.inputs["mask"].root().name]
        assert set(const.unique().tolist()) == {0.0, 1.0}


def test_rope_tables_as_inputs_broadcast_over_heads():
    torch.manual_seed(2)
    B, S, D = 2, 16, 8
    x = torch.randn(B, S, 64)
    cos, sin = torch.randn(B, S, D), torch.randn(B, S, D)  # [B, S, D] -> [B, 1, S, D] inside
    compiled_matches(Attention(rope="input", mask="causal"), (x, cos, sin))


@pytest.mark.parametrize("kind", ["bool", "additive"])
def test_attention_mask_inputs(kind):
    torch.manual_seed(3)
    B, S = 2, 16
    x = torch.randn(B, S, 64)
    keep = torch.rand(B, 1, S, S) > 0.3
    keep |= torch.eye(S, dtype=torch.bool)  # every query sees a key: no all-masked rows
    if kind == "bool":
        mask = keep
    else:
        mask = torch.randn(B, 1, S, S).masked_fill(~keep, float("-inf"))
    prog = compiled_matches(Attention(mask="input", gqa="sdpa"), (x, mask))
    (att,) = [n for n in prog.opgraph.nodes if n.op == "attention"]
    assert att.params["mask_shape"] == [B, 1, S, S]
    padding = torch.ones(B, 1, 1, S, dtype=torch.bool)
    padding[1, ..., -5:] = False  # the second sequence is padded: broadcast over the queries
    compiled_matches(Attention(mask="input"), (x, padding))


class FusedQKV(nn.Module):
    """One QKV projection cut with chunk (and split with sizes for a GQA layout)."""

    def __init__(self, hidden=32, heads=4, kv_heads=2, use="chunk"):
        super().__init__()
        self.heads, self.kv_heads, self.hd, self.use = heads, kv_heads, hidden // heads, use
        kv = kv_heads if use == "split" else heads
        self.qkv = nn.Linear(hidden, (heads + 2 * kv) * self.hd, bias=False)
        self.out = nn.Linear(hidden, hidden, bias=False)

    def forward(self, x):
        B, S, _ = x.shape
        qkv = self.qkv(x)
        if self.use == "chunk":
            q, k, v = qkv.chunk(3, dim=-1)
        else:
            kv = self.kv_heads * self.hd
            q, k, v = torch.split(qkv, [self.heads * self.hd, kv, kv], dim=-1)
        q, k, v = (t.view(B, S, -1, self.hd).transpose(1, 2) for t in (q, k, v))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.out(o.transpose(1, 2).reshape(B, S, -1))


@pytest.mark.parametrize("use", ["chunk", "split"])
def test_chunk_and_split_of_a_fused_projection(use):
    torch.manual_seed(4)
    x = torch.randn(2, 8, 32)
    prog = compiled_matches(FusedQKV(use=use), (x,), plan={}, topology="1x2")
    assert ops(prog).count("relayout") >= 3


class Pieces(nn.Module):
    """Splits and cats along other dims: unbind, split over the sequence, cat over batch."""

    def forward(self, x):
        a, b = x.split(x.shape[1] // 2, dim=1)  # [B, S/2, H] each
        first, second = x.unbind(0)
        y = torch.cat([b * 2.0, a], dim=1)  # sequence halves swapped
        z = torch.cat([second[None], first[None]], dim=0)  # batches swapped
        return y + z + x.narrow(2, 1, 1) + x[:, 0:1]


def test_split_unbind_narrow_and_cat_on_other_dims():
    torch.manual_seed(5)
    x = torch.randn(2, 8, 16)
    compiled_matches(Pieces(), (x,), plan={}, topology="1x2", tol=1e-6)


class Broadcasts(nn.Module):
    def forward(self, x, per_pos, per_head, table):
        # [B, H, S, D] with [S, D], with [1, H, 1, 1] times [B, 1, S, 1] (both broadcast)
        return x * table + per_head * per_pos + x


def test_broadcasts_over_any_leading_dims():
    torch.manual_seed(6)
    B, H, S, D = 2, 4, 8, 16
    args = (torch.randn(B, H, S, D), torch.randn(B, 1, S, 1), torch.randn(1, H, 1, D),
            torch.randn(S, D))
    compiled_matches(Broadcasts(), args, plan={}, topology="2x2", tol=1e-6)


def test_concat_op_matches_torch():
    for layout in (None, ["rows", -1, False]):
        check_graph(mg.ops.concat(rows=32, cols=8, cols_y=24, layout=layout, tile_rows=8,
                                  topology="2x2"))
    with pytest.raises(mg.ShapeError, match="concatenated"):
        mg.ops.concat(rows=8, cols=8, cols_y=8, layout=["shard", 1, False], topology="1x2")


def test_attention_op_with_a_mask_matches_torch():
    for mask_shape in ([2, 1, 32, 32], [1, 4, 1, 32]):
        check_graph(mg.ops.attention(B=2, H=4, S=32, D=8, block=8, causal=True,
                                     mask_shape=mask_shape, topology="1x2"))
    with pytest.raises(mg.ShapeError, match="does not broadcast"):
        mg.ops.attention(B=2, H=4, S=32, D=8, mask_shape=[2, 2, 32, 32], topology="1x2")


# -- what still does not trace: named errors ---------------------------------------------------
class Masked(nn.Module):
    def forward(self, q, mask):
        return F.scaled_dot_product_attention(q, q, q, attn_mask=mask)


def test_unsupported_forms_are_named_errors():
    q = torch.randn(1, 2, 8, 4)
    with pytest.raises(mg.UnsupportedOpError, match="does not broadcast"):
        mg.compile(Masked(), (q, torch.randn(8, 1)), topology="1x2")

    class UsesBoolInput(nn.Module):
        def forward(self, x, keep):
            return x * keep.to(x.dtype)

    with pytest.raises(mg.UnsupportedOpError, match="only be an attention mask"):
        mg.compile(UsesBoolInput(), (q, torch.rand(1, 2, 8, 4) > 0.5), topology="1x2")

    with pytest.raises(mg.UnsupportedOpError, match="ring_attention"):
        padding = torch.rand(1, 16) > 0.2
        mg.compile(Attention(mask="input"), (torch.randn(1, 16, 64), padding[:, None, None]),
                   plan={"": mg.ContextParallel()}, topology="1x2")

    class Dropout(nn.Module):
        def forward(self, q):
            return F.scaled_dot_product_attention(q, q, q, dropout_p=0.1)

    with pytest.raises(mg.UnsupportedOpError, match="dropout"):
        mg.compile(Dropout(), (q,), topology="1x2")


def test_mask_math_outside_transformers_forms_is_a_named_error():
    q = torch.randn(1, 2, 8, 4)

    class Reversed(nn.Module):
        def forward(self, x):
            return x[:, torch.arange(x.shape[1]).flip(0)] * 2.0  # a gather, not a view

    with pytest.raises(mg.UnsupportedOpError, match="only where it is a view"):
        mg.compile(Reversed(), (q,), topology="1x2")

    class Selects(nn.Module):
        def forward(self, x, keep):
            return torch.where(keep, x, 0.0)

    with pytest.raises(mg.UnsupportedOpError, match="torch.where is supported only"):
        mg.compile(Selects(), (q, torch.rand(1, 2, 8, 4) > 0.5), topology="1x2")
