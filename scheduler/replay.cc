#include "dear/scheduler/replay.h"

#include <sys/prctl.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <memory>
#include <string>
#include <thread>
#include <utility>

#include "common/stats.h"
#include "dear/error.h"
#include "dear/scheduler/comm_backend.h"

namespace dear::scheduler {
namespace {

using Clock = std::chrono::steady_clock;

double seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

// Arithmetic whose speed on an idle core is measured once; under load it slows down, as CPU
// compute would.
class BusyWork {
 public:
  static void run(double s) {
    if (s <= 0) return;
    static const double rate = calibrate();
    spin(static_cast<std::int64_t>(s * rate));
  }

 private:
  static double spin(std::int64_t n) {
    double x = 1.0;
    for (std::int64_t i = 0; i < n; ++i) x = x * 0.999999 + 1e-6;
    volatile double sink = x;  // keeps the loop
    return sink;
  }
  static double calibrate() {
    constexpr std::int64_t kProbe = 2'000'000;
    double best = 1e9;
    for (int i = 0; i < 3; ++i) {
      const auto t0 = Clock::now();
      spin(kProbe);
      best = std::min(best, seconds(Clock::now() - t0));
    }
    return static_cast<double>(kProbe) / std::max(best, 1e-9);
  }
};

// The noise pattern repeats every 61 elements; (j - 30) / 64 is exact in fp32.
constexpr int kNoisePeriod = 61;

std::array<float, kNoisePeriod> noise_table() {
  std::array<float, kNoisePeriod> t{};
  for (int j = 0; j < kNoisePeriod; ++j) t[static_cast<std::size_t>(j)] = (j - 30) / 64.0F;
  return t;
}

int noise_phase(std::int64_t i, int iteration, int rank) {
  const std::int64_t v = i + 13LL * iteration + 29LL * rank;
  return static_cast<int>(((v % kNoisePeriod) + kNoisePeriod) % kNoisePeriod);
}

class Trainer {
 public:
  Trainer(Communicator& comm, const Model& model, std::string_view name,
          const ReplayOptions& options)
      : comm_(comm),
        model_(model),
        options_(options),
        named_(make_named_policy(model, name,
                                 SimConfig{options.net, comm.size(), 3, EngineChoice::kPolicy,
                                           options.threshold_bytes})),
        offsets_(layer_offsets(model)),
        epoch_(Clock::now()) {
    const std::size_t layers = model.layers.size();
    position_.resize(layers);
    if (named_.plan.empty()) {
      for (std::size_t l = 0; l < layers; ++l) position_[l] = offsets_[l];
      storage_.assign(static_cast<std::size_t>(offsets_.back()), 0.0F);
    } else {
      // Fusion groups, each padded to a multiple of the rank count, back to back.
      std::int64_t at = 0;
      for (const Group& g : named_.plan) {
        for (int l = g.first; l <= g.last; ++l) {
          position_[static_cast<std::size_t>(l)] = at + offsets_[l] - offsets_[g.first];
        }
        at += g.padded;
      }
      storage_.assign(static_cast<std::size_t>(at), 0.0F);
    }
    // Parameters in the gradients' layout, so that an all-gather can carry them in place.
    params_.assign(storage_.size(), 0.0F);
    for (std::size_t l = 0; l < layers; ++l) {
      for (std::int64_t i = offsets_[l]; i < offsets_[l + 1]; ++i) {
        params_[static_cast<std::size_t>(position_[l] + i - offsets_[l])] = initial_param(i);
      }
    }
    version_.assign(layers, 0);
    applied_.assign(layers, 0);
    backend_ = std::make_unique<CommBackend>(
        comm, [this](const CommRequest& r) { return buffer(r); },
        [this](const CommRequest& r) { consume(r); }, epoch_, options.algorithm);
  }

