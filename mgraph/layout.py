"""Layouts: how one tensor is spread over the ranks, and the rows of it a rank's buffer holds.

A ``Layout`` is the placement the tracer reasons with (DTensor's vocabulary on a 1-D mesh of all
ranks): ``replicate``; ``shard`` along one dimension (``zigzag``: cut in 2W chunks and rank r
holds chunks r and 2W-1-r, ring attention's causal balance); ``rows``: the flattened leading
dimensions cut in W contiguous ranges (sequence parallelism over the tokens of a (B, S, H) tensor,
whatever B is).

The lowering compares layouts through ``runs``: every buffer is 2-D, the tensor viewed as
``(prod(shape[:-1]), shape[-1])`` (its *flat view*), and a buffer holds a list of row ranges of
that view stacked in buffer order, all over one column range. Two holdings with equal runs hold
the same elements in the same order, whatever N-D layout produced them; a reshape that keeps the
last dimension keeps the runs, so it moves no data.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import lru_cache
from typing import NamedTuple

from .builder import shard_range
from .errors import ShapeError

__all__ = [
    "Run",
    "Layout",
    "REPLICATE",
    "ROWS",
    "flat_shape",
    "binding_runs",
    "box_runs",
    "normalize_runs",
    "runs_pieces",
    "layout_pieces",
    "layout_runs",
    "check_layout",
    "view_layout",
    "permute_layout",
    "expand_layout",
    "slice_layout",
    "as_dim_shard",
    "canonical",
]

Run = tuple[int, int, int, int]  # flat rows [r0, r1) x columns [c0, c1)
Box = tuple[tuple[int, int], ...]


class Layout(NamedTuple):
    """``kind``: "replicate" | "shard" | "rows"; ``dim`` and ``zigzag`` only for "shard"."""

    kind: str
    dim: int = -1
    zigzag: bool = False

    def to_json(self) -> list:
        return [self.kind, self.dim, self.zigzag]

    @classmethod
    def from_json(cls, value: Sequence | None) -> Layout:
        if value is None:
            return REPLICATE
        return cls(str(value[0]), int(value[1]), bool(value[2]))

    def describe(self) -> str:
        if self.kind == "shard":
            return f"Shard({self.dim}{', zigzag' if self.zigzag else ''})"
        return "Replicate()" if self.kind == "replicate" else "Shard(tokens)"


REPLICATE = Layout("replicate")
ROWS = Layout("rows")


def flat_shape(shape: Sequence[int]) -> tuple[int, int]:
    """The 2-D view every buffer of a tensor of ``shape`` uses."""
    if len(shape) == 0:
        return (1, 1)
    return (math.prod(shape[:-1]), int(shape[-1]))


def box_runs(shape: Sequence[int], box: Box) -> list[Run]:
    """Runs of the flat view holding ``box`` (one range per dim), in row-major order of the box."""
    n = len(shape)
    if n <= 1:
        lo, hi = box[0] if n else (0, 1)
        return [(0, 1, lo, hi)]
    rows_dims = n - 1
    stride = [1] * rows_dims
    for d in range(rows_dims - 2, -1, -1):
        stride[d] = stride[d + 1] * shape[d + 1]
    # The rows of the box are contiguous from the first dim after which every row dim is full.
    k = rows_dims - 1
    while k > 0 and box[k] == (0, shape[k]):
        k -= 1
    c0, c1 = box[-1]
    out: list[Run] = []

    def walk(d: int, base: int) -> None:
        if d == k:
            out.append((base + box[k][0] * stride[k], base + box[k][1] * stride[k], c0, c1))
            return
        for i in range(box[d][0], box[d][1]):
            walk(d + 1, base + i * stride[d])

    walk(0, 0)
    return out


def normalize_runs(runs: Sequence[Run]) -> tuple[Run, ...]:
    """Consecutive runs that continue each other merged: the canonical form compared for reuse."""
    out: list[Run] = []
    for run in runs:
        if out and out[-1][1] == run[0] and out[-1][2:] == run[2:]:
            out[-1] = (out[-1][0], run[1], run[2], run[3])
        else:
            out.append(tuple(run))
    return tuple(out)


def binding_runs(shape: Sequence[int], pieces: Sequence[Box], cat_dim: int = 0) -> tuple[Run, ...]:
    """Runs of a buffer holding ``torch.cat([t[p] for p in pieces], cat_dim)`` (a Binding)."""
    pieces = [tuple(tuple(r) for r in p) for p in pieces]
    if len(pieces) == 1:
        return normalize_runs(box_runs(shape, pieces[0]))
    outer = pieces[0][:cat_dim]
    assert all(p[:cat_dim] == outer for p in pieces), "pieces must agree before cat_dim"
    runs: list[Run] = []

    def walk(d: int, fixed: tuple[tuple[int, int], ...]) -> None:
        if d == cat_dim:
            for p in pieces:
                runs.extend(box_runs(shape, fixed + p[cat_dim:]))
            return
        for i in range(outer[d][0], outer[d][1]):
            walk(d + 1, fixed + ((i, i + 1),))

    walk(0, ())
    return normalize_runs(runs)


def runs_pieces(runs: Sequence[Run]) -> tuple[Box, ...]:
    """The Binding pieces (over the flat 2-D view, cat along rows) of a holding's runs."""
    return tuple(((r0, r1), (c0, c1)) for r0, r1, c0, c1 in runs)


