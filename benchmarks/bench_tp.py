"""Tensor-parallel fused ops on 2 GPUs: mgraph's megakernel against cuBLAS + NCCL, torch's fused
symmetric-memory ops, and cuBLAS + two-shot all-reduce, on the same inputs in the same process.

Run: torchrun --nproc_per_node=2 benchmarks/bench_tp.py [--shapes 8192,8192,4096 ...] [--out DIR]

Shapes are PER-RANK GEMMs (M, N, K), as in ../shared/GPU.md's baselines: GEMM+AR and GEMM+RS
multiply [M, K] @ [K, N] on every rank (global K = world * K); AG+GEMM gathers A [M/world, K]
shards into [M, K] and multiplies by the rank's [K, N] columns (global N = world * N).
Medians of CUDA-event timings, max over ranks. Writes JSON rows {op, M, N, K, world, impl, ms}
and a markdown table.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import time
from pathlib import Path

os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")  # GPU.md: lazy loading vs spinning kernels
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import mgraph as mg  # noqa: E402  (installed: mgraph.runtime comes from the package-dir map)
from mgraph.runtime.megakernel import TritonRuntime, local_shards  # noqa: E402

SHAPES = [(4096, 8192, 4096), (8192, 8192, 4096), (8192, 8192, 14336), (2048, 8192, 8192)]


def timeit(fn, warmup: int, reps: int) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        dist.barrier()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    med = torch.tensor([statistics.median(times)], device="cuda")
    dist.all_reduce(med, op=dist.ReduceOp.MAX)
    return med.item()


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


class Bench:
    def __init__(self, args) -> None:
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.args = args
        self.rows: list[dict] = []
        self.group = dist.group.WORLD.group_name

    def add(self, op, shape, impl, ms, **extra) -> None:
        M, N, K = shape
        row = {"op": op, "M": M, "N": N, "K": K, "world": self.world, "impl": impl, "ms": round(ms, 4)}
        row.update(extra)
        self.rows.append(row)
        if self.rank == 0:
            print(json.dumps(row), flush=True)

    # -- mgraph ---------------------------------------------------------------------------------
    def mgraph(self, op_name, shape, graph_kw, want_fn, comm_workers):
        """Check once, then time: the default SM partition and a sweep of NVLink workers."""
        op = mg.ops.get_op(op_name)
        graph = op(topology=f"1x{self.world}", dtype=torch.bfloat16, **graph_kw)
        inputs = op.random_inputs(graph, seed=1)
        local = {k: v.cuda() for k, v in local_shards(graph, self.rank, inputs).items()}
        want = want_fn(local)
        best = None
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        for n in [None, *comm_workers]:
            workers = None if n is None else {"compute": sms - n, "nvlink": n}
            sched = mg.schedule(graph, workers=workers)
            rt = TritonRuntime(sched)
            err = rel(rt.run(local).outputs["out"], want)
            ms = timeit(rt.launch, self.args.warmup, self.args.reps)
            rt.check()
            nv = sched.ranks[self.rank].workers["nvlink"]
            self.add(op_name, shape, "mgraph" if n is None else "mgraph_sweep", ms,
                     nvlink_workers=nv, rel_err=round(err, 5))
            if best is None or ms < best[0]:
                best = (ms, nv)
            del rt
            gc.collect()
            torch.cuda.empty_cache()
        # Where the time goes: one traced launch of the best split (in-kernel %globaltimer stamps).
        workers = {"compute": sms - best[1], "nvlink": best[1]}
        rt = TritonRuntime(mg.schedule(graph, workers=workers), trace=True)
        rt.run(local)
        busy = busy_fractions(rt.trace(), workers)
        self.add(op_name, shape, "mgraph_best", best[0], nvlink_workers=best[1], **busy)
        del rt

    def gemm_alone(self, shape):
        M, N, K = shape
        a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(K, N, device="cuda", dtype=torch.bfloat16)
        self.add("gemm", shape, "cublas", timeit(lambda: a @ b, self.args.warmup, self.args.reps))
        graph = mg.ops.gemm(M=M, N=N, K=K, topology="1x1", dtype=torch.bfloat16)
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        rt = TritonRuntime(mg.schedule(graph, workers={"compute": sms}), rank=0)
        err = rel(rt.run({"a": a, "b": b}).outputs["out"], a.float() @ b.float())
        self.add("gemm", shape, "mgraph_gemm", timeit(rt.launch, self.args.warmup, self.args.reps),
                 rel_err=round(err, 5))
        del rt

    def allreduce(self, shape):
        M, N, K = shape
        w = self.world
        a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(K, N, device="cuda", dtype=torch.bfloat16)

        def nccl():
            c = a @ b
            dist.all_reduce(c)

        self.add("gemm_allreduce", shape, "cublas_nccl", timeit(nccl, self.args.warmup, self.args.reps))
        import torch.distributed._symmetric_memory as symm_mem

        buf = symm_mem.empty(M, N, dtype=torch.bfloat16, device="cuda")
        symm_mem.rendezvous(buf, self.group)

        def two_shot():
            torch.matmul(a, b, out=buf)
            torch.ops.symm_mem.two_shot_all_reduce_(buf, "sum", self.group)

        self.add("gemm_allreduce", shape, "cublas_symm_two_shot",
                 timeit(two_shot, self.args.warmup, self.args.reps))

        def want(local):
            c = local["a"].float() @ local["b"].float()
            dist.all_reduce(c)
            return c

        self.mgraph("gemm_allreduce", shape, dict(M=M, N=N, K=K * w), want, self.args.comm_workers)

    def reduce_scatter(self, shape):
        M, N, K = shape
        w = self.world
        a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(K, N, device="cuda", dtype=torch.bfloat16)
        out = torch.empty(M // w, N, device="cuda", dtype=torch.bfloat16)

        def nccl():
            dist.reduce_scatter_tensor(out, a @ b)

        self.add("gemm_reduce_scatter", shape, "cublas_nccl", timeit(nccl, self.args.warmup, self.args.reps))

        def fused():
            torch.ops.symm_mem.fused_matmul_reduce_scatter(a, b, "sum", 0, self.group)

        self.add("gemm_reduce_scatter", shape, "torch_fused", timeit(fused, self.args.warmup, self.args.reps))

        def want(local):
            c = local["a"].float() @ local["b"].float()
            o = torch.empty(M // w, N, device="cuda")
            dist.reduce_scatter_tensor(o, c)
            return o

        self.mgraph("gemm_reduce_scatter", shape, dict(M=M, N=N, K=K * w), want, self.args.comm_workers)

    def all_gather(self, shape):
        M, N, K = shape
        w = self.world
        a = torch.randn(M // w, K, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(K, N, device="cuda", dtype=torch.bfloat16)
        full = torch.empty(M, K, device="cuda", dtype=torch.bfloat16)

        def nccl():
            dist.all_gather_into_tensor(full, a)
            return full @ b

        self.add("allgather_gemm", shape, "cublas_nccl", timeit(nccl, self.args.warmup, self.args.reps))

        def fused():
            torch.ops.symm_mem.fused_all_gather_matmul(a, [b], 0, self.group)

        self.add("allgather_gemm", shape, "torch_fused", timeit(fused, self.args.warmup, self.args.reps))

        def want(local):
            g = torch.empty(M, K, device="cuda", dtype=torch.bfloat16)
            dist.all_gather_into_tensor(g, local["a"])
            return g.float() @ local["b"].float()

        self.mgraph("allgather_gemm", shape, dict(M=M, N=N * w, K=K), want, self.args.comm_workers)


def busy_fractions(trace, workers: dict[str, int]) -> dict[str, float]:
    """Busy time per role over (workers x makespan) of one traced launch, and the makespan."""
    span = trace.makespan
    out = {"traced_ms": round(span * 1e3, 4)}
    for role, n in workers.items():
        busy = sum(r.end - r.start for r in trace.records if r.role == role)
        out[f"busy_{role}"] = round(busy / (n * span), 3) if n and span else 0.0
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", nargs="*", default=[",".join(map(str, s)) for s in SHAPES])
    parser.add_argument("--ops", nargs="*", default=["gemm_alone", "allreduce", "reduce_scatter", "all_gather"])
    parser.add_argument("--comm-workers", type=int, nargs="*", default=[4, 8, 12, 16, 24, 32])
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    args = parser.parse_args()
    rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
    bench = Bench(args)
    start = time.time()
    for text in args.shapes:
        shape = tuple(int(x) for x in text.split(","))
        for name in args.ops:
            getattr(bench, name)(shape)
            gc.collect()
            torch.cuda.empty_cache()
    if rank == 0:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "bench_tp.json").write_text(json.dumps(bench.rows, indent=1))
        (out / "bench_tp.md").write_text(table(bench.rows))
        print(table(bench.rows), flush=True)
        print(f"total {time.time() - start:.0f} s", flush=True)
    dist.destroy_process_group()


def table(rows: list[dict]) -> str:
    keys = sorted({(r["op"], r["M"], r["N"], r["K"]) for r in rows})
    lines = ["| op | M,N,K | impl | ms | vs cublas_nccl |", "|---|---|---|---|---|"]
    for op, M, N, K in keys:
        mine = [r for r in rows if (r["op"], r["M"], r["N"], r["K"]) == (op, M, N, K)]
        base = next((r["ms"] for r in mine if r["impl"] in ("cublas_nccl", "cublas")), None)
        for r in mine:
            if r["impl"] == "mgraph_sweep":
                continue
            ratio = f"{base / r['ms']:.2f}x" if base else ""
            extra = f" (nvlink {r['nvlink_workers']})" if "nvlink_workers" in r else ""
            if "busy_compute" in r:
                extra += f" busy compute {r['busy_compute']:.2f} nvlink {r['busy_nvlink']:.2f}"
            lines.append(f"| {op} | {M},{N},{K} | {r['impl']}{extra} | {r['ms']:.3f} | {ratio} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