  ReplayResult run(std::string_view name) {
    const int total = options_.warmup + options_.iterations;
    const int layers = static_cast<int>(model_.layers.size());
    Policy& policy = *named_.policy;
    std::vector<double> step_s;
    comm_.barrier().wait();
    for (int it = 0; it < total; ++it) {
      iteration_ = it;
      timing_ = it >= options_.warmup;
      backend_->set_iteration(it);
      for (int l = 0; l < layers; ++l) {
        hook([&] { policy.before_forward(*backend_, l); });
        check_version(l, it, name);
        const auto t0 = begin_compute();
        end_compute(EventKind::kForward, l, t0,
                    model_.layers[static_cast<std::size_t>(l)].forward_s);
      }
      for (int l = layers - 1; l >= 0; --l) {
        const auto t0 = begin_compute();
        make_gradient(l);
        end_compute(EventKind::kBackward, l, t0,
                    model_.layers[static_cast<std::size_t>(l)].backward_s);
        hook([&] { policy.gradient_ready(*backend_, l); });
      }
      hook([&] { policy.step(*backend_); });
      step_s.push_back(seconds(Clock::now() - epoch_));
      if (options_.progress) {
        const double last = it == 0 ? step_s[0] : step_s.back() - step_s[step_s.size() - 2];
        options_.progress(it + 1, total, last);
      }
    }
    // The last update lands during the next forward pass for DeAR: let it land.
    timing_ = false;
    iteration_ = total;
    backend_->set_iteration(total);
    for (int l = 0; l < layers; ++l) policy.before_forward(*backend_, l);
    for (int l = 0; l < layers; ++l) check_version(l, total, name);
    backend_->drain();

    ReplayResult r;
    r.policy = std::string(name);
    for (int it = options_.warmup; it < total; ++it) {
      r.iteration_s.push_back(step_s[static_cast<std::size_t>(it)] -
                              step_s[static_cast<std::size_t>(it - 1)]);
    }
    double sum = 0;
    for (double s : r.iteration_s) sum += s;
    const double n = static_cast<double>(r.iteration_s.size());
    r.mean_s = sum / n;
    r.p50_s = median(r.iteration_s);
    r.samples_per_s = comm_.size() * model_.batch_size / r.mean_s;
    r.hooks_s = hooks_s_ / n;
    r.gradient_s = gradient_s_ / n;
    r.optimizer_s = optimizer_s_ / n;
    r.late_priority_changes = backend_->late_priority_changes();
    r.params.resize(static_cast<std::size_t>(offsets_.back()));
    for (std::size_t l = 0; l < model_.layers.size(); ++l) {
      std::copy(params_.begin() + position_[l],
                params_.begin() + position_[l] + (offsets_[l + 1] - offsets_[l]),
                r.params.begin() + offsets_[l]);
    }
    if (options_.record_trace) {
      r.trace.events = std::move(compute_events_);
      for (const auto& rec : backend_->records()) {
        TraceEvent e;
        e.kind = EventKind::kComm;
        e.op = rec.request.kind;
        e.iteration = rec.iteration;
        e.first_layer = rec.request.first_layer;
        e.last_layer = rec.request.last_layer;
        e.group = rec.request.group;
        e.priority = rec.priority;
        e.elements = rec.request.elements;
        e.issue_s = rec.issue_s;
        e.start_s = rec.start_s;
        e.end_s = rec.end_s;
        r.trace.events.push_back(e);
      }
      r.trace.step_s = step_s;
      r.trace.iteration_s = r.mean_s;
    }
    return r;
  }

 private:
  // The request's buffer: the gradients, or the parameters for an all-gather that carries them.
  float* buffer(const CommRequest& r) {
    return (r.kind == OpKind::kAllGather && r.carries_parameters ? params_.data()
                                                                 : storage_.data()) +
           position(r);
  }

  // Where the request's range starts in storage_ and params_.
  std::int64_t position(const CommRequest& r) const {
    const auto l = static_cast<std::size_t>(r.first_layer);
    if (r.first_layer < 0 || l >= position_.size() || r.offset < offsets_[l] ||
        r.offset >= offsets_[l + 1]) {
      throw Error(ErrorCode::kInternal,
                  "replay: request offset " + std::to_string(r.offset) +
                      " is not in its first layer " + std::to_string(r.first_layer),
                  comm_.rank());
    }
    const std::int64_t at = position_[l] + (r.offset - offsets_[l]);
    if (at + r.elements > static_cast<std::int64_t>(storage_.size())) {
      throw Error(ErrorCode::kInternal,
                  "replay: request of " + std::to_string(r.elements) + " elements at " +
                      std::to_string(at) + " runs past the gradient storage",
                  comm_.rank());
    }
    return at;
  }

  // The averaged gradients of the request's range have landed: SGD on that range. With the
  // sharded optimizer step the reduce-scatter updates this rank's shard, and the all-gather
  // has already written every shard's new parameters in place.
  void consume(const CommRequest& r) {
    const auto t0 = Clock::now();
    apply(r);
    consumed_ = true;
    consumed_s_ += seconds(Clock::now() - t0);
  }

