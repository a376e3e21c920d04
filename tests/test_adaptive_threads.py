"""Settings(adaptive=True) on AG+GEMM, whose GEMM tiles wait for NVLink copies: both ranks' kernels
run at once under Triton's interpreter with every program on its own thread
(tests/interp_threads.py), so programs spin on each other's flags and the controller moves them
between the queues as on a GPU. The megakernel used to refuse this case (its GPU runs hung:
tests/test_adaptive_uniform.py has the cause); three launches must each match torch and leave
the queue heads reset for the next one."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from helpers import run_interpreted

pytest.importorskip("triton")

HERE = Path(__file__).resolve().parent


def test_adaptive_allgather_gemm_with_concurrent_programs_matches_torch():
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = run_interpreted([str(HERE / "adaptive_threads_interp.py")], env, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    row = json.loads(proc.stdout.strip().splitlines()[-1])
    assert row["failures"] == [], row
    assert row["adaptive"] == [True, True], row
    assert len(row["errors"]) == 3 and max(row["errors"]) < 1e-5, row
    # the last program of every launch resets the heads (roles moved: the next launch's
    # tickets start from 0, not from a base that assumes fixed workers per role)
    assert row["heads"] == [[[0, 0], [0, 0]]] * 3, row
    # every nvlink task ends with a decision (the interpreter has no clock: window 0)
    assert row["decisions"] == [12, 12], row
