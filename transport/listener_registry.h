// Listening sockets opened by UniqueId::create() and kept until this process's rank 0 adopts
// them, so that an id handed to other threads or processes is valid before rank 0 starts; and
// the one a launcher opened and handed to this process (DEAR_LISTEN_FD), so that the port it
// chose stays held until rank 0 adopts it.
#pragma once

#include <array>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>

namespace dear::transport {

[[nodiscard]] std::array<std::uint8_t, 16> random_secret();

class ListenerRegistry {
 public:
  static ListenerRegistry& instance();
  // Binds and listens on host:port (0 = any free port); returns the bound port.
  std::uint16_t open(const std::string& host, std::uint16_t port);
  // The socket bound for host:port earlier in this process, or -1; the caller owns it.
  int take(std::uint16_t port);
  // Why the socket DEAR_LISTEN_FD names was not adopted, or empty (none named, or adopted):
  // what a rank 0 that then cannot bind the port adds to its error.
  [[nodiscard]] const std::string& unadopted_reason() const { return unadopted_; }

 private:
  // Adopts the listening socket named by DEAR_LISTEN_FD, if that is one; anything else there
  // (a variable inherited by a process it was not meant for) is left alone.
  ListenerRegistry();

  std::mutex mu_;
  std::map<std::uint16_t, int> fds_;
  std::string unadopted_;
};

}  // namespace dear::transport
