"""The ``mgraph plot`` and ``mgraph view`` subcommands (registered by ``mgraph/cli.py``)."""

from __future__ import annotations

import argparse
from typing import Any

__all__ = ["add_subcommands"]


def add_subcommands(sub: Any, commands: dict[str, Any], console: Any) -> None:
    """Add ``plot`` and ``view`` to the ``mgraph`` parser's subparsers and command table."""
    p = sub.add_parser(
        "plot", help="PNG charts of benchmark results (speedup, NVLink-worker sweeps, proxy)",
        description="Reads benchmarks/results/*.json rows (bench_tp, bench_emulated, bench_proxy,"
                    " simulated sweeps) and writes <out>/<stem>_<chart>.png for each chart that"
                    " fits: speedup (vs cublas_nccl / cublas / sequential, 1.0x line), sweep (ms"
                    " vs NVLink workers), proxy (commands/s, GB/s, latency vs bytes/command).")
    p.add_argument("files", nargs="+", help="benchmark result JSON files")
    p.add_argument("--out", help="folder for the PNGs (default: beside each JSON file)")
    p.add_argument("--chart", action="append", choices=("speedup", "sweep", "proxy"),
                   help="only these charts (repeatable; default: every chart that fits)")
    p.add_argument("--baseline", help="impl to measure speedups against (default: cublas_nccl, "
                                      "sequential or cublas, the first a shape has)")

    def run_plot(args: argparse.Namespace) -> int:
        from .plot import plot_file

        for path in args.files:
            for png in plot_file(path, args.out, charts=args.chart, baseline=args.baseline):
                console.print(f"wrote {png}", soft_wrap=True, highlight=False)
        return 0

    commands["plot"] = run_plot
