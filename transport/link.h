// The link contract: what the progress engine needs from a transport back-end.
//
// A link joins this rank to one peer and consists of `channels`, each an independent ordered,
// reliable, full-duplex stream of messages (for TCP: one socket). A message is a fixed 32-byte
// FrameHeader followed by `header.bytes` bytes of payload. Channels exist so that one large
// operation can be striped over several connections, and so that operations on different
// channels never wait behind each other.
//
// Threading: a Channel is used by one thread only (the communicator's engine); nothing here
// blocks. Every call returns at once.
//
// Sending: try_send() queues a message (header copied, payload NOT copied: it must stay valid
// and unchanged until the SendSink is told the message is sent) or returns false when the
// channel's bounded queue is full (back-pressure: try again after progress()). Messages on one
// channel leave in the order they were queued. "Sent" means the payload was handed to the
// transport and the buffer may be reused; it does not mean the peer has it. (A back-end that
// sends from the caller's memory reports it later: TCP's zero-copy sends once the peer has
// read them.)
//
// Receiving: progress() reads what has arrived. For each message it calls
// RecvSink::on_header(); the sink answers where the payload goes: straight into memory
// (kDirect) or handed over in pieces through on_payload() (kStream, used to reduce while data
// arrives; pieces are multiples of `unit` bytes, start at an address aligned to `unit`, and
// come from transport-owned memory valid only during the call). Then on_message() says the message
// is complete. The sink may return kDiscard to have the payload dropped.
//
// Completion and errors: every queued message is reported sent exactly once, or the channel
// fails. A failure (peer closed, reset, protocol violation) is thrown from progress() as
// dear::Error(kPeerFailed) naming the peer; after that the channel is dead and the engine
// fails the operations that use it. A clean close by the peer is reported through
// RecvSink::on_closed() instead, because a peer that finished and destroyed its communicator
// is not an error unless an operation still needs it.
#pragma once

#include <poll.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "dear/error.h"

