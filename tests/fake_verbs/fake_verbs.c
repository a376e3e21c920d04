// A fake libibverbs: RC queue pairs between "devices" of ONE process, a worker thread per opened
// device acting as its NIC. tests/fake_verbs/__init__.py says what it is for and how to drive it.
//
// What it keeps from real hardware, because the proxy's verbs backend relies on it:
// - the ABI: exported IBVERBS_1.x entry points, and post_send / post_recv / poll_cq reached only
//   through ``context->ops`` (they are static inline in verbs.h);
// - asynchrony: ibv_post_send queues; the device's worker executes requests later, in order per
//   queue pair, reading the source when it executes (like a NIC's DMA);
// - checks: QP state machine with the attribute masks each transition requires; a connection
//   needs matching QP numbers, the peer's LID and the same PSN on both ends (else the requests
//   fail with IBV_WC_RETRY_EXC_ERR, as lost packets would); lkeys must cover the local range in
//   the QP's protection domain; rkeys must cover the remote range with remote write access in
//   the PEER's protection domain (else IBV_WC_LOC_PROT_ERR / IBV_WC_REM_ACCESS_ERR); a failed
//   request moves the QP to the error state and flushes the rest (IBV_WC_WR_FLUSH_ERR);
// - WRITE WITH IMMEDIATE consumes a posted receive on the peer (none posted: the request waits,
//   as rnr_retry 7 retries forever) and completes there as IBV_WC_RECV_RDMA_WITH_IMM after the
//   data is placed;
// - selective signaling: only signaled requests (or sq_sig_all) complete; a send-queue slot is
//   free again only once a LATER-or-equal signaled completion was polled, so a poster that never
//   signals fills the queue (ibv_post_send: ENOMEM); a full CQ overruns (poll_cq returns -1);
// - GPU memory: ranges the test declares "device memory" register with ibv_reg_mr only while
//   "nvidia-peermem" is on, and with ibv_reg_dmabuf_mr only with a dma-buf fd from the fake CUDA
//   driver (tests/fake_cuda: a memfd named after the range) that covers what is registered.
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "fake_verbs.h"

#define EXPORT __attribute__((visibility("default")))

enum { kMaxDevices = 8, kMaxMrs = 1024, kMaxQps = 256, kMaxGpuRanges = 16 };

// ---------------------------------------------------------------------------------------------
// Statistics and controls.

enum Stat {
  kPostCalls, kWrs, kWrites, kImms, kBytes, kRecvsPosted, kRnrWaits, kCqOverruns, kErrors,
  kPsnMismatch, kHostRegs, kPeermemRegs, kDmabufRegs, kMaxChain, kSqFull, kUnsignaled,
  kLiveContexts, kLivePds, kLiveMrs, kLiveCqs, kLiveQps, kStatCount
};
static const char* const kStatNames[kStatCount] = {
    "post_calls",  "wrs",          "writes",       "imms",         "bytes",
    "recvs_posted", "rnr_waits",   "cq_overruns",  "errors",       "psn_mismatch",
    "host_regs",   "peermem_regs", "dmabuf_regs",  "max_chain",    "sq_full",
    "unsignaled",  "live_contexts", "live_pds",    "live_mrs",     "live_cqs",
    "live_qps",
};
static int64_t stats[kStatCount];

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;  // guards everything below
static pthread_cond_t work_cv = PTHREAD_COND_INITIALIZER;

static int n_devices = 2;
static int peermem = 1;
static int dmabuf = 1;
static int delay_us = 0;
static int fail_next = 0;
static struct { uint64_t lo, hi; } gpu_ranges[kMaxGpuRanges];
static int n_gpu_ranges = 0;

EXPORT int64_t fakeverbs_stat(const char* name) {
  for (int i = 0; i < kStatCount; ++i)
    if (strcmp(name, kStatNames[i]) == 0) return __atomic_load_n(&stats[i], __ATOMIC_RELAXED);
  return INT64_MIN;
}

