"""transformers' own ``LlamaDecoderLayer`` (not a look-alike), built from a small ``LlamaConfig``
in code (nothing is downloaded), under tensor + sequence parallelism.

The layer is fed as ``LlamaModel`` feeds it: rotary tables from ``LlamaRotaryEmbedding`` at
positions ``arange(S)`` and the mask from transformers' ``create_causal_mask``. Both depend on no
input, so mgraph computes them once at trace time and recognises the mask as causal. The layer's
attention is transformers' default for a layer built from a config, ``eager_attention_forward``
(``matmul(q, k^T) * scaling + mask``, softmax, ``matmul(weights, v)``, after ``repeat_kv``): that
chain becomes one ``attention`` node, as ``F.scaled_dot_product_attention`` would
(``--attn sdpa`` runs transformers' SDPA path instead). The projections are column/row
parallel, the RMSNorms token-sharded (AllGather+GEMM in, GEMM+ReduceScatter out).

    python examples/hf_llama_layer.py [--attn eager|sdpa] [--topology 2x2]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn as nn
from transformers import LlamaConfig
from transformers.masking_utils import create_causal_mask
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

import mgraph as mg


class OneLayer(nn.Module):
    """Layer 0 of a Llama model, with the model's rotary embedding and causal mask."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.layer = LlamaDecoderLayer(config, layer_idx=0)
        self.rotary_emb = LlamaRotaryEmbedding(config)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(hidden_states.shape[1])[None]
        mask = create_causal_mask(
            config=self.config,
            inputs_embeds=hidden_states,
            attention_mask=None,
            cache=None,
            position_ids=positions,
        )
        cos_sin = self.rotary_emb(hidden_states, positions)
        return self.layer(hidden_states, attention_mask=mask, position_embeddings=cos_sin)


def layer_plan() -> dict[str, mg.plans.ParallelStyle]:
    """Heads and FFN columns sharded (Colwise in, Rowwise out), norms sequence-parallel."""
    plan: dict[str, mg.plans.ParallelStyle] = {
        f"layer.self_attn.{p}_proj": mg.ColwiseParallel() for p in ("q", "k", "v")
    }
    plan["layer.self_attn.o_proj"] = mg.RowwiseParallel()
    plan["layer.mlp.gate_proj"] = mg.ColwiseParallel()
    plan["layer.mlp.up_proj"] = mg.ColwiseParallel()
    plan["layer.mlp.down_proj"] = mg.RowwiseParallel()
    plan["layer.input_layernorm"] = mg.SequenceParallel()
    plan["layer.post_attention_layernorm"] = mg.SequenceParallel()
    return plan


def main(topology: str = "2x2", backend: str = "reference", attn: str = "eager") -> float:
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=128,
        num_attention_heads=8,
        num_key_value_heads=4,  # grouped-query attention: repeat_kv
        intermediate_size=256,
        num_hidden_layers=1,
        max_position_embeddings=64,
        attn_implementation=attn,
    )
    model = OneLayer(config).eval()
    with torch.no_grad():  # the norms start at ones: random weights check them too
        for norm in (model.layer.input_layernorm, model.layer.post_attention_layernorm):
            norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(2, 32, 128)
    prog = mg.compile(model, (x,), plan=layer_plan(), topology=topology, backend=backend)
    got = prog(x)
    with torch.no_grad():
        want = model(x)
    err = ((got - want).norm() / want.norm()).item()
    print(prog)
    print(prog.opgraph.to_text())
    print("tasks per (role, kind):", dict(prog.graph.stats().by_role_kind()))
    print(f"relative error vs eager torch: {err:.2e}")
    assert err < 1e-4, err
    return err


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--attn", choices=["eager", "sdpa"], default="eager")
    parser.add_argument("--topology", default="2x2")
    args = parser.parse_args()
    main(topology=args.topology, attn=args.attn)
