"""A mixture-of-experts layer (top-2 of 8 SwiGLU experts) with expert parallelism.

The block is written as it would be for eager PyTorch: a router, top-k on its logits, softmax
over the chosen k, and a loop over experts that gathers each expert's tokens. That loop is
data-dependent, so torch.export could not trace it; under ExpertParallel mgraph does not trace
inside the block at all: it becomes the router (a local GEMM on each rank's tokens) and ONE fused
moe_dispatch_combine op, with tokens and experts sharded over all ranks. Which rows go where is
decided at run time by the route tile, so the same static graph is exact for any routing that
fits its segments: here, 8 experts and top-2, the op's default capacity_factor (4 = E / top_k)
gives each (source rank, expert) segment room for all of the rank's tokens, so no routing drops
a token (larger E / top_k than the factor would bound the segments and drop overflowing picks;
ExpertParallel(options={"capacity_factor": ...}) sets it).

    python examples/moe_layer.py
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

import mgraph as mg


class Expert(nn.Module):
    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, ffn, bias=False)
        self.up_proj = nn.Linear(hidden, ffn, bias=False)
        self.down_proj = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class SparseMoE(nn.Module):
    """Mixtral-style: top-k on the router logits, softmax over the k weights."""

    def __init__(self, hidden: int, ffn: int, experts: int, top_k: int) -> None:
        super().__init__()
        self.top_k = top_k
        self.router = nn.Linear(hidden, experts, bias=False)
        self.experts = nn.ModuleList(Expert(hidden, ffn) for _ in range(experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        weights, chosen = torch.topk(self.router(x), self.top_k, dim=-1)
        weights = torch.softmax(weights, dim=-1)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            token, slot = (chosen == e).nonzero(as_tuple=True)
            if token.numel():
                out.index_add_(0, token, expert(x[token]) * weights[token, slot, None])
        return out.reshape(shape)


class MoELayer(nn.Module):
    def __init__(self, hidden: int = 64, ffn: int = 128, experts: int = 8, top_k: int = 2) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(hidden)
        self.moe = SparseMoE(hidden, ffn, experts, top_k)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.moe(self.norm(x))


PLAN = {"moe": mg.ExpertParallel()}


def main(topology: str = "2x2", backend: str = "reference") -> float:
    torch.manual_seed(0)
    model = MoELayer().eval()
    x = torch.randn(2, 32, 64)
    prog = mg.compile(model, (x,), plan=PLAN, topology=topology, backend=backend)
    got = prog(x)
    with torch.no_grad():
        want = model(x)
    err = ((got - want).norm() / want.norm()).item()
    print(prog)
    print(prog.opgraph.to_text())
    print(f"relative error vs eager torch: {err:.2e}")
    assert err < 1e-4, err
    return err


if __name__ == "__main__":
    main()
