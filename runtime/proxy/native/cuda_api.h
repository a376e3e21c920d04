// CUDA entry points the drain loop uses, resolved at RUN time with dlopen/dlsym.
//
// The extension is built without a CUDA toolkit (CI has gcc only), so nothing here is linked:
// ``load`` opens the runtime (libcudart) and the driver (libcuda) that the running process
// already uses (the Python side passes their paths, found in /proc/self/maps), and only when a
// cuda_ipc transport is attached. Signatures are the public, stable C ABI of CUDA 12.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace mgraph {

class CudaApi {
 public:
  // cudaMemcpyKind / cudaStreamFlags values from driver_types.h.
  static constexpr int kMemcpyDefault = 4;
  static constexpr unsigned kStreamNonBlocking = 1;

  // "" on success, otherwise what could not be loaded.
  std::string load(const std::vector<std::string>& runtime_libs,
                   const std::vector<std::string>& driver_libs);
  bool loaded() const { return memcpy_2d_async != nullptr; }
  // cudaMemcpyBatchAsync was found and the runtime's version says which signature it has.
  bool has_batch() const { return memcpy_batch_ != nullptr || memcpy_batch13_ != nullptr; }
  // cuStreamBatchMemOp was found: several flag writes in one call (write_values32); _v2, which
  // also has memory barrier operations (write_values32's ``gpu_scope``).
  bool has_batch_memop() const { return batch_memop_ != nullptr; }
  bool has_memop_barrier() const { return batch_memop_ != nullptr && batch_memop_v2_; }
  // cuMemcpyAsync (the driver's) was found: copy_driver can queue 1-D copies.
  bool has_driver_copy() const { return memcpy_driver_ != nullptr; }
  // cuModuleLoadData, cuModuleGetFunction, cuLaunchKernel and cuModuleUnload were found (the
  // copy-and-flag kernel, copy_kernel.h).
  bool has_kernel() const {
    return module_load_ != nullptr && module_function_ != nullptr && launch_kernel_ != nullptr &&
           module_unload_ != nullptr;
  }
  // Loads ``ptx`` (the driver JIT-compiles it) into the current context; returns the function
  // ``name`` and sets ``module``.
  void* load_kernel(const char* ptx, const char* name, void*& module) const;
  void unload_module(void* module) const;
  // One launch of ``function`` with ONE parameter, ``args`` (copied by the driver at the call),
  // ``blocks`` x ``threads``, on ``stream``; counted with the queueing calls.
  void launch(void* function, unsigned blocks, unsigned threads, const void* args,
              void* stream) const;
  // cuMemGetHandleForAddressRange was found (the verbs backend's dma-buf registration).
  bool has_dmabuf() const { return get_handle_ != nullptr; }
  // A dma-buf fd for [ptr, ptr + bytes) (page-aligned) in ``fd``; "" or why there is none.
  std::string dmabuf_fd(unsigned long long ptr, size_t bytes, int& fd) const;
  int runtime_version() const { return runtime_version_; }
  // Host time spent inside the calls that queue copies or flag writes (copy, copy_2d,
  // copy_batch, copy_driver, write_value32, each cuStreamBatchMemOp of write_values32) and how
  // many there were: the proxy's own share of a command's latency (bench_proxy reports it per
  // command). Written by the drain thread, read by any.
  mutable std::atomic<int64_t> call_ns{0}, calls{0};

  // Each throws Failure{-1, ...} naming the call when CUDA reports an error.
  void set_device(int device) const;
  void* create_stream() const;
  void destroy_stream(void* stream) const;
  void synchronize(void* stream) const;
  void copy_2d(void* dst, size_t dpitch, const void* src, size_t spitch, size_t width,
               size_t height, void* stream) const;
  void write_value32(void* stream, unsigned long long address, unsigned value) const;
  // ``n`` stores as cuStreamWriteValue32 makes them (each after a system-wide memory barrier:
  // the data queued before them on ``stream`` is visible first), in ONE cuStreamBatchMemOp per
  // kMaxMemOps of them, executed in array order; without the symbol, one write_value32 each.
  // ``gpu_scope`` (has_memop_barrier() only, else ignored): each call starts with ONE barrier
  // of GPU scope and its stores have none of their own, which orders the stream's earlier
  // writes before them for readers on this GPU only (Mover::local_memory says when that is
  // every reader). On failure ``failed`` holds the index of the first store of the failing call.
  static constexpr size_t kMaxMemOps = 255;  // CUDA: "count ... must be less than 256"
  void write_values32(void* stream, const unsigned long long* addresses, const unsigned* values,
                      size_t n, size_t& failed, bool gpu_scope = false) const;
  // For flags written by the copy engine from pinned host memory (Mover::flag_copy).
  void* host_alloc(size_t bytes) const;
  void free_host(void* ptr) const;
  void* create_event() const;
  void destroy_event(void* event) const;
  void record(void* event, void* stream) const;  // counted with the queueing calls
  // Whether everything queued on ``stream`` (before ``event``'s record) has executed: polls,
  // not counted as queueing calls; any status but "not ready" throws.
  bool stream_done(void* stream) const;
  bool event_done(void* event) const;
  void wait_event(void* event) const;
  void copy(void* dst, const void* src, size_t bytes, void* stream) const;
  // The same 1-D copy through the driver's cuMemcpyAsync (unified addressing infers the
  // direction, as cudaMemcpyDefault does), skipping the runtime's layer (has_driver_copy()).
  void copy_driver(void* dst, const void* src, size_t bytes, void* stream) const;
  // ``n`` 1-D copies in ONE cudaMemcpyBatchAsync call (has_batch() only): ordered as a whole
  // after earlier work of ``stream``, in no order among themselves. On failure ``failed`` holds
  // the index CUDA blamed (or n when it named none) and Failure{-1} is thrown.
  void copy_batch(void* const* dsts, void* const* srcs, const size_t* sizes, size_t n,
                  void* stream, size_t& failed) const;
  // Lets ``device``'s copies reach every peer GPU directly (NVLink), not staged through the
  // host; returns how many peers it enabled now.
  int enable_peers(int device) const;

