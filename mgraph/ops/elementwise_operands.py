"""Operand forms of the elementwise op beside a plain tensor of the output's shape: ``bcast:``
(an operand broadcast over one run of leading dims, read through a row map) and ``gather:`` (a
relayout's result read from its source through the relayout's gather map). elementwise.py
lowers and checks them; its bodies read them (elementwise_bodies.py)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from functools import lru_cache
from typing import Any

from ..builder import split
from ..errors import OptionError
from ..layout import Layout, canonical, layout_runs
from .relayout import _rank_maps, relayout_feasible, steps_shape, tile_gathers
from .tilewise import parse_layout

__all__ = ["MAPS", "GATHER", "bcast_shape", "bcast_form", "row_map", "operand_maps",
           "gather_form", "gather_spec", "gather_fits"]

# Distinct row maps of broadcast operands one chain may read (cos and sin share one); per map a
# task's params hold A, M and ``lo``, the first operand row its region holds.
MAPS = 2
# The map code of a ``gather:`` operand (2 bits per input: 0 the output's rows, 1..MAPS a
# broadcast map); its tile's gather map (relayout's GPU params: base, row digits, column
# digits) is in the ``g_*`` params.
GATHER = 3


def bcast_shape(form: str) -> tuple[int, ...] | None:
    """The operand shape of a ``bcast:`` form; None for the other forms."""
    if not form.startswith("bcast:"):
        return None
    return tuple(int(d) for d in form[len("bcast:") :].split("x"))


def gather_form(in_shape: Sequence[int], steps: Sequence, in_layout: Sequence | None) -> str:
    """The ``gather:`` form of a relayout's result read from its source of ``in_shape``, held
    in ``in_layout`` (JSON, relayout's ``in_layout`` param), through ``steps``."""
    spec = [
        [int(d) for d in in_shape],
        [[str(k), [int(v) for v in a]] for k, a in steps],
        Layout.from_json(in_layout).to_json(),
    ]
    return "gather:" + json.dumps(spec, separators=(",", ":"))


@lru_cache(maxsize=256)
def gather_spec(form: str) -> tuple[tuple[int, ...], tuple, Layout] | None:
    """(source shape, steps, source layout) of a ``gather:`` form; None for the other forms."""
    if not form.startswith("gather:"):
        return None
    shape, steps, lay = json.loads(form[len("gather:") :])
    steps = tuple((str(k), tuple(int(v) for v in a)) for k, a in steps)
    return tuple(int(d) for d in shape), steps, Layout.from_json(lay)


@lru_cache(maxsize=256)
def _gathers(form: str, nd: tuple, lay: Layout, rank: int, world: int, tiles: tuple) -> Any:
    """(g_* params per tile, F, G) of a ``gather:`` operand on rank ``rank``: its map at
    output buffer (i, j) is F[i] + G[j] (relayout._rank_maps); None when some tile's map has
    no gather form. Cached: fuse_pointwise asks before the lowering does."""
    shape, steps, src = gather_spec(form)  # type: ignore[misc]
    dst = canonical(nd, lay, world)
    fits = tile_gathers(shape, steps, src, dst, rank, world, [(t0, t0 + n) for t0, _, n in tiles])
    if not all(fits):
        return None
    rows, cols = _rank_maps(shape, steps, src, dst, rank, world)  # type: ignore[misc]
    return [{f"g_{k}": v for k, v in f.items()} for f in fits], rows, cols


def _tiles(nd: tuple, lay: Layout, rank: int, world: int, tile_rows: int) -> tuple:
    """The tasks' tiles on rank ``rank``: (buffer row, global row, rows), none across two runs
    of the layout (so that ``row0`` maps a tile's rows)."""
    tiles, at = [], 0
    for g0, g1, _, _ in layout_runs(nd, lay, rank, world):
        tiles += [(at + t0, g0 + t0, t1 - t0) for t0, t1 in split(g1 - g0, tile_rows)]
        at += g1 - g0
    return tuple(tiles)


def gather_fits(
    form: str, shape: Sequence[int], layout: Sequence | None, world: int, tile_rows: int = 64
) -> bool:
    """Whether an op of ``shape`` in ``layout`` can read the ``gather:`` operand ``form``:
    every rank's source part holds what the rank reads, and each tile's map has a gather form."""
    spec = gather_spec(form)
    nd, lay = tuple(shape), parse_layout(layout)
    if spec is None or steps_shape(spec[0], spec[1]) != nd:
        return False
    if not relayout_feasible(spec[0], spec[1], spec[2], canonical(nd, lay, world), world):
        return False
    return all(
        _gathers(form, nd, lay, r, world, _tiles(nd, lay, r, world, tile_rows)) is not None
        for r in range(world)
    )


def bcast_form(shape: Sequence[int], out: Sequence[int]) -> str | None:
    """The ``bcast:`` form of an operand of ``shape`` read by an op of shape ``out``, or None
    when :func:`row_map` cannot express the broadcast (the last dim broadcast too, or the
    broadcast dims not one run of leading dims)."""
    shape, out = tuple(shape), tuple(out)
    if not shape or len(shape) > len(out) or shape[-1] != out[-1] or shape == out:
        return None
    padded = (1,) * (len(out) - len(shape)) + shape
    try:
        row_map(padded, out)
    except ValueError:
        return None
    return "bcast:" + "x".join(str(d) for d in padded)


def row_map(shape: Sequence[int], out: Sequence[int]) -> tuple[int, int]:
    """``(A, M)``: output row ``g`` of ``out`` (flat, all dims but the last) reads row
    ``(g // A) * M + g % M`` of an operand of ``shape`` (same rank) broadcast to it. ValueError
    unless the broadcast dims form one run (dims of size 1 in ``out`` are ignored)."""
    if len(shape) != len(out) or shape[-1] != out[-1]:
        raise ValueError(f"{list(shape)} is not {list(out)} broadcast over leading dims")
    bdims = []
    for i in range(len(out) - 1):
        if out[i] == 1 or shape[i] == out[i]:
            continue
        if shape[i] != 1:
            raise ValueError(f"{list(shape)} does not broadcast to {list(out)}")
        bdims.append(i)
    if not bdims:
        raise ValueError(f"{list(shape)} is not broadcast against {list(out)}")
    first, last = bdims[0], bdims[-1]
    if any(shape[i] != 1 and out[i] != 1 for i in range(first, last + 1)):
        raise ValueError(f"{list(shape)} broadcasts over more than one run of dims of {list(out)}")
    prod = 1
    for d in out[last + 1 : -1]:
        prod *= d
    span = prod
    for d in out[first : last + 1]:
        span *= d
    return span, prod


def operand_maps(forms: Sequence[str], shape: Sequence[int]) -> tuple[list[int], list[tuple]]:
    """(map code per input, the distinct ``(A, M)`` maps): code 0 reads the output's rows, code
    ``k`` map ``k - 1``, GATHER the ``gather:`` operand. ``forms``: every input's, ``x`` first.
    OptionError past MAPS maps, two gather forms, or a mapped input past the 15 that the
    ``maps`` param packs (2 bits each)."""
    codes: list[int] = []
    maps: list[tuple[int, int]] = []
    gathers = {f for f in forms if f.startswith("gather:")}
    if len(gathers) > 1 or (gathers and len(forms) > 15):
        raise OptionError(
            "elementwise: more than one gather operand, or past the 15th input",
            hint="keep the other relayouts as relayout ops",
        )
    for k, form in enumerate(forms):
        if form.startswith("gather:"):
            codes.append(GATHER)
            continue
        b = bcast_shape(form)
        if b is None:
            codes.append(0)
            continue
        m = row_map(b, shape)
        if m not in maps:
            maps.append(m)
        if len(maps) > MAPS or k >= 15:
            raise OptionError(
                f"elementwise: more than {MAPS} distinct broadcast maps, or a broadcast operand "
                "past the 15th input",
                hint="split the chain into several elementwise ops",
            )
        codes.append(maps.index(m) + 1)
    return codes, maps
