"""On 2 GPUs (torchrun --nproc_per_node=2 tests/gpu_adaptive_ag.py): the adaptive controller on
AG+GEMM, whose v9 runs never finished (the warp-divergent branches sync.py now forbids), and
whether a sweep over NVLink workers and chunks reuses one compiled megakernel.

1. AG+GEMM per-rank 4096x8192x4096 and 8192x8192x4096 (bf16, default options and split), with
   Settings(adaptive=True) and without: one NaN-poisoned checked launch, then LAUNCHES launches
   (CUDA graph replays) timed with CUDA events, then check(); error of the whole output and of
   the worst 128x256 tile against torch, decisions the controller made.
2. At 8192x8192x4096: NVLink workers 8, 16, 24 x chunks 1 and 4 MiB: seconds to build and run
   each point once, and how many kernels the megakernel's JIT cache holds after it.

Prints one JSON row per item as it goes (a hang shows as the last row printed) and writes them
to $OUT/gpu_adaptive_ag.json.
"""

from __future__ import annotations

import json
import os
import statistics
import time

import torch
import torch.distributed as dist

import mgraph as mg
from mgraph.runtime.megakernel.control import C_DECISIONS
from mgraph.runtime.megakernel.runtime import TritonRuntime, local_shards
from mgraph.settings import Settings

LAUNCHES = 50
SHAPES = [(4096, 8192, 4096), (8192, 8192, 4096)]


def emit(rows: list, row: dict) -> None:
    rows.append(row)
    if dist.get_rank() == 0:
        print(json.dumps(row), flush=True)


def worst_tile(got: torch.Tensor, want: torch.Tensor, tile=(128, 256)) -> float:
    worst = 0.0
    for r in range(0, want.shape[0], tile[0]):
        for c in range(0, want.shape[1], tile[1]):
            w = want[r : r + tile[0], c : c + tile[1]]
            g = got[r : r + tile[0], c : c + tile[1]].float()
            worst = max(worst, ((g - w).norm() / w.norm().clamp_min(1e-30)).item())
    return worst


def graph_and_inputs(M: int, N: int, K: int, **options):
    rank, world = dist.get_rank(), dist.get_world_size()
    op = mg.ops.get_op("allgather_gemm")
    graph = op(
        M=M * world, N=N * world, K=K, topology=f"1x{world}", dtype=torch.bfloat16, **options
    )
    inputs = op.random_inputs(graph, seed=1)
    local = {k: v.cuda() for k, v in local_shards(graph, rank, inputs).items()}
    return graph, inputs, local


def adaptive_rows(rows: list) -> None:
    rank = dist.get_rank()
    for M, N, K in SHAPES:
        graph, inputs, local = graph_and_inputs(M, N, K)
        a, b = inputs["a"].cuda(), inputs["b"].cuda()
        cols = slice(rank * N, (rank + 1) * N)
        want = a.float() @ b[:, cols].float()
        del a, b
        for adaptive in (False, True):
            rt = TritonRuntime(mg.schedule(graph), settings=Settings(adaptive=adaptive))
            got = rt.run(local).outputs["out"]
            err = ((got.float() - want).norm() / want.norm()).item()
            tile_err = worst_tile(got, want)
            times = []
            for _ in range(LAUNCHES):
                start, end = (
                    torch.cuda.Event(enable_timing=True),
                    torch.cuda.Event(enable_timing=True),
                )
                start.record()
                rt.launch()
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end))
            rt.check()
            got = rt.run(local).outputs["out"]  # after the replays: still right
            err_after = ((got.float() - want).norm() / want.norm()).item()
            emit(
                rows,
                dict(
                    item="ag",
                    M=M,
                    N=N,
                    K=K,
                    adaptive=adaptive,
                    rank=rank,
                    ms=round(statistics.median(times), 4),
                    rel_err=round(err, 5),
                    worst_tile_err=round(tile_err, 5),
                    rel_err_after=round(err_after, 5),
                    decisions=int(rt.d["ctl"][C_DECISIONS].item()),
                    nvlink=rt.schedule.ranks[rank].workers.get("nvlink", 0),
                ),
            )
            del rt
            dist.barrier()


def sweep_rows(rows: list) -> None:
    rank = dist.get_rank()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    M, N, K = SHAPES[-1]
    kernel = None
    for chunk in (1 << 20, 4 << 20):
        graph, _inputs, local = graph_and_inputs(M, N, K, chunk_bytes=chunk)
        for nvlink in (8, 16, 24):
            dist.barrier()
            t0 = time.perf_counter()
            sched = mg.schedule(graph, workers={"compute": sms - nvlink, "nvlink": nvlink})
            rt = TritonRuntime(sched)
            rt.run(local)
            seconds = time.perf_counter() - t0
            kernel = rt._kernel
            # compiled kernels in the JIT's per-device caches (first field of each entry)
            compiled = sum(len(entry[0]) for entry in kernel.device_caches.values())
            emit(
                rows,
                dict(
                    item="sweep",
                    chunk_kib=chunk >> 10,
                    nvlink=nvlink,
                    rank=rank,
                    build_and_first_run_s=round(seconds, 2),
                    compiled_kernels=compiled,
                ),
            )
            del rt


def main() -> None:
    dist.init_process_group("nccl")
    torch.cuda.set_device(dist.get_rank())
    rows: list = []
    try:
        adaptive_rows(rows)
        sweep_rows(rows)
    finally:
        out = os.environ.get("OUT")
        if out and dist.get_rank() == 0:
            with open(os.path.join(out, "gpu_adaptive_ag.json"), "w") as f:
                json.dump(rows, f, indent=1)
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