EXPORT void fakeverbs_set_devices(int n) { n_devices = n < 0 ? 0 : n > kMaxDevices ? kMaxDevices : n; }
EXPORT void fakeverbs_peermem(int on) { peermem = on; }
EXPORT void fakeverbs_dmabuf(int on) { dmabuf = on; }
EXPORT void fakeverbs_set_delay_us(int us) { __atomic_store_n(&delay_us, us, __ATOMIC_RELAXED); }
// The next request a device executes fails with ``status`` (e.g. 12: the link to the peer died).
EXPORT void fakeverbs_fail_next(int status) {
  pthread_mutex_lock(&mu);
  fail_next = status;
  pthread_mutex_unlock(&mu);
}
// [addr, addr + len) is GPU memory: see the top.
EXPORT int fakeverbs_gpu_range(uint64_t addr, uint64_t len) {
  if (n_gpu_ranges == kMaxGpuRanges) return -1;
  gpu_ranges[n_gpu_ranges].lo = addr;
  gpu_ranges[n_gpu_ranges].hi = addr + len;
  ++n_gpu_ranges;
  return 0;
}
// Clears the knobs and counters (not the live-object counts).
EXPORT void fakeverbs_reset(void) {
  pthread_mutex_lock(&mu);
  n_devices = 2;
  peermem = dmabuf = 1;
  delay_us = 0;
  fail_next = 0;
  n_gpu_ranges = 0;
  for (int i = 0; i < kLiveContexts; ++i) stats[i] = 0;
  pthread_mutex_unlock(&mu);
}

static void bump(int stat, int64_t d) { __atomic_add_fetch(&stats[stat], d, __ATOMIC_RELAXED); }

// ---------------------------------------------------------------------------------------------
// Objects.

typedef struct {
  int index;
  char name[64];
} FakeDevice;
static FakeDevice devices[kMaxDevices];

typedef struct {
  struct ibv_context base;
  int dev;
  int stop;
  pthread_t worker;
} FakeCtx;

typedef struct {
  struct ibv_pd base;
} FakePd;

typedef struct {
  struct ibv_mr base;
  int used, access, gpu;
  uint64_t lo, hi;
} FakeMr;
static FakeMr mrs[kMaxMrs];

struct FakeQp;
typedef struct {
  struct ibv_wc wc;
  struct FakeQp* qp;  // send completions: the QP whose queue slots it retires
  uint64_t pos;
} Cqe;

typedef struct {
  struct ibv_cq base;
  Cqe* ring;
  int cap, head, count, overrun;
} FakeCq;

typedef struct {
  struct ibv_send_wr wr;
  struct ibv_sge sge;
  uint64_t pos;
} SendItem;

typedef struct FakeQp {
  struct ibv_qp base;
  int used;
  FakeCtx* ctx;
  FakeCq *scq, *rcq;
  struct ibv_qp_cap cap;
  int sig_all, port;
  uint32_t dest, rq_psn, sq_psn, access;
  uint16_t dlid;
  SendItem* sq;
  int sq_head, sq_count;
  uint64_t posted, retired;
  uint64_t* rq;
  int rq_head, rq_count;
} FakeQp;
static FakeQp* qps[kMaxQps];

static uint32_t lkey_of(int i) { return ((uint32_t)i << 8) | 0x5A; }
static uint32_t rkey_of(int i) { return ((uint32_t)i << 8) | 0xA5; }

static FakeMr* mr_by(uint32_t key, int remote) {
  const int i = (int)(key >> 8);
  if (i < 0 || i >= kMaxMrs || !mrs[i].used) return NULL;
  return key == (remote ? rkey_of(i) : lkey_of(i)) ? &mrs[i] : NULL;
}

static FakeQp* qp_by_num(uint32_t num) {
  for (int i = 0; i < kMaxQps; ++i)
    if (qps[i] != NULL && qps[i]->base.qp_num == num) return qps[i];
  return NULL;
}

