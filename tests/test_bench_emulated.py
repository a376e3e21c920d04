"""The CPU-side helpers of benchmarks/bench_emulated.py (its GPU part runs under torchrun on two
GPUs): argument parsing, the chunking into row blocks, what each op's baseline sends, the
analytic NCCL model, the pacing correction, the headline comparison and the markdown table; and
benchmarks/gpu_check_net.py's summary."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch

from mgraph.runtime.proxy import Rect

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_emulated.py"


def _load():
    before = dict(os.environ)
    spec = importlib.util.spec_from_file_location("bench_emulated", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert dict(os.environ) == before, "importing the benchmark must not change the environment"
    return module


bench = _load()


# -- arguments ----------------------------------------------------------------------------------
def test_defaults():
    args = bench.parse_args([])
    assert args.shapes == [(8192, 8192, 4096), (4096, 8192, 4096)]
    assert args.nic_gbps == [50.0, 0.0]
    assert (args.warmup, args.reps, args.chunk_kib) == (3, 10, 256)
    assert args.timeout > 0


def test_custom_arguments():
    args = bench.parse_args(
        ["--shapes", "256,512,128", "1024,1024,64", "--nic-gbps", "25", "--reps", "2",
         "--warmup", "0", "--chunk-kib", "64", "--out", "/tmp/x"]
    )  # fmt: skip
    assert args.shapes == [(256, 512, 128), (1024, 1024, 64)]
    assert args.nic_gbps == [25.0]
    assert (args.reps, args.warmup, args.chunk_kib, args.out) == (2, 0, 64, "/tmp/x")


@pytest.mark.parametrize(
    "argv",
    [["--shapes", "8192,8192"], ["--shapes", "a,b,c"], ["--shapes", "0,8,8"],
     ["--shapes", "8,-8,8"], ["--nic-gbps", "-1"], ["--reps", "0"], ["--chunk-kib", "0"],
     ["--timeout", "0"]],
)  # fmt: skip
def test_bad_arguments_exit_with_usage(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        bench.parse_args(argv)
    assert exc.value.code == 2
    assert "usage" in capsys.readouterr().err


# -- chunking -----------------------------------------------------------------------------------
def _check_tiling(rects, rows, cols, itemsize, chunk_bytes, buffer):
    row = 0
    for r in rects:
        assert isinstance(r, Rect) and r.buffer == buffer
        assert (r.row0, r.col0, r.col1) == (row, 0, cols), f"{r} does not continue at row {row}"
        assert r.row1 > r.row0
        assert r.numel * itemsize <= chunk_bytes or r.row1 - r.row0 == 1
        row = r.row1
    assert row == rows
    assert sum(r.numel for r in rects) == rows * cols


def test_chunks_of_the_default_shapes_are_256_kib_row_blocks():
    for rows, count in [(8192, 512), (4096, 256)]:
        rects = bench.chunk_rects(rows, 8192, 2, 256 * 1024, 0)
        assert len(rects) == count
        assert {r.row1 - r.row0 for r in rects} == {16}
        assert {r.numel * 2 for r in rects} == {256 * 1024}
        _check_tiling(rects, rows, 8192, 2, 256 * 1024, 0)


@pytest.mark.parametrize(
    "rows,cols,itemsize,chunk",
    [(37, 96, 2, 2048), (1, 8, 2, 4096), (100, 100, 4, 1000), (5, 3000, 2, 1024), (64, 64, 2, 8192)],
)
def test_chunks_tile_the_buffer_exactly(rows, cols, itemsize, chunk):
    rects = bench.chunk_rects(rows, cols, itemsize, chunk, 3)
    _check_tiling(rects, rows, cols, itemsize, chunk, 3)


def test_a_row_wider_than_a_chunk_goes_alone():
    rects = bench.chunk_rects(4, 200_000, 2, 256 * 1024, 0)
    assert [(r.row0, r.row1) for r in rects] == [(0, 1), (1, 2), (2, 3), (3, 4)]


def test_what_each_baseline_sends():
    shape = (8192, 8192, 4096)
    d = 8192 * 8192 * 2
    assert bench.exchange_rows("gemm_allreduce", shape, 1) == (0, 8192, 8192)
    # RS sends the peer's half of C's rows; AG sends the rank's own A shard
    assert bench.exchange_rows("gemm_reduce_scatter", shape, 0) == (4096, 8192, 8192)
    assert bench.exchange_rows("gemm_reduce_scatter", shape, 1) == (0, 4096, 8192)
    assert bench.exchange_rows("allgather_gemm", shape, 1) == (4096, 8192, 4096)
    assert bench.exchange_bytes("gemm_allreduce", shape) == d
    assert bench.exchange_bytes("gemm_reduce_scatter", shape) == d // 2
    assert bench.exchange_bytes("allgather_gemm", shape) == 4096 * 4096 * 2
    with pytest.raises(ValueError, match="valid: gemm_allreduce"):
        bench.exchange_rows("gemm", shape, 0)


@pytest.mark.parametrize("op", ["gemm_allreduce", "gemm_reduce_scatter", "allgather_gemm"])
def test_graph_sizes_give_the_per_rank_gemm(op):
    """The fused graph's local shards are the baseline's GEMM operands, on both ranks."""
    import mgraph as mg
    from mgraph.runtime.megakernel import local_shards

    shape = (256, 512, 128)
    graph = getattr(mg.ops, op)(topology="2x1", dtype=torch.bfloat16, chunk_bytes=16384,
                                **bench.graph_kwargs(op, shape))  # fmt: skip
    inputs = mg.ops.get_op(op).random_inputs(graph, seed=1)
    full = inputs["a"].float() @ inputs["b"].float()
    for rank in (0, 1):
        local = local_shards(graph, rank, inputs)
        M, N, K = shape
        a_rows = M // 2 if op == "allgather_gemm" else M
        assert tuple(local["a"].shape) == (a_rows, K) and tuple(local["b"].shape) == (K, N)
        want = bench.local_output(graph, rank, full)
        r0, r1, cols = bench.exchange_rows(op, shape, rank)
        if op == "allgather_gemm":  # the baseline multiplies the gathered A by its own b
            gathered = torch.empty(M, K)
            gathered[r0:r1] = local["a"].float()
            peer = local_shards(graph, 1 - rank, inputs)["a"].float()
            p0, p1, _ = bench.exchange_rows(op, shape, 1 - rank)
            gathered[p0:p1] = peer
            got = gathered @ local["b"].float()
        else:  # the baseline adds its partial C and the peer's, over the rows it keeps
            mine = (local["a"].float() @ local["b"].float())
            theirs = local_shards(graph, 1 - rank, inputs)
            total = mine + theirs["a"].float() @ theirs["b"].float()
            got = total if op == "gemm_allreduce" else total[rank * M // 2 : (rank + 1) * M // 2]
            assert cols == N
        assert got.numel() == want.numel()
        assert bench.rel(got, want) < 1e-5


def test_nccl_model():
    # 8192x8192 bf16 = 128 MiB at 50 GB/s x 0.92
    ms = bench.model_ms(0.75, 8192 * 8192 * 2, 50.0)
    assert ms == pytest.approx(0.75 + 134217728 / 46e9 * 1e3)
    assert bench.model_ms(0.75, 1 << 20, 0.0) is None  # uncapped: no baseline


def test_pacing_converges_on_the_cap():
    """A stream whose per-chunk cost is copy + sleep x 1.1 + 3 us of gaps: two corrections from
    the measured time land within 1% of chunk / cap."""
    chunk, cap = 1 << 20, 50.0
    target = chunk / (cap * 1e9) * 1e6

    def measured(sleep):
        return 2.6 + 1.1 * sleep + 3.0

    sleep = 0.0
    for _ in range(3):
        sleep = bench.pace_sleep_us(chunk, cap, measured(sleep), sleep)
    assert measured(sleep) == pytest.approx(target, rel=0.01)
    assert bench.pace_sleep_us(chunk, 0.0, 5.0, 1.0) == 0.0
    assert bench.pace_sleep_us(chunk, cap, 500.0, 1.0) == 0.0  # never negative


def test_headline_is_over_the_faster_baseline():
    d = bench.derived(2.0, ce_ms=3.0, model=2.5, net_ms=2.0)
    assert d == {"baseline": "nccl_ib_model", "speedup": 1.25, "fraction_hidden": 0.5}
    d = bench.derived(2.0, ce_ms=2.2, model=2.5, net_ms=2.0)
    assert d["baseline"] == "ce_paced" and d["speedup"] == 1.1
    assert bench.derived(3.0, 2.0, None, 1.0)["fraction_hidden"] == 0.0  # clamped
    assert bench.derived(1.0, 3.0, None, 1.0)["fraction_hidden"] == 1.0
    assert bench.derived(1.0, None, None, None)["speedup"] is None


def _row(impl, ms, cap=50.0, **extra):
    return {"op": "gemm_allreduce", "M": 8192, "N": 8192, "K": 4096, "topology": "2x1",
            "nic_gbps": cap, "chunk_kib": 1024, "impl": impl, "ms": ms, **extra}  # fmt: skip


def test_table():
    rows = [
        _row("net_alone", 2.7, gbps=49.7),
        _row("nccl_ib_model", 3.5),
        _row("ce_paced", 4.0, rel_err=0.003),
        _row("cublas", 0.8),
        _row("mgraph_fused", 2.0, rel_err=0.004, fraction_hidden=0.741, speedup=1.75,
             baseline="nccl_ib_model"),
        _row("cublas", 0.8, cap=0.0),
        _row("mgraph_fused", None, cap=0.0, error="wrong result: rel err 0.5 > 0.01"),
        _row("ce_paced", 1.6, cap=0.0),
    ]
    lines = bench.table(rows).strip().splitlines()
    assert lines[0].startswith("| op | M,N,K | chunk | NIC | impl | ms | faster baseline")
    body = [line.split(" | ") for line in lines[2:]]
    assert [b[4] for b in body] == ["cublas", "mgraph_fused", "ce_paced", "net_alone",
                                    "nccl_ib_model", "cublas", "mgraph_fused", "ce_paced"]
    assert {b[2] for b in body} == {"1024 KiB"}
    fused = body[1]
    assert fused[5:7] == ["2.000", "1.75x"] and "vs nccl_ib_model" in fused[7]
    assert "hides 0.74 of net" in fused[7]
    assert body[2][6] == "0.88x" and "49.7 GB/s" in body[3][7]
    failed = body[6]
    assert failed[5:7] == ["-", ""] and "FAILED: wrong result" in failed[7]
    assert body[5][6] == "2.00x"  # uncapped: ce_paced is the only baseline


def test_gpu_check_summary_lists_every_step():
    spec = importlib.util.spec_from_file_location("gpu_check_net", SCRIPT.parent / "gpu_check_net.py")
    check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(check)
    steps = [
        {"step": "build", "status": "ok", "seconds": 20.0},
        {"step": "crash_1m", "status": "failed", "seconds": 40.0, "rows": []},
        {"step": "ar_256k", "status": "ok", "seconds": 30.0, "rows": [
            _row("cublas", 0.8), _row("mgraph_fused", 2.0, ce_paced_ms=4.0, model_ms=3.5,
                                      speedup=1.75, net_gbps=49.0)]},
        {"step": "rs_ag_1m", "status": "skipped", "why": "budget: 10 s left"},
    ]
    lines = check.summary(steps).splitlines()
    assert [ln.split(" | ")[0].lstrip("| ") for ln in lines[2:]] == [
        "build", "crash_1m", "ar_256k", "rs_ag_1m"]
    assert "1.75" in lines[4] and "failed" in lines[3] and "skipped" in lines[5]
    cmd = check.bench_cmd(1024, Path("/tmp/o"))
    assert cmd[:3] == ["torchrun", "--nproc_per_node=2", "benchmarks/bench_emulated.py"]
    assert cmd[cmd.index("--chunk-kib") + 1] == "1024" and "8192,8192,4096" in cmd
