"""Validation's race check (mgraph.validate runs it last): every two accesses of overlapping
regions, one of them a write, are ordered by the counters (``check_races``), and the
happens-before queries it asks (``Reachability``). The module docstring of mgraph.validate says
what orders two tasks.
"""

from __future__ import annotations

import struct
from array import array
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch

from .errors import RaceError
from .graph import Region, TaskGraph

if TYPE_CHECKING:
    from .validate import _Seen

__all__ = ["check_races", "order_edges", "Reachability", "region_table"]


# -- races -------------------------------------------------------------------------------------
def order_edges(graph: TaskGraph) -> list[list[int]]:
    """succ[a] = tasks ordered directly after a (they wait on ALL signals of an event a raises)."""
    total = [0] * len(graph.events)
    for t in graph.tasks:
        for e in t.signals:
            total[e] += 1
    signalers = graph.signalers()
    succ: list[list[int]] = [[] for _ in graph.tasks]
    for t in graph.tasks:
        for e, c in t.waits:
            if c >= total[e]:
                for s in set(signalers[e]):
                    succ[s].append(t.id)
    return succ


class Reachability:
    """Answers "is b ordered after a".

    ``preds(b)``: the tasks b is ordered directly after, the signalers of the events it waits
    for with their full count (one shared set per event: the readiness waits of a traced layer
    are ~10^7 edges, too many to store per task). ``before`` tries that set, then searches
    backwards from b, pruned with topological positions."""

    def __init__(
        self, graph: TaskGraph, order: list[int], signalers: list[list[int]] | None = None
    ) -> None:
        tasks = self.tasks = graph.tasks
        pos = self.pos = [0] * len(tasks)
        for i, tid in enumerate(order):
            pos[tid] = i
        if signalers is None:  # else each event's signaling task ids, in id order
            signalers = [[] for _ in graph.events]
            for t in tasks:
                tid = t.id
                for e in t.signals:
                    signalers[e].append(tid)
        total = self.total = [len(s) for s in signalers]  # signals per event
        self.signalers = signalers
        # Every task's direct predecessors, made in one pass (the race check asks for nearly
        # every task's, ~80k at 2x8): one shared set per event, and a task with one full
        # wait (almost all of them) takes its event's set as it is.
        event_set = [frozenset(s) for s in signalers]
        empty: frozenset[int] = frozenset()
        preds: list[frozenset[int]] = []
        add = preds.append
        for t in tasks:
            waits = t.waits
            if len(waits) == 1:
                e, c = waits[0]
                add(event_set[e] if c >= total[e] else empty)
            else:
                sets = [event_set[e] for e, c in waits if c >= total[e]]
                add(sets[0] if len(sets) == 1 else empty.union(*sets))
        self.preds_of = preds
        self.cache: dict[tuple[int, int], bool] = {}

    def preds(self, b: int) -> frozenset[int]:
        return self.preds_of[b]

    def before(self, a: int, b: int) -> bool:
        if a == b:
            return True
        pos = self.pos
        floor = pos[a]
        if floor > pos[b]:
            return False
        preds = self.preds_of
        if a in preds[b]:
            return True
        key = (a, b)
        hit = self.cache.get(key)
        if hit is not None:
            return hit
        seen = {b}
        stack = [b]
        found = False
        while stack and not found:
            for p in preds[stack.pop()]:
                if p == a:
                    found = True
                    break
                if p not in seen and pos[p] > floor:
                    seen.add(p)
                    stack.append(p)
        self.cache[key] = found
        return found

    def ordered(self, a: int, b: int) -> bool:
        return self.before(a, b) or self.before(b, a)


def check_races(graph: TaskGraph, order: list[int], seen: _Seen) -> None:
    """Every two accesses of overlapping regions, one of them a write, are ordered.

    Accesses of one exact region form a group. Inside a group, sorted in topological order, it
    is enough that every access is ordered after the group's last write before it, and every
    write after the reads since that write: the other pairs follow by transitivity (an earlier
    write is ordered before the last one, an earlier read before the write that followed it).
    So a region that many tiles read and rewrite (a chain of attention blocks accumulating into
    one state tile) costs a pass, not a pass per pair.

    Across groups, each access is checked against the writers of every other group overlapping
    its region at once: those writers, less the tasks it directly waits for (one set difference),
    are usually none; the rest are checked one by one. A GEMM tile reading a row of ~100
    elementwise tiles is one set operation, not 100 searches. The overlapping pairs of groups
    are found by one sort of all regions (``_overlapping_pairs``), not a sweep per buffer.

    The groups, and the signalers and accumulating tasks, are what _check_structure's pass
    collected (``seen``). Writes that accumulate (atomic adds into a zeroed buffer) commute
    with each other: two of them on one region are no race; against a plain write or a read
    they still are.
    """
    reach = Reachability(graph, order, seen.signalers)
    _check_groups(graph, seen, reach)


