"""Local attention: ``out = softmax(q k^T * scale) v`` per (batch, head), no communication
(``softcap`` > 0: the scores soft-capped first, ``softcap * tanh(scores / softcap)``, as
Gemma2 writes it; those tasks take the bodies' pointer path on a GPU).

Every rank computes the (batch, head) pairs it holds: heads sharded (the attention between a
column-parallel QKV projection and a row-parallel output projection), batches sharded, or all of
them (replicated). Sequence-sharded attention is ring_attention. The math is ring attention's
online softmax on the same kinds: ``attn_block`` folds one KV block into the fp32 state
(acc, ml), chained per q block; the chain's last attn_block (or, with
``inline_finalize=False``, an ``attn_finalize`` task) writes ``acc / l`` (0 in a query row whose
every key the mask hides, as SDPA returns it). Causal masks skip the blocks above the diagonal
and mask the diagonal one.

Masks: option ``mask_shape`` is the 4-D shape ``[Bm, Hm, Qm, S]`` of a mask (input ``mask``, in
the compute dtype) broadcast over the batch (Bm = 1), heads (Hm = 1) or queries (Qm = 1), as
SDPA's ``attn_mask`` broadcasts. ``mask_kind="additive"`` (the default): added to the scores,
-inf where a key is hidden. ``mask_kind="boolean"``: nonzero where a key is shown, 0 where it is
hidden (SDPA's boolean mask, as ``mask.to(dtype)``). Every rank holds it whole; each
``attn_block`` reads its tile of it (its last read). The tracer gives a boolean SDPA mask
folded at trace time as ``mask_kind="boolean"``, and a boolean program input in the additive
form, which the Program makes on the way in (mgraph/trace/attention_map.py).

Grouped-query attention: option ``kv_heads`` (dividing H) gives k and v that many heads, each
shared by H / kv_heads query heads (SDPA's ``enable_gqa``); the q blocks of a group read the
same KV rows. Heads sharded, a rank binds the KV heads its query heads share (``kv_box``), so
kv_heads need not divide by the world size: at 16 ranks, 32 heads and 8 KV heads, two ranks
read each KV head and nothing repeats it. ``kv_block``: keys per ``attn_block`` task; by default the largest multiple of
the q block dividing S, at most 8192 (ring_attention's ``default_kv_block``: every task reads
and writes the fp32 state once, so fewer, longer tasks pay that less often per key; a q block's
tasks form a chain, so longer ones take no parallelism away). Under a
causal mask a KV block that straddles the diagonal is masked in the body (which hides the keys
after each query; the Triton body skips the key chunks after the block's last query), and its
cost counts only the pairs it shows; blocks wholly after a q block's last query are not emitted.
``inline_finalize`` (default on): each chain's last attn_block also writes the out rows
(ring_attention's option of that name), and no attn_finalize task is emitted;
``inline_finalize=False`` ends each chain with an attn_finalize task instead.

Token-major tensors: option ``token_major`` names those of q, k, v and out held as
``[B, S, heads * D]`` (the projections' layout: a head is the column range ``h*D .. h*D+D`` of
every token row) rather than ``[B, heads, S, D]``; the others keep the head-major form. A task's
region of a token-major tensor is that head's column range over its block's token rows, a
strided 2-D tile the attn_block bodies read as they read any region (a TMA descriptor's row
stride is the buffer's, heads * D), and the finalize step writes out so, so no relayout splits
heads before the op or merges them after it (mgraph/trace/attention_map.py chooses it).
Heads sharded, a rank holds the column range of its heads; batches sharded, its token rows.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from ..builder import GraphBuilder, edge_tile
from ..errors import ShapeError
from ..graph import Region
from ..kinds import Role, TaskKind
from ..layout import Box, Layout, as_dim_shard, check_layout, layout_pieces
from ..topology import Topology
from .attention_tiles import BIAS_ADD, BIAS_BOOL
from .registry import OpDef
from .ring_attention import KV_KEYS, default_kv_block, repeat_kv

__all__ = ["attention", "tm_layout"]

OP = "attention"
attention = OpDef(OP, dims=("B", "H", "S", "D"), inputs=("q", "k", "v", "mask"), outputs=("out",))
ATTN_BLOCK, ATTN_FINALIZE = TaskKind.ATTN_BLOCK.value, TaskKind.ATTN_FINALIZE.value
MASK_KINDS = {"additive": BIAS_ADD, "boolean": BIAS_BOOL}
TENSORS = ("q", "k", "v", "out")  # the tensors ``token_major`` may name


def _token_major(token_major: Sequence[str] | None) -> frozenset[str]:
    """The tensors held token-major; ShapeError for a name that is not one of TENSORS."""
    names = frozenset(token_major or ())
    bad = sorted(names - set(TENSORS))
    if bad:
        raise ShapeError(
            f"{OP}: token_major names {bad}, not among {list(TENSORS)}",
            hint="token_major lists which of q, k, v, out are [B, S, heads * head_dim]",
        )
    return names


def _shape_of(name: str, B: int, heads: int, S: int, D: int, tm: frozenset[str]) -> tuple:
    """Tensor ``name``'s global shape: [B, S, heads * D] token-major, else [B, heads, S, D]."""
    return (B, S, heads * D) if name in tm else (B, heads, S, D)


