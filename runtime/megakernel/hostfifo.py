"""The GPU's side of the host command FIFO (runtime/proxy/fifo.py has the protocol and layout).

``push`` is what an RDMA-role worker does for one command:
- claim a ticket with a fetch-add on ``dhead`` (int64, device memory: only GPU workers claim);
- wait, bounded, while the ring is full: ``ticket - tail >= capacity``, reading the proxy's
  ``tail`` (pinned host memory) with ``ld.acquire.sys``, so the slot's clearing is visible;
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

from .sync import now

__all__ = ["push", "ld_acquire_sys64", "publish64", "CMD_WORDS"]

CMD_WORDS = tl.constexpr(WORDS)
_EPOCH_WORD = tl.constexpr(2)  # Word.EPOCH


@triton.jit
def ld_acquire_sys64(ptr, ASM: tl.constexpr):
    if ASM:
        v = tl.inline_asm_elementwise(
            "ld.acquire.sys.global.b64 $0, [$1];", "=l,l", [ptr], dtype=tl.int64, is_pure=False,
            pack=1,
        )
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
    ``(ticket, tail seen)``: the push happened iff ``ticket - tail < capacity``."""
    ticket = tl.atomic_add(dhead, 1, sem="relaxed", scope="gpu")
    done = ld_acquire_sys64(tail, ASM)
    if ticket - done >= capacity:
        start = now(ASM)
        spins = 0
        elapsed = tl.zeros((), dtype=tl.int64)
        aborted = tl.load(abort, volatile=True)
        while (ticket - done >= capacity) & (elapsed < limit) & (aborted == 0):
            done = ld_acquire_sys64(tail, ASM)
            aborted = tl.load(abort, volatile=True)
            spins += 1
            if ASM:
                elapsed = now(ASM) - start
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
