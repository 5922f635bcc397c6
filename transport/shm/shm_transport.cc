// transport "shm": the ring and mesh links between ranks of one host through shared memory
// (shm_channel.h), and TCP to ranks on other hosts. The TCP transport connects the ranks
// first; each of its channels to a rank of the same host becomes the control socket of a
// shared-memory channel, the others stay as they are. Every rank makes one segment (a memfd)
// holding the rings it reads, one per channel that ends here, and the ranks of one host map
// each other's segments through /proc/<pid>/fd/<fd>, which works for processes of one user
// in one PID namespace (a failure is reported, naming both ranks). "One host" is one running
// kernel: the same boot id. Registered in transport/registry.cc.
#include "transport/shm/shm_transport.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>

#include "dear/error.h"
#include "transport/shm/shm_channel.h"
#include "transport/socket_util.h"
#include "transport/transport.h"

namespace dear::transport {
namespace tcp {
const Transport& transport();
}

namespace shm {
namespace {

constexpr std::uint32_t kSegmentVersion = 1;
constexpr std::uint64_t kMagic = 0x6465617273686d31ULL;  // "dearshm1"
// One ring's head (its RingControl, on a page of its own) and data.
constexpr std::size_t kControlBytes = 4096;
constexpr std::size_t kRingBytes = std::size_t{1} << 20;
constexpr std::size_t kRingStride = kControlBytes + kRingBytes;
static_assert(sizeof(RingControl) <= kControlBytes);
// The log-step schedules' reach (CommOptions::halving_max_bytes' default). Over TCP they beat
// the ring up to 4 MiB on four ranks; here the ring's steps cost less, and it won from 2 MiB
// on (4 ranks, all_reduce: 1334 against 1733 us at 2 MiB, 2847 against 4185 us at 4 MiB,
// `dear-bench --compare`; docs/transports.md, "shm transport").
constexpr std::int64_t kMediumBytes = std::int64_t{1} << 20;

// The first page of a segment.
struct SegmentHead {
  std::uint64_t magic;
  std::uint64_t tag;
  std::int32_t rank;
};

// Which host each rank is on (its kernel's boot id, or what the caller named).
struct HostRecord {
  char id[40];
};

// What each rank tells the others about its segment.
struct SegmentRecord {
  std::int32_t pid;
  std::int32_t fd;
  std::uint64_t tag;
  std::uint64_t bytes;  // the layout: the same channels and local ranks give the same size
  std::uint32_t version;
};

// What each rank tells the others after mapping theirs: 0, or the rank it could not map.
struct MapResult {
  std::int32_t failed_peer;
  char why[200];
};

// This kernel's boot id (/proc/sys/kernel/random/boot_id): the same for every process of
// one host, containers included, and different on every other host; empty where unreadable.
std::string boot_id() {
  char id[40] = {};
  std::FILE* f = std::fopen("/proc/sys/kernel/random/boot_id", "r");
  if (f == nullptr) return {};
  const bool ok = std::fgets(id, sizeof(id), f) != nullptr;
  std::fclose(f);
  if (!ok) return {};
  std::string s(id);
  while (!s.empty() && (s.back() == '\n' || s.back() == ' ')) s.pop_back();
  return s;
}

std::string this_host() {
  char name[64] = {};
  if (::gethostname(name, sizeof(name) - 1) != 0) return "?";
  return name;
}

// Which ring of a rank's segment a channel ending there reads: the ring links' channels from
// the previous rank, then from the next, then one per mesh peer of the same host (by the
// peer's place among the host's ranks).
struct RingIndex {
  int channels;
  const std::vector<int>& local;  // per rank: its place among this host's ranks, or -1
  [[nodiscard]] std::size_t from_prev(int c) const { return static_cast<std::size_t>(c); }
  [[nodiscard]] std::size_t from_next(int c) const {
    return static_cast<std::size_t>(channels + c);
  }
  [[nodiscard]] std::size_t from_mesh(int peer) const {
    return static_cast<std::size_t>(2 * channels + local[static_cast<std::size_t>(peer)]);
  }
};

Ring ring_at(char* segment, std::size_t index) {
  char* base = segment + kControlBytes + index * kRingStride;
  return Ring{reinterpret_cast<RingControl*>(base), base + kControlBytes, kRingBytes};
}

class ShmTransport final : public Transport {
 public:
  std::string_view name() const override { return "shm"; }
  std::optional<std::string> missing() const override { return std::nullopt; }
  std::optional<std::string> unavailable(const TransportOptions&) const override {
    return std::nullopt;
  }
  void check(const TransportOptions&) const override {}
  std::int64_t log_step_max_bytes(int) const override { return kMediumBytes; }
  Links connect(Bootstrap& bootstrap, const std::vector<int>& mesh_peers,
                const TransportOptions& options) const override;
};

Links ShmTransport::connect(Bootstrap& bootstrap, const std::vector<int>& mesh_peers,
                            const TransportOptions& options) const {
  return connect_links(bootstrap, mesh_peers, options, boot_id());
}

}  // namespace

Links connect_links(Bootstrap& bootstrap, const std::vector<int>& mesh_peers,
                    const TransportOptions& options, const std::string& host_id) {
  const int rank = bootstrap.rank();
  const int size = bootstrap.size();
  // The control sockets, and with them the same checks of the options as over TCP.
  Links control = tcp::transport().connect(bootstrap, mesh_peers, options);

  // The ranks of this host: shared memory with them, TCP with the others.
  HostRecord own_host{};
  std::snprintf(own_host.id, sizeof(own_host.id), "%s", host_id.c_str());
  std::vector<HostRecord> hosts(static_cast<std::size_t>(size));
  bootstrap.all_gather(&own_host, sizeof(own_host), hosts.data());
  std::vector<int> local(static_cast<std::size_t>(size), -1);
  int locals = 0;
  for (int r = 0; r < size; ++r) {
    const bool same =
        r == rank || (!host_id.empty() && std::strncmp(hosts[static_cast<std::size_t>(r)].id,
                                                       own_host.id, sizeof(own_host.id)) == 0);
    if (same) local[static_cast<std::size_t>(r)] = locals++;
  }
  const RingIndex index{options.channels, local};
  const std::size_t rings =
      2 * static_cast<std::size_t>(options.channels) + static_cast<std::size_t>(locals);
  const std::size_t bytes = kControlBytes + rings * kRingStride;
  Fd own(::memfd_create("dear-shm", MFD_CLOEXEC));
  if (!own.valid() || ::ftruncate(own.get(), static_cast<off_t>(bytes)) != 0) {
    throw Error(ErrorCode::kSystem,
                std::string("transport 'shm': cannot make a shared-memory segment of ") +
                    std::to_string(bytes) + " bytes (" + std::strerror(errno) + ")",
                rank);
  }
  auto mappings = std::make_shared<Mappings>();
  const auto map = [&](int fd) -> char* {
    void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) return nullptr;
    mappings->add(p, bytes);
    return static_cast<char*>(p);
  };
  char* mine = map(own.get());
  if (mine == nullptr) {
    throw Error(
        ErrorCode::kSystem,
        std::string("transport 'shm': cannot map its segment (") + std::strerror(errno) + ")",
        rank);
  }
  SegmentRecord rec{};
  rec.pid = static_cast<std::int32_t>(::getpid());
  rec.fd = own.get();
  rec.tag = random_u64();
  rec.bytes = bytes;
  rec.version = kSegmentVersion;
  auto* head = reinterpret_cast<SegmentHead*>(mine);
  head->magic = kMagic;
  head->tag = rec.tag;
  head->rank = rank;
  std::vector<SegmentRecord> all(static_cast<std::size_t>(size));
  bootstrap.all_gather(&rec, sizeof(rec), all.data());

