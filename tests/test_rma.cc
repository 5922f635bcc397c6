// The pieces of a slot-staged channel that need no network, shared by the libfabric and
// ibverbs back-ends (transport/rma/): the slot/credit protocol (slot_window.h) and the
// fragmenting and reassembly of messages (fragments.h), and the registrations behind direct-write
// windows (window_registrations.h). Every build runs them, with or
// without libfabric, rdma-core or an RDMA device.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <deque>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "dear/error.h"
#include "transport/link.h"
#include "transport/rma/fragments.h"
#include "transport/rma/slot_region.h"
#include "transport/rma/slot_window.h"
#include "transport/rma/window_registrations.h"

namespace dear::testing {
namespace {

using transport::FrameHeader;
using transport::RecvTarget;
using transport::rma::InPlaceSends;
using transport::rma::kControlSlots;
using transport::rma::Reassembler;
using transport::rma::RecvWindow;
using transport::rma::SendQueue;
using transport::rma::SendWindow;

// ---- slot/credit bookkeeping
// -------------------------------------------------------------

TEST(SlotWindow, SenderSpendsOneCreditPerFragmentAndStopsAtZero) {
  SendWindow w(4);
  for (std::uint32_t i = 0; i < 4; ++i) {
    ASSERT_TRUE(w.can_send());
    EXPECT_EQ(w.take(), i);
  }
  EXPECT_FALSE(w.can_send());
  EXPECT_EQ(w.unacknowledged(), 4u);
  EXPECT_FALSE(w.on_returned(5)) << "more credits than outstanding is a protocol violation";
  EXPECT_EQ(w.credits(), 0u);
  EXPECT_TRUE(w.on_returned(3));
  EXPECT_EQ(w.credits(), 3u);
  EXPECT_EQ(w.next_seq(), 4u);
  EXPECT_THROW(SendWindow(0), Error);
}

TEST(SlotWindow, ReceiverHandsOutFragmentsInSequenceWhateverTheArrivalOrder) {
  RecvWindow w(4, 2);
  EXPECT_FALSE(w.next_ready());
  ASSERT_TRUE(w.arrived(2, 12));
  ASSERT_TRUE(w.arrived(1, 11));
  EXPECT_FALSE(w.next_ready()) << "fragment 0 has not arrived";
  ASSERT_TRUE(w.arrived(0, 10));
  std::vector<std::uint32_t> order;
  while (auto b = w.next_ready()) {
    order.push_back(*b);
    w.consume();
  }
  EXPECT_EQ(order, (std::vector<std::uint32_t>{10, 11, 12}));
  EXPECT_EQ(w.expected(), 3u);
  EXPECT_EQ(w.owed(), 3u);
  EXPECT_TRUE(w.should_return());
  EXPECT_EQ(w.take_owed(), 3u);
  EXPECT_EQ(w.owed(), 0u);
  EXPECT_FALSE(w.should_return());
}

TEST(SlotWindow, ReceiverRejectsDuplicatesAndFragmentsOutsideTheWindow) {
  RecvWindow w(4, 2);
  EXPECT_FALSE(w.arrived(4, 0)) << "seq 4 needs a fifth slot";
  EXPECT_TRUE(w.arrived(3, 0));
  EXPECT_FALSE(w.arrived(3, 1)) << "duplicate";
  EXPECT_FALSE(w.arrived(0xffffffffU, 1)) << "behind the window";
  EXPECT_THROW(w.consume(), Error) << "fragment 0 has not arrived";
  EXPECT_THROW(RecvWindow(4, 5), Error);
  EXPECT_THROW(RecvWindow(4, 0), Error);
}

TEST(SlotWindow, SequenceNumbersWrapAround) {
  const std::uint32_t start = 0xfffffffdU;
  SendWindow s(4, start);
  RecvWindow r(4, 2, start);
  std::uint32_t delivered = 0;
  for (int round = 0; round < 3; ++round) {
    std::vector<std::uint32_t> seqs;
    while (s.can_send()) seqs.push_back(s.take());
    std::reverse(seqs.begin(), seqs.end());  // arrive backwards
    for (const auto q : seqs) ASSERT_TRUE(r.arrived(q, q % 4)) << "seq " << q;
    while (auto b = r.next_ready()) {
      EXPECT_EQ(*b, (start + delivered) % 4);
      r.consume();
      ++delivered;
    }
    ASSERT_TRUE(s.on_returned(r.take_owed()));
  }
  EXPECT_EQ(delivered, 12u);
  EXPECT_EQ(r.expected(), start + 12u) << "wrapped past 2^32";
  EXPECT_FALSE(r.arrived(start + 8u, 0)) << "already consumed, before the wrap";
}

// Both ends of a channel, joined by a "network" that delivers in a random
// order, run the protocol of slot_window.h as FabricChannel does: fragments
// spend credits, credits return piggybacked or in control messages once
// `threshold` are owed. Checks: every fragment is delivered once and in order,
// no side deadlocks, and no more control messages are ever in flight than
// kControlSlots allows.
TEST(SlotWindow, SimulatedChannelNeverDeadlocksAndBoundsControlMessages) {
  struct Msg {
    bool control;
    std::uint32_t seq;
    std::uint32_t credits;
  };
  struct Side {
    SendWindow send{8};
    RecvWindow recv{8, 4};
    std::uint32_t to_send = 0;    // fragments still to send
    std::uint32_t delivered = 0;  // fragments received in order
    std::deque<Msg> inbox;        // arrived, not processed
    std::uint32_t control_in_flight = 0;
  };
  std::mt19937 rng(7);
  for (int trial = 0; trial < 50; ++trial) {
    Side side[2];
    side[0].to_send = 200 + rng() % 100;
    side[1].to_send = rng() % 2 == 0 ? 0 : rng() % 300;  // one-way and two-way traffic
    std::vector<std::pair<int, Msg>> network;            // (destination, message)
    std::uint32_t max_control = 0;
    for (int step = 0; step < 100000; ++step) {
      const bool done = side[0].to_send == 0 && side[1].to_send == 0 && network.empty() &&
                        side[0].inbox.empty() && side[1].inbox.empty();
      if (done) break;
      const int who = static_cast<int>(rng() % 3);
      if (who == 2 && !network.empty()) {
        // The network delivers any message in flight: order is not preserved.
        const std::size_t k = rng() % network.size();
        side[network[k].first].inbox.push_back(network[k].second);
        network.erase(network.begin() + static_cast<std::ptrdiff_t>(k));
        continue;
      }
      const int me = who % 2;
      Side& s = side[me];
      Side& peer = side[1 - me];
      // Receive: arrivals, then in-order delivery.
      while (!s.inbox.empty()) {
        const Msg m = s.inbox.front();
        s.inbox.pop_front();
        ASSERT_TRUE(s.send.on_returned(m.credits));
        if (m.control) {
          --s.control_in_flight;  // counted at the receiver, reposted at once
          continue;
        }
        ASSERT_TRUE(s.recv.arrived(m.seq, m.seq % 8));
      }
      while (s.recv.next_ready()) {
        s.recv.consume();
        ++s.delivered;
      }
      // Send data, piggybacking credits; then a control message if enough are
      // owed.
      while (s.to_send > 0 && s.send.can_send() && rng() % 4 != 0) {
        network.push_back({1 - me, Msg{false, s.send.take(), s.recv.take_owed()}});
        --s.to_send;
      }
      if (s.recv.should_return()) {
        network.push_back({1 - me, Msg{true, 0, s.recv.take_owed()}});
        ++peer.control_in_flight;
        max_control = std::max(max_control, peer.control_in_flight);
      }
    }
    EXPECT_TRUE(side[0].to_send == 0 && side[1].to_send == 0 && network.empty())
        << "trial " << trial << " deadlocked";
    EXPECT_LE(max_control, kControlSlots - 1) << "control messages in flight, trial " << trial;
  }
}

// ---- fragmenting (SendQueue)
// -------------------------------------------------------------

constexpr std::size_t kHeader = sizeof(FrameHeader);

FrameHeader header_of(std::uint32_t bytes, std::uint64_t seq) {
  FrameHeader h;
  h.bytes = bytes;
  h.seq = seq;
  return h;
}

std::vector<char> pattern(std::size_t n, int salt) {
  std::vector<char> v(n);
  for (std::size_t i = 0; i < n; ++i)
    v[i] = static_cast<char>((i * 7 + salt * 13 + i / 251) & 0xff);
  return v;
}

TEST(SendQueue, FirstFragmentCarriesTheHeaderAndTheTokenComesWithTheLast) {
  SendQueue q;
  const std::vector<char> payload = pattern(250, 1);
  q.push(header_of(250, 42), payload.data(), 7);
  EXPECT_EQ(q.size(), 1u);
  EXPECT_EQ(q.bytes(), 250u);
  std::vector<char> body(128);
  std::vector<char> got;
  std::vector<std::uint32_t> sizes;
  std::optional<std::uint64_t> token;
  for (int i = 0; i < 10 && !token; ++i) {
    const SendQueue::Fragment f = q.fill(body.data(), body.size());
    EXPECT_EQ(f.first, i == 0);
    sizes.push_back(f.bytes);
    const char* data = body.data();
    const char* end = body.data() + f.bytes;
    if (f.first) {
      FrameHeader h;
      std::memcpy(&h, data, kHeader);
      EXPECT_EQ(h.seq, 42u);
      EXPECT_EQ(h.bytes, 250u);
      data += kHeader;
    }
    got.insert(got.end(), data, end);
    token = q.commit(f);
    if (!token) {
      EXPECT_EQ(q.bytes(), 250u) << "bytes count until the message is fragmented";
    }
  }
  EXPECT_EQ(sizes, (std::vector<std::uint32_t>{128, 128, 26}));
  ASSERT_TRUE(token);
  EXPECT_EQ(*token, 7u);
  EXPECT_EQ(got, payload);
  EXPECT_TRUE(q.empty());
  EXPECT_EQ(q.bytes(), 0u);
}

TEST(SendQueue, EmptyMessageIsOneHeaderOnlyFragment) {
  SendQueue q;
  q.push(header_of(0, 1), nullptr, 11);
  std::vector<char> body(64);
  const SendQueue::Fragment f = q.fill(body.data(), body.size());
  EXPECT_TRUE(f.first);
  EXPECT_EQ(f.bytes, kHeader);
  EXPECT_EQ(q.commit(f), std::optional<std::uint64_t>(11));
  EXPECT_TRUE(q.empty());
}

TEST(SendQueue, FillingAgainWithoutCommitGivesTheSameFragment) {
  // A transport that refuses a fragment for now (EAGAIN) fills the same one again later.
  SendQueue q;
  const std::vector<char> payload = pattern(300, 2);
  q.push(header_of(300, 1), payload.data(), 1);
  std::vector<char> a(100), b(100);
  (void)q.commit(q.fill(a.data(), a.size()));
  const SendQueue::Fragment f1 = q.fill(a.data(), a.size());
  const SendQueue::Fragment f2 = q.fill(b.data(), b.size());
  EXPECT_EQ(f1.bytes, f2.bytes);
  EXPECT_EQ(f1.first, f2.first);
  EXPECT_EQ(a, b);
  EXPECT_FALSE(f1.first);
  EXPECT_EQ(std::memcmp(a.data(), payload.data() + (100 - kHeader), 100), 0);
}

TEST(SendQueue, BoundedFirstInFirstOutAndClear) {
  SendQueue q;
  const char byte = 'x';
  for (std::size_t i = 0; i < SendQueue::kCapacity; ++i) {
    ASSERT_FALSE(q.full());
    q.push(header_of(1, i), &byte, 100 + i);
  }
  EXPECT_TRUE(q.full());
  EXPECT_EQ(q.bytes(), SendQueue::kCapacity);
  EXPECT_THROW(q.push(header_of(1, 0), &byte, 0), Error);
  std::vector<char> body(64);
  for (std::size_t i = 0; i < 3; ++i) {
    EXPECT_EQ(q.commit(q.fill(body.data(), body.size())), std::optional<std::uint64_t>(100 + i));
  }
  EXPECT_EQ(q.size(), SendQueue::kCapacity - 3);
  q.clear();
  EXPECT_TRUE(q.empty());
  EXPECT_EQ(q.bytes(), 0u);
  EXPECT_THROW((void)q.fill(body.data(), body.size()), Error);
}

// The gather form (fill_header + peek) cuts the same fragments as fill(), and the header plus
// the pieces it points at are, byte for byte, what fill() copies.
TEST(SendQueue, GatherFormMatchesTheCopyingForm) {
  SendQueue copying;
  SendQueue gathering;
  const std::vector<char> a = pattern(250, 3);
  const std::vector<char> b = pattern(64, 4);
  for (SendQueue* q : {&copying, &gathering}) {
    q->push(header_of(250, 1), a.data(), 1);
    q->push(header_of(0, 2), nullptr, 2);
    q->push(header_of(64, 3), b.data(), 3);
  }
  std::vector<std::uint64_t> tokens;
  const std::size_t room = 100;
  while (!copying.empty()) {
    ASSERT_FALSE(gathering.empty());
    std::vector<char> want(room);
    const SendQueue::Fragment fc = copying.fill(want.data(), room);
    std::vector<char> header(room, '\0');
    const SendQueue::Piece piece = gathering.peek(room);
    const SendQueue::Fragment fg = gathering.fill_header(header.data(), room);
    EXPECT_EQ(fg.bytes, fc.bytes);
    EXPECT_EQ(fg.first, fc.first);
    EXPECT_EQ(piece.first, fc.first);
    const std::size_t head = fg.first ? kHeader : 0;
    ASSERT_EQ(head + piece.bytes, fg.bytes);
    std::vector<char> got(header.begin(), header.begin() + static_cast<std::ptrdiff_t>(head));
    if (piece.bytes > 0) got.insert(got.end(), piece.data, piece.data + piece.bytes);
    want.resize(fc.bytes);
    EXPECT_EQ(got, want);
    const auto tc = copying.commit(fc);
    const auto tg = gathering.commit(fg);
    EXPECT_EQ(tc, tg);
    if (tg) tokens.push_back(*tg);
  }
  EXPECT_TRUE(gathering.empty());
  EXPECT_EQ(tokens, (std::vector<std::uint64_t>{1, 2, 3}));
}

TEST(SendQueue, MessageIsTheWholePayloadOfTheHead) {
  SendQueue q;
  const std::vector<char> a = pattern(300, 5);
  q.push(header_of(300, 1), a.data(), 1);
  std::vector<char> body(100);
  (void)q.commit(q.fill(body.data(), body.size()));
  const SendQueue::Piece m = q.message();
  EXPECT_EQ(m.data, a.data());
  EXPECT_EQ(m.bytes, 300u);
  EXPECT_FALSE(m.first);
  const SendQueue::Piece p = q.peek(body.size());
  EXPECT_EQ(p.data, a.data() + (100 - kHeader));
  EXPECT_EQ(p.bytes, 100u);
}

// ---- in-place sends (send_in_place, InPlaceSends)
// ---------------------------------------------------------------

TEST(InPlace, LargePiecesOnGatheringProvidersOnly) {
  using transport::rma::send_in_place;
  EXPECT_TRUE(send_in_place(8192, 8192, 2));
  EXPECT_TRUE(send_in_place(1 << 20, 8192, 4));
  EXPECT_FALSE(send_in_place(8191, 8192, 4)) << "small pieces are copied";
  EXPECT_FALSE(send_in_place(1 << 20, 8192, 1)) << "the provider cannot gather";
  EXPECT_FALSE(send_in_place(1 << 20, 0, 4)) << "0 turns in-place sends off";
  EXPECT_FALSE(send_in_place(0, 1, 4));
}

TEST(InPlace, MessageWithoutInPlaceFragmentsIsSentAtOnce) {
  InPlaceSends s(4);
  EXPECT_EQ(s.finished(7), std::optional<std::uint64_t>(7));
  EXPECT_EQ(s.held(), 0u);
}

TEST(InPlace, MessageIsSentWhenItsLastFragmentCompletesInAnyOrder) {
  InPlaceSends s(4);
  const std::uint32_t a = s.posted();
  const std::uint32_t b = s.posted();
  EXPECT_EQ(a, b) << "fragments of one message share a record";
  EXPECT_EQ(s.finished(1), std::nullopt);
  EXPECT_EQ(s.held(), 1u);
  const std::uint32_t c = s.posted();  // the next message
  EXPECT_NE(c, a);
  EXPECT_EQ(s.completed(c), std::nullopt) << "its message is not finished";
  EXPECT_EQ(s.completed(a), std::nullopt);
  EXPECT_EQ(s.completed(b), std::optional<std::uint64_t>(1));
  EXPECT_EQ(s.held(), 0u);
  EXPECT_EQ(s.finished(2), std::optional<std::uint64_t>(2)) << "nothing of it outstanding";
  EXPECT_THROW((void)s.completed(a), Error) << "a completion the record does not expect";
}

TEST(InPlace, RecordsAreReusedAndBounded) {
  // Capacity = fragments in flight + 1: one message per fragment in flight, plus the one
  // being fragmented, never run out; one more does.
  InPlaceSends s(3);
  std::vector<std::uint32_t> ids;
  for (std::uint64_t t = 0; t < 2; ++t) {
    ids.push_back(s.posted());
    EXPECT_EQ(s.finished(t), std::nullopt);
  }
  ids.push_back(s.posted());
  EXPECT_THROW(
      {
        EXPECT_EQ(s.finished(9), std::nullopt);
        (void)s.posted();
      },
      Error);
  for (std::size_t round = 0; round < 100; ++round) {
    const std::uint32_t id = ids[round % ids.size()];
    const auto sent = s.completed(id);
    ASSERT_TRUE(sent.has_value());
    ids[round % ids.size()] = s.posted();
    EXPECT_EQ(s.finished(1000 + round), std::nullopt);
  }
  EXPECT_EQ(s.held(), 3u);
  s.clear();
  EXPECT_EQ(s.held(), 0u);
  EXPECT_EQ(s.finished(5), std::optional<std::uint64_t>(5));
}

// ---- reassembly (Reassembler)
// ------------------------------------------------------------

// Records what a RecvSink is told, checking the link contract's promises for kStream pieces.
struct RecordingSink final : transport::RecvSink {
  RecvTarget::Mode mode = RecvTarget::kDirect;
  std::size_t unit = 1;
  std::vector<std::vector<char>> messages;  // payloads, in the order on_message() came
  std::vector<std::uint64_t> seqs;
  std::vector<char> current;
  std::size_t streamed = 0;  // kStream: next offset on_payload must give
  std::size_t pieces = 0;
  std::string broken;  // first broken promise
  RecvTarget on_header(int, const FrameHeader& h) override {
    current.assign(h.bytes, 0);
    streamed = 0;
    return {mode, current.data(), unit};
  }
  void on_payload(int, const FrameHeader& h, const char* data, std::size_t offset,
                  std::size_t len) override {
    ++pieces;
    if (!broken.empty()) return;
    if (offset != streamed) broken = "offset " + std::to_string(offset) + " out of order";
    if (offset + len != h.bytes && len % unit != 0) broken = "a piece of part units";
    if (reinterpret_cast<std::uintptr_t>(data) % unit != 0) broken = "a misaligned piece";
    if (offset + len > current.size()) broken = "a piece past the message";
    if (!broken.empty()) return;
    std::memcpy(current.data() + offset, data, len);
    streamed += len;
  }
  void on_message(int, const FrameHeader& h) override {
    if (mode == RecvTarget::kStream && streamed != h.bytes && broken.empty()) {
      broken = "streamed " + std::to_string(streamed) + " of " + std::to_string(h.bytes);
    }
    messages.push_back(mode == RecvTarget::kDiscard ? std::vector<char>{} : current);
    seqs.push_back(h.seq);
  }
  void on_sent(int, std::uint64_t) override {}
  void on_closed(int) override {}
};

// Carries `sizes` through a SendQueue and a Reassembler, each fragment body staged at
// `body_offset` into a 64-byte aligned slot of `room` + body_offset bytes.
void round_trip(RecordingSink& sink, const std::vector<std::size_t>& sizes, std::size_t room,
                std::size_t body_offset) {
  SendQueue q;
  Reassembler r(room + body_offset);
  std::vector<std::vector<char>> payloads;
  for (std::size_t m = 0; m < sizes.size(); ++m)
    payloads.push_back(pattern(sizes[m], static_cast<int>(m)));
  std::size_t next = 0;
  std::vector<std::uint64_t> sent;
  std::vector<char, std::allocator<char>> storage(room + body_offset + 64);
  char* slot = storage.data() + (64 - reinterpret_cast<std::uintptr_t>(storage.data()) % 64) % 64;
  while (next < sizes.size() || !q.empty()) {
    while (next < sizes.size() && !q.full()) {
      q.push(header_of(static_cast<std::uint32_t>(sizes[next]), next), payloads[next].data(), next);
      ++next;
    }
    const SendQueue::Fragment f = q.fill(slot + body_offset, room);
    ASSERT_LE(f.bytes, room);
    const auto bad = r.on_fragment(sink, 0, slot + body_offset, f.bytes, f.first);
    ASSERT_FALSE(bad) << *bad;
    if (const auto token = q.commit(f)) sent.push_back(*token);
  }
  EXPECT_FALSE(r.in_message());
  ASSERT_EQ(sent.size(), sizes.size());
  ASSERT_EQ(sink.messages.size(), sizes.size());
  for (std::size_t m = 0; m < sizes.size(); ++m) {
    EXPECT_EQ(sent[m], m);
    EXPECT_EQ(sink.seqs[m], m);
    if (sink.mode != RecvTarget::kDiscard) {
      EXPECT_EQ(sink.messages[m], payloads[m]) << "message " << m << " of " << sizes[m] << " bytes";
    }
  }
  EXPECT_EQ(sink.broken, "");
}

const std::vector<std::size_t> kSizes = {0, 1, 31, 32, 33, 96, 1000, 4096, 70001};

TEST(Reassembler, DirectMessagesArriveWholeAcrossFragments) {
  for (const std::size_t room : {64u, 992u, 1000u}) {
    RecordingSink sink;
    round_trip(sink, kSizes, room, 32);
    EXPECT_EQ(sink.pieces, 0u) << "kDirect copies; no on_payload";
  }
}

TEST(Reassembler, StreamPiecesAreWholeAlignedUnitsInOrder) {
  // Units up to 64 bytes; bodies at the prefix's 32 bytes into the slot (as the back-ends put
  // them) and at an odd offset; rooms that are and are not multiples of the unit, so both the
  // carry (a unit split between fragments) and the bounce buffer (a misaligned run) are used.
  for (const std::size_t unit : {1u, 2u, 4u, 8u, 16u, 64u}) {
    for (const std::size_t room : {992u, 1000u, 4064u}) {
      for (const std::size_t offset : {32u, 3u}) {
        RecordingSink sink;
        sink.mode = RecvTarget::kStream;
        sink.unit = unit;
        std::vector<std::size_t> sizes;
        for (const std::size_t s : kSizes) sizes.push_back(s / unit * unit);
        round_trip(sink, sizes, room, offset);
        ASSERT_EQ(sink.broken, "") << "unit " << unit << " room " << room << " offset " << offset;
      }
    }
  }
}

TEST(Reassembler, StreamTailShorterThanAUnitComesLast) {
  RecordingSink sink;
  sink.mode = RecvTarget::kStream;
  sink.unit = 8;
  round_trip(sink, {13, 1005}, 1000, 32);
  EXPECT_EQ(sink.broken, "");
}

TEST(Reassembler, DiscardDeliversNoPayloadButEveryMessage) {
  RecordingSink sink;
  sink.mode = RecvTarget::kDiscard;
  round_trip(sink, kSizes, 1000, 32);
  EXPECT_EQ(sink.pieces, 0u);
}

TEST(Reassembler, ProtocolViolationsAreNamed) {
  RecordingSink sink;
  std::vector<char> body(256, 0);
  const FrameHeader h = header_of(100, 1);
  std::memcpy(body.data(), &h, kHeader);
  {
    Reassembler r(256);
    const auto bad = r.on_fragment(sink, 0, body.data(), 64, false);
    ASSERT_TRUE(bad);
    EXPECT_NE(bad->find("starts mid-message"), std::string::npos) << *bad;
    EXPECT_TRUE(r.on_fragment(sink, 0, body.data(), kHeader - 1, true)) << "a short first body";
  }
  {
    Reassembler r(256);
    ASSERT_FALSE(r.on_fragment(sink, 0, body.data(), kHeader + 40, true));
    EXPECT_TRUE(r.in_message());
    const auto inside = r.on_fragment(sink, 0, body.data(), kHeader, true);
    ASSERT_TRUE(inside);
    EXPECT_NE(inside->find("starts inside another"), std::string::npos) << *inside;
    const auto more = r.on_fragment(sink, 0, body.data(), 61, false);
    ASSERT_TRUE(more);
    EXPECT_NE(more->find("more payload than the header's 100 bytes"), std::string::npos) << *more;
  }
  {
    Reassembler r(256);
    sink.mode = RecvTarget::kStream;
    sink.unit = 128;
    const auto unit = r.on_fragment(sink, 0, body.data(), kHeader, true);
    ASSERT_TRUE(unit);
    EXPECT_NE(unit->find("stream unit of 128 bytes is not supported"), std::string::npos) << *unit;
  }
}

// ---- direct messages (a payload written straight into the receiver's window)
// ------------------------------------------------------------

using transport::rma::DirectInfo;
using transport::rma::DirectTarget;

// A direct message leaves the queue as a first fragment holding its header and DirectInfo,
// then as pieces of the payload in order; the token comes with the last piece, and a slot
// message behind it is fragmented as usual.
TEST(SendQueue, DirectMessageIsAHeaderFragmentThenPayloadPieces) {
  SendQueue q;
  const std::vector<char> payload = pattern(250, 3);
  const std::vector<char> other = pattern(40, 4);
  q.push(header_of(250, 9), payload.data(), 5, DirectTarget{0x1000, 77, 0x7000});
  q.push(header_of(40, 10), other.data(), 6);
  ASSERT_NE(q.direct(), nullptr);
  EXPECT_EQ(q.direct()->addr, 0x1000u);
  EXPECT_EQ(q.direct()->key, 77u);
  EXPECT_FALSE(q.started());
  std::vector<char> body(128);
  const SendQueue::Fragment f = q.fill_direct_header(body.data(), 100);
  EXPECT_TRUE(f.first);
  EXPECT_EQ(f.bytes, kHeader + sizeof(DirectInfo));
  FrameHeader h;
  DirectInfo info;
  std::memcpy(&h, body.data(), kHeader);
  std::memcpy(&info, body.data() + kHeader, sizeof(info));
  EXPECT_EQ(h.seq, 9u);
  EXPECT_EQ(h.bytes, 250u);
  EXPECT_EQ(info.local, 0x7000u);
  EXPECT_EQ(info.write_bytes, 100u);
  EXPECT_FALSE(q.commit_direct(0)) << "the header fragment does not end the message";
  EXPECT_TRUE(q.started());
  std::vector<char> got;
  std::vector<std::size_t> offsets;
  std::optional<std::uint64_t> token;
  for (int i = 0; i < 5 && !token; ++i) {
    const SendQueue::Piece p = q.piece(100);
    offsets.push_back(q.offset());
    got.insert(got.end(), p.data, p.data + p.bytes);
    token = q.commit_direct(p.bytes);
  }
  EXPECT_EQ(offsets, (std::vector<std::size_t>{0, 100, 200}));
  ASSERT_TRUE(token);
  EXPECT_EQ(*token, 5u);
  EXPECT_EQ(got, payload);
  ASSERT_EQ(q.size(), 1u);
  EXPECT_EQ(q.direct(), nullptr) << "the next message goes through slots";
  EXPECT_EQ(q.bytes(), 40u);
}

// A direct message not yet started can still go through slots (its payload memory could not
// be registered); once started it cannot.
TEST(SendQueue, DirectMessageFallsBackToSlotsOnlyBeforeItStarts) {
  SendQueue q;
  const std::vector<char> payload = pattern(50, 5);
  q.push(header_of(50, 1), payload.data(), 1, DirectTarget{1, 2, 3});
  q.drop_direct();
  EXPECT_EQ(q.direct(), nullptr);
  std::vector<char> body(128);
  const SendQueue::Fragment f = q.fill(body.data(), body.size());
  EXPECT_EQ(f.bytes, kHeader + 50);
  EXPECT_EQ(q.commit(f), std::optional<std::uint64_t>(1));
  q.push(header_of(50, 2), payload.data(), 2, DirectTarget{1, 2, 3});
  (void)q.fill_direct_header(body.data(), 64);
  EXPECT_FALSE(q.commit_direct(0));
  EXPECT_THROW(q.drop_direct(), Error);
}

// The receiver of a direct message: the sink must place it kDirect exactly where the writes
// put it; then the writes complete it, without a copy. Anything else is a named violation.
TEST(Reassembler, DirectWritesCompleteAMessageWhereTheSinkPlacesIt) {
  RecordingSink sink;
  std::vector<char> body(kHeader + sizeof(DirectInfo));
  auto start = [&](Reassembler& r, std::uint64_t local, std::uint32_t bytes,
                   std::uint64_t write_bytes, std::size_t* per_write) {
    const FrameHeader h = header_of(bytes, 4);
    const DirectInfo info{local, write_bytes};
    std::memcpy(body.data(), &h, kHeader);
    std::memcpy(body.data() + kHeader, &info, sizeof(info));
    return r.on_direct_header(sink, 0, body.data(), body.size(), per_write);
  };
  {
    // RecordingSink places each message in `current`, which on_header sizes: its address is
    // known only afterwards, so the first try names the mismatch and the second matches.
    Reassembler r(256);
    std::size_t per_write = 0;
    const auto wrong = start(r, 0x10, 300, 128, &per_write);
    ASSERT_TRUE(wrong);
    EXPECT_NE(wrong->find("directly where this rank does not place it"), std::string::npos)
        << *wrong;
    Reassembler r2(256);
    const auto local = reinterpret_cast<std::uint64_t>(sink.current.data());
    ASSERT_FALSE(start(r2, local, 300, 128, &per_write));
    EXPECT_EQ(per_write, 128u);
    EXPECT_TRUE(r2.in_direct());
    EXPECT_EQ(r2.remaining(), 300u);
    EXPECT_EQ(reinterpret_cast<std::uint64_t>(r2.direct_destination()), local);
    const auto slot = r2.on_fragment(sink, 0, body.data(), 10, false);
    ASSERT_TRUE(slot);
    EXPECT_NE(slot->find("slot fragment inside a direct message"), std::string::npos) << *slot;
    const std::size_t before = sink.messages.size();
    ASSERT_FALSE(r2.on_placed(sink, 0, 128));
    ASSERT_FALSE(r2.on_placed(sink, 0, 128));
    EXPECT_EQ(sink.messages.size(), before) << "not complete before its last write";
    ASSERT_FALSE(r2.on_placed(sink, 0, 44));
    EXPECT_EQ(sink.messages.size(), before + 1);
    EXPECT_FALSE(r2.in_message());
    EXPECT_EQ(r2.direct_destination(), nullptr);
    EXPECT_EQ(sink.pieces, 0u);
    const auto outside = r2.on_placed(sink, 0, 1);
    ASSERT_TRUE(outside);
    EXPECT_NE(outside->find("direct write outside a direct message"), std::string::npos);
  }
  {
    Reassembler r(256);
    sink.mode = RecvTarget::kStream;  // a sink that reduces cannot take a direct write
    std::size_t per_write = 0;
    const auto local = reinterpret_cast<std::uint64_t>(sink.current.data());
    EXPECT_TRUE(start(r, local, 300, 128, &per_write));
    sink.mode = RecvTarget::kDirect;
    Reassembler r2(256);
    EXPECT_TRUE(start(r2, local, 0, 128, &per_write)) << "a direct message of no bytes";
    Reassembler r3(256);
    EXPECT_TRUE(start(r3, local, 300, 0, &per_write)) << "writes of no bytes";
  }
}

// ---- one-sided writes into the receiver's slots (slot_region.h)
// ----------------------------------------------------------

using transport::rma::kPrefix;
using transport::rma::Prefix;
using transport::rma::SlotRegion;

TEST(SlotRegion, FragmentsGoToSlotSeqModuloSlotsAcrossTheWrap) {
  SlotRegion r;
  r.base = 1 << 20;
  r.key = 77;
  r.slot_bytes = 4096 + 64;
  r.slots = 8;
  for (const std::uint32_t seq : {0u, 1u, 7u, 8u, 123u, 0xfffffffeu, 0xffffffffu}) {
    EXPECT_EQ(transport::rma::slot_address(r, seq), r.base + (seq % 8) * r.slot_bytes) << seq;
  }
  // Any `slots` consecutive fragments, across the wrap too, go to distinct slots (why slot
  // counts are powers of two: check_slot_options).
  std::vector<bool> used(r.slots, false);
  for (std::uint32_t k = 0; k < r.slots; ++k) {
    const std::uint32_t seq = 0xfffffffcu + k;
    const std::uint64_t slot = (transport::rma::slot_address(r, seq) - r.base) / r.slot_bytes;
    ASSERT_LT(slot, r.slots);
    EXPECT_FALSE(used[slot]) << "fragment " << seq << " shares slot " << slot;
    used[slot] = true;
  }
  r.slots = 0;
  EXPECT_THROW((void)transport::rma::slot_address(r, 1), Error);
}

TEST(SlotRegion, BaseIsAVirtualAddressOrAnOffset) {
  std::vector<char> mem(256);
  const auto at = static_cast<std::uint64_t>(reinterpret_cast<std::uintptr_t>(mem.data()));
  EXPECT_EQ(transport::rma::region_base(mem.data(), 64, true), at + 64);
  EXPECT_EQ(transport::rma::region_base(mem.data(), 64, false), 64u);
  EXPECT_EQ(transport::rma::region_base(mem.data(), 0, false), 0u);
}

TEST(SlotRegion, RecordSurvivesTheBytesOfTheExchange) {
  SlotRegion r;
  r.base = 0x7f0012345000ULL;
  r.key = 0xfedcba9876543210ULL;
  r.slot_bytes = (1 << 20) + 4096;
  r.slots = 8;
  std::array<char, sizeof(SlotRegion)> wire{};
  std::memcpy(wire.data(), &r, sizeof(r));
  SlotRegion back;
  std::memcpy(&back, wire.data(), sizeof(back));
  EXPECT_EQ(back.base, r.base);
  EXPECT_EQ(back.key, r.key);
  EXPECT_EQ(back.slot_bytes, r.slot_bytes);
  EXPECT_EQ(back.slots, r.slots);
  EXPECT_EQ(transport::rma::slot_address(back, 11), r.base + 3 * r.slot_bytes);
}

TEST(SlotRegion, PeersWithOtherSlotsAreNamedWithBothViews) {
  SlotRegion r;
  r.slot_bytes = 131072;
  r.slots = 8;
  EXPECT_FALSE(transport::rma::check_region(r, 131072, 8, 0, 1));
  const auto fewer = transport::rma::check_region(r, 131072, 4, 2, 5);
  ASSERT_TRUE(fewer);
  EXPECT_NE(fewer->find("rank 5 offers 8 slots of 131072 bytes"), std::string::npos) << *fewer;
  EXPECT_NE(fewer->find("rank 2 has 4 of 131072"), std::string::npos) << *fewer;
  EXPECT_TRUE(transport::rma::check_region(r, 65536, 8, 0, 1));
  EXPECT_TRUE(transport::rma::check_region(SlotRegion{}, 131072, 8, 0, 1))
      << "a peer that published no slots (send data path) does not fit";
}

TEST(SlotRegion, WrittenPrefixMustMatchItsAnnouncement) {
  Prefix p;
  p.tag = 42;
  p.seq = 9;
  p.bytes = 1000;
  p.kind = transport::rma::Kind::kData;
  EXPECT_FALSE(transport::rma::check_written(p, 9, 42, 4096, std::nullopt));
  EXPECT_FALSE(transport::rma::check_written(p, 9, 42, 4096, kPrefix + 1000));
  EXPECT_FALSE(transport::rma::check_written(p, 9, 42, kPrefix + 1000, std::nullopt))
      << "a fragment filling its slot exactly";
  const auto expect = [&](const std::optional<std::string>& got, const std::string& part) {
    ASSERT_TRUE(got) << part;
    EXPECT_NE(got->find("fragment 9"), std::string::npos) << *got;
    EXPECT_NE(got->find(part), std::string::npos) << *got;
  };
  expect(transport::rma::check_written(p, 9, 43, 4096, std::nullopt), "another communicator");
  expect(transport::rma::check_written(p, 9, 42, kPrefix + 999, std::nullopt), "1000 bytes");
  expect(transport::rma::check_written(p, 9, 42, 4096, kPrefix + 999), "1031 bytes");
  Prefix stale = p;
  stale.seq = 1;  // the slot's previous occupant: the write has not landed where announced
  expect(transport::rma::check_written(stale, 9, 42, 4096, std::nullopt), "left fragment 1");
  Prefix credit = p;
  credit.kind = transport::rma::Kind::kCredit;
  expect(transport::rma::check_written(credit, 9, 42, 4096, std::nullopt), "of kind 2");
}

// A sender writing into a receiver's slots under the credit rules, with writes landing in a
// shuffled order and the receiver consuming at random moments: no write ever lands in a slot
// whose fragment has not been consumed, and every fragment is read back whole, in order.
TEST(SlotRegion, SimulatedWritesNeverOverwriteAnUnconsumedSlot) {
  // (With 6 slots, which check_slot_options refuses, fragments 2^32-2 and 2 share a slot and
  // some of these runs overwrite it.)
  constexpr std::uint32_t kSlots = 8;
  constexpr std::size_t kSlotBytes = 256;
  for (unsigned seed = 1; seed <= 20; ++seed) {
    SCOPED_TRACE("seed " + std::to_string(seed));
    std::mt19937 rng(seed);
    std::vector<char> memory(kSlots * kSlotBytes);
    SlotRegion region;
    region.base = 0;  // offset addressing
    region.slot_bytes = kSlotBytes;
    region.slots = kSlots;
    SendWindow send(kSlots, 0xfffffff0u);  // crosses the wrap
    RecvWindow recv(kSlots, kSlots / 2, 0xfffffff0u);
    std::vector<bool> occupied(kSlots, false);
    struct InFlight {
      std::uint32_t seq;
      std::vector<char> bytes;
    };
    std::vector<InFlight> flying;
    const std::uint32_t total = 500;
    std::uint32_t written = 0, consumed = 0, credits_in_flight = 0;
    const auto fill = [](std::uint32_t seq, std::size_t i) {
      return static_cast<char>((seq * 17 + i * 3) & 0xff);
    };
    while (consumed < total) {
      const int action = static_cast<int>(rng() % 4);
      if (action == 0 && written < total && send.can_send()) {
        const std::uint32_t seq = send.take();
        InFlight f{seq, std::vector<char>(kSlotBytes)};
        Prefix p;
        p.seq = seq;
        p.bytes = static_cast<std::uint32_t>(kSlotBytes - kPrefix);
        std::memcpy(f.bytes.data(), &p, kPrefix);
        for (std::size_t i = kPrefix; i < kSlotBytes; ++i) f.bytes[i] = fill(seq, i);
        flying.push_back(std::move(f));
        ++written;
      } else if (action == 1 && !flying.empty()) {
        // A write lands (any of those in flight) and is announced.
        const std::size_t k = rng() % flying.size();
        InFlight f = std::move(flying[k]);
        flying.erase(flying.begin() + static_cast<std::ptrdiff_t>(k));
        const std::uint64_t at = transport::rma::slot_address(region, f.seq);
        const std::size_t slot = static_cast<std::size_t>(at / kSlotBytes);
        ASSERT_FALSE(occupied[slot]) << "fragment " << f.seq << " overwrote an unconsumed slot";
        occupied[slot] = true;
        std::memcpy(memory.data() + at, f.bytes.data(), kSlotBytes);
        Prefix p;
        std::memcpy(&p, memory.data() + at, kPrefix);
        ASSERT_FALSE(transport::rma::check_written(p, f.seq, 0, kSlotBytes, kSlotBytes));
        ASSERT_FALSE(
            transport::rma::accept_fragment(recv, f.seq, static_cast<std::uint32_t>(slot)));
      } else if (action == 2) {
        while (auto slot = recv.next_ready()) {
          const char* body = memory.data() + *slot * kSlotBytes;
          Prefix p;
          std::memcpy(&p, body, kPrefix);
          ASSERT_EQ(p.seq, recv.expected());
          for (std::size_t i = kPrefix; i < kSlotBytes; ++i) {
            ASSERT_EQ(body[i], fill(p.seq, i)) << "fragment " << p.seq << " byte " << i;
          }
          occupied[*slot] = false;
          recv.consume();
          ++consumed;
        }
      } else if (action == 3) {
        // Credits travel back (piggybacked or in a control message: the same to the windows).
        credits_in_flight += recv.take_owed();
        const std::uint32_t n = credits_in_flight == 0 ? 0 : 1 + rng() % credits_in_flight;
        ASSERT_FALSE(transport::rma::accept_credits(send, n, 1));
        credits_in_flight -= n;
      }
    }
    EXPECT_EQ(written, total);
    EXPECT_TRUE(flying.empty());
  }
}

// ---- arrival checks and options
// ----------------------------------------------------------

TEST(RmaChecks, CreditsAndFragmentsOutsideTheProtocolAreWorded) {
  SendWindow s(4);
  (void)s.take();
  EXPECT_FALSE(transport::rma::accept_credits(s, 1, 3));
  (void)s.take();
  const auto credits = transport::rma::accept_credits(s, 2, 3);
  ASSERT_TRUE(credits);
  EXPECT_EQ(*credits, "protocol violation: rank 3 returned 2 credits with only 1 outstanding");
  RecvWindow r(4, 2);
  EXPECT_FALSE(transport::rma::accept_fragment(r, 0, 5));
  const auto twice = transport::rma::accept_fragment(r, 0, 6);
  ASSERT_TRUE(twice);
  EXPECT_EQ(*twice, "protocol violation: fragment 0 outside the receive window (next expected 0)");
}

TEST(RmaChecks, SlotOptionsNameTheTransport) {
  EXPECT_NO_THROW(transport::rma::check_slot_options("fabric", 128 * 1024, 8, 0));
  try {
    transport::rma::check_slot_options("verbs", 128 * 1024, 1, 2);
    ADD_FAILURE() << "slots=1 was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find("verbs: slots=1 is outside [2, 1024]"), std::string::npos)
        << e.what();
  }
  EXPECT_THROW(transport::rma::check_slot_options("fabric", 1000, 8, 0), Error);
  EXPECT_THROW(transport::rma::check_slot_options("fabric", 1024 + 32, 8, 0), Error);
  EXPECT_THROW(transport::rma::check_slot_options("fabric", 128u << 20, 8, 0), Error);
  EXPECT_THROW(transport::rma::check_slot_options("fabric", 4096, 2048, 0), Error);
  try {
    transport::rma::check_slot_options("fabric", 4096, 6, 1);
    ADD_FAILURE() << "slots=6 was accepted: fragments 2^32-1 and 0 would share slot 3";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find("fabric: slots=6 is not a power of two"),
              std::string::npos)
        << e.what();
  }
}

// ---- registrations of direct-write windows
// ---------------------------------------------------

// A back-end that registers by handing out numbers: handle h has key 1000 + h, unless `keys`
// says otherwise; it records what it registered and released.
struct FakeRegistrar {
  std::uint64_t next = 1;
  bool fail = false;
  std::optional<std::uint64_t> key;  // every registration's key, when set
  std::vector<std::pair<std::uintptr_t, std::size_t>> registered;
  std::vector<std::uint64_t> released;

