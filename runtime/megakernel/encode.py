"""Encode one rank's share of a Schedule into the megakernel's int32 tables (mgraph/ops/abi.py).

Pure torch on the CPU: tested in CI. What depends on device addresses (where each buffer and
event lives) is left symbolic here: the layout gives each buffer an offset in its rank's arena and
each event an index in its rank's flag array; the runtime adds the ranks' base addresses.

Worker programs: compute first, then nvlink, then rdma, as the schedule's SM partition says. A
single program with role ALL runs the rank's whole queue in one global order: that is how the
Triton interpreter (which runs programs one after another) executes a schedule on the CPU.

Multi-node graphs (netplan.py): an rdma task becomes a PUSH of its precomputed FIFO commands
(int64 rows of ``cmds``; the kernel patches in the epoch and the header) and signals nothing
itself: the proxies raise its events in net words, which waiters add to the event's GPU word.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from mgraph.errors import ScheduleError
from mgraph.graph import ITEMSIZE, TaskGraph
from mgraph.kinds import KINDS, ROLES, Role
from mgraph.ops.abi import (
    F_CMD0,
    F_GID,
    F_KIND,
    F_NCMD,
    F_NPARAM,
    F_NREAD,
    F_NSIG,
    F_NWAIT,
    F_NWRITE,
    F_PARAM0,
    F_READ0,
    F_SIG0,
    F_WAIT0,
    F_WRITE0,
    POS_FIELDS,
    QINFO_FIELDS,
    REGION_FIELDS,
    SEG_FIELDS,
    SIGNAL_FIELDS,
    TASK_FIELDS,
    WAIT_FIELDS,
)
from mgraph.runtime.proxy.command import WORDS, encode

from .netplan import NetPlan, net_plan

__all__ = [
    "Layout", "RankTables", "layout", "encode_rank", "ROLE_ALL", "ALIGN", "kind_id", "PUSH_ID",
    "tma_rows", "gemm_by_pointers", "gemm_a_vectors",
]

ROLE_ALL = len(ROLES)  # role index of a program that serves every queue (interpreter mode)
PUSH_ID = 1 << 16  # the kind id of an rdma task (push its FIFO commands): past every registry
# index, so kinds defined later (custom ops) never collide with it
ALIGN = 256  # bytes: TMA needs 16-byte aligned bases; 256 keeps every tile row-aligned too


def kind_id(kind: str) -> int:
    """The kind's position in the one kind registry (the kernel's dispatch constant)."""
    return list(KINDS).index(kind)


@dataclass
class Layout:
    """Where every buffer and event lives, for every rank (all ranks compute the same layout)."""

    offset: dict[str, int]  # buffer id -> byte offset in its rank's arena
    arena_bytes: int  # the largest rank's arena (symmetric allocations are equal-sized)
    event_index: list[int]  # event id -> index in its rank's flag array
    flag_count: int  # the largest rank's number of events
    net: NetPlan | None = None  # multi-node graphs: commands and the proxies' net words

    @property
    def net_base(self) -> int:
        """Index of the first net word in a rank's flag array (after the events and the node
        barrier's start flag)."""
        return self.flag_count + 1

    @property
    def flag_words(self) -> int:
        """int32 words of every rank's flag array: events, start flag, net words."""
        return self.net_base + (self.net.count if self.net is not None else 0)


