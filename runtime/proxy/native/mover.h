// Registered memory and the three native data paths of the drain loop.
//
// A ``Mover`` knows, for every rank a proxy can reach, where that rank's memory is seen from
// this process and how its events are raised:
//   host   - CPU memory in this process: memmove, events are atomic adds on an int64 counter
//            array the runtime reads (the reference runtime's Counters), or on int32 "net flag
//            words" (a Triton-interpreted megakernel's flag arrays);
//   cuda   - GPU memory (own or CUDA-IPC-mapped peer): cudaMemcpy2DAsync on the proxy's stream,
//            events are cuStreamWriteValue32 stores of a running count (no SM involved);
//   socket - a peer process reached over a connected TCP socket: one frame per write (header,
//            event ids, payload; runtime/proxy/tcp.py receives it), shapes only are known here;
//   verbs  - a peer rank reached over an RDMA queue pair (verbs.h): RDMA WRITE WITH IMMEDIATE
//            into its registered buffers, whose addresses and rkeys are known here; its proxy
//            raises the events when the immediates arrive (poll_network on its side).
// Every region is bounds-checked against the registered shape before a byte moves, so a bad
// command is rejected instead of writing outside a buffer.
//
// Raising is merged per batch: a word that several commands of one batch raise (coalesced
// tiles, or chunks of one tile that each count on the same word) gets ONE update adding the
// total, because on the GPU each update is a cuStreamWriteValue32 driver call. A word is raised
// as soon as the last command of the batch that raises it has executed (its data is in place or,
// for cuda, ahead of the update in stream order), and words are raised in the order their first
// raise appeared, so "seeing word B means an earlier-raised word A is visible" still holds. In a
// batch where no word repeats, every word goes out exactly when it did before merging existed.
//
// Several streams (``n_streams`` > 1, Settings.proxy_streams). A command runs on copy stream
// ``lane mod n_streams`` (command word LANE). The streams run concurrently and in no order
// relative to each other, so a flag word raised from two of them could go backwards: the first
// command raising a word binds it to its stream, and a command raising it from another stream
// is refused by name (check_lane; runtime/megakernel/netplan.py gives every word one lane). Per
// stream and per batch: contiguous data copies are collected and go out together
// (cudaMemcpyBatchAsync where the runtime has it, else one cudaMemcpyAsync each; strided ones
// one cudaMemcpy2DAsync each, in order), then the batch's flag words of that stream, raised
// together: each word once with the batch's total, words that are neighbours in one rank's flag
// array in ONE staged copy. So a stream's flags always follow all of its data of the batch
// (stream order: data before flags, the property every waiter rests on), while flags of one
// batch go out in no particular order among themselves. Paced (``bytes_per_s``), what was
// collected also goes out whenever the loop is about to wait for the emulated link, data first,
// then the flags of as many streams as the wait leaves time for (see pace): the same order per
// stream, a word raised more than once per batch. With one stream the single-stream path above
// is kept exactly (words raised as soon as their last command executed).
//
// CUDA calls per command (``fuse_flags``, the default). The stream orders a command's flags after
// its data, so a WRITE needs its data copy and, after it, its flags; every word that becomes due
// at one point (the words of one command, or of a coalesced group) goes out in ONE call: with
// cuStreamWriteValue32 flags one cuStreamBatchMemOp of up to 255 stores (each after its memory
// barrier, in array order), with copy-engine flags one staged copy per run of neighbouring words
// and, for several runs, one cudaMemcpyBatchAsync where the runtime has it. So a WRITE raising a
// destination word and a done word is 2 calls (it was 3: one per word), a SIGNAL 1, a coalesced
// group of k WRITEs 2 (a word that a later command of the batch raises again waits for that
// one, as before). With several streams, a stream's words of a batch likewise go out in one
// cuStreamBatchMemOp (memop flags). Words that become due together go out in no promised
// order among themselves (sorted by rank and word), as with several streams; a word due later
// still goes out after them. ``fuse_flags`` false keeps one call per word, in first-raise order.
// ``gpu_fence`` (with fused cuStreamWriteValue32 flags, and only where ``local_memory``): a call's
// stores follow ONE GPU-scope barrier instead of each a system-wide one; a flag's reader on
// this GPU still sees the data first, and none is elsewhere. It changes what the GPU executes,
// not the number of calls.
//
// Host-resident flags (a CUDA rank whose flag words are in pinned host memory, which its GPU
// polls with sys-scope loads; one stream only). No flag call at all: a WRITE is its data copy,
// and its words are raised by the loop itself, with host release stores, once cudaStreamQuery
// says the stream has executed everything queued (the data included); between batches the loop
// polls for that. If a new batch arrives while such words still wait, one event is recorded
// behind them first (cudaEventRecord, counted as a call), so a stream kept busy by later work
// cannot hold them back: they go out when that event completes. So a WRITE in flight alone
// (the latency bench) is 1 CUDA call, and a SIGNAL 0.
#pragma once

