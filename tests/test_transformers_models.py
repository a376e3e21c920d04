"""Decoder layers of the transformers library itself (not look-alikes) trace and match eager
torch on random inputs: Llama (eager and SDPA attention, rotary tables computed inside or passed
in, causal masks from transformers' own mask utility, additive and boolean mask inputs), Mixtral
and Qwen3-MoE (stacked experts under ExpertParallel), on 1 rank and under TP / TP+SP / EP plans.
Small configs built in code: nothing is fetched from a model hub."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import transformers  # imported once per module: it takes seconds
from test_trace import _load
from transformers import LlamaConfig, MixtralConfig, Qwen3MoeConfig
from transformers.masking_utils import create_causal_mask
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding
from transformers.models.mixtral.modeling_mixtral import (
    MixtralDecoderLayer,
    MixtralRotaryEmbedding,
)
from transformers.models.qwen3_moe.modeling_qwen3_moe import (
    Qwen3MoeDecoderLayer,
    Qwen3MoeRotaryEmbedding,
)

import mgraph as mg
from helpers import rel_err

# 8 query heads, 4 KV heads: on 4 ranks each rank holds 2 query heads and their KV head.
SMALL = dict(
    hidden_size=128,
    num_attention_heads=8,
    num_key_value_heads=4,
    intermediate_size=256,
    num_hidden_layers=1,
    max_position_embeddings=64,
)
MOE = dict(SMALL, num_experts_per_tok=2)
B, S = 2, 16


def randomize(module: nn.Module) -> nn.Module:
    """Random weights everywhere: norms start at ones and MoE experts at torch.empty."""
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in module.parameters():
            if p.dim() == 1:
                p.copy_(torch.rand(p.shape, generator=gen) + 0.5)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5)
    return module.eval()


class Layer(nn.Module):
    """One decoder layer fed as the model feeds it: rotary tables from the model's rotary
    embedding at positions arange(S) (or passed in), the mask from create_causal_mask (or a
    mask argument)."""

    def __init__(self, config, layer_cls, rotary_cls, rope: str = "inside", mask: str = "util"):
        super().__init__()
        self.config, self.rope, self.mask = config, rope, mask
        self.layer = layer_cls(config, 0)
        self.rotary_emb = rotary_cls(config)

    def forward(self, x: torch.Tensor, *extra: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(x.shape[1])[None]
        if self.rope == "input":
            cos_sin, extra = (extra[0], extra[1]), extra[2:]
        else:
            cos_sin = self.rotary_emb(x, positions)
        if self.mask in ("util", "padding"):  # padding: a [B, S] mask of kept tokens
            mask = create_causal_mask(
                config=self.config,
                inputs_embeds=x,
                attention_mask=extra[0] if self.mask == "padding" else None,
                cache=None,
                position_ids=positions,
            )
        else:
            mask = extra[0]
        return self.layer(x, attention_mask=mask, position_embeddings=cos_sin)


def llama(attn: str = "sdpa", **kw) -> Layer:
    config = LlamaConfig(**SMALL, attn_implementation=attn)
    return randomize(Layer(config, LlamaDecoderLayer, LlamaRotaryEmbedding, **kw))


def tp_plan(mlp: bool = True, sequence: bool = False) -> dict[str, mg.plans.ParallelStyle]:
    plan: dict[str, mg.plans.ParallelStyle] = {
        f"layer.self_attn.{p}_proj": mg.ColwiseParallel() for p in "qkv"
    }
    plan["layer.self_attn.o_proj"] = mg.RowwiseParallel()
    if mlp:
        plan.update(
            {
                "layer.mlp.gate_proj": mg.ColwiseParallel(),
                "layer.mlp.up_proj": mg.ColwiseParallel(),
                "layer.mlp.down_proj": mg.RowwiseParallel(),
            }
        )
    if sequence:
        plan["layer.input_layernorm"] = mg.SequenceParallel()
        plan["layer.post_attention_layernorm"] = mg.SequenceParallel()
    return plan


def compiled_matches(model, args, plan=None, topology="1x1", tol=1e-5) -> mg.Program:
    prog = mg.compile(model, args, plan=plan, topology=topology)
    with torch.no_grad():
        want = model(*args)
    got = prog(*args)
    assert rel_err(got, want) < tol, rel_err(got, want)
    return prog


def attention_nodes(prog) -> list:
    return [n for n in prog.opgraph.nodes if n.op in ("attention", "ring_attention")]


def test_the_tested_transformers_is_5x():
    assert int(transformers.__version__.split(".")[0]) >= 5, transformers.__version__


@pytest.mark.parametrize(
    "attn,topology,plan",
    [
        ("eager", "1x1", None),
        ("sdpa", "1x1", None),
        ("eager", "2x2", "tp+sp"),
        ("sdpa", "1x2", "tp"),
    ],
)
def test_llama_decoder_layer(attn, topology, plan):
    torch.manual_seed(0)
    model = llama(attn)
    x = torch.randn(B, S, SMALL["hidden_size"])
    styles = {None: None, "tp": tp_plan(), "tp+sp": tp_plan(sequence=True)}[plan]
    prog = compiled_matches(model, (x,), styles, topology)
    (att,) = attention_nodes(prog)
    # create_causal_mask's mask (None under SDPA, a folded float mask under eager) is causal:
    # no mask tensor reaches the attention, which skips the blocks above the diagonal.
    assert att.params["causal"] and "mask" not in att.inputs
    assert att.params["scale"] == pytest.approx(model.layer.self_attn.scaling)
    # repeat_kv's expand + reshape is undone (eager), or never there (SDPA's enable_gqa): the
    # op shares each KV head among 2 query heads
    assert att.params["kv_heads"] == SMALL["num_key_value_heads"]
    assert att.inputs["k"].shape[1] == att.inputs["v"].shape[1] == SMALL["num_key_value_heads"]
    if plan is not None:  # heads stay sharded through RoPE and the KV repeat
        assert att.params["layout"] == ["shard", 1, False]
    ops = {n.op for n in prog.opgraph.nodes}
    if plan == "tp+sp":
        assert {"allgather_gemm", "gemm_reduce_scatter"} <= ops


def test_llama_eager_attention_under_context_parallel():
    torch.manual_seed(5)
    x = torch.randn(B, S, SMALL["hidden_size"])
    plan = {"layer.self_attn": mg.ContextParallel()}
    prog = compiled_matches(llama("eager"), (x,), plan, "1x2")
    (att,) = attention_nodes(prog)
    assert att.op == "ring_attention" and att.params["causal"]
    assert att.params["kv_heads"] == SMALL["num_key_value_heads"]  # the ring moves 4 heads, not 8


def test_llama_rotary_tables_as_inputs():
    torch.manual_seed(1)
    model = llama("sdpa", rope="input")
    x = torch.randn(B, S, SMALL["hidden_size"])
    head_dim = SMALL["hidden_size"] // SMALL["num_attention_heads"]
    cos, sin = torch.randn(B, S, head_dim), torch.randn(B, S, head_dim)  # any tables, per batch
    compiled_matches(model, (x, cos, sin), tp_plan(), "2x2")


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_llama_mask_inputs(attn):
    """A padding + causal mask passed in: boolean (True = attend) to SDPA, additive to eager."""
    torch.manual_seed(2)
    model = llama(attn, mask="input")
    x = torch.randn(B, S, SMALL["hidden_size"])
    keep = torch.ones(S, S, dtype=torch.bool).tril().expand(B, 1, S, S).clone()
    keep[1, ..., S - 5 :] = False  # the second sequence is right-padded by 5 tokens
    keep |= torch.eye(S, dtype=torch.bool)  # every query sees itself: no row fully hidden
    mask = keep if attn == "sdpa" else torch.zeros(B, 1, S, S).masked_fill(~keep, float("-inf"))
    prog = compiled_matches(model, (x, mask), tp_plan(mlp=False), "1x2")
    (att,) = attention_nodes(prog)
    assert att.params["mask_shape"] == [B, 1, S, S] and not att.params["causal"]


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_llama_padding_mask_through_create_causal_mask(attn, side):
    """The [B, S] padding mask a tokenizer gives, as torch.bool, turned into the 4-D mask by
    transformers' create_causal_mask inside the module: index by aranges (a view), & with the
    folded causal mask (a sum of additive masks), and for eager where(mask, 0, lowest).
    Left padding hides every key from the pad queries: SDPA returns 0 in their attention rows
    (and mgraph's finalize, the last attn_block of a q block, too: l = 0); eager's lowest-value
    mask hides nothing there (scores + lowest are all equal: a uniform average of v), and mgraph
    adds the same mask."""
    torch.manual_seed(4)
    model = llama(attn, mask="padding")
    x = torch.randn(B, S, SMALL["hidden_size"])
    padding = torch.ones(B, S, dtype=torch.bool)
    pad = slice(S - 5, None) if side == "right" else slice(0, 5)
    padding[1, pad] = False
    prog = compiled_matches(model, (x, padding), tp_plan(mlp=False), "1x2")
    (att,) = attention_nodes(prog)
    assert att.params["mask_shape"] == [B, 1, S, S] and not att.params["causal"]
    mask_ops = [n for n in prog.opgraph.nodes if n.outputs["out"].encoding]  # computed masks
    fns = [n.params["fn"] for n in mask_ops if n.op == "elementwise"]
    assert fns == (["add", "maximum"] if attn == "eager" else ["add"])
    # the mask is an input: another padding, the same program
    padding[0, slice(S - 2, None) if side == "right" else slice(0, 2)] = False
    with torch.no_grad():
        want = model(x, padding)
    assert rel_err(prog(x, padding), want) < 1e-5


def mixtral(**kw) -> Layer:
    config = MixtralConfig(**MOE, num_local_experts=4, attn_implementation="sdpa", **kw)
    return randomize(Layer(config, MixtralDecoderLayer, MixtralRotaryEmbedding))


def qwen3_moe(norm_topk_prob: bool = True) -> Layer:
    config = Qwen3MoeConfig(
        **MOE,
        num_experts=4,
        moe_intermediate_size=96,
        norm_topk_prob=norm_topk_prob,
        attn_implementation="eager",
    )
    return randomize(Layer(config, Qwen3MoeDecoderLayer, Qwen3MoeRotaryEmbedding))


@pytest.mark.parametrize("name,topology", [("mixtral", "2x2"), ("qwen3_moe", "1x1")])
def test_moe_decoder_layers(name, topology):
    torch.manual_seed(3)
    model = mixtral() if name == "mixtral" else qwen3_moe()
    x = torch.randn(B, S, SMALL["hidden_size"])
    plan = tp_plan(mlp=False) if topology != "1x1" else {}
    plan["layer.mlp"] = mg.ExpertParallel(router="gate")
    prog = compiled_matches(model, (x,), plan, topology)
    (moe,) = [n for n in prog.opgraph.nodes if n.op == "moe_dispatch_combine"]
    assert (moe.params["E"], moe.params["top_k"]) == (4, 2)
    assert len(attention_nodes(prog)) == 1


def test_moe_blocks_that_mean_something_else_are_plan_errors():
    """Qwen2-MoE's shared expert and norm_topk_prob=False trace now (tests/test_qwen2_moe.py);
    DeepSeek-V3's block (biased, grouped routing; ``shared_experts``) does not."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    config = DeepseekV3Config(hidden_size=64, moe_intermediate_size=32, n_routed_experts=4,
                              num_experts_per_tok=2, n_group=1, topk_group=1)  # fmt: skip
    x = torch.randn(B, S, 64)
    block, plan = randomize(DeepseekV3MoE(config)), {"": mg.ExpertParallel(router="gate")}
    with pytest.raises(mg.PlanError, match="e_score_correction_bias"):
        mg.compile(block, (x,), plan=plan)
    del block.gate.e_score_correction_bias  # past the router: its shared experts
    with pytest.raises(mg.PlanError, match="'shared_experts'"):
        mg.compile(block, (x,), plan=plan)


