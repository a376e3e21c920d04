"""Suite-wide settings. Tile bodies on the CPU are tiny matmuls: torch's intra-op threads only
contend with the runtime's worker threads on CI's two cores, so each test process runs torch on one
thread (the README's command runs two such processes, pytest-xdist's workers)."""

from __future__ import annotations

import os
from collections import Counter

import pytest
import torch

torch.set_num_threads(1)


# -- the fake CUDA libraries (tests/fake_cuda) of the native proxy's tests --------------------
@pytest.fixture(scope="module")
def fake_lib(tmp_path_factory: pytest.TempPathFactory):
    """The fake CUDA runtime and driver, built once per test module (needs gcc: the modules
    that use it skip themselves without it)."""
    import fake_cuda

    return fake_cuda.build(tmp_path_factory.mktemp("fake_cuda"))


@pytest.fixture
def fake(fake_lib):
    """``fake_lib`` reset before and after the test: a hold, a delay or a trace of one test
    never reaches the next, and no stream of a failed test stays stuck."""
    fake_lib.reset()
    yield fake_lib
    fake_lib.reset()


def pytest_collection_modifyitems(config, items):
    """`gpu` tests need CUDA; `multi_gpu(n)` tests need n GPUs. Both skip cleanly elsewhere.

    Files that hold `slow` tests run first, the most such tests first, each file's tests still
    together and in their own order. Run in parallel by pytest-xdist with ``--dist loadfile``, the longest files are then
    handed out before the short ones, so no worker starts a minute-long file while the other
    has nothing left; run serially, only the order changes. The order is the same in every
    process, as xdist requires of its workers."""
    slow = Counter(item.path for item in items if item.get_closest_marker("slow"))
    items.sort(key=lambda item: -slow[item.path])  # stable: the order within a file is kept

    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    # MGRAPH_TEST_SHARE_GPU=1 runs multi_gpu tests with every rank on one GPU (gpu_workers.setup)
    share = have >= 1 and os.environ.get("MGRAPH_TEST_SHARE_GPU") == "1"
    for item in items:
        if item.get_closest_marker("gpu") and have < 1:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
        marker = item.get_closest_marker("multi_gpu")
        if marker is not None:
            need = marker.args[0] if marker.args else 2
            if have < need and not share:
                item.add_marker(pytest.mark.skip(reason=f"needs {need} CUDA GPUs, found {have}"))
