"""Relayout: a chain of views, permutes, expands and slices (``t.view(...).transpose(1, 2)``,
head splits and merges, ``repeat_kv``'s expand, ``x[..., :d]``, one piece of ``chunk``/``split``)
applied to a distributed tensor, each rank producing its part of the result locally.

Steps: ``["view", shape]``, ``["permute", perm]``, ``["expand", shape]`` (a broadcast that copies:
the result holds every repeated element), ``["slice", [dim, start, end, step]]``.

The tracer fuses consecutive view/permute/transpose ops into one ``steps`` list and picks the
result's layout so that every rank already holds the elements its part needs (checked here: a
rank missing one raises). A view that keeps the last dim moves no data and never reaches this
op: the buffers' flat 2-D view is the same.

Tasks: one ``relayout`` compute task per ``tile_rows`` rows of the rank's output buffer; each
reads the rank's whole input buffer. CPU body: place the held runs in the global index space,
apply the steps, gather this tile's runs (index arithmetic a GPU body does with a gather).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import lru_cache

import torch

from ..builder import GraphBuilder, split
from ..errors import ShapeError
from ..graph import Task
from ..kinds import Role, define_kind
from ..layout import Layout, check_layout, flat_shape, layout_runs, runs_pieces
from ..topology import Topology
from .registry import OpDef

__all__ = ["relayout", "apply_steps", "steps_shape", "relayout_feasible"]

OP = "relayout"
relayout = OpDef(OP, dims=("rows", "cols"), inputs=("x",), outputs=("out",))
RELAYOUT = define_kind("relayout", [Role.COMPUTE], "view/permute chain of a rank's part (steps)")

Steps = tuple[tuple[str, tuple[int, ...]], ...]


def _steps(steps: Sequence) -> Steps:
    return tuple((str(kind), tuple(int(v) for v in arg)) for kind, arg in steps)


def steps_shape(shape: Sequence[int], steps: Sequence) -> tuple[int, ...]:
    """The shape after ``steps`` (``view`` shapes may hold one -1)."""
    shape = tuple(shape)
    for kind, arg in _steps(steps):
        if kind == "view":
            arg = list(arg)
            if -1 in arg:
                known = math.prod(n for n in arg if n != -1)
                arg[arg.index(-1)] = math.prod(shape) // max(known, 1)
            if math.prod(arg) != math.prod(shape):
                raise ShapeError(f"{OP}: cannot view shape {list(shape)} as {arg}")
            shape = tuple(arg)
        elif kind == "permute":
            if sorted(arg) != list(range(len(shape))):
                raise ShapeError(f"{OP}: {list(arg)} is not a permutation of {len(shape)} dims")
            shape = tuple(shape[p] for p in arg)
        elif kind == "expand":
            if len(arg) != len(shape) or any(
                n != m and n != 1 and m != -1 for n, m in zip(shape, arg, strict=True)
            ):
                raise ShapeError(f"{OP}: cannot expand shape {list(shape)} to {list(arg)}")
            shape = tuple(n if m == -1 else m for n, m in zip(shape, arg, strict=True))
        elif kind == "slice":
            if len(arg) != 4 or not -len(shape) <= arg[0] < len(shape) or arg[3] <= 0:
                raise ShapeError(f"{OP}: slice step {list(arg)} is not [dim, start, end, step>0]")
            dim, start, end, step = arg[0] % len(shape), *arg[1:]
            if not 0 <= start < end <= shape[dim]:
                raise ShapeError(
                    f"{OP}: slice [{start}:{end}] is out of dim {dim} of {list(shape)}"
                )
            shape = shape[:dim] + (len(range(start, end, step)),) + shape[dim + 1 :]
        else:
            raise ShapeError(
                f"{OP}: unknown step {kind!r}", hint="steps are view, permute, expand or slice"
            )
    return shape


def apply_steps(t: torch.Tensor, steps: Sequence) -> torch.Tensor:
    for kind, arg in _steps(steps):
        if kind == "view":
            t = t.reshape(arg)
        elif kind == "permute":
            t = t.permute(arg)
        elif kind == "expand":
            t = t.expand(arg)
        else:
            dim, start, end, step = arg
            index = [slice(None)] * t.dim()
            index[dim] = slice(start, end, step)
            t = t[tuple(index)]
    return t


@lru_cache(maxsize=256)
def _feasible(shape: tuple, steps: Steps, src: Layout, dst: Layout, world: int) -> int | None:
    """The first rank that lacks an element its output part needs, or None."""
    if src.kind == "replicate" or world == 1:
        return None
    out_shape = steps_shape(shape, steps)
    index = apply_steps(torch.arange(math.prod(shape)).reshape(shape), steps)
    index = index.reshape(flat_shape(out_shape))
    # Every element of a sharded layout lives on exactly one rank.
    holder = torch.full(flat_shape(shape), -1, dtype=torch.int32)
    for r in range(world):
        for r0, r1, c0, c1 in layout_runs(shape, src, r, world):
            holder[r0:r1, c0:c1] = r
    holder = holder.reshape(-1)
    for r in range(world):
        for r0, r1, c0, c1 in layout_runs(out_shape, dst, r, world):
            if not bool((holder[index[r0:r1, c0:c1].reshape(-1)] == r).all()):
                return r
    return None


def relayout_feasible(
    shape: Sequence[int], steps: Sequence, src: Layout, dst: Layout, world: int
) -> bool:
    return _feasible(tuple(shape), _steps(steps), src, dst, world) is None


@relayout.shapes
def _shapes(
    topology: Topology,
    rows: int,
    cols: int,
    in_shape: Sequence[int] | None = None,
    steps: Sequence = (),
    in_layout: Sequence | None = None,
    out_layout: Sequence | None = None,
    **_: object,
) -> dict[str, tuple]:
    shape = tuple(in_shape) if in_shape is not None else (rows, cols)
    if flat_shape(shape) != (rows, cols):
        raise ShapeError(f"{OP}: in_shape={list(shape)} does not flatten to {rows} x {cols}")
    out_shape = steps_shape(shape, steps)
    world = topology.world_size
    src, dst = Layout.from_json(in_layout), Layout.from_json(out_layout)
    check_layout(shape, src, world, OP, "choose sizes divisible by the world size")
    check_layout(out_shape, dst, world, OP, "choose sizes divisible by the world size")
    missing = _feasible(shape, _steps(steps), src, dst, world)
    if missing is not None:
        raise ShapeError(
            f"{OP}: rank {missing} does not hold every element its part of the result "
            f"({dst.describe()} of {list(out_shape)}) needs from {src.describe()} of {list(shape)}",
            hint="replicate the input first (in_layout=None)",
        )
    return {"x": (rows, cols), "out": flat_shape(out_shape)}


@relayout.reference
def _reference(
    x: torch.Tensor, in_shape: Sequence[int] | None = None, steps: Sequence = (), **_: object
) -> dict[str, torch.Tensor]:
    shape = tuple(in_shape) if in_shape is not None else tuple(x.shape)
    out = apply_steps(x.reshape(shape), steps)
    return {"out": out.reshape(flat_shape(out.shape)).contiguous()}


@relayout.lower
def _lower(
    b: GraphBuilder,
    rows: int,
    cols: int,
    in_shape: list[int] | None = None,
    steps: list = (),
    in_layout: list | None = None,
    out_layout: list | None = None,
    tile_rows: int = 128,
) -> None:
    shape = tuple(in_shape) if in_shape is not None else (rows, cols)
    out_shape = steps_shape(shape, steps)
    src, dst = Layout.from_json(in_layout), Layout.from_json(out_layout)
    b.global_input("x", (rows, cols))
    b.global_output("out", flat_shape(out_shape))
    for r in b.topo.ranks:
        x = b.bound_buffer("x", r, "x", runs_pieces(layout_runs(shape, src, r, b.world)))
        pieces = runs_pieces(layout_runs(out_shape, dst, r, b.world))
        out = b.bound_buffer("out", r, "out", pieces, role="output")
        for t0, t1 in split(out.rows, tile_rows):
            b.task(
                r,
                Role.COMPUTE,
                RELAYOUT.name,
                [x.region()],
                [out.region((t0, t1))],
                name=f"relayout r{r} [{t0}:{t1}]",
                params={
                    "in_shape": list(shape),
                    "steps": [[k, list(a)] for k, a in _steps(steps)],
                    "in_layout": src.to_json(),
                    "out_layout": dst.to_json(),
                    "rank": r,
                    "world": b.world,
                    "rows": [t0, t1],
                },
            )


@RELAYOUT.cpu
def _relayout_cpu(
    task: Task, reads: Sequence[torch.Tensor], writes: Sequence[torch.Tensor]
) -> None:
    p = task.params
    shape = tuple(p["in_shape"])
    rank, world = p["rank"], p["world"]
    full = torch.empty(flat_shape(shape), dtype=reads[0].dtype)
    offset = 0
    for r0, r1, c0, c1 in layout_runs(shape, Layout.from_json(p["in_layout"]), rank, world):
        full[r0:r1, c0:c1] = reads[0][offset : offset + r1 - r0]
        offset += r1 - r0
    out_shape = steps_shape(shape, p["steps"])
    result = apply_steps(full.reshape(shape), p["steps"]).reshape(flat_shape(out_shape))
    t0, t1 = p["rows"]
    offset = 0
    for r0, r1, c0, c1 in layout_runs(out_shape, Layout.from_json(p["out_layout"]), rank, world):
        lo, hi = max(t0, offset), min(t1, offset + r1 - r0)
        if lo < hi:
            src = result[r0 + lo - offset : r0 + hi - offset, c0:c1]
            writes[0][lo - t0 : hi - t0] = src
        offset += r1 - r0


@RELAYOUT.flops
def _relayout_flops(
    reads: Sequence[tuple[int, int]], writes: Sequence[tuple[int, int]], params: dict
):
    return 0.0
