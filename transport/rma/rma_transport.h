// What the back-ends with receiver-owned slots (fabric, verbs) share as registry entries
// (transport/transport.h): their messages are cut into fragments of the mesh links' slots, so
// the log-step schedules keep their lead over the ring to smaller sizes than over TCP
// (docs/results.md); and options they need not check.
#pragma once

#include <cstdint>

#include "transport/transport.h"

namespace dear::transport::rma {

class RmaTransport : public Transport {
 public:
  static constexpr std::int64_t kLogStepMaxBytes = std::int64_t{256} << 10;
  void check(const TransportOptions&) const override {}
  [[nodiscard]] std::int64_t log_step_max_bytes(int) const override { return kLogStepMaxBytes; }
};

}  // namespace dear::transport::rma
