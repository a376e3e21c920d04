"""The GPU's side of the host command FIFO (runtime/proxy/fifo.py has the protocol and layout).

``push`` is what an RDMA-role worker does for one command:
- claim a ticket with a fetch-add on ``dhead`` (int64, device memory: only GPU workers claim);
- wait, bounded, while the ring is full: ``ticket - tail >= capacity``, reading the proxy's
  ``tail`` (pinned host memory) with ``ld.acquire.sys``, so the slot's clearing is visible;
  one thread reads it and a reduction hands its value to every warp (``ld_acquire_sys64``),
  as the abort flag and the clock are read (sync.load_uniform, sync.now_uniform): the loop and
  the branches after it hold CTA barriers, so every warp must take them alike (sync.py,
  "Uniform control flow");
- store words 1..15 of the slot from the precomputed command row (the launch epoch patched in);
- CTA barrier, then ONE thread publishes the header ``(ticket + 1) << 8 | opcode`` with
  ``st.release.sys``: the release orders the whole body (all threads' stores, by the barrier)
  before the header on the PCIe path, the usual "many threads write, one thread flags" pattern.

A fetch-add claim (not a compare-and-swap) is enough here: a worker that gives up waiting for
space leaves its ticket unpublished, but it also raises the abort flag, and a failed runtime is
never launched again (the proxy is aborted, not drained).

Under Triton's interpreter (``ASM`` false) the PTX becomes atomics on CPU memory, which the
native drain thread reads concurrently: the same protocol, tested in CI.
"""

from __future__ import annotations

import triton
import triton.language as tl

from mgraph.runtime.proxy.command import WORDS

from .sync import LANES, load_uniform, now_uniform

__all__ = ["push", "ld_acquire_sys64", "publish64", "CMD_WORDS"]

CMD_WORDS = tl.constexpr(WORDS)
_EPOCH_WORD = tl.constexpr(2)  # Word.EPOCH


@triton.jit
def ld_acquire_sys64(ptr, ASM: tl.constexpr):
    """``ld.acquire.sys`` of the int64 at ``ptr``, as ONE value in every thread of the program.

    One lane (element 0 of a block that spans every warp) loads; the sum over the block hands
    its value to every warp through shared memory, between CTA barriers. The acquire orders
    the proxy's release of the tail before that thread's later accesses, and the barrier
    orders them before every other thread's: the usual "one thread acquires, then the CTA
    syncs" pattern, with one PCIe read per poll rather than one per thread. Under the
    interpreter (``ASM`` false) an atomic add of 0, whose result is one value already."""
    if ASM:
        lanes = tl.arange(0, LANES)
        v = tl.sum(
            tl.inline_asm_elementwise(
                "{ .reg .pred p; setp.eq.s32 p, $2, 0; mov.b64 $0, 0; "
                "@p ld.acquire.sys.global.b64 $0, [$1]; }",
                "=l,l,r", [ptr + tl.zeros([LANES], dtype=tl.int32), lanes], dtype=tl.int64,
                is_pure=False, pack=1,
            ),
            axis=0,
        )  # (a sum, not a max: the other lanes' 0 is neutral whatever the tail's sign)
    else:
        v = tl.atomic_add(ptr, 0)
    return v


@triton.jit
def publish64(ptr, value, ASM: tl.constexpr):
    """Thread 0 of the CTA stores ``value`` at ``ptr`` with a system-scope release."""
    if ASM:
        tl.inline_asm_elementwise(
            "{ .reg .pred p; .reg .u32 t; mov.u32 t, %tid.x; setp.eq.u32 p, t, 0; "
            "@p st.release.sys.global.b64 [$1], $2; mov.u32 $0, 0; }",
            "=r,l,l", [ptr, value], dtype=tl.int32, is_pure=False, pack=1,
        )
    else:
        tl.atomic_xchg(ptr, value)


@triton.jit
def push(ring, dhead, tail, capacity, row, epoch, limit, abort, ASM: tl.constexpr):
    """Push the 16-word command at ``row`` (device memory) with ``epoch``; returns
    ``(ticket, tail seen)``, both the same in every warp: the push happened iff
    ``ticket - tail < capacity``."""
    ticket = tl.atomic_add(dhead, 1, sem="relaxed", scope="gpu")
    done = ld_acquire_sys64(tail, ASM)
    if ticket - done >= capacity:
        # (ticket: an atomic's result; done, aborted, the clock: uniform reads)
        start = now_uniform(ASM)
        spins = 0
        elapsed = tl.zeros((), dtype=tl.int64)
        aborted = load_uniform(abort)
        while (ticket - done >= capacity) & (elapsed < limit) & (aborted == 0):
            done = ld_acquire_sys64(tail, ASM)
            aborted = load_uniform(abort)
            spins += 1
            if ASM:
                elapsed = now_uniform(ASM) - start
            else:
                elapsed = spins.to(tl.int64)
    if ticket - done < capacity:
        offs = tl.arange(0, CMD_WORDS)
        body = tl.load(row + offs)
        # epoch may arrive as a constexpr (Triton specialises an int argument equal to 1)
        body = tl.where(offs == _EPOCH_WORD, tl.zeros((), dtype=tl.int64) + epoch, body)
        slot = ring + (ticket & (capacity - 1)) * CMD_WORDS
        tl.store(slot + offs, body, mask=offs > 0)
        tl.debug_barrier()
        header = ((ticket + 1) << 8) | (tl.load(row) & 0xFF)
        publish64(slot, header, ASM)
    return ticket, done
