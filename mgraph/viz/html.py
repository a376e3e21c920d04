"""``mgraph.viz.view``: one self-contained, offline HTML file of a graph, its schedule and a run.

The page is plain hand-written JavaScript over SVG (the graph) and canvas (queues, timeline),
inlined from ``viewer.js`` (graph), ``timeline.js`` (schedule, timeline) and ``viewer.css``
beside this file, with the data as one JSON block:
no network at view time and no third-party code (so no licence to carry). What it shows and how
the numbers are made: ``mgraph/viz/data.py``.
"""

from __future__ import annotations

import html
import json
from pathlib import Path
from typing import Any

from ..errors import InputError
from ..graph import TaskGraph
from .data import graph_data, schedule_data, trace_data

__all__ = ["view", "build_html", "load_chrome_trace"]

HERE = Path(__file__).resolve().parent
MAX_BYTES = 20 * 1024 * 1024  # the bound: a 40k-task graph's page stays under 20 MB


def _parts(obj: Any, schedule: Any, trace: Any) -> tuple[TaskGraph, Any, Any]:
    """(graph, schedule or None, trace or None) from any object the page can show."""
    from ..runtime.reference import RunResult
    from ..runtime.trace import Trace
    from ..scheduler import Schedule

    if isinstance(obj, RunResult):
        trace = trace if trace is not None else obj.trace
        obj = schedule
        if obj is None:
            raise InputError("view(run_result) needs the schedule that ran",
                             hint="view(result, path, schedule=sched)")
    elif isinstance(obj, Trace):
        trace, obj = obj, schedule
        if obj is None:
            raise InputError("view(trace) needs the schedule (or graph) that ran",
                             hint="view(trace, path, schedule=sched)")
    if hasattr(obj, "schedule") and hasattr(obj, "opgraph"):  # a compiled Program
        last = getattr(obj, "last_result", None)
        if trace is None and last is not None:
            trace = last.trace
        obj = obj.schedule
    if isinstance(obj, Schedule):
        return obj.graph, obj, trace
    if isinstance(obj, TaskGraph):
        if schedule is None:
            from ..scheduler import schedule as make_schedule

            schedule = make_schedule(obj)
        return obj, schedule, trace
    raise InputError(f"cannot view a {type(obj).__name__}",
                     hint="pass a TaskGraph, Schedule, Program, RunResult or Trace")


def build_html(obj: Any, *, schedule: Any = None, trace: Any = None,
               title: str | None = None) -> str:
    """The page's text (see ``view``)."""
    from ..scheduler.costmodel import task_costs

    graph, sched, trace = _parts(obj, schedule, trace)
    data = {
        "graph": graph_data(graph, task_costs(graph, sched.hardware) if sched else None),
        "schedule": schedule_data(sched) if sched is not None else None,
        "trace": trace_data(trace, graph) if trace is not None and trace.records else None,
    }
    title = title or f"mgraph: {graph.op} on {graph.topology}"
    # "</" inside a JSON string would end the <script> element early
    payload = json.dumps(data, separators=(",", ":")).replace("</", "<\\/")
    page = (HERE / "viewer.html").read_text()
    return (page.replace("{{TITLE}}", html.escape(title))
                .replace("{{CSS}}", (HERE / "viewer.css").read_text())
                .replace("{{JS}}", (HERE / "viewer.js").read_text()
                         + (HERE / "timeline.js").read_text())
                .replace("{{DATA}}", payload))


def view(obj: Any, path: str | Path | None = None, *, schedule: Any = None, trace: Any = None,
         title: str | None = None) -> Path:
    """Write the viewer page of ``obj`` to ``path`` (default ``mgraph-view.html``).

    ``obj``: a TaskGraph (scheduled with defaults unless ``schedule=``), a Schedule, a compiled
    Program (with its last run's trace), a RunResult or a Trace (both with ``schedule=``: the
    schedule that ran). ``trace=`` adds a timeline to any of them: the reference runtime's, the
    simulator's (``mg.run(s, backend="sim")``) or the megakernel's in-kernel trace.
    """
    text = build_html(obj, schedule=schedule, trace=trace, title=title)
    if len(text) > MAX_BYTES:
        raise InputError(f"the page would be {len(text) / 2**20:.1f} MiB (bound "
                         f"{MAX_BYTES / 2**20:.0f} MiB)", hint="view a smaller graph")
    out = Path(path or "mgraph-view.html")
    out.write_text(text)
    return out


def load_chrome_trace(path: str | Path) -> Any:
    """A Trace back from the Chrome JSON ``Trace.save`` wrote (``mgraph run --trace``)."""
    from ..runtime.trace import TaskRecord, Trace

    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise InputError(f"cannot read a trace from {path}: {exc}") from None
    events = doc.get("traceEvents", []) if isinstance(doc, dict) else []
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
               if e.get("ph") == "M" and e.get("name") == "thread_name"}
    records = []
    for e in events:
        if e.get("ph") != "X" or "task" not in e.get("args", {}):
            continue
        role, _, worker = threads.get((e["pid"], e["tid"]), "? 0").rpartition(" ")
        records.append(TaskRecord(task=e["args"]["task"], name=e["name"], kind=e.get("cat", ""),
                                  rank=e["pid"], role=e["args"].get("role", role),
                                  worker=int(worker) if worker.isdigit() else 0,
                                  start=e["ts"] / 1e6, end=(e["ts"] + e["dur"]) / 1e6))
    if not records:
        raise InputError(f"{path} holds no task records",
                         hint="expected a timeline written by Trace.save / mgraph run --trace")
    return Trace(records=records, backend=doc.get("otherData", {}).get("backend", "trace"))
