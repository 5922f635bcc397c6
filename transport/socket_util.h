// Small, deadline-bounded helpers over POSIX stream sockets, used by the bootstrap and to set
// up TCP links. Every blocking helper takes a deadline and throws dear::Error (kTimeout,
// kPeerFailed or kSystem) with `what` in its message instead of waiting forever.
#pragma once

#include <sys/socket.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace dear::transport {

using Clock = std::chrono::steady_clock;
using Deadline = Clock::time_point;

// 64 random bits from the kernel (getrandom), or the clock where it has none: tags that tell
// one job's or one link's connections from another's, not secrets.
[[nodiscard]] std::uint64_t random_u64();

[[nodiscard]] inline Deadline deadline_after(std::chrono::milliseconds d) {
  if (d.count() <= 0 || d > std::chrono::hours(24 * 365)) return Deadline::max();
  return Clock::now() + d;
}
// Milliseconds left until `d`, clamped to [0, cap]; for poll().
[[nodiscard]] int poll_timeout_ms(Deadline d, int cap_ms = 1000);

// An owned file descriptor.
class Fd {
 public:
  Fd() = default;
  explicit Fd(int fd) noexcept : fd_(fd) {}
  Fd(Fd&& o) noexcept : fd_(o.release()) {}
  Fd& operator=(Fd&& o) noexcept;
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  ~Fd() { reset(); }

  [[nodiscard]] int get() const noexcept { return fd_; }
  [[nodiscard]] bool valid() const noexcept { return fd_ >= 0; }
  int release() noexcept {
    const int f = fd_;
    fd_ = -1;
    return f;
  }
  void reset(int fd = -1) noexcept;

 private:
  int fd_ = -1;
};

struct SockAddr {
  sockaddr_storage storage{};
  socklen_t len = 0;
  [[nodiscard]] const sockaddr* get() const { return reinterpret_cast<const sockaddr*>(&storage); }
  [[nodiscard]] int family() const { return storage.ss_family; }
  [[nodiscard]] std::string to_string() const;  // "host:port", IPv6 in brackets
  [[nodiscard]] std::string host() const;
  [[nodiscard]] std::uint16_t port() const;
};

// Resolves a numeric address or a host name (first result). Throws kInvalidArgument.
[[nodiscard]] SockAddr resolve(const std::string& host, std::uint16_t port);

// A listening socket bound to addr (port 0 = any); SO_REUSEADDR set. Its congestion control
// (below) counts the peers as on this host when addr is a loopback address.
[[nodiscard]] Fd listen_on(const SockAddr& addr, int backlog = 128);
// The same in two steps, for a listener whose peers are known only once its port has been
// advertised: a socket bound to addr that does not listen yet (a peer connecting now is
// refused, and connect_with_retry tries again), then listen_for() once the addresses of the
// peers that will connect (`peers`, any port) are known. Under DEAR_TCP_CONGESTION=auto the
// accepted connections get the unpaced algorithm when every one of them is on this host.
[[nodiscard]] Fd bind_unlistened(const SockAddr& addr);
void listen_for(int fd, const std::vector<SockAddr>& peers, int backlog = 128);
// Whether addr is one of this host's: a loopback address or an address of one of its
// interfaces (traffic to it is routed over loopback). False when the interfaces cannot be read.
[[nodiscard]] bool on_this_host(const SockAddr& addr);
[[nodiscard]] SockAddr local_address(int fd);
[[nodiscard]] SockAddr peer_address(int fd);

// Connects, retrying refused/unreachable attempts every few milliseconds until the deadline
// (the listener may not be up yet).
[[nodiscard]] Fd connect_with_retry(const SockAddr& addr, Deadline deadline,
                                    const std::string& what);
// Accepts one connection, or returns an invalid Fd when the deadline passes first.
[[nodiscard]] Fd accept_until(int listen_fd, Deadline deadline);

// The TCP congestion control of every socket dear connects (connect_with_retry) or listens
// with (listen_on, listen_for), set before the connection exists (DEAR_TCP_CONGESTION):
// - unset or "auto": to an address of this host (on_this_host: 127.0.0.0/8, ::1, or one of
//   its interfaces' addresses) an unpaced algorithm, "cubic" where the kernel lets this
//   process choose it, else "reno"; elsewhere the system's. A host
//   whose default is a pacing algorithm (BBR) sends a loopback burst of more than a few
//   segments from pacing timers, out of order, and the receiver's D-SACKs then undo spurious
//   retransmissions (README, "Configuration"); nothing queues on loopback for pacing to spare.
// - "system": the system's default everywhere;
// - a name ("cubic", "bbr", ...): that one on every connection; throws kInvalidArgument naming
//   the variable when the kernel refuses it.
// check_congestion_control_env() throws what those would for DEAR_TCP_CONGESTION, on a socket
// of its own, so that a bad value fails before any connection.
void check_congestion_control_env();
// The same choice for the sockets of a library dear drives (libfabric's tcp and sockets
// providers, which offer no option for it), found among this process's descriptors: the
// listener at `own` and every TCP connection between `own` and `peer` (both "address:port").
// Under "auto" only where `peer` is on this host (on_this_host). A connection that exists already
// keeps the pacing its first algorithm asked for (BBR's), so a listener changed before it accepts
// serves better. Returns how many sockets it changed; never throws (a socket the kernel refuses
// to change keeps its own).
int adopt_congestion_control(const SockAddr& own, const SockAddr& peer);

void set_nonblocking(int fd, bool on = true);
void set_nodelay(int fd);
void set_cloexec(int fd);

// Whole-buffer transfers on a blocking or non-blocking socket, bounded by the deadline.
void write_all(int fd, const void* data, std::size_t bytes, Deadline deadline,
               const std::string& what);
void read_all(int fd, void* data, std::size_t bytes, Deadline deadline, const std::string& what);

// Handshakes in progress are capped: beyond `max` live entries (those whose `fd` is still
// open) the oldest is closed, after on_drop(entry) had a chance to log it. Entries are closed in
// place, not erased, because callers match them to poll() results by index.
template <typename T, typename OnDrop>
void drop_oldest_beyond(std::vector<T>& entries, std::size_t max, OnDrop on_drop) {
  const auto live =
      std::count_if(entries.begin(), entries.end(), [](const T& e) { return e.fd.valid(); });
  if (static_cast<std::size_t>(live) < max) return;
  const auto oldest =
      std::find_if(entries.begin(), entries.end(), [](const T& e) { return e.fd.valid(); });
  on_drop(*oldest);
  oldest->fd.reset();
}

}  // namespace dear::transport
