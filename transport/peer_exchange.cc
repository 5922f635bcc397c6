#include "transport/peer_exchange.h"

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "dear/error.h"

namespace dear::transport {
namespace {

struct Counts {
  std::uint32_t entries = 0;
  std::uint32_t blob_bytes = 0;
};

}  // namespace

void check_peer_list(const std::vector<int>& peers, int rank, int size, const std::string& what) {
  for (std::size_t i = 0; i < peers.size(); ++i) {
    const int p = peers[i];
    if (p < 0 || p >= size || p == rank) {
      throw Error(ErrorCode::kInvalidArgument,
                  what + ": peers[" + std::to_string(i) + "]=" + std::to_string(p) +
                      " is not another rank of this job (size " + std::to_string(size) + ")",
                  rank);
    }
    if (std::find(peers.begin(), peers.begin() + static_cast<std::ptrdiff_t>(i), p) !=
        peers.begin() + static_cast<std::ptrdiff_t>(i)) {
      throw Error(ErrorCode::kInvalidArgument,
                  what + ": rank " + std::to_string(p) + " is listed twice in peers", rank);
    }
  }
}

std::vector<std::vector<char>> exchange_with_peers(Bootstrap& bootstrap,
                                                   const std::vector<int>& peers,
                                                   const std::vector<std::vector<char>>& mine,
                                                   std::size_t blob_bytes,
                                                   const std::string& what) {
  const int rank = bootstrap.rank();
  const int size = bootstrap.size();
  check_peer_list(peers, rank, size, what);
  if (mine.size() != peers.size()) {
    throw Error(ErrorCode::kInternal, what + ": one blob per peer expected", rank);
  }
  for (const auto& b : mine) {
    if (b.size() != blob_bytes) {
      throw Error(ErrorCode::kInternal, what + ": blob of the wrong size", rank);
    }
  }
  const auto n = static_cast<std::size_t>(size);
  Counts my_counts{static_cast<std::uint32_t>(peers.size()),
                   static_cast<std::uint32_t>(blob_bytes)};
  std::vector<Counts> counts(n);
  bootstrap.all_gather(&my_counts, sizeof(Counts), counts.data());
  std::uint32_t rounds = 0;
  for (int r = 0; r < size; ++r) {
    const Counts& c = counts[static_cast<std::size_t>(r)];
    if (c.blob_bytes != my_counts.blob_bytes) {
      throw Error(ErrorCode::kMismatch,
                  what + ": rank " + std::to_string(r) + " exchanges " +
                      std::to_string(c.blob_bytes) + "-byte records, rank " + std::to_string(rank) +
                      " " + std::to_string(blob_bytes) +
                      "-byte ones (do all ranks run the same build and transport?)",
                  rank, r, "create");
    }
    rounds = std::max(rounds, c.entries);
  }

  // Record of one round: the peer this entry is for (-1: this rank has no k-th peer), then
  // the blob.
  const std::size_t record = sizeof(std::int32_t) + blob_bytes;
  std::vector<char> all(record * n * rounds);
  std::vector<char> out_rec(record);
  for (std::uint32_t k = 0; k < rounds; ++k) {
    std::fill(out_rec.begin(), out_rec.end(), 0);
    std::int32_t to = -1;
    if (k < peers.size()) {
      to = peers[k];
      std::memcpy(out_rec.data() + sizeof(to), mine[k].data(), blob_bytes);
    }
    std::memcpy(out_rec.data(), &to, sizeof(to));
    bootstrap.all_gather(out_rec.data(), record, all.data() + record * n * k);
  }

  std::vector<std::vector<char>> theirs;
  theirs.reserve(peers.size());
  for (const int p : peers) {
    const std::uint32_t entries = counts[static_cast<std::size_t>(p)].entries;
    bool found = false;
    for (std::uint32_t k = 0; k < entries && !found; ++k) {
      const char* rec = all.data() + record * (n * k + static_cast<std::size_t>(p));
      std::int32_t to = 0;
      std::memcpy(&to, rec, sizeof(to));
      if (to != rank) continue;
      theirs.emplace_back(rec + sizeof(to), rec + record);
      found = true;
    }
    if (!found) {
      throw Error(ErrorCode::kMismatch,
                  what + ": rank " + std::to_string(rank) + " lists rank " + std::to_string(p) +
                      " as a peer but rank " + std::to_string(p) + " does not list rank " +
                      std::to_string(rank) + " (peer lists must be symmetric)",
                  rank, p, "create");
    }
  }
  return theirs;
}

}  // namespace dear::transport
