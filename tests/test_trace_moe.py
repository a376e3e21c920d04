"""MoE blocks in both forms trace onto moe_dispatch_combine under ExpertParallel and match eager
torch: a ModuleList of experts, and stacked expert weights (one [E, 2F, H] gate-up tensor and
one [E, H, F] down tensor with a router module, as recent transformers Mixtral/Qwen-MoE blocks
write them)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import mgraph as mg
from helpers import rel_err


class StackedExperts(nn.Module):
    """transformers' MixtralExperts: the loop over the experts the tokens were routed to."""

    def __init__(self, experts: int, hidden: int, ffn: int, act: nn.Module | None = None):
        super().__init__()
        self.num_experts = experts
        self.gate_up_proj = nn.Parameter(torch.randn(experts, 2 * ffn, hidden) * hidden**-0.5)
        self.down_proj = nn.Parameter(torch.randn(experts, hidden, ffn) * ffn**-0.5)
        self.act_fn = act if act is not None else nn.SiLU()

    def forward(self, hidden_states, top_k_index, top_k_weights):
        final = torch.zeros_like(hidden_states)
        with torch.no_grad():
            expert_mask = F.one_hot(top_k_index, num_classes=self.num_experts).permute(2, 1, 0)
            expert_hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero()
        for expert_idx in expert_hit:
            expert_idx = expert_idx[0]
            top_k_pos, token_idx = torch.where(expert_mask[expert_idx])
            current = hidden_states[token_idx]
            gate, up = F.linear(current, self.gate_up_proj[expert_idx]).chunk(2, dim=-1)
            current = self.act_fn(gate) * up
            current = F.linear(current, self.down_proj[expert_idx])
            current = current * top_k_weights[token_idx, top_k_pos, None]
            final.index_add_(0, token_idx, current.to(final.dtype))
        return final


class TopKRouter(nn.Module):
    """transformers' MixtralTopKRouter: softmax over all experts, top k, renormalised."""

    def __init__(self, experts: int, hidden: int, top_k: int, norm_topk_prob: bool = True):
        super().__init__()
        self.top_k, self.norm_topk_prob = top_k, norm_topk_prob
        self.weight = nn.Parameter(torch.randn(experts, hidden) * hidden**-0.5)

    def forward(self, hidden_states):
        router_logits = F.linear(hidden_states, self.weight)
        probs = F.softmax(router_logits.float(), dim=-1)
        top_value, top_index = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            top_value = top_value / top_value.sum(dim=-1, keepdim=True)
        return router_logits, top_value.to(router_logits.dtype), top_index


class StackedMoeBlock(nn.Module):
    def __init__(self, hidden=32, ffn=48, experts=8, top_k=2, norm_topk_prob=True, act=None):
        super().__init__()
        self.gate = TopKRouter(experts, hidden, top_k, norm_topk_prob)
        self.experts = StackedExperts(experts, hidden, ffn, act)

    def forward(self, hidden_states):
        B, S, H = hidden_states.shape
        hidden_states = hidden_states.view(-1, H)
        _, weights, index = self.gate(hidden_states)
        return self.experts(hidden_states, index, weights).reshape(B, S, H)


class Expert(nn.Module):
    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(hidden, ffn, bias=False)
        self.w3 = nn.Linear(hidden, ffn, bias=False)
        self.w2 = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class ListMoeBlock(nn.Module):
    """The older transformers Mixtral block: a gate Linear and a ModuleList of w1/w2/w3."""

    def __init__(self, hidden=32, ffn=48, experts=8, top_k=2):
        super().__init__()
        self.top_k = top_k
        self.gate = nn.Linear(hidden, experts, bias=False)
        self.experts = nn.ModuleList(Expert(hidden, ffn) for _ in range(experts))

    def forward(self, hidden_states):
        B, S, H = hidden_states.shape
        x = hidden_states.view(-1, H)
        weights = F.softmax(self.gate(x), dim=1, dtype=torch.float)
        weights, chosen = torch.topk(weights, self.top_k, dim=-1)
        weights = (weights / weights.sum(dim=-1, keepdim=True)).to(x.dtype)
        out = torch.zeros_like(x)
        mask = F.one_hot(chosen, num_classes=len(self.experts)).permute(2, 1, 0)
        for e, expert in enumerate(self.experts):
            idx, top_x = torch.where(mask[e])
            out.index_add_(0, top_x, expert(x[top_x]) * weights[top_x, idx, None])
        return out.reshape(B, S, H)


