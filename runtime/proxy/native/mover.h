// Registered memory and the three native data paths of the drain loop.
//
// A ``Mover`` knows, for every rank a proxy can reach, where that rank's memory is seen from
// this process and how its events are raised:
//   host   - CPU memory in this process: memmove, events are atomic adds on an int64 counter
//            array the runtime reads (the reference runtime's Counters);
//   cuda   - GPU memory (own or CUDA-IPC-mapped peer): cudaMemcpy2DAsync on the proxy's stream,
//            events are cuStreamWriteValue32 stores of a running count (no SM involved);
//   socket - a peer process reached over a connected TCP socket: one frame per write (header,
//            event ids, payload; runtime/proxy/tcp.py receives it), shapes only are known here.
// Every region is bounds-checked against the registered shape before a byte moves, so a bad
// command is rejected instead of writing outside a buffer.
#pragma once

#include <atomic>
#include <cstdint>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "command.h"
#include "cuda_api.h"

namespace mgraph {

enum class Place : int { kNone = 0, kHost = 1, kCuda = 2, kSocket = 3 };

struct Buffer {
  uint8_t* base = nullptr;  // null for a socket peer's buffer: its shape is all we know
  int64_t rows = 0, cols = 0, row_bytes = 0, itemsize = 0;
  std::string dtype;
};

struct RankMemory {
  Place place = Place::kNone;
  std::unordered_map<int64_t, Buffer> buffers;
  int64_t n_events = -1;        // -1: events not registered
  int64_t* counters = nullptr;  // host: event words
  unsigned long long flags = 0; // cuda: device address of uint32 flag words
  int64_t* shadow = nullptr;    // cuda: host copy of each flag word (one writer per word)
  int fd = -1;                  // socket
  int device = -1;              // cuda
};

struct MoverStats {
  std::atomic<int64_t> writes{0}, signals{0}, bytes{0};
};

class Mover {
 public:
  std::unordered_map<int64_t, RankMemory> ranks;
  CudaApi cuda;
  int cuda_device = -1;
  double bytes_per_s = 0;       // > 0: pace writes like a NIC of that bandwidth
  double send_timeout_s = 10;   // a socket that accepts nothing for this long is an error
  int doorbell_fd = -1;         // written after a batch that raised host events
  const std::atomic<bool>* abort = nullptr;
  MoverStats stats;
  // By destination rank: (bytes, writes), for the transport's per-link counters.
  std::unordered_map<int64_t, std::pair<int64_t, int64_t>> sent_to;

  RankMemory& rank(int64_t r) { return ranks[r]; }
  const Buffer& check_region(int64_t rank, const Rect& rect, const char* role) const;
  void check_write(const Command& c) const;
  void check_event(int64_t rank, int64_t event, const char* what) const;

  void write(int64_t src_rank, const Rect& src, int64_t dst_rank, const Rect& dst,
             const std::vector<int64_t>& events, const std::vector<int64_t>& done, int64_t epoch);
  void signal(int64_t src_rank, int64_t dst_rank, int64_t event, int64_t epoch);
  void start_thread();   // in the drain thread: CUDA device and stream
  void end_batch();      // ring the doorbell if host events were raised
  void finish();         // wait for queued GPU work
  ~Mover();

 private:
  void* stream_ = nullptr;
  bool rang_ = false;
  double busy_until_ = 0;

  void raise_local(int64_t rank, int64_t event);
  void pace(int64_t nbytes);
  void send_frame(int64_t src_rank, int64_t dst_rank, int kind, const Rect& dst,
                  const std::vector<int64_t>& events, int64_t epoch, const Rect* src);
};

double now_s();

}  // namespace mgraph
