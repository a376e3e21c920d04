"""Attention masks computed from a boolean program input, as transformers' ``create_causal_mask``
builds them from a ``[B, S]`` padding mask (True = a real token):

    padding[arange(B)[:, None, None, None], arange(S)[None, None, None, :]]   # index: a view
    causal & that                                                          # and: a sum
    torch.where(mask, 0.0, torch.finfo(dtype).min)                          # eager's float form

A boolean program input is carried in its additive form (0 = attend, -inf = hidden; see
attention_map.py), so these become tile ops on that form: indexing by broadcast aranges is a
view and an expand (a relayout), ``a & b`` of two masks is ``a + b``, and eager's
``where(mask, 0, lowest)`` is ``maximum(mask, lowest)``. Each result is still a mask
(``Value.encoding``): only attention and other mask ops may read it.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ..errors import UnsupportedOpError
from ..graph import torch_dtype
from ..layout import REPLICATE, flat_shape
from .attention_map import additive_mask
from .capture import CNode
from .mapping import broadcast_form, handles
from .opgraph import ParamSource, Value
from .slicing import broadcast
from .tracer import Tracer

__all__: list[str] = []


def _is_mask(v: Any) -> bool:
    return isinstance(v, Value) and bool(v.encoding or v.root().encoding)


def _index_view(x_shape: tuple[int, ...], indices: list[torch.Tensor]) -> tuple[int, ...] | None:
    """The view of ``x`` that ``x[indices]`` expands, when every index tensor is an arange over
    its dim of ``x`` laid along one dim of the broadcast index shape (in order); else None."""
    k = len(indices)
    index_shape = torch.broadcast_shapes(*(t.shape for t in indices))
    view = [1] * len(index_shape) + list(x_shape[k:])
    last = -1
    for j, idx in enumerate(indices):
        full = idx.expand(index_shape)
        varies = [
            d
            for d in range(len(index_shape))
            if full.shape[d] > 1 and not bool((full == full.narrow(d, 0, 1)).all())
        ]
        if x_shape[j] == 1 and not varies:
            continue
        if len(varies) != 1 or varies[0] <= last or index_shape[varies[0]] != x_shape[j]:
            return None
        last = varies[0]
        view[last] = x_shape[j]
    # The arange order itself, checked on a probe: x[indices] == x.view(view).expand(...)
    probe = torch.arange(math.prod(x_shape), device=indices[0].device).reshape(x_shape)
    want = probe[tuple(indices)]
    if not torch.equal(probe.reshape(view).expand(want.shape), want):
        return None
    return tuple(view)


@handles("index")
def _index(tr: Tracer, n: CNode) -> Any:
    x = tr.tensor(n, n.args[0], "input")
    raw = list(n.arg(1, "indices"))
    indices = [tr.folded(i) for i in raw]
    view = None
    if raw and all(isinstance(t, torch.Tensor) and not t.is_floating_point() for t in indices):
        view = _index_view(tuple(x.shape), indices)
    if view is None:
        raise UnsupportedOpError(
            f"{n.where()}: indexing with tensors is supported only where it is a view (index "
            "tensors that are aranges over their dims, computed from shapes)",
            hint="gather data-dependent rows inside an op registered with mg.register_op",
        )
    steps = [("view", view), ("expand", tuple(n.shape))]
    return tr.relayout(n, x, steps, shape=tuple(n.shape))


def _additive_constant(tr: Tracer, n: CNode, t: torch.Tensor) -> Value:
    """A folded boolean mask as an additive constant of the program."""
    name = tr.unique(f"const.{n.name}_additive")
    tr.og.constants[name] = additive_mask(t, torch_dtype(tr.dtype)).contiguous()
    v = Value(name, tuple(t.shape), tr.dtype, None, "param", source=ParamSource((name,)))
    tr.og.params.append(v)
    return v


def _mask_elementwise(
    tr: Tracer, n: CNode, fn: str, x: Value, y: Value | None, scalar: float | None
) -> Value:
    out_shape = tuple(n.shape)
    if x.shape != out_shape:
        x = broadcast(tr, n, x, out_shape, None)
    lay = tr.layout_in(x, n) or REPLICATE
    rows, cols = flat_shape(out_shape)
    params: dict[str, Any] = {"rows": rows, "cols": cols, "fn": fn, "shape": list(out_shape)}
    inputs = {"x": x}
    if y is not None:
        form = broadcast_form(y.shape, out_shape)
        if form is None:
            y, form = broadcast(tr, n, y, out_shape, lay), "full"
        params["other"], inputs["y"] = form, y
    else:
        params["scalar"] = scalar
    params["layout"] = lay.to_json()
    return tr.emit(n, "elementwise", params, inputs, out_shape, lay, mask_math=True)


@handles("__and__", "bitwise_and", "logical_and")
def _and(tr: Tracer, n: CNode) -> Any:
    """``a & b`` of two masks: hidden where either hides, the sum of the additive forms."""
    operands = []
    for arg in n.args[:2]:
        folded = tr.folded(arg)
        if folded is not None and folded.dtype == torch.bool:
            operands.append(_additive_constant(tr, arg, folded))
            continue
        v = tr.value(arg)
        if not _is_mask(v):
            raise UnsupportedOpError(
                f"{n.where()}: '&' of tensors is supported only between attention masks "
                "(a boolean program input and masks computed from shapes)",
                hint="compute it outside the module, or inside an op registered with "
                "mg.register_op",
            )
        operands.append(v)
    a, b = operands
    if b.shape == tuple(n.shape) and a.shape != b.shape:
        a, b = b, a
    if not _is_mask(a):  # the emitted op must read the mask first
        a, b = b, a
    return _mask_elementwise(tr, n, "add", a, b, None)


@handles("where")
def _where(tr: Tracer, n: CNode) -> Any:
    """Eager attention's float mask, ``where(mask, 0, lowest)``: 0 stays, -inf becomes lowest."""
    cond, keep, hide = (tr.value(a) for a in n.args[:3])
    keep = keep.item() if isinstance(keep, torch.Tensor) else keep
    hide = hide.item() if isinstance(hide, torch.Tensor) else hide
    lowest = torch.finfo(torch_dtype(tr.dtype)).min
    if not (_is_mask(cond) and keep == 0 and isinstance(hide, float) and hide <= lowest / 2):
        raise UnsupportedOpError(
            f"{n.where()}: torch.where is supported only as transformers writes an eager "
            "attention mask: where(mask, 0, a large negative number), mask from a boolean input",
            hint="compute it outside the module, or inside an op registered with mg.register_op",
        )
    return _mask_elementwise(tr, n, "maximum", cond, None, float(hide))
