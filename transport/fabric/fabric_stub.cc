// Builds without libfabric: the fabric transport reports itself unavailable.
#include "dear/error.h"
#include "transport/fabric/fabric_link.h"

namespace dear::transport::fabric {
namespace {
constexpr const char* kWhy =
    "this build of dear has no libfabric transport (libfabric was not found "
    "when it was "
    "configured; install libfabric-dev and reconfigure)";
}  // namespace

bool built() { return false; }

std::vector<std::string> available_providers() { return {}; }

std::optional<std::string> unavailable_reason(const std::string&) { return std::string(kWhy); }

std::optional<std::string> write_unavailable_reason(const std::string&) {
  return std::string(kWhy);
}

std::optional<std::string> hmem_unavailable_reason(const std::string&) { return std::string(kWhy); }

std::uint64_t registrations_made(const Channel&) { return 0; }
std::uint64_t window_registrations_made(const Channel&) { return 0; }
std::uint64_t direct_received_total() { return 0; }
std::size_t queue_members(const Channel&) { return 0; }
const void* endpoint_of(const Channel&) { return nullptr; }

RingLinks connect_ring(Bootstrap& bootstrap, int, const FabricOptions&) {
  throw Error(ErrorCode::kInvalidArgument, kWhy, bootstrap.rank());
}

std::vector<std::unique_ptr<Channel>> connect_peers(Bootstrap& bootstrap, const std::vector<int>&,
                                                    const FabricOptions&) {
  throw Error(ErrorCode::kInvalidArgument, kWhy, bootstrap.rank());
}

Connected connect(Bootstrap& bootstrap, int, const FabricOptions&, const std::vector<int>&,
                  const FabricOptions&) {
  throw Error(ErrorCode::kInvalidArgument, kWhy, bootstrap.rank());
}

}  // namespace dear::transport::fabric
