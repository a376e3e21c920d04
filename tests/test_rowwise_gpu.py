"""The kinds that had not run on a GPU (README): layer_norm, softmax and row_reduce bodies, and the
ring-attention op, in the megakernel on one GPU (``pytest -m gpu``; skipped without CUDA), as
test_megakernel_gpu.py runs the GEMMs: random inputs, three launches, against the op's fp32
reference for the whole output AND every tile (one racy or unwritten tile fails). On one GPU the
ring has one rank: its tasks are the attention chains and their in-chain finalize, no transfers.
Sizes: whole row tiles and a short last one; row widths the fast paths take and one they do not.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn as nn

import mgraph as mg

os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")

BF16, F32 = torch.bfloat16, torch.float32
# bf16 outputs: half an ulp (2^-9) on every element plus the inputs' rounding; float32: TF32
# dots in attention (10-bit mantissas)
TOL = {BF16: 1e-2, F32: 5e-3}

CASES = [
    ("layer_norm", dict(rows=4096, cols=4096), BF16),
    ("layer_norm", dict(rows=1000, cols=1000, has_bias=False), BF16),
    ("softmax", dict(rows=4096, cols=4096), BF16),
    ("softmax", dict(rows=1000, cols=3000), F32),
    ("row_reduce", dict(rows=4096, cols=4096, fn="mean"), BF16),
    ("row_reduce", dict(rows=1000, cols=1000, fn="sum"), F32),
    ("row_reduce", dict(rows=4096, cols=2048, fn="amax"), BF16),
    ("row_reduce", dict(rows=1000, cols=4096, fn="amin"), BF16),
    # rows of 1024 bf16 columns: the traced row-ops module's width (tests/gpu_programs.py)
    ("layer_norm", dict(rows=2048, cols=1024), BF16),
    ("softmax", dict(rows=2048, cols=1024), BF16),
    ("row_reduce", dict(rows=2048, cols=1024, fn="amax"), BF16),
    ("row_reduce", dict(rows=2048, cols=1024, fn="mean"), BF16),
    ("ring_attention", dict(B=1, H=8, S=2048, D=128, kv_heads=2, causal=True), BF16),
    ("ring_attention", dict(B=2, H=4, S=1024, D=64), BF16),
    ("ring_attention", dict(B=1, H=4, S=512, D=128, causal=True), F32),
]


def _tiles(out: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """The output as 2-D rows (attention: one row per (batch, head, position)) and a tile."""
    flat = out.reshape(-1, out.shape[-1])
    return flat, 64, min(128, flat.shape[-1])


@pytest.mark.gpu
@pytest.mark.parametrize("op,kw,dtype", CASES, ids=lambda v: str(v) if not isinstance(v, dict)
                         else ",".join(f"{k}={x}" for k, x in v.items()))
def test_rowwise_and_attention_kinds_match_torch_on_a_gpu(op, kw, dtype):
    from mgraph.runtime.memory import worst_tile_error

    definition = mg.ops.get_op(op)
    graph = definition(topology="1x1", dtype=dtype, **kw)
    sched = mg.schedule(graph)
    for launch in range(3):
        inputs = definition.random_inputs(graph, seed=launch, device="cuda")
        got = mg.run(sched, inputs, backend="triton").outputs["out"]
        want = definition.run_reference({k: v.float() for k, v in inputs.items()},
                                        graph.params)["out"]
        g, rows, cols = _tiles(got.float().cpu())
        w, _, _ = _tiles(want.float().cpu())
        assert bool(w.isfinite().all()) and float(w.abs().max()) > 0, (op, kw)  # a real check
        err = ((g - w).norm() / w.norm()).item()
        assert err < TOL[dtype], (op, kw, launch, err)
        tile = worst_tile_error(g, w, rows=rows, cols=cols)
        assert tile < TOL[dtype], (op, kw, launch, tile)


class RowOps(nn.Module):
    """LayerNorm, softmax and two row reductions (amax, mean) broadcast back over the rows:
    the row-wise kinds traced into one Program (layer_norm, softmax, row_reduce, ewise)."""

    def __init__(self, cols: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(cols)
        with torch.no_grad():  # not the ones and zeros it starts with
            self.ln.weight.uniform_(0.5, 1.5)
            self.ln.bias.uniform_(-0.5, 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p = torch.softmax(self.ln(x), dim=-1)
        return p * x.amax(-1, keepdim=True) + x.mean(-1, keepdim=True)


@pytest.mark.gpu
def test_traced_row_ops_program_matches_torch_on_a_gpu():
    """The same kinds traced from a module into one Program (backend="triton"), three calls
    (the third replays the CUDA graph), against eager torch in fp32 on the same bf16 inputs."""
    import copy

    from mgraph.runtime.memory import worst_tile_error

    torch.manual_seed(1)
    model = RowOps(1024).to("cuda", BF16).eval()
    exact = copy.deepcopy(model).float()
    x = torch.randn(2, 1024, 1024, device="cuda", dtype=BF16)
    prog = mg.compile(model, (x,), backend="triton")
    assert {"layer_norm", "softmax", "row_reduce", "ewise"} <= {t.kind for t in prog.graph.tasks}
    for call in range(3):
        xs = x * (1.0 - 0.25 * call)
        with torch.no_grad():
            want = exact(xs.float()).reshape(-1, 1024).cpu()
        got = prog(xs).float().reshape(-1, 1024).cpu()
        assert ((got - want).norm() / want.norm()).item() < TOL[BF16], call
        assert worst_tile_error(got, want, rows=64, cols=128) < TOL[BF16], call
