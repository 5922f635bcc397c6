// ThresholdTuner: Bayesian optimisation of the fusion threshold (see dear/scheduler/tuner.h).
//
// The surrogate is a textbook Gaussian process (Rasmussen & Williams, algorithm 2.1) on a
// handful of points, so a plain Cholesky factorisation is all the linear algebra it needs.
// Inputs are log2(threshold) scaled to [0, 1]; outputs are the measured times standardised
// (mean 0, standard deviation 1), which lets one fixed set of hyperparameters serve any model
// and network.
#include "dear/scheduler/tuner.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <numbers>
#include <string>
#include <utility>

#include "dear/error.h"

namespace dear::scheduler {
namespace {

[[noreturn]] void bad(const std::string& what) {
  throw Error(ErrorCode::kInvalidArgument, "ThresholdTuner: " + what);
}

// Length scales (in units of the whole log range: 0.1 of 1-256 MiB is 0.8 octaves) and noise
// variances (in units of the measured times' variance) that the marginal likelihood chooses
// among. Fixed and few, so the choice is cheap and deterministic.
constexpr double kLengthScales[] = {0.06, 0.1, 0.16, 0.25, 0.4, 0.6};
constexpr double kNoiseVariances[] = {1e-6, 1e-3, 1e-2, 0.05, 0.2};
constexpr double kJitter = 1e-10;

// Lower-triangular L with L L^T = a (n x n, row-major); false when a is not positive definite.
bool cholesky(std::vector<double>& a, std::size_t n) {
  for (std::size_t j = 0; j < n; ++j) {
    double d = a[j * n + j];
    for (std::size_t k = 0; k < j; ++k) d -= a[j * n + k] * a[j * n + k];
    if (!(d > 0)) return false;
    const double ljj = std::sqrt(d);
    a[j * n + j] = ljj;
    for (std::size_t i = j + 1; i < n; ++i) {
      double s = a[i * n + j];
      for (std::size_t k = 0; k < j; ++k) s -= a[i * n + k] * a[j * n + k];
      a[i * n + j] = s / ljj;
    }
    for (std::size_t k = j + 1; k < n; ++k) a[j * n + k] = 0;
  }
  return true;
}

// Solves L x = b in place (forward substitution).
void solve_lower(const std::vector<double>& l, std::size_t n, std::vector<double>& b) {
  for (std::size_t i = 0; i < n; ++i) {
    double s = b[i];
    for (std::size_t k = 0; k < i; ++k) s -= l[i * n + k] * b[k];
    b[i] = s / l[i * n + i];
  }
}

// Solves L^T x = b in place (backward substitution).
void solve_upper_t(const std::vector<double>& l, std::size_t n, std::vector<double>& b) {
  for (std::size_t i = n; i-- > 0;) {
    double s = b[i];
    for (std::size_t k = i + 1; k < n; ++k) s -= l[k * n + i] * b[k];
    b[i] = s / l[i * n + i];
  }
}

double kernel(double a, double b, double length) {
  const double d = (a - b) / length;
  return std::exp(-0.5 * d * d);
}

// A Gaussian process fitted to the reports, predicting in milliseconds.
class Surrogate {
 public:
  Surrogate(const std::vector<double>& x, const std::vector<double>& y_ms) : x_(x) {
    const std::size_t n = x.size();
    double sum = 0;
    for (double v : y_ms) sum += v;
    mean_ = sum / static_cast<double>(n);
    double var = 0;
    for (double v : y_ms) var += (v - mean_) * (v - mean_);
    scale_ = std::sqrt(var / static_cast<double>(n));
    if (!(scale_ > 1e-12 * std::abs(mean_))) scale_ = std::max(std::abs(mean_), 1.0);
    y_.resize(n);
    for (std::size_t i = 0; i < n; ++i) y_[i] = (y_ms[i] - mean_) / scale_;

    // Hyperparameters by log marginal likelihood: -y^T a / 2 - sum(log diag L) (constant
    // dropped). The first best in the fixed order wins ties.
    double best_lml = -std::numeric_limits<double>::infinity();
    for (double length : kLengthScales) {
      for (double noise : kNoiseVariances) {
        std::vector<double> l;
        std::vector<double> alpha;
        if (!factor(length, noise, l, alpha)) continue;
        double lml = 0;
        for (std::size_t i = 0; i < n; ++i) lml -= 0.5 * y_[i] * alpha[i] + std::log(l[i * n + i]);
        if (lml > best_lml) {
          best_lml = lml;
          length_ = length;
          l_ = std::move(l);
          alpha_ = std::move(alpha);
        }
      }
    }
    if (l_.empty()) {
      // Not reachable with the noise floor above, but keep a usable model: heavy noise.
      length_ = kLengthScales[0];
      factor(length_, 1.0, l_, alpha_);
    }
  }

