// Ranks started by hand (not through dear-run) as separate processes: their job id and
// environment, with rank 0 listening on a port the test holds.
#pragma once

#include <string>
#include <vector>

#include "dear/bootstrap.h"
#include "proc.h"
#include "transport/listener_registry.h"

namespace dear::test {

// What rank `rank` of `world` started by hand is told: the id of a job whose rank 0 listens on
// `held`, its rank and size, and for rank 0 the socket itself (spawn it with inherit_fd).
inline std::vector<std::string> rank_env(const HeldPort& held, const std::string& secret_id,
                                         int rank, int world) {
  std::vector<std::string> env{"DEAR_UNIQUE_ID=" + secret_id, "DEAR_RANK=" + std::to_string(rank),
                               "DEAR_WORLD_SIZE=" + std::to_string(world)};
  if (rank == 0) env.push_back(held.env());
  return env;
}

// The id of a job on this host whose rank 0 listens on `held`.
inline std::string loopback_id(const HeldPort& held) {
  dear::UniqueId id;
  id.host = "127.0.0.1";
  id.port = held.port;
  id.secret = dear::transport::random_secret();
  return id.to_string();
}

}  // namespace dear::test
