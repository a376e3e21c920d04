"""A sweep over the NVLink workers and chunk sizes at one shape reuses one compiled megakernel.

bench_tp's sweeps rebuilt the kernel at every NVLink-worker point: the compute program count
(the GEMM prefix's stride) was a constexpr. It is a runtime integer that Triton does not
specialise (kernel.megakernel's ``do_not_specialize``), and so is the start-flag address, whose
16-byte alignment followed the event count (so the chunk size). This checks the key Triton looks
its compiled kernels up by (the arguments' specialisation and the constexprs, as its launcher
computes them for cuda:90) is one key over AG+GEMM's grid of splits and chunks.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from test_adaptive_uniform import gpu_launch_args  # noqa: E402

import mgraph as mg  # noqa: E402


def launch_key(fn, args: dict) -> str:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    backend = make_backend(GPUTarget("cuda", 90, 32))
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    _bound, specialization, options = binder(**args)
    return repr((specialization, options))


def test_nvlink_worker_sweep_compiles_one_kernel():
    keys, seg_p = {}, set()
    for chunk in (128 * 256 * 2, 4 * 128 * 256 * 2):
        g = mg.ops.allgather_gemm(
            M=2048, N=1024, K=256, topology="1x2", dtype=torch.bfloat16, chunk_bytes=chunk
        )
        for nvlink in (4, 8, 16, 24, 32):
            fn, args = gpu_launch_args(g, {"compute": 132 - nvlink, "nvlink": nvlink})
            seg_p.add(args["seg_p"])
            keys.setdefault((id(fn), launch_key(fn, args)), []).append((chunk, nvlink))
    assert seg_p == {128, 124, 116, 108, 100}  # the split did change
    assert len(keys) == 1, list(keys.values())
