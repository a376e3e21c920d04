// A fake CUDA driver: the entry points runtime/proxy/native/cuda_api.cpp takes from libcuda.
// Stores and copies go onto the fake runtime's streams (fake_cudart.c), so they are ordered with
// the runtime's copies. Built with -DFAKE_CUDA_V1_ONLY it exports only cuStreamWriteValue32 and
// no cuStreamBatchMemOp nor cuMemcpyAsync, like an older driver, for the proxy's fallbacks.
#define _GNU_SOURCE
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "fake_cuda.h"

// CUresult cuGetErrorString(CUresult, const char**).
FAKE_EXPORT int cuGetErrorString(int status, const char** text) {
  if (text == NULL) return kFakeInvalidValue;
  *text = fakecuda_error_text(status);
  return *text != NULL ? kFakeSuccess : kFakeInvalidValue;
}

// CUresult cuStreamWriteValue32(CUstream, CUdeviceptr, cuuint32_t, unsigned int).
FAKE_EXPORT int cuStreamWriteValue32(void* stream, uint64_t address, uint32_t value,
                                     unsigned flags) {
  return fakecuda_enqueue_store32(stream, address, value, flags, 1);
}

#ifndef FAKE_CUDA_V1_ONLY
FAKE_EXPORT int cuStreamWriteValue32_v2(void* stream, uint64_t address, uint32_t value,
                                        unsigned flags) {
  return fakecuda_enqueue_store32(stream, address, value, flags, 2);
}
#endif

#ifndef FAKE_CUDA_V1_ONLY
// CUstreamBatchMemOpParams (cuda.h): a 48-byte union; its writeValue and memoryBarrier members.
typedef union {
  struct {
    int operation;  // 2: CU_STREAM_MEM_OP_WRITE_VALUE_32
    uint64_t address;
    uint64_t value;  // union {cuuint32_t value; cuuint64_t value64}
    unsigned flags;  // 1: CU_STREAM_WRITE_VALUE_NO_MEMORY_BARRIER
    uint64_t alias;
  } write;
  struct {
    int operation;   // 6: CU_STREAM_MEM_OP_BARRIER (the _v2 entry point only)
    unsigned flags;  // 0: system scope, 1: GPU scope
  } barrier;
  uint64_t pad[6];
} FakeMemOp;
_Static_assert(sizeof(FakeMemOp) == 48, "CUstreamBatchMemOpParams is 48 bytes");

// WRITE_VALUE_32 stores and (v2) barriers. A store without its own barrier (flags 1) is refused
// unless a barrier came before it in the call: the proxy must never let a flag pass its data.
// The fake's stores are release stores anyway; a barrier executes as nothing, and is counted.
static int batch_memop(void* stream, unsigned count, const FakeMemOp* ops, unsigned flags,
                       int version) {
  if (ops == NULL || count == 0 || count >= 256 || flags != 0) return kFakeInvalidValue;
  uint64_t addresses[256];
  uint32_t values[256];
  unsigned n = 0, barriers = 0, gpu_barriers = 0;
  for (unsigned i = 0; i < count; ++i) {
    if (ops[i].barrier.operation == 6 && version == 2 && ops[i].barrier.flags <= 1) {
      barriers += 1;
      gpu_barriers += ops[i].barrier.flags;
      continue;
    }
    if (ops[i].write.operation != 2 || ops[i].write.flags > 1 ||
        (ops[i].write.flags == 1 && barriers == 0))
      return kFakeInvalidValue;
    addresses[n] = ops[i].write.address;
    values[n++] = (uint32_t)ops[i].write.value;
  }
  if (n == 0) return kFakeInvalidValue;  // the proxy never sends a call without a store
  const int status = fakecuda_enqueue_store_batch(stream, addresses, values, n, version);
  if (status == 0) fakecuda_count_barriers(barriers, gpu_barriers);
  return status;
}

FAKE_EXPORT int cuStreamBatchMemOp(void* stream, unsigned count, const FakeMemOp* ops,
                                   unsigned flags) {
  return batch_memop(stream, count, ops, flags, 1);
}

FAKE_EXPORT int cuStreamBatchMemOp_v2(void* stream, unsigned count, const FakeMemOp* ops,
                                      unsigned flags) {
  return batch_memop(stream, count, ops, flags, 2);
}

// CUresult cuMemcpyAsync(CUdeviceptr dst, CUdeviceptr src, size_t, CUstream).
FAKE_EXPORT int cuMemcpyAsync(uint64_t dst, uint64_t src, size_t bytes, void* stream) {
  return fakecuda_enqueue_driver_copy((void*)(uintptr_t)dst, (const void*)(uintptr_t)src, bytes,
                                      stream);
}
#endif

// CUresult cuMemGetHandleForAddressRange(void* handle, CUdeviceptr, size_t, type, flags): a
// dma-buf fd for a page-aligned range of "device" memory. Here a memfd whose name records the
// range ("fakecuda-dmabuf:<base hex>:<size hex>"), so the fake libibverbs (tests/fake_verbs)
// can check what an ibv_reg_dmabuf_mr on it claims to cover. Type 1 is
// CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD, the only one CUDA defines.
FAKE_EXPORT int cuMemGetHandleForAddressRange(void* handle, uint64_t ptr, size_t size, int type,
                                              unsigned long long flags) {
  const uint64_t page = (uint64_t)sysconf(_SC_PAGESIZE);
  if (handle == NULL || type != 1 || flags != 0 || ptr == 0 || size == 0 || ptr % page != 0 ||
      size % page != 0)
    return kFakeInvalidValue;
  char name[64];
  snprintf(name, sizeof(name), "fakecuda-dmabuf:%llx:%llx", (unsigned long long)ptr,
           (unsigned long long)size);
  const int fd = memfd_create(name, MFD_CLOEXEC);
  if (fd < 0) return kFakeMemoryAllocation;
  fakecuda_count_dmabuf();
  *(int*)handle = fd;
  return kFakeSuccess;
}

