"""GEMM+AllReduce across 2 emulated nodes: the fused megakernel against a sequential baseline
that crosses the same emulated NIC, on the same inputs in the same run.

Run: torchrun --nproc_per_node=2 benchmarks/bench_emulated.py [--shapes M,N,K ...]
         [--nic-gbps 50 0] [--out DIR]

Two GPUs of one host act as 2 nodes of 1 GPU (topology "2x1"): inter-node bytes go GPU -> command
FIFO -> native host proxy -> copy engine into the peer's memory, paced like a NIC of nic_gbps
GB/s (0: uncapped). Shapes are PER-RANK GEMMs [M, K] @ [K, N] (global K = 2K, as in bench_tp).
Per shape and cap: ``cublas`` (GEMM alone), ``mgraph_fused`` (checked against torch, then timed),
``sequential`` (cuBLAS; the host pushes the partial C in --chunk-kib row blocks through its own
FIFO + native proxy + cuda_ipc transport at the same cap, waits for the peer's partial and its
own sends, as the fused kernel does at exit, and adds), ``net_alone`` (that exchange without the
GEMM). Medians, max over ranks; CUDA events, wall clock for the host-driven rows. The fused row
gets fraction_hidden = clamp((sequential - fused) / net_ms, 0, 1) and speedup = sequential /
fused. The helpers above the GPU section run on any CPU (tests/test_bench_emulated.py).
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

from mgraph.errors import ProxyError
from mgraph.runtime.proxy.command import Command, Rect

SHAPES = [(8192, 8192, 4096), (4096, 8192, 4096)]
CAPS = [50.0, 0.0]
TOPOLOGY = "2x1"
TOL = 1e-2  # bf16 output against an fp32 reference
ITEMSIZE = 2  # bf16
SRC, RECV = 0, 1  # registered buffers: this rank's partial C, the peer's partial arriving
ARRIVED, SENT = 0, 1  # flag words (running counts): peer chunks arrived, own chunks sent
IMPLS = ["cublas", "mgraph_fused", "sequential", "net_alone"]
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
    parser.add_argument("--nic-gbps", nargs="+", type=float, default=CAPS, help="0: uncapped")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--chunk-kib", type=int, default=256, help="KiB per WRITE, fused and sequential")
    parser.add_argument("--timeout", type=float, default=30.0, help="bound on each host wait (s)")
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


def fifo_capacity(commands: int) -> int:
    """The smallest power of two holding one exchange: the host never waits for a slot."""
    return max(2, 1 << (commands - 1).bit_length())


def exchange_commands(rank: int, peer: int, rects: Sequence[Rect], itemsize: int,
                      epoch: int) -> list[Command]:  # fmt: skip
    """Each chunk of ``rank``'s SRC into the same rows of ``peer``'s RECV, raising the peer's
    ARRIVED word and, once the copy is done, this rank's SENT word."""
    return [
        Command.write(rank, r, peer, r._replace(buffer=RECV), bytes=r.numel * itemsize,
                      event=ARRIVED, done_event=SENT, epoch=epoch)  # fmt: skip
        for r in rects
    ]


def wait_flags(read: Callable[[], Sequence[int]], targets: Sequence[int], names: Sequence[str],
               timeout: float, check: Callable[[], None] = lambda: None) -> None:  # fmt: skip
    """Poll ``read()`` until every word reaches its target; ``check`` raises a proxy's own error
    early. After ``timeout`` s, a ProxyError naming the words that fell short."""
    deadline = time.monotonic() + timeout
    while True:
        values = list(read())
        if all(v >= t for v, t in zip(values, targets, strict=True)):
            return
        check()
        if time.monotonic() > deadline:
            short = [f"{n}: {v} of {t}" for n, v, t in zip(names, values, targets, strict=True)]
            raise ProxyError(
                f"sequential exchange: waited {timeout:g} s for {'; '.join(short)}",
                hint="did the peer rank fail or stop pushing? (its log has the root cause)",
            )
        time.sleep(0)


def derived(sequential_ms: float, fused_ms: float, net_ms: float) -> dict[str, float]:
    """The share of the network time the fused kernel hid, and its speedup."""
    hidden = (sequential_ms - fused_ms) / net_ms if net_ms > 0 else 0.0
    return {"fraction_hidden": round(min(1.0, max(0.0, hidden)), 3),
            "speedup": round(sequential_ms / fused_ms, 3)}  # fmt: skip


