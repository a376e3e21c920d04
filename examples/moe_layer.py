"""A mixture-of-experts layer (top-2 of 8 SwiGLU experts) with expert parallelism.

The block is written as it would be for eager PyTorch: a router, top-k on its logits, softmax
over the chosen k, and a loop over experts that gathers each expert's tokens. That loop is
data-dependent, so torch.export could not trace it; under ExpertParallel mgraph does not trace
inside the block at all: it becomes the router (a local GEMM on each rank's tokens) and ONE fused
moe_dispatch_combine op, with tokens and experts sharded over all ranks. Which rows go where is
decided at run time by the route tile, so the same static graph is exact for any routing that
fits its segments: ExpertParallel sets the op's capacity_factor to E / top_k, which gives each
(source rank, expert) segment room for all of the rank's tokens, so no routing drops a token, as
in eager torch (ExpertParallel(options={"capacity_factor": ...}) would bound the segments; the
Program returns only the layer's output, not how many picks that dropped).

The op alone reports its drops: ``mg.run(graph, inputs).outputs["dropped"]`` ([ranks, experts],
float32) counts the picks of each rank's tokens that each expert's segment had no room for. The
end of main() runs the layer's MoE that way with segments of an expert's mean load (4 rows:
capacity_factor 1), which a random router overflows, and checks the counts against the eager
routing.

    python examples/moe_layer.py
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

import mgraph as mg
from mgraph.ops.moe_dispatch_combine import segment_capacity


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


def moe_alone(model: MoELayer, x: torch.Tensor, topology: str, **options) -> dict:
    """The layer's MoE as one moe_dispatch_combine graph run with mg.run (its inputs: the
    normalised tokens, the router's logits, the experts' weights stacked as [E, in, out])."""
    moe = model.moe
    h = model.norm(x).reshape(-1, x.shape[-1])
    inputs = {"x": h, "router_logits": moe.router(h)}
    for name, proj in (("w_gate", "gate_proj"), ("w_up", "up_proj"), ("w_down", "down_proj")):
        inputs[name] = torch.stack([getattr(e, proj).weight.t() for e in moe.experts])
    E, F_ = inputs["w_gate"].shape[0], inputs["w_gate"].shape[2]
    graph = mg.ops.moe_dispatch_combine(T=h.shape[0], H=h.shape[1], E=E, top_k=moe.top_k, F=F_,
                                        topology=topology, **options)  # fmt: skip
    return mg.run(mg.schedule(graph), inputs).outputs


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

    # The op alone, segments of an expert's mean load: the picks past them are dropped, and the
    # op says how many per (rank, expert): the eager routing's picks past the segment's rows.
    with torch.no_grad():
        outputs = moe_alone(model, x, topology, capacity_factor=1.0, expert_rows=4)
        h = model.norm(x).reshape(-1, x.shape[-1])
        chosen = model.moe.router(h).topk(model.moe.top_k, dim=-1).indices
    ranks, E, k = mg.Topology.parse(topology).world_size, len(model.moe.experts), model.moe.top_k
    T_loc = h.shape[0] // ranks
    rows = segment_capacity(T_loc, E, k, capacity_factor=1.0, tile_rows=4)  # T_loc * k / E
    picks = torch.zeros(h.shape[0], E).scatter_(1, chosen, 1.0).view(ranks, T_loc, E).sum(1)
    dropped = outputs["dropped"]
    assert torch.equal(dropped, (picks - rows).clamp(min=0)) and dropped.sum() > 0, dropped
    print(f"op alone, segments of {rows} rows: {int(dropped.sum())} of {h.shape[0] * k} picks "
          f"dropped (per rank and expert: {dropped.int().tolist()})")  # fmt: skip
    return err


if __name__ == "__main__":
    main()
