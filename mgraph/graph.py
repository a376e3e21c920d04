"""The IR: Buffer, Region, Task, Event, TaskGraph.

A TaskGraph is a closed set of plain records (torch.fx style): every field is documented here and
everything later in the pipeline reads only these records.

- ``Buffer``: a 2-D allocation on one rank (rows x cols, dtype, role input/output/scratch).
  Tensors of any rank are viewed as 2-D (rows = product of all but the last dim). ``zeroed``
  buffers are filled with zeros before every launch (tasks accumulate into them). ``symmetric``
  is derived: true when a task of another rank reads or writes it (peer memory, registered RDMA
  memory). Input and output buffers carry a ``Binding``: which pieces of which GLOBAL tensor they
  hold, so every runtime shards inputs and gathers outputs the same way.
- ``Region``: a tile ``[row0:row1, col0:col1]`` of a buffer, named by the buffer's id.
- ``Event``: a counter on one rank. A waiter names (event, count); every signal adds one.
- ``Task``: runs on ``rank`` in ``role`` and does ``kind`` (a key of mgraph.kinds.KINDS) to its
  read and write regions, after all its waits are satisfied; then signals its events, possibly on
  other ranks. ``flops``/``bytes`` are cost hints, ``params`` kind-specific constants;
  ``params["accumulate"]`` makes a task's writes ADD into a ``zeroed`` buffer instead of storing
  (writes that accumulate into one region are not a race with each other).

Validation lives in mgraph/validate.py, statistics in mgraph/stats.py, JSON and text forms in
mgraph/serialize.py; TaskGraph exposes them as methods.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from .errors import DTypeError
from .topology import Topology

if TYPE_CHECKING:
    import networkx as nx

    from .stats import GraphStats

__all__ = [
    "DTYPES",
    "dtype_name",
    "torch_dtype",
    "Binding",
    "TensorSpec",
    "Buffer",
    "Region",
    "Event",
    "Task",
    "TaskGraph",
    "gc_paused",
]

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
ITEMSIZE = {name: torch.empty((), dtype=dt).element_size() for name, dt in DTYPES.items()}


def dtype_name(dtype: torch.dtype | str) -> str:
    """Canonical dtype name; raises DTypeError for dtypes mgraph does not compute in."""
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise DTypeError(
            f"unsupported dtype {dtype}", hint=f"use one of {', '.join(sorted(DTYPES))}"
        )
    return name


def torch_dtype(name: str) -> torch.dtype:
    return DTYPES[dtype_name(name)]


@contextmanager
def gc_paused() -> Iterator[None]:
    """The cyclic collector off while a graph is built, checked or scheduled; on exit it is on
    again (if it was) with what was allocated meanwhile moved to the oldest generation.

    A graph is ~10^6 small long-lived objects with no reference cycles. With the collector on,
    the collections their allocation triggers rescan all of them again and again and free
    none (~0.7 s of validate at 2x8). Re-enabled plainly, the first young collection after it
    still scans every one (~0.3 s at 2x8, in whatever runs next); gc.freeze + gc.unfreeze
    moves them to the oldest generation without a scan, where only a full collection, as
    rare as CPython makes it, visits them. The young generations are collected on entry
    (at most a few thousand objects, ~1 ms), so the caller's young garbage is freed as it
    would have been, not promoted with the graph. Skipped when the process froze objects
    itself (unfreeze would release its frozen objects too).
    """
    was_enabled = gc.isenabled()
    if was_enabled:
        gc.collect(1)
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            if gc.get_freeze_count() == 0:
                gc.freeze()
                gc.unfreeze()
            gc.enable()


class Binding(NamedTuple):
    """How a rank's buffer maps to a GLOBAL tensor.

    The buffer holds ``torch.cat([global[piece] for piece in pieces], dim=cat_dim)`` viewed as 2-D.
    Each piece is one (start, stop) range per dimension of the global tensor.
    """

    tensor: str
    pieces: tuple[tuple[tuple[int, int], ...], ...]
    cat_dim: int = 0


class TensorSpec(NamedTuple):
    """A global input or output tensor of the op."""

    shape: tuple[int, ...]
    dtype: str


class Region(NamedTuple):
    """``buffer[row0:row1, col0:col1]``."""

    buffer: str
    row0: int
    row1: int
    col0: int
    col1: int

    @property
    def shape(self) -> tuple[int, int]:
        return (self.row1 - self.row0, self.col1 - self.col0)

    @property
    def numel(self) -> int:
        return (self.row1 - self.row0) * (self.col1 - self.col0)

    def overlaps(self, other: Region) -> bool:
        return (
            self.buffer == other.buffer
            and self.row0 < other.row1
            and other.row0 < self.row1
            and self.col0 < other.col1
            and other.col0 < self.col1
        )

    def __str__(self) -> str:
        return f"{self.buffer}[{self.row0}:{self.row1},{self.col0}:{self.col1}]"


_new_region = tuple.__new__  # NamedTuple.__new__ is 3x slower; graphs hold 100k+ regions


@dataclass(slots=True)
class Buffer:
    """A 2-D allocation on one rank. ``id`` is ``name@rank`` and names it in regions."""

    name: str
    rank: int
    rows: int
    cols: int
    dtype: str
    role: str  # "input" | "output" | "scratch"
    binding: Binding | None = None
    symmetric: bool = False
    # True: every runtime fills the buffer with zeros before each launch, and tasks ACCUMULATE
    # into it (``params["accumulate"]``: their writes add, e.g. a GEMM epilogue's TMA
    # reduce-add into a peer's output). Peers' adds start after the launch's entry barrier, so
    # they never land before the owner's zeros.
    zeroed: bool = False
    id: str = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.id = f"{self.name}@{self.rank}"

    @property
    def shape(self) -> tuple[int, int]:
        return (self.rows, self.cols)

    @property
    def nbytes(self) -> int:
        return self.rows * self.cols * ITEMSIZE[self.dtype]

    def region(
        self, rows: tuple[int, int] | None = None, cols: tuple[int, int] | None = None
    ) -> Region:
        r0, r1 = rows if rows is not None else (0, self.rows)
        c0, c1 = cols if cols is not None else (0, self.cols)
        assert 0 <= r0 < r1 <= self.rows and 0 <= c0 < c1 <= self.cols, (self.id, rows, cols)
        return _new_region(Region, (self.id, r0, r1, c0, c1))


@dataclass(slots=True)
class Event:
    """A counter on one rank; ``name`` is for messages and timelines."""

    id: int
    rank: int
    name: str


@dataclass(slots=True)
class Task:
    """One tile of work on one rank in one role. See the module docstring."""

    id: int
    name: str
    rank: int
    role: str
    kind: str
    reads: list[Region]
    writes: list[Region]
    waits: list[tuple[int, int]] = field(default_factory=list)  # (event id, count)
    signals: list[int] = field(default_factory=list)  # event ids, +1 each
    flops: float = 0.0
    bytes: int = 0
    params: dict[str, Any] = field(default_factory=dict)


@dataclass
class TaskGraph:
    """Buffers, events and tasks of one fused op on one topology."""

    op: str
    topology: Topology
    dtype: str
    params: dict[str, Any]
    inputs: dict[str, TensorSpec]
    outputs: dict[str, TensorSpec]
    buffers: dict[str, Buffer]
    events: list[Event]
    tasks: list[Task]

    # -- lookups -----------------------------------------------------------------------------
    def buffer(self, buffer_id: str) -> Buffer:
        return self.buffers[buffer_id]

    def region_rank(self, region: Region) -> int:
        return self.buffers[region.buffer].rank

    def region_bytes(self, region: Region) -> int:
        return region.numel * ITEMSIZE[self.buffers[region.buffer].dtype]

    def tasks_on(self, rank: int) -> list[Task]:
        return [t for t in self.tasks if t.rank == rank]

    def signalers(self) -> dict[int, list[int]]:
        """event id -> ids of the tasks that signal it (one entry per signal)."""
        out: dict[int, list[int]] = {e.id: [] for e in self.events}
        for t in self.tasks:
            for e in t.signals:
                out[e].append(t.id)
        return out

    def waiters(self) -> dict[int, list[int]]:
        out: dict[int, list[int]] = {e.id: [] for e in self.events}
        for t in self.tasks:
            for e, _ in t.waits:
                out[e].append(t.id)
        return out

    # -- facets implemented in their own modules ---------------------------------------------
    def validate(self) -> TaskGraph:
        """Raise a GraphError subclass naming the offending tasks; return self when valid."""
        from .validate import validate

        validate(self)
        return self

    def stats(self) -> GraphStats:
        from .stats import graph_stats

        return graph_stats(self)

    def to_json(self) -> str:
        from .serialize import graph_to_json

        return graph_to_json(self)

    @classmethod
    def from_json(cls, text: str) -> TaskGraph:
        from .serialize import graph_from_json

        return graph_from_json(text)

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            f.write(self.to_json())

    @classmethod
    def load(cls, path: str) -> TaskGraph:
        """Read a graph JSON file; a missing file, a folder, garbage or a schema violation is a
        named GraphFileError/GraphError (mgraph.serialize.load_graph_file)."""
        from .serialize import load_graph_file

        return load_graph_file(path)

    def view(self, path: str | None = None, **kw: Any):
        """Write the offline HTML viewer of this graph (mgraph.viz.view; ``schedule=`` and
        ``trace=`` add the schedule and timeline tabs); returns the file's path."""
        from .viz import view

        return view(self, path, **kw)

    def to_text(self) -> str:
        from .serialize import graph_to_text

        return graph_to_text(self)

    def to_networkx(self) -> nx.MultiDiGraph:
        """Tasks as nodes; an edge per (signaller, waiter) pair, keyed by the event."""
        import networkx as nx

        g = nx.MultiDiGraph(op=self.op, topology=str(self.topology))
        for t in self.tasks:
            g.add_node(t.id, name=t.name, rank=t.rank, role=t.role, kind=t.kind, flops=t.flops)
        sig = self.signalers()
        for t in self.tasks:
            for e, count in t.waits:
                for src in set(sig[e]):
                    g.add_edge(src, t.id, key=e, event=self.events[e].name, count=count)
        return g

    def __repr__(self) -> str:
        return (
            f"TaskGraph(op={self.op!r}, topology={self.topology}, dtype={self.dtype}, "
            f"tasks={len(self.tasks)}, events={len(self.events)}, buffers={len(self.buffers)})"
        )
