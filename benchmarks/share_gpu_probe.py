"""Can two ranks share ONE GPU? (`torchrun --nproc_per_node=2 benchmarks/share_gpu_probe.py`)

Two processes on the same device, a gloo group (NCCL refuses two ranks on one device)
and the runtime's CUDA-IPC peer buffers (runtime/megakernel/ipc_share.py), and a
persistent Triton kernel in each that ping-pongs flags with the other through sys-scope atomics.
Without MPS the two contexts time-slice, so a spinning kernel only sees the peer's flag after a
context switch: this measures whether that progresses at all and how long one hop takes. Every
spin is bounded (a hop that never comes is reported, not waited for). If it works, the
multi-rank kernels (ring attention, MoE, TP Programs) can be checked for correctness, not speed,
on a one-GPU machine."""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist
import triton
import triton.language as tl


@triton.jit
def _ping(mine, peer, n, limit, out, RANK: tl.constexpr):
    # step i belongs to rank i % 2: it waits for its own flag i (raised by the peer at step i-1;
    # step 0 needs nothing), then raises the peer's flag i + 1
    spins = 0
    failed = 0
    for i in range(RANK, n, 2):
        if i > 0:  # at most ``limit`` polls a hop (v19's first run bounded the total instead)
            seen = tl.atomic_add(mine + i, 0, sem="acquire", scope="sys")
            polls = 0
            while (seen == 0) & (polls < limit):
                seen = tl.atomic_add(mine + i, 0, sem="acquire", scope="sys")
                polls += 1
            spins += polls
            failed += (seen == 0).to(tl.int32)
        tl.atomic_xchg(peer + i + 1, 1, sem="release", scope="sys")
    tl.store(out, spins)
    tl.store(out + 1, failed)


def main() -> None:
    from mgraph.runtime.megakernel.ipc_share import IpcBuffers

    rank = int(os.environ["RANK"])
    torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group("gloo")
    flags = torch.zeros(4096, dtype=torch.int32, device="cuda")
    handle = IpcBuffers(flags)  # what the runtime maps when ranks share a GPU
    print(f"rank {rank}: rendezvous ok, peers {list(handle.buffer_ptrs)}", flush=True)
    peer_ptr = handle.buffer_ptrs[1 - rank]
    out = torch.zeros(2, dtype=torch.int64, device="cuda")

    class _Ptr:  # Triton takes a raw address from anything with data_ptr() and a dtype
        dtype = torch.int32

        def __init__(self, p: int) -> None:
            self.p = p

        def data_ptr(self) -> int:
            return self.p

    for n in (2, 20, 200, 2000):
        flags.zero_()
        torch.cuda.synchronize()
        dist.barrier()
        t0 = time.perf_counter()
        _ping[(1,)](flags, _Ptr(peer_ptr), n, 5_000_000, out, RANK=rank)
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        spins, failed = out.tolist()
        print(f"rank {rank}: {n} hops in {dt * 1e3:.1f} ms ({dt / max(n, 1) * 1e6:.1f} us a hop), "
              f"spins {spins}, hops that never came {failed}", flush=True)
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
