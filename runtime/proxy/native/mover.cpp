// The checks and data paths of the native drain loop; see mover.h. Raising the events they
// owe is in raise.cpp.
#include "mover.h"

#include <poll.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <thread>

#include "mover_internal.h"
#include "wire.h"

namespace mgraph {

double now_s() {
  using clock = std::chrono::steady_clock;
  return std::chrono::duration<double>(clock::now().time_since_epoch()).count();
}

[[noreturn]] void fail(const std::string& message) { throw Failure{-1, message}; }

const char* place_name(Place p) {
  switch (p) {
    case Place::kHost: return "host";
    case Place::kCuda: return "cuda";
    case Place::kSocket: return "socket";
    case Place::kVerbs: return "verbs";
    default: return "none";
  }
}

Mover::~Mover() {
  if (stream_ != nullptr && cuda.loaded()) {
    try {
      cuda.synchronize(stream_);
      for (void* e : marks_) cuda.destroy_event(e);
      cuda.free_host(stage_);
      for (void* e : single_.marks) cuda.destroy_event(e);  // single_.stream is stream_
      cuda.free_host(single_.stage);
      for (const Completion& c : closed_) cuda.destroy_event(c.event);
      for (void* e : free_events_) cuda.destroy_event(e);
      stop_kernel();
      cuda.destroy_stream(stream_);
    } catch (const Failure&) {
      // The process may be tearing CUDA down already; nothing useful to report.
    }
  }
  if (!cuda.loaded()) return;
  for (StreamState& st : streams_) {
    try {  // each stream on its own: one that failed must not leak the others
      if (st.stream != nullptr) cuda.synchronize(st.stream);
    } catch (const Failure&) {
    }
    try {
      for (void* e : st.marks) cuda.destroy_event(e);
      cuda.free_host(st.stage);
      cuda.destroy_stream(st.stream);
    } catch (const Failure&) {
    }
  }
}

const Buffer& Mover::check_region(int64_t rank, const Rect& r, const char* role) const {
  auto it = ranks.find(rank);
  if (it == ranks.end() || it->second.place == Place::kNone)
    fail(std::string(role) + ": rank " + std::to_string(rank) + " has no registered memory");
  auto b = it->second.buffers.find(r.buffer);
  if (b == it->second.buffers.end())
    fail(std::string(role) + ": rank " + std::to_string(rank) + " has no buffer " +
         std::to_string(r.buffer));
  const Buffer& buf = b->second;
  if (!(0 <= r.row0 && r.row0 <= r.row1 && r.row1 <= buf.rows && 0 <= r.col0 &&
        r.col0 <= r.col1 && r.col1 <= buf.cols))
    fail(std::string(role) + ": region " + r.str() + " is outside rank " +
         std::to_string(rank) + " buffer " + std::to_string(r.buffer) + " of shape (" +
         std::to_string(buf.rows) + ", " + std::to_string(buf.cols) + ")");
  return buf;
}

void Mover::check_event(int64_t rank, int64_t event, const char* what) const {
  if (event < 0) return;
  auto it = ranks.find(rank);
  const int64_t n = it == ranks.end() ? -1 : it->second.n_events;
  if (n < 0) fail(std::string(what) + " " + std::to_string(event) + " on rank " +
                  std::to_string(rank) + ", which registered no events");
  if (event >= n)
    fail(std::string(what) + " " + std::to_string(event) + " is outside rank " +
         std::to_string(rank) + "'s " + std::to_string(n) + " events");
}

void Mover::check_write(const Command& c) const {
  if (c.src.numel() <= 0 || c.src.row0 > c.src.row1 || c.src.col0 > c.src.col1)
    fail("source region " + c.src.str() + " is empty or inverted");
  if (c.src.rows() != c.dst.rows() || c.src.cols() != c.dst.cols())
    fail("source " + c.src.str() + " and destination " + c.dst.str() + " differ in shape");
  const Buffer& s = check_region(c.src_rank, c.src, "source");
  const Buffer& d = check_region(c.dst_rank, c.dst, "destination");
  const Place sp = ranks.at(c.src_rank).place, dp = ranks.at(c.dst_rank).place;
  if (sp != Place::kHost && sp != Place::kCuda)
    fail("source rank " + std::to_string(c.src_rank) + " is not in this process (" +
         place_name(sp) + ")");
  if (sp == Place::kCuda && !cuda.loaded())
    fail("rank " + std::to_string(c.src_rank) +
         " has CUDA memory but this proxy loaded no CUDA libraries (Drain.use_cuda)");
  if (dp == Place::kVerbs) {
    if (nic == nullptr)
      fail("rank " + std::to_string(c.dst_rank) + " is a verbs peer but no NIC is attached");
    if (!d.writable)
      fail("rank " + std::to_string(c.dst_rank) + " buffer " + std::to_string(c.dst.buffer) +
           " is GPU memory its NIC could not register (no dma-buf, no nvidia-peermem): verbs "
           "cannot write into it; host staging covers only the sending side");
    const int64_t span = (c.src.rows() - 1) * s.row_bytes + c.src.cols() * s.itemsize;
    const NicRegion* r =
        nic->find(s.base + c.src.row0 * s.row_bytes + c.src.col0 * s.itemsize, span);
    if (r == nullptr)
      fail("source " + c.src.str() + " of rank " + std::to_string(c.src_rank) + " is " +
           place_name(sp) + " memory the NIC has not registered");
  } else if ((sp == Place::kCuda) != (dp == Place::kCuda)) {
    fail(std::string("no path from ") + place_name(sp) + " memory to " + place_name(dp) +
         " memory");
  }
  if (s.dtype != d.dtype) fail("source is " + s.dtype + " but destination is " + d.dtype);
  if (c.bytes != c.src.numel() * s.itemsize)
    fail("bytes=" + std::to_string(c.bytes) + " but the (" + std::to_string(c.src.rows()) +
         ", " + std::to_string(c.src.cols()) + ") " + s.dtype + " region holds " +
         std::to_string(c.src.numel() * s.itemsize));
  check_event(c.dst_rank, c.event, "event");
  check_event(c.src_rank, c.done_event, "done event");
}

void Mover::start_thread() {
  if (cuda_device < 0) return;
  cuda.set_device(cuda_device);
  if (nic != nullptr) nic->start(cuda_device);  // its staging ring, if GPU memory is staged
  // Without peer access a copy into another GPU's memory is staged through the host: measured
  // on H200 as ~40 us per copy whatever its size (benchmarks/NOTES.md).
  cuda.enable_peers(cuda_device);
  if (multi()) {
    streams_.resize(static_cast<size_t>(n_streams));  // filled one by one: a failure leaks nothing
    for (StreamState& st : streams_) {
      st.stream = cuda.create_stream();
      if (!flag_copy) continue;
      st.stage = static_cast<uint32_t*>(cuda.host_alloc(kStageWords * sizeof(uint32_t)));
      for (size_t r = 0; r < kStageWords / kRegionWords; ++r) st.marks.push_back(cuda.create_event());
      st.marked.assign(st.marks.size(), false);
    }
    return;
  }
  stream_ = cuda.create_stream();
  start_kernel();
  if (fused()) {
    single_.stream = stream_;
    if (!flag_copy) return;
    single_.stage = static_cast<uint32_t*>(cuda.host_alloc(kStageWords * sizeof(uint32_t)));
    for (size_t r = 0; r < kStageWords / kRegionWords; ++r)
      single_.marks.push_back(cuda.create_event());
    single_.marked.assign(single_.marks.size(), false);
    return;
  }
  if (flag_copy) {
    stage_ = static_cast<uint32_t*>(cuda.host_alloc(kStageWords * sizeof(uint32_t)));
    for (size_t r = 0; r < kStageWords / kRegionWords; ++r) marks_.push_back(cuda.create_event());
    marked_.assign(marks_.size(), false);
  }
}

void Mover::begin_batch(const std::vector<Command>& cmds, int n, bool backlog) {
  // Seen now, unless the ring held a backlog: then they were queued behind the link's previous
  // transfer, which a real NIC (posted to in a microsecond, not in this loop's time per
  // command) would have started back to back.
  if (!backlog || seen_at_ == 0) seen_at_ = now_s();
  if (!open_.empty()) close_completions();  // before this batch queues work behind them
  last_use_.clear();
  for (int i = 0; i < n; ++i) {
    const Command& c = cmds[static_cast<size_t>(i)];
    if (c.opcode != kWrite && c.opcode != kSignal) continue;
    if (c.event >= 0) last_use_[EventKey{c.dst_rank, c.event}] = i;
    if (c.opcode == kWrite && c.done_event >= 0) last_use_[EventKey{c.src_rank, c.done_event}] = i;
  }
}

void Mover::check_lane(const Command& c) {
  if (!multi()) return;
  const int s = stream_index(c.lane);
  auto claim = [&](int64_t rank, int64_t event) {
    if (event < 0) return;
    auto it = ranks.find(rank);
    if (it == ranks.end() || it->second.place != Place::kCuda) return;  // host: atomic adds
    auto [at, fresh] = word_stream_.try_emplace(EventKey{rank, event}, s);
    if (!fresh && at->second != s)
      fail("flag word " + std::to_string(event) + " of rank " + std::to_string(rank) +
           " is raised from copy stream " + std::to_string(at->second) + " and now from stream " +
           std::to_string(s) + " (lane " + std::to_string(c.lane) + " of " +
           std::to_string(n_streams) + " streams): a running count needs ONE writer, so every "
           "command raising a word must carry lanes that map to one stream");
  };
  if (c.opcode == kWrite) {
    claim(c.dst_rank, c.event);
    claim(c.src_rank, c.done_event);
  } else if (c.opcode == kSignal) {
    claim(c.dst_rank, c.event);
  }
}

void Mover::copy_1d(void* dst, const void* src, size_t bytes, void* stream) {
  if (driver_copy && cuda.has_driver_copy()) {
    cuda.copy_driver(dst, src, bytes, stream);
  } else {
    cuda.copy(dst, src, bytes, stream);
  }
}

void Mover::pace(int64_t nbytes) {
  if (bytes_per_s <= 0) return;
  // A NIC starts a transfer once the command is posted and its previous transfer ended, and
  // finishes it nbytes / bandwidth later: the copy is held until then, so the destination sees
  // data no earlier than the emulated link would deliver it. The link's clock runs from when
  // the batch was seen, not from when this loop reached the command: the loop's own cost per
  // command (a copy call, ~10 us on the GPU) must not add to the link's time, or the paced
  // rate falls to nbytes / (nbytes / bandwidth + that cost) (issue 15, 2 H200: 15 GB/s at a
  // 50 GB/s cap with 4 streams and 256 KiB copies, 75 GB/s uncapped).
  const double start = std::max(seen_at_ > 0 ? seen_at_ : now_s(), busy_until_);
  busy_until_ = start + static_cast<double>(nbytes) / bytes_per_s;
  double left = busy_until_ - now_s();
  if (left <= 0) return;  // the loop is behind the link: this copy is due already
  // Several streams: copies collected so far are due; submit them before idling (and, while
  // the wait still hides it, the flags that follow them), instead of at the batch's end.
  if (multi()) flush_early();
  const double waited_from = now_s();
  while ((left = busy_until_ - now_s()) > 0) {
    if (abort != nullptr && abort->load(std::memory_order_relaxed)) fail("aborted");
    if (left > 50e-6) std::this_thread::sleep_for(std::chrono::duration<double>(left - 20e-6));
  }
  stats.paced_ns.fetch_add(static_cast<int64_t>((now_s() - waited_from) * 1e9),
                           std::memory_order_relaxed);
}

void Mover::flush_early() {
  // Data first on every stream (it is due), then flags one stream at a time while the link's
  // transfer has at least kEarlyRaiseS left: idle time only, never the link's.
  for (int pass = 0; pass < 2; ++pass) {
    for (StreamState& st : streams_) {
      if (pass == 1 && (st.raises.empty() || busy_until_ - now_s() < kEarlyRaiseS)) continue;
      try {
        if (pass == 0) {
          flush_data(st);
        } else {
          flush_raises(st);
        }
      } catch (const Failure& f) {  // kept for end_batch (cf. its handling of the same)
        st.data.clear();
        st.raises.clear();
        st.raise_at.clear();
        if (!early_failed_ || f.index < early_failure_.index) early_failure_ = f;
        early_failed_ = true;
      }
    }
  }
}

void Mover::write(int64_t src_rank, const Rect& src, int64_t dst_rank, const Rect& dst,
                  const std::vector<int64_t>& events, const std::vector<int64_t>& done,
                  int64_t epoch, int64_t lane, int index) {
  const Buffer& s = check_region(src_rank, src, "source");
  const Buffer& d = check_region(dst_rank, dst, "destination");
  const int64_t width = src.cols() * s.itemsize, nbytes = width * src.rows();
  const uint8_t* from = s.base + src.row0 * s.row_bytes + src.col0 * s.itemsize;
  RankMemory& dm = ranks.at(dst_rank);
  bool done_raised = false;
  pace(nbytes);
  if (dm.place == Place::kHost) {
    uint8_t* to = d.base + dst.row0 * d.row_bytes + dst.col0 * d.itemsize;
    if (width == s.row_bytes && width == d.row_bytes) {
      std::memmove(to, from, static_cast<size_t>(nbytes));
    } else {
      for (int64_t r = 0; r < src.rows(); ++r)
        std::memmove(to + r * d.row_bytes, from + r * s.row_bytes, static_cast<size_t>(width));
    }
    for (int64_t e : events) defer_raise(dst_rank, e);
  } else if (dm.place == Place::kCuda && multi()) {
    const int si = stream_index(lane);
    StreamState& st = streams_.at(static_cast<size_t>(si));
    uint8_t* to = d.base + dst.row0 * d.row_bytes + dst.col0 * d.itemsize;
    const bool flat = src.rows() == 1 || (width == s.row_bytes && width == d.row_bytes);
    if (flat) {
      // Collected for one submission at the end of the batch (paced: at the next wait, see
      // pace). Copies of one submission run in no promised order, so one that overlaps an
      // earlier destination goes after them.
      const auto lo = reinterpret_cast<uintptr_t>(to), hi = lo + static_cast<uintptr_t>(nbytes);
      for (const Copy1D& c : st.data) {
        const auto clo = reinterpret_cast<uintptr_t>(c.dst);
        if (clo < hi && lo < clo + c.bytes) {
          flush_data(st);
          break;
        }
      }
      st.data.push_back(Copy1D{to, from, static_cast<size_t>(nbytes), index});
    } else {
      // Strided: now, after what the stream already holds.
      flush_data(st);
      cuda.copy_2d(to, static_cast<size_t>(d.row_bytes), from, static_cast<size_t>(s.row_bytes),
                   static_cast<size_t>(width), static_cast<size_t>(src.rows()), st.stream);
      stats.data_copies.fetch_add(1, std::memory_order_relaxed);
    }
    for (int64_t e : events) defer_raise(dst_rank, e, si, index);
    for (int64_t e : done) defer_raise(src_rank, e, si, index);
    done_raised = true;
  } else if (dm.place == Place::kCuda) {
    uint8_t* to = d.base + dst.row0 * d.row_bytes + dst.col0 * d.itemsize;
    if (write_kernel(src_rank, dst_rank, s, d, src, to, from, events, done)) {
      done_raised = true;  // the kernel raised both sides' words
    } else {
      if (src.rows() == 1 || (width == s.row_bytes && width == d.row_bytes)) {
        copy_1d(to, from, static_cast<size_t>(nbytes), stream_);
      } else {
        cuda.copy_2d(to, static_cast<size_t>(d.row_bytes), from, static_cast<size_t>(s.row_bytes),
                     static_cast<size_t>(width), static_cast<size_t>(src.rows()), stream_);
      }
      for (int64_t e : events) defer_raise(dst_rank, e);  // stream order: after the copy
    }
  } else if (dm.place == Place::kSocket) {
    send_frame(src_rank, dst_rank, wire::kWrite, dst, events, epoch, &src);
  } else if (dm.place == Place::kVerbs) {
    write_verbs(src_rank, s, src, dst_rank, d, dst, events, done);
    done_raised = true;
  } else {
    fail("rank " + std::to_string(dst_rank) + " has no registered memory");
  }
  if (!done_raised)
    for (int64_t e : done) defer_raise(src_rank, e);
  stats.writes.fetch_add(1, std::memory_order_relaxed);
  stats.bytes.fetch_add(nbytes, std::memory_order_relaxed);
  auto& sent = sent_to[dst_rank];
  sent.first += nbytes;
  sent.second += 1;
}

void Mover::signal(int64_t src_rank, int64_t dst_rank, int64_t event, int64_t epoch,
                   int64_t lane, int index) {
  auto it = ranks.find(dst_rank);
  if (it == ranks.end() || it->second.place == Place::kNone)
    fail("rank " + std::to_string(dst_rank) + " has no registered memory");
  if (it->second.place == Place::kSocket) {
    send_frame(src_rank, dst_rank, wire::kSignal, Rect{}, {event}, epoch, nullptr);
  } else if (it->second.place == Place::kVerbs) {
    check_event(dst_rank, event, "event");
    if (nic == nullptr)
      fail("rank " + std::to_string(dst_rank) + " is a verbs peer but no NIC is attached");
    // Zero bytes: the address and key are not used, only the immediate.
    nic->queue_write(src_rank, dst_rank, 0, 0, 0, 0, 0, event);
  } else {
    check_event(dst_rank, event, "event");
    defer_raise(dst_rank, event, multi() ? stream_index(lane) : 0, index);
  }
  stats.signals.fetch_add(1, std::memory_order_relaxed);
}

void Mover::send_frame(int64_t src_rank, int64_t dst_rank, int kind, const Rect& dst,
                       const std::vector<int64_t>& events, int64_t epoch, const Rect* src) {
  const int fd = ranks.at(dst_rank).fd;
  const Buffer* s = src ? &ranks.at(src_rank).buffers.at(src->buffer) : nullptr;
  const int64_t width = src ? src->cols() * s->itemsize : 0;
  const int64_t nbytes = src ? width * src->rows() : 0;
  // Events beyond one frame's limit go as extra SIGNAL frames, after the data.
  const size_t first = std::min<size_t>(events.size(), wire::kMaxEvents);
  std::vector<int64_t> head(wire::kHeaderWords + first);
  head[0] = wire::word0(kind, static_cast<int>(first));
  head[1] = epoch;
  head[2] = src_rank;
  head[3] = dst_rank;
  head[4] = dst.buffer;
  head[5] = (dst.row0 << 32) | dst.row1;
  head[6] = (dst.col0 << 32) | dst.col1;
  head[7] = nbytes;
  std::copy(events.begin(), events.begin() + static_cast<long>(first), head.begin() + 8);
  std::vector<iovec> iov;
  iov.push_back({head.data(), head.size() * sizeof(int64_t)});
  if (src != nullptr) {
    const uint8_t* from = s->base + src->row0 * s->row_bytes + src->col0 * s->itemsize;
    if (width == s->row_bytes) {
      iov.push_back({const_cast<uint8_t*>(from), static_cast<size_t>(nbytes)});
    } else {
      for (int64_t r = 0; r < src->rows(); ++r)
        iov.push_back({const_cast<uint8_t*>(from + r * s->row_bytes), static_cast<size_t>(width)});
    }
  }
  size_t at = 0;  // first iovec not fully sent
  const double deadline = now_s() + send_timeout_s;
  while (at < iov.size()) {
    msghdr msg{};
    msg.msg_iov = &iov[at];
    msg.msg_iovlen = std::min<size_t>(iov.size() - at, 1024);  // IOV_MAX
    const ssize_t sent = sendmsg(fd, &msg, MSG_NOSIGNAL);
    if (sent < 0) {
      if (errno == EINTR) continue;
      if (errno != EAGAIN && errno != EWOULDBLOCK)
        fail("tcp: send to rank " + std::to_string(dst_rank) + " failed: " + std::strerror(errno) +
             " (the peer disconnected)");
      if (abort != nullptr && abort->load(std::memory_order_relaxed)) fail("aborted");
      if (now_s() > deadline)
        fail("tcp: rank " + std::to_string(dst_rank) + " accepted no data for " +
             std::to_string(send_timeout_s) + " s");
      pollfd p{fd, POLLOUT, 0};
      poll(&p, 1, 100);
      continue;
    }
    size_t left = static_cast<size_t>(sent);
    while (at < iov.size() && left >= iov[at].iov_len) left -= iov[at++].iov_len;
    if (left > 0) {
      iov[at].iov_base = static_cast<uint8_t*>(iov[at].iov_base) + left;
      iov[at].iov_len -= left;
    }
  }
  for (size_t i = first; i < events.size(); ++i)
    send_frame(src_rank, dst_rank, wire::kSignal, Rect{}, {events[i]}, epoch, nullptr);
}

void Mover::write_verbs(int64_t src_rank, const Buffer& s, const Rect& src, int64_t dst_rank,
                        const Buffer& d, const Rect& dst, const std::vector<int64_t>& events,
                        const std::vector<int64_t>& done) {
  const int64_t width = src.cols() * s.itemsize, rows = src.rows();
  const uint8_t* from = s.base + src.row0 * s.row_bytes + src.col0 * s.itemsize;
  const NicRegion* reg = nic->find(from, static_cast<uint64_t>((rows - 1) * s.row_bytes + width));
  uint64_t pitch = static_cast<uint64_t>(s.row_bytes);
  uint32_t lkey = 0;
  const bool staged = reg->memory == NicMemory::kStaged;  // check_write found the region
  if (staged) {  // GPU memory the NIC cannot read: through the bounce ring, dense
    from = nic->stage(from, pitch, static_cast<uint64_t>(width), static_cast<uint64_t>(rows),
                      src_rank, dst_rank);
    pitch = static_cast<uint64_t>(width);
    lkey = nic->stage_lkey();
  } else {
    lkey = reg->lkey;
  }
  const uint64_t raddr = reinterpret_cast<uint64_t>(d.base) +
                         static_cast<uint64_t>(dst.row0 * d.row_bytes + dst.col0 * d.itemsize);
  const int64_t first = events.empty() ? -1 : events[0];
  const auto laddr = reinterpret_cast<uint64_t>(from);
  if (rows == 1 || (static_cast<uint64_t>(width) == pitch && width == d.row_bytes)) {
    nic->queue_write(src_rank, dst_rank, laddr, static_cast<uint64_t>(width * rows), lkey, raddr,
                     d.rkey, first);
  } else {
    for (int64_t r = 0; r < rows; ++r)
      nic->queue_write(src_rank, dst_rank, laddr + static_cast<uint64_t>(r) * pitch,
                       static_cast<uint64_t>(width), lkey,
                       raddr + static_cast<uint64_t>(r * d.row_bytes), d.rkey,
                       r + 1 == rows ? first : -1);
  }
  for (size_t i = 1; i < events.size(); ++i)  // zero-length writes, each with one event
    nic->queue_write(src_rank, dst_rank, 0, 0, 0, 0, 0, events[i]);
  if (staged) nic->seal_stage(src_rank, dst_rank);
  for (int64_t e : done) nic->queue_done(src_rank, dst_rank, e);
}

int Mover::poll_network() {
  if (nic == nullptr) return 0;
  const int n = nic->poll();
  const auto events = nic->take_events();
  if (events.empty()) return n;
  for (const auto& [rank, event] : events) {
    check_event(rank, event, "event arriving over verbs,");
    defer_raise(rank, event);  // stream 0 with several streams: this proxy is the word's writer
  }
  end_batch();  // raises them (host adds, or GPU flag writes on this proxy's stream)
  return n;
}

void Mover::end_batch() {
  // The batch's verbs requests go out first, one chain per queue pair.
  if (nic != nullptr) nic->flush();
  // Normally raise_ready already raised everything; after a failure, the raises of the commands
  // that did execute are still owed. Cleared first so a failing raise leaves no stale batch.
  std::vector<PendingRaise> left(pending_.begin() + static_cast<long>(emitted_), pending_.end());
  pending_.clear();
  pending_at_.clear();
  emitted_ = 0;
  for (const PendingRaise& p : left) emit(p, -1);
  flush_single();
  if (multi()) {
    // Every stream, even after one failed (commands before the failing one are reported done);
    // the failure of the earliest command is the one thrown.
    bool failed = early_failed_;
    Failure first = early_failure_;
    early_failed_ = false;
    for (StreamState& st : streams_) {
      try {
        flush_data(st);
        flush_raises(st);
      } catch (const Failure& f) {
        st.data.clear();
        st.raises.clear();
        st.raise_at.clear();
        if (!failed || f.index < first.index) first = f;
        failed = true;
      }
    }
    if (failed) throw first;
  }
  if (!rang_ || doorbell_fd < 0) return;
  rang_ = false;
  const uint64_t one = 1;
  // eventfd: adds one; a full pipe (EAGAIN) already guarantees the reader wakes up.
  ssize_t ignored = ::write(doorbell_fd, &one, sizeof(one));
  (void)ignored;
}

void Mover::finish() {
  if (nic != nullptr) {  // every write of ours read its source, every "sent" event raised
    nic->quiesce(send_timeout_s, abort);
    poll_network();
  }
  if (stream_ != nullptr) cuda.synchronize(stream_);
  for (StreamState& st : streams_)
    if (st.stream != nullptr) cuda.synchronize(st.stream);
  if (completions_pending()) poll_completions();  // all executed: every host-resident word
}

}  // namespace mgraph
