"""Tensor-parallel Llama MLP: ``down(silu(gate(x)) * up(x))``, column-parallel then row-parallel.

The plan uses torch.distributed.tensor.parallel's vocabulary. gate_proj and up_proj shard their
output features (a local GEMM each: the replicated input needs no communication), SiLU and the
product run on each rank's columns, and down_proj shards its input features: its partial sums
are reduced by the fused GEMM+AllReduce, hierarchically over NVLink and RDMA.

    python examples/tp_mlp.py            # 2 nodes x 2 GPUs, on the CPU reference backend
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

import mgraph as mg


class LlamaMLP(nn.Module):
    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, ffn, bias=False)
        self.up_proj = nn.Linear(hidden, ffn, bias=False)
        self.down_proj = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


PLAN = {
    "gate_proj": mg.ColwiseParallel(),
    "up_proj": mg.ColwiseParallel(),
    "down_proj": mg.RowwiseParallel(),
}


def main(topology: str = "2x2", backend: str = "reference") -> float:
    torch.manual_seed(0)
    model = LlamaMLP(hidden=128, ffn=256).eval()
    x = torch.randn(2, 32, 128)
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
