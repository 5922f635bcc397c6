// Ranks started by hand (not through dear-run) as separate processes, rank 0 listening on a
// port the test holds.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "dear/bootstrap.h"
#include "proc.h"
#include "transport/listener_registry.h"
#include "transport/socket_util.h"

namespace dear::test {

// A listening socket on a free loopback port, held by the test while its ranks run and handed
// to rank 0 (DEAR_LISTEN_FD, spawn's inherit_fd) as dear-run hands it: no other program can
// take the port between its choice and rank 0's start. While the test holds it, rank 0 could
// not bind the port itself, so a rank 0 that failed to adopt it fails the test.
struct HeldPort {
  HeldPort()
      : socket(transport::listen_on(transport::resolve("127.0.0.1", 0))),
        fd(socket.get()),
        port(transport::local_address(fd).port()) {}

  [[nodiscard]] std::string env() const { return "DEAR_LISTEN_FD=" + std::to_string(fd); }

  transport::Fd socket;
  int fd;
  std::uint16_t port;
};

// The id of a job on this host whose rank 0 listens on `held`.
inline std::string loopback_id(const HeldPort& held) {
  dear::UniqueId id;
  id.host = "127.0.0.1";
  id.port = held.port;
  id.secret = dear::transport::random_secret();
  return id.to_string();
}

// Starts `ranks` ranks of one job, each running `argv`, rank 0 listening on `held`: each is
// told the job's id, its rank and size and the deadline (`timeout_s`, DEAR_TIMEOUT) besides
// `env`, and rank 0 the listening socket (DEAR_LISTEN_FD), which it inherits unless
// `hand_over` is false. Outputs in tmp_file(tag + "." + rank + ".out").
inline std::vector<Proc> start_by_hand(const HeldPort& held, const std::vector<std::string>& argv,
                                       const std::string& tag, int ranks = 2, int timeout_s = 120,
                                       const std::vector<std::string>& env = {},
                                       bool hand_over = true) {
  const std::string id = loopback_id(held);
  std::vector<Proc> procs;
  for (int r = 0; r < ranks; ++r) {
    std::vector<std::string> e{"DEAR_UNIQUE_ID=" + id, "DEAR_RANK=" + std::to_string(r),
                               "DEAR_WORLD_SIZE=" + std::to_string(ranks),
                               "DEAR_TIMEOUT=" + std::to_string(timeout_s)};
    if (r == 0) e.push_back(held.env());
    e.insert(e.end(), env.begin(), env.end());
    procs.push_back(spawn(argv, e, tmp_file(tag + "." + std::to_string(r) + ".out"),
                          r == 0 && hand_over ? held.fd : -1));
  }
  return procs;
}

}  // namespace dear::test
