"""bf16 GEMMs in the megakernel under Triton's interpreter (this file as a TRITON_INTERPRET=1
subprocess): the whole output and every task's tile against float32 torch.

Triton 3.9's interpreter multiplies the raw bits of bf16 ``tl.dot`` operands (relative error
~1e10; runtime/megakernel/interp_fixes.py, benchmarks/interp_bf16_repro.py); TritonRuntime
applies interp_fixes.fix_interpreter when it interprets. The cases take each GEMM path of the
kernel: the static prefix (kernel.py's persistent loop), the dynamic body (tiles.gemm_tile:
tasks larger than the kernel's block, block by block, a K tail that is not a multiple of BK),
its gemm_glu epilogue (matmul_glu), and a 2-rank gemm_allreduce (reduce-adds of bf16 partial
products). The MoE expert GEMM's bf16 paths are tests/test_moe_fast_paths.py's.

The interpreter rounds float32 to bf16 toward zero (the GPU to nearest): an element may be off
by up to one bf16 step, 2^-7 of its value.
"""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

from helpers import interpreter_rows

# name: (op, topology, dims, the GEMM path: "static" (every GEMM in the prefix) or "dynamic")
CASES = {
    # the reported case: one 128 x 128 tile, the prefix
    "gemm-128": ("gemm", "1x1", dict(M=128, N=128, K=128), "static"),
    "gemm-tiles": ("gemm", "1x1", dict(M=128, N=192, K=128, tile=[64, 64]), "static"),
    # one 160 x 320 task: 2 x 2 blocks of at most 128 x 256 (short edges), K = 64 + a tail of 8
    "gemm-blocks": ("gemm", "1x1", dict(M=160, N=320, K=72, tile=[256, 512]), "dynamic"),
    "matmul_glu": ("matmul_glu", "1x1", dict(M=96, N=256, K=72, tile=[64, 128]), "dynamic"),
    "gemm_allreduce-1x2": ("gemm_allreduce", "1x2", dict(M=64, N=64, K=128, tile=[32, 32]),
                           "static"),
}
GEMM_KINDS = ("gemm", "gemm_glu")
STEP = 2.0**-7  # one bf16 step relative to the value (8 significant bits)


@pytest.fixture(scope="module")
def rows() -> dict[str, dict]:
    pytest.importorskip("triton")
    return interpreter_rows("test_bf16_gemm_interp.py")


@pytest.mark.parametrize("case", list(CASES))
def test_bf16_gemm_in_the_megakernel_matches_float32(rows, case):
    r = rows[case]
    assert not r["nan"], r
    assert r["error"] < 1e-2, r  # ~1e10 without interp_fixes
    assert r["tile_error"] < 1e-2, r
    # every element within one bf16 step of its float32 value (plus float32 sums' order); on
    # 2 ranks, one step of each partial product too (each is rounded before the reduce-add)
    assert r["worst_step"] <= 1.0, r
    assert r["tiles"] == r["gemm_tasks"] > 0, r
    path = CASES[case][3]
    assert r["static"] == (r["gemm_tasks"] if path == "static" else 0), r


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).norm() / want.norm()).item()


def _case(name: str, op_name: str, topology: str, dims: dict) -> dict:
    import mgraph as mg
    from mgraph.kinds import ROLES
    from mgraph.ops.abi import Q_STATIC
    from mgraph.runtime.megakernel import TritonRuntime
    from mgraph.runtime.megakernel.runtime import _SharedMemory

    op = mg.ops.get_op(op_name)
    graph = op(topology=topology, dtype=torch.bfloat16, **dims)
    inputs = op.random_inputs(graph, seed=len(name))
    want = op.run_reference({k: v.float() for k, v in inputs.items()}, graph.params)["out"]
    sched = mg.schedule(graph)
    shared = _SharedMemory(graph, torch.device("cpu")) if graph.topology.world_size > 1 else None
    rt = TritonRuntime(sched, rank=None, interpret=True, shared=shared)
    try:
        got = rt.run(inputs).outputs["out"].float()
        static = int(rt.tables.qinfo[len(ROLES)][Q_STATIC])
    finally:
        rt.close()
    gemms = [t for t in graph.tasks if t.kind in GEMM_KINDS]
    # each GEMM task's tile of the output: 1x1 tasks write it; a gemm_allreduce task writes its
    # rank's partial product over the same rows and columns of the output
    tiles = [(w.row0, w.row1, w.col0, w.col1) for w in (t.writes[0] for t in gemms)]
    # a bf16 rounding of each rank's partial product (K shards), then of their sum
    world = graph.topology.world_size
    mag = want.abs()
    if world > 1:
        a, b = inputs["a"].float(), inputs["b"].float()
        for part in zip(a.chunk(world, dim=1), b.chunk(world, dim=0), strict=True):
            mag += (part[0] @ part[1]).abs()
    step = (got - want).abs() / (STEP * mag + 1e-5 * want.abs().max().item())
    return {
        "case": name,
        "error": _rel(got, want),
        "tile_error": max(_rel(got[r0:r1, c0:c1], want[r0:r1, c0:c1]) for r0, r1, c0, c1 in tiles),
        "worst_step": step.max().item(),
        "nan": bool(got.isnan().any()),
        "tiles": len(tiles),
        "gemm_tasks": len(gemms),
        "static": static,
    }


def _interp_main() -> None:
    for name, (op_name, topology, dims, _path) in CASES.items():
        print(json.dumps(_case(name, op_name, topology, dims)), flush=True)


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1", "set TRITON_INTERPRET=1 before triton"
    torch.set_num_threads(1)
    sys.exit(_interp_main())
