"""Constant folding: ops that depend on no program input and no trainable parameter run once, at
trace time, on the real tensors.

Model code builds much of its state from nothing but shapes and buffers: causal masks from
``torch.triu``/``torch.arange``, rotary tables from an ``inv_freq`` buffer and the positions
``arange(S)``, ``~mask``, dtype casts. None of it needs a task: the result is a constant of the
program, stored in ``OpGraph.constants`` and bound like a parameter where an op reads it.
Parameters (``nn.Parameter``) are never folded, because a Program reads them from the module at
every call (updated weights are used); buffers and lifted constants are folded, as torch.export
itself treats them as fixed state of the graph.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

import torch

from .capture import CNode

__all__ = ["Folded", "fold"]


@dataclass(eq=False)
class Folded:
    """A value computed at trace time: a tensor, or a list of them (``split``'s result)."""

    value: Any


def _tensor_of(node: CNode, env: dict, fixed: dict[str, torch.Tensor]) -> Any:
    """The trace-time value of a captured argument, or raise LookupError when it has none."""
    if node.op == "param":
        if node.fqn in fixed:
            return fixed[node.fqn]
        raise LookupError(node.fqn)
    folded = env.get(node)
    if isinstance(folded, Folded):
        return folded.value
    raise LookupError(node.name)


def _substitute(value: Any, env: dict, fixed: dict[str, torch.Tensor]) -> Any:
    if isinstance(value, CNode):
        return _tensor_of(value, env, fixed)
    if isinstance(value, (list, tuple)):
        return type(value)(_substitute(v, env, fixed) for v in value)
    if isinstance(value, dict):
        return {k: _substitute(v, env, fixed) for k, v in value.items()}
    return value


def fold(n: CNode, env: dict, fixed: dict[str, torch.Tensor]) -> Folded | None:
    """``n`` run on its constant arguments, or None when one of them is not constant (an input,
    a parameter, a value computed by tasks) or the op is random."""
    fn = n.fn
    if isinstance(fn, torch._ops.OpOverload):
        if torch.Tag.nondeterministic_seeded in fn.tags or fn.namespace not in ("aten", "prims"):
            return None
    elif fn is not operator.getitem:
        return None
    try:
        args = _substitute(n.args, env, fixed)
        kwargs = _substitute(n.kwargs, env, fixed)
    except LookupError:
        return None
    with torch.no_grad():
        return Folded(fn(*args, **kwargs))
