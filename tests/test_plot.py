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
from mgraph.viz.plot import detect, load_rows, plot_file, plot_rows, speedup_table

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
    with pytest.raises(UnknownNameError, match="speedup, sweep, proxy"):
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
