"""Capture a module's computation as a list of ``CNode``s: torch.export, or torch.fx where export
cannot (the reason is reported), normalised to one form the op mapping reads.

A ``CNode`` is one tensor-valued operation: a canonical op name (the ATen overload packet,
``linear``, ``add``, ``view``, ...; ``custom:<name>`` for ops made with ``mg.register_op``;
``leaf`` for a module traced as a unit), arguments with CNodes in place of tensors, the result's
shape and dtype, and the module paths it runs in (from ``nn_module_stack``).

Leaf modules: a module planned as one fused op (ExpertParallel) is swapped, for the duration of
the capture only, for a wrapper calling the ``mgraph::leaf`` custom op, so its data-dependent
insides (routing, per-expert loops) are never traced. A leaf's dense part (``Shared``: a MoE
block's shared expert and its gate) stays outside the custom op: the wrapper runs it as
ordinary modules, registered under the block's own names, so it traces like any other code.
"""

from __future__ import annotations

import contextlib
import io
import logging
import operator
import re
import warnings
from collections.abc import Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
from torch import Tensor

from ..errors import TraceError

__all__ = ["CNode", "Captured", "Shared", "capture", "CUSTOM_NAMESPACE"]

CUSTOM_NAMESPACE = "mgraph_user"
_ROUTED = "_mgraph_routed"  # _WithShared's child: a name no block uses, dropped from paths
_LEAVES: dict[int, nn.Module] = {}


@torch.library.custom_op("mgraph::leaf", mutates_args=())
def _leaf(inputs: list[Tensor], leaf_id: int) -> Tensor:
    return _LEAVES[leaf_id](*inputs)


@_leaf.register_fake
def _leaf_fake(inputs: list[Tensor], leaf_id: int) -> Tensor:
    return torch.empty_like(inputs[0])


class _Leaf(nn.Module):
    """Stands in for a leaf module during capture; holds it without registering it."""

    def __init__(self, inner: nn.Module, leaf_id: int) -> None:
        super().__init__()
        object.__setattr__(self, "inner", inner)
        self.leaf_id = leaf_id

    def forward(self, *inputs: Tensor) -> Tensor:
        return torch.ops.mgraph.leaf(list(inputs), self.leaf_id)


@dataclass(frozen=True)
class Shared:
    """A leaf block's dense part, traced beside its fused op (Qwen2-MoE's shared expert): the
    block computes ``leaf(x) + sigmoid(gate(x)) * expert(x)`` (``gate`` None: ``+ expert(x)``),
    ``expert`` and ``gate`` naming its child modules."""

    expert: str
    gate: str | None = None


class _WithShared(nn.Module):
    """Stands in for a leaf block with a ``Shared`` part: its routed part as a _Leaf (whose
    custom op, run on fake tensors only, never computes), its shared modules registered under
    their names in the block, so their parameters keep their paths."""

    def __init__(self, routed: _Leaf, inner: nn.Module, shared: Shared) -> None:
        super().__init__()
        setattr(self, _ROUTED, routed)
        self._mgraph_shared = shared
        for name in (shared.expert, shared.gate):
            if name is not None:
                setattr(self, name, getattr(inner, name))

    def forward(self, *inputs: Tensor) -> Tensor:
        x, shared = inputs[0], self._mgraph_shared
        dense = getattr(self, shared.expert)(x)
        if shared.gate is not None:
            dense = torch.sigmoid(getattr(self, shared.gate)(x)) * dense
        return getattr(self, _ROUTED)(*inputs) + dense


@dataclass(eq=False)
class CNode:
    name: str
    op: str
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)
    shape: tuple[int, ...] | None = None
    dtype: torch.dtype | None = None
    paths: tuple[str, ...] = ()
    code: str = ""
    target: str = ""
    fqn: str | None = None  # parameters, buffers and lifted constants
    users: list[CNode] = field(default_factory=list)
    fn: Any = None  # the callable ATen overload (export only): constant folding runs it

    @property
    def path(self) -> str:
        return self.paths[-1] if self.paths else ""

    def arg(self, index: int, name: str, default: Any = None) -> Any:
        if index < len(self.args):
            return self.args[index]
        return self.kwargs.get(name, default)

    def where(self) -> str:
        loc = f" at {self.code}" if self.code else ""
        return f"{self.target or self.op} (node {self.name!r}, module {self.path or '<root>'}{loc})"