namespace dear::transport {

enum class FrameType : std::uint8_t {
  kData = 1,    // a slice of an operation
  kPosted = 2,  // "I have posted operation `seq`": the sender may send non-eager slices
  kAbort = 3,   // the peer failed; payload = reason text; root = rank to blame; count = code
  // Internal to a back-end, never handed to a RecvSink: the TCP channel's "consumed" notice
  // for payloads it sent without copying them (tcp_channel.h); count = messages consumed.
  kConsumed = 4,
  // Point-to-point (Communicator::send/recv), on the mesh channel between the two ranks; seq is
  // the message's place among that pair's sends, count and dtype the caller's.
  kP2pData = 5,     // the message; payload = its bytes
  kP2pReady = 6,    // "the receive for message `seq` is posted": the large send may go
  kP2pRequest = 7,  // "a large message `seq` waits for its receive" (no payload)
  // On a ring channel, from the receiver of a device window's messages: it has finished with
  // the first `count` messages written into that channel's slots of the window, which the
  // sender may write again (no payload).
  kCredit = 8,
};

struct FrameHeader {
  std::uint32_t bytes = 0;  // payload bytes that follow
  FrameType type = FrameType::kData;
  std::uint8_t kind = 0;  // collective (collectives::OpKind)
  std::uint8_t dtype = 0;
  std::uint8_t redop = 0;
  std::uint64_t seq = 0;    // operation sequence number
  std::uint32_t index = 0;  // message index within (operation, channel)
  std::int32_t root = 0;
  std::uint64_t count = 0;  // the operation's count as the caller gave it
};
static_assert(sizeof(FrameHeader) == 32, "the wire header is 32 bytes");

struct RecvTarget {
  enum Mode : std::uint8_t { kDirect, kStream, kDiscard };
  Mode mode = kDiscard;
  char* dst = nullptr;   // kDirect: where the payload goes
  std::size_t unit = 1;  // kStream: pieces are multiples of this many bytes
};

// Memory of the receiving end that the sending end may write a message's payload into directly
// (a back-end with remote writes, e.g. fabric's write data path), instead of into the
// receiver's staging, which saves the receiver a copy. The receiver opens it
// (Channel::open_window) for the destination of an operation and gives it to the sender (the
// engine carries it in the operation's kPosted frame); the sender names it, with an offset, when
// it queues a message (Channel::try_send_to). A message written that way is still announced by
// its header: the receiving channel asks its sink where the payload goes and fails, as a protocol
// violation, unless the answer is kDirect at exactly `local` + offset, where the bytes already
// are. 32 bytes, carried as they are.
struct Window {
  std::uint64_t addr = 0;   // what the peer's writes address: a virtual address or an offset
  std::uint64_t key = 0;    // the registration's remote key
  std::uint64_t local = 0;  // the window's first byte in the receiver's address space
  std::uint64_t bytes = 0;
};
static_assert(sizeof(Window) == 32, "a window travels as 32 bytes");

// CUDA device memory handed to a link for GPUDirect RDMA: the dma-buf the CUDA driver exported
// for the pages holding it (cuda/dmabuf.h), and the memory's offset into that dma-buf; fd -1
// where the driver exported none (a back-end then tries its peer-memory path). The link does
// not tell device memory from host memory itself: the caller says which it passes.
struct DeviceMemory {
  int dmabuf_fd = -1;
  std::uint64_t offset = 0;
  // The CUDA device holding it; -1 for host memory standing in for device memory (the
  // collectives' tests of the device path on a CPU), which a back-end registers as host memory.
  int cuda_device = -1;
};

class RecvSink {
 public:
  virtual ~RecvSink() = default;
  virtual RecvTarget on_header(int channel, const FrameHeader& h) = 0;
  // kStream only: payload bytes [offset, offset + len) of the current message.
  virtual void on_payload(int channel, const FrameHeader& h, const char* data, std::size_t offset,
                          std::size_t len) = 0;
  virtual void on_message(int channel, const FrameHeader& h) = 0;
  virtual void on_sent(int channel, std::uint64_t token) = 0;
  virtual void on_closed(int channel) = 0;
};

// A sink that takes nothing (every payload discarded): what arrives while a channel closes
// belongs to no operation.
struct NullSink final : RecvSink {
  RecvTarget on_header(int, const FrameHeader&) override { return {}; }
  void on_payload(int, const FrameHeader&, const char*, std::size_t, std::size_t) override {}
  void on_message(int, const FrameHeader&) override {}
  void on_sent(int, std::uint64_t) override {}
  void on_closed(int) override {}
};

// How long a closing channel waits at most for its peer to acknowledge what was sent (a reset
// that followed would destroy it); close_by() lets an engine share one such deadline.
inline constexpr std::chrono::milliseconds kCloseLinger{500};

class Channel {
 public:
  virtual ~Channel() = default;
  [[nodiscard]] virtual bool try_send(const FrameHeader& h, const void* payload,
                                      std::uint64_t token) = 0;
  // try_send() of a message whose payload belongs at byte `offset` of `window`, a window the
  // peer opened: a back-end with direct writes writes it there (when the payload is large
  // enough to gain from it); any other sends it as try_send() does, which is always correct, as
  // the peer's sink places it at the same address.
  [[nodiscard]] virtual bool try_send_to(const FrameHeader& h, const void* payload,
                                         std::uint64_t token, const Window& window,
                                         std::size_t offset) {
    (void)window;
    (void)offset;
    return try_send(h, payload, token);
  }
  // try_send_to() of a message that must be written into `window` directly, whatever its size:
  // a window the peer opened on device memory (open_device_window), where its CPU could not
  // place a staged message, sent from memory registered with register_device_source(). A
  // message without payload is sent as try_send() does (there is nothing to place). Throws
  // dear::Error: kInternal from a back-end without direct writes (the default: it opens no
  // such window), kInvalidArgument when the payload does not fit the window at `offset`.
  [[nodiscard]] virtual bool try_send_direct(const FrameHeader& h, const void* payload,
                                             std::uint64_t token, const Window& window,
                                             std::size_t offset) {
    (void)h;
    (void)payload;
    (void)token;
    (void)window;
    (void)offset;
    throw Error(ErrorCode::kInternal,
                "a direct send on " + describe() + ", whose back-end has no direct writes");
  }
  // Opens [base, base + bytes) for the peer's direct writes on every channel of this link to
  // the same peer (one registration serves them all), for messages of up to `message_bytes`;
  // nullopt where the back-end has none (the default), where such messages are too small to
  // gain from it, or where the memory cannot be registered. Open until close_window(): the
  // owner closes it once nothing more may be written there (its operation completed or
  // failed), before the memory is returned to the caller. A back-end may keep the memory's
  // registration after that, for the next window on it, until forget_memory() names it.
  [[nodiscard]] virtual std::optional<Window> open_window(char* base, std::size_t bytes,
                                                          std::size_t message_bytes) {
    (void)base;
    (void)bytes;
    (void)message_bytes;
    return std::nullopt;
  }
  virtual void close_window(const Window& window) { (void)window; }
  // open_window() on CUDA device memory (GPUDirect RDMA), `memory` saying how the back-end may
  // register it. The peer's direct writes land in device memory, and before the sink hears
  // that such a message is complete (on_message) the back-end makes every write visible to the
  // device (verbs: an RDMA READ through a loopback queue pair, which completes only after the
  // writes before it reached memory). Only direct messages may land there: the receiver's CPU
  // cannot copy a staged one into device memory, so the sender sends into such a window with
  // try_send_direct() (any size; `message_bytes` is not checked against the back-end's direct
  // size), from device memory it registered (register_device_source). nullopt where the
  // back-end cannot reach device memory (the default) or cannot register this memory: the
  // caller then stages through host memory. Closed with close_window().
  // Whether open_device_window() may succeed on memory of `cuda_device` (-1: host memory
  // standing in), so that a caller need not allocate memory to find out; false by default.
  [[nodiscard]] virtual bool takes_device_windows(int cuda_device) const {
    (void)cuda_device;
    return false;
  }
  [[nodiscard]] virtual std::optional<Window> open_device_window(char* base, std::size_t bytes,
                                                                 std::size_t message_bytes,
                                                                 const DeviceMemory& memory) {
    (void)base;
    (void)bytes;
    (void)message_bytes;
    (void)memory;
    return std::nullopt;
  }
  // Registers CUDA device memory [base, base + bytes) as a source of direct messages
  // (try_send_to) on every channel of this link; false where the back-end cannot read device
  // memory (the default) or cannot register it. A message whose payload lies there must go
  // direct: try_send() and try_send_to() throw dear::Error(kInvalidArgument) for one that
  // would be staged, which the CPU would have to read. Registered until forget_memory() names
  // the memory.
  [[nodiscard]] virtual bool register_device_source(const char* base, std::size_t bytes,
                                                    const DeviceMemory& memory) {
    (void)base;
    (void)bytes;
    (void)memory;
    return false;
  }
  [[nodiscard]] virtual std::size_t queued() const = 0;
  [[nodiscard]] virtual std::size_t queued_bytes() const = 0;
  // Moves bytes both ways without blocking; returns true if anything moved. On return every
  // complete message received so far has been delivered, so a caller may skip progress()
  // while queued() is 0 and wait_spec()'s descriptor is not ready. `may_read` false says the
  // caller has just seen that descriptor not readable: only sends and what is already
  // buffered are handled, sparing a read that would find nothing.
  virtual bool progress(RecvSink& sink, bool may_read) = 0;
  // What to wait for when idle (fd and events for poll()); fd < 0 = nothing to wait on.
  [[nodiscard]] virtual pollfd wait_spec() const = 0;
  // True for a transport that moves data only while progress() is called (libfabric's manual
  // progress): the caller then calls progress() every turn, ready descriptor or not, and does
  // not sleep for long while it has work in flight.
  [[nodiscard]] virtual bool polled() const { return false; }
  // The owner of [addr, addr + bytes) is about to free or reuse it: registrations the channel
  // keeps for sending from callers' memory (cached by address) and overlapping it are dropped,
  // so that a new allocation there is registered afresh. Called between the operations that
  // use the memory, never while a message from it is queued. Default: nothing is cached.
  virtual void forget_memory(const void* addr, std::size_t bytes) {
    (void)addr;
    (void)bytes;
  }
  // Starts close() without waiting: sends what can be sent now and tells the peer that nothing
  // follows (TCP: a FIN). An engine closing all its channels calls this on every one before
  // close_by(), because a peer may acknowledge what one channel sent only when it closes
  // another (its own end of the same link, say): closed one by one, each wait could last
  // until a delayed acknowledgement (40 ms on Linux). Default: nothing to start.
  virtual void begin_close() {}
  // Sends what can be sent now and closes; never blocks for long (a back-end may wait a
  // bounded moment for the peer to take what was sent).
  virtual void close() = 0;
  // close(), waiting for the peer at most until `linger_until` (an engine closing all its
  // channels gives them one shared deadline, so that the waits do not add up).
  virtual void close_by(std::chrono::steady_clock::time_point linger_until) {
    (void)linger_until;
    close();
  }
  // Closes after a failure, when what was sent no longer matters: no waiting at all.
  void abandon() { close_by(std::chrono::steady_clock::time_point::min()); }
  [[nodiscard]] virtual bool closed() const = 0;
  [[nodiscard]] virtual std::string describe() const = 0;
};

// What a back-end's connect_ring() returns: `channels` channels to each ring neighbour. In a
// ring of two both lists join the same two ranks, over separate channels.
struct RingLinks {
  std::vector<std::unique_ptr<Channel>> to_next;    // channels to rank (rank + 1) % size
  std::vector<std::unique_ptr<Channel>> from_prev;  // channels to rank (rank - 1 + size) % size
};

}  // namespace dear::transport
