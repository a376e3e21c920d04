"""PNG charts of benchmark rows (``benchmarks/results/*.json``), with matplotlib.

Rows are the dicts the benchmarks write, as they are today:

- ``bench_tp``: ``op, M, N, K, world, impl, ms`` (+ ``nvlink_workers``, ``busy_*``, ...). The
  baseline is ``cublas_nccl`` (``cublas`` for the plain GEMM); ``mgraph`` is the default
  configuration, ``mgraph_best`` the best point of the ``mgraph_sweep`` rows over NVLink workers.
- ``bench_emulated``: the same plus ``topology, nic_gbps``; the baseline is ``sequential``.
- ``bench_proxy`` (CPU and GPU): ``bench, ...`` with ``tile_bytes`` or ``chunk_bytes`` and
  ``commands_per_s``, ``gb_per_s``, ``latency_us_median``.
- any row with a ``sweep`` dict ``{workers: ms}`` (``simulated_mkernel.json``'s rows).

- ``bench_layer``: ``impl, ms, vs_eager_tp, error, status`` (impls ``mgraph``, ``mgraph_kernel``,
  ``eager_tp``, ``torch_compile_tp``); a failed or skipped impl has ``ms`` null and says why in
  ``status``.
- ``bench_moe``: ``impl, T, H, E, top_k, F, world, ms`` (``torch_a2a``, ``grouped_gemm``, one
  ``mgraph`` row per configuration: ``expert_rows``, ``expert_cols_f``, ...); its ``mgraph_kind``
  rows are per-kind breakdowns of one launch, not times.
- ``bench_attention``: ``part, S, causal, impl, ms, tflops`` (+ ``variant``, ``default``,
  ``task``); rows without ``ms`` or ``error`` are the compiled kernel's registers and spills.

Keys a chart does not know are ignored, so benchmarks may add fields freely. Four charts:
``speedup`` (baseline_ms / ms per shape per op, the 1.0x line drawn), ``sweep`` (ms vs NVLink
workers per shape, the default point and the baseline marked), ``proxy`` (throughput and
latency vs bytes per command) and ``times`` (for impl+ms rows no other chart takes: ms per row
per configuration group, each bar's ratio to the group's fastest baseline, failed rows listed).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from ..errors import InputError, MgraphError, UnknownNameError
from .palette import COLORS, OTHER_COLORS, _color
from .times import TIMES_BASELINES, _timed, _times, times_table

__all__ = ["plot_rows", "plot_file", "load_rows", "detect", "speedup_table", "times_table",
           "CHARTS", "BASELINES", "TIMES_BASELINES"]

Row = dict[str, Any]
CHARTS = ("speedup", "sweep", "proxy", "times")
# The first of these an (op, shape) group has is its baseline: bench_tp's table uses the same rule
# (cublas_nccl, or cublas for the plain GEMM); the emulated benchmark's is its sequential run,
# whose group also holds a cublas row (the GEMM alone), hence sequential before cublas.
BASELINES = ("cublas_nccl", "sequential", "cublas")
# Not alternatives to the baseline: sweep points (drawn by the sweep chart) and the emulated
# benchmark's parts (its GEMM alone, its network alone).
NOT_COMPARED = ("mgraph_sweep", "cublas", "net_alone")
SHAPE_KEYS = ("M", "N", "K")
# Configuration keys that split a speedup group beyond its shape (emulated: the NIC cap).
GROUP_KEYS = ("topology", "nic_gbps", "world")
PROXY_SERIES_KEYS = ("bench", "proxy", "transport", "order", "kind", "path", "producers",
                     "flags", "cap_gbps", "batch")


def load_rows(path: str | Path) -> list[Row]:
    """A results file's rows: a JSON list of dicts, or a dict holding one under ``rows``."""
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise InputError(f"cannot read benchmark rows from {path}: {exc}") from None
    if isinstance(doc, dict) and isinstance(doc.get("rows"), list):
        doc = doc["rows"]
    if not isinstance(doc, list) or not all(isinstance(r, dict) for r in doc):
        raise InputError(f"{path} holds no list of row objects",
                         hint="expected the JSON a benchmarks/*.py script writes")
    return doc


