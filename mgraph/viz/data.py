"""The viewer's data: a TaskGraph, its Schedule and a Trace as compact column arrays.

Everything the HTML page shows is computed here or from these arrays in the page, so the tests
can count what the page must render from the same numbers. Columns rather than one object per
task keep a 40k-task graph at a few MB of JSON.

- Stages: tasks grouped by the stem of their name (``gemm r0 [0:128,0:256]`` -> ``gemm``;
  compiled programs prefix their op node: ``down_proj/gemm``). A stage is the op-level node the
  page shows until the user expands it to tiles.
- Edges: one per (signalling task, waiting task) pair, classed by the link the dependency
  crosses: the signaller's own transfer link if it moves data to or from another rank, else the
  link between the two tasks' ranks (``local`` on one rank); bytes are what the signaller wrote.
- Critical path: in a trace, the chain that ends at the last-finishing task, each step back to the
  predecessor (a dependency, or the previous task on the same worker) that finished last.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from ..graph import ITEMSIZE, TaskGraph

if TYPE_CHECKING:
    from ..runtime.trace import Trace
    from ..scheduler import Schedule

__all__ = ["graph_data", "schedule_data", "trace_data", "stage_of", "task_edges", "LINKS"]

LINKS = ("local", "nvlink", "rdma")
_STEM = re.compile(r"^(.*?)(?:\s+r\d+\b|\s+\[|$)")
BANDWIDTH_BINS = 240


def stage_of(name: str) -> str:
    """A task name's stem: its stage (the op-level node it belongs to)."""
    stem = _STEM.match(name)
    return (stem.group(1) if stem else name) or name


def _task_link(graph: TaskGraph, task: Any) -> str:
    """The link class a task moves data over: local unless it touches another rank's memory."""
    link = "local"
    for region in (*task.reads, *task.writes):
        other = graph.buffers[region.buffer].rank
        if other != task.rank:
            cls = graph.topology.link(task.rank, other)
            if cls == "rdma":
                return "rdma"
            link = cls
    return link


def task_edges(graph: TaskGraph) -> list[tuple[int, int, str, int]]:
    """(signaller, waiter, link class, bytes) per dependency; the page draws these."""
    links = [_task_link(graph, t) for t in graph.tasks]
    wrote = [sum(graph.region_bytes(r) for r in t.writes) for t in graph.tasks]
    signalers = graph.signalers()
    edges = []
    for t in graph.tasks:
        for event, _ in t.waits:
            for src in dict.fromkeys(signalers[event]):
                s = graph.tasks[src]
                link = links[src]
                if link == "local" and s.rank != t.rank:
                    link = graph.topology.link(s.rank, t.rank)
                edges.append((src, t.id, link, wrote[src]))
    return edges


def graph_data(graph: TaskGraph, costs: list[float] | None = None) -> dict[str, Any]:
    """Tasks, stages, regions, waits/signals and edges, as columns."""
    stages: dict[str, int] = {}
    roles: dict[str, int] = {}
    kinds: dict[str, int] = {}
    buffers = {b: i for i, b in enumerate(graph.buffers)}
    cols: dict[str, list] = {k: [] for k in ("name", "rank", "role", "kind", "stage", "flops",
                                             "bytes", "link", "reads", "writes", "waits",
                                             "signals")}
    for t in graph.tasks:
        cols["name"].append(t.name)
        cols["rank"].append(t.rank)
        cols["role"].append(roles.setdefault(t.role, len(roles)))
        cols["kind"].append(kinds.setdefault(t.kind, len(kinds)))
        cols["stage"].append(stages.setdefault(stage_of(t.name), len(stages)))
        cols["flops"].append(t.flops)
        cols["bytes"].append(t.bytes)
        cols["link"].append(LINKS.index(_task_link(graph, t)))
        # regions flattened to [buffer, row0, row1, col0, col1, ...]: 5 ints each
        cols["reads"].append([v for r in t.reads for v in (buffers[r.buffer], *r[1:])])
        cols["writes"].append([v for r in t.writes for v in (buffers[r.buffer], *r[1:])])
        cols["waits"].append([v for w in t.waits for v in w])
        cols["signals"].append(list(t.signals))
    edges = task_edges(graph)
    topo = graph.topology
    return {
        "op": graph.op, "topology": str(topo), "nodes": topo.nodes,
        "gpus_per_node": topo.gpus_per_node, "world": topo.world_size, "dtype": graph.dtype,
        "params": graph.params, "stages": list(stages), "roles": list(roles),
        "kinds": list(kinds), "links": list(LINKS),
        "buffers": [[b.id, b.rank, b.rows, b.cols, b.role, ITEMSIZE[b.dtype]]
                    for b in graph.buffers.values()],
        "events": [[e.rank, e.name] for e in graph.events],
        "tasks": cols, "cost_us": [c * 1e6 for c in costs] if costs else None,
        "edges": {"src": [e[0] for e in edges], "dst": [e[1] for e in edges],
                  "link": [LINKS.index(e[2]) for e in edges], "bytes": [e[3] for e in edges]},
    }


