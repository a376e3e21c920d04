"""The ``mgraph plot`` and ``mgraph view`` subcommands (registered by ``mgraph/cli.py``)."""

from __future__ import annotations

import argparse
from typing import Any

__all__ = ["add_subcommands"]


def add_subcommands(sub: Any, commands: dict[str, Any], console: Any) -> None:
    """Add ``plot`` and ``view`` to the ``mgraph`` parser's subparsers and command table."""
    from .plot import CHARTS

    p = sub.add_parser(
        "plot", help="PNG charts of benchmark results (speedup, NVLink-worker sweeps, proxy, "
                     "times)",
        description="Reads benchmarks/results/*.json rows (bench_tp, bench_emulated, bench_proxy,"
                    " simulated sweeps, bench_layer, bench_moe, bench_attention) and writes"
                    " <out>/<stem>_<chart>.png for each chart that fits: speedup (vs cublas_nccl"
                    " / cublas / sequential, 1.0x line), sweep (ms vs NVLink workers), proxy"
                    " (commands/s, GB/s, latency vs bytes/command), times (impl+ms rows no other"
                    " chart takes: ms bars per configuration group with each bar's ratio to the"
                    " group's fastest baseline, failed rows listed).")
    p.add_argument("files", nargs="+", help="benchmark result JSON files")
    p.add_argument("--out", help="folder for the PNGs (default: beside each JSON file)")
    p.add_argument("--chart", action="append", choices=CHARTS,
                   help="only these charts (repeatable; default: every chart that fits)")
    p.add_argument("--baseline", help="impl to measure speedups against (default: cublas_nccl, "
                                      "sequential or cublas, the first a shape has; times: the "
                                      "fastest of eager_tp, torch_compile_tp, torch_a2a, "
                                      "sdpa_cudnn, sdpa_fa2, cudnn+nccl, fa2+nccl)")

    def run_plot(args: argparse.Namespace) -> int:
        from .plot import plot_file

        for path in args.files:
            for png in plot_file(path, args.out, charts=args.chart, baseline=args.baseline):
                console.print(f"wrote {png}", soft_wrap=True, highlight=False)
        return 0

    commands["plot"] = run_plot

    from ..cli import add_op_args

    p = sub.add_parser(
        "view", help="write one offline HTML page: the graph, its schedule and a run's timeline",
        description="Builds (or loads) a graph, schedules it, optionally runs it, and writes a "
                    "self-contained HTML page (no network needed to open it).")
    p.add_argument("file", nargs="?", help="a graph or schedule JSON (mgraph inspect/schedule "
                                           "--json) instead of --op")
    add_op_args(p, required=False)
    p.add_argument("--policy", default="critical_path", help="queue ordering policy")
    p.add_argument("--timeline", default="sim", choices=("sim", "reference", "none"),
                   help="run for the timeline: sim (predicted, H200), reference (CPU), none")
    p.add_argument("--trace", help="a timeline JSON written by `mgraph run --trace` to show "
                                   "instead of running")
    p.add_argument("-o", "--out", default="mgraph-view.html", help="the HTML file to write")

    def run_view(args: argparse.Namespace) -> int:
        from ..errors import MgraphError
        from .html import load_chrome_trace, view

        sched = _schedule_from_args(args)
        if sched is None:
            raise MgraphError("view needs --op (with --shape) or a graph/schedule JSON file")
        if args.trace:
            trace = load_chrome_trace(args.trace)
        elif args.timeline == "none":
            trace = None
        else:
            from ..api import run

            console.print(f"running on the {args.timeline} backend for the timeline ...")
            trace = run(sched, backend=args.timeline).trace
        path = view(sched, args.out, trace=trace)
        console.print(f"wrote {path} ({path.stat().st_size / 2**20:.1f} MiB, "
                      f"{len(sched.graph.tasks)} tasks); open it in a browser", soft_wrap=True,
                      highlight=False)
        return 0

    commands["view"] = run_view


def _schedule_from_args(args: argparse.Namespace) -> Any:
    import json

    from ..graph import TaskGraph
    from ..scheduler import Schedule, schedule

    if args.file:
        with open(args.file) as f:
            text = f.read()
        head = json.loads(text)
        if isinstance(head, dict) and str(head.get("format", "")).startswith("mgraph.schedule"):
            return Schedule.from_json(text)
        return schedule(TaskGraph.from_json(text), policy=args.policy)
    if not args.op:
        return None
    from ..cli import build_from_args

    graph, _ = build_from_args(args)
    return schedule(graph, policy=args.policy)
