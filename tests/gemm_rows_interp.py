"""Runs under TRITON_INTERPRET=1 in a subprocess (see test_gemm_rows.py): GEMMs whose operands'
rows are not whole 16-byte units, which TMA cannot address, in the interpreted megakernel
The GEMM body runs them by masked pointers (mgraph/ops/gemm_pointers.py). Float32 cases (exact
to rounding): rows of 2, 30, 50 and 270 elements are 8, 120, 200 and 1080 bytes, as a bf16
router's of 4 or 60 experts and odd widths'. bf16 cases (the interpreter's bf16 dot is by value
since runtime/megakernel/interp_fixes.py): a router of 4 experts, 60 columns, a MoE block of 4
experts against float32 eager. Most tasks here read A in 16-byte vectors (the transposed block
shape); rows of 50 (K), 18-column K ranges and gemm_glu tasks take the 2-byte shape.

Prints one JSON line per case: the relative error over the whole output and the worst tile's
(every tile of the op's tile shape, the short edge tiles included), how many GEMM tasks run by
pointers and through TMA, whether the kernel compiled the pointer path, and how many tasks the
static (TMA) prefix ran."""

from __future__ import annotations

import json
import os

assert os.environ.get("TRITON_INTERPRET") == "1", "set TRITON_INTERPRET=1 before importing triton"

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

import mgraph as mg  # noqa: E402
from mgraph.ops.abi import Q_STATIC  # noqa: E402
from mgraph.runtime.megakernel import TritonRuntime  # noqa: E402
from mgraph.runtime.megakernel.dispatch import body_constexprs  # noqa: E402
from mgraph.runtime.megakernel.encode import (  # noqa: E402
    GEMM_KINDS,
    ROLE_ALL,
    gemm_a_vectors,
    gemm_by_pointers,
)
from mgraph.runtime.megakernel.runtime import _SharedMemory  # noqa: E402
from mgraph.runtime.memory import worst_tile_error  # noqa: E402

F32 = torch.float32


def tile_error(got: torch.Tensor, want: torch.Tensor, rows: int, cols: int) -> float:
    """The worst relative error of any rows x cols tile, short edge tiles included."""
    return worst_tile_error(got, want, rows, cols)


def paths(graph) -> dict:
    gemms = [t for t in graph.tasks if t.kind in GEMM_KINDS]
    by_pointers = sum(gemm_by_pointers(graph, t) for t in gemms)
    vectors = sum(gemm_by_pointers(graph, t) and gemm_a_vectors(graph, t) for t in gemms)
    return {"pointer_tasks": by_pointers, "tma_tasks": len(gemms) - by_pointers,
            "vector_tasks": vectors,
            "gemm_ptr": body_constexprs(graph, range(len(graph.tasks)))["GEMM_PTR"]}


def report(case: str, got, want, tile, graph, static: int, **extra: float) -> None:
    err = ((got.double() - want.double()).norm() / want.double().norm()).item()
    print(json.dumps({"case": case, "error": err, "tile_error": tile_error(got, want, *tile),
                      "finite": bool(got.isfinite().all()), "static": static,
                      "dtype": graph.dtype, **paths(graph), **extra}), flush=True)


BF16 = torch.bfloat16
OPS = {
    # B's and out's rows of 50 (200 bytes); 18-column edge tiles
    "gemm-n50": ("gemm", "1x1", dict(M=64, N=50, K=64, tile=[32, 32])),
    # a 2-expert router (8-byte rows, as bf16's 4 experts), 40 tokens: a short row tile
    "gemm-n2": ("gemm", "1x1", dict(M=40, N=2, K=64, tile=[32, 256])),
    # A's rows of 50 (K): the K range ends inside a pointer block
    "gemm-n30-k50": ("gemm", "1x1", dict(M=48, N=30, K=50, tile=[32, 16])),
    # regions larger than the kernel's block (256 x 512 tiles, 128 x 256 blocks), short edges
    "gemm-multiblock-n270": ("gemm", "1x1", dict(M=160, N=270, K=72, tile=[256, 512])),
    # gemm_glu by pointers (A's rows of 50): the gate and up columns of each packed block
    "matmul_glu-k50": ("matmul_glu", "1x1", dict(M=64, N=256, K=50, tile=[64, 128])),
    # reduce-adds into rows of 50 on two ranks (the pointer path's adds), short tiles
    "gemm_allreduce-1x2-accumulate-n50": (
        "gemm_allreduce", "1x2", dict(M=48, N=50, K=64, tile=[32, 32], algorithm="accumulate")),
    # bf16: a router of 4 experts (8-byte rows), Qwen1.5-MoE's 60 (120-byte rows)
    "gemm-bf16-n4": ("gemm", "1x1", dict(M=40, N=4, K=64, tile=[32, 256], dtype=BF16)),
    "gemm-bf16-n60": ("gemm", "1x1", dict(M=64, N=60, K=96, tile=[32, 32], dtype=BF16)),
    # A's rows in vectors, one 200-row task: a full and a short block of 128 rows (the vector
    # shape's), K steps of 128, 128 and 64
    "gemm-bf16-n4-k320": ("gemm", "1x1", dict(M=200, N=4, K=320, tile=[256, 256], dtype=BF16)),
    # A's pitch (36 floats) whole 16-byte units but each rank's K range (18) not: 2-byte loads
    "gemm_allreduce-1x2-accumulate-n50-k36": (
        "gemm_allreduce", "1x2", dict(M=48, N=50, K=36, tile=[32, 32], algorithm="accumulate")),
}