def tm_layout(lay: Layout) -> Layout:
    """The token-major ``[B, S, heads * D]`` form of a head-major batch or head shard: batches
    are token rows (dim 0), heads are column ranges (dim 2)."""
    if lay.kind != "shard":
        return lay
    return Layout("shard", 0 if lay.dim == 0 else 2)


def _layout(shape: tuple[int, ...], layout: Sequence | None, world: int) -> Layout | None:
    """The layout as a batch or head shard (a token-row shard of a (1, H, S, D) tensor is one)."""
    return as_dim_shard(shape, Layout.from_json(layout), world)


@attention.shapes
def _shapes(
    topology: Topology,
    B: int,
    H: int,
    S: int,
    D: int,
    block: int = 128,
    layout: Sequence | None = None,
    mask_shape: Sequence[int] | None = None,
    kv_heads: int | None = None,
    kv_block: int | None = None,
    mask_kind: str = "additive",
    token_major: Sequence[str] | None = None,
    softcap: float = 0.0,
    **_: object,
) -> dict[str, tuple]:
    if softcap < 0:  # (its type and finiteness: the registry's option check)
        raise ShapeError(f"{OP}: softcap={softcap!r} must be >= 0 (0: off)",
                         hint="Gemma2's attn_logit_softcapping, e.g. 50.0")
    shape = (B, H, S, D)
    kv = (B, _kv_heads(H, kv_heads), S, D)
    tm = _token_major(token_major)
    out = {
        name: _shape_of(name, B, H if name in ("q", "out") else kv[1], S, D, tm) for name in TENSORS
    }
    if mask_shape is not None:
        out["mask"] = _mask_shape(B, H, S, mask_shape)
    if mask_kind not in MASK_KINDS:
        raise ShapeError(
            f"{OP}: mask_kind={mask_kind!r} is not one of {sorted(MASK_KINDS)}",
            hint="additive: -inf where hidden; boolean: nonzero where shown",
        )
    lay = _layout(shape, layout, topology.world_size)
    if lay is None or (lay.kind == "shard" and lay.dim % 4 >= 2):
        lay = Layout.from_json(layout)
        raise ShapeError(
            f"{OP}: q, k, v must be sharded along batch or heads (got {lay.describe()})",
            hint="sequence-sharded attention is ring_attention (ContextParallel)",
        )
    check_layout(shape, lay, topology.world_size, OP, "choose heads divisible by the world size")
    _blocks(S, block, kv_block)
    return out


def _kv_heads(H: int, kv_heads: int | None) -> int:
    if kv_heads is None:
        return H
    if isinstance(kv_heads, bool) or not isinstance(kv_heads, int) or kv_heads <= 0 or H % kv_heads:
        raise ShapeError(
            f"{OP}: kv_heads={kv_heads!r} must be a positive divisor of H={H}",
            hint="grouped-query attention shares each KV head among H / kv_heads query heads",
        )
    return kv_heads


