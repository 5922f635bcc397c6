// The choices made when an RC queue pair is connected, as pure functions of what the two ports
// report and what the options ask, so they are unit tested without a device (tests/
// test_verbs.cc) and verbs_link.cc only copies the plan into ibv_qp_attr.
//
// Defaults (VerbsOptions) and why:
// - path MTU: the port's active MTU, lowered to the peer's (both ends must use one value);
//   VerbsOptions::mtu lowers it further.
// - timeout 18 (4.096 us * 2^18, about 1.07 s per try), retry_count 7, rnr_retry 7 (retry
//   without limit: a receiver that has not reposted yet is slow, not broken),
//   min_rnr_timer 12 (0.64 ms): NCCL's defaults, proven on large clusters.
// - one outstanding RDMA READ / atomic each way (max_rd_atomic = max_dest_rd_atomic = 1): the
//   data path only writes; the GPU flush reads one byte at a time.
// - GRH (global routing) on RoCE always, on InfiniBand when the peer has no LID or sits on
//   another subnet; hop limit 255.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "transport/verbs/verbs_link.h"

namespace dear::transport::verbs {

enum class LinkLayer : std::uint8_t { kInfiniBand = 1, kEthernet = 2 };
enum class GidType : std::uint8_t { kInfiniBand = 0, kRoceV1 = 1, kRoceV2 = 2 };

using Gid = std::array<std::uint8_t, 16>;

struct GidEntry {
  int index = 0;
  GidType type = GidType::kInfiniBand;
  Gid gid{};
};

// What one end publishes about its queue pair (and what the other end needs to reach it).
struct QpEndpoint {
  LinkLayer link_layer = LinkLayer::kInfiniBand;
  std::uint16_t lid = 0;
  std::uint32_t mtu = 0;  // the port's active MTU in bytes
  std::uint32_t qpn = 0;
  std::uint32_t psn = 0;  // the first packet sequence number it sends (24 bits)
  Gid gid{};
  int gid_index = 0;
};

// Everything the INIT -> RTR -> RTS transitions set, in plain values.
struct ConnectionPlan {
  std::uint8_t port = 1;
  // RTR
  std::uint32_t path_mtu = 0;  // bytes
  std::uint32_t dest_qpn = 0;
  std::uint32_t rq_psn = 0;  // = the peer's send PSN
  std::uint8_t max_dest_rd_atomic = 1;
  std::uint8_t min_rnr_timer = 12;
  std::uint16_t dlid = 0;
  std::uint8_t service_level = 0;
  bool use_grh = false;
  Gid dgid{};
  std::uint8_t sgid_index = 0;
  std::uint8_t hop_limit = 255;
  std::uint8_t traffic_class = 0;
  // RTS
  std::uint32_t sq_psn = 0;  // = this end's PSN
  std::uint8_t timeout = 18;
  std::uint8_t retry_count = 7;
  std::uint8_t rnr_retry = 7;
  std::uint8_t max_rd_atomic = 1;
};

// The plan for connecting `local` (on port `port`) to `remote`. Throws dear::Error:
// kInvalidArgument (an option out of range: names it), kMismatch (the ends sit on different
// link layers, or a RoCE peer sent no GID). `rank`/`peer` are for the error.
[[nodiscard]] ConnectionPlan plan_connection(const QpEndpoint& local, const QpEndpoint& remote,
                                             std::uint8_t port, const VerbsOptions& options,
                                             int rank = -1, int peer = -1);

// Bytes of an IB MTU code (IBV_MTU_256 = 1 ... IBV_MTU_4096 = 5) and back; 0 when invalid.
[[nodiscard]] std::uint32_t mtu_bytes(int code);
[[nodiscard]] int mtu_code(std::uint32_t bytes);

// The GID index to use on a port with link layer `link` and GID table `table` (empty entries
// already left out): `requested` when >= 0 (it must be in the table), else the automatic
// choice documented at VerbsOptions::gid_index. Throws dear::Error(kInvalidArgument) naming the
// table when there is nothing usable.
[[nodiscard]] int choose_gid_index(const std::vector<GidEntry>& table, LinkLayer link,
                                   int requested, int rank = -1);

// "mlx5_0" or "mlx5_0:2" -> name and port (0 = the first active port). Throws
// dear::Error(kInvalidArgument) for a malformed port.
struct DeviceSpec {
  std::string name;
  int port = 0;
};
[[nodiscard]] DeviceSpec parse_device_spec(const std::string& text, int rank = -1);

// Text of a GID, "fe80:0000:...", for messages.
[[nodiscard]] std::string gid_text(const Gid& gid);

}  // namespace dear::transport::verbs
