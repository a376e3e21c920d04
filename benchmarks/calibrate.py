"""Calibrate the hardware profile on the GPU machine from microbenchmarks, and write its JSON.

Run (2 GPUs of one host, ~2 minutes):

    torchrun --nproc_per_node=2 benchmarks/calibrate.py --out $OUT/h200.json

Each constant comes from one small measurement of the megakernel's own code paths (CUDA-event
medians; rank 0 reports, both ranks run), never from a fused op that benchmarks/predict.py
later predicts:

- ``tile_gemm_tflops``: the megakernel's GEMM alone (1 GPU, 8192x8192x4096, 128x256 tiles),
  as the simulator costs it: whole waves of tiles on all SMs.
- ``launch_us``: a one-tile GEMM on one GPU. ``multi_gpu_launch_us``: the same tile on each of
  2 GPUs, each storing it into the other (entry barrier, exit wait), less ``launch_us``.
- ``epilogue_peer_gbps``: 8192x8192x4096 GEMM tiles whose epilogue stores each tile into the
  peer GPU, against the same tiles stored locally: the extra time per wave over a tile's bytes.
- ``nvlink_worker_gbps`` and ``nvlink_worker_push_gbps``: NVLink copy tasks only (256 KiB
  chunks, 16 workers, no compute): bytes moved over NVLink / (time x workers), pulling (the
  worker reads from the peer, what AG+GEMM's gather does) and pushing (it writes into the peer,
  what node broadcasts do). The cost model and the simulator cost each direction at its rate.
- ``copy_engine_gbps``: 1 MiB copies into a peer GPU's buffer mapped by symmetric memory, both
  GPUs at once, back to back (the path of bench_emulated.py's wire): bytes per direction / time.

Every other value is kept from the shipped profile with its source. Correctness: every graph's
outputs are checked against torch on random inputs before it is timed.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")  # GPU.md: lazy loading vs spinning kernels
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")

import torch  # noqa: E402

import mgraph as mg  # noqa: E402
from mgraph.builder import GraphBuilder, piece  # noqa: E402
from mgraph.kinds import Role  # noqa: E402

CHUNK_ROWS, CHUNK_COLS = 64, 2048  # 256 KiB of bf16
TILE = (128, 256)


# -- the microbenchmark graphs (pure Python: checked on the CPU by tests/test_profile.py) ------
def nvlink_copies(chunks: int, pull: bool) -> mg.TaskGraph:
    """1x2: each rank moves ``chunks`` 256 KiB chunks of its ``x`` rows into the other rank's
    ``out`` (push: the source rank's NVLink worker writes the peer; pull: the destination's
    worker reads it). ``out`` == ``x`` globally."""
    rows = chunks * CHUNK_ROWS
    b = GraphBuilder("calibrate_nvlink", mg.Topology.parse("1x2"), "bfloat16", {})
    b.global_input("x", (2 * rows, CHUNK_COLS))
    b.global_output("out", (2 * rows, CHUNK_COLS))
    shape = (2 * rows, CHUNK_COLS)
    x = [b.bound_buffer("x", r, "x", [piece(shape, d0=(r * rows, (r + 1) * rows))])
         for r in range(2)]  # fmt: skip
    # out on rank p holds the rows of rank 1 - p
    out = [b.bound_buffer("out", p, "out", [piece(shape, d0=((1 - p) * rows, (2 - p) * rows))],
                          role="output") for p in range(2)]  # fmt: skip
    for src in range(2):
        dst = 1 - src
        for c in range(chunks):
            rng = (c * CHUNK_ROWS, (c + 1) * CHUNK_ROWS)
            b.task(dst if pull else src, Role.NVLINK, "copy", [x[src].region(rng)],
                   [out[dst].region(rng)], name=f"copy r{src}->r{dst} {c}")  # fmt: skip
    return b.finish().validate()


def gemm_tiles(M: int, N: int, K: int, peer: bool) -> mg.TaskGraph:
    """1x2: each rank multiplies its [M, K] rows of ``a`` by ``b`` [K, N] in 128x256 tiles; each
    tile's epilogue stores into the other rank's ``out`` (``peer``) or its own."""
    b = GraphBuilder("calibrate_epilogue", mg.Topology.parse("1x2"), "bfloat16", {})
    b.global_input("a", (2 * M, K))
    b.global_input("b", (K, N))
    b.global_output("out", (2 * M, N))
    a = [b.bound_buffer("a", r, "a", [piece((2 * M, K), d0=(r * M, (r + 1) * M))])
         for r in range(2)]  # fmt: skip
    w = [b.bound_buffer("b", r, "b", [piece((K, N))]) for r in range(2)]
    owner = [1 - p if peer else p for p in range(2)]  # whose rows out on rank p holds
    out = [b.bound_buffer("out", p, "out", [piece((2 * M, N), d0=(owner[p] * M, (owner[p] + 1) * M))],
                          role="output") for p in range(2)]  # fmt: skip
    tm, tn = TILE
    for r in range(2):
        dst = 1 - r if peer else r
        for i in range(0, M, tm):
            for j in range(0, N, tn):
                b.task(r, Role.COMPUTE, "gemm", [a[r].region((i, i + tm)), w[r].region(None, (j, j + tn))],
                       [out[dst].region((i, i + tm), (j, j + tn))], name=f"gemm r{r} {i},{j}")  # fmt: skip
    return b.finish().validate()


# -- timing on the GPUs --------------------------------------------------------------------------
def timed(call: Callable[[], object], reps: int, warmup: int = 3) -> float:
    """Median CUDA-event ms of ``call()`` (a runtime's ``launch``), max over ranks."""
    import torch.distributed as dist

    for _ in range(warmup):
        call()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        dist.barrier()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    med = torch.tensor([statistics.median(times)], device="cuda")
    dist.all_reduce(med, op=dist.ReduceOp.MAX)
    return med.item()


def reference_out(graph: mg.TaskGraph, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """The global ``out`` of a calibration graph, in torch (fp32)."""
    if "a" in inputs:
        return inputs["a"].float() @ inputs["b"].float()
    return inputs["x"].float()


def out_rows_owner(graph: mg.TaskGraph, rank: int) -> int:
    """Whose rows the ``out`` buffer of ``rank`` holds (its binding's first piece)."""
    buf = next(b for b in graph.buffers.values() if b.name == "out" and b.rank == rank)
    lo = buf.binding.pieces[0][0][0]
    return lo // buf.rows


def run_checked(graph: mg.TaskGraph, workers: dict[str, int] | None, reps: int) -> float:
    """Check this rank's ``out`` against torch once (outputs NaN-poisoned first), then time."""
    import torch.distributed as dist

    from mgraph.runtime.megakernel import TritonRuntime, local_shards

    rank = dist.get_rank()
    gen = torch.Generator().manual_seed(1)
    inputs = {n: torch.randn(s.shape, generator=gen).to(torch.bfloat16)
              for n, s in graph.inputs.items()}  # fmt: skip
    local = {k: v.cuda() for k, v in local_shards(graph, rank, inputs).items()}
    rt = TritonRuntime(mg.schedule(graph, workers=workers))
    got = rt.run(local).outputs["out"].float().cpu()
    owner = out_rows_owner(graph, rank)
    want = reference_out(graph, inputs)[owner * got.shape[0]:(owner + 1) * got.shape[0]]
    err = ((got - want).norm() / want.norm()).item()
    if not err < 2e-2:
        raise SystemExit(f"calibrate: {graph.op} output off by {err:.3g}: not timing a wrong kernel")
    ms = timed(rt.launch, reps)
    del rt
    torch.cuda.empty_cache()
    return ms


def copy_engine_gbps(reps: int, chunks: int = 256) -> float:
    """GB/s per direction of 1 MiB copy-engine copies into the peer GPU, both GPUs sending at
    once: each rank copies into the other's buffer through its symmetric-memory mapping, a
    same-device copy for torch (no cross-device stream syncs), as bench_emulated.py's wire."""
    import torch.distributed as dist
    import torch.distributed._symmetric_memory as symm_mem

    nbytes = chunks << 20
    recv = symm_mem.empty(nbytes, dtype=torch.uint8, device="cuda")
    handle = symm_mem.rendezvous(recv, dist.group.WORLD.group_name)
    peer = handle.get_buffer(1 - dist.get_rank(), (nbytes,), torch.uint8)
    rank = dist.get_rank()

    def pattern(r: int) -> torch.Tensor:  # each rank's own bytes, so a copy that lands is seen
        return ((torch.arange(nbytes, dtype=torch.int32, device="cuda") * (r + 3) + 7) % 251).to(torch.uint8)

    src = pattern(rank)

    def send() -> None:
        for i in range(chunks):
            peer[i << 20:(i + 1) << 20].copy_(src[i << 20:(i + 1) << 20], non_blocking=True)

    recv.zero_()
    torch.cuda.synchronize()
    dist.barrier()
    send()
    torch.cuda.synchronize()
    handle.barrier(channel=0)
    if not torch.equal(recv, pattern(1 - rank)):
        raise SystemExit("calibrate: the copy-engine copies did not land: not timing them")
    ms = timed(send, reps)
    return nbytes / (ms * 1e-3) / 1e9


def measure(reps: int) -> dict[str, float]:
    import torch.distributed as dist

    hw = mg.H200
    rank = dist.get_rank()
    out: dict[str, float] = {}
    # GEMM alone on one GPU (rank 0; rank 1 waits at the barrier)
    M, N, K = 8192, 8192, 4096
    if rank == 0:
        from mgraph.runtime.megakernel import TritonRuntime

        g = mg.ops.gemm(M=M, N=N, K=K, topology="1x1", dtype=torch.bfloat16)
        a, w = torch.randn(M, K, device="cuda", dtype=torch.bfloat16), torch.randn(K, N, device="cuda", dtype=torch.bfloat16)
        rt = TritonRuntime(mg.schedule(g), rank=0)
        rt.run({"a": a, "b": w})
        times = []
        tiny = TritonRuntime(mg.schedule(mg.ops.gemm(M=128, N=256, K=64, topology="1x1", dtype=torch.bfloat16)), rank=0)
        tiny.run({"a": a[:128, :64].contiguous(), "b": w[:64, :256].contiguous()})
        for r in (rt, tiny):
            for _ in range(3):
                r.launch()
            torch.cuda.synchronize()
            ts = []
            for _ in range(reps):
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                r.launch()
                e.record()
                torch.cuda.synchronize()
                ts.append(s.elapsed_time(e))
            times.append(statistics.median(ts))
        out["gemm_ms"], out["tiny_ms"] = times
        del rt, tiny
    dist.barrier()
    out["copy_engine_gbps"] = copy_engine_gbps(reps)
    tiles_per_rank = (M // TILE[0]) * (N // TILE[1])
    waves = -(-tiles_per_rank // hw.sms)
    out["epilogue_local_ms"] = run_checked(gemm_tiles(M, N, K, peer=False), None, reps)
    out["epilogue_peer_ms"] = run_checked(gemm_tiles(M, N, K, peer=True), None, reps)
    out["tiny_2gpu_ms"] = run_checked(gemm_tiles(128, 256, 64, peer=True), None, reps)
    workers = 16
    chunks = 8 * workers
    nbytes = chunks * CHUNK_ROWS * CHUNK_COLS * 2
    for mode in ("pull", "push"):
        ms = run_checked(nvlink_copies(chunks, pull=mode == "pull"),
                         {"compute": 0, "nvlink": workers}, reps)  # fmt: skip
        out[f"nvlink_{mode}_ms"] = ms
        out[f"nvlink_{mode}_gbps"] = nbytes / (ms * 1e-3) / workers / 1e9
    if rank == 0:
        tile_flops = 2 * TILE[0] * TILE[1] * K
        out["tile_gemm_tflops"] = waves * tile_flops * hw.sms / ((out["gemm_ms"] - out["tiny_ms"]) * 1e-3) / 1e12
        out["launch_us"] = out["tiny_ms"] * 1e3
        out["multi_gpu_launch_us"] = max(0.0, (out["tiny_2gpu_ms"] - out["tiny_ms"]) * 1e3)
        extra_s = (out["epilogue_peer_ms"] - out["epilogue_local_ms"]) * 1e-3
        tile_bytes = TILE[0] * TILE[1] * 2
        out["epilogue_peer_gbps"] = waves * tile_bytes / max(extra_s, 1e-9) / 1e9
    return out


def profile_from(m: dict[str, float], machine: str) -> mg.HardwareProfile:
    """The shipped profile with the measured constants replaced, each with its source.
    ``machine``: what ran it, as the sources name it ("2x H200")."""
    when = datetime.date.today().isoformat()
    tag = f"benchmarks/calibrate.py on {machine}, {when}"
    new = {
        "tile_gemm_tflops": (m["tile_gemm_tflops"], f"{tag}: megakernel GEMM alone 8192x8192x4096 {m['gemm_ms']:.3f} ms, whole waves of 128x256 tiles"),
        "launch_us": (m["launch_us"], f"{tag}: one-tile GEMM launch {m['tiny_ms'] * 1e3:.1f} us"),
        "multi_gpu_launch_us": (m["multi_gpu_launch_us"], f"{tag}: one tile per GPU on 2 GPUs, stored into the peer, {m['tiny_2gpu_ms'] * 1e3:.1f} us, less launch_us"),
        "epilogue_peer_gbps": (m["epilogue_peer_gbps"], f"{tag}: 8192x8192x4096 tiles stored into the peer {m['epilogue_peer_ms']:.3f} ms vs locally {m['epilogue_local_ms']:.3f} ms"),
        "nvlink_worker_gbps": (m["nvlink_pull_gbps"], f"{tag}: 16 NVLink workers copying 256 KiB chunks out of the peer (pull, no compute): {m['nvlink_pull_gbps']:.2f} GB/s per worker"),
        "nvlink_worker_push_gbps": (m["nvlink_push_gbps"], f"{tag}: 16 NVLink workers copying 256 KiB chunks into the peer (push, no compute): {m['nvlink_push_gbps']:.2f} GB/s per worker"),
        "copy_engine_gbps": (m["copy_engine_gbps"], f"{tag}: 1 MiB copy-engine copies into the peer's symmetric-memory buffer, both GPUs at once, per direction"),
    }  # fmt: skip
    hw = mg.H200
    values = {k: round(v, 3) for k, (v, _) in new.items()}
    sources = {**hw.sources, **{k: s for k, (_, s) in new.items()}}
    return mg.HardwareProfile.model_validate(hw.model_dump() | values | {"sources": sources})


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="h200.json", help="where to write the profile JSON")
    parser.add_argument("--reps", type=int, default=10)
    args = parser.parse_args()
    import torch.distributed as dist

    dist.init_process_group("nccl")
    rank = dist.get_rank()
    torch.cuda.set_device(rank)
    if dist.get_world_size() != 2:
        raise SystemExit("calibrate: run with torchrun --nproc_per_node=2")
    m = measure(args.reps)
    if rank == 0:
        hw = profile_from(m, f"{dist.get_world_size()}x {torch.cuda.get_device_name().split()[-1]}")
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        hw.save(args.out)
        Path(args.out).with_suffix(".measurements.json").write_text(json.dumps(m, indent=1) + "\n")
        for k, v in sorted(m.items()):
            print(f"{k:24s} {v:10.3f}")
        print(f"wrote {args.out}: copy it to mgraph/profiles/h200.json, then run "
              "python benchmarks/predict.py")
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
