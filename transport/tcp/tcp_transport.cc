// transport "tcp": the ring and mesh links over TCP (tcp_channel.h), their listeners'
// addresses exchanged through the bootstrap. Registered in transport/registry.cc.

#include <chrono>
#include <cstdio>

#include "dear/error.h"
#include "transport/signals.h"
#include "transport/socket_util.h"
#include "transport/tcp/tcp_channel.h"
#include "transport/transport.h"

namespace dear::transport::tcp {
namespace {

constexpr std::uint32_t kAddressVersion = 2;
// The log-step schedules' reach over TCP (CommOptions::halving_max_bytes' default): up to four
// ranks their fewer steps beat the ring to larger sizes than on more ranks, where the ring's
// bandwidth wins sooner (docs/results.md has the measurements).
constexpr std::int64_t kMediumBytes = std::int64_t{1} << 20;
constexpr std::int64_t kMediumBytesFourRanks = std::int64_t{4} << 20;

struct AddressRecord {
  char host[64];
  std::uint16_t port;
  std::uint16_t mesh_port;
  std::int32_t channels;
  std::uint32_t version;
  std::uint64_t tag;
};

class TcpTransport final : public Transport {
 public:
  std::string_view name() const override { return "tcp"; }
  std::optional<std::string> missing() const override { return std::nullopt; }
  std::optional<std::string> unavailable(const TransportOptions&) const override {
    return std::nullopt;
  }
  // Read by every TCP channel; checked before any link is built, so that a bad value fails
  // every rank at once instead of the first channel's rank alone.
  void check(const TransportOptions&) const override {
    (void)socket_buffer_from_env();
    check_congestion_control_env();
  }
  std::int64_t log_step_max_bytes(int ranks) const override {
    return ranks <= 4 ? kMediumBytesFourRanks : kMediumBytes;
  }
  Links connect(Bootstrap& bootstrap, const std::vector<int>& mesh_peers,
                const TransportOptions& options) const override;
};

Links TcpTransport::connect(Bootstrap& bootstrap, const std::vector<int>& mesh_peers,
                            const TransportOptions& options) const {
  const int rank = bootstrap.rank();
  const int size = bootstrap.size();
  const std::string host = bootstrap.advertise_host();
  // The listeners listen once the peers' addresses are known (their congestion control
  // depends on them); a peer that connects sooner is refused and tries again.
  Fd listener = bind_unlistened(resolve(host, 0));
  // The mesh has a listener of its own: a rank still accepting its ring links must not be
  // offered a mesh connection it would take for a stranger.
  Fd mesh_listener = bind_unlistened(resolve(host, 0));
  AddressRecord mine{};
  std::snprintf(mine.host, sizeof(mine.host), "%s", host.c_str());
  mine.port = local_address(listener.get()).port();
  mine.mesh_port = local_address(mesh_listener.get()).port();
  mine.channels = options.channels;
  mine.version = kAddressVersion;
  mine.tag = random_u64();
  std::vector<AddressRecord> all(static_cast<std::size_t>(size));
  bootstrap.all_gather(&mine, sizeof(mine), all.data());
  for (int r = 0; r < size; ++r) {
    const auto& rec = all[static_cast<std::size_t>(r)];
    if (rec.channels != options.channels || rec.version != kAddressVersion) {
      throw Error(ErrorCode::kMismatch,
                  "rank " + std::to_string(r) + " uses channels=" + std::to_string(rec.channels) +
                      ", rank " + std::to_string(rank) +
                      " uses channels=" + std::to_string(options.channels) +
                      " (DEAR_CHANNELS / CommOptions::channels must agree)",
                  rank, r, "create");
    }
  }
  const std::uint64_t tag = all[0].tag;
  const int next = (rank + 1) % size;
  const int prev = (rank - 1 + size) % size;
  const auto address_of = [&](int r) {
    const auto& rec = all[static_cast<std::size_t>(r)];
    return resolve(rec.host, 0);
  };
  listen_for(listener.get(), {address_of(prev)});
  std::vector<SockAddr> lower_addresses;
  for (int p : mesh_peers) {
    if (p < rank) lower_addresses.push_back(address_of(p));
  }
  listen_for(mesh_listener.get(), lower_addresses);
  const std::uint8_t* secret = bootstrap.id().secret.data();
  Links links;
  const auto& n = all[static_cast<std::size_t>(next)];
  links.to_next = connect_link(resolve(n.host, n.port), rank, next, options.channels, secret, tag,
                               options.deadline);
  auto from =
      accept_links(listener.get(), rank, {prev}, options.channels, secret, tag, options.deadline);
  links.from_prev = std::move(from.at(0));
  // Mesh: connect to the higher peers, accept from the lower ones (one channel each).
  const std::uint64_t mesh_tag = tag ^ 0x6d657368ULL;  // "mesh": apart from the ring's
  std::vector<int> lower;
  std::vector<std::unique_ptr<Channel>> higher;
  for (int p : mesh_peers) {
    if (p < rank) {
      lower.push_back(p);
      continue;
    }
    const auto& rec = all[static_cast<std::size_t>(p)];
    auto ch = connect_link(resolve(rec.host, rec.mesh_port), rank, p, 1, secret, mesh_tag,
                           options.deadline);
    higher.push_back(std::move(ch.at(0)));
  }
  auto accepted =
      accept_links(mesh_listener.get(), rank, lower, 1, secret, mesh_tag, options.deadline);
  std::size_t li = 0;
  std::size_t hi = 0;
  for (int p : mesh_peers) {
    links.mesh.push_back(p < rank ? std::move(accepted.at(li++).at(0))
                                  : std::move(higher.at(hi++)));
  }
  return links;
}

}  // namespace

const Transport& transport() {
  static const TcpTransport t;
  return t;
}

}  // namespace dear::transport::tcp
