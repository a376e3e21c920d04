"""tests/rank_reports.py: the spawned multi-GPU tests show every rank's failure, in rank order,
and name a rank that never reported instead of waiting out the queue's timeout in silence."""

from __future__ import annotations

import queue

import rank_reports


class _Proc:
    """What collect reads of a multiprocessing.Process."""

    def __init__(self, exitcode: int | None) -> None:
        self.exitcode = exitcode
        self.joined = False

    def is_alive(self) -> bool:
        return self.exitcode is None

    def join(self, timeout: float | None = None) -> None:
        self.joined = True


def test_every_failing_rank_is_shown_in_rank_order() -> None:
    q: queue.Queue = queue.Queue()
    # rank 1 reported first, as a rank whose error came first would
    q.put((1, None, "Traceback ...\nWatchdogTimeout: rank 1 waited for sent 0"))
    q.put((0, None, "Traceback ...\nWatchdogTimeout: rank 0 waited for task 2174"))
    procs = [_Proc(0), _Proc(0)]
    reports = rank_reports.collect(q, procs, timeout=60)
    assert [r[0] for r in reports] == [0, 1]
    text = rank_reports.failures(reports)
    assert "rank 0 waited for task 2174" in text and "rank 1 waited for sent 0" in text
    assert text.index("--- rank 0 ---") < text.index("--- rank 1 ---")
    assert all(p.joined for p in procs)


def test_a_rank_that_sent_nothing_is_named_with_its_exit_code() -> None:
    q: queue.Queue = queue.Queue()
    q.put((0, 3.0e-3, None))
    reports = rank_reports.collect(q, [_Proc(0), _Proc(-9)], timeout=60)  # both ended
    assert reports[0] == (0, 3.0e-3, None)
    text = rank_reports.failures(reports)
    assert "--- rank 0 ---" not in text
    assert "rank 1 sent no report (exit code -9" in text


def test_no_failure_is_an_empty_text() -> None:
    q: queue.Queue = queue.Queue()
    for r in range(3):
        q.put((r, "ran", 1e-3))
    reports = rank_reports.collect(q, [_Proc(0)] * 3, timeout=60)
    assert rank_reports.failures(reports, failed=lambda r: r[1] != "ran") == ""


def test_a_failed_launch_trace_is_dumped_in_start_order(tmp_path) -> None:
    """tests/gpu_workers._dump_trace (MGRAPH_TEST_TRACE_DIR): tasks that started, by start time,
    and those that never did, named."""
    import json
    from types import SimpleNamespace

    import torch

    import gpu_workers

    names = ["gemm r1 [0:128,0:256]", "node-reduce r1 [0:128,0:256]", "rail-send r1->r0 [0:128]"]
    trace = torch.tensor([[20, 25, 30, 3], [10, 12, 15, 7], [0, 0, 0, 0]], dtype=torch.int64)
    rt = SimpleNamespace(
        d={"trace": trace.view(-1)}, epoch=1, tables=SimpleNamespace(local_tasks=[5, 6, 9]),
        graph=SimpleNamespace(tasks={5: SimpleNamespace(name=names[0]),
                                     6: SimpleNamespace(name=names[1]),
                                     9: SimpleNamespace(name=names[2])}),
    )  # fmt: skip
    gpu_workers._dump_trace(rt, 1, str(tmp_path))
    dumped = json.loads((tmp_path / "trace_rank1.json").read_text())
    assert dumped["ran"] == [[names[1], 10, 12, 15, 7], [names[0], 20, 25, 30, 3]]
    assert dumped["never"] == [names[2]] and dumped["rank"] == 1 and dumped["epoch"] == 1
