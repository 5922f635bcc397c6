#include "transport/socket_util.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <ifaddrs.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/random.h>
#include <unistd.h>

#include <algorithm>
#include <asio/ip/address.hpp>
#include <asio/ip/tcp.hpp>
#include <cerrno>
#include <charconv>
#include <cstring>
#include <filesystem>
#include <string_view>
#include <system_error>
#include <thread>

#include "common/env.h"
#include "dear/error.h"

namespace dear::transport {

std::uint64_t random_u64() {
  std::uint64_t v = 0;
  if (::getrandom(&v, sizeof(v), 0) != static_cast<ssize_t>(sizeof(v))) {
    v = static_cast<std::uint64_t>(Clock::now().time_since_epoch().count());
  }
  return v;
}

namespace {

[[noreturn]] void throw_errno(const std::string& what, int err) {
  throw Error(ErrorCode::kSystem, what + ": " + std::strerror(err));
}

// Waits until fd is ready for `events` or the deadline passes; false on timeout.
bool wait_ready(int fd, short events, Deadline deadline) {
  for (;;) {
    pollfd p{fd, events, 0};
    const int rc = ::poll(&p, 1, poll_timeout_ms(deadline));
    if (rc > 0) return true;
    if (rc < 0 && errno != EINTR) throw_errno("poll", errno);
    if (Clock::now() >= deadline) return false;
  }
}

}  // namespace

int poll_timeout_ms(Deadline d, int cap_ms) {
  if (d == Deadline::max()) return cap_ms;
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(d - Clock::now());
  return static_cast<int>(std::clamp<std::int64_t>(left.count() + 1, 0, cap_ms));
}

Fd& Fd::operator=(Fd&& o) noexcept {
  if (this != &o) reset(o.release());
  return *this;
}

void Fd::reset(int fd) noexcept {
  if (fd_ >= 0) ::close(fd_);
  fd_ = fd;
}

std::string SockAddr::host() const {
  char buf[INET6_ADDRSTRLEN] = {0};
  if (family() == AF_INET) {
    const auto* a = reinterpret_cast<const sockaddr_in*>(&storage);
    ::inet_ntop(AF_INET, &a->sin_addr, buf, sizeof(buf));
  } else if (family() == AF_INET6) {
    const auto* a = reinterpret_cast<const sockaddr_in6*>(&storage);
    ::inet_ntop(AF_INET6, &a->sin6_addr, buf, sizeof(buf));
  }
  return buf;
}

std::uint16_t SockAddr::port() const {
  if (family() == AF_INET) return ntohs(reinterpret_cast<const sockaddr_in*>(&storage)->sin_port);
  if (family() == AF_INET6) {
    return ntohs(reinterpret_cast<const sockaddr_in6*>(&storage)->sin6_port);
  }
  return 0;
}

std::string SockAddr::to_string() const {
  const std::string h = host();
  return (family() == AF_INET6 ? "[" + h + "]" : h) + ":" + std::to_string(port());
}

SockAddr resolve(const std::string& host, std::uint16_t port) {
  asio::ip::tcp::endpoint endpoint;
  asio::error_code ec;
  const auto address = asio::ip::make_address(host, ec);
  if (!ec) {
    endpoint = asio::ip::tcp::endpoint(address, port);
  } else {
    asio::io_context io;
    asio::ip::tcp::resolver resolver(io);
    const auto results = resolver.resolve(host, std::to_string(port), ec);
    if (ec || results.empty()) {
      throw Error(ErrorCode::kInvalidArgument,
                  "cannot resolve host '" + host + "': " + (ec ? ec.message() : "no address"));
    }
    endpoint = results.begin()->endpoint();
  }
  SockAddr out;
  out.len = static_cast<socklen_t>(endpoint.size());
  std::memcpy(&out.storage, endpoint.data(), out.len);
  return out;
}

namespace {

bool is_loopback(const SockAddr& addr) {
  if (addr.family() == AF_INET) {
    const auto* in = reinterpret_cast<const sockaddr_in*>(addr.get());
    return (ntohl(in->sin_addr.s_addr) >> 24) == 127;
  }
  if (addr.family() == AF_INET6) {
    const auto* in6 = reinterpret_cast<const sockaddr_in6*>(addr.get());
    return IN6_IS_ADDR_LOOPBACK(&in6->sin6_addr) != 0;
  }
  return false;
}

bool set_congestion(int fd, const std::string& name) {
  return ::setsockopt(fd, IPPROTO_TCP, TCP_CONGESTION, name.data(),
                      static_cast<socklen_t>(name.size())) == 0;
}

void set_named_congestion(int fd, const std::string& wanted) {
  if (!set_congestion(fd, wanted)) {
    throw Error(ErrorCode::kInvalidArgument,
                "environment variable DEAR_TCP_CONGESTION=" + wanted + ": the kernel refused it (" +
                    std::strerror(errno) +
                    "; see net.ipv4.tcp_available_congestion_control and "
                    "net.ipv4.tcp_allowed_congestion_control), or use auto or system");
  }
}

std::string congestion_from_env() {
  std::string wanted = env::get("DEAR_TCP_CONGESTION").value_or("auto");
  return wanted.empty() ? "auto" : wanted;
}

}  // namespace

namespace {

// The address bytes of an IPv4 or IPv6 socket address; empty for any other family.
std::string_view ip_bytes(const SockAddr& a) {
  if (a.family() == AF_INET) {
    const auto* in = reinterpret_cast<const sockaddr_in*>(a.get());
    return {reinterpret_cast<const char*>(&in->sin_addr), sizeof(in->sin_addr)};
  }
  if (a.family() == AF_INET6) {
    const auto* in6 = reinterpret_cast<const sockaddr_in6*>(a.get());
    return {reinterpret_cast<const char*>(&in6->sin6_addr), sizeof(in6->sin6_addr)};
  }
  return {};
}

// Sets `wanted` (not "system") on `fd`: for "auto" the unpaced algorithm; false when the kernel
// refuses it. The kernel refuses an algorithm this process may not pick (not in
// net.ipv4.tcp_allowed_congestion_control, without CAP_NET_ADMIN); reno always may be.
bool set_choice(int fd, const std::string& wanted) {
  if (wanted != "auto") return set_congestion(fd, wanted);
  return set_congestion(fd, "cubic") || set_congestion(fd, "reno");
}

// Sets DEAR_TCP_CONGESTION's choice on `fd`; under "auto" the unpaced one only when `on_host`.
// Throws when the kernel refuses a named one.
void apply_congestion_control(int fd, bool on_host) {
  const std::string wanted = congestion_from_env();
  if (wanted == "system") return;
  if (wanted == "auto") {
    if (on_host) (void)set_choice(fd, wanted);
    return;
  }
  set_named_congestion(fd, wanted);
}

}  // namespace

bool on_this_host(const SockAddr& addr) {
  if (is_loopback(addr)) return true;
  const std::string_view ip = ip_bytes(addr);
  if (ip.empty()) return false;
  ifaddrs* list = nullptr;
  if (::getifaddrs(&list) != 0) return false;
  bool found = false;
  for (const ifaddrs* i = list; i != nullptr && !found; i = i->ifa_next) {
    if (i->ifa_addr == nullptr || i->ifa_addr->sa_family != addr.family()) continue;
    SockAddr own;
    own.len = addr.family() == AF_INET ? sizeof(sockaddr_in) : sizeof(sockaddr_in6);
    std::memcpy(&own.storage, i->ifa_addr, own.len);
    found = ip_bytes(own) == ip;
  }
  ::freeifaddrs(list);
  return found;
}

namespace {

bool same_endpoint(const SockAddr& a, const SockAddr& b) {
  const std::string_view ip = ip_bytes(a);
  return !ip.empty() && a.family() == b.family() && ip == ip_bytes(b) && a.port() == b.port();
}

bool is_tcp_stream(int fd) {
  int type = 0;
  int protocol = 0;
  socklen_t len = sizeof(type);
  if (::getsockopt(fd, SOL_SOCKET, SO_TYPE, &type, &len) != 0 || type != SOCK_STREAM) return false;
  len = sizeof(protocol);
  return ::getsockopt(fd, SOL_SOCKET, SO_PROTOCOL, &protocol, &len) == 0 && protocol == IPPROTO_TCP;
}

// Whether socket `fd` is the listener at `own` or a connection between `own` and `peer` (the
// connecting end sees `peer`, the accepting end `own`); never throws.
bool joins(int fd, const SockAddr& own, const SockAddr& peer) {
  if (!is_tcp_stream(fd)) return false;
  SockAddr local;
  local.len = sizeof(local.storage);
  if (::getsockname(fd, reinterpret_cast<sockaddr*>(&local.storage), &local.len) != 0) {
    return false;
  }
  SockAddr remote;
  remote.len = sizeof(remote.storage);
  if (::getpeername(fd, reinterpret_cast<sockaddr*>(&remote.storage), &remote.len) != 0) {
    int listening = 0;
    socklen_t len = sizeof(listening);
    return errno == ENOTCONN && same_endpoint(local, own) &&
           ::getsockopt(fd, SOL_SOCKET, SO_ACCEPTCONN, &listening, &len) == 0 && listening != 0;
  }
  return same_endpoint(local, own) || same_endpoint(remote, peer);
}

}  // namespace

int adopt_congestion_control(const SockAddr& own, const SockAddr& peer) {
  const std::string wanted = congestion_from_env();
  if (wanted == "system" || ip_bytes(own).empty() || ip_bytes(peer).empty()) return 0;
  // One host: `peer` at a loopback address or another of this host's (routed over loopback).
  if (wanted == "auto" && !on_this_host(peer)) return 0;
  std::error_code ec;
  std::filesystem::directory_iterator it("/proc/self/fd", ec);
  int changed = 0;
  for (; !ec && it != std::filesystem::directory_iterator(); it.increment(ec)) {
    const std::string name = it->path().filename().string();
    int fd = -1;
    const auto [end, err] = std::from_chars(name.data(), name.data() + name.size(), fd);
    if (err != std::errc() || end != name.data() + name.size() || !joins(fd, own, peer)) continue;
    if (set_choice(fd, wanted)) ++changed;
  }
  return changed;
}

void check_congestion_control_env() {
  const std::string wanted = congestion_from_env();
  if (wanted == "auto" || wanted == "system") return;
  const Fd probe(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!probe.valid()) throw_errno("socket", errno);
  set_named_congestion(probe.get(), wanted);
}

Fd bind_unlistened(const SockAddr& addr) {
  Fd fd(::socket(addr.family(), SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!fd.valid()) throw_errno("socket", errno);
  const int one = 1;
  ::setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  if (::bind(fd.get(), addr.get(), addr.len) != 0) {
    throw Error(ErrorCode::kBootstrap,
                "cannot listen on " + addr.to_string() + ": " + std::strerror(errno));
  }
  return fd;
}

void listen_for(int fd, const std::vector<SockAddr>& peers, int backlog) {
  // Accepted connections inherit the listener's choice, made before any can arrive.
  apply_congestion_control(fd, std::all_of(peers.begin(), peers.end(), on_this_host));
  if (::listen(fd, backlog) != 0) throw_errno("listen on " + local_address(fd).to_string(), errno);
}

Fd listen_on(const SockAddr& addr, int backlog) {
  Fd fd = bind_unlistened(addr);
  // A listener on a loopback address is reached from this host only.
  apply_congestion_control(fd.get(), is_loopback(addr));
  if (::listen(fd.get(), backlog) != 0) throw_errno("listen on " + addr.to_string(), errno);
  return fd;
}

SockAddr local_address(int fd) {
  SockAddr a;
  a.len = sizeof(a.storage);
  if (::getsockname(fd, reinterpret_cast<sockaddr*>(&a.storage), &a.len) != 0) {
    throw_errno("getsockname", errno);
  }
  return a;
}

SockAddr peer_address(int fd) {
  SockAddr a;
  a.len = sizeof(a.storage);
  if (::getpeername(fd, reinterpret_cast<sockaddr*>(&a.storage), &a.len) != 0) {
    throw_errno("getpeername", errno);
  }
  return a;
}

Fd connect_with_retry(const SockAddr& addr, Deadline deadline, const std::string& what) {
  int last_err = 0;
  auto backoff = std::chrono::milliseconds(2);
  const bool on_host = on_this_host(addr);  // once, not on every retry
  for (;;) {
    Fd fd(::socket(addr.family(), SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
    if (!fd.valid()) throw_errno("socket", errno);
    apply_congestion_control(fd.get(), on_host);
    int rc = ::connect(fd.get(), addr.get(), addr.len);
    if (rc != 0 && errno == EINPROGRESS) {
      if (wait_ready(fd.get(), POLLOUT, deadline)) {
        int err = 0;
        socklen_t len = sizeof(err);
        ::getsockopt(fd.get(), SOL_SOCKET, SO_ERROR, &err, &len);
        rc = err == 0 ? 0 : -1;
        errno = err;
      } else {
        errno = ETIMEDOUT;
      }
    }
    if (rc == 0) {
      set_nonblocking(fd.get(), false);
      return fd;
    }
    last_err = errno;
    if (Clock::now() >= deadline) break;
    // Refused or unreachable: the listener may simply not be up yet.
    std::this_thread::sleep_for(backoff);
    backoff = std::min(backoff * 2, std::chrono::milliseconds(100));
    if (Clock::now() >= deadline) break;
  }
  throw Error(ErrorCode::kTimeout,
              what + ": could not connect to " + addr.to_string() +
                  " before the deadline (last error: " + std::strerror(last_err) + ")");
}

Fd accept_until(int listen_fd, Deadline deadline) {
  for (;;) {
    if (!wait_ready(listen_fd, POLLIN, deadline)) return Fd();
    Fd fd(::accept4(listen_fd, nullptr, nullptr, SOCK_CLOEXEC));
    if (fd.valid()) return fd;
    if (errno != EINTR && errno != EAGAIN && errno != ECONNABORTED && errno != EWOULDBLOCK) {
      throw_errno("accept", errno);
    }
  }
}

void set_nonblocking(int fd, bool on) {
  const int flags = ::fcntl(fd, F_GETFL, 0);
  if (flags < 0) throw_errno("fcntl(F_GETFL)", errno);
  const int want = on ? (flags | O_NONBLOCK) : (flags & ~O_NONBLOCK);
  if (want != flags && ::fcntl(fd, F_SETFL, want) != 0) throw_errno("fcntl(F_SETFL)", errno);
}

void set_nodelay(int fd) {
  const int one = 1;
  if (::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one)) != 0) {
    throw_errno("setsockopt(TCP_NODELAY)", errno);
  }
}

void set_cloexec(int fd) { ::fcntl(fd, F_SETFD, FD_CLOEXEC); }

void write_all(int fd, const void* data, std::size_t bytes, Deadline deadline,
               const std::string& what) {
  const auto* p = static_cast<const char*>(data);
  while (bytes > 0) {
    const ssize_t n = ::send(fd, p, bytes, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n > 0) {
      p += n;
      bytes -= static_cast<std::size_t>(n);
      continue;
    }
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) {
      if (!wait_ready(fd, POLLOUT, deadline)) {
        throw Error(ErrorCode::kTimeout, what + ": timed out writing");
      }
      continue;
    }
    throw Error(ErrorCode::kPeerFailed,
                what + ": connection lost while writing (" + std::strerror(errno) + ")");
  }
}

void read_all(int fd, void* data, std::size_t bytes, Deadline deadline, const std::string& what) {
  auto* p = static_cast<char*>(data);
  while (bytes > 0) {
    const ssize_t n = ::recv(fd, p, bytes, MSG_DONTWAIT);
    if (n > 0) {
      p += n;
      bytes -= static_cast<std::size_t>(n);
      continue;
    }
    if (n == 0) {
      throw Error(ErrorCode::kPeerFailed, what + ": connection closed by the other side");
    }
    if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) {
      if (!wait_ready(fd, POLLIN, deadline)) {
        throw Error(ErrorCode::kTimeout, what + ": timed out reading");
      }
      continue;
    }
    throw Error(ErrorCode::kPeerFailed,
                what + ": connection lost while reading (" + std::strerror(errno) + ")");
  }
}

}  // namespace dear::transport
