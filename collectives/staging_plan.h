// How a collective on device buffers is staged through pinned host memory: which byte ranges
// are copied in (device -> pinned) before the host collective runs, where in the pinned buffer
// the collective reads and writes, and which ranges are copied out (pinned -> device) after.
//
// Pure arithmetic on addresses, no CUDA: it is built and tested everywhere.
//
// - A device input and output that overlap (in-place forms: all_reduce with in == out,
//   reduce_scatter with out inside in, all_gather with in inside out) share one pinned region
//   laid out as the device memory is, so the host collective sees the same in-place form.
// - Otherwise each device buffer gets its own region; host buffers are used as they are.
// - Copies are split into chunks of at most `chunk_bytes`, on element boundaries, issued back
//   to back. This is the layout of operations too small to be split into pieces; larger ones
//   are pipelined piece by piece (staging_pieces.h).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

namespace dear::collectives {

struct StagingSpan {
  const void* ptr = nullptr;
  std::size_t bytes = 0;  // 0: nothing to stage (null, empty, or not read on this rank)
  bool device = false;
};

struct StagingCopy {
  std::uintptr_t device = 0;      // device address
  std::size_t pinned_offset = 0;  // offset into the pinned buffer
  std::size_t bytes = 0;
};

struct StagingPlan {
  static constexpr std::size_t kUnstaged = static_cast<std::size_t>(-1);
  std::size_t pinned_bytes = 0;
  // Where the host collective finds in / out in the pinned buffer; kUnstaged: use the caller's
  // pointer as is (host memory, or nothing to stage).
  std::size_t in_offset = kUnstaged;
  std::size_t out_offset = kUnstaged;
  std::vector<StagingCopy> copy_in;   // device -> pinned, before the collective
  std::vector<StagingCopy> copy_out;  // pinned -> device, after it
};

// Default copy chunk: large enough for full PCIe bandwidth, small enough to pipeline.
inline constexpr std::size_t kStagingChunkBytes = 4u << 20;

// [device, device + bytes) as chunks of at most chunk_bytes (rounded down to whole elements,
// at least one element), appended to `out`.
inline void append_chunks(std::vector<StagingCopy>& out, std::uintptr_t device,
                          std::size_t pinned_offset, std::size_t bytes, std::size_t elem,
                          std::size_t chunk_bytes) {
  elem = std::max<std::size_t>(elem, 1);
  const std::size_t chunk = std::max(elem, chunk_bytes / elem * elem);
  for (std::size_t done = 0; done < bytes; done += chunk) {
    out.push_back({device + done, pinned_offset + done, std::min(chunk, bytes - done)});
  }
}

[[nodiscard]] inline StagingPlan plan_staging(const StagingSpan& in, const StagingSpan& out,
                                              std::size_t elem,
                                              std::size_t chunk_bytes = kStagingChunkBytes) {
  StagingPlan plan;
  const bool stage_in = in.device && in.bytes > 0 && in.ptr != nullptr;
  const bool stage_out = out.device && out.bytes > 0 && out.ptr != nullptr;
  const auto in_lo = reinterpret_cast<std::uintptr_t>(in.ptr);
  const auto out_lo = reinterpret_cast<std::uintptr_t>(out.ptr);
  if (stage_in && stage_out && in_lo < out_lo + out.bytes && out_lo < in_lo + in.bytes) {
    const std::uintptr_t lo = std::min(in_lo, out_lo);
    const std::uintptr_t hi = std::max(in_lo + in.bytes, out_lo + out.bytes);
    plan.pinned_bytes = hi - lo;
    plan.in_offset = in_lo - lo;
    plan.out_offset = out_lo - lo;
  } else {
    // Separate regions, the second one starting on a 256-byte boundary (as cudaMalloc's).
    if (stage_in) {
      plan.in_offset = 0;
      plan.pinned_bytes = (in.bytes + 255) / 256 * 256;
    }
    if (stage_out) {
      plan.out_offset = plan.pinned_bytes;
      plan.pinned_bytes += out.bytes;
    }
  }
  if (stage_in) append_chunks(plan.copy_in, in_lo, plan.in_offset, in.bytes, elem, chunk_bytes);
  if (stage_out) {
    append_chunks(plan.copy_out, out_lo, plan.out_offset, out.bytes, elem, chunk_bytes);
  }
  return plan;
}

}  // namespace dear::collectives