  void apply(const CommRequest& r) {
    if (r.kind == OpKind::kReduceScatter) {
      if (r.carries_parameters) update_shard(r);
      return;  // otherwise only a shard is averaged so far
    }
    const std::int64_t count =
        r.group >= 0 ? offsets_[static_cast<std::size_t>(r.last_layer) + 1] - r.offset : r.elements;
    if (!r.carries_parameters) {
      const auto t0 = Clock::now();
      const float* g = storage_.data() + position(r);
      float* p = params_.data() + position(r);
      const float lr = options_.learning_rate;
      for (std::int64_t j = 0; j < count; ++j) p[j] -= lr * g[j];
      if (timing_) optimizer_s_ += seconds(Clock::now() - t0);
    }
    mark_applied(r, count);
  }

  // SGD on this rank's shard of a fusion group, the reduce-scatter's output block: rank r
  // owns elements [r s, (r + 1) s) of the group's buffer, s = padded / ranks, and the same
  // block of the group's parameters, which the all-gather then sends. Padding elements are
  // not updated: their parameters stay zero.
  void update_shard(const CommRequest& r) {
    const auto t0 = Clock::now();
    if (r.group < 0) {
      throw Error(ErrorCode::kInternal,
                  "replay: a sharded update needs a fusion group's reduce-scatter", comm_.rank());
    }
    const std::int64_t count = offsets_[static_cast<std::size_t>(r.last_layer) + 1] - r.offset;
    const std::int64_t shard = r.elements / comm_.size();
    const std::int64_t lo = shard * comm_.rank();
    const std::int64_t hi = std::min(lo + shard, count);
    const float* g = storage_.data() + position(r);
    float* p = params_.data() + position(r);
    const float lr = options_.learning_rate;
    for (std::int64_t j = lo; j < hi; ++j) p[j] -= lr * g[j];
    if (timing_) optimizer_s_ += seconds(Clock::now() - t0);
  }

  // Count what each layer of the request's range received; a layer is current once all of
  // it is updated.
  void mark_applied(const CommRequest& r, std::int64_t count) {
    const std::int64_t end = r.offset + count;
    for (auto l = static_cast<std::size_t>(r.first_layer);
         l < model_.layers.size() && offsets_[l] < end; ++l) {
      const std::int64_t got = std::min(end, offsets_[l + 1]) - std::max(r.offset, offsets_[l]);
      applied_[l] += got;
      const std::int64_t size = offsets_[l + 1] - offsets_[l];
      if (applied_[l] > size) {
        throw Error(ErrorCode::kInternal,
                    "replay: layer " + model_.layers[l].name + " updated twice in one step",
                    comm_.rank());
      }
      if (applied_[l] == size) {
        applied_[l] = 0;
        ++version_[l];
      }
    }
  }

  void check_version(int l, int iteration, std::string_view name) const {
    const int v = version_[static_cast<std::size_t>(l)];
    if (v == iteration) return;
    throw Error(ErrorCode::kInternal,
                "replay (" + std::string(name) + "): layer " + std::to_string(l) + " (" +
                    model_.layers[static_cast<std::size_t>(l)].name + ") in iteration " +
                    std::to_string(iteration) + " has " + std::to_string(v) +
                    " updates applied, expected " + std::to_string(iteration) +
                    ": its forward pass would run before its collective",
                comm_.rank());
  }

  template <typename F>
  void hook(F&& f) {
    const auto t0 = Clock::now();
    f();
    if (timing_) hooks_s_ += seconds(Clock::now() - t0);
  }

  // Compute may not start before the policy let it. After a wait that blocked it starts now.
  // Otherwise it starts where the previous layer was meant to end, plus the time the updates
  // applied since then took (they run on the same device as the compute), so that sleep
  // overshoot does not add up over hundreds of short layers: a device's kernels run back to
  // back, and a thread's sleeps overshoot by tens of microseconds each.
  Clock::time_point begin_compute() {
    const auto now = Clock::now();
    const std::int64_t blocked = backend_->blocked_waits();
    if (first_compute_ || blocked != seen_blocked_) {
      clock_ = now;
    } else if (consumed_) {
      clock_ = std::min(now, clock_ + std::chrono::duration_cast<Clock::duration>(
                                          std::chrono::duration<double>(consumed_s_)));
    }
    first_compute_ = false;
    consumed_ = false;
    consumed_s_ = 0;
    seen_blocked_ = blocked;
    return now;
  }

  void end_compute(EventKind kind, int layer, Clock::time_point t0, double duration) {
    switch (options_.compute) {
      case ComputeMode::kSleep:
        clock_ +=
            std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(duration));
        std::this_thread::sleep_until(clock_);
        break;
      case ComputeMode::kBusy: BusyWork::run(duration - seconds(Clock::now() - t0)); break;
      case ComputeMode::kNone: break;
    }
    if (options_.record_trace) {
      TraceEvent e;
      e.kind = kind;
      e.iteration = iteration_;
      e.first_layer = e.last_layer = layer;
      e.start_s = seconds(t0 - epoch_);
      e.end_s = seconds(Clock::now() - epoch_);
      compute_events_.push_back(e);
    }
  }

