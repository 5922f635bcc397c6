#include "transport/delay_channel.h"

#include <sys/epoll.h>
#include <sys/timerfd.h>
#include <time.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <limits>
#include <string>
#include <utility>

#include "dear/error.h"

namespace dear::transport {
namespace {

constexpr std::int64_t kNsPerSec = 1000000000;
// The timer fires this long before a held message is due: waking a thread asleep in poll()
// takes tens of microseconds, and the engine yields for a while (CommOptions::spin_us) after
// each wake-up, calling progress(), which then releases the message on time instead of late.
constexpr std::int64_t kEarlyWakeNs = 50000;

// The timer runs on CLOCK_MONOTONIC with absolute expiry times, so due times are read from the
// same clock rather than from std::chrono, whose epoch the standard leaves open.
std::int64_t now_ns() {
  timespec ts{};
  ::clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<std::int64_t>(ts.tv_sec) * kNsPerSec + ts.tv_nsec;
}

std::uint32_t to_epoll(short poll_events) {
  std::uint32_t e = 0;
  if (poll_events & POLLIN) e |= EPOLLIN;
  if (poll_events & POLLOUT) e |= EPOLLOUT;
  if (poll_events & POLLPRI) e |= EPOLLPRI;
  return e;
}

[[noreturn]] void system_error(const std::string& what) {
  throw Error(ErrorCode::kSystem, "link delay: " + what + ": " + std::strerror(errno));
}

}  // namespace

DelayChannel::DelayChannel(std::unique_ptr<Channel> inner, std::chrono::microseconds delay)
    : inner_(std::move(inner)), delay_(delay), delay_ns_(0) {
  if (!inner_) throw Error(ErrorCode::kInvalidArgument, "DelayChannel: inner channel is null");
  if (delay_.count() < 0 || delay_.count() > std::numeric_limits<std::int64_t>::max() / 4000) {
    throw Error(ErrorCode::kInvalidArgument,
                "link delay of " + std::to_string(delay_.count()) + " us is out of range");
  }
  delay_ns_ = static_cast<std::int64_t>(delay_.count()) * 1000;
  ring_.resize(kHoldCapacity);
  epoll_.reset(::epoll_create1(EPOLL_CLOEXEC));
  if (!epoll_.valid()) system_error("epoll_create1");
  timer_.reset(::timerfd_create(CLOCK_MONOTONIC, TFD_NONBLOCK | TFD_CLOEXEC));
  if (!timer_.valid()) system_error("timerfd_create");
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.fd = timer_.get();
  if (::epoll_ctl(epoll_.get(), EPOLL_CTL_ADD, timer_.get(), &ev) != 0) {
    system_error("adding the timer to the epoll set");
  }
}

DelayChannel::~DelayChannel() { close(); }

std::string DelayChannel::describe() const {
  return inner_->describe() + " (+" + std::to_string(delay_.count()) + " us link delay)";
}

bool DelayChannel::try_send(const FrameHeader& h, const void* payload, std::uint64_t token) {
  // A dead inner channel reports itself exactly as it would undecorated.
  if (inner_->closed()) return inner_->try_send(h, payload, token);
  if (held_ == kHoldCapacity) return false;
  ring_[(head_ + held_) % kHoldCapacity] = {h, payload, token, now_ns() + delay_ns_};
  ++held_;
  held_bytes_ += h.bytes;
  return true;
}

bool DelayChannel::release(bool all) {
  if (held_ == 0 || inner_->closed()) return false;
  const std::int64_t now = all ? std::numeric_limits<std::int64_t>::max() : now_ns();
  bool moved = false;
  inner_full_ = false;
  while (held_ > 0) {
    const Held& m = ring_[head_];
    if (m.due_ns > now) break;
    if (!inner_->try_send(m.header, m.payload, m.token)) {
      inner_full_ = true;
      break;
    }
    held_bytes_ -= m.header.bytes;
    head_ = (head_ + 1) % kHoldCapacity;
    --held_;
    moved = true;
  }
  return moved;
}

bool DelayChannel::progress(RecvSink& sink, bool may_read) {
  bool moved = release(false);
  moved |= inner_->progress(sink, may_read);
  // The inner channel may just have made room for a message that was due but refused.
  if (inner_full_) moved |= release(false);
  return moved;
}

void DelayChannel::sync_wait_set() const {
  const pollfd want = inner_->wait_spec();
  if (want.fd != registered_.fd || want.events != registered_.events) {
    if (registered_.fd >= 0 && want.fd != registered_.fd) {
      // Fails harmlessly when the inner channel has closed the fd: closing removed it.
      (void)::epoll_ctl(epoll_.get(), EPOLL_CTL_DEL, registered_.fd, nullptr);
    }
    if (want.fd >= 0) {
      epoll_event ev{};
      ev.events = to_epoll(want.events);
      ev.data.fd = want.fd;
      const int op = want.fd == registered_.fd ? EPOLL_CTL_MOD : EPOLL_CTL_ADD;
      if (::epoll_ctl(epoll_.get(), op, want.fd, &ev) != 0) {
        system_error("watching " + inner_->describe());
      }
    }
    registered_ = want;
  }

  // When the inner queue is full its own POLLOUT wakes us; a timer already past due would
  // only spin the engine.
  const std::int64_t due =
      held_ > 0 && !inner_full_ ? std::max<std::int64_t>(1, ring_[head_].due_ns - kEarlyWakeNs) : 0;
  // Setting the timer also clears an expiry that was not read, so it is set again whenever
  // the armed time may already have passed; a future time that is already armed is kept.
  if (due == armed_ns_ && (due == 0 || due > now_ns())) return;
  itimerspec spec{};
  if (due > 0) {
    spec.it_value.tv_sec = static_cast<time_t>(due / kNsPerSec);
    spec.it_value.tv_nsec = static_cast<long>(due % kNsPerSec);
  }
  if (::timerfd_settime(timer_.get(), due > 0 ? TFD_TIMER_ABSTIME : 0, &spec, nullptr) != 0) {
    system_error("timerfd_settime");
  }
  armed_ns_ = due;
}

pollfd DelayChannel::wait_spec() const {
  if (inner_->closed()) return {-1, 0, 0};
  sync_wait_set();
  return {epoll_.get(), POLLIN, 0};
}

// Held messages go to the inner channel first, as in shut(): a FIN must not overtake them.
void DelayChannel::begin_close() {
  if (!inner_) return;
  release_for_close();
  inner_->begin_close();
}

void DelayChannel::release_for_close() {
  if (inner_->closed()) return;
  try {
    release(true);
  } catch (const Error&) {
    // Closing anyway; the inner channel is broken.
  }
}

void DelayChannel::close() {
  shut([](Channel& inner) { inner.close(); });
}

void DelayChannel::close_by(std::chrono::steady_clock::time_point linger_until) {
  shut([&](Channel& inner) { inner.close_by(linger_until); });
}

void DelayChannel::shut(const std::function<void(Channel&)>& close_inner) {
  if (!inner_) return;
  release_for_close();
  close_inner(*inner_);
  head_ = 0;
  held_ = 0;
  held_bytes_ = 0;
  inner_full_ = false;
}

std::vector<std::unique_ptr<Channel>> with_delay(std::vector<std::unique_ptr<Channel>> channels,
                                                 std::chrono::microseconds delay) {
  if (delay.count() <= 0) return channels;
  for (auto& ch : channels) ch = std::make_unique<DelayChannel>(std::move(ch), delay);
  return channels;
}

}  // namespace dear::transport
