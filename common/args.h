// Argument checks every communicator makes alike, with the error that names the argument.
#pragma once

#include <algorithm>
#include <cstddef>
#include <span>
#include <string>
#include <vector>

#include "dear/error.h"

namespace dear {

// Throws Error(kInvalidArgument) unless 0 <= root < size, naming the call `op` and the rank.
inline void check_root(int root, int size, int rank, const char* op) {
  if (root < 0 || root >= size) {
    throw Error(ErrorCode::kInvalidArgument,
                "root=" + std::to_string(root) + " is outside [0, " + std::to_string(size) + ")",
                rank, Error::kNone, op);
  }
}

// send/recv: throws Error(kInvalidArgument) unless `peer` is another rank of [0, size), or
// (with `any_source`: a receive) Communicator::kAnySource.
inline void check_peer(int peer, int size, int rank, const char* op, bool any_source = false) {
  if (any_source && peer == -1) return;  // Communicator::kAnySource
  if (peer < 0 || peer >= size || peer == rank) {
    throw Error(ErrorCode::kInvalidArgument,
                "peer=" + std::to_string(peer) +
                    (peer == rank ? " is this rank (send and receive to itself are not supported)"
                                  : " is outside [0, " + std::to_string(size) + ")" +
                                        (any_source ? " and is not kAnySource (-1)" : "")),
                rank, Error::kNone, op);
  }
}

// all_to_all_v: throws Error(kInvalidArgument) unless `list` (counts or displacements, named
// `arg`) has one entry per rank.
inline void check_per_rank(std::span<const std::size_t> list, const char* arg, int size, int rank,
                           const char* op) {
  if (list.size() != static_cast<std::size_t>(size)) {
    throw Error(ErrorCode::kInvalidArgument,
                std::string(arg) + " has " + std::to_string(list.size()) +
                    " entries; it needs one per rank (" + std::to_string(size) + ")",
                rank, Error::kNone, op);
  }
}

// all_gather_v, gather_v: what a rank gathers from itself (recv_counts[rank], the lists checked
// by check_per_rank) must be what it sends.
inline void check_own_count(std::span<const std::size_t> recv_counts, std::size_t send_count,
                            int rank, const char* op) {
  const std::size_t own = recv_counts[static_cast<std::size_t>(rank)];
  if (own != send_count) {
    throw Error(ErrorCode::kInvalidArgument,
                "recv_counts[" + std::to_string(rank) + "]=" + std::to_string(own) +
                    " differs from send_count=" + std::to_string(send_count) +
                    " (what this rank gathers from itself)",
                rank, Error::kNone, op);
  }
}

// The bytes from the start of a buffer that all_to_all_v's `counts` at `displs` (elements of
// `el` bytes, the lists checked by check_per_rank) reach.
inline std::size_t layout_extent(std::span<const std::size_t> counts,
                                 std::span<const std::size_t> displs, std::size_t el) {
  std::size_t e = 0;
  for (std::size_t j = 0; j < counts.size() && j < displs.size(); ++j) {
    if (counts[j] > 0) e = std::max(e, (displs[j] + counts[j]) * el);
  }
  return e;
}

// all_to_all_v's four lists, copied for a call that outlives its caller's spans.
struct AllToAllLists {
  std::vector<std::size_t> send_counts, send_displs, recv_counts, recv_displs;
  AllToAllLists(std::span<const std::size_t> sc, std::span<const std::size_t> sd,
                std::span<const std::size_t> rc, std::span<const std::size_t> rd)
      : send_counts(sc.begin(), sc.end()),
        send_displs(sd.begin(), sd.end()),
        recv_counts(rc.begin(), rc.end()),
        recv_displs(rd.begin(), rd.end()) {}
  AllToAllLists() = default;
};

// all_gather_v (`root` -1) and gather_v as all_to_all_v lists (Communicator::
// gather_as_all_to_all_v), after the checks those calls make: this rank's one block to every
// rank (to the root only for gather_v), and what it receives (nothing off a gather_v's root).
// A gather_v's caller checks its root first: -1 here means all_gather_v.
inline AllToAllLists gather_as_all_to_all_v_lists(int root, std::size_t send_count,
                                                  std::span<const std::size_t> recv_counts,
                                                  std::span<const std::size_t> recv_displs,
                                                  int size, int rank) {
  const char* op = root < 0 ? "all_gather_v" : "gather_v";
  if (root >= 0) check_root(root, size, rank, op);
  const auto n = static_cast<std::size_t>(size);
  AllToAllLists l;
  l.send_counts.assign(n, root < 0 ? send_count : 0);
  l.send_displs.assign(n, 0);
  if (root >= 0) l.send_counts[static_cast<std::size_t>(root)] = send_count;
  if (root < 0 || root == rank) {
    check_per_rank(recv_counts, "recv_counts", size, rank, op);
    check_per_rank(recv_displs, "recv_displs", size, rank, op);
    check_own_count(recv_counts, send_count, rank, op);
    l.recv_counts.assign(recv_counts.begin(), recv_counts.end());
    l.recv_displs.assign(recv_displs.begin(), recv_displs.end());
  } else {
    l.recv_counts.assign(n, 0);
    l.recv_displs.assign(n, 0);
  }
  return l;
}

}  // namespace dear
