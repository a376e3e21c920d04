"""Relayout: a chain of views, permutes, expands and slices (``t.view(...).transpose(1, 2)``,
head splits and merges, ``repeat_kv``'s expand, ``x[..., :d]``, one piece of ``chunk``/``split``)
applied to a distributed tensor, each rank producing its part of the result locally.

Steps: ``["view", shape]``, ``["permute", perm]``, ``["expand", shape]`` (a broadcast that copies:
the result holds every repeated element), ``["slice", [dim, start, end, step]]``.

The tracer fuses consecutive view/permute/transpose ops into one ``steps`` list and picks the
result's layout so that every rank already holds the elements its part needs (checked here: a
rank missing one raises). A view that keeps the last dim moves no data and never reaches this
op: the buffers' flat 2-D view is the same.

Tasks: one ``relayout`` compute task per ``tile_rows`` rows of the rank's output buffer; each
reads the rank's whole input buffer. CPU body: place the held runs in the global index space,
apply the steps, gather this tile's runs.

GPU body: a gather ``out[i, j] = in_buffer.flat[base + f(i) + g(j)]``, with ``f`` and ``g``
mixed-radix sums of up to :data:`DIGITS` digits (``((i // div_k) % radix_k) * stride_k``): head
splits and merges, transposes, expands (stride 0) and slices all have that form. The lowering
derives each rank's map by index arithmetic on the steps (``_Map``: no tensor of the relayout's
size is built), then fits each tile's row and column digits. A tile whose map has no such form
gets no GPU params (so the megakernel's encoder refuses the graph, naming the task, before
anything launches, and the reference backend still runs it); so does every tile of a chain whose
views regroup digits that no split of the earlier ones expresses (``x.permute(1, 0).reshape`` to
a shape that cuts across the permuted dims: torch copies there too). tests/test_relayout_maps.py
checks the derived maps against a fit of the CPU body run on the positions themselves.

The body has two paths, chosen once per task: when the innermost column digit is a stride-1 run
of whole 16-byte vectors and every other stride, the base and the output's pitch are multiples of
16 bytes (head splits and merges, repeat_kv's expand and last-dim slices, when the head size and
the slice bounds are multiples of 8 bf16 or 4 fp32 elements), it moves 16-byte vectors with
int32 offsets, the digits evaluated once per row and once per vector; otherwise it gathers
element by element in int64.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import lru_cache
from typing import Any

import torch

from ..builder import GraphBuilder, shard_range, split
from ..errors import ShapeError
from ..graph import Region, Task, _new_region
from ..kinds import Role, define_kind
from ..layout import (
    Layout,
    check_layout,
    flat_shape,
    layout_runs,
    runs_pieces,
)
from ..topology import Topology
from .abi import F_READ0, F_WRITE0, HAVE_TRITON
from .registry import OpDef
from .relayout_maps import (
    OP,
    Steps,
    _axes,
    _contiguous,
    _Map,
    _NoMap,
    _rank_maps,
    _restrict,
    _run_steps,
    _steps,
    steps_shape,
)

__all__ = ["relayout", "apply_steps", "steps_shape", "relayout_feasible"]

relayout = OpDef(OP, dims=("rows", "cols"), inputs=("x",), outputs=("out",))
DIGITS = 4  # mixed-radix digits per axis of a tile's gather map (see the module docstring)
_GPU_PARAMS = ("base", *(f"{axis}{k}{what}" for axis in "rc" for k in range(DIGITS)
                         for what in ("n", "s")))
RELAYOUT = define_kind("relayout", [Role.COMPUTE], "view/permute chain of a rank's part (steps)",
                       params=_GPU_PARAMS)

def apply_steps(t: torch.Tensor, steps: Sequence) -> torch.Tensor:
    for kind, arg in _steps(steps):
        if kind == "view":
            t = t.reshape(arg)
        elif kind == "permute":
            t = t.permute(arg)
        elif kind == "expand":
            t = t.expand(arg)
        else:
            dim, start, end, step = arg
            index = [slice(None)] * t.dim()
            index[dim] = slice(start, end, step)
            t = t[tuple(index)]
    return t


def _feasible_by_holding(
    shape: tuple, steps: Steps, src: Layout, dst: Layout, world: int
) -> int | None:
    """_feasible element by element, on full-size index tensors (chains with no sub-dim form)."""
    if src.kind == "replicate" or world == 1:
        return None
    out_shape = steps_shape(shape, steps)
    index = apply_steps(torch.arange(math.prod(shape)).reshape(shape), steps)
    index = index.reshape(flat_shape(out_shape))
    # Every element of a sharded layout lives on exactly one rank.
    holder = torch.full(flat_shape(shape), -1, dtype=torch.int32)
    for r in range(world):
        for r0, r1, c0, c1 in layout_runs(shape, src, r, world):
            holder[r0:r1, c0:c1] = r
    holder = holder.reshape(-1)
    for r in range(world):
        for r0, r1, c0, c1 in layout_runs(out_shape, dst, r, world):
            if not bool((holder[index[r0:r1, c0:c1].reshape(-1)] == r).all()):
                return r
    return None


def relayout_feasible(
    shape: Sequence[int], steps: Sequence, src: Layout, dst: Layout, world: int
) -> bool:
    return _feasible(tuple(shape), _steps(steps), src, dst, world) is None


@relayout.shapes
def _shapes(
    topology: Topology,
    rows: int,
    cols: int,
    in_shape: Sequence[int] | None = None,
    steps: Sequence = (),
    in_layout: Sequence | None = None,
    out_layout: Sequence | None = None,
    **_: object,
) -> dict[str, tuple]:
    shape = tuple(in_shape) if in_shape is not None else (rows, cols)
    if flat_shape(shape) != (rows, cols):
        raise ShapeError(f"{OP}: in_shape={list(shape)} does not flatten to {rows} x {cols}")
    out_shape = steps_shape(shape, steps)
    world = topology.world_size
    src, dst = Layout.from_json(in_layout), Layout.from_json(out_layout)
    check_layout(shape, src, world, OP, "choose sizes divisible by the world size")
    check_layout(out_shape, dst, world, OP, "choose sizes divisible by the world size")
    missing = _feasible(shape, _steps(steps), src, dst, world)
    if missing is not None:
        raise ShapeError(
            f"{OP}: rank {missing} does not hold every element its part of the result "
            f"({dst.describe()} of {list(out_shape)}) needs from {src.describe()} of {list(shape)}",
            hint="replicate the input first (in_layout=None)",
        )
    return {"x": (rows, cols), "out": flat_shape(out_shape)}


@relayout.reference
def _reference(
    x: torch.Tensor, in_shape: Sequence[int] | None = None, steps: Sequence = (), **_: object
) -> dict[str, torch.Tensor]:
    shape = tuple(in_shape) if in_shape is not None else tuple(x.shape)
    out = apply_steps(x.reshape(shape), steps)
    return {"out": out.reshape(flat_shape(out.shape)).contiguous()}


@relayout.lower
def _lower(
    b: GraphBuilder,
    rows: int,
    cols: int,
    in_shape: list[int] | None = None,
    steps: list = (),
    in_layout: list | None = None,
    out_layout: list | None = None,
    tile_rows: int = 128,
) -> None:
    shape = tuple(in_shape) if in_shape is not None else (rows, cols)
    out_shape = steps_shape(shape, steps)
    src, dst = Layout.from_json(in_layout), Layout.from_json(out_layout)
    b.global_input("x", (rows, cols))
    b.global_output("out", flat_shape(out_shape))
    # Replicated in and out (a head split or repeat_kv's expand of a replicated value): every
    # rank's gather map is the same, so its tiles are fitted once, not once per rank (at 2x8
    # the 16 fits took ~0.1 s of a warm compile). The fits are only read below.
    fitted: dict[tuple, tuple[list, list, list]] = {}
    same_maps = _rank_free(src, dst, b.world)
    for r in b.topo.ranks:
        x = b.bound_buffer("x", r, "x", runs_pieces(layout_runs(shape, src, r, b.world)))
        pieces = runs_pieces(layout_runs(out_shape, dst, r, b.world))
        out = b.bound_buffer("out", r, "out", pieces, role="output")
        common = {
            "in_shape": list(shape),
            "steps": [[k, list(a)] for k, a in _steps(steps)],
            "in_layout": src.to_json(),
            "out_layout": dst.to_json(),
            "rank": r,
            "world": b.world,
        }
        tiles = split(out.rows, tile_rows)
        key = tuple(tiles)
        if same_maps and key in fitted:
            tiles, fits, bands = fitted[key]
        else:
            maps = _rank_maps(shape, _steps(steps), src, dst, r, b.world)
            fits = _tile_fits(maps, tiles)
            if any(not digits for digits, _ in fits):
                tiles, fits = _aligned(maps, tiles, fits, tile_rows)
            bands = _column_bands(maps, tiles, x.rows, x.cols)
            if same_maps:
                fitted[key] = tiles, fits, bands
        # Hot: a traced layer's head splits and merges are ~half its tasks at 2x8 (42k), so
        # what every tile of the rank shares is made once: the regions read (a band of x's
        # columns per run of tiles, _column_bands) and the flops hint, which depends on no
        # tile (the kind's own facet, asked once).
        flops = RELAYOUT.flops_fn((), (), common)
        # Each task's params are ``{**common, "rows": [t0, t1], **digits, "base": base}``
        # (tile_gathers' params, "base" in its place after "rows"). The tiles of one fit share
        # its digits dict, so that dict is merged once into a template which each tile copies
        # and fills in (a copy of a 24-key dict is ~4x cheaper than merging it again).
        templates: dict[int, dict[str, Any]] = {}
        out_id, out_cols = out.id, out.cols
        made = []  # (write region, name, params) per tile, emitted together below
        for (t0, t1), (digits, base) in zip(tiles, fits, strict=True):
            template = templates.get(id(digits))  # the fits' dicts outlive this loop
            if template is None:
                template = templates[id(digits)] = {**common, "rows": None, **digits}
            params = template.copy()
            params["rows"] = [t0, t1]
            if digits:
                params["base"] = base
            made.append((
                # out.region((t0, t1)) without its bounds assert: split() keeps t1 <= out.rows
                _new_region(Region, (out_id, t0, t1, 0, out_cols)),
                f"relayout r{r} [{t0}:{t1}]",
                params,
            ))  # fmt: skip
        for i0, i1, box in bands:
            read = _new_region(Region, (x.id, *box))
            b.tasks_alike(r, Role.COMPUTE, RELAYOUT.name, [read], made[i0:i1], flops=flops)


def _column_bands(
    maps: tuple[torch.Tensor, torch.Tensor] | None, tiles: list[tuple[int, int]], xrows: int,
    xcols: int,
) -> list[tuple[int, int, tuple[int, int, int, int]]]:
    """(first tile, end tile, (row0, row1, col0, col1) of x) per run of consecutive tiles that
    read the same columns of x: what they read, not all of x. A head split of k at 2x8 read
    all 8 KV heads in every tile, so each tile waited for every rank's shard of k, gathered
    across both nodes; now it waits for its head's two (and mgraph.prune drops the tiles of
    heads no attention on the rank reads, and the copies only they read). All of x where the
    map wraps rows (its columns then say nothing) or has no sub-dim form."""
    whole = [(0, len(tiles), (0, xrows, 0, xcols))]
    if maps is None or not tiles:
        return whole
    # x's element (i, j) of the output buffer is at flat position F[i] + G[j] of x's buffer:
    # row F // xcols + G // xcols and column F % xcols + G % xcols when those never sum past
    # a row (then the two axes' extremes bound every tile's box)
    f_row, f_col = maps[0] // xcols, maps[0] % xcols
    g_row, g_col = maps[1] // xcols, maps[1] % xcols
    if int(f_col.max()) + int(g_col.max()) >= xcols:
        return whole
    sizes = torch.tensor([t1 - t0 for t0, t1 in tiles])
    tile_of = torch.repeat_interleave(torch.arange(len(tiles)), sizes)
    f_row, f_col = f_row[tiles[0][0]:tiles[-1][1]], f_col[tiles[0][0]:tiles[-1][1]]

    def per_tile(v: torch.Tensor, how: str) -> list[int]:
        out = torch.zeros(len(tiles), dtype=v.dtype)
        return out.scatter_reduce(0, tile_of, v, how, include_self=False).tolist()

    g = (int(g_row.min()), int(g_row.max()), int(g_col.min()), int(g_col.max()))
    boxes = zip(per_tile(f_row, "amin"), per_tile(f_row, "amax"), per_tile(f_col, "amin"),
                per_tile(f_col, "amax"), strict=True)
    bands: list[tuple[int, int, tuple[int, int, int, int]]] = []
    for i, (r0, r1, c0, c1) in enumerate(boxes):
        r0, r1, c0, c1 = r0 + g[0], r1 + g[1] + 1, c0 + g[2], c1 + g[3] + 1
        if bands and bands[-1][2][2:] == (c0, c1):
            first, _, (q0, q1, _, _) = bands[-1]
            bands[-1] = (first, i + 1, (min(q0, r0), max(q1, r1), c0, c1))
        else:
            bands.append((i, i + 1, (r0, r1, c0, c1)))
    return bands


def _aligned(
    maps: tuple[torch.Tensor, torch.Tensor] | None, tiles: list[tuple[int, int]], fits: list,
    tile_rows: int,
) -> tuple[list[tuple[int, int]], list]:
    """Tiles that line up with the row map's digits where ``tile_rows`` rows do not.

    A head split at 200 tokens (``[2, 200, 8, 16] -> [2, 8, 200, 16]``) maps row i through
    i % 200 and i // 200: a 128-row tile that crosses a multiple of 200 has no mixed-radix
    form, so it got no GPU params and the megakernel refused the graph. Tiles of T rows fit
    wherever T is a divisor of a digit's radix times the digits inside it (T = d * p_k, d |
    radix_{k+1}): the largest such T up to ``tile_rows`` is taken (the body's row block). The
    tiles are kept as they were when no T fits every tile."""
    digits = _fit_axis(maps[0]) if maps is not None and len(maps[0]) > 1 else None
    if not digits:
        return tiles, fits
    sizes, inner = set(), 1
    for radix, _ in digits:
        sizes.update(inner * d for d in range(1, radix + 1) if radix % d == 0)
        inner *= radix
    size = max(t for t in sizes if t <= tile_rows)
    aligned = split(tiles[-1][1], size)
    new = _tile_fits(maps, aligned)
    if all(d for d, _ in new):
        return aligned, new
    return tiles, fits


def _fit_axis(v: torch.Tensor) -> list[tuple[int, int]] | None:
    """(radix, stride) digits, innermost first, with v[i] - v[0] = sum of digit_k(i) * stride_k;
    None when more than DIGITS digits are needed. Every element is checked: level by level the
    first ``radix`` blocks of a period are compared, and the radices multiply up to len(v)."""
    n, v = len(v), v - v[0]
    digits, period = [], 1
    while period < n:
        if len(digits) == DIGITS:
            return None
        stride = int(v[period])
        # the longest run of whole periods that steps by ``stride``, then the largest radix
        # within it that divides what is left of n (the later digits repeat whole blocks)
        blocks = v[: n // period * period].view(-1, period)
        steps = torch.arange(blocks.shape[0]) * stride
        ok = (blocks == blocks[0] + steps[:, None]).all(dim=1)
        run = int(ok.long().cumprod(0).sum())  # whole periods before the first mismatch
        radix = max(r for r in range(1, run + 1) if (n // period) % r == 0)
        if radix == 1:
            return None
        digits.append((radix, stride))
        period *= radix
    return digits


def gather_params(rows: list[tuple[int, int]] | None, cols: list[tuple[int, int]] | None,
                  base: int) -> dict[str, int]:
    """The GPU params of a tile (see the module docstring) from its two axes' digits; {} when
    either axis has no fit."""
    if rows is None or cols is None:
        return {}
    out = {"base": base}
    for axis, digits in (("r", rows), ("c", cols)):
        digits = digits + [(1, 0)] * (DIGITS - len(digits))
        for k, (radix, stride) in enumerate(digits):
            out[f"{axis}{k}n"], out[f"{axis}{k}s"] = radix, stride
    return out


@lru_cache(maxsize=256)
def _feasible(shape: tuple, steps: Steps, src: Layout, dst: Layout, world: int) -> int | None:
    """The first rank that lacks an element its output part needs, or None.

    By index arithmetic: the map of each output element to the input coordinate that decides
    its holder (the flat row, the sharded dim's index, or its zigzag chunk), checked against the
    rank's range: where[i, j] = F[i] + G[j] takes every sum, so its extremes (or, for chunks,
    its few distinct values) decide. Chains with no sub-dim form are checked element by element.
    """
    if src.kind == "replicate" or world == 1:
        return None
    zero = [[(n, 0, None)] for n in shape]
    if src.kind == "rows":
        zero = [[(n, s, None)] for n, s in zip(shape, _contiguous(shape[:-1]), strict=False)]
        zero.append([(shape[-1], 0, None)])
    elif src.zigzag:
        zero[src.dim] = [(2 * world, 1, None), (shape[src.dim] // (2 * world), 0, None)]
    else:
        zero[src.dim] = [(shape[src.dim], 1, None)]
    try:
        coords = _Map(0, zero)
        out_shape = _run_steps(coords, shape, steps)
        for r in range(world):
            m = _Map(coords.base, coords.dims)
            _restrict(m, out_shape, dst, r, world)
            rows, cols = _axes(m)
            if src.kind == "shard" and src.zigzag:
                sums = rows.unique()[:, None] + cols.unique()[None, :]
                if not bool(((sums == r) | (sums == 2 * world - 1 - r)).all()):
                    return r
                continue
            if src.kind == "rows":
                lo, hi = layout_runs(shape, src, r, world)[0][:2]
            else:
                lo, hi = shard_range(shape[src.dim], r, world)
            if int(rows.min() + cols.min()) < lo or int(rows.max() + cols.max()) >= hi:
                return r
        return None
    except _NoMap:
        return _feasible_by_holding(shape, steps, src, dst, world)


def _rank_free(src: Layout, dst: Layout, world: int) -> bool:
    """Whether every rank has the same gather map (``_input_map`` and ``_restrict`` read the
    rank only for a sharded source or result on several ranks)."""
    return world == 1 or (src.kind == "replicate" and dst.kind == "replicate")


def tile_gathers(
    shape: Sequence[int], steps: Sequence, src: Layout, dst: Layout, rank: int, world: int,
    tiles: Sequence[tuple[int, int]],
) -> list[dict[str, int]]:
    """The GPU params of each tile (output buffer rows [t0, t1)) of rank ``rank``; {} for a
    tile whose map has no gather form."""
    return [
        {**digits, "base": base} if digits else {}
        for digits, base in _tile_fits(
            _rank_maps(tuple(shape), _steps(steps), src, dst, rank, world), tiles
        )
    ]


def _tile_fits(
    maps: tuple[torch.Tensor, torch.Tensor] | None, tiles: Sequence[tuple[int, int]],
) -> list[tuple[dict[str, int], int]]:
    """tile_gathers' params per tile, from the rank's gather maps (``_rank_maps``), as (the
    params with base 0, or {}; the tile's base): the tiles of a fit share its dict (the
    lowering builds each task's params from it)."""
    if maps is None:
        return [({}, 0) for _ in tiles]
    rows, cols = maps
    col_digits = _fit_axis(cols)
    col0 = int(cols[0])
    # A rank's tiles mostly repeat one row pattern: fit each distinct pattern once.
    firsts = rows.index_select(0, torch.tensor([t0 for t0, _ in tiles])).tolist()
    fits: dict[tuple[int, int], dict[str, int]] = {}  # (t1 - t0, pattern) -> params but base
    pattern: list[int] = [0] * len(tiles)
    for size in {t1 - t0 for t0, t1 in tiles}:
        which = [i for i, (t0, t1) in enumerate(tiles) if t1 - t0 == size]
        starts = torch.tensor([tiles[i][0] for i in which], dtype=torch.int64)
        index = (starts[:, None] + torch.arange(size)[None, :]).reshape(-1)
        # index_select: indexing by a tensor took 7 ms for 8k elements on torch 2.13's CPU
        block = rows.index_select(0, index).view(len(which), size)
        block = block - block[:, :1]
        if bool((block == block[0]).all()):  # the usual case, and 20x cheaper than unique
            fits[size, 0] = gather_params(_fit_axis(block[0]), col_digits, 0)
            continue
        unique, inverse = torch.unique(block, dim=0, return_inverse=True)
        for k, v in enumerate(unique):
            fits[size, k] = gather_params(_fit_axis(v), col_digits, 0)
        for i, k in zip(which, inverse.tolist(), strict=True):
            pattern[i] = k
    return [
        (fits[t1 - t0, k], first + col0)
        for (t0, t1), first, k in zip(tiles, firsts, pattern, strict=True)
    ]


@RELAYOUT.cpu
def _relayout_cpu(
    task: Task, reads: Sequence[torch.Tensor], writes: Sequence[torch.Tensor]
) -> None:
    p = task.params
    shape = tuple(p["in_shape"])
    rank, world = p["rank"], p["world"]
    runs = layout_runs(shape, Layout.from_json(p["in_layout"]), rank, world)
    # the task reads a box of x's buffer (_column_bands): placed in a buffer of NaN, so a box
    # that missed an element the steps take would show in the output
    _, q0, q1, p0, p1 = task.reads[0]
    fill = math.nan if reads[0].dtype.is_floating_point else 0
    x = torch.full((sum(r1 - r0 for r0, r1, _, _ in runs), runs[0][3] - runs[0][2]), fill,
                   dtype=reads[0].dtype)
    x[q0:q1, p0:p1] = reads[0]
    full = torch.empty(flat_shape(shape), dtype=reads[0].dtype)
    offset = 0
    for r0, r1, c0, c1 in runs:
        full[r0:r1, c0:c1] = x[offset : offset + r1 - r0]
        offset += r1 - r0
    out_shape = steps_shape(shape, p["steps"])
    result = apply_steps(full.reshape(shape), p["steps"]).reshape(flat_shape(out_shape))
    t0, t1 = p["rows"]
    offset = 0
    for r0, r1, c0, c1 in layout_runs(out_shape, Layout.from_json(p["out_layout"]), rank, world):
        lo, hi = max(t0, offset), min(t1, offset + r1 - r0)
        if lo < hi:
            src = result[r0 + lo - offset : r0 + hi - offset, c0:c1]
            writes[0][lo - t0 : hi - t0] = src
        offset += r1 - r0


@RELAYOUT.flops
def _relayout_flops(
    reads: Sequence[tuple[int, int]], writes: Sequence[tuple[int, int]], params: dict
):
    return 0.0


# -- megakernel tile body ------------------------------------------------------------------------
if HAVE_TRITON:
    import triton
    import triton.language as tl

    from .abi import F_PARAM0, load_region, param_i32

    _READ0, _WRITE0 = tl.constexpr(F_READ0), tl.constexpr(F_WRITE0)
    _DIGITS = tl.constexpr(DIGITS)
    _PARAM0 = tl.constexpr(F_PARAM0)

    @triton.jit
    def _digits(params, tp, first, i):
        """sum over the axis's digits of ((i // div_k) % radix_k) * stride_k (params from
        ``first``: radix, stride per digit, innermost first)."""
        i = i.to(tl.int64)
        out = tl.zeros_like(i)
        div = 1
        for k in tl.static_range(_DIGITS):
            radix = param_i32(params, tp, first + 2 * k).to(tl.int64)
            out += ((i // div) % radix) * param_i32(params, tp, first + 2 * k + 1).to(tl.int64)
            div = div * radix
        return out

    @triton.jit
    def _digit_sum(i, pp, MULT: tl.constexpr, RUN: tl.constexpr):
        """_digits in int32 on the task's params row ``pp`` (radix, stride per digit, innermost
        first): i // (n0 * n1) is i // n0 // n1. Four digits: DIGITS. The caller vouches that
        every sum is a multiple of MULT and that they come in runs of RUN consecutive values;
        the hints go on the last add here, not on the call's result outside: Triton 3.6
        drops a hint put on a call's result when it inlines the call (3.9 keeps it)."""
        out = (i % tl.load(pp)) * tl.load(pp + 1)
        i = i // tl.load(pp)
        out += (i % tl.load(pp + 2)) * tl.load(pp + 3)
        i = i // tl.load(pp + 2)
        out += (i % tl.load(pp + 4)) * tl.load(pp + 5)
        i = i // tl.load(pp + 4)
        out = out + (i % tl.load(pp + 6)) * tl.load(pp + 7)
        return tl.max_contiguous(tl.multiple_of(out, MULT), RUN)

    @triton.jit
    def _copy_runs(pp, src, dst, pitch, dm0, dn0, m, n, VEC: tl.constexpr, BLK_M: tl.constexpr,
                   BLK_N: tl.constexpr):
        """The gather when every source run of VEC columns is contiguous and VEC-aligned (the
        gate in relayout_tile): blocks of [BLK_M rows, BLK_N / VEC chunks, VEC], the map's
        digits evaluated once per row and once per chunk (int32), each chunk moved by one
        16-byte load and store whose contiguity and alignment Triton can prove."""
        NCH: tl.constexpr = BLK_N // VEC
        lane = tl.arange(0, VEC)[None, None, :]
        base = tl.load(pp)
        for i in range(0, m, BLK_M):
            om = i + tl.arange(0, BLK_M)
            rpos = tl.multiple_of(base + _digit_sum(om, pp + 1, VEC, 1), VEC)
            drow = tl.multiple_of((dm0 + om) * pitch + dn0, VEC)
            for j in range(0, n, BLK_N):
                oc = tl.multiple_of(j + tl.arange(0, NCH) * VEC, VEC)
                cpos = _digit_sum(oc, pp + 1 + 2 * _DIGITS, VEC, 1)
                mask = (om < m)[:, None, None] & (oc < n)[None, :, None]
                x = tl.load(src + (rpos[:, None, None] + cpos[None, :, None] + lane), mask=mask)
                tl.store(dst + (drow[:, None, None] + oc[None, :, None] + lane), x, mask=mask)

    @triton.jit
    def _gather(params, tp, src, dst, pitch, dm0, dn0, m, n, base, RB_M: tl.constexpr,
                RB_N: tl.constexpr):
        """The general gather, element by element in int64 (any strides, any alignment)."""
        for i in range(0, m, RB_M):
            for j in range(0, n, RB_N):
                om = i + tl.arange(0, RB_M)
                on = j + tl.arange(0, RB_N)
                mask = (om < m)[:, None] & (on < n)[None, :]
                pos = base + _digits(params, tp, 1, om)[:, None] + _digits(
                    params, tp, 1 + 2 * _DIGITS, on)[None, :]
                x = tl.load(src + pos, mask=mask)
                tl.store(dst + (dm0 + om)[:, None].to(tl.int64) * pitch + (dn0 + on)[None, :],
                         x, mask=mask)

    @RELAYOUT.triton
    @triton.jit
    def relayout_tile(tp, params, regions, bufaddr, bufrows, bufcols, DT: tl.constexpr,
                      RB_M: tl.constexpr, RB_N: tl.constexpr):
        """A gather: out[i, j] = in_buffer.flat[base + f(i) + g(j)] over the task's output
        rows (the fit of tile_gathers; no arithmetic, so no rounding).

        Fast path (_copy_runs), decided once per task: the column map's innermost digit is a
        contiguous run (stride 1) of a multiple of VEC = 16 bytes, every other stride, the
        base and the output's row pitch and corner are multiples of VEC, the buffers' bases
        are 16-byte aligned (encode.ALIGN guarantees 256) and both buffers have fewer than
        2^31 elements (int32 offsets: every partial digit sum is a position in the buffer).
        Head splits, merges, repeat_kv's expand and last-dim slices qualify when the head size
        and the slice bounds are multiples of VEC. Otherwise, the general int64 gather,
        element by element."""
        VEC: tl.constexpr = 128 // DT.primitive_bitwidth
        s_in, _a, _b, _c, _d = load_region(regions, tl.load(tp + _READ0))
        d, dm0, dm1, dn0, dn1 = load_region(regions, tl.load(tp + _WRITE0))
        src_addr = tl.load(bufaddr + s_in)
        dst_addr = tl.load(bufaddr + d)
        d_cols = tl.load(bufcols + d)
        m = dm1 - dm0
        n = dn1 - dn0
        pp = params + tl.load(tp + _PARAM0)  # the task's params: base, row digits, col digits
        small = (tl.load(bufrows + s_in).to(tl.int64) * tl.load(bufcols + s_in) < 2**31) & (
            tl.load(bufrows + d).to(tl.int64) * d_cols < 2**31)
        aligned = ((src_addr % 16) | (dst_addr % 16)) == 0
        # every row stride and the base (pp + 0..8 even offsets), the column digits past the
        # first, the run length, the output pitch, corner and width: multiples of VEC
        odd = tl.load(pp) | d_cols | dn0 | n | tl.load(pp + 9)
        for k in tl.static_range(_DIGITS):
            odd = odd | tl.load(pp + 2 + 2 * k)
        for k in tl.static_range(1, _DIGITS):
            odd = odd | tl.load(pp + 10 + 2 * k)
        if (tl.load(pp + 10) == 1) & (odd % VEC == 0) & aligned & small:
            # The hints go on values made in this branch: tl.multiple_of marks the op that
            # defines its argument, and a mark on a load outside would reach the other path.
            src = tl.multiple_of(src_addr.to(tl.pointer_type(DT)), 16)
            dst = tl.multiple_of(dst_addr.to(tl.pointer_type(DT)), 16)
            pitch = d_cols // VEC * VEC  # == d_cols here, and provably a multiple of VEC
            if n <= RB_N // 2:  # a head (64-128 columns): twice the rows per block instead
                _copy_runs(pp, src, dst, pitch, dm0, dn0, m, n, VEC, 2 * RB_M, RB_N // 2)
            else:
                _copy_runs(pp, src, dst, pitch, dm0, dn0, m, n, VEC, RB_M, RB_N)
        else:
            _gather(params, tp, src_addr.to(tl.pointer_type(DT)), dst_addr.to(tl.pointer_type(DT)),
                    d_cols.to(tl.int64), dm0, dn0, m, n, tl.load(pp).to(tl.int64), RB_M // 4,
                    RB_N // 2)
