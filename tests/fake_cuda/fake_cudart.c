// A fake CUDA runtime over host memory: the entry points runtime/proxy/native/cuda_api.cpp
// resolves with dlsym, with CUDA 12's C ABI (int status, 0 = success). tests/fake_cuda/__init__.py
// says what it is for and how to drive it.
//
// Streams are asynchronous like a GPU's: each is a FIFO of operations executed in order by the
// stream's own worker thread, so a caller runs ahead of its copies. A copy reads its source when
// it EXECUTES, not when it is queued (a pinned staging word rewritten too early is read with its
// new value, as the copy engine would). Writes that a reader polls (4-byte copies and stores) are
// release stores, so a thread that sees a flag also sees the data copied before it.
//
// Test controls (fakecuda_*): a per-operation delay (FAKE_CUDA_DELAY_US, read at load), holding
// every worker, poisoned address ranges (failing at the call or at execution, the latter sticky
// like a real illegal address), failing a named entry point, two deliberate bugs for negative
// controls (events that do not wait, stores that skip the queue), a trace of executed operations
// and named statistics.
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "fake_cuda.h"

#define EXPORT FAKE_EXPORT

// ---------------------------------------------------------------------------------------------
// Statistics: named counters, read with fakecuda_stat(name).

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

static const char* const kStatNames[kStatCount] = {
    "enq_copy",     "enq_copy2d",         "enq_store",      "enq_mark",
    "executed",     "skipped",            "max_lag",        "event_syncs",
    "event_syncs_blocked", "waiting",     "stream_syncs",   "set_device",
    "last_device",  "peer_enabled",       "peer_already",   "last_error_cleared",
    "store_v1",     "store_v2",           "null_stream_ops", "live_streams",
    "live_events",  "live_host",          "trace_dropped",  "enq_batch",
    "batch_copies", "streams_created", "batch13",      "dmabuf_handles",
    "enq_store_batch", "batch_stores",  "driver_copies", "memop_barriers",
    "gpu_barriers",  "queries",        "kernel_launches", "live_modules",
};

static int64_t stats[kStatCount];

static void bump(int stat, int64_t delta) {
  __atomic_add_fetch(&stats[stat], delta, __ATOMIC_RELAXED);
}

