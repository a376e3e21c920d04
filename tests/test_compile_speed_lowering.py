"""Compile-speed rewrites of the lowerings that must not change a task: relayout fits a
replicated chain's tiles once for all ranks (every rank's gather map is the same there, and only
there)."""

from __future__ import annotations

import sys

import pytest

import mgraph  # noqa: F401  (registers the ops; mgraph.ops.relayout is the op, not the module)
from mgraph.layout import REPLICATE, ROWS, Layout
from mgraph.ops import relayout as _op  # noqa: F401

R = sys.modules["mgraph.ops.relayout"]

SHAPE = (1, 2, 16, 8)
STEPS = (("permute", (0, 2, 1, 3)),)
TILES = [(0, 8), (8, 16), (16, 24), (24, 32)]


def test_rank_free_relayouts_fit_the_same_tiles_on_every_rank():
    assert R._rank_free(REPLICATE, REPLICATE, 4)
    fits = [R.tile_gathers(SHAPE, STEPS, REPLICATE, REPLICATE, r, 4, TILES) for r in range(4)]
    assert all(f == fits[0] for f in fits) and all(fits[0])


@pytest.mark.parametrize(
    ("src", "dst"),
    [(Layout("shard", 2), REPLICATE), (REPLICATE, Layout("shard", 1)), (ROWS, ROWS)],
)
def test_sharded_relayouts_are_fitted_per_rank(src, dst):
    # the shortcut must not apply where ranks' maps differ: here they do
    assert not R._rank_free(src, dst, 4)
    assert R._rank_free(src, dst, 1)
    tiles = TILES[:1]
    fits = [R.tile_gathers(SHAPE, STEPS, src, dst, r, 4, tiles) for r in range(4)]
    assert any(f != fits[0] for f in fits)