  // The layer's synthetic gradients, written where the policy's collective will read them.
  void make_gradient(int layer) {
    static const auto table = noise_table();
    const auto t0 = Clock::now();
    const auto l = static_cast<std::size_t>(layer);
    const std::int64_t first = offsets_[l];
    const std::int64_t n = offsets_[l + 1] - first;
    float* g = storage_.data() + position_[l];
    const float* p = params_.data() + position_[l];
    int phase = noise_phase(first, iteration_, comm_.rank());
    std::int64_t j = 0;
    while (j < n) {
      // Runs of the noise period without wrap-around, so the inner loop vectorises.
      const std::int64_t run = std::min<std::int64_t>(n - j, kNoisePeriod - phase);
      const float* t = table.data() + phase;
      for (std::int64_t k = 0; k < run; ++k) g[j + k] = kGradientSlope * p[j + k] + t[k];
      j += run;
      phase = 0;
    }
    if (timing_) gradient_s_ += seconds(Clock::now() - t0);
  }

  Communicator& comm_;
  const Model& model_;
  ReplayOptions options_;
  NamedPolicy named_;
  std::vector<std::int64_t> offsets_;
  // Where each layer starts in storage_ and params_: fusion groups (padded) back to back.
  std::vector<std::int64_t> position_;
  std::vector<float> storage_;  // gradients as the collectives see them
  std::vector<float> params_;
  std::vector<int> version_;           // updates applied to each layer
  std::vector<std::int64_t> applied_;  // elements of the current update applied
  Clock::time_point epoch_;
  std::unique_ptr<CommBackend> backend_;
  int iteration_ = 0;
  bool timing_ = false;
  bool first_compute_ = true;
  bool consumed_ = false;
  double consumed_s_ = 0;  // time the updates applied since the last layer's compute took
  std::int64_t seen_blocked_ = 0;
  Clock::time_point clock_;
  double hooks_s_ = 0;
  double gradient_s_ = 0;
  double optimizer_s_ = 0;
  std::vector<TraceEvent> compute_events_;
};

}  // namespace

float initial_param(std::int64_t i) {
  // Deterministic, varied, of order one: every element distinguishable.
  return static_cast<float>((i * 37) % 101 - 50) / 128.0F;
}

float gradient_noise(std::int64_t i, int iteration, int rank) {
  return static_cast<float>(noise_phase(i, iteration, rank) - 30) / 64.0F;
}

ReplayResult replay(Communicator& comm, const Model& model, std::string_view policy,
                    const ReplayOptions& options) {
  if (options.warmup < 1 || options.iterations < 1) {
    throw Error(ErrorCode::kInvalidArgument,
                "replay: warmup and iterations must be >= 1 (got " +
                    std::to_string(options.warmup) + " and " + std::to_string(options.iterations) +
                    ")",
                comm.rank());
  }
  // A sleeping thread wakes up to its timer slack late (50 us by default on Linux): over a
  // hundred short layers that is milliseconds per iteration of compute the profile does not
  // have. This thread's slack is 1 ns while it replays, then what it was.
  const int slack = ::prctl(PR_GET_TIMERSLACK, 0, 0, 0, 0);
  const bool tighten = options.compute == ComputeMode::kSleep && slack > 1;
  if (tighten) ::prctl(PR_SET_TIMERSLACK, 1UL, 0, 0, 0);
  struct Restore {
    bool on;
    int slack;
    ~Restore() {
      if (on) ::prctl(PR_SET_TIMERSLACK, static_cast<unsigned long>(slack), 0, 0, 0);
    }
  } restore{tighten, slack};
  Trainer trainer(comm, model, policy, options);
  return trainer.run(policy);
}

