"""Drop the tasks of a traced program whose results nothing uses.

A traced program computes what its ops' layouts say, on every rank: a replicated value is made
whole on each rank even where that rank's consumers read a part of it. The Llama layer at 2x8
(32 query heads, 8 KV heads, 16 ranks) gathers k whole on every rank, splits all 8 KV heads and
rotates them, and each rank's attention then reads the ONE KV head its query heads share. The
tiles and copies for the other seven are work no output depends on.

A task is kept when it writes a buffer that is not scratch (a program output, or an input
written in place), when it writes nothing (its effect is not a region this pass can follow), or
when a kept task waits on an event it signals. Everything a kept task reads was written by
tasks ordered before it (validation's race check insists on it), and every such order is a
chain of waits: the producers of what a kept task reads are kept. A wait's count stays right:
all the signalers of an event a kept task waits on are kept.

Events no kept task signals or waits on, and scratch buffers no kept task touches, go too;
task and event ids are renumbered to their new positions.
"""

from __future__ import annotations

from .graph import TaskGraph

__all__ = ["prune"]


def prune(graph: TaskGraph) -> TaskGraph:
    """``graph`` without the tasks no output depends on (in place; returned for chaining)."""
    tasks, buffers = graph.tasks, graph.buffers
    kept_buffers = {bid for bid, buf in buffers.items() if buf.role != "scratch"}
    signalers: list[list[int]] = [[] for _ in graph.events]
    for t in tasks:
        for e in t.signals:
            signalers[e].append(t.id)
    live = bytearray(len(tasks))
    stack = [
        t.id for t in tasks if not t.writes or any(w[0] in kept_buffers for w in t.writes)
    ]
    for i in stack:
        live[i] = 1
    done = bytearray(len(graph.events))  # events whose signalers are all kept already
    while stack:
        for e, _ in tasks[stack.pop()].waits:
            if done[e]:
                continue
            done[e] = 1
            for s in signalers[e]:
                if not live[s]:
                    live[s] = 1
                    stack.append(s)
    if all(live):
        return graph
    graph.tasks = [t for t in tasks if live[t.id]]
    _renumber(graph)
    return graph


def _renumber(graph: TaskGraph) -> None:
    """Task ids, then event ids, to their positions; unused events and scratch buffers out."""
    used = bytearray(len(graph.events))
    touched: set[str] = set()
    for i, t in enumerate(graph.tasks):
        t.id = i
        for e, _ in t.waits:
            used[e] = 1
        for e in t.signals:
            used[e] = 1
        touched.update(r[0] for r in t.reads)
        touched.update(r[0] for r in t.writes)
    new_id = [-1] * len(graph.events)
    events = []
    for ev in graph.events:
        if used[ev.id]:
            new_id[ev.id] = len(events)
            ev.id = len(events)
            events.append(ev)
    graph.events = events
    for t in graph.tasks:
        if t.waits:
            t.waits = [(new_id[e], count) for e, count in t.waits]
        if t.signals:
            t.signals = [new_id[e] for e in t.signals]
    graph.buffers = {
        bid: buf for bid, buf in graph.buffers.items() if buf.role != "scratch" or bid in touched
    }
