// TCP back-end of the link contract (transport/link.h): one non-blocking socket per channel,
// TCP_NODELAY, vectored writes of header+payload with several messages batched per system
// call, and payloads read straight into their destination when they are large.
#pragma once

#include <sys/uio.h>

#include <array>
#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "transport/link.h"
#include "transport/socket_util.h"

namespace dear::transport::tcp {

// DEAR_SOCKET_BUFFER (K/M/G suffixes): both socket buffers of every TCP channel fixed at that
// size, which turns off the kernel's autotuning of them (the kernel caps it at
// net.core.[rw]mem_max); nullopt when unset or empty. Throws dear::Error(kInvalidArgument)
// naming the variable when it is malformed or outside [4K, 1G].
[[nodiscard]] std::optional<std::size_t> socket_buffer_from_env();

class TcpChannel final : public Channel {
 public:
  TcpChannel(Fd fd, int self_rank, int peer_rank, int index);
  ~TcpChannel() override;

  bool try_send(const FrameHeader& h, const void* payload, std::uint64_t token) override;
  std::size_t queued() const override { return count_; }
  std::size_t queued_bytes() const override { return queued_bytes_; }
  bool progress(RecvSink& sink, bool may_read) override;
  pollfd wait_spec() const override;
  void begin_close() override;
  void close() override;
  void close_by(std::chrono::steady_clock::time_point linger_until) override;
  bool closed() const override { return !fd_.valid(); }
  std::string describe() const override;

 private:
  struct Pending {
    FrameHeader header;
    const char* payload;
    std::uint64_t token;
  };
  static constexpr std::size_t kQueueCapacity = 64;
  static constexpr std::size_t kInboxBytes = 256 * 1024;
  static constexpr int kMaxIov = 64;

  bool flush(RecvSink& sink);
  bool receive(RecvSink& sink, std::size_t budget);  // reads at most `budget` socket bytes
  // Consumes payload bytes buffered in the inbox; true when the message completed.
  bool consume_buffered(RecvSink& sink);
  [[noreturn]] void fail(const std::string& why) const;
  // The peer closed (or reset) the connection: forget what is queued, tell the sink.
  bool peer_closed(RecvSink& sink);
  void drop_queue();

  Fd fd_;
  int self_;
  int peer_;
  int index_;

  std::array<Pending, kQueueCapacity> queue_{};
  std::size_t head_ = 0;
  std::size_t count_ = 0;
  std::size_t head_offset_ = 0;  // bytes of the head message already written
  std::size_t queued_bytes_ = 0;
  bool write_blocked_ = false;
  bool fin_sent_ = false;   // begin_close() has handed over what it could and sent a FIN
  bool send_gone_ = false;  // a send found the peer's end closed; receive() reports it
  std::array<iovec, kMaxIov> iov_{};

  std::unique_ptr<char[]> inbox_;
  std::size_t rpos_ = 0;
  std::size_t wpos_ = 0;
  bool in_payload_ = false;
  FrameHeader current_{};
  RecvTarget target_{};
  std::size_t done_ = 0;
};

// Link setup. Every connection proves the job's secret with the challenge-response of
// transport/auth.h, bound to (communicator tag, connector rank, listener rank, channel), and the
// listener proves it back. Each rank connects to its peers first and accepts from its peers
// second, so a connector cannot wait for its challenge inside connect_link(): the peer that
// would send it may itself still be connecting, and a ring of ranks would wait on each other.
// connect_link() therefore only opens the connections; this thread's next accept_links() with
// the same tag answers their challenges while it accepts, and returns only when both directions
// are proven. Nothing may be sent or received on the returned channels before that.

// Opens `channels` connections to a peer's link listener; their handshakes complete in the
// accept_links() call that follows on this thread.
[[nodiscard]] std::vector<std::unique_ptr<Channel>> connect_link(
    const SockAddr& peer_addr, int self_rank, int peer_rank, int channels,
    const std::uint8_t* secret, std::uint64_t comm_tag, Deadline deadline);

// Accepts `channels` connections from each rank in `peers` on `listen_fd` and completes this
// thread's pending connect_link() handshakes for `comm_tag`. Connections are served
// concurrently: one that sends garbage, a wrong proof or nothing at all is dropped and logged
// (after at most 5 s) without delaying the others. Result indexed [peer position][channel].
[[nodiscard]] std::vector<std::vector<std::unique_ptr<Channel>>> accept_links(
    int listen_fd, int self_rank, const std::vector<int>& peers, int channels,
    const std::uint8_t* secret, std::uint64_t comm_tag, Deadline deadline);

}  // namespace dear::transport::tcp
