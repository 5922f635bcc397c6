// dear-bench --calibrate: alpha and beta of one ring step, measured on the job's own ranks
// and transport, fitted by collectives::fit_alpha_beta.
//
// Each size is a ring all-gather of one block per rank: N-1 steps, each a message from every
// rank to its ring neighbour. Small blocks are the ping-pong part (a step is one neighbour
// hop, alpha dominates); large ones the streaming part (slices pipelined on the link, beta
// dominates). A step's time is the median over iterations of the whole operation divided by
// N-1, the slowest rank's. The local reduction rate is timed on each rank's own buffers.
// Then each all_reduce schedule this communicator runs (ring, gather_reduce, and the log-step
// ones where it has their links) is timed at several sizes, all schedules interleaved, and
// collectives::fit_schedule fits that schedule's alpha and bandwidth multiplier
// (CostModel::schedule_alpha_us, schedule_beta_scale). Where the fastest schedule changes
// between two of those sizes, a size in between is timed as well (collectives::refinement_sizes).
// Collective: every rank calls it, and every rank returns rank 0's fit.
#pragma once

#include <cstddef>
#include <cstdio>
#include <functional>
#include <vector>

#include "collectives/cost_model.h"
#include "dear/communicator.h"

namespace dear::bench {

struct CalibrateOptions {
  // Per-rank block sizes of the all-gathers; the defaults span 8 B to 4 MiB.
  std::vector<std::size_t> sizes{8, 64, 512, 4096, 32768, 262144, 1048576, 4194304};
  int warmup = 3;
  int min_iters = 5;
  double min_time_ms = 40;  // per size: more iterations where min_iters would take less
  // All_reduce sizes (bytes of the whole fp32 vector) at which each schedule is timed: 8 bytes
  // and even powers of two, so that a check over dear-bench's -b 8 -f 4 grid (odd powers)
  // measures sizes the model interpolates rather than ones it was fitted on.
  std::vector<std::size_t> schedule_sizes{8, 256, 4096, 65536, 262144, 1048576, 4194304, 16777216};
  int rounds = 8;  // interleaved_median_us: rounds over the candidates
  // Per schedule and size: the schedules come within a few percent of one another at large
  // sizes, so they get more time than the base fit's all-gathers.
  double schedule_min_time_ms = 100;
  // Sizes added where the fastest schedule changes between two neighbouring schedule_sizes
  // (collectives::refinement_sizes), at most this many.
  int max_refinements = 8;
};

// The calibration for operations up to `max_bytes`: schedule_sizes beyond the first one at or
// above it (and beyond the second, which a fit needs) are dropped (dear-bench --calibrate -e SIZE),
// so that a study of small messages does not wait for 16 MiB all_reduces.
[[nodiscard]] CalibrateOptions calibrate_up_to(CalibrateOptions opts, std::size_t max_bytes);

// Times several operations interleaved, so that a slow spell of a shared machine hits them
// alike: opts.rounds rounds, each running every candidate in turn (the order rotating from
// round to round) for its share of at least opts.min_iters and opts.min_time_ms. Returns, per
// candidate, the largest over ranks of each rank's median time of one run, in microseconds.
// Collective: every rank passes the same candidates in the same order.
[[nodiscard]] std::vector<double> interleaved_median_us(
    Communicator& comm, const CalibrateOptions& opts,
    const std::vector<std::function<void()>>& runs);

// The communicator must run ring all-gathers at every size: create it with
// gather_reduce_max_bytes = 0 and no cost model (calibration_options() does that).
[[nodiscard]] collectives::CostModel calibrate(Communicator& comm, const CalibrateOptions& opts);
[[nodiscard]] CommOptions calibration_options(CommOptions options);

// Rank 0 prints the points and the fit to `out`.
void print_calibration(std::FILE* out, const collectives::CostModel& m);

}  // namespace dear::bench
