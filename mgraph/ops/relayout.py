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
apply the steps, gather this tile's runs.

GPU body: the lowering runs that same CPU body once per rank on an index tensor, which gives each
output element's position in the rank's input buffer, and fits every tile's map as
``base + f(row) + g(col)`` with ``f`` and ``g`` mixed-radix sums of up to :data:`DIGITS` digits
(``((i // div_k) % radix_k) * stride_k``): head splits and merges, transposes, expands (stride 0)
and slices all have that form. The fit is checked element by element; a tile whose map does not
fit gets no GPU params, so the megakernel's encoder refuses the graph (naming the task) before
anything launches, and the reference backend still runs it.
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
from .abi import F_READ0, F_WRITE0, HAVE_TRITON
from .registry import OpDef

__all__ = ["relayout", "apply_steps", "steps_shape", "relayout_feasible"]

OP = "relayout"
relayout = OpDef(OP, dims=("rows", "cols"), inputs=("x",), outputs=("out",))
DIGITS = 4  # mixed-radix digits per axis of a tile's gather map (see the module docstring)
_GPU_PARAMS = ("base", *(f"{axis}{k}{what}" for axis in "rc" for k in range(DIGITS)
                         for what in ("n", "s")))
RELAYOUT = define_kind("relayout", [Role.COMPUTE], "view/permute chain of a rank's part (steps)",
                       params=_GPU_PARAMS)

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
        common = {
            "in_shape": list(shape),
            "steps": [[k, list(a)] for k, a in _steps(steps)],
            "in_layout": src.to_json(),
            "out_layout": dst.to_json(),
            "rank": r,
            "world": b.world,
        }
        where = _gather_map(common, (x.rows, x.cols), (out.rows, out.cols))
        for t0, t1 in split(out.rows, tile_rows):
            b.task(
                r,
                Role.COMPUTE,
                RELAYOUT.name,
                [x.region()],
                [out.region((t0, t1))],
                name=f"relayout r{r} [{t0}:{t1}]",
                params={**common, "rows": [t0, t1], **fit_gather(where[t0:t1])},
            )


class _Params:  # what _relayout_cpu reads of a task
    def __init__(self, params: dict) -> None:
        self.params = params


def _gather_map(params: dict, in_size: tuple[int, int], out_size: tuple[int, int]) -> torch.Tensor:
    """Each element of the rank's output buffer: its flat position in the rank's input buffer
    (the CPU body run on the positions themselves)."""
    index = torch.arange(in_size[0] * in_size[1], dtype=torch.int64).reshape(in_size)
    where = torch.empty(out_size, dtype=torch.int64)
    _relayout_cpu(_Params({**params, "rows": [0, out_size[0]]}), [index], [where])
    return where


def _fit_axis(v: torch.Tensor) -> list[tuple[int, int]] | None:
    """(radix, stride) digits, innermost first, with v[i] - v[0] = sum of digit_k(i) * stride_k;
    None when more than DIGITS digits are needed."""
    n, v = len(v), v - v[0]
    digits, period = [], 1
    while period < n:
        if len(digits) == DIGITS:
            return None
        stride = int(v[period])
        # the longest run of whole periods that steps by ``stride``, then the largest radix
        # within it that divides what is left of n (the later digits repeat whole blocks)
        blocks = v[: n // period * period].view(-1, period)
        steps = torch.arange(blocks.shape[0]) * stride
        ok = (blocks == blocks[0] + steps[:, None]).all(dim=1)
        run = int(ok.long().cumprod(0).sum())  # whole periods before the first mismatch
        radix = max(r for r in range(1, run + 1) if (n // period) % r == 0)
        if radix == 1:
            return None
        digits.append((radix, stride))
        period *= radix
    return digits


def _digits_value(n: int, digits: list[tuple[int, int]]) -> torch.Tensor:
    i, out, div = torch.arange(n), torch.zeros(n, dtype=torch.int64), 1
    for radix, stride in digits:
        out += (i // div) % radix * stride
        div *= radix
    return out


def fit_gather(where: torch.Tensor) -> dict[str, int]:
    """The GPU params of one tile's gather map (see the module docstring); {} when it has no
    such form."""
    rows = _fit_axis(where[:, 0])
    cols = _fit_axis(where[0, :])
    if rows is None or cols is None:
        return {}
    base = int(where[0, 0])
    f, g = _digits_value(where.shape[0], rows), _digits_value(where.shape[1], cols)
    if not bool((where == base + f[:, None] + g[None, :]).all()):
        return {}
    out = {"base": base}
    for axis, digits in (("r", rows), ("c", cols)):
        digits = digits + [(1, 0)] * (DIGITS - len(digits))
        for k, (radix, stride) in enumerate(digits):
            out[f"{axis}{k}n"], out[f"{axis}{k}s"] = radix, stride
    return out


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


# -- megakernel tile body ------------------------------------------------------------------------
if HAVE_TRITON:
    import triton
    import triton.language as tl

    from .abi import buffer_base, load_region, param_i32

    _READ0, _WRITE0 = tl.constexpr(F_READ0), tl.constexpr(F_WRITE0)
    _DIGITS = tl.constexpr(DIGITS)

    @triton.jit
    def _digits(params, tp, first, i):
        """sum over the axis's digits of ((i // div_k) % radix_k) * stride_k (params from
        ``first``: radix, stride per digit, innermost first)."""
        i = i.to(tl.int64)
        out = tl.zeros_like(i)
        div = 1
        for k in tl.static_range(_DIGITS):
            radix = param_i32(params, tp, first + 2 * k).to(tl.int64)
            out += ((i // div) % radix) * param_i32(params, tp, first + 2 * k + 1).to(tl.int64)
            div = div * radix
        return out

    @RELAYOUT.triton
    @triton.jit
    def relayout_tile(tp, params, regions, bufaddr, bufcols, DT: tl.constexpr,
                      RB_M: tl.constexpr, RB_N: tl.constexpr):
        """A gather: out[i, j] = in_buffer.flat[base + f(i) + g(j)] over the task's output
        rows (the fit of fit_gather; no arithmetic, so no rounding)."""
        s_in, _a, _b, _c, _d = load_region(regions, tl.load(tp + _READ0))
        d, dm0, dm1, dn0, dn1 = load_region(regions, tl.load(tp + _WRITE0))
        src = buffer_base(bufaddr, s_in, DT)
        dst = buffer_base(bufaddr, d, DT)
        d_cols = tl.load(bufcols + d).to(tl.int64)
        base = param_i32(params, tp, 0).to(tl.int64)
        for i in range(0, dm1 - dm0, RB_M):
            for j in range(0, dn1 - dn0, RB_N):
                om = i + tl.arange(0, RB_M)
                on = j + tl.arange(0, RB_N)
                mask = (om < dm1 - dm0)[:, None] & (on < dn1 - dn0)[None, :]
                pos = base + _digits(params, tp, 1, om)[:, None] + _digits(
                    params, tp, 1 + 2 * _DIGITS, on)[None, :]
                x = tl.load(src + pos, mask=mask)
                tl.store(dst + (dm0 + om)[:, None].to(tl.int64) * d_cols + (dn0 + on)[None, :],
                         x, mask=mask)
