// Messages cut into slot-sized fragments and put back together: the part of a slot-staged
// channel (libfabric RDM endpoints, ibverbs queue pairs) that knows the link contract's
// messages (transport/link.h) but not the API that moves the bytes.
//
// Why a separate piece: both back-ends stage every fragment in a slot of `slot_bytes`, behind the
// same 32-byte Prefix, and the rules for what follows the prefix (a message's first
// fragment carries its FrameHeader, then payload in order), for back-pressure, and for handing a
// message to a RecvSink (kDirect copies, kStream pieces of whole units at aligned addresses,
// kDiscard) are the same for both. Written once here, they are unit tested without a network.
//
// A fragment's body (what follows its Prefix):
//   first fragment of a message:  FrameHeader (32 bytes), then payload bytes [0, k)
//   later fragments:              payload bytes [k, k + n)
// A message of 0 bytes is one fragment holding only its header.
//
// Not thread-safe: one channel, one thread, as for every Channel.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "transport/link.h"
#include "transport/rma/slot_window.h"

namespace dear::transport::rma {

enum class Kind : std::uint8_t { kData = 1, kCredit = 2, kBye = 3 };

// Starts every fragment (in its slot) and every control message. 32 bytes keep what follows
// 32-byte aligned.
struct Prefix {
  std::uint64_t tag = 0;      // fabric: the communicator's, anything else is a stranger's and
                              // dropped; verbs: 0 (a queue pair has one peer)
  std::uint32_t seq = 0;      // kData: fragment sequence; kBye: data fragments sent before it
  std::uint32_t credits = 0;  // credits returned to the receiver of this message
  std::uint32_t bytes = 0;    // bytes after the prefix
  Kind kind = Kind::kData;
  std::uint8_t first = 0;   // kData: starts a message (a FrameHeader follows the prefix)
  std::uint8_t direct = 0;  // kData, first: the payload is written directly (see DirectInfo)
  std::uint8_t reserved = 0;
  std::uint64_t reserved2 = 0;
};
static_assert(sizeof(Prefix) == 32, "the fragment prefix is 32 bytes");
inline constexpr std::size_t kPrefix = sizeof(Prefix);

// A message written directly into the receiver's memory (a Window, transport/link.h) is one
// fragment in a slot holding its FrameHeader and this record, then its payload as remote writes
// of at most `write_bytes` each, in order, each spending a credit and a sequence number like a
// fragment but landing at `local` + its offset instead of in a slot.
struct DirectInfo {
  std::uint64_t local = 0;        // where the payload lands, in the receiver's address space
  std::uint64_t write_bytes = 0;  // payload bytes per write (the last one may hold fewer)
};
static_assert(sizeof(DirectInfo) == 16, "the direct record is 16 bytes");

// Where a direct message's payload goes: the peer's address and key for the writes, and the
// same place in the peer's own address space (DirectInfo::local).
struct DirectTarget {
  std::uint64_t addr = 0;
  std::uint64_t key = 0;
  std::uint64_t local = 0;
};

// Where a message of `bytes` payload bytes named for byte `offset` of the peer's `window`
// (Channel::try_send_to) is written directly: at least `direct_min` bytes (0: never) and
// wholly inside the window; nullopt where it goes through slots like any other.
[[nodiscard]] inline std::optional<DirectTarget> direct_target(std::size_t bytes,
                                                               const Window& window,
                                                               std::size_t offset,
                                                               std::size_t direct_min) {
  if (direct_min == 0 || bytes < direct_min || offset > window.bytes ||
      bytes > window.bytes - offset) {
    return std::nullopt;
  }
  return DirectTarget{window.addr + offset, window.key, window.local + offset};
}

// The sender's queue of messages (Channel::try_send) and the fragmenting of its head message.
// Payloads are not copied: they stay the caller's until the message is reported sent.
class SendQueue {
 public:
  // Messages queued per channel before try_send() answers false (back-pressure).
  static constexpr std::size_t kCapacity = 64;

  [[nodiscard]] bool full() const { return count_ == kCapacity; }
  [[nodiscard]] bool empty() const { return count_ == 0; }
  [[nodiscard]] std::size_t size() const { return count_; }
  // Payload bytes of the queued messages, counted until each is wholly fragmented.
  [[nodiscard]] std::size_t bytes() const { return bytes_; }

  // Queues a message. Requires !full(). With `direct`, the message is to be written directly
  // (see DirectInfo): direct() says so while it is the head.
  void push(const FrameHeader& h, const void* payload, std::uint64_t token,
            const std::optional<DirectTarget>& direct = std::nullopt);

