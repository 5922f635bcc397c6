// See shm_channel.h. The rings are byte streams: a message's header may wrap around the end
// of the data area, and a payload starts wherever the message before it ended.
#include "transport/shm/shm_channel.h"

#include <sys/mman.h>

#include <algorithm>
#include <cstring>
#include <thread>

#include "dear/error.h"

namespace dear::transport::shm {
namespace {

// What the control socket carries: wake-ups only, and its close.
struct ControlSink final : RecvSink {
  bool closed = false;
  RecvTarget on_header(int, const FrameHeader&) override { return {}; }
  void on_payload(int, const FrameHeader&, const char*, std::size_t, std::size_t) override {}
  void on_message(int, const FrameHeader&) override {}
  void on_sent(int, std::uint64_t) override {}
  void on_closed(int) override { closed = true; }
};

// Copies `len` bytes out of / into a ring from stream position `pos`, across its end.
void copy_out(const Ring& r, std::uint64_t pos, char* dst, std::size_t len) {
  const std::size_t off = static_cast<std::size_t>(pos & (r.capacity - 1));
  const std::size_t first = std::min(len, r.capacity - off);
  std::memcpy(dst, r.data + off, first);
  if (first < len) std::memcpy(dst + first, r.data, len - first);
}

void copy_in(const Ring& r, std::uint64_t pos, const char* src, std::size_t len) {
  const std::size_t off = static_cast<std::size_t>(pos & (r.capacity - 1));
  const std::size_t first = std::min(len, r.capacity - off);
  std::memcpy(r.data + off, src, first);
  if (first < len) std::memcpy(r.data, src + first, len - first);
}

}  // namespace

Mappings::~Mappings() {
  for (const Map& m : maps_) ::munmap(m.base, m.bytes);
}

ShmChannel::ShmChannel(std::unique_ptr<Channel> control, Ring in, Ring out, int self_rank,
                       int peer_rank, int index, std::shared_ptr<const Mappings> mappings)
    : control_(std::move(control)),
      in_(in),
      out_(out),
      self_(self_rank),
      peer_(peer_rank),
      index_(index),
      mappings_(std::move(mappings)),
      bounce_(new char[kBounceBytes]) {
  // Both ends start from zero: the rings are fresh, and each has one writer and one reader.
  wpos_ = published_ = out_.control->head.load(std::memory_order_acquire);
  rpos_ = in_.control->tail.load(std::memory_order_acquire);
}

ShmChannel::~ShmChannel() { abandon(); }

std::string ShmChannel::describe() const {
  return "shm channel " + std::to_string(index_) + " between rank " + std::to_string(self_) +
         " and rank " + std::to_string(peer_);
}

void ShmChannel::fail(const std::string& why) const {
  throw Error(ErrorCode::kPeerFailed, why + " on " + describe(), self_, peer_);
}

std::size_t ShmChannel::queued() const { return queue_.size() + (wake_queued_ ? 1 : 0); }

bool ShmChannel::try_send(const FrameHeader& h, const void* payload, std::uint64_t token) {
  if (closed_ || queue_.full()) return false;
  queue_.push(h, payload, token);
  return true;
}

bool ShmChannel::write_out(RecvSink& sink) {
  if (queue_.empty()) return false;
  const std::uint64_t tail = out_.control->tail.load(std::memory_order_acquire);
  std::size_t room = out_.capacity - static_cast<std::size_t>(wpos_ - tail);
  bool moved = false;
  // The queue hands out a message in fragments (its header, then payload), each written where
  // the ring has room; a fragment needs room for more than a header.
  while (!queue_.empty() && room > kHeader) {
    const std::size_t off = static_cast<std::size_t>(wpos_ & (out_.capacity - 1));
    const std::size_t contiguous = std::min({room, out_.capacity - off, kPublishBytes});
    rma::SendQueue::Fragment f;
    if (contiguous > kHeader) {
      f = queue_.fill(out_.data + off, contiguous);
    } else {  // the ring's end is too near: round it through the bounce buffer
      f = queue_.fill(bounce_.get(), std::min(room, kBounceBytes));
      copy_in(out_, wpos_, bounce_.get(), f.bytes);
    }
    wpos_ += f.bytes;
    room -= f.bytes;
    if (wpos_ - published_ >= kPublishBytes) {
      out_.control->head.store(wpos_, std::memory_order_release);
      published_ = wpos_;
    }
    if (const auto token = queue_.commit(f)) {
      moved = true;
      sink.on_sent(index_, *token);  // may queue more: the loop takes it too
    }
  }
  if (wpos_ != published_) {
    out_.control->head.store(wpos_, std::memory_order_release);
    published_ = wpos_;
    moved = true;
  }
  if (moved) wake_reader();
  return moved;
}

void ShmChannel::wake_reader() {
  // Pairs with wait_spec(): the reader sets reader_waiting, then looks at head; this side
  // published head, then looks at reader_waiting. One of the two sees the other's store.
  std::atomic_thread_fence(std::memory_order_seq_cst);
  if (out_.control->reader_waiting.load(std::memory_order_relaxed) == 0) return;
  if (out_.control->reader_waiting.exchange(0) == 0) return;
  FrameHeader wake;
  wake.type = FrameType::kPosted;
  // Wake-ups are all the control socket carries: one that has not left yet will do.
  if (!wake_queued_) wake_queued_ = control_->try_send(wake, nullptr, 0);
}

void ShmChannel::deliver(RecvSink& sink, const char* data, std::size_t len) {
  switch (target_.mode) {
    case RecvTarget::kDirect: std::memcpy(target_.dst + done_, data, len); break;
    case RecvTarget::kStream: sink.on_payload(index_, current_, data, done_, len); break;
    case RecvTarget::kDiscard: break;
  }
  done_ += len;
}

void ShmChannel::finish_message(RecvSink& sink) {
  in_payload_ = false;
  sink.on_message(index_, current_);
}

bool ShmChannel::read_in(RecvSink& sink) {
  const std::uint64_t head = in_.control->head.load(std::memory_order_acquire);
  if (head == rpos_) return false;
  const std::uint64_t start = rpos_;
  std::uint64_t released = rpos_;
  const auto release = [&] {
    in_.control->tail.store(rpos_, std::memory_order_release);
    released = rpos_;
  };
  while (rpos_ < head) {
    if (!in_payload_) {
      // The writer publishes a header whole (its first fragment holds it and some payload).
      if (head - rpos_ < kHeader) break;
      copy_out(in_, rpos_, reinterpret_cast<char*>(&current_), kHeader);
      rpos_ += kHeader;
      in_payload_ = true;
      done_ = 0;
      target_ = sink.on_header(index_, current_);
      if (target_.unit == 0) target_.unit = 1;
      if (current_.bytes == 0) {
        finish_message(sink);
        continue;
      }
    }
    const std::size_t need = current_.bytes - done_;
    const std::size_t avail = static_cast<std::size_t>(std::min<std::uint64_t>(head - rpos_, need));
    const std::size_t off = static_cast<std::size_t>(rpos_ & (in_.capacity - 1));
    std::size_t take = std::min({avail, in_.capacity - off, kPublishBytes});
    const char* from = in_.data + off;
    if (target_.mode == RecvTarget::kStream) {
      // Pieces are whole elements (unless they end the message) and start aligned to one:
      // where the ring's bytes are not, or an element wraps round its end, they go through
      // the bounce buffer.
      const std::size_t unit = target_.unit;
      if (take < need) take -= take % unit;
      if (take == 0 || reinterpret_cast<std::uintptr_t>(from) % unit != 0) {
        take = std::min(avail, kBounceBytes);
        if (take < need) take -= take % unit;
        if (take == 0) break;  // less than an element has arrived
        copy_out(in_, rpos_, bounce_.get(), take);
        from = bounce_.get();
      }
    }
    deliver(sink, from, take);
    rpos_ += take;
    if (rpos_ - released >= kPublishBytes) release();
    if (done_ == current_.bytes) finish_message(sink);
  }
  if (rpos_ != released) release();
  // Nothing moved where the ring holds only part of an element (the rest is on its way).
  return rpos_ != start;
}

bool ShmChannel::progress_control(RecvSink& sink, bool may_read) {
  ControlSink control_sink;
  bool moved = false;
  try {
    moved = control_->progress(control_sink, may_read);
    wake_queued_ = control_->queued() > 0;
  } catch (const Error& e) {
    throw Error(e.code(), e.cause() + " (the control socket of " + describe() + ")", self_, peer_);
  }
  if (!control_sink.closed) return moved;
  // The peer wrote everything it sent into the ring before it closed its socket.
  read_in(sink);
  if (in_payload_) fail("the peer closed in the middle of a message");
  closed_ = true;
  drop_queue();
  sink.on_closed(index_);
  return true;
}

bool ShmChannel::progress(RecvSink& sink, bool may_read) {
  if (closed_) return false;
  bool moved = write_out(sink);
  if (may_read) {
    if (armed_) {
      armed_ = false;
      in_.control->reader_waiting.store(0, std::memory_order_relaxed);
    }
    moved |= read_in(sink);
  }
  // The control socket: a wake-up to flush, one to read after a sleep, or a look for the
  // peer's close now and then.
  const bool look = may_read && ++calls_ % kControlEvery == 0;
  if (look || wake_queued_) moved |= progress_control(sink, look);
  return moved;
}

pollfd ShmChannel::wait_spec() const {
  if (closed_) return {-1, 0, 0};
  pollfd p = control_->wait_spec();
  if (p.fd < 0) return p;
  p.events = POLLIN;
  in_.control->reader_waiting.store(1, std::memory_order_relaxed);
  std::atomic_thread_fence(std::memory_order_seq_cst);
  armed_ = true;
  // Data that arrived before the request for a wake-up: a socket with room to send is ready.
  if (in_.control->head.load(std::memory_order_acquire) != rpos_) p.events = POLLOUT;
  return p;
}

void ShmChannel::drop_queue() {
  queue_.clear();
  wake_queued_ = false;
}

void ShmChannel::begin_close() {
  if (closed_) return;
  NullSink none;
  write_out(none);
  control_->begin_close();
}

void ShmChannel::close() { close_by(std::chrono::steady_clock::now() + kCloseLinger); }

void ShmChannel::close_by(std::chrono::steady_clock::time_point linger_until) {
  if (closed_) return;
  // What is in the ring stays readable after this side is gone (the memory is the peer's);
  // what is queued goes in as far as the peer makes room before the deadline.
  NullSink none;
  write_out(none);
  while (!queue_.empty() && std::chrono::steady_clock::now() < linger_until) {
    std::this_thread::sleep_for(std::chrono::microseconds(50));
    write_out(none);
  }
  drop_queue();
  closed_ = true;
  control_->close_by(linger_until);
}

}  // namespace dear::transport::shm
