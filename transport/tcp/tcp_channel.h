// TCP back-end of the link contract (transport/link.h): one non-blocking socket per channel,
// TCP_NODELAY, vectored writes of header+payload with several messages batched per system
// call, and payloads read straight into their destination when they are large.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <sys/uio.h>
#include <vector>

#include "transport/link.h"
#include "transport/socket_util.h"

namespace dear::transport::tcp {

class TcpChannel final : public Channel {
 public:
  TcpChannel(Fd fd, int self_rank, int peer_rank, int index);
  ~TcpChannel() override;

  bool try_send(const FrameHeader& h, const void* payload, std::uint64_t token) override;
  std::size_t queued() const override { return count_; }
  std::size_t queued_bytes() const override { return queued_bytes_; }
  bool progress(RecvSink& sink) override;
  pollfd wait_spec() const override;
  void close() override;
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
  bool receive(RecvSink& sink);
  // Consumes payload bytes buffered in the inbox; true when the message completed.
  bool consume_buffered(RecvSink& sink);
  [[noreturn]] void fail(const std::string& why) const;

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
  std::array<iovec, kMaxIov> iov_{};

  std::unique_ptr<char[]> inbox_;
  std::size_t rpos_ = 0;
  std::size_t wpos_ = 0;
  bool in_payload_ = false;
  FrameHeader current_{};
  RecvTarget target_{};
  std::size_t done_ = 0;
};

// Handshake that binds an accepted socket to (communicator, rank, channel).
struct LinkHello {
  std::uint32_t magic;
  std::uint32_t version;
  std::uint8_t secret[16];
  std::int32_t rank;
  std::int32_t channel;
  std::uint64_t comm_tag;
};

// Opens `channels` connections to a peer's link listener and introduces each.
[[nodiscard]] std::vector<std::unique_ptr<Channel>> connect_link(
    const SockAddr& peer_addr, int self_rank, int peer_rank, int channels,
    const std::uint8_t* secret, std::uint64_t comm_tag, Deadline deadline);

// Accepts `channels` connections from each rank in `peers` on `listen_fd`; connections that do
// not prove the secret are dropped and logged. Result indexed [peer position][channel].
[[nodiscard]] std::vector<std::vector<std::unique_ptr<Channel>>> accept_links(
    int listen_fd, int self_rank, const std::vector<int>& peers, int channels,
    const std::uint8_t* secret, std::uint64_t comm_tag, Deadline deadline);

}  // namespace dear::transport::tcp
