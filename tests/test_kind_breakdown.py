"""benchmarks/kind_breakdown.py's arithmetic on a hand-made trace: body time is end - ready,
waiting is ready - start (start when a runtime records no ready), TF/s over body time."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

from mgraph.runtime.trace import TaskRecord, Trace

sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks"))
from kind_breakdown import kind_rows  # noqa: E402


def test_rows_split_busy_time_into_body_and_waiting():
    tasks = [SimpleNamespace(flops=4e6), SimpleNamespace(flops=4e6), SimpleNamespace(flops=0.0)]
    trace = Trace([
        TaskRecord(0, "g0", "gemm", 0, "compute", 0, 0.0, 3e-6, 1e-6),  # waited 1 us, ran 2 us
        TaskRecord(1, "g1", "gemm", 0, "compute", 1, 1e-6, 3e-6, 1e-6),  # ran 2 us, no wait
        TaskRecord(2, "c0", "copy", 0, "nvlink", 0, 0.0, 6e-6),  # no ready stamp: all body
    ])
    rows = {r["kind"]: r for r in kind_rows(trace, tasks)}
    g, c = rows["gemm"], rows["copy"]
    assert (g["tasks"], g["programs"], c["tasks"]) == (2, 2, 1)
    assert abs(g["busy_ms"] - 5e-3) < 1e-9 and abs(g["work_ms"] - 4e-3) < 1e-9
    assert abs(g["wait_ms"] - 1e-3) < 1e-9 and abs(g["mean_work_us"] - 2.0) < 1e-9
    assert abs(g["tflops_per_program"] - 8e6 / 4e-6 / 1e12) < 1e-9
    assert c["wait_ms"] == 0.0 and c["tflops_per_program"] is None
    assert g["makespan_ms"] == c["makespan_ms"] == 6e-3
    assert list(rows) == ["copy", "gemm"]  # most busy first