static void push_cqe(FakeCq* cq, const struct ibv_wc* wc, FakeQp* qp, uint64_t pos) {
  if (cq->count == cq->cap) {  // a real CQ overruns: the consumer sized it too small
    cq->overrun = 1;
    bump(kCqOverruns, 1);
    return;
  }
  Cqe* e = &cq->ring[(cq->head + cq->count) % cq->cap];
  e->wc = *wc;
  e->qp = qp;
  e->pos = pos;
  ++cq->count;
}

// ---------------------------------------------------------------------------------------------
// The NIC: each opened device's worker executes its QPs' send queues.

static void complete_send(FakeQp* qp, const SendItem* it, int status) {
  struct ibv_wc wc;
  memset(&wc, 0, sizeof(wc));
  wc.wr_id = it->wr.wr_id;
  wc.status = status;
  wc.opcode = IBV_WC_RDMA_WRITE;
  wc.qp_num = qp->base.qp_num;
  if (status != IBV_WC_SUCCESS || qp->sig_all || (it->wr.send_flags & IBV_SEND_SIGNALED))
    push_cqe(qp->scq, &wc, qp, it->pos);
  else
    bump(kUnsignaled, 1);
}

static void pop_send(FakeQp* qp) {
  qp->sq_head = (qp->sq_head + 1) % (int)qp->cap.max_send_wr;
  --qp->sq_count;
}

// Executes the head of ``qp``'s send queue; 0 when it must wait for a receive on the peer.
static int execute(FakeQp* qp) {
  SendItem* it = &qp->sq[qp->sq_head];
  if (qp->base.state == IBV_QPS_ERR) {
    complete_send(qp, it, IBV_WC_WR_FLUSH_ERR);
    pop_send(qp);
    return 1;
  }
  int status = IBV_WC_SUCCESS;
  if (fail_next != 0) {
    status = fail_next;
    fail_next = 0;
  }
  FakeQp* peer = qp_by_num(qp->dest);
  if (status == 0 && (peer == NULL || peer->dest != qp->base.qp_num ||
                      peer->base.state < IBV_QPS_RTR || peer->base.state == IBV_QPS_ERR ||
                      qp->dlid != peer->ctx->dev + 1))
    status = IBV_WC_RETRY_EXC_ERR;  // nobody answers at that address
  if (status == 0 && qp->sq_psn != peer->rq_psn) {
    bump(kPsnMismatch, 1);
    status = IBV_WC_RETRY_EXC_ERR;  // the peer drops every packet as out of sequence
  }
  const uint32_t len = it->wr.num_sge > 0 ? it->sge.length : 0;
  const int imm = it->wr.opcode == IBV_WR_RDMA_WRITE_WITH_IMM;
  if (status == 0 && len > 0) {
    FakeMr* l = mr_by(it->sge.lkey, 0);
    if (l == NULL || l->base.pd != qp->base.pd || it->sge.addr < l->lo ||
        it->sge.addr + len > l->hi)
      status = IBV_WC_LOC_PROT_ERR;
  }
  if (status == 0 && len > 0) {
    FakeMr* r = mr_by(it->wr.wr.rdma.rkey, 1);
    const uint64_t a = it->wr.wr.rdma.remote_addr;
    if (r == NULL || r->base.pd != peer->base.pd || !(r->access & IBV_ACCESS_REMOTE_WRITE) ||
        a < r->lo || a + len > r->hi)
      status = IBV_WC_REM_ACCESS_ERR;
  }
  if (status == 0 && imm && peer->rq_count == 0) {
    bump(kRnrWaits, 1);
    return 0;
  }
  if (status != 0) {
    bump(kErrors, 1);
    complete_send(qp, it, status);
    pop_send(qp);
    qp->base.state = IBV_QPS_ERR;
    return 1;
  }
  if (len > 0) {
    memcpy((void*)(uintptr_t)it->wr.wr.rdma.remote_addr, (const void*)(uintptr_t)it->sge.addr,
           len);
    bump(kBytes, len);
  }
  bump(kWrites, 1);
  if (imm) {
    struct ibv_wc wc;
    memset(&wc, 0, sizeof(wc));
    wc.wr_id = peer->rq[peer->rq_head];
    peer->rq_head = (peer->rq_head + 1) % (int)peer->cap.max_recv_wr;
    --peer->rq_count;
    wc.status = IBV_WC_SUCCESS;
    wc.opcode = IBV_WC_RECV_RDMA_WITH_IMM;
    wc.byte_len = len;
    wc.imm_data = it->wr.imm_data;
    wc.qp_num = peer->base.qp_num;
    wc.src_qp = qp->base.qp_num;
    wc.wc_flags = IBV_WC_WITH_IMM;
    push_cqe(peer->rcq, &wc, NULL, 0);
    bump(kImms, 1);
  }
  complete_send(qp, it, IBV_WC_SUCCESS);
  pop_send(qp);
  return 1;
}

