"""Causal self-attention over a long sequence with context parallelism (ring attention).

Under ContextParallel the attention module runs on a shard of the sequence. Causal attention
shards it zigzag (rank r holds chunks r and 2W-1-r of 2W) so every rank gets the same share of
the unmasked blocks; the q/k/v/o projections run on each rank's tokens, and
``scaled_dot_product_attention`` becomes the fused ring_attention op: each rank folds the key and
value blocks of every other rank into an online softmax as they arrive, while the blocks move
hierarchically (once per node over RDMA, then over NVLink).

    python examples/ring_attention.py
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

import mgraph as mg


class CausalSelfAttention(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.q_proj = nn.Linear(hidden, hidden, bias=False)
        self.k_proj = nn.Linear(hidden, hidden, bias=False)
        self.v_proj = nn.Linear(hidden, hidden, bias=False)
        self.o_proj = nn.Linear(hidden, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, S, H = x.shape
        q = self.q_proj(x).view(B, S, self.heads, -1).transpose(1, 2)
        k = self.k_proj(x).view(B, S, self.heads, -1).transpose(1, 2)
        v = self.v_proj(x).view(B, S, self.heads, -1).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(o.transpose(1, 2).reshape(B, S, H))


class Model(nn.Module):
    def __init__(self, hidden: int = 64, heads: int = 2) -> None:
        super().__init__()
        self.attn = CausalSelfAttention(hidden, heads)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.attn(x)


# block: sequence rows per attention tile (it must divide each rank's zigzag chunks).
PLAN = {"attn": mg.ContextParallel(options={"block": 32})}


def main(topology: str = "2x2", backend: str = "reference", seq: int = 512) -> float:
    torch.manual_seed(0)
    model = Model().eval()
    x = torch.randn(1, seq, 64)
    prog = mg.compile(model, (x,), plan=PLAN, topology=topology, backend=backend)
    got = prog(x)
    with torch.no_grad():
        want = model(x)
    err = ((got - want).norm() / want.norm()).item()
    print(prog)
    print(prog.opgraph.to_text())
    stats = prog.graph.stats()
    print(f"RDMA bytes sent per node: {stats.rdma_sent_per_node}")
    print(f"relative error vs eager torch: {err:.2e}")
    assert err < 1e-4, err
    return err


if __name__ == "__main__":
    main()
