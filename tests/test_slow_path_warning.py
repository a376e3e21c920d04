"""backend="triton" says when GEMM tasks take the masked-pointer path (rows TMA cannot address:
correct, 9-24x slower a task on an H200, NOTES v19): one SlowPathWarning per runtime naming the
op, a task and the narrow buffers, and how to avoid it; aligned graphs stay silent."""

from __future__ import annotations

import warnings

import pytest
import torch

import mgraph as mg
from mgraph.runtime.megakernel import TritonRuntime

pytest.importorskip("triton")


def runtime_warnings(graph: mg.TaskGraph) -> list[warnings.WarningMessage]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        TritonRuntime(mg.schedule(graph), interpret=True).close()
    return [w for w in caught if issubclass(w.category, mg.SlowPathWarning)]


def test_a_gemm_with_narrow_rows_warns_once_and_names_the_buffer():
    graph = mg.ops.gemm(M=256, N=50, K=128, topology="1x1", dtype=torch.float32)  # 200-byte rows
    caught = runtime_warnings(graph)
    assert len(caught) == 1
    text = str(caught[0].message)
    assert "2 GEMM task(s)" in text and "b@0 (50 columns)" in text and "multiple of 8" in text
    assert "out@0" not in text  # plain writes are stored through pointers on either path


@pytest.mark.parametrize("n, dtype", [(64, torch.bfloat16), (60, torch.float32)])
def test_aligned_gemms_are_silent(n, dtype):
    graph = mg.ops.gemm(M=256, N=n, K=128, topology="1x1", dtype=dtype)  # 128- and 240-byte rows
    assert runtime_warnings(graph) == []