class Layer(nn.Module):
    def __init__(self, moe: nn.Module, hidden: int = 32) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(hidden)
        self.mlp = moe

    def forward(self, x):
        return x + self.mlp(self.norm(x))


LIST_PLAN = mg.ExpertParallel(router="gate", gate_proj="w1", up_proj="w3", down_proj="w2",
                              top_k=2)


@pytest.mark.parametrize("form", ["stacked", "list"])
@pytest.mark.parametrize("topology", ["1x2", "2x2"])
def test_moe_block_forms_match_eager(form, topology):
    torch.manual_seed(0)
    model = Layer(StackedMoeBlock() if form == "stacked" else ListMoeBlock()).eval()
    style = mg.ExpertParallel(router="gate", top_k=2) if form == "stacked" else LIST_PLAN
    x = torch.randn(2, 8, 32)
    prog = mg.compile(model, (x,), plan={"mlp": style}, topology=topology)
    assert [n.op for n in prog.opgraph.nodes] == ["rms_norm", "matmul", "moe_dispatch_combine",
                                                  "elementwise"]
    with torch.no_grad():
        want = model(x)
    assert rel_err(prog(x), want) < 1e-5
    # Updated weights are read at the next call, through the same stacked-weight transforms.
    with torch.no_grad():
        for p in model.mlp.parameters():
            p.mul_(1.5)
        want = model(x)
    assert rel_err(prog(x), want) < 1e-5


def test_stacked_moe_that_is_not_mixtral_is_a_named_error():
    x = torch.randn(1, 8, 32)
    plan = {"mlp": mg.ExpertParallel(router="gate", top_k=2)}
    # norm_topk_prob=False is the op's normalize=False now (tests/test_qwen2_moe.py)
    model = Layer(StackedMoeBlock(norm_topk_prob=False)).eval()
    prog = mg.compile(model, (x,), plan=plan, topology="1x2")
    with torch.no_grad():
        assert rel_err(prog(x), model(x)) < 1e-5
    with pytest.raises(mg.PlanError, match="activation is GELU"):
        mg.compile(Layer(StackedMoeBlock(act=nn.GELU())), (x,), plan=plan, topology="1x2")
    block = StackedMoeBlock()
    block.experts.down_proj = nn.Parameter(torch.randn(8, 48, 32))  # [E, F, H]: transposed
    with pytest.raises(mg.PlanError, match=r"\[E, H, F\]"):
        mg.compile(Layer(block), (x,), plan=plan, topology="1x2")
    with pytest.raises(mg.PlanError, match="no bias-free router 'router'"):
        mg.compile(Layer(StackedMoeBlock()), (x,), plan={"mlp": mg.ExpertParallel(top_k=2)},
                   topology="1x2")


def test_a_capacity_bound_in_the_plan_is_announced():
    """A plan that bounds the segments (capacity_factor < E / top_k) may drop picks, which a
    Program does not report: compiling it warns, by name; the default bound never drops, so it
    compiles silently."""
    import warnings

    torch.manual_seed(0)
    model = Layer(StackedMoeBlock()).eval()
    x = torch.randn(2, 8, 32)
    bounded = mg.ExpertParallel(router="gate", top_k=2, options={"capacity_factor": 1.0})
    with pytest.warns(mg.errors.MoECapacityWarning, match="capacity_factor=1"):
        mg.compile(model, (x,), plan={"mlp": bounded}, topology="1x2")
    with warnings.catch_warnings():
        warnings.simplefilter("error", mg.errors.MoECapacityWarning)
        mg.compile(model, (x,), plan={"mlp": mg.ExpertParallel(router="gate", top_k=2)},
                   topology="1x2")
