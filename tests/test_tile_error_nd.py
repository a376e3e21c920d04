"""worst_tile_error on outputs of more than two dims (ring attention's [B, H, S, D]): the rows
are every leading dim folded, so a [1, 4, 1024, 128] output has 32 tiles, not zero."""

from __future__ import annotations

import torch

from mgraph.runtime.memory import worst_tile_error


def test_four_dim_outputs_are_checked_tile_by_tile():
    want = torch.randn(1, 4, 1024, 128)
    got = want + 1e-4 * torch.randn_like(want)
    assert worst_tile_error(got, want) < 1e-3
    got[0, 2, 500:503, 7:10] += 1.0  # one racy tile in the third head
    assert ((got - want).norm() / want.norm()).item() < 1e-2
    assert worst_tile_error(got, want) > 1e-2
    got[0, 3, 1023, 127] = float("nan")  # an unwritten element in the last tile
    assert worst_tile_error(got, want) == float("inf")


def test_short_edge_tiles_are_checked_too():
    """A 1000 x 1000 output has a short last tile row (104 rows) and column (104 columns): a
    mis-masked element there fails the check as one in a whole tile does."""
    want = torch.randn(1000, 1000)
    got = want + 1e-4 * torch.randn_like(want)
    assert worst_tile_error(got, want) < 1e-3
    got[990:993, 995:998] += 1.0  # in the corner tile, which has 104 x 104 elements
    assert ((got - want).norm() / want.norm()).item() < 1e-2
    assert worst_tile_error(got, want) > 1e-2
