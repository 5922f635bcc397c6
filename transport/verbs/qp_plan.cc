#include "transport/verbs/qp_plan.h"

#include <algorithm>
#include <cstdio>

#include "dear/error.h"

namespace dear::transport::verbs {
namespace {

bool is_zero(const Gid& g) {
  return std::all_of(g.begin(), g.end(), [](std::uint8_t b) { return b == 0; });
}

// ::ffff:a.b.c.d, the form RoCE v2 GIDs of IPv4 addresses take.
bool is_ipv4_mapped(const Gid& g) {
  for (int i = 0; i < 10; ++i) {
    if (g[static_cast<std::size_t>(i)] != 0) return false;
  }
  return g[10] == 0xff && g[11] == 0xff;
}

bool is_link_local(const Gid& g) { return g[0] == 0xfe && (g[1] & 0xc0) == 0x80; }

std::uint64_t subnet_prefix(const Gid& g) {
  std::uint64_t p = 0;
  for (int i = 0; i < 8; ++i) p = (p << 8) | g[static_cast<std::size_t>(i)];
  return p;
}

const char* type_text(GidType t) {
  switch (t) {
    case GidType::kInfiniBand: return "IB";
    case GidType::kRoceV1: return "RoCE v1";
    case GidType::kRoceV2: return "RoCE v2";
  }
  return "?";
}

std::string table_text(const std::vector<GidEntry>& table) {
  if (table.empty()) return "an empty GID table";
  std::string s;
  for (const auto& e : table) {
    s += (s.empty() ? "" : ", ") + std::to_string(e.index) + " (" + type_text(e.type) + " " +
         gid_text(e.gid) + ")";
  }
  return s;
}

}  // namespace

std::uint32_t mtu_bytes(int code) { return code >= 1 && code <= 5 ? 128U << code : 0; }

int mtu_code(std::uint32_t bytes) {
  for (int c = 1; c <= 5; ++c) {
    if (mtu_bytes(c) == bytes) return c;
  }
  return 0;
}

std::string gid_text(const Gid& gid) {
  std::string s;
  char buf[8];
  for (std::size_t i = 0; i < gid.size(); i += 2) {
    std::snprintf(buf, sizeof(buf), "%02x%02x", gid[i], gid[i + 1]);
    s += (i == 0 ? "" : ":") + std::string(buf);
  }
  return s;
}

ConnectionPlan plan_connection(const QpEndpoint& local, const QpEndpoint& remote, std::uint8_t port,
                               const VerbsOptions& o, int rank, int peer) {
  const auto bad = [&](const std::string& what) {
    return Error(ErrorCode::kInvalidArgument, "verbs: " + what, rank, peer, "verbs setup");
  };
  if (o.timeout > 31) throw bad("timeout=" + std::to_string(o.timeout) + " is outside [0, 31]");
  if (o.retry_count > 7) {
    throw bad("retry_count=" + std::to_string(o.retry_count) + " is outside [0, 7]");
  }
  if (o.rnr_retry > 7) throw bad("rnr_retry=" + std::to_string(o.rnr_retry) + " is outside [0, 7]");
  if (o.min_rnr_timer > 31) {
    throw bad("min_rnr_timer=" + std::to_string(o.min_rnr_timer) + " is outside [0, 31]");
  }
  if (o.service_level > 15) {
    throw bad("service_level=" + std::to_string(o.service_level) + " is outside [0, 15]");
  }
  if (o.mtu != 0 && mtu_code(o.mtu) == 0) {
    throw bad("mtu=" + std::to_string(o.mtu) + " is not one of 256, 512, 1024, 2048, 4096");
  }
  if (mtu_code(local.mtu) == 0 || mtu_code(remote.mtu) == 0) {
    throw Error(ErrorCode::kMismatch,
                "verbs: port MTUs " + std::to_string(local.mtu) + " (rank " + std::to_string(rank) +
                    ") and " + std::to_string(remote.mtu) + " (rank " + std::to_string(peer) +
                    ") are not both valid IB MTUs",
                rank, peer, "verbs setup");
  }
  if (local.link_layer != remote.link_layer) {
    const auto name = [](LinkLayer l) {
      return l == LinkLayer::kEthernet ? std::string("Ethernet (RoCE)") : std::string("InfiniBand");
    };
    throw Error(ErrorCode::kMismatch,
                "verbs: rank " + std::to_string(rank) + "'s port is " + name(local.link_layer) +
                    ", rank " + std::to_string(peer) + "'s is " + name(remote.link_layer),
                rank, peer, "verbs setup");
  }
  ConnectionPlan p;
  p.port = port;
  p.path_mtu = std::min(local.mtu, remote.mtu);
  if (o.mtu != 0) p.path_mtu = std::min(p.path_mtu, o.mtu);
  p.dest_qpn = remote.qpn;
  p.rq_psn = remote.psn & 0xffffffU;
  p.sq_psn = local.psn & 0xffffffU;
  p.min_rnr_timer = o.min_rnr_timer;
  p.service_level = o.service_level;
  p.traffic_class = o.traffic_class;
  p.timeout = o.timeout;
  p.retry_count = o.retry_count;
  p.rnr_retry = o.rnr_retry;
  p.dlid = remote.lid;
  if (local.link_layer == LinkLayer::kEthernet) {
    if (is_zero(remote.gid)) {
      throw Error(ErrorCode::kMismatch,
                  "verbs: rank " + std::to_string(peer) +
                      " sent no GID, which RoCE needs (set its gid_index / DEAR_IB_GID_INDEX)",
                  rank, peer, "verbs setup");
    }
    p.use_grh = true;
    p.dlid = 0;
  } else {
    p.use_grh = remote.lid == 0 ||
                (!is_zero(remote.gid) && subnet_prefix(remote.gid) != subnet_prefix(local.gid));
  }
  if (p.use_grh) {
    p.dgid = remote.gid;
    p.sgid_index = static_cast<std::uint8_t>(local.gid_index);
  }
  return p;
}

int choose_gid_index(const std::vector<GidEntry>& table, LinkLayer link, int requested, int rank) {
  if (requested >= 0) {
    for (const auto& e : table) {
      if (e.index == requested) return requested;
    }
    throw Error(ErrorCode::kInvalidArgument,
                "verbs: gid_index=" + std::to_string(requested) +
                    " is not in the port's GID table (" + table_text(table) + ")",
                rank, Error::kNone, "verbs setup");
  }
  if (link == LinkLayer::kInfiniBand) {
    // Index 0 holds the port GID (subnet prefix + GUID) on InfiniBand.
    for (const auto& e : table) {
      if (e.index == 0) return 0;
    }
    if (!table.empty()) return table.front().index;
    return 0;  // IB works on LIDs alone within a subnet
  }
  // RoCE: v2 (routable) with an IPv4 address first, then any non-link-local v2, then v2, then
  // v1; ties go to the lowest index.
  int best = -1;
  int best_rank = 0;
  for (const auto& e : table) {
    if (is_zero(e.gid)) continue;
    int r = 0;
    if (e.type == GidType::kRoceV2) {
      r = is_ipv4_mapped(e.gid) ? 4 : (!is_link_local(e.gid) ? 3 : 2);
    } else if (e.type == GidType::kRoceV1) {
      r = 1;
    }
    if (r > best_rank || (r == best_rank && r > 0 && e.index < best)) {
      best = e.index;
      best_rank = r;
    }
  }
  if (best < 0) {
    throw Error(ErrorCode::kInvalidArgument,
                "verbs: no usable RoCE GID on the port (" + table_text(table) +
                    "); is an IP address configured on its network interface?",
                rank, Error::kNone, "verbs setup");
  }
  return best;
}

DeviceSpec parse_device_spec(const std::string& text, int rank) {
  DeviceSpec d;
  const auto colon = text.rfind(':');
  if (colon == std::string::npos) {
    d.name = text;
    return d;
  }
  d.name = text.substr(0, colon);
  const std::string port = text.substr(colon + 1);
  int v = 0;
  bool ok = !port.empty() && port.size() <= 3;
  for (const char c : port) {
    if (c < '0' || c > '9') ok = false;
    v = v * 10 + (c - '0');
  }
  if (!ok || v < 1 || d.name.empty()) {
    throw Error(ErrorCode::kInvalidArgument,
                "verbs: device '" + text + "' is not NAME or NAME:PORT (a port from 1)", rank);
  }
  d.port = v;
  return d;
}

}  // namespace dear::transport::verbs