def _check_groups(graph: TaskGraph, seen: _Seen, reach: Reachability) -> None:
    """check_races on the regions' accesses (``_Seen.groups``)."""
    groups, adds = seen.groups, seen.adds
    regions = list(groups)
    codes_of = list(groups.values())
    written = bytearray(len(regions))  # group i has a writer
    pos = reach.pos
    before = reach.before
    preds = reach.preds_of
    for i, codes in enumerate(codes_of):
        if codes.__class__ is int:
            written[i] = codes & 1  # one access: nothing to order inside the group
            continue
        if len(codes) == 2:
            # The common multi-access group (~20k at 2x8: a tile written once and read once
            # by another task), _check_group's two-access case without building its list.
            a, b = codes
            if a & 1 or b & 1:
                written[i] = 1
                ta, tb = a >> 1, b >> 1
                if not ((a & 1 and ta in adds) or (b & 1 and tb in adds)):
                    if ta != tb:
                        x, y = (a, b) if pos[ta] <= pos[tb] else (b, a)
                        # before()'s direct-predecessor test first, without the call (the
                        # reader of a tile almost always waits on its writer's event)
                        if x >> 1 not in preds[y >> 1] and not before(x >> 1, y >> 1):
                            r = regions[i]
                            _race(graph, x >> 1, r, x & 1 == 1, y >> 1, r, y & 1 == 1)
                    continue
            else:
                continue
        for c in codes:
            if c & 1:
                written[i] = 1
                accesses = [(c >> 1, c & 1 == 1) for c in codes]
                _check_group(graph, reach, regions[i], accesses, adds)
                break
    # The groups each group overlaps, one of them written, by group in ascending order (the
    # order the errors are looked for in) with each one's overlapped groups in the order of
    # the pairs (see ``_overlapping_writers``): grouped by tensor ops, not by a dict and set
    # update per pair in Python (~3x10^4 pairs at 2x8).
    targets, counts, sources = _overlapping_writers(seen.table, written)
    writers_of: dict[int, list[int]] = {}
    preds = reach.preds_of
    end = 0
    for i, k in zip(targets, counts, strict=True):
        # ``over``: the writers of the groups overlapping group i: the one group's writers
        # list itself (shared, never changed) where there is one such group, else a set made
        # by the same steps as ever (set of the first, updated with each next), so that a race
        # is reported for the writer it always was
        start, end = end, end + k
        over = None
        for j in sources[start:end]:
            ws = writers_of.get(j)
            if ws is None:
                codes = codes_of[j]
                ws = writers_of[j] = (
                    [codes >> 1] if codes.__class__ is int else [c >> 1 for c in codes if c & 1]
                )
            if over is None:
                over = ws
            elif over.__class__ is list:
                over = set(over)
                over.update(ws)
            else:
                over.update(ws)
        assert over is not None
        region = regions[i]
        codes = codes_of[i]
        # Tasks reading one region usually wait on one event whose signalers are all the
        # writers it overlaps (a gather reading a whole 512-tile activation from 1024 tiles):
        # one subset test per distinct predecessor set, not per access (15M -> 0.2M
        # membership tests at 2x8).
        covered = None  # a predecessor set known to hold every writer in ``over``
        for c in (codes,) if codes.__class__ is int else codes:
            tid, is_write = c >> 1, c & 1 == 1
            direct = preds[tid]
            if direct is covered:
                continue
            if direct.issuperset(over):  # no set made for the answer of nearly every access
                covered = direct
                continue
            left = set(over).difference(direct)
            left.discard(tid)
            for w in left:
                if is_write and tid in adds and w in adds:
                    continue
                if not reach.ordered(w, tid):
                    theirs = _region_of(graph, w, region)
                    if w < tid:  # named in task order
                        _race(graph, w, theirs, True, tid, region, is_write)
                    _race(graph, tid, region, is_write, w, theirs, True)


