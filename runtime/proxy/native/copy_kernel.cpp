// The copy-and-flag kernel's PTX and the Mover's path through it; see copy_kernel.h.
#include "copy_kernel.h"

#include <cstring>
#include <string>
#include <thread>

#include "mover.h"

namespace mgraph {

// Hand-written, so the extension still builds without a CUDA toolkit (setup.py); checked by
// tests/test_native_copy_kernel.py with ptxas where one is installed. Registers: rd1 dst, rd2
// src, rd3 width, rd4 height, rd5 dpitch, rd6 spitch, rd7 unit, rd8 n_flags; thread i copies
// units i, i + ntid, ... of the (height x width/unit) grid; after barrier.sync, thread 0 stores the
// flags in order, each with st.release.sys.
const char kCopyKernelPtx[] = R"PTX(
.version 7.8
.target sm_90
.address_size 64

// One CTA: copy height rows of width bytes (unit bytes per access), then raise n_flags words.
.visible .entry mgraph_copy_flags(.param .align 8 .b8 args[160])
{
  .reg .pred %p<4>;
  .reg .b32 %r<8>;
  .reg .b64 %rd<24>;

  ld.param.u64 %rd1, [args+0];
  ld.param.u64 %rd2, [args+8];
  ld.param.u64 %rd3, [args+16];
  ld.param.u64 %rd4, [args+24];
  ld.param.u64 %rd5, [args+32];
  ld.param.u64 %rd6, [args+40];
  ld.param.u64 %rd7, [args+48];
  ld.param.u64 %rd8, [args+56];
  mov.u32 %r1, %tid.x;
  mov.u32 %r2, %ntid.x;
  cvt.u64.u32 %rd9, %r1;
  cvt.u64.u32 %rd10, %r2;
  div.u64 %rd11, %rd3, %rd7;
  mul.lo.u64 %rd12, %rd11, %rd4;
$copy:
  setp.ge.u64 %p1, %rd9, %rd12;
  @%p1 bra $copied;
  div.u64 %rd13, %rd9, %rd11;
  mul.lo.u64 %rd14, %rd13, %rd11;
  sub.u64 %rd15, %rd9, %rd14;
  mul.lo.u64 %rd15, %rd15, %rd7;
  mad.lo.u64 %rd16, %rd13, %rd6, %rd2;
  add.u64 %rd16, %rd16, %rd15;
  mad.lo.u64 %rd17, %rd13, %rd5, %rd1;
  add.u64 %rd17, %rd17, %rd15;
  setp.eq.u64 %p2, %rd7, 16;
  @%p2 bra $v16;
  setp.eq.u64 %p2, %rd7, 4;
  @%p2 bra $v4;
  ld.global.cg.u8 %r3, [%rd16];
  st.global.u8 [%rd17], %r3;
  bra $next;
$v4:
  ld.global.cg.u32 %r3, [%rd16];
  st.global.u32 [%rd17], %r3;
  bra $next;
$v16:
  ld.global.cg.v4.u32 {%r3, %r4, %r5, %r6}, [%rd16];
  st.global.v4.u32 [%rd17], {%r3, %r4, %r5, %r6};
$next:
  add.u64 %rd9, %rd9, %rd10;
  bra $copy;
$copied:
  barrier.sync 0;
  setp.ne.u32 %p3, %r1, 0;
  @%p3 bra $done;
  setp.le.u64 %p3, %rd8, 0;
  @%p3 bra $done;
  ld.param.u64 %rd18, [args+64];
  ld.param.u32 %r7, [args+128];
  st.release.sys.global.u32 [%rd18], %r7;
  setp.le.u64 %p3, %rd8, 1;
  @%p3 bra $done;
  ld.param.u64 %rd18, [args+72];
  ld.param.u32 %r7, [args+132];
  st.release.sys.global.u32 [%rd18], %r7;
  setp.le.u64 %p3, %rd8, 2;
  @%p3 bra $done;
  ld.param.u64 %rd18, [args+80];
  ld.param.u32 %r7, [args+136];
  st.release.sys.global.u32 [%rd18], %r7;
  setp.le.u64 %p3, %rd8, 3;
  @%p3 bra $done;
  ld.param.u64 %rd18, [args+88];
  ld.param.u32 %r7, [args+140];
  st.release.sys.global.u32 [%rd18], %r7;
  setp.le.u64 %p3, %rd8, 4;
  @%p3 bra $done;
  ld.param.u64 %rd18, [args+96];
  ld.param.u32 %r7, [args+144];
  st.release.sys.global.u32 [%rd18], %r7;
  setp.le.u64 %p3, %rd8, 5;
  @%p3 bra $done;
  ld.param.u64 %rd18, [args+104];
  ld.param.u32 %r7, [args+148];
  st.release.sys.global.u32 [%rd18], %r7;
  setp.le.u64 %p3, %rd8, 6;
  @%p3 bra $done;
  ld.param.u64 %rd18, [args+112];
  ld.param.u32 %r7, [args+152];
  st.release.sys.global.u32 [%rd18], %r7;
  setp.le.u64 %p3, %rd8, 7;
  @%p3 bra $done;
  ld.param.u64 %rd18, [args+120];
  ld.param.u32 %r7, [args+156];
  st.release.sys.global.u32 [%rd18], %r7;
$done:
  ret;
}
)PTX";

