"""Reports of spawned rank processes (the multi-GPU tests), every rank's failure shown.

A rank's worker puts one tuple on a queue whose first item is its rank (tests/gpu_workers.py:
``(rank, error, traceback or None)``). Asserting on the reports in arrival order showed the
first failing rank's traceback only, and a rank that never reported stopped the test at the
queue's timeout with no traceback at all: a two-rank hang showed one side of it (the emulated
GEMM+AR on one shared GPU: rank 0's watchdog shown, rank 1's error never seen). ``collect``
returns one report per rank in rank order, standing in for a rank that sent none; ``failures``
joins the text of every failing rank.
"""

from __future__ import annotations

import queue as queue_module
import time
from collections.abc import Callable, Sequence

__all__ = ["collect", "failures"]

Report = tuple


def collect(queue, procs: Sequence, timeout: float, join_s: float = 60.0) -> list[Report]:
    """One report per process (``procs[r]`` runs rank ``r``), in rank order. Waits up to
    ``timeout`` seconds in all, and no longer once every process has ended; a rank that sent
    nothing gets ``(rank, None, "rank r sent no report (...)")``, so its third item reads as a
    failure. Then joins every process (``join_s`` each)."""
    deadline = time.monotonic() + timeout
    got: dict[int, Report] = {}
    while len(got) < len(procs) and time.monotonic() < deadline:
        ended = all(not p.is_alive() for p in procs)  # before the get: its reports are queued
        try:
            report = queue.get(timeout=max(0.01, min(1.0, deadline - time.monotonic())))
        except queue_module.Empty:
            if ended:
                break
            continue
        got[report[0]] = report
    for p in procs:
        p.join(join_s)
    out = []
    for rank, p in enumerate(procs):
        if rank in got:
            out.append(got[rank])
            continue
        state = "still running" if p.is_alive() else f"exit code {p.exitcode}"
        out.append((rank, None, f"rank {rank} sent no report ({state}; its stderr is in the "
                    "test's captured output)"))
    return out


def failures(
    reports: Sequence[Report],
    failed: Callable[[Report], bool] = lambda r: r[2] is not None,
    text: Callable[[Report], str] = lambda r: str(r[2]),
) -> str:
    """Every failing rank's text (by default a report's third item, its traceback), each under
    a header naming the rank; empty when none failed."""
    return "\n".join(f"--- rank {r[0]} ---\n{text(r)}" for r in reports if failed(r))
