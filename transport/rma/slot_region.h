// A receiver's data slots as a writing peer sees them: the part of a slot-staged channel that a
// back-end needs when the sender puts each fragment into the receiver's slot itself, with a
// one-sided write (libfabric RMA, ibverbs RDMA WRITE), instead of sending it into a receive
// buffer the receiver posted.
//
// The protocol on top of slot_window.h
// - The receiver registers its `slots` data slots of `slot_bytes` each as one region its peer
//   may write, and publishes a SlotRegion for it during setup (its start in the addressing the
//   provider uses, and the key of the registration).
// - The sender writes fragment `seq` (its Prefix, then its body, exactly as a sent fragment)
//   into slot seq % slots, at slot_address(region, seq), and announces it with `seq` as the
//   write's immediate data (32 bits: what every provider with remote CQ data carries).
// - The credit rules make that safe: the sender holds a credit for fragment seq only once the
//   receiver has consumed fragment seq - slots, which is the slot's previous occupant.
// - The receiver reads the prefix the write left in the slot and checks it against the
//   announcement (check_written): verbs on the announcement, fabric when the fragment's turn
//   in sequence comes (one of a direct message's writes, see fragments.h, leaves its slot
//   untouched, and that is known only from the message's first fragment). From there on
//   arrival, delivery and credits are those of the send path.
//
// Why a separate piece: the arithmetic and the checks are the same for every back-end that
// writes into slots, and are unit tested here without a network.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>

#include "transport/rma/fragments.h"

namespace dear::transport::rma {

// What the receiver publishes about its data slots. Plain bytes, exchanged over the bootstrap.
struct SlotRegion {
  std::uint64_t base = 0;  // where slot 0 lies: a virtual address, or an offset into the
                           // registration, as the provider addresses registered memory
  std::uint64_t key = 0;   // the registration's remote key
  std::uint64_t slot_bytes = 0;
  std::uint32_t slots = 0;
  std::uint32_t reserved = 0;
};
static_assert(sizeof(SlotRegion) == 32, "exchanged as plain bytes");

// The address a writer targets for fragment `seq`: slot seq % slots. Requires region.slots > 0.
[[nodiscard]] std::uint64_t slot_address(const SlotRegion& region, std::uint32_t seq);

// The base to publish for slots that start `offset` bytes into a registration beginning at
// `registered`: that address plus the offset where the provider addresses registered memory by
// virtual address (libfabric FI_MR_VIRT_ADDR, ibverbs), else the offset alone.
[[nodiscard]] std::uint64_t region_base(const void* registered, std::uint64_t offset,
                                        bool virtual_addresses);

// What is wrong with the region `peer` published for a channel whose own slots are `slots` of
// `slot_bytes` (both ends must agree: the sender computes slot addresses from its peer's
// figures, the receiver reads slots by its own), naming both ranks' views; nullopt when it fits.
[[nodiscard]] std::optional<std::string> check_region(const SlotRegion& theirs,
                                                      std::size_t slot_bytes, std::uint32_t slots,
                                                      int self, int peer);

// What is wrong with the prefix `p` found in slot seq % slots when a write announced fragment
// `seq`: it must be a data fragment of this communicator (`tag`), carry the same sequence
// number, and fit its slot of `slot_bytes`; `written`, where the transport reports how many
// bytes the write placed, must be the prefix and its body. nullopt when it is sound.
[[nodiscard]] std::optional<std::string> check_written(const Prefix& p, std::uint32_t seq,
                                                       std::uint64_t tag, std::size_t slot_bytes,
                                                       std::optional<std::size_t> written);

}  // namespace dear::transport::rma
