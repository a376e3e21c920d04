"""Tile bodies of the MoE kinds: moe_route, moe_expert, moe_combine (CPU bodies and flops).

The graph is static but what flows through it is data-dependent: the route tile decides at run
time which rows of a send slot are filled, and writes that decision next to the rows as fp32
metadata, which travels with them. Every later tile reads the metadata instead of assuming a
routing, so the same graph is exact for any router output.

Send-slot layout (one per source rank): segment ``e`` (global expert) holds rows
``[e * T_loc, (e + 1) * T_loc)``; the tokens routed to ``e`` fill its first rows in ascending
token order and the rest are empty. A token picks an expert at most once, so ``T_loc`` rows per
segment is the worst case: no token is ever dropped. Metadata columns (``META_COLS``):
token index (local to the source rank), routing weight, local expert index; empty rows hold
``EMPTY_ROW`` = (-1, 0, -1) and zeros in the data rows.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from ..graph import Task
from ..kinds import TaskKind, kind_spec

__all__ = [
    "META_COLS",
    "EMPTY_ROW",
    "route_topk",
    "swiglu",
    "expert_flops",
    "combine_flops",
]

META_COLS = 3  # token index, weight, local expert
EMPTY_ROW = (-1.0, 0.0, -1.0)

ROUTE = kind_spec(TaskKind.MOE_ROUTE)
EXPERT = kind_spec(TaskKind.MOE_EXPERT)
COMBINE = kind_spec(TaskKind.MOE_COMBINE)


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


# -- moe_route: reads [x (T_loc, H), logits (T_loc, E)], writes [send (E*T_loc, H), meta] --------
@ROUTE.cpu
def _route_cpu(task: Task, reads: Sequence[torch.Tensor], writes: Sequence[torch.Tensor]) -> None:
    x, logits = reads
    send, meta = writes
    tokens, experts_total = logits.shape
    per_rank = task.params["experts_per_rank"]
    weights, experts = route_topk(logits, task.params["top_k"])
    send.zero_()
    meta.copy_(torch.tensor(EMPTY_ROW, dtype=meta.dtype).expand_as(meta))
    for e in range(experts_total):
        # nonzero() lists tokens in ascending order. Nothing downstream depends on the order
        # (the metadata names each row's token), but it keeps runs reproducible row for row.
        token, slot = (experts == e).nonzero(as_tuple=True)
        n = token.numel()
        if n == 0:
            continue
        assert n <= tokens, (task.name, e, n)  # top-k picks distinct experts
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


# -- moe_expert: reads [rows (n, H), meta (n, 3), w_gate (H, F), w_up (H, F), w_down (F, H)] ------
@EXPERT.cpu
def _expert_cpu(task: Task, reads: Sequence[torch.Tensor], writes: Sequence[torch.Tensor]) -> None:
    rows, meta, w_gate, w_up, w_down = reads
    (y,) = writes
    valid = meta[:, 0] >= 0
    assert bool((meta[valid, 2] == task.params["local_expert"]).all()), task.name
    # Empty rows are written too (zeros) so the return buffer never carries poison, but the
    # GEMMs only see the routed rows: on the GPU an empty tile exits after reading its metadata.
    y.zero_()
    if bool(valid.any()):
        y[valid] = swiglu(rows[valid], w_gate, w_up, w_down).to(y.dtype)


@EXPERT.flops
def _expert_flops(
    reads: Sequence[tuple[int, int]], writes: Sequence[tuple[int, int]], params: dict
):
    (capacity, hidden), (_, ffn) = reads[0], reads[2]
    # The lowering records the EXPECTED routed rows; without it this is the worst case.
    return expert_flops(params.get("expected_rows", capacity), hidden, ffn)


# -- moe_combine: reads [back (E*T_loc, cols), meta (E*T_loc, 3)], writes [out (T_loc, cols)] -----
@COMBINE.cpu
def _combine_cpu(task: Task, reads: Sequence[torch.Tensor], writes: Sequence[torch.Tensor]) -> None:
    back, meta = reads
    (out,) = writes
    valid = meta[:, 0] >= 0
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
