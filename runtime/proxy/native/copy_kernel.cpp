// The copy-and-flag kernel's PTX and the Mover's path through it; see copy_kernel.h.
#include "copy_kernel.h"

#include <string>

#include "mover.h"

namespace mgraph {

// Hand-written, so the extension still builds without a CUDA toolkit (setup.py); checked by
// tests/test_native_copy_kernel.py with ptxas where one is installed. Registers: rd1 dst, rd2
// src, rd3 width, rd4 height, rd5 dpitch, rd6 spitch, rd7 unit, rd8 n_flags; thread i copies
// units i, i + ntid, ... of the (height x width/unit) grid; after barrier.sync, thread 0 stores
// the flags in order, each with st.release.sys.
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