// The mailbox kernel (copy_kernel.h): thread 0 polls slot ``head % n_slots`` until its sequence
// is head + 1 and copies the slot into shared memory (relaxed sys-scope loads: host memory,
// never a stale L1 line); after barrier.sync every thread reads it there and copies as above
// (registers rd1..rd8 as in the copy kernel); after the second barrier.sync thread 0 raises the
// flags, then stores head + 1 into ``done`` with st.release.sys.
const char kMailboxPtx[] = R"PTX(
.version 7.8
.target sm_90
.address_size 64

// Persistent, one CTA: executes the descriptors the proxy posts into ``ring`` (pinned host
// memory, ``n_slots`` slots of 176 bytes: seq, op, then a CopyKernelArgs) in order; after each,
// ``done`` (pinned host memory) holds how many are finished. op 2 ends the kernel.
.visible .entry mgraph_mailbox(.param .u64 ring, .param .u64 done, .param .u64 n_slots)
{
  .reg .pred %p<6>;
  .reg .b32 %r<8>;
  .reg .b64 %rd<32>;
  .shared .align 8 .b8 desc[176];

  ld.param.u64 %rd24, [ring];
  ld.param.u64 %rd25, [done];
  ld.param.u64 %rd26, [n_slots];
  mov.u64 %rd27, 0;
  mov.u32 %r1, %tid.x;
$next_desc:
  setp.ne.u32 %p4, %r1, 0;
  @%p4 bra $posted;
  rem.u64 %rd20, %rd27, %rd26;
  mad.lo.u64 %rd20, %rd20, 176, %rd24;
  add.u64 %rd21, %rd27, 1;
$poll:
  ld.acquire.sys.global.u64 %rd22, [%rd20];
  setp.ne.u64 %p5, %rd22, %rd21;
  @%p5 bra $poll;
  ld.relaxed.sys.global.u64 %rd22, [%rd20+8];
  st.shared.u64 [desc+8], %rd22;
  ld.relaxed.sys.global.u64 %rd22, [%rd20+16];
  st.shared.u64 [desc+16], %rd22;
  ld.relaxed.sys.global.u64 %rd22, [%rd20+24];
  st.shared.u64 [desc+24], %rd22;
  ld.relaxed.sys.global.u64 %rd22, [%rd20+32];
  st.shared.u64 [desc+32], %rd22;
  ld.relaxed.sys.global.u64 %rd22, [%rd20+40];
  st.shared.u64 [desc+40], %rd22;
  ld.relaxed.sys.global.u64 %rd22, [%rd20+48];
  st.shared.u64 [desc+48], %rd22;
  ld.relaxed.sys.global.u64 %rd22, [%rd20+56];
  st.shared.u64 [desc+56], %rd22;
  ld.relaxed.sys.global.u64 %rd22, [%rd20+64];
  st.shared.u64 [desc+64], %rd22;
  ld.relaxed.sys.global.u64 %rd22, [%rd20+72];
  st.shared.u64 [desc+72], %rd22;
  ld.relaxed.sys.global.u64 %rd22, [%rd20+80];
  st.shared.u64 [desc+80], %rd22;
  ld.relaxed.sys.global.u64 %rd22, [%rd20+88];
  st.shared.u64 [desc+88], %rd22;
  ld.relaxed.sys.global.u64 %rd22, [%rd20+96];
  st.shared.u64 [desc+96], %rd22;
  ld.relaxed.sys.global.u64 %rd22, [%rd20+104];
  st.shared.u64 [desc+104], %rd22;
  ld.relaxed.sys.global.u64 %rd22, [%rd20+112];
  st.shared.u64 [desc+112], %rd22;
  ld.relaxed.sys.global.u64 %rd22, [%rd20+120];
  st.shared.u64 [desc+120], %rd22;
  ld.relaxed.sys.global.u64 %rd22, [%rd20+128];
  st.shared.u64 [desc+128], %rd22;
  ld.relaxed.sys.global.u64 %rd22, [%rd20+136];
  st.shared.u64 [desc+136], %rd22;
  ld.relaxed.sys.global.u64 %rd22, [%rd20+144];
  st.shared.u64 [desc+144], %rd22;
  ld.relaxed.sys.global.u64 %rd22, [%rd20+152];
  st.shared.u64 [desc+152], %rd22;
  ld.relaxed.sys.global.u64 %rd22, [%rd20+160];
  st.shared.u64 [desc+160], %rd22;
  ld.relaxed.sys.global.u64 %rd22, [%rd20+168];
  st.shared.u64 [desc+168], %rd22;
$posted:
  barrier.sync 0;
  ld.shared.u64 %rd23, [desc+8];
  setp.eq.u64 %p5, %rd23, 2;
  @%p5 bra $stop;
  ld.shared.u64 %rd1, [desc+16];
  ld.shared.u64 %rd2, [desc+24];
  ld.shared.u64 %rd3, [desc+32];
  ld.shared.u64 %rd4, [desc+40];
  ld.shared.u64 %rd5, [desc+48];
  ld.shared.u64 %rd6, [desc+56];
  ld.shared.u64 %rd7, [desc+64];
  ld.shared.u64 %rd8, [desc+72];
  mov.u32 %r1, %tid.x;
  mov.u32 %r2, %ntid.x;
  cvt.u64.u32 %rd9, %r1;
  cvt.u64.u32 %rd10, %r2;
  div.u64 %rd11, %rd3, %rd7;
  mul.lo.u64 %rd12, %rd11, %rd4;
$copy:
  setp.ge.u64 %p1, %rd9, %rd12;
  @%p1 bra $copied;
  div.u64 %rd13, %rd9, %rd11;
  mul.lo.u64 %rd14, %rd13, %rd11;
  sub.u64 %rd15, %rd9, %rd14;
  mul.lo.u64 %rd15, %rd15, %rd7;
  mad.lo.u64 %rd16, %rd13, %rd6, %rd2;
  add.u64 %rd16, %rd16, %rd15;
  mad.lo.u64 %rd17, %rd13, %rd5, %rd1;
  add.u64 %rd17, %rd17, %rd15;
  setp.eq.u64 %p2, %rd7, 16;
  @%p2 bra $v16;
  setp.eq.u64 %p2, %rd7, 4;
  @%p2 bra $v4;
  ld.global.cg.u8 %r3, [%rd16];
  st.global.u8 [%rd17], %r3;
  bra $next;
$v4:
  ld.global.cg.u32 %r3, [%rd16];
  st.global.u32 [%rd17], %r3;
  bra $next;
$v16:
  ld.global.cg.v4.u32 {%r3, %r4, %r5, %r6}, [%rd16];
  st.global.v4.u32 [%rd17], {%r3, %r4, %r5, %r6};
$next:
  add.u64 %rd9, %rd9, %rd10;
  bra $copy;
$copied:
  barrier.sync 0;
  @%p4 bra $flagged;
  setp.le.u64 %p3, %rd8, 0;
  @%p3 bra $flagged;
  ld.shared.u64 %rd18, [desc+80];
  ld.shared.u32 %r7, [desc+144];
  st.release.sys.global.u32 [%rd18], %r7;
  setp.le.u64 %p3, %rd8, 1;
  @%p3 bra $flagged;
  ld.shared.u64 %rd18, [desc+88];
  ld.shared.u32 %r7, [desc+148];
  st.release.sys.global.u32 [%rd18], %r7;
  setp.le.u64 %p3, %rd8, 2;
  @%p3 bra $flagged;
  ld.shared.u64 %rd18, [desc+96];
  ld.shared.u32 %r7, [desc+152];
  st.release.sys.global.u32 [%rd18], %r7;
  setp.le.u64 %p3, %rd8, 3;
  @%p3 bra $flagged;
  ld.shared.u64 %rd18, [desc+104];
  ld.shared.u32 %r7, [desc+156];
  st.release.sys.global.u32 [%rd18], %r7;
  setp.le.u64 %p3, %rd8, 4;
  @%p3 bra $flagged;
  ld.shared.u64 %rd18, [desc+112];
  ld.shared.u32 %r7, [desc+160];
  st.release.sys.global.u32 [%rd18], %r7;
  setp.le.u64 %p3, %rd8, 5;
  @%p3 bra $flagged;
  ld.shared.u64 %rd18, [desc+120];
  ld.shared.u32 %r7, [desc+164];
  st.release.sys.global.u32 [%rd18], %r7;
  setp.le.u64 %p3, %rd8, 6;
  @%p3 bra $flagged;
  ld.shared.u64 %rd18, [desc+128];
  ld.shared.u32 %r7, [desc+168];
  st.release.sys.global.u32 [%rd18], %r7;
  setp.le.u64 %p3, %rd8, 7;
  @%p3 bra $flagged;
  ld.shared.u64 %rd18, [desc+136];
  ld.shared.u32 %r7, [desc+172];
  st.release.sys.global.u32 [%rd18], %r7;
$flagged:
  add.u64 %rd27, %rd27, 1;
  @%p4 bra $next_desc;
  st.release.sys.global.u64 [%rd25], %rd27;
  bra $next_desc;
$stop:
  ret;
}
)PTX";

