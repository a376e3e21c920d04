"""Settings(adaptive=True) on the megakernel is refused, before anything launches, where compute
tasks wait for NVLink tasks (AG+GEMM): such runs did not finish on 2 H200 (NOTES v9)."""

from __future__ import annotations

import pytest
import torch

import mgraph as mg
from mgraph.errors import ScheduleError
from mgraph.settings import Settings

pytest.importorskip("triton")


def _runtime(graph, adaptive: bool):
    from mgraph.runtime.megakernel.runtime import TritonRuntime, _SharedMemory

    shared = _SharedMemory(graph, torch.device("cpu"))
    return TritonRuntime(mg.schedule(graph), rank=0, interpret=True, interpret_roles=True,
                         shared=shared, settings=Settings(adaptive=adaptive))


def test_adaptive_refused_where_gemm_tiles_wait_for_nvlink_copies():
    g = mg.ops.allgather_gemm(M=256, N=512, K=64, topology="1x2", dtype=torch.float32, tile=[64, 64])
    with pytest.raises(ScheduleError, match="adaptive=True.*wait for NVLink tasks"):
        _runtime(g, adaptive=True)
    rt = _runtime(g, adaptive=False)  # the static split builds
    assert not rt.adaptive


def test_adaptive_allowed_without_nvlink_waits():
    g = mg.ops.gemm_allreduce(M=128, N=128, K=128, topology="1x2", dtype=torch.float32)
    assert _runtime(g, adaptive=True).adaptive
