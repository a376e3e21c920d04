// The fake CUDA runtime's test controls, statistics and trace (the runtime itself is
// fake_cudart.c; fake_controls.h is what the two share). tests/fake_cuda/__init__.py says how to
// drive them.
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

#include "fake_controls.h"

// ---------------------------------------------------------------------------------------------
// Statistics: named counters, read with fakecuda_stat(name).

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

int64_t stats[kStatCount];

void bump(int stat, int64_t delta) {
  __atomic_add_fetch(&stats[stat], delta, __ATOMIC_RELAXED);
}

void raise_max(int stat, int64_t value) {
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

int device_count = 2;
static int delay_us_at_load = 0;
static int delay_us = 0;
static int call_us = 0;  // host time every copy-queueing call takes (the caller spins)
static int hold = 0;
int events_never_wait = 0;
int unordered_stores = 0;
static int kernel_flags_first = 0;  // negative control: the fake kernel stores flags first
// What cudaRuntimeGetVersion reports: 12080 (CUDA 12.8) is the first with cudaMemcpyBatchAsync,
// so a lower value makes the proxy take its fallback even though the symbol is here.
enum { kDefaultRuntimeVersion = 12080 };
int runtime_version = kDefaultRuntimeVersion;
static pthread_mutex_t hold_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t hold_cv = PTHREAD_COND_INITIALIZER;


enum { kMaxPoison = 8 };
static Poison poison[kMaxPoison];
static int n_poison = 0;

char fail_call[64];
int fail_status = 0;

pthread_mutex_t peer_mu = PTHREAD_MUTEX_INITIALIZER;
unsigned char peer_enabled[kMaxDevices][kMaxDevices];

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

const Poison* poisoned(const void* base, size_t pitch, size_t width, size_t height,
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

void wait_delay(void) { spin_for(__atomic_load_n(&delay_us, __ATOMIC_RELAXED)); }

void call_cost(void) { spin_for(__atomic_load_n(&call_us, __ATOMIC_RELAXED)); }

void wait_while_held(void) {
  if (!__atomic_load_n(&hold, __ATOMIC_ACQUIRE)) return;
  pthread_mutex_lock(&hold_mu);
  while (__atomic_load_n(&hold, __ATOMIC_ACQUIRE)) pthread_cond_wait(&hold_cv, &hold_mu);
  pthread_mutex_unlock(&hold_mu);
}

// ---------------------------------------------------------------------------------------------
// Trace of executed operations: one row of int64 per operation, in execution order.

TraceRow* trace_rows = NULL;
int64_t trace_cap = 0;
int64_t trace_len = 0;

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
