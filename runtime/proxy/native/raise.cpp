// Raising events in the native drain loop: host adds, GPU flag words (merged per batch, fused
// per call, or one call per word), host-resident flags waiting for their stream, and each copy
// stream's submission of what it collected (data copies, then staged flag copies). See mover.h
// from "Raising is merged per batch" on; mover.cpp holds the checks and the data paths.
#include "mover.h"

#include <algorithm>
#include <string>
#include <vector>

#include "mover_internal.h"

namespace mgraph {

namespace {

// Adds the CUDA queueing calls made in its scope (and their host time) to the flag counters.
class FlagCalls {
 public:
  FlagCalls(const CudaApi& cuda, MoverStats& stats)
      : cuda_(cuda), stats_(stats), calls_(cuda.calls.load(std::memory_order_relaxed)),
        ns_(cuda.call_ns.load(std::memory_order_relaxed)) {}
  ~FlagCalls() {
    stats_.flag_calls.fetch_add(cuda_.calls.load(std::memory_order_relaxed) - calls_,
                                std::memory_order_relaxed);
    stats_.flag_call_ns.fetch_add(cuda_.call_ns.load(std::memory_order_relaxed) - ns_,
                                  std::memory_order_relaxed);
  }

 private:
  const CudaApi& cuda_;
  MoverStats& stats_;
  int64_t calls_, ns_;
};

}  // namespace

void Mover::defer_raise(int64_t rank, int64_t event, int stream, int index) {
  const RankMemory& m = ranks.at(rank);
  const bool host = m.place == Place::kHost && (m.counters != nullptr || m.host_flags != nullptr);
  const bool gpu = m.place == Place::kCuda && m.shadow != nullptr && cuda.loaded();
  const bool hosted = m.place == Place::kCuda && m.host_flags != nullptr && cuda.loaded();
  if (!host && !gpu && !hosted)
    fail("cannot raise event " + std::to_string(event) + " on rank " + std::to_string(rank) +
         " from here (" + place_name(m.place) + " memory without matching event words)");
  if (hosted && multi())
    fail("rank " + std::to_string(rank) + "'s flag words are in host memory, raised once the "
         "stream has executed the work before them: that needs one copy stream (streams=1)");
  const EventKey key{rank, event};
  if (gpu && multi()) {  // raised with its stream's flags at the end of the batch
    StreamState& st = streams_.at(static_cast<size_t>(stream));
    auto [at, fresh] = st.raise_at.try_emplace(key, st.raises.size());
    if (fresh) {
      st.raises.push_back(StreamRaise{key, 1, index});
    } else {
      st.raises[at->second].count += 1;
    }
    return;
  }
  auto [at, fresh] = pending_at_.try_emplace(key, pending_.size());
  // A word raised again after it went out this batch (not foreseen by begin_batch) starts anew.
  if (!fresh && at->second < emitted_) {
    at->second = pending_.size();
    fresh = true;
  }
  if (fresh) {
    pending_.push_back(PendingRaise{key, 1});
  } else {
    pending_[at->second].count += 1;
  }
}

void Mover::raise_ready(int done_upto) {
  while (emitted_ < pending_.size()) {
    const PendingRaise& p = pending_[emitted_];
    auto last = last_use_.find(p.key);
    if (last != last_use_.end() && last->second > done_upto) break;  // more of it to come
    ++emitted_;  // first: a failing raise is not retried (it would count twice on the GPU)
    emit(p, done_upto);
  }
  flush_single();  // the words due now, in one call
}

void Mover::emit(const PendingRaise& p, int index) {
  const RankMemory& m = ranks.at(p.key.rank);
  if (!fused() || m.place != Place::kCuda || m.host_flags != nullptr) {
    raise_now(p.key, p.count);
    return;
  }
  auto [at, fresh] = single_.raise_at.try_emplace(p.key, single_.raises.size());
  if (fresh) {
    single_.raises.push_back(StreamRaise{p.key, p.count, index});
  } else {
    single_.raises[at->second].count += p.count;
  }
}

void Mover::flush_single() {
  if (fused() && !single_.raises.empty()) flush_raises(single_);
}

void Mover::raise_now(const EventKey& key, int64_t count) {
  RankMemory& m = ranks.at(key.rank);
  if (m.place == Place::kCuda && m.host_flags != nullptr) {  // once the stream got this far
    open_.push_back(PendingRaise{key, count});
    return;
  }
  if (m.place == Place::kHost) {
    // Release: the data written before this add is visible to whoever reads the new count.
    if (m.host_flags != nullptr) {
      __atomic_fetch_add(m.host_flags + key.event, static_cast<int32_t>(count), __ATOMIC_RELEASE);
    } else {
      __atomic_fetch_add(m.counters + key.event, count, __ATOMIC_RELEASE);
    }
    rang_ = true;
  } else {
    // The flag word holds a running count (never reset, so targets are epoch * count); the
    // proxy is its only writer, so it can write the new value instead of adding.
    const int64_t value = __atomic_add_fetch(&m.shadow[key.event], count, __ATOMIC_RELAXED);
    const unsigned long long address = m.flags + 4ull * static_cast<unsigned long long>(key.event);
    const FlagCalls counted(cuda, stats);
    if (!flag_copy) {
      cuda.write_value32(stream_, address, static_cast<unsigned>(value));
    } else {
      // Measured on H200 (benchmarks/NOTES.md): a stream memory write costs ~22 us of stream
      // time while persistent kernels run (its system-wide fence), a 4-byte copy-engine copy
      // ~7 us; the stream orders the copy after the data copy all the same.
      const size_t slot = stage_next_++ & (kStageWords - 1);
      const size_t region = slot / kRegionWords;
      if (slot % kRegionWords == 0 && marked_[region]) cuda.wait_event(marks_[region]);
      stage_[slot] = static_cast<uint32_t>(value);
      cuda.copy(reinterpret_cast<void*>(address), &stage_[slot], sizeof(uint32_t), stream_);
      if (slot % kRegionWords == kRegionWords - 1) {
        cuda.record(marks_[region], stream_);
        marked_[region] = true;
      }
    }
  }
  stats.raises.fetch_add(1, std::memory_order_relaxed);
  stats.events.fetch_add(count, std::memory_order_relaxed);
}

void Mover::close_completions() {
  void* event = nullptr;
  if (free_events_.empty()) {
    event = cuda.create_event();
  } else {
    event = free_events_.back();
    free_events_.pop_back();
  }
  try {
    cuda.record(event, stream_);
  } catch (const Failure&) {
    free_events_.push_back(event);
    throw;
  }
  closed_.push_back(Completion{event, std::move(open_)});
  open_.clear();
}

int Mover::raise_hosted(const std::vector<PendingRaise>& raises) {
  for (const PendingRaise& p : raises) {
    // Release: the host saw the stream complete the data before this store (cf. raise_now).
    __atomic_fetch_add(ranks.at(p.key.rank).host_flags + p.key.event,
                       static_cast<int32_t>(p.count), __ATOMIC_RELEASE);
    stats.raises.fetch_add(1, std::memory_order_relaxed);
    stats.events.fetch_add(p.count, std::memory_order_relaxed);
  }
  return static_cast<int>(raises.size());
}

int Mover::poll_completions() {
  if (!completions_pending()) return 0;
  int n = 0;
  if (cuda.stream_done(stream_)) {  // everything queued so far has executed
    for (const Completion& c : closed_) {
      n += raise_hosted(c.raises);
      free_events_.push_back(c.event);
    }
    closed_.clear();
    n += raise_hosted(open_);
    open_.clear();
    return n;
  }
  while (!closed_.empty() && cuda.event_done(closed_.front().event)) {  // in recording order
    n += raise_hosted(closed_.front().raises);
    free_events_.push_back(closed_.front().event);
    closed_.pop_front();
  }
  return n;
}

std::string Mover::Copy1D::what() const {
  if (rank < 0) return "";
  return "raising flag words " + std::to_string(first) + ".." + std::to_string(last) +
         " of rank " + std::to_string(rank) + ": ";
}

size_t Mover::take_stage(StreamState& st, size_t n) {
  // Runs never straddle a region: one that does not fit closes the region (its event is
  // recorded after the copies already taken from it are queued) and starts the next.
  const size_t off = st.next % kRegionWords;
  if (off != 0 && off + n > kRegionWords) {
    st.to_mark.push_back((st.next % kStageWords) / kRegionWords);
    st.next += kRegionWords - off;
  }
  if (st.next % kRegionWords == 0) {
    const size_t region = (st.next % kStageWords) / kRegionWords;
    // Reused a lap later: its last copies must have read their words (cf. raise_now).
    if (st.marked[region]) cuda.wait_event(st.marks[region]);
  }
  const size_t slot = st.next % kStageWords;
  st.next += n;
  if (st.next % kRegionWords == 0) st.to_mark.push_back(slot / kRegionWords);
  return slot;
}

void Mover::submit(StreamState& st, std::vector<Copy1D>& copies, bool flags) {
  if (!copies.empty()) {
    if (copies.size() > 1 && batch_api()) {
      std::vector<void*> dsts, srcs;
      std::vector<size_t> sizes;
      for (const Copy1D& c : copies) {
        dsts.push_back(c.dst);
        srcs.push_back(const_cast<void*>(c.src));
        sizes.push_back(c.bytes);
      }
      size_t failed = copies.size();
      try {
        cuda.copy_batch(dsts.data(), srcs.data(), sizes.data(), copies.size(), st.stream, failed);
      } catch (const Failure& f) {
        const Copy1D& c = copies[failed < copies.size() ? failed : 0];
        throw Failure{c.index, c.what() + f.message};
      }
      stats.batch_calls.fetch_add(1, std::memory_order_relaxed);
    } else {
      for (const Copy1D& c : copies) {
        try {
          copy_1d(c.dst, c.src, c.bytes, st.stream);
        } catch (const Failure& f) {
          throw Failure{c.index, c.what() + f.message};
        }
      }
    }
    (flags ? stats.flag_copies : stats.data_copies)
        .fetch_add(static_cast<int64_t>(copies.size()), std::memory_order_relaxed);
  }
  copies.clear();
  for (size_t region : st.to_mark) {  // after the copies that read the region
    cuda.record(st.marks[region], st.stream);
    st.marked[region] = true;
  }
  st.to_mark.clear();
}

void Mover::flush_data(StreamState& st) { submit(st, st.data, false); }

void Mover::flush_raises(StreamState& st) {
  if (st.raises.empty()) return;
  const FlagCalls counted(cuda, stats);
  // Scratch kept between calls (its capacity, swapped into st.raises): no allocation per raise
  // on the latency path. Nothing below re-enters flush_raises.
  std::vector<StreamRaise>& raises = flush_raises_;
  raises.clear();
  raises.swap(st.raises);
  st.raise_at.clear();
  std::sort(raises.begin(), raises.end(), [](const StreamRaise& a, const StreamRaise& b) {
    return a.key.rank != b.key.rank ? a.key.rank < b.key.rank : a.key.event < b.key.event;
  });
  if (!flag_copy && fuse_flags) {  // every word in one cuStreamBatchMemOp (per 255)
    std::vector<unsigned long long>& addresses = flush_addresses_;
    std::vector<unsigned>& values = flush_values_;
    addresses.clear();
    values.clear();
    for (const StreamRaise& r : raises) {
      RankMemory& m = ranks.at(r.key.rank);
      const int64_t value = __atomic_add_fetch(&m.shadow[r.key.event], r.count, __ATOMIC_RELAXED);
      addresses.push_back(m.flags + 4ull * static_cast<unsigned long long>(r.key.event));
      values.push_back(static_cast<unsigned>(value));
    }
    size_t failed = raises.size();
    try {
      cuda.write_values32(st.stream, addresses.data(), values.data(), raises.size(), failed,
                          gpu_scope());
    } catch (const Failure& f) {
      const StreamRaise& r = raises[std::min(failed, raises.size() - 1)];
      throw Failure{r.index, "raising flag word " + std::to_string(r.key.event) + " of rank " +
                                 std::to_string(r.key.rank) + ": " + f.message};
    }
    stats.flag_copies.fetch_add(static_cast<int64_t>(raises.size()), std::memory_order_relaxed);
    for (const StreamRaise& r : raises) {
      stats.raises.fetch_add(1, std::memory_order_relaxed);
      stats.events.fetch_add(r.count, std::memory_order_relaxed);
    }
    return;
  }
  std::vector<Copy1D> copies;
  for (size_t i = 0; i < raises.size();) {
    // A run: neighbouring words of one rank's flag array, at most one staging region.
    size_t j = i + 1;
    while (j < raises.size() && raises[j].key.rank == raises[i].key.rank &&
           raises[j].key.event == raises[j - 1].key.event + 1 && j - i < kRegionWords)
      ++j;
    RankMemory& m = ranks.at(raises[i].key.rank);
    int index = raises[i].index;
    for (size_t k = i; k < j; ++k) index = std::min(index, raises[k].index);
    const unsigned long long address =
        m.flags + 4ull * static_cast<unsigned long long>(raises[i].key.event);
    if (flag_copy) {
      // The submission before may have filled regions this run now needs to wait for.
      if (st.to_mark.size() >= kStageWords / kRegionWords / 2) submit(st, copies, true);
      const size_t slot = take_stage(st, j - i);
      for (size_t k = i; k < j; ++k) {
        const int64_t value =
            __atomic_add_fetch(&m.shadow[raises[k].key.event], raises[k].count, __ATOMIC_RELAXED);
        st.stage[slot + (k - i)] = static_cast<uint32_t>(value);
      }
      copies.push_back(Copy1D{reinterpret_cast<void*>(address), &st.stage[slot], 4 * (j - i), index,
                              raises[i].key.rank, raises[i].key.event, raises[j - 1].key.event});
    } else {
      for (size_t k = i; k < j; ++k) {
        const int64_t value =
            __atomic_add_fetch(&m.shadow[raises[k].key.event], raises[k].count, __ATOMIC_RELAXED);
        try {
          cuda.write_value32(st.stream, address + 4ull * (k - i), static_cast<unsigned>(value));
        } catch (const Failure& f) {
          throw Failure{raises[k].index, f.message};
        }
        stats.flag_copies.fetch_add(1, std::memory_order_relaxed);
      }
    }
    for (size_t k = i; k < j; ++k) {
      stats.raises.fetch_add(1, std::memory_order_relaxed);
      stats.events.fetch_add(raises[k].count, std::memory_order_relaxed);
    }
    i = j;
  }
  submit(st, copies, true);
}

}  // namespace mgraph
