"""JSON (lossless, validated with pydantic on load) and text (deterministic, for golden tests)
forms of a TaskGraph."""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from .errors import GraphError
from .graph import Binding, Buffer, Event, Region, Task, TaskGraph, TensorSpec
from .topology import Topology

__all__ = ["graph_to_json", "graph_from_json", "graph_to_text", "FORMAT"]

FORMAT = "mgraph.taskgraph/1"

RegionRow = tuple[str, int, int, int, int]


class _Spec(BaseModel):
    shape: list[int]
    dtype: str


class _Buffer(BaseModel):
    name: str
    rank: int
    rows: int
    cols: int
    dtype: str
    role: str
    binding: tuple[str, list[list[tuple[int, int]]], int] | None = None
    symmetric: bool = False


class _Task(BaseModel):
    name: str
    rank: int
    role: str
    kind: str
    reads: list[RegionRow]
    writes: list[RegionRow]
    waits: list[tuple[int, int]] = []
    signals: list[int] = []
    flops: float = 0.0
    bytes: int = 0
    params: dict[str, Any] = {}


class _Graph(BaseModel):
    model_config = ConfigDict(extra="forbid")

    format: str
    op: str
    topology: str
    dtype: str
    params: dict[str, Any]
    inputs: dict[str, _Spec]
    outputs: dict[str, _Spec]
    buffers: list[_Buffer]
    events: list[tuple[int, str]]  # (rank, name); the id is the position
    tasks: list[_Task]


def graph_to_json(g: TaskGraph) -> str:
    doc = {
        "format": FORMAT,
        "op": g.op,
        "topology": str(g.topology),
        "dtype": g.dtype,
        "params": g.params,
        "inputs": {k: {"shape": list(v.shape), "dtype": v.dtype} for k, v in g.inputs.items()},
        "outputs": {k: {"shape": list(v.shape), "dtype": v.dtype} for k, v in g.outputs.items()},
        "buffers": [
            {
                "name": b.name,
                "rank": b.rank,
                "rows": b.rows,
                "cols": b.cols,
                "dtype": b.dtype,
                "role": b.role,
                "binding": None
                if b.binding is None
                else [b.binding.tensor, b.binding.pieces, b.binding.cat_dim],
                "symmetric": b.symmetric,
            }
            for b in g.buffers.values()
        ],
        "events": [[e.rank, e.name] for e in g.events],
        "tasks": [
            {
                "name": t.name,
                "rank": t.rank,
                "role": t.role,
                "kind": t.kind,
                "reads": [list(r) for r in t.reads],
                "writes": [list(w) for w in t.writes],
                "waits": [list(w) for w in t.waits],
                "signals": t.signals,
                "flops": t.flops,
                "bytes": t.bytes,
                "params": t.params,
            }
            for t in g.tasks
        ],
    }
    return json.dumps(doc, separators=(",", ":"))


def graph_from_json(text: str) -> TaskGraph:
    try:
        doc = _Graph.model_validate_json(text)
    except ValidationError as exc:
        raise GraphError(f"not a valid mgraph task graph JSON: {exc}") from None
    if doc.format != FORMAT:
        raise GraphError(f"graph JSON format {doc.format!r}; this mgraph reads {FORMAT!r}")
    buffers: dict[str, Buffer] = {}
    for b in doc.buffers:
        binding = None
        if b.binding is not None:
            tensor, pieces, cat_dim = b.binding
            binding = Binding(tensor, tuple(tuple(tuple(r) for r in p) for p in pieces), cat_dim)
        buf = Buffer(b.name, b.rank, b.rows, b.cols, b.dtype, b.role, binding, b.symmetric)
        buffers[buf.id] = buf
    tasks = [
        Task(
            i,
            t.name,
            t.rank,
            t.role,
            t.kind,
            [Region(*r) for r in t.reads],
            [Region(*w) for w in t.writes],
            [tuple(w) for w in t.waits],
            list(t.signals),
            t.flops,
            t.bytes,
            t.params,
        )
        for i, t in enumerate(doc.tasks)
    ]
    return TaskGraph(
        op=doc.op,
        topology=Topology.parse(doc.topology),
        dtype=doc.dtype,
        params=doc.params,
        inputs={k: TensorSpec(tuple(v.shape), v.dtype) for k, v in doc.inputs.items()},
        outputs={k: TensorSpec(tuple(v.shape), v.dtype) for k, v in doc.outputs.items()},
        buffers=buffers,
        events=[Event(i, rank, name) for i, (rank, name) in enumerate(doc.events)],
        tasks=tasks,
    )


def _fmt_params(params: dict[str, Any]) -> str:
    return json.dumps(params, sort_keys=True, separators=(",", ":"))


def graph_to_text(g: TaskGraph) -> str:
    """One line per buffer, event and task, in id order: stable across runs and platforms."""
    lines = [f"graph {g.op} topology={g.topology} dtype={g.dtype} params={_fmt_params(g.params)}"]
    for name, spec in g.inputs.items():
        lines.append(f"input {name} {list(spec.shape)} {spec.dtype}")
    for name, spec in g.outputs.items():
        lines.append(f"output {name} {list(spec.shape)} {spec.dtype}")
    for b in g.buffers.values():
        bind = "" if b.binding is None else f" <- {b.binding.tensor}{list(b.binding.pieces)}"
        sym = " symmetric" if b.symmetric else ""
        lines.append(f"buffer {b.id} {b.rows}x{b.cols} {b.dtype} {b.role}{sym}{bind}")
    for e in g.events:
        lines.append(f"event e{e.id} r{e.rank} {e.name}")
    for t in g.tasks:
        reads = " ".join(str(r) for r in t.reads)
        writes = " ".join(str(w) for w in t.writes)
        waits = " ".join(f"e{e}>={c}" for e, c in t.waits)
        signals = " ".join(f"e{e}" for e in t.signals)
        params = f" {_fmt_params(t.params)}" if t.params else ""
        lines.append(
            f"task t{t.id} r{t.rank} {t.role} {t.kind} {t.name!r} reads[{reads}] "
            f"writes[{writes}] waits[{waits}] signals[{signals}]{params}"
        )
    return "\n".join(lines) + "\n"
