"""Tile bodies of the MoE kinds: moe_route, moe_move, moe_expert, moe_combine (CPU here; Triton in
moe_bodies.py).

The graph is static but what flows through it is data-dependent: route tiles decide at run time
which rows of a send slot are filled, and write that decision as counts, fp32 metadata rows and
a picks map, which travel with the data or stay home. Every later tile reads them instead of
assuming a routing, so the same graph is exact for any router output.

Send-slot layout (one per source rank): segment ``e`` (global expert) holds rows
``[e * C, (e + 1) * C)``, ``C`` the segment capacity (the route tile's ``capacity`` param; the
lowering derives it from its ``capacity_factor`` option, at most T_loc); the tokens routed to
``e`` fill its first rows in ascending token order. Drop policy: when more than ``C`` of the
source's tokens pick ``e``, the first ``C`` of them (ascending token index) keep that pick and the
others lose it: their row is not sent, their picks map entry says "not picked", so their output
sums their other picks only (weights are not renormalised). The route tile writes how many picks
of each expert it dropped to its ``dropped`` region (fp32, one entry per expert of its group), so
a drop is never silent. A token picks an expert at most once, so ``C = T_loc`` never drops.
Metadata columns (``META_COLS``): token index (local to the source rank), routing weight, local
expert index. ``back`` (the expert outputs, home again) has the send
layout.

A route tile covers a group of consecutive experts (``expert0`` and the width of its counts
region): it ranks every token's logits, then packs the tokens of its own experts. Tiles of
different groups write disjoint rows and columns, so they run in parallel. Besides the send rows
it writes the picks map (``pick_rows`` / ``pick_weights`` [T_loc, E], fp32): for token t and
expert e, the row of ``back`` that will hold e's output for t (-1: not picked) and its weight
(0). Combine reads it to gather each token's k rows: no scatter, no atomics.

Counts travel as data: the route tiles also write ``counts [W, E_loc]`` (fp32, exact below
2**24), the filled rows of each segment (at most ``C``: kept picks only), and every later tile reads them. Capacity bounds the
buffers, not the traffic: ``moe_move`` copies only the filled rows of each segment, an expert
tile computes only its filled rows (a tile past its segment's count exits at once), combine
reads only picked rows. Rows past a count are never written nor read (they hold whatever the
buffer held: stale or poison).

Ranking: a token's top_k experts are its top_k logits in the order (value descending, expert
index ascending), so ties go to the lower index on both backends; the CPU bodies take torch's
``topk`` (``route_topk``), which may break exact ties otherwise (random logits have none).

The expert tile stores the SwiGLU hidden ``silu(x @ w_gate) * (x @ w_up)`` in the graph's dtype
(a scratch region of its own), then multiplies it by ``w_down``, as a bf16 grouped GEMM does;
the CPU body rounds it the same way. A tile is one task (part 0) or, with the lowering's column
split, pass-1 tasks on slices of the hidden columns (part 1) and pass-2 tasks on slices of the
output columns (part 2) that run after all of them (EXPERT_PARTS).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from ..errors import GraphError
from ..graph import ITEMSIZE, Task, TaskGraph
from ..kinds import Role, TaskKind, define_kind, kind_spec

__all__ = [
    "META_COLS",
    "route_topk",
    "swiglu",
    "expert_flops",
    "combine_flops",
    "MOE_MOVE",
    "filled_rows",
    "expert_row_blocks",
    "weight_streams",
]

META_COLS = 3  # token index, weight, local expert
MOE_MOVE = "moe_move"

ROUTE = kind_spec(TaskKind.MOE_ROUTE)
EXPERT = kind_spec(TaskKind.MOE_EXPERT)
COMBINE = kind_spec(TaskKind.MOE_COMBINE)
# The builtin kinds are defined in mgraph/kinds.py without params; the params a Triton body
# reads are declared beside it (the encoder packs them in this order).
ROUTE.params = ("top_k", "experts_per_rank", "expert0", "capacity", "normalize")
# normalize 0: top-k weights from the softmax over all experts (route_topk); the lowering sets it
# only then, so the tasks of a renormalising op are as before the flag
ROUTE.param_defaults = {"normalize": 1}
EXPERT.params = ("local_expert", "row0", "part")
# part: 0 both passes (regions below), 1 pass 1 only, 2 pass 2 only (EXPERT_PARTS)
EXPERT.param_defaults = {"part": 0}
COMBINE.params = ("top_k",)
# A transfer whose size is data: the COPY kind moves whole regions, and the builtin kinds are not
# ours to change, so the data-dependent copy is a kind of its own. RDMA is not among its roles:
# the proxy encodes its WRITEs at launch from the static regions (runtime/network.py).
MOVE = define_kind(
    MOE_MOVE,
    [Role.NVLINK],
    "copy the first counts[j] rows of each segment j (segment_rows rows) of reads[0] to writes[0]",
    # float32: 1 when the moved buffer holds float32 (the metadata), 0 for the graph's dtype
    params=("segment_rows", "float32"),
    own_dtypes=True,
)


def filled_rows(counts: torch.Tensor, segment_rows: int) -> torch.Tensor:
    """Row indices of the filled rows of consecutive segments with these counts (flattened)."""
    n = counts.reshape(-1).long()
    if bool(((n < 0) | (n > segment_rows)).any()):
        raise GraphError(
            f"a segment count in {n.tolist()} is outside [0, {segment_rows}]",
            hint="the counts buffer was not written by a moe_route tile of this graph",
        )
    filled = torch.arange(segment_rows, device=n.device)[None, :] < n[:, None]
    return filled.reshape(-1).nonzero().flatten()


def expert_row_blocks(rows: int, itemsize: int) -> list[int]:
    """The row blocks of the expert body's TMA path (moe_bodies.expert_tile's rule) for a task
    with ``rows`` filled rows of ``itemsize``-byte elements, in order, each block the rows one
    stream of the task's weights feeds (its MMA rows, padding included). 16-bit: chunks of up
    to 192 rows, each a 192-row block (the pair tile: 128 + 64 rows in one K loop) when it has
    more than 128 rows, else a 128-row block when more than 64, else a 64-row block; float32:
    64-row blocks."""
    if itemsize != 2:
        return [64] * -(-rows // 64)
    blocks = []
    for o in range(0, rows, 192):
        r = min(rows - o, 192)
        blocks.append(192 if r > 128 else 128 if r > 64 else 64)
    return blocks


def weight_streams(
    graph: TaskGraph,
    picks: torch.Tensor,
    row_blocks: object = expert_row_blocks,
    queues: Sequence[Sequence[int]] | None = None,
) -> dict[str, float]:
    """How many times a routing makes the expert tasks of ``graph`` (a moe_dispatch_combine
    graph) read their expert's weights, from the host alone. ``picks [W, E]``: how many of
    source rank s's tokens picked global expert e (before the drop policy). Per expert task:
    its filled rows (min(picks, capacity) past its ``row0``, at most its rows) in the blocks
    ``row_blocks(rows, itemsize)`` lists (default: the body's TMA rule; the pointer path, for
    rows not in whole 16-byte units, is not modelled), each block reading the weight regions
    of the task once (all three matrices for a whole task; a column slice of gate and up, or
    of down, for a task of the column split: moe_dispatch_combine's ``expert_cols_f`` /
    ``expert_cols_h``). Summed over all ranks: the streams (in whole experts' weights) and
    their bytes, the bytes of x and hidden rows a block reads again per block of hidden and of
    output columns (``reread_bytes``: an upper bound, none found in L2; tasks of one slice
    each share their rows through L2 only when they run at the same time, not modelled), the
    blocks' rows (filled and padding: the MMA work; a split task counts its share of the
    expert's work) and the filled rows (once per row tile).

    ``queues`` (each rank's compute queue, ``[rs.queues["compute"] for rs in schedule.ranks]``):
    expert tasks reading the same weight regions that come one after another among their
    rank's expert tasks in its queue (as moe_dispatch_combine queues one slice's tiles of every
    source) are taken by programs at about the same time: they count as streaming those
    weights once per row block of the largest of them, the others reading them from L2. An
    upper bound on what running side by side saves: two programs on one slice share its reads
    only while their loops stay in step. None: every task streams its own."""
    itemsize = ITEMSIZE[graph.dtype]
    H, F = graph.params["H"], graph.params["F"]
    # the body's column blocks (hidden, output): moe_bodies' pass 1 and pass 2 tiles
    cols_f, cols_h = (128, 256) if itemsize == 2 else (64, 128)
    whole = 3 * H * F  # one expert's weight elements
    stream_elems = reread = padded = filled = 0.0
    # (rank, weight regions) of the previous expert task in its rank's queue, and its blocks
    run: dict[int, tuple[tuple, int]] = {}
    order = [t.id for t in graph.tasks] if queues is None else [i for q in queues for i in q]
    for tid in order:
        task = graph.tasks[tid]
        if task.kind != EXPERT.name:
            continue
        e = task.rank * (graph.params["E"] // graph.topology.world_size)
        e += task.params["local_expert"]
        tile = task.reads[0].row1 - task.reads[0].row0
        capacity = task.params["capacity"]
        n = min(max(min(int(picks[task.params["source"], e]), capacity) - task.params["row0"], 0),
                tile)  # fmt: skip
        if not n:
            continue
        part = task.params.get("part", 0)
        weights = task.reads[3:]
        elems = sum((w.row1 - w.row0) * (w.col1 - w.col0) for w in weights)
        cols = weights[0].col1 - weights[0].col0  # f (parts 0, 1) or h (part 2) columns
        if part == 1:
            per_row, share = -(-cols // cols_f) * H, 2.0 * cols / (3 * F)
        elif part == 2:
            per_row, share = -(-cols // cols_h) * F, cols / (3.0 * H)
        else:
            per_row, share = -(-F // cols_f) * H + -(-H // cols_h) * F, 1.0
        blocks = row_blocks(n, itemsize)
        streams = len(blocks)
        if queues is not None:
            same, before = run.get(task.rank, ((), 0))
            if same == tuple(weights):  # its row blocks after the run's first read from L2
                streams, blocks_run = max(streams - before, 0), max(before, streams)
            else:
                blocks_run = streams
            run[task.rank] = (tuple(weights), blocks_run)
        stream_elems += streams * elems
        reread += sum(blocks) * per_row * itemsize
        padded += sum(blocks) * share
        filled += n if part == 0 or (part == 1 and weights[0].col0 == 0) else 0
    return {
        "experts": float(graph.params["E"]),
        "streams": stream_elems / whole,
        "stream_bytes": float(stream_elems * itemsize),
        "reread_bytes": float(reread),
        "block_rows": float(padded),
        "filled_rows": float(filled),
    }


def route_topk(
    logits: torch.Tensor, top_k: int, normalize: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mixtral routing: top-k on the logits, softmax over those k values (fp32). ``normalize``
    False: the softmax over all E logits at the top k, not renormalised (Qwen2-MoE's
    ``norm_topk_prob=False``); the same picks.

    Returns ``(weights [T, k] fp32, experts [T, k] int64)``. The reference and the route tile share
    it so that the tie-breaking of ``topk`` is identical in both.
    """
    logits = logits.float()
    values, experts = logits.topk(top_k, dim=-1)
    if normalize:
        return torch.softmax(values, dim=-1), experts
    return torch.softmax(logits, dim=-1).gather(1, experts), experts


def swiglu(
    x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor
) -> torch.Tensor:
    """The expert MLP in fp32: ``(silu(x @ w_gate) * (x @ w_up)) @ w_down``."""
    x = x.float()
    return (F.silu(x @ w_gate.float()) * (x @ w_up.float())) @ w_down.float()


def expert_flops(rows: float, hidden: int, ffn: int) -> float:
    """Three GEMMs of ``rows`` x H x F (gate, up, down); the SiLU and product are negligible."""
    return 6.0 * rows * hidden * ffn


def combine_flops(rows: float, cols: int) -> float:
    """One multiply-add per routed row and column."""
    return 2.0 * rows * cols


# -- moe_route: reads [x (T_loc, H), logits (T_loc, E)], writes [send (G*C, H), meta, counts
# (1, G), pick_rows (T_loc, G), pick_weights (T_loc, G), dropped (1, G)] for the group of G
# experts at expert0, C = params["capacity"] rows per segment ------------------------------------
@ROUTE.cpu
def _route_cpu(task: Task, reads: Sequence[torch.Tensor], writes: Sequence[torch.Tensor]) -> None:
    x, logits = reads
    send, meta, counts, pick_rows, pick_weights, dropped = writes
    per_rank, first = task.params["experts_per_rank"], task.params["expert0"]
    capacity = task.params["capacity"]
    normalize = bool(task.params.get("normalize", ROUTE.param_defaults["normalize"]))
    weights, experts = route_topk(logits, task.params["top_k"], normalize)
    flat = counts.view(-1)
    flat.zero_()
    lost = dropped.view(-1)
    lost.zero_()
    pick_rows.fill_(-1.0)
    pick_weights.zero_()
    for j in range(flat.numel()):
        e = first + j
        # nonzero() lists tokens in ascending order, as the Triton body packs them; the first
        # `capacity` keep the pick (the drop policy of the module docstring), the rest are
        # counted as dropped.
        token, slot = (experts == e).nonzero(as_tuple=True)
        lost[j] = max(token.numel() - capacity, 0)
        token, slot = token[:capacity], slot[:capacity]
        n = token.numel()
        if n == 0:
            continue
        flat[j] = n
        rows = slice(j * capacity, j * capacity + n)
        send[rows] = x[token].to(send.dtype)
        meta[rows, 0] = token.to(meta.dtype)
        meta[rows, 1] = weights[token, slot].to(meta.dtype)
        meta[rows, 2] = float(e % per_rank)
        pick_rows[token, j] = (e * capacity + torch.arange(n)).to(pick_rows.dtype)
        pick_weights[token, j] = weights[token, slot].to(pick_weights.dtype)


@ROUTE.flops
def _route_flops(reads: Sequence[tuple[int, int]], writes: Sequence[tuple[int, int]], params: dict):
    tokens, experts = reads[1]
    # top_k scans of the logits, then a k-wide softmax per token (without normalize: one more
    # scan, the softmax's denominator over all experts).
    scans = params.get("top_k", 1) + (0 if params.get("normalize", 1) else 1)
    return float(tokens * experts * scans + 4 * tokens * params.get("top_k", 1))


# -- moe_move: reads [src (S*seg, cols), counts (1, S)], writes [dst (S*seg, cols)] ---------------
@MOVE.cpu
def _move_cpu(task: Task, reads: Sequence[torch.Tensor], writes: Sequence[torch.Tensor]) -> None:
    src, counts = reads
    (dst,) = writes
    rows = filled_rows(counts, task.params["segment_rows"])  # an empty segment moves nothing
    dst[rows] = src[rows]


@MOVE.flops
def _move_flops(reads: Sequence[tuple[int, int]], writes: Sequence[tuple[int, int]], params: dict):
    return 0.0


# -- moe_expert: one task computes its row tile's SwiGLU whole (part 0) or one pass of it on a
# slice of columns (parts 1 and 2: the lowering's column split, several programs on one expert at
# once). The regions per part (EXPERT_PARTS): the rows are the filled ones, the count says how
# many; hidden is the SwiGLU hidden in the graph's dtype, scratch:
#   0: reads [rows (n, H), meta (n, 3), count (1, 1), w_gate (H, F), w_up (H, F), w_down (F, H)],
#      writes [y (n, H), hidden (n, F)]
#   1: reads [rows (n, H), meta (n, 3), count, w_gate (H, f), w_up (H, f)], writes [hidden (n, f)]
#      for a slice of f hidden columns
#   2: reads [hidden (n, F), meta (n, 3), count, w_down (F, h)], writes [y (n, h)] for a slice of
#      h output columns (after every part-1 task of its rows)
EXPERT_PARTS = {0: "both passes", 1: "pass 1 on a slice of hidden columns",
                2: "pass 2 on a slice of output columns"}  # fmt: skip


@EXPERT.cpu
def _expert_cpu(task: Task, reads: Sequence[torch.Tensor], writes: Sequence[torch.Tensor]) -> None:
    part = task.params.get("part", 0)
    if part not in EXPERT_PARTS:
        raise GraphError(f"{task.name}: moe_expert part={part!r} is not one of {EXPERT_PARTS}")
    rows, meta, count = reads[:3]
    # The tile covers rows [row0, row0 + len) of its segment; the count says how many are filled.
    n = min(max(int(count.item()) - task.params["row0"], 0), rows.shape[0])
    if n == 0:
        return  # an empty tile exits at once; its output rows are never moved nor read
    assert bool((meta[:n, 2] == task.params["local_expert"]).all()), task.name
    if part == 2:  # rows are the hidden rows pass 1 stored
        (w_down,), (y,) = reads[3:], writes
        y[:n] = (rows[:n].float() @ w_down.float()).to(y.dtype)
        return
    x = rows[:n].float()
    w_gate, w_up = reads[3:5]
    hidden = writes[-1]
    hidden[:n] = (F.silu(x @ w_gate.float()) * (x @ w_up.float())).to(hidden.dtype)
    if part == 0:
        y = writes[0]
        y[:n] = (hidden[:n].float() @ reads[5].float()).to(y.dtype)


@EXPERT.flops
def _expert_flops(
    reads: Sequence[tuple[int, int]], writes: Sequence[tuple[int, int]], params: dict
):
    part = params.get("part", 0)
    capacity = reads[0][0]
    # The lowering records the EXPECTED routed rows; without it this is the worst case.
    rows = params.get("expected_rows", capacity)
    if part == 1:  # gate and up on f columns: 2 GEMMs of rows x H x f
        return 4.0 * rows * reads[0][1] * reads[3][1]
    if part == 2:  # rows x F x h
        return 2.0 * rows * reads[0][1] * reads[3][1]
    return expert_flops(rows, reads[0][1], reads[3][1])


# -- moe_combine: reads [back (E*C, cols), pick_rows (n, E), pick_weights (n, E)], writes
# out (n, cols): out[t] = sum over t's picked experts, ascending, of weight * back[row] ---------
@COMBINE.cpu
def _combine_cpu(task: Task, reads: Sequence[torch.Tensor], writes: Sequence[torch.Tensor]) -> None:
    back, pick_rows, pick_weights = reads
    (out,) = writes
    acc = torch.zeros(out.shape, dtype=torch.float32, device=out.device)
    for e in range(pick_rows.shape[1]):  # the Triton body's order of the fp32 sum
        token = (pick_rows[:, e] >= 0).nonzero().flatten()
        if token.numel():
            row = pick_rows[token, e].long()
            acc[token] += pick_weights[token, e, None].float() * back[row].float()
    out.copy_(acc)


@COMBINE.flops
def _combine_flops(
    reads: Sequence[tuple[int, int]], writes: Sequence[tuple[int, int]], params: dict
):
    capacity, cols = reads[0]
    return combine_flops(params.get("expected_rows", capacity), cols)


# The Triton bodies live in moe_bodies.py (it reads the kinds above); importing it registers them.
from . import moe_bodies  # noqa: E402, F401
