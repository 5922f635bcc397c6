// The alpha-beta cost model: predicted times of dear's schedules, the fit that calibrates it,
// and the choice Algorithm::kAuto makes from it.
//
// Contract
// - Pure functions of their arguments: no engine, no communicator, no clock. Every rank that
//   holds the same model computes the same predictions, so ranks agree on the schedule (the
//   schedule is part of what they must agree on; see ops.h).
// - The step cost follows what plan() and chunk_sent() in ops.cc send. A ring step moves one
//   chunk per direction, split over the channels and, within a channel, into `slices`
//   messages; messages of one channel are sent one after another and every link is busy from
//   the first step on (each rank starts with its own data), so a schedule of `steps` steps
//   costs steps * (slices * alpha + chunk_bytes * beta). Schedules that send in both ring
//   directions at once overlap their alphas but share the rank's egress (the NIC, or on
//   loopback the CPU that copies), so their bytes add up while their latency does not.
// - Local reductions (ring: as slices arrive; gather_reduce: N-1 whole inputs at the end) cost
//   reduce_us_per_byte per byte of the reduced operand.
#pragma once

#include <cstddef>
#include <map>
#include <string>
#include <vector>

#include "collectives/ops.h"
#include "dear/communicator.h"

namespace dear::collectives {

// One calibration sample: the time of one ring step moving `bytes` in `slices` messages.
struct CalibrationPoint {
  double bytes = 0;
  int slices = 1;
  double step_us = 0;    // measured
  double model_us = 0;   // the fit's prediction (filled by fit_alpha_beta)
  double rel_error = 0;  // |model - measured| / measured (filled by fit_alpha_beta)
};

// One sample of a schedule's calibration: an all_reduce of `bytes` run with that schedule.
struct ScheduleSample {
  double bytes = 0;
  double measured_us = 0;
  double model_us = 0;   // filled by fit_schedule
  double rel_error = 0;  // |model - measured| / measured (filled by fit_schedule)
};

struct CostModel {
  double alpha_us = 0;            // per message: software + wire latency of one ring step
  double beta_us_per_byte = 0;    // per byte through one rank's egress
  double reduce_us_per_byte = 0;  // local reduction, per byte of one operand
  // Per-schedule latency of one step, by schedule name (to_string(Schedule)), measured from
  // the 8-byte all_reduce of each schedule on the calibrated ranks (NCCL's tuning model keeps
  // a base latency per algorithm for the same reason): how many ranks are busy at once, and
  // with how many peers, differs between schedules, and on a host with fewer cores than ranks
  // that decides a step's cost. A schedule without an entry uses alpha_us; all_gather's
  // bi_gather uses gather_reduce's.
  std::map<std::string, double> schedule_alpha_us;
  // Per-schedule multiplier of the bandwidth part of a prediction (wire bytes, local
  // reductions and copies), fitted together with that schedule's alpha from all_reduces of it
  // at several sizes (fit_schedule): on a host with fewer cores than ranks, how many ranks copy
  // and reduce at once, and whether their sends wait for one another, differs between
  // schedules, as NCCL's tuning model keeps a bandwidth per algorithm. A schedule without an
  // entry uses 1; all_gather's bi_gather uses gather_reduce's.
  std::map<std::string, double> schedule_beta_scale;
  // The samples behind those fits, by schedule name, in ascending size. They also correct the
  // fitted line by size (size_correction): per byte, a message that fits in the caches costs
  // less than one that streams through memory, which one line cannot follow from 8 bytes to
  // tens of MiB.
  std::map<std::string, std::vector<ScheduleSample>> schedule_samples;
  // kAuto keeps the ring unless another schedule is predicted faster by more than this
  // fraction: where the schedules come within the calibration's own noise of one another
  // (large sizes, all bandwidth-bound), the ring, which pipelines its slices and needs no
  // staging memory, is the safer choice.
  double ring_margin = 0.10;
  // Where it was measured (informational; the model is used for any rank count).
  std::string transport;
  int ranks = 0;
  std::size_t slice_bytes = 0;
  std::vector<CalibrationPoint> points;
  double median_rel_error = 0;
};

// The geometry plan() uses to split a chunk; defaults as CommOptions'.
struct ModelGeometry {
  int nranks = 2;
  int channels = 1;
  std::size_t slice_bytes = 512 * 1024;
  std::size_t min_channel_bytes = 64 * 1024;  // SliceGeometryOptions::min_channel_bytes
  // Whether the log-step schedules (steps.h) can run: the communicator has its mesh links.
  bool log_steps = false;
};

// Messages per channel per step for a chunk of `chunk_bytes`, as plan() splits it (el: element
// size, so that rounding matches).
[[nodiscard]] int slices_for(std::size_t chunk_bytes, std::size_t el, const ModelGeometry& g);

// The shape of a schedule: steps per direction and bytes per step.
struct SchedulePlan {
  int forward_steps = 0;
  int backward_steps = 0;
  std::size_t chunk_bytes = 0;    // bytes a step moves in one direction
  int slices = 1;                 // messages per channel per step
  std::size_t reduced_bytes = 0;  // bytes of operand reduced locally on each rank
  std::size_t copied_bytes = 0;   // bytes copied locally (own block) before the first step
};

// kind: kAllReduce (kRing, kGatherReduce), kReduceScatter (kRing), kAllGather (kRing,
// kBiGather), kBroadcast (kChain), kBarrier (kBiGather). `bytes` is the caller's per-rank
// buffer: count * element size (all_reduce, broadcast: the whole vector; reduce_scatter: the
// output block; all_gather: the input block). Throws std::invalid_argument for a kind/schedule
// pair that dear does not run.
[[nodiscard]] SchedulePlan schedule_plan(OpKind kind, Schedule schedule, std::size_t bytes,
                                         std::size_t el, const ModelGeometry& g);

// The latency per step the model uses for `schedule` (see CostModel::schedule_alpha_us).
[[nodiscard]] double step_alpha_us(const CostModel& m, Schedule schedule);
// The multiplier of the bandwidth part for `schedule` (see CostModel::schedule_beta_scale).
[[nodiscard]] double beta_scale(const CostModel& m, Schedule schedule);

// Steps on the critical path of an operation of `bytes` (as predict_us counts them): what a
// per-schedule alpha is measured against.
[[nodiscard]] int latency_steps(OpKind kind, Schedule schedule, std::size_t bytes, std::size_t el,
                                const ModelGeometry& g);

// The factor by which measurement differed from the fitted line of `schedule` (a sample's
// measured_us / model_us) at the operation's total bytes (the whole vector of an all_reduce;
// block x ranks for reduce_scatter and all_gather), interpolated linearly in log2(bytes)
// between the schedule's samples and held at the end ones beyond them; 1 without samples.
[[nodiscard]] double size_correction(const CostModel& m, Schedule schedule, double total_bytes);

// Predicted time in microseconds: (latency_steps * step_alpha_us + beta_scale * the bandwidth
// part) * size_correction. Log-step schedules (steps.h) cost, along their critical path, alpha per
// step, beta per byte of the larger of a step's send and receive, and reduce_us_per_byte per byte
// reduced or copied locally.
[[nodiscard]] double predict_us(const CostModel& m, OpKind kind, Schedule schedule,
                                std::size_t bytes, std::size_t el, const ModelGeometry& g);
// The bandwidth part alone, before beta_scale: what predict_us adds to the latency steps.
[[nodiscard]] double bandwidth_us(const CostModel& m, OpKind kind, Schedule schedule,
                                  std::size_t bytes, std::size_t el, const ModelGeometry& g);

// The schedule an all_reduce, reduce_scatter or all_gather runs. `requested` is the caller's
// choice (OpOptions over CommOptions). Forced choices are honoured (kRing -> ring;
// kGatherReduce -> gather_reduce for all_reduce; the log-step algorithms -> their schedule,
// when g.log_steps and the kind supports it; the caller rejects the other pairs). kAuto, and
// kGatherReduce for all_gather: with a model, the candidate with the lowest predicted time,
// unless the ring's is within model->ring_margin of it (then the ring); without one (model ==
// nullptr), a threshold: the small schedule while the operation's total bytes are <=
// threshold_bytes (with log steps from 3 ranks on, the tree for all_reduce, recursive doubling
// for all_gather and halving for reduce_scatter; otherwise gather_reduce for
// all_reduce, the ring's two-way gather for all_gather, the ring for reduce_scatter), then, from
// 4 ranks on with log steps, halving + doubling for all_reduce and recursive doubling for
// all_gather while they are <= medium_bytes, halving for reduce_scatter while it is <=
// medium_bytes / 4, the ring above.
[[nodiscard]] Schedule select_schedule(OpKind kind, Algorithm requested, std::size_t bytes,
                                       std::size_t el, const ModelGeometry& g,
                                       const CostModel* model, std::size_t threshold_bytes,
                                       std::size_t medium_bytes = 0);

// Least-squares fit of step_us = alpha * slices + beta * bytes, weighted by 1/step_us^2 so
// that every point counts by its relative error (small steps are not drowned by large ones).
// Fills alpha_us, beta_us_per_byte, each point's model_us and rel_error, and
// median_rel_error. Throws std::invalid_argument with fewer than two distinct points or a
// non-positive time.
void fit_alpha_beta(CostModel& m);

// Where a calibration should time the schedules again after timing them at `sizes` (sorted;
// samples[s][k] is schedule s at sizes[k]): between two neighbouring sizes at least a factor
// 4 apart whose measured fastest schedules differ, the power of two nearest their geometric
// midpoint; at most max_refinements of them, smallest first.
[[nodiscard]] std::vector<std::size_t> refinement_sizes(
    const std::vector<std::size_t>& sizes, const std::vector<std::vector<ScheduleSample>>& samples,
    int max_refinements);

// Fits `schedule`'s alpha and bandwidth multiplier to all_reduces of it (elements of `el`
// bytes) measured at several sizes on g.nranks ranks: measured = alpha * latency_steps +
// scale * bandwidth_us, least squares weighted by relative error, both non-negative, with the
// base alpha/beta/reduction rates of `m` held fixed. Stores alpha, scale and the samples (with
// their predictions) in `m`, and returns the samples' median relative error. Throws
// std::invalid_argument with fewer than two sizes or a non-positive time.
double fit_schedule(CostModel& m, Schedule schedule, std::vector<ScheduleSample> samples,
                    std::size_t el, const ModelGeometry& g);

// JSON text of a model, and back. parse_cost_model throws dear::Error(kInvalidArgument) whose
// message names `source` (a file name) and the field that is missing or malformed.
[[nodiscard]] std::string to_json_text(const CostModel& m);
[[nodiscard]] CostModel parse_cost_model(const std::string& text, const std::string& source);
// Reads and parses a file; errors name the file.
[[nodiscard]] CostModel load_cost_model(const std::string& path);

}  // namespace dear::collectives
