"""ATen op -> mgraph op for data movement and the big compute: views, linears, attention.

Pattern fusion happens here: a planned linear becomes a fused compute+collective op
(allgather_gemm, gemm_allreduce, gemm_reduce_scatter), attention under ContextParallel becomes
ring_attention. Elementwise math, norms and reductions are in pointwise.py.
"""

from __future__ import annotations

import math
from typing import Any

from ..errors import ShapeError, UnsupportedOpError
from ..layout import REPLICATE, ROWS, Layout, as_dim_shard, flat_shape
from ..plans import ColwiseParallel, ContextParallel, RowwiseParallel, SequenceParallel, Shard
from .capture import CNode
from .mapping import BINARY, UNARY, VIEWS, handles, token_sharded, whole_rows
from .tracer import Tracer

__all__: list[str] = []


# -- identity and views ------------------------------------------------------------------------
@handles(
    "alias",
    "detach",
    "detach_",
    "contiguous",
    "clone",
    "lift_fresh_copy",
    "_to_copy",
    "to",
    "type_as",
    "float",
    "dropout",
    "feature_dropout",
)
def _identity(tr: Tracer, n: CNode) -> Any:
    if n.op in ("dropout", "feature_dropout"):
        p, train = n.arg(1, "p", 0.5), n.arg(2, "train", True)
        if train and p > 0:
            raise UnsupportedOpError(
                f"{n.where()}: dropout in training mode is random",
                hint="call model.eval() before mg.compile",
            )
    return tr.tensor(n, n.args[0], "input")


@handles(*VIEWS, "t", "transpose", "permute", "swapaxes")
def _view(tr: Tracer, n: CNode) -> Any:
    x = tr.tensor(n, n.args[0], "input")
    nd = len(x.shape)
    if n.op in VIEWS:
        if n.op == "expand" and tuple(n.shape) != x.shape:
            raise UnsupportedOpError(
                f"{n.where()}: expand of {list(x.shape)} to {list(n.shape)} copies data",
                hint="use broadcasting in an elementwise op instead",
            )
        return tr.relayout(n, x, ("view", tuple(n.shape)))
    if n.op == "t":
        perm = (1, 0) if nd == 2 else (0,)
    elif n.op in ("transpose", "swapaxes"):
        d0, d1 = n.arg(1, "dim0") % nd, n.arg(2, "dim1") % nd
        perm = list(range(nd))
        perm[d0], perm[d1] = perm[d1], perm[d0]
    else:
        dims = n.args[1] if isinstance(n.arg(1, "dims"), (list, tuple)) else n.args[1:]
        perm = [d % nd for d in (dims or n.kwargs.get("dims"))]
    return tr.relayout(n, x, ("permute", tuple(perm)))


# -- linear layers -----------------------------------------------------------------------------


@handles("linear", "matmul", "mm")
def _linear(tr: Tracer, n: CNode) -> Any:
    x = tr.tensor(n, n.args[0], "input")
    wc = n.arg(1, "weight" if n.op == "linear" else "other")
    if not isinstance(wc, CNode) or wc.op != "param" or len(wc.shape) != 2:
        raise UnsupportedOpError(
            f"{n.where()}: a product of two activations is not supported",
            hint="matmuls multiply by a 2-D parameter (nn.Linear); attention uses "
            "F.scaled_dot_product_attention",
        )
    if n.op == "linear":
        N, K = wc.shape
        w = tr.param(wc, "t")
    else:
        K, N = wc.shape
        w = tr.param(wc)
    M = flat_shape(x.shape)[0]
    out_shape = tuple(x.shape[:-1]) + (N,)
    path = n.path
    style = tr.plan.get(path) if n.op == "linear" else None
    where = f"plan {path!r} {type(style).__name__}"
    dims = {"M": M, "N": N, "K": K}
    if isinstance(style, ColwiseParallel):
        if N % tr.world:
            raise ShapeError(
                f"{where}: out_features={N} is not divisible by the world size {tr.world}",
                hint=f"ColwiseParallel shards the output features: use a multiple of {tr.world}, "
                f"or leave {path!r} out of the plan",
            )
        xl = tr.layout_in(x, n)
        sequence = (
            isinstance(style.input_layouts, Shard)
            and style.input_layouts.dim % len(x.shape) != len(x.shape) - 1
        )
        if sequence or token_sharded(xl, len(x.shape)):
            out = tr.emit(
                n,
                "allgather_gemm",
                {**dims, **style.options},
                {"a": x, "b": w},
                out_shape,
                Layout("shard", len(out_shape) - 1),
            )
        else:
            params = {**dims, "shard": "cols", "shape": list(x.shape), **style.options}
            out = tr.emit(
                n,
                "matmul",
                params,
                {"a": x, "b": w},
                out_shape,
                Layout("shard", len(out_shape) - 1),
            )
        if not isinstance(style.output_layouts, Shard):
            out.layout = REPLICATE  # consumers gather it (the lowering reshards on demand)
    elif isinstance(style, RowwiseParallel):
        if K % tr.world:
            raise ShapeError(
                f"{where}: in_features={K} is not divisible by the world size {tr.world}",
                hint=f"RowwiseParallel shards the input features: use a multiple of {tr.world}, "
                f"or leave {path!r} out of the plan",
            )
        if isinstance(style.output_layouts, Shard) or _meets_sequence_parallel(tr, n):
            out = tr.emit(
                n,
                "gemm_reduce_scatter",
                {**dims, **style.options},
                {"a": x, "b": w},
                out_shape,
                ROWS,
            )
        else:
            out = tr.emit(
                n,
                "gemm_allreduce",
                {**dims, **style.options},
                {"a": x, "b": w},
                out_shape,
                REPLICATE,
            )
    else:
        lay = whole_rows(tr, x, n)
        params = {**dims, "shard": "none", "shape": list(x.shape), "layout": lay.to_json()}
        out = tr.emit(n, "matmul", params, {"a": x, "b": w}, out_shape, lay)
    bias = n.arg(2, "bias") if n.op == "linear" else None
    if bias is None:
        return out
    b = tr.param(bias)
    rows, cols = flat_shape(out_shape)
    params = {
        "rows": rows,
        "cols": cols,
        "fn": "add",
        "other": "row",
        "shape": list(out_shape),
        "layout": out.layout.to_json(),
    }
    return tr.emit(
        n, "elementwise", params, {"x": out, "y": b}, out_shape, out.layout, name=f"{n.name}_bias"
    )


