"""Signal, wait and timing primitives of the megakernel: every memory-ordering rule lives here.

Contracts (DESIGN: synchronisation protocol):
- Scope: ``SYS`` (system) when the event crosses GPUs, else ``gpu``: a sys-scope release is a
  system-wide fence, measured as costly as moving a 64 KiB tile over NVLink (benchmarks/NOTES.md).
- ``signal(flag)``: a CTA barrier, then ``atom.add.release`` on the flag. The barrier orders
  every thread's earlier stores before thread 0's release; release is cumulative, so a consumer
  that acquires the new value sees all of the tile's stores, on this GPU and on peers (sys scope
  covers NVLink peers and the host proxy).
- ``wait(flag, target)``: ``atom.add.acquire.sys`` polls (add 0) until the value reaches ``target``;
  loads issued after it see everything the signalling side stored before its release. Bounded:
  it gives up after ``limit`` (nanoseconds of %globaltimer on the GPU, polls in the interpreter)
  or when another program raised the abort flag, and returns the last value it saw.
- A wait comes before a tile's K-loop, never inside it: Triton's pipeliner may hoist the loop's
  loads above a wait that sits in the loop body.
- Data consumed through TMA (the async proxy) that peers wrote with plain stores (the generic
  proxy) needs ``fence_proxy_async()`` after the wait; the kernel issues it after the entry
  barrier and after the waits of every GEMM task that waited.
- Data produced through TMA stores is published only after ``bulk_store_fence()`` (complete the
  bulk stores, then a proxy fence), a CTA barrier and the release.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["now", "signal", "wait", "wait_sum", "fence_proxy_async", "bulk_store_fence"]


@triton.jit
def now(USE_TIMER: tl.constexpr):
    """Nanoseconds of the GPU's global timer; 0 in the interpreter (no inline asm there)."""
    if USE_TIMER:
        t = tl.inline_asm_elementwise(
            "mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1
        )
    else:
        t = tl.zeros((), dtype=tl.int64)
    return t


@triton.jit
def fence_proxy_async(USE_TIMER: tl.constexpr):
    """Order earlier generic-proxy accesses before later TMA (async proxy) accesses."""
    if USE_TIMER:
        tl.inline_asm_elementwise(
            "fence.proxy.async.global; mov.u32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=False,
            pack=1,
        )


@triton.jit
def bulk_store_fence(USE_TIMER: tl.constexpr):
    """Complete this thread's TMA (bulk async) stores and order them before later generic-proxy
    accesses, such as the release that publishes them. A TMA store's own wait only covers its
    read of shared memory: without this, a signal could publish a tile whose bytes are still
    in flight to global (or a peer's) memory."""
    if USE_TIMER:
        tl.inline_asm_elementwise(
            "cp.async.bulk.wait_group 0; fence.proxy.async.global; mov.u32 $0, 0;", "=r", [],
            dtype=tl.int32, is_pure=False, pack=1,
        )


@triton.jit
def signal(flag, SYS: tl.constexpr):
    tl.debug_barrier()
    if SYS:
        tl.atomic_add(flag, 1, sem="release", scope="sys")
    else:
        tl.atomic_add(flag, 1, sem="release", scope="gpu")


@triton.jit
def _poll(flag, SYS: tl.constexpr):
    if SYS:
        v = tl.atomic_add(flag, 0, sem="acquire", scope="sys")
    else:
        v = tl.atomic_add(flag, 0, sem="acquire", scope="gpu")
    return v


@triton.jit
def wait(flag, target, limit, abort, USE_TIMER: tl.constexpr, SYS: tl.constexpr = True):
    value = _poll(flag, SYS)
    if value < target:
        start = now(USE_TIMER)
        spins = 0
        aborted = tl.load(abort, volatile=True)
        elapsed = tl.zeros((), dtype=tl.int64)
        while (value < target) & (elapsed < limit) & (aborted == 0):
            value = _poll(flag, SYS)
            aborted = tl.load(abort, volatile=True)
            spins += 1
            if USE_TIMER:
                elapsed = now(USE_TIMER) - start
            else:
                elapsed = spins.to(tl.int64)
    return value


@triton.jit
def _poll_sum(flag, net, nnet, SYS: tl.constexpr):
    v = _poll(flag, SYS)
    for j in range(nnet):
        word = tl.load(net + j).to(tl.pointer_type(tl.int32))
        v += _poll(word, True)  # raised by a host proxy through the copy engine: sys scope
    return v


@triton.jit
def wait_sum(flag, net, nnet, target, limit, abort, USE_TIMER: tl.constexpr, SYS: tl.constexpr):
    """``wait`` for an event whose count is its GPU word plus the ``nnet`` net words whose
    addresses start at ``net``, which host proxies raise (runtime/megakernel/netplan.py)."""
    value = _poll_sum(flag, net, nnet, SYS)
    if value < target:
        start = now(USE_TIMER)
        spins = 0
        aborted = tl.load(abort, volatile=True)
        elapsed = tl.zeros((), dtype=tl.int64)
        while (value < target) & (elapsed < limit) & (aborted == 0):
            value = _poll_sum(flag, net, nnet, SYS)
            aborted = tl.load(abort, volatile=True)
            spins += 1
            if USE_TIMER:
                elapsed = now(USE_TIMER) - start
            else:
                elapsed = spins.to(tl.int64)
    return value
