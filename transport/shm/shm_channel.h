// Shared-memory back-end of the link contract (transport/link.h) for ranks of one host: each
// direction of a channel is a single-producer, single-consumer byte ring in the receiver's
// shared memory (a memfd every peer maps). Messages are written into it as they are framed
// everywhere else (32-byte FrameHeader, then the payload), so one copy in user space on each
// side moves a byte, with no system call and no lock. Each channel keeps the TCP channel its
// two ranks connected first as its control socket: a sleeping reader is woken through it, and
// the peer's exit is noticed on it (the kernel closes a dead process's sockets). See
// docs/transports.md ("shm transport").
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "transport/link.h"
#include "transport/rma/fragments.h"

namespace dear::transport::shm {

// The head of one ring, apart from its data. The writer moves `head` (bytes published), the
// reader `tail` (bytes consumed); both only grow. A reader about to sleep sets
// `reader_waiting`; a writer that publishes while it is set clears it and sends a wake-up on
// the control socket.
struct RingControl {
  alignas(64) std::atomic<std::uint64_t> head{0};
  alignas(64) std::atomic<std::uint64_t> tail{0};
  alignas(64) std::atomic<std::uint32_t> reader_waiting{0};
};

struct Ring {
  RingControl* control = nullptr;
  char* data = nullptr;
  std::size_t capacity = 0;  // a power of two
};

// The mappings the channels of one communicator write and read through: this rank's segment
// and every peer's. Unmapped when the last channel is gone.
class Mappings {
 public:
  Mappings() = default;
  Mappings(const Mappings&) = delete;
  Mappings& operator=(const Mappings&) = delete;
  ~Mappings();
  void add(void* base, std::size_t bytes) { maps_.push_back({base, bytes}); }

 private:
  struct Map {
    void* base;
    std::size_t bytes;
  };
  std::vector<Map> maps_;
};

class ShmChannel final : public Channel {
 public:
  // `control`: the TCP channel joining the same two ranks; `in`: the ring this rank reads (in
  // its own segment), `out`: the ring it writes (in the peer's).
  ShmChannel(std::unique_ptr<Channel> control, Ring in, Ring out, int self_rank, int peer_rank,
             int index, std::shared_ptr<const Mappings> mappings);
  ~ShmChannel() override;

  bool try_send(const FrameHeader& h, const void* payload, std::uint64_t token) override;
  std::size_t queued() const override;
  std::size_t queued_bytes() const override { return queue_.bytes(); }
  bool progress(RecvSink& sink, bool may_read) override;
  // The control socket; before the engine sleeps on it this also asks the peer for a wake-up,
  // and answers a descriptor that is ready at once (POLLOUT) when the ring holds data already.
  pollfd wait_spec() const override;
  // The ring is read only when asked: no descriptor says it holds data.
  bool polled() const override { return true; }
  void begin_close() override;
  void close() override;
  void close_by(std::chrono::steady_clock::time_point linger_until) override;
  bool closed() const override { return closed_; }
  std::string describe() const override;

 private:
  static constexpr std::size_t kHeader = sizeof(FrameHeader);
  // Published (head or tail) at least this often within a large message, so that the other
  // side works on one part while this side copies the next.
  static constexpr std::size_t kPublishBytes = 64 * 1024;
  static constexpr std::size_t kBounceBytes = 64 * 1024;
  // The control socket is read every this many progress() calls (besides after a sleep), for
  // a peer's exit or close.
  static constexpr unsigned kControlEvery = 64;

  // Copies queued messages into the peer's ring as far as it has room; reports each one sent
  // once its last byte is in.
  bool write_out(RecvSink& sink);
  // Hands over what the ring holds to the sink.
  bool read_in(RecvSink& sink);
  // Reads and flushes the control socket; true when it moved something. A peer's close is
  // reported once the ring is drained.
  bool progress_control(RecvSink& sink, bool may_read);
  void deliver(RecvSink& sink, const char* data, std::size_t len);
  void finish_message(RecvSink& sink);
  void wake_reader();
  void drop_queue();
  [[noreturn]] void fail(const std::string& why) const;

  std::unique_ptr<Channel> control_;
  Ring in_;
  Ring out_;
  int self_;
  int peer_;
  int index_;
  std::shared_ptr<const Mappings> mappings_;
  bool closed_ = false;

  // Sending: the bounded queue the RMA links use, its messages cut into fragments that go
  // into the ring back to back.
  rma::SendQueue queue_;
  std::uint64_t wpos_ = 0;       // bytes written into the peer's ring
  std::uint64_t published_ = 0;  // what the peer's ring's head says

  // Receiving.
  std::uint64_t rpos_ = 0;  // bytes consumed from this rank's ring
  bool in_payload_ = false;
  FrameHeader current_{};
  RecvTarget target_{};
  std::size_t done_ = 0;
  std::unique_ptr<char[]> bounce_;
  unsigned calls_ = 0;
  bool wake_queued_ = false;    // a wake-up waits in the control socket's queue
  mutable bool armed_ = false;  // reader_waiting was set by wait_spec()
};

}  // namespace dear::transport::shm
