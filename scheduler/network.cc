#include "dear/scheduler/network.h"

namespace dear::scheduler {

NetModel net_10gbe() {
  NetModel n;
  n.name = "10gbe";
  n.alpha_s = 50e-6;
  n.gap_s = 10e-6;
  n.beta_s_per_byte = 8.0 / 9.4e9;
  return n;
}

NetModel net_100gib() {
  NetModel n;
  n.name = "100gib";
  n.alpha_s = 6e-6;
  n.gap_s = 1.5e-6;
  n.beta_s_per_byte = 1.0 / 11.5e9;
  return n;
}

std::optional<NetModel> net_by_name(std::string_view name) {
  if (name == "10gbe") return net_10gbe();
  if (name == "100gib") return net_100gib();
  return std::nullopt;
}

const char* to_string(OpKind kind) noexcept {
  switch (kind) {
    case OpKind::kReduceScatter: return "RS";
    case OpKind::kAllGather: return "AG";
    case OpKind::kAllReduce: return "AR";
  }
  return "?";
}

int ring_steps(OpKind kind, int ranks) {
  return kind == OpKind::kAllReduce ? 2 * (ranks - 1) : ranks - 1;
}

std::int64_t ring_chunk_bytes(std::int64_t elements, int ranks, int element_bytes) {
  return (elements + ranks - 1) / ranks * element_bytes;
}

double op_time(const NetModel& net, OpKind kind, std::int64_t elements, int ranks,
               int element_bytes) {
  const auto chunk = static_cast<double>(ring_chunk_bytes(elements, ranks, element_bytes));
  return net.op_overhead_s + ring_steps(kind, ranks) * (net.alpha_s + net.beta_s_per_byte * chunk);
}

}  // namespace dear::scheduler