static void* worker_main(void* arg) {
  FakeCtx* ctx = arg;
  int next = 0;
  pthread_mutex_lock(&mu);
  while (!ctx->stop) {
    FakeQp* qp = NULL;
    for (int k = 0; k < kMaxQps && qp == NULL; ++k) {
      FakeQp* q = qps[(next + k) % kMaxQps];
      if (q != NULL && q->ctx == ctx && q->sq_count > 0) {
        qp = q;
        next = (next + k + 1) % kMaxQps;
      }
    }
    if (qp == NULL) {
      pthread_cond_wait(&work_cv, &mu);
      continue;
    }
    const int us = __atomic_load_n(&delay_us, __ATOMIC_RELAXED);
    if (us > 0) {  // the NIC lags behind the poster
      pthread_mutex_unlock(&mu);
      usleep((useconds_t)us);
      pthread_mutex_lock(&mu);
      if (!qp->used || qp->sq_count == 0) continue;
    }
    if (!execute(qp)) {  // receiver not ready: retry later, let other QPs go
      pthread_mutex_unlock(&mu);
      usleep(20);
      pthread_mutex_lock(&mu);
    }
  }
  pthread_mutex_unlock(&mu);
  return NULL;
}

// ---------------------------------------------------------------------------------------------
// Data path entry points (through context->ops).

static int fake_post_send(struct ibv_qp* base, struct ibv_send_wr* wr, struct ibv_send_wr** bad) {
  FakeQp* qp = (FakeQp*)base;
  pthread_mutex_lock(&mu);
  int k = 0;
  for (struct ibv_send_wr* w = wr; w != NULL; w = w->next) ++k;
  int err = 0;
  if (qp->base.state != IBV_QPS_RTS) err = EINVAL;
  if (err == 0 && qp->posted - qp->retired + (uint64_t)k > qp->cap.max_send_wr) {
    bump(kSqFull, 1);
    err = ENOMEM;
  }
  for (struct ibv_send_wr* w = wr; err == 0 && w != NULL; w = w->next)
    if ((w->opcode != IBV_WR_RDMA_WRITE && w->opcode != IBV_WR_RDMA_WRITE_WITH_IMM) ||
        w->num_sge < 0 || w->num_sge > (int)qp->cap.max_send_sge ||
        (w->num_sge > 0 && w->sg_list == NULL))
      err = EINVAL;
  if (err != 0) {
    if (bad != NULL) *bad = wr;
    pthread_mutex_unlock(&mu);
    return err;
  }
  for (struct ibv_send_wr* w = wr; w != NULL; w = w->next) {
    SendItem* it = &qp->sq[(qp->sq_head + qp->sq_count) % (int)qp->cap.max_send_wr];
    it->wr = *w;
    it->wr.next = NULL;
    memset(&it->sge, 0, sizeof(it->sge));
    if (w->num_sge > 0) it->sge = w->sg_list[0];  // copied now: the caller may reuse its list
    it->pos = ++qp->posted;
    ++qp->sq_count;
  }
  bump(kPostCalls, 1);
  bump(kWrs, k);
  if (k > stats[kMaxChain]) stats[kMaxChain] = k;
  pthread_cond_broadcast(&work_cv);
  pthread_mutex_unlock(&mu);
  return 0;
}

