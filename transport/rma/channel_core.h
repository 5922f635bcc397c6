// The channel of a back-end with receiver-owned slots (libfabric RDM endpoints, ibverbs queue
// pairs), written once: the link contract (transport/link.h) on top of the slot and credit
// protocol (slot_window.h), the fragments and direct messages (fragments.h) and the writes into
// slots (slot_region.h). A back-end keeps only what its API does: posting a fragment, a direct
// write or a control message, polling its completions and registering memory.
//
// What the core owns
// - Queueing (try_send, try_send_to): a message whose destination the peer opened as a window
//   and that is large enough goes direct; any other through slots.
// - The send pump: the head message cut into fragments, one credit each, gathered from the
//   caller's memory where the back-end sends in place; a direct message's first fragment and
//   then its payload writes. A message is reported sent once its last fragment is handed over,
//   or, where fragments or writes read the caller's memory, once the last of those completed.
// - Delivery: fragments in sequence order into the Reassembler (a direct message's writes
//   counted in place), the checks of what a write left in its slot, credits returned, and the
//   peer's goodbye once every fragment before it has been delivered.
// - Close: what the peer's credits allow is handed over, then the goodbye, waiting at most
//   kCloseLinger (transport/link.h) in all.
//
// What a back-end provides (RmaChannel<Backend>, Backend deriving from it; called without
// virtual dispatch):
//   using Source = ...;  // what a send from registered memory names (a descriptor, a key)
//   static constexpr bool kAnswersBye;  // says goodbye after the peer's goodbye too
//   void check_staged(const FrameHeader& h, const void* payload);  // may refuse a staged send
//   bool opened() const;     // the endpoint exists (close() has something to close)
//   bool connected() const;  // the peer is known (close() has someone to say goodbye to)
//   bool can_post() const;   // a data staging buffer is free and the provider may take more
//   char* staging();         // that buffer: where the next fragment is filled
//   std::optional<Source> source(const char* p, std::size_t n);  // registered [p, p + n)
//   // Hands over the fragment `seq`: `staged` bytes of the staging buffer, then (when given)
//   // a payload piece read where it lies. False when the provider says try again later.
//   bool post_fragment(std::uint32_t seq, std::size_t staged, const Gather<Source>* gather);
//   // A direct message's payload write of `piece` to the peer's `addr` under `key`.
//   bool post_write(std::uint32_t seq, const SendQueue::Piece& piece, Source source,
//                   std::uint64_t addr, std::uint64_t key);
//   // The fragment or write just posted reads the caller's memory until it completes; its
//   // completion hands `id` to sent_after().
//   void hold_posted(std::uint32_t id);
//   bool post_control(const Prefix& p);  // a credit return or goodbye; false: not now
//   void flush();                         // hands over what the posts above batched
//   const char* slot_base(std::uint32_t buffer) const;  // where fragment `buffer` lies
//   std::optional<std::size_t> written(std::uint32_t buffer) const;  // what a write placed
//   void slot_consumed(std::uint32_t buffer);  // the fragment there was delivered
//   void direct_started(const char* destination);  // a direct message's header delivered
//   bool writes_visible();  // the last direct write may be announced now (a GPU flush)
//   // Around progress(); `may_read`: progress()'s (false: the caller read the links a moment
//   // ago and only wants what is queued sent, so a shared queue need not be read again).
//   void begin_progress(bool may_read); bool poll(RecvSink&); void end_progress();
//   void drain();             // takes completions while closing
//   bool in_flight() const;  // posts the provider has not completed yet
//
// Not thread-safe: one channel, one thread, as for every Channel.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "dear/error.h"
#include "transport/link.h"
#include "transport/rma/fragments.h"
#include "transport/rma/slot_window.h"
#include "transport/socket_util.h"

namespace dear::transport::rma {

// Setup that every back-end's connect calls share.
// The most channels one connect_ring() makes to each neighbour (the setup records hold that many).
inline constexpr int kMaxChannels = 16;
// Throws dear::Error(kInvalidArgument), naming `transport`, unless `channels` is in
// [1, kMaxChannels].
void check_channel_count(std::string_view transport, int channels, int rank);
// Throws dear::Error(kTimeout), naming `transport`, once `deadline` has passed.
void check_setup_deadline(std::string_view transport, Clock::time_point deadline, int rank);
// A connect_ring()'s answer made of a back-end's own channels.
template <class C>
[[nodiscard]] RingLinks ring_links(std::vector<std::unique_ptr<C>>& to_next,
                                   std::vector<std::unique_ptr<C>>& from_prev) {
  RingLinks out;
  for (auto& ch : to_next) out.to_next.push_back(std::move(ch));
  for (auto& ch : from_prev) out.from_prev.push_back(std::move(ch));
  return out;
}

// A fragment's payload piece sent from where it lies, behind the prefix in the staging buffer.
template <class Source>
struct Gather {
  const char* data = nullptr;
  std::size_t bytes = 0;
  Source source{};
};

// What every slot channel has, whatever drives it: the protocol state and the checks made as
// fragments and control messages arrive.
class ChannelCore : public Channel {
 public:
  struct Params {
    int self = -1;
    int peer = -1;
    int index = 0;
    std::uint64_t tag = 0;  // stamped on every prefix (0 where an endpoint has one peer)
    std::size_t slot_bytes = 0;
    std::uint32_t slots = 0;
    std::size_t direct_min = 0;    // direct messages from this many payload bytes; 0: never
    std::size_t write_max = 1;     // payload bytes per direct write
    std::size_t in_place_min = 0;  // fragments sent in place from this many bytes; 0: never
    std::size_t iov_limit = 1;     // gather entries the provider takes per send
    // Fragments are written into the slots (their prefix is checked when delivered), rather
    // than sent into receives (checked on arrival, on_control).
    bool written = true;
  };
  explicit ChannelCore(const Params& p);

