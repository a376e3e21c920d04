"""``F.scaled_dot_product_attention`` -> ``attention`` (or ``ring_attention`` under
ContextParallel), with the forms model code writes:

- grouped-query attention: ``enable_gqa=True`` with fewer KV heads than query heads, and
  transformers' ``repeat_kv`` (``x[:, :, None].expand(B, Hkv, rep, S, D).reshape(B, H, S, D)``,
  read by this attention only) give the op ``kv_heads``: k and v keep their Hkv heads, each
  shared by H / Hkv query heads, so nothing repeats them and a ring moves Hkv / H of the bytes,
  also with heads sharded over more ranks than there are KV heads (each rank reads the KV heads
  its query heads share). ``repeat_kv``'s result read by another op too is repeated as written;
- masks: ``attn_mask`` boolean (True = attend) or additive, of any shape that broadcasts to
  ``[B, H, S, S]``. A mask computed at trace time (``torch.triu``/``arange``/``ones`` on shapes)
  is folded: one equal to the causal mask becomes ``is_causal`` (blocks above the diagonal are
  skipped, and ring attention can zigzag), any other is a constant mask, ``mask_kind="boolean"``
  (1 = attend, 0 = hidden) for a boolean one and additive otherwise. A boolean program input is
  taken as an attention mask: the Program turns it into the additive form on the way in
  (``Value.encoding``; masks.py combines masks in that form), and no other op may read it.

After tracing, :func:`token_major_attention` gives a local attention the projections' layout:
a head split (``x.view(B, S, heads, D).transpose(1, 2)`` of a ``[B, S, heads * D]`` tensor) that
it alone reads, and an output merge (``o.transpose(1, 2).reshape(B, S, H * D)``) that alone
reads it, are taken out and the op reads and writes the token-major tensors in place (option
``token_major``), where the rank holds the same elements either way. mg.compile runs it after
fuse_pointwise (mgraph/program.py).

A query row whose every key is hidden (left padding) is 0, as SDPA returns it (the op's
finalize step: each chain's last ``attn_block`` by default, ``attn_finalize`` with
``inline_finalize=False``); an eager mask that hides with the dtype's lowest value instead
hides nothing in such a row (all its scores are equal), in eager torch as in the op.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ..errors import UnsupportedOpError
from ..graph import torch_dtype
from ..layout import REPLICATE, Layout, as_dim_shard, layout_runs
from ..ops.attention import tm_layout
from ..plans import ContextParallel
from .capture import CNode
from .fold import Folded
from .mapping import handles
from .opgraph import OpGraph, OpNode, Value
from .tracer import Tracer

__all__ = ["additive_mask", "token_major_attention"]


def additive_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """SDPA's boolean mask (True = attend) as the additive one the attention op reads."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, float("-inf"))


def _is_causal(mask: torch.Tensor, S: int) -> bool:
    """Whether a boolean (True = attend) or additive mask is exactly the causal one."""
    # At S = 4096 these are passes over 16M elements in every compile: torch.equal compares
    # without a temporary, and no boolean indexing (which gathered the hidden half: ~0.2 s).
    # (on the mask's device: a module traced on a GPU folds its masks there)
    causal = torch.ones(S, S, dtype=torch.bool, device=mask.device).tril_().expand_as(mask)
    if mask.dtype == torch.bool:
        return torch.equal(mask, causal)
    visible = mask == 0
    if not torch.equal(visible, causal):
        return False
    # every element not visible (above the diagonal, by the check above) is hidden: -inf, or
    # the dtype's lowest value, with which transformers' eager masks hide
    lowest = torch.finfo(mask.dtype).min
    return bool((visible | torch.isneginf(mask) | (mask == lowest)).all())