@dataclass
class Captured:
    nodes: list[CNode]
    inputs: list[CNode]
    outputs: list[CNode]
    single: bool
    constants: dict[str, Tensor]
    leaves: dict[int, tuple[str, nn.Module]]
    via: str = "export"
    note: str = ""


@contextmanager
def _quiet():
    """torch.export logs every failed guard and prints the partial graph to stderr before
    raising; the TraceError we raise instead says what matters."""
    logging.disable(logging.WARNING)
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        logging.disable(logging.NOTSET)


@contextmanager
def _swapped(module: nn.Module, leaf_paths: Sequence[str], shared: Mapping[str, Shared]):
    """``module`` with each leaf path replaced by a _Leaf (the root itself when path is ""), or
    by a _WithShared around one when ``shared`` names its dense part."""
    swaps = []
    leaves: dict[int, tuple[str, nn.Module]] = {}
    root = module
    for path in leaf_paths:
        inner = module.get_submodule(path)
        leaf_id = id(inner)
        _LEAVES[leaf_id] = inner
        leaves[leaf_id] = (path, inner)
        stand_in: nn.Module = _Leaf(inner, leaf_id)
        if path in shared:
            stand_in = _WithShared(stand_in, inner, shared[path])
        if path == "":
            root = stand_in
            continue
        parent_path, _, name = path.rpartition(".")
        parent = module.get_submodule(parent_path)
        swaps.append((parent, name, inner))
        setattr(parent, name, stand_in)
    try:
        yield root, leaves
    finally:
        for parent, name, inner in reversed(swaps):
            setattr(parent, name, inner)


def capture(
    module: nn.Module,
    args: tuple,
    leaf_paths: Sequence[str],
    shared: Mapping[str, Shared] | None = None,
) -> Captured:
    with _swapped(module, leaf_paths, shared or {}) as (root, leaves):
        try:
            with _quiet():
                ep = torch.export.export(root, args, strict=False)
            out = _from_export(ep)
            out.leaves = leaves
            return out
        except Exception as export_error:  # noqa: BLE001  (any failure: fall back, then explain)
            first = export_error
        try:
            from .fx import from_fx

            out = from_fx(root, args)
        except Exception as fx_error:  # noqa: BLE001
            raise _trace_error(module, first, fx_error) from first
    out.leaves = leaves
    out.via = "fx"
    out.note = f"torch.export failed ({_first_line(first)}); traced with torch.fx instead"
    warnings.warn(f"mgraph: {type(module).__name__}: {out.note}", stacklevel=3)
    return out


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"


def _trace_error(module: nn.Module, export_error: Exception, fx_error: Exception) -> TraceError:
    text = str(export_error)
    name = type(module).__name__
    if "data-dependent" in text or "data dependent" in text.lower():
        m = re.search(r'File "([^"]+)", line (\d+), in (\w+)\n\s*(.+)', text)
        where = f" at {m.group(1)}:{m.group(2)} in {m.group(3)}: {m.group(4).strip()}" if m else ""
        return TraceError(
            f"{name}: data-dependent control flow{where} (a branch or size that depends on "
            "tensor values cannot become a static task graph)",
            hint="make the branch depend on shapes only, use torch.cond, or hide the data-"
            "dependent part inside an op registered with mg.register_op",
        )
    return TraceError(
        f"{name} cannot be traced: torch.export failed with {_first_line(export_error)}; "
        f"torch.fx failed with {_first_line(fx_error)}",
        hint="mgraph needs a module whose forward is a fixed sequence of tensor ops",
    )