uint64_t copy_unit(uint64_t dst, uint64_t src, uint64_t width, uint64_t dpitch, uint64_t spitch) {
  const uint64_t all = dst | src | width | dpitch | spitch;
  if (all % 16 == 0) return 16;
  if (all % 4 == 0) return 4;
  return 1;
}

void Mover::start_kernel() {
  if (copy_kernel_bytes <= 0) return;
  if (multi()) fail_kernel("copy_kernel_bytes needs one copy stream (streams=1)");
  if (!cuda.has_kernel())
    fail_kernel("copy_kernel_bytes needs the driver's cuModuleLoadData, cuModuleGetFunction and "
                "cuLaunchKernel, which this libcuda lacks");
  kernel_ = cuda.load_kernel(kCopyKernelPtx, kCopyKernelName, kernel_module_);
  // One empty launch, synchronised, while no kernel of the runtime spins yet: the module is
  // resident before the first WRITE needs it (cf. GPU.md, lazy loading under spinning kernels).
  CopyKernelArgs none;
  cuda.launch(kernel_, 1, kKernelThreads, &none, stream_);
  cuda.synchronize(stream_);
}

void Mover::stop_kernel() {
  if (kernel_module_ == nullptr) return;
  cuda.unload_module(kernel_module_);
  kernel_module_ = nullptr;
  kernel_ = nullptr;
}