def _mask(
    tr: Tracer, n: CNode, arg: Any, q_shape: tuple[int, ...]
) -> tuple[Value | None, bool, str]:
    """(the mask as a Value, or None; whether it is the causal mask; the op's ``mask_kind``)."""
    B, H, S, _ = q_shape
    kind = "additive"
    folded = tr.folded(arg)
    if folded is not None:
        if folded.shape[-2:] == (S, S) and _is_causal(folded, S):
            return None, True, kind
        if folded.dtype == torch.bool:
            kind = "boolean"  # as SDPA reads it, 1 = attend: no -inf in the constant
        v = tr.constant(arg, Folded(folded.to(torch_dtype(tr.dtype))))
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
    return v, False, kind


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
    softcap: float = 0.0,
) -> Value:
    """``softmax(q k^T * scale + mask) v`` as an attention (or ring_attention) node; ``scale``
    None is 1/sqrt(head_dim), as in SDPA; ``softcap`` > 0 caps the scaled scores first
    (Gemma2's ``softcap * tanh(scores / softcap)``; not under ContextParallel)."""
    region = tr.region(n)
    ring = region is not None and isinstance(region[1], ContextParallel)
    lay = REPLICATE
    if len(q.shape) == 4 and not ring:
        lay = tr.layout_in(q, n) or REPLICATE
        if lay.kind == "rows" or (lay.kind == "shard" and lay.dim >= 2):
            as_dim = as_dim_shard(q.shape, lay, tr.world)
            lay = as_dim if as_dim is not None and as_dim.dim < 2 else REPLICATE
    if len(q.shape) == 4 and len(k.shape) == 4 and k.shape[1] != q.shape[1] and gqa:
        if q.shape[1] % k.shape[1]:
            raise UnsupportedOpError(
                f"{n.where()}: {q.shape[1]} query heads are not a multiple of {k.shape[1]} "
                "KV heads",
                hint="grouped-query attention shares each KV head among heads / kv_heads queries",
            )
    elif len(q.shape) == 4 and q.shape == k.shape == v.shape:
        k, v = _unrepeat_kv(tr, n, k, v)
        gqa = k.shape[1] != q.shape[1]
    if not (
        len(q.shape) == 4
        and k.shape == v.shape
        and len(k.shape) == 4
        and (k.shape[0], *k.shape[2:]) == (q.shape[0], *q.shape[2:])
        and (k.shape[1] == q.shape[1] or gqa)
    ):
        raise UnsupportedOpError(
            f"{n.where()}: q, k, v must be [batch, heads, seq, head_dim] of one shape "
            f"(got {list(q.shape)}, {list(k.shape)}, {list(v.shape)})",
            hint="self-attention; for fewer KV heads pass enable_gqa=True or repeat them "
            "(repeat_kv)",
        )
    mask, mask_kind = None, "additive"
    if mask_arg is not None:
        mask, is_causal, mask_kind = _mask(tr, n, mask_arg, q.shape)
        causal = causal or is_causal
    B, H, S, D = q.shape
    dims: dict[str, Any] = {"B": B, "H": H, "S": S, "D": D, "causal": causal}
    if k.shape[1] != H:
        dims["kv_heads"] = k.shape[1]
    if ring:
        assert region is not None
        if softcap:
            raise UnsupportedOpError(
                f"{n.where()}: ring_attention (ContextParallel) has no score soft-capping",
                hint="drop ContextParallel for this module (the attention op caps the scores)",
            )
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
    params = {**dims, "scale": scale, "layout": lay.to_json()}
    if softcap:
        params["softcap"] = float(softcap)
    inputs = {"q": q, "k": k, "v": v}
    if mask is not None:
        params["mask_shape"] = list(mask.shape)
        inputs["mask"] = mask
        if mask_kind != "additive":
            params["mask_kind"] = mask_kind
    return tr.emit(n, "attention", params, inputs, q.shape, lay)


