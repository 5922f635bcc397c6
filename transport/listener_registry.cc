#include "transport/listener_registry.h"

#include <fcntl.h>
#include <sys/socket.h>

#include <charconv>
#include <cstdlib>
#include <cstring>

#include "transport/socket_util.h"

namespace dear::transport {

ListenerRegistry::ListenerRegistry() {
  const char* text = std::getenv("DEAR_LISTEN_FD");
  if (text == nullptr) return;
  int fd = -1;
  const char* end = text + std::strlen(text);
  const auto [stop, err] = std::from_chars(text, end, fd);
  int listening = 0;
  socklen_t len = sizeof listening;
  if (err != std::errc() || stop != end || fd < 0 ||
      ::getsockopt(fd, SOL_SOCKET, SO_ACCEPTCONN, &listening, &len) != 0 || listening == 0) {
    unadopted_ = std::string("DEAR_LISTEN_FD=") + text +
                 ", the socket a launcher opened on this port for rank 0, is no listening socket "
                 "in this process: a program between the launcher and this one closed it "
                 "(Python's subprocess does, unless given pass_fds); pass it on, start this "
                 "program directly, or give the launcher a port (dear-run --port)";
    return;
  }
  // Not passed on to programs this one starts.
  ::fcntl(fd, F_SETFD, FD_CLOEXEC);
  fds_[local_address(fd).port()] = fd;
}

ListenerRegistry& ListenerRegistry::instance() {
  static ListenerRegistry registry;
  return registry;
}

std::uint16_t ListenerRegistry::open(const std::string& host, std::uint16_t port) {
  Fd fd = listen_on(resolve(host, port));
  const std::uint16_t bound = local_address(fd.get()).port();
  std::lock_guard<std::mutex> lock(mu_);
  auto it = fds_.find(bound);
  if (it != fds_.end()) Fd old(it->second);  // replaced: close the stale one
  fds_[bound] = fd.release();
  return bound;
}

int ListenerRegistry::take(std::uint16_t port) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = fds_.find(port);
  if (it == fds_.end()) return -1;
  const int fd = it->second;
  fds_.erase(it);
  return fd;
}

}  // namespace dear::transport