# -- torch.export ------------------------------------------------------------------------------
def _canonical(target: Any) -> str:
    if isinstance(target, torch._ops.OpOverload):
        ns, name = target.namespace, target._overloadpacket.__name__
        if ns == "aten":
            return name
        if ns == "mgraph" and name == "leaf":
            return "leaf"
        if ns == CUSTOM_NAMESPACE:
            return f"custom:{name}"
        return f"{ns}.{name}"
    if target is operator.getitem:
        return "getitem"
    return getattr(target, "__name__", str(target))


def _paths(meta: dict) -> tuple[str, ...]:
    """The module paths of a node, outermost first; a leaf's _WithShared child is the block."""
    stack = meta.get("nn_module_stack") or {}
    paths = (v[0].removesuffix(_ROUTED).removesuffix(".") for v in stack.values() if v[0])
    return tuple(dict.fromkeys(p for p in paths if p))


def _code(meta: dict, stack_trace: str | None) -> str:
    trace = meta.get("stack_trace") or stack_trace or ""
    found = re.findall(r'File "([^"]+)", line (\d+), in \w+\n\s*(.+)', trace)
    if not found:
        return ""
    path, line, code = found[-1]
    return f"{path.rsplit('/', 1)[-1]}:{line}: {code.strip()}"


def _tensor_meta(val: Any) -> tuple[tuple[int, ...] | None, torch.dtype | None]:
    if isinstance(val, torch.Tensor):
        return tuple(int(s) for s in val.shape), val.dtype
    return None, None


def _map_args(value: Any, env: dict) -> Any:
    if isinstance(value, fx.Node):
        return env[value]
    if isinstance(value, (list, tuple)):
        return type(value)(_map_args(v, env) for v in value)
    if isinstance(value, dict):
        return {k: _map_args(v, env) for k, v in value.items()}
    return value


def _link_users(nodes: list[CNode]) -> None:
    def visit(value: Any, user: CNode) -> None:
        if isinstance(value, CNode):
            if user not in value.users:
                value.users.append(user)
        elif isinstance(value, (list, tuple)):
            for v in value:
                visit(v, user)
        elif isinstance(value, dict):
            for v in value.values():
                visit(v, user)

    for n in nodes:
        visit(n.args, n)
        visit(n.kwargs, n)


def _outputs(value: Any) -> tuple[list, bool]:
    if isinstance(value, (list, tuple)):
        if len(value) == 1 and isinstance(value, tuple):
            return [value[0]], True
        return list(value), False
    return [value], True


def _from_export(ep: torch.export.ExportedProgram) -> Captured:
    from torch.export.graph_signature import InputKind

    specs = {s.arg.name: s for s in ep.graph_signature.input_specs if hasattr(s.arg, "name")}
    env: dict[fx.Node, Any] = {}
    nodes: list[CNode] = []
    inputs: list[CNode] = []
    outputs: list = []
    single = True
    for node in ep.graph.nodes:
        shape, dtype = _tensor_meta(node.meta.get("val"))
        if node.op == "placeholder":
            spec = specs[node.name]
            if spec.kind == InputKind.USER_INPUT:
                c = CNode(node.name, "input", shape=shape, dtype=dtype)
                inputs.append(c)
            else:
                c = CNode(node.name, "param", shape=shape, dtype=dtype, fqn=spec.target)
            env[node] = c
            nodes.append(c)
        elif node.op == "call_function":
            c = CNode(
                node.name,
                _canonical(node.target),
                _map_args(node.args, env),
                _map_args(dict(node.kwargs), env),
                shape,
                dtype,
                _paths(node.meta),
                _code(node.meta, node.stack_trace),
                str(node.target),
            )
            c.fn = node.target
            env[node] = c
            nodes.append(c)
        elif node.op == "output":
            outputs, single = _outputs(_map_args(node.args[0], env))
    _link_users(nodes)
    constants = {k: v for k, v in ep.constants.items() if isinstance(v, torch.Tensor)}
    return Captured(nodes, inputs, outputs, single, constants, {})