void Mover::fail_kernel(const std::string& why) const { throw Failure{-1, why}; }

bool Mover::write_kernel(int64_t src_rank, int64_t dst_rank, const Buffer& s, const Buffer& d,
                         const Rect& src, uint8_t* to, const uint8_t* from,
                         const std::vector<int64_t>& events, const std::vector<int64_t>& done) {
  const int64_t width = src.cols() * s.itemsize, nbytes = width * src.rows();
  if (kernel_ == nullptr || nbytes > copy_kernel_bytes) return false;
  // Raised now, by the kernel: only when no earlier raise of the batch is still held back, so
  // words still go out in the order of their first raise (mover.h), and only GPU words.
  if (emitted_ != pending_.size() || events.size() + done.size() > kKernelFlags) return false;
  auto gpu_word = [&](int64_t rank) {
    const RankMemory& m = ranks.at(rank);
    return m.place == Place::kCuda && m.shadow != nullptr && m.host_flags == nullptr;
  };
  if ((!events.empty() && !gpu_word(dst_rank)) || (!done.empty() && !gpu_word(src_rank)))
    return false;
  CopyKernelArgs a;
  a.dst = reinterpret_cast<uint64_t>(to);
  a.src = reinterpret_cast<uint64_t>(from);
  a.width = static_cast<uint64_t>(width);
  a.height = static_cast<uint64_t>(src.rows());
  a.dpitch = static_cast<uint64_t>(d.row_bytes);
  a.spitch = static_cast<uint64_t>(s.row_bytes);
  a.unit = copy_unit(a.dst, a.src, a.width, a.height > 1 ? a.dpitch : 0,
                     a.height > 1 ? a.spitch : 0);
  // One store per word, its last count (a coalesced group may raise a word several times).
  auto add = [&](int64_t rank, int64_t event) {
    RankMemory& m = ranks.at(rank);
    const int64_t value = __atomic_add_fetch(&m.shadow[event], 1, __ATOMIC_RELAXED);
    const uint64_t address = m.flags + 4ull * static_cast<uint64_t>(event);
    stats.events.fetch_add(1, std::memory_order_relaxed);
    for (uint64_t k = 0; k < a.n_flags; ++k) {
      if (a.flag[k] != address) continue;
      a.value[k] = static_cast<uint32_t>(value);
      return;
    }
    a.flag[a.n_flags] = address;
    a.value[a.n_flags++] = static_cast<uint32_t>(value);
    stats.raises.fetch_add(1, std::memory_order_relaxed);
  };
  for (int64_t e : events) add(dst_rank, e);  // the destination's words first, as raise_ready
  for (int64_t e : done) add(src_rank, e);
  cuda.launch(kernel_, 1, kKernelThreads, &a, stream_);
  stats.kernel_writes.fetch_add(1, std::memory_order_relaxed);
  return true;
}

}  // namespace mgraph

