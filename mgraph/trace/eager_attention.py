"""Attention written out by hand, as transformers' ``eager_attention_forward`` writes it (the
attention a decoder layer built from a config uses unless ``attn_implementation="sdpa"``):

    w = torch.matmul(q, k.transpose(2, 3)) * scaling      # or / sqrt(d), or no scale
    w = torch.tanh(w / softcap) * softcap                 # optional (Gemma2), a number
    w = w + attention_mask                                # optional, additive
    w = softmax(w, dim=-1, dtype=torch.float32).to(q.dtype)
    w = dropout(w, p=0.0)                                 # optional, identity at eval
    o = torch.matmul(w, v)

The chain becomes ONE ``attention`` node (attention_map.attention), the same as SDPA's: mgraph
multiplies activations only inside attention. The chain is found before the Tracer emits
anything (``find``), so its inner nodes (the transpose of k, the score matrix, the softmax)
never become tasks; its matmul of the weights with v is where attention is emitted. A chain
whose intermediate values are used elsewhere (attention weights returned to the caller, e.g.
``output_attentions=True``) is not this pattern, and its first matmul stays an
UnsupportedOpError.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import UnsupportedOpError
from .capture import Captured, CNode
from .opgraph import Value
from .tracer import Tracer

__all__ = ["EagerAttention", "find", "emit"]

_PASS_THROUGH = {"to", "_to_copy", "type_as", "alias", "contiguous", "clone", "detach", "float"}


@dataclass(eq=False)
class EagerAttention:
    """One matched chain: its operands (captured nodes) and what it folds into the attention."""

    q: CNode
    k: CNode
    v: CNode
    mask: Any  # the additive mask operand (a CNode), or None
    scale: float
    nodes: list[CNode]  # every node of the chain but the last matmul (never emitted)
    softcap: float = 0.0  # Gemma2's soft-capping of the scaled scores; 0: none


def find(cap: Captured) -> dict[CNode, EagerAttention]:
    """The eager attention chains of ``cap``, keyed by their final matmul (``weights @ v``)."""
    outputs = set(cap.outputs)
    found: dict[CNode, EagerAttention] = {}
    for n in cap.nodes:
        if n.op == "matmul" and (match := _match(n, outputs)) is not None:
            found[match[0]] = match[1]
    return found


def emit(tr: Tracer, n: CNode, match: EagerAttention) -> Value:
    """The attention node of a matched chain, emitted at its final matmul ``n``."""
    from .attention_map import attention

    if isinstance(match.mask, CNode) and match.mask.dtype == torch.bool:
        # SDPA reads a boolean mask as "attend where True"; adding one to the scores adds 1.0
        raise UnsupportedOpError(
            f"{n.where()}: hand-written attention adds the boolean tensor "
            f"{match.mask.name!r} to its scores (+1 where True), which is not a mask",
            hint="add an additive float mask (0 = attend, -inf = hidden), or pass the boolean "
            "mask to F.scaled_dot_product_attention (attn_implementation='sdpa')",
        )

    q, k, v = (
        tr.tensor(n, c, what)
        for c, what in ((match.q, "query"), (match.k, "key"), (match.v, "value"))
    )
    return attention(tr, n, q, k, v, match.mask, causal=False, scale=match.scale,
                     softcap=match.softcap)


def _live_users(n: CNode, outputs: set) -> list[CNode]:
    """Users that compute something (export adds ``_assert_tensor_metadata`` checks, which
    have no users of their own)."""
    return [u for u in n.users if u.users or u in outputs]


def _last_two_swapped(t: CNode) -> bool:
    if t.shape is None or len(t.shape) != 4:
        return False
    if t.op in ("transpose", "swapaxes"):
        return {t.arg(1, "dim0") % 4, t.arg(2, "dim1") % 4} == {2, 3}
    if t.op == "permute":
        return [d % 4 for d in t.arg(1, "dims")] == [0, 1, 3, 2]
    return False


def _number(x: Any) -> float | None:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else None


def _match(first: CNode, outputs: set) -> tuple[CNode, EagerAttention] | None:
    q, kt = first.args[0], first.args[1]
    if not (isinstance(q, CNode) and isinstance(kt, CNode) and _last_two_swapped(kt)):
        return None
    if q.shape is None or len(q.shape) != 4:
        return None
    chain = [first]
    if len(_live_users(kt, outputs)) == 1:  # the transposed k is read by the score matmul only
        chain.insert(0, kt)
    scale, mask, node, cap = 1.0, None, first, 0.0
    # scale, then soft-capping (divide, tanh, multiply back), then mask, then softmax, then
    # pass-through ops, then the matmul
    stage = "scale"
    while True:
        users = _live_users(node, outputs)
        if len(users) != 1 or node in outputs:
            return None
        u = users[0]
        other = [a for a in u.args[:2] if a is not node]
        if stage == "scale" and u.op in ("mul", "div") and len(other) == 1:
            factor = _number(other[0])
            if factor is None or factor == 0:
                return None
            scale = scale * factor if u.op == "mul" else scale / factor
            stage = "mask"
        elif stage == "mask" and u.op == "div" and len(other) == 1 and u.args[0] is node:
            cap = _number(other[0])  # soft-capping: then tanh, then times the same number
            if cap is None or cap <= 0 or not math.isfinite(cap):
                return None
            stage = "tanh"
        elif stage == "tanh" and u.op == "tanh":
            stage = "uncap"
        elif stage == "uncap" and u.op == "mul" and len(other) == 1:
            if _number(other[0]) != cap:
                return None
            stage = "capped"
        elif stage in ("scale", "mask", "capped") and u.op == "add" and len(other) == 1:
            if u.arg(2, "alpha", 1) != 1 or not isinstance(other[0], CNode):
                return None
            mask, stage = other[0], "softmax"
        elif stage in ("scale", "mask", "capped", "softmax") and u.op in ("softmax", "_softmax"):
            if u.arg(1, "dim") % 4 != 3:
                return None
            stage = "after"
        elif stage == "after" and u.op in _PASS_THROUGH:
            pass
        elif stage == "after" and u.op in ("dropout", "feature_dropout"):
            if u.arg(1, "p", 0.5) and u.arg(2, "train", True):
                return None  # random at run time: left to the dropout handler's error
        elif stage == "after" and u.op == "matmul" and u.args[0] is node:
            v = u.args[1]
            if not isinstance(v, CNode) or u.shape is None or len(u.shape) != 4:
                return None
            if not math.isfinite(scale):
                return None
            return u, EagerAttention(q, kt.args[0], v, mask, scale, chain, cap)
        else:
            return None
        chain.append(u)
        node = u