def table(rows: list[dict]) -> str:
    """Markdown: per shape and cap, each impl's ms and sequential's ms over it."""
    keys = list(dict.fromkeys((r["M"], r["N"], r["K"], r["nic_gbps"]) for r in rows))
    lines = ["| M,N,K | NIC | impl | ms | vs sequential | notes |", "|---|---|---|---|---|---|"]
    for key in keys:
        mine = [r for r in rows if (r["M"], r["N"], r["K"], r["nic_gbps"]) == key]
        mine.sort(key=lambda r: IMPLS.index(r["impl"]) if r["impl"] in IMPLS else len(IMPLS))
        base = next((r["ms"] for r in mine if r["impl"] == "sequential"), None)
        nic = f"{key[3]:g} GB/s" if key[3] else "uncapped"
        for r in mine:
            ms = r["ms"]
            notes = [f"FAILED: {r['error']}"] if "error" in r else []
            for field, text in [("fraction_hidden", "hides {:.2f} of net"),
                                ("push_ms", "host push {:.2f} ms"), ("gbps", "{:.1f} GB/s"),
                                ("rel_err", "rel err {:.1e}")]:  # fmt: skip
                if r.get(field) is not None:
                    notes.append(text.format(r[field]))
            ratio = f"{base / ms:.2f}x" if base and ms else ""
            shown = "-" if ms is None else f"{ms:.3f}"
            lines.append(f"| {key[0]},{key[1]},{key[2]} | {nic} | {r['impl']} | {shown} | "
                         f"{ratio} | {', '.join(notes)} |")  # fmt: skip
    return "\n".join(lines) + "\n"


# -- GPU (torchrun, 2 GPUs) ---------------------------------------------------------------------
def timeit(fn: Callable[[], object], warmup: int, reps: int) -> float:
    """bench_tp.timeit: CUDA events around ``fn``, median per rank, max over ranks."""
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
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