def detect(rows: Sequence[Row]) -> list[str]:
    """The charts these rows can make, in the order ``plot_file`` writes them."""
    charts = []
    if any("impl" in r and "ms" in r and r.get("impl") not in NOT_COMPARED for r in rows) and any(
        r.get("impl") in BASELINES for r in rows
    ):
        charts.append("speedup")
    if any(r.get("impl") == "mgraph_sweep" or isinstance(r.get("sweep"), dict) for r in rows):
        charts.append("sweep")
    if any(_proxy_x(r) is not None for r in rows):
        charts.append("proxy")
    if not charts and any(_timed(r) for r in rows):
        charts.append("times")
    return charts


def plot_rows(rows: Iterable[Row], out_png: str | Path, chart: str = "auto", *,
              title: str | None = None, baseline: str | None = None) -> Path:
    """Draw one chart of ``rows`` into ``out_png`` and return its path.

    ``chart``: ``speedup``, ``sweep``, ``proxy``, ``times`` or ``auto`` (the first that fits,
    see ``detect``). ``baseline`` overrides the impl speedups (and times' ratios) are measured
    against.
    """
    rows = [r for r in rows if isinstance(r, dict)]
    if chart == "auto":
        found = detect(rows)
        if not found:
            raise InputError("no chart fits these rows",
                             hint="rows need impl+ms (speedup with a baseline, else times), "
                                  "mgraph_sweep or sweep (sweep), or bench with "
                                  "tile_bytes/chunk_bytes (proxy)")
        chart = found[0]
    if chart not in CHARTS:
        raise UnknownNameError(f"unknown chart {chart!r}", hint=f"one of {', '.join(CHARTS)}")
    plt = _pyplot()
    draw = {"speedup": _speedup, "sweep": _sweep, "proxy": _proxy, "times": _times}[chart]
    fig = draw(plt, rows, baseline)
    if title:
        fig.suptitle(title, fontsize=12, fontweight="bold")
    fig.tight_layout()
    out = Path(out_png)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def plot_file(path: str | Path, out_dir: str | Path | None = None, *,
              charts: Sequence[str] | None = None, baseline: str | None = None) -> list[Path]:
    """Every chart that fits a results file, as ``<out_dir>/<stem>_<chart>.png``."""
    path = Path(path)
    rows = load_rows(path)
    out_dir = Path(out_dir) if out_dir is not None else path.parent
    wanted = list(charts) if charts else detect(rows)
    if not wanted:
        raise InputError(f"{path}: no chart fits its rows",
                         hint="see `mgraph plot --help` for the row formats it reads")
    return [plot_rows(rows, out_dir / f"{path.stem}_{c}.png", c, title=path.stem,
                      baseline=baseline) for c in wanted]


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise MgraphError("mgraph plot needs matplotlib",
                          hint="pip install 'mgraph[viz]' (or pip install matplotlib)") from None
    matplotlib.use("Agg")  # files only; never open a window (CI has no display)
    import matplotlib.pyplot as plt

    return plt


def _shape(r: Row) -> str:
    if all(k in r for k in SHAPE_KEYS):
        text = "x".join(str(r[k]) for k in SHAPE_KEYS)
    else:
        text = str(r.get("label", r.get("shape", "?")))
    if "nic_gbps" in r:
        text += f"\nNIC {r['nic_gbps']:g} GB/s" if r["nic_gbps"] else "\nNIC uncapped"
    return text


def _groups(rows: Sequence[Row]) -> dict[str, dict[tuple, list[Row]]]:
    """op -> (shape, config) -> rows, in first-seen order."""
    out: dict[str, dict[tuple, list[Row]]] = {}
    for r in rows:
        if "impl" not in r or not isinstance(r.get("ms"), (int, float)):
            continue
        key = tuple(r.get(k) for k in (*SHAPE_KEYS, *GROUP_KEYS, "label"))
        out.setdefault(str(r.get("op", "?")), {}).setdefault(key, []).append(r)
    return out


def _baseline_of(group: Sequence[Row], baseline: str | None) -> Row | None:
    for name in (baseline,) if baseline else BASELINES:
        for r in group:
            if r["impl"] == name and r["ms"] > 0:
                return r
    return None


