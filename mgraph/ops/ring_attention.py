"""Ring attention: sequence-parallel (context-parallel) attention with q, k, v and out sharded on S.

``out = softmax(q k^T / sqrt(D)) v`` per (batch, head), optionally causal. Every rank keeps its own
queries and must see every key/value slice (only the slices at or before its positions when
causal); its output never leaves it. Grouped-query attention: option ``kv_heads`` (dividing H)
gives k and v that many heads, each shared by H / kv_heads query heads; the ring then moves
kv_heads / H of the bytes of full multi-head KV, since no head is repeated before it moves.

Layout. Non-causal: rank r holds the contiguous positions [r S/W, (r+1) S/W). Causal: the sequence
is cut into 2W chunks and rank r holds chunks r and 2W-1-r (zigzag), so every rank owns the same
number of unmasked (q block, k block) pairs; a contiguous split would leave rank 0 with almost no
work and rank W-1 with most of it. A rank's 2-D buffers are ``[b, h, s_local]`` rows x D columns
(the two zigzag pieces concatenated along S), so one (b, h, block) is a contiguous row range.
A task folds ``kv_block`` keys into a ``block``-row q block. By default (:func:`default_kv_block`)
that is the largest multiple of the q block dividing a segment, at most ``KV_KEYS`` (8192): every
task reads and writes the fp32 state once, so 128-key tasks paid that per 128 keys (71-76 TF/s
for the tile on one H200, 266-303 TF/s with 1024 keys, 404-504 with one task over all 8192 or
16384 keys of a q block: benchmarks/NOTES.md).

Math (per q block, on its rank): online softmax in fp32 with the state acc [rows, D] and
ml [rows, 2] = (running max m, running denominator l). ``attn_block`` folds one KV block into the
state (the first block of a chain initialises it, so no zeroing task exists); successive blocks of
one q block are chained by events because they rewrite the same state. ``attn_finalize`` writes
``acc / l`` in the op dtype, and 0 in a row whose every key was hidden (l = 0), as SDPA does.
Option ``inline_finalize`` (default on) folds that into the chain's last attn_block instead
(param ``final``: it also writes the out rows), one task and one wait fewer per q block;
``inline_finalize=False`` emits the attn_finalize task (benchmarks/bench_attention.py
``--inline-finalize`` compares the two).
Causal masks use GLOBAL positions (task params ``q_start``, ``k_start``): with both block sizes
dividing a zigzag chunk, a k block either reaches past the q block's first position (masked:
the body hides keys after each query; the Triton body skips the key chunks after the block's
last query), lies
entirely before it (unmasked) or starts after its last position (no task at all). When the KV
block is a multiple of the q block (the default), a masked block starts at or before the q
block's first position, so every row of every task sees at least one key.

The KV "ring" is a CONSUMPTION ORDER, not the movement. Rank r folds its own slice first (no
wait), then the slices of its node peers (r-1, r-2, ... wrapping inside the node: the order their
pushes reach it), then the slices of the other nodes in ring order; each attn_block waits only on the arrival of the rows it reads,
so compute starts at once and overlaps the transfers. The movement is hierarchical: the owner of a
slice pushes it over NVLink to its node peers and over RDMA, in chunks of at least
``chunk_bytes``, to its rail peer on every other node, which forwards it over NVLink to its own
node peers; every NVLink push or forward is one copy per (chunk, peer). Each slice thus crosses
each node boundary exactly once: RDMA bytes sent per node = (N-1) x the node's KV bytes. A plain ring (r sends to r+1) cannot run on a rail-only network:
its cross-node hop goes from local GPU G-1 of one node to local GPU 0 of the next, two different
rails, which such a network does not connect; and even where they are connected, all the
cross-node traffic would funnel through one NIC per node. Here every GPU sends its own slice on
its own rail, so all G NICs of a node carry traffic at once.

Received slices land in per-rank gather buffers ``k_gather`` / ``v_gather`` with one slot per
source rank (the own slot stays unused; indexing by source keeps every peer's write offset
independent of the receiver, as symmetric memory wants).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from ..builder import GraphBuilder, pick_tile, piece, split
from ..errors import ShapeError
from ..graph import ITEMSIZE, Buffer, Region, Task, torch_dtype
from ..kinds import Role, TaskKind, kind_spec
from ..topology import Topology
from .attention_tiles import BIAS_BOOL, BIAS_NONE  # (imports the kinds' Triton bodies too)
from .registry import OpDef

if TYPE_CHECKING:
    from ..graph import TaskGraph

__all__ = ["KV_KEYS", "default_kv_block", "ring_attention"]

ring_attention = OpDef(
    "ring_attention", dims=("B", "H", "S", "D"), inputs=("q", "k", "v"), outputs=("out",)
)

ATTN_BLOCK = kind_spec(TaskKind.ATTN_BLOCK)
ATTN_FINALIZE = kind_spec(TaskKind.ATTN_FINALIZE)
COPY = TaskKind.COPY.value

Segment = tuple[int, int]  # a global sequence range [start, stop) held by one rank
# Keys an attn_block task folds by default, where the sequence allows. Every task reads and
# writes the fp32 state (acc, ml) of its q block once, whatever its key count: 128 KB per 128
# rows at D = 128, a fifth of a 1024-key task's time on one H200 SM, under 3% of an 8192-key
# one's. On one H200 the tile ran 128x1024 tasks at 266-303 TF/s and one task per q block over
# 8192-16384 keys at 404-504 (benchmarks/NOTES.md, v12). Longer tasks cost no parallelism: the
# tasks of one q block are a chain (each rewrites its state), so whatever their length the
# tasks that can run at once are one per q block. What a longer task does cost: a ring's KV
# chunk is whole KV blocks (an arrival wait per block), 2 MiB of k at 8192 keys x D 128 in
# bf16; and the longest task bounds the tail (128 x 8192 keys at D 128 is 0.54 GFLOP: ~140 us
# on one SM at the tile's 500 TF/s).
KV_KEYS = 8192


# -- shapes, meaning, inputs -------------------------------------------------------------------
def _segments(S: int, world: int, rank: int, causal: bool) -> list[Segment]:
    """The global sequence ranges rank ``rank`` holds, in buffer order."""
    if not causal:
        step = S // world
        return [(rank * step, (rank + 1) * step)]
    chunk = S // (2 * world)
    mirror = 2 * world - 1 - rank
    return [(rank * chunk, (rank + 1) * chunk), (mirror * chunk, (mirror + 1) * chunk)]


def default_kv_block(segment: int, blk: int) -> int:
    """Keys per attn_block task when the caller names none: the largest multiple of the q block
    ``blk`` that divides ``segment`` (a multiple of ``blk``), at most ``max(KV_KEYS, blk)``.
    A multiple of the q block, so a causal KV block that reaches past a q block's first query
    starts at or before it (no row of a task has every key masked)."""
    assert segment % blk == 0, (segment, blk)
    blocks = segment // blk
    most = max(KV_KEYS, blk) // blk
    return blk * max(m for m in range(1, min(most, blocks) + 1) if blocks % m == 0)


def _block_size(
    S: int, world: int, causal: bool, block: int, kv_block: int | None = None
) -> tuple[int, int]:
    """(q rows, keys) per tile; each must divide every segment so blocks never straddle one."""
    segment, dim = (S // (2 * world), "S/(2W)") if causal else (S // world, "S/W")
    sizes = []
    for name, value in (("block", block), ("kv_block", kv_block)):
        if value is None:  # kv_block: the default, from the q block
            sizes.append(default_kv_block(segment, sizes[0]))
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ShapeError(
                f"ring_attention: {name}={value!r} must be a positive integer",
                hint=f"pass {name} as the number of sequence rows per tile, e.g. 128",
            )
        sizes.append(pick_tile("ring_attention", dim, segment, value))
    return sizes[0], sizes[1]


def _kv_heads(H: int, kv_heads: int | None) -> int:
    """KV heads; ShapeError unless they divide the query heads."""
    if kv_heads is None:
        return H
    if isinstance(kv_heads, bool) or not isinstance(kv_heads, int) or kv_heads <= 0 or H % kv_heads:
        raise ShapeError(
            f"ring_attention: kv_heads={kv_heads!r} must be a positive divisor of H={H}",
            hint="grouped-query attention shares each KV head among H / kv_heads query heads",
        )
    return kv_heads


@ring_attention.shapes
def _shapes(
    topology: Topology,
    B: int,
    H: int,
    S: int,
    D: int,
    causal: bool = False,
    block: int = 128,
    chunk_bytes: int = 256 * 1024,
    kv_heads: int | None = None,
    kv_block: int | None = None,
    **_: object,
) -> dict[str, tuple]:
    world = topology.world_size
    parts = 2 * world if causal else world
    if S % parts:
        layout = f"2W={parts} zigzag chunks" if causal else f"the world size W={world}"
        raise ShapeError(
            f"ring_attention: S={S} is not divisible by {layout}",
            hint=f"choose S as a multiple of {parts}",
        )
    _block_size(S, world, causal, block, kv_block)
    kv = (B, _kv_heads(H, kv_heads), S, D)
    if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int) or chunk_bytes <= 0:
        raise ShapeError(
            f"ring_attention: chunk_bytes={chunk_bytes!r} must be a positive integer",
            hint="the default, 256 KiB, keeps the proxy well under its command rate",
        )
    shape = (B, H, S, D)
    return {"q": shape, "k": kv, "v": kv, "out": shape}


def repeat_kv(x: torch.Tensor, heads: int) -> torch.Tensor:
    """[B, Hkv, S, D] -> [B, heads, S, D]: each KV head serves heads / Hkv query heads in turn
    (SDPA's ``enable_gqa`` grouping)."""
    return x.repeat_interleave(heads // x.shape[1], dim=1)


@ring_attention.reference
def _reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False, **_: object
) -> dict[str, torch.Tensor]:
    H = q.shape[1]
    k, v = repeat_kv(k.float(), H), repeat_kv(v.float(), H)
    out = F.scaled_dot_product_attention(q.float(), k, v, is_causal=causal)
    return {"out": out.to(q.dtype)}


@ring_attention.make_inputs
def _make_inputs(graph: TaskGraph, generator: torch.Generator) -> dict[str, torch.Tensor]:
    # Unit normals: q.k / sqrt(D) then has unit variance, so the softmax is neither uniform nor
    # one-hot and every KV block contributes visibly to the output.
    return {
        name: torch.randn(spec.shape, generator=generator).to(torch_dtype(spec.dtype))
        for name, spec in graph.inputs.items()
    }


# -- tile bodies -------------------------------------------------------------------------------
@ATTN_BLOCK.cpu
def _attn_block_cpu(
    task: Task, reads: Sequence[torch.Tensor], writes: Sequence[torch.Tensor]
) -> None:
    """reads: q, k, v blocks (+ acc, ml unless ``first``; + a mask tile last when ``bias``, one
    row when it broadcasts over the queries: additive when bias is 1, boolean (nonzero = attend)
    when 2); writes: acc, ml (same rows), and with ``final`` the out rows too (what attn_finalize
    would write: the chain's last task finalises inline)."""
    p = task.params
    q, k, v = (t.float() for t in reads[:3])
    scores = (q @ k.T) * p["scale"]
    if p.get("softcap"):  # Gemma2's soft-capping, before the mask (attention.py)
        scores = p["softcap"] * torch.tanh(scores / p["softcap"])
    if p.get("bias") == BIAS_BOOL:
        scores = scores.masked_fill(reads[-1] == 0, float("-inf"))
    elif p.get("bias"):
        scores = scores + reads[-1].float()
    if p["mask"]:
        q_pos = p["q_start"] + torch.arange(q.shape[0])
        k_pos = p["k_start"] + torch.arange(k.shape[0])
        scores = scores.masked_fill(k_pos[None, :] > q_pos[:, None], float("-inf"))
    block_max = scores.amax(dim=1)
    if p["first"]:
        m_new = block_max
    else:
        acc_old, ml_old = reads[3], reads[4]
        m_old, l_old = ml_old[:, 0], ml_old[:, 1]
        m_new = torch.maximum(m_old, block_max)
    # A row with nothing unmasked yet keeps m = -inf; shift it by 0 so exp() gives 0, not NaN.
    shift = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
    probs = torch.exp(scores - shift[:, None])
    acc_new = probs @ v.float()
    l_new = probs.sum(dim=1)
    if not p["first"]:
        alpha = torch.exp(m_old - shift)
        acc_new += alpha[:, None] * acc_old
        l_new += alpha * l_old
    writes[0].copy_(acc_new)
    writes[1][:, 0] = m_new
    writes[1][:, 1] = l_new
    if p.get("final"):
        writes[2].copy_(_finalized(acc_new, l_new[:, None]))


@ATTN_BLOCK.flops
def _attn_block_flops(
    reads: Sequence[tuple[int, int]], writes: Sequence[tuple[int, int]], params: dict
) -> float:
    (rows, d), (keys, _) = reads[0], reads[1]
    pairs = rows * keys
    if params.get("mask"):
        pairs = _causal_pairs(rows, keys, params["q_start"] - params["k_start"])
    # q k^T and p v; the exp/max/sum terms are O(rows * keys); ``final``: attn_finalize's acc / l
    return 4.0 * pairs * d + (rows * d if params.get("final") else 0)


def _causal_pairs(rows: int, keys: int, offset: int) -> int:
    """The (query, key) pairs a causal mask shows in a rows x keys block whose first query sits
    ``offset`` positions after its first key: row i sees min(keys, max(0, offset + i + 1)) keys.
    Counted so, a KV block much longer than the q block that straddles the diagonal costs the
    keys its rows see (the Triton body skips the chunks after its last query), not all of them."""
    d = offset + 1  # keys row 0 sees, before clamping
    lo = max(0, min(rows, 1 - d))  # rows before lo see no key
    hi = max(lo, min(rows, keys - d))  # rows from hi see every key
    return (hi - lo) * d + (lo + hi - 1) * (hi - lo) // 2 + (rows - hi) * keys


@ATTN_FINALIZE.cpu
def _attn_finalize_cpu(
    task: Task, reads: Sequence[torch.Tensor], writes: Sequence[torch.Tensor]
) -> None:
    """out = acc / l; a row whose every key was hidden (l = 0: left padding) is 0, as SDPA
    returns it, not 0 / 0."""
    acc, ml = reads
    writes[0].copy_(_finalized(acc, ml[:, 1:2]))


def _finalized(acc: torch.Tensor, denom: torch.Tensor) -> torch.Tensor:
    """acc / l, and 0 in a row with l = 0 (every key hidden) rather than 0 / 0."""
    return torch.where(denom == 0, 0.0, acc / denom)


@ATTN_FINALIZE.flops
def _attn_finalize_flops(
    reads: Sequence[tuple[int, int]], writes: Sequence[tuple[int, int]], params: dict
) -> float:
    rows, d = writes[0]
    return float(rows * d)


# -- lowering ----------------------------------------------------------------------------------
@ring_attention.lower
def _lower(
    b: GraphBuilder,
    B: int,
    H: int,
    S: int,
    D: int,
    causal: bool = False,
    block: int = 128,
    chunk_bytes: int = 256 * 1024,
    kv_heads: int | None = None,
    kv_block: int | None = None,
    inline_finalize: bool = True,
) -> None:
    topo, world = b.topo, b.world
    blk, kvb = _block_size(S, world, causal, block, kv_block)
    Hkv = _kv_heads(H, kv_heads)
    shape, kv_shape = (B, H, S, D), (B, Hkv, S, D)
    b.global_input("q", shape)
    b.global_input("k", kv_shape)
    b.global_input("v", kv_shape)
    b.global_output("out", shape)
    segments = [_segments(S, world, r, causal) for r in topo.ranks]

    def bound(name: str, rank: int, role: str) -> Buffer:
        full = kv_shape if name in ("k", "v") else shape
        pieces = [piece(full, d2=seg) for seg in segments[rank]]
        return b.bound_buffer(name, rank, name, pieces, cat_dim=2, role=role)

    q = [bound("q", r, "input") for r in topo.ranks]
    k = [bound("k", r, "input") for r in topo.ranks]
    v = [bound("v", r, "input") for r in topo.ranks]
    out = [bound("out", r, "output") for r in topo.ranks]
    rows = q[0].rows  # B * H * S_local, the same on every rank
    acc = [b.buffer("attn_acc", r, rows, D, dtype="float32") for r in topo.ranks]
    ml = [b.buffer("attn_ml", r, rows, 2, dtype="float32") for r in topo.ranks]

    moves = _Movement(b, k, v, kvb, chunk_bytes)
    scale = 1.0 / math.sqrt(D)
    s_local = rows // (B * H)
    for r in topo.ranks:
        orders = {
            q0: _kv_order(topo, segments, r, kvb, causal, q0, blk)
            for _, q0 in _blocks(segments[r], blk)
        }
        for bh in range(B * H):
            base = bh * s_local  # first row of this (b, h) in q's and out's buffers
            # ... and of its KV head in every rank's k and v buffers
            kv_base = ((bh // H) * Hkv + (bh % H) // (H // Hkv)) * s_local
            for q_row, q_start in _blocks(segments[r], blk):
                q_rows = (base + q_row, base + q_row + blk)
                state = [acc[r].region(q_rows), ml[r].region(q_rows)]
                out_rows = out[r].region(q_rows)
                chain: Task | None = None
                last = len(orders[q_start]) - 1
                for i, (src, k_row, k_start) in enumerate(orders[q_start]):
                    params = {
                        "q_start": q_start,
                        "k_start": k_start,
                        # keys past the q block's first position: the body hides those after
                        # each query
                        "mask": causal and k_start + kvb - 1 > q_start,
                        "first": chain is None,
                        "scale": scale,
                        "bias": BIAS_NONE,  # no mask tile (a declared param of the GPU body)
                    }
                    final = inline_finalize and i == last
                    if final:  # (left out otherwise: the kind's default, 0)
                        params["final"] = True
                    k_rows = (kv_base + k_row, kv_base + k_row + kvb)
                    name = f"attn r{r} bh{bh} q{q_start} k{k_start} (slice r{src})"
                    writes = [*state, out_rows] if final else state
                    step = (state, writes, chain, src, k_rows, params, name)
                    chain = _attn_step(b, moves, r, q[r].region(q_rows), *step)
                assert chain is not None  # the diagonal (causal) or every block is computed
                if inline_finalize:
                    continue
                b.task(
                    r,
                    Role.COMPUTE,
                    ATTN_FINALIZE.name,
                    state,
                    [out_rows],
                    waits=b.after(r, [chain]),
                    name=f"attn-final r{r} bh{bh} q{q_start}",
                )


def _kv_order(
    topo: Topology,
    segments: list[list[Segment]],
    rank: int,
    kvb: int,
    causal: bool,
    q_start: int,
    blk: int,
) -> list[tuple[int, int, int]]:
    """(source rank, row offset within one (b, h), global start) of every ``kvb``-key block the
    ``blk``-row q block at ``q_start`` on ``rank`` folds, in consumption order; causal blocks
    starting after the q block's last position are left out (every key follows every query)."""
    return [
        (src, k_row, k_start)
        for src in _ring_order(topo, rank)
        for k_row, k_start in _blocks(segments[src], kvb)
        if not (causal and k_start >= q_start + blk)
    ]


def _attn_step(
    b: GraphBuilder,
    moves: _Movement,
    r: int,
    q_region: Region,
    state: list[Region],
    writes: list[Region],
    chain: Task | None,
    src: int,
    k_rows: tuple[int, int],
    params: dict,
    name: str,
) -> Task:
    """One online-softmax step on rank r: fold rows ``k_rows`` of KV slice ``src`` into the
    ``state`` (acc, ml) of ``q_region``, after the chain's previous step and the rows' arrival;
    ``writes``: the state, and the out rows when the step finalises inline."""
    k_region, v_region = moves.kv_regions(r, src, k_rows)
    reads = [q_region, k_region, v_region]
    waits = []
    if chain is not None:
        reads += state  # the first step initialises the state instead of reading it
        waits += b.after(r, [chain])
    if src != r:
        waits += moves.arrival_waits(r, src, k_rows[0])
    return b.task(
        r, Role.COMPUTE, ATTN_BLOCK.name, reads, writes, waits=waits, name=name, params=params
    )


def _blocks(segments: list[Segment], blk: int) -> list[tuple[int, int]]:
    """(row offset within one (b, h), global start position) of every block of a rank."""
    out, offset = [], 0
    for start, stop in segments:
        for pos in range(start, stop, blk):
            out.append((offset + pos - start, pos))
        offset += stop - start
    return out


def _ring_order(topo: Topology, rank: int) -> list[int]:
    """The slices rank ``rank`` folds, in order: its own, its node peers', then every other
    node's in ring order, each node's from the rail peer's (it lands by RDMA, one hop before the
    forwarded ones) on. Within a node the order runs down (local l, l-1, l-2, ...): every GPU
    pushes and forwards to l+1 first (the scheduler's push rotation queues the copies to the
    next GPU before those to the one after), so GPU l gets l-1's chunks first. Folding the
    node's slices upwards waited on the slices landing last: with the copies split per peer,
    2x8 S=49152 simulated at 21.8 ms upwards, 19.0 ms downwards."""
    G, node, local = topo.gpus_per_node, topo.node_of(rank), topo.local_of(rank)
    down = [(local - i) % G for i in range(G)]
    return [topo.rank((node + hop) % topo.nodes, g) for hop in range(topo.nodes) for g in down]


class _Movement:
    """Hierarchical KV movement: every slice crosses each node boundary once.

    The owner pushes each chunk of its k and v slices over NVLink to its node peers and over RDMA
    to its rail peer on every other node, which forwards it over NVLink to its node peers. A chunk
    is whole blocks of rows, at least ``chunk_bytes`` (except a slice's last chunk). Every NVLink
    push or forward is one copy per (chunk, peer), so a receiver's attn_block waits only for the
    two copies (k and v) that land its chunk there.
    """

    def __init__(
        self, b: GraphBuilder, k: list[Buffer], v: list[Buffer], blk: int, chunk_bytes: int
    ) -> None:
        self.b, self.topo = b, b.topo
        self.k, self.v = k, v
        self.rows = k[0].rows
        row_bytes = k[0].cols * ITEMSIZE[k[0].dtype]
        blocks_per_chunk = max(1, -(-chunk_bytes // (blk * row_bytes)))
        self.chunk_rows = min(self.rows, blocks_per_chunk * blk)
        # One slot per source rank; a single GPU receives nothing and needs no gather buffer.
        slots = b.world * self.rows
        ranks = b.topo.ranks if b.world > 1 else []
        self.k_gather = [b.buffer("k_gather", r, slots, k[0].cols) for r in ranks]
        self.v_gather = [b.buffer("v_gather", r, slots, v[0].cols) for r in ranks]
        # (receiver, source, chunk) -> the tasks that deliver that chunk of k and v there
        self.arrivals: dict[tuple[int, int, int], list[Task]] = {}
        self._waits: dict[tuple[int, int, int], list[tuple[int, int]]] = {}
        self._lower()

    def arrival_waits(self, rank: int, src: int, row: int) -> list[tuple[int, int]]:
        """Waits on ``rank`` for the chunk of slice ``src`` holding ``row`` (k and v) to land."""
        key = (rank, src, row // self.chunk_rows)
        waits = self._waits.get(key)
        if waits is None:  # every block of the chunk reuses one event: cache the lookup
            waits = self._waits[key] = self.b.after(rank, self.arrivals[key])
        return waits

    def kv_regions(self, rank: int, src: int, rows: tuple[int, int]) -> tuple[Region, Region]:
        """Where rank ``rank`` reads rows ``rows`` of slice ``src`` (its input when its own)."""
        if src == rank:
            return self.k[rank].region(rows), self.v[rank].region(rows)
        slot = (src * self.rows + rows[0], src * self.rows + rows[1])
        return self.k_gather[rank].region(slot), self.v_gather[rank].region(slot)

    def _lower(self) -> None:
        """Emit every slice's transfers, chunk by chunk, k then v, filling ``arrivals``."""
        for src in self.topo.ranks:
            for chunk, (r0, r1) in enumerate(split(self.rows, self.chunk_rows)):
                self._move(src, chunk, (r0, r1), "k", self.k[src], self.k_gather)
                self._move(src, chunk, (r0, r1), "v", self.v[src], self.v_gather)

    def _move(
        self,
        src: int,
        chunk: int,
        rows: tuple[int, int],
        name: str,
        inp: Buffer,
        gather: list[Buffer],
    ) -> None:
        b, topo = self.b, self.topo
        slot = (src * self.rows + rows[0], src * self.rows + rows[1])
        what = f"{name}[{rows[0]}:{rows[1]}] of r{src}"
        home = topo.node_of(src)
        peers = _node_peers(topo, src)
        for p in peers:
            # one peer (1x2): the name single-node graphs had before the split
            to = f"r{p}" if len(peers) > 1 else f"node{home}"
            push = b.task(
                src,
                Role.NVLINK,
                COPY,
                [inp.region(rows)],
                [gather[p].region(slot)],
                name=f"push {what} -> {to}",
            )
            self.arrivals.setdefault((p, src, chunk), []).append(push)
        for hop in range(1, topo.nodes):  # the other nodes, in ring order from home
            node = (home + hop) % topo.nodes
            rail = topo.rail_peer(src, node)
            send = b.task(
                src,
                Role.RDMA,
                COPY,
                [inp.region(rows)],
                [gather[rail].region(slot)],
                name=f"rail-send {what} -> r{rail}",
            )
            self.arrivals.setdefault((rail, src, chunk), []).append(send)
            waits = b.after(rail, [send])
            others = _node_peers(topo, rail)
            for p in others:
                to = f"r{p}" if len(others) > 1 else f"node{node}"
                forward = b.task(
                    rail,
                    Role.NVLINK,
                    COPY,
                    [gather[rail].region(slot)],
                    [gather[p].region(slot)],
                    waits=waits,
                    name=f"forward {what} at r{rail} -> {to}",
                )
                self.arrivals.setdefault((p, src, chunk), []).append(forward)


def _node_peers(topo: Topology, rank: int) -> list[int]:
    """The other GPUs of ``rank``'s node, from the next one on: one NVLink copy each (one copy
    into all G-1 peers was one worker moving G-1 chunks in a row), and the G GPUs of a node
    start their pushes on G different peers."""
    G, node, local = topo.gpus_per_node, topo.node_of(rank), topo.local_of(rank)
    return [topo.rank(node, (local + i) % G) for i in range(1, G)]
