"""GEMMs whose operands' rows are not whole 16-byte units, on one GPU: what the GEMM body's
pointer path (mgraph/ops/gemm_pointers.py) costs, and what compiling it costs the TMA GEMMs that
share its kernel.

1. Pointer path against its aligned neighbour and cuBLAS. Per shape (M, N, K) with N or K not a
   multiple of 8 (a router of 4 or 60 experts, GPT-2's lm_head, K = 4095), a traced RMSNorm +
   Linear (the GEMM tasks wait for norm tiles, as a layer's do) at N (K) and at the next
   multiple of 8 (the TMA path), and cuBLAS (``x @ w.t()``) on both shapes: ms a call (median of
   ``--reps`` calls from an idle GPU) and the GEMM tasks' mean work time (one traced launch).
2. The kernel's other GEMMs. A layer ``y = big(h) * router(h).sum(-1)`` with h = RMSNorm(x),
   big a 4096 x 4096 Linear and router Linear(4096, E): E = 8 (rows of 16 bytes: the kernel has
   no pointer path, GEMM_PTR off) against E = 4 (by pointers: GEMM_PTR on). The big GEMM's tasks
   run the same TMA loop in both; their mean work time says what the compiled pointer path (a
   noinline call in the dispatch) costs them.

Rows go to ``<out>/bench_gemm_rows.json``, one line each is printed.

    python3 benchmarks/bench_gemm_rows.py --out $OUT          # H200, ~2 minutes
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_gemm_tasks import NormLinear, gemm_rows, timed  # noqa: E402

import mgraph as mg  # noqa: E402

# (name, M, N, K): N or K not a multiple of 8; the aligned neighbour rounds it up
SHAPES = [
    ("router-4", 8192, 4, 4096),
    ("router-60", 8192, 60, 4096),
    ("lm_head-gpt2", 2048, 50257, 768),
    ("k-4095", 4096, 4096, 4095),
]


def up8(n: int) -> int:
    return -(-n // 8) * 8


class RouterLayer(nn.Module):
    def __init__(self, hidden: int, experts: int) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(hidden, eps=1e-6)
        self.big = nn.Linear(hidden, hidden, bias=False)
        self.router = nn.Linear(hidden, experts, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        return self.big(h) * self.router(h).sum(-1, keepdim=True)


def mgraph_row(args, module: nn.Module, x: torch.Tensor, device, **fields) -> dict:
    from mgraph.runtime.megakernel.dispatch import body_constexprs

    with torch.no_grad():
        want = copy.deepcopy(module).float()(x.float())
    row = {"bench": "gemm_rows", "impl": "mgraph", **fields}
    try:
        prog = mg.compile(module, (x,), backend="triton")
        with torch.no_grad():
            got = prog(x).float()
        row["error"] = ((got - want).norm() / want.norm()).item()
        runtime = prog._runtime
        graph = prog.graph
        row["GEMM_PTR"] = body_constexprs(graph, range(len(graph.tasks)))["GEMM_PTR"]
        row["ms"], row["ms_back_to_back"] = timed(runtime.launch, args.reps, args.chain, device)
        row["gemm"] = gemm_rows(runtime)
        row["status"] = "ok" if row["error"] < args.tol else "FAIL (error)"
    except Exception as exc:  # noqa: BLE001 - one failed point is a row, not the end
        row["status"] = f"FAIL: {type(exc).__name__}: {str(exc)[:300]}"
    return row


def cublas_row(args, m: int, n: int, k: int, device, dtype, **fields) -> dict:
    x = torch.randn(m, k, device=device, dtype=dtype)
    w = torch.randn(n, k, device=device, dtype=dtype) / k**0.5
    ms, chained = timed(lambda: x @ w.t(), args.reps, args.chain, device)
    return {"bench": "gemm_rows", "impl": "cublas", "M": m, "N": n, "K": k, "ms": ms,
            "ms_back_to_back": chained, "status": "ok", **fields}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--chain", type=int, default=10)
    p.add_argument("--tol", type=float, default=2e-2)
    p.add_argument("--points", nargs="*", help="shape names (and layer-router) to run; all")
    p.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    args = p.parse_args(argv)
    os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")  # GPU.md: lazy loading can hang
    device, dtype = torch.device("cuda", 0), torch.bfloat16
    torch.cuda.set_device(device)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []

    def emit(row: dict) -> None:
        rows.append(row)
        gemm = "; ".join(f"{g['kind']}: {g['mean_work_us']} us/task x {g['tasks']}"
                         for g in row.get("gemm", []))
        print(f"{row.get('point', '')} {row['impl']} {row.get('M')}x{row.get('N')}x"
              f"{row.get('K')} GEMM_PTR={row.get('GEMM_PTR', '-')}: "
              f"{row.get('ms', float('nan')):.3f} ms {row['status'][:80]} | {gemm}", flush=True)
        (out / "bench_gemm_rows.json").write_text(json.dumps(rows, indent=1) + "\n")

    wanted = set(args.points or [name for name, *_ in SHAPES] + ["layer-router"])
    for name, m, n, k in SHAPES:
        if name not in wanted:
            continue
        for nn_, kk in ((n, k), (up8(n), up8(k))):
            fields = dict(point=name, M=m, N=nn_, K=kk, aligned=(nn_, kk) != (n, k))
            torch.manual_seed(0)
            x = torch.randn(m, kk, device=device, dtype=dtype)
            emit(cublas_row(args, m, nn_, kk, device, dtype, **fields))
            module = NormLinear(kk, nn_, True).to(device=device, dtype=dtype)
            emit(mgraph_row(args, module, x, device, **fields))
    for experts in (8, 4) if "layer-router" in wanted else ():
        torch.manual_seed(0)
        x = torch.randn(4096, 4096, device=device, dtype=dtype)
        module = RouterLayer(4096, experts).to(device=device, dtype=dtype)
        emit(mgraph_row(args, module, x, device, point=f"layer-router-{experts}", M=4096,
                        N=4096, K=4096, experts=experts))
    return 0 if all(r["status"] == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
