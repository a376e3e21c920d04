// The native drain loop; see drain.h.
#include "drain.h"

#include <algorithm>
#include <chrono>
#include <thread>

namespace mgraph {
namespace {

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// Spin briefly (a command usually follows another within microseconds), then sleep in growing
// steps so an idle proxy does not take a core from the runtime's workers. ``max_sleep_us`` 0
// never sleeps: past the spins it only yields, so a GPU's command is seen within microseconds
// (a sleep costs at least the kernel's timer slack, ~50 us) while a runnable thread of the
// runtime still gets the core. sleep_for(0) would be a bare syscall loop, hence the yield.
class Backoff {
 public:
  explicit Backoff(int max_sleep_us) : max_sleep_us_(std::max(max_sleep_us, 0)) {}
  void reset() {
    spins_ = 0;
    sleep_us_ = 1;
  }
  void pause() {
    if (spins_ < 256) {
      ++spins_;
      cpu_relax();
    } else if (spins_ < 272 || max_sleep_us_ == 0) {
      spins_ = std::min(spins_ + 1, 272);
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(sleep_us_));
      sleep_us_ = std::min(sleep_us_ * 2, max_sleep_us_);
    }
  }

 private:
  int max_sleep_us_;
  int spins_ = 0;
  int sleep_us_ = 1;
};

bool continues(const Rect& a, const Rect& b, int& way) {
  if (a.buffer != b.buffer) return false;
  if (a.col0 == b.col0 && a.col1 == b.col1 && a.row1 == b.row0) {
    way = 1;  // next rows of the same columns
    return true;
  }
  if (a.row0 == b.row0 && a.row1 == b.row1 && a.col1 == b.col0) {
    way = 2;  // next columns of the same rows
    return true;
  }
  return false;
}

Rect join(const Rect& a, const Rect& b) {
  return Rect{a.buffer, std::min(a.row0, b.row0), std::max(a.row1, b.row1),
              std::min(a.col0, b.col0), std::max(a.col1, b.col1)};
}

}  // namespace

Drain::Drain(uint64_t ring, uint64_t head, uint64_t tail, int64_t capacity, int batch,
             bool coalesce, double timeout_s)
    : ring_(reinterpret_cast<int64_t*>(ring)),
      head_(reinterpret_cast<int64_t*>(head)),
      tail_(reinterpret_cast<int64_t*>(tail)),
      capacity_(capacity),
      mask_(capacity - 1),
      batch_(static_cast<int>(std::min<int64_t>(batch, capacity))),
      coalesce_(coalesce),
      timeout_s_(timeout_s),
      cmds_(static_cast<size_t>(batch_)) {
  mover.abort = &abort_;
  mover.send_timeout_s = timeout_s;
}

Drain::~Drain() {
  abort();
  if (thread_.joinable()) thread_.join();
}

void Drain::start() {
  started_ = true;
  thread_ = std::thread([this] { run(); });
  if (mover.copy_kernel_bytes <= 0) return;
  std::unique_lock<std::mutex> lock(mutex_);
  done_cv_.wait_for(lock, std::chrono::duration<double>(timeout_s_),
                    [this] { return ready_.load() || finished_.load(); });
}

bool Drain::stop(double timeout_s) {
  deadline_.store(now_s() + timeout_s);
  stopping_.store(true);
  if (!started_) return true;
  if (!wait(timeout_s + 1.0)) return false;
  if (thread_.joinable()) thread_.join();
  return true;
}

void Drain::abort() {
  deadline_.store(now_s());
  stopping_.store(true);
  abort_.store(true);
}

bool Drain::wait(double timeout_s) {
  std::unique_lock<std::mutex> lock(mutex_);
  return done_cv_.wait_for(lock, std::chrono::duration<double>(timeout_s),
                           [this] { return finished_.load(); });
}

DrainError Drain::error() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return error_;
}

void Drain::finish(const DrainError& err) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    error_ = err;
    finished_.store(true);
  }
  done_cv_.notify_all();
}

