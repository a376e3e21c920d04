"""``F.scaled_dot_product_attention`` -> ``attention`` (or ``ring_attention`` under
ContextParallel), with the forms model code writes:

- grouped-query attention: ``enable_gqa=True`` with fewer KV heads than query heads repeats each
  KV head in a relayout (what ``repeat_kv`` does by hand, which traces as expand + reshape);
- masks: ``attn_mask`` boolean (True = attend) or additive, of any shape that broadcasts to
  ``[B, H, S, S]``. A mask computed at trace time (``torch.triu``/``arange``/``ones`` on shapes)
  is folded: one equal to the causal mask becomes ``is_causal`` (blocks above the diagonal are
  skipped, and ring attention can zigzag), any other is a constant additive mask. A boolean
  program input is taken as an attention mask: the Program turns it into the additive form on
  the way in (``Value.encoding``), and no other op may read it.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ..errors import UnsupportedOpError
from ..graph import torch_dtype
from ..layout import REPLICATE, Layout, as_dim_shard
from ..plans import ContextParallel
from .capture import CNode
from .fold import Folded
from .mapping import handles
from .opgraph import Value
from .tracer import Tracer

__all__ = ["additive_mask"]


def additive_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """SDPA's boolean mask (True = attend) as the additive one the attention op reads."""
    return torch.zeros(mask.shape, dtype=dtype).masked_fill(~mask, float("-inf"))


def _repeat_heads(tr: Tracer, n: CNode, x: Value, heads: int, what: str) -> Value:
    B, Hkv, S, D = x.shape
    if heads % Hkv:
        raise UnsupportedOpError(
            f"{n.where()}: {heads} query heads are not a multiple of {Hkv} {what} heads",
            hint="grouped-query attention shares each KV head among heads / kv_heads queries",
        )
    steps = [
        ("view", (B, Hkv, 1, S, D)),
        ("expand", (B, Hkv, heads // Hkv, S, D)),
        ("view", (B, heads, S, D)),
    ]
    return tr.relayout(n, x, steps, shape=(B, heads, S, D), name=f"{n.name}_{what}_rep")


def _is_causal(mask: torch.Tensor, S: int) -> bool:
    """Whether a boolean (True = attend) or additive mask is exactly the causal one."""
    causal = torch.ones(S, S, dtype=torch.bool).tril()
    if mask.dtype == torch.bool:
        return bool((mask == causal).all())
    # transformers' eager masks hide with the dtype's lowest value rather than -inf
    hidden = mask[~causal.expand_as(mask)]
    lowest = torch.finfo(mask.dtype).min
    return bool(
        ((mask == 0) == causal).all() and (torch.isneginf(hidden) | (hidden == lowest)).all()
    )


def _mask(tr: Tracer, n: CNode, arg: Any, q_shape: tuple[int, ...]) -> tuple[Value | None, bool]:
    """(the additive mask as a Value, or None; whether it is the causal mask)."""
    B, H, S, _ = q_shape
    folded = tr.folded(arg)
    if folded is not None:
        if folded.shape[-2:] == (S, S) and _is_causal(folded, S):
            return None, True
        t = folded
        if t.dtype == torch.bool:
            t = additive_mask(t, torch_dtype(tr.dtype))
        v = tr.constant(arg, Folded(t.to(torch_dtype(tr.dtype))))
    else:
        v = tr.tensor(n, arg, "attn_mask")
    shape = (1,) * (4 - len(v.shape)) + tuple(v.shape)
    if (
        len(shape) != 4
        or shape[3] != S
        or any(m not in (1, full) for m, full in zip(shape[:3], (B, H, S), strict=True))
    ):
        raise UnsupportedOpError(
            f"{n.where()}: attn_mask of shape {list(v.shape)} does not broadcast to "
            f"[B, H, S, S] = {[B, H, S, S]} over its batch, heads and queries",
            hint="give the mask a key dim of S (e.g. [B, 1, 1, S] for padding, [S, S] causal)",
        )
    if shape != v.shape:
        v = tr.relayout(n, v, ("view", shape), shape=shape, name=f"{n.name}_mask4d")
    return v, False


@handles("scaled_dot_product_attention")
def _sdpa(tr: Tracer, n: CNode) -> Any:
    q, k, v = (tr.tensor(n, n.args[i], name) for i, name in enumerate(("query", "key", "value")))
    mask_arg, dropout = n.arg(3, "attn_mask"), n.arg(4, "dropout_p", 0.0)
    causal, scale = bool(n.arg(5, "is_causal", False)), n.arg(6, "scale")
    if dropout:
        raise UnsupportedOpError(
            f"{n.where()}: attention dropout (dropout_p={dropout}) is random",
            hint="call model.eval() and pass dropout_p=0.0 outside training",
        )
    gqa = bool(n.kwargs.get("enable_gqa"))
    return attention(tr, n, q, k, v, mask_arg, causal=causal, scale=scale, gqa=gqa)


def attention(
    tr: Tracer,
    n: CNode,
    q: Value,
    k: Value,
    v: Value,
    mask_arg: Any,
    *,
    causal: bool,
    scale: float | None,
    gqa: bool = False,
) -> Value:
    """``softmax(q k^T * scale + mask) v`` as an attention (or ring_attention) node; ``scale``
    None is 1/sqrt(head_dim), as in SDPA."""
    if len(q.shape) == 4 and gqa and k.shape[1] != q.shape[1]:
        k = _repeat_heads(tr, n, k, q.shape[1], "k")
        v = _repeat_heads(tr, n, v, q.shape[1], "v")
    if not (len(q.shape) == 4 and q.shape == k.shape == v.shape):
        raise UnsupportedOpError(
            f"{n.where()}: q, k, v must be [batch, heads, seq, head_dim] of one shape "
            f"(got {list(q.shape)}, {list(k.shape)}, {list(v.shape)})",
            hint="self-attention; for fewer KV heads pass enable_gqa=True or repeat them "
            "(repeat_kv)",
        )
    mask = None
    if mask_arg is not None:
        mask, is_causal = _mask(tr, n, mask_arg, q.shape)
        causal = causal or is_causal
    B, H, S, D = q.shape
    dims = {"B": B, "H": H, "S": S, "D": D, "causal": causal}
    region = tr.region(n)
    if region is not None and isinstance(region[1], ContextParallel):
        if mask is not None:
            raise UnsupportedOpError(
                f"{n.where()}: ring_attention (ContextParallel) takes no attn_mask other than "
                "the causal one",
                hint="use is_causal=True (or a causal mask built from torch.triu/arange), or "
                "drop ContextParallel for this module",
            )
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
    inputs = {"q": q, "k": k, "v": v}
    if mask is not None:
        params["mask_shape"] = list(mask.shape)
        inputs["mask"] = mask
    return tr.emit(n, "attention", params, inputs, q.shape, lay)
