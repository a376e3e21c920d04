// The verbs backend of the native drain loop: one RDMA NIC port, RC queue pairs to peer ranks.
//
// Wire protocol (both sides run this file):
//   WRITE  - RDMA WRITE of the region's bytes straight into the peer's registered buffer (one
//            work request per row when a side is strided). The command's first event rides on
//            the last of them as RDMA WRITE WITH IMMEDIATE, the immediate being the event id (32
//            bits, network byte order); further events go as zero-length WRITE WITH IMMEDIATEs.
//   SIGNAL - a zero-length WRITE WITH IMMEDIATE carrying the event.
// The receiving proxy polls its completion queue; each receive completion raises its event on
// the receiving rank (host counter, host int32 flag, or GPU flag word through the CUDA path), so
// a flag is raised by the immediate, never by the sender writing flag memory. An RC queue pair
// places data in order and a receive completion is generated only after the write it belongs
// to is placed, so a raised flag vouches for the data written before it on that pair.
//
// Memory. Host memory is registered with ibv_reg_mr. GPU memory is registered, in this order of
// preference (mode "auto"), through dma-buf (cuMemGetHandleForAddressRange + ibv_reg_dmabuf_mr),
// through nvidia-peermem (ibv_reg_mr on the device pointer), or not at all ("staged"): the
// sender then copies the region with cudaMemcpy2DAsync into a registered pinned bounce ring and
// writes from there. Staging covers the SENDING side only: a GPU buffer the NIC cannot register
// cannot be written into, and a write to one is refused by name.
//
// Batching. Work requests of one drain batch are queued and posted at the end of the batch, one
// ibv_post_send chain per queue pair (staged copies of the batch are waited for once, before).
// Only the last request of each chain is signaled (and one every depth/2, so the send queue
// never fills with requests whose completion is unknown); the commands' "sent" (done) events
// ride on that one completion, so they are raised once per batch and queue pair, when the NIC
// has finished reading every source of the batch.
#pragma once

#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "cuda_api.h"
#include "verbs_api.h"

namespace mgraph {

// How a registered range is reached by the NIC.
enum class NicMemory : int { kNone = 0, kHost = 1, kDmabuf = 2, kPeermem = 3, kStaged = 4 };
const char* nic_memory_name(NicMemory m);

struct NicRegion {
  uint64_t addr = 0, length = 0;
  uint32_t lkey = 0, rkey = 0;
  NicMemory memory = NicMemory::kNone;
  ibv::mr* mr = nullptr;
};

struct QpAddress {
  uint32_t qp_num = 0, psn = 0;
  uint16_t lid = 0;
  std::string gid;  // 16 raw bytes
};

struct NicStats {
  int64_t post_calls = 0, wrs = 0, imms = 0, signaled = 0, send_completions = 0,
          recv_completions = 0, staged_copies = 0, staged_bytes = 0, stage_waits = 0;
};

class Nic {
 public:
  Nic() = default;
  Nic(const Nic&) = delete;
  Nic& operator=(const Nic&) = delete;
  ~Nic();

  // Set-up (Python thread, before the drain loop starts). Each throws Failure{-1, why}; ``open``
  // prefixes "no RDMA device" when there is none, "libibverbs" when the library is missing.
  void open(const std::vector<std::string>& libs, const std::string& device, int port,
            int gid_index, int depth, int max_peers);
  std::string device_name() const { return device_; }
  void use_cuda(const std::vector<std::string>& runtime_libs,
                const std::vector<std::string>& driver_libs);
  NicRegion register_host(uint64_t addr, uint64_t bytes);
  // ``mode``: auto, dmabuf, peermem or staged (see the top); a mode asked for by name that
  // does not work here is an error naming why.
  NicRegion register_gpu(uint64_t addr, uint64_t bytes, const std::string& mode);
  QpAddress create_qp(int64_t local, int64_t peer);
  void connect(int64_t local, int64_t peer, const QpAddress& theirs);
  bool connected(int64_t local, int64_t peer) const;
  // What this NIC registered covering [p, p + n): its region, or null.
  const NicRegion* find(const void* p, uint64_t n) const;