class HostExchange:
    """The sequential baseline's network: this rank's FIFO, native proxy and cuda_ipc transport.
    RECV and the flags are symmetric memory, so this rank's proxy copies straight into the
    peer's RECV and raises the peer's ARRIVED word (a running count, never reset)."""

    def __init__(self, M: int, N: int, cap: float, chunk_bytes: int, batch: int, timeout: float):
        import torch.distributed._symmetric_memory as symm_mem

        from mgraph.runtime.proxy import CommandFifo, CudaIpcTransport, NativeProxy

        self.rank, self.timeout, self.epoch = dist.get_rank(), timeout, 0
        from mgraph.settings import Settings

        self.peer = 1 - self.rank
        device = torch.device("cuda", torch.cuda.current_device())
        group = dist.group.WORLD.group_name
        self.src = torch.empty(M, N, dtype=torch.bfloat16, device=device)
        self.out = torch.empty_like(self.src)
        self.recv = symm_mem.empty(M, N, dtype=torch.bfloat16, device=device)
        self.flags = symm_mem.empty(2, dtype=torch.int32, device=device).zero_()
        recv_handle = symm_mem.rendezvous(self.recv, group)
        flags_handle = symm_mem.rendezvous(self.flags, group)
        recv_peer = recv_handle.get_buffer(self.peer, (M, N), torch.bfloat16)
        flags_peer = flags_handle.get_buffer(self.peer, (2,), torch.int32)
        store = dist.distributed_c10d._get_default_store()
        self.transport = CudaIpcTransport(store, {self.rank: device.index}, bandwidth=cap * 1e9)
        self.transport.register_mapped(self.rank, {SRC: self.src, RECV: self.recv}, self.flags)
        self.transport.register_mapped(self.peer, {RECV: recv_peer}, flags_peer)
        self.transport.connect(self.rank, self.peer)
        self.rects = chunk_rects(M, N, ITEMSIZE, chunk_bytes, SRC)
        self.fifo = CommandFifo(fifo_capacity(len(self.rects)), timeout=timeout, pinned=True)
        self.proxy = NativeProxy(self.fifo, self.transport, batch, rank=self.rank,
                                 name=f"sequential-rank{self.rank}", timeout=timeout,
                                 bandwidth=cap * 1e9, idle_sleep_us=0,
                                 flag_copy=Settings.from_env().gpu_flags == "copy",  # as fused
                                 ).start()  # fmt: skip
        self.names = [
            f"flag word {ARRIVED} (chunks from rank {self.peer} arrived on rank {self.rank})",
            f"flag word {SENT} (rank {self.rank}'s own sends done)",
        ]
        torch.cuda.synchronize()
        dist.barrier()  # both ranks' flags are zero before either proxy raises one

    def run(self, a: torch.Tensor | None = None,
            b: torch.Tensor | None = None) -> tuple[float, float]:  # fmt: skip
        """One exchange (with the GEMM before it and the add after it when given ``a`` and
        ``b``): (wall ms, host push ms). Returns once our sends are done: SRC may be rewritten."""
        self.epoch += 1
        target = self.epoch * len(self.rects)
        cmds = exchange_commands(self.rank, self.peer, self.rects, ITEMSIZE, self.epoch)
        torch.cuda.synchronize()
        dist.barrier()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        if a is not None:
            torch.matmul(a, b, out=self.src)
            torch.cuda.current_stream().synchronize()
        pushing = time.perf_counter()
        for cmd in cmds:
            self.fifo.push(cmd)
        push_ms = (time.perf_counter() - pushing) * 1e3
        wait_flags(self.flags.tolist, [target, target], self.names, self.timeout, self.proxy.check)
        if a is not None:
            torch.add(self.src, self.recv, out=self.out)
            torch.cuda.current_stream().synchronize()
        return (time.perf_counter() - t0) * 1e3, push_ms

    def close(self, failed: bool) -> None:
        (self.proxy.abort if failed else self.proxy.stop)()
        self.transport.close()


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args, self.rank = args, dist.get_rank()
        self.rows: list[dict] = []

    def add(self, shape: Shape, cap: float, impl: str, ms: float | None, **extra: object) -> dict:
        M, N, K = shape
        row = {"op": "gemm_allreduce", "M": M, "N": N, "K": K, "topology": TOPOLOGY,
               "nic_gbps": cap, "impl": impl, "ms": None if ms is None else round(ms, 4)}
        row.update(extra)
        self.rows.append(row)
        if self.rank == 0:
            print(json.dumps(row), flush=True)
        return row

    def failed(self, shape: Shape, cap: float, impl: str, error: str | None,
               **extra: object) -> bool:  # fmt: skip
        """Whether ``impl`` failed on any rank; if so, its row records the error (no number)."""
        # Every rank takes the same branch (a lone rank in a collective would hang).
        if max_over_ranks(float(error is not None)) == 0:
            return False
        self.add(shape, cap, impl, None, error=error or "failed on the other rank", **extra)
        return True

    def shape(self, shape: Shape) -> None:
        import mgraph as mg
        from mgraph.runtime.megakernel import local_shards

        M, N, K = shape
        # the fused inter-node chunks are as large as the baseline's (--chunk-kib)
        graph = mg.ops.gemm_allreduce(M=M, N=N, K=2 * K, topology=TOPOLOGY, dtype=torch.bfloat16,
                                      chunk_bytes=self.args.chunk_kib * 1024)
        inputs = mg.ops.get_op("gemm_allreduce").random_inputs(graph, seed=1)
        local = {k: v.cuda() for k, v in local_shards(graph, self.rank, inputs).items()}
        a, b = local["a"], local["b"]
        want = a.float() @ b.float()
        dist.all_reduce(want)
        schedule = mg.schedule(graph)
        for cap in self.args.nic_gbps:
            self.add(shape, cap, "cublas", timeit(lambda: a @ b, self.args.warmup, self.args.reps))
            fused = self.fused(shape, cap, schedule, local, want)
            seq = self.sequential(shape, cap, a, b, want)
            if fused is not None and seq is not None:
                fused.update(net_ms=round(seq[1], 4), **derived(seq[0], fused["ms"], seq[1]))
                if self.rank == 0:
                    print(json.dumps(fused), flush=True)
            gc.collect()
            torch.cuda.empty_cache()

    def fused(self, shape: Shape, cap: float, schedule: object, local: dict[str, torch.Tensor],
              want: torch.Tensor) -> dict | None:  # fmt: skip
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
            if self.failed(shape, cap, "mgraph_fused", error, rel_err=err):
                return None
            ms = timeit(rt.launch, self.args.warmup, self.args.reps)
            try:
                rt.check()
            except Exception as exc:  # noqa: BLE001
                error = f"after timing: {type(exc).__name__}: {exc}"
            if self.failed(shape, cap, "mgraph_fused", error, rel_err=err):
                return None
            return self.add(shape, cap, "mgraph_fused", ms, rel_err=round(err, 5))
        finally:
            if rt is not None:
                rt.close()  # stops its host proxy

    def sequential(self, shape: Shape, cap: float, a: torch.Tensor, b: torch.Tensor,
                   want: torch.Tensor) -> tuple[float, float] | None:  # fmt: skip
        """Check once, then time the exchange alone and the whole sequence: (sequential ms,
        net ms), or None when the check failed."""
        from mgraph.settings import Settings

        M, N, _ = shape
        w, n = self.args.warmup, self.args.reps
        ex = HostExchange(M, N, cap, self.args.chunk_kib * 1024, Settings.from_env().proxy_batch,
                          self.args.timeout)  # fmt: skip
        ok = False
        try:
            ex.recv.fill_(float("nan"))
            ex.out.fill_(float("nan"))
            ex.run(a, b)
            err = rel(ex.out, want)
            error = None if err <= TOL else f"wrong result: rel err {err:.3g} > {TOL:g}"
            if self.failed(shape, cap, "sequential", error, rel_err=err):
                return None
            net = [ex.run()[0] for _ in range(w + n)][w:]
            runs = [ex.run(a, b) for _ in range(w + n)][w:]
            ok = True
        finally:
            ex.close(failed=not ok)
        net_ms = max_over_ranks(statistics.median(net))
        seq_ms = max_over_ranks(statistics.median(t for t, _ in runs))
        push_ms = max_over_ranks(statistics.median(p for _, p in runs))
        self.add(shape, cap, "sequential", seq_ms, push_ms=round(push_ms, 4), rel_err=round(err, 5))
        gbps = M * N * ITEMSIZE / (net_ms * 1e6)
        self.add(shape, cap, "net_alone", net_ms, gbps=round(gbps, 2), chunks=len(ex.rects))
        return seq_ms, net_ms


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
    for shape in args.shapes:
        bench.shape(shape)
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
