"""Gather maps of a relayout by index arithmetic (mgraph/ops/relayout.py's GPU params).

A rank's map from its output buffer's (row, col) to a position in its input buffer, derived from
the relayout's steps without building a tensor of the relayout's size: relayout.py fits each
tile's digits on it and checks which rank holds what.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ..builder import shard_range
from ..errors import ShapeError
from ..layout import Layout, layout_pieces, layout_runs

OP = "relayout"
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


# -- gather maps by index arithmetic ------------------------------------------------------------
# A map is ``pos(x) = base + sum of each sub-dim's part of x``: every logical dim of the tensor is
# a list of sub-dims, outer first, each (size, stride, table): its digit i adds i * stride, or
# table[i] when no stride describes it (a zigzag chunk index). Views regroup sub-dims, permutes
# reorder dims, expands add stride-0 sub-dims, slices move base and scale strides. The map starts
# as the rank's input buffer over global input coordinates and ends over the rank's output
# buffer, whose rows and cols are then two disjoint sets of sub-dims: where(i, j) = F[i] + G[j]
# exactly, so each tile's map is fitted on one row and one column, never on the whole tile.
_Sub = tuple[int, int, "tuple[int, ...] | None"]


class _NoMap(Exception):
    """The steps regroup digits no sub-dim split can express (the tile gets no GPU params)."""


def _part(sub: _Sub) -> torch.Tensor:
    size, stride, table = sub
    if table is not None:
        return torch.tensor(table, dtype=torch.int64)
    return torch.arange(size, dtype=torch.int64) * stride


def _values(subs: Sequence[_Sub]) -> torch.Tensor:
    """The sum of the sub-dims' parts at every index of their mixed radix, in row-major order."""
    out = torch.zeros(1, dtype=torch.int64)
    for sub in subs:
        out = (out[:, None] + _part(sub)[None, :]).reshape(-1)
    return out


