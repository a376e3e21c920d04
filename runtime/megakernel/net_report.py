"""What the network held when a launch stopped at the watchdog (``Settings.net_report``,
MGRAPH_NET_REPORT=1): appended to the WatchdogTimeout's message, so that each rank's error says
which side of a cross-rank wait is missing.

A net word (netplan.py) has one writing proxy. For every word below its count at the failed
launch's epoch the report gives, on the rank whose flags this process holds, the value the
GPU word holds; and for words that THIS process's proxy raises on a peer, how many raises the
proxy issued (its host shadow of the running count; cuda_ipc only) against what landed. So:

- issued == expected but landed short: the proxy queued the raise (after its data copy, in
  stream order) and the GPU has not executed it: the copy stream is held up;
- issued short: the proxy never executed the command; then ``tickets`` (commands the kernel
  claimed in the FIFO, ``dhead``) against ``tail`` (commands the proxy finished) says whether
  the kernel pushed it.

Words are read twice, ``settle_s`` apart, after the kernel ended: a word that landed only in
the second read was held up behind the kernel itself. The proxy's counters are read across the
settle too: commands still queued (tail < tickets) and no progress means its thread is stuck
(in a CUDA call, say), not waiting for commands.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection
from typing import TYPE_CHECKING

import torch

from ..proxy.command import Rect

if TYPE_CHECKING:
    from mgraph.graph import TaskGraph

    from .netplan import NetPlan
    from .runtime import TritonRuntime

__all__ = ["net_report", "writer_of", "short_words"]


def writer_of(graph: TaskGraph, rank: int, key: tuple) -> int:
    """The rank whose proxy raises net word ``key`` of ``rank`` (netplan.py's word kinds)."""
    kind = key[0]
    if kind == "task":
        return graph.tasks[key[1]].rank
    if kind in ("arrive", "start"):
        return key[1]
    if kind == "event":
        return key[2]
    return rank  # "sent": the rank's own proxy


def short_words(
    graph: TaskGraph,
    plan: NetPlan,
    rank: int,
    epoch: int,
    values: list[int],
    later: list[int] | None = None,
    issued: list[int] | None = None,
    here: Collection[int] | None = None,
    starts: bool = True,
    data: Callable[[int], str] | None = None,
) -> list[str]:
    """One line per net word of ``rank`` below ``epoch`` x its raises per launch: its key, the
    task that raises it (task words), the writing proxy, what landed (``values``; ``later``:
    a second read), and what that proxy issued (``issued``: its shadow, shown for words whose
    writer is one of the ranks ``here``, the proxies of this process). With ``here``, words of
    another rank are listed only if a proxy here writes them. ``starts`` false: the "start"
    words are not raised (one interpreter program runs every rank: no entry barrier).
    ``data(task id)``: whether that rdma task's chunk is in its destination, said for the
    short task words a proxy here writes (the copy went out, or only its flag is missing)."""
    lines = []
    for key, w in plan.words[rank].items():
        if key[0] == "start" and not starts:
            continue
        writer = writer_of(graph, rank, key)
        ours = here is None or writer in here
        if not ours and rank not in (here or ()):
            continue
        want = epoch * plan.per_launch[rank][w]
        landed = int(values[w])
        again = None if later is None else int(later[w])
        if landed >= want and (again is None or again >= want):
            continue
        what = " ".join(str(k) for k in key)
        if key[0] == "task":
            what += f" ({graph.tasks[key[1]].name})"
        line = f"  rank {rank} word {w} [{what}], raised by rank {writer}'s proxy: "
        line += f"{landed} of {want}"
        if again is not None and again != landed:
            line += f" ({again} after the settle)"
        if issued is not None and ours:
            line += f", issued {int(issued[w])}"
        if data is not None and ours and key[0] == "task":
            line += f", chunk {data(key[1])}"
        lines.append(line)
    return lines


def net_report(rt: TritonRuntime, settle_s: float = 2.0) -> str:
    """The report described in the module docstring, for a runtime whose launch failed."""
    net, plan, graph = rt.net, rt.layout.net, rt.graph
    if net is None or plan is None:
        return ""
    lo, hi = rt.layout.net_base, rt.layout.net_base + plan.count
    epoch = rt.epoch
    lines = [f"network at epoch {epoch} (MGRAPH_NET_REPORT):"]
    tickets = int(net.dhead[0].item())  # the kernel ended (its record was read)
    tail = int(net.fifo.tail[0])
    lines.append(f"  FIFO: {tickets} tickets claimed by the kernel, {tail} commands finished "
                 f"by the proxy (capacity {net.fifo.capacity})")
    info = rt.kernel_info()
    if info:  # whether another kernel's blocks fit beside it (a same-device copy may be one)
        lines.append(f"  megakernel: {rt.tables.programs} programs, "
                     + ", ".join(f"{k} {v}" for k, v in info.items()))
    for p in net.proxies:
        s = p.loop_stats()
        keys = ("commands", "batches", "max_batch", "coalesced", "writes", "signals", "bytes",
                "events", "raises", "cuda_calls", "flag_calls")
        state = "running" if p.running else "stopped"
        lines.append(f"  proxy {p.name} ({state}): "
                     + ", ".join(f"{k} {s.get(k, 0)}" for k in keys))

    def read() -> dict[int, list[int]]:
        out = {}
        for r in sorted(rt.mine):
            flags = rt.shared.flags[r] if rt.shared is not None else rt.flags
            out[r] = flags[lo:hi].cpu().tolist()
        for t in net.transports:  # peers' words this process raises (mapped flags, shadows)
            for r, flags in getattr(t, "flags", {}).items():
                if r not in out and isinstance(flags, torch.Tensor):
                    try:  # (a peer process that already exited may have unmapped them)
                        out[r] = flags.cpu().tolist()
                    except Exception as exc:  # noqa: BLE001 - the rank's own words still count
                        unread[r] = repr(exc)[:120]
        return out

    unread: dict[int, str] = {}

    before = [p.loop_stats() for p in net.proxies]
    first = read()
    time.sleep(settle_s)
    second = read()
    for p, was in zip(net.proxies, before, strict=True):  # a thread stuck in a call stays put
        now = p.loop_stats()
        tail_now = int(net.fifo.tail[0])
        lines.append(f"  proxy {p.name} during the {settle_s:g} s settle: commands "
                     f"+{now['commands'] - was['commands']}, cuda_calls "
                     f"+{now.get('cuda_calls', 0) - was.get('cuda_calls', 0)}, FIFO tail "
                     f"{tail_now} (tickets {tickets})")
    shadows = {}
    for t in net.transports:
        shadows.update({r: s.tolist() for r, s in getattr(t, "shadow", {}).items()})
    here = set(rt.mine)  # the ranks whose proxies run in this process

    def data(task: int) -> str:
        t = graph.tasks[task]
        try:
            got, want = (net.transports[0].view(graph.buffers[g.buffer].rank, Rect(
                plan.buffer_index[g.buffer], g.row0, g.row1, g.col0, g.col1)).cpu()
                for g in (t.writes[0], t.reads[0]))
        except Exception as exc:  # noqa: BLE001 - a transport without views
            return f"unknown ({exc!r:.60})"
        return "landed" if torch.equal(got, want) else "NOT in its destination"

    for r, why in sorted(unread.items()):
        lines.append(f"  rank {r}'s words could not be read here: {why}")
    short = []
    for r in sorted(set(first) & set(second)):
        short += short_words(graph, plan, r, epoch, first[r], second[r], shadows.get(r), here,
                             starts=not rt.single_program, data=data)
    lines += short or ["  every net word read here is at its count"]
    return "\n".join(lines)
