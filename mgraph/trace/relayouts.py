"""The Tracer's relayout emitter: views, permutes, expands and slices of a Value, fused into one
``relayout`` op per chain, with the result's layout chosen so each rank holds what its part
needs (a view that keeps the last dim is a free alias)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from ..layout import (
    REPLICATE,
    Layout,
    canonical,
    expand_layout,
    flat_shape,
    permute_layout,
    slice_layout,
    view_layout,
)
from ..ops.relayout import relayout_feasible, steps_shape
from .capture import CNode
from .opgraph import Value

if TYPE_CHECKING:
    from .tracer import Tracer

__all__ = ["relayout"]


def relayout(
    self: Tracer,
    n: CNode,
    x: Value,
    step: tuple[str, tuple[int, ...]] | list[tuple[str, tuple[int, ...]]],
    *,
    shape: Sequence[int] | None = None,
    name: str | None = None,
    want: Layout | None = None,
) -> Value:
    """``x`` viewed, permuted, expanded or sliced (one step or a list); free when the flat
    2-D view is unchanged. ``want``: the result's layout when the input allows it (a
    broadcast operand made in its consumer's layout)."""
    out_shape = tuple(n.shape if shape is None else shape)
    new_steps = [tuple(s) for s in step] if isinstance(step, list) else [step]
    if len(new_steps) == 1:
        kind, arg = new_steps[0]
        if kind == "permute" and _keeps_order(x.shape, arg):
            kind, arg = "view", out_shape
        if kind == "view" and len(out_shape) and x.shape[-1:] == out_shape[-1:]:
            lay = (
                None if x.layout is None else view_layout(x.shape, out_shape, x.layout, self.world)
            )
            if x.layout is None or lay is not None:
                root = x.root()
                return Value(
                    self.unique(name or n.name),
                    out_shape,
                    self.dtype,
                    lay,
                    root.kind,
                    alias_of=x,
                )
        new_steps = [(kind, tuple(arg))]
    new_steps = [(k, tuple(a)) for k, a in new_steps]
    prev = self.relayouts.get(x.name)
    source = n.args[0] if n.args else None
    if (
        prev is not None
        and shape is None
        and isinstance(source, CNode)
        and len(source.users) == 1
        and self.env.get(source) is x
    ):
        base = prev.inputs["x"]
        steps = [tuple(s) for s in prev.params["steps"]] + new_steps
        src = Layout.from_json(prev.params["in_layout"])
    else:
        prev, base, steps = None, x, new_steps
        src = x.layout if x.layout is not None else REPLICATE
    dst = _chain_layout(self, base.shape, steps, src)
    if want is not None and relayout_feasible(base.shape, steps, src, want, self.world):
        dst = canonical(out_shape, want, self.world)
    if dst is None:
        src = dst = REPLICATE
    if not relayout_feasible(base.shape, steps, src, dst, self.world):
        src = REPLICATE
    params = {
        "rows": flat_shape(base.shape)[0],
        "cols": flat_shape(base.shape)[1],
        "in_shape": list(base.shape),
        "steps": [[k, list(a)] for k, a in steps],
        "in_layout": src.to_json(),
        "out_layout": dst.to_json(),
    }
    if prev is not None:
        prev.params = params
        x.shape, x.layout = out_shape, canonical(out_shape, dst, self.world)
        return x
    out = self.emit(n, "relayout", params, {"x": base}, out_shape, dst, name=name)
    self.relayouts[out.name] = self.og.nodes[-1]
    return out


def _chain_layout(self: Tracer, shape, steps, layout: Layout) -> Layout | None:
    for kind, arg in steps:
        nxt = steps_shape(shape, [[kind, list(arg)]])
        if kind == "view":
            layout = view_layout(shape, nxt, layout, self.world)
        elif kind == "permute":
            layout = permute_layout(shape, arg, layout, self.world)
        elif kind == "expand":
            layout = expand_layout(shape, nxt, layout, self.world)
        else:
            layout = slice_layout(shape, nxt, arg[0], layout, self.world)
        if layout is None:
            return None
        shape = nxt
    return canonical(shape, layout, self.world)


def _keeps_order(shape: Sequence[int], perm: Sequence[int]) -> bool:
    """A permute that only moves unit dims is a view."""
    moved = [p for p in perm if shape[p] != 1]
    return moved == sorted(moved)
