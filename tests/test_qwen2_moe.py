"""Qwen2-MoE as transformers writes it traces and matches eager torch under ExpertParallel: its
shared expert (``shared_expert`` scaled by ``sigmoid(shared_expert_gate(x))``, added to the
routed output) as ordinary ops beside moe_dispatch_combine, placed as the plan says (replicated,
or its linears tensor-parallel), and routing without renormalisation (``norm_topk_prob=False``:
the op's ``normalize=False``), also for Qwen3-MoE and OLMoE. Renormalising blocks build the
graphs they built before the flag. Small configs built in code: nothing is fetched. The Triton
route body's branch: tests/test_triton_moe_unnormalized.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from test_compile_speed_digest import graph_digest, schedule_digest
from test_transformers_models import MOE, SMALL, Layer, qwen3_moe, randomize, tp_plan
from transformers import OlmoeConfig, Qwen2MoeConfig
from transformers.models.olmoe.modeling_olmoe import OlmoeDecoderLayer, OlmoeRotaryEmbedding
from transformers.models.qwen2_moe.modeling_qwen2_moe import (
    Qwen2MoeDecoderLayer,
    Qwen2MoeRotaryEmbedding,
    Qwen2MoeSparseMoeBlock,
)

import mgraph as mg
from helpers import rel_err

OP = "moe_dispatch_combine"
B, S = 2, 16
TOL = 1e-5  # fp32: the op sums in another order than eager's per-expert loop
QWEN2 = dict(MOE, num_experts=4, moe_intermediate_size=96, shared_expert_intermediate_size=128)
SHARED_TP = {
    "layer.mlp.shared_expert.gate_proj": mg.ColwiseParallel(),
    "layer.mlp.shared_expert.up_proj": mg.ColwiseParallel(),
    "layer.mlp.shared_expert.down_proj": mg.RowwiseParallel(),
}


def qwen2_moe(norm_topk_prob: bool) -> Layer:
    config = Qwen2MoeConfig(**QWEN2, norm_topk_prob=norm_topk_prob, attn_implementation="sdpa")
    return randomize(Layer(config, Qwen2MoeDecoderLayer, Qwen2MoeRotaryEmbedding))


def matches(model: nn.Module, plan: dict, topology: str) -> mg.Program:
    x = torch.randn(B, S, SMALL["hidden_size"])
    prog = mg.compile(model, (x,), plan=plan, topology=topology)
    with torch.no_grad():
        want = model(x)
    err = rel_err(prog(x), want)
    assert err < TOL, (topology, err)
    return prog


@pytest.mark.parametrize("topology,plan,norm", [
    ("1x1", "ep", True), ("1x1", "ep", False), ("1x2", "ep", False), ("2x2", "tp+ep", True),
    ("2x2", "tp+ep+shared", False)])  # fmt: skip
def test_qwen2_moe_decoder_layer(topology, plan, norm):
    torch.manual_seed(0)
    styles = tp_plan(mlp=False) if plan.startswith("tp") else {}
    styles["layer.mlp"] = mg.ExpertParallel(router="gate")
    if plan.endswith("shared"):
        styles.update(SHARED_TP)
    prog = matches(qwen2_moe(norm), styles, topology)
    (moe,) = [n for n in prog.opgraph.nodes if n.op == OP]
    assert (moe.params["E"], moe.params["top_k"], moe.path) == (4, 2, "layer.mlp")
    # the flag is recorded only when off: a renormalising block's node is as before it
    assert moe.params.get("normalize", True) is norm and ("normalize" in moe.params) != norm
    # the shared expert: ordinary ops outside the fused op, as the plan places them
    shared = [n for n in prog.opgraph.nodes if n.path.startswith("layer.mlp.shared_expert")]
    ops = [n.op for n in shared]
    if plan.endswith("shared"):
        # the gate's one-column product is a row sum (aten._dot_rows): elementwise, row_reduce
        assert ops == ["matmul", "elementwise", "matmul", "elementwise", "gemm_allreduce",
                       "elementwise", "row_reduce"], ops  # fmt: skip
        assert [n.params.get("shard") for n in shared[:3:2]] == ["cols", "cols"]
    else:
        assert ops == ["matmul", "elementwise", "matmul", "elementwise", "matmul", "elementwise",
                       "row_reduce"], ops  # fmt: skip
        assert {n.outputs["out"].layout.kind for n in shared} == {"replicate"}
    gate = [n for n in prog.opgraph.nodes if n.op == "elementwise" and n.path == "layer.mlp"]
    assert len(gate) == 3  # sigmoid, its product with the shared expert, the sum with the routed


def test_sparse_moe_block_as_the_root():
    """The block alone, planned at the root (path ""): its shared expert keeps its parameters'
    names."""
    torch.manual_seed(1)
    config = Qwen2MoeConfig(**QWEN2, norm_topk_prob=False)
    block = randomize(Qwen2MoeSparseMoeBlock(config))
    x = torch.randn(B, S, SMALL["hidden_size"])
    prog = mg.compile(block, (x,), plan={"": mg.ExpertParallel(router="gate")}, topology="1x2")
    with torch.no_grad():
        assert rel_err(prog(x), block(x)) < TOL
    fqns = {f for v in prog.opgraph.params for f in v.source.fqns}
    assert {"shared_expert.up_proj.weight", "shared_expert_gate.weight"} <= fqns


@pytest.mark.parametrize("family", ["qwen3_moe", "olmoe"])
def test_other_families_without_renormalisation(family):
    torch.manual_seed(2)
    if family == "qwen3_moe":
        model = qwen3_moe(norm_topk_prob=False)
    else:  # OLMoE's default is norm_topk_prob=False
        config = OlmoeConfig(**dict(MOE, num_experts=4), attn_implementation="sdpa")
        assert config.norm_topk_prob is False
        model = randomize(Layer(config, OlmoeDecoderLayer, OlmoeRotaryEmbedding))
    prog = matches(model, {"layer.mlp": mg.ExpertParallel(router="gate")}, "1x2")
    (moe,) = [n for n in prog.opgraph.nodes if n.op == OP]
    assert moe.params["normalize"] is False


def test_renormalising_graphs_are_as_before_the_flag():
    """Digests taken before ``normalize`` existed: the op alone, and a traced Qwen3-MoE layer
    (its program's graph and schedule)."""
    pinned = {"1x1": "6603ebb6ad4b6245", "1x2": "4b2c23512e21ffad"}
    for topology, digest in pinned.items():
        g = mg.ops.moe_dispatch_combine(T=64, H=32, E=8, top_k=2, F=48, topology=topology)
        assert graph_digest(g) == digest and "normalize" not in g.params
    torch.manual_seed(3)
    model = qwen3_moe()
    x = torch.randn(B, S, SMALL["hidden_size"])
    prog = mg.compile(model, (x,), plan={"layer.mlp": mg.ExpertParallel(router="gate")})
    # re-pinned on purpose (v21): a relayout tile's bytes hint is twice its write, not all of
    # its input (the graph digest counts Task.bytes; the schedule did not move)
    assert (graph_digest(prog.graph), schedule_digest(prog.schedule)) == (
        "77384e842dad3cb7", "e793676ca0a76a8b")  # fmt: skip


@pytest.mark.parametrize("topology", ["1x1", "1x2"])
def test_unnormalized_op_against_eager_routing(topology):
    """The op alone with normalize=False: the CPU runtime and the reference against routing
    written out as transformers writes it (softmax over all experts, top k, no renormalisation);
    a renormalising graph differs from it."""
    T, H, E, k, F = 64, 32, 8, 2, 48
    op = mg.ops.get_op(OP)
    g = mg.ops.moe_dispatch_combine(T=T, H=H, E=E, top_k=k, F=F, topology=topology,
                                    normalize=False)  # fmt: skip
    assert g.params["normalize"] is False
    assert {t.params.get("normalize") for t in g.tasks if t.kind == "moe_route"} == {0}
    inputs = op.random_inputs(g, seed=4)
    probs, experts = inputs["router_logits"].softmax(-1).topk(k, dim=-1)
    x = inputs["x"]
    want = torch.zeros_like(x)
    for slot in range(k):
        for e in range(E):
            rows = experts[:, slot] == e
            hidden = nn.functional.silu(x[rows] @ inputs["w_gate"][e]) * (x[rows] @ inputs["w_up"][e])
            want[rows] += probs[rows, slot, None] * (hidden @ inputs["w_down"][e])
    got = mg.run(mg.schedule(g), inputs).outputs["out"]
    assert rel_err(got, want) < 1e-6
    assert rel_err(op.run_reference(inputs, g.params)["out"], want) < 1e-6
    normalized = mg.ops.moe_dispatch_combine(T=T, H=H, E=E, top_k=k, F=F, topology=topology)
    assert rel_err(mg.run(mg.schedule(normalized), inputs).outputs["out"], want) > 0.1


class GateOnly(nn.Module):
    """A shared expert gate without a shared expert."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.gate, self.experts = block.gate, block.experts
        self.shared_expert_gate = block.shared_expert_gate

    def forward(self, x):
        return x


def test_what_still_does_not_trace_is_a_named_error():
    config = Qwen2MoeConfig(**QWEN2)
    x = torch.randn(B, S, SMALL["hidden_size"])
    plan = {"": mg.ExpertParallel(router="gate")}
    block = randomize(Qwen2MoeSparseMoeBlock(config))
    with pytest.raises(mg.PlanError, match="gate 'shared_expert_gate' but no shared expert"):
        mg.compile(GateOnly(block), (x,), plan=plan)
    block.norm_topk_prob = not config.norm_topk_prob  # the block says one thing, its router another
    with pytest.raises(mg.PlanError, match="norm_topk_prob disagrees"):
        mg.compile(block, (x,), plan=plan)
    del block.norm_topk_prob
    block.extra = nn.Linear(4, 4)  # a module the op would silently lose
    with pytest.raises(mg.PlanError, match="'extra'"):
        mg.compile(block, (x,), plan=plan)
    # a plan entry inside the block but outside its shared expert
    layer = qwen2_moe(True)
    with pytest.raises(mg.PlanError, match="inside the ExpertParallel block"):
        mg.compile(layer, (torch.randn(B, S, SMALL["hidden_size"]),),
                   plan={"layer.mlp": mg.ExpertParallel(router="gate"),
                         "layer.mlp.gate": mg.SequenceParallel()})  # fmt: skip
