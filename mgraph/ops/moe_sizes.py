"""moe_dispatch_combine's sizing rules, from the sizes alone: the segment capacity and the drop
policy it implies (``segment_capacity``, ``kept_picks``), the bytes one rank allocates
(``rank_bytes``), and the tiles the op takes for options left unset (``auto_tiles``). Split
from moe_dispatch_combine.py (its module docstring, "Capacity", says what they mean)."""

from __future__ import annotations

import math

import torch

from .moe_tiles import META_COLS, route_topk

__all__ = ["segment_capacity", "kept_picks", "rank_bytes", "auto_tiles", "AUTO_ROWS",
           "AUTO_GROUP", "AUTO_COLS"]


def segment_capacity(
    tokens_per_rank: int, E: int, top_k: int, capacity_factor: float, tile_rows: int
) -> int:
    """Rows of one (source rank, expert) segment: ``capacity_factor`` times an expert's mean load
    from one rank, rounded up to whole expert tiles, at most ``tokens_per_rank`` (which never
    drops)."""
    want = math.ceil(capacity_factor * tokens_per_rank * top_k / E)
    tiles = -(-want // tile_rows)
    return max(tile_rows, min(tokens_per_rank, tiles * tile_rows))


def kept_picks(
    router_logits: torch.Tensor,
    top_k: int,
    tokens_per_rank: int,
    capacity: int,
    normalize: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The routing (``route_topk``) and its drop policy: ``(weights [T, k] fp32, experts [T, k],
    kept [T, k] bool)``; a pick is kept when fewer than ``capacity`` earlier tokens of its
    source rank (consecutive ``tokens_per_rank`` rows) picked the same expert."""
    weights, experts = route_topk(router_logits, top_k, normalize)
    T, E = router_logits.shape
    hits = torch.zeros(T, E, dtype=torch.int32, device=router_logits.device)
    hits.scatter_(1, experts, 1)
    # a token's place among its source's tokens that picked the expert (0 for the first)
    place = hits.view(T // tokens_per_rank, tokens_per_rank, E).cumsum(1).view(T, E) - 1
    return weights, experts, place.gather(1, experts) < capacity


def rank_bytes(
    nodes: int,
    gpus_per_node: int,
    T: int,
    H: int,
    E: int,
    top_k: int,
    F: int,
    itemsize: int,
    expert_rows: int = 64,
    capacity_factor: float = 4.0,
) -> int:
    """Bytes of the buffers of one rank of this op's graph (the sum in the module docstring's
    "Capacity"), from the sizes alone: what a run allocates per GPU."""
    W = nodes * gpus_per_node
    T_loc, E_loc = T // W, E // W
    C = segment_capacity(T_loc, E, top_k, capacity_factor, min(expert_rows, T_loc))
    B, R = E_loc * C, (nodes - 1) * (gpus_per_node - 1)
    rows_h = (2 * W + 2 * (W - 1) + 2 * R) * B  # send, back, recv, ret, relay, relay_ret
    meta = (2 * W - 1 + R) * B * META_COLS * 4
    counts = (2 * W - 1 + R) * E_loc * 4
    picks = (2 * T_loc + 1) * E * 4  # the picks map and the rank's row of dropped
    shards = (2 * T_loc * H + T_loc * E + 3 * E_loc * H * F) * itemsize  # x, out, logits, weights
    return (rows_h * H + W * B * F) * itemsize + meta + counts + picks + shards


# The default tiles (every option left None): what measured fastest at issue 17's size on one
# H200 (benchmarks/NOTES.md v13: 512 expert rows, groups of 8 experts, the 128/512 column split:
# 9.3 ms against 14.6 ms for 64-row tiles, groups of 1 and no split), as a rule for any size.
AUTO_ROWS = (512, 256, 128, 64)
AUTO_GROUP = 8
AUTO_COLS = (128, 512)  # (expert_cols_f, expert_cols_h)


def auto_tiles(T_loc: int, H: int, E_loc: int, E: int, top_k: int, F: int,
               capacity_factor: float, expert_rows: int | None = None,
               expert_split: bool | None = None) -> dict[str, int | None]:
    """The tiles the op uses for options left None. ``expert_rows``: the largest of AUTO_ROWS
    that divides both T/W and the segment capacity 64-row tiles give (so the capacity, and with
    it the drop policy, is what it was with 64-row tiles), else 64 (or T/W, if smaller).
    ``expert_group``: the largest divisor of E/W up to AUTO_GROUP. The column split (AUTO_COLS)
    where each tile has at least 128 rows (with fewer, v13 measured the split slower) and F and
    H divide into at least two slices; ``expert_split=True`` asks for it wherever F and H
    divide."""
    base = min(64, T_loc)
    cap = segment_capacity(T_loc, E, top_k, capacity_factor, base)
    rows = next((t for t in AUTO_ROWS if t <= cap and cap % t == 0 and T_loc % t == 0), base)
    if expert_rows is not None:
        rows = expert_rows
    group = max(g for g in range(1, AUTO_GROUP + 1) if E_loc % g == 0)
    f, h = AUTO_COLS
    divides = F % f == 0 and H % h == 0 and F >= 2 * f and H >= 2 * h
    split = divides and (expert_split or (expert_split is None and min(rows, T_loc) >= 128))
    return {"expert_rows": rows, "expert_group": group,
            "expert_cols_f": f if split else None, "expert_cols_h": h if split else None}
