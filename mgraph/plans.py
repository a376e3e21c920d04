"""Parallel plans: torch.distributed.tensor.parallel's vocabulary on module paths.

A plan maps module paths (as ``model.get_submodule`` names them; ``""`` is the root) to a style:

- ``ColwiseParallel()``: an ``nn.Linear`` with its output features sharded. Its input is
  replicated (a local GEMM), or, with ``input_layouts=Shard(dim)`` or when it arrives
  sequence-sharded, gathered on the fly: the fused ``allgather_gemm``.
- ``RowwiseParallel()``: an ``nn.Linear`` with its input features sharded (the output of a
  column-parallel layer). The partial products are reduced by the fused ``gemm_allreduce``, or
  ``gemm_reduce_scatter`` when ``output_layouts=Shard(dim)`` or its result meets a
  sequence-parallel region.
- ``SequenceParallel()``: a module (norms, dropout) that runs on its tokens' shard
  (``sequence_dim``; the first dim of a 2-D input).
- ``ContextParallel()``: an attention module run on a shard of the sequence: its
  ``scaled_dot_product_attention`` becomes ``ring_attention`` (zigzag when causal), everything
  else in it runs on the local tokens.
- ``ExpertParallel()``: a mixture-of-experts block, traced as ONE ``moe_dispatch_combine``
  (tokens and experts sharded over all ranks). The block follows Mixtral's form: a router
  ``nn.Linear(H, E, bias=False)`` (or router logits passed as its second input), top-k on the
  logits then softmax over the k, experts that are SwiGLU MLPs of three bias-free linears, or
  stacked expert weights (``gate_up_proj`` [E, 2F, H] and ``down_proj`` [E, H, F]) with a router
  module holding an [E, H] ``weight``. A ``norm_topk_prob = False`` on the block or its router
  (Qwen2-MoE, Qwen3-MoE, OLMoE) weighs the k picks by their softmax over all E logits instead
  (the op's ``normalize=False``). A block may also hold a shared expert (Qwen2-MoE): a module
  ``shared_expert`` that every token runs, optionally scaled by ``sigmoid(shared_expert_gate(x))``,
  added to the routed output; it is traced as ordinary code beside the fused op (replicated
  unless the plan names its linears, e.g. ``"mlp.shared_expert.up_proj": ColwiseParallel()``).

``options`` are passed to the fused op the style lowers to (e.g. ``{"tile": [64, 128]}``,
``{"block": 64}``; see ``mgraph ops``).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

__all__ = [
    "Replicate",
    "Shard",
    "ParallelStyle",
    "ColwiseParallel",
    "RowwiseParallel",
    "SequenceParallel",
    "ContextParallel",
    "ExpertParallel",
]


class Replicate(BaseModel):
    """Every rank holds the whole tensor."""

    model_config = ConfigDict(frozen=True)


class Shard(BaseModel):
    """The tensor is cut in equal parts along ``dim``, one per rank."""

    model_config = ConfigDict(frozen=True)
    dim: int

    def __init__(self, dim: int | None = None, **kw: Any) -> None:
        if dim is not None:
            kw["dim"] = dim
        super().__init__(**kw)


Placement = Replicate | Shard


class ParallelStyle(BaseModel):
    """Base of the styles; ``options`` go to the fused op the style lowers to."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    options: dict[str, Any] = {}


class ColwiseParallel(ParallelStyle):
    input_layouts: Placement = Replicate()
    output_layouts: Placement = Shard(-1)


class RowwiseParallel(ParallelStyle):
    input_layouts: Placement = Shard(-1)
    output_layouts: Placement = Replicate()


class SequenceParallel(ParallelStyle):
    sequence_dim: int = 1


class ContextParallel(ParallelStyle):
    """``seq_dim`` None: dim 1 of a (B, S, H) input, dim 2 of a (B, H, S, D) one, else dim 0."""

    seq_dim: int | None = None


class ExpertParallel(ParallelStyle):
    router: str = "router"
    experts: str = "experts"
    gate_proj: str = "gate_proj"
    up_proj: str = "up_proj"
    down_proj: str = "down_proj"
    gate_up_proj: str = "gate_up_proj"  # stacked experts: [E, 2F, H], gate rows first
    top_k: int | None = None  # None: the block's ``top_k`` attribute
    # the block's shared expert and its gate, where it has them (out = routed(x) +
    # sigmoid(gate(x)) * shared(x), or routed(x) + shared(x) without a gate)
    shared_expert: str = "shared_expert"
    shared_expert_gate: str = "shared_expert_gate"