# -- transformers' repeat_kv, undone ----------------------------------------------------------
def _unrepeat_kv(tr: Tracer, n: CNode, k: Value, v: Value) -> tuple[Value, Value]:
    """k and v before transformers' ``repeat_kv`` when both are its result and read by this
    attention only: their repeat relayouts are taken out of the graph. Else k and v as
    given."""
    found = [_repeat_of(tr, x) for x in (k, v)]
    if any(f is None for f in found):
        return k, v
    (k_node, k_base), (v_node, v_base) = found  # type: ignore[misc]
    if k_base.shape != v_base.shape:
        return k, v
    if not all(_only_read_by(tr, n, node) for node in (k_node, v_node)):
        return k, v
    for node in (k_node, v_node):
        del tr.og.nodes[next(i for i, m in enumerate(tr.og.nodes) if m is node)]
        del tr.relayouts[node.outputs["out"].name]
    return k_base, v_base


def _repeat_of(tr: Tracer, x: Value) -> tuple[OpNode, Value] | None:
    """(the relayout node, its [B, Hkv, S, D] source) when ``x`` [B, H, S, D] is that source
    repeated head-wise as ``repeat_kv`` writes it: a view to [B, Hkv, 1, S, D], an expand to
    [B, Hkv, H / Hkv, S, D] and a view back to 4-D (the views may be free aliases)."""
    out = x
    while out.name not in tr.relayouts and out.alias_of is not None:
        out = out.alias_of
    node = tr.relayouts.get(out.name)
    if node is None or node.outputs["out"] is not out or len(x.shape) != 4:
        return None
    B, H, S, D = x.shape
    steps = [(kind, tuple(arg)) for kind, arg in node.params["steps"]]
    source = node.inputs["x"]
    in_shape = tuple(node.params["in_shape"])
    if steps and steps[-1] == ("view", x.shape):
        steps.pop()
    if len(in_shape) == 4 and steps and steps[0][0] == "view":
        in_shape = steps.pop(0)[1]
    if len(in_shape) != 5 or len(steps) != 1 or steps[0][0] != "expand":
        return None
    b, kv_heads, one, s, d = in_shape
    rep = steps[0][1]
    if (b, one, s, d) != (B, 1, S, D) or rep != (B, kv_heads, H // kv_heads, S, D):
        return None
    if kv_heads * rep[2] != H or out.shape not in (x.shape, rep):
        return None
    if len(source.shape) == 5:  # the free [:, :, None] alias: take what it views
        if source.alias_of is not None and source.alias_of.shape == (B, kv_heads, S, D):
            source = source.alias_of
        else:
            return None
    return node, source


def _only_read_by(tr: Tracer, n: CNode, node: OpNode) -> bool:
    """Whether the result of relayout ``node`` (and every alias of it) is read by captured node
    ``n`` alone: no op emitted so far reads it, and every path of captured users from a node
    holding it leads to ``n`` (hand-written attention's transpose and score matmul, absorbed
    into ``n``'s attention node, may lie between), never to a program output."""
    out = node.outputs["out"]

    def holds(x: Any) -> bool:
        if isinstance(x, (list, tuple)):
            return any(holds(y) for y in x)
        while isinstance(x, Value):
            if x is out:
                return True
            x = x.alias_of
        return False

    for other in tr.og.nodes:
        if other is not node and any(holds(x) for x in other.inputs.values()):
            return False
    outputs = set(tr.cap.outputs)
    seen: dict[CNode, bool] = {}

    def feeds_only_n(c: CNode) -> bool:
        if c is n:
            return True
        if c in seen:
            return seen[c]
        seen[c] = False  # a cycle cannot occur in a captured graph; stay conservative
        live = [u for u in c.users if u.users or u in outputs]
        seen[c] = c not in outputs and bool(live) and all(feeds_only_n(u) for u in live)
        return seen[c]

    holders = [c for c, x in tr.env.items() if holds(x)]
    return bool(holders) and all(feeds_only_n(c) for c in holders)


# -- token-major q, k, v and out ---------------------------------------------------------------
def token_major_attention(og: OpGraph) -> OpGraph:
    """``og`` with each local attention node reading the ``[B, S, heads * D]`` source of a head
    split relayout (``view(B, S, heads, D)`` then ``permute(0, 2, 1, 3)``) read by that node
    alone, in place of the split, and writing the ``[B, S, H * D]`` result of an output merge
    relayout (``permute(0, 2, 1, 3)`` then ``view(B, S, H * D)``) that alone reads its output,
    in place of the merge (option ``token_major``); the folded relayouts are dropped. A tensor
    is folded only where each rank holds the same elements in both forms (heads or batches
    sharded as the op's ``layout``), so no copy replaces the relayout; any other form keeps
    its relayout. The returned OpGraph shares ``og``'s values; ``og`` is left as it was."""
    from collections import Counter
    from dataclasses import replace

    reads: Counter[str] = Counter()
    readers: dict[str, list[OpNode]] = {}
    for node in og.nodes:
        for v in node.inputs.values():
            reads[v.root().name] += 1
            readers.setdefault(v.name, []).append(node)
    for v in og.outputs:
        reads[v.root().name] += 2  # a program output is kept
    made = {node.outputs["out"].name: node for node in og.nodes if node.op == "relayout"}
    world = og.topology.world_size
    dropped: set[str] = set()
    swapped: dict[str, OpNode] = {}
    for node in og.nodes:
        if node.op != "attention" or node.params.get("token_major"):
            continue
        p = node.params
        B, H, S, D = (int(p[d]) for d in ("B", "H", "S", "D"))
        heads = {"q": H, "k": int(p.get("kv_heads", H)), "v": int(p.get("kv_heads", H)), "out": H}
        lay = Layout.from_json(p.get("layout"))

        inputs, token_major = dict(node.inputs), []
        for name in ("q", "k", "v"):
            x = node.inputs[name]
            split = made.get(x.name)
            if split is None or reads[x.name] != 1 or split.name in dropped:
                continue
            source = split.inputs["x"]
            want = (B, S, heads[name] * D)
            steps = [["view", [B, S, heads[name], D]], ["permute", [0, 2, 1, 3]]]
            if (
                tuple(split.params["in_shape"]) == want == tuple(source.shape)
                and split.params["steps"] == steps
                and _same_elements(source, want, lay, world)
            ):
                inputs[name] = source
                token_major.append(name)
                dropped.add(split.name)
        outputs = dict(node.outputs)
        out = node.outputs["out"]
        merge = next(iter(readers.get(out.name, [])), None)
        if (
            merge is not None
            and merge.op == "relayout"
            and reads[out.name] == 1
            and list(merge.params["in_shape"]) == [B, H, S, D]
            and merge.params["steps"] == [["permute", [0, 2, 1, 3]], ["view", [B, S, H * D]]]
            and _same_elements(merge.outputs["out"], (B, S, H * D), lay, world)
        ):
            outputs["out"] = merge.outputs["out"]
            token_major.append("out")
            dropped.add(merge.name)
        if token_major:
            params = {**p, "token_major": sorted(token_major)}
            swapped[node.name] = replace(node, params=params, inputs=inputs, outputs=outputs)
    if not swapped:
        return og
    nodes = [swapped.get(n.name, n) for n in og.nodes if n.name not in dropped]
    return replace(og, nodes=nodes)


def _same_elements(v: Value, shape: tuple[int, ...], lay: Layout, world: int) -> bool:
    """Whether every rank holds the same elements of ``v`` as of the attention's token-major
    tensor of ``shape`` under the op's (head-major) ``lay`` (a free value is bound as the op
    asks)."""
    if v.layout is None:
        return True
    tm = tm_layout(lay)
    return all(
        layout_runs(v.shape, v.layout, r, world) == layout_runs(shape, tm, r, world)
        for r in range(world)
    )
