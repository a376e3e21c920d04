// The native drain loop: one std::thread per proxy, never touching Python.
//
// It consumes the CommandFifo's ring exactly as runtime/proxy/fifo.py documents (poll the
// header at ``tail`` with an acquire load, check its sequence, read the body, execute, zero the
// slot, advance ``tail`` with a release store) and executes what it finds the way
// runtime/proxy/proxy.py does: up to ``batch`` commands per round, neighbouring WRITEs that
// continue each other's rectangles the same way in source and destination merged into one
// transfer, every event still raised (a word raised several times in one batch gets one update
// adding the total: mover.h). A command that cannot be executed stops the loop and stays at the
// tail; ``error()`` says which and why.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "command.h"
#include "mover.h"

namespace mgraph {

struct DrainError {
  bool set = false;
  int64_t ticket = -1;
  std::string message;
};

class Drain {
 public:
  Drain(uint64_t ring, uint64_t head, uint64_t tail, int64_t capacity, int batch, bool coalesce,
        double timeout_s);
  ~Drain();
  Drain(const Drain&) = delete;
  Drain& operator=(const Drain&) = delete;

  Mover mover;
  // Longest sleep between empty polls, read when the loop starts. 0: never sleep, only spin and
  // yield (a GPU's proxy, which must see a command within microseconds, at the cost of a core).
  int idle_sleep_us = 200;

  // With the copy kernel (Mover::copy_kernel_bytes) it returns once the loop's CUDA set-up is
  // done (or failed): the kernel's module is loaded before the caller launches spinning kernels.
  void start();
  bool stop(double timeout_s);   // drain what is queued, then end; false if still running
  void abort();                  // end as soon as possible, dropping what is queued
  bool wait(double timeout_s);   // true once the loop has ended
  bool running() const { return started_ && !finished_.load(); }
  bool started() const { return started_; }
  DrainError error() const;

  std::atomic<int64_t> commands{0}, batches{0}, max_batch{0}, coalesced{0};
  // Host time from reading a batch to its end (events raised, copies queued), summed, and the
  // part of it spent waiting for an emulated NIC (Mover::paced_ns): per batch, the proxy's own
  // share of a command's push-to-flag latency.
  std::atomic<int64_t> busy_ns{0};

 private:
  struct Group {
    int first = 0;
    Command cmd;
    Rect src, dst;
    std::vector<int64_t> events, done;
    int count = 1;
  };

  int64_t* ring_;
  int64_t* head_;
  int64_t* tail_;
  int64_t capacity_, mask_;
  int batch_;
  // The previous read filled a whole batch: the next one's commands may have been waiting.
  bool last_full_ = false, backlog_ = false;
  bool coalesce_;
  double timeout_s_;
  std::vector<Command> cmds_;
  std::thread thread_;
  bool started_ = false;
  std::atomic<bool> stopping_{false}, abort_{false}, finished_{false}, ready_{false};
  std::atomic<double> deadline_{0};
  mutable std::mutex mutex_;
  std::condition_variable done_cv_;
  DrainError error_;

  void run();
  int peek();
  void execute(int n);
  void release(int n);
  bool extends(Group& g, const Command& c) const;
  void send(const Group& g);
  void finish(const DrainError& err);
};

}  // namespace mgraph
