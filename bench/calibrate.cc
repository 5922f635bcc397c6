#include "calibrate.h"

#include <algorithm>
#include <chrono>
#include <vector>

#include "collectives/reduce.h"
#include "common/stats.h"
#include "dear/error.h"

namespace dear::bench {
namespace {

using Clock = std::chrono::steady_clock;

double us_since(Clock::time_point t0) {
  return std::chrono::duration<double, std::micro>(Clock::now() - t0).count();
}

double max_over_ranks(Communicator& comm, double v) {
  comm.all_reduce(&v, &v, 1, DataType::kFloat64, ReduceOp::kMax).wait();
  return v;
}

// Median time of `run` alone: interleaved_median_us with one candidate and one round.
double median_us(Communicator& comm, CalibrateOptions opts, const std::function<void()>& run) {
  opts.rounds = 1;
  return interleaved_median_us(comm, opts, {run})[0];
}

}  // namespace

std::vector<double> interleaved_median_us(Communicator& comm, const CalibrateOptions& opts,
                                          const std::vector<std::function<void()>>& runs) {
  // Iterations per candidate from its warm-up, the slowest rank's, so every rank agrees.
  std::vector<int> per_round;
  const int rounds = std::max(opts.rounds, 1);
  for (const auto& run : runs) {
    const auto warm = Clock::now();
    for (int i = 0; i < opts.warmup; ++i) run();
    const double per_iter = max_over_ranks(comm, us_since(warm) / std::max(opts.warmup, 1));
    const int iters = std::clamp(
        static_cast<int>(opts.min_time_ms * 1000 / std::max(per_iter, 0.01)), opts.min_iters, 5000);
    per_round.push_back((iters + rounds - 1) / rounds);
  }
  std::vector<std::vector<double>> times(runs.size());
  comm.barrier().wait();
  for (int r = 0; r < rounds; ++r) {
    for (std::size_t k = 0; k < runs.size(); ++k) {
      const std::size_t c = (k + static_cast<std::size_t>(r)) % runs.size();
      for (int i = 0; i < per_round[c]; ++i) {
        const auto t0 = Clock::now();
        runs[c]();
        times[c].push_back(us_since(t0));
      }
    }
  }
  std::vector<double> result;
  for (auto& t : times) result.push_back(max_over_ranks(comm, median(std::move(t))));
  return result;
}

CalibrateOptions calibrate_up_to(CalibrateOptions opts, std::size_t max_bytes) {
  auto& sizes = opts.schedule_sizes;
  std::sort(sizes.begin(), sizes.end());
  // At least two sizes: a schedule's fit has two unknowns.
  const auto first_above = std::lower_bound(sizes.begin(), sizes.end(), max_bytes);
  const auto keep_end = std::max(
      first_above + 1,
      sizes.begin() + std::min<std::ptrdiff_t>(2, static_cast<std::ptrdiff_t>(sizes.size())));
  if (keep_end < sizes.end()) sizes.erase(keep_end, sizes.end());
  return opts;
}

CommOptions calibration_options(CommOptions options) {
  options.gather_reduce_max_bytes = 0;  // ring all-gathers at every size
  options.halving_max_bytes = 0;
  options.cost_model_file.clear();
  options.alpha_us = 0;
  options.beta_us_per_byte = 0;
  options.reduce_us_per_byte = 0;
  options.algorithm = Algorithm::kAuto;
  return options;
}

collectives::CostModel calibrate(Communicator& comm, const CalibrateOptions& opts) {
  const int n = comm.size();
  if (n < 2) {
    throw Error(ErrorCode::kInvalidArgument,
                "--calibrate needs at least 2 ranks, got " + std::to_string(n), comm.rank());
  }
  collectives::CostModel m;
  m.transport = comm.options().transport;
  m.ranks = n;
  m.slice_bytes = comm.options().slice_bytes;
  collectives::ModelGeometry g;
  g.nranks = n;
  g.channels = comm.options().channels;
  g.slice_bytes = comm.options().slice_bytes;
  const auto nz = static_cast<std::size_t>(n);
  const std::size_t largest = *std::max_element(opts.sizes.begin(), opts.sizes.end());
  std::vector<char> out(largest * nz, 1);
  OpOptions ring;
  ring.algorithm = Algorithm::kRing;
  for (const std::size_t bytes : opts.sizes) {
    char* mine = out.data() + static_cast<std::size_t>(comm.rank()) * bytes;
    const double t = median_us(comm, opts, [&] {
      comm.all_gather(mine, out.data(), bytes, DataType::kUint8, ring).wait();
    });
    collectives::CalibrationPoint p;
    p.bytes = static_cast<double>(bytes);
    p.slices = collectives::slices_for(bytes, 1, g);
    p.step_us = t / (n - 1);
    m.points.push_back(p);
  }
  collectives::fit_alpha_beta(m);

  // Local reduction: fp32 sum of 1 MiB operands, while the other ranks do the same (as they
  // would in a collective on a shared host).
  constexpr std::size_t kElems = 256 * 1024;
  std::vector<float> a(kElems, 1.0F);
  std::vector<float> b(kElems, 2.0F);
  std::vector<float> c(kElems);
  const double reduce_us = median_us(comm, opts, [&] {
    collectives::reduce(c.data(), a.data(), b.data(), kElems, DataType::kFloat32, ReduceOp::kSum);
  });
  m.reduce_us_per_byte = reduce_us / static_cast<double>(kElems * sizeof(float));

  // Each schedule's alpha and bandwidth multiplier, from all_reduces of it at several sizes,
  // the schedules interleaved at each size. A schedule this communicator cannot run (the
  // log-step ones without their links) is refused on every rank alike, at submission, and
  // keeps no entry.
  constexpr std::pair<Algorithm, collectives::Schedule> kSchedules[] = {
      {Algorithm::kRing, collectives::Schedule::kRing},
      {Algorithm::kGatherReduce, collectives::Schedule::kGatherReduce},
      {Algorithm::kRecursiveDoubling, collectives::Schedule::kRecursiveDoubling},
      {Algorithm::kHalvingDoubling, collectives::Schedule::kHalvingDoubling},
      {Algorithm::kTree, collectives::Schedule::kTree},
  };
  const std::size_t biggest =
      *std::max_element(opts.schedule_sizes.begin(), opts.schedule_sizes.end()) / sizeof(float);
  std::vector<float> vec(std::max<std::size_t>(biggest, 1), 1.0F);
  std::vector<std::pair<Algorithm, collectives::Schedule>> runnable;
  for (const auto& [algo, schedule] : kSchedules) {
    OpOptions o;
    o.algorithm = algo;
    try {
      comm.all_reduce(vec.data(), vec.data(), 1, DataType::kFloat32, ReduceOp::kSum, o).wait();
      runnable.emplace_back(algo, schedule);
    } catch (const Error& e) {
      if (e.code() != ErrorCode::kInvalidArgument) throw;
    }
  }
  // samples[s][k]: schedule s at the k-th size timed; every rank holds the same maxima, so
  // every rank makes the same choices from them below.
  std::vector<std::vector<collectives::ScheduleSample>> samples(runnable.size());
  const auto sample_at = [&](std::size_t bytes) {
    const std::size_t count = std::max<std::size_t>(bytes / sizeof(float), 1);
    std::vector<std::function<void()>> runs;
    for (const auto& [algo, schedule] : runnable) {
      OpOptions o;
      o.algorithm = algo;
      runs.emplace_back([&comm, &vec, count, o] {
        comm.all_reduce(vec.data(), vec.data(), count, DataType::kFloat32, ReduceOp::kSum, o)
            .wait();
      });
    }
    CalibrateOptions timing = opts;
    timing.min_time_ms = opts.schedule_min_time_ms;
    const std::vector<double> t = interleaved_median_us(comm, timing, runs);
    for (std::size_t s = 0; s < runnable.size(); ++s) {
      collectives::ScheduleSample sample;
      sample.bytes = static_cast<double>(count * sizeof(float));
      sample.measured_us = t[s];
      samples[s].push_back(sample);
    }
  };
  std::vector<std::size_t> sizes = opts.schedule_sizes;
  std::sort(sizes.begin(), sizes.end());
  for (const std::size_t bytes : sizes) sample_at(bytes);
  for (const std::size_t bytes :
       collectives::refinement_sizes(sizes, samples, opts.max_refinements)) {
    sample_at(bytes);
  }

  // Every rank uses rank 0's base fit (they agree already: the times are maxima over ranks).
  std::vector<double> fit{m.alpha_us, m.beta_us_per_byte, m.reduce_us_per_byte};
  comm.broadcast(fit.data(), fit.data(), fit.size(), DataType::kFloat64, 0).wait();
  m.alpha_us = fit[0];
  m.beta_us_per_byte = fit[1];
  m.reduce_us_per_byte = fit[2];
  for (std::size_t s = 0; s < runnable.size(); ++s) {
    (void)collectives::fit_schedule(m, runnable[s].second, std::move(samples[s]), sizeof(float), g);
  }
  return m;
}

void print_calibration(std::FILE* out, const collectives::CostModel& m) {
  std::fprintf(out, "# calibration: %s, %d ranks, slice %zu bytes\n", m.transport.c_str(), m.ranks,
               m.slice_bytes);
  std::fprintf(out, "# %12s %7s %12s %12s %9s\n", "step_bytes", "slices", "measured_us", "model_us",
               "rel_err");
  for (const auto& p : m.points) {
    std::fprintf(out, "  %12.0f %7d %12.2f %12.2f %8.1f%%\n", p.bytes, p.slices, p.step_us,
                 p.model_us, 100 * p.rel_error);
  }
  std::fprintf(out,
               "# alpha = %.2f us per step, beta = %.3g us/byte (%.2f GB/s), reduction "
               "%.3g us/byte (%.2f GB/s)\n",
               m.alpha_us, m.beta_us_per_byte,
               m.beta_us_per_byte > 0 ? 1e-3 / m.beta_us_per_byte : 0.0, m.reduce_us_per_byte,
               m.reduce_us_per_byte > 0 ? 1e-3 / m.reduce_us_per_byte : 0.0);
  for (const auto& [name, samples] : m.schedule_samples) {
    const auto a = m.schedule_alpha_us.find(name);
    const auto k = m.schedule_beta_scale.find(name);
    std::fprintf(out,
                 "# all_reduce %s: alpha %.2f us per step, bandwidth x%.2f (the line; the model "
                 "follows the samples' measured/line between sizes)\n",
                 name.c_str(), a == m.schedule_alpha_us.end() ? 0.0 : a->second,
                 k == m.schedule_beta_scale.end() ? 1.0 : k->second);
    for (const auto& s : samples) {
      std::fprintf(out, "  %12.0f bytes %12.2f us measured %12.2f us line %8.1f%%\n", s.bytes,
                   s.measured_us, s.model_us, 100 * s.rel_error);
    }
  }
  std::fprintf(
      out, "# fit error: median %.1f%%, max %.1f%%\n", 100 * m.median_rel_error,
      100 * std::max_element(m.points.begin(), m.points.end(), [](const auto& x, const auto& y) {
              return x.rel_error < y.rel_error;
            })->rel_error);
}

}  // namespace dear::bench
