// The part of rdma-core's <infiniband/verbs.h> the fake libibverbs implements, written out
// from that header (rdma-core is not installed here): the same field order and types, so the
// structures have the real ABI. The _Static_asserts hold the offsets a compiler gives with the
// real header on LP64 Linux. This file is separate from runtime/proxy/native/verbs_api.h on
// purpose: the proxy's mirror is checked against this one only through running code.
#pragma once

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

union ibv_gid {
  uint8_t raw[16];
  struct {
    uint64_t subnet_prefix;
    uint64_t interface_id;
  } global;
};

struct ibv_device;
struct ibv_context;
struct ibv_cq;
struct ibv_qp;
struct ibv_pd;

struct ibv_port_attr {
  int state, max_mtu, active_mtu, gid_tbl_len;
  uint32_t port_cap_flags, max_msg_sz, bad_pkey_cntr, qkey_viol_cntr;
  uint16_t pkey_tbl_len, lid, sm_lid;
  uint8_t lmc, max_vl_num, sm_sl, subnet_timeout, init_type_reply, active_width, active_speed,
      phys_state, link_layer, flags;
  uint16_t port_cap_flags2;
  uint32_t active_speed_ex;
};

struct ibv_wc {
  uint64_t wr_id;
  int status;
  int opcode;
  uint32_t vendor_err;
  uint32_t byte_len;
  union {
    uint32_t imm_data;
    uint32_t invalidated_rkey;
  };
  uint32_t qp_num;
  uint32_t src_qp;
  unsigned int wc_flags;
  uint16_t pkey_index;
  uint16_t slid;
  uint8_t sl;
  uint8_t dlid_path_bits;
};

struct ibv_pd {
  struct ibv_context* context;
  uint32_t handle;
};

struct ibv_mr {
  struct ibv_context* context;
  struct ibv_pd* pd;
  void* addr;
  size_t length;
  uint32_t handle;
  uint32_t lkey;
  uint32_t rkey;
};

struct ibv_global_route {
  union ibv_gid dgid;
  uint32_t flow_label;
  uint8_t sgid_index;
  uint8_t hop_limit;
  uint8_t traffic_class;
};

struct ibv_ah_attr {
  struct ibv_global_route grh;
  uint16_t dlid;
  uint8_t sl;
  uint8_t src_path_bits;
  uint8_t static_rate;
  uint8_t is_global;
  uint8_t port_num;
};

struct ibv_qp_cap {
  uint32_t max_send_wr;
  uint32_t max_recv_wr;
  uint32_t max_send_sge;
  uint32_t max_recv_sge;
  uint32_t max_inline_data;
};

struct ibv_qp_init_attr {
  void* qp_context;
  struct ibv_cq* send_cq;
  struct ibv_cq* recv_cq;
  void* srq;
  struct ibv_qp_cap cap;
  int qp_type;
  int sq_sig_all;
};

struct ibv_qp_attr {
  int qp_state;
  int cur_qp_state;
  int path_mtu;
  int path_mig_state;
  uint32_t qkey;
  uint32_t rq_psn;
  uint32_t sq_psn;
  uint32_t dest_qp_num;
  unsigned int qp_access_flags;
  struct ibv_qp_cap cap;
  struct ibv_ah_attr ah_attr;
  struct ibv_ah_attr alt_ah_attr;
  uint16_t pkey_index;
  uint16_t alt_pkey_index;
  uint8_t en_sqd_async_notify;
  uint8_t sq_draining;
  uint8_t max_rd_atomic;
  uint8_t max_dest_rd_atomic;
  uint8_t min_rnr_timer;
  uint8_t port_num;
  uint8_t timeout;
  uint8_t retry_cnt;
  uint8_t rnr_retry;
  uint8_t alt_port_num;
  uint8_t alt_timeout;
  uint32_t rate_limit;
};

struct ibv_sge {
  uint64_t addr;
  uint32_t length;
  uint32_t lkey;
};

struct ibv_mw_bind_info {
  void* mr;
  uint64_t addr;
  uint64_t length;
  unsigned int mw_access_flags;
};

struct ibv_send_wr {
  uint64_t wr_id;
  struct ibv_send_wr* next;
  struct ibv_sge* sg_list;
  int num_sge;
  int opcode;
  unsigned int send_flags;
  union {
    uint32_t imm_data;
    uint32_t invalidate_rkey;
  };
  union {
    struct {
      uint64_t remote_addr;
      uint32_t rkey;
    } rdma;
    struct {
      uint64_t remote_addr;
      uint64_t compare_add;
      uint64_t swap;
      uint32_t rkey;
    } atomic;
    struct {
      void* ah;
      uint32_t remote_qpn;
      uint32_t remote_qkey;
    } ud;
  } wr;
  union {
    struct {
      uint32_t remote_srqn;
    } xrc;
  } qp_type;
  union {
    struct {
      void* mw;
      uint32_t rkey;
      struct ibv_mw_bind_info bind_info;
    } bind_mw;
    struct {
      void* hdr;
      uint16_t hdr_sz;
      uint16_t mss;
    } tso;
  };
};

struct ibv_recv_wr {
  uint64_t wr_id;
  struct ibv_recv_wr* next;
  struct ibv_sge* sg_list;
  int num_sge;
};