def _zigzag_segments(size: int, rank: int, world: int) -> list[tuple[int, int]]:
    chunk = size // (2 * world)
    mirror = 2 * world - 1 - rank
    return [(rank * chunk, (rank + 1) * chunk), (mirror * chunk, (mirror + 1) * chunk)]


def layout_pieces(
    shape: Sequence[int], layout: Layout, rank: int, world: int
) -> tuple[list[Box], int]:
    """(pieces, cat_dim) rank ``rank`` holds: the same form the ops' Bindings use."""
    full = tuple((0, n) for n in shape)
    if layout.kind == "replicate" or world == 1:
        return [full], 0
    if layout.kind == "rows":
        rows, cols = flat_shape(shape)
        return [((shard_range(rows, rank, world)), (0, cols))], 0
    d = layout.dim
    if layout.zigzag:
        segs = _zigzag_segments(shape[d], rank, world)
        return [full[:d] + (s,) + full[d + 1 :] for s in segs], d
    return [full[:d] + (shard_range(shape[d], rank, world),) + full[d + 1 :]], d


@lru_cache(maxsize=4096)
def _layout_runs(shape: tuple[int, ...], layout: Layout, rank: int, world: int):
    pieces, cat_dim = layout_pieces(shape, layout, rank, world)
    if layout.kind == "rows" and world > 1:
        return binding_runs(flat_shape(shape), pieces, 0)
    return binding_runs(shape, pieces, cat_dim)


def layout_runs(shape: Sequence[int], layout: Layout, rank: int, world: int) -> tuple[Run, ...]:
    """The runs rank ``rank``'s buffer holds under ``layout`` (cached: lowerings ask often)."""
    return _layout_runs(tuple(shape), layout, rank, world)


def check_layout(shape: Sequence[int], layout: Layout, world: int, where: str, hint: str) -> None:
    """ShapeError unless ``layout`` cuts ``shape`` evenly over ``world`` ranks."""
    if layout.kind == "replicate" or world == 1:
        return
    if layout.kind == "rows":
        size, what, parts = flat_shape(shape)[0], "the flattened token dims", world
    else:
        size, what = shape[layout.dim], f"dim {layout.dim}"
        parts = 2 * world if layout.zigzag else world
    if size % parts:
        raise ShapeError(
            f"{where}: {what} of shape {tuple(shape)} has size {size}, not divisible into "
            f"{parts} {'zigzag chunks' if layout.zigzag else 'shards'} (world size {world})",
            hint=hint,
        )