static void raise_max(int stat, int64_t value) {
  int64_t seen = __atomic_load_n(&stats[stat], __ATOMIC_RELAXED);
  while (value > seen && !__atomic_compare_exchange_n(&stats[stat], &seen, value, 1,
                                                      __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
  }
}

EXPORT int64_t fakecuda_stat(const char* name) {
  for (int i = 0; i < kStatCount; ++i)
    if (strcmp(name, kStatNames[i]) == 0) return __atomic_load_n(&stats[i], __ATOMIC_RELAXED);
  return INT64_MIN;  // unknown name: the Python side raises KeyError
}

// ---------------------------------------------------------------------------------------------
// Controls. Tests set them between runs; the workers and entry points only read them.

static int device_count = 2;
static int delay_us_at_load = 0;
static int delay_us = 0;
static int call_us = 0;  // host time every copy-queueing call takes (the caller spins)
static int hold = 0;
static int events_never_wait = 0;
static int unordered_stores = 0;
static int kernel_flags_first = 0;  // negative control: the fake kernel stores flags first
// What cudaRuntimeGetVersion reports: 12080 (CUDA 12.8) is the first with cudaMemcpyBatchAsync,
// so a lower value makes the proxy take its fallback even though the symbol is here.
enum { kDefaultRuntimeVersion = 12080 };
static int runtime_version = kDefaultRuntimeVersion;
static pthread_mutex_t hold_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t hold_cv = PTHREAD_COND_INITIALIZER;

typedef struct {
  uintptr_t lo, hi;
  int status;
  int at_execution;
} Poison;

enum { kMaxPoison = 8 };
static Poison poison[kMaxPoison];
static int n_poison = 0;

static char fail_call[64];
static int fail_status = 0;

static pthread_mutex_t peer_mu = PTHREAD_MUTEX_INITIALIZER;
enum { kMaxDevices = 16 };
static unsigned char peer_enabled[kMaxDevices][kMaxDevices];

static __thread int current_device = 0;
static __thread int last_error = 0;

__attribute__((constructor)) static void fakecuda_load(void) {
  const char* d = getenv("FAKE_CUDA_DELAY_US");
  if (d != NULL) delay_us_at_load = atoi(d);
  delay_us = delay_us_at_load;
  const char* n = getenv("FAKE_CUDA_DEVICES");
  if (n != NULL && atoi(n) > 0 && atoi(n) <= kMaxDevices) device_count = atoi(n);
}

EXPORT int fakecuda_delay_us(void) { return __atomic_load_n(&delay_us, __ATOMIC_RELAXED); }

EXPORT void fakecuda_set_delay_us(int us) { __atomic_store_n(&delay_us, us, __ATOMIC_RELAXED); }

// A real cudaMemcpyAsync costs its caller microseconds of host time (H200: ~10 us into a peer),
// which a loop that paces itself must not add to the link's time (mover.cpp, pace).
EXPORT void fakecuda_set_call_us(int us) { __atomic_store_n(&call_us, us, __ATOMIC_RELAXED); }

EXPORT void fakecuda_hold(int on) {
  pthread_mutex_lock(&hold_mu);
  __atomic_store_n(&hold, on, __ATOMIC_RELEASE);
  pthread_cond_broadcast(&hold_cv);
  pthread_mutex_unlock(&hold_mu);
}

EXPORT void fakecuda_set_runtime_version(int version) {
  __atomic_store_n(&runtime_version, version, __ATOMIC_RELAXED);
}

EXPORT void fakecuda_events_never_wait(int on) {
  __atomic_store_n(&events_never_wait, on, __ATOMIC_RELAXED);
}

// Negative control: cuStreamWriteValue32 stores at once, ahead of the copies queued before it.
EXPORT void fakecuda_unordered_stores(int on) {
  __atomic_store_n(&unordered_stores, on, __ATOMIC_RELAXED);
}

// Negative control: the copy-and-flag kernel (fake_cuda.c) stores its flags before copying.
EXPORT void fakecuda_kernel_flags_first(int on) {
  __atomic_store_n(&kernel_flags_first, on, __ATOMIC_RELAXED);
}

EXPORT int fakecuda_kernel_flags_first_on(void) {
  return __atomic_load_n(&kernel_flags_first, __ATOMIC_RELAXED);
}

// The driver's kernel entry points count here (and fail through fakecuda_fail, by name).
EXPORT void fakecuda_count_kernel(void) { bump(kKernelLaunches, 1); }

EXPORT void fakecuda_count_module(int delta) { bump(kLiveModules, delta); }

EXPORT int fakecuda_forced(const char* call) {
  const int forced = __atomic_load_n(&fail_status, __ATOMIC_ACQUIRE);
  return forced != 0 && strcmp(fail_call, call) == 0 ? forced : 0;
}

// Operations touching [lo, lo + len) fail with ``status``: when called (at_execution 0), or when
// the worker reaches them (at_execution 1; the stream then fails for good, like an illegal
// address on a GPU, and reports the status from every later call).
EXPORT int fakecuda_poison(const void* lo, size_t len, int status, int at_execution) {
  if (n_poison == kMaxPoison) return -1;
  const uintptr_t a = (uintptr_t)lo;
  poison[n_poison] = (Poison){a, a + len, status, at_execution};
  __atomic_store_n(&n_poison, n_poison + 1, __ATOMIC_RELEASE);
  return 0;
}

// Every later call of the entry point ``call`` returns ``status`` (NULL or "": none fails).
EXPORT void fakecuda_fail(const char* call, int status) {
  __atomic_store_n(&fail_status, 0, __ATOMIC_RELEASE);
  if (call == NULL || call[0] == '\0' || status == 0) return;
  strncpy(fail_call, call, sizeof(fail_call) - 1);
  fail_call[sizeof(fail_call) - 1] = '\0';
  __atomic_store_n(&fail_status, status, __ATOMIC_RELEASE);
}

static int set_error(int status) {
  if (status != 0) last_error = status;
  return status;
}

#define FAIL_POINT(name)                                                  \
  do {                                                                    \
    const int forced_ = __atomic_load_n(&fail_status, __ATOMIC_ACQUIRE); \
    if (forced_ != 0 && strcmp(fail_call, (name)) == 0) return set_error(forced_); \
  } while (0)

// The poisoned range ``height`` rows of ``width`` bytes, ``pitch`` apart from ``base``, touch.
static const Poison* poisoned(const void* base, size_t pitch, size_t width, size_t height,
                              int at_execution) {
  const int n = __atomic_load_n(&n_poison, __ATOMIC_ACQUIRE);
  for (int i = 0; i < n; ++i) {
    if (poison[i].at_execution != at_execution) continue;
    for (size_t r = 0; r < height; ++r) {
      const uintptr_t lo = (uintptr_t)base + r * pitch;
      if (lo < poison[i].hi && poison[i].lo < lo + width) return &poison[i];
    }
  }
  return NULL;
}

// ---------------------------------------------------------------------------------------------
// Trace of executed operations: one row of int64 per operation, in execution order.

typedef struct {
  int64_t seq, kind, dst, width, height, dpitch, value, stream;
} TraceRow;

static TraceRow* trace_rows = NULL;
static int64_t trace_cap = 0;
static int64_t trace_len = 0;

// Starts a new trace of at most ``capacity`` rows (0: stop tracing). Call with no stream busy.
EXPORT int fakecuda_trace(int64_t capacity) {
  free(trace_rows);
  trace_rows = NULL;
  __atomic_store_n(&trace_cap, 0, __ATOMIC_RELEASE);
  __atomic_store_n(&trace_len, 0, __ATOMIC_RELEASE);
  if (capacity <= 0) return 0;
  trace_rows = calloc((size_t)capacity, sizeof(TraceRow));
  if (trace_rows == NULL) return -1;
  __atomic_store_n(&trace_cap, capacity, __ATOMIC_RELEASE);
  return 0;
}

EXPORT int64_t fakecuda_trace_len(void) {
  const int64_t n = __atomic_load_n(&trace_len, __ATOMIC_ACQUIRE);
  const int64_t cap = __atomic_load_n(&trace_cap, __ATOMIC_ACQUIRE);
  return n < cap ? n : cap;
}

EXPORT int64_t fakecuda_trace_read(TraceRow* out, int64_t max_rows) {
  int64_t n = fakecuda_trace_len();
  if (n > max_rows) n = max_rows;
  memcpy(out, trace_rows, (size_t)n * sizeof(TraceRow));
  return n;
}

EXPORT void fakecuda_reset(void) {
  fakecuda_hold(0);
  fakecuda_fail(NULL, 0);
  __atomic_store_n(&n_poison, 0, __ATOMIC_RELEASE);
  fakecuda_events_never_wait(0);
  fakecuda_unordered_stores(0);
  fakecuda_kernel_flags_first(0);
  fakecuda_set_delay_us(delay_us_at_load);
  fakecuda_set_call_us(0);
  fakecuda_set_runtime_version(kDefaultRuntimeVersion);
  fakecuda_trace(0);
  pthread_mutex_lock(&peer_mu);
  memset(peer_enabled, 0, sizeof(peer_enabled));
  pthread_mutex_unlock(&peer_mu);
  for (int i = 0; i < kStatCount; ++i)
    if (i != kLiveStreams && i != kLiveEvents && i != kLiveHost && i != kLiveModules)
      __atomic_store_n(&stats[i], 0, __ATOMIC_RELAXED);
  last_error = 0;
}

// ---------------------------------------------------------------------------------------------
// Streams and events.

enum { kStreamMagic = 0x5354524d, kEventMagic = 0x4556454e };
enum OpKind { kCopy = 1, kCopy2D = 2, kStore32 = 3, kMark = 4, kBatch = 5, kStoreBatch = 6 };

// One store of a cuStreamBatchMemOp call.
typedef struct {
  uint8_t* dst;
  uint32_t value;
} BatchStore;

// One copy of a cudaMemcpyBatchAsync call.
typedef struct {
  uint8_t* dst;
  const uint8_t* src;
  size_t bytes;
  int pinned_src;
} BatchCopy;

struct FakeEvent;

typedef struct Op {
  struct Op* next;
  int kind;
  uint8_t* dst;
  const uint8_t* src;
  size_t width, height, dpitch, spitch;
  uint32_t value;
  struct FakeEvent* event;
  uint64_t generation;
  int pinned_src;      // the source is cudaHostAlloc memory: a staged flag word (or words)
  int64_t stream_id;   // for the trace
  BatchCopy* batch;    // kBatch: its copies, executed in REVERSE order (CUDA promises none)
  size_t n_batch;
  BatchStore* stores;  // kStoreBatch: its stores, executed in array order (as CUDA does)
  size_t n_stores;
} Op;

typedef struct FakeStream {
  int magic;
  pthread_mutex_t mu;
  pthread_cond_t work;      // an operation was queued, or stop
  pthread_cond_t progress;  // an operation finished
  Op *head, *tail;
  uint64_t enqueued, executed;
  int sticky;  // the first execution failure; every later call on the stream returns it
  int stop;
  pthread_t worker;
  int64_t id;  // 1, 2, ... in creation order (never reset): the trace's stream column
} FakeStream;

typedef struct FakeEvent {
  int magic;
  FakeStream* stream;   // where it was last recorded (NULL: never)
  uint64_t recorded;    // generation of the last record
  uint64_t completed;   // generation of the last marker the stream executed
} FakeEvent;

static void spin_for(int us) {
  if (us <= 0) return;
  struct timespec now, until;
  clock_gettime(CLOCK_MONOTONIC, &until);
  until.tv_nsec += (long)us * 1000;
  until.tv_sec += until.tv_nsec / 1000000000L;
  until.tv_nsec %= 1000000000L;
  if (us >= 200) {  // long enough for the timer: sleep instead of taking a core
    clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &until, NULL);
    return;
  }
  do {  // a sleep would last ~60 us whatever was asked: spin, yielding the core
    sched_yield();
    clock_gettime(CLOCK_MONOTONIC, &now);
  } while (now.tv_sec < until.tv_sec ||
           (now.tv_sec == until.tv_sec && now.tv_nsec < until.tv_nsec));
}