  // Posterior mean and standard deviation of the noise-free time at x, standardised.
  void predict(double x, double& mean, double& sd) const {
    const std::size_t n = x_.size();
    std::vector<double> k(n);
    for (std::size_t i = 0; i < n; ++i) k[i] = kernel(x, x_[i], length_);
    mean = 0;
    for (std::size_t i = 0; i < n; ++i) mean += k[i] * alpha_[i];
    solve_lower(l_, n, k);
    double var = 1;
    for (double v : k) var -= v * v;
    sd = std::sqrt(std::max(var, 1e-12));
  }

  [[nodiscard]] double to_ms(double standardised) const { return mean_ + scale_ * standardised; }

 private:
  bool factor(double length, double noise, std::vector<double>& l,
              std::vector<double>& alpha) const {
    const std::size_t n = x_.size();
    l.assign(n * n, 0);
    for (std::size_t i = 0; i < n; ++i) {
      for (std::size_t j = 0; j < n; ++j) l[i * n + j] = kernel(x_[i], x_[j], length);
      l[i * n + i] += noise + kJitter;
    }
    if (!cholesky(l, n)) return false;
    alpha = y_;
    solve_lower(l, n, alpha);
    solve_upper_t(l, n, alpha);
    return true;
  }

  std::vector<double> x_;
  std::vector<double> y_;
  double mean_ = 0;
  double scale_ = 1;
  double length_ = 0;
  std::vector<double> l_;
  std::vector<double> alpha_;
};

double normal_pdf(double z) { return std::exp(-0.5 * z * z) / std::sqrt(2 * std::numbers::pi); }
double normal_cdf(double z) { return 0.5 * std::erfc(-z / std::numbers::sqrt2); }

// Where a threshold sits in the search space: 0 at min_bytes, 1 at max_bytes, linear in log2.
double position(std::int64_t bytes, const TunerOptions& o) {
  const double lo = std::log2(static_cast<double>(o.min_bytes));
  const double hi = std::log2(static_cast<double>(o.max_bytes));
  return (std::log2(static_cast<double>(bytes)) - lo) / (hi - lo);
}

Surrogate fit(const std::vector<TunerTrial>& trials, const TunerOptions& o) {
  std::vector<double> x;
  std::vector<double> y;
  for (const auto& t : trials) {
    x.push_back(position(t.threshold_bytes, o));
    y.push_back(t.iter_ms);
  }
  return Surrogate(x, y);
}

}  // namespace

ThresholdTuner::ThresholdTuner(TunerOptions options) : options_(options) {
  if (options_.min_bytes < 1) bad("options.min_bytes must be >= 1");
  if (options_.max_bytes <= options_.min_bytes) {
    bad("options.max_bytes must be greater than options.min_bytes");
  }
  if (options_.trials < 1) bad("options.trials must be >= 1");
  if (options_.initial_trials < 1 || options_.initial_trials > 3) {
    bad("options.initial_trials must be 1, 2 or 3");
  }
  if (options_.grid_per_octave < 1 || options_.grid_per_octave > 1024) {
    bad("options.grid_per_octave must be in [1, 1024]");
  }
  if (options_.middle_bytes != 0 &&
      (options_.middle_bytes < options_.min_bytes || options_.middle_bytes > options_.max_bytes)) {
    bad("options.middle_bytes must be 0 or in [options.min_bytes, options.max_bytes]");
  }
  if (!std::isfinite(options_.exploration) || options_.exploration < 0) {
    bad("options.exploration must be finite and >= 0");
  }
  // Log-spaced candidates, rounded to whole KiB where that stays in range; the ends exact.
  const double lo = std::log2(static_cast<double>(options_.min_bytes));
  const double hi = std::log2(static_cast<double>(options_.max_bytes));
  const auto steps = static_cast<int>(std::ceil((hi - lo) * options_.grid_per_octave - 1e-9));
  grid_.push_back(options_.min_bytes);
  for (int i = 1; i < steps; ++i) {
    const double bytes = std::exp2(lo + (hi - lo) * i / steps);
    auto t = static_cast<std::int64_t>(std::llround(bytes / 1024.0)) * 1024;
    if (t <= options_.min_bytes || t >= options_.max_bytes) t = std::llround(bytes);
    if (t > grid_.back() && t < options_.max_bytes) grid_.push_back(t);
  }
  grid_.push_back(options_.max_bytes);
}

void ThresholdTuner::report(std::int64_t threshold_bytes, double iter_ms) {
  if (threshold_bytes < options_.min_bytes || threshold_bytes > options_.max_bytes) {
    bad("threshold_bytes " + std::to_string(threshold_bytes) + " is outside [" +
        std::to_string(options_.min_bytes) + ", " + std::to_string(options_.max_bytes) + "]");
  }
  if (!std::isfinite(iter_ms) || iter_ms <= 0) {
    bad("iter_ms must be finite and > 0 (got " + std::to_string(iter_ms) + ")");
  }
  trials_.push_back({threshold_bytes, iter_ms});
}

std::int64_t ThresholdTuner::next() const {
  const std::size_t n = trials_.size();
  if (n < static_cast<std::size_t>(options_.initial_trials)) {
    if (n == 0) return grid_.front();
    if (n == 1) return grid_.back();
    return middle();
  }
  const Surrogate gp = fit(trials_, options_);
  // Plug-in expected improvement: the incumbent is the best predicted time at a measured
  // point, not the best single measurement, which noise flatters.
  double incumbent = std::numeric_limits<double>::infinity();
  for (const auto& t : trials_) {
    double m = 0;
    double sd = 0;
    gp.predict(position(t.threshold_bytes, options_), m, sd);
    incumbent = std::min(incumbent, m);
  }
  std::int64_t choice = grid_.front();
  double best_ei = -1;
  for (std::int64_t t : grid_) {
    double m = 0;
    double sd = 0;
    gp.predict(position(t, options_), m, sd);
    const double gain = incumbent - m - options_.exploration;
    const double z = gain / sd;
    const double ei = gain * normal_cdf(z) + sd * normal_pdf(z);
    if (ei > best_ei) {
      best_ei = ei;
      choice = t;
    }
  }
  return choice;
}

std::int64_t ThresholdTuner::best() const {
  if (trials_.empty()) return middle();
  std::map<std::int64_t, std::pair<double, int>> sums;  // threshold -> (sum of ms, count)
  for (const auto& t : trials_) {
    auto& s = sums[t.threshold_bytes];
    s.first += t.iter_ms;
    s.second += 1;
  }
  // In the order of first measurement, so that a tie keeps the earlier threshold (the fixed
  // first trials, e.g. a default the caller would otherwise use).
  std::int64_t choice = 0;
  double best_mean = std::numeric_limits<double>::infinity();
  for (const auto& t : trials_) {
    const auto& s = sums[t.threshold_bytes];
    const double mean = s.first / s.second;
    if (mean < best_mean) {
      best_mean = mean;
      choice = t.threshold_bytes;
    }
  }
  return choice;
}

std::int64_t ThresholdTuner::middle() const {
  // A caller's threshold at an end of the range was measured already by the first two trials.
  const std::int64_t m = options_.middle_bytes;
  if (m != 0 && m != grid_.front() && m != grid_.back()) return m;
  return grid_[grid_.size() / 2];  // the grid is log-spaced
}

double ThresholdTuner::predict_ms(std::int64_t threshold_bytes) const {
  if (threshold_bytes < options_.min_bytes || threshold_bytes > options_.max_bytes) {
    bad("threshold_bytes " + std::to_string(threshold_bytes) + " is outside the range");
  }
  if (trials_.empty()) return 0;
  const Surrogate gp = fit(trials_, options_);
  double m = 0;
  double sd = 0;
  gp.predict(position(threshold_bytes, options_), m, sd);
  return gp.to_ms(m);
}

TuneResult tune_threshold(const TunerOptions& options, std::int64_t default_bytes,
                          const std::function<double(std::int64_t)>& measure,
                          const std::function<void(const TunerTrial&)>& on_trial) {
  ThresholdTuner tuner(options);
  while (!tuner.done()) {
    const std::int64_t threshold = tuner.next();
    tuner.report(threshold, measure(threshold));
    if (on_trial) on_trial(tuner.trials().back());
  }
  TuneResult r;
  r.threshold_bytes = tuner.best();
  r.default_bytes = default_bytes;
  r.default_ms = measure(default_bytes);
  r.iter_ms = measure(r.threshold_bytes);
  r.trials = tuner.trials();
  return r;
}

}  // namespace dear::scheduler
