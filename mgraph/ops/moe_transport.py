"""MoE transport: a region from one rank to another by the links the network has.

Same node: one NVLink push. Other node: RDMA to the source's rail peer on the destination node
(the only peers a rail network joins); when that is not the destination, the rail peer forwards
over NVLink from a relay slot reserved for this (source, destination) pair.

Moves whose size is data (``Counted``): the NVLink legs are ``moe_move`` tasks that copy only
the filled rows of each segment, as the counts say. RDMA legs copy the whole region: the proxy
encodes its WRITEs at launch from the static regions (runtime/network.py), so a count-sized
WRITE needs a proxy (or GPU RDMA worker) that reads the count first.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..builder import GraphBuilder
from ..graph import Buffer, Region, Task
from ..kinds import Role, TaskKind
from .moe_tiles import MOE_MOVE

__all__ = ["Counted", "move", "relay_index"]

COPY = TaskKind.COPY.value


@dataclass(frozen=True)
class Counted:
    """The counts of a move's segments: a region at the source, one at the destination and the
    tasks that land the latter (empty when it is there already)."""

    at_src: Region
    at_dst: Region
    landed: list[Task]
    segment_rows: int
    expected_fill: float  # the sim's expectation of filled rows / capacity rows (no data there)


def relay_index(b: GraphBuilder, relay: int, src: int, dst: int) -> int:
    """The slot of (src, dst) in ``relay``'s staging buffers: one per (remote node, node peer)."""
    topo = b.topo
    nodes = [n for n in range(topo.nodes) if n != topo.node_of(relay)]
    peers = [q for q in topo.node_ranks(topo.node_of(relay)) if q != relay]
    return nodes.index(topo.node_of(src)) * len(peers) + peers.index(dst)


def move(
    b: GraphBuilder,
    src: Region,
    dst: Region,
    relay: list[Buffer] | None,
    ready: list[Task],
    name: str,
    slot_rows: int,
    counts: Counted | None = None,
    offset: int = 0,
) -> Task:
    """Copy ``src`` to ``dst`` after ``ready``; return the task that lands it. ``slot_rows``:
    the rows of one relay slot; ``offset``: where ``src`` starts inside its slot (a part of a
    slot is staged at the same place of the relay slot)."""
    topo = b.topo
    s, d = b.buffers[src.buffer].rank, b.buffers[dst.buffer].rank

    def nvlink(rank: int, a: Region, z: Region, count: Region | None, waits, name: str) -> Task:
        if counts is None:
            return b.task(rank, Role.NVLINK, COPY, [a], [z], waits=waits, name=name)
        params = {
            "segment_rows": counts.segment_rows,
            "float32": int(b.buffers[a.buffer].dtype == "float32"),
            "expected_fill": counts.expected_fill,
        }
        return b.task(
            rank, Role.NVLINK, MOE_MOVE, [a, count], [z], waits=waits, name=name, params=params
        )

    if topo.link(s, d) == "nvlink":
        return nvlink(s, src, dst, counts and counts.at_src, b.after(s, ready), name)
    hop = topo.rail_peer(s, topo.node_of(d))
    if hop == d:
        return b.task(s, Role.RDMA, COPY, [src], [dst], waits=b.after(s, ready), name=name)
    assert relay is not None, (name, hop)
    i = relay_index(b, hop, s, d)
    row0 = i * slot_rows + offset
    stage = relay[hop].region((row0, row0 + src.row1 - src.row0))
    first = b.task(
        s, Role.RDMA, COPY, [src], [stage], waits=b.after(s, ready), name=f"{name} via r{hop}"
    )
    # The forwarding leg reads the count where it landed (d, a node peer of the hop).
    landed = counts.landed if counts else []
    waits = b.after(hop, [first, *landed])
    return nvlink(hop, stage, dst, counts and counts.at_dst, waits, f"{name} relay r{hop}")
