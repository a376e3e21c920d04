"""Tiling and chunking helpers shared by the collective lowerings.

A tile is ``(row0, row1, col0, col1)`` of an output matrix. Network chunks group consecutive
tiles of one tile row (so a chunk is one rectangle) until they reach ``chunk_bytes``: the proxy
then moves one rectangle per command instead of one tile.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING

from ..errors import ShapeError
from ..graph import Buffer, Region, Task
from ..kinds import KINDS, Role, TaskKind

if TYPE_CHECKING:
    from ..builder import GraphBuilder
    from ..topology import Topology

__all__ = [
    "NETWORK_CHUNK_BYTES",
    "NODE_CHUNK_BYTES",
    "default_chunk_bytes",
    "Tile",
    "tile_grid",
    "partition",
    "group_chunks",
    "bounding",
    "tile_region",
    "shift",
    "row_chunks",
    "rotated",
    "unique_tasks",
    "check_options",
    "grouped",
    "push_reduce",
]

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
_GEMM, _COPY, _REDUCE = TaskKind.GEMM.value, TaskKind.COPY.value, TaskKind.REDUCE.value
_COMPUTE = Role.COMPUTE.value


def gemm_task(
    b: GraphBuilder, rank: int, a: Buffer, w: Buffer, k: int, tile: Tile, dst: Buffer, **kw
) -> Task:
    """The GEMM task of output ``tile`` on ``rank``: ``a``'s rows of the tile (columns 0..k)
    times ``w``'s columns of it, into ``dst``'s tile (``kw``: signals, params, ...)."""
    # Hot (~18k calls in a 2x8 Llama layer): the three regions made directly, not through
    # Buffer.region's unpacking and assert (validation checks every region's bounds)
    t0, t1, c0, c1 = tile
    return b.task(
        rank, _COMPUTE, _GEMM,
        [_new(Region, (a.id, t0, t1, 0, k)), _new(Region, (w.id, 0, k, c0, c1))],
        [_new(Region, (dst.id, t0, t1, c0, c1))],
        name=f"gemm r{rank} [{t0}:{t1},{c0}:{c1}]",
        **kw,
    )


def gemm_flops(m: int, n: int, k: int) -> float:
    """The GEMM kind's flops hint (its facet, tiles.py) for an m x n tile over k: for
    lowerings that pass ``flops=`` once per tile shape instead of the builder's per-task call."""
    fn = KINDS[_GEMM].flops_fn
    return fn([(m, k), (k, n)], [(m, n)], {}) if fn is not None else 0.0


def gemm_tasks(
    b: GraphBuilder, rank: int, a: Buffer, w: Buffer, k: int, tiles: Sequence[Tile], dst: Buffer
) -> dict[Tile, Task]:
    """``gemm_task`` of each of ``tiles`` in order (no waits, signals or params), by tile."""
    # Hot (a 2x8 layer's reduce-scatters: 16k tiles): made in bulk (GraphBuilder.tasks_made),
    # the regions directly as in gemm_task, the flops hint once per tile shape
    cost: dict[tuple[int, int], float] = {}
    aid, wid, did = a.id, w.id, dst.id

    def specs() -> Iterator[tuple[list[Region], list[Region], tuple, str, float]]:
        for t0, t1, c0, c1 in tiles:
            flops = cost.get((t1 - t0, c1 - c0))
            if flops is None:
                flops = cost[(t1 - t0, c1 - c0)] = gemm_flops(t1 - t0, c1 - c0, k)
            yield (
                [_new(Region, (aid, t0, t1, 0, k)), _new(Region, (wid, 0, k, c0, c1))],
                [_new(Region, (did, t0, t1, c0, c1))],
                (),
                f"gemm r{rank} [{t0}:{t1},{c0}:{c1}]",
                flops,
            )

    return dict(zip(tiles, b.tasks_made(rank, _COMPUTE, _GEMM, specs()), strict=True))


def shift(tile: Tile, rows: int) -> Tile:
    """``tile`` moved down by ``rows`` (negative: up): global rows <-> a shard's local rows."""
    return (tile[0] + rows, tile[1] + rows, tile[2], tile[3])


