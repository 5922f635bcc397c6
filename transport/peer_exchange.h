// Exchange of per-pair connection data over the bootstrap, for links to an arbitrary set of
// peers (not only the ring neighbours).
//
// Why: an RDMA endpoint (libfabric RDM, ibverbs RC queue pair) is made before its peer is
// known to it, and each end must learn the other's name. For the ring every rank publishes a
// fixed record (its to_next and from_prev names); for an arbitrary peer list the records differ
// in length from rank to rank, so the exchange is done in rounds: round k carries each rank's
// k-th (peer, blob) entry, and a rank picks out of peer p's entries the one p addressed to it.
// Pairs are matched by rank, never by position, so two ranks may list each other at different
// positions.
//
// Contract: collective over the bootstrap (every rank calls it, in the same order as its other
// bootstrap calls, with the same `blob_bytes`, possibly with a different peer list, possibly
// empty). Peer lists must be symmetric: if rank a lists b, b lists a. Costs 1 + (longest list)
// all_gathers of (4 + blob_bytes) bytes per rank.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include "dear/bootstrap.h"

namespace dear::transport {

// Checks `peers` (distinct, in [0, size), never this rank); throws dear::Error
// (kInvalidArgument) naming `what` and the offending entry.
void check_peer_list(const std::vector<int>& peers, int rank, int size, const std::string& what);

// `mine[i]` (blob_bytes each) is meant for `peers[i]`. Returns, for each i, the blob that rank
// peers[i] listed for this rank. Throws dear::Error: kInvalidArgument (bad list, as
// check_peer_list), kMismatch (a peer does not list this rank, or ranks disagree on
// blob_bytes: names both ranks and `what`).
[[nodiscard]] std::vector<std::vector<char>> exchange_with_peers(
    Bootstrap& bootstrap, const std::vector<int>& peers, const std::vector<std::vector<char>>& mine,
    std::size_t blob_bytes, const std::string& what);

}  // namespace dear::transport
