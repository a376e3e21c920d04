"""Tile bodies of the MoE kinds: moe_route, moe_move, moe_expert, moe_combine (CPU bodies, flops).

The graph is static but what flows through it is data-dependent: the route tile decides at run
time which rows of a send slot are filled, and writes that decision as counts and fp32
metadata rows, which travel with the data. Every later tile reads them instead of assuming a
routing, so the same graph is exact for any router output.

Send-slot layout (one per source rank): segment ``e`` (global expert) holds rows
``[e * T_loc, (e + 1) * T_loc)``; the tokens routed to ``e`` fill its first rows in ascending
token order. A token picks an expert at most once, so ``T_loc`` rows per segment is the worst
case: no token is ever dropped. Metadata columns (``META_COLS``): token index (local to the
source rank), routing weight, local expert index.

Counts travel as data: the route tile also writes ``counts [W, E_loc]`` (fp32, exact below
2**24), the filled rows of each segment, and every later tile reads them. Capacity bounds the
buffers, not the traffic: ``moe_move`` copies only the filled rows of each segment, an expert
tile computes only its filled rows (a tile past its segment's count returns at once), combine
reads only filled rows. Rows past a count are never written nor read (they hold whatever the
buffer held: stale or poison).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from ..errors import GraphError
from ..graph import Task
from ..kinds import Role, TaskKind, define_kind, kind_spec

__all__ = [
    "META_COLS",
    "route_topk",
    "swiglu",
    "expert_flops",
    "combine_flops",
    "MOE_MOVE",
    "filled_rows",
]

META_COLS = 3  # token index, weight, local expert
MOE_MOVE = "moe_move"

ROUTE = kind_spec(TaskKind.MOE_ROUTE)
EXPERT = kind_spec(TaskKind.MOE_EXPERT)
COMBINE = kind_spec(TaskKind.MOE_COMBINE)
# A transfer whose size is data: the COPY kind moves whole regions, and the builtin kinds are not
# ours to change, so the data-dependent copy is a kind of its own. RDMA is not among its roles:
# the proxy encodes its WRITEs at launch from the static regions (runtime/network.py).
MOVE = define_kind(
    MOE_MOVE,
    [Role.NVLINK],
    "copy the first counts[j] rows of each segment j (segment_rows rows) of reads[0] to writes[0]",
    params=("segment_rows",),
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


def route_topk(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Mixtral routing: top-k on the logits, softmax over those k values (fp32).

    Returns ``(weights [T, k] fp32, experts [T, k] int64)``. The reference and the route tile share
    it so that the tie-breaking of ``topk`` is identical in both.
    """
    values, experts = logits.float().topk(top_k, dim=-1)
    return torch.softmax(values, dim=-1), experts


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


# -- moe_route: reads [x (T_loc, H), logits (T_loc, E)], writes [send, meta, counts (W, E_loc)] --
@ROUTE.cpu
def _route_cpu(task: Task, reads: Sequence[torch.Tensor], writes: Sequence[torch.Tensor]) -> None:
    x, logits = reads
    send, meta, counts = writes
    tokens, experts_total = logits.shape
    per_rank = task.params["experts_per_rank"]
    weights, experts = route_topk(logits, task.params["top_k"])
    flat = counts.view(-1)  # [W, E_loc] row-major: global expert e is flat[e]
    flat.zero_()
    for e in range(experts_total):
        # nonzero() lists tokens in ascending order. Nothing downstream depends on the order
        # (the metadata names each row's token), but it keeps runs reproducible row for row.
        token, slot = (experts == e).nonzero(as_tuple=True)
        n = token.numel()
        if n == 0:
            continue
        assert n <= tokens, (task.name, e, n)  # top-k picks distinct experts
        flat[e] = n
        rows = slice(e * tokens, e * tokens + n)
        send[rows] = x[token].to(send.dtype)
        meta[rows, 0] = token.to(meta.dtype)
        meta[rows, 1] = weights[token, slot].to(meta.dtype)
        meta[rows, 2] = float(e % per_rank)


@ROUTE.flops
def _route_flops(reads: Sequence[tuple[int, int]], writes: Sequence[tuple[int, int]], params: dict):
    tokens, experts = reads[1]
    # A scan of the logits for the top-k, then a k-wide softmax per token.
    return float(tokens * experts + 4 * tokens * params.get("top_k", 1))


# -- moe_move: reads [src (S*seg, cols), counts (1, S)], writes [dst (S*seg, cols)] ---------------
@MOVE.cpu
def _move_cpu(task: Task, reads: Sequence[torch.Tensor], writes: Sequence[torch.Tensor]) -> None:
    src, counts = reads
    (dst,) = writes
    seg = task.params["segment_rows"]
    for j, n in enumerate(counts.reshape(-1).long().tolist()):
        if n:  # an empty segment moves nothing
            dst[j * seg : j * seg + n] = src[j * seg : j * seg + n]


@MOVE.flops
def _move_flops(reads: Sequence[tuple[int, int]], writes: Sequence[tuple[int, int]], params: dict):
    return 0.0


# -- moe_expert: reads [rows (n, H), meta (n, 3), count (1, 1), w_gate, w_up, w_down] -------------
@EXPERT.cpu
def _expert_cpu(task: Task, reads: Sequence[torch.Tensor], writes: Sequence[torch.Tensor]) -> None:
    rows, meta, count, w_gate, w_up, w_down = reads
    (y,) = writes
    # The tile covers rows [row0, row0 + len) of its segment; the count says how many are filled.
    n = min(max(int(count.item()) - task.params["row0"], 0), rows.shape[0])
    if n == 0:
        return  # an empty tile exits at once; its output rows are never moved nor read
    assert bool((meta[:n, 2] == task.params["local_expert"]).all()), task.name
    y[:n] = swiglu(rows[:n], w_gate, w_up, w_down).to(y.dtype)


@EXPERT.flops
def _expert_flops(
    reads: Sequence[tuple[int, int]], writes: Sequence[tuple[int, int]], params: dict
):
    (capacity, hidden), (_, ffn) = reads[0], reads[3]
    # The lowering records the EXPECTED routed rows; without it this is the worst case.
    return expert_flops(params.get("expected_rows", capacity), hidden, ffn)


# -- moe_combine: reads [back (E*T_loc, cols), meta (E*T_loc, 3), counts (W, E_loc)], writes out --
@COMBINE.cpu
def _combine_cpu(task: Task, reads: Sequence[torch.Tensor], writes: Sequence[torch.Tensor]) -> None:
    back, meta, counts = reads
    (out,) = writes
    valid = filled_rows(counts, out.shape[0])  # segments of T_loc rows, one per global expert
    token = meta[valid, 0].long()
    weight = meta[valid, 1].float()
    acc = torch.zeros(out.shape, dtype=torch.float32, device=out.device)
    acc.index_add_(0, token, back[valid].float() * weight[:, None])
    out.copy_(acc)


@COMBINE.flops
def _combine_flops(
    reads: Sequence[tuple[int, int]], writes: Sequence[tuple[int, int]], params: dict
):
    capacity, cols = reads[0]
    return combine_flops(params.get("expected_rows", capacity), cols)
