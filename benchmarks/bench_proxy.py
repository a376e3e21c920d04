"""The GPU-initiated network path on one host: a Triton kernel pushes commands, the native proxy
moves the data with the copy engine, a kernel on the other GPU sees the flags.

- producer (GPU0, persistent Triton kernel, ``NPROG`` programs): stamps %globaltimer, then
  ``hostfifo.push``es a precomputed 16-word command row into the CommandFifo (pinned host ring);
- NativeProxy over CudaIpcTransport (``register_mapped``: one process drives both GPUs): drains
  the ring, cudaMemcpyAsync into the destination, then cuStreamWriteValue32 of the destination's
  flag word (a running count);
- consumer (GPU1, or GPU0 for "loopback"): waits for watched flags to reach their counts and
  stamps %globaltimer when each arrives.

Benches (rows: bench, kind, chunk_bytes, commands, cap_gbps, path, ms, commands_per_s, gb_per_s,
latency_us_median/p10/p90, ok, error):
  drain     NOP, SIGNAL or 64 KiB WRITE commands from 8 producers, ~0.2 s worth: commands/s.
  latency   one command in flight (the producer waits for the source-side done flag, raised after
            the destination flag on the proxy's stream): push -> destination flag, per command.
            ``roundtrip_us_median`` (push -> done flag, both on GPU0's clock) bounds it;
            ``push_us_median`` is the producer's push call alone (the GPU's share before the
            proxy can see the command).
  bandwidth 64 KiB / 256 KiB / 1 MiB WRITEs, uncapped and paced at 50 GB/s, data checked.
Protocols (``--protocols``, NativeProxy options; the first runs every bench, the others the
latency bench only, to compare in one run): ``old`` one call per flag word (the proxy's default
again: NOTES v14 measured ``new`` slower on one H200), ``new`` fused flags (a WRITE with its
destination and done words is 2 CUDA calls, data then one call for both flags; 3 with ``old``),
``new+driver`` fused with the data copy through the driver's cuMemcpyAsync,
``new+gpufence`` fused memop flags after one GPU-scope barrier per call instead of a system-wide
one per store (in force where all memory is on the proxy's GPU: loopback; ``cuda_apis`` says;
memop rows only, copy-engine flags have no barrier; on the H200 of NOTES v14 every such call
failed with "invalid argument", so it is not among the default protocols), ``hostflags`` both sides' flag words in
pinned host memory, raised by the proxy with host stores once its stream executed the data
(no flag call: 1 CUDA call per WRITE in flight; rows with flags "host", one stream),
``kernel`` WRITEs of up to 64 KiB as ONE launch of a one-CTA copy-and-flag kernel that copies
and then raises the flags with a release store (runtime/proxy/native/copy_kernel.h: no second
stream operation after the copy; one stream only, so it skips the rows with several; it also
runs the 64 KiB WRITE drain, a throughput row; ``kernel_writes`` counts its launches).
(``mailbox``, one persistent CTA polling a descriptor ring, was removed after v20's run:
slower than the default on every row, benchmarks/results/v20/call3_hang_proxy/.)
Every row carries ``cuda_calls_per_cmd`` (the proxy's queueing calls / commands), the host time
of a data call and of a flag call (``data_call_us``, ``flag_call_us``), and the latency
rows a canary: the consumer reads the first and last element of a command's destination chunk
(NaN until written) right after its flag arrives, and counts arrivals that came before the data.
``--streams 1 4`` runs every case with each number of proxy copy streams (NativeProxy
``streams``, Settings.proxy_streams): commands carry lanes as netplan.py assigns them (flag word
f on lane (f // LANE_BLOCK) % LANES, so a word keeps one stream and neighbouring words of a lane
go out in one flag copy).
Every row is checked (statuses, final flag counts, destination == source); a failed check makes
the row an error with no numbers, and the exit status non-zero.

Run (2 GPUs):  python benchmarks/bench_proxy.py --out benchmarks/results [--quick]
Run (CPU):     python benchmarks/bench_proxy.py --out /tmp/bp --cpu --quick
``--cpu`` runs the same kernels under TRITON_INTERPRET=1 on host memory (InProcessTransport, host
flag words, memmove): it proves the harness and the protocol; its timings mean nothing.
"""

from __future__ import annotations

import os
import sys

# Before torch/triton are imported: the interpreter is chosen when triton loads, and lazy module
# loading deadlocks against spinning kernels (GPU.md, "The host-proxy path").
os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")
if "--cpu" in sys.argv[1:]:
    os.environ["TRITON_INTERPRET"] = "1"