  struct Fragment {
    std::uint32_t bytes = 0;  // body bytes written (FrameHeader included on a first fragment)
    bool first = false;       // starts a message: the body opens with its FrameHeader
  };
  // Writes the body of the head message's next fragment to `dst`, at most `room` bytes (room >
  // sizeof(FrameHeader)). Changes nothing: a fragment the transport does not take (try again
  // later) is simply filled again. Requires !empty().
  [[nodiscard]] Fragment fill(char* dst, std::size_t room) const;
  // Where the payload of the head message's next fragment lies when its body may hold `room`
  // bytes (room > sizeof(FrameHeader)): the bytes fill() would copy after the header, if any.
  // `first`: the fragment starts the message (its body opens with the FrameHeader).
  struct Piece {
    const char* data = nullptr;
    std::size_t bytes = 0;
    bool first = false;
  };
  [[nodiscard]] Piece peek(std::size_t room) const;
  // The gather form of fill(), for a transport that sends from two places at once: writes only
  // the FrameHeader (on a first fragment) to `dst`, and the payload stays where peek(room) says;
  // the transport sends both, in that order. Returns the same Fragment as fill(dst, room), so
  // commit() is unchanged, but the payload must stay untouched until the transport is done
  // with it, not only until commit(). Requires !empty().
  [[nodiscard]] Fragment fill_header(char* dst, std::size_t room) const;
  // The whole payload of the head message (what a transport registers once for all of its
  // fragments). Requires !empty().
  [[nodiscard]] Piece message() const;
  // The fragment last filled has been handed to the transport. Returns the message's token when
  // that fragment was its last: the message is sent (its payload is no longer read).
  [[nodiscard]] std::optional<std::uint64_t> commit(const Fragment& f);
  // The head message's direct target, or null when it goes through slots. Requires !empty().
  [[nodiscard]] const DirectTarget* direct() const;
  // Whether some of the head message has been handed over (its first fragment has).
  [[nodiscard]] bool started() const { return head_started_; }
  // Sends the head message through slots after all (its direct writes cannot be made), as long
  // as nothing of it has been handed over.
  void drop_direct();
  // Direct messages. The first fragment: writes the FrameHeader and DirectInfo{local,
  // write_bytes} to `dst`; commit_direct(0) once it is handed over. Then each write: piece()
  // of at most `write_bytes`, and commit_direct(its bytes), which returns the token once the
  // payload is all handed over. Piece::data is the payload's next byte, Piece::bytes how many
  // bytes of it follow, and the offset of Piece::data in the payload is offset().
  [[nodiscard]] Fragment fill_direct_header(char* dst, std::uint64_t write_bytes) const;
  [[nodiscard]] Piece piece(std::size_t most) const;
  [[nodiscard]] std::size_t offset() const { return head_offset_; }
  [[nodiscard]] std::optional<std::uint64_t> commit_direct(std::size_t payload_bytes);
  // Forgets every queued message (the channel closes); none is reported sent.
  void clear();

 private:
  struct Pending {
    FrameHeader header;
    const char* payload;
    std::uint64_t token;
    bool direct;
    DirectTarget target;
  };
  std::optional<std::uint64_t> advance(std::size_t payload_bytes);
  std::array<Pending, kCapacity> queue_{};
  std::size_t head_ = 0;
  std::size_t count_ = 0;
  std::size_t bytes_ = 0;
  std::size_t head_offset_ = 0;  // payload bytes of the head message already fragmented
  bool head_started_ = false;
};

// Whether a fragment whose payload piece is `piece_bytes` long is sent from the caller's memory
// (in place, gathered behind its prefix) rather than copied into its slot. In place saves the
// sender's copy, which dominates on providers that copy again themselves (shm); it needs a
// provider taking two gather entries per send (`iov_limit`), and is worth it only from
// `min_bytes` on (0: never), below which the copy costs less than the provider's extra work
// and, where the provider needs one, a registration lookup.
[[nodiscard]] bool send_in_place(std::size_t piece_bytes, std::size_t min_bytes,
                                 std::size_t iov_limit);

// Messages whose payload a transport still reads after their last fragment was handed over
// (fragments sent in place): a message is reported sent only once every one of its in-place
// fragments has completed, whatever the order of the completions. Messages are fragmented one
// at a time, in order: posted() calls belong to the message being fragmented until finished().
class InPlaceSends {
 public:
  // `capacity`: the most fragments the transport may hold at once, plus one (the message
  // being fragmented may have none outstanding).
  explicit InPlaceSends(std::uint32_t capacity);

  // An in-place fragment of the message being fragmented was handed over; returns the id its
  // completion passes to completed().
  [[nodiscard]] std::uint32_t posted();
  // The last fragment of the message being fragmented was handed over. Returns `token` when
  // none of its in-place fragments is outstanding (report it sent now); otherwise holds it.
  [[nodiscard]] std::optional<std::uint64_t> finished(std::uint64_t token);
  // The in-place fragment `id` completed. Returns its message's token when that was the last
  // outstanding fragment of a finished message.
  [[nodiscard]] std::optional<std::uint64_t> completed(std::uint32_t id);
  // Messages finished and still held.
  [[nodiscard]] std::size_t held() const { return held_; }
  // Forgets everything (the channel closes); nothing is reported.
  void clear();

