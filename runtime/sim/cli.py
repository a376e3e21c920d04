"""``mgraph simulate``: build an op, schedule it, predict it on a cluster, print rich tables."""

from __future__ import annotations

import argparse
import json
import time

from rich.console import Console
from rich.table import Table

from mgraph.hardware import H200, HardwareProfile
from mgraph.kinds import ROLES

from . import simulate
from .result import SimResult
from .sweep import SweepPoint, sweep_comm_sms, with_comm_sms

__all__ = ["add_arguments", "simulate_command"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``mgraph simulate`` besides the op ones (--op, --shape, --topology...)."""
    p.add_argument("--policy", default="critical_path", help="queue ordering policy")
    split = p.add_mutually_exclusive_group()
    split.add_argument("--comm-sms", type=int, help="nvlink workers per rank (default: the "
                       "scheduler's work-balance split)")  # fmt: skip
    split.add_argument(
        "--sweep-comm-sms",
        action="store_true",
        help="simulate 1..64 nvlink workers and report the best static split",
    )
    p.add_argument(
        "--adaptive",
        action="store_true",
        help="let the controller re-split compute/nvlink workers while running",
    )
    p.add_argument("--hardware", help="hardware profile JSON (default: H200)")
    p.add_argument("--trace", help="write the predicted timeline (Chrome/Perfetto JSON) here")
    p.add_argument("--json", help="write the numbers (times, busy, bytes, sweep) here")


def load_hardware(path: str) -> HardwareProfile:
    """A hardware profile JSON, with named errors for a missing, unreadable or invalid file."""
    from pathlib import Path

    from pydantic import ValidationError

    from mgraph.errors import SettingsError

    p = Path(path)
    if not p.is_file():
        raise SettingsError(f"--hardware {path!r}: no such file",
                            hint="omit --hardware for the built-in H200 profile")
    try:
        return HardwareProfile.model_validate_json(p.read_bytes())
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(map(str, err["loc"])) or "(top level)"
        raise SettingsError(f"--hardware {path!r}: field {where}: {err['msg']}",
                            hint="start from mgraph.H200.model_dump_json()") from None


def simulate_command(args: argparse.Namespace, console: Console) -> int:
    from mgraph.cli import build_from_args, check_output_path, human_bytes
    from mgraph.scheduler import schedule

    check_output_path(args.trace, "--trace")  # before the work, not after it
    check_output_path(args.json, "--json")
    hw = load_hardware(args.hardware) if args.hardware else H200
    graph, build_s = build_from_args(args)
    start = time.perf_counter()
    sched = schedule(graph, hw, policy=args.policy)
    if args.comm_sms is not None:
        sched = with_comm_sms(sched, args.comm_sms)
    sched_s = time.perf_counter() - start
    start = time.perf_counter()
    res = simulate(sched, adaptive=args.adaptive)
    sim_s = time.perf_counter() - start
    console.print(
        f"[bold]{graph.op}[/] {json.dumps({d: graph.params[d] for d in _dims(graph)})} on "
        f"{graph.topology} x {hw.name}: {len(graph.tasks)} tasks (built {build_s:.2f} s, "
        f"scheduled {sched_s:.2f} s, simulated {sim_s:.2f} s)"
    )
    _times_table(res, console)
    _busy_table(res, console)
    stats = graph.stats().bytes_by_link
    console.print(
        "bytes per link class: "
        + ", ".join(
            f"{link} {human_bytes(res.bytes_by_link.get(link, 0))} (graph: "
            f"{human_bytes(stats.get(link, 0))})"
            for link in ("nvlink", "rdma")
        )
    )
    doc = res.summary()
    if args.sweep_comm_sms:
        points = sweep_comm_sms(sched, adaptive=args.adaptive)
        _sweep_table(points, res, console)
        doc["sweep"] = [{"comm_sms": p.comm_sms, "predicted_ms": p.predicted_s * 1e3}
                        for p in points]  # fmt: skip
    if args.trace:
        res.save_timeline(args.trace)
        console.print(f"wrote predicted timeline {args.trace} (open in https://ui.perfetto.dev)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
        console.print(f"wrote {args.json}")
    return 0


def _dims(graph) -> list[str]:
    from mgraph.ops import get_op

    return list(get_op(graph.op).dims)


def _times_table(res: SimResult, console: Console) -> None:
    table = Table(title="predicted time")
    for col in ("what", "time", "speedup of fused", "details"):
        table.add_column(col, justify="left" if col in ("what", "details") else "right")
    w = res.workers[0]
    table.add_row(
        "fused megakernel" + (" (adaptive)" if res.adaptive else ""),
        _ms(res.predicted_s),
        "",
        f"SMs per rank: compute {w.get('compute', 0)}, nvlink {w.get('nvlink', 0)}, "
        f"rdma {w.get('rdma', 0)}",
    )
    for name, b in res.baselines.items():
        details = ", ".join(
            f"{k.removesuffix('_s')} {_ms(v)}" if k.endswith("_s") else f"{k} {v}"
            for k, v in b.parts.items()
        )
        table.add_row(name, _ms(b.time_s), f"{b.time_s / res.predicted_s:.2f}x", details)
    console.print(table)


def _busy_table(res: SimResult, console: Console) -> None:
    table = Table(title="busy fraction (SMs of each role; host proxy; NIC send side), rank mean")
    busy = res.busy_by_role
    names = [*(r.value for r in ROLES), "proxy", "nic"]
    for name in names:
        table.add_column(name, justify="right")
    table.add_row(*(f"{busy[n]:.0%}" for n in names))
    console.print(table)


def _sweep_table(points: list[SweepPoint], res: SimResult, console: Console) -> None:
    chosen = res.workers[0].get("nvlink", 0)
    table = Table(title="static SM split sweep (same queues, N nvlink SMs on every rank)")
    for col in ("nvlink SMs", "predicted", "vs scheduler's split"):
        table.add_column(col, justify="right")
    best = min(points, key=lambda p: (p.predicted_s, p.comm_sms))
    for p in points:
        mark = " [bold green]best[/]" if p is best else ""
        mark += " (scheduler)" if p.comm_sms == chosen else ""
        table.add_row(
            f"{p.comm_sms}{mark}", _ms(p.predicted_s), f"{res.predicted_s / p.predicted_s:.2f}x"
        )
    console.print(table)
    console.print(
        f"best static split: {best.comm_sms} nvlink SMs, {_ms(best.predicted_s)} (the "
        f"work-balance rule chose {chosen}: {_ms(res.predicted_s)})"
    )


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f} ms" if seconds >= 1e-3 else f"{seconds * 1e6:.1f} us"
