// What the fake driver (fake_cuda.c) needs from the fake runtime (fake_cudart.c): both libraries
// share the runtime's streams, so a cuStreamWriteValue32 is ordered with the copies around it.
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

// Counts a dma-buf handle handed out (statistic "dmabuf_handles").
FAKE_EXPORT void fakecuda_count_dmabuf(void);
