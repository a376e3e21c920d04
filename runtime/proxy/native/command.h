// The 16-word FIFO command as the native drain loop reads it.
//
// runtime/proxy/command.py is the source of truth for the layout; this header mirrors it and
// tests/test_native_proxy.py checks that the constants the module exports equal the Python ones,
// so the two cannot drift apart silently.
#pragma once

#include <cstdint>
#include <string>

namespace mgraph {

constexpr int kWords = 16;

enum Word : int {
  kHeader = 0,
  kTask = 1,
  kEpoch = 2,
  kSrcRank = 3,
  kSrcBuf = 4,
  kSrcRows = 5,
  kSrcCols = 6,
  kDstRank = 7,
  kDstBuf = 8,
  kDstRows = 9,
  kDstCols = 10,
  kBytes = 11,
  kEvent = 12,
  kDoneEvent = 13,
  kLane = 14,
};

enum Opcode : int { kNop = 1, kWrite = 2, kSignal = 3, kShutdown = 4 };

struct Rect {
  int64_t buffer = 0, row0 = 0, row1 = 0, col0 = 0, col1 = 0;
  int64_t rows() const { return row1 - row0; }
  int64_t cols() const { return col1 - col0; }
  int64_t numel() const { return rows() * cols(); }
  std::string str() const {
    return "buf" + std::to_string(buffer) + "[" + std::to_string(row0) + ":" +
           std::to_string(row1) + "," + std::to_string(col0) + ":" + std::to_string(col1) + "]";
  }
};

struct Command {
  int64_t ticket = 0;
  int64_t seq = 0;
  int opcode = 0;
  int64_t task = -1, epoch = 0, src_rank = 0, dst_rank = 0, bytes = 0, event = -1,
          done_event = -1, lane = 0;
  Rect src, dst;
};

// Coordinates travel two per word: ``row0 << 32 | row1``.
inline Rect unpack_rect(int64_t buffer, int64_t rows, int64_t cols) {
  const uint64_t r = static_cast<uint64_t>(rows), c = static_cast<uint64_t>(cols);
  return Rect{buffer, static_cast<int64_t>(r >> 32), static_cast<int64_t>(r & 0xffffffffu),
              static_cast<int64_t>(c >> 32), static_cast<int64_t>(c & 0xffffffffu)};
}

inline Command decode(const int64_t* w, int64_t ticket) {
  Command c;
  c.ticket = ticket;
  c.seq = static_cast<int64_t>(static_cast<uint64_t>(w[kHeader]) >> 8);
  c.opcode = static_cast<int>(w[kHeader] & 0xff);
  c.task = w[kTask];
  c.epoch = w[kEpoch];
  c.src_rank = w[kSrcRank];
  c.src = unpack_rect(w[kSrcBuf], w[kSrcRows], w[kSrcCols]);
  c.dst_rank = w[kDstRank];
  c.dst = unpack_rect(w[kDstBuf], w[kDstRows], w[kDstCols]);
  c.bytes = w[kBytes];
  c.event = w[kEvent];
  c.done_event = w[kDoneEvent];
  c.lane = w[kLane];
  return c;
}

// What the loop throws when a command cannot be executed; ``index`` is its place in the batch.
struct Failure {
  int index;
  std::string message;
};

}  // namespace mgraph
