// The verbs backend: one NIC port and its RC queue pairs; see verbs.h.
#include "verbs.h"

#include <arpa/inet.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <random>
#include <thread>

#include "command.h"

namespace mgraph {

double now_s();  // mover.cpp

namespace {

[[noreturn]] void nic_fail(const std::string& message) { throw Failure{-1, "verbs: " + message}; }

std::string errno_text(int err) { return std::string(std::strerror(err)) + " (errno " +
                                         std::to_string(err) + ")"; }

const char* wc_status_name(int status) {
  switch (status) {
    case 1: return "IBV_WC_LOC_LEN_ERR";
    case 2: return "IBV_WC_LOC_QP_OP_ERR";
    case 4: return "IBV_WC_LOC_PROT_ERR";
    case 5: return "IBV_WC_WR_FLUSH_ERR";
    case 9: return "IBV_WC_REM_INV_REQ_ERR";
    case 10: return "IBV_WC_REM_ACCESS_ERR";
    case 11: return "IBV_WC_REM_OP_ERR";
    case 12: return "IBV_WC_RETRY_EXC_ERR";
    case 13: return "IBV_WC_RNR_RETRY_EXC_ERR";
    default: return "an error status";
  }
}

constexpr int kAccess = ibv::kAccessLocalWrite | ibv::kAccessRemoteWrite;
constexpr int kPortActive = 4;                // IBV_PORT_ACTIVE
constexpr uint64_t kRecvBit = 1ull << 62;     // wr_id of a receive: kRecvBit | connection
constexpr uint64_t kSeqMask = (1ull << 40) - 1;
constexpr uint64_t kUnsealed = ~0ull;         // staged bytes whose reader is not queued yet
constexpr uint64_t kMaxMessage = 1ull << 30;  // one work request moves at most this much

}  // namespace

const char* nic_memory_name(NicMemory m) {
  switch (m) {
    case NicMemory::kHost: return "host";
    case NicMemory::kDmabuf: return "dmabuf";
    case NicMemory::kPeermem: return "peermem";
    case NicMemory::kStaged: return "staged";
    default: return "none";
  }
}

Nic::~Nic() {
  if (!api_.loaded()) return;
  // Reverse order of creation; the process may be exiting, so nothing here throws.
  for (Conn& c : conns_)
    if (c.qp != nullptr) api_.destroy_qp(c.qp);
  for (NicRegion& r : regions_)
    if (r.mr != nullptr) api_.dereg_mr(r.mr);
  if (stage_mr_.mr != nullptr) api_.dereg_mr(stage_mr_.mr);
  if (stage_ != nullptr && cuda_.loaded()) {
    try {
      cuda_.synchronize(stage_stream_);
      cuda_.free_host(stage_);
      cuda_.destroy_stream(stage_stream_);
    } catch (const Failure&) {
    }
  }
  if (cq_ != nullptr) api_.destroy_cq(cq_);
  if (pd_ != nullptr) api_.dealloc_pd(pd_);
  if (ctx_ != nullptr) api_.close_device(ctx_);
}

void Nic::open(const std::vector<std::string>& libs, const std::string& device, int port,
               int gid_index, int depth, int max_peers) {
  if (ctx_ != nullptr) nic_fail("this NIC is already open (" + device_ + ")");
  if (depth < 4 || depth > (1 << 15) || max_peers < 1 || max_peers > 1024)
    nic_fail("depth must be in [4, 32768] and max_peers in [1, 1024], got " + std::to_string(depth) +
         " and " + std::to_string(max_peers));
  const std::string err = api_.load(libs);
  if (!err.empty()) throw Failure{-1, "libibverbs: " + err};
  int n = 0;
  errno = 0;
  void** list = api_.get_device_list(&n);
  if (list == nullptr)
    throw Failure{-1, "no RDMA device: ibv_get_device_list failed: " + errno_text(errno)};
  std::vector<std::string> names;
  void* chosen = nullptr;
  for (int i = 0; i < n; ++i) {
    const char* name = api_.get_device_name(list[i]);
    names.emplace_back(name != nullptr ? name : "?");
    if (chosen == nullptr && (device.empty() || names.back() == device)) {
      chosen = list[i];
      device_ = names.back();
    }
  }
  if (chosen == nullptr) {
    api_.free_device_list(list);
    std::string found;
    for (const auto& name : names) found += (found.empty() ? "" : ", ") + name;
    throw Failure{-1, n == 0 ? "no RDMA device: " + api_.path + " found none"
                             : "no RDMA device named '" + device + "' (found " + found + ")"};
  }
  ctx_ = api_.open_device(chosen);  // before freeing the list, as libibverbs requires
  const int open_errno = errno;
  api_.free_device_list(list);
  if (ctx_ == nullptr) nic_fail("ibv_open_device(" + device_ + ") failed: " + errno_text(open_errno));
  port_ = port;
  gid_index_ = gid_index;
  depth_ = depth;
  max_peers_ = max_peers;
  ibv::port_attr pa;
  std::memset(&pa, 0, sizeof(pa));
  if (api_.query_port(ctx_, static_cast<uint8_t>(port), &pa) != 0)
    nic_fail("ibv_query_port(" + device_ + ", port " + std::to_string(port) + ") failed");
  if (pa.state != kPortActive)
    throw Failure{-1, "no RDMA device: port " + std::to_string(port) + " of " + device_ +
                          " is not active (state " + std::to_string(pa.state) + ")"};
  lid_ = pa.lid;
  ethernet_ = pa.link_layer == ibv::kLinkLayerEthernet;
  active_mtu_ = pa.active_mtu > 0 ? pa.active_mtu : ibv::kMtu1024;
  if (api_.query_gid(ctx_, static_cast<uint8_t>(port), gid_index, &gid_) != 0)
    nic_fail("ibv_query_gid(" + device_ + ", index " + std::to_string(gid_index) + ") failed");
  pd_ = api_.alloc_pd(ctx_);
  if (pd_ == nullptr) nic_fail("ibv_alloc_pd failed: " + errno_text(errno));
  // Per queue pair at most ``depth`` receives and ``depth`` signaled sends are outstanding.
  cq_ = api_.create_cq(ctx_, 2 * depth * max_peers, nullptr, nullptr, 0);
  if (cq_ == nullptr) nic_fail("ibv_create_cq failed: " + errno_text(errno));
}

void Nic::use_cuda(const std::vector<std::string>& runtime_libs,
                   const std::vector<std::string>& driver_libs) {
  const std::string err = cuda_.load(runtime_libs, driver_libs);
  if (!err.empty()) nic_fail(err);
}

NicRegion Nic::register_host(uint64_t addr, uint64_t bytes) {
  if (pd_ == nullptr) nic_fail("register before open");
  ibv::mr* mr = api_.reg_mr(pd_, reinterpret_cast<void*>(addr), bytes, kAccess);
  if (mr == nullptr)
    nic_fail("ibv_reg_mr of " + std::to_string(bytes) + " host bytes failed: " + errno_text(errno));
  regions_.push_back(NicRegion{addr, bytes, mr->lkey, mr->rkey, NicMemory::kHost, mr});
  return regions_.back();
}

NicRegion Nic::register_gpu(uint64_t addr, uint64_t bytes, const std::string& mode) {
  if (pd_ == nullptr) nic_fail("register before open");
  if (mode != "auto" && mode != "dmabuf" && mode != "peermem" && mode != "staged")
    nic_fail("unknown GPU memory mode '" + mode + "' (auto, dmabuf, peermem or staged)");
  std::string why;
  if (mode == "auto" || mode == "dmabuf") {
    if (!api_.has_dmabuf()) {
      why = api_.path + " has no ibv_reg_dmabuf_mr (rdma-core < 34)";
    } else if (!cuda_.has_dmabuf()) {
      why = "the CUDA driver has no cuMemGetHandleForAddressRange (CUDA < 11.7)";
    } else {
      // The handle covers whole pages; the MR starts ``addr - base`` into it.
      const uint64_t page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
      const uint64_t base = addr & ~(page - 1), end = (addr + bytes + page - 1) & ~(page - 1);
      int fd = -1;
      why = cuda_.dmabuf_fd(base, end - base, fd);
      if (fd >= 0) {
        ibv::mr* mr = api_.reg_dmabuf_mr(pd_, addr - base, bytes, addr, fd, kAccess);
        const int reg_errno = errno;
        ::close(fd);  // the MR holds its own reference
        if (mr != nullptr) {
          regions_.push_back(NicRegion{addr, bytes, mr->lkey, mr->rkey, NicMemory::kDmabuf, mr});
          return regions_.back();
        }
        why = "ibv_reg_dmabuf_mr failed: " + errno_text(reg_errno);
      }
    }
    if (mode == "dmabuf") nic_fail("dma-buf registration of GPU memory is not possible here: " + why);
  }
  if (mode == "auto" || mode == "peermem") {
    ibv::mr* mr = api_.reg_mr(pd_, reinterpret_cast<void*>(addr), bytes, kAccess);
    if (mr != nullptr) {
      regions_.push_back(NicRegion{addr, bytes, mr->lkey, mr->rkey, NicMemory::kPeermem, mr});
      return regions_.back();
    }
    const std::string text = "ibv_reg_mr on GPU memory failed (is nvidia-peermem loaded?): " +
                             errno_text(errno);
    if (mode == "peermem") nic_fail(text);
    why += "; " + text;
  }
  any_staged_ = true;
  regions_.push_back(NicRegion{addr, bytes, 0, 0, NicMemory::kStaged, nullptr});
  return regions_.back();
}

const NicRegion* Nic::find(const void* p, uint64_t n) const {
  const auto a = reinterpret_cast<uint64_t>(p);
  for (const NicRegion& r : regions_)
    if (r.addr <= a && a + n <= r.addr + r.length) return &r;
  return nullptr;
}

size_t Nic::conn_index(int64_t local, int64_t peer) const {
  for (size_t i = 0; i < conns_.size(); ++i)
    if (conns_[i].local == local && conns_[i].peer == peer) return i;
  return conns_.size();
}

bool Nic::connected(int64_t local, int64_t peer) const {
  const size_t i = conn_index(local, peer);
  return i < conns_.size() && conns_[i].ready;
}

QpAddress Nic::create_qp(int64_t local, int64_t peer) {
  if (cq_ == nullptr) nic_fail("create_qp before open");
  if (conn_index(local, peer) < conns_.size())
    nic_fail("rank " + std::to_string(local) + " already has a queue pair to rank " +
         std::to_string(peer));
  if (static_cast<int>(conns_.size()) >= max_peers_)
    nic_fail("more than max_peers=" + std::to_string(max_peers_) + " queue pairs on " + device_);
  ibv::qp_init_attr init{};
  init.send_cq = init.recv_cq = cq_;
  init.cap = ibv::qp_cap{static_cast<uint32_t>(depth_), static_cast<uint32_t>(depth_), 1, 1, 0};
  init.qp_type = ibv::kQptRc;
  init.sq_sig_all = 0;  // only the requests marked signaled complete (see verbs.h, Batching)
  ibv::qp* qp = api_.create_qp(pd_, &init);
  if (qp == nullptr) nic_fail("ibv_create_qp failed: " + errno_text(errno));
  ibv::qp_attr attr{};
  attr.qp_state = ibv::kQpsInit;
  attr.pkey_index = 0;
  attr.port_num = static_cast<uint8_t>(port_);
  attr.qp_access_flags = kAccess;
  const int rc = api_.modify_qp(
      qp, &attr, ibv::kQpState | ibv::kQpPkeyIndex | ibv::kQpPort | ibv::kQpAccessFlags);
  if (rc != 0) {
    api_.destroy_qp(qp);
    nic_fail("ibv_modify_qp to INIT failed: " + errno_text(rc));
  }
  Conn c;
  c.local = local;
  c.peer = peer;
  c.qp = qp;
  conns_.push_back(std::move(c));
  by_qp_num_[qp->qp_num] = conns_.size() - 1;
  post_recvs(conns_.back(), depth_);  // every WRITE WITH IMMEDIATE consumes one
  static thread_local std::mt19937 rng{std::random_device{}()};
  QpAddress a;
  a.qp_num = qp->qp_num;
  a.psn = rng() & 0xffffff;
  a.lid = lid_;
  a.gid.assign(reinterpret_cast<const char*>(gid_.raw), sizeof(gid_.raw));
  psn_[conns_.size() - 1] = a.psn;
  return a;
}

void Nic::connect(int64_t local, int64_t peer, const QpAddress& theirs) {
  const size_t i = conn_index(local, peer);
  if (i == conns_.size())
    nic_fail("connect(" + std::to_string(local) + ", " + std::to_string(peer) +
         ") before create_qp");
  Conn& c = conns_[i];
  if (theirs.gid.size() != 16) nic_fail("a GID is 16 bytes, got " + std::to_string(theirs.gid.size()));
  ibv::qp_attr attr{};
  attr.qp_state = ibv::kQpsRtr;
  attr.path_mtu = active_mtu_;
  attr.dest_qp_num = theirs.qp_num;
  attr.rq_psn = theirs.psn;
  attr.max_dest_rd_atomic = 1;
  attr.min_rnr_timer = 12;
  attr.ah.dlid = theirs.lid;
  attr.ah.port_num = static_cast<uint8_t>(port_);
  // RoCE routes by GID (the address handle needs a GRH); InfiniBand inside a subnet by LID.
  attr.ah.is_global = ethernet_ ? 1 : 0;
  if (ethernet_) {
    std::memcpy(attr.ah.grh.dgid.raw, theirs.gid.data(), 16);
    attr.ah.grh.sgid_index = static_cast<uint8_t>(gid_index_);
    attr.ah.grh.hop_limit = 64;
  }
  int rc = api_.modify_qp(c.qp, &attr,
                          ibv::kQpState | ibv::kQpAv | ibv::kQpPathMtu | ibv::kQpDestQpn |
                              ibv::kQpRqPsn | ibv::kQpMaxDestRdAtomic | ibv::kQpMinRnrTimer);
  if (rc != 0) nic_fail("ibv_modify_qp to RTR (towards rank " + std::to_string(peer) + ") failed: " +
                    errno_text(rc));
  attr = ibv::qp_attr{};
  attr.qp_state = ibv::kQpsRts;
  attr.timeout = 14;
  attr.retry_cnt = 7;
  attr.rnr_retry = 7;  // 7: retry forever while the peer has no receive posted
  attr.sq_psn = psn_.at(i);
  attr.max_rd_atomic = 1;
  rc = api_.modify_qp(c.qp, &attr,
                      ibv::kQpState | ibv::kQpTimeout | ibv::kQpRetryCnt | ibv::kQpRnrRetry |
                          ibv::kQpSqPsn | ibv::kQpMaxQpRdAtomic);
  if (rc != 0) nic_fail("ibv_modify_qp to RTS failed: " + errno_text(rc));
  c.ready = true;
}

void Nic::post_recvs(Conn& c, int n) {
  const size_t index = static_cast<size_t>(&c - conns_.data());
  for (int k = 0; k < n; ++k) {
    ibv::recv_wr wr{kRecvBit | index, nullptr, nullptr, 0};  // no bytes: immediates only
    ibv::recv_wr* bad = nullptr;
    const int rc = c.qp->ctx->ops.post_recv(c.qp, &wr, &bad);
    if (rc != 0) nic_fail("ibv_post_recv failed: " + errno_text(rc));
  }
}

void Nic::start(int device) {
  if (!any_staged_ || stage_ != nullptr) return;
  if (!cuda_.loaded()) nic_fail("GPU memory is staged but the NIC loaded no CUDA libraries");
  cuda_.set_device(device);
  stage_stream_ = cuda_.create_stream();
  stage_ = static_cast<uint8_t*>(cuda_.host_alloc(staging_bytes));
  stage_bytes_ = staging_bytes;
  ibv::mr* mr = api_.reg_mr(pd_, stage_, stage_bytes_, kAccess);
  if (mr == nullptr) nic_fail("ibv_reg_mr of the staging ring failed: " + errno_text(errno));
  stage_mr_ = NicRegion{reinterpret_cast<uint64_t>(stage_), stage_bytes_, mr->lkey, mr->rkey,
                        NicMemory::kHost, mr};
}

uint8_t* Nic::stage(const uint8_t* from, uint64_t spitch, uint64_t width, uint64_t rows,
                    int64_t local, int64_t peer) {
  if (stage_ == nullptr) nic_fail("no staging ring (the loop did not start the NIC)");
  const size_t index = conn_index(local, peer);
  const uint64_t n = (width * rows + 63) & ~63ull;  // keep every staged block 64-byte aligned
  if (n > stage_bytes_)
    nic_fail("a staged transfer of " + std::to_string(width * rows) + " bytes is larger than the " +
         "staging ring (" + std::to_string(stage_bytes_) + " bytes): raise staging_bytes");
  uint64_t pos = stage_head_;
  if (pos % stage_bytes_ + n > stage_bytes_) pos += stage_bytes_ - pos % stage_bytes_;
  if (pos + n - stage_tail_ > stage_bytes_) {
    ++stats.stage_waits;
    flush();  // what is queued reads the ring: post it, so its completions can free room
    wait_for("room in the staging ring", timeout_s, abort,
             [&] { return pos + n - stage_tail_ <= stage_bytes_; });
  }
  uint8_t* to = stage_ + pos % stage_bytes_;
  cuda_.copy_2d(to, width, from, spitch, width, rows, stage_stream_);
  stage_dirty_ = true;
  staged_.push_back(Staged{index, kUnsealed, pos + n});
  stage_head_ = pos + n;
  ++stats.staged_copies;
  stats.staged_bytes += static_cast<int64_t>(width * rows);
  return to;
}

void Nic::seal_stage(int64_t local, int64_t peer) {
  const Conn& c = conns_.at(conn_index(local, peer));
  if (!staged_.empty() && staged_.back().seq == kUnsealed)
    staged_.back().seq = c.posted + c.queued.size();  // the last request reading it
}

void Nic::release_staging() {
  while (!staged_.empty() && staged_.front().seq != kUnsealed &&
         conns_[staged_.front().conn].completed >= staged_.front().seq) {
    stage_tail_ = staged_.front().end;
    staged_.pop_front();
  }
  if (staged_.empty()) stage_tail_ = stage_head_;
}

void Nic::queue_write(int64_t local, int64_t peer, uint64_t laddr, uint64_t length,
                      uint32_t lkey, uint64_t raddr, uint32_t rkey, int64_t imm_event) {
  const size_t i = conn_index(local, peer);
  if (i == conns_.size() || !conns_[i].ready)
    nic_fail("rank " + std::to_string(local) + " is not connected to rank " + std::to_string(peer) +
         " (connect both sides before the proxy starts)");
  Conn& c = conns_[i];
  do {  // a message longer than one request allows goes in pieces; the last carries the event
    const uint64_t piece = std::min(length, kMaxMessage);
    length -= piece;
    c.queued.push_back(Pending{laddr, raddr, static_cast<uint32_t>(piece), lkey, rkey,
                               length == 0 ? imm_event : -1});
    laddr += piece;
    raddr += piece;
  } while (length > 0);
}

void Nic::queue_done(int64_t local, int64_t peer, int64_t event) {
  conns_.at(conn_index(local, peer)).done.push_back(event);
}

void Nic::flush() {
  if (stage_dirty_) {  // the batch's staged copies, waited for once
    cuda_.synchronize(stage_stream_);
    stage_dirty_ = false;
  }
  for (size_t i = 0; i < conns_.size(); ++i) {
    Conn& c = conns_[i];
    if (!c.queued.empty()) {
      post_chain(i);
    } else if (!c.done.empty()) {  // nothing in flight to wait for
      for (int64_t e : c.done) events_.emplace_back(c.local, e);
      c.done.clear();
    }
  }
}

void Nic::post_chain(size_t index) {
  Conn& c = conns_[index];
  if (c.broken)
    nic_fail("the queue pair to rank " + std::to_string(c.peer) + " failed earlier");
  const size_t piece = static_cast<size_t>(std::max(1, depth_ / 2));
  std::vector<ibv::send_wr> wrs;
  std::vector<ibv::sge> sges;
  for (size_t p = 0; p < c.queued.size(); p += piece) {
    const size_t k = std::min(piece, c.queued.size() - p);
    if (c.posted + k - c.completed > static_cast<uint64_t>(depth_))
      wait_for("room in the send queue", timeout_s, abort,
               [&] { return c.posted + k - c.completed <= static_cast<uint64_t>(depth_); });
    wrs.assign(k, ibv::send_wr{});
    sges.assign(k, ibv::sge{});
    for (size_t j = 0; j < k; ++j) {
      const Pending& q = c.queued[p + j];
      ibv::send_wr& wr = wrs[j];
      wr.wr_id = (static_cast<uint64_t>(index) << 40) | (c.posted + j + 1);
      wr.next = j + 1 < k ? &wrs[j + 1] : nullptr;
      sges[j] = ibv::sge{q.laddr, q.length, q.lkey};
      wr.sg_list = q.length > 0 ? &sges[j] : nullptr;
      wr.num_sge = q.length > 0 ? 1 : 0;
      wr.opcode = q.imm >= 0 ? ibv::kWrRdmaWriteWithImm : ibv::kWrRdmaWrite;
      wr.imm_data = q.imm >= 0 ? htonl(static_cast<uint32_t>(q.imm)) : 0;
      wr.send_flags = j + 1 == k ? ibv::kSendSignaled : 0;
      wr.rdma.remote_addr = q.raddr;
      wr.rdma.rkey = q.rkey;
      stats.imms += q.imm >= 0;
    }
    ibv::send_wr* bad = nullptr;
    const int rc = c.qp->ctx->ops.post_send(c.qp, wrs.data(), &bad);
    if (rc != 0) {
      // A queue pair that went to the error state refuses posts (EINVAL); the failed completion
      // that put it there is the cause, and it is on the CQ or soon will be: poll() raises it.
      // Report the refusal only when no such completion shows up within 100 ms.
      const double until = now_s() + 0.1;
      while (now_s() < until) {
        if (poll() == 0) std::this_thread::yield();
      }
      nic_fail("ibv_post_send of " + std::to_string(k) + " requests to rank " +
           std::to_string(c.peer) + " failed: " + errno_text(rc));
    }
    c.posted += k;
    ++stats.post_calls;
    ++stats.signaled;
    stats.wrs += static_cast<int64_t>(k);
    max_chain = std::max<int64_t>(max_chain, static_cast<int64_t>(k));
  }
  if (!c.done.empty()) {
    auto& at = c.done_at[c.posted];
    at.insert(at.end(), c.done.begin(), c.done.end());
    c.done.clear();
  }
  c.queued.clear();
}

int Nic::poll() {
  if (cq_ == nullptr) return 0;
  ibv::wc wcs[32];
  const int n = cq_->ctx->ops.poll_cq(cq_, 32, wcs);
  if (n < 0) nic_fail("ibv_poll_cq failed (" + std::to_string(n) + ")");
  for (int k = 0; k < n; ++k) {
    const ibv::wc& wc = wcs[k];
    const bool recv = (wc.wr_id & kRecvBit) != 0;
    const size_t index = recv ? static_cast<size_t>(wc.wr_id & ~kRecvBit)
                              : static_cast<size_t>(wc.wr_id >> 40);
    if (index >= conns_.size()) nic_fail("a completion with unknown wr_id " + std::to_string(wc.wr_id));
    Conn& c = conns_[index];
    if (wc.status != ibv::kWcSuccess) {
      // The queue pair is in the error state: nothing more completes normally on it, so
      // nobody waits for it (quiesce), and nothing more is posted to it.
      c.broken = true;
      c.completed = c.posted;
      nic_fail(std::string(recv ? "a receive from" : "a write to") + " rank " +
           std::to_string(c.peer) + " failed: " + wc_status_name(wc.status) + " (status " +
           std::to_string(wc.status) + ", vendor error " + std::to_string(wc.vendor_err) +
           "); the peer is gone, or a region or key is wrong");
    }
    if (recv) {
      if (wc.opcode != ibv::kWcRecvRdmaWithImm)
        nic_fail("rank " + std::to_string(c.peer) + " sent a message that is not a write with "
             "immediate (opcode " + std::to_string(wc.opcode) + ")");
      events_.emplace_back(c.local, static_cast<int64_t>(ntohl(wc.imm_data)));
      ++stats.recv_completions;
      post_recvs(c, 1);
    } else {
      // RC completes in order: this request and every one before it on the queue pair are done.
      const uint64_t seq = wc.wr_id & kSeqMask;
      c.completed = std::max(c.completed, seq);
      for (auto it = c.done_at.begin(); it != c.done_at.end();) {
        if (it->first > c.completed) {
          ++it;
          continue;
        }
        for (int64_t e : it->second) events_.emplace_back(c.local, e);
        it = c.done_at.erase(it);
      }
      ++stats.send_completions;
    }
  }
  release_staging();
  return n;
}

void Nic::wait_for(const char* what, double limit_s, const std::atomic<bool>* stop,
                   const std::function<bool()>& done) {
  const double deadline = now_s() + limit_s;
  while (!done()) {
    if (poll() > 0) continue;
    if (stop != nullptr && stop->load(std::memory_order_relaxed)) nic_fail("aborted");
    if (now_s() > deadline)
      nic_fail(std::string("waited ") + std::to_string(limit_s) + " s for " + what +
           " (no completion arrived: is the peer's proxy running?)");
    std::this_thread::yield();
  }
}

void Nic::quiesce(double limit_s, const std::atomic<bool>* stop) {
  flush();
  wait_for("the last writes to complete", limit_s, stop, [&] {
    for (const Conn& c : conns_)
      if (c.completed < c.posted) return false;
    return true;
  });
}

std::vector<std::pair<int64_t, int64_t>> Nic::take_events() {
  std::vector<std::pair<int64_t, int64_t>> out;
  out.swap(events_);
  return out;
}

}  // namespace mgraph
