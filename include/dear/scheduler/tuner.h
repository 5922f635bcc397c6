// Online tuning of DeAR's fusion threshold by Bayesian optimisation.
//
// DeAR fuses gradients into groups of at most a threshold of bytes (plan_threshold); the best
// threshold depends on the model, the worker count and the network, so the reference DeAR
// tunes it while training: run a few iterations at a threshold, measure, pick the next one.
// ThresholdTuner is that loop's brain. It never runs anything itself:
//
//   ThresholdTuner tuner;
//   while (!tuner.done()) {
//     const std::int64_t t = tuner.next();
//     tuner.report(t, measured_iteration_ms(t));
//   }
//   use(tuner.best());
//
// The search space is log2(threshold) over [min_bytes, max_bytes]. The first trials are fixed
// and spread out (both ends, then the geometric middle); after them a Gaussian process with a
// squared-exponential kernel over log2(threshold) and a noise term models the iteration time,
// its two hyperparameters (length scale and noise) chosen by marginal likelihood from a small
// fixed set, and the next threshold is the candidate of a fine log-spaced grid that maximises
// the expected improvement over the best predicted time so far.
//
// Contract:
// - next() and best() are pure functions of the options and the reports so far, in order: two
//   tuners fed the same values propose the same thresholds, on every rank and every run. A
//   distributed job stays consistent as long as every rank reports the same value (e.g. the
//   maximum over ranks of the measured time).
// - report() accepts any threshold in range, proposed or not, and the same threshold any
//   number of times (measurements are noisy; the model and best() average them).
// - next() keeps proposing after done(); done() only says that the budget is spent.
// - Invalid options or reports throw dear::Error(kInvalidArgument) naming the argument.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

namespace dear::scheduler {

struct TunerOptions {
  std::int64_t min_bytes = 1LL << 20;    // 1 MiB
  std::int64_t max_bytes = 256LL << 20;  // 256 MiB
  int trials = 10;                       // budget: done() once this many reports arrived
  // Fixed spread-out trials before the model takes over (1 to 3): min_bytes, max_bytes, then
  // middle_bytes.
  int initial_trials = 3;
  // The third fixed trial; 0 is the geometric middle of the range (16 MiB by default). A
  // caller that wants the tuned threshold never to measure worse than the one it would use
  // otherwise passes that one (e.g. kDefaultThresholdBytes). One at an end of the range (the
  // first two trials measure those) gives way to the geometric middle.
  std::int64_t middle_bytes = 0;
  int grid_per_octave = 16;  // candidate thresholds per doubling, rounded to whole KiB
  // Expected improvement asked for beyond the best prediction, in standard deviations of the
  // measured times: a little exploration, so that a flat model does not stall.
  double exploration = 0.01;
};

struct TunerTrial {
  std::int64_t threshold_bytes = 0;
  double iter_ms = 0;
};

class ThresholdTuner {
 public:
  explicit ThresholdTuner(TunerOptions options = {});

  // The threshold to measure next.
  [[nodiscard]] std::int64_t next() const;
  // One measurement: `iter_ms` (finite, > 0) is the iteration time at `threshold_bytes`.
  void report(std::int64_t threshold_bytes, double iter_ms);
  // Whether options.trials measurements have been reported.
  [[nodiscard]] bool done() const { return static_cast<int>(trials_.size()) >= options_.trials; }
  // The measured threshold with the lowest mean of its measurements (repeats are averaged;
  // of equal means, the one measured first); before any report, the middle trial. Not the model's
  // minimum: the model is smooth, while the true time steps wherever the threshold crosses a layer
  // boundary, so only measured times are trusted.
  [[nodiscard]] std::int64_t best() const;
  // The model's predicted iteration time at a threshold in range, in ms (before any report,
  // 0). Exposed for reports and tests.
  [[nodiscard]] double predict_ms(std::int64_t threshold_bytes) const;

  [[nodiscard]] const std::vector<TunerTrial>& trials() const { return trials_; }
  [[nodiscard]] const TunerOptions& options() const { return options_; }
  // The candidate thresholds next() chooses among (ascending, both ends included).
  [[nodiscard]] const std::vector<std::int64_t>& candidates() const { return grid_; }

 private:
  [[nodiscard]] std::int64_t middle() const;

  TunerOptions options_;
  std::vector<std::int64_t> grid_;
  std::vector<TunerTrial> trials_;
};

// The whole tuning loop, as dear-sim and dear-train run it: `measure` (the iteration time at a
// threshold, in ms; on several ranks it must return the same value everywhere) at every
// proposed threshold until the budget is spent, `on_trial` after each (may be empty), then
// the tuned threshold and `default_bytes` measured once more each.
struct TuneResult {
  std::int64_t threshold_bytes = 0;  // the tuned one
  double iter_ms = 0;
  std::int64_t default_bytes = 0;
  double default_ms = 0;
  std::vector<TunerTrial> trials;
};
[[nodiscard]] TuneResult tune_threshold(const TunerOptions& options, std::int64_t default_bytes,
                                        const std::function<double(std::int64_t)>& measure,
                                        const std::function<void(const TunerTrial&)>& on_trial);

}  // namespace dear::scheduler