static int fake_post_recv(struct ibv_qp* base, struct ibv_recv_wr* wr, struct ibv_recv_wr** bad) {
  FakeQp* qp = (FakeQp*)base;
  pthread_mutex_lock(&mu);
  int err = 0;
  for (struct ibv_recv_wr* w = wr; w != NULL; w = w->next) {
    if (qp->base.state == IBV_QPS_RESET || qp->base.state == IBV_QPS_ERR ||
        w->num_sge > (int)qp->cap.max_recv_sge)
      err = EINVAL;
    else if (qp->rq_count == (int)qp->cap.max_recv_wr)
      err = ENOMEM;
    if (err != 0) {
      if (bad != NULL) *bad = w;
      break;
    }
    qp->rq[(qp->rq_head + qp->rq_count) % (int)qp->cap.max_recv_wr] = w->wr_id;
    ++qp->rq_count;
    bump(kRecvsPosted, 1);
  }
  pthread_cond_broadcast(&work_cv);  // a request waiting for a receive may go now
  pthread_mutex_unlock(&mu);
  return err;
}

static int fake_poll_cq(struct ibv_cq* base, int n, struct ibv_wc* out) {
  FakeCq* cq = (FakeCq*)base;
  pthread_mutex_lock(&mu);
  if (cq->overrun) {
    pthread_mutex_unlock(&mu);
    return -1;
  }
  int got = 0;
  for (; got < n && cq->count > 0; ++got) {
    Cqe* e = &cq->ring[cq->head];
    out[got] = e->wc;
    if (e->qp != NULL && e->pos > e->qp->retired) e->qp->retired = e->pos;
    cq->head = (cq->head + 1) % cq->cap;
    --cq->count;
  }
  pthread_mutex_unlock(&mu);
  return got;
}

// ---------------------------------------------------------------------------------------------
// Exported entry points.

EXPORT struct ibv_device** ibv_get_device_list(int* num) {
  struct ibv_device** list = calloc((size_t)n_devices + 1, sizeof(*list));
  if (list == NULL) {
    errno = ENOMEM;
    return NULL;
  }
  for (int i = 0; i < n_devices; ++i) {
    devices[i].index = i;
    snprintf(devices[i].name, sizeof(devices[i].name), "fakeib%d", i);
    list[i] = (struct ibv_device*)&devices[i];
  }
  if (num != NULL) *num = n_devices;
  return list;
}

EXPORT void ibv_free_device_list(struct ibv_device** list) { free(list); }

EXPORT const char* ibv_get_device_name(struct ibv_device* dev) {
  return ((FakeDevice*)dev)->name;
}

EXPORT struct ibv_context* ibv_open_device(struct ibv_device* dev) {
  FakeCtx* ctx = calloc(1, sizeof(FakeCtx));
  if (ctx == NULL) {
    errno = ENOMEM;
    return NULL;
  }
  ctx->base.device = dev;
  ctx->base.ops.post_send = fake_post_send;
  ctx->base.ops.post_recv = fake_post_recv;
  ctx->base.ops.poll_cq = fake_poll_cq;
  ctx->dev = ((FakeDevice*)dev)->index;
  pthread_create(&ctx->worker, NULL, worker_main, ctx);
  bump(kLiveContexts, 1);
  return &ctx->base;
}

