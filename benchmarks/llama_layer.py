"""The Llama-style decoder layer bench_layer.py times (hidden, heads, KV heads, FFN from its
arguments): RMSNorm, grouped-query attention with RoPE (SDPA, causal), residual add, RMSNorm,
SwiGLU MLP, residual add, written as model code writes it (what mgraph traces)."""

from __future__ import annotations

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int, theta: float = 500000.0) -> None:
        super().__init__()
        self.head_dim = hidden // heads
        self.q_proj = nn.Linear(hidden, heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(heads * self.head_dim, hidden, bias=False)
        exponents = torch.arange(0, self.head_dim, 2).float() / self.head_dim
        self.register_buffer("inv_freq", 1.0 / theta**exponents, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, S, _ = x.shape  # under torch's TP: the gathered (Replicate) input, global shape
        # -1 heads: under torch's TP the projections return this rank's heads only
        q = self.q_proj(x).view(B, S, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, S, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, S, -1, self.head_dim).transpose(1, 2)
        freqs = torch.outer(torch.arange(S, device=self.inv_freq.device).float(), self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)  # [S, D]: broadcasts over [B, H, S, D]
        cos, sin = emb.cos().to(q.dtype), emb.sin().to(q.dtype)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o_proj(o.transpose(1, 2).reshape(B, S, -1))


class MLP(nn.Module):
    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, ffn, bias=False)
        self.up_proj = nn.Linear(hidden, ffn, bias=False)
        self.down_proj = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Llama's decoder layer with nn.RMSNorm: mgraph rejects the fp32 upcast of transformers'
    LlamaRMSNorm in a bf16 program (a DTypeError), so the norm is torch's own."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, ffn: int) -> None:
        super().__init__()
        self.input_layernorm = nn.RMSNorm(hidden, eps=1e-5)
        self.self_attn = Attention(hidden, heads, kv_heads)
        self.post_attention_layernorm = nn.RMSNorm(hidden, eps=1e-5)
        self.mlp = MLP(hidden, ffn)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.self_attn(self.input_layernorm(x))
        return h + self.mlp(self.post_attention_layernorm(h))


def build_layer(args: argparse.Namespace, device: torch.device) -> DecoderLayer:
    """The layer with seed-0 weights (norm weights random too, so the norms are checked)."""
    torch.manual_seed(0)
    layer = DecoderLayer(args.hidden, args.heads, args.kv_heads, args.ffn)
    with torch.no_grad():
        for lin in layer.modules():
            if isinstance(lin, nn.Linear):  # unit-variance activations through the layer
                nn.init.normal_(lin.weight, std=lin.in_features**-0.5)
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            norm.weight.uniform_(0.5, 1.5)
    return layer.to(device, args.dtype).eval()
