// Profile replay: real training iterations of a model profile on a dear::Communicator.
//
// Every rank runs the same loop: forward passes in layer order and backward passes in
// reverse, each replayed from the profile's times (sleeping, or busy on the CPU), the policy's
// hooks in between, and the policy's collectives issued for real (CommBackend) on real
// buffers. Gradients are synthetic but depend on the parameters, as real ones do:
//
//   g[i] = kGradientSlope * p[i] + noise(i, iteration, rank)
//   noise(i, k, r) = (((i + 13 k + 29 r) mod 61) - 30) / 64
//
// where i is the element's index in the flat forward-order layout (layer_offsets()), p[i] the
// parameter as the layer's forward pass saw it, and k counts iterations from 0. Plain SGD,
// p[i] -= learning_rate * average over ranks of g[i], is applied to each range of parameters
// when the policy waits for its averaged gradients (the all-gather or all-reduce that
// carries them): exactly where the policy says. With the sharded optimizer step (dear_shard,
// CommRequest::carries_parameters) each rank applies it to its own shard of a fusion group
// when the policy waits for the group's reduce-scatter (the shard is that reduce-scatter's
// output block: rank r's is block r of the group's buffer, padded to a multiple of the rank
// count; padding elements update nothing), and the all-gather then carries the updated
// parameters in place: the replay keeps the parameters in the gradients' padded layout, so
// no copy is made. A forward pass that would use parameters missing an update is an error, so
// a policy that lets compute overtake its collectives fails loudly instead of timing well.
//
// Parameters start at initial_param(i) on every rank (as after a broadcast).
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "dear/communicator.h"
#include "dear/scheduler/model.h"
#include "dear/scheduler/network.h"
#include "dear/scheduler/simulator.h"

namespace dear::scheduler {

enum class ComputeMode : std::uint8_t {
  kSleep,  // the compute thread sleeps for the layer's time (an accelerator computing)
  kBusy,   // it runs calibrated arithmetic for that time (a CPU computing; slows under load)
  kNone,   // no compute at all: communication and bookkeeping only
};

inline constexpr float kGradientSlope = 0.25F;

[[nodiscard]] float initial_param(std::int64_t i);
[[nodiscard]] float gradient_noise(std::int64_t i, int iteration, int rank);

struct ReplayOptions {
  int warmup = 2;       // iterations run before timing starts (>= 1)
  int iterations = 10;  // timed iterations (>= 1)
  ComputeMode compute = ComputeMode::kSleep;
  float learning_rate = 0.05F;
  // Fusion threshold of dear, dear_prio, dear_eager and dear_shard
  // (SimConfig::threshold_bytes); the same on every rank.
  std::int64_t threshold_bytes = kDefaultThresholdBytes;
  // The network model the planning policies use (mgwfbp, dear_auto, dear_plus). All ranks
  // must pass the same one, so that they plan the same collectives.
  NetModel net;
  Algorithm algorithm = Algorithm::kAuto;  // for the all-reduces
  bool record_trace = false;               // fill ReplayResult::trace
  // Called on the compute thread after every iteration: (done, total, that iteration's s).
  std::function<void(int, int, double)> progress;
};

struct ReplayResult {
  std::string policy;
  std::vector<double> iteration_s;  // the timed iterations, step to step
  double mean_s = 0;
  double p50_s = 0;
  double samples_per_s = 0;  // ranks * batch size / mean
  // Per timed iteration, averaged: time the compute thread spent in the policy's hooks
  // (issuing, waiting for collectives, applying SGD), making synthetic gradients, and
  // applying SGD alone (for dear_shard: to this rank's shards only).
  double hooks_s = 0;
  double gradient_s = 0;
  double optimizer_s = 0;
  int late_priority_changes = 0;  // see CommBackend
  std::vector<float> params;      // after warmup + iterations updates, flat forward order
  SimResult trace;                // with record_trace: compute spans and collectives
};

// Runs warmup + iterations training iterations of `policy` (a name from policy_names()) and
// then lets the last update land. Collective: every rank of `comm` calls it with the same
// arguments. Throws dear::Error on a communication failure or a broken ordering.
[[nodiscard]] ReplayResult replay(Communicator& comm, const Model& model, std::string_view policy,
                                  const ReplayOptions& options);

// Fits the network model of one ring step on `comm`. beta: the slope between timed
// reduce-scatters and all-gathers (median of `repeats` timings each) of 16 KiB and 1 MiB per
// step. alpha and op_overhead_s: from one-element ring operations (medians of 4 x `repeats`),
// an all_reduce taking overhead + 2(N-1) alpha and an all_gather overhead + (N-1) alpha.
// wake_s: the per-operation period of 32 all-gathers of 16 KiB per step, each issued when the
// previous one's wait returned (median of `repeats` chains), beyond the same all-gather's time
// alone. gap_s is set to alpha (on loopback the whole step latency is CPU work). Returns rank
// 0's fit on every rank. Collective.
[[nodiscard]] NetModel calibrate_network(Communicator& comm, int repeats = 7);

}  // namespace dear::scheduler
