"""What the megakernel's RDMA workers push, and the flag words the host proxies raise.

Pure Python over the graph: every rank computes the same plan, so a command's buffer indices and
event words mean the same thing in the pushing process and in the peer's memory.

Net words. A GPU event counter may be signalled both by tiles on GPUs (atomic adds) and by a
host proxy, which cannot add: it writes a running count with a copy-engine memory operation
(cuStreamWriteValue32, ordered after the data copy). So the proxy never touches an event's GPU
word. Instead each rank has a region of "net words" after its event flags, each with exactly ONE
writing proxy, and a waiter sums the event's GPU word and its net words. The words are, per rank:

- ``("task", t)``: rdma task ``t`` (on another rank, or this one) delivered its region here. The
  WRITE raises it once, and every event of this rank that ``t`` signals counts it: a tile
  chunk that feeds several consumer tiles costs one flag, not one SIGNAL command per consumer;
- ``("event", e, src, lane)``: event ``e`` of this rank (the source's own) raised by ``src``'s
  proxy after a write of that lane completed (an rdma task's events on its own rank);
- ``("arrive", src, lane)``: WRITEs from ``src`` of that lane whose task signals nothing here:
  the kernel waits for them at exit, so no launch ends with data in flight into it;
- ``("sent", lane)``: this rank's WRITEs of that lane that completed (the source may be
  overwritten);
- ``("start", src)``: ``src`` started this launch. Before any task, a rank waits for the start
  of every remote peer it exchanges data with: a peer that started launch k has finished reading
  what launch k-1 left in its buffers, so writes of launch k may land.

Lanes. A proxy may execute commands on several copy streams (``Settings.proxy_streams``): a
command carries a lane (command word LANE) and runs on stream ``lane mod streams``. Streams run
in no order relative to each other, and a running count written by two of them could go
backwards (stream 1 writes 5, then stream 0 writes 3). So every word that several rdma tasks
raise is split per lane: all raises of a word come from commands of ONE lane, hence one stream,
whatever the stream count; waiters already sum word lists (``event_words``, the exit words).
An rdma task's lane is its position among its rank's rdma tasks (task id order), in blocks of
``LANE_BLOCK``, modulo ``LANES``: neighbouring chunks share a lane, so they still coalesce into
one copy and a proxy batch raises one "sent" word, while consecutive blocks feed different
streams. The lane count is fixed here, not taken from the settings, so that the plan (and the
tables every process builds from it) does not depend on a proxy knob; with one stream every
lane maps to stream 0 and the proxy behaves as before, at the cost of up to ``LANES`` "sent"
and "arrive" words per rank instead of one each.

Every word's raises per launch are known here (``per_launch``), so targets are epoch-tagged like
GPU events. At exit one program waits for the "sent" and "arrive" words (``exit_keys``): when
the kernel ends, all of its sends completed and all data bound for it arrived (task words are
waited for by the tasks that consume them).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mgraph.errors import ScheduleError
from mgraph.graph import Task, TaskGraph
from mgraph.kinds import Role
from mgraph.runtime.proxy.command import Command, Rect

__all__ = ["NetPlan", "net_plan", "LANES", "LANE_BLOCK"]

Key = tuple
LANES = 8  # the most copy streams a proxy can use concurrently (Settings.proxy_streams <= 8)
LANE_BLOCK = 8  # consecutive rdma tasks of a rank per lane: one default proxy batch


@dataclass
class NetPlan:
    """See the module docstring. Commands carry epoch 0; the kernel patches the launch's."""

    words: list[dict[Key, int]]  # per rank: key -> net word index
    per_launch: list[list[int]]  # per rank: raises per launch of each word
    commands: dict[int, list[Command]]  # rdma task id -> its commands, in push order
    peers: list[list[int]]  # per rank: remote ranks it exchanges data with
    buffer_index: dict[str, int]  # buffer id -> index in its rank's registered memory
    event_words: dict[int, list[int]] = field(default_factory=dict)  # event -> its net words
    lanes: dict[int, int] = field(default_factory=dict)  # rdma task id -> its lane

    exit_keys = ("sent", "arrive")

    @property
    def count(self) -> int:
        """Net words of the rank with the most (every rank allocates this many)."""
        return max((len(w) for w in self.words), default=0)

    def start_commands(self, rank: int) -> list[Command]:
        return [
            Command.signal(rank, q, self.words[q][("start", rank)]) for q in self.peers[rank]
        ]

    def describe(self, rank: int, word: int) -> str:
        """The key of net word ``word`` on ``rank``, for error messages."""
        for key, index in self.words[rank].items():
            if index == word:
                return " ".join(str(k) for k in key)
        return f"word {word}"


