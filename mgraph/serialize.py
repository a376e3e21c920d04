"""JSON (lossless, validated with pydantic on load) and text (deterministic, for golden tests)
forms of a TaskGraph.

Loading is strict: unknown fields, wrong types, dtypes mgraph does not compute in, ranks outside
the topology, regions outside their buffer, unknown buffers, events or kinds, duplicate buffers,
an empty graph and sizes above the size guard are all GraphFileError (or SizeLimitError), each
naming the path of the bad field (``tasks[3].reads[0]``), before anything is allocated.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .errors import GraphFileError
from .graph import Binding, Buffer, Event, Region, Task, TaskGraph, TensorSpec
from .settings import Settings
from .topology import Topology

__all__ = ["graph_to_json", "graph_from_json", "graph_to_text", "load_graph_file", "FORMAT"]

FORMAT = "mgraph.taskgraph/1"

_STRICT = ConfigDict(extra="forbid", strict=True)
Size = Annotated[int, Field(ge=1)]
Index = Annotated[int, Field(ge=0)]
DType = Literal["float32", "bfloat16", "float16"]
RegionRow = tuple[str, Index, Index, Index, Index]


class _Spec(BaseModel):
    model_config = _STRICT
    shape: list[Size]
    dtype: DType


class _Buffer(BaseModel):
    model_config = _STRICT
    name: str
    rank: Index
    rows: Size
    cols: Size
    dtype: DType
    role: Literal["input", "output", "scratch"]
    binding: tuple[str, list[list[tuple[Index, Index]]], Index] | None = None
    symmetric: bool = False
    zeroed: bool = False


class _Task(BaseModel):
    model_config = _STRICT
    name: str
    rank: Index
    role: Literal["compute", "nvlink", "rdma"]
    kind: str
    reads: list[RegionRow]
    writes: list[RegionRow]
    waits: list[tuple[Index, Size]] = []
    signals: list[Index] = []
    flops: Annotated[float, Field(ge=0, allow_inf_nan=False)] = 0.0
    bytes: Index = 0
    params: dict[str, Any] = {}


class _Graph(BaseModel):
    model_config = _STRICT

    format: str
    op: str
    topology: str
    dtype: DType
    params: dict[str, Any]
    inputs: dict[str, _Spec]
    outputs: dict[str, _Spec]
    buffers: list[_Buffer]
    events: list[tuple[Index, str]]  # (rank, name); the id is the position
    tasks: list[_Task]


def _path(loc: tuple) -> str:
    """pydantic's location tuple as a path: ``tasks[3].reads[0][2]``."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "(top level)"


def load_graph_file(path: str | Path, settings: Settings | None = None) -> TaskGraph:
    """Read a graph JSON file written by ``TaskGraph.save``/``mgraph inspect --json``."""
    p = Path(path)
    how = "write one with `mgraph inspect --op ... --json FILE` or TaskGraph.save(FILE)"
    if not p.exists():
        raise GraphFileError(f"graph file {str(p)!r} does not exist", hint=how)
    if p.is_dir():
        raise GraphFileError(f"graph file {str(p)!r} is a directory, not a JSON file", hint=how)
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise GraphFileError(
            f"graph file {str(p)!r} is not text (byte {exc.start} is not UTF-8)", hint=how
        ) from None
    except OSError as exc:
        raise GraphFileError(f"cannot read graph file {str(p)!r}: {exc.strerror}") from None
    return graph_from_json(text, settings=settings, source=str(p))


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
                "zeroed": b.zeroed,
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


def graph_from_json(
    text: str, *, settings: Settings | None = None, source: str = "graph JSON"
) -> TaskGraph:
    """A TaskGraph from its JSON form, checked strictly (module docstring)."""
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise GraphFileError(
            f"{source}: not JSON ({exc.msg} at line {exc.lineno}, column {exc.colno})",
            hint="a graph file is the JSON `mgraph inspect --json` writes",
        ) from None
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        got = raw.get("format") if isinstance(raw, dict) else type(raw).__name__
        raise GraphFileError(
            f"{source}: format {got!r} is not {FORMAT!r}",
            hint="this mgraph reads graphs written by TaskGraph.save / `mgraph inspect --json`",
        )
    try:
        doc = _Graph.model_validate_json(text)  # JSON mode: arrays are tuples, strictly typed
    except ValidationError as exc:
        errs = exc.errors()
        first = errs[0]
        more = f" (and {len(errs) - 1} more)" if len(errs) > 1 else ""
        raise GraphFileError(
            f"{source} is not a valid mgraph task graph: field {_path(first['loc'])}: "
            f"{first['msg']} "
            f"(got {_short(first.get('input'))}){more}",
            hint="fix that field; the schema is mgraph/serialize.py's _Graph",
        ) from None
    from .schema_checks import check_document

    check_document(doc, source, settings or Settings.from_env())
    buffers: dict[str, Buffer] = {}
    for b in doc.buffers:
        binding = None
        if b.binding is not None:
            tensor, pieces, cat_dim = b.binding
            binding = Binding(tensor, tuple(tuple(tuple(r) for r in p) for p in pieces), cat_dim)
        buf = Buffer(b.name, b.rank, b.rows, b.cols, b.dtype, b.role, binding, b.symmetric,
                     b.zeroed)
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
        sym = (" symmetric" if b.symmetric else "") + (" zeroed" if b.zeroed else "")
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


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
