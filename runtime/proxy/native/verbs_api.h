// libibverbs entry points the verbs backend uses, resolved at RUN time with dlopen/dlsym.
//
// Like cuda_api.h: the extension is built without rdma-core's headers or library (CI has gcc
// only), so the few structures the backend touches are mirrored here from rdma-core's
// libibverbs/verbs.h, whose layout is a stable ABI (IBVERBS_1.1, 2005 on). The static_asserts
// pin every offset the backend reads or writes to the value a compiler gives with the real header
// on LP64 Linux (measured with rdma-core's verbs.h; a mirror that drifts does not compile).
//
// ibv_post_send, ibv_post_recv and ibv_poll_cq are static inline functions in verbs.h, not
// exported symbols: they call through the provider's function table in ``ibv_context::ops``,
// and so does this file. Everything else is an exported IBVERBS_1.x symbol (ibv_reg_dmabuf_mr:
// IBVERBS_1.12, rdma-core 34, optional).
#pragma once

#include <pthread.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace mgraph::ibv {

struct context;
struct pd;
struct cq;
struct qp;

union gid {
  uint8_t raw[16];
  struct {
    uint64_t subnet_prefix, interface_id;
  } global;
};

struct port_attr {  // ibv_port_attr (ibv_query_port fills its IBVERBS_1.1 prefix)
  int state, max_mtu, active_mtu, gid_tbl_len;
  uint32_t port_cap_flags, max_msg_sz, bad_pkey_cntr, qkey_viol_cntr;
  uint16_t pkey_tbl_len, lid, sm_lid;
  uint8_t lmc, max_vl_num, sm_sl, subnet_timeout, init_type_reply, active_width, active_speed,
      phys_state, link_layer, flags;
  uint16_t port_cap_flags2;
  uint32_t active_speed_ex;
};

struct wc {
  uint64_t wr_id;
  int status, opcode;
  uint32_t vendor_err, byte_len;
  uint32_t imm_data;  // network byte order
  uint32_t qp_num, src_qp;
  unsigned wc_flags;
  uint16_t pkey_index, slid;
  uint8_t sl, dlid_path_bits;
};

struct mr {
  context* ctx;
  pd* pd_;
  void* addr;
  size_t length;
  uint32_t handle, lkey, rkey;
};

struct global_route {
  gid dgid;
  uint32_t flow_label;
  uint8_t sgid_index, hop_limit, traffic_class;
};

struct ah_attr {
  global_route grh;
  uint16_t dlid;
  uint8_t sl, src_path_bits, static_rate, is_global, port_num;
};

struct qp_cap {
  uint32_t max_send_wr, max_recv_wr, max_send_sge, max_recv_sge, max_inline_data;
};

struct qp_init_attr {
  void* qp_context;
  cq* send_cq;
  cq* recv_cq;
  void* srq;
  qp_cap cap;
  int qp_type;
  int sq_sig_all;
};

struct qp_attr {
  int qp_state, cur_qp_state, path_mtu, path_mig_state;
  uint32_t qkey, rq_psn, sq_psn, dest_qp_num;
  unsigned qp_access_flags;
  qp_cap cap;
  ah_attr ah, alt_ah;
  uint16_t pkey_index, alt_pkey_index;
  uint8_t en_sqd_async_notify, sq_draining, max_rd_atomic, max_dest_rd_atomic, min_rnr_timer,
      port_num, timeout, retry_cnt, rnr_retry, alt_port_num, alt_timeout;
  uint32_t rate_limit;
};

struct sge {
  uint64_t addr;
  uint32_t length, lkey;
};

struct send_wr {
  uint64_t wr_id;
  send_wr* next;
  sge* sg_list;
  int num_sge;
  int opcode;
  unsigned send_flags;
  uint32_t imm_data;  // network byte order
  struct {
    uint64_t remote_addr;
    uint32_t rkey;
    uint32_t pad_[5];  // the union's other members (atomic: 32 bytes)
  } rdma;
  uint32_t qp_type_;
  uint64_t tail_[6];  // bind_mw / tso union
};

struct recv_wr {
  uint64_t wr_id;
  recv_wr* next;
  sge* sg_list;
  int num_sge;
};

struct qp {
  context* ctx;
  void* qp_context;
  pd* pd_;
  cq* send_cq;
  cq* recv_cq;
  void* srq;
  uint32_t handle, qp_num;
  int state, qp_type;
  pthread_mutex_t mutex;
  pthread_cond_t cond;
  uint32_t events_completed;
};

struct context_ops {
  void* compat_[11];  // _compat_query_device .. _compat_create_cq
  int (*poll_cq)(cq*, int, wc*);
  void* compat2_[13];  // req_notify_cq .. _compat_destroy_qp
  int (*post_send)(qp*, send_wr*, send_wr**);
  int (*post_recv)(qp*, recv_wr*, recv_wr**);
  void* compat3_[5];
};

struct context {
  void* device;
  context_ops ops;
  int cmd_fd, async_fd, num_comp_vectors;
  pthread_mutex_t mutex;
  void* abi_compat;
};

struct cq {
  context* ctx;
};

