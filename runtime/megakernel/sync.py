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
- Uniform control flow: Triton holds a scalar as one value per program, but every thread computes
  it. A scalar atomic whose result is used is executed by one thread and broadcast through shared
  memory between two CTA barriers, so its result is the same in every warp; a scalar loaded with
  ``volatile=True`` or read from ``%globaltimer`` is NOT: warps execute the load at different
  times and may see different values. A branch or loop on such a value splits the program's
  warps, and the barriers inside (every scalar atomic, reductions, ``signal``) then pair the
  wrong warps: the kernel hangs on a hardware barrier, where the watchdog cannot see it (the
  adaptive AG+GEMM hang of NOTES v9). So control flow branches only on atomics' results, on
  tables that do not change during a launch, and on ``load_uniform`` / ``now_uniform``, which
  reduce the threads' reads to one value through shared memory. ``now`` (per thread) is for
  trace stamps only. tests/cta_uniform.py checks the compiled kernel for such branches
  (tests/test_adaptive_uniform.py); hostfifo.push follows it too (one lane acquires the tail).
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["now", "now_uniform", "load_uniform", "signal", "wait", "wait_sum", "fence_proxy_async",
           "bulk_store_fence", "LANES"]

# A block this wide spans every warp of a program (at most 32 warps of 32 threads), so a
# reduction over it combines all warps' values through shared memory.
LANES = tl.constexpr(1024)


@triton.jit
def now(USE_TIMER: tl.constexpr):
    """Nanoseconds of the GPU's global timer, read by each thread (warps may differ: for trace
    stamps, never for a branch); 0 in the interpreter (no inline asm there)."""
    if USE_TIMER:
        t = tl.inline_asm_elementwise(
            "mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1
        )
    else:
        t = tl.zeros((), dtype=tl.int64)
    return t


@triton.jit
def now_uniform(USE_TIMER: tl.constexpr):
    """The global timer as ONE value in every thread of the program (the latest of the
    threads' reads): what control flow may branch on. 0 in the interpreter."""
    if USE_TIMER:
        lanes = tl.zeros([LANES], dtype=tl.int32)  # one read per element: nothing to fold
        t = tl.max(
            tl.inline_asm_elementwise(
                "mov.u64 $0, %globaltimer; // $1", "=l,r", [lanes], dtype=tl.int64,
                is_pure=False, pack=1,
            ),
            axis=0,
        )
    else:
        t = tl.zeros((), dtype=tl.int64)
    return t


@triton.jit
def load_uniform(ptr):
    """A volatile read of a word other programs change, as ONE value in every thread of the
    program (the largest of the threads' reads; every one is a value the word held). No
    ordering: a relaxed read, for control words and the abort flag."""
    return tl.max(tl.load(ptr + tl.zeros([LANES], dtype=tl.int32), volatile=True), axis=0)


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
    if value < target:  # (value: an atomic's result, the same in every warp)
        start = now_uniform(USE_TIMER)
        spins = 0
        aborted = load_uniform(abort)
        elapsed = tl.zeros((), dtype=tl.int64)
        while (value < target) & (elapsed < limit) & (aborted == 0):
            value = _poll(flag, SYS)
            aborted = load_uniform(abort)
            spins += 1
            if USE_TIMER:
                elapsed = now_uniform(USE_TIMER) - start
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
        start = now_uniform(USE_TIMER)
        spins = 0
        aborted = load_uniform(abort)
        elapsed = tl.zeros((), dtype=tl.int64)
        while (value < target) & (elapsed < limit) & (aborted == 0):
            value = _poll_sum(flag, net, nnet, SYS)
            aborted = load_uniform(abort)
            spins += 1
            if USE_TIMER:
                elapsed = now_uniform(USE_TIMER) - start
            else:
                elapsed = spins.to(tl.int64)
    return value