// The runtime's copies (fake_cudart.c), which the fake kernel queues.
int cudaMemcpyAsync(void* dst, const void* src, size_t bytes, int kind, void* stream);
int cudaMemcpy2DAsync(void* dst, size_t dpitch, const void* src, size_t spitch, size_t width,
                      size_t height, int kind, void* stream);

// The copy-and-flag kernel (runtime/proxy/native/copy_kernel.h). A module is accepted when its
// image is PTX text defining the entry asked for; only mgraph_copy_flags can be launched. A
// launch queues what the kernel does, in the kernel's order, as two operations of its stream
// (traced and counted as such): the copy (1-D or 2-D, through the runtime's copies), then its
// flag stores in array order (as a cuStreamBatchMemOp does). With the negative control
// (fakecuda_kernel_flags_first) the stores go first, as a kernel without its barrier might.
typedef struct {
  uint64_t dst, src, width, height, dpitch, spitch, unit, n_flags;
  uint64_t flag[8];
  uint32_t value[8];
} FakeCopyArgs;
_Static_assert(sizeof(FakeCopyArgs) == 160, "copy_kernel.h: CopyKernelArgs is 160 bytes");

enum { kModuleMagic = 0x4d4f4455, kInvalidPtx = 218, kNotFound = 500 };

typedef struct {
  int magic;
  char* image;
} FakeModule;

static FakeModule* module_of(void* handle) {
  FakeModule* m = handle;
  return m != NULL && m->magic == kModuleMagic ? m : NULL;
}

// CUresult cuModuleLoadData(CUmodule*, const void* image).
FAKE_EXPORT int cuModuleLoadData(void** module, const void* image) {
  const int forced = fakecuda_forced("cuModuleLoadData");
  if (forced != 0) return forced;
  if (module == NULL || image == NULL) return kFakeInvalidValue;
  const char* text = image;
  if (strstr(text, ".version") == NULL || strstr(text, ".entry") == NULL) return kInvalidPtx;
  FakeModule* m = calloc(1, sizeof(FakeModule));
  if (m == NULL || (m->image = strdup(text)) == NULL) {
    free(m);
    return kFakeMemoryAllocation;
  }
  m->magic = kModuleMagic;
  fakecuda_count_module(1);
  *module = m;
  return kFakeSuccess;
}

// CUresult cuModuleGetFunction(CUfunction*, CUmodule, const char*): the handle is the module.
FAKE_EXPORT int cuModuleGetFunction(void** function, void* module, const char* name) {
  FakeModule* m = module_of(module);
  if (m == NULL) return kFakeInvalidHandle;
  if (function == NULL || name == NULL) return kFakeInvalidValue;
  char entry[160];
  snprintf(entry, sizeof(entry), ".entry %s(", name);
  if (strstr(m->image, entry) == NULL || strcmp(name, "mgraph_copy_flags") != 0) return kNotFound;
  *function = m;
  return kFakeSuccess;
}

FAKE_EXPORT int cuModuleUnload(void* module) {
  FakeModule* m = module_of(module);
  if (m == NULL) return kFakeInvalidHandle;
  m->magic = 0;
  free(m->image);
  free(m);
  fakecuda_count_module(-1);
  return kFakeSuccess;
}

// CUresult cuLaunchKernel(f, grid x/y/z, block x/y/z, shared bytes, stream, params, extra).
FAKE_EXPORT int cuLaunchKernel(void* function, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                               unsigned by, unsigned bz, unsigned shared, void* stream,
                               void** params, void** extra) {
  const int forced = fakecuda_forced("cuLaunchKernel");
  if (forced != 0) return forced;
  if (module_of(function) == NULL) return kFakeInvalidHandle;
  if (gx != 1 || gy != 1 || gz != 1 || bx == 0 || bx > 1024 || by != 1 || bz != 1 ||
      shared != 0 || extra != NULL || params == NULL || params[0] == NULL)
    return kFakeInvalidValue;
  const FakeCopyArgs* a = params[0];
  const uint64_t u = a->unit;
  // A misaligned access would fault on a GPU: refuse it here.
  const uint64_t pitches = a->height > 1 ? (a->dpitch | a->spitch) : 0;
  if (a->n_flags > 8 || (u != 1 && u != 4 && u != 16) ||
      (a->dst | a->src | a->width | pitches) % u != 0)
    return kFakeInvalidValue;
  fakecuda_count_kernel();
  const int flags_first = fakecuda_kernel_flags_first_on();
  const unsigned n = (unsigned)a->n_flags;
  int status = 0;
  if (flags_first && n > 0) status = fakecuda_enqueue_store_batch(stream, a->flag, a->value, n, 2);
  if (status == 0 && a->width > 0 && a->height > 0) {
    void* dst = (void*)(uintptr_t)a->dst;
    const void* src = (const void*)(uintptr_t)a->src;
    status = a->height == 1
                 ? cudaMemcpyAsync(dst, src, a->width, 4, stream)
                 : cudaMemcpy2DAsync(dst, a->dpitch, src, a->spitch, a->width, a->height, 4,
                                     stream);
  }
  if (status == 0 && !flags_first && n > 0)
    status = fakecuda_enqueue_store_batch(stream, a->flag, a->value, n, 2);
  return status;
}
