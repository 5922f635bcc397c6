// Rendezvous of the N ranks of a job.
//
// Rank 0 listens on the address named by a UniqueId; every other rank connects to it and
// proves it knows the id's 128-bit secret before rank 0 trusts the connection. Connections that
// fail to prove it (port scanners, a stale job on a reused port) are dropped and logged without
// holding up the others. Once all ranks are in, the bootstrap offers a few slow, simple
// collectives (all-gather of small blobs, barrier) that the communicator uses to exchange link
// addresses. It is not a data path.
//
// Contract: every call either completes on all ranks or throws dear::Error on the ranks that
// see the failure, within the bootstrap timeout. Calls are collective and must be issued in the
// same order on all ranks; a Bootstrap is not thread-safe.
#pragma once

#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace dear {

// Where rank 0 listens and the secret that proves membership of the job.
// Text form (what dear-run puts in DEAR_UNIQUE_ID): "host:port:32-hex-digit-secret";
// an IPv6 host is written in brackets: "[::1]:29500:…".
struct UniqueId {
  std::string host;
  std::uint16_t port = 0;
  std::array<std::uint8_t, 16> secret{};

  // Binds a listening socket on `host` (port 0 = any free port) and keeps it for the rank 0
  // of this process to adopt, so that the returned id is valid before rank 0 starts; the
  // secret comes from the OS's random source.
  [[nodiscard]] static UniqueId create(const std::string& host = "127.0.0.1",
                                       std::uint16_t port = 0);
  // Throws dear::Error(kInvalidArgument) naming what is wrong with the text.
  [[nodiscard]] static UniqueId parse(std::string_view text);
  [[nodiscard]] std::string to_string() const;
  // The address without the secret, for messages and logs (the secret is never logged).
  [[nodiscard]] std::string address() const;
};

struct BootstrapOptions {
  // How long rendezvous and each bootstrap collective may take before every rank fails.
  std::chrono::milliseconds timeout{std::chrono::minutes(5)};
  // Address the other ranks use to reach this rank's link listener, and the only address it
  // listens on (never the wildcard); empty = the address this rank used to reach rank 0
  // (which is right for one host and for routed clusters). From the environment:
  // DEAR_ADVERTISE_HOST, or DEAR_SOCKET_IFNAME (an interface name, its IPv4 address).
  std::string advertise_host;
};

class Bootstrap {
 public:
  virtual ~Bootstrap() = default;

  // Rendezvous with an explicit id, rank and world size (rank 0 listens, others connect).
  [[nodiscard]] static std::unique_ptr<Bootstrap> create(const UniqueId& id, int rank,
                                                         int world_size,
                                                         const BootstrapOptions& options = {});
  // Rendezvous from the launcher's environment: dear-run (DEAR_UNIQUE_ID, DEAR_RANK,
  // DEAR_WORLD_SIZE), torchrun (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE), Open MPI
  // (OMPI_COMM_WORLD_RANK/SIZE) and Slurm (SLURM_PROCID, SLURM_NTASKS) with DEAR_UNIQUE_ID or
  // MASTER_ADDR/MASTER_PORT for the address. DEAR_TIMEOUT (seconds), DEAR_SOCKET_IFNAME and
  // DEAR_ADVERTISE_HOST override `options`. Throws dear::Error naming the missing variable.
  [[nodiscard]] static std::unique_ptr<Bootstrap> from_env(const BootstrapOptions& options = {});

  [[nodiscard]] virtual int rank() const = 0;
  [[nodiscard]] virtual int size() const = 0;
  [[nodiscard]] virtual const UniqueId& id() const = 0;
  [[nodiscard]] virtual const BootstrapOptions& options() const = 0;

  // Every rank contributes `bytes` bytes; afterwards out[r*bytes, (r+1)*bytes) holds rank r's.
  virtual void all_gather(const void* in, std::size_t bytes, void* out) = 0;
  virtual void barrier() = 0;
  // The host other ranks should use to reach this one (see BootstrapOptions::advertise_host).
  [[nodiscard]] virtual std::string advertise_host() const = 0;
};

// The IPv4 address of network interface `ifname` (e.g. "eth0"); dear::Error naming the
// interfaces that have one when it has none. `rank` is for the error.
[[nodiscard]] std::string interface_address(const std::string& ifname, int rank);

}  // namespace dear