def _meets_sequence_parallel(tr: Tracer, n: CNode) -> bool:
    """Whether a row-parallel linear's result flows (through elementwise ops and views) into a
    SequenceParallel module or into an op with a token-sharded operand: then reduce-scatter."""
    frontier, seen = list(n.users), {n}
    for _ in range(4):
        nxt = []
        for u in frontier:
            if u in seen:
                continue
            seen.add(u)
            region = tr.region(u)
            if region is not None and isinstance(region[1], SequenceParallel):
                return True
            if u.op in BINARY:
                for a in u.args[:2]:
                    v = tr.env.get(a) if isinstance(a, CNode) else None
                    if v is not None and token_sharded(v.layout, len(v.shape)):
                        return True
            if u.op in BINARY or u.op in UNARY or u.op in VIEWS or u.op == "alias":
                nxt.extend(u.users)
        frontier = nxt
    return False


# -- attention ---------------------------------------------------------------------------------


@handles("scaled_dot_product_attention")
def _sdpa(tr: Tracer, n: CNode) -> Any:
    q, k, v = (tr.tensor(n, n.args[i], name) for i, name in enumerate(("query", "key", "value")))
    mask, dropout = n.arg(3, "attn_mask"), n.arg(4, "dropout_p", 0.0)
    causal, scale = bool(n.arg(5, "is_causal", False)), n.arg(6, "scale")
    if mask is not None or dropout or n.kwargs.get("enable_gqa"):
        raise UnsupportedOpError(
            f"{n.where()}: attention with an explicit mask, dropout or GQA is not supported",
            hint="use is_causal=True for causal masks, dropout_p=0.0, equal q/k/v heads",
        )
    if not (len(q.shape) == 4 and q.shape == k.shape == v.shape):
        raise UnsupportedOpError(
            f"{n.where()}: q, k, v must all be [batch, heads, seq, head_dim] of one shape "
            f"(got {list(q.shape)}, {list(k.shape)}, {list(v.shape)})",
            hint="self-attention with equal heads; repeat KV heads before the call for GQA",
        )
    B, H, S, D = q.shape
    dims = {"B": B, "H": H, "S": S, "D": D, "causal": causal}
    region = tr.region(n)
    if region is not None and isinstance(region[1], ContextParallel):
        if scale is not None and not math.isclose(scale, 1.0 / math.sqrt(D)):
            raise UnsupportedOpError(
                f"{n.where()}: ring_attention uses scale 1/sqrt(head_dim), got {scale}",
                hint="leave scale=None under ContextParallel",
            )
        return tr.emit(
            n,
            "ring_attention",
            {**dims, **region[1].options},
            {"q": q, "k": k, "v": v},
            q.shape,
            Layout("shard", 2, causal),
        )
    lay = tr.layout_in(q, n) or REPLICATE
    if lay.kind == "rows" or (lay.kind == "shard" and lay.dim >= 2):
        as_dim = as_dim_shard(q.shape, lay, tr.world)
        lay = as_dim if as_dim is not None and as_dim.dim < 2 else REPLICATE
    params = {**dims, "scale": scale, "layout": lay.to_json()}
    return tr.emit(n, "attention", params, {"q": q, "k": k, "v": v}, q.shape, lay)
