"""Tracing: an nn.Module + example inputs + a parallel plan -> OpGraph (see mgraph/lower.py for
the next step, mgraph/program.py for the whole pipeline behind ``mg.compile``).

capture.py records the module's ops (torch.export; torch.fx where export cannot), tracer.py
decides layouts and emits nodes, aten.py and modules.py map each op family to registered ops.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.nn as nn

from ..errors import InputError, PlanError
from ..graph import dtype_name, gc_paused
from ..plans import (
    ColwiseParallel,
    ContextParallel,
    ExpertParallel,
    ParallelStyle,
    RowwiseParallel,
)
from ..topology import Topology
from .capture import Captured, CNode, Shared, capture
from .opgraph import OpGraph, OpNode, ParamSource, Value
from .tracer import Tracer

__all__ = ["trace", "check_plan", "OpGraph", "OpNode", "Value", "ParamSource", "CNode", "Captured"]


def trace(
    module: nn.Module,
    example_inputs: Sequence[torch.Tensor] | torch.Tensor,
    plan: Mapping[str, ParallelStyle] | None = None,
    topology: Topology | str = "1x1",
) -> OpGraph:
    """The OpGraph of ``module`` run on ``example_inputs`` under ``plan`` on ``topology``."""
    topo = Topology.parse(topology)
    checked = check_plan(module, plan)
    args = example_args(example_inputs)
    leaf_paths = [p for p, s in checked.items() if isinstance(s, ExpertParallel)]
    shared = dense_parts(module, checked)
    # The collector is paused while torch.export runs (mgraph.graph.gc_paused). The first
    # export in a process imports ~1200 modules (torch._dynamo and what it pulls in), and the
    # collections their allocations trigger rescan those long-lived objects again and again,
    # freeing none: ~0.25 s of a cold trace. What export leaves as cyclic garbage (its fake
    # tensors and fx graphs, no tensor storage of its own) is freed by the next full
    # collection instead of a young one.
    with gc_paused():
        captured = capture(module, args, leaf_paths, shared)
        # Folding runs the model's constant ops on real tensors (a 4096 x 4096 causal mask:
        # ones, triu, ~, then the causal check), memory-bound passes of a few MB each, on one
        # intra-op thread as lowering does: a second thread roughly doubled their CPU time
        # (2x8 Llama layer: ~55 -> ~21 ms) and, on a busy machine, their wall time too. The
        # folded values are the same (elementwise ops); the caller's setting is restored.
        threads = torch.get_num_threads()
        if threads != 1:
            torch.set_num_threads(1)
        try:
            og = Tracer(module, captured, checked, topo, dtype_name(args[0].dtype)).run()
        finally:
            if threads != 1:
                torch.set_num_threads(threads)
    og.note = captured.note
    return og


def example_args(example_inputs: Any) -> tuple[torch.Tensor, ...]:
    args = tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
    if not args or not all(isinstance(a, torch.Tensor) for a in args):
        raise InputError(
            "example_inputs must be a tensor or a tuple of tensors "
            f"(got {[type(a).__name__ for a in args]})",
            hint="pass the positional inputs of module.forward, e.g. (x,)",
        )
    return args


def dense_parts(module: nn.Module, plan: Mapping[str, ParallelStyle]) -> dict[str, Shared]:
    """The shared experts of the plan's ExpertParallel blocks (traced beside their fused op)."""
    from .modules import shared_parts

    found = {}
    for path, style in plan.items():
        if isinstance(style, ExpertParallel):
            shared = shared_parts(module.get_submodule(path), style, path)
            if shared is not None:
                found[path] = shared
    return found


def check_plan(module: nn.Module, plan: Mapping[str, Any] | None) -> dict[str, ParallelStyle]:
    """The plan, checked against the module: every path exists and fits its style."""
    from .modules import expert_modules

    if plan is None:
        return {}
    if not isinstance(plan, Mapping):
        raise PlanError(
            f"plan must be a dict of module path -> style, got {type(plan).__name__}",
            hint='e.g. {"mlp.up_proj": mg.ColwiseParallel()}',
        )
    names = [name for name, _ in module.named_modules()]
    out: dict[str, ParallelStyle] = {}
    for path, style in plan.items():
        if not isinstance(style, ParallelStyle):
            raise PlanError(
                f"plan[{path!r}] is {style!r}, not a parallel style",
                hint="use mg.ColwiseParallel(), RowwiseParallel(), SequenceParallel(), "
                "ContextParallel() or ExpertParallel()",
            )
        if path not in names:
            close = difflib.get_close_matches(path, names, n=3)
            raise PlanError(
                f"plan names module path {path!r}, which {type(module).__name__} does not have",
                hint=(f"did you mean {', '.join(map(repr, close))}? " if close else "")
                + "paths are as model.named_modules() lists them ('' is the model itself)",
            )
        sub = module.get_submodule(path)
        if isinstance(style, (ColwiseParallel, RowwiseParallel)) and not isinstance(sub, nn.Linear):
            raise PlanError(
                f"plan[{path!r}] is {type(style).__name__}, but {path!r} is a "
                f"{type(sub).__name__}, not an nn.Linear",
                hint="plan the linear layers themselves, e.g. 'mlp.up_proj'",
            )
        if isinstance(style, ContextParallel) and isinstance(sub, nn.Linear):
            raise PlanError(
                f"plan[{path!r}] is ContextParallel, but {path!r} is an nn.Linear: ContextParallel "
                "shards an attention module's sequence (its scaled_dot_product_attention becomes "
                "ring_attention), and a linear layer has no attention",
                hint="put ContextParallel() on the attention module (e.g. 'attn'); shard linears "
                "with ColwiseParallel()/RowwiseParallel()",
            )
        if isinstance(style, ExpertParallel):
            expert_modules(sub, style, path)
        out[path] = style
    leaves = [p for p, s in out.items() if isinstance(s, ExpertParallel)]
    shared = dense_parts(module, out)
    for path in out:
        for leaf in leaves:
            inner = path[len(leaf) + 1 :] if leaf else path
            if path == leaf or (leaf and not path.startswith(leaf + ".")):
                continue
            dense = shared.get(leaf)
            names = (dense.expert, dense.gate) if dense else ()
            if any(n is not None and (inner == n or inner.startswith(n + ".")) for n in names):
                continue  # the shared expert is ordinary code, planned as such
            raise PlanError(
                f"plan[{path!r}] lies inside the ExpertParallel block {leaf!r}",
                hint="an ExpertParallel block is lowered as a whole (but for its shared "
                "expert, which the plan may name): drop the inner entry",
            )
    return out
