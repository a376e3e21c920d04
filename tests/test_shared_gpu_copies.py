"""Ranks sharing one GPU: a proxy's same-device copy needs an SM its own megakernel left free
(runtime/megakernel/shared_gpu.py). The model against what v20's one-H200 runs saw: the 2x1
GEMM+AR 4096x4096x2048 deadlocks with the default split of 132 SMs (every run timed out, one
rank at a rail-reduce, the other right after), the other emulated cases complete (they passed),
every case completes on two GPUs (copy engines), and one compute worker fewer runs the hung one.
"""

from __future__ import annotations

import pytest
import torch

import mgraph as mg
from mgraph.errors import ScheduleError
from mgraph.runtime.megakernel.shared_gpu import check_shared_gpu, starved

H200_SMS = 132
HUNG = ("gemm_allreduce", dict(M=4096, N=4096, K=2048))
PASSED = [
    ("gemm_allreduce", dict(M=1024, N=768, K=1024, tile=[128, 128])),
    ("allgather_gemm", dict(M=4096, N=4096, K=2048)),
    ("gemm_reduce_scatter", dict(M=4096, N=4096, K=2048)),
    ("gemm_allreduce", dict(M=1024, N=1024, K=1024)),
]


def _schedule(op_name: str, kw: dict, workers: dict | None = None):
    graph = mg.ops.get_op(op_name)(topology="2x1", dtype=torch.bfloat16, **kw)
    return mg.schedule(graph, workers=workers)


def test_hung_case_deadlocks_on_a_shared_gpu_only():
    s = _schedule(*HUNG)
    assert sum(s.ranks[0].workers.values()) == H200_SMS  # the split fills every SM
    stuck = starved(s, [0, 0])
    names = {s.graph.tasks[t].name.split(" ")[0] for _, t in stuck}
    assert {r for r, _ in stuck} == {0, 1}  # both ranks: neither proxy's sends ever run
    assert names == {"rail-reduce", "rail-gather"}
    with pytest.raises(ScheduleError, match="same-device copy.*rail-reduce") as err:
        check_shared_gpu(s, H200_SMS)
    assert "one compute worker fewer" in err.value.hint
    # Two GPUs: copy engines, copies never wait for an SM.
    assert starved(s, [10**9, 10**9]) == []


@pytest.mark.parametrize("op_name, kw", PASSED)
def test_cases_that_passed_on_a_shared_gpu_complete(op_name, kw):
    check_shared_gpu(_schedule(op_name, kw), H200_SMS)


def test_one_compute_worker_fewer_runs_the_hung_case():
    from gpu_workers import shared_gpu_workers

    s = _schedule(*HUNG)
    workers = shared_gpu_workers(s.graph)
    assert workers["compute"] == s.ranks[0].workers["compute"] - 1
    check_shared_gpu(_schedule(*HUNG, workers=workers), H200_SMS)
    assert shared_gpu_workers(mg.ops.get_op("gemm_allreduce")(topology="1x2", M=256, N=256, K=256)) is None


def test_kernel_net_refuses_the_hung_schedule_on_a_shared_gpu(monkeypatch):
    """KernelNet checks a GPU runtime whose peers are mapped through CUDA IPC (ranks sharing a
    GPU) before starting its proxy; peers on other GPUs (symmetric memory) are not checked."""
    from types import SimpleNamespace

    from mgraph.runtime.megakernel import net
    from mgraph.runtime.megakernel.ipc_share import IpcBuffers

    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device: SimpleNamespace(multi_processor_count=H200_SMS))
    shared = SimpleNamespace(arena_handle=object.__new__(IpcBuffers), schedule=_schedule(*HUNG),
                             device=torch.device("cuda", 0))
    with pytest.raises(ScheduleError, match="ranks share one GPU"):
        net._check_shared_gpu(shared)
    net._check_shared_gpu(SimpleNamespace(arena_handle=object(), schedule=shared.schedule,
                                          device=shared.device))


def test_kernel_net_refuses_the_hung_schedule_with_the_copy_kernel(monkeypatch):
    """The proxy's copy-and-flag kernel (MGRAPH_PROXY_COPY_KERNEL_BYTES) needs a free SM on
    separate GPUs too: the same schedule is refused there, and runs once an SM is left free."""
    from types import SimpleNamespace

    from gpu_workers import shared_gpu_workers
    from mgraph.runtime.megakernel import net

    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device: SimpleNamespace(multi_processor_count=H200_SMS))
    on = SimpleNamespace(proxy_copy_kernel_bytes=65536)
    rt = SimpleNamespace(arena_handle=object(), schedule=_schedule(*HUNG), settings=on,
                         device=torch.device("cuda", 0))
    with pytest.raises(ScheduleError, match="MGRAPH_PROXY_COPY_KERNEL_BYTES"):
        net._check_shared_gpu(rt)
    rt.settings = SimpleNamespace(proxy_copy_kernel_bytes=0)
    net._check_shared_gpu(rt)
    workers = shared_gpu_workers(rt.schedule.graph)
    net._check_shared_gpu(SimpleNamespace(arena_handle=object(), settings=on, device=rt.device,
                                          schedule=_schedule(*HUNG, workers=workers)))