namespace mgraph {

void Mover::start_mailbox() {
  if (!mailbox) return;
  if (multi()) fail_kernel("mailbox needs one copy stream (streams=1)");
  if (nic != nullptr) fail_kernel("mailbox: the verbs backend raises GPU words on the stream");
  if (!cuda.has_kernel())
    fail_kernel("mailbox needs the driver's cuModuleLoadData, cuModuleGetFunction and "
                "cuLaunchKernel, which this libcuda lacks");
  void* function = cuda.load_kernel(kMailboxPtx, kMailboxName, mailbox_module_);
  const size_t ring_bytes = kMailboxSlots * sizeof(MailboxSlot);
  slots_ = static_cast<MailboxSlot*>(cuda.host_alloc(ring_bytes + sizeof(uint64_t)));
  std::memset(static_cast<void*>(slots_), 0, ring_bytes + sizeof(uint64_t));  // seq 0: empty
  mailbox_done_ = reinterpret_cast<uint64_t*>(reinterpret_cast<uint8_t*>(slots_) + ring_bytes);
  mailbox_stream_ = cuda.create_stream();
  uint64_t ring = reinterpret_cast<uint64_t>(slots_), done = ring + ring_bytes, n = kMailboxSlots;
  void* params[] = {&ring, &done, &n};
  cuda.launch_params(function, 1, kKernelThreads, params, mailbox_stream_);
  mailbox_running_ = true;
}

void Mover::post_mailbox(uint64_t op, const CopyKernelArgs& args, bool abortable) {
  const uint64_t ticket = mailbox_head_;
  if (ticket >= kMailboxSlots) {  // the slot's previous descriptor must be finished
    const uint64_t need = ticket - kMailboxSlots + 1;
    const double deadline = now_s() + send_timeout_s;
    while (__atomic_load_n(mailbox_done_, __ATOMIC_ACQUIRE) < need) {
      if (abortable && abort != nullptr && abort->load(std::memory_order_relaxed))
        fail_kernel("aborted");
      if (now_s() > deadline) {
        mailbox_stuck_ = !abortable;  // the stop descriptor could not be posted
        fail_kernel("mailbox: the GPU finished no descriptor for " +
                    std::to_string(send_timeout_s) + " s (" +
                    std::to_string(__atomic_load_n(mailbox_done_, __ATOMIC_ACQUIRE)) + " of " +
                    std::to_string(ticket) + " done): its kernel is not running (every SM held "
                    "by other kernels?)");
      }
      std::this_thread::yield();
    }
  }
  MailboxSlot& slot = slots_[ticket % kMailboxSlots];
  slot.op = op;
  slot.args = args;
  // Release: the slot's body is visible before its sequence number (x86: stores in order; the
  // GPU reads the sequence with ld.acquire.sys, then the body).
  __atomic_store_n(&slot.seq, ticket + 1, __ATOMIC_RELEASE);
  mailbox_head_ = ticket + 1;
  if (op == kMailboxCopy) stats.mailbox_posts.fetch_add(1, std::memory_order_relaxed);
}

void Mover::stop_mailbox() {
  if (!mailbox_running_) return;
  mailbox_running_ = false;
  // After every descriptor posted before it; even when aborting, or the kernel runs on.
  post_mailbox(kMailboxStop, CopyKernelArgs{}, false);
  // Bounded, not cudaStreamSynchronize: a kernel that never ends must be an error, not a hang.
  const double deadline = now_s() + send_timeout_s;
  while (!cuda.stream_done(mailbox_stream_)) {
    if (now_s() > deadline) {
      mailbox_stuck_ = true;  // nothing may be freed under it (~Mover leaks instead)
      fail_kernel("mailbox: its kernel did not end within " + std::to_string(send_timeout_s) +
                  " s of the stop descriptor (" + std::to_string(*mailbox_done_) + " of " +
                  std::to_string(mailbox_head_ - 1) + " descriptors done)");
    }
    std::this_thread::yield();
  }
}

void Mover::free_mailbox() {
  cuda.destroy_stream(mailbox_stream_);
  mailbox_stream_ = nullptr;
  cuda.free_host(slots_);
  slots_ = nullptr;
  cuda.unload_module(mailbox_module_);
  mailbox_module_ = nullptr;
}

bool Mover::raise_by_mailbox(CopyKernelArgs& a, int64_t rank, const std::vector<int64_t>& words) {
  if (words.empty()) return true;
  const RankMemory& m = ranks.at(rank);
  if (m.place != Place::kCuda || m.shadow == nullptr || m.host_flags != nullptr) return false;
  for (int64_t event : words) {
    const uint64_t address = m.flags + 4ull * static_cast<uint64_t>(event);
    uint64_t k = 0;
    while (k < a.n_flags && a.flag[k] != address) ++k;
    if (k == a.n_flags) {  // a new word: the descriptor full, the rest go in flag-only ones
      if (a.n_flags == kKernelFlags) {
        post_mailbox(kMailboxCopy, a);
        a = CopyKernelArgs{};  // no data: width 0, executed after the copy before it
        k = 0;
      }
      a.flag[a.n_flags++] = address;
      stats.raises.fetch_add(1, std::memory_order_relaxed);
    }
    a.value[k] = static_cast<uint32_t>(__atomic_add_fetch(&m.shadow[event], 1, __ATOMIC_RELAXED));
    stats.events.fetch_add(1, std::memory_order_relaxed);
  }
  return true;
}

void Mover::write_mailbox(int64_t src_rank, int64_t dst_rank, const Buffer& s, const Buffer& d,
                          const Rect& src, uint8_t* to, const uint8_t* from,
                          const std::vector<int64_t>& events, const std::vector<int64_t>& done) {
  CopyKernelArgs a;
  a.dst = reinterpret_cast<uint64_t>(to);
  a.src = reinterpret_cast<uint64_t>(from);
  a.width = static_cast<uint64_t>(src.cols() * s.itemsize);
  a.height = static_cast<uint64_t>(src.rows());
  a.dpitch = static_cast<uint64_t>(d.row_bytes);
  a.spitch = static_cast<uint64_t>(s.row_bytes);
  a.unit = copy_unit(a.dst, a.src, a.width, a.height > 1 ? a.dpitch : 0,
                     a.height > 1 ? a.spitch : 0);
  // Every GPU word goes through the ring while it runs (copy_kernel.h): no other path. A word
  // (or more than kKernelFlags of them) follows the copy in the same or a later descriptor.
  auto gpu_words = [&](int64_t rank, const std::vector<int64_t>& words) {
    const RankMemory& m = ranks.at(rank);
    return words.empty() ||
           (m.place == Place::kCuda && m.shadow != nullptr && m.host_flags == nullptr);
  };
  if (!gpu_words(dst_rank, events) || !gpu_words(src_rank, done))
    fail_kernel("mailbox: a WRITE raising words not in GPU memory cannot go through the mailbox "
                "(leave the mailbox off with host-resident flags)");
  raise_by_mailbox(a, dst_rank, events);
  raise_by_mailbox(a, src_rank, done);
  post_mailbox(kMailboxCopy, a);
}

void Mover::signal_mailbox(int64_t rank, int64_t event) {
  CopyKernelArgs a;  // no data: width 0
  if (!raise_by_mailbox(a, rank, {event}))
    fail_kernel("mailbox: SIGNAL of a word not in GPU memory");
  post_mailbox(kMailboxCopy, a);
}

}  // namespace mgraph