NetModel calibrate_network(Communicator& comm, int repeats) {
  repeats = std::max(repeats, 1);
  const int n = comm.size();
  NetModel net;
  net.name = "measured";
  net.slice_bytes = static_cast<std::int64_t>(comm.options().slice_bytes);
  std::array<double, 4> fit{20e-6, 1e-9, 0, 0};  // alpha, beta, overhead, wake: as on one rank
  if (n > 1) {
    const std::array<std::int64_t, 2> chunks{16 << 10, 1 << 20};
    std::vector<float> buf(static_cast<std::size_t>(chunks.back() / 4 * n), 1.0F);
    std::vector<double> xs;
    std::vector<double> ys;
    for (std::int64_t chunk : chunks) {
      const auto shard = static_cast<std::size_t>(chunk / 4);
      float* mine = buf.data() + static_cast<std::size_t>(comm.rank()) * shard;
      for (int kind = 0; kind < 2; ++kind) {
        auto once = [&] {
          if (kind == 0) {
            comm.reduce_scatter(buf.data(), mine, shard, DataType::kFloat32, ReduceOp::kAvg).wait();
          } else {
            comm.all_gather(mine, buf.data(), shard, DataType::kFloat32).wait();
          }
        };
        once();  // warm-up
        // The median of single timings: a shared machine's hiccups stay out of the fit.
        std::vector<double> t;
        for (int r = 0; r < repeats; ++r) {
          comm.barrier().wait();
          const auto t0 = Clock::now();
          once();
          t.push_back(seconds(Clock::now() - t0));
        }
        xs.push_back(static_cast<double>(chunk));
        ys.push_back(median(t) / (n - 1));
      }
    }
    // Beta: the slope between the two sizes (each the mean of RS and AG). Loopback is not
    // quite linear: larger steps run out of cache and cost more per byte, which pulls a
    // least-squares line over more sizes below zero at zero bytes.
    const double y_small = (ys[0] + ys[1]) / 2;
    const double y_big = (ys[2] + ys[3]) / 2;
    const double beta = std::max((y_big - y_small) / (xs[2] - xs[0]), 1e-12);
    // Alpha and the per-operation software cost from one-element ring operations, whose bytes
    // cost nothing: an all_reduce takes overhead + 2(N-1) alpha, an all_gather overhead +
    // (N-1) alpha. (The line's intercept is no measure of alpha: at many ranks on few cores it
    // falls below zero, and the steps' cost would all land in the overhead, which the
    // simulator lets operations pay at the same time, while a step occupies the engine.)
    OpOptions ring;
    ring.algorithm = Algorithm::kRing;
    std::vector<float> ones(static_cast<std::size_t>(n), 1.0F);
    // Alpha is a difference of the two: they are timed alternately, so that a shared machine's
    // slower and faster moments fall on both alike.
    std::array<std::vector<double>, 2> tiny;  // [0] all_reduce, [1] all_gather
    for (int r = 0; r < 4 * repeats; ++r) {
      for (int kind = 0; kind < 2; ++kind) {
        comm.barrier().wait();
        const auto t0 = Clock::now();
        if (kind == 0) {
          comm.all_reduce(ones.data(), ones.data(), 1, DataType::kFloat32, ReduceOp::kSum, ring)
              .wait();
        } else {
          comm.all_gather(ones.data() + comm.rank(), ones.data(), 1, DataType::kFloat32, ring)
              .wait();
        }
        tiny[static_cast<std::size_t>(kind)].push_back(seconds(Clock::now() - t0));
      }
    }
    const double t_reduce = median(tiny[0]);
    const double t_gather = median(tiny[1]);
    const double alpha = std::max((t_reduce - t_gather) / (n - 1), 1e-6);
    const double overhead = std::max(t_gather - (n - 1) * alpha, 0.0);
    // The wake-up after a blocked wait: the same small all-gather as above, now in a chain
    // where each one is issued as soon as the previous one's wait returns, without a barrier
    // lining the ranks up in between.
    constexpr int kChain = 32;
    const auto shard = static_cast<std::size_t>(chunks.front() / 4);
    float* mine = buf.data() + static_cast<std::size_t>(comm.rank()) * shard;
    std::vector<double> chain;
    for (int r = 0; r < repeats; ++r) {
      comm.barrier().wait();
      const auto t0 = Clock::now();
      for (int k = 0; k < kChain; ++k) {
        comm.all_gather(mine, buf.data(), shard, DataType::kFloat32).wait();
      }
      chain.push_back(seconds(Clock::now() - t0) / kChain);
    }
    const double alone = ys[1] * (n - 1);  // the 16 KiB all-gather's median, timed alone
    const double wake = std::max(median(chain) - alone, 0.0);
    fit = {alpha, beta, overhead, wake};
    // Every rank must plan with the same numbers: take rank 0's.
    std::array<double, 4> root{};
    comm.broadcast(fit.data(), root.data(), root.size(), DataType::kFloat64, 0).wait();
    fit = root;
  }
  net.alpha_s = fit[0];
  net.beta_s_per_byte = fit[1];
  net.op_overhead_s = fit[2];
  net.wake_s = fit[3];
  net.gap_s = net.alpha_s;
  return net;
}

}  // namespace dear::scheduler
