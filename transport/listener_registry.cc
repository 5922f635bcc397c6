#include "transport/listener_registry.h"

#include "transport/socket_util.h"

namespace dear::transport {

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
