// The transport registry: every back-end (tcp, shm, fabric, verbs) is one Transport, registered in
// transport/registry.cc, and a communicator asks the registry for the back-end it was told
// to use (CommOptions::transport, DEAR_TRANSPORT) by name. The communicator includes no
// back-end header: what a back-end implements is this interface, and the links it makes keep
// the contract of transport/link.h. See docs/architecture.md ("transport/").
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "dear/bootstrap.h"
#include "transport/link.h"
#include "transport/socket_util.h"

namespace dear::transport {

// What a communicator hands a back-end: the shape of the links and the options that its
// users set (CommOptions' transport fields, after their environment overrides). A back-end
// reads the fields it knows and ignores the others.
struct TransportOptions {
  int channels = 1;             // channels of each ring link
  std::size_t slice_bytes = 0;  // the communicator's slice: the largest ring message payload
  Deadline deadline = Deadline::max();
  std::string fabric_provider;        // fabric: the libfabric provider ("" = the first that works)
  std::size_t fabric_slot_bytes = 0;  // fabric: slot bytes; 0 = the back-end's choice
  std::string fabric_data_path = "auto";  // fabric: auto, write or send
  std::string fabric_hmem = "off";        // fabric: FI_HMEM asked for: on or off (auto: as off)
  std::int64_t direct_bytes = -1;         // fabric, verbs: direct messages from; -1 = default
  std::string ib_device;                  // verbs: device[:port]; "" = the first active one
  int ib_gid_index = -1;                  // verbs: GID index; -1 = automatic
};

// The links of one communicator: the ring in both directions and, where the back-end made
// them, one channel to each mesh peer (in the order asked for). An empty mesh says the
// back-end has none: the log-step schedules are then not used.
struct Links {
  std::vector<std::unique_ptr<Channel>> to_next;
  std::vector<std::unique_ptr<Channel>> from_prev;
  std::vector<std::unique_ptr<Channel>> mesh;
};

// Links from a back-end's ring links and its mesh channels (made after the ring, in that
// order on every rank).
[[nodiscard]] inline Links links_of(RingLinks ring, std::vector<std::unique_ptr<Channel>> mesh) {
  Links links;
  links.to_next = std::move(ring.to_next);
  links.from_prev = std::move(ring.from_prev);
  links.mesh = std::move(mesh);
  return links;
}

class Transport {
 public:
  virtual ~Transport() = default;
  // The name users select it by.
  [[nodiscard]] virtual std::string_view name() const = 0;
  // Why this build does not have the back-end (its library was not found when dear was
  // configured), or nullopt when it was built.
  [[nodiscard]] virtual std::optional<std::string> missing() const = 0;
  // Why the back-end cannot run on this host with `options` (no device, no such provider),
  // or nullopt when it can. May probe the host: not free.
  [[nodiscard]] virtual std::optional<std::string> unavailable(
      const TransportOptions& options) const = 0;
  // Checks the back-end's own options before any link is made; throws
  // dear::Error(kInvalidArgument) naming the option (its CommOptions field and environment
  // variable). Runs for every registered back-end, whichever is selected, so that a bad value
  // fails at once rather than on the day the back-end is chosen.
  virtual void check(const TransportOptions& options) const = 0;
  // CommOptions::halving_max_bytes's default over this back-end on `ranks` ranks: the largest
  // operation for which the log-step schedules are chosen over the ring.
  [[nodiscard]] virtual std::int64_t log_step_max_bytes(int ranks) const = 0;
  // Makes the links: the ring (to the next and from the previous rank, `options.channels`
  // channels each) and one channel to each of `mesh_peers`. Collective over the bootstrap's
  // ranks; throws dear::Error naming the rank and peer on failure.
  [[nodiscard]] virtual Links connect(Bootstrap& bootstrap, const std::vector<int>& mesh_peers,
                                      const TransportOptions& options) const = 0;
};

// Every back-end this source tree has, built or not, in the order of the registration list.
[[nodiscard]] const std::vector<const Transport*>& transports();
// The back-end named `name` that this build has. Throws dear::Error(kInvalidArgument) for an
// unknown name or one this build lacks, naming `what` (e.g. "CommOptions::transport") and
// listing what this build has and why each missing one is missing.
[[nodiscard]] const Transport& find_transport(std::string_view name, int rank,
                                              const std::string& what);

}  // namespace dear::transport