import argparse  # noqa: E402
import faulthandler  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402
from contextlib import nullcontext  # noqa: E402
from dataclasses import asdict, dataclass  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from mgraph.errors import ProxyError  # noqa: E402
from mgraph.runtime.megakernel.hostfifo import CMD_WORDS, push  # noqa: E402
from mgraph.runtime.megakernel.netplan import LANE_BLOCK, LANES  # noqa: E402
from mgraph.runtime.megakernel.sync import now, wait  # noqa: E402
from mgraph.runtime.proxy import Command, CommandFifo, InProcessTransport, Rect, Word  # noqa: E402
from mgraph.runtime.proxy.command import encode  # noqa: E402
from mgraph.runtime.proxy.native import NativeProxy  # noqa: E402

KiB, MiB = 1024, 1024 * 1024
# NativeProxy options per protocol (module docstring): "old" is the one before issue 15 item 2.
PROTOCOLS = {
    "old": {"fuse_flags": False, "driver_copy": False},
    "new": {"fuse_flags": True, "driver_copy": False},
    "new+driver": {"fuse_flags": True, "driver_copy": True},
    "new+gpufence": {"fuse_flags": True, "gpu_fence": True},  # memop flags only
    "hostflags": {"fuse_flags": True},  # flags in pinned host memory (rows: flags "host")
    # WRITEs up to 64 KiB as ONE launch of the copy-and-flag kernel (copy_kernel.h); larger
    # ones, and SIGNALs, as "old"; one stream only
    "kernel": {"fuse_flags": False, "copy_kernel_bytes": 64 * 1024},
}
# Protocols that also run the 64 KiB WRITE drain (a throughput row beside the first protocol's)
THROUGHPUT_TOO = ("kernel",)
MAX_FLAGS = 1024  # flag words per side; command k of those raising an event uses word k % 1024
TARGETS = {"drain": 200e3, "latency": 10.0, "bandwidth": 45.0}  # k cmd/s, median us, GB/s@256K
_EPOCH = 1
METRICS = ("ms", "commands_per_s", "gb_per_s", "latency_us_median", "latency_us_p10",
           "latency_us_p90")  # fmt: skip


@triton.jit(do_not_specialize=["capacity", "n_cmds", "epoch"])
def _producer(ring, dhead, tail, capacity, rows, n_cmds, epoch, push_ns, pushed_ns, done_ns,
              done_flags, watch_flag, watch_target, status, abort, limit,
              NPROG: tl.constexpr, WAIT_DONE: tl.constexpr, ASM: tl.constexpr):  # fmt: skip
    # Program p pushes commands p, p + NPROG, ...: its last one is among the last NPROG.
    i = tl.program_id(0)
    ok = 1
    while (i < n_cmds) & (ok == 1):
        start = now(ASM)
        ticket, seen = push(ring, dhead, tail, capacity, rows + i * CMD_WORDS, epoch, limit,
                            abort, ASM)  # fmt: skip
        tl.store(push_ns + i, start)
        tl.store(pushed_ns + i, now(ASM))  # push returned: its release store of the header issued
        if ticket - seen >= capacity:  # the ring stayed full for `limit`: the proxy is stuck
            tl.store(status, i)
            ok = 0
        elif WAIT_DONE:  # one in flight: watch entry i is command i (latency bench)
            target = tl.load(watch_target + i)
            seen_done = wait(done_flags + tl.load(watch_flag + i), target, limit, abort, ASM)
            tl.store(done_ns + i, now(ASM))
            if seen_done < target:
                tl.store(status, i)
                ok = 0
        i += NPROG


@triton.jit(do_not_specialize=["n_watch"])
def _consumer(flags, watch_flag, watch_target, n_watch, arrive_ns, status, abort, limit, dst,
              cols, n_slots, ASM: tl.constexpr, CANARY: tl.constexpr):  # fmt: skip
    k = 0
    ok = 1
    early = tl.zeros((), dtype=tl.int32)  # a tensor even where CANARY prunes its updates
    while (k < n_watch) & (ok == 1):
        target = tl.load(watch_target + k)
        seen = wait(flags + tl.load(watch_flag + k), target, limit, abort, ASM)
        tl.store(arrive_ns + k, now(ASM))
        if seen < target:
            tl.store(status, k)
            tl.store(status + 1, seen.to(tl.int64))
            ok = 0
        elif CANARY:  # watch k is command k, whose chunk is k % n_slots: written by now?
            row = dst + (k % n_slots).to(tl.int64) * cols
            # NaN (not yet written) by its bits: no compiler may fold the test away
            first = tl.load(row, volatile=True).to(tl.int32, bitcast=True) & 0x7FFFFFFF
            last = tl.load(row + cols - 1, volatile=True).to(tl.int32, bitcast=True) & 0x7FFFFFFF
            early += ((first > 0x7F800000) | (last > 0x7F800000)).to(tl.int32)
        k += 1
    tl.store(status + 2, early.to(tl.int64))