void Drain::run() {
  DrainError err;
  try {
    mover.start_thread();
    {
      std::lock_guard<std::mutex> lock(mutex_);
      ready_.store(true);
    }
    done_cv_.notify_all();
    Backoff backoff(idle_sleep_us);
    while (!abort_.load(std::memory_order_relaxed)) {
      try {  // arrivals and send completions of the verbs backend, between batches
        if (mover.poll_network() > 0) backoff.reset();
      } catch (const Failure& f) {
        err = {true, -1, f.message};  // no command of ours failed: the network did
        break;
      }
      if (mover.completions_pending()) {  // host-resident flags whose data may be done now
        try {
          if (mover.poll_completions() > 0) backoff.reset();
        } catch (const Failure& f) {
          err = {true, -1, f.message};  // the stream failed; its commands were released
          break;
        }
      }
      int n = 0;
      const double read_at = now_s();
      try {
        n = peek();
        if (n > 0) execute(n);
      } catch (const Failure& f) {
        const int index = f.index < 0 ? 0 : f.index;
        err = {true, cmds_[static_cast<size_t>(index)].ticket, f.message};
        int done = index;
        try {
          mover.end_batch();  // the events of the commands before it
        } catch (const Failure& g) {
          if (g.index < 0) throw;
          done = 0;  // their queued copies or flags failed too (several streams): none is done
          if (g.index < index) err = {true, cmds_[static_cast<size_t>(g.index)].ticket, g.message};
        }
        release(done);  // the commands before it are done; the failing one stays at the tail
        commands.fetch_add(done);
        break;
      }
      if (n > 0) {
        try {
          mover.end_batch();  // events first: a freed slot means its command's events are out
        } catch (const Failure& f) {
          if (f.index < 0) throw;
          // Several streams: a copy or flag queued for the end of the batch failed there. The
          // batch's copies went out together, so none of it is known done: nothing released.
          err = {true, cmds_[static_cast<size_t>(f.index)].ticket, f.message};
          break;
        }
        release(n);
        commands.fetch_add(n);
        busy_ns.fetch_add(static_cast<int64_t>((now_s() - read_at) * 1e9),
                          std::memory_order_relaxed);
        backoff.reset();
        continue;
      }
      if (stopping_.load()) {
        const int64_t tail = __atomic_load_n(tail_, __ATOMIC_RELAXED);
        if (__atomic_load_n(head_, __ATOMIC_ACQUIRE) == tail) break;
        if (now_s() > deadline_.load()) {
          err = {true, tail,
                 "slot " + std::to_string(tail & mask_) +
                     " was claimed but never published (head " +
                     std::to_string(__atomic_load_n(head_, __ATOMIC_RELAXED)) + ", tail " +
                     std::to_string(tail) + ")"};
          break;
        }
      }
      backoff.pause();
    }
    mover.finish();
  } catch (const Failure& f) {
    if (!err.set) err = {true, -1, f.message};
  }
  finish(err);
}

int Drain::peek() {
  const int64_t tail = __atomic_load_n(tail_, __ATOMIC_RELAXED);  // only this thread writes it
  backlog_ = last_full_;
  last_full_ = false;
  int n = 0;
  for (; n < batch_; ++n) {
    const int64_t ticket = tail + n;
    const int64_t* slot = ring_ + (ticket & mask_) * kWords;
    // Acquire pairs with the producer's release store of the header: the body is complete.
    const int64_t header = __atomic_load_n(slot, __ATOMIC_ACQUIRE);
    if (header == 0) break;
    Command c = decode(slot, ticket);
    if (c.seq != ticket + 1) {
      if (n > 0) break;  // execute what came before; the bad slot is reported next round
      cmds_[0] = c;
      throw Failure{0, "slot " + std::to_string(ticket & mask_) + ": header holds sequence " +
                           std::to_string(c.seq) + ", expected " + std::to_string(ticket + 1) +
                           " (a producer wrote a slot it had not claimed)"};
    }
    cmds_[static_cast<size_t>(n)] = c;
  }
  last_full_ = n == batch_;
  if (n > 0) {
    batches.fetch_add(1, std::memory_order_relaxed);
    int64_t best = max_batch.load(std::memory_order_relaxed);
    if (n > best) max_batch.store(n, std::memory_order_relaxed);
  }
  return n;
}

