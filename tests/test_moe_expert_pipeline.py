"""The MoE expert body's K loops keep as many loads in flight as the megakernel's GEMM segment,
and its 128-row tile as much work (sm_90, ahead of time on the CPU: the body alone, compiled to
TTGIR, where Triton's pipeliner has laid out each loop's ring of shared-memory stages).

Why (v11, benchmarks/results/v11/bench_moe.json, 2 H200): moe_expert ran at 2.0-2.3 TF/s per
program where the megakernel's GEMM segment reaches 5.0 (bench_layer's gemm row). Compiled for
sm_90 (Triton 3.6, ptxas 12.8) both loops had the same skeleton per K step: TMA loads 2 steps
ahead (3 stages), mbarrier waits, wgmma with one WARPGROUP.DEPBAR (not serialised), no spill, 4
CTA barriers. What differed was the work per step: the GEMM's 128 x 256 x 64 tile (4.2 MFLOP,
48 KB loaded) against the expert's 2.1 MFLOP steps (128 x 64 gate and up for 32 KB, 128 x 128
down; or 64 x 128 and 64 x 256 for 40 KB), so at the same depth and latency a program had half
the work and 2/3 to 5/6 of the bytes in flight. The test pins what replaced them: every bf16 K
loop has at least the GEMM's 2 x 48 KB of loads in flight ((stages - 1) x one slot of each
ring), the 128-row tile's step is the GEMM's, and the pair tile (128 + 64 rows against one
block of weights, so 129-192 rows stream the weights once) steps 3/4 of it for 40 KB."""

from __future__ import annotations

import re

import pytest

triton = pytest.importorskip("triton")
pytest.importorskip("triton.backends.nvidia")

import triton.language as tl  # noqa: E402

from mgraph.ops import moe_bodies  # noqa: E402

# the GEMM segment's step (runtime/megakernel/kernel.py at block-sp's BM, BN, BK) and depth
GEMM_STEP_FLOP = 2 * 128 * 256 * 64
GEMM_STEP_BYTES = (128 * 64 + 64 * 256) * 2
GEMM_STAGES = 3


@triton.jit
def _expert_kernel(tp, params, regions, bufaddr, bufcols, DT: tl.constexpr):
    moe_bodies.expert_tile(tp, params, regions, bufaddr, bufcols, DT, True)


def _ttgir(dtype: tl.dtype) -> str:
    """The expert body alone as a kernel (the megakernel's table pointers, 8 warps and 3 stages
    as runtime.py launches it) through Triton's front end and TTGIR passes for cuda:90."""
    from triton._C.libtriton import ir
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend

    signature = {"tp": "*i32", "params": "*i32", "regions": "*i32", "bufaddr": "*i64",
                 "bufcols": "*i64", "DT": "constexpr"}  # fmt: skip
    src = ASTSource(_expert_kernel, signature, constexprs={"DT": dtype})
    target = GPUTarget("cuda", 90, 32)
    backend = make_backend(target)
    options = backend.parse_options({"num_warps": 8, "num_stages": 3})
    stages: dict = {}
    backend.add_stages(stages, options, src.language)
    context = ir.context()
    ir.load_dialects(context)
    backend.load_dialects(context)
    module = src.make_ir(target, options, backend.get_codegen_implementation(options),
                         backend.get_module_map(), context)  # fmt: skip
    metadata: dict = {}
    for stage in ("ttir", "ttgir"):
        module = stages[stage](module, metadata)
    return str(module)


_RING = re.compile(r"ttg\.local_alloc\s*:\s*\(\)\s*->\s*!ttg\.memdesc<(\d+)x(\d+)x(\d+)x(bf16|f32)")
_BYTES = {"bf16": 2, "f32": 4}
_DOT = re.compile(r"ttng\.warp_group_dot .*?-> tensor<(\d+)x(\d+)xf32")
_A = re.compile(r"ttng\.warp_group_dot \S+, \S+, \S+ .*?: !ttg\.memdesc<(\d+)x(\d+)x")


def k_loops(text: str) -> list[dict]:
    """Per innermost loop holding wgmma: its stages (the leading dim of the shared-memory rings
    allocated just before it), the bytes its loads bring per step (one slot of each ring) and
    its dots' work per step (2 * M * N * K each)."""
    lines = text.splitlines()
    loops, ring = [], []
    for i, line in enumerate(lines):
        m = _RING.search(line)
        if m:
            ring.append((int(m.group(1)), int(m.group(2)) * int(m.group(3)) * _BYTES[m.group(4)]))
        if "scf.for" not in line:
            continue
        indent = len(line) - len(line.lstrip())
        body = []
        for inner in lines[i + 1 :]:
            if len(inner) - len(inner.lstrip()) <= indent:
                break
            body.append(inner)
        if any("scf.for" in b for b in body) or not any("warp_group_dot " in b for b in body):
            ring = [] if any("scf.for" in b for b in body) else ring
            continue
        flop = 0
        for b in body:
            d, a = _DOT.search(b), _A.search(b)
            if d and a:
                flop += 2 * int(d.group(1)) * int(d.group(2)) * int(a.group(2))
        loops.append({"stages": min(r[0] for r in ring) if ring else 1,
                      "step_bytes": sum(r[1] for r in ring), "step_flop": flop})  # fmt: skip
        ring = []
    return loops


def test_expert_k_loops_keep_the_gemm_segments_work_in_flight():
    loops = k_loops(_ttgir(tl.bfloat16))
    # pass 1 (gate and up) and pass 2 (down) of the pair, 128- and 64-row tiles
    assert len(loops) == 6, loops
    for loop in loops:
        assert loop["stages"] >= 3 and loop["step_flop"] > 0, loops
        # loads in flight: at least the GEMM's 2 x 48 KB
        in_flight = (loop["stages"] - 1) * loop["step_bytes"]
        assert in_flight >= (GEMM_STAGES - 1) * GEMM_STEP_BYTES, loops
    # the 128-row tile does the GEMM's step itself (4.2 MFLOP for 48 KB, so also its work in
    # flight); the 64-row one (at most 64 filled rows, bound by its weights' bytes) does half
    # of it for 40 KB and keeps one step more in flight; the pair tile 3/4 of it for 40 KB, 4
    # stages (its work in flight 3 x 3.1 MFLOP, more than the GEMM's 2 x 4.2)
    assert sorted((r["stages"], r["step_flop"], r["step_bytes"]) for r in loops) == sorted(
        [(3, GEMM_STEP_FLOP, GEMM_STEP_BYTES)] * 2
        + [(4, GEMM_STEP_FLOP // 2, 40 * 1024)] * 2
        + [(4, GEMM_STEP_FLOP * 3 // 4, 40 * 1024)] * 2
    ), loops
