"""Compile-speed rewrites of the lowerings that must not change a task: relayout fits a
replicated chain's tiles once for all ranks (every rank's gather map is the same there, and only
there), and builds each task's params without building tile_gathers' dicts first (the same
params, keys in the same order)."""

from __future__ import annotations

import math
import sys

import pytest

import mgraph as mg
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


@pytest.mark.parametrize(
    ("topology", "shape", "steps", "src", "dst"),
    [
        ("2x2", SHAPE, STEPS, REPLICATE, REPLICATE),
        ("2x2", SHAPE, STEPS, Layout("shard", 2), Layout("shard", 1)),
        # a reshape across the permuted dims: no gather form, no GPU params
        ("1x2", (4, 6), (("permute", (1, 0)), ("view", (4, 6))), REPLICATE, REPLICATE),
    ],
)
def test_relayout_params_are_tile_gathers_params(topology, shape, steps, src, dst):
    rows, cols = math.prod(shape[:-1]), shape[-1]
    g = mg.ops.relayout(rows=rows, cols=cols, in_shape=shape, steps=steps,
                        in_layout=src.to_json(), out_layout=dst.to_json(), tile_rows=8,
                        topology=topology)  # fmt: skip
    world = g.topology.world_size
    for r in range(world):
        tasks = [t for t in g.tasks if t.rank == r]
        tiles = [tuple(t.params["rows"]) for t in tasks]
        fits = R.tile_gathers(shape, steps, src, dst, r, world, tiles)
        for t, fit in zip(tasks, fits, strict=True):
            common = {k: v for k, v in t.params.items() if k not in fit}
            want = {**common, **fit}
            assert list(t.params.items()) == list(want.items())
            assert bool(fit) == (shape == SHAPE)


def test_writer_index_finds_the_overlapping_writers_in_note_order():
    # lower._WriterIndex answers readiness's "who wrote what this region reads" by bisection
    # over row bands, memoised by (bands, columns): it must equal a scan of every writer, in
    # the order noted (a task noted twice appears twice), on random tiles of mixed heights
    import random

    from mgraph.graph import Region, Task
    from mgraph.lower import _WriterIndex

    rng = random.Random(0)
    writers = []
    for i in range(300):
        r0, c0 = rng.randrange(0, 500), rng.randrange(0, 60)
        w = Region("buf@0", r0, r0 + rng.choice((1, 16, 128)), c0, c0 + rng.randrange(1, 40))
        task = Task(i % 250, f"t{i}", 0, "compute", "ewise", [], [w])
        writers.append((w, task))
    index = _WriterIndex(writers)
    for _ in range(400):
        r0, c0 = rng.randrange(0, 600), rng.randrange(0, 100)
        r = Region("buf@0", r0, r0 + rng.randrange(1, 200), c0, c0 + rng.randrange(1, 50))
        want = [t for w, t in writers if w.overlaps(r)]
        got = index.overlapping(r)
        assert got == want and all(a is b for a, b in zip(got, want, strict=True))
