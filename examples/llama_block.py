"""A Llama-style decoder block written as model libraries write it (rotary embeddings with
``rotate_half``, grouped-query attention through ``repeat_kv``, a causal mask built with
``torch.triu``, RMSNorm, gated MLP) under tensor + sequence parallelism.

What mgraph does with it: the rotary tables and the mask depend on no input, so they are computed
once at trace time (the triu mask is recognised as causal: attention skips the blocks above the
diagonal); ``q * cos + rotate_half(q) * sin`` is one elementwise task per tile, reading
``cos``/``sin`` (``[B, 1, S, D]``, broadcast over the heads) through a row map and q's head split
in place; the attention reads v's head split and writes its output merge in place;
``repeat_kv`` is undone: the attention shares each KV head among its query heads;
the norms run on token shards (SequenceParallel), so the column-parallel projections become
AllGather+GEMM and the row-parallel ones GEMM+ReduceScatter. One TaskGraph holds the whole block.

    python examples/llama_block.py
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

import mgraph as mg


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def repeat_kv(hidden: torch.Tensor, n_rep: int) -> torch.Tensor:
    batch, kv_heads, slen, head_dim = hidden.shape
    hidden = hidden[:, :, None, :, :].expand(batch, kv_heads, n_rep, slen, head_dim)
    return hidden.reshape(batch, kv_heads * n_rep, slen, head_dim)


class Attention(nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int, theta: float = 10000.0) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, hidden // heads
        self.q_proj = nn.Linear(hidden, heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(heads * self.head_dim, hidden, bias=False)
        exponents = torch.arange(0, self.head_dim, 2).float() / self.head_dim
        self.register_buffer("inv_freq", 1.0 / theta**exponents, persistent=False)

    def rotary(self, x: torch.Tensor, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = torch.outer(torch.arange(seq, device=x.device).float(), self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)[None]  # [1, S, D]
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, S, _ = x.shape
        q = self.q_proj(x).view(B, S, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, S, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, S, -1, self.head_dim).transpose(1, 2)
        cos, sin = self.rotary(x, S)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [1, 1, S, D] against [B, H, S, D]
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        n_rep = self.heads // self.kv_heads
        k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)
        mask = torch.triu(torch.ones(S, S, dtype=torch.bool, device=x.device), diagonal=1)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=~mask)
        return self.o_proj(o.transpose(1, 2).reshape(B, S, -1))


class MLP(nn.Module):
    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, ffn, bias=False)
        self.up_proj = nn.Linear(hidden, ffn, bias=False)
        self.down_proj = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderBlock(nn.Module):
    def __init__(self, hidden: int = 128, heads: int = 8, kv_heads: int = 4, ffn: int = 256):
        super().__init__()
        self.input_layernorm = nn.RMSNorm(hidden, eps=1e-6)
        self.self_attn = Attention(hidden, heads, kv_heads)
        self.post_attention_layernorm = nn.RMSNorm(hidden, eps=1e-6)
        self.mlp = MLP(hidden, ffn)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.self_attn(self.input_layernorm(x))
        return h + self.mlp(self.post_attention_layernorm(h))


def block_plan() -> dict[str, mg.plans.ParallelStyle]:
    """Tensor parallel projections (heads and FFN columns sharded), sequence-parallel norms."""
    plan: dict[str, mg.plans.ParallelStyle] = {
        f"self_attn.{p}_proj": mg.ColwiseParallel() for p in ("q", "k", "v")
    }
    plan["self_attn.o_proj"] = mg.RowwiseParallel()
    plan["mlp.gate_proj"] = mg.ColwiseParallel()
    plan["mlp.up_proj"] = mg.ColwiseParallel()
    plan["mlp.down_proj"] = mg.RowwiseParallel()
    plan["input_layernorm"] = mg.SequenceParallel()
    plan["post_attention_layernorm"] = mg.SequenceParallel()
    return plan


def main(topology: str = "2x2", backend: str = "reference") -> float:
    torch.manual_seed(0)
    model = DecoderBlock().eval()
    x = torch.randn(1, 64, 128)
    prog = mg.compile(model, (x,), plan=block_plan(), topology=topology, backend=backend)
    got = prog(x)
    with torch.no_grad():
        want = model(x)
    err = ((got - want).norm() / want.norm()).item()
    print(prog)
    print(prog.opgraph.to_text())
    print("tasks per (role, kind):", dict(prog.graph.stats().by_role_kind()))
    print(f"relative error vs eager torch: {err:.2e}")
    assert err < 1e-4, err
    return err


if __name__ == "__main__":
    main()
