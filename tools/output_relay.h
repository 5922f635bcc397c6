// Relaying the ranks' stdout and stderr through dear-run as whole, prefixed lines.
//
// Contract: LineRelay turns one rank's byte stream into lines that each start with the rank's
// prefix and end with '\n'; bytes are never dropped or reordered within a stream. A line is
// only emitted once it is complete (or too long to hold, or the stream ended), so a caller
// that writes each batch with one OutputSink::write() never mixes two ranks inside a line.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>
#include <utility>

namespace dear::tools {

class LineRelay {
 public:
  // Longer lines are cut into pieces of this size, each prefixed, so that one rank printing
  // without newlines cannot make dear-run hold unbounded memory or starve the other ranks.
  static constexpr std::size_t kMaxLine = 64 * 1024;

  explicit LineRelay(std::string prefix = {}) : prefix_(std::move(prefix)) {}

  // Appends to `out` every line of `data` that is now complete; keeps the rest for later.
  void feed(std::string_view data, std::string& out);
  // The stream ended: a last line without '\n' is appended to `out`, completed with one.
  void finish(std::string& out);

 private:
  std::string prefix_;
  std::string partial_;
};

// "[R] " with R right-aligned to the width of the largest rank, e.g. "[ 3] " for 12 ranks.
[[nodiscard]] std::string rank_prefix(int rank, int world_size);

// A file descriptor dear-run writes to (its stdout or stderr).
class OutputSink {
 public:
  explicit OutputSink(int fd) : fd_(fd) {}

  // Writes all of `data` in as few write() calls as the kernel allows; waits when the fd is
  // non-blocking and full. After a write error (the reader went away) output is dropped, so
  // that the job keeps running and its pipes keep draining.
  void write(std::string_view data);

 private:
  int fd_;
  bool broken_ = false;
};

}  // namespace dear::tools
