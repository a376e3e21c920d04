"""`mgraph plot`: the committed benchmark results turn into the charts they should, the speedups
drawn are baseline_ms / ms with the default `mgraph` row quoted and `mgraph_best` beside it, and
rows with extra keys still plot."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from mgraph.cli import main
from mgraph.errors import InputError, UnknownNameError
from mgraph.viz.plot import detect, load_rows, plot_file, plot_rows, speedup_table, times_table

pytest.importorskip("matplotlib")  # the dev extra installs it; the module says how otherwise

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"


def png_size(path: Path) -> tuple[int, int]:
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    return struct.unpack(">II", head[16:24])


def test_bench_tp_speedups_quote_default_mgraph_and_best_beside_it():
    rows = load_rows(RESULTS / "bench_tp_v5.json")
    table = speedup_table(rows)
    ar = table["gemm_allreduce"]
    assert ar["baselines"] == ["cublas_nccl"] and ar["shapes"] == ["8192x8192x4096"]
    assert list(ar["speedup"])[:2] == ["mgraph", "mgraph_best"]
    assert "mgraph_sweep" not in ar["speedup"]  # sweep points go to the sweep chart
    assert ar["speedup"]["mgraph"][0] == pytest.approx(1.223 / 1.5655)
    assert ar["speedup"]["cublas_symm_two_shot"][0] == pytest.approx(1.223 / 1.1803)
    # default and best differ where the default split was not the best one
    rs = table["gemm_reduce_scatter"]["speedup"]
    assert rs["mgraph"][0] == pytest.approx(1.1011 / 1.4118)
    assert rs["mgraph_best"][0] == pytest.approx(1.1011 / 1.3767)


def test_plain_gemm_uses_cublas_and_emulated_uses_sequential():
    v4 = speedup_table(load_rows(RESULTS / "bench_tp_v4.json"))
    assert v4["gemm"]["baselines"] == ["cublas"]
    assert v4["gemm"]["speedup"]["mgraph_gemm"][0] == pytest.approx(0.748 / 0.8504)
    emu = speedup_table(load_rows(RESULTS / "bench_emulated_1m.json"))["gemm_allreduce"]
    # cublas (the GEMM alone) and net_alone are parts of the run, not contenders
    assert emu["baselines"] == ["sequential"] and list(emu["speedup"]) == ["mgraph_fused"]
    assert emu["shapes"] == ["8192x8192x4096\nNIC 50 GB/s", "8192x8192x4096\nNIC uncapped"]
    assert emu["speedup"]["mgraph_fused"] == pytest.approx([4.8269 / 4.5768, 2.3948 / 2.8007])


@pytest.mark.parametrize("name, charts", [
    ("bench_tp_v4", ["speedup", "sweep"]),
    ("bench_emulated_1m", ["speedup"]),
    ("bench_proxy_cpu", ["proxy"]),
    ("bench_proxy_gpu", ["proxy"]),
    ("simulated_mkernel", ["sweep"]),
])
def test_every_results_file_makes_its_charts(tmp_path, name, charts):
    assert detect(load_rows(RESULTS / f"{name}.json")) == charts
    pngs = plot_file(RESULTS / f"{name}.json", tmp_path)
    assert [p.name for p in pngs] == [f"{name}_{c}.png" for c in charts]
    for p in pngs:
        width, height = png_size(p)
        assert width > 400 and height > 300


def test_rows_with_extra_keys_and_a_baseline_override(tmp_path):
    rows = [
        {"op": "x", "M": 8, "N": 8, "K": 8, "impl": "cublas_nccl", "ms": 2.0, "gpu": "H200"},
        {"op": "x", "M": 8, "N": 8, "K": 8, "impl": "mgraph", "ms": 1.0, "nvlink_workers": 8,
         "notes": {"anything": [1, 2]}},
        {"op": "x", "M": 8, "N": 8, "K": 8, "impl": "torch_fused", "ms": 4.0},
    ]
    assert speedup_table(rows)["x"]["speedup"] == {"mgraph": [2.0], "torch_fused": [0.5]}
    over = speedup_table(rows, baseline="torch_fused")["x"]
    assert over["baselines"] == ["torch_fused"] and over["speedup"]["mgraph"] == [4.0]
    png = plot_rows(rows, tmp_path / "x.png", title="extra keys")
    assert png_size(png)[0] > 400


def test_bad_input_is_a_named_error(tmp_path):
    with pytest.raises(InputError, match="no chart fits"):
        plot_rows([{"foo": 1}], tmp_path / "none.png")
    with pytest.raises(UnknownNameError, match="speedup, sweep, proxy, times"):
        plot_rows([], tmp_path / "none.png", "pie")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"not": "rows"}))
    with pytest.raises(InputError, match="no list of row objects"):
        load_rows(bad)


def test_cli_plot_writes_pngs_and_reports_errors(tmp_path, capsys):
    assert main(["plot", str(RESULTS / "bench_tp_v5.json"), "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "bench_tp_v5_speedup.png" in out and "bench_tp_v5_sweep.png" in out
    assert png_size(tmp_path / "bench_tp_v5_sweep.png")[0] > 400
    assert main(["plot", str(RESULTS / "bench_tp_v5.json"), "--out", str(tmp_path),
                 "--chart", "proxy"]) == 2
    assert "InputError" in capsys.readouterr().out


LAYER = {"hidden": 64, "heads": 4, "kv_heads": 2, "ffn": 128, "seq": 32, "batch": 1,
         "dtype": "bfloat16", "world": 2}
MOE = {"T": 64, "H": 32, "E": 8, "top_k": 2, "F": 16, "world": 2}


def test_times_chart_layer_rows_ratios_and_failures_listed(tmp_path):
    rows = [
        dict(LAYER, impl="mgraph", ms=3.0, vs_eager_tp=1.5, error=1e-3, status="ok",
             stages={"trace": 1.0}),  # a dict field is no label
        dict(LAYER, impl="eager_tp", ms=4.5, vs_eager_tp=1.0, error=1e-3, status="ok"),
        dict(LAYER, impl="mgraph_kernel", ms=2.5, error=1e-3, status="ok"),
        dict(LAYER, impl="torch_compile_tp", ms=None, vs_eager_tp=None, error=None,
             status="skipped: torch.compile unavailable"),
        dict(LAYER, impl="torch_compile_tp", ms=9.0, error=0.5, status="FAIL (error)"),
    ]
    assert detect(rows) == ["times"]
    (panel,) = times_table(rows)
    assert panel["reference"] == "eager_tp" and panel["left_out"] == 0
    bars = {(b["label"], b["failed"] or ""): b for b in panel["bars"]}
    assert [b["label"] for b in panel["bars"]] == [
        "mgraph", "eager_tp", "mgraph_kernel", "torch_compile_tp", "torch_compile_tp"]
    assert bars["mgraph", ""]["ratio"] == pytest.approx(1.5) and bars["mgraph", ""]["default"]
    assert bars["mgraph_kernel", ""]["ratio"] == pytest.approx(1.8)
    assert bars["eager_tp", ""]["reference"] and bars["eager_tp", ""]["ratio"] == 1.0
    # failed and skipped rows stay, without a time or a ratio
    skipped = bars["torch_compile_tp", "skipped: torch.compile unavailable"]
    failed = bars["torch_compile_tp", "FAIL (error)"]
    assert skipped["ms"] is skipped["ratio"] is failed["ms"] is failed["ratio"] is None
    png = plot_rows(rows, tmp_path / "layer.png")
    assert png_size(png)[0] > 400


def test_times_chart_layer_back_to_back_is_its_own_panel():
    rows = [
        dict(LAYER, impl="mgraph", ms=3.7, ms_back_to_back=3.7, error=1e-3, status="ok"),
        dict(LAYER, impl="eager_tp", ms=4.2, ms_back_to_back=3.2, error=1e-3, status="ok"),
    ]
    idle, chained = times_table(rows)
    assert idle["title"].startswith("timing=idle start") and idle["reference"] == "eager_tp"
    assert chained["title"].startswith("timing=back to back")
    ratios = {b["impl"]: b["ratio"] for b in chained["bars"]}
    # back to back, eager's launch costs hide behind its kernels: mgraph is the slower one
    assert ratios["mgraph"] == pytest.approx(3.2 / 3.7) and ratios["eager_tp"] == 1.0
    assert {b["impl"]: b["ratio"] for b in idle["bars"]}["mgraph"] == pytest.approx(4.2 / 3.7)


def test_times_chart_moe_rows_drop_kind_rows_and_default_is_first_mgraph(tmp_path):
    cfg = {"expert_group": 8, "combine_rows": 64}  # the same in every mgraph row: no label
    rows = [
        dict(MOE, impl="torch_a2a", ms=16.0),
        dict(MOE, impl="grouped_gemm", ms=10.0),  # a GEMM-only bound, not a baseline
        dict(MOE, **cfg, impl="mgraph", ms=8.0, expert_rows=512, expert_cols_f=128,
             expert_cols_h=512),
        dict(MOE, impl="mgraph_kind", ms=900.0, expert_rows=512, kind="moe_expert"),
        dict(MOE, **cfg, impl="mgraph", ms=12.8, expert_rows=128),
        dict(MOE, **cfg, impl="mgraph", ms=float("nan"), expert_rows=4096, error="RuntimeError('x')"),
        dict(MOE, T=128, impl="torch_a2a", ms=30.0),  # another shape: another panel
        dict(MOE, T=128, impl="mgraph", ms=20.0, expert_rows=512),
    ]
    assert detect(rows) == ["times"]
    first, second = times_table(rows)
    assert first["title"] == "T=64, H=32, E=8, top_k=2, F=16, world=2"
    assert first["reference"] == "torch_a2a" and first["left_out"] == 1
    assert [(b["label"], b["ratio"], b["default"]) for b in first["bars"]] == [
        ("torch_a2a", 1.0, False),
        ("grouped_gemm", pytest.approx(1.6), False),
        ("mgraph expert_rows=512 expert_cols_f=128 expert_cols_h=512", pytest.approx(2.0), True),
        ("mgraph expert_rows=128", pytest.approx(1.25), False),
        ("mgraph expert_rows=4096", None, False),
    ]
    assert first["bars"][-1]["failed"] == "error: RuntimeError('x')"
    assert [(b["label"], b["ratio"]) for b in second["bars"]] == [
        ("torch_a2a", 1.0), ("mgraph", pytest.approx(1.5))]
    # --baseline measures against another impl (its fastest row)
    over = times_table(rows, baseline="grouped_gemm")[0]
    assert over["reference"] == "grouped_gemm" and over["bars"][2]["ratio"] == pytest.approx(1.25)
    assert times_table(rows, baseline="nope")[0]["bars"][2]["ratio"] is None
    path = tmp_path / "bench_moe.json"
    path.write_text(json.dumps(rows))
    (png,) = plot_file(path, tmp_path)
    assert png.name == "bench_moe_times.png" and png_size(png)[0] > 400


def test_times_chart_attention_rows_fastest_baseline_and_marked_default(tmp_path):
    rows = []
    for S, causal, cudnn in ((1024, False, 2.0), (1024, True, 1.2)):
        base = {"part": "tile", "S": S, "causal": causal}
        rows += [
            dict(base, impl="sdpa_cudnn", ms=cudnn, tflops=600.0),
            dict(base, impl="sdpa_fa2", ms=1.6, tflops=300.0),
            dict(base, impl="mgraph_tile", variant="plain", default=True, kernel="chains_kernel",
                 regs=255),  # the kernel's record: no bar
            dict(base, impl="mgraph_tile", variant="plain", default=True, task="128x1024",
                 ms=3.2, tflops=400.0),
            dict(base, impl="mgraph_tile", variant="pipe", default=False, task="128x1024",
                 ms=2.4, tflops=410.0),
            dict(base, impl="mgraph_tile", variant="w4", default=False, task="128x1024",
                 error="OutOfResources: shared memory"),
        ]
    assert detect(rows) == ["times"]
    noncausal, causal = times_table(rows)
    assert noncausal["title"] == "part=tile, S=1024, causal=False"
    assert noncausal["left_out"] == 1
    # the fastest baseline is the reference: FA2 here, cuDNN in the causal group
    assert noncausal["reference"] == "sdpa_fa2" and causal["reference"] == "sdpa_cudnn"
    assert [(b["label"], b["ms"], b["ratio"], b["default"]) for b in noncausal["bars"]] == [
        ("sdpa_cudnn", 2.0, pytest.approx(0.8), False),
        ("sdpa_fa2", 1.6, 1.0, False),
        ("mgraph_tile variant=plain", 3.2, pytest.approx(0.5), True),
        ("mgraph_tile variant=pipe", 2.4, pytest.approx(2 / 3), False),
        ("mgraph_tile variant=w4", None, None, False),
    ]
    assert noncausal["bars"][-1]["failed"] == "error: OutOfResources: shared memory"
    assert [b["ratio"] for b in causal["bars"][2:4]] == [pytest.approx(0.375), pytest.approx(0.5)]
    png = plot_rows(rows, tmp_path / "attn.png", "times", title="attention")
    width, height = png_size(png)
    assert width > 1000 and height > 300  # two panels side by side
