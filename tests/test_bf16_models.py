"""Model code in bfloat16, as users run it: transformers' decoder layers upcast to float32 around
their norms, softmaxes and rotary tables and cast back (``hidden_states.to(torch.float32)`` in
every RMSNorm). Those float32 intermediates were a DTypeError ("the program computes in
bfloat16"); now they trace, and the program matches float32 eager torch on the same bf16
weights and inputs as closely as eager bf16 does (reference backend; the GPU runs the same
traces: ``python examples/hf_families.py --gpu``)."""

from __future__ import annotations

import copy

import pytest
import torch
from test_transformers_models import dense, llama, mixtral, tp_plan

import mgraph as mg

CASES = {
    "llama": lambda: llama(),
    "llama-eager": lambda: llama("eager"),
    "qwen3": lambda: dense("qwen3"),
    "gemma2-softcap": lambda: dense("gemma2", attn="eager", attn_logit_softcapping=2.0),
    "phi3": lambda: dense("phi3"),
    "cohere": lambda: dense("cohere"),
    "mixtral": lambda: mixtral(),
}


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want).norm() / want.norm()).item()


@pytest.mark.parametrize("name,topology", [(n, "1x1") for n in CASES] + [("llama", "1x2")])
def test_bf16_layers_trace_and_match_eager(name, topology):
    torch.manual_seed(3)
    model = CASES[name]().to(torch.bfloat16)
    exact = copy.deepcopy(model).float()
    x = torch.randn(2, 16, 128, dtype=torch.bfloat16)
    plan = tp_plan() if topology != "1x1" else None
    if name == "mixtral":  # an MoE block traces under ExpertParallel
        plan = {"layer.mlp": mg.ExpertParallel(router="gate")}
    prog = mg.compile(model, (x,), plan=plan, topology=topology)
    assert prog.opgraph.dtype == "bfloat16"
    with torch.no_grad():
        want = exact(x.float())
        eager = rel(model(x), want)
    got = rel(prog(x), want)
    # eager bf16 itself is ~3e-3 off float32 here; mgraph keeps float32 inside fused bodies and
    # rounds where a value is stored between tasks: the same order, never many times more
    assert got < 2 * eager + 2e-3, (got, eager)


def test_a_float32_input_to_a_bf16_program_is_still_refused():
    model = llama().to(torch.bfloat16)
    x = torch.randn(2, 16, 128, dtype=torch.bfloat16)
    prog = mg.compile(model, (x,))
    with pytest.raises(mg.DTypeError):
        prog(x.float())


class Gate(torch.nn.Module):
    """One-column products: Qwen2-MoE's ``shared_expert_gate`` (Linear(H, 1)) and ``x @ w`` with
    w of shape [H, 1]."""

    def __init__(self, bias: bool) -> None:
        super().__init__()
        self.gate = torch.nn.Linear(128, 1, bias=bias)
        self.w = torch.nn.Parameter(torch.randn(128, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.gate(x)) * x + x @ self.w


@pytest.mark.parametrize("bias", [False, True])
def test_one_column_products_are_row_sums_the_megakernel_takes(bias):
    """As a GEMM, a one-column product has 1-element rows in its weight and output buffers,
    which TMA cannot address: the megakernel refused Qwen2-MoE's layer before launch
    (ScheduleError: 'rows are 1 elements, not a multiple of 16 bytes'). It is a row sum of
    ``x * w`` now."""
    from mgraph.runtime.megakernel import TritonRuntime

    torch.manual_seed(0)
    model = Gate(bias).eval()
    x = torch.randn(2, 40, 128)
    prog = mg.compile(model, (x,))
    assert "matmul" not in {n.op for n in prog.opgraph.nodes}
    with torch.no_grad():
        want = model(x)
    assert rel(prog(x), want) < 1e-5
    TritonRuntime(prog.schedule, interpret=True)  # encodes every task: no buffer TMA refuses