static void wait_delay(void) { spin_for(__atomic_load_n(&delay_us, __ATOMIC_RELAXED)); }

static void call_cost(void) { spin_for(__atomic_load_n(&call_us, __ATOMIC_RELAXED)); }

static void wait_while_held(void) {
  if (!__atomic_load_n(&hold, __ATOMIC_ACQUIRE)) return;
  pthread_mutex_lock(&hold_mu);
  while (__atomic_load_n(&hold, __ATOMIC_ACQUIRE)) pthread_cond_wait(&hold_cv, &hold_mu);
  pthread_mutex_unlock(&hold_mu);
}

static void record_row(const Op* op, int kind, const uint8_t* dst, size_t width, size_t height,
                       size_t dpitch) {
  if (__atomic_load_n(&trace_cap, __ATOMIC_ACQUIRE) == 0) return;
  const int64_t at = __atomic_fetch_add(&trace_len, 1, __ATOMIC_RELAXED);
  if (at >= __atomic_load_n(&trace_cap, __ATOMIC_ACQUIRE)) {
    bump(kTraceDropped, 1);
    return;
  }
  int64_t value = -1;
  if (kind != kMark && height == 1 && width == 4 && (uintptr_t)dst % 4 == 0)
    value = __atomic_load_n((const uint32_t*)dst, __ATOMIC_ACQUIRE);
  trace_rows[at] = (TraceRow){at,
                              kind,
                              kind == kMark ? (int64_t)(uintptr_t)op->event : (int64_t)(uintptr_t)dst,
                              (int64_t)width,
                              (int64_t)height,
                              (int64_t)dpitch,
                              value,
                              op->stream_id};
}

