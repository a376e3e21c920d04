"""GEMMs whose operands' rows are not whole 16-byte units, in bf16 on one GPU through
backend="triton" (``pytest -m gpu``; skipped without CUDA): TMA cannot address those rows, and the
GEMM body runs such tasks by masked pointers (mgraph/ops/gemm_pointers.py) where it used to refuse
the graph. Random inputs, three launches, against float32 torch over the whole output and every
tile, the short edge tiles included (one racy, unwritten or mis-masked tile fails):

- op GEMMs: routers of 4 and 60 experts (8- and 120-byte rows), GPT-2's lm_head (768 x 50257),
  K of 1001 (A's rows), regions of several blocks, and a gated unit (gemm_glu) with K of 1001;
- traced modules: a Linear on TMA beside one of 1001 outputs in the same kernel, and a MoE block
  (stacked experts, ExpertParallel on the one GPU) with 4 and with 60 experts, against float32
  eager on the same bf16 weights: as close as eager bf16 itself is (routing near a top-k tie
  can pick another expert in bf16, in eager too).
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.nn as nn

import mgraph as mg
from mgraph.runtime.memory import worst_tile_error

os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")

BF16 = torch.bfloat16
TOL = 1e-2  # bf16 outputs: half an ulp (2^-9) on every element plus the inputs' rounding


def tile_error(got: torch.Tensor, want: torch.Tensor, rows: int, cols: int) -> float:
    """The worst relative error of any rows x cols tile of the 2-D views, edge tiles included;
    inf where ``got`` is not finite where ``want`` is."""
    return worst_tile_error(got, want, rows, cols)


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


OPS = [
    ("gemm", dict(M=4096, N=4, K=2048, tile=[128, 256])),  # a router of 4 experts
    ("gemm", dict(M=2048, N=60, K=2048, tile=[128, 256])),  # Qwen1.5-MoE's 60
    ("gemm", dict(M=512, N=50257, K=768, tile=[128, 256])),  # GPT-2's lm_head
    ("gemm", dict(M=1024, N=1024, K=1001, tile=[128, 256])),  # A's rows of 1001
    ("gemm", dict(M=1000, N=1001, K=512, tile=[256, 512])),  # regions of several blocks
    ("matmul_glu", dict(M=512, N=512, K=1001, tile=[128, 128])),  # gemm_glu by pointers
]


@pytest.mark.gpu
@pytest.mark.parametrize("op,kw", OPS, ids=lambda v: v if isinstance(v, str)
                         else ",".join(f"{k}={x}" for k, x in v.items()))
def test_gemm_with_rows_tma_cannot_address_matches_torch_on_a_gpu(op, kw):
    from mgraph.runtime.megakernel.encode import GEMM_KINDS, gemm_by_pointers

    definition = mg.ops.get_op(op)
    graph = definition(topology="1x1", dtype=BF16, **kw)
    gemms = [t for t in graph.tasks if t.kind in GEMM_KINDS]
    assert all(gemm_by_pointers(graph, t) for t in gemms)  # the path under test
    sched = mg.schedule(graph)
    for launch in range(3):
        inputs = definition.random_inputs(graph, seed=launch, device="cuda")
        got = mg.run(sched, inputs, backend="triton").outputs["out"].float().cpu()
        want = definition.run_reference({k: v.float() for k, v in inputs.items()},
                                        graph.params)["out"].cpu()
        assert bool(want.isfinite().all()) and float(want.abs().max()) > 0  # a real check
        assert rel(got, want) < TOL, (op, kw, launch, rel(got, want))
        tile = tile_error(got, want, *kw["tile"])
        assert tile < TOL, (op, kw, launch, tile)


class Head(nn.Module):
    """A Linear on the TMA path (its rows 16-byte multiples), GELU, then an odd vocabulary."""

    def __init__(self, hidden: int, vocab: int) -> None:
        super().__init__()
        self.proj = nn.Linear(hidden, hidden)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(nn.functional.gelu(self.proj(x)))


def _matches_eager(model: nn.Module, x: torch.Tensor, plan, tile: tuple[int, int],
                   kinds: set[str]) -> None:
    """``model`` compiled for the GPU, three calls against float32 eager on the same bf16
    weights and inputs: within twice eager bf16's own error (whole and per tile) plus 2e-3."""
    from mgraph.runtime.megakernel.encode import GEMM_KINDS, gemm_by_pointers

    exact = copy.deepcopy(model).float()
    prog = mg.compile(model, (x,), plan=plan, backend="triton")
    graph = prog.graph
    assert kinds <= {t.kind for t in graph.tasks}
    assert any(gemm_by_pointers(graph, t) for t in graph.tasks if t.kind in GEMM_KINDS)
    for call in range(3):
        xs = x * (1.0 - 0.25 * call)
        with torch.no_grad():
            want = exact(xs.float()).cpu()
            eager = model(xs).float().cpu()
        got = prog(xs).float().cpu()
        bound = 2 * rel(eager, want) + 2e-3
        assert rel(got, want) < bound, (call, rel(got, want), bound)
        tile_bound = 2 * tile_error(eager, want, *tile) + 2e-3
        assert tile_error(got, want, *tile) < tile_bound, (call, tile_bound)


@pytest.mark.gpu
def test_traced_head_with_an_odd_vocabulary_matches_torch_on_a_gpu():
    """proj (TMA, maybe the static prefix) and lm_head of 1001 columns (by pointers) in one
    kernel: the kernel compiles both paths."""
    torch.manual_seed(0)
    model = Head(1024, 1001).to("cuda", BF16).eval()
    x = torch.randn(2, 256, 1024, device="cuda", dtype=BF16)
    _matches_eager(model, x, None, (128, 256), {"gemm"})


@pytest.mark.gpu
@pytest.mark.parametrize("experts,top_k", [(4, 2), (60, 4)])
def test_traced_moe_block_with_a_narrow_router_matches_torch_on_a_gpu(experts, top_k):
    """A MoE block whose router Linear(256, E) writes logits rows of 8 (E=4) or 120 (E=60)
    bytes, under ExpertParallel on the one GPU (route, experts, combine in the kernel)."""
    from test_trace_moe import StackedMoeBlock

    torch.manual_seed(0)
    model = StackedMoeBlock(hidden=256, ffn=512, experts=experts, top_k=top_k)
    model = model.to("cuda", BF16).eval()
    x = torch.randn(2, 128, 256, device="cuda", dtype=BF16)
    _matches_eager(model, x, {"": mg.ExpertParallel(router="gate")}, (64, 128),
                   {"gemm", "moe_route", "moe_expert", "moe_combine"})
