"""ATen op -> mgraph op for the data movement model code writes with indexing: slices
(``x[..., :d]``, ``narrow``, ``select``), ``chunk``/``split``/``unbind`` (one slice per piece
used), ``expand`` (``repeat_kv``) and ``cat``.

Slices and expands are relayout steps (mgraph/ops/relayout.py), so a chain of them and of
views/permutes is one op; cat along the last dim is the ``concat`` op, along another dim it is
the same op between relayouts that bring that dim last. ``rotate_half``'s cat of a negated and
a plain half of one tensor is a pointwise op instead (:func:`_rotate_half`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ..errors import UnsupportedOpError
from ..layout import REPLICATE, flat_shape
from ..ops.elementwise import ROTATE, traced_tile_rows
from .capture import CNode
from .mapping import handles, sharded_last
from .opgraph import Value
from .tracer import Tracer

__all__: list[str] = []


def _bounds(size: int, start: Any, end: Any) -> tuple[int, int]:
    start = 0 if start is None else start
    end = size if end is None else end
    start = max(0, start + size if start < 0 else start)
    end = min(size, end + size if end < 0 else end)
    return start, max(start, end)


def slice_of(tr: Tracer, n: CNode, x: Value, dim: int, start: int, end: int, step: int = 1):
    """``x`` sliced along ``dim`` (normalised bounds); ``x`` itself when the slice is whole."""
    dim %= len(x.shape)
    if step <= 0:
        raise UnsupportedOpError(f"{n.where()}: slice step {step} must be positive")
    if start == 0 and end >= x.shape[dim] and step == 1:
        return x
    if start >= end:
        # An empty piece: torch.cat skips it (Phi-3's rotary code cuts q[..., rotary_dim:],
        # empty when the rotation covers the whole head, and cats it back on). Only cat may
        # read it (Tracer.tensor names any other reader).
        shape = list(x.shape)
        shape[dim] = 0
        return Value(tr.unique(f"{n.name}_empty"), tuple(shape), x.dtype, None, "empty")
    return tr.relayout(n, x, ("slice", (dim, start, end, step)))


@handles("slice")
def _slice(tr: Tracer, n: CNode) -> Any:
    x = tr.tensor(n, n.args[0], "input")
    dim = n.arg(1, "dim", 0) % len(x.shape)
    start, end = _bounds(x.shape[dim], n.arg(2, "start"), n.arg(3, "end"))
    return slice_of(tr, n, x, dim, start, end, n.arg(4, "step", 1))


@handles("narrow")
def _narrow(tr: Tracer, n: CNode) -> Any:
    x = tr.tensor(n, n.args[0], "input")
    dim = n.arg(1, "dim") % len(x.shape)
    start = n.arg(2, "start") % x.shape[dim]
    return slice_of(tr, n, x, dim, start, start + n.arg(3, "length"))


@handles("select")
def _select(tr: Tracer, n: CNode) -> Any:
    x = tr.tensor(n, n.args[0], "input")
    dim = n.arg(1, "dim") % len(x.shape)
    index = n.arg(2, "index") % x.shape[dim]
    step = ("slice", (dim, index, index + 1, 1))
    return tr.relayout(n, x, [step, ("view", tuple(n.shape))])


@dataclass
class Pieces:
    """``split``/``chunk``/``unbind`` of ``x`` along ``dim``: the ``(start, end)`` of each piece,
    sliced only when a ``getitem`` uses it (unused pieces cost nothing)."""

    x: Value
    dim: int
    bounds: list[tuple[int, int]]
    squeeze: bool = False


@handles("split", "split_with_sizes", "chunk", "unbind")
def _split(tr: Tracer, n: CNode) -> Any:
    x = tr.tensor(n, n.args[0], "input")
    dim = n.arg(2 if n.op != "unbind" else 1, "dim", 0) % len(x.shape)
    size = x.shape[dim]
    if n.op == "unbind":
        return Pieces(x, dim, [(i, i + 1) for i in range(size)], squeeze=True)
    arg = n.arg(1, "chunks" if n.op == "chunk" else "split_size")
    if n.op == "chunk":
        arg = math.ceil(size / arg)  # torch.chunk: pieces of ceil(size / chunks)
    sizes = list(arg) if isinstance(arg, (list, tuple)) else [arg] * math.ceil(size / arg)
    bounds, start = [], 0
    for s in sizes:
        bounds.append((start, min(start + s, size)))
        start += s
    return Pieces(x, dim, bounds)


@handles("getitem")
def _getitem(tr: Tracer, n: CNode) -> Any:
    whole = tr.env.get(n.args[0]) if isinstance(n.args[0], CNode) else None
    index = n.args[1]
    if isinstance(whole, Pieces):
        start, end = whole.bounds[index]
        if whole.squeeze:
            step = ("slice", (whole.dim, start, end, 1))
            return tr.relayout(n, whole.x, [step, ("view", tuple(n.shape))])
        return slice_of(tr, n, whole.x, whole.dim, start, end)
    if isinstance(whole, (list, tuple)):
        return whole[index]
    raise UnsupportedOpError(f"{n.where()}: indexing a {type(whole).__name__} is not supported")


@handles("expand")
def _expand(tr: Tracer, n: CNode) -> Any:
    return broadcast(tr, n, tr.tensor(n, n.args[0], "input"), tuple(n.shape), None)


def broadcast(tr: Tracer, n: CNode, x: Value, out: tuple[int, ...], want) -> Value:
    """``x`` broadcast to ``out`` as a tensor of its own (an expand relayout), made in the
    layout ``want`` of the operand it meets where ``x``'s layout allows."""
    if x.shape == out:
        return x
    lead = (1,) * (len(out) - len(x.shape)) + x.shape
    if lead != x.shape:
        x = tr.relayout(n, x, ("view", lead), shape=lead, name=f"{n.name}_lead")
    return tr.relayout(n, x, ("expand", out), shape=out, name=f"{n.name}_bcast", want=want)