struct ibv_qp {
  struct ibv_context* context;
  void* qp_context;
  struct ibv_pd* pd;
  struct ibv_cq* send_cq;
  struct ibv_cq* recv_cq;
  void* srq;
  uint32_t handle;
  uint32_t qp_num;
  int state;
  int qp_type;
  pthread_mutex_t mutex;
  pthread_cond_t cond;
  uint32_t events_completed;
};

struct ibv_cq {
  struct ibv_context* context;
  void* channel;
  void* cq_context;
  uint32_t handle;
  int cqe;
  pthread_mutex_t mutex;
  pthread_cond_t cond;
  uint32_t comp_events_completed;
  uint32_t async_events_completed;
};

struct ibv_context_ops {
  void* compat_query_device;
  void* compat_query_port;
  void* compat_alloc_pd;
  void* compat_dealloc_pd;
  void* compat_reg_mr;
  void* compat_rereg_mr;
  void* compat_dereg_mr;
  void* alloc_mw;
  void* bind_mw;
  void* dealloc_mw;
  void* compat_create_cq;
  int (*poll_cq)(struct ibv_cq* cq, int num_entries, struct ibv_wc* wc);
  void* req_notify_cq;
  void* compat_cq_event;
  void* compat_resize_cq;
  void* compat_destroy_cq;
  void* compat_create_srq;
  void* compat_modify_srq;
  void* compat_query_srq;
  void* compat_destroy_srq;
  void* post_srq_recv;
  void* compat_create_qp;
  void* compat_query_qp;
  void* compat_modify_qp;
  void* compat_destroy_qp;
  int (*post_send)(struct ibv_qp* qp, struct ibv_send_wr* wr, struct ibv_send_wr** bad_wr);
  int (*post_recv)(struct ibv_qp* qp, struct ibv_recv_wr* wr, struct ibv_recv_wr** bad_wr);
  void* compat_create_ah;
  void* compat_destroy_ah;
  void* compat_attach_mcast;
  void* compat_detach_mcast;
  void* compat_async_event;
};

struct ibv_context {
  struct ibv_device* device;
  struct ibv_context_ops ops;
  int cmd_fd;
  int async_fd;
  int num_comp_vectors;
  pthread_mutex_t mutex;
  void* abi_compat;
};

enum {
  IBV_ACCESS_LOCAL_WRITE = 1,
  IBV_ACCESS_REMOTE_WRITE = 2,
  IBV_QPT_RC = 2,
  IBV_QPS_RESET = 0,
  IBV_QPS_INIT = 1,
  IBV_QPS_RTR = 2,
  IBV_QPS_RTS = 3,
  IBV_QPS_ERR = 6,
  IBV_WR_RDMA_WRITE = 0,
  IBV_WR_RDMA_WRITE_WITH_IMM = 1,
  IBV_SEND_SIGNALED = 2,
  IBV_WC_SUCCESS = 0,
  IBV_WC_LOC_PROT_ERR = 4,
  IBV_WC_WR_FLUSH_ERR = 5,
  IBV_WC_REM_ACCESS_ERR = 10,
  IBV_WC_RETRY_EXC_ERR = 12,
  IBV_WC_RDMA_WRITE = 1,
  IBV_WC_RECV_RDMA_WITH_IMM = 129,
  IBV_WC_WITH_IMM = 2,
  IBV_PORT_ACTIVE = 4,
  IBV_LINK_LAYER_INFINIBAND = 1,
};

enum {
  IBV_QP_STATE = 1 << 0,
  IBV_QP_ACCESS_FLAGS = 1 << 3,
  IBV_QP_PKEY_INDEX = 1 << 4,
  IBV_QP_PORT = 1 << 5,
  IBV_QP_AV = 1 << 7,
  IBV_QP_PATH_MTU = 1 << 8,
  IBV_QP_TIMEOUT = 1 << 9,
  IBV_QP_RETRY_CNT = 1 << 10,
  IBV_QP_RNR_RETRY = 1 << 11,
  IBV_QP_RQ_PSN = 1 << 12,
  IBV_QP_MAX_QP_RD_ATOMIC = 1 << 13,
  IBV_QP_MIN_RNR_TIMER = 1 << 15,
  IBV_QP_SQ_PSN = 1 << 16,
  IBV_QP_MAX_DEST_RD_ATOMIC = 1 << 17,
  IBV_QP_DEST_QPN = 1 << 20,
};

_Static_assert(sizeof(struct ibv_send_wr) == 128, "ibv_send_wr");
_Static_assert(offsetof(struct ibv_send_wr, imm_data) == 36, "ibv_send_wr.imm_data");
_Static_assert(offsetof(struct ibv_send_wr, wr.rdma.rkey) == 48, "ibv_send_wr.wr.rdma.rkey");
_Static_assert(sizeof(struct ibv_wc) == 48 && offsetof(struct ibv_wc, qp_num) == 28, "ibv_wc");
_Static_assert(sizeof(struct ibv_qp_attr) == 144 && offsetof(struct ibv_qp_attr, rnr_retry) == 132,
               "ibv_qp_attr");
_Static_assert(offsetof(struct ibv_qp, qp_num) == 52, "ibv_qp.qp_num");
_Static_assert(offsetof(struct ibv_context, ops.post_send) == 208, "ibv_context.ops.post_send");
_Static_assert(offsetof(struct ibv_context, ops.poll_cq) == 96, "ibv_context.ops.poll_cq");
_Static_assert(sizeof(struct ibv_port_attr) == 56 && offsetof(struct ibv_port_attr, lid) == 34,
               "ibv_port_attr");
