"""Runs under TRITON_INTERPRET=1 in a subprocess (see test_program_triton.py): Programs compiled
with backend="triton" run in the interpreted megakernel, on 1 rank (the Program's own runtime,
global tensors) and on 2 ranks (every rank in one interpreter program), against eager torch.
Prints one JSON line per case: {"case", "error", "ewise_per_tile", "kinds"}."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

assert os.environ.get("TRITON_INTERPRET") == "1", "set TRITON_INTERPRET=1 before importing triton"

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
from test_program_triton import chain_case, ewise_tasks_per_tile  # noqa: E402

import mgraph as mg  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

INTERPRET = {"interpret": True}


def report(case: str, prog: mg.Program, model: nn.Module, args: tuple) -> None:
    """Run ``prog`` twice (the second launch reuses its runtime) against eager torch."""
    with torch.no_grad():
        want = model(*args)
    errors = []
    for scale in (1.0, -0.5):
        inputs = tuple(a * scale for a in args)
        with torch.no_grad():
            want = model(*inputs)
        got = prog(*inputs)
        errors.append(((got - want).norm() / want.norm()).item())
    has_ewise = any(t.kind == "ewise" for t in prog.graph.tasks)
    print(json.dumps({
        "case": case, "error": max(errors),
        "ewise_per_tile": ewise_tasks_per_tile(prog) if has_ewise else None,
        "kinds": sorted({t.kind for t in prog.graph.tasks}),
    }), flush=True)


def mlp() -> None:
    """The README's TP MLP: gate/up GEMMs, the fused silu * up chain, the row-parallel GEMM
    (its all-reduce on 2 ranks). Sizes whose GEMM tiles share one shape (runtime.py)."""
    from tp_mlp import PLAN, LlamaMLP

    torch.manual_seed(0)
    model = LlamaMLP(hidden=256, ffn=512).eval()
    x = torch.randn(2, 32, 256)
    # On 2 ranks down_proj's all-reduce is the default epilogue reduce-add (accumulate); its
    # GEMM waits for the silu * up tiles, so it runs in the kernel's dynamic GEMM body.
    plan = PLAN
    for topology in ("1x1", "1x2"):
        prog = mg.compile(model, (x,), plan=plan, topology=topology, backend="triton",
                          backend_options=INTERPRET)
        report(f"mlp-{topology}", prog, model, (x,))


def chains() -> None:
    """Random pointwise chains (one fused ewise task per tile) on 1 and 2 ranks."""
    for seed in range(2):
        model, args = chain_case(seed, shape=(2, 24, 80))
        for topology in ("1x1", "1x2"):
            prog = mg.compile(model, args, topology=topology, backend="triton",
                              backend_options=INTERPRET)
            report(f"chain-{topology}-{seed}", prog, model, args)


def custom() -> None:
    """register_op(..., triton=body): the user's body runs inside a traced Program."""
    import torch.nn.functional as F
    from megakernel_bodies_interp import gated_tile

    @mg.register_op("gated_program_test", triton=gated_tile, whole_rows=False, tile_rows=16)
    def gated(x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, scale: float = 0.5,
              shift: int = 1) -> torch.Tensor:
        return F.silu(x) * y * weight * scale + shift

    class Gate(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.rand(64) + 0.5)

        def forward(self, x, y):
            return gated(x, y, self.w, 0.25, 3)

    torch.manual_seed(2)
    model = Gate().eval()
    args = (torch.randn(2, 16, 64), torch.randn(2, 16, 64))
    prog = mg.compile(model, args, backend="triton", backend_options=INTERPRET)
    assert {t.kind for t in prog.graph.tasks} == {"gated_program_test"}
    report("custom-1x1", prog, model, args)


CASES = {"mlp": mlp, "chains": chains, "custom": custom}

if __name__ == "__main__":
    torch.set_num_threads(1)
    for name in sys.argv[1:] or list(CASES):
        CASES[name]()