  // Data path (drain thread only).
  void start(int device);  // the staging stream, on the drain thread's CUDA device
  // Copy a GPU region into the bounce ring (queued on the staging stream); returns its bytes
  // there, dense (``width`` bytes per row). Waits for room, posting what is queued if needed.
  uint8_t* stage(const uint8_t* from, uint64_t spitch, uint64_t width, uint64_t rows,
                 int64_t local, int64_t peer);
  uint32_t stage_lkey() const { return stage_mr_.lkey; }
  // After the requests reading the last staged block were queued: they free it once complete.
  void seal_stage(int64_t local, int64_t peer);
  void queue_write(int64_t local, int64_t peer, uint64_t laddr, uint64_t length, uint32_t lkey,
                   uint64_t raddr, uint32_t rkey, int64_t imm_event);
  void queue_done(int64_t local, int64_t peer, int64_t event);
  void flush();  // post what is queued (after the batch's staged copies completed)
  int poll();    // completions -> arrived / sent events; throws on a failed work request
  void quiesce(double timeout_s, const std::atomic<bool>* abort);  // flush, all sends complete
  // Bounds of every wait for completions (the drain loop's timeout and abort flag).
  double timeout_s = 10;
  const std::atomic<bool>* abort = nullptr;
  // Events to raise, each (rank, event): arrived through immediates, or "sent" completions.
  std::vector<std::pair<int64_t, int64_t>> take_events();
  NicStats stats;
  int64_t max_chain = 0;  // longest ibv_post_send chain

 private:
  struct Pending {
    uint64_t laddr, raddr;
    uint32_t length, lkey, rkey;
    int64_t imm;  // -1: plain RDMA WRITE
  };
  struct Conn {
    int64_t local = 0, peer = 0;
    ibv::qp* qp = nullptr;
    bool ready = false;
    bool broken = false;  // a request failed: the QP is in the error state
    uint64_t posted = 0, completed = 0;  // work requests posted / known complete
    std::vector<Pending> queued;
    std::vector<int64_t> done;  // done events of the queued requests
    std::map<uint64_t, std::vector<int64_t>> done_at;  // signaled seq -> events
  };
  struct Staged {
    size_t conn;
    uint64_t seq;  // the conn's request that reads it: freed once that completed
    uint64_t end;  // ring position after it
  };

  ibv::Api api_;
  CudaApi cuda_;
  std::string device_;
  ibv::context* ctx_ = nullptr;
  ibv::pd* pd_ = nullptr;
  ibv::cq* cq_ = nullptr;
  int port_ = 1, gid_index_ = 0, depth_ = 256, max_peers_ = 8;
  uint16_t lid_ = 0;
  ibv::gid gid_{};
  bool ethernet_ = false;
  int active_mtu_ = ibv::kMtu1024;
  std::vector<NicRegion> regions_;
  std::vector<Conn> conns_;
  std::unordered_map<uint32_t, size_t> by_qp_num_;
  std::unordered_map<size_t, uint32_t> psn_;  // our first packet sequence number, per conn
  std::vector<std::pair<int64_t, int64_t>> events_;
  // Staging: pinned bounce ring (registered), its stream, what in it is still being read.
  void* stage_stream_ = nullptr;
  uint8_t* stage_ = nullptr;
  uint64_t stage_bytes_ = 0, stage_head_ = 0, stage_tail_ = 0;
  NicRegion stage_mr_{};
  std::deque<Staged> staged_;
  bool stage_dirty_ = false;  // copies queued since the last flush
  bool any_staged_ = false;   // a GPU region was left unregistered: the ring is needed

  size_t conn_index(int64_t local, int64_t peer) const;
  void post_recvs(Conn& c, int n);
  void post_chain(size_t index);
  void release_staging();
  void wait_for(const char* what, double timeout_s, const std::atomic<bool>* abort,
                const std::function<bool()>& done);

 public:
  uint64_t staging_bytes = 64ull << 20;  // bounce ring size, fixed at the first GPU registration
};

}  // namespace mgraph
