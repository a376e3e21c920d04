"""Tiling and chunking helpers shared by the collective lowerings.

A tile is ``(row0, row1, col0, col1)`` of an output matrix. Network chunks group consecutive
tiles of one tile row (so a chunk is one rectangle) until they reach ``chunk_bytes``: the proxy
then moves one rectangle per command instead of one tile.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..graph import Buffer, Region

__all__ = ["Tile", "tile_grid", "partition", "group_chunks", "bounding", "tile_region"]

Tile = tuple[int, int, int, int]


def tile_grid(rows: int, cols: int, tile_rows: int, tile_cols: int) -> list[Tile]:
    """Row-major tiles covering a rows x cols matrix."""
    return [
        (r, min(r + tile_rows, rows), c, min(c + tile_cols, cols))
        for r in range(0, rows, tile_rows)
        for c in range(0, cols, tile_cols)
    ]


def partition(items: Sequence, parts: int) -> list[list]:
    """``items`` cut into ``parts`` contiguous runs whose lengths differ by at most one."""
    n = len(items)
    base, extra = divmod(n, parts)
    out, start = [], 0
    for p in range(parts):
        size = base + (1 if p < extra else 0)
        out.append(list(items[start : start + size]))
        start += size
    return out


def group_chunks(tiles: Sequence[Tile], itemsize: int, chunk_bytes: int) -> list[list[Tile]]:
    """Consecutive tiles of one tile row grouped until a group holds ``chunk_bytes``."""
    chunks: list[list[Tile]] = []
    current: list[Tile] = []
    size = 0
    for t in tiles:
        if current and (t[0] != current[-1][0] or t[2] != current[-1][3] or size >= chunk_bytes):
            chunks.append(current)
            current, size = [], 0
        current.append(t)
        size += (t[1] - t[0]) * (t[3] - t[2]) * itemsize
    if current:
        chunks.append(current)
    return chunks


def bounding(tiles: Sequence[Tile]) -> Tile:
    return (
        min(t[0] for t in tiles),
        max(t[1] for t in tiles),
        min(t[2] for t in tiles),
        max(t[3] for t in tiles),
    )


def tile_region(buf: Buffer, tile: Tile) -> Region:
    return _new(Region, (buf.id, tile[0], tile[1], tile[2], tile[3]))


_new = tuple.__new__  # hot: a NamedTuple built without its slower __new__