def op_case(case: str) -> None:
    name, topology, kw = OPS[case]
    kw = dict(kw)
    dtype = kw.pop("dtype", F32)
    op = mg.ops.get_op(name)
    graph = op(topology=topology, dtype=dtype, **kw)
    sched = mg.schedule(graph)
    rank = 0 if topology == "1x1" else None
    shared = None if rank == 0 else _SharedMemory(graph, torch.device("cpu"))
    rt = TritonRuntime(sched, rank=rank, interpret=True, shared=shared)
    try:
        errors = []
        # reduce-adds: a second launch adds into outputs zeroed again
        for launch in range(2 if kw.get("algorithm") == "accumulate" else 1):
            inputs = op.random_inputs(graph, seed=launch)
            got = rt.run(inputs).outputs["out"]
            want = op.run_reference({k: v.double() for k, v in inputs.items()},
                                    graph.params)["out"]
            errors.append((got, want))
        static = int(rt.tables.qinfo[ROLE_ALL][Q_STATIC])
    finally:
        rt.close()
    got, want = max(errors, key=lambda gw: (gw[0].double() - gw[1]).norm().item())
    report(case, got, want, kw["tile"], graph, static)


class Mlp(nn.Module):
    """An aligned Linear (TMA, the static prefix), then odd widths: Linear(64, 50) with a bias,
    GELU, Linear(50, 30) (A's rows of 50, B's and out's of 30)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(64, 64, bias=False)
        self.b = nn.Linear(64, 50)
        self.c = nn.Linear(50, 30, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.nn.functional.gelu(self.b(self.a(x))))


def traced_linears() -> None:
    torch.manual_seed(0)
    model = Mlp().eval()
    x = torch.randn(2, 20, 64)
    prog = mg.compile(model, (x,), backend="triton", backend_options={"interpret": True})
    with torch.no_grad():
        want = model(x)
    got = prog(x)
    static = int(prog._runtime.tables.qinfo[ROLE_ALL][Q_STATIC])
    report("traced-linears", got, want, (32, 32), prog.graph, static)


def traced_moe() -> None:
    """A MoE block of 6 experts under ExpertParallel: its router Linear(64, 6) writes logits in
    rows of 24 bytes (a bf16 router of 4 or 12 experts has rows of 8 or 24), then the route,
    expert and combine bodies."""
    from test_trace_moe import StackedMoeBlock

    torch.manual_seed(0)
    model = StackedMoeBlock(hidden=64, ffn=32, experts=6, top_k=2).eval()
    x = torch.randn(2, 16, 64)
    prog = mg.compile(model, (x,), plan={"": mg.ExpertParallel(router="gate")},
                      backend="triton", backend_options={"interpret": True})
    with torch.no_grad():
        want = model(x)
    got = prog(x)
    static = int(prog._runtime.tables.qinfo[ROLE_ALL][Q_STATIC])
    report("traced-moe-e6", got, want, (32, 32), prog.graph, static)


def traced_moe_bf16() -> None:
    """The MoE block in bf16 with 4 experts (router rows of 8 bytes), against float32 eager on
    the same bf16 weights and input; ``eager`` is eager bf16's own error there."""
    import copy

    from test_trace_moe import StackedMoeBlock

    torch.manual_seed(0)
    model = StackedMoeBlock(hidden=64, ffn=32, experts=4, top_k=2).to(BF16).eval()
    exact = copy.deepcopy(model).float()
    x = torch.randn(2, 16, 64, dtype=BF16)
    prog = mg.compile(model, (x,), plan={"": mg.ExpertParallel(router="gate")},
                      backend="triton", backend_options={"interpret": True})
    with torch.no_grad():
        want, eager = exact(x.float()), model(x).float()
    got = prog(x).float()
    static = int(prog._runtime.tables.qinfo[ROLE_ALL][Q_STATIC])
    report("traced-moe-bf16-e4", got, want, (32, 32), prog.graph, static,
           eager=((eager - want).norm() / want.norm()).item(),
           eager_tile=tile_error(eager, want, 32, 32))


CASES = {"traced-linears": traced_linears, "traced-moe-e6": traced_moe,
         "traced-moe-bf16-e4": traced_moe_bf16}


if __name__ == "__main__":
    import sys

    for name in sys.argv[1:]:
        CASES[name]() if name in CASES else op_case(name)
