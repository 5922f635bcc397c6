// libfabric back-end of the link contract (transport/link.h).
//
// Each channel is one reliable-datagram endpoint (FI_EP_RDM) with its own
// completion queue and a one-entry address vector holding the peer's endpoint,
// so channels never wait behind each other and two ranks joined twice (a ring
// of two) keep the two links apart. Endpoint names are exchanged over the
// bootstrap; an RDM endpoint needs no connection handshake.
//
// Data path (see transport/rma/slot_window.h for the protocol): the receiver keeps data slots
// and a few control buffers posted; the sender copies each message into send
// staging buffers in fragments of at most one slot (the provider's message size
// limit included), spends one credit per fragment, and reports the message sent
// once its last fragment is handed to the provider (its payload is no longer
// needed then). Large fragments are not copied: the provider gathers the prefix
// from the slot and the payload from the caller's memory (registered through a
// cache where the provider needs that), and the message is reported sent once
// every such fragment has completed. Every fragment starts with a 32-byte prefix carrying the
// communicator's tag, the fragment's sequence number and credits returned to
// the peer; the first fragment of a message then holds the FrameHeader.
// Fragments are consumed in sequence order even when completions arrive out of
// order; a closing message says how many fragments preceded it, so the peer
// reports on_closed() only after it has delivered all of them.
//
// Waiting: wait_spec() returns the completion queue's wait descriptor
// (FI_WAIT_FD) after fi_trywait() said it is safe to sleep on; when it is not,
// or while sends are still in the provider's hands, a descriptor that is always
// readable, so the engine keeps progressing. A provider without wait
// descriptors (shm) gets a timer descriptor instead: the engine then polls the
// channel every 50 us while traffic flows and every 2 ms when idle.
//
// Errors: a failed completion is thrown from progress() as
// dear::Error(kPeerFailed) with the peer's rank and the provider's error text;
// setup failures name the provider asked for and the ones this host offers.
// Nothing here aborts or blocks for long: close() waits at most kCloseLinger
// for the provider to take what is queued.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "dear/bootstrap.h"
#include "transport/link.h"

namespace dear::transport::fabric {

struct FabricOptions {
  // libfabric provider name as fi_info prints it ("tcp;ofi_rxm", "sockets",
  // "shm", "verbs;ofi_rxm", "efa"); empty = the first RDM provider libfabric
  // offers, skipping single-host ones (shm).
  std::string provider;
  // Bytes per data slot (fragment size, prefix included) and data slots per
  // channel and direction; each channel holds 2 * (slots + kControlSlots) *
  // slot_bytes of staging memory.
  std::size_t slot_bytes = 128 * 1024;
  std::uint32_t slots = 8;
  // Fragments carrying at least this many payload bytes are sent from the caller's memory
  // (gathered behind their prefix) instead of being copied into a send slot; 0: always copy.
  // Where the provider needs local registrations (FI_MR_LOCAL: verbs, efa) that memory is
  // registered through a cache; a failed registration falls back to the copy.
  std::size_t in_place_bytes = 8 * 1024;
  // Register the memory of in-place sends even where the provider does not need it (tests the
  // path that providers needing FI_MR_LOCAL take, on providers that run here).
  bool register_in_place = false;
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

// Builds `channels` channels to the next and from the previous rank of the
// ring. Collective over the bootstrap (one all_gather of endpoint names).
// Throws dear::Error: kInvalidArgument (bad options, provider not available:
// the message names it and the available ones), kMismatch (ranks chose
// different providers or channel counts), kSystem (a libfabric call failed:
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

}  // namespace dear::transport::fabric