def speedup_table(rows: Iterable[Row], baseline: str | None = None
                  ) -> dict[str, dict[str, Any]]:
    """What the speedup chart draws: per op, its baselines, shape labels, and per impl one
    ``baseline_ms / ms`` per shape (``None`` where the impl has no row for that shape)."""
    table: dict[str, dict[str, Any]] = {}
    for op, groups in _groups(list(rows)).items():
        shapes = [k for k, rs in groups.items() if _baseline_of(rs, baseline)]
        if not shapes:
            continue
        bases = [_baseline_of(groups[k], baseline) for k in shapes]
        base_names = list(dict.fromkeys(b["impl"] for b in bases))  # type: ignore[index]
        impls = list(dict.fromkeys(r["impl"] for k in shapes for r in groups[k]
                                   if r["impl"] not in NOT_COMPARED and r["impl"] not in base_names))
        # mgraph's default row first, its best-of-sweep beside it, then the other contenders
        impls.sort(key=lambda name: (not name.startswith("mgraph"), name != "mgraph"))
        speedups: dict[str, list[float | None]] = {}
        for impl in impls:
            speedups[impl] = []
            for key, base in zip(shapes, bases, strict=True):
                mine = next((r for r in groups[key] if r["impl"] == impl and r["ms"] > 0), None)
                speedups[impl].append(base["ms"] / mine["ms"] if mine and base else None)
        table[op] = {"baselines": base_names, "shapes": [_shape(groups[k][0]) for k in shapes],
                     "speedup": speedups}
    return table


def _speedup(plt: Any, rows: Sequence[Row], baseline: str | None) -> Any:
    table = speedup_table(rows, baseline)
    if not table:
        raise InputError("speedup chart: no group has a baseline row",
                         hint=f"baseline impls: {', '.join(BASELINES)} (or pass baseline=)")
    fig, axes = plt.subplots(1, len(table), figsize=(max(5.0, 4.6 * len(table)), 4.4),
                             squeeze=False)
    for ax, (op, entry) in zip(axes[0], table.items(), strict=True):
        impls, shapes = list(entry["speedup"]), entry["shapes"]
        width = 0.8 / max(1, len(impls))
        top = 1.0
        for i, impl in enumerate(impls):
            points = [(j - 0.4 + width * (i + 0.5), y)
                      for j, y in enumerate(entry["speedup"][impl]) if y is not None]
            xs, ys = [p[0] for p in points], [p[1] for p in points]
            label = impl + (" (best of sweep)" if impl == "mgraph_best" else "")
            bars = ax.bar(xs, ys, width * 0.92, label=label, color=_color(impl, impls),
                          hatch="//" if impl == "mgraph_best" else None, edgecolor="#333333",
                          linewidth=0.5)
            ax.bar_label(bars, labels=[f"{y:.2f}x" for y in ys], fontsize=7, padding=1)
            top = max([top, *ys])
        base_names = entry["baselines"]
        ax.axhline(1.0, color="#d62728", linestyle="--", linewidth=1.2,
                   label=f"{'/'.join(base_names)} (baseline) = 1.0x")
        ax.set_xticks(range(len(shapes)))
        ax.set_xticklabels(shapes, fontsize=8)
        ax.set_ylim(0, top * 1.18)
        ax.set_title(op, fontsize=10)
        ax.set_ylabel("speedup over baseline (higher is better)", fontsize=8)
        ax.set_xlim(-0.5, len(shapes) - 0.5)
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=2,
                  frameon=False)
        ax.grid(axis="y", alpha=0.3)
    return fig


def _sweep_points(rs: Sequence[Row]) -> list[tuple[float, float]]:
    points = [(r["nvlink_workers"], r["ms"]) for r in rs
              if r["impl"] == "mgraph_sweep" and "nvlink_workers" in r]
    for r in rs:
        if isinstance(r.get("sweep"), dict):
            points += [(float(k), float(v)) for k, v in r["sweep"].items()]
    return sorted(points)


