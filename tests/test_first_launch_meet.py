"""A multi-rank TritonRuntime (one process per rank) compiles its kernel and meets every rank
on the host before its first launch (runtime.py ``_compile_and_meet``), and its watchdog hint
names what an entry-barrier timeout means.

Issue 15: on 2 H200 the first configuration of each torchrun process failed with "the entry
barrier: start 1 (a remote peer's start): value 0, target 1, after 5 s", or, where the other
rank launched first and gave up, with a local event stuck at 1 of 2 (the peer's half), while
the same process's second configuration, same kernel, ran. Triton compiles at the first call and
the ranks compile different specialisations, so the rank that finished compiling first spent its
5 s entry barrier on a peer still compiling. The CPU tests check the order of compile, module
load, scratch, host barrier and launch with a recording kernel; the multi_gpu test holds rank 1
on its host for longer than the watchdog before its first launch (without the host barrier,
rank 0's 2 s entry barrier would expire while rank 1 sleeps; not yet run on a GPU).
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from mgraph.runtime.megakernel.runtime import TritonRuntime, _watchdog_hint


class Compiled:
    """What Triton's warmup returns: its module loads at ``_init_handles``; the launcher
    allocates programs x CTAs x ``global_scratch_size`` bytes of scratch."""

    def __init__(self, log: list[str]) -> None:
        self.log = log
        self.metadata = SimpleNamespace(global_scratch_size=64, num_ctas=1)

    def _init_handles(self) -> None:
        self.log.append("load")


class RecordingKernel:
    def __init__(self, log: list[str]) -> None:
        self.log = log

    def warmup(self, *, grid: tuple, **kwargs: object) -> Compiled:
        assert grid == (4,) and kwargs == {"x": 1}, (grid, kwargs)
        self.log.append("compile")
        return Compiled(self.log)

    def __getitem__(self, grid: tuple):
        def launch(**kwargs: object) -> str:
            self.log.append("launch")
            return "compiled"

        return launch


def bare_runtime(log: list[str], *, world: int, shared: object = None,
                 interpret: bool = False) -> TritonRuntime:  # fmt: skip
    """A TritonRuntime with only what ``_zero_and_launch`` reads (no graph buffers to zero)."""
    rt = TritonRuntime.__new__(TritonRuntime)
    rt.graph = SimpleNamespace(buffers={})
    rt.tables = SimpleNamespace(programs=4)
    rt.world, rt.shared, rt.interpret = world, shared, interpret
    rt._args = None
    rt._kernel = RecordingKernel(log)
    rt._kernel_args = lambda: {"x": 1}
    rt._scratch = lambda size, align, stream: log.append(f"scratch {size}")
    rt.device = "cuda:0"
    return rt


def test_first_launch_compiles_then_meets_every_rank_then_launches(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import torch.distributed as dist

    log: list[str] = []
    monkeypatch.setattr(dist, "barrier", lambda *a, **k: log.append("barrier"))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: log.append("sync"))
    rt = bare_runtime(log, world=2)
    rt._zero_and_launch()
    first = ["compile", "load", "scratch 256", "sync", "barrier", "launch"]
    assert log == first
    rt._zero_and_launch()  # later launches: compiled, and the ranks already met
    assert log == [*first, "launch"]


@pytest.mark.parametrize("case", ["one rank", "one process, every rank", "interpreter"])
def test_nobody_to_meet_launches_directly(monkeypatch: pytest.MonkeyPatch, case: str) -> None:
    import torch.distributed as dist

    log: list[str] = []
    monkeypatch.setattr(dist, "barrier", lambda *a, **k: log.append("barrier"))
    kw = {"one rank": dict(world=1), "one process, every rank": dict(world=2, shared=object()),
          "interpreter": dict(world=2, interpret=True)}[case]  # fmt: skip
    bare_runtime(log, **kw)._zero_and_launch()
    assert log == ["launch"]


def test_entry_barrier_hint_does_not_blame_a_missing_signal() -> None:
    for slot in (-1, 0, 3):  # -1: node peers' start flags; >= 0: a remote peer's start word
        task = -1 if slot == -1 else -3
        hint = _watchdog_hint(task, slot)
        assert "did not start this launch" in hint and "signal is missing" not in hint
    # a full FIFO while pushing a start SIGNAL, and a task's wait: the general hint
    for task, slot in ((-3, -2), (7, 2), (-2, 0)):
        hint = _watchdog_hint(task, slot)
        assert "signal is missing" in hint and "peer" in hint


@pytest.mark.multi_gpu(2)
def test_a_peer_held_past_the_watchdog_before_its_first_launch() -> None:
    import gpu_skew_worker
    import rank_reports
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = random.randint(20000, 40000)
    # rank 1 reaches its first launch 4 s after rank 0, whose watchdog is 2 s
    procs = [ctx.Process(target=gpu_skew_worker.skewed_first_launch,
                         args=(r, 2, port, 4.0, 2.0, queue)) for r in range(2)]  # fmt: skip
    for p in procs:
        p.start()
    results = rank_reports.collect(queue, procs, timeout=300)
    failed = rank_reports.failures(results)
    assert not failed, failed
    for rank, err, _ in results:
        assert err < 1e-2, (rank, err)  # test_megakernel_gpu.TOL
