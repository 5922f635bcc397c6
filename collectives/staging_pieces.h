// How a staged collective is split into pieces that pipeline through pinned host memory:
// piece i is copied in (device -> pinned), then runs as a host collective of its own on its
// part of the pinned buffers, then is copied out (pinned -> device), and the copies of one
// piece overlap the host collectives of the others (device_staging.cc runs the plan).
//
// Pure arithmetic on addresses, no CUDA: it is built and tested everywhere.
//
// Contract:
// - The number of pieces depends only on the collective, its per-rank count, the element
//   size and PieceOptions, never on where the buffers live or whether they overlap, so every
//   rank that splits an operation splits it alike and hands the engine the same sequence of
//   host collectives. (Whether a rank splits at all is decided by the caller: `split`.)
// - Piece i covers elements [first, first + count) of the operation's per-rank data, sizes as
//   even as possible (they differ by at most one element), every piece non-empty:
//   all_reduce, broadcast: that range of the vector; reduce_scatter: that range of EVERY
//   rank's input block (its pinned input is the N sub-blocks, contiguous) and of the output
//   block; all_gather: that range of the input and of every block of the output (its pinned
//   output is N contiguous sub-blocks, copied out with a stride); all_to_all: that range of
//   every block on both sides. scatter is staged as reduce_scatter is (the root's input is N
//   blocks), gather as all_gather.
// - A split plan stages every buffer that is read or written, device or host, in two pinned
//   regions (input, then output on a 256-byte boundary), so each piece's host collective is
//   out of place even when the user's operation is in place. The copies of different pieces
//   touch disjoint user memory, except that an in-place form's own block is read by piece
//   i's copy-in and written by the same piece's copy-out only, after it: any order that keeps
//   copy-in -> collective -> copy-out per piece is correct.
// - A broadcast on a non-root rank (input of 0 bytes) gets its piece's output as input: the
//   host collective sees an in-place broadcast there.
// - A reduce or gather on a rank other than its root (output of 0 bytes: nothing is written
//   there) gets pieces whose outputs lie in the pinned output region, which nothing copies out,
//   so that it splits as the root does.
// - An unsplit plan (one piece) is plan_staging()'s: overlapping buffers share one region, host
//   buffers are used as they are (offset kUnstaged), copies are chunked.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "collectives/staging_plan.h"