def layout(graph: TaskGraph) -> Layout:
    used = [0] * graph.topology.world_size
    offset: dict[str, int] = {}
    for buf in graph.buffers.values():
        start = -(-used[buf.rank] // ALIGN) * ALIGN
        offset[buf.id] = start
        used[buf.rank] = start + buf.rows * buf.cols * ITEMSIZE[buf.dtype]
    count = [0] * graph.topology.world_size
    index = []
    for ev in graph.events:
        index.append(count[ev.rank])
        count[ev.rank] += 1
    has_rdma = any(t.role == Role.RDMA.value for t in graph.tasks)
    net = net_plan(graph) if has_rdma else None
    return Layout(offset, max(max(used), ALIGN), index, max(max(count), 1), net)


@dataclass
class RankTables:
    """One rank's tables (CPU int32 tensors) plus what the runtime needs to fill addresses."""

    rank: int | None  # None: every rank's tasks (single-program interpreter mode)
    tasks: torch.Tensor  # [T, TASK_FIELDS]
    regions: torch.Tensor  # [R, REGION_FIELDS]
    waits: torch.Tensor  # [Wn, WAIT_FIELDS]
    signals: torch.Tensor  # [Sn, SIGNAL_FIELDS]
    queues: torch.Tensor  # concatenated role queues (local task indices), then the ALL queue
    qinfo: torch.Tensor  # [len(ROLES) + 1, QINFO_FIELDS]: offset, length, workers, static
    roles: torch.Tensor  # [programs]: role index of each worker program
    params: torch.Tensor  # int32 words: each task's declared params (floats as float32 bits)
    segs: torch.Tensor  # [S, SEG_FIELDS]: the GEMM segments of the static queue prefix
    segwaits: torch.Tensor  # [n, WAIT_FIELDS]: the segments' hoisted waits
    segpos: torch.Tensor  # [static tasks, POS_FIELDS]: per static position, its tile coordinates
    prefix_adds: bool  # the prefix's GEMMs reduce-add into zeroed buffers (params accumulate)
    slots: list[str] = field(default_factory=list)  # buffer id per buffer slot
    event_slots: list[int] = field(default_factory=list)  # event id per event slot
    local_tasks: list[int] = field(default_factory=list)  # graph task id per local task index
    kinds: set[str] = field(default_factory=set)
    a0_slot: int = 0  # the most used GEMM A buffer slot (its descriptor is built once per launch)
    b0_slot: int = 0  # likewise for B
    # Multi-node only (see netplan.py); word indices are relative to a rank's net region.
    cmds: torch.Tensor | None = None  # [C, 16] int64: start SIGNALs first, then tasks' commands
    start_cmds: int = 0  # the first rows of cmds: pushed by program 0 at entry
    event_net: list[tuple[int, list[int]]] = field(default_factory=list)  # per event slot: its
    # rank and the net words a waiter adds to its count (none: the proxies never raise it)
    exits: list[tuple[int, int, int]] = field(default_factory=list)  # rank, word, per launch
    starts: list[tuple[int, int]] = field(default_factory=list)  # rank, word: wait for epoch
    # Events of this rank that only other ranks' tasks signal and no local task waits for (a
    # peer's epilogue stores into this rank's output): (event slot, signals per launch). The
    # kernel waits for them before it ends, so a finished launch holds every byte peers owe it.
    exit_events: list[tuple[int, int]] = field(default_factory=list)

    @property
    def programs(self) -> int:
        return int(self.roles.numel())


def encode_rank(
    schedule, rank: int | None, *, single_program: bool = False, net: NetPlan | None = None
) -> RankTables:
    """Tables for ``rank``. ``single_program`` gives one ALL-role program (interpreter mode);
    ``rank=None`` encodes every rank's tasks for that one program, in the schedule's global
    order (the interpreter runs programs one by one, so it cannot spin across ranks). ``net``:
    the graph's network plan when the caller has one (``layout(graph).net``)."""
    graph: TaskGraph = schedule.graph
    if rank is None:
        assert single_program, "all ranks in one table set only for the single-program mode"
    rs = schedule.ranks[rank if rank is not None else 0]
    total = [0] * len(graph.events)
    # Scope: an event only this GPU signals and waits on needs gpu-scope release/acquire; one that
    # crosses GPUs needs sys scope, which costs a system-wide fence per signal.
    crosses = [False] * len(graph.events)
    for t in graph.tasks:
        for e in t.signals:
            total[e] += 1
            if graph.events[e].rank != t.rank:
                crosses[e] = True
    order = [tid for tid in schedule.order() if rank is None or graph.tasks[tid].rank == rank]
    local = {tid: i for i, tid in enumerate(order)}
    slot_of: dict[str, int] = {}
    ev_slot: dict[int, int] = {}
    tasks, regions, waits, signals, params = [], [], [], [], []

    def slot(buffer_id: str) -> int:
        if buffer_id not in slot_of:
            slot_of[buffer_id] = len(slot_of)
        return slot_of[buffer_id]

    def eslot(event: int) -> int:
        if event not in ev_slot:
            ev_slot[event] = len(ev_slot)
        return ev_slot[event]

    if net is None and any(t.role == Role.RDMA.value for t in graph.tasks):
        net = net_plan(graph)
    cmd_rows: list[list[int]] = []
    start_cmds = 0
    if net is not None and rank is not None:
        cmd_rows += [_cmd_row(c) for c in net.start_commands(rank)]
        start_cmds = len(cmd_rows)
    kinds = set()
    for tid in order:
        t = graph.tasks[tid]
        row = [0] * TASK_FIELDS
        row[F_WAIT0], row[F_NWAIT] = len(waits), len(t.waits)
        waits += [
            [eslot(e), c, total[e], int(crosses[e] or graph.events[e].rank != t.rank)]
            for e, c in t.waits
        ]
        row[F_GID] = tid
        tasks.append(row)
        if t.role == Role.RDMA.value:  # a push of its commands; the proxies raise its events
            kinds.add("push")
            row[F_KIND] = PUSH_ID
            row[F_CMD0] = len(cmd_rows)
            cmd_rows += [_cmd_row(c) for c in net.commands[tid]]
            row[F_NCMD] = len(cmd_rows) - row[F_CMD0]
            row[F_SIG0] = len(signals)
            continue
        kinds.add(t.kind)
        row[F_KIND] = kind_id(t.kind)
        row[F_READ0], row[F_NREAD] = len(regions), len(t.reads)
        regions += [[slot(r.buffer), r.row0, r.row1, r.col0, r.col1] for r in t.reads]
        row[F_WRITE0], row[F_NWRITE] = len(regions), len(t.writes)
        regions += [[slot(w.buffer), w.row0, w.row1, w.col0, w.col1] for w in t.writes]
        row[F_SIG0], row[F_NSIG] = len(signals), len(t.signals)
        row[F_PARAM0] = len(params)
        params += _param_words(t)
        row[F_NPARAM] = len(params) - row[F_PARAM0]
        signals += [
            [eslot(e), int(crosses[e] or graph.events[e].rank != t.rank)] for e in t.signals
        ]

    qrows, flat = [], []
    # One program running every task in global order cannot hoist a wait: its signaller may
    # come later in that same order.
    prefix = _Prefix(graph, slot, eslot, total, crosses, net, hoist=not single_program)
    for role in ROLES:
        q = [] if rank is None else [local[tid] for tid in rs.queues.get(role.value, [])]
        n = rs.workers.get(role.value, 0) if q else 0
        if q and n < 1:
            raise ScheduleError(f"rank {rank} has {role.value} tasks but no {role.value} workers")
        static = 0
        if role == Role.COMPUTE and not single_program:
            static = prefix.cut([order[i] for i in q], local)
        qrows.append([len(flat), len(q), 0 if single_program else n, static])
        flat += q
    static = prefix.cut(order, local) if single_program else 0
    qrows.append([len(flat), len(order), 1 if single_program else 0, static])
    flat += list(range(len(order)))
    if single_program:
        roles = [ROLE_ALL]
    else:
        roles = [i for i, role in enumerate(ROLES) for _ in range(qrows[i][2])]
    event_net, exits, starts = [], [], []
    if net is not None:
        for e in ev_slot:
            event_net.append((graph.events[e].rank, net.event_words.get(e, [])))
        for r in [rank] if rank is not None else graph.topology.ranks:
            exits += [
                (r, w, net.per_launch[r][w])
                for key, w in net.words[r].items()
                if key[0] in net.exit_keys
            ]
        if rank is not None:
            starts = [(rank, net.words[rank][("start", q)]) for q in net.peers[rank]]

    waited = {e for tid in order for e, _ in graph.tasks[tid].waits}
    mine = set(graph.topology.ranks) if rank is None else {rank}
    remote_signalled = {
        e for t in graph.tasks if t.rank not in mine for e in t.signals
        if graph.events[e].rank in mine and e not in waited
    }
    exit_events = [(eslot(e), total[e]) for e in sorted(remote_signalled)]

    def i32(rows, width=None):
        if not rows:
            return torch.zeros((0, width) if width else (0,), dtype=torch.int32)
        return torch.tensor(rows, dtype=torch.int32)

    # The descriptors ad0/bd0 serve GEMMs on the TMA path: count those. A rank whose GEMMs
    # all run by pointers still gets slots (the kernel builds, never uses, their descriptors).
    gemm_tids = [tid for tid in order if graph.tasks[tid].kind in GEMM_KINDS]
    on_tma = [tid for tid in gemm_tids if not gemm_by_pointers(graph, graph.tasks[tid])]
    a_use: dict[int, int] = {}
    b_use: dict[int, int] = {}
    for tid in on_tma or gemm_tids:  # (gemm_glu's packed B tile is a gemm B tile too)
        t = graph.tasks[tid]
        a, b = slot_of[t.reads[0].buffer], slot_of[t.reads[1].buffer]
        a_use[a] = a_use.get(a, 0) + 1
        b_use[b] = b_use.get(b, 0) + 1
    return RankTables(
        rank=rank,
        tasks=i32(tasks, TASK_FIELDS),
        regions=i32(regions, REGION_FIELDS),
        waits=i32(waits, WAIT_FIELDS),
        signals=i32(signals, SIGNAL_FIELDS),
        queues=i32(flat),
        qinfo=i32(qrows, QINFO_FIELDS),
        roles=i32(roles),
        params=i32(params) if params else torch.zeros(1, dtype=torch.int32),
        segs=i32(prefix.segs, SEG_FIELDS),
        segwaits=i32(prefix.waits, WAIT_FIELDS),
        segpos=i32(prefix.pos, POS_FIELDS),
        prefix_adds=bool(prefix.add),
        slots=list(slot_of),
        event_slots=list(ev_slot),
        local_tasks=order,
        kinds=kinds,
        a0_slot=max(a_use, key=a_use.get) if a_use else 0,
        b0_slot=max(b_use, key=b_use.get) if b_use else 0,
        cmds=torch.tensor(cmd_rows, dtype=torch.int64) if cmd_rows else None,
        start_cmds=start_cmds,
        event_net=event_net,
        exits=exits,
        starts=starts,
        exit_events=exit_events,
    )


# The largest GEMM block the kernel compiles (its accumulator is BM x BN fp32 in registers: 128
# x 256 is what one warpgroup pair holds without spilling). A task's tile may be larger: the
# dynamic GEMM body runs it block by block (mgraph/ops/tiles.gemm_tile).
MAX_BLOCK = (128, 256)


GEMM_KINDS = ("gemm", "gemm_glu")  # kinds whose bodies run on the GEMM block (BM, BN)


def gemm_block(gemms) -> tuple[int, int]:
    """The GEMM block (BM, BN) for tasks of GEMM_KINDS: the largest tile, capped at MAX_BLOCK;
    smaller tiles are the short edge tiles, larger ones run as several blocks. A gemm_glu
    output column reads two packed B columns (its block is BM x BN/2 outputs), so its width
    counts twice; its tiles are multiples of 128 columns, so BN is 256 wherever it runs.
    Triton's blocks are powers of two, and a dot's at least 16 x 16: a largest tile of another
    size (a Linear of 100 outputs over 80 tokens) gets the next such block, whose rows and
    columns past the tile are the masked edge."""
    def block(size: int, cap: int) -> int:
        return min(max(16, 1 << (size - 1).bit_length()), cap)

    return (block(max(t.writes[0].shape[0] for t in gemms), MAX_BLOCK[0]),
            block(max(t.writes[0].shape[1] * (2 if t.kind == "gemm_glu" else 1) for t in gemms),
                  MAX_BLOCK[1]))


def tma_rows(graph: TaskGraph, buffer_id: str) -> bool:
    """Whether TMA can address the rows of ``buffer_id`` as the GEMM bodies read it (in the
    graph's dtype): a row pitch of whole 16-byte units (bases are ALIGN-aligned)."""
    return graph.buffers[buffer_id].cols * ITEMSIZE[graph.dtype] % 16 == 0


def gemm_by_pointers(graph: TaskGraph, t) -> bool:
    """Whether the GEMM body runs task ``t`` (of GEMM_KINDS) by pointers (tiles.gemm_pointers)
    rather than through TMA: A's or B's rows are not whole 16-byte units, or the task
    reduce-adds into a write whose rows are not (the TMA path's reduce is a TMA store). Plain
    writes do not count: the body stores them through pointers either way. Mirrors the test
    gemm_tile makes at run time (tiles.gemm_tma_rows)."""
    if not (tma_rows(graph, t.reads[0].buffer) and tma_rows(graph, t.reads[1].buffer)):
        return True
    return bool(t.params.get("accumulate")) and not all(
        tma_rows(graph, w.buffer) for w in t.writes)


def gemm_a_vectors(graph: TaskGraph, t) -> bool:
    """Whether a task the GEMM body runs by pointers (:func:`gemm_by_pointers`) reads A in
    16-byte vectors, in the transposed block shape (gemm_pointers._vectors at run time): A's
    rows, its first column and its K range are whole 16-byte units (bases are ALIGN-aligned)."""
    a, item = t.reads[0], ITEMSIZE[graph.dtype]
    return tma_rows(graph, a.buffer) and a.col0 * item % 16 == 0 and (a.col1 - a.col0) * item % 16 == 0


def tma_exact(graph: TaskGraph, t, block: tuple[int, int], bk: int = 64) -> bool:
    """Whether whole-block TMA loads and stores compute exactly ``t``'s tile: TMA zero-fills
    loads and clips stores only at a buffer's END, so a tile whose last block row (column) is
    short must end every buffer it writes, and a K range that is not a multiple of ``bk`` must
    end A's columns and B's rows. (The dynamic GEMM body masks instead, so tiles that are not
    exact run there.)"""
    rows, cols = t.writes[0].shape
    for w in t.writes:
        buf = graph.buffers[w.buffer]
        if (rows % block[0] and w.row1 != buf.rows) or (cols % block[1] and w.col1 != buf.cols):
            return False
    a, b = t.reads[0], t.reads[1]
    if (a.col1 - a.col0) % bk:
        return a.col1 == graph.buffers[a.buffer].cols and b.row1 == graph.buffers[b.buffer].rows
    return True


class _Prefix:
    """The compute queue's static prefix: its leading GEMM tasks, cut into segments.

    The kernel runs these tasks statically (position j of the prefix on compute program j mod
    P, in one software-pipelined loop per segment: no atomics, waits or fences inside) and
    raises their signals once per program, after the whole prefix. A segment's tasks share A,
    B, the K range and the buffers of writes 0 and 1 (one TMA descriptor each per segment).

    A GEMM joins the prefix when it waits for nothing, or when every event it waits for is
    raised only by tasks that themselves wait for nothing and run outside this rank's compute
    queue (e.g. the NVLink copies of a gather): such a wait can be hoisted to the start of the
    segment (every program waits once, before the loop) without any possible deadlock, since
    its signallers always finish. Waits on events the network proxies raise are not hoisted.
    """

    def __init__(self, graph: TaskGraph, slot, eslot, total, crosses, net, *,
                 hoist: bool) -> None:
        self.graph, self.slot, self.eslot = graph, slot, eslot
        self.hoist = hoist
        self.total, self.crosses, self.net = total, crosses, net
        self.segs: list[list[int]] = []
        self.waits: list[list[int]] = []
        self.pos: list[list[int]] = []
        self.signallers: dict[int, list] = {}
        for t in graph.tasks:
            for e in t.signals:
                self.signallers.setdefault(e, []).append(t)
        gemms = [t for t in graph.tasks if t.kind == "gemm"]
        self.block = gemm_block(gemms) if gemms else (0, 0)
        self.nw: int | None = None  # writes per task: the kernel's SEG_NW
        self.add: bool | None = None  # writes reduce-add (the kernel's SEG_ADD)

    def hoistable(self, t) -> bool:
        if t.waits and not self.hoist:
            return False
        for e, _ in t.waits:
            if self.net is not None and self.net.event_words.get(e):
                return False
            for s in self.signallers.get(e, []):
                if s.waits or (s.role == Role.COMPUTE.value and s.rank == t.rank):
                    return False
        return True

    def cut(self, queue: list[int], local: dict[int, int]) -> int:
        """Append the segments of ``queue``'s prefix; return how many tasks they cover."""
        graph, slot = self.graph, self.slot
        count = 0
        waits: dict[int, int] = {}  # the current segment's hoisted waits: event -> count
        for tid in queue:
            t = graph.tasks[tid]
            # One writes-per-task count for the whole prefix (the kernel's SEG_NW constexpr),
            # at most 2 (each a TMA descriptor); other GEMMs run in the dynamic part.
            add = bool(t.params.get("accumulate"))
            if (t.kind != "gemm" or len(t.writes) > 2 or self.nw not in (None, len(t.writes))
                    or self.add not in (None, add) or not self.hoistable(t)
                    # its loads and stores are all TMA: rows of whole 16-byte units only
                    or not all(tma_rows(graph, r.buffer) for r in (*t.reads, *t.writes))
                    or not tma_exact(graph, t, self.block)
                    or t.writes[0].shape[0] > self.block[0]
                    or t.writes[0].shape[1] > self.block[1]):  # one block a position
                break
            self.nw, self.add = len(t.writes), add
            a, b = t.reads
            w0 = t.writes[0]
            w1 = t.writes[1] if len(t.writes) > 1 else w0
            key = [slot(a.buffer), slot(b.buffer), a.col0, a.col1, len(t.writes),
                   slot(w0.buffer), slot(w1.buffer) if len(t.writes) > 1 else -1]
            segs = self.segs
            if not (segs and segs[-1][2:9] == key and segs[-1][0] + segs[-1][1] == count):
                self._close(waits)
                waits = {}
                segs.append([count, 0, *key, len(self.waits), 0])
            segs[-1][1] += 1
            for e, c in t.waits:
                waits[e] = max(c, waits.get(e, 0))
            self.pos.append([a.row0, b.row0, b.col0, w0.row0, w0.col0, w1.row0, w1.col0,
                             local[tid]])
            count += 1
        self._close(waits)
        return count

    def _close(self, waits: dict[int, int]) -> None:
        if not self.segs or self.segs[-1][-1] or not waits:
            return
        rows = [[self.eslot(e), c, self.total[e], int(self.crosses[e])]
                for e, c in sorted(waits.items())]
        self.segs[-1][-2] = len(self.waits)
        self.segs[-1][-1] = len(rows)
        self.waits += rows


def _param_words(task) -> list[int]:
    """The task's params in its kind's declared order, one int32 word each (floats as float32
    bits); a declared param the task lacks, or a value of another type, is a ScheduleError."""
    import struct

    words = []
    spec = KINDS[task.kind]
    for name in spec.params:
        if name not in task.params and name in spec.param_defaults:
            words.append(int(spec.param_defaults[name]))
            continue
        if name not in task.params:
            raise ScheduleError(
                f"task {task.name!r} (kind {task.kind!r}) has no param {name!r}",
                hint=f"the kind declares params {KINDS[task.kind].params}: set each in the "
                "task's params",
            )
        value = task.params[name]
        if isinstance(value, bool) or isinstance(value, int):
            if not -(2**31) <= int(value) < 2**31:
                raise ScheduleError(f"task {task.name!r}: param {name}={value} exceeds int32")
            words.append(int(value))
        elif isinstance(value, float):
            words.append(struct.unpack("<i", struct.pack("<f", value))[0])
        else:
            raise ScheduleError(
                f"task {task.name!r}: param {name}={value!r} is not an int or a float",
                hint="the megakernel passes params as int32 or float32 words",
            )
    return words


def _cmd_row(cmd) -> list[int]:
    """A command's 16 words as the kernel reads them: word 0 holds only the opcode (the kernel
    writes the header with the ticket's sequence number)."""
    words = encode(cmd, 1)
    words[0] = int(cmd.opcode)
    assert len(words) == WORDS
    return words
