// Discrete-event simulation of training iterations on N data-parallel workers.
//
// Compute is one stream per worker (all workers identical): forward passes in layer order,
// backward passes in reverse, the policy's hooks in between. Communication runs on one
// representative ring link (the ring is symmetric) under the NetModel's alpha-beta costs:
// a step of an operation sends its chunk, then the next step may start alpha later.
//
// Two engines:
// - serial (EngineModel{}): one collective at a time holds the link from its first step to
//   its end, alpha gaps included, as NCCL or MPI run them on one stream. The next one is the
//   highest-priority, then earliest-issued, pending operation; with a credit, operations are
//   admitted in priority order while the bytes admitted and not finished fit the credit,
//   then run in admission order (ByteScheduler over an all-reduce engine).
// - interleaved (interleave = true): dear's engine. The link sends one slice at a time, each
//   time of the highest-priority operation whose current step may move, so the alpha gaps of
//   one operation carry the slices of others.
#pragma once

#include <cstdint>
#include <functional>
#include <iosfwd>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "dear/scheduler/fusion.h"
#include "dear/scheduler/model.h"
#include "dear/scheduler/network.h"
#include "dear/scheduler/policy.h"

namespace dear::scheduler {

struct EngineModel {
  bool interleave = false;
  std::int64_t credit_bytes = 0;  // serial engine only; 0 = no credit
};

// Which engine simulate_named() runs a policy on: the one the policy was designed for (NCCL-
// like serial for the baselines and DeAR, dear's interleaving engine for dear_prio and
// dear_plus), or one engine for all, e.g. interleaved to model runs on dear's own engine.
enum class EngineChoice : std::uint8_t { kPolicy, kSerial, kInterleaved };

struct SimConfig {
  NetModel net;
  int workers = 1;
  int iterations = 3;  // the last two steady iterations give the iteration time
  EngineChoice engine = EngineChoice::kPolicy;
  // Fusion threshold of the threshold-planned DeAR policies (dear, dear_prio, dear_eager,
  // dear_shard):
  // what the threshold tuner (tuner.h) varies.
  std::int64_t threshold_bytes = kDefaultThresholdBytes;
  // Optimizer cost on the compute stream, in microseconds per million parameters updated
  // (0: free, as before). It is charged where the policy's wait first sees the collective
  // that completes an update, as the replay applies SGD there: for the whole range of an
  // all-reduce or of a gradient all-gather (dear: the group, before its first layer's
  // forward pass; the all-reduce baselines: at the step, or before the layer's forward for
  // bytescheduler), and for one shard (padded / N elements, the busiest rank's) of a
  // reduce-scatter with carries_parameters (dear_shard: at the step). An all-gather that
  // carries parameters costs nothing.
  double optimizer_us_per_mparam = 0;
};

// kOptimizer: the optimizer on the compute stream (only when SimConfig charges for it).
enum class EventKind : std::uint8_t { kForward, kBackward, kComm, kOptimizer };

struct TraceEvent {
  EventKind kind = EventKind::kForward;
  OpKind op = OpKind::kAllReduce;  // for kComm
  int iteration = 0;
  int first_layer = 0;
  int last_layer = 0;
  int group = -1;
  int priority = 0;
  std::int64_t elements = 0;
  double issue_s = 0;  // kComm: when the policy issued it
  double start_s = 0;  // first byte on the link (compute: start)
  double end_s = 0;    // last byte delivered
};

struct SimResult {
  double iteration_s = 0;
  std::vector<double> step_s;  // time of each iteration's step hook
  std::vector<TraceEvent> events;
};

[[nodiscard]] SimResult simulate(const Model& model, Policy& policy, const SimConfig& config,
                                 const EngineModel& engine = {});

// Lower bound on the iteration time of any policy: the largest of (compute + the all-reduce
// of layer 0, which can overlap nothing: its gradient is the last one produced and the first
// one needed), (compute + the optimizer on 1/N of the parameters, the least any rank can
// update on its compute stream) and the bandwidth term of all-reducing every gradient once.
[[nodiscard]] double ideal_bound_s(const Model& model, const SimConfig& config);

// Chrome trace (chrome://tracing, Perfetto) of a run: compute on one track, collectives on
// as many tracks as overlap.
void write_chrome_trace(const SimResult& result, const Model& model, std::ostream& out);

// The automatic fusion planner. Candidates: the plan that minimises the finish time of the
// reduce-scatters behind backpropagation (dynamic programming over group boundaries, exact
// for one-at-a-time operations), one group per layer, threshold plans from 1 to 256 MiB, and
// the same thresholds with a small group 0 or groups growing geometrically from the input;
// each is scored by `score` (e.g. a simulated iteration time), and the best is refined by
// refine_plan() with kRefineBudget scores.
[[nodiscard]] FusionPlan plan_rs_dp(const Model& model, const SimConfig& config);
[[nodiscard]] FusionPlan plan_auto(const Model& model, const SimConfig& config,
                                   const std::function<double(const FusionPlan&)>& score);

// Local search over group boundaries from `plan`, whose score is `plan_score`: it moves one
// boundary by 1, 2, 4, ... layers either way, drops one (merging two groups) or splits a
// group where its parameters pass half, keeps the first change that scores lower, and starts
// over, until no change does or `score` has been called `budget` times. Returns the plan
// with the lowest score seen (`plan` itself when nothing scored lower).
inline constexpr int kRefineBudget = 4000;
[[nodiscard]] FusionPlan refine_plan(const Model& model, int ranks, FusionPlan plan,
                                     double plan_score,
                                     const std::function<double(const FusionPlan&)>& score,
                                     int budget);

// Named policies as dear-sim runs them: dear dear_notf dear_prio dear_eager dear_shard
// dear_auto dear_plus wfbp ddp bytescheduler mgwfbp. dear_shard is dear with the sharded
// optimizer step (DearOptions::shard_optimizer) on the same plan and engine.
[[nodiscard]] const std::vector<std::string>& policy_names();
// Throws dear::Error(kInvalidArgument) for an unknown name.
[[nodiscard]] SimResult simulate_named(const Model& model, std::string_view name,
                                       const SimConfig& config);

// A named policy ready to run: the policy, the engine it was designed for, and its fusion plan
// (empty for the all-reduce policies). Planning uses config.net and config.workers (mgwfbp,
// dear_auto, dear_plus), so ranks that pass the same config get the same plan.
struct NamedPolicy {
  std::unique_ptr<Policy> policy;
  EngineModel engine;
  FusionPlan plan;
};
[[nodiscard]] NamedPolicy make_named_policy(const Model& model, std::string_view name,
                                            const SimConfig& config);

}  // namespace dear::scheduler
