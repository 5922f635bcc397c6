// transport "shm" (shm_transport.cc): shared-memory channels between ranks of one host, TCP
// channels to the others.
#pragma once

#include <string>
#include <vector>

#include "dear/bootstrap.h"
#include "transport/transport.h"

namespace dear::transport::shm {

// What the registered back-end's connect() does, with this rank's host named by `host_id`
// (the back-end passes the kernel's boot id): ranks that name the same host get
// shared-memory channels, the others keep TCP ones. Collective over the bootstrap's ranks.
[[nodiscard]] Links connect_links(Bootstrap& bootstrap, const std::vector<int>& mesh_peers,
                                  const TransportOptions& options, const std::string& host_id);

}  // namespace dear::transport::shm
