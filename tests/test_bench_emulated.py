"""The CPU-side helpers of benchmarks/bench_emulated.py (its GPU part runs under torchrun on two
GPUs): argument parsing, the chunking of a partial C into row-block WRITEs, the exchange's
commands and flag targets (through the real native drain loop, host memory standing in for the
GPUs), the derived metrics and the markdown table."""

from __future__ import annotations

import importlib.util
import os
import time
from pathlib import Path

import pytest
import torch

from mgraph.errors import ProxyError
from mgraph.runtime.proxy import CommandFifo, InProcessTransport, NativeProxy, Opcode, Rect
from mgraph.runtime.proxy.native import available

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
        rects = bench.chunk_rects(rows, 8192, 2, 256 * 1024, bench.SRC)
        assert len(rects) == count
        assert {r.row1 - r.row0 for r in rects} == {16}
        assert {r.numel * 2 for r in rects} == {256 * 1024}
        _check_tiling(rects, rows, 8192, 2, 256 * 1024, bench.SRC)


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


def test_fifo_holds_one_exchange():
    assert [bench.fifo_capacity(n) for n in (1, 2, 3, 256, 512, 513)] == [2, 2, 4, 256, 512, 1024]


def test_exchange_commands():
    rects = bench.chunk_rects(40, 64, 2, 2048, bench.SRC)
    cmds = bench.exchange_commands(1, 0, rects, 2, epoch=7)
    assert len(cmds) == len(rects) == 3
    for cmd, r in zip(cmds, rects, strict=True):
        assert cmd.opcode is Opcode.WRITE
        assert (cmd.src_rank, cmd.dst_rank, cmd.epoch) == (1, 0, 7)
        assert cmd.src == r and cmd.dst == r._replace(buffer=bench.RECV)
        assert cmd.bytes == r.numel * 2
        assert (cmd.event, cmd.done_event) == (bench.ARRIVED, bench.SENT)
    assert sum(c.bytes for c in cmds) == 40 * 64 * 2


# -- the exchange through the native drain (host memory for the two GPUs) -----------------------
@pytest.mark.skipif(not available(), reason="native proxy extension not built")
@pytest.mark.parametrize("bandwidth", [0.0, 20e6])
def test_exchange_through_native_proxies(bandwidth):
    """What the sequential baseline does per rep, on the CPU: both ranks push their chunks, wait
    until ARRIVED and SENT reach epoch * chunks, and find the peer's partial in RECV."""
    rows, cols, chunk = 64, 96, 2048
    rects = bench.chunk_rects(rows, cols, 2, chunk, bench.SRC)
    transport = InProcessTransport(lambda *a: pytest.fail(f"callback raised {a}"))
    src = {r: torch.empty(rows, cols, dtype=torch.bfloat16) for r in (0, 1)}
    recv = {r: torch.full((rows, cols), float("nan"), dtype=torch.bfloat16) for r in (0, 1)}
    flags = {r: torch.zeros(2, dtype=torch.int32) for r in (0, 1)}
    for r in (0, 1):
        transport.register(r, {bench.SRC: src[r], bench.RECV: recv[r]})
        transport.register_flags(r, flags[r])
    transport.connect(0, 1)
    proxies = {
        r: NativeProxy(CommandFifo(bench.fifo_capacity(len(rects))), transport, 4, rank=r,
                       name=f"rank{r}", bandwidth=bandwidth).start()  # fmt: skip
        for r in (0, 1)
    }
    try:
        for epoch in (1, 2, 3):
            for r in (0, 1):
                src[r].copy_(torch.randn(rows, cols))  # safe: last epoch's SENT was reached
            start = time.perf_counter()
            for r in (0, 1):
                for cmd in bench.exchange_commands(r, 1 - r, rects, 2, epoch):
                    proxies[r].fifo.push(cmd)
            target = epoch * len(rects)
            for r in (0, 1):
                bench.wait_flags(flags[r].tolist, [target, target], ["arrived", "sent"], 10.0,
                                 proxies[r].check)  # fmt: skip
            elapsed = time.perf_counter() - start
            for r in (0, 1):
                assert flags[r].tolist() == [target, target]  # one count per chunk, no more
                assert torch.equal(recv[r], src[1 - r])
            if bandwidth:  # each proxy paces its rank's bytes like a NIC
                assert elapsed >= 0.8 * rows * cols * 2 / bandwidth
    finally:
        for p in proxies.values():
            p.stop()
        transport.close()