class _Map:
    def __init__(self, base: int, dims: list[list[_Sub]]) -> None:
        self.base = base
        self.dims = [self._normal(d) for d in dims]

    def _normal(self, subs: Sequence[_Sub]) -> list[_Sub]:
        """Unit sub-dims folded into base, tables that step evenly turned into strides,
        neighbours that continue each other (outer stride = inner size x stride) merged."""
        out: list[_Sub] = []
        for size, stride, table in subs:
            if table is not None:
                self.base += table[0]
                table = tuple(t - table[0] for t in table)
                if size > 1 and all(t == i * table[1] for i, t in enumerate(table)):
                    stride, table = table[1], None
            if size == 1:
                continue
            if out and table is None and out[-1][2] is None and out[-1][1] == size * stride:
                out[-1] = (out[-1][0] * size, stride, None)
            else:
                out.append((size, stride, table))
        return out

    @staticmethod
    def _split(sub: _Sub, outer: int) -> tuple[_Sub, _Sub]:
        size, stride, table = sub
        inner = size // outer
        if table is None:
            return (outer, stride * inner, None), (inner, stride, None)
        hi, lo = table[::inner], table[:inner]
        if any(table[a * inner + b] != hi[a] + lo[b] for a in range(outer) for b in range(inner)):
            raise _NoMap
        return (outer, 0, hi), (inner, 0, lo)

    def _regroup(self, subs: list[_Sub], shape: Sequence[int]) -> list[list[_Sub]]:
        """``subs`` (outer first) cut into consecutive groups of the sizes ``shape``."""
        queue, groups = list(subs), []
        for n in shape:
            group, need = [], n
            while need > 1:
                if not queue:
                    raise _NoMap
                size = queue[0][0]
                if need % size == 0:
                    group.append(queue.pop(0))
                    need //= size
                elif size % need == 0:
                    head, queue[0] = self._split(queue[0], need)
                    group.append(head)
                    need = 1
                else:
                    raise _NoMap
            groups.append(group)
        if queue:
            raise _NoMap
        return groups

    @staticmethod
    def _table(subs: Sequence[_Sub]) -> _Sub:
        """One sub-dim holding the same parts (a table)."""
        values = _values(subs)
        return (len(values), 0, tuple(values.tolist()))

    def view(self, shape: Sequence[int]) -> None:
        flat = self._normal([sub for d in self.dims for sub in d])
        self.dims = [self._normal(g) for g in self._regroup(flat, shape)]

    def permute(self, perm: Sequence[int]) -> None:
        self.dims = [self.dims[p] for p in perm]

    def expand(self, old: Sequence[int], shape: Sequence[int]) -> None:
        for d, (n, m) in enumerate(zip(old, shape, strict=True)):
            if m != -1 and m != n:  # a unit dim repeated: its sub-dims are already gone
                self.dims[d] = [(m, 0, None)]

    def slice(self, dim: int, start: int, end: int, step: int) -> None:
        self.dims[dim] = self._normal(self._slice(self.dims[dim], start, end, step))

    def _slice(self, subs: list[_Sub], start: int, end: int, step: int) -> list[_Sub]:
        if not subs:  # a unit dim: [0:1] is all of it
            return []
        size, stride, table = subs[0]
        inner = math.prod(s[0] for s in subs[1:])
        if len(subs) > 1:
            if step == 1 and start % inner == 0 and end % inner == 0:
                return [*self._slice([subs[0]], start // inner, end // inner, 1), *subs[1:]]
            if start // inner == (end - 1) // inner:  # inside one outer digit
                self.base += int(_part(subs[0])[start // inner])
                lo = start // inner * inner
                return self._slice(subs[1:], start - lo, end - lo, step)
            subs = [self._table(subs)]
            size, stride, table = subs[0]
        if table is not None:
            return [(len(range(start, end, step)), 0, table[start:end:step])]
        self.base += start * stride
        return [(len(range(start, end, step)), stride * step, None)]

    def select(self, dim: int, parts: int, picks: Sequence[int]) -> None:
        """Dim ``dim`` cut into ``parts`` chunks, of which ``picks`` are kept, in that order."""
        size = math.prod(s[0] for s in self.dims[dim])
        outer, inner = self._regroup(self.dims[dim], [parts, size // parts])
        chunk = _part(self._table(outer))
        self.dims[dim] = self._normal(
            [(len(picks), 0, tuple(int(chunk[p]) for p in picks)), *inner]
        )


def _contiguous(shape: Sequence[int]) -> list[int]:
    strides, acc = [], 1
    for n in reversed(shape):
        strides.append(acc)
        acc *= n
    return strides[::-1]


def _input_map(shape: tuple[int, ...], src: Layout, rank: int, world: int) -> _Map:
    """Global input coordinates -> flat position in rank ``rank``'s input buffer."""
    if src.kind == "replicate" or world == 1:
        return _Map(0, [[(n, s, None)] for n, s in zip(shape, _contiguous(shape), strict=True)])
    if src.kind == "rows":
        r0 = layout_runs(shape, src, rank, world)[0][0]
        strides = _contiguous(shape)
        return _Map(-r0 * shape[-1], [[(n, s, None)] for n, s in zip(shape, strides, strict=True)])
    pieces, d = layout_pieces(shape, src, rank, world)
    held = [hi - lo for lo, hi in pieces[0]]
    held[d] = sum(p[d][1] - p[d][0] for p in pieces)
    strides = _contiguous(held)
    base = -sum(p[0] * s for p, s in zip(pieces[0], strides, strict=True))
    dims = [[(n, s, None)] for n, s in zip(shape, strides, strict=True)]
    if src.zigzag:  # chunk k of 2W: rank r's chunk r first, then its mirror chunk
        chunk = shape[d] // (2 * world)
        table = [0] * (2 * world)
        table[2 * world - 1 - rank] = chunk * strides[d]
        base = 0
        dims[d] = [(2 * world, 0, tuple(table)), (chunk, strides[d], None)]
    return _Map(base, dims)


def _run_steps(m: _Map, shape: tuple[int, ...], steps: Steps) -> tuple[int, ...]:
    """``m`` carried through the steps; the result's shape."""
    for kind, arg in steps:
        out = steps_shape(shape, [(kind, arg)])
        if kind == "view":
            m.view(out)
        elif kind == "permute":
            m.permute(arg)
        elif kind == "expand":
            m.expand(shape, out)
        else:
            m.slice(arg[0] % len(shape), *arg[1:])
        shape = out
    return shape


def _restrict(m: _Map, shape: tuple[int, ...], dst: Layout, rank: int, world: int) -> None:
    """``m`` over global output coordinates cut to rank ``rank``'s output buffer."""
    if world > 1 and dst.kind == "rows":
        r0, r1 = layout_runs(shape, dst, rank, world)[0][:2]
        m.dims = [m._normal([s for d in m.dims[:-1] for s in d]), m.dims[-1]]
        m.slice(0, r0, r1, 1)
    elif world > 1 and dst.kind == "shard" and dst.zigzag:
        m.select(dst.dim, 2 * world, (rank, 2 * world - 1 - rank))
    elif world > 1 and dst.kind == "shard":
        lo, hi = shard_range(shape[dst.dim], rank, world)
        m.slice(dst.dim, lo, hi, 1)


def _axes(m: _Map) -> tuple[torch.Tensor, torch.Tensor]:
    """(F, G): m at output buffer (i, j) is F[i] + G[j]."""
    rows = _values([s for d in m.dims[:-1] for s in d]) + m.base
    return rows, _values(m.dims[-1]) if m.dims else torch.zeros(1, dtype=torch.int64)


def _rank_maps(
    shape: tuple[int, ...], steps: Steps, src: Layout, dst: Layout, rank: int, world: int
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(F, G) with rank ``rank``'s gather map where[i, j] = F[i] + G[j] (positions in its input
    buffer of its output buffer's elements), or None when the steps have no sub-dim form."""
    m = _input_map(shape, src, rank, world)
    try:
        _restrict(m, _run_steps(m, shape, steps), dst, rank, world)
    except _NoMap:
        return None
    return _axes(m)
