// The copy-and-flag kernel: a WRITE's data copy and its flag raises as ONE operation on the
// proxy's stream (Mover::copy_kernel_bytes, opt-in; bench_proxy's protocol "kernel").
//
// Why. On one H200 a loopback WRITE measured 13.4-16 us push -> flag with every copy-engine
// protocol (benchmarks/NOTES.md v14): the data copy and the flag write are two stream
// operations, the second waits for the first to complete, and each starts only after the host
// queued it (cudaMemcpyAsync ~4 us of host time). Here the proxy queues ONE cuLaunchKernel of a
// one-CTA kernel (PTX below, JIT-compiled by the driver when the loop starts): its threads copy
// the data with plain loads and stores, meet at barrier.sync, and thread 0 then stores each flag
// word's new count with st.release.sys. No second operation, no completion to wait for.
// Measured (NOTES v20, one H200): 12.7-13.4 us at 4 KiB against the default's 14.1-14.8 in
// the same run; slower at 64 KiB (16.7-17.1 us) and in the 64 KiB drain (78-80 k/s against 99).
//
// Why the flag never passes its data. (1) Earlier work on the stream (copies, flags of earlier
// commands) has completed before the kernel starts, and later work starts after it ends:
// stream order, as for every other operation of the proxy. (2) Inside the kernel, every data
// store is ordered before barrier.sync (the non-.aligned form: threads leave the copy loop
// after different numbers of passes, so they arrive from divergent paths); thread 0's
// st.release.sys after the barrier is cumulative (PTX memory model: a release orders every
// write that precedes it in causality order, and barrier.sync puts all the CTA's earlier stores
// there), so any thread, on this GPU, on an NVLink peer or on the host, that observes the new
// count with an acquire (sync.wait's atom.add.acquire.sys) and then reads the data sees it.
// The megakernel's own ``signal`` is the same pattern (sync.py: CTA barrier, then
// atom.add.release.sys). Source loads are ld.global.cg (L2, not the SM's L1), so data the
// producer published before its FIFO header is read fresh. (3) Counts stay monotonic: each
// word's value is taken from its host shadow when the launch is queued, in stream order like
// every other raise of that word.
//
// The cost: an SM for a few microseconds per WRITE, so it needs an SM that no persistent kernel
// holds (a megakernel whose grid fills every SM would never let it run; KernelNet refuses a
// schedule that leaves it none, runtime/megakernel/shared_gpu.py), and
// one CTA copies at a fraction of the copy engine's rate, hence the size limit.
#pragma once

#include <cstddef>
#include <cstdint>

namespace mgraph {

constexpr int kKernelFlags = 8;          // flag stores one launch carries
constexpr unsigned kKernelThreads = 1024;  // one CTA: 16 KiB per pass at 16-byte units
constexpr const char* kCopyKernelName = "mgraph_copy_flags";

// The kernel's ONE parameter, passed by value; the PTX reads it at these offsets.
struct CopyKernelArgs {
  uint64_t dst = 0, src = 0;        // 0, 8
  uint64_t width = 0, height = 0;   // 16, 24: bytes per row, rows
  uint64_t dpitch = 0, spitch = 0;  // 32, 40
  uint64_t unit = 1;                // 48: bytes per load/store: 16, 4 or 1
  uint64_t n_flags = 0;             // 56
  uint64_t flag[kKernelFlags] = {};   // 64..127: flag word addresses
  uint32_t value[kKernelFlags] = {};  // 128..159: their new counts, stored in this order
};
static_assert(sizeof(CopyKernelArgs) == 160, "the PTX reads a 160-byte parameter");

// The PTX (ISA 7.8, sm_90; the driver JIT-compiles it for the GPU it runs on).
extern const char kCopyKernelPtx[];

// The widest of 16, 4, 1 bytes that divides both addresses, both pitches and the width.
uint64_t copy_unit(uint64_t dst, uint64_t src, uint64_t width, uint64_t dpitch, uint64_t spitch);

}  // namespace mgraph