def region_table(
    fields: list[str | int], count: int, dims: Mapping[str, tuple[int, int]]
) -> tuple[torch.Tensor | Exception | None, bool]:
    """The ``count`` groups' regions (``_Seen.fields``: five fields a region; the buffer ids are
    replaced by ints in place) as ONE int64 tensor of five columns, for ``_overlaps``, and
    whether every region lies inside its buffer, tested on that tensor at once:
    _check_structure's bounds check, which as a Python test per distinct region was ~8% of it
    at 2x8. In the tensor's place the error packing raised where a field is no int64
    (``_overlapping_pairs`` raises it, where the packing used to be), None where a region has
    not five fields; False where the test cannot tell (those cases, a buffer dimension that is
    no int64): the caller then checks the regions one by one."""
    if len(fields) != 5 * count:
        return None, False
    if not count:
        return torch.zeros((0, 5), dtype=torch.int64), True
    # struct.pack, not array("q", flat): array converts each int through PyArg_Parse (~500
    # instructions an int, ~6% of validate at 2x8)
    buffer_ids = fields[0::5]
    index = {b: i for i, b in enumerate(dict.fromkeys(buffer_ids))}
    fields[0::5] = map(index.__getitem__, buffer_ids)
    packed = bytearray(8 * len(fields))
    try:
        try:
            struct.pack_into(f"{len(fields)}q", packed, 0, *fields)
        except struct.error:
            array("q", fields)  # a field that is no int64: the error array gives here
            raise
    except Exception as error:
        return error, False
    table = torch.frombuffer(packed, dtype=torch.int64).view(-1, 5)
    shapes = [dims.get(b) for b in index]
    if None in shapes:  # (a region's fields out of step: one of them has not five)
        return None, False
    if any(rows.__class__ is not int or cols.__class__ is not int for rows, cols in shapes):
        return table, False
    with _one_thread():
        try:
            rows, cols = torch.tensor(shapes, dtype=torch.int64).index_select(0, table[:, 0]).T
        except (OverflowError, RuntimeError):
            return table, False
        _, row0, row1, col0, col1 = table.unbind(1)
        inside = (
            (row0 >= 0) & (row0 < row1) & (row1 <= rows)
            & (col0 >= 0) & (col0 < col1) & (col1 <= cols)
        )  # fmt: skip
        return table, bool(inside.all())


@contextmanager
def _one_thread() -> Iterator[None]:
    """One intra-op thread for torch: on ~10^5 elements a second one costs more than it brings,
    and on a busy machine it waits for a core (the sort: 5 ms on one thread, 50-100 ms on
    two)."""
    threads = torch.get_num_threads()
    if threads != 1:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        if threads != 1:
            torch.set_num_threads(threads)


def _overlapping_writers(
    table: torch.Tensor | Exception | None, written: bytearray
) -> tuple[list[int], list[int], list[int]]:
    """For each group i (ascending) that overlaps a written other group: i, how many such
    groups j there are, and (in the third list, one run per i) the js, in the order of the
    pairs of distinct overlapping groups, one of them written, that are found as follows.

    All regions sorted by (buffer, row0): the regions whose rows can meet region i's are the
    ones after it up to the first starting at or past its row1 (a binary search), so the
    candidate pairs are those of a per-buffer row sweep, found by a few tensor ops rather than
    a Python loop over ~10^5 regions (torch, not numpy: numpy is no dependency of mgraph).
    ``table``: the groups' regions (``region_table``)."""
    n = len(written)
    if n < 2:
        return [], [], []
    if isinstance(table, Exception):
        raise table
    assert table is not None, "a region of other than five fields is a structure error"
    with _one_thread():
        return _overlaps(table, written)


