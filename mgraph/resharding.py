"""Where every value of a traced program lives, and the tasks that move it between layouts.

A ``Holding`` is one buffer holding some runs of a value (layout.py: row ranges of the value's
flat 2-D view, stacked in buffer order). A value has one or more holdings per rank: the one its
producing op wrote, and any a later op asked for in another layout.

Resharding fills a new holding from the existing ones, each piece from the cheapest source:
the rank itself (a local ``copy`` task), a GPU of its node (an ``nvlink`` copy, pulled by the
receiver), its rail peer on another node (one ``rdma`` copy, the only cross-node link a
rail-optimised network has), or, for any other GPU of another node, an ``rdma`` copy to that
GPU's rail peer on the receiver's node followed by an ``nvlink`` copy from there. A piece relayed
to a node lands there once, however many of its GPUs need it. Every copy waits for the tasks that
wrote the rows it reads.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from itertools import pairwise

from .builder import GraphBuilder
from .graph import Buffer, Region, Task
from .kinds import Role, TaskKind
from .layout import Run

__all__ = ["Holding", "Resharder"]

COPY = TaskKind.COPY.value


@dataclass
class Holding:
    buffer: Buffer
    runs: tuple[Run, ...]
    offsets: list[int] = field(default_factory=list)  # first buffer row of each run

    def __post_init__(self) -> None:
        row = 0
        for r0, r1, _, _ in self.runs:
            self.offsets.append(row)
            row += r1 - r0

    def region(self, r0: int, r1: int, c0: int, c1: int) -> Region | None:
        """The buffer region holding flat rows [r0, r1) x cols [c0, c1), if one run has them."""
        for (a, b, x, y), off in zip(self.runs, self.offsets, strict=True):
            if a <= r0 and r1 <= b and x <= c0 and c1 <= y:
                return self.buffer.region((off + r0 - a, off + r1 - a), (c0 - x, c1 - x))
        return None


class Resharder:
    def __init__(self, builder: GraphBuilder) -> None:
        self.b = builder
        self.topo = builder.topo
        self.holdings: dict[str, dict[int, list[Holding]]] = defaultdict(lambda: defaultdict(list))
        self.writers: dict[str, list[tuple[Region, Task]]] = defaultdict(list)
        self.relayed: dict[tuple[Region, int], tuple[Region, Task]] = {}
        self.count: dict[str, int] = defaultdict(int)

    # -- bookkeeping --------------------------------------------------------------------------
    def add(self, value: str, rank: int, holding: Holding) -> None:
        self.holdings[value][rank].append(holding)

    def held(self, value: str) -> bool:
        return any(self.holdings[value].values())

    def on(self, value: str, rank: int) -> bool:
        return bool(self.holdings[value].get(rank))

    def primary(self, value: str, rank: int) -> Holding:
        return self.holdings[value][rank][0]

    def find(self, value: str, rank: int, runs: tuple[Run, ...]) -> Holding | None:
        for h in self.holdings[value].get(rank, ()):
            if h.runs == runs:
                return h
        return None

    def note_writer(self, region: Region, task: Task) -> None:
        self.writers[region.buffer].append((region, task))

    def producers(self, region: Region) -> list[Task]:
        """The tasks that wrote any part of ``region`` (none for a program input)."""
        # Region.overlaps inline (the writers are of the same buffer): ~40k tests at 2x8
        bid, r0, r1, c0, c1 = region
        return [
            t
            for w, t in self.writers.get(bid, ())
            if w[1] < r1 and r0 < w[2] and w[3] < c1 and c0 < w[4]
        ]

    # -- moving data --------------------------------------------------------------------------
    def reshard(self, value: str, rank: int, runs: tuple[Run, ...]) -> Holding:
        """A new holding of ``runs`` of ``value`` on ``rank``, filled from existing holdings."""
        b = self.b
        k = self.count[value]
        self.count[value] += 1
        rows = sum(r[1] - r[0] for r in runs)
        c0 = runs[0][2]
        buf = b.buffer(f"{value}~{k}", rank, rows, runs[0][3] - c0)
        target = Holding(buf, runs)
        for run, off in zip(runs, target.offsets, strict=True):
            for r0, r1, x0, x1, src in self._cover(value, rank, run):
                dst = buf.region((off + r0 - run[0], off + r1 - run[0]), (x0 - c0, x1 - c0))
                region = src.region(r0, r1, x0, x1)
                assert region is not None
                task = self._move(value, region, dst)
                self.note_writer(dst, task)
        self.add(value, rank, target)
        return target

    def _cover(self, value: str, rank: int, run: Run) -> list[tuple[int, int, int, int, Holding]]:
        """Rectangles covering ``run``, each with the cheapest holding that has it."""
        topo = self.topo
        candidates: list[tuple[int, Holding]] = []
        for q, hs in self.holdings[value].items():
            if q == rank:
                cost = 0
            elif topo.node_of(q) == topo.node_of(rank):
                cost = 1
            elif topo.local_of(q) == topo.local_of(rank):
                cost = 2
            else:
                cost = 3
            # a rank's first holding is the one its producer wrote; later ones were filled by
            # resharding, so copying from them waits for that fill
            candidates += [(cost + 0.5 * (i > 0), h) for i, h in enumerate(hs)]
        candidates.sort(key=lambda c: (c[0], c[1].buffer.rank))
        r0, r1, c0, c1 = run
        row_cuts, col_cuts = {r0, r1}, {c0, c1}
        for _, h in candidates:
            for a, b, x, y in h.runs:
                row_cuts.update(v for v in (a, b) if r0 < v < r1)
                col_cuts.update(v for v in (x, y) if c0 < v < c1)
        rows, cols = sorted(row_cuts), sorted(col_cuts)
        bands: list[tuple[int, int, list[tuple[int, int, Holding]]]] = []
        for a, b in pairwise(rows):
            segments: list[tuple[int, int, Holding]] = []
            for x, y in pairwise(cols):
                src = next((h for _, h in candidates if h.region(a, b, x, y) is not None), None)
                assert src is not None, f"no rank holds rows {a}:{b} cols {x}:{y} of {value}"
                if segments and segments[-1][2] is src and segments[-1][1] == x:
                    if src.region(a, b, segments[-1][0], y) is not None:
                        segments[-1] = (segments[-1][0], y, src)
                        continue
                segments.append((x, y, src))
            last = bands[-1] if bands else None
            if last is not None and _same_sources(last[2], segments):
                merged = (last[0], b, last[2])
                if all(h.region(merged[0], b, x, y) is not None for x, y, h in segments):
                    bands[-1] = merged
                    continue
            bands.append((a, b, segments))
        return [(a, b, x, y, h) for a, b, segs in bands for x, y, h in segs]

    def _move(self, value: str, src: Region, dst: Region) -> Task:
        """One copy of ``src`` into ``dst`` over the link their ranks share; returns the task
        after which ``dst`` holds the data."""
        b, topo = self.b, self.topo
        s, r = b.buffers[src.buffer].rank, b.buffers[dst.buffer].rank
        ready = self.producers(src)
        label = f"reshard {value} r{s}->r{r} [{dst.row0}:{dst.row1},{dst.col0}:{dst.col1}]"
        if s == r:
            return b.task(r, Role.COMPUTE, COPY, [src], [dst], waits=b.after(r, ready), name=label)
        if topo.node_of(s) == topo.node_of(r):
            return b.task(r, Role.NVLINK, COPY, [src], [dst], waits=b.after(r, ready), name=label)
        if topo.local_of(s) == topo.local_of(r):
            return b.task(s, Role.RDMA, COPY, [src], [dst], waits=b.after(s, ready), name=label)
        hop = topo.rail_peer(s, topo.node_of(r))
        staged = self.relayed.get((src, hop))
        if staged is None:
            k = self.count[f"{value}~relay"]
            self.count[f"{value}~relay"] += 1
            stage = b.buffer(f"{value}~relay{k}", hop, *src.shape).region()
            send = b.task(
                s,
                Role.RDMA,
                COPY,
                [src],
                [stage],
                waits=b.after(s, ready),
                name=f"reshard {value} r{s}->r{hop} (relay for r{r})",
            )
            staged = self.relayed[(src, hop)] = (stage, send)
        stage, send = staged
        return b.task(r, Role.NVLINK, COPY, [stage], [dst], waits=b.after(r, [send]), name=label)


def _same_sources(a: list[tuple[int, int, Holding]], b: list[tuple[int, int, Holding]]) -> bool:
    return len(a) == len(b) and all(
        x[0] == y[0] and x[1] == y[1] and x[2] is y[2] for x, y in zip(a, b, strict=True)
    )
