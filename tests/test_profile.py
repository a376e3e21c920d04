"""The one hardware profile: shipped as package data with a source per value, read alike by the
scheduler and the simulator; and the committed predictions of every committed GPU measurement
(benchmarks/predict.py) checked against those measurements."""

from __future__ import annotations

import json
import math
import sys
from collections import defaultdict
from pathlib import Path

import pytest
import tomllib

import mgraph as mg
from mgraph.hardware import PROFILES, load_profile

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
PREDICTIONS = json.loads((RESULTS / "predictions.json").read_text())


# -- the profile -------------------------------------------------------------------------------
def test_shipped_profile_is_package_data_with_a_source_per_value():
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert "profiles/*.json" in data["package-data"]["mgraph"]
    for name in PROFILES:
        assert (ROOT / "mgraph" / "profiles" / f"{name}.json").is_file()
    hw = load_profile("h200")
    assert hw == mg.H200
    values = set(mg.HardwareProfile.model_fields) - {"name", "sources"}
    assert values - set(hw.sources) == set(), "every value says where it comes from"
    assert all(hw.source(f) for f in values)
    with pytest.raises(mg.UnknownNameError, match="h200"):
        load_profile("h100")


def test_sources_must_name_fields(tmp_path):
    doc = json.loads(mg.H200.model_dump_json())
    doc["sources"]["nvlink_speed"] = "typo"
    with pytest.raises(ValueError, match="nvlink_speed"):
        mg.HardwareProfile.model_validate(doc)
    path = tmp_path / "p.json"
    mg.H200.save(path)
    assert mg.HardwareProfile.load(path) == mg.H200


def test_one_nvlink_worker_cap_and_rates():
    """The static partition and the simulator's controller read one cap; the scheduler and the
    simulator the same per-worker NVLink rates, one for reads from a peer (pull) and one for
    writes into a peer (push) (costmodel.nvlink_rate_per_sm), both calibrated."""
    from mgraph.scheduler.costmodel import nvlink_rate_per_sm

    hw = mg.H200
    assert hw.nvlink_push_sms == hw.nvlink_max_sms
    assert nvlink_rate_per_sm(hw) == hw.nvlink_worker_gbps * 1e9
    assert nvlink_rate_per_sm(hw, push=True) == hw.nvlink_worker_push_gbps * 1e9
    for field in ("nvlink_worker_gbps", "nvlink_worker_push_gbps"):
        assert hw.source(field).startswith("benchmarks/calibrate.py on 2x H200")
    # one contention constant beside compute, from the v7 traces over the calibrated push rate
    assert hw.source("nvlink_beside_compute").startswith("bench_tp v7 traces")
    assert hw.nvlink_beside_compute == pytest.approx(3.54 / hw.nvlink_worker_push_gbps, abs=0.01)
    assert nvlink_rate_per_sm(hw, push=True, beside=True) == pytest.approx(
        hw.nvlink_worker_push_gbps * 1e9 * hw.nvlink_beside_compute
    )
    assert mg.schedule(mg.ops.gemm(M=256, N=256, K=256, topology="1x1")).hardware == hw


# -- predictions against measurements ----------------------------------------------------------
def test_every_committed_measurement_has_its_prediction():
    rows = PREDICTIONS["rows"]
    by_source = defaultdict(list)
    for r in rows:
        by_source[r["source"]].append(r)
    for name, preds in by_source.items():
        measured = json.loads((RESULTS / name).read_text())
        assert [p["index"] for p in preds] == list(range(len(measured))), name
        for p, m in zip(preds, measured, strict=True):
            assert (p["op"], p["impl"], p["M"], p["N"], p["K"]) == (
                m["op"], m["impl"], m["M"], m["N"], m["K"])  # fmt: skip
            assert p["measured_ms"] == m["ms"] or math.isnan(m["ms"])
            if p["predicted_ms"] is None:
                assert p["model"], "a row without a prediction says why"
                continue
            assert p["error"] == pytest.approx(p["predicted_ms"] / p["measured_ms"] - 1)
            assert p["within_goal"] == (abs(p["error"]) <= PREDICTIONS["goal"])
    s = PREDICTIONS["summary"]
    modelled = [r for r in rows if r["predicted_ms"] is not None]
    assert s["rows"] == len(rows) and s["modelled"] == len(modelled)
    assert s["within_goal"] == sum(r["within_goal"] for r in modelled)