def test_wait_flags_returns_when_every_word_is_reached():
    reads = iter([[0, 0], [3, 1], [4, 4], [9, 9]])
    bench.wait_flags(lambda: next(reads), [4, 4], ["a", "b"], 1.0)
    assert next(reads) == [9, 9]


def test_wait_flags_times_out_naming_what_it_waited_for():
    start = time.monotonic()
    with pytest.raises(ProxyError) as exc:
        bench.wait_flags(lambda: [3, 8], [5, 8], ["flag word 0 (arrived)", "flag word 1"], 0.05)
    assert time.monotonic() - start < 2
    text = str(exc.value)
    assert "flag word 0 (arrived): 3 of 5" in text and "0.05 s" in text


def test_wait_flags_raises_the_proxy_error_at_once():
    def check():
        raise ProxyError("proxy rank0: command #3 failed")

    start = time.monotonic()
    with pytest.raises(ProxyError, match="command #3"):
        bench.wait_flags(lambda: [0], [1], ["w"], 30.0, check)
    assert time.monotonic() - start < 1


# -- metrics and table --------------------------------------------------------------------------
def test_derived_metrics():
    assert bench.derived(3.0, 2.0, 2.0) == {"fraction_hidden": 0.5, "speedup": 1.5}
    assert bench.derived(3.0, 0.5, 2.0)["fraction_hidden"] == 1.0  # clamped
    slower = bench.derived(2.0, 2.5, 1.0)
    assert slower["fraction_hidden"] == 0.0 and slower["speedup"] == 0.8
    assert bench.derived(2.0, 1.0, 0.0)["fraction_hidden"] == 0.0


def _row(impl, ms, cap=50.0, **extra):
    return {"op": "gemm_allreduce", "M": 8192, "N": 8192, "K": 4096, "topology": "2x1",
            "nic_gbps": cap, "impl": impl, "ms": ms, **extra}  # fmt: skip


def test_table():
    rows = [
        _row("net_alone", 2.7, gbps=49.7),
        _row("sequential", 4.0, push_ms=1.1, rel_err=0.003),
        _row("cublas", 0.8),
        _row("mgraph_fused", 2.0, rel_err=0.004, fraction_hidden=0.741, speedup=2.0),
        _row("cublas", 0.8, cap=0.0),
        _row("mgraph_fused", None, cap=0.0, error="wrong result: rel err 0.5 > 0.01"),
        _row("sequential", 1.6, cap=0.0, push_ms=1.0),
    ]
    text = bench.table(rows)
    lines = text.strip().splitlines()
    assert lines[0].startswith("| M,N,K | NIC | impl | ms | vs sequential")
    body = [line.split(" | ") for line in lines[2:]]
    assert [b[2] for b in body] == ["cublas", "mgraph_fused", "sequential", "net_alone",
                                    "cublas", "mgraph_fused", "sequential"]  # fmt: skip
    assert [b[1] for b in body[:4]] == ["50 GB/s"] * 4
    assert [b[1] for b in body[4:]] == ["uncapped"] * 3
    fused, seq, net = body[1], body[2], body[3]
    assert fused[3:5] == ["2.000", "2.00x"] and "hides 0.74 of net" in fused[5]
    assert seq[4] == "1.00x" and "host push 1.10 ms" in seq[5]
    assert net[4] == "1.48x" and "49.7 GB/s" in net[5]
    failed = body[5]
    assert failed[3:5] == ["-", ""] and "FAILED: wrong result" in failed[5]
    assert body[4][4] == "2.00x"  # cuBLAS alone against the uncapped sequential run