EXPORT int ibv_close_device(struct ibv_context* base) {
  FakeCtx* ctx = (FakeCtx*)base;
  pthread_mutex_lock(&mu);
  ctx->stop = 1;
  pthread_cond_broadcast(&work_cv);
  pthread_mutex_unlock(&mu);
  pthread_join(ctx->worker, NULL);
  free(ctx);
  bump(kLiveContexts, -1);
  return 0;
}

EXPORT int ibv_query_port(struct ibv_context* base, uint8_t port, struct ibv_port_attr* attr) {
  if (port != 1) return EINVAL;
  memset(attr, 0, sizeof(*attr));
  attr->state = IBV_PORT_ACTIVE;
  attr->max_mtu = attr->active_mtu = 5;  // IBV_MTU_4096
  attr->gid_tbl_len = 1;
  attr->max_msg_sz = 1u << 31;
  attr->lid = (uint16_t)(((FakeCtx*)base)->dev + 1);
  attr->link_layer = IBV_LINK_LAYER_INFINIBAND;
  return 0;
}

EXPORT int ibv_query_gid(struct ibv_context* base, uint8_t port, int index, union ibv_gid* gid) {
  if (port != 1 || index != 0) return EINVAL;
  memset(gid, 0, sizeof(*gid));
  gid->raw[0] = 0xfe;
  gid->raw[1] = 0x80;
  gid->raw[15] = (uint8_t)(((FakeCtx*)base)->dev + 1);
  return 0;
}

EXPORT struct ibv_pd* ibv_alloc_pd(struct ibv_context* ctx) {
  FakePd* pd = calloc(1, sizeof(FakePd));
  if (pd == NULL) return NULL;
  pd->base.context = ctx;
  bump(kLivePds, 1);
  return &pd->base;
}

EXPORT int ibv_dealloc_pd(struct ibv_pd* pd) {
  pthread_mutex_lock(&mu);
  int busy = 0;
  for (int i = 0; i < kMaxMrs; ++i) busy |= mrs[i].used && mrs[i].base.pd == pd;
  for (int i = 0; i < kMaxQps; ++i) busy |= qps[i] != NULL && qps[i]->base.pd == pd;
  pthread_mutex_unlock(&mu);
  if (busy) return EBUSY;
  free(pd);
  bump(kLivePds, -1);
  return 0;
}

static int is_gpu(uint64_t lo, uint64_t hi) {
  for (int i = 0; i < n_gpu_ranges; ++i)
    if (lo < gpu_ranges[i].hi && gpu_ranges[i].lo < hi) return 1;
  return 0;
}

static struct ibv_mr* new_mr(struct ibv_pd* pd, uint64_t lo, size_t len, int access, int gpu) {
  if (!(access & IBV_ACCESS_LOCAL_WRITE) && (access & IBV_ACCESS_REMOTE_WRITE)) {
    errno = EINVAL;  // remote write needs local write, as verbs requires
    return NULL;
  }
  pthread_mutex_lock(&mu);
  for (int i = 0; i < kMaxMrs; ++i) {
    if (mrs[i].used) continue;
    FakeMr* m = &mrs[i];
    memset(m, 0, sizeof(*m));
    m->used = 1;
    m->access = access;
    m->gpu = gpu;
    m->lo = lo;
    m->hi = lo + len;
    m->base.context = pd->context;
    m->base.pd = pd;
    m->base.addr = (void*)(uintptr_t)lo;
    m->base.length = len;
    m->base.lkey = lkey_of(i);
    m->base.rkey = rkey_of(i);
    pthread_mutex_unlock(&mu);
    bump(kLiveMrs, 1);
    return &m->base;
  }
  pthread_mutex_unlock(&mu);
  errno = ENOMEM;
  return NULL;
}

EXPORT struct ibv_mr* ibv_reg_mr(struct ibv_pd* pd, void* addr, size_t len, int access) {
  const uint64_t lo = (uint64_t)(uintptr_t)addr;
  const int gpu = is_gpu(lo, lo + len);
  if (gpu && !peermem) {  // without nvidia-peermem the kernel cannot pin device memory
    errno = EFAULT;
    return NULL;
  }
  struct ibv_mr* mr = new_mr(pd, lo, len, access, gpu);
  if (mr != NULL) bump(gpu ? kPeermemRegs : kHostRegs, 1);
  return mr;
}

