"""One compiled megakernel serves a model at power-of-two sequence lengths and any batch size:
the traced layer at four such input shapes gives the same kernel (Triton's cache key of the
function and what it calls, its constexprs and its argument specialisation: what Triton keys a
compiled kernel by), so a process that built it once (82-89 s on the H200 machines for the
Llama layer, benchmarks/NOTES.md v17), or a later one through Triton's disk cache, does not
build it again for those shapes. Other lengths may need their own: at 384 or 640 tokens the
RoPE's head split is a relayout of its own and the pointwise chains' generated code follows
their tiles' shape (ops/elementwise_special.py), so each is a new kernel. Checked on the CPU
through the sm_90 backend's own argument binder, as tests/test_gpu_compile.py does."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")
pytest.importorskip("triton.backends.nvidia")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_layer as bl  # noqa: E402
from glu_sass import kernel_and_args  # noqa: E402

import mgraph as mg  # noqa: E402


def kernel_key(seq: int, batch: int):
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    args = argparse.Namespace(hidden=256, heads=4, kv_heads=2, ffn=512, seq=seq, batch=batch,
                              dtype=torch.bfloat16)
    torch.manual_seed(0)
    layer = bl.build_layer(args, torch.device("cpu"))
    x = torch.randn(batch, seq, args.hidden, dtype=args.dtype)
    prog = mg.compile(layer, (x,), plan=bl.mgraph_plan(), topology="1x1", backend="triton")
    fn, kargs = kernel_and_args(prog.schedule)
    bound, specialization, _ = create_function_from_signature(
        fn.signature, fn.params, make_backend(GPUTarget("cuda", 90, 32))
    )(**kargs)
    constexprs = {p.name: kargs[p.name] for p in fn.params if p.is_constexpr}
    return fn.cache_key, constexprs, specialization, len(prog.graph.tasks)


def test_one_kernel_for_every_shape_of_a_layer():
    keys = {shape: kernel_key(*shape) for shape in [(512, 1), (256, 2), (1024, 1), (512, 2)]}
    tasks = {shape: key[3] for shape, key in keys.items()}
    assert len(set(tasks.values())) > 1, tasks  # the graphs do differ
    first = next(iter(keys.values()))[:3]
    for shape, key in keys.items():
        assert key[:3] == first, shape
