// Slot and credit bookkeeping of a message channel over a transport whose
// receiver must have a buffer ready before data arrives (libfabric RDM
// endpoints, ibverbs queue pairs).
//
// Why a separate piece: the rules that keep such a channel from overrunning its
// peer or deadlocking are independent of the API that moves the bytes, so they
// are written (and unit tested) once here, and every back-end that stages data
// in receiver-owned slots reuses them.
//
// The protocol
// - The receiver owns `slots` data slots. Data travels in fragments of at most
// one slot each;
//   fragment k of a channel carries sequence number k (32 bits, wrapping).
// - The sender starts with one credit per slot (SendWindow) and spends one per
// fragment. It
//   never has more than `slots` fragments unacknowledged, so fragment k can
//   only land in a slot the receiver has free, and sequence numbers in flight
//   are distinct modulo `slots` (across the 32-bit wrap too, as transports keep
//   `slots` a power of two: check_slot_options).
// - Fragments may complete at the receiver out of order (a provider may reorder
// completions);
//   RecvWindow holds them until the next one in sequence is there and hands
//   them out in order.
// - Once the receiver has consumed a fragment its slot is free again and it
// owes the sender a
//   credit. Owed credits ride on the receiver's own outgoing fragments
//   (piggybacked) or, once at least `return_threshold` are owed, in a
//   credit-only control message.
// - Control messages (credit returns, the closing message) use a separate small
// pool of
//   buffers, never data credits, so returning credits cannot itself run out of
//   credits. Bound: every credit-only message returns at least
//   `return_threshold` credits, and the credits of all such messages the peer
//   has not yet processed belong to distinct fragments of its unacknowledged
//   window, so at most slots / return_threshold of them are in flight
//   (kControlSlots covers that plus the closing message).
// - No deadlock: a sender is only stalled at zero credits, when all `slots` of
// its fragments are
//   unacknowledged; the receiver consumes every fragment it gets, so it comes
//   to owe `slots`
//   >= return_threshold credits and returns them without needing any credit
//   itself.
//
// Not thread-safe: one channel, one thread, as for every Channel.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

namespace dear::transport::rma {

// Control buffers each side keeps posted besides its data slots (see the bound
// above).
inline constexpr std::uint32_t kControlSlots = 4;

// The sender's view: credits for the peer's data slots and the next sequence
// number.
class SendWindow {
 public:
  // `slots` > 0: the peer's data slots. `first_seq`: the first fragment's
  // sequence number (both ends must agree; tests start near the wrap).
  explicit SendWindow(std::uint32_t slots, std::uint32_t first_seq = 0);

  [[nodiscard]] bool can_send() const { return credits_ > 0; }
  [[nodiscard]] std::uint32_t credits() const { return credits_; }
  [[nodiscard]] std::uint32_t slots() const { return slots_; }
  // Sequence number the next fragment carries.
  [[nodiscard]] std::uint32_t next_seq() const { return next_seq_; }
  // Fragments sent and not yet acknowledged by a returned credit.
  [[nodiscard]] std::uint32_t unacknowledged() const { return slots_ - credits_; }

  // Spends a credit for the fragment with sequence next_seq(); returns that
  // number. Requires can_send().
  std::uint32_t take();
  // The peer returned `n` credits. False (and nothing changed) when that is
  // more than are outstanding: the peer broke the protocol.
  [[nodiscard]] bool on_returned(std::uint32_t n);

 private:
  std::uint32_t slots_;
  std::uint32_t credits_;
  std::uint32_t next_seq_ = 0;
};

// The receiver's view: which fragments have arrived in which buffer, the next
// one in order, and the credits owed to the sender.
class RecvWindow {
 public:
  // `slots` > 0 data slots; `return_threshold` in [1, slots]: owed credits
  // worth a message; `first_seq` as for SendWindow.
  RecvWindow(std::uint32_t slots, std::uint32_t return_threshold, std::uint32_t first_seq = 0);

  // Fragment `seq` arrived in buffer `buffer`. False (and nothing recorded)
  // when `seq` is not within the window the sender may use, or arrived twice:
  // the sender broke the protocol.
  [[nodiscard]] bool arrived(std::uint32_t seq, std::uint32_t buffer);
  // The buffer holding the next fragment in sequence, once it has arrived.
  [[nodiscard]] std::optional<std::uint32_t> next_ready() const;
  // The next fragment in sequence has been consumed: its slot is free, one more
  // credit owed. Requires next_ready().
  void consume();

  // Sequence number of the next fragment to consume (= fragments consumed so
  // far).
  [[nodiscard]] std::uint32_t expected() const { return expected_; }
  [[nodiscard]] std::uint32_t owed() const { return owed_; }
  // Enough credits owed to justify a credit-only control message.
  [[nodiscard]] bool should_return() const { return owed_ >= threshold_; }
  // Hands over all owed credits (to piggyback or to send); returns how many.
  std::uint32_t take_owed();
  [[nodiscard]] std::uint32_t threshold() const { return threshold_; }

 private:
  static constexpr std::uint32_t kEmpty = 0xffffffffU;
  std::uint32_t slots_;
  std::uint32_t threshold_;
  std::uint32_t expected_ = 0;
  std::uint32_t owed_ = 0;
  std::vector<std::uint32_t> buffer_of_;  // indexed by seq % slots; kEmpty when not arrived
};

}  // namespace dear::transport::rma