def canonical(shape: Sequence[int], layout: Layout, world: int) -> Layout:
    """One name per distinct set of runs: a shard along a dim with only unit dims before it
    (and not the last dim) is the token-row shard."""
    if world == 1:
        return REPLICATE
    if layout.kind == "shard":
        d = layout.dim % len(shape)
        layout = Layout("shard", d, layout.zigzag)
        if not layout.zigzag and d < len(shape) - 1 and all(n == 1 for n in shape[:d]):
            return ROWS
    return layout


def view_layout(
    src: Sequence[int], dst: Sequence[int], layout: Layout, world: int
) -> Layout | None:
    """The layout of ``t.view(dst)`` when ``t`` of shape ``src`` has ``layout``; None when the
    rank's elements are not one layout of the result (the caller then replicates first)."""
    if layout.kind == "replicate" or world == 1:
        return REPLICATE
    if layout.kind == "rows":
        # Rank r holds elements [r N/W, (r+1) N/W): rows of the result iff they start on its rows.
        return canonical(dst, ROWS, world) if flat_shape(dst)[0] % world == 0 else None
    d = layout.dim
    prefix = math.prod(src[:d])
    parts = 2 * world if layout.zigzag else world
    acc = 1
    for e, n in enumerate(dst):
        if acc == prefix and n != 1:
            # Per outer index the rank holds one contiguous block of prod(src[d:]) / parts
            # elements: the same block of dst when dim e carries exactly what dim d did.
            if n % parts or math.prod(dst[e:]) != math.prod(src[d:]):
                return None
            return canonical(dst, Layout("shard", e, layout.zigzag), world)
        acc *= n
        if acc > prefix:
            return None
    return None


def as_dim_shard(shape: Sequence[int], layout: Layout, world: int) -> Layout | None:
    """A token-row shard named as a shard of one dim (the first non-unit one), when it is one."""
    if layout.kind != "rows":
        return layout
    for d, n in enumerate(shape):
        if n != 1:
            return Layout("shard", d) if n % world == 0 else None
    return None


def permute_layout(
    shape: Sequence[int], perm: Sequence[int], layout: Layout, world: int
) -> Layout | None:
    """The layout of ``t.permute(perm)`` when ``t`` of ``shape`` has ``layout``."""
    if layout.kind == "replicate" or world == 1:
        return REPLICATE
    as_dim = as_dim_shard(shape, layout, world)
    if as_dim is None:
        return None
    out_shape = [shape[p] for p in perm]
    return canonical(out_shape, Layout("shard", list(perm).index(as_dim.dim), as_dim.zigzag), world)


def expand_layout(
    shape: Sequence[int], out: Sequence[int], layout: Layout, world: int
) -> Layout | None:
    """The layout of ``t.expand(out)``: a shard along a dim the expand keeps stays one (each rank
    repeats its own elements); None when no dim shard describes ``t``'s holding."""
    if layout.kind == "replicate" or world == 1:
        return REPLICATE
    as_dim = as_dim_shard(shape, layout, world)
    if as_dim is None or shape[as_dim.dim] != out[as_dim.dim]:
        return None
    return canonical(out, as_dim, world)


def slice_layout(
    shape: Sequence[int], out: Sequence[int], dim: int, layout: Layout, world: int
) -> Layout | None:
    """The layout of a slice of ``t`` along ``dim``: a shard along another dim stays one; a
    shard along ``dim`` itself is None (rank r's slice elements are not rank r's shard)."""
    if layout.kind == "replicate" or world == 1:
        return REPLICATE
    as_dim = as_dim_shard(shape, layout, world)
    if as_dim is None or as_dim.dim == dim % len(shape):
        return None
    return canonical(out, as_dim, world)
