"""Do the native proxy's CUDA operations run while a persistent kernel holds the SMs of the SAME
process? (`python3 benchmarks/share_copy_probe.py`; one GPU, about 30 s)

Why: with two ranks on one GPU (MGRAPH_TEST_SHARE_GPU=1) a rank's proxy copies each chunk into
the peer's memory on the SAME device (cudaMemcpyAsync device to device, through the CUDA-IPC
mapping), and raises the flag behind it on its stream, while its own megakernel spins on every
SM. On two GPUs the same WRITE is a peer copy, done by a copy engine. A same-device copy may
instead run as a driver copy kernel on the SMs (it reaches HBM speed, which one copy engine
does not): then it starts only when a block of it fits beside the megakernel's, and if none
fits, not before the megakernel ends, and the 2x1 GEMM+AR waits at the watchdog for a chunk
whose flag is queued behind it (the v19/v20 hang: "value 1, target 2").

Each mode launches a kernel whose programs spin on a device flag (bounded by --limit seconds):
``megakernel``: one 256-thread program per SM, as the megakernel's grid (but with few registers,
so other blocks fit beside it); ``full``: two 1024-thread programs of at most 32 registers per
SM (no thread slot or register left for any other block, as with the megakernel's 255
registers a thread: tests/test_gpu_compile.py-style sm_90 builds of every emulated test's
kernel give 255). While it spins, each operation below goes out on a stream of its own, and the probe
reports which completed within --wait seconds (then releases the kernel and waits for the rest):
1-D device-to-device copies (cudaMemcpyAsync: a coalesced WRITE) of 256 KiB to 32 MiB, a 2-D one
(cudaMemcpy2DAsync: a strided WRITE), 4-byte host-to-device and device-to-host copies (a flag
raise, gpu_flags=copy, and a record read), and a torch kernel (a fill: whether a block fits).
Prints one line per (mode, operation) and a JSON summary; writes it to $OUT if set."""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import time

import torch
import triton

from mgraph.runtime.megakernel.sync import wait
from mgraph.runtime.proxy.cuda_ipc import cuda_libraries

DEFAULT = 4  # cudaMemcpyDefault


@triton.jit
def _spin(flag, abort, limit):
    wait(flag, 1, limit, abort, True, True)


def _cudart() -> ctypes.CDLL:
    for path in cuda_libraries()[0]:  # the runtime torch loaded first: its primary context
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        lib.cudaMemcpyAsync.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t,
                                        ctypes.c_int, ctypes.c_void_p]
        lib.cudaMemcpy2DAsync.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p,
                                          ctypes.c_size_t, ctypes.c_size_t, ctypes.c_size_t,
                                          ctypes.c_int, ctypes.c_void_p]
        return lib
    raise SystemExit("no CUDA runtime library found")


def _operations(rt: ctypes.CDLL, dev: torch.device) -> tuple[dict, tuple]:
    """(name -> function(stream) queueing the operation on ``stream``, the tensors it uses)."""
    src = torch.ones(32 << 20, dtype=torch.uint8, device=dev)
    dst = torch.zeros_like(src)
    host = torch.ones(64, dtype=torch.int32, pin_memory=True)
    word = torch.zeros(64, dtype=torch.int32, device=dev)
    filled = torch.zeros(1 << 20, dtype=torch.float32, device=dev)
    keep = (src, dst, host, word, filled)

    def copy_1d(nbytes: int):
        return lambda s: rt.cudaMemcpyAsync(dst.data_ptr(), src.data_ptr(), nbytes, DEFAULT, s)

    def copy_2d(s: int) -> int:  # 128 rows of 2 KiB out of 8 KiB rows: a tile's columns
        return rt.cudaMemcpy2DAsync(dst.data_ptr(), 8192, src.data_ptr(), 8192, 2048, 128,
                                    DEFAULT, s)

    def fill(s: int) -> int:
        with torch.cuda.stream(torch.cuda.ExternalStream(s)):
            filled.fill_(2.0)
        return 0

    ops = {f"d2d 1-D {n >> 10} KiB": copy_1d(n) for n in (256 << 10, 1 << 20, 8 << 20, 32 << 20)}
    ops["d2d 2-D 128x2 KiB"] = copy_2d
    ops["h2d 4 B (flag raise)"] = lambda s: rt.cudaMemcpyAsync(word.data_ptr(), host.data_ptr(),
                                                               4, DEFAULT, s)
    ops["d2h 4 B"] = lambda s: rt.cudaMemcpyAsync(host.data_ptr() + 4, word.data_ptr(), 4,
                                                  DEFAULT, s)
    ops["torch fill kernel"] = fill
    return ops, keep