// Constants of verbs.h used here.
enum : int {
  kAccessLocalWrite = 1,
  kAccessRemoteWrite = 2,
  kQptRc = 2,
  kQpsInit = 1,
  kQpsRtr = 2,
  kQpsRts = 3,
  kMtu1024 = 3,
  kWrRdmaWrite = 0,
  kWrRdmaWriteWithImm = 1,
  kSendSignaled = 2,
  kWcSuccess = 0,
  kWcRdmaWrite = 1,
  kWcRecvRdmaWithImm = 129,
  kLinkLayerEthernet = 2,
};
enum : int {  // ibv_qp_attr_mask
  kQpState = 1 << 0,
  kQpAccessFlags = 1 << 3,
  kQpPkeyIndex = 1 << 4,
  kQpPort = 1 << 5,
  kQpAv = 1 << 7,
  kQpPathMtu = 1 << 8,
  kQpTimeout = 1 << 9,
  kQpRetryCnt = 1 << 10,
  kQpRnrRetry = 1 << 11,
  kQpRqPsn = 1 << 12,
  kQpMaxQpRdAtomic = 1 << 13,
  kQpMinRnrTimer = 1 << 15,
  kQpSqPsn = 1 << 16,
  kQpMaxDestRdAtomic = 1 << 17,
  kQpDestQpn = 1 << 20,
};

// Offsets and sizes from rdma-core's verbs.h on x86_64 / aarch64 (LP64).
static_assert(sizeof(send_wr) == 128 && offsetof(send_wr, opcode) == 28 &&
              offsetof(send_wr, imm_data) == 36 && offsetof(send_wr, rdma) == 40 &&
              offsetof(send_wr, rdma.rkey) == 48, "ibv_send_wr layout");
static_assert(sizeof(recv_wr) == 32 && sizeof(sge) == 16, "ibv_recv_wr / ibv_sge layout");
static_assert(sizeof(wc) == 48 && offsetof(wc, status) == 8 && offsetof(wc, byte_len) == 20 &&
              offsetof(wc, imm_data) == 24 && offsetof(wc, qp_num) == 28 &&
              offsetof(wc, wc_flags) == 36, "ibv_wc layout");
static_assert(sizeof(qp_attr) == 144 && offsetof(qp_attr, qp_access_flags) == 32 &&
              offsetof(qp_attr, ah) == 56 && offsetof(qp_attr, pkey_index) == 120 &&
              offsetof(qp_attr, max_rd_atomic) == 126 && offsetof(qp_attr, port_num) == 129 &&
              offsetof(qp_attr, rnr_retry) == 132 && offsetof(qp_attr, rate_limit) == 136,
              "ibv_qp_attr layout");
static_assert(sizeof(ah_attr) == 32 && offsetof(ah_attr, dlid) == 24 &&
              offsetof(ah_attr, is_global) == 29 && offsetof(ah_attr, port_num) == 30 &&
              offsetof(global_route, sgid_index) == 20, "ibv_ah_attr layout");
static_assert(sizeof(qp_init_attr) == 64 && offsetof(qp_init_attr, cap) == 32 &&
              offsetof(qp_init_attr, qp_type) == 52 && offsetof(qp_init_attr, sq_sig_all) == 56,
              "ibv_qp_init_attr layout");
static_assert(offsetof(qp, qp_num) == 52 && offsetof(qp, state) == 56, "ibv_qp layout");
static_assert(offsetof(context, ops) == 8 && offsetof(context, ops.poll_cq) == 96 &&
              offsetof(context, ops.post_send) == 208 && offsetof(context, ops.post_recv) == 216,
              "ibv_context layout");
static_assert(offsetof(mr, lkey) == 36 && offsetof(mr, rkey) == 40, "ibv_mr layout");
static_assert(sizeof(port_attr) == 56 && offsetof(port_attr, lid) == 34 &&
              offsetof(port_attr, link_layer) == 46, "ibv_port_attr layout");

// The exported entry points (dlsym), each null until ``load`` resolved it.
class Api {
 public:
  // "" on success, otherwise which library could not be opened or which symbols it lacks.
  std::string load(const std::vector<std::string>& libs);
  bool loaded() const { return modify_qp != nullptr; }
  bool has_dmabuf() const { return reg_dmabuf_mr != nullptr; }
  std::string path;  // the library that was opened

  void** (*get_device_list)(int*) = nullptr;
  void (*free_device_list)(void**) = nullptr;
  const char* (*get_device_name)(void*) = nullptr;
  context* (*open_device)(void*) = nullptr;
  int (*close_device)(context*) = nullptr;
  int (*query_port)(context*, uint8_t, port_attr*) = nullptr;
  int (*query_gid)(context*, uint8_t, int, gid*) = nullptr;
  pd* (*alloc_pd)(context*) = nullptr;
  int (*dealloc_pd)(pd*) = nullptr;
  mr* (*reg_mr)(pd*, void*, size_t, int) = nullptr;
  mr* (*reg_dmabuf_mr)(pd*, uint64_t, size_t, uint64_t, int, int) = nullptr;
  int (*dereg_mr)(mr*) = nullptr;
  cq* (*create_cq)(context*, int, void*, void*, int) = nullptr;
  int (*destroy_cq)(cq*) = nullptr;
  qp* (*create_qp)(pd*, qp_init_attr*) = nullptr;
  int (*modify_qp)(qp*, qp_attr*, int) = nullptr;
  int (*destroy_qp)(qp*) = nullptr;

 private:
  void* lib_ = nullptr;
};

}  // namespace mgraph::ibv