  transport::rma::WindowRegistrations::Register make() {
    return
        [this](char* b, std::size_t n) -> std::optional<transport::rma::WindowRegistrations::Made> {
          if (fail) return std::nullopt;
          registered.emplace_back(reinterpret_cast<std::uintptr_t>(b), n);
          const std::uint64_t h = next++;
          return transport::rma::WindowRegistrations::Made{h, key.value_or(1000 + h)};
        };
  }
  transport::rma::WindowRegistrations::Release release() {
    return [this](std::uint64_t h) { released.push_back(h); };
  }
};

TEST(WindowRegistrations, AWindowOnMemoryUsedBeforeReusesItsRegistration) {
  FakeRegistrar fake;
  std::vector<char> mem(1 << 16);
  transport::rma::WindowRegistrations w(4, fake.release());
  const auto a = w.open(mem.data(), mem.size(), fake.make());
  ASSERT_TRUE(a.has_value());
  EXPECT_EQ(a->key, 1001U);
  EXPECT_EQ(a->begin, reinterpret_cast<std::uintptr_t>(mem.data()));
  w.close(a->key);
  EXPECT_TRUE(fake.released.empty()) << "a closed window's registration stays cached";
  // A window inside the registered range: the same registration, its start reported.
  const auto b = w.open(mem.data() + 4096, 8192, fake.make());
  ASSERT_TRUE(b.has_value());
  EXPECT_EQ(b->key, a->key);
  EXPECT_EQ(b->begin, reinterpret_cast<std::uintptr_t>(mem.data()));
  EXPECT_EQ(w.made(), 1U);
  EXPECT_EQ(fake.registered.size(), 1U);
  w.close(b->key);
  // Memory beyond the registered range needs a registration of its own.
  std::vector<char> other(4096);
  const auto c = w.open(other.data(), other.size(), fake.make());
  ASSERT_TRUE(c.has_value());
  EXPECT_EQ(c->key, 1002U);
  EXPECT_EQ(w.made(), 2U);
  EXPECT_EQ(w.held(), 2U);
  w.close(c->key);
  w.clear();
  std::sort(fake.released.begin(), fake.released.end());
  EXPECT_EQ(fake.released, (std::vector<std::uint64_t>{1, 2}));
  EXPECT_EQ(w.held(), 0U);
}

TEST(WindowRegistrations, ForgottenMemoryIsReleasedOnceItsLastWindowCloses) {
  FakeRegistrar fake;
  std::vector<char> mem(1 << 16);
  transport::rma::WindowRegistrations w(4, fake.release());
  const auto a = w.open(mem.data(), mem.size(), fake.make());
  const auto b = w.open(mem.data(), 100, fake.make());  // two operations on one buffer
  ASSERT_TRUE(a && b);
  EXPECT_EQ(a->key, b->key);
  w.forget(mem.data() + 100, 1);
  EXPECT_TRUE(fake.released.empty()) << "released while peers may still write into it";
  w.close(a->key);
  EXPECT_TRUE(fake.released.empty()) << "one window is still open";
  w.close(b->key);
  EXPECT_EQ(fake.released, (std::vector<std::uint64_t>{1}));
  // Opened again after forget(): registered afresh.
  const auto c = w.open(mem.data(), mem.size(), fake.make());
  ASSERT_TRUE(c.has_value());
  EXPECT_EQ(c->key, 1002U);
  EXPECT_EQ(w.made(), 2U);
  // Forgetting memory no window touches changes nothing; neither do stray closes.
  std::vector<char> other(64);
  w.forget(other.data(), other.size());
  w.close(77);
  w.close(c->key);
  w.close(c->key);
  EXPECT_EQ(fake.released.size(), 1U);
  EXPECT_EQ(w.held(), 1U);
}

TEST(WindowRegistrations, EvictedWhileOpenStaysUntilClosed) {
  FakeRegistrar fake;
  std::vector<std::vector<char>> bufs(3, std::vector<char>(4096));
  transport::rma::WindowRegistrations w(2, fake.release());
  const auto a = w.open(bufs[0].data(), 4096, fake.make());
  ASSERT_TRUE(a.has_value());
  w.close(w.open(bufs[1].data(), 4096, fake.make())->key);
  // A third range evicts the least recently used entry, a's, which is still open.
  const auto c = w.open(bufs[2].data(), 4096, fake.make());
  ASSERT_TRUE(c.has_value());
  EXPECT_TRUE(fake.released.empty());
  EXPECT_EQ(w.held(), 3U);
  w.close(a->key);
  EXPECT_EQ(fake.released, (std::vector<std::uint64_t>{1}));
  // a's memory is no longer cached: a new window there registers it again.
  const auto again = w.open(bufs[0].data(), 4096, fake.make());
  ASSERT_TRUE(again.has_value());
  EXPECT_EQ(again->key, 1004U);
  EXPECT_EQ(w.made(), 4U);
  w.close(again->key);
  w.close(c->key);
}

TEST(WindowRegistrations, FailedOrClashingRegistrationsOpenNothing) {
  FakeRegistrar fake;
  std::vector<char> mem(8192);
  std::vector<char> other(8192);
  transport::rma::WindowRegistrations w(4, fake.release());
  fake.fail = true;
  EXPECT_FALSE(w.open(mem.data(), mem.size(), fake.make()).has_value());
  fake.fail = false;
  EXPECT_FALSE(w.open(nullptr, 10, fake.make()).has_value());
  EXPECT_FALSE(w.open(mem.data(), 0, fake.make()).has_value());
  EXPECT_TRUE(fake.registered.empty());
  // A back-end handing out a key that a held registration has: released, not opened.
  fake.key = 5;
  const auto a = w.open(mem.data(), mem.size(), fake.make());
  ASSERT_TRUE(a.has_value());
  EXPECT_FALSE(w.open(other.data(), other.size(), fake.make()).has_value());
  EXPECT_EQ(fake.released, (std::vector<std::uint64_t>{2}));
  EXPECT_EQ(w.made(), 1U);
  w.close(a->key);
}

}  // namespace
}  // namespace dear::testing