def row_chunks(
    rows: int, row_bytes: int, tile_rows: int, chunk_bytes: int
) -> list[tuple[int, int]]:
    """[0, rows) cut into network chunks of about ``chunk_bytes``, whole rows each.

    Chunks are aligned to ``tile_rows``: a chunk is a whole number of row tiles, or, when one row
    tile is already larger than ``chunk_bytes``, an exact fraction of one. So a consumer tile
    waits for exactly the chunks holding its rows, never for a chunk that straddles into the next
    tile. ``rows`` need not be a multiple of ``tile_rows``: the last tile and chunk end at ``rows``.
    """
    fit = max(1, chunk_bytes // max(1, row_bytes))
    if fit >= tile_rows:
        step = fit // tile_rows * tile_rows
    else:
        step = max(d for d in range(1, fit + 1) if tile_rows % d == 0)
    return [(s, min(s + step, rows)) for s in range(0, rows, step)]


def rotated(count: int, start: int) -> list[int]:
    """``start, start+1, ..., start-1`` modulo ``count``: each rank begins with a different peer,
    so no single link or GPU is the first target of everyone."""
    return [(start + i) % count for i in range(count)]


def unique_tasks(tasks: Iterable[Task]) -> list[Task]:
    """``tasks`` without repeats (a chunk's task appears once per tile it covers), order kept."""
    seen: dict[int, Task] = {}
    for t in tasks:
        seen.setdefault(t.id, t)
    return list(seen.values())


# Default chunk sizes. Across nodes a chunk is one proxy command (~17 us of host work each,
# NOTES v6-v11): 1 MiB keeps the proxy off the critical path (simulated 2x8 GEMM+AR 1.06x at 256
# KiB, 1.53x at 1 MiB over sequential, NOTES v14; emulated 2x1 on 2 H200, v11: 256 KiB stopped,
# 1 MiB 0.72x, 4 MiB 0.92x). Inside a node a chunk is NVLink work: the size the one-node
# schedules were measured with.
NETWORK_CHUNK_BYTES = 1024 * 1024
NODE_CHUNK_BYTES = 256 * 1024


def default_chunk_bytes(topology: Topology, chunk_bytes: int | None) -> int:
    """``chunk_bytes`` when given, else the default for ``topology`` (above)."""
    if chunk_bytes is not None:
        return chunk_bytes
    return NETWORK_CHUNK_BYTES if topology.nodes > 1 else NODE_CHUNK_BYTES


def check_options(op: str, tile: Sequence[int], chunk_bytes: int | None) -> tuple[int, int]:
    """The ``tile`` and ``chunk_bytes`` options of a tiled collective, checked; returns the tile."""
    if len(tile) != 2 or any(isinstance(x, bool) or not isinstance(x, int) or x <= 0 for x in tile):
        raise ShapeError(
            f"{op}: tile={list(tile)!r} must be two positive ints [rows, cols]",
            hint="pass e.g. tile=[128, 256]",
        )
    if chunk_bytes is not None and (
        isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int) or chunk_bytes <= 0
    ):
        raise ShapeError(
            f"{op}: chunk_bytes={chunk_bytes!r} must be a positive int",
            hint="pass e.g. chunk_bytes=262144 (256 KiB per network command)",
        )
    return int(tile[0]), int(tile[1])


def grouped(tiles: Sequence[Tile], group_rows: int = 8) -> list[Tile]:
    """Row-major tiles reordered in bands of ``group_rows`` tile rows, column by column inside a
    band: consecutive GEMM tiles then share A rows and B columns in L2 (the order Triton's
    matmul tutorial uses; the megakernel's GEMM in this order measured 0.96x of cuBLAS at
    8192x8192x4096: benchmarks/NOTES.md v7)."""
    rows = sorted({t[0] for t in tiles})
    band_of = {r: i // group_rows for i, r in enumerate(rows)}
    return sorted(tiles, key=lambda t: (band_of[t[0]], t[2], t[0]))


def push_reduce(
    b: GraphBuilder,
    owner: int,
    sources: dict[int, tuple[Region, Task]],
    dst: Region,
    recv: dict[tuple[int, int], Buffer],
    name: str,
    *,
    fuse: bool = True,
) -> Task:
    """Sum one tile held by several GPUs of a node into ``dst`` on ``owner``.

    ``sources``: rank -> (its region of the tile, the task that finished it). The other ranks
    PUSH their region into the owner's receive buffer (same coordinates as their source buffer)
    over NVLink, then the owner adds everything from local memory in a compute task. Pushing,
    not pulling: a store to a peer is fire-and-forget while a load waits a round trip (pulling
    reduce bodies measured about 2 GB/s per program on H200). ``recv`` caches the owner's
    receive buffers by (owner, pusher); it is shared by every call of one lowering.

    ``fuse`` (the v2 data path): when a source tile is a GEMM tile's partial (a GEMM task that
    writes exactly that region), the push rides on the GEMM's epilogue: its write is MOVED to
    the owner's receive buffer (the tile is stored straight into the peer; no NVLink task, no
    local copy) and it signals the owner's event itself. Every lowering reads a GEMM partial of
    a non-owner only through this push. A separate NVLink copy task remains for other producers
    (an rdma arrival, a rail reduce whose result is also sent on).
    """
    # Hot (a 2x8 layer's reduce-scatters: ~2k calls of 8 sources): kinds compared as plain
    # strings (an enum's .value is a property call) and landings made without
    # NamedTuple.__new__.
    where = f"[{dst[1]}:{dst[2]},{dst[3]}:{dst[4]}]"
    pushes, reads = [], []
    for rank, (region, ready) in sources.items():
        if rank == owner:
            continue
        buf = recv.get((owner, rank))
        if buf is None:
            src_buf = b.buffers[region[0]]
            buf = recv[(owner, rank)] = b.buffer(
                f"{src_buf.name}_from{rank}", owner, src_buf.rows, src_buf.cols
            )
        _, r0, r1, c0, c1 = region
        landing = _new(Region, (buf.id, r0, r1, c0, c1))
        writes = ready.writes
        if fuse and ready.kind == _GEMM and len(writes) == 1 and writes[0] == region:
            ready.writes = [landing]
            pushes.append(ready)
        else:
            pushes.append(
                b.task(rank, Role.NVLINK, _COPY, [region], [landing],
                       waits=b.after(rank, [ready]), name=f"push r{rank}->r{owner} {name} {where}")
            )
        reads.append(landing)
    own = [sources[owner]] if owner in sources else []
    reads = [r for r, _ in own] + reads
    return b.task(owner, Role.COMPUTE, _REDUCE, reads, [dst],
                  waits=b.after(owner, [t for _, t in own] + pushes), name=f"{name} r{owner} {where}")
