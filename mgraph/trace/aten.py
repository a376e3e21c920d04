"""ATen op -> mgraph op for data movement and the big compute: views, linears, attention.

Pattern fusion happens here: a planned linear becomes a fused compute+collective op
(allgather_gemm, gemm_allreduce, gemm_reduce_scatter), attention under ContextParallel becomes
ring_attention. Elementwise math, norms and reductions are in pointwise.py.
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import ShapeError, UnsupportedOpError
from ..layout import REPLICATE, ROWS, Layout, flat_shape
from ..plans import ColwiseParallel, RowwiseParallel, SequenceParallel, Shard
from .capture import CNode
from .mapping import BINARY, UNARY, VIEWS, handles, token_sharded, whole_rows
from .opgraph import Value
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
    x = tr.tensor(n, n.args[0], "input")
    if (x.encoding or x.root().encoding) and n.dtype != torch.bool:
        raise UnsupportedOpError(
            f"{n.where()}: casts the boolean input {x.root().name!r}; a boolean program input "
            "can only be an attention mask",
            hint="pass the float tensor as the input instead",
        )
    return x


@handles(*(v for v in VIEWS if v != "expand"), "t", "transpose", "permute", "swapaxes")
def _view(tr: Tracer, n: CNode) -> Any:
    x = tr.tensor(n, n.args[0], "input")
    nd = len(x.shape)
    if n.op in VIEWS:  # expand (a copy) is a relayout step of its own: slicing.py
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


# Wide GEMM tasks for traced linears on one GPU (bench_layer --gemm-tiles, benchmarks/NOTES.md
# v14): a 128 x 1024 task (4 kernel blocks, run one after another by the dynamic GEMM body) pays
# the per-task costs once for 4 blocks; in the Llama layer its blocks ran 49 us against 55 at
# K=4096. It is chosen only where the op still gives every SM a task (a phase with fewer tasks
# than SMs would idle the rest) and its columns split into whole wide tasks (no short block
# that a TMA reduce-add could not take). Several GPUs keep the op's default tile: not measured.
_WIDE_TILE = [128, 1024]


def _default_tile(tr: Tracer, M: int, N: int, options: dict) -> dict:
    from ..hardware import H200

    if "tile" in options or tr.world != 1 or N % _WIDE_TILE[1]:
        return {}
    tasks = -(-M // _WIDE_TILE[0]) * (N // _WIDE_TILE[1])
    return {"tile": list(_WIDE_TILE)} if tasks >= H200.sms else {}


@handles("linear", "matmul", "mm", "addmm")
def _linear(tr: Tracer, n: CNode) -> Any:
    """x @ W.T + b (linear), x @ W (matmul, mm) and b + x @ W (addmm: GPT-2's Conv1D, whose
    weight is [in, out]) with W a 2-D parameter; only linear takes a plan style."""
    if n.op == "addmm":
        if n.arg(3, "beta", 1) != 1 or n.arg(4, "alpha", 1) != 1:
            raise UnsupportedOpError(f"{n.where()}: addmm with beta or alpha other than 1")
        x = tr.tensor(n, n.arg(1, "mat1"), "input")
        wc = n.arg(2, "mat2")
    else:
        x = tr.tensor(n, n.args[0], "input")
        wc = n.arg(1, "weight" if n.op == "linear" else "other")
    if not isinstance(wc, CNode) or wc.op != "param" or len(wc.shape) != 2:
        raise UnsupportedOpError(
            f"{n.where()}: a product of two activations is not supported",
            hint="matmuls multiply by a 2-D parameter (nn.Linear); attention uses "
            "F.scaled_dot_product_attention, or is written matmul(q, k^T), softmax, "
            "matmul(weights, v) with weights used nowhere else (transformers' eager attention)",
        )
    N = wc.shape[0] if n.op == "linear" else wc.shape[1]
    path = n.path
    style = tr.plan.get(path) if n.op == "linear" else None
    if N == 1 and style is None:
        out = _dot_rows(tr, n, x, wc)
    else:
        out = _product(tr, n, x, wc, style, path)
    bias = n.arg(2, "bias") if n.op == "linear" else n.arg(0, "self") if n.op == "addmm" else None
    if bias is None:
        return out
    out_shape = tuple(x.shape[:-1]) + (N,)
    if not isinstance(bias, CNode) or bias.op != "param" or tuple(bias.shape) != (N,):
        raise UnsupportedOpError(
            f"{n.where()}: the bias added to the product must be a parameter of shape [{N}]"
        )
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


def _dot_rows(tr: Tracer, n: CNode, x: Value, wc: CNode) -> Value:
    """A product with one output column (a gate: Qwen2-MoE's ``shared_expert_gate``, a value
    head) as a row sum of ``x * w``: its GEMM would have 1-element rows, which TMA cannot
    address (16-byte rows), and it is memory-bound anyway."""
    K = x.shape[-1]
    w = tr.param(wc) if n.op == "linear" else tr.param(wc, "t")  # [1, K] either way
    w = tr.relayout(n, w, ("view", (K,)), shape=(K,), name=f"{n.name}_row")
    lay = whole_rows(tr, x, n)
    rows, cols = flat_shape(x.shape)
    common = {"rows": rows, "cols": cols, "shape": list(x.shape), "layout": lay.to_json()}
    prod = tr.emit(n, "elementwise", {**common, "fn": "mul", "other": "row"}, {"x": x, "y": w},
                   x.shape, lay, name=f"{n.name}_terms")
    kept = tuple(x.shape[:-1]) + (1,)
    return tr.emit(n, "row_reduce", {**common, "fn": "sum"}, {"x": prod}, kept, lay)


def _product(tr: Tracer, n: CNode, x: Value, wc: CNode, style: Any, path: str) -> Value:
    """x @ W (W.T for linear) as a matmul, or the fused op of the linear's plan style."""
    if n.op == "linear":
        N, K = wc.shape
        w = tr.param(wc, "t")
    else:
        K, N = wc.shape
        w = tr.param(wc)
    M = flat_shape(x.shape)[0]
    out_shape = tuple(x.shape[:-1]) + (N,)
    where = f"plan {path!r} {type(style).__name__}"
    dims = {"M": M, "N": N, "K": K}
    options = style.options if style is not None else {}
    dims.update(_default_tile(tr, M, N, options))
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
    return out


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


# attention (masks, grouped-query heads) maps in attention_map.py