@handles("cat", "concat", "concatenate")
def _cat(tr: Tracer, n: CNode) -> Any:
    rotated = _rotate_half(tr, n)
    if rotated is not None:
        return rotated
    parts = [tr.tensor(n, t, "input", empty_ok=True) for t in n.arg(0, "tensors")]
    parts = [p for p in parts if math.prod(p.shape) > 0]  # torch.cat skips empty tensors
    if not parts:
        raise UnsupportedOpError(f"{n.where()}: a cat of empty tensors only")
    return _cat_parts(tr, n, parts, n.arg(1, "dim", 0) % len(parts[0].shape))


@handles("stack")
def _stack(tr: Tracer, n: CNode) -> Any:
    """``torch.stack(tensors, dim)``: each tensor viewed with a new dim of 1 at ``dim``, then a
    cat along it. The interleaved ``rotate_half`` of Cohere, GLM and Helium
    (``stack((-x[..., 1::2], x[..., ::2]), -1).flatten(-2)``) takes this path: strided slices,
    a negation and a concat of 1-column pieces, correct but not one fused step as Llama's
    half rotation is (_rotate_half)."""
    out_shape = tuple(n.shape)
    dim = n.arg(1, "dim", 0) % len(out_shape)
    parts = []
    for i, t in enumerate(n.arg(0, "tensors")):
        p = tr.tensor(n, t, "input")
        shape = p.shape[:dim] + (1,) + p.shape[dim:]
        parts.append(tr.relayout(n, p, ("view", shape), shape=shape, name=f"{n.name}_in{i}"))
    return _cat_parts(tr, n, parts, dim)


def _cat_parts(tr: Tracer, n: CNode, parts: list[Value], dim: int) -> Value:
    """``parts`` (none empty) joined along ``dim`` into ``n``'s output shape."""
    nd = len(parts[0].shape)
    if len(parts) == 1:
        return parts[0]
    out_shape = tuple(n.shape)
    if dim != nd - 1:
        # Bring the cat dim last ([outer, d * inner] views), concat, and view back.
        outer = math.prod(out_shape[:dim])
        flat = [
            tr.relayout(
                n,
                p,
                ("view", (outer, math.prod(p.shape[dim:]))),
                shape=(outer, math.prod(p.shape[dim:])),
                name=f"{n.name}_in{i}",
            )
            for i, p in enumerate(parts)
        ]
        joined = _concat_last(tr, n, flat)
        return tr.relayout(n, joined, ("view", out_shape), shape=out_shape, name=f"{n.name}_out")
    return _concat_last(tr, n, parts)