EXPORT struct ibv_mr* ibv_reg_dmabuf_mr(struct ibv_pd* pd, uint64_t offset, size_t len,
                                        uint64_t iova, int fd, int access) {
  if (!dmabuf) {
    errno = EOPNOTSUPP;
    return NULL;
  }
  char path[64], target[256];
  snprintf(path, sizeof(path), "/proc/self/fd/%d", fd);
  const ssize_t n = readlink(path, target, sizeof(target) - 1);
  unsigned long long base = 0, size = 0;
  if (n <= 0) {
    errno = EBADF;
    return NULL;
  }
  target[n] = '\0';
  const char* name = strstr(target, "fakecuda-dmabuf:");
  if (name == NULL || sscanf(name, "fakecuda-dmabuf:%llx:%llx", &base, &size) != 2 ||
      offset + len > size || iova != base + offset || !is_gpu(iova, iova + len)) {
    errno = EINVAL;  // not a dma-buf of the fake CUDA driver, or not what it covers
    return NULL;
  }
  struct ibv_mr* mr = new_mr(pd, iova, len, access, 1);
  if (mr != NULL) bump(kDmabufRegs, 1);
  return mr;
}

EXPORT int ibv_dereg_mr(struct ibv_mr* mr) {
  pthread_mutex_lock(&mu);
  ((FakeMr*)mr)->used = 0;
  pthread_mutex_unlock(&mu);
  bump(kLiveMrs, -1);
  return 0;
}

EXPORT struct ibv_cq* ibv_create_cq(struct ibv_context* ctx, int cqe, void* cq_context,
                                    void* channel, int comp_vector) {
  (void)channel;
  (void)comp_vector;
  if (cqe < 1 || cqe > (1 << 22)) {
    errno = EINVAL;
    return NULL;
  }
  FakeCq* cq = calloc(1, sizeof(FakeCq));
  Cqe* ring = calloc((size_t)cqe, sizeof(Cqe));
  if (cq == NULL || ring == NULL) {
    free(cq);
    free(ring);
    errno = ENOMEM;
    return NULL;
  }
  cq->base.context = ctx;
  cq->base.cq_context = cq_context;
  cq->base.cqe = cqe;
  cq->ring = ring;
  cq->cap = cqe;
  bump(kLiveCqs, 1);
  return &cq->base;
}

EXPORT int ibv_destroy_cq(struct ibv_cq* base) {
  FakeCq* cq = (FakeCq*)base;
  pthread_mutex_lock(&mu);
  int busy = 0;
  for (int i = 0; i < kMaxQps; ++i)
    busy |= qps[i] != NULL && (qps[i]->scq == cq || qps[i]->rcq == cq);
  pthread_mutex_unlock(&mu);
  if (busy) return EBUSY;
  free(cq->ring);
  free(cq);
  bump(kLiveCqs, -1);
  return 0;
}

