// dear-bench --calibrate: alpha and beta of one ring step, measured on the job's own ranks
// and transport, fitted by collectives::fit_alpha_beta.
//
// Each size is a ring all-gather of one block per rank: N-1 steps, each a message from every
// rank to its ring neighbour. Small blocks are the ping-pong part (a step is one neighbour
// hop, alpha dominates); large ones the streaming part (slices pipelined on the link, beta
// dominates). A step's time is the median over iterations of the whole operation divided by
// N-1, the slowest rank's. The local reduction rate is timed on each rank's own buffers.
// Then each all_reduce schedule this communicator runs (ring, gather_reduce, and the log-step
// ones where it has their links) is timed on 8 bytes: its time over its latency steps is that
// schedule's alpha (CostModel::schedule_alpha_us).
// Collective: every rank calls it, and every rank returns rank 0's fit.
#pragma once

#include <cstddef>
#include <cstdio>
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
};

// The communicator must run ring all-gathers at every size: create it with
// gather_reduce_max_bytes = 0 and no cost model (calibration_options() does that).
[[nodiscard]] collectives::CostModel calibrate(Communicator& comm, const CalibrateOptions& opts);
[[nodiscard]] CommOptions calibration_options(CommOptions options);

// Rank 0 prints the points and the fit to `out`.
void print_calibration(std::FILE* out, const collectives::CostModel& m);

}  // namespace dear::bench
