// CPU-side tests of the CUDA support, run in every build and on machines without a GPU:
// the staging planner, pointer-location dispatch with host pointers, and the equivalence of
// the shared host/device functors (what a GPU kernel computes per element) with the CPU
// kernels and with independently written references, for every dtype x op.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "collectives/device_staging.h"
#include "collectives/reduce.h"
#include "collectives/resident.h"
#include "collectives/staging_pieces.h"
#include "collectives/staging_plan.h"
#include "common/reduce_ops.h"
#include "harness.h"
#include "reference.h"

namespace dear::collectives {
namespace {

const void* at(std::uintptr_t a) { return reinterpret_cast<const void*>(a); }

// ---- staging planner -------------------------------------------------------------------------

TEST(StagingPlan, HostBuffersAreNotStaged) {
  const auto p = plan_staging({at(0x1000), 64, false}, {at(0x2000), 64, false}, 4);
  EXPECT_EQ(p.pinned_bytes, 0u);
  EXPECT_EQ(p.in_offset, StagingPlan::kUnstaged);
  EXPECT_EQ(p.out_offset, StagingPlan::kUnstaged);
  EXPECT_TRUE(p.copy_in.empty());
  EXPECT_TRUE(p.copy_out.empty());
}

TEST(StagingPlan, SeparateDeviceBuffersGetSeparateRegions) {
  const auto p = plan_staging({at(0x10000), 1000, true}, {at(0x90000), 24, true}, 4);
  EXPECT_EQ(p.in_offset, 0u);
  EXPECT_EQ(p.out_offset, 1024u);  // after the input, on a 256-byte boundary
  EXPECT_EQ(p.pinned_bytes, 1024u + 24u);
  ASSERT_EQ(p.copy_in.size(), 1u);
  EXPECT_EQ(p.copy_in[0].device, 0x10000u);
  EXPECT_EQ(p.copy_in[0].bytes, 1000u);
  ASSERT_EQ(p.copy_out.size(), 1u);
  EXPECT_EQ(p.copy_out[0].device, 0x90000u);
  EXPECT_EQ(p.copy_out[0].pinned_offset, 1024u);
}

TEST(StagingPlan, MixedHostAndDevice) {
  const auto p = plan_staging({at(0x1000), 64, false}, {at(0x90000), 64, true}, 8);
  EXPECT_EQ(p.in_offset, StagingPlan::kUnstaged);
  EXPECT_EQ(p.out_offset, 0u);
  EXPECT_TRUE(p.copy_in.empty());
  ASSERT_EQ(p.copy_out.size(), 1u);
}

TEST(StagingPlan, InPlaceAllReduceSharesOneRegion) {
  const auto p = plan_staging({at(0x4000), 4096, true}, {at(0x4000), 4096, true}, 4);
  EXPECT_EQ(p.pinned_bytes, 4096u);
  EXPECT_EQ(p.in_offset, 0u);
  EXPECT_EQ(p.out_offset, 0u);
}

TEST(StagingPlan, InPlaceReduceScatterKeepsTheLayout) {
  // 4 ranks, 100 floats each, rank 2: out == in + 2 * 400 bytes; only the block is copied out.
  const std::uintptr_t in = 0x100000;
  const auto p = plan_staging({at(in), 1600, true}, {at(in + 800), 400, true}, 4);
  EXPECT_EQ(p.pinned_bytes, 1600u);
  EXPECT_EQ(p.in_offset, 0u);
  EXPECT_EQ(p.out_offset, 800u);
  ASSERT_EQ(p.copy_out.size(), 1u);
  EXPECT_EQ(p.copy_out[0].device, in + 800);
  EXPECT_EQ(p.copy_out[0].pinned_offset, 800u);
  EXPECT_EQ(p.copy_out[0].bytes, 400u);
}

TEST(StagingPlan, InPlaceAllGatherCopiesOnlyTheOwnBlockIn) {
  const std::uintptr_t out = 0x200000;
  const auto p = plan_staging({at(out + 3 * 256), 256, true}, {at(out), 1024, true}, 2);
  EXPECT_EQ(p.pinned_bytes, 1024u);
  EXPECT_EQ(p.in_offset, 768u);
  ASSERT_EQ(p.copy_in.size(), 1u);
  EXPECT_EQ(p.copy_in[0].bytes, 256u);
  EXPECT_EQ(p.copy_in[0].pinned_offset, 768u);
  ASSERT_EQ(p.copy_out.size(), 1u);
  EXPECT_EQ(p.copy_out[0].bytes, 1024u);
}

TEST(StagingPlan, ChunksCoverTheBufferOnElementBoundaries) {
  for (const std::size_t elem : {1u, 2u, 4u, 8u}) {
    for (const std::size_t bytes : {elem, 1000 * elem, 12345 * elem}) {
      const std::size_t chunk = 1000;  // not a multiple of 8: rounded down per element size
      const auto p = plan_staging({at(0x8000), bytes, true}, {}, elem, chunk);
      std::size_t next = 0;
      for (const auto& c : p.copy_in) {
        EXPECT_EQ(c.device, 0x8000u + next);
        EXPECT_EQ(c.pinned_offset, next);
        EXPECT_GT(c.bytes, 0u);
        EXPECT_LE(c.bytes, chunk);
        EXPECT_EQ(c.bytes % elem, 0u);
        next += c.bytes;
      }
      EXPECT_EQ(next, bytes) << "elem " << elem;
    }
  }
  // A chunk smaller than one element still moves whole elements.
  const auto p = plan_staging({at(0x8000), 64, true}, {}, 8, 3);
  ASSERT_EQ(p.copy_in.size(), 8u);
  EXPECT_EQ(p.copy_in[0].bytes, 8u);
}

TEST(StagingPlan, NothingToStageForEmptyOrUnreadBuffers) {
  // Broadcast on a non-root rank passes in = 0 bytes.
  const auto p = plan_staging({at(0x8000), 0, true}, {at(0x9000), 16, true}, 4);
  EXPECT_EQ(p.in_offset, StagingPlan::kUnstaged);
  EXPECT_TRUE(p.copy_in.empty());
  EXPECT_EQ(p.out_offset, 0u);
}

// ---- pieces: the pipelined plan, simulated on the CPU
// --------------------------------------------

const char* kind_name(StagedKind k) {
  switch (k) {
    case StagedKind::kAllReduce: return "all_reduce";
    case StagedKind::kReduceScatter: return "reduce_scatter";
    case StagedKind::kAllGather: return "all_gather";
    case StagedKind::kBroadcast: return "broadcast";
    case StagedKind::kAllToAll: return "all_to_all";
    case StagedKind::kOther: return "other";
  }
  return "?";
}

TEST(StagingPieces, PieceCountDependsOnSizeOnly) {
  const PieceOptions o;  // 4 MiB pieces, split from 1 MiB
  EXPECT_EQ(piece_count(StagedKind::kAllReduce, 0, 4, o), 1u);
  EXPECT_EQ(piece_count(StagedKind::kAllReduce, (1u << 18) - 1, 4, o), 1u);  // < 1 MiB
  EXPECT_EQ(piece_count(StagedKind::kAllReduce, 1u << 18, 4, o), 2u);        // 1 MiB: two
  EXPECT_EQ(piece_count(StagedKind::kAllReduce, 1u << 20, 4, o), 2u);        // 4 MiB: two
  EXPECT_EQ(piece_count(StagedKind::kAllReduce, (1u << 20) + 1, 4, o), 2u);
  EXPECT_EQ(piece_count(StagedKind::kAllReduce, 16u << 20, 4, o), 16u);      // 64 MiB
  EXPECT_EQ(piece_count(StagedKind::kReduceScatter, 16u << 20, 4, o), 16u);  // per-rank bytes
  EXPECT_EQ(piece_count(StagedKind::kAllToAll, 16u << 20, 4, o), 16u);       // bytes per block
  EXPECT_EQ(piece_count(StagedKind::kOther, 16u << 20, 4, o), 1u);
  // Never more pieces than elements, never an empty piece.
  const PieceOptions tiny{1, 1};
  EXPECT_EQ(piece_count(StagedKind::kAllGather, 5, 8, tiny), 5u);
  EXPECT_EQ(piece_count(StagedKind::kAllGather, 1, 8, tiny), 1u);
}

TEST(StagingPieces, ReduceScatterPiecesAreStridedCopiesIntoContiguousSubBlocks) {
  // 3 ranks, 10 floats per rank, pieces of at most 4 elements: 3 pieces of 4, 3, 3.
  const std::uintptr_t in = 0x10000, out = 0x90000;
  const auto plan = plan_pieces(StagedKind::kReduceScatter, {at(in), 120, true},
                                {at(out), 40, true}, 10, 4, 1, 3, true, {16, 1});
  ASSERT_EQ(plan.pieces.size(), 3u);
  const auto& p1 = plan.pieces[1];
  EXPECT_EQ(p1.first, 4u);
  EXPECT_EQ(p1.count, 3u);
  ASSERT_EQ(p1.copy_in.size(), 1u);
  const PieceCopy& c = p1.copy_in[0];
  EXPECT_EQ(c.user, in + 16);
  EXPECT_EQ(c.user_pitch, 40u);
  EXPECT_EQ(c.rows, 3u);
  EXPECT_EQ(c.row_bytes, 12u);
  EXPECT_EQ(c.pinned_pitch, 12u);
  EXPECT_EQ(c.pinned_offset, 3u * 16);  // after piece 0's three sub-blocks of 4 elements
  EXPECT_EQ(p1.in_offset, c.pinned_offset);
  ASSERT_EQ(p1.copy_out.size(), 1u);
  EXPECT_EQ(p1.copy_out[0].rows, 1u);
  EXPECT_EQ(p1.copy_out[0].user, out + 16);
  EXPECT_EQ(p1.out_offset, 256u + 16u);  // the output region starts on a 256-byte boundary
  EXPECT_EQ(plan.pinned_bytes, 256u + 40u);
}

TEST(StagingPieces, AllToAllPiecesCoverTheSameRangeOfEveryBlockOnBothSides) {
  // 3 ranks, blocks of 10 floats, pieces of at most 4 elements: 3 pieces of 4, 3, 3. Piece 1
  // is elements [4, 7) of each of the three blocks, in and out, packed as three sub-blocks.
  const std::uintptr_t in = 0x10000, out = 0x90000;
  const auto plan = plan_pieces(StagedKind::kAllToAll, {at(in), 120, true}, {at(out), 120, true},
                                10, 4, 2, 3, true, {16, 1});
  ASSERT_EQ(plan.pieces.size(), 3u);
  const auto& p1 = plan.pieces[1];
  EXPECT_EQ(p1.first, 4u);
  EXPECT_EQ(p1.count, 3u);
  ASSERT_EQ(p1.copy_in.size(), 1u);
  ASSERT_EQ(p1.copy_out.size(), 1u);
  for (const PieceCopy& c : {p1.copy_in[0], p1.copy_out[0]}) {
    EXPECT_EQ(c.user_pitch, 40u);
    EXPECT_EQ(c.rows, 3u);
    EXPECT_EQ(c.row_bytes, 12u);
    EXPECT_EQ(c.pinned_pitch, 12u);
  }
  EXPECT_EQ(p1.copy_in[0].user, in + 16);
  EXPECT_EQ(p1.copy_out[0].user, out + 16);
  EXPECT_EQ(p1.in_offset, 3u * 16);
  EXPECT_EQ(p1.out_offset, 256u + 3u * 16);
  EXPECT_EQ(plan.pinned_bytes, 256u + 120u);
  // In place (in == out) is split too, into separate pinned regions.
  const auto same = plan_pieces(StagedKind::kAllToAll, {at(in), 120, true}, {at(in), 120, true}, 10,
                                4, 0, 3, true, {16, 1});
  ASSERT_EQ(same.pieces.size(), 3u);
  EXPECT_NE(same.pieces[0].in_offset, same.pieces[0].out_offset);
  // Buffers that overlap otherwise are not: one piece, laid out as the user's.
  EXPECT_EQ(plan_pieces(StagedKind::kAllToAll, {at(in), 120, true}, {at(in + 40), 120, true}, 10, 4,
                        0, 3, true, {16, 1})
                .pieces.size(),
            1u);
}

TEST(StagingPieces, RootedOperationsSplitOffTheRootAsOnItWithoutCopyingOut) {
  // reduce and gather: the root's output is written, the others' is 0 bytes (ignored). Both
  // sides must issue the same host collectives, piece for piece.
  const PieceOptions o{16, 1};
  const std::uintptr_t in = 0x10000, out = 0x90000;
  for (const StagedKind kind : {StagedKind::kAllReduce, StagedKind::kAllGather}) {
    const std::size_t out_bytes = kind == StagedKind::kAllGather ? 3 * 40 : 40;
    const auto root =
        plan_pieces(kind, {at(in), 40, true}, {at(out), out_bytes, true}, 10, 4, 1, 3, true, o);
    const auto other =
        plan_pieces(kind, {at(in), 40, true}, {nullptr, 0, false}, 10, 4, 2, 3, true, o);
    ASSERT_EQ(root.pieces.size(), 3u);
    ASSERT_EQ(other.pieces.size(), root.pieces.size());
    for (std::size_t i = 0; i < root.pieces.size(); ++i) {
      EXPECT_EQ(other.pieces[i].first, root.pieces[i].first) << i;
      EXPECT_EQ(other.pieces[i].count, root.pieces[i].count) << i;
      ASSERT_EQ(other.pieces[i].copy_in.size(), 1u);
      EXPECT_EQ(other.pieces[i].copy_in[0].user, in + root.pieces[i].first * 4) << i;
      EXPECT_TRUE(other.pieces[i].copy_out.empty()) << i;
      EXPECT_EQ(root.pieces[i].copy_out.size(), 1u) << i;
      // Its output still lies inside the pinned buffer.
      EXPECT_LE(other.pieces[i].out_offset + other.pieces[i].count * 4, other.pinned_bytes) << i;
    }
  }
}

TEST(StagingPieces, InvalidFormsAreNotSplit) {
  const PieceOptions o{16, 1};
  const std::uintptr_t b = 0x10000;
  // all_reduce with partially overlapping buffers: one piece, laid out as the user's.
  auto plan = plan_pieces(StagedKind::kAllReduce, {at(b), 400, true}, {at(b + 8), 400, true}, 100,
                          4, 0, 2, true, o);
  EXPECT_EQ(plan.pieces.size(), 1u);
  // reduce_scatter "in place" at another rank's block.
  plan = plan_pieces(StagedKind::kReduceScatter, {at(b), 800, true}, {at(b), 400, true}, 100, 4, 1,
                     2, true, o);
  EXPECT_EQ(plan.pieces.size(), 1u);
  // Null output.
  plan = plan_pieces(StagedKind::kAllReduce, {at(b), 400, true}, {nullptr, 400, true}, 100, 4, 0, 2,
                     true, o);
  EXPECT_EQ(plan.pieces.size(), 1u);
  // The valid in-place form is split.
  plan = plan_pieces(StagedKind::kReduceScatter, {at(b), 800, true}, {at(b + 400), 400, true}, 100,
                     4, 1, 2, true, o);
  EXPECT_EQ(plan.pieces.size(), 25u);
}

// One simulated rank: its user memory (device and host alike, one arena with guard bytes around
// the buffers) and its pinned buffer.
struct SimRank {
  std::vector<std::byte> mem;
  std::vector<std::byte> initial;
  std::uintptr_t in = 0, out = 0;
  StagingSpan in_span, out_span;
  PiecePlan plan;
  std::vector<std::byte> pinned;
};

struct SimCase {
  StagedKind kind;
  int nranks;
  std::size_t count;
  std::size_t elem;
  bool in_place;
  bool in_on_device;  // false: the input is host memory (out-of-place cases only)
  bool split;
  PieceOptions opts;
  int order;  // 0: copy-ins run ahead, 1: copy-outs first, 2..: random with this seed
  // With kReduceScatter: a scatter from the last rank (only its input is read), staged as
  // reduce_scatter is.
  bool scatter = false;
};

std::string describe(const SimCase& c) {
  return std::string(c.scatter ? "scatter" : kind_name(c.kind)) + " nranks " +
         std::to_string(c.nranks) + " count " + std::to_string(c.count) + " elem " +
         std::to_string(c.elem) + (c.in_place ? " in place" : " out of place") +
         (c.in_on_device ? "" : " host in") + (c.split ? " split" : " unsplit") + " piece_bytes " +
         std::to_string(c.opts.piece_bytes) + " order " + std::to_string(c.order);
}

std::byte add(std::byte a, std::byte b) {
  return static_cast<std::byte>(static_cast<unsigned>(a) + static_cast<unsigned>(b));
}

void copy_rows(const PieceCopy& c, std::byte* pinned, bool to_pinned) {
  for (std::size_t r = 0; r < c.rows; ++r) {
    auto* user = reinterpret_cast<std::byte*>(c.user + r * c.user_pitch);
    std::byte* pin = pinned + c.pinned_offset + r * c.pinned_pitch;
    if (to_pinned) {
      std::memcpy(pin, user, c.row_bytes);
    } else {
      std::memcpy(user, pin, c.row_bytes);
    }
  }
}

// The host collective of one piece, from its definition, on every rank's pointers at once. The
// reduction is a bytewise sum mod 256: any misplaced byte shows.
void host_collective(const SimCase& c, std::vector<SimRank>& ranks, std::size_t piece) {
  const auto n = static_cast<std::size_t>(c.nranks);
  const int root = c.nranks - 1;
  std::vector<const std::byte*> in(n);
  std::vector<std::byte*> out(n);
  const StagedPiece& p0 = ranks[0].plan.pieces[piece];
  const std::size_t b = p0.count * c.elem;
  for (std::size_t r = 0; r < n; ++r) {
    const StagedPiece& p = ranks[r].plan.pieces[piece];
    ASSERT_EQ(p.count, p0.count) << "rank " << r << " piece " << piece;
    in[r] = p.in_offset == StagingPlan::kUnstaged ? reinterpret_cast<const std::byte*>(ranks[r].in)
                                                  : ranks[r].pinned.data() + p.in_offset;
    out[r] = p.out_offset == StagingPlan::kUnstaged ? reinterpret_cast<std::byte*>(ranks[r].out)
                                                    : ranks[r].pinned.data() + p.out_offset;
  }
  // Read every input first: in-place forms write where they read.
  std::vector<std::vector<std::byte>> result(n);
  for (std::size_t r = 0; r < n; ++r) {
    switch (c.kind) {
      case StagedKind::kAllReduce:
        result[r].assign(b, std::byte{0});
        for (std::size_t q = 0; q < n; ++q) {
          for (std::size_t j = 0; j < b; ++j) result[r][j] = add(result[r][j], in[q][j]);
        }
        break;
      case StagedKind::kReduceScatter:
        if (c.scatter) {
          const std::byte* from = in[static_cast<std::size_t>(root)] + r * b;
          result[r].assign(from, from + b);
          break;
        }
        result[r].assign(b, std::byte{0});
        for (std::size_t q = 0; q < n; ++q) {
          for (std::size_t j = 0; j < b; ++j) result[r][j] = add(result[r][j], in[q][r * b + j]);
        }
        break;
      case StagedKind::kAllGather:
        for (std::size_t q = 0; q < n; ++q) result[r].insert(result[r].end(), in[q], in[q] + b);
        break;
      case StagedKind::kBroadcast:
        result[r].assign(in[static_cast<std::size_t>(root)],
                         in[static_cast<std::size_t>(root)] + b);
        break;
      case StagedKind::kAllToAll:
        for (std::size_t q = 0; q < n; ++q) {
          result[r].insert(result[r].end(), in[q] + r * b, in[q] + (r + 1) * b);
        }
        break;
      case StagedKind::kOther: break;
    }
  }
  for (std::size_t r = 0; r < n; ++r) {
    if (!result[r].empty()) std::memcpy(out[r], result[r].data(), result[r].size());
  }
}

// The expected final user memory of every rank, from the initial memory alone.
std::vector<std::vector<std::byte>> reference(const SimCase& c, const std::vector<SimRank>& ranks) {
  const auto n = static_cast<std::size_t>(c.nranks);
  const std::size_t b = c.count * c.elem;
  const std::size_t root = n - 1;
  const auto in_of = [&](std::size_t r) {
    return ranks[r].initial.data() +
           (ranks[r].in - reinterpret_cast<std::uintptr_t>(ranks[r].mem.data()));
  };
  std::vector<std::vector<std::byte>> want(n);
  for (std::size_t r = 0; r < n; ++r) {
    want[r] = ranks[r].initial;
    std::byte* out =
        want[r].data() + (ranks[r].out - reinterpret_cast<std::uintptr_t>(ranks[r].mem.data()));
    switch (c.kind) {
      case StagedKind::kAllReduce:
        for (std::size_t j = 0; j < b; ++j) {
          std::byte s{0};
          for (std::size_t q = 0; q < n; ++q) s = add(s, in_of(q)[j]);
          out[j] = s;
        }
        break;
      case StagedKind::kReduceScatter:
        if (c.scatter) {
          std::memcpy(out, in_of(root) + r * b, b);
          break;
        }
        for (std::size_t j = 0; j < b; ++j) {
          std::byte s{0};
          for (std::size_t q = 0; q < n; ++q) s = add(s, in_of(q)[r * b + j]);
          out[j] = s;
        }
        break;
      case StagedKind::kAllGather:
        for (std::size_t q = 0; q < n; ++q) std::memcpy(out + q * b, in_of(q), b);
        break;
      case StagedKind::kBroadcast: std::memcpy(out, in_of(root), b); break;
      case StagedKind::kAllToAll:
        for (std::size_t q = 0; q < n; ++q) std::memcpy(out + q * b, in_of(q) + r * b, b);
        break;
      case StagedKind::kOther: break;
    }
  }
  return want;
}

void check_plan_shape(const SimCase& c, const SimRank& rank) {
  const PiecePlan& plan = rank.plan;
  ASSERT_FALSE(plan.pieces.empty());
  const std::size_t expect_pieces = c.split ? piece_count(c.kind, c.count, c.elem, c.opts) : 1;
  if (expect_pieces > 1) {
    ASSERT_EQ(plan.pieces.size(), expect_pieces) << describe(c);
    std::size_t next = 0;
    for (const auto& p : plan.pieces) {
      ASSERT_EQ(p.first, next);
      ASSERT_GT(p.count, 0u);
      ASSERT_LE(p.count, c.count / expect_pieces + 1);
      ASSERT_GE(p.count, c.count / expect_pieces);
      next += p.count;
    }
    ASSERT_EQ(next, c.count);
  } else {
    ASSERT_EQ(plan.pieces.size(), 1u) << describe(c);
    ASSERT_EQ(plan.pieces[0].count, c.count);
  }
  for (const auto& p : plan.pieces) {
    for (const auto* copies : {&p.copy_in, &p.copy_out}) {
      for (const auto& cp : *copies) {
        ASSERT_EQ(cp.row_bytes % c.elem, 0u);
        ASSERT_EQ(cp.pinned_offset % c.elem, 0u);
        ASSERT_GE(cp.user_pitch, cp.row_bytes);
        ASSERT_GE(cp.pinned_pitch, cp.row_bytes);
        ASSERT_LE(cp.pinned_offset + (cp.rows - 1) * cp.pinned_pitch + cp.row_bytes,
                  plan.pinned_bytes)
            << describe(c);
      }
    }
  }
}

void simulate(const SimCase& c) {
  SCOPED_TRACE(describe(c));
  const auto n = static_cast<std::size_t>(c.nranks);
  const std::size_t b = c.count * c.elem;
  const bool to_all = c.kind == StagedKind::kAllToAll;
  const std::size_t in_bytes = c.kind == StagedKind::kReduceScatter || to_all ? n * b : b;
  const std::size_t out_bytes = c.kind == StagedKind::kAllGather || to_all ? n * b : b;
  constexpr std::size_t kGuard = 24;
  std::vector<SimRank> ranks(n);
  for (std::size_t r = 0; r < n; ++r) {
    SimRank& s = ranks[r];
    s.mem.resize(kGuard + in_bytes + kGuard + out_bytes + kGuard);
    std::mt19937_64 rng(1000 * r + c.count);
    for (std::size_t i = 0; i < s.mem.size(); i += 8) {
      const std::uint64_t v = rng();
      std::memcpy(s.mem.data() + i, &v, std::min<std::size_t>(8, s.mem.size() - i));
    }
    s.initial = s.mem;
    const auto base = reinterpret_cast<std::uintptr_t>(s.mem.data()) + kGuard;
    if (!c.in_place) {
      s.in = base;
      s.out = base + in_bytes + kGuard;
    } else if (c.kind == StagedKind::kReduceScatter) {
      s.in = base;
      s.out = base + r * b;
    } else if (c.kind == StagedKind::kAllGather) {
      s.out = base;
      s.in = base + r * b;
    } else {
      s.in = s.out = base;
    }
    const bool rooted_in = c.kind == StagedKind::kBroadcast || c.scatter;
    const bool reads_in = !rooted_in || r == n - 1;
    s.in_span = {at(s.in), reads_in ? in_bytes : 0, c.in_on_device};
    s.out_span = {at(s.out), out_bytes, true};
    s.plan = plan_pieces(c.kind, s.in_span, s.out_span, c.count, c.elem, static_cast<int>(r),
                         c.nranks, c.split, c.opts);
    check_plan_shape(c, s);
    if (::testing::Test::HasFatalFailure()) return;
    s.pinned.assign(s.plan.pinned_bytes, std::byte{0xee});
  }
  const std::size_t pieces = ranks[0].plan.pieces.size();
  // Per rank: copy-ins and copy-outs each in piece order; collective i after every rank's
  // copy-in i, collectives in order; copy-out i after collective i.
  std::vector<std::size_t> next_in(n, 0), next_out(n, 0);
  std::size_t next_coll = 0;
  std::mt19937 pick(static_cast<unsigned>(c.order));
  for (;;) {
    std::vector<std::function<void()>> ready_in, ready_coll, ready_out;
    for (std::size_t r = 0; r < n; ++r) {
      if (next_in[r] < pieces) {
        ready_in.push_back([&, r] {
          for (const auto& cp : ranks[r].plan.pieces[next_in[r]].copy_in) {
            copy_rows(cp, ranks[r].pinned.data(), true);
          }
          ++next_in[r];
        });
      }
      if (next_out[r] < next_coll) {
        ready_out.push_back([&, r] {
          for (const auto& cp : ranks[r].plan.pieces[next_out[r]].copy_out) {
            copy_rows(cp, ranks[r].pinned.data(), false);
          }
          ++next_out[r];
        });
      }
    }
    if (next_coll < pieces &&
        std::all_of(next_in.begin(), next_in.end(), [&](std::size_t i) { return i > next_coll; })) {
      ready_coll.push_back([&] {
        host_collective(c, ranks, next_coll);
        ++next_coll;
      });
    }
    std::vector<std::function<void()>>* from = nullptr;
    if (c.order == 0) {
      from = !ready_in.empty() ? &ready_in : !ready_coll.empty() ? &ready_coll : &ready_out;
    } else if (c.order == 1) {
      from = !ready_out.empty() ? &ready_out : !ready_coll.empty() ? &ready_coll : &ready_in;
    } else {
      std::vector<std::vector<std::function<void()>>*> any;
      for (auto* v : {&ready_in, &ready_coll, &ready_out}) {
        if (!v->empty()) any.push_back(v);
      }
      if (!any.empty()) from = any[pick() % any.size()];
    }
    if (from == nullptr || from->empty()) break;
    (*from)[pick() % from->size()]();
    if (::testing::Test::HasFatalFailure()) return;
  }
  ASSERT_EQ(next_coll, pieces);
  const auto want = reference(c, ranks);
  for (std::size_t r = 0; r < n; ++r) {
    if (std::memcmp(ranks[r].mem.data(), want[r].data(), want[r].size()) == 0) continue;
    for (std::size_t i = 0; i < want[r].size(); ++i) {
      ASSERT_EQ(ranks[r].mem[i], want[r][i])
          << "rank " << r << " byte " << i << " of user memory (buffers start at " << kGuard << ")";
    }
  }
}

// Every kind the staging path splits, and scatter (staged as reduce_scatter).
struct SimKind {
  StagedKind kind;
  bool scatter;
};
constexpr SimKind kSimKinds[] = {
    {StagedKind::kAllReduce, false}, {StagedKind::kReduceScatter, false},
    {StagedKind::kAllGather, false}, {StagedKind::kBroadcast, false},
    {StagedKind::kAllToAll, false},  {StagedKind::kReduceScatter, true}};

TEST(StagingPieces, PipelineSimulationMatchesTheReference) {
  for (const auto [kind, scatter] : kSimKinds) {
    for (const int nranks : {1, 2, 3, 4, 5, 8}) {
      for (const std::size_t count : {0u, 1u, 2u, 7u, 64u, 1001u}) {
        for (const std::size_t elem : {1u, 2u, 4u, 8u}) {
          for (const bool in_place : {false, true}) {
            for (const bool in_on_device : {true, false}) {
              if (in_place && !in_on_device) continue;
              for (const bool split : {true, false}) {
                for (const int order : {0, 1, 2, 3}) {
                  if (!split && order > 0) continue;
                  // Pieces of 40 bytes (not a multiple of 8), split from 16 bytes: many pieces,
                  // uneven ones.
                  simulate({kind,
                            nranks,
                            count,
                            elem,
                            in_place,
                            in_on_device,
                            split,
                            {40, 16},
                            order,
                            scatter});
                  if (::testing::Test::HasFatalFailure()) return;
                }
              }
            }
          }
        }
      }
    }
  }
}

TEST(StagingPieces, PipelineSimulationWithDefaultSizedPieces) {
  // 1 MiB to a few MiB per rank with the default options: 2 to 3 pieces, as on a GPU.
  const PieceOptions o;
  for (const auto [kind, scatter] : kSimKinds) {
    for (const bool in_place : {false, true}) {
      simulate({kind, 2, (9u << 20) / 4 + 3, 4, in_place, true, true, o, 5, scatter});
      if (::testing::Test::HasFatalFailure()) return;
    }
    simulate({kind, 3, (1u << 20) / 2, 2, false, true, true, o, 6, scatter});
    if (::testing::Test::HasFatalFailure()) return;
  }
}

// ---- pointer-location dispatch with host pointers ----------------------------------------------

TEST(DeviceDispatch, WhichCollectivesTheEngineRunsOnDeviceMemory) {
  using collectives::CollectiveCall;
  using collectives::kDeviceLogStepMaxBytes;
  using collectives::runs_resident;
  const auto call = [](OpKind kind, int root, std::size_t count = 1 << 20,
                       DataType dtype = DataType::kFloat32) {
    CollectiveCall c;
    c.kind = kind;
    c.root = root;
    c.count = count;
    c.dtype = dtype;
    return c;
  };
  // The ring collectives and their rooted forms, at every size.
  EXPECT_TRUE(runs_resident(call(OpKind::kAllReduce, -1), 4));
  EXPECT_TRUE(runs_resident(call(OpKind::kAllReduce, 1), 4));  // reduce
  EXPECT_TRUE(runs_resident(call(OpKind::kReduceScatter, -1), 4));
  EXPECT_TRUE(runs_resident(call(OpKind::kAllGather, -1), 4));
  EXPECT_TRUE(runs_resident(call(OpKind::kAllGather, 0), 4));  // gather
  EXPECT_TRUE(runs_resident(call(OpKind::kBroadcast, 2), 4));
  // scatter and all_to_all (log-step schedules only) while their N blocks fit in
  // kDeviceLogStepMaxBytes, which every rank computes alike; staged in pieces beyond.
  const std::size_t fits = kDeviceLogStepMaxBytes / 4 / 4;  // floats per block on 4 ranks
  for (const auto& [kind, root] : {std::pair{OpKind::kReduceScatter, 0},  // scatter
                                   std::pair{OpKind::kAllToAll, -1}}) {
    EXPECT_TRUE(runs_resident(call(kind, root, fits), 4));
    EXPECT_TRUE(runs_resident(call(kind, root, 0), 4));
    EXPECT_FALSE(runs_resident(call(kind, root, fits + 1), 4));
    EXPECT_TRUE(runs_resident(call(kind, root, fits * 2), 2));
    EXPECT_FALSE(runs_resident(call(kind, root, fits * 2), 3));
    EXPECT_TRUE(runs_resident(call(kind, root, fits * 4, DataType::kUint8), 4));
    EXPECT_FALSE(runs_resident(call(kind, root, 1, static_cast<DataType>(200)), 4));
  }
  // all_to_all_v and its gather forms go through exchange_on_device; barrier, send and recv
  // never reach the engine on device memory.
  EXPECT_FALSE(runs_resident(call(OpKind::kAllToAllV, -1, 1), 4));
  EXPECT_FALSE(runs_resident(call(OpKind::kAllToAllV, 0, 1), 4));  // gather_v
  EXPECT_FALSE(runs_resident(call(OpKind::kBarrier, -1, 1), 4));
}

TEST(DeviceDispatch, HostPointersAreNotDevicePointers) {
  int on_stack = 0;
  std::vector<float> on_heap(16);
  EXPECT_FALSE(is_device_pointer(nullptr));
  EXPECT_FALSE(is_device_pointer(&on_stack));
  EXPECT_FALSE(is_device_pointer(on_heap.data()));
}

TEST(DeviceDispatch, HostBuffersRunOnTheHostPath) {
  dear::testing::run_ranks(3, [](Communicator& comm) {
    std::vector<float> in(1000), out(1000, -1.0f);
    for (std::size_t i = 0; i < in.size(); ++i) in[i] = static_cast<float>(comm.rank() + i);
    comm.all_reduce(in.data(), out.data(), in.size(), DataType::kFloat32, ReduceOp::kSum).wait();
    for (std::size_t i = 0; i < out.size(); ++i) {
      ASSERT_EQ(out[i], static_cast<float>(3 * i + 3)) << "element " << i;
    }
    // In place through the same dispatch.
    comm.all_reduce(in.data(), in.data(), in.size(), DataType::kFloat32, ReduceOp::kMax).wait();
    for (std::size_t i = 0; i < in.size(); ++i) ASSERT_EQ(in[i], static_cast<float>(2 + i));
  });
}

TEST(DeviceDispatch, StreamWithoutUsableCudaIsRejected) {
  dear::testing::run_ranks(1, [](Communicator& comm) {
    float x = 1;
    OpOptions o;
    o.cuda_stream = reinterpret_cast<void*>(0x1);  // cudaStreamLegacy's value
    try {
      // Only completes in a CUDA build on a machine with a device.
      comm.all_reduce(&x, &x, 1, DataType::kFloat32, ReduceOp::kSum, o).wait();
      EXPECT_EQ(x, 1.0f);
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
      EXPECT_NE(std::string(e.what()).find("cuda_stream"), std::string::npos) << e.what();
    }
  });
}

// ---- functor equivalence ---------------------------------------------------------------------

constexpr DataType kTypes[] = {DataType::kInt8,    DataType::kUint8,   DataType::kInt32,
                               DataType::kInt64,   DataType::kFloat16, DataType::kBFloat16,
                               DataType::kFloat32, DataType::kFloat64};
constexpr ReduceOp kOps[] = {ReduceOp::kSum, ReduceOp::kProd, ReduceOp::kMin, ReduceOp::kMax,
                             ReduceOp::kAvg};

// What one GPU thread computes for one element: the shared functors, applied one at a time.
template <DataType kType>
void scalar_functors(void* dst, const void* a, const void* b, std::size_t n, ReduceOp op,
                     int divisor) {
  using E = Element<kType>;
  using S = typename E::Storage;
  using C = typename E::Compute;
  auto* d = static_cast<S*>(dst);
  const auto* pa = static_cast<const S*>(a);
  const auto* pb = static_cast<const S*>(b);
  for (std::size_t i = 0; i < n; ++i) {
    const C x = E::load(pa[i]);
    const C y = E::load(pb[i]);
    C r{};
    switch (op) {
      case ReduceOp::kSum: r = SumOp{}(x, y); break;
      case ReduceOp::kProd: r = ProdOp{}(x, y); break;
      case ReduceOp::kMin: r = MinOp{}(x, y); break;
      case ReduceOp::kMax: r = MaxOp{}(x, y); break;
      case ReduceOp::kAvg: r = divisor > 1 ? AvgFinalOp<C>{divisor}(x, y) : SumOp{}(x, y); break;
    }
    d[i] = E::store(r);
  }
}

void scalar(void* dst, const void* a, const void* b, std::size_t n, DataType t, ReduceOp op,
            int divisor) {
  switch (t) {
    case DataType::kInt8: return scalar_functors<DataType::kInt8>(dst, a, b, n, op, divisor);
    case DataType::kUint8: return scalar_functors<DataType::kUint8>(dst, a, b, n, op, divisor);
    case DataType::kInt32: return scalar_functors<DataType::kInt32>(dst, a, b, n, op, divisor);
    case DataType::kInt64: return scalar_functors<DataType::kInt64>(dst, a, b, n, op, divisor);
    case DataType::kFloat16: return scalar_functors<DataType::kFloat16>(dst, a, b, n, op, divisor);
    case DataType::kBFloat16:
      return scalar_functors<DataType::kBFloat16>(dst, a, b, n, op, divisor);
    case DataType::kFloat32: return scalar_functors<DataType::kFloat32>(dst, a, b, n, op, divisor);
    case DataType::kFloat64: return scalar_functors<DataType::kFloat64>(dst, a, b, n, op, divisor);
  }
}

// Random bit patterns (NaN, Inf, subnormals included) plus a share of ordinary values, so that
// rounding, not only special values, is exercised.
std::vector<std::byte> random_bytes(std::size_t n, std::size_t elem, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<std::byte> v(n * elem);
  for (auto& b : v) b = static_cast<std::byte>(rng());
  return v;
}

// NaN results agree as NaNs only: which operand's payload an addition keeps depends on
// operand order, which compilers may swap (x86), and GPUs return one canonical NaN.
bool is_nan(const std::byte* p, DataType t) {
  switch (t) {
    case DataType::kFloat16: {
      std::uint16_t h;
      std::memcpy(&h, p, 2);
      return (h & 0x7fff) > 0x7c00;
    }
    case DataType::kBFloat16: {
      std::uint16_t h;
      std::memcpy(&h, p, 2);
      return (h & 0x7fff) > 0x7f80;
    }
    case DataType::kFloat32: {
      float f;
      std::memcpy(&f, p, 4);
      return std::isnan(f);
    }
    case DataType::kFloat64: {
      double f;
      std::memcpy(&f, p, 8);
      return std::isnan(f);
    }
    default: return false;
  }
}

// Bit for bit apart from NaN payloads (see is_nan).
TEST(FunctorEquivalence, ScalarFunctorsMatchTheCpuKernelsBitForBit) {
  constexpr std::size_t kN = 4099;  // odd: vector bodies and tails
  for (const DataType t : kTypes) {
    const std::size_t el = dtype_size(t);
    const auto a = random_bytes(kN, el, 1 + static_cast<int>(t));
    const auto b = random_bytes(kN, el, 100 + static_cast<int>(t));
    for (const ReduceOp op : kOps) {
      for (const int nranks : {1, 3}) {
        std::vector<std::byte> want(kN * el), got(kN * el);
        scalar(want.data(), a.data(), b.data(), kN, t, op, op == ReduceOp::kAvg ? nranks : 1);
        reduce_final(got.data(), a.data(), b.data(), kN, t, op, nranks);
        for (std::size_t i = 0; i < kN; ++i) {
          if (is_nan(want.data() + i * el, t)) {
            ASSERT_TRUE(is_nan(got.data() + i * el, t)) << to_string(t) << " element " << i;
            continue;
          }
          ASSERT_EQ(std::memcmp(want.data() + i * el, got.data() + i * el, el), 0)
              << to_string(t) << " " << to_string(op) << " nranks " << nranks << " element " << i;
        }
      }
    }
  }
}

// Independent rounding of an fp32 value to bf16: the nearer neighbour, ties to the even one,
// decided by exact arithmetic in double.
std::uint16_t independent_bf16(float f) {
  if (std::isnan(f)) return 0x7fc0;
  std::uint32_t u;
  std::memcpy(&u, &f, 4);
  const std::uint32_t lo_bits = u & 0xffff0000u;
  const std::uint32_t hi_bits = lo_bits + 0x10000u;
  float lo, hi;
  std::memcpy(&lo, &lo_bits, 4);
  std::memcpy(&hi, &hi_bits, 4);
  const double dlo = std::fabs(static_cast<double>(f) - static_cast<double>(lo));
  const double dhi = std::fabs(static_cast<double>(hi) - static_cast<double>(f));
  if (dlo < dhi || (dlo == dhi && ((lo_bits >> 16) & 1u) == 0)) {
    return static_cast<std::uint16_t>(lo_bits >> 16);
  }
  return static_cast<std::uint16_t>(hi_bits >> 16);
}

double finite_value(std::mt19937_64& rng) {
  std::uniform_real_distribution<double> d(-300.0, 300.0);
  return d(rng);
}

TEST(FunctorEquivalence, SixteenBitFloatsRoundOnceFromFp32) {
  std::mt19937_64 rng(7);
  for (int k = 0; k < 200000; ++k) {
    const auto fa = static_cast<float>(finite_value(rng));
    const auto fb = static_cast<float>(finite_value(rng));
    // bf16: inputs rounded independently, fp32 arithmetic, then rounded once.
    const std::uint16_t ba = independent_bf16(fa), bb = independent_bf16(fb);
    const auto bf = [](std::uint16_t x) {
      return static_cast<float>(dear::testing::bf16_bits_value(x));
    };
    using B = Element<DataType::kBFloat16>;
    EXPECT_EQ(B::store(SumOp{}(B::load(ba), B::load(bb))), independent_bf16(bf(ba) + bf(bb)));
    EXPECT_EQ(B::store(ProdOp{}(B::load(ba), B::load(bb))), independent_bf16(bf(ba) * bf(bb)));
    EXPECT_EQ(B::store(AvgFinalOp<float>{3}(B::load(ba), B::load(bb))),
              independent_bf16((bf(ba) + bf(bb)) / 3.0f));
#ifdef __FLT16_MAX__
    // fp16: the compiler's own _Float16 conversions are the reference.
    const auto ha = static_cast<_Float16>(fa / 8), hb = static_cast<_Float16>(fb / 8);
    std::uint16_t ua, ub;
    std::memcpy(&ua, &ha, 2);
    std::memcpy(&ub, &hb, 2);
    const auto ref = [](float r) {
      const auto h = static_cast<_Float16>(r);
      std::uint16_t u;
      std::memcpy(&u, &h, 2);
      return u;
    };
    using H = Element<DataType::kFloat16>;
    const float xa = static_cast<float>(ha), xb = static_cast<float>(hb);
    EXPECT_EQ(H::store(SumOp{}(H::load(ua), H::load(ub))), ref(xa + xb));
    EXPECT_EQ(H::store(ProdOp{}(H::load(ua), H::load(ub))), ref(xa * xb));
    EXPECT_EQ(H::store(AvgFinalOp<float>{3}(H::load(ua), H::load(ub))), ref((xa + xb) / 3.0f));
    EXPECT_EQ(H::store(MinOp{}(H::load(ua), H::load(ub))), ref(std::fmin(xa, xb)));
    EXPECT_EQ(H::store(MaxOp{}(H::load(ua), H::load(ub))), ref(std::fmax(xa, xb)));
#endif
    if (::testing::Test::HasFailure()) return;
  }
}

TEST(FunctorEquivalence, IntegersAgreeWithWideArithmetic) {
  std::mt19937_64 rng(11);
  for (int k = 0; k < 100000; ++k) {
    const auto a = static_cast<std::int64_t>(rng());
    const auto b = static_cast<std::int64_t>(rng());
    const auto a8 = static_cast<std::int8_t>(a), b8 = static_cast<std::int8_t>(b);
    ASSERT_EQ(SumOp{}(a8, b8), static_cast<std::int8_t>((a8 + b8) & 0xff));
    ASSERT_EQ(ProdOp{}(a8, b8), static_cast<std::int8_t>((a8 * b8) & 0xff));
    const auto u8a = static_cast<std::uint8_t>(a), u8b = static_cast<std::uint8_t>(b);
    ASSERT_EQ(ProdOp{}(u8a, u8b), static_cast<std::uint8_t>((u8a * u8b) & 0xff));
    const auto a32 = static_cast<std::int32_t>(a), b32 = static_cast<std::int32_t>(b);
    ASSERT_EQ(SumOp{}(a32, b32), static_cast<std::int32_t>(static_cast<std::int64_t>(a32) + b32));
    ASSERT_EQ(MinOp{}(a32, b32), std::min(a32, b32));
    ASSERT_EQ(MaxOp{}(a, b), std::max(a, b));
    ASSERT_EQ(AvgFinalOp<std::int32_t>{3}(a32 / 4, b32 / 4),
              static_cast<std::int32_t>((static_cast<std::int64_t>(a32 / 4) + b32 / 4) / 3));
  }
}

}  // namespace
}  // namespace dear::collectives