// A 1-D copy. Flag words (4-byte aligned copies from pinned memory, one word or a run of them)
// are read when the copy EXECUTES and published one word at a time with release stores, each
// traced as its own row, so a reader that sees a word also sees the data copied before it; a
// run's words go out in no promised order (here: last first).
static void copy_1d(const Op* op, uint8_t* dst, const uint8_t* src, size_t bytes, int pinned) {
  if (bytes % 4 == 0 && (uintptr_t)dst % 4 == 0 && (uintptr_t)src % 4 == 0 &&
      (pinned || bytes == 4)) {
    for (size_t i = bytes / 4; i-- > 0;) {
      const uint32_t v = __atomic_load_n((const uint32_t*)src + i, __ATOMIC_RELAXED);
      __atomic_store_n((uint32_t*)dst + i, v, __ATOMIC_RELEASE);
      record_row(op, kCopy, dst + 4 * i, 4, 1, 4);
    }
    return;
  }
  memmove(dst, src, bytes);
  record_row(op, kCopy, dst, bytes, 1, bytes);
}

// 0, or the status the operation failed with.
static int execute(const Op* op) {
  if (op->kind == kBatch) {
    for (size_t i = 0; i < op->n_batch; ++i) {
      const BatchCopy* c = &op->batch[i];
      if (poisoned(c->dst, c->bytes, c->bytes, 1, 1) != NULL ||
          poisoned(c->src, c->bytes, c->bytes, 1, 1) != NULL)
        return kFakeIllegalAddress;
    }
    for (size_t i = op->n_batch; i-- > 0;)
      copy_1d(op, op->batch[i].dst, op->batch[i].src, op->batch[i].bytes, op->batch[i].pinned_src);
    return 0;
  }
  if (op->kind == kStoreBatch) {
    for (size_t i = 0; i < op->n_stores; ++i)
      if (poisoned(op->stores[i].dst, 4, 4, 1, 1) != NULL) return kFakeIllegalAddress;
    for (size_t i = 0; i < op->n_stores; ++i) {
      __atomic_store_n((uint32_t*)op->stores[i].dst, op->stores[i].value, __ATOMIC_RELEASE);
      record_row(op, kStore32, op->stores[i].dst, 4, 1, 4);
    }
    return 0;
  }
  if (op->kind != kMark) {
    if (poisoned(op->dst, op->dpitch, op->width, op->height, 1) != NULL ||
        (op->src != NULL && poisoned(op->src, op->spitch, op->width, op->height, 1) != NULL))
      return kFakeIllegalAddress;
  }
  switch (op->kind) {
    case kCopy:
    case kCopy2D:
      if (op->height == 1) {
        copy_1d(op, op->dst, op->src, op->width, op->pinned_src);
      } else {
        for (size_t r = 0; r < op->height; ++r)
          memmove(op->dst + r * op->dpitch, op->src + r * op->spitch, op->width);
        record_row(op, op->kind, op->dst, op->width, op->height, op->dpitch);
      }
      break;
    case kStore32:
      __atomic_store_n((uint32_t*)op->dst, op->value, __ATOMIC_RELEASE);
      record_row(op, op->kind, op->dst, 4, 1, 4);
      break;
    case kMark:
      record_row(op, op->kind, NULL, 0, 1, 0);
      break;
    default:
      break;
  }
  return 0;
}

static void free_op(Op* op) {
  free(op->stores);
  free(op->batch);
  free(op);
}

static void* worker_main(void* arg) {
  FakeStream* s = arg;
  pthread_mutex_lock(&s->mu);
  for (;;) {
    while (s->head == NULL && !s->stop) pthread_cond_wait(&s->work, &s->mu);
    if (s->head == NULL) break;  // stopping, and everything queued was executed
    Op* op = s->head;
    const int failed_before = s->sticky;
    pthread_mutex_unlock(&s->mu);
    wait_while_held();
    wait_delay();
    int status = 0;
    if (failed_before) {
      bump(kSkipped, 1);
    } else {
      status = execute(op);
    }
    pthread_mutex_lock(&s->mu);
    if (status != 0 && s->sticky == 0) s->sticky = status;
    if (op->kind == kMark) op->event->completed = op->generation;
    s->head = op->next;
    if (s->head == NULL) s->tail = NULL;
    s->executed += 1;
    bump(kExecuted, 1);
    pthread_cond_broadcast(&s->progress);
    free_op(op);
  }
  pthread_mutex_unlock(&s->mu);
  return NULL;
}

static FakeStream* new_stream(void) {
  FakeStream* s = calloc(1, sizeof(FakeStream));
  if (s == NULL) return NULL;
  pthread_mutex_init(&s->mu, NULL);
  pthread_cond_init(&s->work, NULL);
  pthread_cond_init(&s->progress, NULL);
  if (pthread_create(&s->worker, NULL, worker_main, s) != 0) {
    free(s);
    return NULL;
  }
  s->magic = kStreamMagic;
  static int64_t next_id = 0;
  s->id = __atomic_add_fetch(&next_id, 1, __ATOMIC_RELAXED);
  bump(kLiveStreams, 1);
  return s;
}

static FakeStream* default_stream = NULL;
static pthread_once_t default_once = PTHREAD_ONCE_INIT;

static void make_default_stream(void) { default_stream = new_stream(); }

// The stream a handle names: NULL is the legacy default stream (counted: the proxy never
// should use it); a handle that is not a live stream gives NULL.
static FakeStream* stream_of(void* handle) {
  if (handle == NULL) {
    pthread_once(&default_once, make_default_stream);
    bump(kNullStreamOps, 1);
    return default_stream;
  }
  FakeStream* s = handle;
  return s->magic == kStreamMagic ? s : NULL;
}