void Drain::release(int n) {
  if (n <= 0) return;
  const int64_t tail = __atomic_load_n(tail_, __ATOMIC_RELAXED);
  for (int i = 0; i < n; ++i) {
    int64_t* slot = ring_ + ((tail + i) & mask_) * kWords;
    for (int w = 1; w < kWords; ++w) slot[w] = 0;
    __atomic_store_n(slot, 0, __ATOMIC_RELAXED);
  }
  // Release: the cleared slots are visible before a producer sees them free.
  __atomic_store_n(tail_, tail + n, __ATOMIC_RELEASE);
}

bool Drain::extends(Group& g, const Command& c) const {
  const Command& first = g.cmd;
  if (!(coalesce_ && c.src_rank == first.src_rank && c.dst_rank == first.dst_rank &&
        c.epoch == first.epoch && mover.stream_index(c.lane) == mover.stream_index(first.lane)))
    return false;  // one copy runs on one stream: its commands' flags must belong to that one
  int src_way = 0, dst_way = 0;
  if (!continues(g.src, c.src, src_way) || !continues(g.dst, c.dst, dst_way)) return false;
  if (src_way != dst_way) return false;
  g.src = join(g.src, c.src);
  g.dst = join(g.dst, c.dst);
  g.count += 1;
  if (c.event >= 0) g.events.push_back(c.event);
  if (c.done_event >= 0) g.done.push_back(c.done_event);
  return true;
}

void Drain::send(const Group& g) {
  try {
    mover.write(g.cmd.src_rank, g.src, g.cmd.dst_rank, g.dst, g.events, g.done, g.cmd.epoch,
                g.cmd.lane, g.first);
    mover.raise_ready(g.first + g.count - 1);  // the group is consecutive commands
  } catch (const Failure& f) {
    throw Failure{g.first, f.message};
  }
  coalesced.fetch_add(g.count - 1, std::memory_order_relaxed);
}

void Drain::execute(int n) {
  mover.begin_batch(cmds_, n, backlog_);
  Group group;
  bool open = false;
  for (int i = 0; i < n; ++i) {
    const Command& c = cmds_[static_cast<size_t>(i)];
    if (c.opcode == kWrite || c.opcode == kSignal) {
      try {
        mover.check_lane(c);
      } catch (const Failure& f) {
        if (open) send(group);
        throw Failure{i, f.message};
      }
    }
    if (c.opcode == kWrite) {
      try {
        mover.check_write(c);
      } catch (const Failure& f) {
        if (open) send(group);  // the commands before the bad one still go out
        throw Failure{i, f.message};
      }
      if (open && extends(group, c)) continue;
    }
    if (open) {
      send(group);
      open = false;
    }
    switch (c.opcode) {
      case kWrite:
        group = Group{i, c, c.src, c.dst, {}, {}, 1};
        if (c.event >= 0) group.events.push_back(c.event);
        if (c.done_event >= 0) group.done.push_back(c.done_event);
        open = true;
        break;
      case kSignal:
        try {
          if (c.event < 0) throw Failure{i, "a SIGNAL needs an event id >= 0"};
          mover.signal(c.src_rank, c.dst_rank, c.event, c.epoch, c.lane, i);
          mover.raise_ready(i);
        } catch (const Failure& f) {
          throw Failure{i, f.message};
        }
        break;
      case kShutdown:
        deadline_.store(now_s() + timeout_s_);
        stopping_.store(true);
        break;
      case kNop:
        break;
      default:
        throw Failure{i, "unknown opcode " + std::to_string(c.opcode)};
    }
  }
  if (open) send(group);
}

}  // namespace mgraph