def schedule_data(sched: Schedule) -> dict[str, Any]:
    return {
        "policy": sched.policy, "hardware": sched.hardware.name, "sms": sched.hardware.sms,
        "ranks": [{"rank": rs.rank, "workers": rs.workers, "queues": rs.queues,
                   "batches": len(rs.batches)} for rs in sched.ranks],
    }


def critical_path(graph: TaskGraph | None, records: list[Any]) -> list[int]:
    """Indices into ``records`` of the chain ending at the last-finishing task (module doc)."""
    if not records:
        return []
    by_task = {r.task: i for i, r in enumerate(records)}
    preds: dict[int, list[int]] = {}
    if graph is not None:
        signalers = graph.signalers()
        for i, r in enumerate(records):
            if 0 <= r.task < len(graph.tasks):
                preds[i] = [by_task[s] for e, _ in graph.tasks[r.task].waits
                            for s in signalers[e] if s in by_task]
    lanes: dict[tuple[int, str, int], list[int]] = {}
    for i in sorted(range(len(records)), key=lambda i: records[i].start):
        r = records[i]
        lanes.setdefault((r.rank, r.role, r.worker), []).append(i)
    prev_on_worker = {}
    for lane in lanes.values():
        for a, b in zip(lane, lane[1:], strict=False):
            prev_on_worker[b] = a
    path = [max(range(len(records)), key=lambda i: records[i].end)]
    seen = set(path)
    while True:
        cur = records[path[-1]]
        cands = [p for p in preds.get(path[-1], [])]
        if path[-1] in prev_on_worker:
            cands.append(prev_on_worker[path[-1]])
        cands = [p for p in cands if p not in seen and records[p].end <= cur.start + 1e-12]
        if not cands:
            break
        path.append(max(cands, key=lambda p: records[p].end))
        seen.add(path[-1])
    return path[::-1]


def trace_data(trace: Trace, graph: TaskGraph | None) -> dict[str, Any]:
    """Records as columns (times in us), the critical path, and bytes/s per link over time."""
    recs = list(trace.records)
    world = graph.topology.world_size if graph is not None else max((r.rank for r in recs), default=0) + 1
    roles = sorted({r.role for r in recs})
    t0 = min((r.start for r in recs), default=0.0)
    end = max((r.end for r in recs), default=0.0) - t0
    bins = [[0.0] * BANDWIDTH_BINS for _ in LINKS]
    width = end / BANDWIDTH_BINS if end > 0 else 1.0
    if graph is not None:
        # a transfer's bytes spread evenly over its duration; local tasks move none over a link
        for r in recs:
            if not 0 <= r.task < len(graph.tasks):
                continue
            task = graph.tasks[r.task]
            link = _task_link(graph, task)
            if link == "local":
                continue
            moved = sum(graph.region_bytes(x) for x in task.writes)
            a, b = r.start - t0, max(r.end - t0, r.start - t0 + 1e-12)
            for k in range(int(a / width), min(int(b / width), BANDWIDTH_BINS - 1) + 1):
                lo, hi = max(a, k * width), min(b, (k + 1) * width)
                if hi > lo:
                    bins[LINKS.index(link)][k] += moved * (hi - lo) / (b - a)
    return {
        "backend": trace.backend, "makespan_us": end * 1e6, "roles": roles,
        "task": [r.task for r in recs], "rank": [r.rank for r in recs],
        "role": [roles.index(r.role) for r in recs], "worker": [r.worker for r in recs],
        "start": [round((r.start - t0) * 1e6, 4) for r in recs],
        "end": [round((r.end - t0) * 1e6, 4) for r in recs],
        "name": None if graph is not None else [r.name for r in recs],
        "critical": critical_path(graph, recs),
        # mean per GPU: a sum over 16 ranks would read as one impossible link
        "bandwidth": {"bin_us": width * 1e6, "per": "GPU (mean over ranks)",
                      # 4 significant digits, not 3 decimals: on a slow run a bin holds a few
                      # MB/s, which 3 decimals of GB/s rounded by up to 30%
                      "gbps": [[float(f"{v / width / 1e9 / world:.4g}") for v in row]
                               for row in bins]},
    }