class WithWeights(nn.Module):
    """Returns the attention weights too (output_attentions): eager attention is then not one
    attention node."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = llama("eager")

    def forward(self, x):
        positions = torch.arange(x.shape[1])[None]
        cos_sin = self.inner.rotary_emb(x, positions)
        return self.inner.layer.self_attn(x, cos_sin, None)


def test_what_does_not_trace_is_a_named_error():
    x = torch.randn(B, S, SMALL["hidden_size"])
    with pytest.raises(mg.UnsupportedOpError, match="product of two activations"):
        mg.compile(WithWeights(), (x,))
    keep = torch.ones(S, S, dtype=torch.bool).tril().expand(B, 1, S, S)
    with pytest.raises(mg.UnsupportedOpError, match="boolean tensor"):
        mg.compile(llama("eager", mask="input"), (x, keep))  # eager adds it: +1, not a mask
    padding = torch.ones(B, S, dtype=torch.long)  # as a tokenizer returns it
    with pytest.raises(mg.DTypeError, match="input 'extra_0' is torch.int64"):
        mg.compile(llama("sdpa", mask="padding"), (x, padding))


# Dense decoder layers of other families, as transformers writes them: q/k/v biases (Qwen2),
# per-head q/k RMSNorm (Qwen3, OLMo2's over the whole projection), Gemma's (1 + w) norm and
# GELU-tanh MLP, Granite's scaled residuals and logits, Phi-3's fused qkv_proj and gate_up_proj
# with its rotary code's pass-through slice (empty when the rotation covers the head: the case
# that did not trace), partial rotary, and the interleaved rotation of Cohere, GLM and Helium
# (torch.stack: did not trace). Gemma2's attention soft-capping: test_gemma2_soft_capping.
DENSE = {
    "qwen2": ("Qwen2Config", "qwen2", "Qwen2", {}),
    "qwen3": ("Qwen3Config", "qwen3", "Qwen3", {"head_dim": 16}),
    "mistral": ("MistralConfig", "mistral", "Mistral", {}),
    "gemma": ("GemmaConfig", "gemma", "Gemma", {"head_dim": 16}),
    "gemma2": ("Gemma2Config", "gemma2", "Gemma2", {"head_dim": 16,
                                                     "attn_logit_softcapping": None}),
    "olmo2": ("Olmo2Config", "olmo2", "Olmo2", {}),
    "granite": ("GraniteConfig", "granite", "Granite", {"residual_multiplier": 0.5,
                                                        "attention_multiplier": 0.2}),
    "phi3": ("Phi3Config", "phi3", "Phi3", {}),
    "phi3_partial_rotary": ("Phi3Config", "phi3", "Phi3", {"partial_rotary_factor": 0.5}),
    # the interleaved rotate_half (torch.stack; slicing._stack) and Cohere's parallel block
    "cohere": ("CohereConfig", "cohere", "Cohere", {}),
    "glm": ("GlmConfig", "glm", "Glm", {"head_dim": 16}),
    "helium": ("HeliumConfig", "helium", "Helium", {"head_dim": 16}),
}


def dense(name: str, attn: str = "sdpa", **extra) -> Layer:
    import importlib

    config_cls, module, prefix, kw = DENSE[name]
    mod = importlib.import_module(f"transformers.models.{module}.modeling_{module}")
    config = getattr(transformers, config_cls)(**SMALL, **{**kw, **extra},
                                               attn_implementation=attn)
    return randomize(Layer(config, getattr(mod, f"{prefix}DecoderLayer"),
                           getattr(mod, f"{prefix}RotaryEmbedding")))


@pytest.mark.parametrize("name", list(DENSE))
def test_dense_decoder_layers_of_other_families(name):
    torch.manual_seed(7)
    model = dense(name)
    x = torch.randn(B, S, SMALL["hidden_size"])
    prog = compiled_matches(model, (x,))
    assert len(attention_nodes(prog)) == 1
    names = dict(model.named_modules())
    # Phi-3's one qkv_proj, GLM's one gate_up_proj: tp_plan's module names do not exist
    fused = not {"layer.self_attn.q_proj", "layer.mlp.gate_proj"} <= names.keys()
    if fused:  # context parallel instead: the layer's attention over a sequence ring
        compiled_matches(model, (x,), {"layer.self_attn": mg.ContextParallel()}, "1x2")
    else:
        compiled_matches(model, (x,), tp_plan(), "1x2")


class EmptyRead(nn.Module):
    def forward(self, x):
        return torch.cat([x, x[..., 8:8] * 2.0], dim=-1)  # torch: an empty product, skipped


def test_empty_slices_only_feed_cat():
    x = torch.randn(B, S, SMALL["hidden_size"])
    with pytest.raises(mg.UnsupportedOpError, match="empty tensor of shape"):
        mg.compile(EmptyRead(), (x,))


@pytest.mark.parametrize("topology", ["1x1", "1x2"])
def test_gemma2_soft_capping(topology):
    """Gemma2's eager attention caps its scores (tanh(s / cap) * cap, before the mask): one
    attention node with ``softcap``; a strong cap (2.0) so that an uncapped run would be far
    off. Under ContextParallel (ring attention) it is a named error."""
    torch.manual_seed(9)
    model = dense("gemma2", attn="eager", attn_logit_softcapping=2.0)
    x = torch.randn(B, S, SMALL["hidden_size"]) * 4.0
    prog = compiled_matches(model, (x,), tp_plan() if topology == "1x2" else None, topology)
    (att,) = attention_nodes(prog)
    assert att.params["softcap"] == 2.0
    with pytest.raises(mg.UnsupportedOpError, match="soft-capping"):
        mg.compile(model, (x,), plan={"layer.self_attn": mg.ContextParallel()}, topology="1x2")


WIDE = dict(hidden_size=128, num_attention_heads=8, num_hidden_layers=1, intermediate_size=256)
OLDER = {  # name: (config class, module, block class, rotary class or None, config)
    # Conv1D: torch.addmm(bias, x, W) with W [in, out] (did not trace)
    "gpt2": ("GPT2Config", "gpt2", "GPT2Block", None, dict(n_embd=128, n_head=8, n_layer=1,
                                                           n_inner=256)),
    "gpt_bigcode": ("GPTBigCodeConfig", "gpt_bigcode", "GPTBigCodeBlock", None,
                    dict(n_embd=128, n_head=8, n_layer=1, n_inner=256)),
    "opt": ("OPTConfig", "opt", "OPTDecoderLayer", None, dict(WIDE, ffn_dim=256)),
    "phi": ("PhiConfig", "phi", "PhiDecoderLayer", "PhiRotaryEmbedding", WIDE),
}


@pytest.mark.parametrize("name", list(OLDER))
def test_older_decoder_blocks(name):
    # built and fed as examples/hf_families.py does (the causal mask from create_causal_mask,
    # the rotary tables where the family takes them)
    torch.manual_seed(11)
    model = randomize(_load("hf_families").make(*OLDER[name]))
    x = torch.randn(B, S, model.config.hidden_size)
    prog = compiled_matches(model, (x,))
    assert len(attention_nodes(prog)) == 1
