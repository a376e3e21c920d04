"""Ops made of more than one ATen node: user-registered ops and leaf modules.

- ``custom:<name>``: a call of an op made with ``mg.register_op`` (one node in the export);
- ``leaf``: a module the plan lowers as a unit. ExpertParallel: a Mixtral-style MoE block ->
  (its router as a local matmul, unless the logits are its second input) + moe_dispatch_combine,
  tokens and experts sharded over all ranks. The experts are a ModuleList of SwiGLU MLPs, or one
  module holding them stacked as recent transformers releases write Mixtral/Qwen-MoE: a
  ``gate_up_proj`` parameter ``[E, 2F, H]`` (gate rows first, as ``.chunk(2, dim=-1)`` cuts its
  product) and a ``down_proj`` ``[E, H, F]``, applied with ``F.linear``. ``norm_topk_prob =
  False`` (on the block or its router) becomes the op's ``normalize=False``. A shared expert
  (``shared_parts``) is traced as ordinary code beside the op (capture.Shared).
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import torch.nn as nn

from ..errors import MoECapacityWarning, PlanError, ShapeError, UnsupportedOpError
from ..layout import REPLICATE, ROWS, flat_shape
from ..ops.custom import CUSTOM
from ..plans import ExpertParallel
from .capture import CNode, Shared
from .mapping import broadcast_form, handles, sharded_last
from .opgraph import Value
from .tracer import Tracer


@handles("custom")
def _custom(tr: Tracer, n: CNode) -> Any:
    name = n.op.removeprefix("custom:")
    op = CUSTOM.get(name)
    if op is None:
        raise UnsupportedOpError(f"{n.where()}: custom op {name!r} is not registered")
    bound = dict(zip(op.arg_names, n.args, strict=False)) | dict(n.kwargs)
    tensors: dict[str, Value] = {}
    scalars: dict[str, Any] = {}
    for arg in op.arg_names:
        if arg not in bound:
            continue
        value = tr.value(bound[arg])
        if arg in op.tensor_args:
            if not isinstance(value, Value):
                raise UnsupportedOpError(f"{n.where()}: argument {arg!r} must be a tensor")
            tensors[arg] = value
        else:
            scalars[arg] = value
    first = op.tensor_args[0]
    x = tensors[first]
    out_shape = tuple(n.shape)
    if flat_shape(out_shape)[0] != flat_shape(x.shape)[0]:
        raise UnsupportedOpError(
            f"{n.where()}: {name} changes the leading dims ({list(x.shape)} -> {list(out_shape)})",
            hint="a registered op keeps its first argument's rows; only the last dim may change",
        )
    forms = {}
    for arg, value in tensors.items():
        if arg == first:
            continue
        form = broadcast_form(value.shape, x.shape)
        if form not in ("full", "row"):
            raise UnsupportedOpError(
                f"{n.where()}: argument {arg!r} of shape {list(value.shape)} is neither "
                f"{list(x.shape)} nor a vector over its last dim"
            )
        forms[arg] = form
    lay = tr.layout_in(x, n) or REPLICATE
    if (op.whole_rows or out_shape[-1] != x.shape[-1]) and sharded_last(lay, len(x.shape)):
        lay = REPLICATE
    rows, cols = flat_shape(x.shape)
    params = {
        "rows": rows,
        "cols": cols,
        "forms": forms,
        "scalars": scalars,
        "out_cols": out_shape[-1],
        "shape": list(x.shape),
        "layout": lay.to_json(),
    }
    inputs = {"x": x} | {arg: tensors[arg] for arg in op.tensor_args[1:] if arg in tensors}
    return tr.emit(n, name, params, inputs, out_shape, lay)


@handles("leaf")
def _leaf(tr: Tracer, n: CNode) -> Any:
    leaf_id = n.args[1]
    path, module = tr.cap.leaves[leaf_id]
    style = tr.plan[path]
    assert isinstance(style, ExpertParallel), (path, style)
    inputs = [tr.tensor(n, a, "input") for a in n.args[0]]
    return moe_block(tr, n, path, module, style, inputs)


def moe_block(
    tr: Tracer, n: CNode, path: str, block: nn.Module, style: ExpertParallel, inputs: list[Value]
) -> Value:
    where = f"plan {path or '<root>'!r} ExpertParallel"
    experts = expert_modules(block, style, path)
    x = inputs[0]
    if len(inputs) not in (1, 2):
        raise UnsupportedOpError(f"{where}: the block takes (x) or (x, router_logits)")
    H = x.shape[-1]
    T = flat_shape(x.shape)[0]
    if isinstance(experts, list):
        E, F = len(experts), getattr(experts[0], style.gate_proj).out_features
    else:
        E, two_f, _ = getattr(experts, style.gate_up_proj).shape
        F = two_f // 2
    normalize = _normalize(block, where)
    top_k = style.top_k
    if top_k is None:  # Mixtral keeps top_k on the block, Qwen3-MoE on its router
        router = getattr(block, style.router, None)
        top_k = getattr(block, "top_k", getattr(router, "top_k", None))
    if not isinstance(top_k, int):
        raise PlanError(
            f"{where}: top_k is unknown",
            hint="set ExpertParallel(top_k=...) or give the block (or its router) a `top_k` "
            "attribute",
        )
    for what, size in (("the token count", T), ("the number of experts", E)):
        if size % tr.world:
            raise ShapeError(
                f"{where}: {what} {size} is not divisible by the world size {tr.world}",
                hint="tokens and experts are both sharded over all ranks",
            )
    prefix = f"{path}." if path else ""
    if len(inputs) == 2:
        logits = inputs[1]
    else:
        router = getattr(block, style.router, None)
        weight = getattr(router, "weight", None)
        if (
            not isinstance(router, nn.Module)
            or not isinstance(weight, nn.Parameter)
            or tuple(weight.shape) != (E, H)
            or getattr(router, "bias", None) is not None
        ):
            raise PlanError(
                f"{where}: the block has no bias-free router {style.router!r} (an nn.Linear, or "
                f"a module whose `weight` is [experts, hidden] = [{E}, {H}])",
                hint="name it with ExpertParallel(router=...), or pass the logits as the "
                "block's second input",
            )
        extra = [name for name, _ in router.named_parameters() if name != "weight"]
        extra += [name for name, _ in router.named_buffers()]
        if extra:
            raise PlanError(
                f"{where}: the router {style.router!r} ({type(router).__name__}) holds "
                f"{', '.join(map(repr, extra))} besides its weight; moe_dispatch_combine routes "
                "by a softmax over the logits x @ weight.T alone",
                hint="keep blocks with biased or grouped routing (DeepSeek-V3's "
                "e_score_correction_bias) out of the plan",
            )
        fqn = f"{prefix}{style.router}.weight"
        w = tr.stacked(f"{fqn}.T", [fqn], (H, E), transform="t")
        params = {
            "M": T,
            "N": E,
            "K": H,
            "shard": "none",
            "shape": list(x.shape),
            "layout": ROWS.to_json(),
        }
        logits = tr.emit(
            n,
            "matmul",
            params,
            {"a": x, "b": w},
            tuple(x.shape[:-1]) + (E,),
            ROWS,
            name=f"{n.name}_router",
        )
    _check_only_routed(block, style, where)
    if math.prod(logits.shape) != T * E:
        raise UnsupportedOpError(f"{where}: router logits {list(logits.shape)} are not [T, E]")
    weights = {}
    for proj, shape, stacked_from in (
        (style.gate_proj, (E, H, F), ("gate_up_proj", "gate_t")),
        (style.up_proj, (E, H, F), ("gate_up_proj", "up_t")),
        (style.down_proj, (E, F, H), ("down_proj", "batch_t")),
    ):
        if isinstance(experts, list):
            fqns = [f"{prefix}{style.experts}.{i}.{proj}.weight" for i in range(E)]
            weights[proj] = tr.stacked(f"{prefix}{style.experts}.{proj}.stacked", fqns, shape)
        else:
            attr, transform = stacked_from
            fqn = f"{prefix}{style.experts}.{getattr(style, attr)}"
            name = f"{prefix}{style.experts}.{proj}.{transform}"
            weights[proj] = tr.stacked(name, [fqn], shape, transform=transform)
    # A traced model must match eager torch, which drops no token: segments hold every token
    # (capacity_factor E / top_k) unless the plan asks for a bound (then drops follow the op's
    # documented policy).
    params = {"T": T, "H": H, "E": E, "top_k": top_k, "F": F,
              "capacity_factor": E / top_k, **style.options}
    if not normalize:  # (unset when default: the nodes of renormalising blocks are as before)
        params["normalize"] = False
    if params["capacity_factor"] < E / top_k:
        # the op counts its drops in a `dropped` output, but a Program returns the module's
        # outputs only: say it here, once, rather than answer differently from eager in silence
        warnings.warn(
            f"{prefix or n.name}: ExpertParallel capacity_factor={params['capacity_factor']:g} < "
            f"E/top_k = {E / top_k:g}: picks beyond an expert's segment are dropped (the op's "
            "documented policy), so this Program can differ from eager torch; the Program does "
            "not return the drop counts (run moe_dispatch_combine with mg.run to see them)",
            MoECapacityWarning, stacklevel=2,
        )
    inputs_map = {
        "x": x,
        "router_logits": logits,
        "w_gate": weights[style.gate_proj],
        "w_up": weights[style.up_proj],
        "w_down": weights[style.down_proj],
    }
    return tr.emit(
        n, "moe_dispatch_combine", params, inputs_map, x.shape, ROWS, name=f"{n.name}_moe"
    )


def expert_modules(
    block: nn.Module, style: ExpertParallel, path: str
) -> list[nn.Module] | nn.Module:
    """The block's experts, checked: a list of SwiGLU MLPs of bias-free linears, or one module
    with stacked ``gate_up_proj`` [E, 2F, H] and ``down_proj`` [E, H, F] parameters."""
    where = f"plan {path or '<root>'!r} ExpertParallel"
    experts = getattr(block, style.experts, None)
    if isinstance(experts, nn.Module) and not isinstance(experts, (nn.ModuleList, nn.Sequential)):
        return _stacked_experts(experts, style, where)
    if not isinstance(experts, (nn.ModuleList, nn.Sequential)) or len(experts) == 0:
        raise PlanError(
            f"{where}: {type(block).__name__} has no expert list {style.experts!r} (a ModuleList "
            f"of SwiGLU MLPs, or a module with stacked {style.gate_up_proj!r} [E, 2F, H] and "
            f"{style.down_proj!r} [E, H, F] weights)",
            hint="name it with ExpertParallel(experts=...)",
        )
    for i, e in enumerate(experts):
        for proj in (style.gate_proj, style.up_proj, style.down_proj):
            lin = getattr(e, proj, None)
            if not isinstance(lin, nn.Linear) or lin.bias is not None:
                raise PlanError(
                    f"{where}: expert {i} has no bias-free nn.Linear {proj!r}",
                    hint="name the projections with ExpertParallel(gate_proj=, up_proj=, "
                    "down_proj=)",
                )
    return list(experts)


def _stacked_experts(experts: nn.Module, style: ExpertParallel, where: str) -> nn.Module:
    gate_up = getattr(experts, style.gate_up_proj, None)
    down = getattr(experts, style.down_proj, None)
    ok = isinstance(gate_up, nn.Parameter) and isinstance(down, nn.Parameter)
    if ok:
        E, two_f, H = gate_up.shape if gate_up.dim() == 3 else (0, 1, 0)
        ok = two_f % 2 == 0 and tuple(down.shape) == (E, H, two_f // 2) and E > 0
    if not ok:
        shapes = [tuple(getattr(t, "shape", ())) for t in (gate_up, down)]
        raise PlanError(
            f"{where}: {type(experts).__name__} is neither an expert list nor stacked experts: "
            f"{style.gate_up_proj!r} must be an [E, 2F, H] and {style.down_proj!r} an [E, H, F] "
            f"parameter (got shapes {shapes})",
            hint="name them with ExpertParallel(gate_up_proj=..., down_proj=...)",
        )
    if getattr(experts, "has_bias", False) or any(
        "bias" in name for name, _ in experts.named_parameters()
    ):
        raise PlanError(f"{where}: stacked experts with biases are not supported")
    act = getattr(experts, "act_fn", None)
    if (
        act is not None
        and not isinstance(act, nn.SiLU)
        and "silu" not in type(act).__name__.lower()
    ):
        raise PlanError(
            f"{where}: the experts' activation is {type(act).__name__}; moe_dispatch_combine "
            "computes SwiGLU experts (silu(gate) * up)",
            hint="only SiLU-gated experts (Mixtral, Qwen-MoE) are supported",
        )
    return experts


def shared_parts(block: nn.Module, style: ExpertParallel, path: str) -> Shared | None:
    """The block's shared expert (and its gate) as capture traces them beside the fused op, or
    None when it has none. The block is taken to compute ``routed(x) + sigmoid(gate(x)) *
    shared_expert(x)`` (Qwen2-MoE), or ``routed(x) + shared_expert(x)`` without a gate."""
    where = f"plan {path or '<root>'!r} ExpertParallel"
    expert = getattr(block, style.shared_expert, None)
    gate = getattr(block, style.shared_expert_gate, None)
    for name, part in ((style.shared_expert, expert), (style.shared_expert_gate, gate)):
        if part is not None and not isinstance(part, nn.Module):
            raise PlanError(
                f"{where}: {type(block).__name__}.{name} is a {type(part).__name__}, not a module",
                hint="name the shared expert with ExpertParallel(shared_expert=..., "
                "shared_expert_gate=...)",
            )
    if expert is None:
        if gate is not None:
            raise PlanError(
                f"{where}: {type(block).__name__} has a shared expert gate "
                f"{style.shared_expert_gate!r} but no shared expert {style.shared_expert!r}",
                hint="name the shared expert with ExpertParallel(shared_expert=...)",
            )
        return None
    return Shared(style.shared_expert, style.shared_expert_gate if gate is not None else None)


def _check_only_routed(block: nn.Module, style: ExpertParallel, where: str) -> None:
    """moe_dispatch_combine computes the router and the routed experts, and capture traces a
    shared expert beside it; a block holding more (DeepSeek-V3's ``shared_experts``, a bias of
    its own) would silently lose it."""
    known = (style.router, style.experts, style.shared_expert, style.shared_expert_gate)
    extra = [
        name
        for name, child in block.named_children()
        if name not in known and any(True for _ in child.parameters())
    ]
    extra += [name for name, _ in block.named_parameters(recurse=False)]
    if extra:
        raise PlanError(
            f"{where}: {type(block).__name__} holds parameters besides its router "
            f"{style.router!r}, experts {style.experts!r} and shared expert "
            f"{style.shared_expert!r} (with its gate {style.shared_expert_gate!r}): "
            f"{', '.join(map(repr, extra))}; moe_dispatch_combine computes only the routed "
            "experts, and only a shared expert of that name is traced beside it",
            hint="name a shared expert (routed(x) + sigmoid(gate(x)) * shared(x)) with "
            "ExpertParallel(shared_expert=..., shared_expert_gate=...); keep other blocks out "
            "of the plan",
        )


def _normalize(block: nn.Module, where: str) -> bool:
    """Whether the block renormalises its top-k weights (the op's ``normalize``): softmax over
    all experts then top k, renormalised over the k (Mixtral, which writes it as a softmax over
    the k logits) unless the block or its router sets ``norm_topk_prob = False``."""
    flags = {
        type(owner).__name__: owner.norm_topk_prob
        for owner in (block, *block.children())
        if isinstance(getattr(owner, "norm_topk_prob", None), bool)
    }
    if len(set(flags.values())) > 1:
        raise PlanError(
            f"{where}: norm_topk_prob disagrees between {', '.join(flags)} ({flags})",
            hint="set one value: the router's decides the routing",
        )
    return all(flags.values())
