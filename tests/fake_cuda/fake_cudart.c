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
// Its test controls (fakecuda_*), statistics and trace are in fake_controls.c.
#define _GNU_SOURCE
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "fake_controls.h"

static __thread int current_device = 0;
__thread int last_error = 0;

static int set_error(int status) {
  if (status != 0) last_error = status;
  return status;
}

#define FAIL_POINT(name)                                                  \
  do {                                                                    \
    const int forced_ = __atomic_load_n(&fail_status, __ATOMIC_ACQUIRE); \
    if (forced_ != 0 && strcmp(fail_call, (name)) == 0) return set_error(forced_); \
  } while (0)

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
