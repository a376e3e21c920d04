// What the fake runtime (fake_cudart.c) shares with its test controls, statistics and trace
// (fake_controls.c), the two halves of libfakecudart.so. Nothing here is exported: EXPORT
// (FAKE_EXPORT) marks what is.
#pragma once

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

#include "fake_cuda.h"

#define EXPORT FAKE_EXPORT

// Statistics: named counters, read with fakecuda_stat(name) (names: fake_controls.c, kStatNames).

enum Stat {
  kEnqCopy,          // 1-D copies queued (cudaMemcpyAsync, or the driver's cuMemcpyAsync)
  kEnqCopy2D,        // cudaMemcpy2DAsync operations queued
  kEnqStore,         // cuStreamWriteValue32 operations queued
  kEnqMark,          // cudaEventRecord markers queued
  kExecuted,         // operations the workers finished (skipped ones included)
  kSkipped,          // operations not executed because their stream had failed
  kMaxLag,           // most operations queued and not yet executed on one stream
  kEventSyncs,       // cudaEventSynchronize calls on a recorded event
  kEventSyncsBlocked,  // ... that had to wait for the stream
  kWaiting,          // threads blocked in cudaEventSynchronize right now
  kStreamSyncs,      // cudaStreamSynchronize calls
  kSetDevice,        // cudaSetDevice calls that succeeded
  kLastDevice,       // the device of the last such call
  kPeerEnabled,      // peer pairs cudaDeviceEnablePeerAccess enabled
  kPeerAlready,      // ... calls that found the pair enabled (704)
  kLastErrorCleared, // cudaGetLastError calls that returned (and cleared) an error
  kStoreV1,          // stores queued through cuStreamWriteValue32
  kStoreV2,          // stores queued through cuStreamWriteValue32_v2
  kNullStreamOps,    // operations queued on the legacy default stream (the proxy never should)
  kLiveStreams,      // streams created and not destroyed (not reset by fakecuda_reset)
  kLiveEvents,       // events created and not destroyed (not reset)
  kLiveHost,         // cudaHostAlloc blocks not freed (not reset)
  kTraceDropped,     // executed operations the full trace could not record
  kEnqBatch,         // cudaMemcpyBatchAsync calls queued
  kBatchCopies,      // ... the copies inside them
  kStreamsCreated,   // cudaStreamCreateWithFlags calls that succeeded
  kBatch13,          // cudaMemcpyBatchAsync calls taken with CUDA 13's signature
  kDmabufHandles,    // cuMemGetHandleForAddressRange fds handed out (the driver counts them)
  kEnqStoreBatch,    // cuStreamBatchMemOp calls queued (one operation each)
  kBatchStores,      // ... the stores inside them
  kDriverCopies,     // 1-D copies queued through the driver's cuMemcpyAsync (also in enq_copy)
  kMemopBarriers,    // memory barrier operations in cuStreamBatchMemOp calls
  kGpuBarriers,      // ... of them of GPU scope
  kQueries,          // cudaStreamQuery and cudaEventQuery calls
  kKernelLaunches,   // cuLaunchKernel calls of the copy-and-flag kernel that queued it
  kLiveModules,      // cuModuleLoadData modules not unloaded (not reset)
  kStatCount
};

extern int64_t stats[kStatCount];
void bump(int stat, int64_t delta);
void raise_max(int stat, int64_t value);

// Controls the runtime reads (fake_controls.c says what each is for).

extern int device_count;
extern int events_never_wait;
extern int unordered_stores;
extern int runtime_version;
extern char fail_call[64];
extern int fail_status;
enum { kMaxDevices = 16 };
extern pthread_mutex_t peer_mu;
extern unsigned char peer_enabled[kMaxDevices][kMaxDevices];

// The runtime's last error, per thread (fake_cudart.c); fakecuda_reset clears it.
extern __thread int last_error;

typedef struct {
  uintptr_t lo, hi;
  int status;
  int at_execution;
} Poison;

// The poisoned range ``height`` rows of ``width`` bytes, ``pitch`` apart from ``base``, touch.
const Poison* poisoned(const void* base, size_t pitch, size_t width, size_t height,
                       int at_execution);

// What the delay, call-cost and hold controls do: each spins, sleeps or blocks its caller.
void wait_delay(void);
void call_cost(void);
void wait_while_held(void);

// Trace of executed operations: one row of int64 per operation, in execution order.

typedef struct {
  int64_t seq, kind, dst, width, height, dpitch, value, stream;
} TraceRow;

extern TraceRow* trace_rows;
extern int64_t trace_cap;
extern int64_t trace_len;