#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "command.h"
#include "cuda_api.h"
#include "verbs.h"

namespace mgraph {

enum class Place : int { kNone = 0, kHost = 1, kCuda = 2, kSocket = 3, kVerbs = 4 };

struct Buffer {
  uint8_t* base = nullptr;  // null for a socket peer's buffer: its shape is all we know
  int64_t rows = 0, cols = 0, row_bytes = 0, itemsize = 0;
  std::string dtype;
  // verbs peer: ``base`` is the peer's address, ``rkey`` its key; ``writable`` false for GPU
  // memory its NIC could not register (staged: it can send from it, nobody can write into it).
  uint32_t rkey = 0;
  bool writable = true;
};

struct RankMemory {
  Place place = Place::kNone;
  std::unordered_map<int64_t, Buffer> buffers;
  int64_t n_events = -1;        // -1: events not registered
  int64_t* counters = nullptr;  // host: int64 event words
  // host: int32 net flag words (used instead of counters); cuda: the rank's flag words live in
  // pinned host memory (set_cuda_host_flags), raised by the loop once the stream completed the
  // work before them (see "Host-resident flags" above)
  int32_t* host_flags = nullptr;
  unsigned long long flags = 0; // cuda: device address of uint32 flag words
  int64_t* shadow = nullptr;    // cuda: host copy of each flag word (one writer per word)
  int fd = -1;                  // socket
  int device = -1;              // cuda
};

struct MoverStats {
  // events: raises commands asked for on this process's ranks; raises: word updates made for
  // them after merging repeats within a batch (raises <= events).
  std::atomic<int64_t> writes{0}, signals{0}, bytes{0}, events{0}, raises{0};
  // Several streams only: copy operations queued for data and for flags (a staged run of
  // neighbouring words is one), and cudaMemcpyBatchAsync calls (each counts its copies above).
  std::atomic<int64_t> data_copies{0}, flag_copies{0}, batch_calls{0};
  // Host time pace() held commands for the emulated NIC.
  std::atomic<int64_t> paced_ns{0};
  // Of CudaApi's queueing calls (calls, call_ns), those that raised GPU flags: the rest queued
  // data, so a command's host time splits into its data call and its flag call.
  std::atomic<int64_t> flag_calls{0}, flag_call_ns{0};
  // WRITEs that went out as one copy-and-flag kernel launch (copy_kernel.h).
  std::atomic<int64_t> kernel_writes{0};
};

struct EventKey {
  int64_t rank, event;
  bool operator==(const EventKey& o) const { return rank == o.rank && event == o.event; }
};

struct EventKeyHash {
  size_t operator()(const EventKey& k) const {
    const uint64_t mixed = static_cast<uint64_t>(k.rank) * 0x9E3779B97F4A7C15ull;  // unsigned: wraps
    return std::hash<uint64_t>()(mixed ^ static_cast<uint64_t>(k.event));
  }
};

class Mover {
 public:
  std::unordered_map<int64_t, RankMemory> ranks;
  CudaApi cuda;
  int cuda_device = -1;
  double bytes_per_s = 0;       // > 0: pace writes like a NIC of that bandwidth
  double send_timeout_s = 10;   // a socket that accepts nothing for this long is an error
  int doorbell_fd = -1;         // written after a batch that raised host events
  // cuda flags: false writes each new count with cuStreamWriteValue32 (a stream memory op with
  // a system-wide fence); true copies it with the copy engine from a pinned staging word,
  // ordered after the data copy by the stream (see raise_now for why both exist).
  bool flag_copy = false;
  const std::atomic<bool>* abort = nullptr;
  // Copy streams (fixed once the loop starts); 1 keeps the single-stream path.
  int n_streams = 1;
  // Fused flags (fixed once the loop starts; see "CUDA calls per command" above): the GPU words
  // that become due together go out in ONE call; false is the protocol before it, one call
  // per word (kept to measure against: bench_proxy --protocols).
  bool fuse_flags = true;
  // 1-D data copies through the driver's cuMemcpyAsync instead of cudaMemcpyAsync, where the
  // driver has it (fixed once the loop starts).
  bool driver_copy = false;
  // Fused cuStreamWriteValue32 flags: ONE GPU-scope memory barrier per call in place of each
  // store's system-wide one, when ``local_memory`` (the transport found every buffer and flag
  // word this loop reaches on the proxy's own GPU, so every reader of a flag is on that GPU).
  bool gpu_fence = false;
  bool local_memory = false;
  bool gpu_scope() const { return gpu_fence && local_memory && cuda.has_memop_barrier(); }
  // > 0: WRITEs of at most this many bytes go out as one copy-and-flag kernel launch (fixed once
  // the loop starts; one stream only; see "Copy kernel" above).
  int64_t copy_kernel_bytes = 0;
  bool allow_batch = true;  // use cudaMemcpyBatchAsync for several flag copies where it exists
  bool multi() const { return n_streams > 1; }
  bool fused() const { return fuse_flags && !multi(); }
  bool batch_api() const { return (multi() || fuse_flags) && allow_batch && cuda.has_batch(); }
  int stream_index(int64_t lane) const {
    return static_cast<int>(static_cast<uint64_t>(lane) % static_cast<uint64_t>(n_streams));
  }
  MoverStats stats;
  // By destination rank: (bytes, writes), for the transport's per-link counters.
  std::unordered_map<int64_t, std::pair<int64_t, int64_t>> sent_to;