 private:
  static constexpr std::uint32_t kNone = 0xffffffffU;
  struct Record {
    std::uint64_t token = 0;
    std::uint32_t outstanding = 0;
    bool finished = false;
  };
  std::vector<Record> records_;
  std::vector<std::uint32_t> free_;
  std::uint32_t current_ = kNone;  // the record of the message being fragmented
  std::size_t held_ = 0;
};

// The receiver's side: fragment bodies, in sequence order, turned into RecvSink calls.
// on_header() when a message starts, its payload as the sink asked (kDirect: copied to `dst`;
// kStream: on_payload() with whole multiples of `unit` starting at `unit`-aligned addresses,
// the remainder of a unit carried across fragments, a misaligned run copied to a bounce buffer
// first; kDiscard: dropped), then on_message() once the header's byte count is in.
class Reassembler {
 public:
  // The largest stream unit a sink may ask for (units that straddle fragments are carried here).
  static constexpr std::size_t kMaxUnit = 64;

  // `max_body`: the most bytes one fragment body may hold (it sizes the bounce buffer).
  explicit Reassembler(std::size_t max_body);

  // The next fragment body in sequence, `n` bytes at `body`; `first` as its prefix says. Returns
  // what is wrong with it (a protocol violation, or a stream unit above kMaxUnit) or nullopt.
  // After an error the channel is dead: what was already delivered stays delivered.
  [[nodiscard]] std::optional<std::string> on_fragment(RecvSink& sink, int channel,
                                                       const char* body, std::size_t n, bool first);
  // A direct message starts: `body` holds its FrameHeader and DirectInfo (`n` bytes). The sink
  // must place its payload kDirect at exactly DirectInfo::local (where the writes put it);
  // anything else is a protocol violation. On success `*write_bytes` is the payload per write,
  // each of which then arrives through on_placed().
  [[nodiscard]] std::optional<std::string> on_direct_header(RecvSink& sink, int channel,
                                                            const char* body, std::size_t n,
                                                            std::size_t* write_bytes);
  // `n` more payload bytes of the current direct message are in place; on_message() once all
  // are.
  [[nodiscard]] std::optional<std::string> on_placed(RecvSink& sink, int channel, std::size_t n);
  // The current message is direct.
  [[nodiscard]] bool in_direct() const { return in_msg_ && direct_; }
  // Where the current direct message's writes land (its DirectInfo::local, which its sink
  // placed it at); nullptr outside a direct message.
  [[nodiscard]] const char* direct_destination() const {
    return in_direct() ? target_.dst : nullptr;
  }
  // Payload bytes of the current message still to come.
  [[nodiscard]] std::size_t remaining() const { return in_msg_ ? current_.bytes - done_ : 0; }
  // Inside a message: some of its fragments have arrived, not all.
  [[nodiscard]] bool in_message() const { return in_msg_; }

 private:
  struct FreeDeleter {
    void operator()(char* p) const { std::free(p); }
  };
  void payload(RecvSink& sink, int channel, const char* data, std::size_t n);

  bool in_msg_ = false;
  bool direct_ = false;
  FrameHeader current_{};
  RecvTarget target_{};
  std::size_t done_ = 0;       // payload bytes of the current message received
  std::size_t delivered_ = 0;  // kStream: bytes handed to on_payload
  alignas(kMaxUnit) std::array<char, kMaxUnit> carry_{};
  std::size_t carry_n_ = 0;
  std::unique_ptr<char, FreeDeleter> bounce_;  // kStream pieces that arrive misaligned
};

// The arrival checks both back-ends make, worded alike whichever carries the data: credits a
// peer returned (`peer` names it), and a data fragment `seq` that arrived in `buffer`. Each
// returns the protocol violation, or nullopt once the window has recorded it.
[[nodiscard]] std::optional<std::string> accept_credits(SendWindow& w, std::uint32_t credits,
                                                        int peer);
[[nodiscard]] std::optional<std::string> accept_fragment(RecvWindow& w, std::uint32_t seq,
                                                         std::uint32_t buffer);

// Throws dear::Error(kInvalidArgument), naming `transport` ("fabric", "verbs"), unless slots is
// a power of two in [2, 1024] and slot_bytes a multiple of 64 in [1 KiB, 64 MiB].
void check_slot_options(std::string_view transport, std::size_t slot_bytes, std::uint32_t slots,
                        int rank);

}  // namespace dear::transport::rma
