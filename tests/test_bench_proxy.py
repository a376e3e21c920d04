"""benchmarks/bench_proxy.py's harness on the CPU: the same producer and consumer kernels under
Triton's interpreter, pushing through the native proxy into host memory (a subprocess, since
TRITON_INTERPRET must be set before triton is imported). Timings mean nothing here; the rows'
shape, their correctness checks and their counts do."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import run_interpreted
from mgraph.runtime.proxy import native

SCRIPT = Path(__file__).parent.parent / "benchmarks" / "bench_proxy.py"
FIELDS = {
    "bench": str, "kind": str, "chunk_bytes": int, "commands": int, "cap_gbps": (int, float),
    "path": str, "producers": int, "ms": float, "commands_per_s": int, "gb_per_s": float,
    "ok": bool, "batches": int, "n_watch": int, "protocol": str, "cuda_calls_per_cmd": float,
}  # fmt: skip
LATENCY = ("latency_us_median", "latency_us_p10", "latency_us_p90")

pytestmark = pytest.mark.skipif(
    not native.available(), reason="the native proxy extension is not built (pip install -e .)"
)


@pytest.fixture(scope="module")
def rows(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    out = tmp_path_factory.mktemp("bench_proxy")
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--cpu", "--quick", "--out", str(out)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    table = (out / "bench_proxy.md").read_text()
    assert table.startswith("| bench |") and "meaningless" in table
    return json.loads((out / "bench_proxy.json").read_text())


def test_rows_are_well_formed_and_correct(rows: list[dict]) -> None:
    for row in rows:
        for key, kind in FIELDS.items():
            assert isinstance(row[key], kind), (key, row)
        assert row["ok"] is True and row["error"] is None, row
        assert row["path"] == "cpu-interpreter" and "meaningless" in row["timing"], row
        assert row["commands"] > 0 and row["ms"] > 0 and row["commands_per_s"] > 0, row
        if row["bench"] == "latency":
            assert all(row[k] is not None for k in (*LATENCY, "roundtrip_us_median")), row
            assert row["canary"] is True, row  # the consumer checked each command's data
        else:
            assert all(row[k] is None for k in LATENCY), row


def test_every_bench_ran(rows: list[dict]) -> None:
    got = {(r["bench"], r["kind"], r["cap_gbps"]) for r in rows}
    assert {("drain", k, 0) for k in ("nop", "signal", "write")} <= got
    assert ("latency", "write", 0) in got
    assert {("bandwidth", "write", cap) for cap in (0, 50)} <= got
    assert len({r["chunk_bytes"] for r in rows if r["bench"] == "bandwidth"}) >= 2


def test_counts_are_consistent(rows: list[dict]) -> None:
    for row in rows:
        n = row["commands"]
        # The proxy drained every command in batches of at most 32 (its batch size).
        assert -(-n // 32) <= row["batches"] <= n, row
        if row["bench"] == "latency":  # one command in flight: each watched, one producer
            assert row["producers"] == 1 and row["n_watch"] == n, row
        elif row["kind"] == "nop":  # only each producer's last command raises a flag
            assert row["n_watch"] == row["producers"], row
        else:  # one watch per flag word: its final count
            assert row["n_watch"] == min(n, 1024), row
        if row["kind"] != "write":
            assert row["chunk_bytes"] == 0 and row["gb_per_s"] == 0, row
        assert n > 16, row  # the CPU's ring holds 16: every run wraps it


CANARY = """if True:
    import sys
    import torch
    sys.path.insert(0, sys.argv[1])
    import bench_proxy as bp
    n, cols, n_slots = 6, 5, 4  # watch k checks chunk k % 4: chunk 1 serves watches 1 and 5
    dst = torch.randn(n_slots, cols)
    flags = torch.ones(n, dtype=torch.int32)
    watch = torch.arange(n, dtype=torch.int32), torch.ones(n, dtype=torch.int32)
    for bad in (None, (1, 0), (2, cols - 1), (3, 2)):  # NaN: a chunk not yet written
        d = dst.clone()
        if bad is not None:
            d[bad] = float("nan")
        status = torch.full((3,), -1, dtype=torch.int64)
        bp._consumer[(1,)](flags, *watch, n, torch.zeros(n, dtype=torch.int64), status,
                           torch.zeros(1, dtype=torch.int32), 100, d, cols, n_slots,
                           ASM=False, CANARY=True, num_warps=1)
        print(status.tolist())
"""


def test_the_latency_canary_sees_a_flag_ahead_of_its_data() -> None:
    """The consumer's canary (first and last element of each watched command's chunk, NaN until
    written) counts the flags that arrived before their data; it samples the chunk's ends, so a
    hole in the middle goes unseen (the last case)."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = run_interpreted(["-c", CANARY, str(SCRIPT.parent)], env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = [json.loads(line) for line in proc.stdout.splitlines()]
    # status: [failed watch, its value, early arrivals]; watches 1 and 5 read chunk 1.
    assert got == [[-1, -1, 0], [-1, -1, 2], [-1, -1, 1], [-1, -1, 0]]


def test_the_gpu_plan_compares_protocols_on_latency() -> None:
    """On a GPU the first protocol runs every case, each other one the latency cases again."""
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import bench_proxy as bp
    finally:
        sys.path.remove(str(SCRIPT.parent))
    protocols = ("new", "old", "new+driver", "new+gpufence", "kernel", "hostflags")
    cases = bp.plan(bp.Rig(cpu=False), True, False, ("copy", "memop"), (1, 4), protocols)
    base = [c for c in cases if c.protocol == "new"]
    latency = [c for c in base if c.bench == "latency"]
    assert {c.bench for c in base} == {"drain", "latency", "bandwidth"} and latency
    # The copy kernel: one stream only, its latency cases and the WRITE drain (throughput)
    kernel = [c for c in cases if c.protocol == "kernel"]
    want = [
        c
        for c in base
        if c.streams == 1 and (c.bench == "latency" or (c.bench == "drain" and c.kind == "write"))
    ]
    assert [bp.asdict(c) | {"protocol": "new"} for c in kernel] == [bp.asdict(c) for c in want]
    assert {c.bench for c in kernel} == {"drain", "latency"}
    for p in protocols[1:-2]:
        mine = [c for c in cases if c.protocol == p]
        want = [c for c in latency if p != "new+gpufence" or c.flags == "memop"]  # a memop option
        assert [bp.asdict(c) | {"protocol": "new"} for c in mine] == [bp.asdict(c) for c in want]
    # Host flags: the latency cases of one stream, once (flag modes do not apply)
    host = [c for c in cases if c.protocol == "hostflags"]
    want = [c for c in latency if c.streams == 1 and c.flags == "copy"]
    assert [bp.asdict(c) | {"protocol": "new", "flags": "copy"} for c in host] == [
        bp.asdict(c) for c in want
    ] and all(c.flags == "host" for c in host)
    assert set(bp.PROTOCOLS) == set(protocols)
