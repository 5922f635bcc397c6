// Log-step schedules: recursive doubling, recursive halving + doubling (Rabenseifner) and the
// binomial tree, for messages where the ring's 2(N-1) steps of latency dominate; and
// all_to_all's pairwise and scattered exchanges, which only the mesh links can carry.
//
// Unlike the ring schedules of ops.h, which stream slices over the two ring links, a log-step
// schedule is a short list of whole-message steps, each exchanged with a different peer over
// the communicator's mesh links (step_peers() says which). A step may send, receive, or both:
//   1. its send leaves once every earlier step is complete (it carries their result);
//   2. it is complete once its receive has arrived and been applied (copied, or reduced into
//      the work buffer) and, when `wait_send`, its send has left (the receive overwrites what
//      the send reads).
// Messages of later steps may arrive early (a partner can be ahead): received operands wait in
// the operation's staging area at `stage_offset` until their step comes, and copies go to
// regions that no earlier step reads or writes. Each message carries its schedule-wide `tag`
// (the frame's index), which both ends compute alike, so a receiver places it without knowing
// the sender's step list.
//
// Ranks beyond the largest power of two p <= N are folded in the standard way: among the first
// 2(N - p) ranks each even rank hands its data to the odd rank above it and waits for the
// result, so the core runs on p virtual ranks. Every element gets exactly one final reduction
// (where avg divides), and ranks reduce the same operands, so all ranks get identical bits for
// commutative ops (all of dear's ops are).
#pragma once

#include <cstddef>
#include <vector>

#include "collectives/ops.h"

namespace dear::collectives {

// Whether `s` is a log-step schedule (run from a StepPlan over the mesh links).
[[nodiscard]] bool is_log_step(Schedule s) noexcept;

// Whether `kind` can run `s` (log-step schedules only): all_reduce: kRecursiveDoubling,
// kHalvingDoubling and kTree; reduce_scatter: kHalvingDoubling; all_gather: kRecursiveDoubling
// and kHalvingDoubling; all_to_all: kPairwise and kScattered.
[[nodiscard]] bool log_step_supports(OpKind kind, Schedule s) noexcept;

// This rank's steps. `count` is the caller's count (per-rank block for reduce_scatter and
// all_gather), `el` the element size; `root` >= 0 makes an all_reduce a reduce, an all_gather
// a gather and a reduce_scatter a scatter (ops.h), which kTree runs as a binomial tree with
// the root on top (a power of two of ranks) or rooted at rank 0 with a path of the tree's edges
// between rank 0 and the root, and kScattered as one round between the root and every other
// rank (the other schedules run as without a root; kTree and kScattered are a reduce's, a
// gather's and a scatter's beyond log_step_supports(), and a scatter's only ones). Throws
// std::invalid_argument for an unsupported pair.
[[nodiscard]] StepPlan plan_steps(OpKind kind, Schedule s, int rank, int nranks, std::size_t count,
                                  std::size_t el, int root = -1);

// all_to_all_v's steps (kPairwise or kScattered), from this rank's layout: the messages of
// all_to_all's schedule with each peer's own size, empty ones included, so that a receiver
// that expects bytes from a peer with nothing to send hears so (a size mismatch is an error,
// never a wait).
[[nodiscard]] StepPlan plan_all_to_all_v(Schedule s, int rank, int nranks,
                                         const AllToAllLayout& layout);

// Every rank that some log-step schedule makes `rank` exchange with, ascending: all the others
// up to kFullMeshMaxRanks ranks (all_to_all's schedules), beyond that those of the tree, the
// fold and the core (2^k apart), where all_to_all cannot run. Symmetric: b is in
// step_peers(a) exactly when a is in step_peers(b).
inline constexpr int kFullMeshMaxRanks = 64;
[[nodiscard]] std::vector<int> step_peers(int rank, int nranks);

// What the cost model needs: the critical path's steps, its bytes on the wire (the larger of
// send and receive per step) and the bytes it reduces.
struct StepCost {
  int steps = 0;
  std::size_t wire_bytes = 0;
  std::size_t reduced_bytes = 0;
  std::size_t copied_bytes = 0;  // local copies: inputs, results, operands through staging
};
[[nodiscard]] StepCost step_cost(OpKind kind, Schedule s, int nranks, std::size_t count,
                                 std::size_t el);

}  // namespace dear::collectives