  std::shared_ptr<Nic> nic;     // the verbs backend, when a verbs transport attached one

  RankMemory& rank(int64_t r) { return ranks[r]; }
  // Completions of the verbs backend: raises the events that arrived and the "sent" events of
  // finished batches; returns how many completions it saw (0 without a NIC).
  int poll_network();
  const Buffer& check_region(int64_t rank, const Rect& rect, const char* role) const;
  void check_write(const Command& c) const;
  void check_event(int64_t rank, int64_t event, const char* what) const;
  // Several streams: the GPU words ``c`` raises are bound to its stream (see the top).
  void check_lane(const Command& c);

  // The batch's commands ``cmds[0..n)``, before any executes: where each word is last raised.
  // ``backlog``: the read before this one filled a whole batch, so these commands may have
  // been waiting in the ring while the previous batch executed (see pace).
  void begin_batch(const std::vector<Command>& cmds, int n, bool backlog = false);
  // ``lane`` picks the stream; ``index`` (the command's place in the batch) names it when a
  // copy or flag queued for the end of the batch fails there.
  void write(int64_t src_rank, const Rect& src, int64_t dst_rank, const Rect& dst,
             const std::vector<int64_t>& events, const std::vector<int64_t>& done, int64_t epoch,
             int64_t lane = 0, int index = 0);
  void signal(int64_t src_rank, int64_t dst_rank, int64_t event, int64_t epoch, int64_t lane = 0,
              int index = 0);
  // Host-resident flags: raise the words whose data the stream has executed; returns how many
  // (polls cudaStreamQuery / cudaEventQuery; throws if the stream failed).
  int poll_completions();
  bool completions_pending() const { return !open_.empty() || !closed_.empty(); }
  // Commands up to index ``done_upto`` of the batch have executed: raise what is complete.
  void raise_ready(int done_upto);
  void start_thread();   // in the drain thread: CUDA device and stream
  // Raise what is left (a failed batch), ring the doorbell if host rang; several streams: flush
  // every stream's copies and flags (throws Failure{index of the command} if one fails).
  void end_batch();
  void finish();         // wait for queued GPU work
  ~Mover();

 private:
  struct PendingRaise {
    EventKey key;
    int64_t count;
  };

