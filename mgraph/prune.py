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

Task ids are renumbered to the tasks' new positions. Events and buffers stay as they are.
"""

from __future__ import annotations

from .graph import TaskGraph

__all__ = ["prune"]


def prune(graph: TaskGraph) -> TaskGraph:
    """``graph`` without the tasks no output depends on (in place; returned for chaining)."""
    # ~40k tasks at 2x8, inside the compile-time budget: one pass for the signalers and the
    # roots, one walk up the waits, one renumbering; events and buffers stay (an event nobody
    # signals or waits on is an idle counter, a scratch buffer nobody touches idle bytes)
    tasks, buffers = graph.tasks, graph.buffers
    scratch = {bid for bid, buf in buffers.items() if buf.role == "scratch"}
    signalers: list[list[int]] = [[] for _ in graph.events]
    live = bytearray(len(tasks))
    stack = []
    for t in tasks:
        i = t.id
        for e in t.signals:
            signalers[e].append(i)
        writes = t.writes
        # most tasks write one region: its buffer decides
        if not writes or writes[0][0] not in scratch or (
            len(writes) > 1 and any(w[0] not in scratch for w in writes)
        ):
            live[i] = 1
            stack.append(i)
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
    graph.tasks = kept = [t for t in tasks if live[t.id]]
    for i, t in enumerate(kept):
        t.id = i
    return graph
