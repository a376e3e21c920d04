// What the fake driver (fake_cuda.c) needs from the fake runtime (fake_cudart.c, fake_controls.c):
// both libraries share the runtime's streams, so a cuStreamWriteValue32 is ordered with the copies
// around it.
#pragma once

#include <stdint.h>

#define FAKE_EXPORT __attribute__((visibility("default")))

// Status codes as CUDA numbers them (the runtime's and the driver's agree on these).
enum {
  kFakeSuccess = 0,
  kFakeInvalidValue = 1,
  kFakeMemoryAllocation = 2,
  kFakeInvalidPitch = 12,
  kFakeInvalidMemcpyDirection = 21,
  kFakeInvalidDevice = 101,
  kFakeInvalidHandle = 400,
  kFakeIllegalAddress = 700,
  kFakePeerAccessAlreadyEnabled = 704,
};

// Text of a status, or NULL for a code CUDA does not define here.
FAKE_EXPORT const char* fakecuda_error_text(int status);

// Queues a 4-byte release store of ``value`` at ``address`` on ``stream``; ``version`` (1 or 2)
// says which driver symbol was called, for the statistics.
FAKE_EXPORT int fakecuda_enqueue_store32(void* stream, uint64_t address, uint32_t value,
                                         unsigned flags, int version);

// Queues ONE operation of ``n`` 4-byte release stores, executed in array order (what
// cuStreamBatchMemOp's WRITE_VALUE_32 operations do; ``version`` 1 or 2 as above).
FAKE_EXPORT int fakecuda_enqueue_store_batch(void* stream, const uint64_t* addresses,
                                             const uint32_t* values, unsigned n, int version);

// Counts memory barriers of a cuStreamBatchMemOp call ("memop_barriers", "gpu_barriers").
FAKE_EXPORT void fakecuda_count_barriers(unsigned barriers, unsigned gpu_barriers);

// Queues a 1-D copy of ``bytes`` (the driver's cuMemcpyAsync; statistic "driver_copies").
FAKE_EXPORT int fakecuda_enqueue_driver_copy(void* dst, const void* src, uint64_t bytes,
                                             void* stream);

// Counts a dma-buf handle handed out (statistic "dmabuf_handles").
FAKE_EXPORT void fakecuda_count_dmabuf(void);

// The copy-and-flag kernel (fake_cuda.c's cuLaunchKernel): counts launches and live modules,
// and reads the negative control that makes it store its flags before its copy.
FAKE_EXPORT void fakecuda_count_kernel(void);
FAKE_EXPORT void fakecuda_count_module(int delta);
FAKE_EXPORT int fakecuda_kernel_flags_first_on(void);
// The status fakecuda_fail forces on the entry point ``call`` (0: none).
FAKE_EXPORT int fakecuda_forced(const char* call);