@dataclass
class Case:
    bench: str
    kind: str  # nop | signal | write
    chunk_bytes: int
    commands: int
    cap_gbps: float
    path: str  # gpu0->gpu1 | loopback | cpu-interpreter
    producers: int = 8
    flags: str = "copy"  # how the proxy raises GPU flags: copy-engine copy | stream memop
    streams: int = 1  # the proxy's copy streams
    protocol: str = "new"  # PROTOCOLS: the proxy's CUDA calls per command


class Rig:
    """Where things live: two GPUs (or one, loopback) or, with ``cpu``, host memory."""

    def __init__(self, cpu: bool) -> None:
        self.cpu = cpu
        self.capacity = 16 if cpu else 1024  # small on the CPU: wrap-around and back-pressure
        # Bounded waits: ns of %globaltimer on the GPU, polls in the interpreter.
        self.limit = 5_000 if cpu else 5_000_000_000  # an interpreted poll takes ~0.5 ms
        self.deadline = 60 if cpu else 75  # s for a whole case; then it prints its state, exits
        self.slot_bytes = 64 * KiB if cpu else 256 * MiB  # distinct chunks, reused round-robin

    def devices(self, path: str) -> tuple[torch.device, torch.device]:
        if self.cpu:
            return torch.device("cpu"), torch.device("cpu")
        return torch.device("cuda", 0), torch.device("cuda", 0 if path == "loopback" else 1)

    def transport(self, src: torch.device, dst: torch.device, bufs: dict, flags: dict):
        if self.cpu:
            t = InProcessTransport(lambda *_: None)  # the native path raises host flag words
            for r in (0, 1):
                t.register(r, {0: bufs[r]})
                t.register_flags(r, flags[r])
        else:
            import torch.distributed as dist

            from mgraph.runtime.proxy import CudaIpcTransport

            # register_mapped: one process drives both GPUs, so nothing goes through the store
            t = CudaIpcTransport(dist.HashStore(), {0: src.index, 1: dst.index})
            for r in (0, 1):
                t.register_mapped(r, {0: bufs[r]}, flags[r])
        t.connect(0, 1)
        return t