EXPORT struct ibv_qp* ibv_create_qp(struct ibv_pd* pd, struct ibv_qp_init_attr* attr) {
  const struct ibv_qp_cap* cap = &attr->cap;
  if (attr->qp_type != IBV_QPT_RC || attr->send_cq == NULL || attr->recv_cq == NULL ||
      cap->max_send_wr < 1 || cap->max_send_wr > (1u << 15) || cap->max_recv_wr < 1 ||
      cap->max_recv_wr > (1u << 15) || cap->max_send_sge > 4 || cap->max_recv_sge > 4) {
    errno = EINVAL;
    return NULL;
  }
  FakeQp* qp = calloc(1, sizeof(FakeQp));
  if (qp == NULL) return NULL;
  qp->sq = calloc(cap->max_send_wr, sizeof(SendItem));
  qp->rq = calloc(cap->max_recv_wr, sizeof(uint64_t));
  qp->cap = *cap;
  qp->sig_all = attr->sq_sig_all;
  qp->scq = (FakeCq*)attr->send_cq;
  qp->rcq = (FakeCq*)attr->recv_cq;
  qp->ctx = (FakeCtx*)pd->context;
  qp->base.context = pd->context;
  qp->base.pd = pd;
  qp->base.send_cq = attr->send_cq;
  qp->base.recv_cq = attr->recv_cq;
  qp->base.qp_type = IBV_QPT_RC;
  qp->base.state = IBV_QPS_RESET;
  qp->used = 1;
  pthread_mutex_lock(&mu);
  int slot = -1;
  for (int i = 0; i < kMaxQps && slot < 0; ++i)
    if (qps[i] == NULL) slot = i;
  if (slot < 0 || qp->sq == NULL || qp->rq == NULL) {
    pthread_mutex_unlock(&mu);
    free(qp->sq);
    free(qp->rq);
    free(qp);
    errno = ENOMEM;
    return NULL;
  }
  static uint32_t next_num = 0x100;
  qp->base.qp_num = next_num++;
  qps[slot] = qp;
  pthread_mutex_unlock(&mu);
  bump(kLiveQps, 1);
  return &qp->base;
}

EXPORT int ibv_modify_qp(struct ibv_qp* base, struct ibv_qp_attr* a, int mask) {
  FakeQp* qp = (FakeQp*)base;
  const int init = IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS;
  const int rtr = IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
                  IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER;
  const int rts = IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY |
                  IBV_QP_SQ_PSN | IBV_QP_MAX_QP_RD_ATOMIC;
  if (!(mask & IBV_QP_STATE)) return EINVAL;
  pthread_mutex_lock(&mu);
  int err = 0;
  const int from = qp->base.state, to = a->qp_state;
  if (from == IBV_QPS_RESET && to == IBV_QPS_INIT && (mask & init) == init) {
    if (a->port_num != 1) err = EINVAL;
    qp->port = a->port_num;
    qp->access = a->qp_access_flags;
  } else if (from == IBV_QPS_INIT && to == IBV_QPS_RTR && (mask & rtr) == rtr) {
    if (a->path_mtu < 1 || a->path_mtu > 5 || a->ah_attr.port_num != 1 || a->dest_qp_num == 0)
      err = EINVAL;
    qp->dest = a->dest_qp_num;
    qp->rq_psn = a->rq_psn & 0xffffff;
    qp->dlid = a->ah_attr.dlid;
  } else if (from == IBV_QPS_RTR && to == IBV_QPS_RTS && (mask & rts) == rts) {
    qp->sq_psn = a->sq_psn & 0xffffff;
  } else {
    err = EINVAL;  // a transition verbs does not allow, or an attribute it requires is missing
  }
  if (err == 0) qp->base.state = to;
  pthread_mutex_unlock(&mu);
  return err;
}

EXPORT int ibv_destroy_qp(struct ibv_qp* base) {
  FakeQp* qp = (FakeQp*)base;
  pthread_mutex_lock(&mu);
  for (int i = 0; i < kMaxQps; ++i)
    if (qps[i] == qp) qps[i] = NULL;
  qp->used = 0;
  // Its completions still queued no longer retire slots of it.
  FakeCq* cqs[2] = {qp->scq, qp->rcq};
  for (int c = 0; c < 2; ++c)
    for (int k = 0; k < cqs[c]->count; ++k) {
      Cqe* e = &cqs[c]->ring[(cqs[c]->head + k) % cqs[c]->cap];
      if (e->qp == qp) e->qp = NULL;
    }
  pthread_mutex_unlock(&mu);
  free(qp->sq);
  free(qp->rq);
  free(qp);
  bump(kLiveQps, -1);
  return 0;
}