static FakeEvent* event_of(void* handle) {
  FakeEvent* e = handle;
  return e != NULL && e->magic == kEventMagic ? e : NULL;
}

// Queues ``op`` (taking it) on ``s``, with the stream lock held; 0 or the stream's failure.
static int append_locked(FakeStream* s, Op* op) {
  if (s->sticky != 0) {
    free_op(op);
    return s->sticky;
  }
  op->next = NULL;
  op->stream_id = s->id;
  if (s->tail == NULL) {
    s->head = op;
  } else {
    s->tail->next = op;
  }
  s->tail = op;
  s->enqueued += 1;
  raise_max(kMaxLag, (int64_t)(s->enqueued - s->executed));
  pthread_cond_signal(&s->work);
  return 0;
}

static int enqueue(FakeStream* s, Op* op) {
  pthread_mutex_lock(&s->mu);
  const int status = append_locked(s, op);
  pthread_mutex_unlock(&s->mu);
  return set_error(status);
}

static Op* new_op(int kind) {
  Op* op = calloc(1, sizeof(Op));
  if (op != NULL) op->kind = kind;
  return op;
}

// ---------------------------------------------------------------------------------------------
// The CUDA runtime API.

EXPORT const char* fakecuda_error_text(int status) {
  switch (status) {
    case kFakeSuccess: return "no error";
    case kFakeInvalidValue: return "invalid argument";
    case kFakeMemoryAllocation: return "out of memory";
    case kFakeInvalidPitch: return "invalid pitch argument";
    case kFakeInvalidMemcpyDirection: return "invalid copy direction for memcpy";
    case kFakeInvalidDevice: return "invalid device ordinal";
    case kFakeInvalidHandle: return "invalid resource handle";
    case kFakeIllegalAddress: return "an illegal memory access was encountered";
    case kFakePeerAccessAlreadyEnabled:
      return "peer access is already enabled";
    default: return NULL;
  }
}

EXPORT const char* cudaGetErrorString(int status) {
  const char* text = fakecuda_error_text(status);
  return text != NULL ? text : "unrecognized error code";
}

EXPORT int cudaGetLastError(void) {
  const int status = last_error;
  last_error = 0;
  if (status != 0) bump(kLastErrorCleared, 1);
  return status;
}

EXPORT int cudaGetDeviceCount(int* count) {
  FAIL_POINT("cudaGetDeviceCount");
  if (count == NULL) return set_error(kFakeInvalidValue);
  *count = device_count;
  return 0;
}

EXPORT int cudaSetDevice(int device) {
  FAIL_POINT("cudaSetDevice");
  if (device < 0 || device >= device_count) return set_error(kFakeInvalidDevice);
  current_device = device;
  bump(kSetDevice, 1);
  __atomic_store_n(&stats[kLastDevice], device, __ATOMIC_RELAXED);
  return 0;
}

EXPORT int cudaDeviceCanAccessPeer(int* can, int device, int peer) {
  FAIL_POINT("cudaDeviceCanAccessPeer");
  if (can == NULL) return set_error(kFakeInvalidValue);
  if (device < 0 || device >= device_count || peer < 0 || peer >= device_count)
    return set_error(kFakeInvalidDevice);
  *can = device != peer;
  return 0;
}

EXPORT int cudaDeviceEnablePeerAccess(int peer, unsigned flags) {
  FAIL_POINT("cudaDeviceEnablePeerAccess");
  if (flags != 0) return set_error(kFakeInvalidValue);
  if (peer < 0 || peer >= device_count || peer == current_device)
    return set_error(kFakeInvalidDevice);
  pthread_mutex_lock(&peer_mu);
  const int already = peer_enabled[current_device][peer];
  peer_enabled[current_device][peer] = 1;
  pthread_mutex_unlock(&peer_mu);
  if (already) {
    bump(kPeerAlready, 1);
    return set_error(kFakePeerAccessAlreadyEnabled);
  }
  bump(kPeerEnabled, 1);
  return 0;
}

EXPORT int cudaStreamCreateWithFlags(void** stream, unsigned flags) {
  FAIL_POINT("cudaStreamCreateWithFlags");
  if (stream == NULL || flags > 1) return set_error(kFakeInvalidValue);
  FakeStream* s = new_stream();
  if (s == NULL) return set_error(kFakeMemoryAllocation);
  *stream = s;
  bump(kStreamsCreated, 1);
  return 0;
}

EXPORT int cudaStreamSynchronize(void* stream) {
  FAIL_POINT("cudaStreamSynchronize");
  FakeStream* s = stream_of(stream);
  if (s == NULL) return set_error(kFakeInvalidHandle);
  bump(kStreamSyncs, 1);
  pthread_mutex_lock(&s->mu);
  while (s->executed < s->enqueued) pthread_cond_wait(&s->progress, &s->mu);
  const int status = s->sticky;
  pthread_mutex_unlock(&s->mu);
  return set_error(status);
}