def _blocks(S: int, block: int, kv_block: int | None) -> tuple[int, int]:
    """(q rows, keys) per attn_block task. S need not be a multiple of either: the last query
    block and the last key block of a chain are short (their regions end at S; the bodies take
    their row and key counts from the regions, and mask the rest)."""
    sizes = []
    for name, value in (("block", block), ("kv_block", kv_block)):
        if value is None:  # kv_block: the default, from the q block
            blk = sizes[0]
            if S % blk == 0:
                sizes.append(default_kv_block(S, blk))
            else:  # keys in multiples of the q block (default_kv_block's reason), the last short
                sizes.append(blk * max(1, min(max(KV_KEYS, blk) // blk, -(-S // blk))))
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ShapeError(f"{OP}: {name}={value!r} must be a positive int")
        sizes.append(edge_tile(S, value))
    return sizes[0], sizes[1]


def _mask_shape(B: int, H: int, S: int, mask: Sequence[int]) -> tuple[int, int]:
    """The flat 2-D shape of a ``[Bm, Hm, Qm, S]`` mask; ShapeError for one that does not
    broadcast to ``[B, H, S, S]``."""
    mask = [int(m) for m in mask]
    if (
        len(mask) != 4
        or mask[3] != S
        or any(m not in (1, full) for m, full in zip(mask[:3], (B, H, S), strict=True))
    ):
        raise ShapeError(
            f"{OP}: mask of shape {mask} does not broadcast to [B, H, S, S] = {[B, H, S, S]}",
            hint="each of its first three dims is 1 or the full size, its last is S",
        )
    return (mask[0] * mask[1] * mask[2], S)


@attention.reference
def _reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None = None,
    causal: bool = False,
    scale: float | None = None,
    token_major: Sequence[str] | None = None,
    **params: object,
) -> dict[str, torch.Tensor]:
    tm = _token_major(token_major)
    B, S, D = (int(params[d]) for d in ("B", "S", "D"))  # type: ignore[call-overload]

    def heads_first(x: torch.Tensor, name: str) -> torch.Tensor:
        return x.reshape(B, S, -1, D).transpose(1, 2) if name in tm else x

    q, k, v = heads_first(q, "q"), heads_first(k, "k"), heads_first(v, "v")
    bias = None
    if mask is not None:
        bias = mask.float().reshape(params["mask_shape"])
        if params.get("mask_kind") == "boolean":
            bias = torch.zeros_like(bias).masked_fill(bias == 0, float("-inf"))
        if causal:  # SDPA takes one or the other: fold the causal part into the bias
            S = q.shape[-2]
            hidden = torch.ones(S, S, dtype=torch.bool).triu(1)
            bias = bias.masked_fill(hidden, float("-inf"))
            causal = False
    H = q.shape[1]
    k, v = repeat_kv(k.float(), H), repeat_kv(v.float(), H)
    cap = float(params.get("softcap") or 0.0)
    if cap:  # written out: SDPA has no soft-capping (softcap * tanh(scores / softcap))
        scores = (q.float() @ k.transpose(-1, -2)) * (q.shape[-1] ** -0.5 if scale is None
                                                     else scale)
        scores = cap * torch.tanh(scores / cap)
        if bias is not None:
            scores = scores + bias
        if causal:
            hidden = torch.ones(S, S, dtype=torch.bool).triu(1)
            scores = scores.masked_fill(hidden, float("-inf"))
        out = torch.softmax(scores, dim=-1).nan_to_num(0.0) @ v
    else:
        out = F.scaled_dot_product_attention(
            q.float(), k, v, attn_mask=bias, is_causal=causal, scale=scale
        )
    if "out" in tm:
        out = out.transpose(1, 2).reshape(B, S, -1)
    return {"out": out.to(q.dtype)}


def kv_box(box: Box, H: int, Hkv: int) -> Box:
    """The KV heads a rank holding the query heads of ``box`` (a whole (batch, head) box) reads:
    query head h shares KV head h // (H / Hkv). With heads sharded over more ranks than there
    are KV heads, several ranks read one KV head (each gets its own copy of it), and a rank's
    heads may span two groups; nothing requires kv_heads to divide by the world size."""
    rep = H // Hkv
    (h0, h1) = box[1]
    return (box[0], (h0 // rep, (h1 - 1) // rep + 1), *box[2:])


def _operand(
    b: GraphBuilder,
    name: str,
    rank: int,
    shape: tuple[int, int, int, int],
    own: Box,
    token_major: bool,
) -> Callable[[int, int, int, int], Region]:
    """Tensor ``name`` (head-major ``shape``) bound on ``rank``, as a function of (batch,
    head of its heads, first token, end token) -> the region holding those tokens of that
    head: head-major, rows of the head's S; token-major, the batch's token rows and the head's
    D columns. ``own``: the (batch, head) box the rank holds, every token of it (the op's
    layouts shard batches or heads only)."""
    B, heads, S, D = shape
    role = "output" if name == "out" else "input"
    if token_major:
        (h0, h1) = own[1]
        piece = (own[0], (0, S), (h0 * D, h1 * D))
        buf = b.bound_buffer(name, rank, name, [piece], role=role)

        def token_rows(bi: int, hi: int, t0: int, t1: int) -> Region:
            row = (bi - own[0][0]) * S
            col = (hi - own[1][0]) * D
            return buf.region((row + t0, row + t1), (col, col + D))

        return token_rows
    buf = b.bound_buffer(name, rank, name, [own], role=role)
    per_batch = own[1][1] - own[1][0]

    def head_rows(bi: int, hi: int, t0: int, t1: int) -> Region:
        row = ((bi - own[0][0]) * per_batch + hi - own[1][0]) * S
        return buf.region((row + t0, row + t1))

    return head_rows


@attention.lower
def _lower(
    b: GraphBuilder,
    B: int,
    H: int,
    S: int,
    D: int,
    causal: bool = False,
    scale: float | None = None,
    block: int = 128,
    layout: list | None = None,
    mask_shape: list[int] | None = None,
    kv_heads: int | None = None,
    kv_block: int | None = None,
    mask_kind: str = "additive",
    token_major: list[str] | None = None,
    inline_finalize: bool = True,
    softcap: float = 0.0,
) -> None:
    shape = (B, H, S, D)
    blk, kvb = _blocks(S, block, kv_block)
    Hkv = _kv_heads(H, kv_heads)
    tm = _token_major(token_major)
    heads_of = {"q": H, "k": Hkv, "v": Hkv, "out": H}
    lay = _layout(shape, layout, b.world)
    assert lay is not None
    for name in ("q", "k", "v"):
        b.global_input(name, _shape_of(name, B, heads_of[name], S, D, tm))
    if mask_shape is not None:
        b.global_input("mask", _mask_shape(B, H, S, mask_shape))
    b.global_output("out", _shape_of("out", B, H, S, D, tm))
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    for r in b.topo.ranks:
        # batch and head ranges are whole boxes: no zigzag below dim 2
        box = layout_pieces(shape, lay, r, b.world)[0][0]
        heads = [(bi, hi) for bi in range(*box[0]) for hi in range(*box[1])]
        kv = kv_box(box, H, Hkv)
        boxes = {"q": box, "k": kv, "v": kv, "out": box}
        q, k, v, out = (
            _operand(b, n, r, (B, heads_of[n], S, D), boxes[n], n in tm) for n in TENSORS
        )
        bias = None
        if mask_shape is not None:
            rows = _mask_shape(B, H, S, mask_shape)[0]
            bias = b.bound_buffer("mask", r, "mask", [((0, rows), (0, S))])
        acc = b.buffer("attn_acc", r, len(heads) * S, D, dtype="float32")
        ml = b.buffer("attn_ml", r, len(heads) * S, 2, dtype="float32")
        for group, (bi, hi) in enumerate(heads):  # one (batch, head) per S state rows
            base = group * S
            hk = hi // (H // Hkv)  # its KV head (k and v subtract the rank's first)
            for q0 in range(0, S, blk):
                q1 = min(q0 + blk, S)  # the last block is short where blk does not divide S
                rows = (base + q0, base + q1)
                state = [acc.region(rows), ml.region(rows)]
                if bias is not None:
                    Bm, Hm, Qm, _ = mask_shape
                    m0 = ((bi if Bm > 1 else 0) * Hm + (hi if Hm > 1 else 0)) * Qm
                    mask_rows = (m0 + q0, m0 + q1) if Qm > 1 else (m0, m0 + 1)
                chain = None
                # keys up to the block's last query (causal), else all: the chain's last block
                k_end = q1 if causal else S
                out_rows = out(bi, hi, q0, q1)
                for k0 in range(0, k_end, kvb):
                    k1 = min(k0 + kvb, S)
                    final = inline_finalize and k0 + kvb >= k_end
                    reads = [q(bi, hi, q0, q1), k(bi, hk, k0, k1)]
                    reads.append(v(bi, hk, k0, k1))
                    if chain is not None:
                        reads += state
                    if bias is not None:
                        reads.append(bias.region(mask_rows, (k0, k1)))
                    params = {
                        "q_start": q0,
                        "k_start": k0,
                        "mask": causal and k1 - 1 > q0,  # keys past the first query
                        "first": chain is None,
                        "scale": scale,
                        "bias": MASK_KINDS[mask_kind] if bias is not None else 0,
                    }
                    if final:  # (left out otherwise: the kind's default, 0)
                        params["final"] = True
                    if softcap:  # (likewise)
                        params["softcap"] = float(softcap)
                    chain = b.task(
                        r,
                        Role.COMPUTE,
                        ATTN_BLOCK,
                        reads,
                        [*state, out_rows] if final else state,
                        waits=b.after(r, [chain]) if chain is not None else (),
                        name=f"attn r{r} bh{group} q{q0} k{k0}",
                        params=params,
                    )
                if inline_finalize:
                    continue
                b.task(
                    r,
                    Role.COMPUTE,
                    ATTN_FINALIZE,
                    state,
                    [out_rows],
                    waits=b.after(r, [chain]),
                    name=f"attn-final r{r} bh{group} q{q0}",
                )