namespace dear::collectives {

enum class StagedKind { kAllReduce, kReduceScatter, kAllGather, kBroadcast, kAllToAll, kOther };

struct PieceOptions {
  // Per-rank bytes per piece (rounded down to whole elements, at least one element).
  std::size_t piece_bytes = 4u << 20;
  // Operations with at least this many per-rank bytes are split into two pieces or more.
  std::size_t min_split_bytes = 1u << 20;
};

// A copy of `rows` rows of `row_bytes`, from (copy-in) or to (copy-out) user memory at `user`
// with stride `user_pitch`, to or from the pinned buffer at `pinned_offset` with stride
// `pinned_pitch`. rows == 1: a plain copy (the pitches are then row_bytes).
struct PieceCopy {
  std::uintptr_t user = 0;
  std::size_t user_pitch = 0;
  std::size_t pinned_offset = 0;
  std::size_t pinned_pitch = 0;
  std::size_t rows = 1;
  std::size_t row_bytes = 0;
  [[nodiscard]] std::size_t bytes() const { return rows * row_bytes; }
};

struct StagedPiece {
  std::size_t first = 0;  // first element of the per-rank data this piece covers
  std::size_t count = 0;  // the host collective's count (per-rank count for RS and AG)
  // Where the host collective finds in / out in the pinned buffer; kUnstaged: the caller's
  // pointer as it is (unsplit plans only).
  std::size_t in_offset = StagingPlan::kUnstaged;
  std::size_t out_offset = StagingPlan::kUnstaged;
  std::vector<PieceCopy> copy_in;   // before the host collective
  std::vector<PieceCopy> copy_out;  // after it
};

struct PiecePlan {
  std::size_t pinned_bytes = 0;
  std::vector<StagedPiece> pieces;  // at least one
};

// How many pieces an operation of `count` per-rank elements of `elem` bytes is split into when
// it is split (1 for kOther and for small operations).
[[nodiscard]] inline std::size_t piece_count(StagedKind kind, std::size_t count, std::size_t elem,
                                             const PieceOptions& opts) {
  elem = std::max<std::size_t>(elem, 1);
  if (kind == StagedKind::kOther || count < 2) return 1;
  if (count * elem < std::max<std::size_t>(opts.min_split_bytes, 1)) return 1;
  const std::size_t per_piece = std::max<std::size_t>(opts.piece_bytes / elem, 1);
  const std::size_t p = std::max<std::size_t>((count + per_piece - 1) / per_piece, 2);
  return std::min(p, count);
}

namespace detail {

inline PieceCopy flat_copy(std::uintptr_t user, std::size_t pinned_offset, std::size_t bytes) {
  return {user, bytes, pinned_offset, bytes, 1, bytes};
}

inline PiecePlan unsplit(const StagingSpan& in, const StagingSpan& out, std::size_t count,
                         std::size_t elem) {
  const StagingPlan s = plan_staging(in, out, elem);
  PiecePlan plan;
  plan.pinned_bytes = s.pinned_bytes;
  StagedPiece p;
  p.count = count;
  p.in_offset = s.in_offset;
  p.out_offset = s.out_offset;
  for (const auto& c : s.copy_in)
    p.copy_in.push_back(flat_copy(c.device, c.pinned_offset, c.bytes));
  for (const auto& c : s.copy_out) {
    p.copy_out.push_back(flat_copy(c.device, c.pinned_offset, c.bytes));
  }
  plan.pieces.push_back(std::move(p));
  return plan;
}

}  // namespace detail

// The plan for one staged operation. `in` and `out` as for plan_staging (in.bytes = 0 where
// the input is not read: a broadcast off the root); `count` is the per-rank count of the
// collective; `rank` and `nranks` this rank and the communicator's size. With `split` false,
// where piece_count() is 1, or where the arguments are not a valid form of the collective
// (null or wrongly sized buffers, overlaps other than the in-place forms), the plan is
// plan_staging()'s as one piece, so that the host collective sees, and reports, what the
// caller passed.
[[nodiscard]] inline PiecePlan plan_pieces(StagedKind kind, const StagingSpan& in,
                                           const StagingSpan& out, std::size_t count,
                                           std::size_t elem, int rank, int nranks, bool split,
                                           const PieceOptions& opts = {}) {
  elem = std::max<std::size_t>(elem, 1);
  const std::size_t pieces = split ? piece_count(kind, count, elem, opts) : 1;
  if (pieces <= 1) return detail::unsplit(in, out, count, elem);

  const auto n = static_cast<std::size_t>(std::max(nranks, 1));
  const bool reads_in = in.bytes > 0;
  const bool writes_out = out.bytes > 0;
  // Rows per piece on each side, and the user strides between rows.
  const bool all_to_all = kind == StagedKind::kAllToAll;
  const std::size_t in_rows = kind == StagedKind::kReduceScatter || all_to_all ? n : 1;
  const std::size_t out_rows = kind == StagedKind::kAllGather || all_to_all ? n : 1;
  const std::size_t block = count * elem;  // one rank's data: the stride between rows
  const std::size_t in_total = reads_in ? in_rows * block : 0;
  const std::size_t out_total = out_rows * block;
  {
    const auto i0 = reinterpret_cast<std::uintptr_t>(in.ptr);
    const auto o0 = reinterpret_cast<std::uintptr_t>(out.ptr);
    const auto own = static_cast<std::uintptr_t>(std::max(rank, 0)) * block;
    bool valid = (!writes_out || (out.ptr != nullptr && out.bytes == out_total)) &&
                 (!reads_in || (in.ptr != nullptr && in.bytes == in_total));
    if (valid && reads_in && writes_out && i0 < o0 + out_total && o0 < i0 + in_total) {
      switch (kind) {
        case StagedKind::kReduceScatter: valid = o0 == i0 + own; break;
        case StagedKind::kAllGather: valid = i0 == o0 + own; break;
        default: valid = i0 == o0; break;
      }
    }
    if (!valid) return detail::unsplit(in, out, count, elem);
  }
  const std::size_t in_region = 0;
  const std::size_t out_region = (in_total + 255) / 256 * 256;

  PiecePlan plan;
  plan.pinned_bytes = out_region + out_total;
  const auto in_lo = reinterpret_cast<std::uintptr_t>(in.ptr);
  const auto out_lo = reinterpret_cast<std::uintptr_t>(out.ptr);
  std::size_t first = 0;
  for (std::size_t i = 0; i < pieces; ++i) {
    StagedPiece p;
    p.first = first;
    p.count = count / pieces + (i < count % pieces ? 1 : 0);
    const std::size_t row = p.count * elem;
    const std::size_t skip = first * elem;  // into each row's user block
    // Pieces before this one fill rows * first elements of each pinned region.
    p.out_offset = out_region + out_rows * skip;
    if (writes_out) p.copy_out.push_back({out_lo + skip, block, p.out_offset, row, out_rows, row});
    if (reads_in) {
      p.in_offset = in_region + in_rows * skip;
      p.copy_in.push_back({in_lo + skip, block, p.in_offset, row, in_rows, row});
    } else {
      p.in_offset = p.out_offset;
    }
    for (auto* copies : {&p.copy_in, &p.copy_out}) {
      for (auto& c : *copies) {
        if (c.rows == 1) c.user_pitch = c.pinned_pitch = c.row_bytes;
      }
    }
    first += p.count;
    plan.pieces.push_back(std::move(p));
  }
  return plan;
}

}  // namespace dear::collectives
