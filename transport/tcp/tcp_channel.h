// TCP back-end of the link contract (transport/link.h): one non-blocking socket per channel,
// TCP_NODELAY, vectored writes of header+payload with several messages batched per system
// call, and payloads read straight into their destination when they are large.
//
// Large data payloads (DEAR_TCP_ZEROCOPY_BYTES and more) leave without being copied: their
// pages are spliced into the socket (vmsplice into a pipe, splice into the socket), so the
// kernel sends from the caller's memory. That memory must then stay unchanged until the peer
// has read the bytes, not merely until they were handed over, so such a message is reported
// sent only when the peer's channel says it has consumed it: the sender marks the header
// (kAckBit in its type), the receiver, once the payload is read, sends back a kConsumed frame
// with the number of marked messages consumed since its last one. On loopback this halves
// what the kernel copies (one copy, into the reader, instead of two).
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

// DEAR_TCP_ZEROCOPY_BYTES (K/M/G suffixes): data payloads of at least this many bytes are
// spliced into the socket instead of copied (above); 0 turns it off. Default kZeroCopyBytes.
// Throws dear::Error(kInvalidArgument) naming the variable when it is malformed or negative.
inline constexpr std::size_t kZeroCopyBytes = 256 * 1024;
[[nodiscard]] std::size_t zerocopy_bytes_from_env();

class TcpChannel final : public Channel {
 public:
  TcpChannel(Fd fd, int self_rank, int peer_rank, int index);
  ~TcpChannel() override;

  bool try_send(const FrameHeader& h, const void* payload, std::uint64_t token) override;
  // Messages not yet reported sent: queued, and spliced ones the peer has not yet consumed;
  // one more while a consumed notice of our own waits to be written.
  std::size_t queued() const override {
    return count_ + awaiting_count_ + (acks_owed_ > 0 || ack_left_ > 0 ? 1 : 0);
  }
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
  // Set in a data header's type: the payload was spliced, answer with kConsumed once read.
  static constexpr std::uint8_t kAckBit = 0x80;

  bool flush(RecvSink& sink);
  // The part of flush() that moves the head message's spliced payload and what the pipe
  // holds. Returns false when the socket (or pipe) takes no more now.
  bool flush_spliced(bool& moved);
  // A send-side system call failed with errno: marks the socket blocked when it would block;
  // a peer that is gone drops the queue (send_gone_); anything else throws.
  void send_failed(const char* what);
  // Takes the head message off the queue, fully handed over; returns its token.
  std::uint64_t pop_head();
  // The header asks the peer for a consumed notice: its payload is spliced.
  static bool asks_consumed(const FrameHeader& h) {
    return (static_cast<std::uint8_t>(h.type) & kAckBit) != 0;
  }
  // A message's payload has been read in full: tells the sink, and owes a consumed notice
  // when the sender spliced it.
  void finish_message(RecvSink& sink);
  // A kConsumed frame: reports that many spliced messages sent, oldest first.
  void on_consumed(RecvSink& sink, const FrameHeader& h);
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

  // Zero-copy sends. splicing_: the head message's header is written and its payload goes
  // through the pipe; pipe_bytes_ of it sit in the pipe, not yet in the socket. Spliced
  // messages fully handed over wait in awaiting_ (their tokens) for the peer's notice.
  std::size_t zerocopy_min_ = 0;  // 0: off
  Fd pipe_read_;
  Fd pipe_write_;
  std::size_t pipe_capacity_ = 0;
  std::size_t pipe_bytes_ = 0;
  bool splicing_ = false;
  std::array<std::uint64_t, kQueueCapacity> awaiting_{};
  std::size_t awaiting_head_ = 0;
  std::size_t awaiting_count_ = 0;
  // Consumed notices owed to the peer, and what is left to write of the one being written.
  std::uint64_t acks_owed_ = 0;
  FrameHeader ack_{};
  std::size_t ack_left_ = 0;
  bool current_acked_ = false;  // the message being read was spliced by the peer

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
