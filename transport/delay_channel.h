// Link delay decorator: a Channel that adds a fixed one-way latency to another Channel.
//
// Why: studying latency-bound algorithms needs links slower than loopback, and the kernels we
// run on have no netem qdisc. Adding the delay above the transport also makes it work the same
// over every back-end (CommOptions::link_delay_us, DEAR_LINK_DELAY_US).
//
// Contract, on top of transport/link.h:
// - Delay: a message given to try_send() is held for `delay` from that moment, then handed to
//   the inner channel; the peer therefore sees it no earlier than `delay` after try_send(),
//   plus what the inner channel takes itself. Only sends are delayed: wrap both ends of a link
//   to delay both directions (connect() wraps every channel of every rank).
// - Order: held messages leave first in, first out; the delay is the same for all, so the
//   order on the wire is the order of try_send(), as link.h requires.
// - Completion: payloads are not copied. A message is reported sent (RecvSink::on_sent, with
//   the caller's own token) when the inner channel reports it, never earlier, so the payload
//   must stay valid exactly as link.h says. Every accepted message is reported once, or the
//   inner channel fails (thrown from progress(), as the inner channel throws it).
// - Back-pressure: at most kHoldCapacity messages are held; try_send() returns false beyond
//   that. A due message that the inner channel refuses (its queue is full) stays held, and so
//   do all behind it, until the inner channel takes it.
// - Throughput: like TCP's window, what is held bounds the rate: a user that keeps at most B
//   bytes queued (the engine does) gets at most B per `delay` through one channel.
// - Waking: wait_spec() returns one epoll fd, readable when the inner channel's wait_spec()
//   condition holds or from shortly (kEarlyWake) before the earliest held message is due until
//   progress() has released it (a timerfd inside the epoll set), so an engine asleep in poll()
//   wakes in time; waking a little early hides the cost of the wake-up itself.
// - close(): hands every held message to the inner channel at once (a close must not wait for
//   the delay; what the inner queue cannot take is dropped), then closes the inner channel.
// - Threading: one thread, as for every Channel.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "transport/link.h"
#include "transport/socket_util.h"

namespace dear::transport {

class DelayChannel final : public Channel {
 public:
  // Most messages held at once; well above what the engine keeps queued per channel, so that
  // control frames still fit behind a full window of data.
  static constexpr std::size_t kHoldCapacity = 256;

  // Throws dear::Error(kInvalidArgument) for a null inner channel or a negative delay, and
  // dear::Error(kSystem) when the epoll or timer fd cannot be created.
  DelayChannel(std::unique_ptr<Channel> inner, std::chrono::microseconds delay);
  ~DelayChannel() override;
  DelayChannel(const DelayChannel&) = delete;
  DelayChannel& operator=(const DelayChannel&) = delete;

  bool try_send(const FrameHeader& h, const void* payload, std::uint64_t token) override;
  // Held messages plus the inner channel's queue.
  std::size_t queued() const override { return held_ + inner_->queued(); }
  std::size_t queued_bytes() const override { return held_bytes_ + inner_->queued_bytes(); }
  bool progress(RecvSink& sink, bool may_read) override;
  pollfd wait_spec() const override;
  bool polled() const override { return inner_->polled(); }
  void forget_memory(const void* addr, std::size_t bytes) override {
    inner_->forget_memory(addr, bytes);
  }
  void begin_close() override;
  void close() override;
  void close_by(std::chrono::steady_clock::time_point linger_until) override;
  bool closed() const override { return inner_->closed(); }
  std::string describe() const override;

  [[nodiscard]] std::chrono::microseconds delay() const { return delay_; }
  [[nodiscard]] std::size_t held() const { return held_; }

 private:
  // close() or close_by(): hands held messages to the inner channel, then closes
  // that with `close_inner`.
  void shut(const std::function<void(Channel&)>& close_inner);
  // Hands every held message to the inner channel, unless that is closed or broken.
  void release_for_close();
  struct Held {
    FrameHeader header;
    const void* payload;
    std::uint64_t token;
    std::int64_t due_ns;  // CLOCK_MONOTONIC
  };

  // Hands due messages (all of them when `all`) to the inner channel while it accepts them;
  // true if any moved.
  bool release(bool all);
  // Keeps the epoll set in step with the inner channel's wait_spec() and the timer with the
  // earliest held message. Const because wait_spec() is; touches only the mutable state.
  void sync_wait_set() const;

  std::unique_ptr<Channel> inner_;
  std::chrono::microseconds delay_;
  std::int64_t delay_ns_;

  std::vector<Held> ring_;  // kHoldCapacity slots, allocated once
  std::size_t head_ = 0;
  std::size_t held_ = 0;
  std::size_t held_bytes_ = 0;
  // The head is due but the inner queue refused it: its own POLLOUT wakes us, not the timer.
  bool inner_full_ = false;

  Fd epoll_;
  Fd timer_;
  mutable pollfd registered_{-1, 0, 0};  // the inner wait_spec() now in the epoll set
  mutable std::int64_t armed_ns_ = 0;    // 0: timer disarmed
};

// Wraps each channel in a DelayChannel when `delay` > 0; returns them unchanged otherwise.
[[nodiscard]] std::vector<std::unique_ptr<Channel>> with_delay(
    std::vector<std::unique_ptr<Channel>> channels, std::chrono::microseconds delay);

}  // namespace dear::transport