def probe(mode: str, wait_s: float, limit_s: float) -> list[dict]:
    dev = torch.device("cuda", torch.cuda.current_device())
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    rt = _cudart()
    ops, _keep = _operations(rt, dev)
    flag = torch.zeros(1, dtype=torch.int32, device=dev)
    abort = torch.zeros(1, dtype=torch.int32, device=dev)
    one = torch.ones(1, dtype=torch.int32, pin_memory=True)
    # full: 2 x 1024 threads of at most 32 registers per SM, every thread slot and register
    # taken (the megakernel's 256 threads of 255 registers take every register)
    grid, opts = (sms, dict(num_warps=8)) if mode == "megakernel" else (
        2 * sms, dict(num_warps=32, maxnreg=32))
    limit = int(limit_s * 1e9)
    flag.fill_(1)  # compiled and loaded before anything spins (GPU.md): this one returns at once
    _spin[(grid,)](flag, abort, limit, **opts)
    for queue in ops.values():  # the fill's kernel loaded too; the copies are all rewritten
        queue(torch.cuda.current_stream().cuda_stream)
    torch.cuda.synchronize()
    flag.zero_()
    torch.cuda.synchronize()
    spinner = torch.cuda.Stream()
    with torch.cuda.stream(spinner):
        _spin[(grid,)](flag, abort, limit, **opts)
    time.sleep(0.5)  # every program resident and spinning
    streams = {name: torch.cuda.Stream() for name in ops}
    events, issued = {}, {}
    for name, queue in ops.items():
        status = queue(streams[name].cuda_stream)
        ev = torch.cuda.Event()
        ev.record(streams[name])
        events[name], issued[name] = ev, (status, time.perf_counter())
    done: dict[str, float] = {}
    deadline = time.perf_counter() + wait_s
    while time.perf_counter() < deadline and len(done) < len(events):
        for name, ev in events.items():
            if name not in done and ev.query():
                done[name] = time.perf_counter() - issued[name][1]
        time.sleep(1e-4)
    spinning = not spinner.query()
    release = torch.cuda.Stream()  # a host-to-device copy ends the spin (a copy engine's work)
    with torch.cuda.stream(release):
        flag.copy_(one, non_blocking=True)
    released = time.perf_counter()
    torch.cuda.synchronize()
    rows = []
    for name in events:
        status, _ = issued[name]
        row = {"mode": mode, "op": name, "status": int(status),
               "while_spinning_ms": round(done[name] * 1e3, 3) if name in done else None,
               "spin_still_running": spinning}
        if name not in done:
            row["after_release_ms"] = round((time.perf_counter() - released) * 1e3, 1)
        rows.append(row)
        when = f"{row['while_spinning_ms']} ms" if name in done else "NOT while the kernel spun"
        print(f"{mode:10s} grid {grid} {opts} | {name:24s} | {when} (call status "
              f"{status})", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--wait", type=float, default=3.0, help="seconds to wait while it spins")
    ap.add_argument("--limit", type=float, default=20.0, help="the spin's own bound (seconds)")
    ap.add_argument("--modes", nargs="+", default=["megakernel", "full"])
    args = ap.parse_args()
    os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")
    rows = []
    for mode in args.modes:
        rows += probe(mode, args.wait, args.limit)
    text = json.dumps(rows)
    print(text)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "share_copy_probe.json"), "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