// Like CUDA, destroying a stream with queued work lets that work finish first.
EXPORT int cudaStreamDestroy(void* stream) {
  FAIL_POINT("cudaStreamDestroy");
  FakeStream* s = stream == NULL ? NULL : stream_of(stream);
  if (s == NULL) return set_error(kFakeInvalidHandle);
  pthread_mutex_lock(&s->mu);
  s->stop = 1;
  pthread_cond_signal(&s->work);
  pthread_mutex_unlock(&s->mu);
  pthread_join(s->worker, NULL);
  s->magic = 0;
  pthread_mutex_destroy(&s->mu);
  pthread_cond_destroy(&s->work);
  pthread_cond_destroy(&s->progress);
  free(s);
  bump(kLiveStreams, -1);
  return 0;
}

// cudaHostAlloc blocks, so a copy knows its source is pinned memory (a staged flag word).
enum { kMaxPinned = 256 };
static struct { uintptr_t lo, hi; } pinned[kMaxPinned];
static pthread_mutex_t pinned_mu = PTHREAD_MUTEX_INITIALIZER;

static void pin(void* p, size_t bytes, int on) {
  pthread_mutex_lock(&pinned_mu);
  for (int i = 0; i < kMaxPinned; ++i) {
    if (on && pinned[i].lo == 0) {
      pinned[i].lo = (uintptr_t)p;
      pinned[i].hi = (uintptr_t)p + bytes;
      break;
    }
    if (!on && pinned[i].lo == (uintptr_t)p) {
      pinned[i].lo = pinned[i].hi = 0;
      break;
    }
  }
  pthread_mutex_unlock(&pinned_mu);
}

static int is_pinned(const void* p) {
  const uintptr_t a = (uintptr_t)p;
  int found = 0;
  pthread_mutex_lock(&pinned_mu);
  for (int i = 0; i < kMaxPinned && !found; ++i) found = pinned[i].lo <= a && a < pinned[i].hi;
  pthread_mutex_unlock(&pinned_mu);
  return found;
}

static int queue_copy(void* dst, size_t dpitch, const void* src, size_t spitch, size_t width,
                      size_t height, int kind, void* stream, int op_kind) {
  if (kind < 0 || kind > 4) return set_error(kFakeInvalidMemcpyDirection);
  if (width > dpitch || width > spitch) return set_error(kFakeInvalidPitch);
  if (width == 0 || height == 0) return 0;
  if (dst == NULL || src == NULL) return set_error(kFakeInvalidValue);
  FakeStream* s = stream_of(stream);
  if (s == NULL) return set_error(kFakeInvalidHandle);
  Op* op = new_op(op_kind);
  if (op == NULL) return set_error(kFakeMemoryAllocation);
  op->dst = dst;
  op->src = src;
  op->width = width;
  op->height = height;
  op->dpitch = dpitch;
  op->spitch = spitch;
  op->pinned_src = is_pinned(src);
  const Poison* p = poisoned(dst, dpitch, width, height, 0);
  if (p == NULL) p = poisoned(src, spitch, width, height, 0);
  if (p != NULL) {
    free(op);
    return set_error(p->status);
  }
  bump(op_kind == kCopy ? kEnqCopy : kEnqCopy2D, 1);
  return enqueue(s, op);
}

EXPORT int cudaMemcpyAsync(void* dst, const void* src, size_t count, int kind, void* stream) {
  FAIL_POINT("cudaMemcpyAsync");
  call_cost();
  return queue_copy(dst, count, src, count, count, 1, kind, stream, kCopy);
}

EXPORT int cudaMemcpy2DAsync(void* dst, size_t dpitch, const void* src, size_t spitch,
                             size_t width, size_t height, int kind, void* stream) {
  FAIL_POINT("cudaMemcpy2DAsync");
  call_cost();
  return queue_copy(dst, dpitch, src, spitch, width, height, kind, stream, kCopy2D);
}

EXPORT int cudaRuntimeGetVersion(int* version) {
  FAIL_POINT("cudaRuntimeGetVersion");
  if (version == NULL) return set_error(kFakeInvalidValue);
  *version = __atomic_load_n(&runtime_version, __ATOMIC_RELAXED);
  return 0;
}

// CUDA 12.8's cudaMemcpyAttributes: srcAccessOrder, srcLocHint, dstLocHint, flags.
typedef struct {
  int src_access_order;
  int src_loc_type, src_loc_id;
  int dst_loc_type, dst_loc_id;
  unsigned flags;
} FakeMemcpyAttributes;

EXPORT void fakecuda_count_dmabuf(void) { bump(kDmabufHandles, 1); }

