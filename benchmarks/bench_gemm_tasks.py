"""GEMM task shapes in the megakernel on one GPU: what a task costs beyond its kernel blocks.

The Llama layer's GEMM tasks ran at 47-49 us a 128x256 block (K=4096) in tasks of four blocks
and 54 us in tasks of one, and tasks of two blocks were slower per block than either
(benchmarks/NOTES.md v14). This isolates the task shape from the layer's mix. For each shape
(M, N, K) and each task tile, two traced modules:

- ``norm_linear``: RMSNorm then a Linear, so every GEMM task waits for norm tiles and runs in
  the kernel's dynamic loop, as a layer's do;
- ``linear``: the Linear alone, whose tasks wait for nothing (the kernel's static prefix takes
  the single-block ones).

Per point: the megakernel replayed alone (CUDA events, median of ``--reps`` calls from an idle
GPU, and ``--chain`` calls issued back to back), one traced launch's GEMM rows (mean work time
a task and a 128x256 block, busy time summed over programs), and, in the same run, the eager
equivalent (F.rms_norm + cuBLAS matmul; cuBLAS alone) timed the same two ways. Rows go to
``$OUT/bench_gemm_tasks.json``; one line per point is printed.

    python3 benchmarks/bench_gemm_tasks.py                       # H200, ~2-3 minutes
    TRITON_INTERPRET=1 python3 benchmarks/bench_gemm_tasks.py --smoke   # CPU, tiny sizes
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_timing import window  # noqa: E402

import mgraph as mg  # noqa: E402

SHAPES = [(4096, 4096, 4096), (4096, 14336, 4096), (4096, 4096, 14336)]
TILES = [(128, 256), (128, 512), (256, 256), (128, 1024)]
BLOCK = (128, 256)  # the kernel's GEMM block (encode.MAX_BLOCK)


class NormLinear(nn.Module):
    def __init__(self, k: int, n: int, norm: bool):
        super().__init__()
        self.norm = nn.RMSNorm(k, eps=1e-6) if norm else None
        self.lin = nn.Linear(k, n, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(self.norm(x) if self.norm is not None else x)


def timed(fn, reps: int, chain: int, device: torch.device) -> tuple[float, float]:
    """(median ms of ``reps`` calls each from an idle device, ms a call over ``chain`` calls
    issued back to back); the wall clock on the CPU."""
    fn()
    idle = [window(fn, 1, device) for _ in range(reps)]
    return statistics.median(idle), window(fn, chain, device)


def gemm_rows(runtime) -> list[dict]:
    from kind_breakdown import kind_breakdown

    rows = []
    for r in kind_breakdown(runtime):
        if not r["kind"].startswith("gemm "):
            continue
        rows_, cols = (int(v) for v in r["kind"].split()[1].split("x"))
        blocks = -(-rows_ // BLOCK[0]) * -(-cols // BLOCK[1])
        rows.append(
            {
                "kind": r["kind"],
                "tasks": r["tasks"],
                "blocks_per_task": blocks,
                "mean_work_us": r["mean_work_us"],
                "work_us_per_block": round(r["mean_work_us"] / blocks, 2),
                "wait_ms": r["wait_ms"],
                "busy_ms": r["busy_ms"],
                "makespan_ms": r["makespan_ms"],
            }
        )
    return rows


def point(args, m: int, n: int, k: int, tile, norm: bool, device, dtype) -> dict:
    torch.manual_seed(0)
    module = NormLinear(k, n, norm).to(device=device, dtype=dtype)
    x = torch.randn(m, k, device=device, dtype=dtype)
    with torch.no_grad():
        want = module(x).float()
    plan = {"lin": mg.ColwiseParallel(options={"tile": list(tile)})}
    row = {
        "bench": "gemm_tasks",
        "module": "norm_linear" if norm else "linear",
        "M": m,
        "N": n,
        "K": k,
        "tile": f"{tile[0]}x{tile[1]}",
        "dtype": str(dtype).split(".")[-1],
    }
    try:
        prog = mg.compile(
            module,
            (x,),
            plan=plan,
            backend="triton",
            backend_options={"interpret": True} if args.smoke else None,
        )
        with torch.no_grad():
            got = prog(x).float()
        row["error"] = ((got - want).norm() / want.norm()).item()
        runtime = prog._runtime
        row["ms"], row["ms_back_to_back"] = timed(runtime.launch, args.reps, args.chain, device)
        row["flops"] = 2.0 * m * n * k
        row["tflops"] = round(row["flops"] / row["ms"] / 1e9, 1)
        row.update(runtime.kernel_info())
        row["gemm"] = gemm_rows(runtime)
        row["status"] = "ok" if row["error"] < args.tol else "FAIL (error)"
    except Exception as exc:  # noqa: BLE001 - one failed point is a row, not the end
        row["status"] = f"FAIL: {type(exc).__name__}: {str(exc)[:300]}"
    return row


def baselines(args, m: int, n: int, k: int, device, dtype) -> list[dict]:
    torch.manual_seed(0)
    x = torch.randn(m, k, device=device, dtype=dtype)
    w = torch.randn(n, k, device=device, dtype=dtype) / k**0.5
    g = torch.ones(k, device=device, dtype=dtype)
    rows = []
    for name, fn in (
        ("cublas", lambda: x @ w.t()),
        ("eager_norm_cublas", lambda: F.rms_norm(x, (k,), g, 1e-6) @ w.t()),
    ):
        ms, chained = timed(fn, args.reps, args.chain, device)
        rows.append(
            {
                "bench": "gemm_tasks",
                "impl": name,
                "dtype": str(dtype).split(".")[-1],
                "M": m,
                "N": n,
                "K": k,
                "ms": ms,
                "ms_back_to_back": chained,
                "tflops": round(2.0 * m * n * k / ms / 1e9, 1),
                "status": "ok",
            }
        )
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--shapes",
        nargs="*",
        type=lambda v: tuple(int(x) for x in v.split(",")),
        default=SHAPES,
        help="M,N,K per point (default: the layer's q/o, gate/up and down shapes)",
    )
    p.add_argument(
        "--tiles",
        nargs="*",
        type=lambda v: tuple(int(x) for x in v.split(",")),
        default=TILES,
        help="task tiles R,C",
    )
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--chain", type=int, default=10)
    p.add_argument("--tol", type=float, default=2e-2)
    p.add_argument("--smoke", action="store_true", help="CPU interpreter, tiny sizes, fp32")
    p.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    args = p.parse_args(argv)
    if args.smoke:
        device, dtype = torch.device("cpu"), torch.float32
        shapes, tiles = [(256, 512, 64)], [(128, 256), (128, 512)]
        args.reps, args.chain = 1, 1
    else:
        os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")  # GPU.md: lazy loading can hang
        device, dtype = torch.device("cuda", 0), torch.bfloat16
        torch.cuda.set_device(device)
        shapes, tiles = args.shapes, args.tiles
    rows = []
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for m, n, k in shapes:
        for row in baselines(args, m, n, k, device, dtype):
            rows.append(row)
            print(json.dumps(row), flush=True)
        for norm in (True, False):
            for tile in tiles:
                row = point(args, m, n, k, tile, norm, device, dtype)
                row["impl"] = f"mgraph_{row['module']}"
                rows.append(row)
                gemm = "; ".join(
                    f"{g['kind']}: {g['mean_work_us']} us/task {g['work_us_per_block']} us/block"
                    for g in row.get("gemm", [])
                )
                print(
                    f"gemm_tasks {m}x{n}x{k} {row['module']} tile {row['tile']}: "
                    f"{row.get('ms', float('nan')):.3f} ms (back to back "
                    f"{row.get('ms_back_to_back', float('nan')):.3f}) {row['status'][:80]} "
                    f"| {gemm}",
                    flush=True,
                )
                (out / "bench_gemm_tasks.json").write_text(json.dumps(rows, indent=1) + "\n")
    (out / "bench_gemm_tasks.json").write_text(json.dumps(rows, indent=1) + "\n")
    return 0 if all(r["status"] == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
