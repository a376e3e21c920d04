"""Colours the benchmark charts share (mgraph/viz/plot.py, mgraph/viz/times.py)."""

from __future__ import annotations

COLORS = {"mgraph": "#1f77b4", "mgraph_best": "#aec7e8", "mgraph_fused": "#1f77b4",
          "mgraph_gemm": "#1f77b4", "torch_fused": "#ff7f0e", "cublas_symm_two_shot": "#2ca02c"}
OTHER_COLORS = ("#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf", "#d62728")


def _color(impl: str, order: list[str]) -> str:
    return COLORS.get(impl) or OTHER_COLORS[order.index(impl) % len(OTHER_COLORS)]