  // Map the segment of every peer on this host; every rank hears which failed, so all of them
  // fail alike.
  std::vector<char*> segments(static_cast<std::size_t>(size), nullptr);
  segments[static_cast<std::size_t>(rank)] = mine;
  MapResult result{};
  result.failed_peer = -1;
  for (int r = 0; r < size && result.failed_peer < 0; ++r) {
    if (r == rank || local[static_cast<std::size_t>(r)] < 0) continue;  // another host: TCP
    const SegmentRecord& peer = all[static_cast<std::size_t>(r)];
    std::string why;
    if (peer.version != kSegmentVersion || peer.bytes != bytes) {
      why = "its segment has another layout (another dear version, or channels differ)";
    } else {
      const std::string path =
          "/proc/" + std::to_string(peer.pid) + "/fd/" + std::to_string(peer.fd);
      Fd fd(::open(path.c_str(), O_RDWR | O_CLOEXEC));
      char* seg = fd.valid() ? map(fd.get()) : nullptr;
      if (seg == nullptr) {
        why = "cannot map its segment " + path + " on host '" + this_host() + "' (" +
              std::strerror(errno) +
              "): transport 'shm' needs the ranks of one host to be processes of one user in "
              "one PID namespace (DEAR_TRANSPORT=tcp does not)";
      } else {
        const auto* h = reinterpret_cast<const SegmentHead*>(seg);
        if (h->magic != kMagic || h->tag != peer.tag || h->rank != r) {
          why = "the segment at " + path + " is not that rank's (another host or PID namespace)";
        } else {
          segments[static_cast<std::size_t>(r)] = seg;
        }
      }
    }
    if (!why.empty()) {
      result.failed_peer = r;
      std::snprintf(result.why, sizeof(result.why), "%s", why.c_str());
    }
  }
  std::vector<MapResult> results(static_cast<std::size_t>(size));
  bootstrap.all_gather(&result, sizeof(result), results.data());
  for (int r = 0; r < size; ++r) {
    const MapResult& m = results[static_cast<std::size_t>(r)];
    if (m.failed_peer < 0) continue;
    throw Error(ErrorCode::kInvalidArgument,
                "transport 'shm': rank " + std::to_string(r) + " cannot reach rank " +
                    std::to_string(m.failed_peer) +
                    "'s shared memory: " + std::string(m.why, strnlen(m.why, sizeof(m.why))),
                rank, m.failed_peer, "create");
  }
  // Every peer has mapped this segment: the descriptor is no longer needed (the mappings
  // keep the memory).
  own.reset();

