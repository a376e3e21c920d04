"""The ``times`` chart of ``mgraph plot``: for rows with ``impl`` and ``ms`` that no other chart
takes (bench_layer, bench_moe, bench_attention), ms per row per configuration group, each bar's
ratio to the group's fastest baseline, failed rows listed (the module docstring of plot.py
lists the row forms)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

from ..errors import InputError
from .palette import COLORS, _color

Row = dict[str, Any]

# times chart: full implementations mgraph is measured against (each group's fastest is the
# reference). Not here: bounds that do only part of the work (bench_moe's grouped_gemm, the ring's
# *_compute_only), and other kernels that are neither mgraph nor a baseline (triton_flat*).
TIMES_BASELINES = ("eager_tp", "torch_compile_tp", "torch_a2a", "sdpa_cudnn", "sdpa_fa2",
                   "cudnn+nccl", "fa2+nccl")
# times chart: the fields that make one configuration group (a panel) ...
TIMES_GROUP_KEYS = ("timing", "op", "part", "S", "causal", "T", "H", "E", "top_k", "F", "hidden", "heads",
                    "kv_heads", "ffn", "seq", "batch", "dtype", "M", "N", "K", "world",
                    "topology", "nic_gbps")
# ... and those that tell a group's rows of one impl apart (shown where they vary in the group)
TIMES_LABEL_KEYS = ("variant", "task", "expert_rows", "expert_cols_f", "expert_cols_h",
                    "expert_group", "combine_rows", "combine_cols", "segment_rows", "block",
                    "kv_block", "warps", "stages", "nvlink_workers", "module", "tile")


def _kind_row(r: Row) -> bool:
    """A per-task-kind breakdown (bench_moe's ``mgraph_kind``): busy time summed over programs."""
    return str(r.get("impl", "")).endswith("_kind") or "kind" in r


def _timed(r: Row) -> bool:
    return "impl" in r and "ms" in r and not _kind_row(r)


def _failure(r: Row) -> str | None:
    """Why a row has no time to compare (None when it has one)."""
    status = r.get("status")
    if isinstance(status, str) and status != "ok":
        return status
    if isinstance(r.get("error"), str):  # bench_layer's numeric error is a tolerance check
        return f"error: {r['error']}"
    ms = r.get("ms")
    if not isinstance(ms, (int, float)) or not math.isfinite(ms) or ms <= 0:
        return "no time"
    return None


def _fmt(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def _scalar(r: Row, key: str) -> Any:
    value = r.get(key)  # bench_layer's ``stages`` is a dict of compile times, not a pipeline depth
    return value if isinstance(value, (str, int, float, bool)) else None


def _with_back_to_back(rows: Iterable[Row]) -> list[Row]:
    """bench_layer's rows time each call from an idle GPU (``ms``) and, with --back-to-back,
    also over calls issued back to back (``ms_back_to_back``): both are drawn, as two panels
    (``timing``), since they rank the implementations differently (host launch costs show in
    the first only)."""
    rows = list(rows)
    if not any("ms_back_to_back" in r for r in rows):
        return rows
    out = [{**r, "timing": "idle start"} for r in rows]
    out += [{**r, "timing": "back to back", "ms": r["ms_back_to_back"]}
            for r in rows if "ms_back_to_back" in r]
    return out


def times_table(rows: Iterable[Row], baseline: str | None = None) -> list[dict[str, Any]]:
    """What the times chart draws: one entry per configuration group (``TIMES_GROUP_KEYS``), in
    first-seen order, ``{"title", "reference", "bars", "left_out"}``.

    ``bars``: one per row in the benchmark's order, ``{"label", "impl", "ms", "ratio", "default",
    "reference", "failed"}``. The label is the impl plus the ``TIMES_LABEL_KEYS`` that vary among
    the group's rows of that impl. ``ratio`` is reference_ms / ms (>1: faster than the reference), the reference being
    the group's fastest ``TIMES_BASELINES`` row (or the fastest ``baseline`` row); ``None`` where
    the group has no reference. ``failed`` says why a row is not compared (its ms and ratio are
    then None): a ``status`` other than ok, a string ``error`` (a run that failed, or whose
    result was wrong), or no finite ms. ``default`` marks the rows saying ``default: true``,
    or, in a group where no row has a ``default`` field, its first ``mgraph`` row (bench_moe's
    first ``--configs`` value; bench_layer's Program call). Kind-breakdown
    rows and rows with neither ms nor an error (kernel records) are no bars: ``left_out`` counts
    them.
    """
    groups: dict[tuple, dict[str, Any]] = {}
    for r in _with_back_to_back(rows):
        if "impl" not in r:
            continue
        key = tuple(_fmt(r.get(k)) for k in TIMES_GROUP_KEYS)
        group = groups.setdefault(key, {"rows": [], "left_out": 0, "title": ", ".join(
            f"{k}={_fmt(r[k])}" for k in TIMES_GROUP_KEYS if k in r)})
        if _kind_row(r) or not ("ms" in r or "error" in r or "status" in r):
            group["left_out"] += 1
        else:
            group["rows"].append(r)
    names = (baseline,) if baseline else TIMES_BASELINES
    table = []
    for group in groups.values():
        rs = group["rows"]
        if not rs:
            continue
        varying = {impl: [k for k in TIMES_LABEL_KEYS
                          if len({_fmt(_scalar(r, k)) for r in rs if r["impl"] == impl}) > 1]
                   for impl in {r["impl"] for r in rs}}
        timed = [r for r in rs if _failure(r) is None]
        bases = [r for r in timed if r["impl"] in names]
        ref = min(bases, key=lambda r: r["ms"]) if bases else None
        has_default = any("default" in r for r in rs)
        first_mgraph = next((r for r in rs if r["impl"] == "mgraph"), None)
        bars = []
        for r in rs:
            failed = _failure(r)
            label = " ".join([r["impl"], *(f"{k}={_fmt(_scalar(r, k))}" for k in varying[r["impl"]]
                                           if _scalar(r, k) is not None)])
            bars.append({
                "label": label, "impl": r["impl"], "ms": None if failed else r["ms"],
                "ratio": ref["ms"] / r["ms"] if ref and not failed else None,
                "default": r.get("default") is True if has_default else r is first_mgraph,
                "reference": r is ref, "failed": failed})
        table.append({"title": group["title"], "reference": ref["impl"] if ref else None,
                      "bars": bars, "left_out": group["left_out"]})
    return table


def _bar_color(bar: dict[str, Any], impls: list[str]) -> str:
    if bar["reference"]:
        return "#d62728"
    if bar["impl"] in TIMES_BASELINES:
        return "#ff9896"
    if bar["impl"].startswith("mgraph"):
        return COLORS["mgraph"]
    return _color(bar["impl"], impls)


def _tick_label(bar: dict[str, Any]) -> str:
    # the impl (and its marks) on the first line, its configuration fields under it
    impl, _, fields = bar["label"].partition(" ")
    impl += " (default)" if bar["default"] else ""
    impl += " [no time]" if bar["failed"] else ""
    return f"{impl}\n{fields}" if fields else impl


def _times(plt: Any, rows: Sequence[Row], baseline: str | None) -> Any:
    table = times_table(rows, baseline)
    if not table:
        raise InputError("times chart: no rows with impl and ms (or a failure status)")
    cols = 1 if len(table) == 1 else 2
    grid_rows = math.ceil(len(table) / cols)
    # each row of panels as tall as its longest bar list, so a 3-bar panel keeps thin bars
    heights = [1.6 + 0.42 * max(len(e["bars"]) for e in table[i:i + cols])
               for i in range(0, len(table), cols)]
    fig, axes = plt.subplots(grid_rows, cols, squeeze=False,
                             figsize=(10.0 if cols == 1 else 16.0, sum(heights)),
                             gridspec_kw={"height_ratios": heights})
    impls = list(dict.fromkeys(b["impl"] for entry in table for b in entry["bars"]))
    for ax, entry in zip(axes.flat, table, strict=False):
        bars = entry["bars"]
        ys = list(range(len(bars)))[::-1]  # the benchmark's order, top down
        top = max((b["ms"] for b in bars if b["ms"] is not None), default=1.0)
        for y, bar in zip(ys, bars, strict=True):
            if bar["failed"]:
                ax.text(top * 0.01, y, f"{bar['failed'][:70]}", va="center", fontsize=7,
                        color="#d62728", style="italic")
                continue
            ax.barh([y], [bar["ms"]], 0.7, color=_bar_color(bar, impls), edgecolor="black",
                    linewidth=1.6 if bar["default"] else 0.4, hatch="//" if bar["default"] else None)
            note = f"{bar['ms']:.3g} ms"
            if bar["reference"]:
                note += "  reference"
            elif bar["ratio"] is not None:
                note += f"  {bar['ratio']:.2f}x"
            ax.text(bar["ms"], y, " " + note, va="center", fontsize=7)
        ref = next((b for b in bars if b["reference"]), None)
        if ref:
            ax.axvline(ref["ms"], color="#d62728", linestyle="--", linewidth=1)
        ax.set_yticks(ys)
        ax.set_yticklabels([_tick_label(b) for b in bars], fontsize=7)
        ax.set_xlim(0, top * 1.3)
        ax.set_ylim(-0.6, len(bars) - 0.4)  # room for a failed row's text at the bottom
        ax.set_xlabel("ms (lower is better); reference_ms / ms beside each bar", fontsize=8)
        title = entry["title"] or "all rows"
        if entry["reference"]:
            title += f"\nreference: {entry['reference']} (fastest baseline)"
        if entry["left_out"]:
            title += f"; {entry['left_out']} kind-breakdown / kernel-info rows not drawn"
        ax.set_title(title, fontsize=8)
        ax.grid(axis="x", alpha=0.3)
    for ax in list(axes.flat)[len(table):]:
        ax.set_visible(False)
    return fig