def _concat_last(tr: Tracer, n: CNode, parts: list[Value]) -> Value:
    out = parts[0]
    for i, y in enumerate(parts[1:], start=1):
        shape = out.shape[:-1] + (out.shape[-1] + y.shape[-1],)
        lay = tr.layout_in(out, n) or tr.layout_in(y, n) or REPLICATE
        if sharded_last(lay, len(shape)):
            lay = REPLICATE  # concat needs whole rows
        rows, cols = flat_shape(out.shape)
        params = {
            "rows": rows,
            "cols": cols,
            "cols_y": y.shape[-1],
            "shape": list(out.shape),
            "layout": lay.to_json(),
            # by width, as traced pointwise ops tile: narrow rows (the interleaved rotation's
            # pairs of one column) in 64-row tasks made hundreds of tasks of a few KiB
            "tile_rows": traced_tile_rows(cols + y.shape[-1]),
        }
        name = n.name if i == len(parts) - 1 else f"{n.name}_{i}"
        out = tr.emit(n, "concat", params, {"x": out, "y": y}, shape, lay, name=name)
    return out


def _rotate_half(tr: Tracer, n: CNode) -> Value | None:
    """``torch.cat((-x[..., h:], x[..., :h]), dim=-1)`` with ``h`` half of x's last dim (the
    ``rotate_half`` of transformers' Llama, Mistral, Qwen and Mixtral) as ONE elementwise op of
    ``x``, a ``rotate_half`` step (mgraph/ops/elementwise.py), in place of two slice
    relayouts, a neg and a concat: a consumer's pointwise chain then reads ``x`` rotated
    (fuse_pointwise). None, and the usual path, for any other cat, for pieces something else
    also reads, or when ``x`` is split along its last dim (the rotation needs whole rows)."""
    tensors = n.arg(0, "tensors")
    if len(tensors) != 2 or not n.shape or n.arg(1, "dim", 0) % len(n.shape) != len(n.shape) - 1:
        return None
    neg, first = tensors
    if not (isinstance(neg, CNode) and neg.op == "neg" and isinstance(first, CNode)):
        return None
    second = neg.args[0]
    if not isinstance(second, CNode) or first.op != "slice" or second.op != "slice":
        return None
    if any(len(c.users) != 1 or c in tr.cap.outputs for c in (neg, first, second)):
        return None
    v_first, v_second, v_neg = (tr.env.get(c) for c in (first, second, neg))
    r_first = tr.relayouts.get(getattr(v_first, "name", ""))
    r_second = tr.relayouts.get(getattr(v_second, "name", ""))
    if r_first is None or r_second is None or not isinstance(v_neg, Value):
        return None
    x = r_first.inputs["x"]
    nd, d = len(x.shape), x.shape[-1]
    h = d // 2
    if (
        r_second.inputs["x"] is not x
        or d % 2
        or tuple(n.shape) != x.shape
        or r_first.params["steps"] != [["slice", [nd - 1, 0, h, 1]]]
        or r_second.params["steps"] != [["slice", [nd - 1, h, d, 1]]]
    ):
        return None
    negs = [
        node
        for node in tr.og.nodes[::-1]
        if node.outputs.get("out") is v_neg
        and node.op == "elementwise"
        and node.params.get("fn") == "neg"
        and node.params.get("chain") is None
        and node.inputs.get("x") is v_second
    ]
    lay = tr.layout_in(x, n) or REPLICATE
    if not negs or sharded_last(lay, nd):
        return None
    for node in (negs[0], r_first, r_second):  # read by nothing else: never lowered
        tr.og.nodes.remove(node)
        tr.relayouts.pop(node.outputs["out"].name, None)
    rows, cols = flat_shape(x.shape)
    params = {
        "rows": rows,
        "cols": cols,
        "chain": [[ROTATE, 0, -1, 0.0]],
        "operands": [],
        "shape": list(x.shape),
        "layout": lay.to_json(),
    }
    return tr.emit(n, "elementwise", params, {"x": x}, x.shape, lay)
