"""The torch.fx fallback of capture.py: for modules torch.export cannot trace (the warning says
why), a symbolic trace run once on the example inputs, so every python value a node computes
(sizes, shapes) is a constant and every tensor node is normalised to capture.CNode.

Leaf modules stay ``call_module`` nodes: torch.nn's own (mapped to the ATen-level names the op
mapping reads: ``linear``, ``rms_norm``, ...) and the _Leaf stand-ins of planned blocks.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from .capture import (
    Captured,
    CNode,
    _canonical,
    _code,
    _Leaf,
    _link_users,
    _map_args,
    _outputs,
    _paths,
    _tensor_meta,
)

__all__ = ["from_fx"]


# -- torch.fx fallback -------------------------------------------------------------------------
class _Tracer(fx.Tracer):
    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return isinstance(m, _Leaf) or super().is_leaf_module(m, qualname)


_FX_FUNCTIONS: dict[Any, str] = {
    operator.add: "add",
    operator.sub: "sub",
    operator.mul: "mul",
    operator.truediv: "div",
    operator.neg: "neg",
    operator.pow: "pow",
    operator.getitem: "getitem",
    torch.add: "add",
    torch.sub: "sub",
    torch.mul: "mul",
    torch.div: "div",
    torch.pow: "pow",
    torch.neg: "neg",
    torch.exp: "exp",
    torch.rsqrt: "rsqrt",
    torch.sqrt: "sqrt",
    torch.tanh: "tanh",
    torch.sigmoid: "sigmoid",
    torch.relu: "relu",
    torch.transpose: "transpose",
    torch.permute: "permute",
    torch.reshape: "reshape",
    torch.flatten: "flatten",
    torch.unsqueeze: "unsqueeze",
    torch.squeeze: "squeeze",
    torch.softmax: "softmax",
    torch.mean: "mean",
    torch.matmul: "matmul",
    F.silu: "silu",
    F.gelu: "gelu",
    F.relu: "relu",
    F.softmax: "softmax",
    F.linear: "linear",
    F.rms_norm: "rms_norm",
    F.layer_norm: "layer_norm",
    F.dropout: "dropout",
    F.scaled_dot_product_attention: "scaled_dot_product_attention",
}
_FX_MODULES: dict[type, str] = {
    nn.SiLU: "silu",
    nn.ReLU: "relu",
    nn.Sigmoid: "sigmoid",
    nn.Tanh: "tanh",
    nn.Identity: "alias",
}


def from_fx(root: nn.Module, args: tuple) -> Captured:
    graph = _Tracer().trace(root)
    gm = fx.GraphModule(root, graph)
    values: dict[fx.Node, Any] = {}

    class Recorder(fx.Interpreter):
        def run_node(self, n: fx.Node) -> Any:
            values[n] = super().run_node(n)
            return values[n]

    with torch.no_grad():
        Recorder(gm).run(*args)
    env: dict[fx.Node, Any] = {}
    nodes: list[CNode] = []
    inputs: list[CNode] = []
    params: dict[str, CNode] = {}
    outputs: list = []
    single = True

    def param(fqn: str) -> CNode | None:
        if fqn not in params:
            try:
                t = root.get_parameter(fqn)
            except AttributeError:
                try:
                    t = root.get_buffer(fqn)
                except AttributeError:
                    return None
            params[fqn] = CNode(
                fqn.replace(".", "_"), "param", shape=tuple(t.shape), dtype=t.dtype, fqn=fqn
            )
            nodes.append(params[fqn])
        return params[fqn]

    for node in gm.graph.nodes:
        result = values.get(node)
        if node.op == "output":
            outputs, single = _outputs(_map_args(node.args[0], env))
            continue
        if not isinstance(result, torch.Tensor):
            env[node] = result  # shapes, sizes and other python values are constants here
            continue
        shape, dtype = _tensor_meta(result)
        meta = dict(paths=_paths(node.meta), code=_code(node.meta, node.stack_trace))
        a, kw = _map_args(node.args, env), _map_args(dict(node.kwargs), env)
        if node.op == "placeholder":
            c = CNode(node.name, "input", shape=shape, dtype=dtype)
            inputs.append(c)
        elif node.op == "get_attr":
            c = param(node.target) or CNode(
                node.name, "param", shape=shape, dtype=dtype, fqn=node.target
            )
        elif node.op == "call_module":
            c = _fx_module(node, root.get_submodule(node.target), a, kw, param, shape, dtype, meta)
        elif node.op == "call_function":
            op = _FX_FUNCTIONS.get(node.target) or _canonical(node.target)
            c = CNode(node.name, op, a, kw, shape, dtype, target=str(node.target), **meta)
        else:
            c = CNode(
                node.name, node.target, a, kw, shape, dtype, target=f"Tensor.{node.target}", **meta
            )
        if c.paths == () and node.op == "call_module":
            c.paths = (node.target,)
        env[node] = c
        if c not in nodes:
            nodes.append(c)
    _link_users(nodes)
    return Captured(nodes, inputs, outputs, single, {}, {})


def _fx_module(node, mod, a, kw, param, shape, dtype, meta) -> CNode:
    target = node.target
    x = a[0] if a else None

    def make(op: str, args: tuple, kwargs: dict | None = None) -> CNode:
        return CNode(
            node.name, op, args, kwargs or {}, shape, dtype, target=type(mod).__name__, **meta
        )

    if isinstance(mod, nn.Linear):
        bias = param(f"{target}.bias") if mod.bias is not None else None
        return make("linear", (x, param(f"{target}.weight"), bias))
    if isinstance(mod, nn.RMSNorm):
        w = param(f"{target}.weight") if mod.weight is not None else None
        return make("rms_norm", (x, list(mod.normalized_shape), w, mod.eps))
    if isinstance(mod, nn.LayerNorm):
        w = param(f"{target}.weight") if mod.weight is not None else None
        b = param(f"{target}.bias") if mod.bias is not None else None
        return make("layer_norm", (x, list(mod.normalized_shape), w, b, mod.eps))
    if isinstance(mod, nn.Dropout):
        return make("dropout", (x, mod.p, mod.training))
    if isinstance(mod, nn.GELU):
        return make("gelu", (x,), {"approximate": mod.approximate})
    if isinstance(mod, nn.Softmax):
        return make("softmax", (x, mod.dim))
    if isinstance(mod, _Leaf):
        return make("leaf", (list(a), mod.leaf_id))
    op = _FX_MODULES.get(type(mod), f"module:{type(mod).__name__}")
    return make(op, tuple(a), kw)
