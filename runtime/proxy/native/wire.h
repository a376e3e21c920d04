// The tcp transport's frame, mirrored from runtime/proxy/tcp.py (the source of truth; the
// module exports these constants and tests compare them).
//
// A frame is kHeaderWords little-endian int64 words, then ``n_events`` int64 event ids, then
// ``nbytes`` of payload: the destination region's rows, each ``cols * itemsize`` bytes.
#pragma once

#include <cstdint>

namespace mgraph::wire {

constexpr int kHeaderWords = 8;
constexpr int64_t kMagic = 0x4D475446;  // "MGTF"
constexpr int kMaxEvents = 255;

enum Kind : int { kWrite = 1, kSignal = 2, kFence = 3, kBye = 4 };

// word 0: magic << 32 | kind << 16 | n_events; then epoch, src rank, dst rank, dst buffer,
// row0 << 32 | row1, col0 << 32 | col1, payload bytes.
inline int64_t word0(int kind, int n_events) {
  return (kMagic << 32) | (static_cast<int64_t>(kind) << 16) | n_events;
}

}  // namespace mgraph::wire
