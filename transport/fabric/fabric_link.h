// libfabric back-end of the link contract (transport/link.h).
//
// Each channel is one reliable-datagram endpoint (FI_EP_RDM), so channels never wait behind
// each other and two ranks joined twice (a ring of two) keep the two links apart. Endpoint
// names are exchanged over the bootstrap; an RDM endpoint needs no connection handshake.
//
// Completions: the channels of one connect (connect() makes a communicator's ring and mesh
// links at once) share one domain, one address vector holding every peer's endpoints, and one
// completion queue (fabric_domain.h, Hub). An engine turn reads that queue once, whichever
// channel it progresses first, instead of one queue per channel (each read takes the
// provider's locks and progresses its endpoints); each completion goes to the channel whose
// buffer is its context, and a peer's write, which carries no context of ours, to the channel
// whose number the writer put in the high half of its remote CQ data (the low half is the
// fragment's sequence number). Providers with 4 bytes of CQ data on the write data path (no
// room for the number) keep one queue per channel.
//
// Data path (see transport/rma/slot_window.h for the protocol): the sender cuts each message
// into fragments of at most one slot (the provider's message size limit included), spends one
// credit per fragment, and reports the message sent once its last fragment is handed to the
// provider (its payload is no longer needed then). Large fragments are not copied into a send
// staging buffer: the provider gathers the prefix from the staging buffer and the payload from
// the caller's memory (registered through a cache where the provider needs that), and the
// message is reported sent once every such fragment has completed. Every fragment starts with
// a 32-byte prefix carrying the communicator's tag, the fragment's sequence number and credits
// returned to the peer; the first fragment of a message then holds the FrameHeader. How a
// fragment reaches the peer's slot (DataPath):
// - write (transport/rma/slot_region.h): each channel registers its data slots for remote
//   writes (FI_REMOTE_WRITE) and publishes their address and key with its endpoint name; the
//   sender writes fragment k into slot k % slots with one RMA write carrying k as remote CQ
//   data, and the receiver learns of it from that completion. Only control messages (credit
//   returns, the closing message) are sent, into small buffers kept posted (as many as the
//   data slots besides, for providers whose writes with CQ data consume a receive:
//   FI_RX_CQ_DATA).
//   Direct messages (FabricOptions::direct_bytes): where the peer opened a window on a
//   message's destination (Channel::open_window; the engine announces it) and the sender names
//   it (try_send_to), the message is its first fragment alone (FrameHeader and DirectInfo, in a
//   slot), then its payload in RMA writes straight into the window, each with remote CQ data
//   and a credit like a fragment; the receiver's copy out of the slot disappears. The
//   receiver checks that its sink places the message exactly where it was written. A window's
//   registration is cached by address range and reused by the next window on that memory
//   (until Communicator::forget_memory names it, or it is the least recently used of many).
// - send: the receiver keeps its data slots and the control buffers posted as receives, and
//   fragments are sent into whichever of them the provider matches.
// Fragments are consumed in sequence order even when completions arrive out of order; a
// closing message says how many fragments preceded it, so the peer reports on_closed() only
// after it has delivered all of them.
//
// Waiting: wait_spec() returns the shared completion queue's wait descriptor (FI_WAIT_FD)
// after fi_trywait() said it is safe to sleep on; when it is not, or while sends are still in
// the provider's hands, a descriptor that is always readable, so the engine keeps progressing.
// A provider without wait descriptors (shm) gets the hub's one-shot 2 ms timer instead, armed
// when the engine goes to sleep (an engine with work in flight polls and never sleeps on it).
//
// Errors: a failed completion (a send, a receive, or an RMA write at either end) is thrown from
// progress() as dear::Error(kPeerFailed) with the peer's rank and the provider's error text;
// setup failures name the provider asked for and the ones this host offers.
// Nothing here aborts or blocks for long: close() waits at most kCloseLinger (link.h)
// for the provider to take what is queued.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "dear/bootstrap.h"
#include "transport/link.h"