def _endpoints(graph: TaskGraph, t: Task) -> tuple[int, list[int], list[int]]:
    if len(t.reads) != 1 or len(t.writes) != 1:
        raise ScheduleError(
            f"{graph.op}: rdma task {t.name!r} reads {len(t.reads)} and writes {len(t.writes)} "
            "regions; a network transfer moves one region into one region",
        )
    dst = graph.buffers[t.writes[0].buffer].rank
    dst_events = [e for e in t.signals if graph.events[e].rank == dst]
    src_events = [e for e in t.signals if graph.events[e].rank == t.rank]
    other = [e for e in t.signals if graph.events[e].rank not in (dst, t.rank)]
    if other:
        ev = graph.events[other[0]]
        raise ScheduleError(
            f"{graph.op}: rdma task {t.name!r} (rank {t.rank} -> {dst}) signals event "
            f"{ev.name!r} on rank {ev.rank}, a third rank",
            hint="a transfer raises events on its destination or its source only",
        )
    return dst, dst_events, src_events


def lane_of(graph: TaskGraph, lanes: int = LANES, block: int = LANE_BLOCK) -> dict[int, int]:
    """rdma task id -> lane: its position among its rank's rdma tasks (id order), in blocks of
    ``block``, modulo ``lanes`` (see the module docstring)."""
    if lanes < 1 or block < 1:
        raise ScheduleError(f"{graph.op}: lanes={lanes} and block={block} must be >= 1")
    seen: dict[int, int] = {}
    out: dict[int, int] = {}
    for t in sorted((t for t in graph.tasks if t.role == Role.RDMA.value), key=lambda t: t.id):
        i = seen.get(t.rank, 0)
        seen[t.rank] = i + 1
        out[t.id] = (i // block) % lanes
    return out


def net_plan(graph: TaskGraph, *, lanes: int = LANES, block: int = LANE_BLOCK) -> NetPlan:
    ranks = graph.topology.world_size
    rdma = [t for t in graph.tasks if t.role == Role.RDMA.value]
    lane = lane_of(graph, lanes, block)
    index: dict[str, int] = {}
    per_rank = [0] * ranks
    for buf in graph.buffers.values():  # graph order, the same in every process
        index[buf.id] = per_rank[buf.rank]
        per_rank[buf.rank] += 1

    # Raises per launch of every key, by rank.
    raises: list[dict[Key, int]] = [{} for _ in range(ranks)]
    peers: list[set[int]] = [set() for _ in range(ranks)]

    def bump(rank: int, key: Key) -> None:
        raises[rank][key] = raises[rank].get(key, 0) + 1

    ends = {}
    for t in rdma:
        dst, dst_events, src_events = _endpoints(graph, t)
        ends[t.id] = dst, dst_events, src_events
        if dst != t.rank:
            peers[t.rank].add(dst)
            peers[dst].add(t.rank)
        if len(set(dst_events)) != len(dst_events):
            raise ScheduleError(
                f"{graph.op}: rdma task {t.name!r} signals an event twice",
                hint="its arrival raises one flag that each of its events counts once",
            )
        ln = lane[t.id]
        bump(dst, ("task", t.id) if dst_events else ("arrive", t.rank, ln))
        for e in src_events:
            bump(t.rank, ("event", e, t.rank, ln))
        if not src_events:
            bump(t.rank, ("sent", ln))
    for r in range(ranks):
        for q in peers[r]:
            bump(r, ("start", q))

    words: list[dict[Key, int]] = [{} for _ in range(ranks)]
    for r in range(ranks):
        for key in sorted(raises[r], key=lambda k: (k[0], k[1:])):
            words[r][key] = len(words[r])
    per_launch = [[raises[r][k] for k in words[r]] for r in range(ranks)]
    event_words: dict[int, list[int]] = {}
    for t in rdma:
        dst, dst_events, src_events = ends[t.id]
        for e in dst_events:
            event_words.setdefault(e, []).append(words[dst][("task", t.id)])
        for e in set(src_events):
            event_words.setdefault(e, []).append(words[t.rank][("event", e, t.rank, lane[t.id])])
    event_words = {e: sorted(set(w)) for e, w in event_words.items()}

    commands: dict[int, list[Command]] = {}
    for t in rdma:
        dst, dst_events, src_events = ends[t.id]
        src, dreg = t.reads[0], t.writes[0]
        ln = lane[t.id]
        arrive = ("task", t.id) if dst_events else ("arrive", t.rank, ln)
        done = ("event", src_events[0], t.rank, ln) if src_events else ("sent", ln)
        cmds = [
            Command.write(
                t.rank,
                Rect(index[src.buffer], src.row0, src.row1, src.col0, src.col1),
                dst,
                Rect(index[dreg.buffer], dreg.row0, dreg.row1, dreg.col0, dreg.col1),
                bytes=graph.region_bytes(src),
                event=words[dst][arrive],
                done_event=words[t.rank][done],
                task=t.id,
                lane=ln,
            )
        ]
        # Further events on the source: SIGNALs of the same lane, so executed after the write
        # (stream order).
        cmds += [
            Command.signal(
                t.rank, t.rank, words[t.rank][("event", e, t.rank, ln)], task=t.id, lane=ln
            )
            for e in src_events[1:]
        ]
        commands[t.id] = cmds
    return NetPlan(
        words, per_launch, commands, [sorted(p) for p in peers], index, event_words, lane
    )