  [[nodiscard]] std::size_t queued() const override { return sendq_.size(); }
  [[nodiscard]] std::size_t queued_bytes() const override { return sendq_.bytes(); }
  [[nodiscard]] bool closed() const override { return closed_ || peer_closed_; }

 protected:
  [[noreturn]] void fail(const std::string& why) const;
  // A back-end's check_staged(): a message whose payload lies in registered device memory
  // (`in_device`) cannot be staged through the host; throws kInvalidArgument saying so.
  void refuse_staged_device_memory(const FrameHeader& h, bool in_device) const;
  // Queues a message (direct when `d` says so); false when the queue is full.
  bool queue(const FrameHeader& h, const void* payload, std::uint64_t token,
             const std::optional<DirectTarget>& d);
  // A credit return or goodbye that arrived: its credits taken; true when it was one of those,
  // false for a data fragment (or a kind unknown) whose handling is the caller's.
  bool on_control(const Prefix& p);
  // A write announced fragment `seq`: recorded for delivery in its turn; returns its slot.
  std::uint32_t on_slot_written(std::uint32_t seq);
  // The prefix of fragment `seq` read from the slot at `base` when its turn comes, checked
  // against the announcement (`written`: the bytes the write placed, where known), its credits
  // taken.
  Prefix slot_prefix(const char* base, std::uint32_t seq, std::optional<std::size_t> written);
  // The prefix of the next data fragment, whose body `f` describes (owed credits piggybacked).
  [[nodiscard]] Prefix data_prefix(const SendQueue::Fragment& f) const;
  [[nodiscard]] Prefix control_prefix(Kind kind, std::uint32_t seq, std::uint32_t credits) const;
  // A fragment or write the provider took: its credit (and, for one carrying a prefix, the
  // credits owed, which the prefix returned) are spent.
  void took(bool with_prefix);
  // A fragment or write posted through hold_posted() completed: the token of its message when
  // that one is now sent.
  std::optional<std::uint64_t> sent_after(std::uint32_t id) { return in_place_.completed(id); }
  // The message whose last fragment was committed: reported sent unless fragments of it still
  // read the caller's memory.
  void report(RecvSink& sink, std::optional<std::uint64_t> token);
  // Forgets what is queued (the channel is closed).
  void drop_queued();

  int self_;
  int peer_;
  int index_;
  std::uint64_t tag_;
  std::size_t slot_bytes_;
  std::uint32_t slots_;
  std::size_t direct_min_;
  std::size_t write_max_;
  std::size_t in_place_min_;
  std::size_t iov_limit_;
  bool written_slots_;

  SendWindow sendw_;
  RecvWindow recvw_;
  SendQueue sendq_;
  InPlaceSends in_place_;
  Reassembler reasm_;
  // Receiving a direct message: payload bytes per write (its writes are the next fragments).
  std::size_t direct_write_ = 0;

  // How long a peer's goodbye waits for this end's sends in flight (deliver()).
  static constexpr auto kByeGrace = std::chrono::milliseconds(200);
  bool peer_bye_ = false;
  Clock::time_point bye_seen_at_{};
  std::uint32_t bye_seq_ = 0;
  bool peer_closed_ = false;
  bool bye_sent_ = false;
  bool closed_ = false;
};

template <class Backend>
class RmaChannel : public ChannelCore {
 public:
  using ChannelCore::ChannelCore;