 private:
  using Status = int;
  Status (*set_device_)(int) = nullptr;
  Status (*stream_create_)(void**, unsigned) = nullptr;
  Status (*stream_destroy_)(void*) = nullptr;
  Status (*stream_synchronize_)(void*) = nullptr;
  Status (*memcpy_async_)(void*, const void*, size_t, int, void*) = nullptr;
  Status (*memcpy_2d_async)(void*, size_t, const void*, size_t, size_t, size_t, int,
                            void*) = nullptr;
  const char* (*error_string_)(Status) = nullptr;
  // Driver API: CUresult cuStreamWriteValue32(CUstream, CUdeviceptr, cuuint32_t, unsigned).
  int (*stream_write_value32_)(void*, unsigned long long, unsigned, unsigned) = nullptr;
  int (*driver_error_string_)(int, const char**) = nullptr;
  Status (*host_alloc_)(void**, size_t, unsigned) = nullptr;
  Status (*free_host_)(void*) = nullptr;
  Status (*event_create_)(void**, unsigned) = nullptr;
  Status (*event_destroy_)(void*) = nullptr;
  Status (*event_record_)(void*, void*) = nullptr;
  Status (*event_synchronize_)(void*) = nullptr;
  Status (*event_query_)(void*) = nullptr;
  Status (*stream_query_)(void*) = nullptr;
  Status (*device_count_)(int*) = nullptr;
  Status (*can_access_peer_)(int*, int, int) = nullptr;
  Status (*enable_peer_)(int, unsigned) = nullptr;
  Status (*last_error_)() = nullptr;
  // CUDA 12.8's cudaMemcpyBatchAsync(dsts, srcs, sizes, count, attrs, attrsIdxs, numAttrs,
  // failIdx, stream). CUDA 13.0 dropped failIdx (8 arguments). The symbol's name is the same,
  // so cudaRuntimeGetVersion picks the signature: calling one through the other would pass the
  // stream as failIdx. Older runtimes: one cudaMemcpyAsync per copy.
  Status (*memcpy_batch_)(void* const*, void* const*, const size_t*, size_t, void*, size_t*,
                          size_t, size_t*, void*) = nullptr;
  Status (*memcpy_batch13_)(void* const*, void* const*, const size_t*, size_t, void*, size_t*,
                            size_t, void*) = nullptr;
  // Driver: CUresult cuStreamBatchMemOp(CUstream, unsigned count, CUstreamBatchMemOpParams*,
  // unsigned flags) and cuMemcpyAsync(CUdeviceptr dst, CUdeviceptr src, size_t, CUstream).
  int (*batch_memop_)(void*, unsigned, void*, unsigned) = nullptr;
  bool batch_memop_v2_ = false;
  int (*memcpy_driver_)(unsigned long long, unsigned long long, size_t, void*) = nullptr;
  // Driver: cuModuleLoadData(CUmodule*, const void*), cuModuleGetFunction(CUfunction*, CUmodule,
  // const char*), cuLaunchKernel(f, grid xyz, block xyz, shared bytes, stream, params, extra),
  // cuModuleUnload(CUmodule).
  int (*module_load_)(void**, const void*) = nullptr;
  int (*module_function_)(void**, void*, const char*) = nullptr;
  int (*launch_kernel_)(void*, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                        unsigned, void*, void**, void**) = nullptr;
  int (*module_unload_)(void*) = nullptr;
  // Driver: CUresult cuMemGetHandleForAddressRange(void*, CUdeviceptr, size_t, type, flags).
  int (*get_handle_)(void*, unsigned long long, size_t, int, unsigned long long) = nullptr;
  int runtime_version_ = 0;
  void* runtime_ = nullptr;
  void* driver_ = nullptr;

  void check(Status status, const char* call) const;
  void check_driver(int status, const char* call) const;
};

}  // namespace mgraph
