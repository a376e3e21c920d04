"""The Llama layer's megakernel compiled for an H200 (sm_90) on the CPU, with the gated units
fused (mg.compile glu=True) and without: registers, spills, ptxas's warnings and the SASS of
each GEMM path, side by side. No GPU: the layer is traced and scheduled here, rank 0's runtime
tables are built the interpreter's way with one program per worker (tests/test_gpu_compile.py's
``gpu_args``) and the kernel goes through Triton's stages to a cubin.

Run it under the GPU's Triton (3.6) to see what the GPU runs::

    PYTHONPATH=/tmp/t36 python benchmarks/glu_sass.py --out /tmp/glu_sass

Each variant writes ``<out>/<name>.{ttgir,ptx,sass,ptxas.log}`` and one summary line; a small
layer (``--small``) compiles the same code paths in less time (the sizes only change integer
arguments' divisibility specialisations, not the constexprs).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tests"))


def layer_schedule(glu: bool, small: bool):
    """rank 0's schedule of the traced layer (bench_layer's model and plan), on one GPU."""
    import bench_layer as bl

    import mgraph as mg

    sizes = (dict(hidden=1024, heads=8, kv_heads=2, ffn=3584, seq=1024, batch=1) if small
             else dict(hidden=4096, heads=32, kv_heads=8, ffn=14336, seq=4096, batch=1))
    args = argparse.Namespace(**sizes, dtype=torch.bfloat16)
    layer = bl.build_layer(args, torch.device("cpu"))
    x = torch.randn(args.batch, args.seq, args.hidden, dtype=args.dtype)
    prog = mg.compile(layer, (x,), plan=bl.mgraph_plan(), glu=glu, topology="1x1",
                      backend="triton")
    return prog.schedule


def kernel_and_args(schedule):
    """(the JITFunction rank 0 launches, its kernel arguments as on a GPU)."""
    import mgraph.runtime.megakernel.runtime as megaruntime

    rt = megaruntime.TritonRuntime(schedule, rank=0, interpret=True, interpret_roles=True,
                                   shared=megaruntime._SharedMemory(schedule.graph,
                                                                    torch.device("cpu")))
    try:
        rt.interpret, rt.trace_enabled = False, False
        args = rt._kernel_args()
        fn = rt._kernel
    finally:
        rt.close()
    return fn, args


def compile_cubin(fn, args: dict):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    target = GPUTarget("cuda", 90, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, launch_opts = binder(**args)
    _options, signature, constexprs, attrs = fn._pack_args(
        backend, launch_opts, bound, specialization, launch_opts)
    return triton.compile(ASTSource(fn, signature, constexprs, attrs), target=target,
                          options={"num_warps": args["num_warps"],
                                   "num_stages": args["num_stages"]})


def summary(compiled, out: Path, name: str) -> dict:
    import triton.backends.nvidia as nvidia

    bin_dir = Path(nvidia.__file__).parent / "bin"
    cubin = out / f"{name}.cubin"
    cubin.write_bytes(compiled.asm["cubin"])
    sass = subprocess.run([str(bin_dir / "cuobjdump"), "-sass", str(cubin)],
                          capture_output=True, text=True, check=True).stdout
    (out / f"{name}.sass").write_text(sass)
    (out / f"{name}.ttgir").write_text(compiled.asm["ttgir"])
    (out / f"{name}.ptx").write_text(compiled.asm["ptx"])
    ttgir = compiled.asm["ttgir"]

    def count(op: str) -> int:
        return len(re.findall(rf"\b{re.escape(op)}\b", sass))

    return dict(
        name=name,
        regs=compiled.metadata.num_regs if hasattr(compiled.metadata, "num_regs") else None,
        spills=getattr(compiled.metadata, "num_spills", None),
        shared=compiled.metadata.shared,
        HGMMA=count("HGMMA"), DEPBAR=sass.count("WARPGROUP.DEPBAR"), LDL=count("LDL"),
        STL=count("STL"), instructions=len(re.findall(r"/\*[0-9a-f]{4,}\*/", sass)),
        convert_layout=ttgir.count("ttg.convert_layout"),
        local_alloc=ttgir.count("ttg.local_alloc"),
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="/tmp/glu_sass")
    p.add_argument("--small", action="store_true")
    p.add_argument("--only", choices=["glu", "plain"])
    a = p.parse_args()
    os.environ.setdefault("TRITON_DUMP_PTXAS_LOG", "1")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    import triton

    print(f"triton {triton.__version__}", flush=True)
    for glu in (False, True):
        name = ("glu" if glu else "plain") + ("-small" if a.small else "")
        if a.only and a.only != ("glu" if glu else "plain"):
            continue
        t0 = time.perf_counter()
        fn, args = kernel_and_args(layer_schedule(glu, a.small))
        t1 = time.perf_counter()
        compiled = compile_cubin(fn, args)
        row = summary(compiled, out, name)
        row.update(trace_s=round(t1 - t0, 1), compile_s=round(time.perf_counter() - t1, 1),
                   GLU=bool(args.get("GLU")), BM=args["BM"], BN=args["BN"])
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
