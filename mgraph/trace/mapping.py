"""The op-mapping registry shared by aten.py, pointwise.py and modules.py: one handler per
captured op name; each reads a capture.CNode, asks the Tracer for its inputs' Values and
layouts, and emits OpNodes of registered ops."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..layout import REPLICATE, Layout
from .capture import CNode
from .tracer import Tracer

__all__ = ["HANDLERS", "handles", "load_handlers", "broadcast_form", "BINARY", "UNARY", "VIEWS"]

Handler = Callable[[Tracer, CNode], Any]
HANDLERS: dict[str, Handler] = {}


def handles(*names: str) -> Callable[[Handler], Handler]:
    def wrap(fn: Handler) -> Handler:
        for name in names:
            HANDLERS[name] = fn
        return fn

    return wrap


def sharded_last(layout: Layout | None, ndim: int) -> bool:
    return layout is not None and layout.kind == "shard" and layout.dim == ndim - 1


def token_sharded(layout: Layout | None, ndim: int) -> bool:
    return layout is not None and (
        layout.kind == "rows" or (layout.kind == "shard" and layout.dim < ndim - 1)
    )


def whole_rows(tr: Tracer, x, n: CNode) -> Layout:
    """The layout of ``x`` for an op that needs whole rows (a column shard is gathered)."""
    lay = tr.layout_in(x, n)
    if lay is None or sharded_last(lay, len(x.shape)):
        return REPLICATE
    return lay


BINARY = {
    "add": "add",
    "sub": "sub",
    "mul": "mul",
    "div": "div",
    "pow": "pow",
    "maximum": "maximum",
    "minimum": "minimum",
    "rsub": "sub",
}
UNARY = {
    "neg": "neg",
    "silu": "silu",
    "gelu": "gelu",
    "relu": "relu",
    "sigmoid": "sigmoid",
    "tanh": "tanh",
    "exp": "exp",
    "log": "log",
    "sqrt": "sqrt",
    "rsqrt": "rsqrt",
    "abs": "abs",
}
VIEWS = (
    "view",
    "_unsafe_view",
    "reshape",
    "flatten",
    "unflatten",
    "unsqueeze",
    "squeeze",
    "expand",
)


def broadcast_form(shape: tuple[int, ...], out: tuple[int, ...]) -> str | None:
    """How an operand of ``shape`` broadcasts to ``out``: full, row (a vector over the last
    dim) or col (one value per row); None for any other broadcast."""
    if shape == out:
        return "full"
    stripped = shape
    while len(stripped) > 1 and stripped[0] == 1:
        stripped = stripped[1:]
    if stripped == out[-1:]:
        return "row"
    if shape == out[:-1] + (1,):
        return "col"
    return None


def load_handlers() -> dict[str, Handler]:
    """HANDLERS, with every handler module imported (they register on import)."""
    from . import aten, attention_map, masks, modules, pointwise, slicing  # noqa: F401

    return HANDLERS
