"""ATen op -> mgraph op for elementwise math, norms, softmax and row reductions: each becomes a
layout-following tile op (mgraph/ops/tilewise.py) in the layout of its main input."""

from __future__ import annotations

from typing import Any

import torch

from ..errors import UnsupportedOpError
from ..layout import REPLICATE, Layout, canonical, flat_shape
from ..ops.elementwise import bcast_form, traced_tile_rows
from ..ops.tilewise import traced_norm_rows
from .capture import CNode
from .mapping import BINARY, UNARY, broadcast_form, handles, whole_rows
from .opgraph import OpGraph, OpNode, Value
from .slicing import broadcast
from .tracer import Tracer

__all__ = ["fuse_pointwise"]


# -- elementwise -------------------------------------------------------------------------------
def _tile_rows(tr: Tracer, shape: tuple, lay: Layout) -> int:
    """traced_tile_rows of the columns ONE rank holds: a chain over columns sharded past the
    ranks (SwiGLU over 14336 / 16 = 896 columns at 2x8) tiled by the global width made 16-row
    tasks of 14k elements, a quarter of what a task is meant to cover."""
    cols = flat_shape(shape)[1]
    lay = canonical(shape, lay, tr.world)
    if lay.kind == "shard" and lay.dim == len(shape) - 1:
        cols = -(-cols // tr.world)
    return traced_tile_rows(cols)


def _shape(v: Any) -> str:
    return str(list(v.shape)) if hasattr(v, "shape") else repr(v)


@handles(*UNARY)
def _unary(tr: Tracer, n: CNode) -> Any:
    x = tr.tensor(n, n.args[0], "input")
    fn = UNARY[n.op]
    if n.op == "gelu" and n.arg(1, "approximate", "none") == "tanh":
        fn = "gelu_tanh"
    lay = tr.layout_in(x, n) or REPLICATE
    rows, cols = flat_shape(x.shape)
    params = {
        "rows": rows,
        "cols": cols,
        "fn": fn,
        "shape": list(x.shape),
        "layout": lay.to_json(),
        "tile_rows": _tile_rows(tr, tuple(x.shape), lay),
    }
    return tr.emit(n, "elementwise", params, {"x": x}, x.shape, lay)


@handles(*BINARY)
def _binary(tr: Tracer, n: CNode) -> Any:
    a, b = tr.value(n.args[0]), tr.value(n.arg(1, "other"))
    alpha = n.kwargs.get("alpha", n.args[2] if len(n.args) > 2 else 1)
    swap = n.op == "rsub"
    if not isinstance(a, Value):
        a, b, swap = b, a, not swap
    out_shape = tuple(n.shape)
    if isinstance(b, Value) and b.shape == out_shape and a.shape != out_shape:
        a, b, swap = b, a, not swap
    if alpha != 1 and swap:
        raise UnsupportedOpError(f"{n.where()}: alpha={alpha} with a broadcast first operand")
    if isinstance(a, Value) and a.shape != out_shape:
        # Both operands broadcast (a [B, 1, S, 1] times a [1, H, 1, D]): the first one becomes
        # a tensor of the result's shape, the second then broadcasts against it.
        a = broadcast(tr, n, a, out_shape, None)
    if not isinstance(a, Value):
        raise UnsupportedOpError(
            f"{n.where()}: neither operand is a tensor ({_shape(a)} with {_shape(b)})"
        )
    rows, cols = flat_shape(out_shape)
    params: dict[str, Any] = {
        "rows": rows,
        "cols": cols,
        "fn": BINARY[n.op],
        "alpha": float(alpha),
        "swap": swap,
        "shape": list(out_shape),
    }
    inputs = {"x": a}
    lay = tr.layout_in(a, n)
    if isinstance(b, Value):
        form = broadcast_form(b.shape, out_shape) or bcast_form(b.shape, out_shape)
        if form is None:
            # A broadcast the row map cannot express ([B, 1, S, 1] against [B, H, S, D]):
            # expanded into the layout of ``a``.
            b, form = broadcast(tr, n, b, out_shape, lay), "full"
        params["other"] = form
        inputs["y"] = b
        if form == "full":
            other = tr.layout_in(b, n)
            if lay is None or (lay == REPLICATE and other is not None):
                lay = other
    elif isinstance(b, (int, float, bool)):
        params["scalar"] = float(b)
    else:
        raise UnsupportedOpError(f"{n.where()}: operand {b!r} is neither a tensor nor a number")
    lay = lay or REPLICATE
    params["layout"] = lay.to_json()
    params["tile_rows"] = _tile_rows(tr, out_shape, lay)
    return tr.emit(n, "elementwise", params, inputs, out_shape, lay)


# -- norms, softmax, reductions ----------------------------------------------------------------
def _last_dim_only(n: CNode, x, normalized) -> None:
    if list(normalized) != [x.shape[-1]]:
        raise UnsupportedOpError(
            f"{n.where()}: normalizes over {list(normalized)}; only the last dim is supported"
        )


@handles("rms_norm")
def _rms_norm(tr: Tracer, n: CNode) -> Any:
    x = tr.tensor(n, n.args[0], "input")
    _last_dim_only(n, x, n.arg(1, "normalized_shape"))
    weight, eps = n.arg(2, "weight"), n.arg(3, "eps")
    eps = torch.finfo(n.dtype).eps if eps is None else float(eps)
    lay = whole_rows(tr, x, n)
    rows, cols = flat_shape(x.shape)
    inputs = {"x": x} | ({"weight": tr.value(weight)} if weight is not None else {})
    params = {
        "rows": rows,
        "cols": cols,
        "eps": eps,
        "has_weight": weight is not None,
        "shape": list(x.shape),
        "layout": lay.to_json(),
        "tile_rows": traced_norm_rows(cols),
    }
    return tr.emit(n, "rms_norm", params, inputs, x.shape, lay)


@handles("layer_norm")
def _layer_norm(tr: Tracer, n: CNode) -> Any:
    x = tr.tensor(n, n.args[0], "input")
    _last_dim_only(n, x, n.arg(1, "normalized_shape"))
    weight, bias, eps = n.arg(2, "weight"), n.arg(3, "bias"), n.arg(4, "eps", 1e-5)
    lay = whole_rows(tr, x, n)
    rows, cols = flat_shape(x.shape)
    inputs = {"x": x}
    if weight is not None:
        inputs["weight"] = tr.value(weight)
    if bias is not None:
        inputs["bias"] = tr.value(bias)
    params = {
        "rows": rows,
        "cols": cols,
        "eps": float(eps),
        "has_weight": weight is not None,
        "has_bias": bias is not None,
        "shape": list(x.shape),
        "layout": lay.to_json(),
        "tile_rows": traced_norm_rows(cols),
    }
    return tr.emit(n, "layer_norm", params, inputs, x.shape, lay)


@handles("softmax", "_softmax")
def _softmax(tr: Tracer, n: CNode) -> Any:
    x = tr.tensor(n, n.args[0], "input")
    dim = n.arg(1, "dim")
    if dim is None or dim % len(x.shape) != len(x.shape) - 1:
        raise UnsupportedOpError(f"{n.where()}: softmax over dim {dim}; only the last dim")
    lay = whole_rows(tr, x, n)
    rows, cols = flat_shape(x.shape)
    params = {"rows": rows, "cols": cols, "shape": list(x.shape), "layout": lay.to_json()}
    return tr.emit(n, "softmax", params, {"x": x}, x.shape, lay)


@handles("mean", "sum", "amax", "amin")
def _reduce(tr: Tracer, n: CNode) -> Any:
    x = tr.tensor(n, n.args[0], "input")
    dims = n.arg(1, "dim")
    dims = [dims] if isinstance(dims, int) else list(dims or [])
    keepdim = bool(n.arg(2, "keepdim", False))
    if [d % len(x.shape) for d in dims] != [len(x.shape) - 1]:
        raise UnsupportedOpError(
            f"{n.where()}: reduces over dims {dims}; only the last dim is supported"
        )
    lay = whole_rows(tr, x, n)
    rows, cols = flat_shape(x.shape)
    kept = tuple(x.shape[:-1]) + (1,)
    params = {
        "rows": rows,
        "cols": cols,
        "fn": n.op,
        "shape": list(x.shape),
        "layout": lay.to_json(),
    }
    out = tr.emit(n, "row_reduce", params, {"x": x}, kept, lay)
    return out if keepdim else tr.relayout(n, out, ("view", tuple(n.shape)))


# user-registered ops and leaf modules (ExpertParallel) map in modules.py


# -- fusion of pointwise chains ----------------------------------------------------------------
class _Chain:
    """An elementwise node as a chain: its inputs (Value, form) and steps over them."""

    def __init__(self, node: OpNode) -> None:
        from ..ops.elementwise import _chain_of, input_names

        p = node.params
        steps, forms = _chain_of(
            p.get("fn", "add"),
            p.get("other"),
            p.get("scalar"),
            float(p.get("alpha", 1.0)),
            bool(p.get("swap", False)),
            p.get("chain"),
            p.get("operands"),
        )
        names = input_names(1 + len(forms))
        self.node = node
        x_form = p.get("x_form", "full")
        self.inputs: list[tuple[Value, str]] = [
            (node.inputs[n], f) for n, f in zip(names, [x_form, *forms], strict=True)
        ]
        self.steps = steps
        self.origins = [node.origin]

    def rebuilt(self) -> OpNode:
        """The node of this chain: its steps and inputs in chain form (option ``chain``; the
        first input's form in ``x_form`` unless full)."""
        from ..ops.elementwise import input_names

        node = self.node
        p = {
            k: v
            for k, v in node.params.items()
            if k not in ("fn", "other", "scalar", "alpha", "swap", "x_form")
        }
        p["chain"] = self.steps
        p["operands"] = [f for _, f in self.inputs[1:]]
        if self.inputs[0][1] != "full":
            p["x_form"] = self.inputs[0][1]
        names = input_names(len(self.inputs))
        return OpNode(
            node.name,
            node.op,
            p,
            {n: v for n, (v, _) in zip(names, self.inputs, strict=True)},
            node.outputs,
            node.path,
            "+".join(self.origins),
        )

    @property
    def out(self) -> Value:
        return self.node.outputs["out"]

    def fits(self, other: _Chain) -> bool:
        """Whether ``other`` (a producer) runs on this chain's tile grid."""
        a, b = self.node.params, other.node.params
        return (a["rows"], a["cols"], a.get("shape"), a.get("layout")) == (
            b["rows"],
            b["cols"],
            b.get("shape"),
            b.get("layout"),
        )

    def inline(self, slot: int, producer: _Chain) -> tuple[list, list]:
        """(inputs, steps) of this chain with input ``slot`` computed by ``producer``'s steps."""
        inputs: list[tuple[Value, str]] = []

        def index(v: Value, form: str) -> int:
            for k, (w, f) in enumerate(inputs):
                if w is v and f == form:
                    return k
            inputs.append((v, form))
            return len(inputs) - 1

        # the first input stays a full operand: the producer's x when it replaces ours
        order = [("p", k) for k in range(len(producer.inputs))] + [
            ("c", k) for k in range(len(self.inputs)) if k != slot
        ]
        if slot != 0:
            order = [o for o in order if o[0] == "c"] + [o for o in order if o[0] == "p"]
        where = {}
        for who, k in order:
            v, f = (producer if who == "p" else self).inputs[k]
            where[(who, k)] = index(v, f)
        n, np_ = len(inputs), len(producer.steps)

        def ref(who: str, r: int, nin: int) -> Any:
            if r == -1:
                return -1
            if r < nin:
                if who == "c" and r == slot:
                    return ("s", np_ - 1)
                return ("i", where[(who, r)])
            return ("s", r - nin + (np_ if who == "c" else 0))

        sym = [
            [fn, ref("p", a, len(producer.inputs)), ref("p", b, len(producer.inputs)), s]
            for fn, a, b, s in producer.steps
        ]
        sym += [
            [fn, ref("c", a, len(self.inputs)), ref("c", b, len(self.inputs)), s]
            for fn, a, b, s in self.steps
        ]

        def number(r: Any) -> int:
            return r if r == -1 else (r[1] if r[0] == "i" else n + r[1])

        return inputs, [[fn, number(a), number(b), s] for fn, a, b, s in sym]


def fuse_pointwise(og: OpGraph) -> OpGraph:
    """``og`` with chains of elementwise nodes fused into one elementwise node each.

    A producer is inlined into its consumer when its output is read by that consumer alone
    (once, as a full operand, not a program output), both run on the same tile grid (same
    shape and layout), and the fused chain still fits the bytecode (MAX_OPS instructions,
    REGISTERS live tiles: mgraph/ops/elementwise.py). ``silu(gate) * up`` becomes one node, one
    ``ewise`` task per row tile; so does RoPE's ``q * cos + rotate_half(q) * sin``, which
    reads ``q`` (loaded plainly and rotated) and ``cos``/``sin`` as ``bcast:`` operands (a
    ``rotate_half`` step fuses only while it rotates an input of the chain, not a computed
    value). Then a relayout that one fused chain alone reads is folded into it
    (:func:`_read_relayouts`): RoPE reads ``q`` from the q projection's output through the
    head split's gather map, and the split is no task. The returned OpGraph shares ``og``'s
    values; ``og`` is left as traced (one node per ATen op)."""
    from collections import Counter
    from dataclasses import replace

    from ..errors import OptionError
    from ..ops.elementwise import compile_chain, operand_maps

    reads: Counter[str] = Counter()
    for node in og.nodes:
        for v in node.inputs.values():
            reads[v.root().name] += 1
    for v in og.outputs:
        reads[v.root().name] += 2  # an output is kept: never fused away
    chains: dict[str, _Chain] = {}  # output value name -> the chain that computes it
    nodes: list[OpNode] = []
    for node in og.nodes:
        if node.op != "elementwise":
            nodes.append(node)
            continue
        chain = _Chain(node)
        fused_any = True
        while fused_any:
            fused_any = False
            for slot, (v, form) in enumerate(chain.inputs):
                producer = chains.get(v.name)
                if (
                    producer is None
                    or form != "full"
                    or v.alias_of is not None
                    or reads[v.name] != 1
                    or v.shape != chain.out.shape
                    or not chain.fits(producer)
                ):
                    continue
                inputs, steps = chain.inline(slot, producer)
                p = chain.node.params
                try:
                    codes, _ = operand_maps(
                        [f for _, f in inputs], p.get("shape") or [p["rows"], p["cols"]]
                    )
                    compile_chain(steps, len(inputs), codes)
                except OptionError:
                    # too long, too many live tiles or broadcast maps, or a rotation of a
                    # computed value (rotate_half loads an input): stays two nodes
                    continue
                chain.inputs, chain.steps = inputs, steps
                chain.origins = producer.origins + chain.origins
                nodes.remove(producer.node)
                del chains[v.name]
                fused_any = True
                break
        if len(chain.steps) > 1 or chain.node.params.get("chain") is not None:
            chain.node = chain.rebuilt()
        nodes.append(chain.node)
        chains[chain.out.name] = chain
    return replace(og, nodes=_read_relayouts(og, nodes))


def _read_relayouts(og: OpGraph, nodes: list[OpNode]) -> list[OpNode]:
    """``nodes`` with each relayout that one elementwise node alone reads (once, as a full
    operand) folded into that node: it reads the relayout's source through the relayout's
    gather map (a ``gather:`` operand, mgraph/ops/elementwise.py), and the relayout is no
    task. Kept as a task: a relayout whose source is held in another layout than the relayout
    reads it in (its source would move between ranks), whose result the consumer reads in
    another layout, whose map has no gather form on some tile, or a second one of a chain."""
    from collections import Counter

    from ..errors import OptionError
    from ..ops.elementwise import gather_fits, gather_form, operand_maps

    reads: Counter[str] = Counter()  # in the fused chains: RoPE's q is one input, read twice
    for node in nodes:
        for v in node.inputs.values():
            reads[v.root().name] += 1
    for v in og.outputs:
        reads[v.root().name] += 2  # an output is kept
    world = og.topology.world_size
    relayouts = {n.outputs["out"].name: n for n in nodes if n.op == "relayout"}
    gone: set[int] = set()
    for i, node in enumerate(nodes):
        if node.op != "elementwise":
            continue
        chain, p, changed = _Chain(node), node.params, False
        shape = tuple(p.get("shape") or (p["rows"], p["cols"]))
        for slot, (v, form) in enumerate(chain.inputs):
            rel = relayouts.get(v.name)
            if (
                rel is None
                or form != "full"
                or v.alias_of is not None
                or reads[v.name] != 1
                or v.shape != shape
            ):
                continue
            rp, source = rel.params, rel.inputs["x"]
            src, dst = Layout.from_json(rp["in_layout"]), Layout.from_json(rp["out_layout"])
            lay = Layout.from_json(p.get("layout"))
            held = source.layout
            if canonical(shape, dst, world) != canonical(shape, lay, world) or (
                held is not None
                and canonical(source.shape, held, world) != canonical(source.shape, src, world)
            ):
                continue
            gather = gather_form(rp["in_shape"], rp["steps"], rp["in_layout"])
            forms = [f for _, f in chain.inputs]
            forms[slot] = gather
            try:
                operand_maps(forms, shape)
            except OptionError:  # a second gather operand
                continue
            if not gather_fits(gather, shape, p.get("layout"), world, p.get("tile_rows", 64)):
                continue
            chain.inputs[slot] = (source, gather)
            chain.origins = [rel.origin, *chain.origins]
            gone.add(id(rel))
            changed = True
        if changed:
            nodes[i] = chain.rebuilt()
    return [n for n in nodes if id(n) not in gone]
