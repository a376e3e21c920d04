"""benchmarks/bench_layer.py on the CPU: its --smoke run on 2 gloo processes (torchrun; mgraph on
the reference backend, torch's TP on gloo, torch.compile with aot_eager) writes well-formed rows
whose outputs match the fp32 layer; argument checks; a failing or wrong implementation becomes
a failed row instead of ending the run. The GPU run itself (2 H200) is the lead's."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_layer.py"


def _load():
    before = dict(os.environ)
    spec = importlib.util.spec_from_file_location("bench_layer", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert dict(os.environ) == before, "importing the benchmark must not change the environment"
    return module


bench = _load()


@pytest.mark.slow
def test_smoke_run_on_two_gloo_ranks(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
         str(SCRIPT), "--smoke", "--reps", "2", "--warmup", "1", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=240, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads((tmp_path / "bench_layer.json").read_text())
    by_impl = {r["impl"]: r for r in rows}
    assert list(by_impl) == ["mgraph", "eager_tp", "torch_compile_tp", "mgraph_warm"]
    for r in rows:
        assert {"impl", "ms", "vs_eager_tp", "error", "status"} <= set(r), r
        assert r["status"] == "ok", r
        assert (r["hidden"], r["heads"], r["kv_heads"], r["ffn"], r["seq"]) == (128, 8, 2, 256, 64)
        assert (r["world"], r["dtype"]) == (2, "bfloat16")
        # bf16 against the fp32 layer: rounding only (a wrong shard or head order is O(1))
        assert 0 < r["error"] < 1e-2, r
    for impl in ("mgraph", "eager_tp", "torch_compile_tp"):
        assert by_impl[impl]["ms"] > 0
        want = by_impl["eager_tp"]["ms"] / by_impl[impl]["ms"]
        assert by_impl[impl]["vs_eager_tp"] == pytest.approx(want, rel=1e-2)
    assert by_impl["eager_tp"]["vs_eager_tp"] == 1.0
    assert by_impl["mgraph_warm"]["ms"] is None  # compiled and checked, not timed
    assert by_impl["torch_compile_tp"]["compile_backend"] == "aot_eager"
    for impl in ("mgraph", "mgraph_warm"):
        r = by_impl[impl]
        assert r["backend"] == "reference" and r["tasks"] > 0
        # numbers are max over ranks, stage by stage: each stage within the slowest compile
        assert 0 < r["trace_s"] <= r["compile_s"] and 0 < r["schedule_s"] <= r["compile_s"], r
        assert 0 < r["lower_s"] <= r["compile_s"], r
        assert r["first_call_s"] > 0 and r["second_call_s"] > 0
        assert set(r["stages"]) >= {"trace", "lower", "schedule"}
    table = (tmp_path / "bench_layer.md").read_text()
    for impl in by_impl:
        assert f"| {impl} |" in table


@pytest.mark.parametrize(
    "argv",
    [["--seq", "0"], ["--hidden", "100", "--heads", "8"], ["--heads", "8", "--kv-heads", "3"],
     ["--reps", "0"], ["--warmup", "-1"], ["--dtype", "int8"]],
)  # fmt: skip
def test_bad_arguments_exit_with_usage(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        bench.parse_args(argv)
    assert exc.value.code == 2
    assert "usage" in capsys.readouterr().err


def test_defaults_are_the_issue_layer():
    args = bench.parse_args([])
    sizes = (args.hidden, args.heads, args.kv_heads, args.ffn, args.seq, args.batch)
    assert sizes == (4096, 32, 8, 14336, 4096, 1)
    assert (args.dtype, args.backend, args.compile_backend) == (
        torch.bfloat16,
        "triton",
        "inductor",
    )
    smoke = bench.parse_args(["--smoke"])
    assert (smoke.backend, smoke.compile_backend, smoke.seq) == ("reference", "aot_eager", 64)


@pytest.fixture
def one_rank_bench(tmp_path):
    import torch.distributed as dist

    store = dist.HashStore()
    dist.init_process_group("gloo", rank=0, world_size=1, store=store)
    try:
        args = bench.parse_args(["--smoke", "--out", str(tmp_path), "--reps", "1"])
        yield bench.Bench(args, torch.device("cpu"))
    finally:
        dist.destroy_process_group()


def test_failures_become_rows(one_rank_bench, tmp_path):
    b = one_rank_bench

    def broken() -> dict:
        raise RuntimeError("no such kernel")

    row = b.step("broken", broken)
    assert row["status"].startswith("FAIL RuntimeError: no such kernel") and row["ms"] is None
    # a result off by a wrong sign on half the rows is caught by the error bound
    wrong = b.want.clone()
    wrong[..., : wrong.shape[-1] // 2] *= -1
    b.timed["wrong"] = lambda: None
    row = b.step("wrong", lambda: {"error": bench.rel(wrong, b.want)})
    assert row["status"] == "FAIL (error)" and "wrong" not in b.timed
    row = b.step("poisoned", lambda: {"error": float("nan")})  # a NaN output read back
    assert row["status"] == "FAIL (error)"
    row = b.step("eager_tp", b.eager_tp)  # world 1: the plan still applies, no communication
    assert row["status"] == "ok" and row["error"] < 1e-2
    calls = []

    def dies_on_the_second_call():
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("watchdog")

    b.step("flaky", lambda: {"error": 1e-3})
    b.timed["flaky"] = dies_on_the_second_call
    b.time_all()
    rows = json.loads((tmp_path / "bench_layer.json").read_text())
    assert [r["impl"] for r in rows] == ["broken", "wrong", "poisoned", "eager_tp", "flaky"]
    assert rows[4]["status"] == "FAIL while timing: RuntimeError: watchdog" and not rows[4]["ms"]
    assert len(calls) == 2  # not called again after the failure (a second round follows)
    assert rows[3]["ms"] > 0 and rows[3]["vs_eager_tp"] == 1.0 and rows[0]["ms"] is None