  void* stream_ = nullptr;
  // The copy-and-flag kernel (copy_kernel.cpp), loaded by start_kernel when enabled.
  void* kernel_module_ = nullptr;
  void* kernel_ = nullptr;
  void start_kernel();
  void stop_kernel();
  [[noreturn]] void fail_kernel(const std::string& why) const;
  // The WRITE as one kernel launch; false (nothing done) when it does not qualify.
  bool write_kernel(int64_t src_rank, int64_t dst_rank, const Buffer& s, const Buffer& d,
                    const Rect& src, uint8_t* to, const uint8_t* from,
                    const std::vector<int64_t>& events, const std::vector<int64_t>& done);
  // Host-resident flags waiting for the stream: ``open_`` behind everything queued so far,
  // ``closed_`` each behind an event recorded before later work (oldest first); events reused.
  struct Completion {
    void* event;
    std::vector<PendingRaise> raises;
  };
  std::vector<PendingRaise> open_;
  std::deque<Completion> closed_;
  std::vector<void*> free_events_;
  void close_completions();
  int raise_hosted(const std::vector<PendingRaise>& raises);
  // flag_copy: a ring of pinned staging words; a word is reused only after the event recorded
  // behind its region's last copy (one lap ago) completed, so no copy reads a newer count.
  static constexpr size_t kStageWords = 1 << 16, kRegionWords = 1 << 10;
  // Several streams, paced: while at least this much of a wait is left, the flags collected so
  // far are raised early, one stream at a time (a copy call costs ~10 us of host time).
  static constexpr double kEarlyRaiseS = 10e-6;
  uint32_t* stage_ = nullptr;
  size_t stage_next_ = 0;
  std::vector<void*> marks_;
  std::vector<bool> marked_;
  bool rang_ = false;
  // The emulated NIC (pace): when its current transfer ends, and since when the commands of
  // this batch are known to be waiting for it.
  double busy_until_ = 0;
  double seen_at_ = 0;
  // Several streams: a failure of copies or flags submitted early (while pacing waited),
  // thrown by end_batch like its own (the drain reports the command and releases nothing).
  bool early_failed_ = false;
  Failure early_failure_{0, ""};
  // This batch's raises, in the order each word was first raised; [0, emitted_) are done.
  std::vector<PendingRaise> pending_;
  size_t emitted_ = 0;
  std::unordered_map<EventKey, size_t, EventKeyHash> pending_at_;  // word -> index in pending_
  std::unordered_map<EventKey, int, EventKeyHash> last_use_;       // word -> last command index

  // One copy stream of the several-streams path and what this batch queued on it.
  struct Copy1D {
    void* dst;
    const void* src;
    size_t bytes;
    int index;  // command (batch index) named if it fails
    // Flags: which words (rank, first, last), named only if the copy fails: building the
    // text on every raise would cost the latency path a few hundred ns.
    int64_t rank = -1, first = 0, last = 0;
    std::string what() const;
  };
  struct StreamRaise {
    EventKey key;
    int64_t count;
    int index;
  };
  struct StreamState {
    void* stream = nullptr;
    uint32_t* stage = nullptr;  // flag_copy: this stream's ring of staging words
    size_t next = 0;
    std::vector<void*> marks;
    std::vector<bool> marked;
    std::vector<size_t> to_mark;  // regions filled: record their event after the next submit
    std::vector<Copy1D> data;     // contiguous data copies of this batch, not yet queued
    std::vector<StreamRaise> raises;
    std::unordered_map<EventKey, size_t, EventKeyHash> raise_at;
  };
  std::vector<StreamState> streams_;
  // One stream, fused flags: the words due at one point, raised by flush_raises on stream_
  // (``stream`` is stream_; its own staging ring with copy-engine flags).
  StreamState single_;
  std::unordered_map<EventKey, int, EventKeyHash> word_stream_;  // GPU word -> its stream
  // flush_raises' scratch (kept for its capacity).
  std::vector<StreamRaise> flush_raises_;
  std::vector<unsigned long long> flush_addresses_;
  std::vector<unsigned> flush_values_;

  void defer_raise(int64_t rank, int64_t event, int stream = 0, int index = 0);
  size_t take_stage(StreamState& st, size_t n);
  void submit(StreamState& st, std::vector<Copy1D>& copies, bool flags);
  void flush_data(StreamState& st);
  void flush_raises(StreamState& st);
  void raise_now(const EventKey& key, int64_t count);
  // A due raise: raised now, or (one stream, fused, GPU word) collected for flush_single.
  void emit(const PendingRaise& p, int index);
  void flush_single();
  // A 1-D copy on ``stream``: cudaMemcpyAsync, or cuMemcpyAsync with driver_copy.
  void copy_1d(void* dst, const void* src, size_t bytes, void* stream);
  void pace(int64_t nbytes);
  void flush_early();
  void write_verbs(int64_t src_rank, const Buffer& s, const Rect& src, int64_t dst_rank,
                   const Buffer& d, const Rect& dst, const std::vector<int64_t>& events,
                   const std::vector<int64_t>& done);
  void send_frame(int64_t src_rank, int64_t dst_rank, int kind, const Rect& dst,
                  const std::vector<int64_t>& events, int64_t epoch, const Rect* src);
};

double now_s();

}  // namespace mgraph
