"""A user-registered op: a fused RMSNorm, used inside a traced, tensor-parallel block.

``@mg.register_op`` turns the torch function into (1) a torch custom op, so the block still runs
eagerly and torch.export records ONE node for it, (2) a task kind whose CPU body is the function
applied to one row tile (a Triton body can be attached with ``triton=``), and (3) an mgraph op
lowered to one task per row tile of each rank's part. The rest of the block (a tensor-parallel
GELU MLP and the residual add) is traced as usual.

    python examples/custom_op.py
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

import mgraph as mg


# Registered once per process (registering a name twice is a RegistrationError). The parameters
# need annotations: torch derives the custom op's schema from them.
@mg.register_op("fused_rmsnorm")
def fused_rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """RMSNorm over the last dim, in fp32."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)


class Block(nn.Module):
    def __init__(self, hidden: int = 64, ffn: int = 256) -> None:
        super().__init__()
        self.norm_weight = nn.Parameter(1.0 + 0.1 * torch.randn(hidden))
        self.up = nn.Linear(hidden, ffn)
        self.down = nn.Linear(ffn, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = fused_rmsnorm(x, self.norm_weight, 1e-5)
        return x + self.down(F.gelu(self.up(h)))


PLAN = {"up": mg.ColwiseParallel(), "down": mg.RowwiseParallel()}


def main(topology: str = "2x2", backend: str = "reference") -> float:
    torch.manual_seed(0)
    model = Block().eval()
    x = torch.randn(4, 16, 64)
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
