"""Fused GEMM + collective across 2 emulated nodes against two honest baselines, on the same
inputs in the same run.

Run: torchrun --nproc_per_node=2 benchmarks/bench_emulated.py [--shapes M,N,K ...]
         [--ops gemm_allreduce gemm_reduce_scatter allgather_gemm] [--nic-gbps 50 0]
         [--chunk-kib 256] [--out DIR]

Two GPUs of one host act as 2 nodes of 1 GPU (topology "2x1"). Shapes are PER-RANK GEMMs
[M, K] @ [K, N]: GEMM+AR and GEMM+RS shard the global K (2K), AG+GEMM gathers A (each rank
holds M/2 rows) and shards N. Every implementation is timed the same way: CUDA events around one
call on the current stream, median per rank, max over ranks (``timeit``). Per op, shape, cap:

- ``cublas``: the rank's GEMM alone;
- ``mgraph_fused``: the megakernel; inter-node chunks of --chunk-kib go GPU -> command FIFO ->
  native host proxy -> copy engine into the peer, paced like a NIC of nic_gbps GB/s (0: none);
- ``ce_paced`` (baseline a): cuBLAS, then the exchange as copy-engine copies of --chunk-kib row
  blocks into the peer's symmetric buffer, each followed by a device sleep so the stream moves no
  more than the cap (what NCCL over that NIC could do at best: no SM, no protocol), a device-side
  barrier (torch symmetric memory) once the copies are done, then the add (AR, RS). AG+GEMM
  exchanges first, then multiplies;
- ``net_alone``: that exchange alone; ``gbps`` is the pace it realised (calibrated to the cap);
- ``nccl_ib_model`` (baseline b, analytic): cublas + bytes / (0.92 x cap): NCCL over InfiniBand
  at 92% of line rate, no overlap (absent uncapped).

The fused row's ``speedup`` is over the FASTER baseline, ``fraction_hidden`` = clamp((ce_paced -
fused) / net_alone, 0, 1). Every chunk size run is reported (one --chunk-kib per process). The
helpers above the GPU section run on any CPU (tests/test_bench_emulated.py).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.distributed as dist

from mgraph.runtime.proxy.command import Rect

SHAPES = [(8192, 8192, 4096), (4096, 8192, 4096)]
CAPS = [50.0, 0.0]
OPS = ["gemm_allreduce", "gemm_reduce_scatter", "allgather_gemm"]
TOPOLOGY = "2x1"
TOL = 1e-2  # bf16 output against an fp32 reference
ITEMSIZE = 2  # bf16
NCCL_EFFICIENCY = 0.92  # NCCL over IB reaches about 92% of the line rate (baseline b)
IMPLS = ["cublas", "mgraph_fused", "ce_paced", "net_alone", "nccl_ib_model"]
Shape = tuple[int, int, int]


# -- pure helpers -------------------------------------------------------------------------------
def parse_shape(text: str) -> Shape:
    parts = text.split(",")
    if len(parts) != 3 or not all(p.strip().isdigit() and int(p) > 0 for p in parts):
        raise argparse.ArgumentTypeError(f"shape {text!r} is not M,N,K of three positive ints")
    return tuple(int(p) for p in parts)  # type: ignore[return-value]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", type=parse_shape, default=SHAPES)
    parser.add_argument("--ops", nargs="+", choices=OPS, default=OPS)
    parser.add_argument("--nic-gbps", nargs="+", type=float, default=CAPS, help="0: uncapped")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--chunk-kib", type=int, default=256, help="KiB per WRITE, fused and baseline")
    parser.add_argument("--timeout", type=float, default=30.0, help="bound on each device wait (s)")
    parser.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    args = parser.parse_args(argv)
    if not all(cap >= 0 for cap in args.nic_gbps):
        parser.error(f"--nic-gbps {args.nic_gbps}: caps are GB/s >= 0 (0: uncapped)")
    if args.reps < 1 or args.warmup < 0 or args.chunk_kib < 1 or not args.timeout > 0:
        parser.error("need --reps >= 1, --warmup >= 0, --chunk-kib >= 1 and --timeout > 0")
    return args


def chunk_rects(rows: int, cols: int, itemsize: int, chunk_bytes: int, buffer: int) -> list[Rect]:
    """Row blocks of ``buffer`` [rows, cols], at most ``chunk_bytes`` each (one row when a row
    alone is larger), tiling it exactly and in order."""
    step = max(1, chunk_bytes // (cols * itemsize))
    return [Rect(buffer, r, min(r + step, rows), 0, cols) for r in range(0, rows, step)]


def exchange_rows(op: str, shape: Shape, rank: int) -> tuple[int, int, int]:
    """What baseline (a) sends to the peer, as (first row, end row, columns) of the rank's
    exchanged matrix: AR the whole partial C [M, N]; RS the peer's half of C's rows; AG the
    rank's A shard [M/2, K] (it lands at the same rows of the peer's gathered A)."""
    M, N, K = shape
    half = M // 2
    if op == "gemm_allreduce":
        return 0, M, N
    if op == "gemm_reduce_scatter":
        peer = 1 - rank
        return peer * half, (peer + 1) * half, N
    if op == "allgather_gemm":
        return rank * half, (rank + 1) * half, K
    raise ValueError(f"unknown op {op!r}; valid: {', '.join(OPS)}")


def exchange_bytes(op: str, shape: Shape) -> int:
    """Bytes each rank sends per call (the same for both ranks and for NCCL's ring)."""
    r0, r1, cols = exchange_rows(op, shape, 0)
    return (r1 - r0) * cols * ITEMSIZE


def graph_kwargs(op: str, shape: Shape) -> dict[str, int]:
    """The global sizes of ``op``'s graph whose per-rank GEMM is ``shape`` on 2 ranks."""
    M, N, K = shape
    if op == "allgather_gemm":
        return {"M": M, "N": 2 * N, "K": K}
    return {"M": M, "N": N, "K": 2 * K}


def model_ms(gemm_ms: float, nbytes: int, cap_gbps: float) -> float | None:
    """Baseline (b): the GEMM, then NCCL over IB at NCCL_EFFICIENCY of the cap (no overlap);
    None uncapped (an infinitely fast NIC is a bound, not a baseline)."""
    if cap_gbps <= 0:
        return None
    return gemm_ms + nbytes / (NCCL_EFFICIENCY * cap_gbps * 1e9) * 1e3


def pace_sleep_us(chunk_bytes: int, cap_gbps: float, measured_us: float, slept_us: float) -> float:
    """Sleep per chunk that makes one chunk take chunk_bytes / cap: the current sleep corrected
    by how far the measured per-chunk time (copy + sleep + gaps) is from that target."""
    if cap_gbps <= 0:
        return 0.0
    target = chunk_bytes / (cap_gbps * 1e9) * 1e6
    return max(0.0, slept_us + target - measured_us)


def derived(fused_ms: float, ce_ms: float | None, model: float | None,
            net_ms: float | None) -> dict[str, float | str | None]:
    """The fused row's comparison: speedup over the FASTER baseline (named), and the share of
    the network time it hid relative to baseline (a)."""
    bases = {k: v for k, v in (("ce_paced", ce_ms), ("nccl_ib_model", model)) if v is not None}
    if not bases:
        return {"baseline": None, "speedup": None, "fraction_hidden": None}
    name = min(bases, key=bases.get)
    hidden = None
    if ce_ms is not None and net_ms:
        hidden = round(min(1.0, max(0.0, (ce_ms - fused_ms) / net_ms)), 3)
    return {"baseline": name, "speedup": round(bases[name] / fused_ms, 3),
            "fraction_hidden": hidden}  # fmt: skip


def table(rows: list[dict]) -> str:
    """Markdown: per op, shape, chunk and cap, each impl's ms and the faster baseline's ms over it."""
    def key(r: dict) -> tuple:
        return (r["op"], r["M"], r["N"], r["K"], r.get("chunk_kib"), r["nic_gbps"])

    lines = ["| op | M,N,K | chunk | NIC | impl | ms | faster baseline / ms | notes |",
             "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for k in dict.fromkeys(key(r) for r in rows):
        mine = sorted((r for r in rows if key(r) == k),
                      key=lambda r: IMPLS.index(r["impl"]) if r["impl"] in IMPLS else len(IMPLS))
        times = [r["ms"] for r in mine if r["impl"] in ("ce_paced", "nccl_ib_model") and r["ms"]]
        base = min(times) if times else None
        nic = f"{k[5]:g} GB/s" if k[5] else "uncapped"
        for r in mine:
            ms = r["ms"]
            notes = [f"FAILED: {r['error']}"] if "error" in r else []
            others = {k: e for k, e in (r.get("errors") or {}).items() if e != r.get("error")}
            notes += [f"rank {k}: {e}" for k, e in others.items()]
            for field, text in [("baseline", "vs {}"), ("fraction_hidden", "hides {:.2f} of net"),
                                ("gbps", "{:.1f} GB/s"), ("rel_err", "rel err {:.1e}")]:  # fmt: skip
                if r.get(field) is not None:
                    notes.append(text.format(r[field]))
            ratio = f"{base / ms:.2f}x" if base and ms else ""
            shown = "-" if ms is None else f"{ms:.3f}"
            lines.append(f"| {k[0]} | {k[1]},{k[2]},{k[3]} | {k[4]} KiB | {nic} | {r['impl']} | "
                         f"{shown} | {ratio} | {', '.join(notes)} |")  # fmt: skip
    return "\n".join(lines) + "\n"


# -- GPU (torchrun, 2 GPUs) ---------------------------------------------------------------------
def timeit(fn: Callable[[], object], warmup: int, reps: int) -> float:
    """CUDA events around ``fn`` on the current stream, median per rank, max over ranks. Every
    implementation, fused and baselines, is timed by this one function."""
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
    return max_over_ranks(statistics.median(times))


def max_over_ranks(value: float) -> float:
    t = torch.tensor([value], device="cuda", dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.reshape(-1).float(), want.reshape(-1).float()
    return ((got - want).norm() / want.norm()).item()


def local_output(graph: object, rank: int, full: torch.Tensor) -> torch.Tensor:
    """The rank's shard of the global output ``full``, as the graph binds its "out" buffer."""
    buf = next(b for b in graph.buffers.values()  # type: ignore[attr-defined]
               if b.rank == rank and b.role == "output" and b.binding is not None)
    parts = [full[tuple(slice(lo, hi) for lo, hi in p)] for p in buf.binding.pieces]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=buf.binding.cat_dim)


class SleepClock:
    """``torch.cuda._sleep`` spins for a number of SM cycles; measured once, in us per cycle."""

    def __init__(self) -> None:
        torch.cuda._sleep(1000)  # load it before timing
        cycles = 2_000_000
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        end.synchronize()
        self.us_per_cycle = start.elapsed_time(end) * 1e3 / cycles

    def sleep(self, us: float) -> None:
        if us > 0:
            torch.cuda._sleep(max(1, int(us / self.us_per_cycle)))


class PacedExchange:
    """Baseline (a)'s network: copy-engine copies of row blocks of this rank's ``src`` rows into
    the same rows of the peer's symmetric ``recv``, a sleep after each so the stream moves no
    more than the cap, then torch symmetric memory's device barrier (both ranks' copies done).
    Everything is on the current stream: CUDA events time it like the fused kernel."""

    def __init__(self, rows: int, cols: int, sent: tuple[int, int], chunk_bytes: int,
                 cap: float, clock: SleepClock, timeout: float) -> None:  # fmt: skip
        import torch.distributed._symmetric_memory as symm_mem

        self.rank, self.cap, self.clock = dist.get_rank(), cap, clock
        self.timeout_ms = int(timeout * 1e3)
        self.recv = symm_mem.empty(rows, cols, dtype=torch.bfloat16, device="cuda")
        self.handle = symm_mem.rendezvous(self.recv, dist.group.WORLD.group_name)
        self.peer_recv = self.handle.get_buffer(1 - self.rank, (rows, cols), torch.bfloat16)
        r0, r1 = sent
        self.blocks = [(r0 + r.row0, r0 + r.row1)
                       for r in chunk_rects(r1 - r0, cols, ITEMSIZE, chunk_bytes, 0)]
        self.chunk_bytes = (self.blocks[0][1] - self.blocks[0][0]) * cols * ITEMSIZE
        self.sleep_us = 0.0
        torch.cuda.synchronize()
        dist.barrier()

    def send(self, src: torch.Tensor) -> None:
        for r0, r1 in self.blocks:
            self.peer_recv[r0:r1].copy_(src[r0:r1], non_blocking=True)
            self.clock.sleep(self.sleep_us)
        self.handle.barrier(channel=0, timeout_ms=self.timeout_ms)

    def calibrate(self, src: torch.Tensor, reps: int) -> float:
        """Set the sleep per chunk so one chunk takes chunk_bytes / cap (two corrections, each
        from the measured time: the sleep kernels and the gaps between operations cost more than
        their nominal length). Returns the realised ms of one exchange."""
        ms = timeit(lambda: self.send(src), 1, reps)
        for _ in range(2 if self.cap > 0 else 0):
            per_chunk = ms * 1e3 / len(self.blocks)
            self.sleep_us = pace_sleep_us(self.chunk_bytes, self.cap, per_chunk, self.sleep_us)
            ms = timeit(lambda: self.send(src), 1, reps)
        return ms


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args, self.rank = args, dist.get_rank()
        self.rows: list[dict] = []
        self.clock = SleepClock()

    def add(self, op: str, shape: Shape, cap: float, impl: str, ms: float | None,
            **extra: object) -> dict:  # fmt: skip
        M, N, K = shape
        row = {"op": op, "M": M, "N": N, "K": K, "topology": TOPOLOGY, "nic_gbps": cap,
               "chunk_kib": self.args.chunk_kib, "impl": impl,
               "ms": None if ms is None else round(ms, 4)}  # fmt: skip
        row.update(extra)
        self.rows.append(row)
        if self.rank == 0:
            print(json.dumps(row), flush=True)
        return row

    def failed(self, op: str, shape: Shape, cap: float, impl: str, error: str | None,
               **extra: object) -> bool:  # fmt: skip
        """Whether ``impl`` failed on any rank; if so, its row records the error (no number):
        this rank's, and every rank's in ``errors`` (the first rank to fail is often the cause:
        a rank whose watchdog fired stops, and its peers then time out waiting for it)."""
        # Every rank takes the same branch (a lone rank in a collective would hang).
        errors: list[str | None] = [None] * dist.get_world_size()
        dist.all_gather_object(errors, error)
        if all(e is None for e in errors):
            return False
        self.add(op, shape, cap, impl, None, error=error or "failed on the other rank",
                 errors={str(r): e for r, e in enumerate(errors) if e is not None},
                 **extra)  # fmt: skip
        return True

    def case(self, op: str, shape: Shape) -> None:
        import mgraph as mg
        from mgraph.runtime.megakernel import local_shards

        graph = getattr(mg.ops, op)(topology=TOPOLOGY, dtype=torch.bfloat16,
                                    chunk_bytes=self.args.chunk_kib * 1024, **graph_kwargs(op, shape))
        inputs = mg.ops.get_op(op).random_inputs(graph, seed=1)
        local = {k: v.cuda() for k, v in local_shards(graph, self.rank, inputs).items()}
        full = inputs["a"].cuda().float() @ inputs["b"].cuda().float()
        want = local_output(graph, self.rank, full)
        del full
        schedule = mg.schedule(graph)
        a, b = local["a"], local["b"]
        for cap in self.args.nic_gbps:
            # AG+GEMM multiplies the gathered A: twice the local rows
            gemm_a = torch.cat([a, a]) if op == "allgather_gemm" else a
            gemm_ms = timeit(lambda: gemm_a @ b, self.args.warmup, self.args.reps)  # noqa: B023
            self.add(op, shape, cap, "cublas", gemm_ms)
            ce = self.ce_paced(op, shape, cap, a, b, want)
            model = model_ms(gemm_ms, exchange_bytes(op, shape), cap)
            self.add(op, shape, cap, "nccl_ib_model", model,
                     bytes=exchange_bytes(op, shape), efficiency=NCCL_EFFICIENCY)
            fused = self.fused(op, shape, cap, schedule, local, want)
            if fused is not None:
                ce_ms, net_ms, gbps = ce if ce is not None else (None, None, None)
                fused.update(ce_paced_ms=ce_ms, model_ms=None if model is None else round(model, 4),
                             net_gbps=gbps, **derived(fused["ms"], ce_ms, model, net_ms))
                if self.rank == 0:
                    print(json.dumps(fused), flush=True)
            gc.collect()
            torch.cuda.empty_cache()

    def fused(self, op: str, shape: Shape, cap: float, schedule: object,
              local: dict[str, torch.Tensor], want: torch.Tensor) -> dict | None:  # fmt: skip
        """Check once, time ``rt.launch``, check again: the row, or None when it failed."""
        from mgraph.runtime.megakernel import TritonRuntime
        from mgraph.settings import Settings

        rt, error, err = None, None, None
        try:  # every rank reaches each self.failed() (a collective) exactly once
            rt = TritonRuntime(schedule, settings=Settings.from_env(nic_gbps=cap))
            err = rel(rt.run(local).outputs["out"], want)
            if not err <= TOL:  # NaN fails too
                error = f"wrong result: rel err {err:.3g} > {TOL:g}"
        except Exception as exc:  # noqa: BLE001  recorded in the row
            error = f"{type(exc).__name__}: {exc}"
        try:
            if self.failed(op, shape, cap, "mgraph_fused", error, rel_err=err):
                return None
            ms = timeit(rt.launch, self.args.warmup, self.args.reps)
            try:
                rt.check()
            except Exception as exc:  # noqa: BLE001
                error = f"after timing: {type(exc).__name__}: {exc}"
            if self.failed(op, shape, cap, "mgraph_fused", error, rel_err=err):
                return None
            return self.add(op, shape, cap, "mgraph_fused", ms, rel_err=round(err, 5))
        finally:
            if rt is not None:
                rt.close()  # stops its host proxy

    def ce_paced(self, op: str, shape: Shape, cap: float, a: torch.Tensor, b: torch.Tensor,
                 want: torch.Tensor) -> tuple[float, float, float] | None:  # fmt: skip
        """Baseline (a), checked once then timed, and its exchange alone: (ms, net ms, realised
        GB/s), or None when the check failed."""
        M, N, K = shape
        r0, r1, cols = exchange_rows(op, shape, self.rank)
        # recv is C's shape (AR, RS) or the gathered A's [M, K] (AG): M rows of ``cols`` either way
        ex = PacedExchange(M, cols, (r0, r1), self.args.chunk_kib * 1024, cap, self.clock,
                           self.args.timeout)
        if op == "allgather_gemm":
            src = ex.recv  # our shard goes to our rows of both ranks' gathered A
            out = torch.empty(M, b.shape[1], dtype=torch.bfloat16, device="cuda")

            def call() -> torch.Tensor:
                src[r0:r1].copy_(a, non_blocking=True)
                ex.send(src)
                return torch.matmul(ex.recv, b, out=out)
        else:
            src = torch.empty(M, N, dtype=torch.bfloat16, device="cuda")
            mine = slice(0, M) if op == "gemm_allreduce" else slice(self.rank * M // 2,
                                                                    (self.rank + 1) * M // 2)
            out = torch.empty_like(src[mine])

            def call() -> torch.Tensor:
                torch.matmul(a, b, out=src)
                ex.send(src)
                return torch.add(src[mine], ex.recv[mine], out=out)

        error, err = None, float("nan")
        try:
            ex.recv.fill_(float("nan"))
            if op == "allgather_gemm":
                src[r0:r1].copy_(a)
            else:
                torch.matmul(a, b, out=src)
            net_ms = ex.calibrate(src, max(3, self.args.reps // 2))
            torch.cuda.synchronize()
            dist.barrier()
            ex.recv.fill_(float("nan"))
            torch.cuda.synchronize()
            dist.barrier()
            err = rel(call(), want)
            if not err <= TOL:
                error = f"wrong result: rel err {err:.3g} > {TOL:g}"
        except Exception as exc:  # noqa: BLE001  recorded in the row
            error = f"{type(exc).__name__}: {exc}"
        if self.failed(op, shape, cap, "ce_paced", error, rel_err=err):
            return None
        ms = timeit(call, self.args.warmup, self.args.reps)
        net_ms = max_over_ranks(net_ms)
        gbps = round(exchange_bytes(op, shape) / (net_ms * 1e6), 2)
        self.add(op, shape, cap, "ce_paced", ms, rel_err=round(err, 5))
        self.add(op, shape, cap, "net_alone", net_ms, gbps=gbps, chunks=len(ex.blocks),
                 sleep_us=round(ex.sleep_us, 2))
        return round(ms, 4), net_ms, gbps


def main(argv: Sequence[str] | None = None) -> None:
    # Here, not at import: the CPU tests import this module. CUDA and NCCL read them at init.
    os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")  # GPU.md: lazy loading vs spinning
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")
    args = parse_args(argv)
    rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
    if dist.get_world_size() != 2:
        raise SystemExit("bench_emulated: topology 2x1 needs torchrun --nproc_per_node=2")
    bench = Bench(args)
    start = time.time()
    for op in args.ops:
        for shape in args.shapes:
            bench.case(op, shape)
    if rank == 0:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "bench_emulated.json").write_text(json.dumps(bench.rows, indent=1))
        (out / "bench_emulated.md").write_text(table(bench.rows))
        print(table(bench.rows), flush=True)
        print(f"total {time.time() - start:.0f} s", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
