"""What a graph JSON must satisfy beyond its field types (mgraph/serialize.py checks those):
references between records (ranks, buffers, events, kinds), regions inside their buffers, no
duplicate buffers, at least one task, and the size guard. Each failure names the field's path.

These are the checks that make a loaded graph safe to allocate and run; the ordering rules
(cycles, races, unsatisfiable waits) stay with ``TaskGraph.validate()``.
"""

from __future__ import annotations

from typing import Any

from .errors import GraphFileError, SizeLimitError, TopologyError
from .graph import ITEMSIZE
from .kinds import KINDS
from .settings import Settings
from .topology import Topology

__all__ = ["check_document"]


def check_document(doc: Any, source: str, settings: Settings) -> None:
    """GraphFileError (or SizeLimitError) for the first rule ``doc`` (a parsed _Graph) breaks."""

    def bad(path: str, what: str, hint: str = "fix or regenerate the file") -> GraphFileError:
        return GraphFileError(f"{source}: field {path}: {what}", hint=hint)

    try:
        topo = Topology.parse(doc.topology)
    except TopologyError as exc:
        raise bad("topology", exc.message, 'write it as NODESxGPUS, e.g. "2x8"') from None
    world = topo.world_size
    if not doc.tasks:
        raise bad("tasks", "the graph has no tasks (nothing would run)")
    if len(doc.tasks) > settings.max_tasks:
        raise SizeLimitError(
            f"{source}: {len(doc.tasks)} tasks, above the limit {settings.max_tasks}",
            hint="raise MGRAPH_MAX_TASKS if the graph is meant to be this large",
        )
    shapes: dict[str, tuple[int, int]] = {}
    total = 0
    for i, b in enumerate(doc.buffers):
        if b.rank >= world:
            raise bad(f"buffers[{i}].rank", f"rank {b.rank} is outside topology {topo} "
                      f"(0..{world - 1})")
        bid = f"{b.name}@{b.rank}"
        if bid in shapes:
            raise bad(f"buffers[{i}]", f"buffer {bid!r} is defined twice")
        shapes[bid] = (b.rows, b.cols)
        total += b.rows * b.cols * ITEMSIZE[b.dtype]
        if b.binding is not None:
            specs = doc.inputs if b.role == "input" else doc.outputs
            if b.role == "scratch" or b.binding[0] not in specs:
                raise bad(f"buffers[{i}].binding", f"binds {b.binding[0]!r}, which is not a "
                          f"global {'input' if b.role == 'input' else 'output'} of the graph")
    if total > settings.max_bytes:
        raise SizeLimitError(
            f"{source}: the buffers take {total / 2**30:.3g} GiB, above the limit "
            f"{settings.max_bytes / 2**30:.3g} GiB",
            hint="raise MGRAPH_MAX_BYTES if the graph is meant to be this large",
        )
    for i, (rank, _name) in enumerate(doc.events):
        if rank >= world:
            raise bad(f"events[{i}]", f"rank {rank} is outside topology {topo}")
    n_events = len(doc.events)
    for i, t in enumerate(doc.tasks):
        where = f"tasks[{i}]"
        if t.rank >= world:
            raise bad(f"{where}.rank", f"rank {t.rank} is outside topology {topo}")
        if t.kind not in KINDS:
            raise bad(f"{where}.kind", f"unknown task kind {t.kind!r}; known: "
                      f"{', '.join(sorted(KINDS))}")
        for field in ("reads", "writes"):
            for j, (buf, r0, r1, c0, c1) in enumerate(getattr(t, field)):
                if buf not in shapes:
                    raise bad(f"{where}.{field}[{j}]", f"unknown buffer {buf!r}")
                rows, cols = shapes[buf]
                if not (r0 < r1 <= rows and c0 < c1 <= cols):
                    raise bad(f"{where}.{field}[{j}]", f"region [{r0}:{r1}, {c0}:{c1}] is "
                              f"empty or outside buffer {buf!r} ({rows}x{cols})")
        for j, (event, _count) in enumerate(t.waits):
            if event >= n_events:
                raise bad(f"{where}.waits[{j}]", f"event {event} does not exist "
                          f"({n_events} events)")
        for j, event in enumerate(t.signals):
            if event >= n_events:
                raise bad(f"{where}.signals[{j}]", f"event {event} does not exist "
                          f"({n_events} events)")