  bool try_send(const FrameHeader& h, const void* payload, std::uint64_t token) override {
    backend().check_staged(h, payload);
    return queue(h, payload, token, std::nullopt);
  }
  bool try_send_to(const FrameHeader& h, const void* payload, std::uint64_t token,
                   const Window& window, std::size_t offset) override {
    const auto d = direct_target(h.bytes, window, offset, direct_min_);
    if (!d) return try_send(h, payload, token);
    return queue(h, payload, token, d);
  }
  bool try_send_direct(const FrameHeader& h, const void* payload, std::uint64_t token,
                       const Window& window, std::size_t offset) override {
    if (h.bytes == 0) return queue(h, payload, token, std::nullopt);
    if (direct_min_ == 0) {
      throw Error(ErrorCode::kInternal,
                  "a direct send on " + describe() + ", whose data path has no windows", self_,
                  peer_);
    }
    const auto d = direct_target(h.bytes, window, offset, 1);
    if (!d) {
      throw Error(ErrorCode::kInvalidArgument,
                  "a direct message of " + std::to_string(h.bytes) + " bytes at offset " +
                      std::to_string(offset) + " does not fit the peer's window of " +
                      std::to_string(window.bytes) + " bytes on " + describe(),
                  self_, peer_);
    }
    return queue(h, payload, token, d);
  }
  bool progress(RecvSink& sink, bool may_read) override;
  void close() override;

 protected:
  bool deliver(RecvSink& sink);
  bool pump(RecvSink& sink);
  bool send_control(Kind kind, std::uint32_t seq, std::uint32_t credits) {
    return backend().post_control(control_prefix(kind, seq, credits));
  }

