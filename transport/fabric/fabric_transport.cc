// transport "fabric": libfabric RDM endpoints (fabric_link.h). Registered in
// transport/registry.cc; compiled with or without libfabric (fabric_stub.cc then answers).
#include <algorithm>

#include "dear/error.h"
#include "transport/fabric/fabric_link.h"
#include "transport/rma/rma_transport.h"
#include "transport/transport.h"

namespace dear::transport::fabric {
namespace {

// A ring slot holds a whole slice of up to this many bytes (plus room for the fragment prefix
// and the frame header), so that a slice is one fragment; larger slices gain nothing from
// larger slots (docs/results.md has the measurements).
constexpr std::size_t kMaxRingSlotPayload = std::size_t{1} << 20;
constexpr std::size_t kSlotHeadroom = 4096;
class FabricTransport final : public rma::RmaTransport {
 public:
  std::string_view name() const override { return "fabric"; }
  std::optional<std::string> missing() const override {
    if (built()) return std::nullopt;
    return unavailable_reason("");
  }
  std::optional<std::string> unavailable(const TransportOptions& o) const override {
    if (o.fabric_data_path == "write") return write_unavailable_reason(o.fabric_provider);
    return unavailable_reason(o.fabric_provider);
  }
  void check(const TransportOptions& o) const override {
    if (!parse_data_path(o.fabric_data_path)) {
      throw Error(ErrorCode::kInvalidArgument,
                  "CommOptions::fabric_data_path='" + o.fabric_data_path +
                      "' is not one of auto, write, send (DEAR_FABRIC_DATA_PATH)");
    }
    if (o.fabric_hmem != "auto" && o.fabric_hmem != "on" && o.fabric_hmem != "off") {
      throw Error(ErrorCode::kInvalidArgument,
                  "CommOptions::fabric_hmem='" + o.fabric_hmem +
                      "' is not one of auto, on, off (DEAR_FABRIC_HMEM)");
    }
  }

  Links connect(Bootstrap& bootstrap, const std::vector<int>& mesh_peers,
                const TransportOptions& o) const override {
    FabricOptions mesh;
    mesh.provider = o.fabric_provider;
    mesh.data_path = *parse_data_path(o.fabric_data_path);
    mesh.deadline = o.deadline;
    mesh.hmem = o.fabric_hmem == "on";
    if (o.fabric_slot_bytes > 0) mesh.slot_bytes = o.fabric_slot_bytes;
    if (o.direct_bytes >= 0) mesh.direct_bytes = static_cast<std::size_t>(o.direct_bytes);
    // Ring links carry the large operations: a slot holds a whole slice (and its header). The
    // mesh links carry the log-step schedules of small operations; there are N-1 of them, so
    // they keep the back-end's smaller slots.
    FabricOptions ring = mesh;
    if (o.fabric_slot_bytes == 0) {
      ring.slot_bytes = std::min(o.slice_bytes, kMaxRingSlotPayload) + kSlotHeadroom;
    }
    auto c = fabric::connect(bootstrap, o.channels, ring, mesh_peers, mesh);
    return links_of(std::move(c.ring), std::move(c.mesh));
  }
};

}  // namespace

const Transport& transport() {
  static const FabricTransport t;
  return t;
}

}  // namespace dear::transport::fabric
