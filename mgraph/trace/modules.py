"""Ops made of more than one ATen node: user-registered ops and leaf modules.

- ``custom:<name>``: a call of an op made with ``mg.register_op`` (one node in the export);
- ``leaf``: a module the plan lowers as a unit. ExpertParallel: a Mixtral-style MoE block ->
  (its router as a local matmul, unless the logits are its second input) + moe_dispatch_combine,
  tokens and experts sharded over all ranks.
"""

from __future__ import annotations

import math
from typing import Any

import torch.nn as nn

from ..errors import PlanError, ShapeError, UnsupportedOpError
from ..layout import REPLICATE, ROWS, flat_shape
from ..ops.custom import CUSTOM
from ..plans import ExpertParallel
from .capture import CNode
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
    E = len(experts)
    gate0 = getattr(experts[0], style.gate_proj)
    F = gate0.out_features
    top_k = style.top_k if style.top_k is not None else getattr(block, "top_k", None)
    if not isinstance(top_k, int):
        raise PlanError(
            f"{where}: top_k is unknown",
            hint="set ExpertParallel(top_k=...) or give the block a `top_k` attribute",
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
        if not isinstance(router, nn.Linear) or router.bias is not None:
            raise PlanError(
                f"{where}: the block has no bias-free nn.Linear router {style.router!r}",
                hint="name it with ExpertParallel(router=...), or pass the logits as the "
                "block's second input",
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
    if math.prod(logits.shape) != T * E:
        raise UnsupportedOpError(f"{where}: router logits {list(logits.shape)} are not [T, E]")
    weights = {}
    for proj, shape in (
        (style.gate_proj, (E, H, F)),
        (style.up_proj, (E, H, F)),
        (style.down_proj, (E, F, H)),
    ):
        fqns = [f"{prefix}{style.experts}.{i}.{proj}.weight" for i in range(E)]
        weights[proj] = tr.stacked(f"{prefix}{style.experts}.{proj}.stacked", fqns, shape)
    params = {"T": T, "H": H, "E": E, "top_k": top_k, "F": F, **style.options}
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


def expert_modules(block: nn.Module, style: ExpertParallel, path: str) -> list[nn.Module]:
    """The block's experts, checked to be SwiGLU MLPs of bias-free linears."""
    where = f"plan {path or '<root>'!r} ExpertParallel"
    experts = getattr(block, style.experts, None)
    if not isinstance(experts, (nn.ModuleList, nn.Sequential)) or len(experts) == 0:
        raise PlanError(
            f"{where}: {type(block).__name__} has no expert list {style.experts!r}",
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