 private:
  Backend& backend() { return static_cast<Backend&>(*this); }
  // The next step of a direct head message (its first fragment, or one payload write); false
  // when it cannot be taken now.
  bool pump_direct(RecvSink& sink, const DirectTarget& d);
};

template <class Backend>
bool RmaChannel<Backend>::progress(RecvSink& sink, bool may_read) {
  if (closed()) return false;
  Backend& b = backend();
  b.begin_progress(may_read);
  bool moved = false;
  for (int round = 0; round < 8 && !closed(); ++round) {
    bool m = b.poll(sink);
    m |= deliver(sink);
    if (closed()) {
      moved = true;  // the peer's goodbye was delivered
      break;
    }
    m |= pump(sink);
    if (recvw_.should_return() && send_control(Kind::kCredit, 0, recvw_.owed())) {
      recvw_.take_owed();
      m = true;
    }
    b.flush();
    if (!m) break;
    moved = true;
  }
  b.end_progress();
  return moved;
}

template <class Backend>
bool RmaChannel<Backend>::deliver(RecvSink& sink) {
  Backend& b = backend();
  bool moved = false;
  while (const auto buffer = recvw_.next_ready()) {
    if (reasm_.in_direct()) {
      // One of a direct message's writes: its payload is in place already.
      const std::size_t n = std::min(direct_write_, reasm_.remaining());
      if (const auto w = b.written(*buffer); w && *w != n) {
        fail("protocol violation: a direct write of " + std::to_string(*w) + " bytes where " +
             std::to_string(n) + " were due");
      }
      if (n == reasm_.remaining() && !b.writes_visible()) break;  // a later progress(), in order
      if (auto bad = reasm_.on_placed(sink, index_, n)) fail(*bad);
      recvw_.consume();
      moved = true;
      continue;
    }
    const char* base = b.slot_base(*buffer);
    Prefix p;
    if (written_slots_) {
      p = slot_prefix(base, recvw_.expected(), b.written(*buffer));
    } else {
      std::memcpy(&p, base, kPrefix);
    }
    if (p.direct != 0) {
      if (!written_slots_) fail("protocol violation: a direct message on the send data path");
      if (p.first == 0) fail("protocol violation: a direct record in a message's later fragment");
      if (auto bad =
              reasm_.on_direct_header(sink, index_, base + kPrefix, p.bytes, &direct_write_)) {
        fail(*bad);
      }
      b.direct_started(reasm_.direct_destination());
    } else if (auto bad = reasm_.on_fragment(sink, index_, base + kPrefix, p.bytes, p.first != 0)) {
      fail(*bad);
    }
    recvw_.consume();  // the buffer is free for the fragment `slots` later: one more credit owed
    b.slot_consumed(*buffer);
    moved = true;
  }
  if (peer_bye_ && !peer_closed_ && recvw_.expected() == bye_seq_) {
    // A provider may report a send complete only once its receiver has taken it, and show the
    // receiver's goodbye first (libfabric's shm, on one endpoint per rank): the close waits for
    // this end's sends in flight, kByeGrace at most, so that a send the peer took is not
    // reported as one it left unfinished.
    if (b.in_flight()) {
      const auto now = Clock::now();
      if (bye_seen_at_ == Clock::time_point{}) bye_seen_at_ = now;
      if (now - bye_seen_at_ < kByeGrace) return moved;
    }
    if (reasm_.in_message()) {
      fail("rank " + std::to_string(peer_) + " closed in the middle of a message");
    }
    peer_closed_ = true;
    // Answered where the peer may then release its endpoint sooner. Nothing is sent after this.
    if (Backend::kAnswersBye && !bye_sent_) {
      bye_sent_ = send_control(Kind::kBye, sendw_.next_seq(), 0);
    }
    sink.on_closed(index_);
    moved = true;
  }
  return moved;
}

template <class Backend>
bool RmaChannel<Backend>::pump(RecvSink& sink) {
  Backend& b = backend();
  bool moved = false;
  const std::size_t room = slot_bytes_ - kPrefix;
  while (!sendq_.empty() && sendw_.can_send() && b.can_post()) {
    if (const DirectTarget* d = sendq_.direct()) {
      if (!pump_direct(sink, *d)) break;
      moved = true;
      continue;
    }
    char* const staging = b.staging();
    const SendQueue::Piece piece = sendq_.peek(room);
    std::optional<typename Backend::Source> source;
    if (send_in_place(piece.bytes, in_place_min_, iov_limit_)) {
      const SendQueue::Piece whole = sendq_.message();
      source = b.source(whole.data, whole.bytes);
    }
    const bool in_place = source.has_value();
    const SendQueue::Fragment f = in_place ? sendq_.fill_header(staging + kPrefix, room)
                                           : sendq_.fill(staging + kPrefix, room);
    const Prefix p = data_prefix(f);
    std::memcpy(staging, &p, kPrefix);
    // In place: the prefix (and header) from the staging buffer, the payload from where it
    // lies; else all of it from the staging buffer.
    if (in_place) {
      const Gather<typename Backend::Source> g{piece.data, piece.bytes, *source};
      if (!b.post_fragment(p.seq, kPrefix + (f.first ? sizeof(FrameHeader) : 0), &g)) break;
    } else if (!b.post_fragment(p.seq, kPrefix + p.bytes, nullptr)) {
      break;
    }
    took(true);
    moved = true;
    if (in_place) b.hold_posted(in_place_.posted());
    report(sink, sendq_.commit(f));
  }
  return moved;
}

template <class Backend>
bool RmaChannel<Backend>::pump_direct(RecvSink& sink, const DirectTarget& d) {
  Backend& b = backend();
  // The payload is read where it lies, so it needs a registration (where the provider wants
  // one); without it the message goes through slots after all, if still possible.
  const SendQueue::Piece whole = sendq_.message();
  const auto source = b.source(whole.data, whole.bytes);
  if (!source) {
    if (!sendq_.started()) {
      sendq_.drop_direct();
      return true;
    }
    fail("the memory of a message being written directly can no longer be registered");
  }
  const std::uint32_t seq = sendw_.next_seq();
  if (!sendq_.started()) {
    // First fragment: the header and where the payload goes, in a slot.
    char* const staging = b.staging();
    const SendQueue::Fragment f = sendq_.fill_direct_header(staging + kPrefix, write_max_);
    Prefix p = data_prefix(f);
    p.direct = 1;
    std::memcpy(staging, &p, kPrefix);
    if (!b.post_fragment(seq, kPrefix + f.bytes, nullptr)) return false;
    took(true);
    report(sink, sendq_.commit_direct(0));
    return true;
  }
  // A payload write, straight from the caller's memory into the peer's window.
  const SendQueue::Piece piece = sendq_.piece(write_max_);
  if (!b.post_write(seq, piece, *source, d.addr + sendq_.offset(), d.key)) return false;
  took(false);
  b.hold_posted(in_place_.posted());
  report(sink, sendq_.commit_direct(piece.bytes));  // d is gone once this was the last write
  return true;
}

template <class Backend>
void RmaChannel<Backend>::close() {
  Backend& b = backend();
  if (closed_ || !b.opened()) return;
  if (!b.connected()) {
    // Setup failed before the peer was known: there is no one to say goodbye to.
    closed_ = true;
    drop_queued();
    return;
  }
  NullSink null_sink;
  const auto deadline = Clock::now() + kCloseLinger;
  try {
    // Hand over what is queued while the peer takes it, then say goodbye once it is out; what
    // arrives meanwhile is not delivered (its operations are gone) but credits are honoured.
    while (!peer_bye_ && !sendq_.empty() && Clock::now() < deadline) {
      b.drain();
      pump(null_sink);
      b.flush();
    }
    // Without answering goodbyes, a peer that said goodbye first has nothing left to hear.
    while ((Backend::kAnswersBye || !peer_bye_) && !bye_sent_ && Clock::now() < deadline) {
      bye_sent_ = send_control(Kind::kBye, sendw_.next_seq(), 0);
      b.flush();
      if (!bye_sent_) b.drain();
    }
    // The goodbye must have left before the endpoint goes.
    while (b.in_flight() && Clock::now() < deadline) b.drain();
  } catch (const Error&) {
    // Closing anyway.
  }
  closed_ = true;
  drop_queued();
}

}  // namespace dear::transport::rma
