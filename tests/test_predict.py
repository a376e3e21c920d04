"""benchmarks/predict.py: the committed predictions cover every committed bench_tp and
bench_emulated row (v8, the calibration's session, included), every modelled row outside the
goal says what the model lacks, the committed numbers are this commit's model's, and the
multi-GPU tile what-if reads calibrate.py's measurement as calibrate.py reads its own."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

import mgraph as mg

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
PREDICTIONS = json.loads((RESULTS / "predictions.json").read_text())


@pytest.fixture(scope="module")
def predict():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import predict
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    return predict


def test_every_committed_row_is_accounted_for(predict):
    rows = PREDICTIONS["rows"]
    for name in predict.SOURCES:
        measured = json.loads((RESULTS / name).read_text())
        mine = [r for r in rows if r["source"] == name]
        assert [r["index"] for r in mine] == list(range(len(measured))), name
    assert "v8/bench_tp_8192.json" in predict.SOURCES
    assert PREDICTIONS["summary"]["rows"] == len(rows)
    for r in rows:
        assert (r["predicted_ms"] is None) == ("error" not in r)
        if r["predicted_ms"] is not None and not r["within_goal"]:
            assert r["why"] and r["why"] != "no cause recorded in the row", r
        if r["predicted_ms"] is None:
            assert r["model"], r  # the reason it has no model


def test_spilling_kernels_are_named_as_the_cause(predict):
    """A missed row whose kernel spilled (bench_tp records n_regs / n_spills) says so, and only
    such a row does."""
    named = 0
    for r in PREDICTIONS["rows"]:
        if not r.get("why") or r["source"].startswith("bench_emulated"):
            continue
        m = json.loads((RESULTS / r["source"]).read_text())[r["index"]]
        if "n_spills" not in m:  # an mgraph_best row: the why comes from its sweep point
            continue
        assert ("spills" in r["why"]) == (m["n_spills"] > 0), r
        named += m["n_spills"] > 0
    assert named >= 20


def test_committed_predictions_are_this_models(predict):
    """A few rows of each source, recomputed now, equal the committed predictions: a model
    change without a rerun of predict.py fails here."""
    p = predict.Predictor(mg.H200)
    checked = 0
    for name in predict.SOURCES:
        measured = json.loads((RESULTS / name).read_text())
        picks = [r for r in PREDICTIONS["rows"] if r["source"] == name
                 and r["predicted_ms"] is not None and r["M"] == 8192 and r["K"] == 4096
                 and r["impl"] in ("mgraph", "mgraph_fused", "mgraph_gemm")]  # fmt: skip
        for r in picks[:3]:
            m = measured[r["index"]]
            if name.startswith("bench_emulated"):
                got, _ = p.emulated(m, 1024 if name.endswith("_1m.json") else 256)
            else:
                got, _ = p.bench_tp(m)
            assert got == pytest.approx(r["predicted_ms"], rel=1e-6), (
                f"{r}: the model or a lowering changed; rerun python benchmarks/predict.py"
            )
            checked += 1
    assert checked >= 8


def test_multi_gpu_tile_rate_is_calibrates_formula(predict):
    """calibrate.py derives tile_gemm_tflops = waves x tile flops x SMs / (GEMM - launch); the
    what-if applies the same formula to its 2-GPU GEMM with local stores (0.807 ms, launch
    0.0334 ms): 16 waves of 128x256x4096 tiles on 132 SMs."""
    m = json.loads(predict.CALIBRATION.read_text())["measurements"]
    want = 16 * 2 * 128 * 256 * 4096 * 132 / ((m["epilogue_local_ms"] - m["tiny_2gpu_ms"]) * 1e-3)
    rate = predict.multi_gpu_tile_tflops(mg.H200)
    assert rate == pytest.approx(want / 1e12, rel=1e-12)
    # the same formula on the 1-GPU GEMM gives the profile's rate back
    one = 16 * 2 * 128 * 256 * 4096 * 132 / ((m["gemm_ms"] - m["tiny_ms"]) * 1e-3) / 1e12
    assert one == pytest.approx(mg.H200.tile_gemm_tflops, rel=1e-4)
    assert rate < mg.H200.tile_gemm_tflops