// cudaMemcpyBatchAsync with CUDA 12.8's signature, or with CUDA 13's when the reported runtime
// version is >= 13000: 13.0 dropped failIdx, so its eighth argument is the stream (read here from
// ``fail_idx``'s slot, as a CUDA 13 runtime would; the ninth is then not an argument at all).
// A caller using the wrong signature for the version passes a pointer as the stream and gets
// cudaErrorInvalidResourceHandle. One queued operation whose copies execute in reverse order
// (CUDA orders the batch as a whole in the stream, and nothing within it).
// Checked as CUDA documents: every copy covered by an attribute entry, attrsIdxs starting at 0
// and increasing, a valid srcAccessOrder (1 stream, 2 during the call, 3 any). A poisoned range
// fails the call with ``*failIdx`` = the copy's index.
EXPORT int cudaMemcpyBatchAsync(void** dsts, void** srcs, size_t* sizes, size_t count,
                                FakeMemcpyAttributes* attrs, size_t* attrs_idxs, size_t num_attrs,
                                size_t* fail_idx, void* stream) {
  FAIL_POINT("cudaMemcpyBatchAsync");
  call_cost();  // once per call, whatever the count: what batching saves
  if (__atomic_load_n(&runtime_version, __ATOMIC_RELAXED) >= 13000) {
    stream = (void*)fail_idx;
    fail_idx = NULL;
    bump(kBatch13, 1);
  }
  if (fail_idx != NULL) *fail_idx = (size_t)-1;
  if (count == 0 || dsts == NULL || srcs == NULL || sizes == NULL || attrs == NULL ||
      attrs_idxs == NULL || num_attrs == 0 || num_attrs > count || attrs_idxs[0] != 0)
    return set_error(kFakeInvalidValue);
  for (size_t a = 0; a < num_attrs; ++a) {
    if (attrs[a].src_access_order < 1 || attrs[a].src_access_order > 3 ||
        (a > 0 && attrs_idxs[a] <= attrs_idxs[a - 1]) || attrs_idxs[a] >= count)
      return set_error(kFakeInvalidValue);
  }
  FakeStream* s = stream_of(stream);
  if (s == NULL) return set_error(kFakeInvalidHandle);
  Op* op = new_op(kBatch);
  BatchCopy* copies = calloc(count, sizeof(BatchCopy));
  if (op == NULL || copies == NULL) {
    free(op);
    free(copies);
    return set_error(kFakeMemoryAllocation);
  }
  for (size_t i = 0; i < count; ++i) {
    const Poison* p = NULL;
    if (dsts[i] == NULL || srcs[i] == NULL || sizes[i] == 0) {
      free(op);
      free(copies);
      if (fail_idx != NULL) *fail_idx = i;
      return set_error(kFakeInvalidValue);
    }
    p = poisoned(dsts[i], sizes[i], sizes[i], 1, 0);
    if (p == NULL) p = poisoned(srcs[i], sizes[i], sizes[i], 1, 0);
    if (p != NULL) {
      free(op);
      free(copies);
      if (fail_idx != NULL) *fail_idx = i;
      return set_error(p->status);
    }
    copies[i] = (BatchCopy){dsts[i], srcs[i], sizes[i], is_pinned(srcs[i])};
  }
  op->batch = copies;
  op->n_batch = count;
  op->height = 1;
  bump(kEnqBatch, 1);
  bump(kBatchCopies, (int64_t)count);
  return enqueue(s, op);
}

EXPORT int fakecuda_enqueue_store32(void* stream, uint64_t address, uint32_t value,
                                    unsigned flags, int version) {
  FAIL_POINT("cuStreamWriteValue32");
  if (flags != 0 || address == 0 || address % 4 != 0) return set_error(kFakeInvalidValue);
  FakeStream* s = stream_of(stream);
  if (s == NULL) return set_error(kFakeInvalidHandle);
  const Poison* p = poisoned((const void*)(uintptr_t)address, 4, 4, 1, 0);
  if (p != NULL) return set_error(p->status);
  Op* op = new_op(kStore32);
  if (op == NULL) return set_error(kFakeMemoryAllocation);
  op->dst = (uint8_t*)(uintptr_t)address;
  op->width = 4;
  op->height = 1;
  op->dpitch = 4;
  op->value = value;
  bump(kEnqStore, 1);
  bump(version == 1 ? kStoreV1 : kStoreV2, 1);
  if (__atomic_load_n(&unordered_stores, __ATOMIC_RELAXED)) {
    execute(op);
    free(op);
    return 0;
  }
  return enqueue(s, op);
}

EXPORT int fakecuda_enqueue_store_batch(void* stream, const uint64_t* addresses,
                                        const uint32_t* values, unsigned n, int version) {
  (void)version;
  FAIL_POINT("cuStreamBatchMemOp");
  FakeStream* s = stream_of(stream);
  if (s == NULL) return set_error(kFakeInvalidHandle);
  for (unsigned i = 0; i < n; ++i) {
    if (addresses[i] == 0 || addresses[i] % 4 != 0) return set_error(kFakeInvalidValue);
    const Poison* p = poisoned((const void*)(uintptr_t)addresses[i], 4, 4, 1, 0);
    if (p != NULL) return set_error(p->status);
  }
  Op* op = new_op(kStoreBatch);
  BatchStore* stores = calloc(n, sizeof(BatchStore));
  if (op == NULL || stores == NULL) {
    free(op);
    free(stores);
    return set_error(kFakeMemoryAllocation);
  }
  for (unsigned i = 0; i < n; ++i) stores[i] = (BatchStore){(uint8_t*)(uintptr_t)addresses[i], values[i]};
  op->stores = stores;
  op->n_stores = n;
  op->width = 4;
  op->height = 1;
  bump(kEnqStoreBatch, 1);
  bump(kBatchStores, n);
  if (__atomic_load_n(&unordered_stores, __ATOMIC_RELAXED)) {  // the negative control, as above
    execute(op);
    free_op(op);
    return 0;
  }
  return enqueue(s, op);
}

EXPORT void fakecuda_count_barriers(unsigned barriers, unsigned gpu_barriers) {
  bump(kMemopBarriers, barriers);
  bump(kGpuBarriers, gpu_barriers);
}

EXPORT int fakecuda_enqueue_driver_copy(void* dst, const void* src, uint64_t bytes, void* stream) {
  FAIL_POINT("cuMemcpyAsync");
  call_cost();
  const int status = queue_copy(dst, bytes, src, bytes, bytes, 1, 4, stream, kCopy);
  if (status == 0) bump(kDriverCopies, 1);
  return status;
}