  const int next = (rank + 1) % size;
  const int prev = (rank - 1 + size) % size;
  const auto channel = [&](std::unique_ptr<Channel> ctl, int peer, std::size_t in_ring,
                           std::size_t out_ring, int c) -> std::unique_ptr<Channel> {
    if (segments[static_cast<std::size_t>(peer)] == nullptr) return ctl;  // another host
    return std::make_unique<ShmChannel>(std::move(ctl), ring_at(mine, in_ring),
                                        ring_at(segments[static_cast<std::size_t>(peer)], out_ring),
                                        rank, peer, c, mappings);
  };
  Links links;
  for (int c = 0; c < options.channels; ++c) {
    // This rank's to_next[c] is the next rank's from_prev[c].
    links.to_next.push_back(channel(std::move(control.to_next.at(static_cast<std::size_t>(c))),
                                    next, index.from_next(c), index.from_prev(c), c));
    links.from_prev.push_back(channel(std::move(control.from_prev.at(static_cast<std::size_t>(c))),
                                      prev, index.from_prev(c), index.from_next(c), c));
  }
  for (std::size_t i = 0; i < mesh_peers.size(); ++i) {
    const int p = mesh_peers[i];
    links.mesh.push_back(
        channel(std::move(control.mesh.at(i)), p, index.from_mesh(p), index.from_mesh(rank), 0));
  }
  return links;
}

const Transport& transport() {
  static const ShmTransport t;
  return t;
}

}  // namespace shm
}  // namespace dear::transport
