// A fake CUDA driver: the two entry points runtime/proxy/native/cuda_api.cpp takes from libcuda.
// Stores go onto the fake runtime's streams (fake_cudart.c), so they are ordered with the copies.
// Built with -DFAKE_CUDA_V1_ONLY it exports only cuStreamWriteValue32, like a pre-CUDA-12 driver,
// for the proxy's fallback from the _v2 symbol.
#define _GNU_SOURCE
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
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