// Pinned host memory: page-aligned and filled with 0xA5, never zero, so a staging word copied
// before it was written shows up as garbage instead of a plausible count.
EXPORT int cudaHostAlloc(void** ptr, size_t bytes, unsigned flags) {
  FAIL_POINT("cudaHostAlloc");
  (void)flags;
  if (ptr == NULL) return set_error(kFakeInvalidValue);
  void* p = NULL;
  if (posix_memalign(&p, 4096, bytes == 0 ? 1 : bytes) != 0) return set_error(kFakeMemoryAllocation);
  memset(p, 0xA5, bytes);
  *ptr = p;
  bump(kLiveHost, 1);
  pin(p, bytes, 1);
  return 0;
}

EXPORT int cudaFreeHost(void* ptr) {
  FAIL_POINT("cudaFreeHost");
  if (ptr == NULL) return 0;
  pin(ptr, 0, 0);
  free(ptr);
  bump(kLiveHost, -1);
  return 0;
}

EXPORT int cudaEventCreateWithFlags(void** event, unsigned flags) {
  FAIL_POINT("cudaEventCreateWithFlags");
  if (event == NULL || flags > 15) return set_error(kFakeInvalidValue);
  FakeEvent* e = calloc(1, sizeof(FakeEvent));
  if (e == NULL) return set_error(kFakeMemoryAllocation);
  e->magic = kEventMagic;
  *event = e;
  bump(kLiveEvents, 1);
  return 0;
}

// Waits for the event's pending marker (CUDA defers the release instead: same effect here).
EXPORT int cudaEventDestroy(void* event) {
  FAIL_POINT("cudaEventDestroy");
  FakeEvent* e = event_of(event);
  if (e == NULL) return set_error(kFakeInvalidHandle);
  FakeStream* s = e->stream;
  if (s != NULL) {
    pthread_mutex_lock(&s->mu);
    while (e->completed < e->recorded) pthread_cond_wait(&s->progress, &s->mu);
    pthread_mutex_unlock(&s->mu);
  }
  e->magic = 0;
  free(e);
  bump(kLiveEvents, -1);
  return 0;
}

// Re-recording on another stream while a marker is pending is not modelled (the proxy records
// each event on its one stream).
EXPORT int cudaEventRecord(void* event, void* stream) {
  FAIL_POINT("cudaEventRecord");
  FakeEvent* e = event_of(event);
  FakeStream* s = stream_of(stream);
  if (e == NULL || s == NULL) return set_error(kFakeInvalidHandle);
  if (e->stream != NULL && e->stream != s) return set_error(kFakeInvalidValue);
  Op* op = new_op(kMark);
  if (op == NULL) return set_error(kFakeMemoryAllocation);
  op->event = e;
  op->width = 0;
  op->height = 1;
  pthread_mutex_lock(&s->mu);
  e->stream = s;
  op->generation = e->recorded + 1;
  const int status = append_locked(s, op);
  if (status == 0) e->recorded += 1;
  pthread_mutex_unlock(&s->mu);
  if (status == 0) bump(kEnqMark, 1);
  return set_error(status);
}

// cudaStreamQuery / cudaEventQuery: 0 once the stream executed everything queued before (the
// event's last record), else 600 (cudaErrorNotReady, which CUDA does not keep as last error);
// a stream that failed reports its failure.
enum { kFakeNotReady = 600 };

EXPORT int cudaStreamQuery(void* stream) {
  FAIL_POINT("cudaStreamQuery");
  FakeStream* s = stream_of(stream);
  if (s == NULL) return set_error(kFakeInvalidHandle);
  bump(kQueries, 1);
  pthread_mutex_lock(&s->mu);
  const int status = s->sticky != 0 ? s->sticky : (s->executed == s->enqueued ? 0 : kFakeNotReady);
  pthread_mutex_unlock(&s->mu);
  return status == kFakeNotReady ? status : set_error(status);
}

EXPORT int cudaEventQuery(void* event) {
  FAIL_POINT("cudaEventQuery");
  FakeEvent* e = event_of(event);
  if (e == NULL) return set_error(kFakeInvalidHandle);
  bump(kQueries, 1);
  FakeStream* s = e->stream;
  if (s == NULL) return 0;  // never recorded: complete, as in CUDA
  pthread_mutex_lock(&s->mu);
  const int status = s->sticky != 0 ? s->sticky : (e->completed >= e->recorded ? 0 : kFakeNotReady);
  pthread_mutex_unlock(&s->mu);
  return status == kFakeNotReady ? status : set_error(status);
}

EXPORT int cudaEventSynchronize(void* event) {
  FAIL_POINT("cudaEventSynchronize");
  FakeEvent* e = event_of(event);
  if (e == NULL) return set_error(kFakeInvalidHandle);
  FakeStream* s = e->stream;
  if (s == NULL) return 0;  // never recorded: complete, as in CUDA
  bump(kEventSyncs, 1);
  if (__atomic_load_n(&events_never_wait, __ATOMIC_RELAXED)) return 0;
  pthread_mutex_lock(&s->mu);
  const uint64_t target = e->recorded;
  if (e->completed < target) {
    bump(kEventSyncsBlocked, 1);
    bump(kWaiting, 1);
    while (e->completed < target) pthread_cond_wait(&s->progress, &s->mu);
    bump(kWaiting, -1);
  }
  const int status = s->sticky;
  pthread_mutex_unlock(&s->mu);
  return set_error(status);
}
