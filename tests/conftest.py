"""Suite-wide settings. Tile bodies on the CPU are tiny matmuls: torch's intra-op threads only
contend with the runtime's worker threads on CI's two cores, so the suite runs single-threaded."""

from __future__ import annotations

import torch

torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    """`gpu` tests need CUDA; `multi_gpu(n)` tests need n GPUs. Both skip cleanly elsewhere."""
    import pytest

    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for item in items:
        if item.get_closest_marker("gpu") and have < 1:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
        marker = item.get_closest_marker("multi_gpu")
        if marker is not None:
            need = marker.args[0] if marker.args else 2
            if have < need:
                item.add_marker(pytest.mark.skip(reason=f"needs {need} CUDA GPUs, found {have}"))