def _sweep(plt: Any, rows: Sequence[Row], baseline: str | None) -> Any:
    # simulated rows carry no impl/ms: read them as an impl-less sweep of their predicted time
    rows = [dict(r, impl=r.get("impl", "simulated"), ms=r.get("ms", r.get("predicted_ms", 0.0)))
            if isinstance(r.get("sweep"), dict) else r for r in rows]
    by_op = {op: g for op, g in _groups(rows).items()
             if any(_sweep_points(rs) for rs in g.values())}
    if not by_op:
        raise InputError("sweep chart: no mgraph_sweep rows or sweep dicts")
    fig, axes = plt.subplots(1, len(by_op), figsize=(max(5.0, 4.6 * len(by_op)), 4.2),
                             squeeze=False)
    for ax, (op, groups) in zip(axes[0], by_op.items(), strict=True):
        for j, rs in enumerate(g for g in groups.values() if _sweep_points(g)):
            color = OTHER_COLORS[j % len(OTHER_COLORS)] if j else COLORS["mgraph"]
            xs, ys = zip(*_sweep_points(rs), strict=True)
            ax.plot(xs, ys, marker="o", color=color, label=_shape(rs[0]).replace("\n", ", "))
            default = next((r for r in rs if r["impl"] in ("mgraph", "mgraph_fused")
                            and "nvlink_workers" in r), None)
            if default:
                ax.plot([default["nvlink_workers"]], [default["ms"]], marker="*", markersize=14,
                        color=color, markeredgecolor="black", linestyle="none")
            base = _baseline_of(rs, baseline)
            if base:
                ax.axhline(base["ms"], color=color, linestyle="--", linewidth=1)
                ax.text(max(xs), base["ms"], f"{base['impl']} {base['ms']:.3g} ms", color=color,
                        fontsize=7, ha="right", va="bottom")
        ax.plot([], [], marker="*", color="gray", markersize=11, linestyle="none",
                label="default split (mgraph)")
        ax.plot([], [], color="gray", linestyle="--", label="baseline")
        ax.set_title(op, fontsize=10)
        ax.set_xlabel("NVLink workers (comm SMs) per GPU", fontsize=8)
        ax.set_ylabel("ms (lower is better)", fontsize=8)
        low, high = ax.get_ylim()
        if low > 0 and high / low > 8:  # a far-off default split would flatten the sweep
            ax.set_yscale("log")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    return fig


def _proxy_x(r: Row) -> int | None:
    for key in ("tile_bytes", "chunk_bytes"):
        if isinstance(r.get(key), int) and r.get("bench") not in (None, "meta"):
            return r[key]
    return None


def _human_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:g} {unit}" if n else "0 B"
        n //= 1024
    raise AssertionError


def _series_name(r: Row, varying: Sequence[str]) -> str:
    return ", ".join(f"{r.get(k)}" for k in varying) or "all"


def _proxy(plt: Any, rows: Sequence[Row], baseline: str | None) -> Any:
    rows = [r for r in rows if _proxy_x(r) is not None]
    if not rows:
        raise InputError("proxy chart: no rows with bench and tile_bytes/chunk_bytes")
    varying = [k for k in PROXY_SERIES_KEYS if len({str(r.get(k)) for r in rows}) > 1]
    xs = sorted({_proxy_x(r) for r in rows})  # type: ignore[type-var]
    metrics = [("commands_per_s", "commands / s", True), ("gb_per_s", "GB/s", False),
               ("latency_us_median", "push-to-flag latency, median (us)", False)]
    metrics = [m for m in metrics if any(isinstance(r.get(m[0]), (int, float)) for r in rows)]
    names = list(dict.fromkeys(_series_name(r, varying) for r in rows))
    palette = (COLORS["mgraph"], *OTHER_COLORS)  # one colour per series across the panels
    fig, axes = plt.subplots(1, len(metrics), figsize=(5.2 * len(metrics), 4.4), squeeze=False)
    for ax, (key, label, log) in zip(axes[0], metrics, strict=True):
        series: dict[str, list[tuple[int, float]]] = {}
        for r in rows:
            if isinstance(r.get(key), (int, float)) and (r[key] > 0 or key == "commands_per_s"):
                series.setdefault(_series_name(r, varying), []).append(
                    (xs.index(_proxy_x(r)), r[key]))
        for name, points in series.items():
            points.sort()
            ax.plot(*zip(*points, strict=True), marker="o", label=name,
                    color=palette[names.index(name) % len(palette)])
        ax.set_xticks(range(len(xs)))
        ax.set_xticklabels([_human_bytes(x) for x in xs], fontsize=8)
        ax.set_xlabel("bytes per command", fontsize=8)
        ax.set_ylabel(label, fontsize=8)
        if log:
            ax.set_yscale("log")
        ax.set_title(label.split(",")[0], fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6, title=", ".join(varying) or None, title_fontsize=6)
    return fig
