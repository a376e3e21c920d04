// dlopen/dlsym of the CUDA runtime and driver; see cuda_api.h for why nothing is linked.
#include "cuda_api.h"

#include <dlfcn.h>

#include <algorithm>
#include <chrono>

#include "command.h"

namespace mgraph {
namespace {

// Adds the host time of one queueing call to CudaApi::call_ns (also when the call throws).
class CallTimer {
 public:
  explicit CallTimer(const CudaApi& api) : api_(api), start_(std::chrono::steady_clock::now()) {}
  ~CallTimer() {
    const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(
        std::chrono::steady_clock::now() - start_).count();
    api_.call_ns.fetch_add(static_cast<int64_t>(ns), std::memory_order_relaxed);
    api_.calls.fetch_add(1, std::memory_order_relaxed);
  }

 private:
  const CudaApi& api_;
  std::chrono::steady_clock::time_point start_;
};

void* open_first(const std::vector<std::string>& names, std::string& tried) {
  for (const auto& name : names) {
    // RTLD_NOLOAD first: the process (torch) normally has the library loaded already, and
    // using that very copy keeps one CUDA context per device.
    void* handle = dlopen(name.c_str(), RTLD_NOW | RTLD_NOLOAD);
    if (handle == nullptr) handle = dlopen(name.c_str(), RTLD_NOW);
    if (handle != nullptr) return handle;
    const char* why = dlerror();
    tried += "\n    " + name + ": " + (why ? why : "not found");
  }
  return nullptr;
}

template <typename Fn>
bool resolve(void* lib, const char* name, Fn& out, std::string& missing) {
  out = reinterpret_cast<Fn>(dlsym(lib, name));
  if (out == nullptr) missing += std::string(" ") + name;
  return out != nullptr;
}

}  // namespace

std::string CudaApi::load(const std::vector<std::string>& runtime_libs,
                          const std::vector<std::string>& driver_libs) {
  if (loaded()) return "";
  std::string tried;
  runtime_ = open_first(runtime_libs, tried);
  if (runtime_ == nullptr) return "cannot load the CUDA runtime (libcudart):" + tried;
  driver_ = open_first(driver_libs, tried);
  if (driver_ == nullptr) return "cannot load the CUDA driver (libcuda):" + tried;
  std::string missing;
  resolve(runtime_, "cudaSetDevice", set_device_, missing);
  resolve(runtime_, "cudaStreamCreateWithFlags", stream_create_, missing);
  resolve(runtime_, "cudaStreamDestroy", stream_destroy_, missing);
  resolve(runtime_, "cudaStreamSynchronize", stream_synchronize_, missing);
  resolve(runtime_, "cudaMemcpyAsync", memcpy_async_, missing);
  resolve(runtime_, "cudaGetErrorString", error_string_, missing);
  resolve(driver_, "cuGetErrorString", driver_error_string_, missing);
  resolve(runtime_, "cudaHostAlloc", host_alloc_, missing);
  resolve(runtime_, "cudaFreeHost", free_host_, missing);
  resolve(runtime_, "cudaEventCreateWithFlags", event_create_, missing);
  resolve(runtime_, "cudaEventDestroy", event_destroy_, missing);
  resolve(runtime_, "cudaEventRecord", event_record_, missing);
  resolve(runtime_, "cudaEventSynchronize", event_synchronize_, missing);
  resolve(runtime_, "cudaEventQuery", event_query_, missing);
  resolve(runtime_, "cudaStreamQuery", stream_query_, missing);
  resolve(runtime_, "cudaGetDeviceCount", device_count_, missing);
  resolve(runtime_, "cudaDeviceCanAccessPeer", can_access_peer_, missing);
  resolve(runtime_, "cudaDeviceEnablePeerAccess", enable_peer_, missing);
  resolve(runtime_, "cudaGetLastError", last_error_, missing);
  // CUDA 12 headers map cuStreamWriteValue32 to the _v2 symbol; older drivers export only v1.
  stream_write_value32_ = reinterpret_cast<decltype(stream_write_value32_)>(
      dlsym(driver_, "cuStreamWriteValue32_v2"));
  if (stream_write_value32_ == nullptr)
    resolve(driver_, "cuStreamWriteValue32", stream_write_value32_, missing);
  // Optional: batched stream memory operations (v2 where the driver has it, as for
  // cuStreamWriteValue32) and the driver's own 1-D copy.
  batch_memop_ = reinterpret_cast<decltype(batch_memop_)>(dlsym(driver_, "cuStreamBatchMemOp_v2"));
  batch_memop_v2_ = batch_memop_ != nullptr;
  if (batch_memop_ == nullptr)
    batch_memop_ = reinterpret_cast<decltype(batch_memop_)>(dlsym(driver_, "cuStreamBatchMemOp"));
  memcpy_driver_ = reinterpret_cast<decltype(memcpy_driver_)>(dlsym(driver_, "cuMemcpyAsync"));
  // Optional: the copy-and-flag kernel's module and launch (copy_kernel.h).
  module_load_ = reinterpret_cast<decltype(module_load_)>(dlsym(driver_, "cuModuleLoadData"));
  module_function_ =
      reinterpret_cast<decltype(module_function_)>(dlsym(driver_, "cuModuleGetFunction"));
  launch_kernel_ = reinterpret_cast<decltype(launch_kernel_)>(dlsym(driver_, "cuLaunchKernel"));
  module_unload_ = reinterpret_cast<decltype(module_unload_)>(dlsym(driver_, "cuModuleUnload"));
  decltype(memcpy_2d_async) copy = nullptr;
  resolve(runtime_, "cudaMemcpy2DAsync", copy, missing);
  if (!missing.empty()) return "CUDA libraries lack:" + missing;
  // Optional: the batch API (CUDA >= 12.8). Absent or another signature: the fallback.
  Status (*version)(int*) = reinterpret_cast<Status (*)(int*)>(dlsym(runtime_, "cudaRuntimeGetVersion"));
  if (version != nullptr && version(&runtime_version_) != 0) runtime_version_ = 0;
  void* batch = dlsym(runtime_, "cudaMemcpyBatchAsync");
  if (batch != nullptr && runtime_version_ >= 13000)
    memcpy_batch13_ = reinterpret_cast<decltype(memcpy_batch13_)>(batch);
  else if (batch != nullptr && runtime_version_ >= 12080)
    memcpy_batch_ = reinterpret_cast<decltype(memcpy_batch_)>(batch);
  // Optional: dma-buf export of device memory (CUDA >= 11.7), for the verbs backend.
  get_handle_ = reinterpret_cast<decltype(get_handle_)>(
      dlsym(driver_, "cuMemGetHandleForAddressRange"));
  memcpy_2d_async = copy;  // last: loaded() is true only when every symbol resolved
  return "";
}

void CudaApi::check(Status status, const char* call) const {
  if (status == 0) return;
  const char* text = error_string_ ? error_string_(status) : "unknown error";
  throw Failure{-1, std::string(call) + " failed: " + text + " (" + std::to_string(status) + ")"};
}

void CudaApi::check_driver(int status, const char* call) const {
  if (status == 0) return;
  const char* text = nullptr;
  if (driver_error_string_) driver_error_string_(status, &text);
  throw Failure{-1, std::string(call) + " failed: " + (text ? text : "unknown error") + " (" +
                        std::to_string(status) + ")"};
}

void CudaApi::set_device(int device) const { check(set_device_(device), "cudaSetDevice"); }

void* CudaApi::create_stream() const {
  void* stream = nullptr;
  check(stream_create_(&stream, kStreamNonBlocking), "cudaStreamCreateWithFlags");
  return stream;
}

void CudaApi::destroy_stream(void* stream) const {
  if (stream != nullptr) check(stream_destroy_(stream), "cudaStreamDestroy");
}

void CudaApi::synchronize(void* stream) const {
  check(stream_synchronize_(stream), "cudaStreamSynchronize");
}

void CudaApi::copy_2d(void* dst, size_t dpitch, const void* src, size_t spitch, size_t width,
                      size_t height, void* stream) const {
  const CallTimer timer(*this);
  if (height == 1 || (width == spitch && width == dpitch)) {
    check(memcpy_async_(dst, src, width * height, kMemcpyDefault, stream), "cudaMemcpyAsync");
  } else {
    check(memcpy_2d_async(dst, dpitch, src, spitch, width, height, kMemcpyDefault, stream),
          "cudaMemcpy2DAsync");
  }
}

void CudaApi::write_value32(void* stream, unsigned long long address, unsigned value) const {
  const CallTimer timer(*this);
  check_driver(stream_write_value32_(stream, address, value, 0), "cuStreamWriteValue32");
}


namespace {
// CUstreamBatchMemOpParams (cuda.h): a 48-byte union; its writeValue and memoryBarrier members,
// spelled out.
struct WriteValueOp {
  int operation;  // CUstreamBatchMemOpType
  unsigned long long address;
  unsigned value, value_high;  // union {cuuint32_t value; cuuint64_t value64}: little-endian
  unsigned flags;              // 0: the store waits for a memory barrier (data first)
  unsigned long long alias;    // driver internal
  unsigned long long pad;      // to the union's 48 bytes
};
struct BarrierOp {
  int operation;
  unsigned flags;  // CUstreamMemoryBarrier_flags
  unsigned long long pad[5];
};
union MemOp {
  WriteValueOp write;
  BarrierOp barrier;
};
static_assert(sizeof(MemOp) == 48, "CUstreamBatchMemOpParams is 48 bytes");
constexpr int kWriteValue32 = 2;    // CU_STREAM_MEM_OP_WRITE_VALUE_32
constexpr int kBarrier = 6;         // CU_STREAM_MEM_OP_BARRIER (the _v2 API only)
constexpr unsigned kNoBarrier = 1;  // CU_STREAM_WRITE_VALUE_NO_MEMORY_BARRIER
constexpr unsigned kGpuScope = 1;   // CU_STREAM_MEMORY_BARRIER_TYPE_GPU
}  // namespace

void CudaApi::write_values32(void* stream, const unsigned long long* addresses,
                             const unsigned* values, size_t n, size_t& failed,
                             bool gpu_scope) const {
  failed = n;
  if (gpu_scope && has_memop_barrier()) {
    MemOp ops[kMaxMemOps];
    for (size_t at = 0; at < n; at += kMaxMemOps - 1) {
      const size_t count = std::min(kMaxMemOps - 1, n - at);
      ops[0].barrier = BarrierOp{kBarrier, kGpuScope, {0, 0, 0, 0, 0}};
      for (size_t i = 0; i < count; ++i)
        ops[1 + i].write =
            WriteValueOp{kWriteValue32, addresses[at + i], values[at + i], 0, kNoBarrier, 0, 0};
      failed = at;
      const CallTimer timer(*this);
      check_driver(batch_memop_(stream, static_cast<unsigned>(count + 1), ops, 0),
                   "cuStreamBatchMemOp");
    }
    failed = n;
    return;
  }
  if (batch_memop_ == nullptr || n == 1) {
    for (size_t i = 0; i < n; ++i) {
      failed = i;
      write_value32(stream, addresses[i], values[i]);
    }
    failed = n;
    return;
  }
  WriteValueOp ops[kMaxMemOps];
  for (size_t at = 0; at < n; at += kMaxMemOps) {
    const size_t count = std::min(kMaxMemOps, n - at);
    for (size_t i = 0; i < count; ++i)
      ops[i] = WriteValueOp{kWriteValue32, addresses[at + i], values[at + i], 0, 0, 0, 0};
    failed = at;
    const CallTimer timer(*this);
    check_driver(batch_memop_(stream, static_cast<unsigned>(count), ops, 0), "cuStreamBatchMemOp");
  }
  failed = n;
}

void CudaApi::copy_driver(void* dst, const void* src, size_t bytes, void* stream) const {
  const CallTimer timer(*this);
  check_driver(memcpy_driver_(reinterpret_cast<unsigned long long>(dst),
                              reinterpret_cast<unsigned long long>(src), bytes, stream),
               "cuMemcpyAsync");
}

void* CudaApi::load_kernel(const char* ptx, const char* name, void*& module) const {
  module = nullptr;
  check_driver(module_load_(&module, ptx), "cuModuleLoadData");
  void* function = nullptr;
  const int status = module_function_(&function, module, name);
  if (status != 0) {
    module_unload_(module);
    module = nullptr;
    check_driver(status, "cuModuleGetFunction");
  }
  return function;
}

void CudaApi::unload_module(void* module) const {
  if (module != nullptr) check_driver(module_unload_(module), "cuModuleUnload");
}

void CudaApi::launch(void* function, unsigned blocks, unsigned threads, const void* args,
                     void* stream) const {
  const CallTimer timer(*this);
  void* params[] = {const_cast<void*>(args)};
  check_driver(launch_kernel_(function, blocks, 1, 1, threads, 1, 1, 0, stream, params, nullptr),
               "cuLaunchKernel");
}

void* CudaApi::host_alloc(size_t bytes) const {
  void* ptr = nullptr;
  check(host_alloc_(&ptr, bytes, 0), "cudaHostAlloc");  // cudaHostAllocDefault: pinned, UVA
  return ptr;
}

void CudaApi::free_host(void* ptr) const {
  if (ptr != nullptr) check(free_host_(ptr), "cudaFreeHost");
}

void* CudaApi::create_event() const {
  void* event = nullptr;
  check(event_create_(&event, 2), "cudaEventCreateWithFlags");  // cudaEventDisableTiming
  return event;
}

void CudaApi::destroy_event(void* event) const {
  if (event != nullptr) check(event_destroy_(event), "cudaEventDestroy");
}

void CudaApi::record(void* event, void* stream) const {
  const CallTimer timer(*this);
  check(event_record_(event, stream), "cudaEventRecord");
}

namespace {
constexpr int kNotReady = 600;  // cudaErrorNotReady: not an error, and not sticky
}  // namespace

bool CudaApi::stream_done(void* stream) const {
  const Status status = stream_query_(stream);
  if (status == kNotReady) return false;
  check(status, "cudaStreamQuery");
  return true;
}

bool CudaApi::event_done(void* event) const {
  const Status status = event_query_(event);
  if (status == kNotReady) return false;
  check(status, "cudaEventQuery");
  return true;
}

void CudaApi::wait_event(void* event) const {
  check(event_synchronize_(event), "cudaEventSynchronize");
}

void CudaApi::copy(void* dst, const void* src, size_t bytes, void* stream) const {
  const CallTimer timer(*this);
  check(memcpy_async_(dst, src, bytes, kMemcpyDefault, stream), "cudaMemcpyAsync");
}

namespace {
// cudaMemcpyAttributes of CUDA 12.8: srcAccessOrder, srcLocHint {type, id}, dstLocHint, flags.
struct MemcpyAttributes {
  int src_access_order;
  int src_loc_type, src_loc_id;
  int dst_loc_type, dst_loc_id;
  unsigned flags;
};
constexpr int kSrcAccessOrderStream = 1;  // read the source in stream order: staged words
}  // namespace

void CudaApi::copy_batch(void* const* dsts, void* const* srcs, const size_t* sizes, size_t n,
                         void* stream, size_t& failed) const {
  const CallTimer timer(*this);
  MemcpyAttributes attrs{kSrcAccessOrderStream, 0, 0, 0, 0, 0};  // location hints: none
  size_t first = 0;
  failed = n;
  size_t blamed = static_cast<size_t>(-1);
  if (memcpy_batch13_ != nullptr) {  // CUDA 13 names no failing copy
    check(memcpy_batch13_(dsts, srcs, sizes, n, &attrs, &first, 1, stream), "cudaMemcpyBatchAsync");
    return;
  }
  const Status status = memcpy_batch_(dsts, srcs, sizes, n, &attrs, &first, 1, &blamed, stream);
  if (status != 0 && blamed < n) failed = blamed;
  check(status, "cudaMemcpyBatchAsync");
}

std::string CudaApi::dmabuf_fd(unsigned long long ptr, size_t bytes, int& fd) const {
  constexpr int kDmaBufFd = 1;  // CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD
  fd = -1;
  if (get_handle_ == nullptr) return "the CUDA driver has no cuMemGetHandleForAddressRange";
  int handle = -1;
  const int status = get_handle_(&handle, ptr, bytes, kDmaBufFd, 0);
  if (status != 0) {
    const char* text = nullptr;
    if (driver_error_string_) driver_error_string_(status, &text);
    return std::string("cuMemGetHandleForAddressRange failed: ") + (text ? text : "unknown") +
           " (" + std::to_string(status) + ")";
  }
  fd = handle;
  return "";
}

int CudaApi::enable_peers(int device) const {
  constexpr Status kAlreadyEnabled = 704;  // cudaErrorPeerAccessAlreadyEnabled
  int count = 0, enabled = 0;
  check(device_count_(&count), "cudaGetDeviceCount");
  for (int peer = 0; peer < count; ++peer) {
    if (peer == device) continue;
    int can = 0;
    check(can_access_peer_(&can, device, peer), "cudaDeviceCanAccessPeer");
    if (!can) continue;
    const Status status = enable_peer_(peer, 0);  // for the current device (``device``)
    if (status == kAlreadyEnabled) {
      last_error_();  // clear it: not an error for us
      continue;
    }
    check(status, "cudaDeviceEnablePeerAccess");
    ++enabled;
  }
  return enabled;
}

}  // namespace mgraph
