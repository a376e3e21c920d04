// A fake CUDA driver: the two entry points runtime/proxy/native/cuda_api.cpp takes from libcuda.
// Stores go onto the fake runtime's streams (fake_cudart.c), so they are ordered with the copies.
// Built with -DFAKE_CUDA_V1_ONLY it exports only cuStreamWriteValue32, like a pre-CUDA-12 driver,
// for the proxy's fallback from the _v2 symbol.
#include <stddef.h>
#include <stdint.h>

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