namespace dear::transport::fabric {

// How fragments reach the peer's data slots (see the data path above).
enum class DataPath : std::uint8_t {
  kAuto,   // kWrite where the provider offers RMA writes with remote CQ data, else kSend
  kWrite,  // RMA writes into slots the peer registered; setup fails where not offered
  kSend,   // sends into receives the peer keeps posted
};

// "auto", "write", "send" (CommOptions::fabric_data_path, DEAR_FABRIC_DATA_PATH); nullopt for
// anything else.
[[nodiscard]] inline std::optional<DataPath> parse_data_path(std::string_view s) {
  if (s == "auto") return DataPath::kAuto;
  if (s == "write") return DataPath::kWrite;
  if (s == "send") return DataPath::kSend;
  return std::nullopt;
}
[[nodiscard]] inline const char* data_path_name(DataPath p) {
  switch (p) {
    case DataPath::kWrite: return "write";
    case DataPath::kSend: return "send";
    case DataPath::kAuto: break;
  }
  return "auto";
}

struct FabricOptions {
  // libfabric provider name as fi_info prints it ("tcp;ofi_rxm", "sockets",
  // "shm", "verbs;ofi_rxm", "efa"); empty = the first RDM provider libfabric
  // offers, skipping single-host ones (shm).
  std::string provider;
  // Bytes per data slot (fragment size, prefix included) and data slots per
  // channel and direction (a power of two); each channel holds 2 * slots * slot_bytes of
  // staging memory on the write data path, 2 * (slots + kControlSlots) * slot_bytes on the
  // send data path.
  std::size_t slot_bytes = 128 * 1024;
  std::uint32_t slots = 8;
  // Fragments carrying at least this many payload bytes are sent from the caller's memory
  // (gathered behind their prefix) instead of being copied into a send slot; 0: always copy.
  // Where the provider needs local registrations (FI_MR_LOCAL: verbs, efa) that memory is
  // registered through a cache; a failed registration falls back to the copy.
  std::size_t in_place_bytes = 8 * 1024;
  // On the write data path, messages of at least this many payload bytes whose destination
  // the peer opened as a window (Channel::open_window, try_send_to) are written straight into
  // it, which saves the receiver's copy out of its slot; 0: never. Default by measurement (see
  // docs/transports.md).
  std::size_t direct_bytes = 384 * 1024;
  // A direct message's payload goes in writes of at most this many bytes (each spends one of
  // the peer's credits, as a fragment does), and of at most the provider's message size.
  std::size_t direct_write_bytes = 4 << 20;
  // Register the memory of in-place sends even where the provider does not need it (tests the
  // path that providers needing FI_MR_LOCAL take, on providers that run here).
  bool register_in_place = false;
  // On the write data path, open the domain for CUDA device memory (FI_HMEM, with FI_MR_HMEM
  // registrations) where the provider offers it, so that device windows and device sources
  // (Channel::open_device_window, register_device_source) take CUDA memory; without it, or
  // where the provider does not offer it, only host memory (device operations then pass
  // through pinned host memory).
  bool hmem = false;
  // The data path; every rank must end up on the same one (kAuto does, given one provider).
  // kAuto, i.e. writes where offered: never slower than sends in the measurements
  // (docs/results.md).
  DataPath data_path = DataPath::kAuto;
  // Tests: XORed into the key the peer published for its data slots, so that this rank's
  // writes are refused (the error path of RMA completions). 0 in real use.
  std::uint64_t corrupt_write_key = 0;
  // Setup must finish by then (it only waits on the bootstrap, whose own
  // timeout also applies).
  std::chrono::steady_clock::time_point deadline = std::chrono::steady_clock::time_point::max();
};

using RingLinks = transport::RingLinks;

// True when this build has the libfabric back-end.
[[nodiscard]] bool built();

// Providers offering RDM endpoints with send/receive on this host, in
// libfabric's order of preference; empty when none (or not built).
[[nodiscard]] std::vector<std::string> available_providers();

// Why `provider` ("" = the default choice) cannot be used here, or nullopt when
// it can.
[[nodiscard]] std::optional<std::string> unavailable_reason(const std::string& provider);

// Why `provider` ("" = the default choice) cannot take the write data path here, or nullopt
// when it can (DataPath::kAuto then chooses it).
[[nodiscard]] std::optional<std::string> write_unavailable_reason(const std::string& provider);
// Why `provider` cannot take CUDA device memory on the write data path here (FI_HMEM), or
// nullopt when it can (FabricOptions::hmem then opens its domain for it).
[[nodiscard]] std::optional<std::string> hmem_unavailable_reason(const std::string& provider);

// Callers' memory ranges registered so far for in-place sends by the domain `channel` belongs
// to (FabricOptions::register_in_place, or a provider that needs local registrations); 0 for a
// channel of another back-end. For tests of the registration cache.
[[nodiscard]] std::uint64_t registrations_made(const Channel& channel);

// Registrations made so far for windows (Channel::open_window) by the domain `channel` belongs
// to: a window on memory used before reuses its cached registration. 0 for a channel of
// another back-end. For tests.
[[nodiscard]] std::uint64_t window_registrations_made(const Channel& channel);

// Channels on the completion queue `channel` reads (itself included); 0 for a channel of another
// back-end. For tests.
[[nodiscard]] std::size_t queue_members(const Channel& channel);

// The libfabric endpoint `channel` sends and receives on (the one its communicator's channels
// share, where the provider allows it); null for a channel of another back-end. For tests.
[[nodiscard]] const void* endpoint_of(const Channel& channel);

// Messages received written directly into a window (FabricOptions::direct_bytes) by every
// fabric channel of this process so far. For tests.
[[nodiscard]] std::uint64_t direct_received_total();

// Builds `channels` channels to the next and from the previous rank of the
// ring. Collective over the bootstrap (one all_gather of endpoint names).
// Throws dear::Error: kInvalidArgument (bad options, provider not available:
// the message names it and the available ones; DataPath::kWrite on a provider
// without it), kMismatch (ranks chose different providers, channel counts, data
// paths or slot sizes), kSystem (a libfabric call failed:
// names it and its error text).
[[nodiscard]] RingLinks connect_ring(Bootstrap& bootstrap, int channels,
                                     const FabricOptions& options);

// Builds one channel to each rank in `peers` (links beyond the ring neighbours, e.g. for
// recursive doubling), returned in the order of `peers`; channel i reports itself to a
// RecvSink as channel i. Peers are distinct and never this rank, and the lists are symmetric:
// if rank a lists b, then b lists a (at any position). Collective over the bootstrap: every
// rank calls it, each with its own list (possibly empty); endpoints are matched by the pair of
// ranks (see transport/peer_exchange.h). Independent of connect_ring: its channels use their
// own endpoints. Throws dear::Error as connect_ring, plus kInvalidArgument for a bad list
// (naming the entry) and kMismatch when a listed peer does not list this rank.
[[nodiscard]] std::vector<std::unique_ptr<Channel>> connect_peers(Bootstrap& bootstrap,
                                                                  const std::vector<int>& peers,
                                                                  const FabricOptions& options);

// A communicator's links: connect_ring() and connect_peers() at once, every channel on one
// domain, one address vector and (where the provider lets completions be told apart) one
// completion queue, which each engine turn reads once (see "Completions" above). Collective
// over the bootstrap, as the two are; throws as they do.
struct Connected {
  RingLinks ring;
  std::vector<std::unique_ptr<Channel>> mesh;
};
[[nodiscard]] Connected connect(Bootstrap& bootstrap, int channels, const FabricOptions& ring,
                                const std::vector<int>& peers, const FabricOptions& mesh);

}  // namespace dear::transport::fabric
