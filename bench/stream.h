// Raw byte streams between the ranks of a benchmark, with no collective library on top: what
// dear-fabric-stream and dear-tcp-ring measure the transports themselves with.
//
// Every message carries a stamp in its first and last 8 bytes that names it, and every receiver
// checks it, so that no figure can come out without the data having moved. Memory is
// page-aligned and touched before any timing, so that no page fault is timed. Helpers that
// involve other ranks go through the bootstrap and are collective: every rank calls them.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "dear/bootstrap.h"
#include "transport/socket_util.h"

namespace dear::bench::stream {

inline constexpr std::size_t kStamp = sizeof(std::uint64_t);
// Bytes per send()/recv() call of a TCP stream: fixed, so that the baseline does not move with
// a tool's other knobs.
inline constexpr std::size_t kTcpChunk = 1 << 20;
// A rank that sees no progress for this long gives up, so that a failure on one rank reaches
// the others (through the bootstrap) well within the bootstrap's own timeout.
inline constexpr auto kStallLimit = std::chrono::seconds(30);

// Writes message `seq`'s stamp into its first and last 8 bytes (size >= 2 * kStamp).
void stamp(char* msg, std::size_t size, std::uint64_t seq);
void clear_stamp(char* msg, std::size_t size);
// Throws kMismatch naming `what`, the message and the sending rank when the stamp is not
// message `seq`'s.
void check_stamp(const char* msg, std::size_t size, std::uint64_t seq, int rank, int from,
                 const std::string& what);

struct FreeDeleter {
  void operator()(char* p) const;
};
using Memory = std::unique_ptr<char, FreeDeleter>;
// Page-aligned memory, every page written with `fill`.
[[nodiscard]] Memory allocate(std::size_t bytes, int fill, int rank);

// Runs `step` on this rank, then tells every rank whether all succeeded. A failing rank passes
// its reason along and rank 0 prints each distinct one once, prefixed by `tool`, so that the
// other ranks do not wait for data that will never come. Collective.
[[nodiscard]] bool all_ok(Bootstrap& boot, const char* tool, const std::function<void()>& step);
// The largest of the ranks' values. Collective.
[[nodiscard]] double max_over_ranks(Bootstrap& boot, double value);

// Messages of `size` bytes over TCP with blocking calls: sent on one connection, received on
// another (or both on one, full duplex). A sending thread runs next to the receiving one when
// a rank does both.
class TcpStream {
 public:
  TcpStream(std::size_t size, int rank);

  // The connections, once made (see connect_pair and connect_ring). `recv` may be invalid: the
  // send connection then carries both directions.
  void attach(transport::Fd send, int send_peer, transport::Fd recv, int recv_peer);

  // Sends and/or receives `messages` messages; returns the seconds from the arrival of message
  // `timed_from` (the last warm-up one, counted from 1; 0: from the start) to that of the last,
  // so that the stream is in full flow when the clock starts and no start-up skew between the
  // ranks is timed. 0 when this rank does not receive.
  double run(bool send, bool recv, std::uint64_t messages, std::uint64_t timed_from);

 private:
  [[noreturn]] void fail(const char* call, int err, int peer) const;
  void send_messages(std::uint64_t messages);
  double recv_messages(std::uint64_t messages, std::uint64_t timed_from);
  [[nodiscard]] int recv_fd() const { return recv_.valid() ? recv_.get() : send_.get(); }

  int rank_;
  std::size_t size_;
  std::size_t chunk_;
  Memory send_buf_;
  Memory recv_buf_;
  transport::Fd send_;
  transport::Fd recv_;
  int send_peer_ = -1;
  int recv_peer_ = -1;
};

// Two ranks, one connection between them over 127.0.0.1 carrying both directions. Collective;
// false (on every rank) when a rank failed.
[[nodiscard]] bool connect_pair(Bootstrap& boot, const char* tool, TcpStream& stream);
// Any number of ranks in a ring over 127.0.0.1: rank r sends to r + 1 and receives from r - 1,
// one connection per direction (two between the same two ranks when there are only two).
// Collective; false (on every rank) when a rank failed.
[[nodiscard]] bool connect_ring(Bootstrap& boot, const char* tool, TcpStream& stream);

}  // namespace dear::bench::stream