def test_committed_predictions_are_this_profile_s():
    """Re-simulate a few cheap rows: the committed predictions come from the shipped profile and
    this commit's model (rerun benchmarks/predict.py when either changes)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from predict import Predictor
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    p = Predictor(mg.H200)
    picks = [r for r in PREDICTIONS["rows"] if r["source"] == "bench_tp_v7.json"
             and (r["M"], r["N"], r["K"]) == (8192, 8192, 4096)
             and r["impl"] in ("cublas", "mgraph_gemm", "cublas_nccl", "mgraph")
             and r["op"] != "allgather_gemm"]  # fmt: skip
    assert len(picks) == 6
    measured = json.loads((RESULTS / "bench_tp_v7.json").read_text())
    for r in picks:
        got, _ = p.bench_tp(measured[r["index"]])
        assert got == pytest.approx(r["predicted_ms"], rel=1e-6), r


def _pairs() -> dict[tuple, dict[str, tuple[float, float]]]:
    out: dict[tuple, dict[str, tuple[float, float]]] = defaultdict(dict)
    for r in PREDICTIONS["rows"]:
        if r["source"] == "bench_tp_v7.json" and r["impl"] in ("mgraph", "cublas_nccl"):
            out[(r["op"], r["M"], r["N"], r["K"])][r["impl"]] = (
                r["measured_ms"], r["predicted_ms"])  # fmt: skip
    return out


# The pairs where the calibrated model predicts the default fused kernel beats cuBLAS+NCCL by
# more than 5% but bench_tp v7 measured it slower: the model built from microbenchmarks alone
# (calibrate.py, 2026-11-30) is optimistic on fused rows (see the next test). The issue asks for
# none; this list may only shrink (benchmarks/NOTES.md, "calibrated profile v2"; AG+GEMM at
# 4096x8192x4096 left it with the contention constant, nvlink_beside_compute).
FALSE_SPEEDUPS = {
    ("allgather_gemm", 8192, 8192, 4096),
    ("allgather_gemm", 8192, 8192, 14336),
    ("gemm_reduce_scatter", 2048, 8192, 8192),
    ("gemm_reduce_scatter", 1024, 8192, 8192),
    ("gemm_reduce_scatter", 8192, 8192, 14336),
    ("gemm_allreduce", 1024, 8192, 8192),
}


def test_predicted_speedups_the_gpus_did_not_show_are_the_known_ones():
    """Where the model predicts the default fused kernel beats cuBLAS+NCCL by more than 5%, the
    GPU measured it faster too, except at the pairs listed in FALSE_SPEEDUPS (no new ones)."""
    pairs = _pairs()
    assert len(pairs) == 15
    false = set()
    for key, v in pairs.items():
        (m_fused, p_fused), (m_seq, p_seq) = v["mgraph"], v["cublas_nccl"]
        if p_seq / p_fused > 1.05 and not m_seq / m_fused > 1.0:
            false.add(key)
    assert false <= FALSE_SPEEDUPS, sorted(false - FALSE_SPEEDUPS)
    assert false == FALSE_SPEEDUPS, f"fixed: {sorted(FALSE_SPEEDUPS - false)}: shrink the list"


def test_rows_the_calibration_predicts_within_goal():
    """What holds for the committed bench_tp v7 rows with the calibrated profile: every
    cuBLAS+NCCL baseline (15) and every megakernel GEMM alone (5) is predicted within 15%. The
    megakernel's fused rows are not: every one is predicted FASTER than measured (default
    GEMM+AR 2 of 5 within 15%, GEMM+RS 0 of 5, AG+GEMM 0 of 5, down to -63%): the GEMM alone
    ran 0.790 ms in v7 and 0.708 ms in the calibration run, and the 2-GPU launch cost 96 us
    fitted to v7's fused rows and 17 us measured alone. The NVLink workers' slowdown beside a
    GEMM (v7: 3.4-4.1 GB/s each, 8.5 alone) is modelled (nvlink_beside_compute 0.42): it moved
    only the AG rows where the gather limits (8 workers -49% -> -17%), none into 15%.
    predictions.json lists every row's error."""
    rows = [r for r in PREDICTIONS["rows"] if r["source"] == "bench_tp_v7.json"]
    held = [r for r in rows if r["impl"] in ("cublas_nccl", "mgraph_gemm")]
    assert len(held) == 15 + 5
    assert all(r["within_goal"] for r in held), [(r["op"], r["M"], r["impl"]) for r in held
                                                  if not r["within_goal"]]  # fmt: skip
    fused = [r for r in rows if r["impl"].startswith("mgraph") and r["impl"] != "mgraph_gemm"
             and r["predicted_ms"] is not None]  # fmt: skip
    assert len(fused) == 66
    assert all(r["error"] < 0 for r in fused), [(r["op"], r["M"], r["impl"], r["config"])
                                                for r in fused if r["error"] >= 0]  # fmt: skip
    default = {}
    for r in fused:
        if r["impl"] == "mgraph":
            default.setdefault(r["op"], []).append(r["within_goal"])
    assert {op: sum(v) for op, v in default.items()} == {
        "gemm_allreduce": 2, "gemm_reduce_scatter": 0, "allgather_gemm": 0}  # fmt: skip


# -- the calibration's microbenchmark graphs (benchmarks/calibrate.py), on the CPU ---------------
@pytest.mark.parametrize("kind", ["pull", "push", "gemm_peer", "gemm_local"])
def test_calibration_graphs_compute_their_reference(kind):
    """The graphs calibrate.py times on the GPU are right: the reference runtime's ``out`` on
    each rank equals torch's on random inputs, and each rank's rows are where calibrate reads
    them from."""
    import torch

    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import calibrate
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    if kind in ("pull", "push"):
        graph = calibrate.nvlink_copies(2, pull=kind == "pull")
        roles = {t.role for t in graph.tasks}
        assert roles == {"nvlink"}
        movers = {t.rank for t in graph.tasks if t.name.startswith("copy r0")}
        assert movers == ({1} if kind == "pull" else {0})
    else:
        graph = calibrate.gemm_tiles(128, 512, 64, peer=kind == "gemm_peer")
    gen = torch.Generator().manual_seed(3)
    inputs = {n: torch.randn(s.shape, generator=gen).to(torch.bfloat16)
              for n, s in graph.inputs.items()}  # fmt: skip
    res = mg.run(graph, inputs, backend="reference")
    want = calibrate.reference_out(graph, inputs)
    got = res.outputs["out"].float()
    assert ((got - want).norm() / want.norm()).item() < 1e-2
    for rank in range(2):
        owner = calibrate.out_rows_owner(graph, rank)
        assert owner == (rank if kind == "gemm_local" else 1 - rank)
