#include "transport/rma/slot_region.h"

#include "dear/error.h"

namespace dear::transport::rma {

std::uint64_t slot_address(const SlotRegion& region, std::uint32_t seq) {
  if (region.slots == 0) throw Error(ErrorCode::kInternal, "slot_address: a region of no slots");
  return region.base + static_cast<std::uint64_t>(seq % region.slots) * region.slot_bytes;
}

std::uint64_t region_base(const void* registered, std::uint64_t offset, bool virtual_addresses) {
  if (!virtual_addresses) return offset;
  return static_cast<std::uint64_t>(reinterpret_cast<std::uintptr_t>(registered)) + offset;
}

std::optional<std::string> check_region(const SlotRegion& theirs, std::size_t slot_bytes,
                                        std::uint32_t slots, int self, int peer) {
  if (theirs.slots == slots && theirs.slot_bytes == slot_bytes) return std::nullopt;
  return "rank " + std::to_string(peer) + " offers " + std::to_string(theirs.slots) + " slots of " +
         std::to_string(theirs.slot_bytes) + " bytes to write into, rank " + std::to_string(self) +
         " has " + std::to_string(slots) + " of " + std::to_string(slot_bytes) +
         " (slot sizes follow the slice size: do the ranks agree?)";
}

std::optional<std::string> check_written(const Prefix& p, std::uint32_t seq, std::uint64_t tag,
                                         std::size_t slot_bytes,
                                         std::optional<std::size_t> written) {
  // Built only on the failure paths: this runs for every fragment received.
  const auto what = [seq] {
    return "protocol violation: the write announced as fragment " + std::to_string(seq) + " left ";
  };
  if (p.tag != tag) return what() + "a prefix of another communicator in its slot";
  if (p.kind != Kind::kData) {
    return what() + "a prefix of kind " + std::to_string(static_cast<int>(p.kind)) + " in its slot";
  }
  if (p.seq != seq) return what() + "fragment " + std::to_string(p.seq) + " in its slot";
  if (slot_bytes < kPrefix || p.bytes > slot_bytes - kPrefix) {
    return what() + "a fragment of " + std::to_string(p.bytes) + " bytes, more than its slot of " +
           std::to_string(slot_bytes) + " holds after the prefix";
  }
  if (written && *written != kPrefix + p.bytes) {
    return what() + std::to_string(*written) + " bytes that say they hold " +
           std::to_string(p.bytes) + " after the prefix";
  }
  return std::nullopt;
}

}  // namespace dear::transport::rma