def _overlaps(table: torch.Tensor, written: bytearray) -> tuple[list[int], list[int], list[int]]:
    n = len(written)
    buf, row0, row1, col0, col1 = table.unbind(1)
    wrote = torch.frombuffer(bytearray(written), dtype=torch.uint8).bool()
    key = (buf << 32) | row0
    by_key = torch.argsort(key, stable=True)
    # in sorted order, the first region of the same buffer starting at or after row1
    # (index_select, not t[idx]: ~4x faster on CPU, and ~2x10^5 candidates are gathered)
    end = torch.searchsorted(
        key.index_select(0, by_key), ((buf << 32) | row1).index_select(0, by_key), side="left"
    )
    counts = (end - torch.arange(1, n + 1)).clamp_(min=0)
    total = int(counts.sum())
    if total == 0:
        return [], [], []
    # expand each sorted position p into its candidates p+1 .. end[p]-1
    left = torch.repeat_interleave(torch.arange(n), counts)
    starts = torch.cumsum(counts, 0) - counts
    right = left + 1 + (torch.arange(total) - starts.index_select(0, left))
    i, j = by_key.index_select(0, left), by_key.index_select(0, right)
    keep = (
        (col0.index_select(0, i) < col1.index_select(0, j))
        & (col0.index_select(0, j) < col1.index_select(0, i))
        & (wrote.index_select(0, i) | wrote.index_select(0, j))
    )
    i, j = i[keep], j[keep]
    # each pair (i, j) as its directed edges: to i from j where j is written, then to j from
    # i where i is; a stable sort by target keeps each target's sources in pair order
    target = torch.stack((i, j), 1).view(-1)
    source = torch.stack((j, i), 1).view(-1)
    valid = torch.stack((wrote.index_select(0, j), wrote.index_select(0, i)), 1).view(-1)
    target, source = target[valid], source[valid]
    by_target = torch.argsort(target, stable=True)
    targets, counts = torch.unique_consecutive(
        target.index_select(0, by_target), return_counts=True
    )
    return targets.tolist(), counts.tolist(), source.index_select(0, by_target).tolist()


def _region_of(graph: TaskGraph, tid: int, near: Region) -> Region:
    """The write of task ``tid`` that overlaps ``near`` (for the race message)."""
    return next(w for w in graph.tasks[tid].writes if w.overlaps(near))


def _check_group(graph: TaskGraph, reach: Reachability, region: Region,
                 accesses: list[tuple[int, bool]], adds: set[int]) -> None:
    """The accesses of one exact region (see check_races), in topological order."""
    pos = reach.pos
    if len(accesses) == 2:
        # The common multi-access group (a tile written once and read once): the chain below
        # reduces to one check, that the first access (by position) is ordered before the second.
        (a, wa), (b, wb) = accesses
        if (wa and a in adds) or (wb and b in adds):
            pass  # fall through to the pairwise check
        else:
            if a != b and (wa or wb):
                x, wx, y, wy = (a, wa, b, wb) if pos[a] <= pos[b] else (b, wb, a, wa)
                if not reach.before(x, y):
                    _race(graph, x, region, wx, y, region, wy)
            return
    if any(tid in adds for tid, w in accesses if w):
        # Accumulating writers need not be ordered among themselves, which breaks the chain
        # argument: check these (few) groups pair by pair.
        for i, (a, wa) in enumerate(accesses):
            for b, wb in accesses[i + 1 :]:
                if a == b or not (wa or wb) or (wa and wb and a in adds and b in adds):
                    continue
                x, y = (a, b) if pos[a] < pos[b] else (b, a)
                if not reach.before(x, y):
                    _race(graph, a, region, wa, b, region, wb)
        return
    last_write = -1
    reads: list[int] = []
    for tid, is_write in sorted(accesses, key=lambda acc: pos[acc[0]]):
        if last_write >= 0 and last_write != tid and not reach.before(last_write, tid):
            _race(graph, last_write, region, True, tid, region, is_write)
        if is_write:
            for r in reads:
                if r != tid and not reach.before(r, tid):
                    _race(graph, r, region, False, tid, region, True)
            last_write, reads = tid, []
        else:
            reads.append(tid)


def _race(graph, a: int, ra: Region, wa: bool, b: int, rb: Region, wb: bool) -> None:
    ta, tb = graph.tasks[a], graph.tasks[b]
    what = "write/write" if wa and wb else "read/write"
    raise RaceError(
        f"{what} race: task {ta.name!r} ({'writes' if wa else 'reads'} {ra}) and task "
        f"{tb.name!r} ({'writes' if wb else 'reads'} {rb}) are not ordered",
        hint="make one wait (with the full count) on an event the other signals",
    )