def build(case: Case, cols: int, n_slots: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Command rows (n, 16), the watch list (flag, target) and each flag's final count."""
    n, nprog = case.commands, case.producers
    i = torch.arange(n, dtype=torch.int64)
    raises = torch.ones(n, dtype=torch.bool)
    if case.kind == "nop":  # only each producer's last command raises: it is after its NOPs
        raises = i >= n - nprog
    k = torch.cumsum(raises.long(), 0) - 1  # index among the commands that raise an event
    n_flags = max(1, min(MAX_FLAGS, int(raises.sum())))
    flag = torch.where(raises, k % n_flags, torch.full_like(i, -1))
    target = torch.where(raises, k // n_flags + 1, torch.zeros_like(i))
    signal = torch.tensor(encode(Command.signal(0, 1, 0), seq=1), dtype=torch.int64)
    if case.kind == "write":
        whole = Rect(0, 0, 1, 0, cols)
        done = 0 if case.bench == "latency" else -1
        cmd = Command.write(0, whole, 1, whole, bytes=case.chunk_bytes, event=0, done_event=done)
    else:
        cmd = Command.nop() if case.kind == "nop" else Command.signal(0, 1, 0)
    rows = torch.tensor(encode(cmd, seq=1), dtype=torch.int64).repeat(n, 1)
    rows[raises & (case.kind == "nop")] = signal
    rows[:, Word.HEADER] &= 0xFF  # the kernel writes the sequence number
    rows[:, Word.EVENT] = flag
    # Lanes as netplan.py gives them: every raise of a flag word from one lane (one stream).
    rows[:, Word.LANE] = torch.where(flag >= 0, (flag // LANE_BLOCK) % LANES, 0)
    if case.kind == "write":
        j = i % n_slots
        rows[:, Word.SRC_ROWS] = rows[:, Word.DST_ROWS] = (j << 32) | (j + 1)
        if case.bench == "latency":
            rows[:, Word.DONE_EVENT] = flag
    counts = torch.bincount(flag[raises], minlength=n_flags)
    if case.bench == "latency":  # watch every command (and the producer waits for each)
        watch = torch.stack([flag, target], 1)
    else:  # watch each flag's last raise only: the consumer never lags behind the arrivals
        last = torch.zeros(n_flags, dtype=torch.int64)
        last.scatter_reduce_(0, flag[raises], i[raises], "amax")  # each flag's last command
        order = flag[last.sort().values]
        watch = torch.stack([order, counts[order]], 1)
    return rows, watch.int(), counts.int()


def quantiles(us: torch.Tensor) -> dict:
    q = torch.quantile(us.double(), torch.tensor([0.1, 0.5, 0.9], dtype=torch.float64)).tolist()
    return {"latency_us_p10": round(q[0], 2), "latency_us_median": round(q[1], 2),
            "latency_us_p90": round(q[2], 2)}  # fmt: skip


def run_case(case: Case, rig: Rig) -> dict:
    row: dict = {**asdict(case), **dict.fromkeys(METRICS), "ok": False, "error": None}
    src_dev, dst_dev = rig.devices(case.path)
    cols = max(1, case.chunk_bytes // 4)  # float32 rows; NOP/SIGNAL still need a buffer
    n_slots = max(1, min(case.commands, rig.slot_bytes // max(case.chunk_bytes, 4)))
    rows, watch, counts = build(case, cols, n_slots)
    n, n_flags, n_watch = case.commands, counts.numel(), watch.shape[0]
    src = torch.randn(n_slots, cols, device=src_dev)
    dst = torch.full((n_slots, cols), float("nan"), device=dst_dev)
    # "host" flags: pinned host words the kernels poll and the proxy raises itself (hostflags)
    pin = case.flags == "host" and not rig.cpu
    flags = {r: torch.zeros(n_flags, dtype=torch.int32, device="cpu" if pin else dev,
                            pin_memory=pin) for r, dev in ((0, src_dev), (1, dst_dev))}  # fmt: skip
    transport = rig.transport(src_dev, dst_dev, {0: src, 1: dst}, flags)
    fifo = CommandFifo(rig.capacity) if rig.cpu else CommandFifo(rig.capacity, pinned=True)
    # coalesce=False: each command is one transfer, so the chunk size is what gets measured.
    # idle_sleep_us=0: the loop spins, as a GPU's proxy must to see a push within microseconds.
    proxy = NativeProxy(fifo, transport, 32, rank=0, timeout=30, coalesce=False,
                        bandwidth=case.cap_gbps * 1e9, idle_sleep_us=0,
                        flag_copy=case.flags == "copy", streams=case.streams,
                        **PROTOCOLS[case.protocol])  # fmt: skip

    def full(size: int, dtype: torch.dtype, dev: torch.device, fill: int = 0) -> torch.Tensor:
        return torch.full((size,), fill, dtype=dtype, device=dev)

    rows_d = rows.to(src_dev)
    # (flag, target) columns as separate contiguous arrays: the kernels index them by position
    w_src = [watch[:, c].contiguous().to(src_dev) for c in (0, 1)]
    w_dst = [watch[:, c].contiguous().to(dst_dev) for c in (0, 1)]
    dhead = full(1, torch.int64, src_dev)
    push_ns, done_ns = full(n, torch.int64, src_dev), full(n, torch.int64, src_dev)
    pushed_ns = full(n, torch.int64, src_dev)
    arrive_ns = full(n_watch, torch.int64, dst_dev)
    p_status, c_status = full(1, torch.int64, src_dev, -1), full(3, torch.int64, dst_dev, -1)
    p_abort, c_abort = full(1, torch.int32, src_dev), full(1, torch.int32, dst_dev)
    asm = not rig.cpu
    # One command per watch, and no chunk reused (rig.slot_bytes holds them all): the consumer
    # can tell whether command k's data was there when its flag arrived.
    canary = case.bench == "latency" and case.kind == "write" and n <= n_slots

    def producer(count: int) -> None:
        with torch.cuda.device(src_dev) if asm else nullcontext():
            _producer[(case.producers,)](
                fifo.ring, dhead, fifo.tail, fifo.capacity, rows_d, count, _EPOCH, push_ns,
                pushed_ns, done_ns, flags[0], *w_src, p_status, p_abort, rig.limit, NPROG=case.producers,
                WAIT_DONE=case.bench == "latency", ASM=asm, num_warps=1)  # fmt: skip

    def consumer(count: int) -> None:
        with torch.cuda.device(dst_dev) if asm else nullcontext():
            _consumer[(1,)](flags[1], *w_dst, count, arrive_ns, c_status, c_abort, rig.limit,
                            dst, cols, n_slots, ASM=asm, CANARY=canary, num_warps=1)  # fmt: skip

    # Load both kernels on their devices with these very specialisations before either spins:
    # a first launch on a device whose kernel spins can wait forever for the device to idle.
    producer(0)
    consumer(0)
    faulthandler.dump_traceback_later(rig.deadline + 60, exit=True)  # the last resort
    errors: list[str] = []
    wall = None
    proxy.start()
    try:
        try:
            wall = _launch(producer, consumer, n, n_watch, asm, (src_dev, dst_dev), rig.deadline,
                           proxy)  # fmt: skip
        except ProxyError:  # the loop failed: the kernels give up within `limit`; see below
            if asm:
                torch.cuda.synchronize(src_dev)
                torch.cuda.synchronize(dst_dev)
        failed_push = p_status.item() >= 0
        if failed_push:
            errors.append(f"producer gave up at command {p_status.item()} (ring full or no "
                          "done flag)")  # fmt: skip
        try:
            if failed_push or not proxy.running:  # an unpublished ticket would block stop()
                proxy.abort()
            else:
                fifo.head[0] = int(dhead.item())  # the GPU claims tickets on dhead, not head
                proxy.stop(timeout=30)
            proxy.check()
        except ProxyError as err:
            errors.append(f"proxy: {err}")
    finally:
        faulthandler.cancel_dump_traceback_later()
    early = int(c_status[2].item()) if canary else 0
    if early > 0:
        errors.append(f"{early} of {n} flags arrived before their chunk's data (canary)")
    if c_status[0].item() >= 0:
        k = c_status[0].item()
        errors.append(f"consumer gave up at watch {k}: flag {watch[k, 0].item()} was "
                      f"{c_status[1].item()}, waited for {watch[k, 1].item()}")  # fmt: skip
    for side in (0, 1) if case.bench == "latency" else (1,):
        got = flags[side].cpu()
        if not torch.equal(got, counts):
            bad = (got != counts).nonzero()[0].item()
            errors.append(f"rank {side} flag {bad} ended at {got[bad].item()}, expected "
                          f"{counts[bad].item()}")  # fmt: skip
    used = min(n, n_slots)
    if case.kind == "write":
        wrong = int((dst[:used].cpu() != src[:used].cpu()).any(1).sum())  # NaN: never written
        if wrong:
            errors.append(f"{wrong} of {used} destination chunks differ from the source")
    if proxy.stats.commands != n:
        errors.append(f"proxy executed {proxy.stats.commands} of {n} commands")
    wall_ms = None if wall is None else round(wall * 1e3, 3)
    row.update(wall_ms=wall_ms, batches=proxy.stats.batches, n_watch=n_watch)
    # The proxy's host share (loop_stats): per batch, from reading it to its end, less pacing;
    # and the CUDA queueing calls in it. With one command in flight (latency) a batch is one
    # command, so push->flag minus proxy_us is the GPU's part (push visible to the host, copy
    # engine, flag visible to the consumer).
    ls, nb = proxy.loop_stats(), max(proxy.stats.batches, 1)
    row.update(proxy_us=round((ls["busy_ns"] - ls["paced_ns"]) / nb / 1e3, 2),
               cuda_calls_per_batch=round(ls["cuda_calls"] / nb, 2),
               cuda_calls_per_cmd=round(ls["cuda_calls"] / max(proxy.stats.commands, 1), 3),
               cuda_call_us=round(ls["cuda_call_ns"] / max(ls["cuda_calls"], 1) / 1e3, 2),
               flag_call_us=round(ls["flag_call_ns"] / max(ls["flag_calls"], 1) / 1e3, 2),
               data_call_us=round((ls["cuda_call_ns"] - ls["flag_call_ns"])
                                  / max(ls["cuda_calls"] - ls["flag_calls"], 1) / 1e3, 2),
               cuda_apis=proxy.cuda_apis, canary=canary,
               kernel_writes=ls.get("kernel_writes", 0))  # fmt: skip
    if errors:
        return {**row, "error": "; ".join(errors)}
    push_t, arrive_t = push_ns.cpu(), arrive_ns.cpu()
    seconds = (arrive_t.max() - push_t.min()).item() / 1e9 if asm else wall
    row.update(ok=True, timing="globaltimer" if asm else "meaningless: Triton interpreter",
               ms=round(seconds * 1e3, 3), commands_per_s=round(n / seconds),
               gb_per_s=round(n * case.chunk_bytes / seconds / 1e9, 2) if case.kind == "write"
               else 0.0)  # fmt: skip
    if case.bench == "latency":
        row.update(quantiles((arrive_t - push_t) / 1e3))
        row["roundtrip_us_median"] = round(((done_ns.cpu() - push_t) / 1e3).median().item(), 2)
        # push -> push returned (tail read, body stored, the header's release store issued):
        # the producer's share, which no proxy protocol removes
        row["push_us_median"] = round(((pushed_ns.cpu() - push_t) / 1e3).median().item(), 2)
    return row


def _launch(producer, consumer, n, n_watch, asm, devices, deadline, proxy) -> float:
    """Run both kernels; return host seconds. The interpreter runs a launch to completion, so
    there the producer goes first (the proxy drains meanwhile) and the consumer checks after."""
    start = time.perf_counter()
    if not asm:
        producer(n)
        consumer(n_watch)
        return time.perf_counter() - start
    src_dev, dst_dev = devices
    done = []
    for launch, count, dev in ((consumer, n_watch, dst_dev), (producer, n, src_dev)):
        stream = torch.cuda.Stream(dev)
        with torch.cuda.stream(stream):
            launch(count)
            done.append(torch.cuda.Event())
            done[-1].record(stream)
    while not all(e.query() for e in done):
        if time.perf_counter() - start > deadline:
            print(f"TIMEOUT after {deadline:.0f} s: consumer done={done[0].query()} producer "
                  f"done={done[1].query()} fifo={proxy.fifo!r} proxy={proxy!r}", flush=True)  # fmt: skip
            os._exit(3)
        proxy.check()
        time.sleep(1e-3)
    return time.perf_counter() - start


def plan(rig: Rig, quick: bool, two_gpus: bool, flag_modes=("copy",), streams=(1,),
         protocols=("new",)) -> list[Case]:  # fmt: skip
    """Every case with protocols[0]; the latency cases again with each other protocol."""
    base = [Case(**{**asdict(c), "streams": k, "protocol": protocols[0]}) for k in streams
            for c in _plan(rig, quick, two_gpus, flag_modes)]  # fmt: skip
    more = [Case(**{**asdict(c), "protocol": p}) for p in protocols[1:] for c in base
            if (c.bench == "latency" or (p in THROUGHPUT_TOO and c.bench == "drain"
                                         and c.kind == "write"))
            and (c.flags == "memop" or "gpu_fence" not in PROTOCOLS[p])
            and (c.streams == 1 or "copy_kernel_bytes" not in PROTOCOLS[p])
            and p != "hostflags"]  # fmt: skip
    if "hostflags" in protocols[1:]:  # no GPU flag to raise: once, on one stream (its limit)
        first = next(c.flags for c in base if c.bench == "latency")
        more += [Case(**{**asdict(c), "protocol": "hostflags", "flags": "host"}) for c in base
                 if c.bench == "latency" and c.streams == 1 and c.flags == first]  # fmt: skip
    return base + more


def _plan(rig: Rig, quick: bool, two_gpus: bool, flag_modes=("copy",)) -> list[Case]:
    far = "cpu-interpreter" if rig.cpu else ("gpu0->gpu1" if two_gpus else "loopback")
    near = "cpu-interpreter" if rig.cpu else "loopback"
    if rig.cpu:  # GPU sizes / 256; counts just big enough to wrap the 16-slot ring
        n, lat, nprog = (48, 20, 2) if quick else (128, 40, 4)
        drain_chunk, lat_chunks = 256, [256]
        chunks = [256, 1 * KiB] if quick else [256, 1 * KiB, 4 * KiB]
        bw = {c: n for c in chunks}
    else:
        n, lat, nprog = 0, 200 if quick else 2000, 8  # drain counts: calibrate()
        drain_chunk, lat_chunks = 64 * KiB, [4 * KiB, 64 * KiB]
        chunks = [256 * KiB] if quick else [64 * KiB, 256 * KiB, MiB]
        budget = (0.05 if quick else 0.2) * 50e9  # bytes: ~0.2 s at the 50 GB/s cap
        bw = {c: int(min(20_000, max(64, budget // c))) for c in chunks}
    cases = [Case("drain", "nop", 0, n, 0, far, nprog)]
    for fl in flag_modes:
        cases += [Case("drain", kind, drain_chunk if kind == "write" else 0, n, 0, far, nprog,
                       fl) for kind in ("signal", "write")]  # fmt: skip
        cases += [Case("latency", "write", c, lat, 0, p, 1, fl)
                  for p in dict.fromkeys([near, far]) for c in lat_chunks]  # fmt: skip
        cases += [Case("bandwidth", "write", c, bw[c], cap, far, nprog, fl)
                  for c in chunks for cap in (0, 50)]  # fmt: skip
    return cases


def calibrate(case: Case, rig: Rig, seconds: float) -> Case:
    """Drain benches size themselves: a short run's rate times ``seconds``."""
    probe = run_case(Case(**{**asdict(case), "commands": 4096}), rig)
    if not probe["ok"]:
        print(f"calibration run failed ({probe['error']}); sizing for 100 k commands/s")
    rate = probe["commands_per_s"] or 100_000
    return Case(**{**asdict(case), "commands": int(min(500_000, max(4096, rate * seconds)))})


def target(row: dict, cpu: bool) -> str:
    if cpu or not row["ok"]:
        return "n/a"
    if row["bench"] == "drain":
        return f"{'met' if row['commands_per_s'] >= TARGETS['drain'] else 'MISSED'} >= 200 k/s"
    if row["bench"] == "latency":
        met = row["latency_us_median"] <= TARGETS["latency"]
        return f"{'met' if met else 'MISSED'} median <= 10 us"
    if row["chunk_bytes"] == 256 * KiB and not row["cap_gbps"]:
        return f"{'met' if row['gb_per_s'] >= TARGETS['bandwidth'] else 'MISSED'} >= 45 GB/s"
    if row["cap_gbps"]:  # paced like a NIC: close to the cap, never (beyond noise) over it
        cap, got = row["cap_gbps"], row["gb_per_s"]
        verdict = "OVER the cap" if got > 1.05 * cap else ("met" if got >= 0.9 * cap else "MISSED")
        return f"{verdict} 0.9-1.0 x cap"
    return ""


def table(rows: list[dict], cpu: bool) -> str:
    lines = ["| bench | kind | flags | protocol | streams | path | chunk | cap GB/s | cmds | ms | "
             "k cmd/s | GB/s | lat p10 / med / p90 us | proxy us/batch (CUDA calls/cmd x us) | "
             "target |", "|---" * 15 + "|"]  # fmt: skip
    for r in rows:
        flags = r["flags"] if r["kind"] != "nop" else "-"
        head = f"| {r['bench']} | {r['kind']} | {flags} | {r.get('protocol', 'new')} | " \
               f"{r.get('streams', 1)} | {r['path']} | " \
               f"{r['chunk_bytes']} | " \
               f"{r['cap_gbps'] or '-'} | {r['commands']} |"  # fmt: skip
        if not r["ok"]:
            lines.append(f"{head} ERROR: {r['error']} | | | | | |")
            continue
        lat = "-" if r["latency_us_median"] is None else \
            f"{r['latency_us_p10']} / {r['latency_us_median']} / {r['latency_us_p90']}"  # fmt: skip
        host = "-" if r.get("proxy_us") is None else \
            f"{r['proxy_us']} ({r['cuda_calls_per_cmd']} x {r['cuda_call_us']})"  # fmt: skip
        lines.append(f"{head} {r['ms']} | {r['commands_per_s'] / 1e3:.1f} | {r['gb_per_s']} | "
                     f"{lat} | {host} | {target(r, cpu)} |")  # fmt: skip
    note = "\nTimings are meaningless: Triton interpreter on the CPU (protocol check only).\n"
    return "\n".join(lines) + "\n" + (note if cpu else "")


def summary(rows: list[dict]) -> str:
    """Issue 15's numbers per setting (flag mode, streams, protocol): GB/s of 256 KiB WRITEs
    uncapped and paced at 50 GB/s, 64 KiB WRITE drain commands/s (the first protocol and THROUGHPUT_TOO), and
    the loopback push-to-flag median of the smallest chunk with the proxy's CUDA calls per
    command there."""
    lines = ["| flags | streams | protocol | 256 KiB uncapped GB/s | 256 KiB at 50 GB/s cap | "
             "64 KiB WRITE drain k cmd/s | loopback push->flag median us | CUDA calls/cmd |",
             "|---" * 8 + "|"]  # fmt: skip
    key = lambda r: (r["flags"], r.get("streams", 1), r.get("protocol", "new"))  # noqa: E731
    for setting in dict.fromkeys(key(r) for r in rows if r["kind"] != "nop"):
        mine = [r for r in rows if r["ok"] and key(r) == setting]
        bw = [r["gb_per_s"] for r in mine if r["bench"] == "bandwidth" and not r["cap_gbps"]
              and r["chunk_bytes"] == 256 * KiB]  # fmt: skip
        capped = [r["gb_per_s"] for r in mine if r["bench"] == "bandwidth" and r["cap_gbps"] == 50
                  and r["chunk_bytes"] == 256 * KiB]  # fmt: skip
        drain = [r["commands_per_s"] / 1e3 for r in mine if r["bench"] == "drain"
                 and r["kind"] == "write"]  # fmt: skip
        lat = sorted((r["chunk_bytes"], r["latency_us_median"], r.get("cuda_calls_per_cmd"))
                     for r in mine if r["bench"] == "latency" and r["path"] == "loopback")  # fmt: skip
        cell = [f"{bw[0]}" if bw else "-", f"{capped[0]}" if capped else "-",
                f"{drain[0]:.1f}" if drain else "-",
                f"{lat[0][1]} ({lat[0][0] // KiB} KiB)" if lat else "-",
                f"{lat[0][2]}" if lat else "-"]  # fmt: skip
        lines.append(f"| {setting[0]} | {setting[1]} | {setting[2]} | " + " | ".join(cell) + " |")
    return "\n".join(lines) + "\n"


def protocols_line(rows: list[dict]) -> str:
    """The comparison the protocols are for, one line per (flags, streams): loopback push->flag
    median of the smallest chunk, the push->done-flag round trip and CUDA calls per command, per
    protocol (printed last, so a log's tail shows it)."""
    lat = [r for r in rows if r["ok"] and r["bench"] == "latency" and r["path"] == "loopback"]
    if not lat:
        return ""
    small = min(r["chunk_bytes"] for r in lat)
    out = [f"loopback push->flag median us ({small // KiB} KiB; rt: push->done flag; push: "
           "the producer's push call) "
           "[CUDA calls/cmd: host us per data call + per flag call] by protocol:"]  # fmt: skip
    for flags, streams in dict.fromkeys((r["flags"], r.get("streams", 1)) for r in lat):
        cells = [f"{r['protocol']} {r['latency_us_median']} (rt {r.get('roundtrip_us_median')}, "
                 f"push {r.get('push_us_median')})"
                 f" [{r['cuda_calls_per_cmd']}: data {r.get('data_call_us')} + flags "
                 f"{r.get('flag_call_us')} us/call]"
                 for r in lat if r["chunk_bytes"] == small and r["flags"] == flags
                 and r.get("streams", 1) == streams]  # fmt: skip
        out.append(f"  {flags} flags, {streams} stream(s): " + ", ".join(cells))
    return "\n".join(out) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder for bench_proxy.json / .md")
    parser.add_argument("--quick", action="store_true", help="fewer sizes and commands")
    parser.add_argument("--cpu", action="store_true", help="Triton interpreter, host memory")
    parser.add_argument("--gpu-flags", nargs="+", default=["copy", "memop"],
                        choices=["copy", "memop"], help="how the proxy raises GPU flag words")
    parser.add_argument("--streams", nargs="+", type=int, default=[1],
                        help="proxy copy streams to run every case with (e.g. 1 4)")
    parser.add_argument("--protocols", nargs="+",
                        default=[p for p in PROTOCOLS if p != "new+gpufence"],
                        choices=list(PROTOCOLS),
                        help="the first runs every case, the others the latency cases")
    args = parser.parse_args()
    rig = Rig(args.cpu)
    if not args.cpu and not torch.cuda.is_available():
        sys.exit("bench_proxy: no CUDA device; use --cpu for the interpreter run")
    two_gpus = not args.cpu and torch.cuda.device_count() >= 2
    if not args.cpu and not two_gpus:
        print("bench_proxy: one GPU only: every path is loopback", flush=True)
    if two_gpus:  # the proxy's GPU0 stream writes GPU1 memory: peer access, enabled by torch
        torch.ones(1, device="cuda:1").copy_(torch.ones(1, device="cuda:0"))
    rows = []
    modes = ["copy"] if args.cpu else args.gpu_flags  # host flags have one mode
    if not all(1 <= k <= LANES for k in args.streams):
        parser.error(f"--streams {args.streams}: each in [1, {LANES}]")
    # Host flags (--cpu) make no CUDA call: one protocol is all there is to see.
    protocols = args.protocols[:1] if args.cpu else list(dict.fromkeys(args.protocols))
    for case in plan(rig, args.quick, two_gpus, modes, args.streams, protocols):
        if case.bench == "drain" and not args.cpu:
            case = calibrate(case, rig, 0.05 if args.quick else 0.2)
        row = run_case(case, rig)
        print(json.dumps(row), flush=True)
        rows.append(row)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_proxy.json").write_text(json.dumps(rows, indent=1) + "\n")
    md = table(rows, args.cpu) + "\n" + summary(rows) + "\n" + protocols_line(rows)
    (out / "bench_proxy.md").write_text(md)
    print(md, flush=True)
    failed = [r for r in rows if not r["ok"]]
    if failed:
        sys.exit(f"bench_proxy: {len(failed)} of {len(rows)} rows failed their checks")


if __name__ == "__main__":
    main()
