#include "dear/scheduler/simulator.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <nlohmann/json.hpp>
#include <ostream>

#include "dear/error.h"
#include "link.h"

namespace dear::scheduler {
namespace {

using detail::kNever;
using detail::Link;

// The Backend the policies drive inside the simulator: issue and wait happen at the compute
// stream's current time.
class SimBackend final : public Backend {
 public:
  SimBackend(const Model& model, const SimConfig& config, const EngineModel& engine)
      : model_(model), config_(config), link_(config.net, engine), offsets_(layer_offsets(model)) {}

  OpId issue(const CommRequest& r) override {
    link_.advance_until(now_);
    const int steps = ring_steps(r.kind, config_.workers);
    const auto chunk = ring_chunk_bytes(r.elements, config_.workers, model_.element_bytes);
    const OpId id =
        link_.add(steps, chunk, r.elements * model_.element_bytes, r.priority, now_, r.after);
    requests_.push_back(r);
    iteration_of_.push_back(r.previous_iteration ? iteration_ - 1 : iteration_);
    consumed_.push_back(false);
    return id;
  }
  // The first wait that sees an operation complete consumes it, as CommBackend's does: the
  // optimizer work it completes runs there, on the compute stream.
  void wait(OpId op) override {
    if (op == kNoOp) return;
    const double end = link_.finish(op);
    if (end > now_) now_ = end + config_.net.wake_s;  // blocked: the worker wakes up
    const auto i = static_cast<std::size_t>(op);
    if (consumed_.at(i)) return;
    consumed_[i] = true;
    const double s = static_cast<double>(optimizer_elements(requests_[i])) *
                     config_.optimizer_us_per_mparam * 1e-12;
    if (s <= 0) return;
    TraceEvent e;
    e.kind = EventKind::kOptimizer;
    e.iteration = iteration_of_[i];
    e.first_layer = requests_[i].first_layer;
    e.last_layer = requests_[i].last_layer;
    e.group = requests_[i].group;
    e.elements = optimizer_elements(requests_[i]);
    e.start_s = now_;
    now_ += s;
    e.end_s = now_;
    optimizer_events_.push_back(e);
  }
  void set_priority(OpId op, int priority) override {
    link_.advance_until(now_);
    link_.set_priority(op, priority);
  }

  // Parameters whose update consuming `r` completes on this worker (see SimConfig).
  [[nodiscard]] std::int64_t optimizer_elements(const CommRequest& r) const {
    if (r.kind == OpKind::kReduceScatter) {
      return r.carries_parameters ? r.elements / config_.workers : 0;
    }
    if (r.carries_parameters) return 0;
    // A fusion group's buffer is padded; its parameters end with its last layer.
    return r.group >= 0 ? offsets_.at(static_cast<std::size_t>(r.last_layer) + 1) - r.offset
                        : r.elements;
  }

  double now_ = 0;
  int iteration_ = 0;
  const Model& model_;
  const SimConfig& config_;
  Link link_;
  std::vector<std::int64_t> offsets_;
  std::vector<CommRequest> requests_;
  std::vector<int> iteration_of_;
  std::vector<bool> consumed_;
  std::vector<TraceEvent> optimizer_events_;
};

}  // namespace

SimResult simulate(const Model& model, Policy& policy, const SimConfig& config,
                   const EngineModel& engine) {
  if (config.workers < 1 || config.iterations < 1) {
    throw Error(ErrorCode::kInvalidArgument, "simulate: workers and iterations must be >= 1");
  }
  SimBackend b(model, config, engine);
  SimResult result;
  const int layers = static_cast<int>(model.layers.size());
  auto compute = [&](EventKind kind, int layer, double seconds) {
    TraceEvent e;
    e.kind = kind;
    e.iteration = b.iteration_;
    e.first_layer = e.last_layer = layer;
    e.start_s = b.now_;
    b.now_ += seconds;
    e.end_s = b.now_;
    result.events.push_back(e);
  };
  for (int it = 0; it < config.iterations; ++it) {
    b.iteration_ = it;
    for (int l = 0; l < layers; ++l) {
      policy.before_forward(b, l);
      compute(EventKind::kForward, l, model.layers[l].forward_s);
    }
    for (int l = layers - 1; l >= 0; --l) {
      compute(EventKind::kBackward, l, model.layers[l].backward_s);
      policy.gradient_ready(b, l);
    }
    policy.step(b);
    result.step_s.push_back(b.now_);
  }
  b.link_.advance_until(kNever);  // let the last all-gathers finish, for the trace
  result.events.insert(result.events.end(), b.optimizer_events_.begin(), b.optimizer_events_.end());
  const auto& ops = b.link_.ops();
  for (std::size_t i = 0; i < ops.size(); ++i) {
    const CommRequest& r = b.requests_[i];
    TraceEvent e;
    e.kind = EventKind::kComm;
    e.op = r.kind;
    e.iteration = b.iteration_of_[i];
    e.first_layer = r.first_layer;
    e.last_layer = r.last_layer;
    e.group = r.group;
    e.priority = ops[i].priority;
    e.elements = r.elements;
    e.issue_s = ops[i].issue_s;
    e.start_s = ops[i].start_s;
    e.end_s = ops[i].end_s;
    result.events.push_back(e);
  }
  const auto& s = result.step_s;
  result.iteration_s = s.size() >= 2 ? s[s.size() - 1] - s[s.size() - 2] : s.back();
  return result;
}

double ideal_bound_s(const Model& model, const SimConfig& config) {
  const int n = config.workers;
  const double compute = model.forward_s() + model.backward_s();
  const double tail = op_time(config.net, OpKind::kAllReduce, model.layers.front().params(), n,
                              model.element_bytes);
  const double bandwidth = 2.0 * (n - 1) / n * config.net.beta_s_per_byte *
                           static_cast<double>(model.params() * model.element_bytes);
  const double optimizer =
      static_cast<double>(model.params()) / n * config.optimizer_us_per_mparam * 1e-12;
  return std::max({compute + (n > 1 ? tail : 0.0), compute + optimizer, bandwidth});
}

void write_chrome_trace(const SimResult& result, const Model& model, std::ostream& out) {
  using nlohmann::json;
  json events = json::array();
  auto meta = [&](int tid, const std::string& name) {
    events.push_back({{"name", "thread_name"},
                      {"ph", "M"},
                      {"pid", 0},
                      {"tid", tid},
                      {"args", {{"name", name}}}});
  };
  meta(0, "compute");
  // Collectives overlap on dear's engine: give each the first track free at its start.
  std::vector<double> track_free;
  std::vector<const TraceEvent*> comms;
  for (const auto& e : result.events) {
    if (e.kind == EventKind::kComm) comms.push_back(&e);
  }
  std::stable_sort(comms.begin(), comms.end(), [](const TraceEvent* a, const TraceEvent* b) {
    return a->start_s < b->start_s;
  });
  auto us = [](double s) { return s * 1e6; };
  auto layer_name = [&](int l) { return model.layers.at(static_cast<std::size_t>(l)).name; };
  for (const auto& e : result.events) {
    if (e.kind == EventKind::kComm) continue;
    const bool fwd = e.kind == EventKind::kForward;
    const bool opt = e.kind == EventKind::kOptimizer;
    std::string name = (opt ? "O " : fwd ? "F " : "B ") + layer_name(e.first_layer);
    if (opt && e.last_layer != e.first_layer) name += ".." + layer_name(e.last_layer);
    events.push_back({{"name", name},
                      {"cat", opt   ? "optimizer"
                              : fwd ? "forward"
                                    : "backward"},
                      {"ph", "X"},
                      {"pid", 0},
                      {"tid", 0},
                      {"ts", us(e.start_s)},
                      {"dur", us(e.end_s - e.start_s)},
                      {"args", {{"iteration", e.iteration}}}});
  }
  for (const TraceEvent* e : comms) {
    std::size_t track = 0;
    while (track < track_free.size() && track_free[track] > e->start_s) ++track;
    if (track == track_free.size()) {
      track_free.push_back(0);
      meta(static_cast<int>(track) + 1, "network " + std::to_string(track));
    }
    track_free[track] = e->end_s;
    std::string name = to_string(e->op);
    if (e->group >= 0) name += " g" + std::to_string(e->group);
    name += " " + layer_name(e->first_layer);
    if (e->last_layer != e->first_layer) name += ".." + layer_name(e->last_layer);
    events.push_back({{"name", name},
                      {"cat", to_string(e->op)},
                      {"ph", "X"},
                      {"pid", 0},
                      {"tid", static_cast<int>(track) + 1},
                      {"ts", us(e->start_s)},
                      {"dur", us(e->end_s - e->start_s)},
                      {"args",
                       {{"iteration", e->iteration},
                        {"elements", e->elements},
                        {"priority", e->priority},
                        {"issued_us", us(e->issue_s)}}}});
  }
  json doc = {{"traceEvents", std::move(events)}, {"displayTimeUnit", "ms"}};
  out << doc.dump() << "\n";
}

FusionPlan plan_rs_dp(const Model& model, const SimConfig& config) {
  // Groups [i, k) in forward order; backpropagation makes group [i, k) ready when layer i's
  // backward ends, at ready[i]. With one operation at a time, reduce-scatters finish at
  //   f = max(ready[i], f of the group after it) + rs(i, k),
  // which grows with the later finish time, so the best split of layers [i, L) extends the
  // best split of [k, L): best[i] = min over k of max(ready[i], best[k]) + rs(i, k).
  const int n = static_cast<int>(model.layers.size());
  std::vector<double> ready(n);
  double t = 0;
  for (int l = n - 1; l >= 0; --l) {
    t += model.layers[l].backward_s;
    ready[l] = t;
  }
  std::vector<double> best(n + 1, std::numeric_limits<double>::infinity());
  std::vector<int> next(n + 1, n);
  best[n] = 0;
  for (int i = n - 1; i >= 0; --i) {
    std::int64_t elements = 0;
    for (int k = i + 1; k <= n; ++k) {
      elements += model.layers[k - 1].params();
      const double f = std::max(ready[i], best[k]) + op_time(config.net, OpKind::kReduceScatter,
                                                             pad_to(elements, config.workers),
                                                             config.workers, model.element_bytes);
      if (f < best[i]) {
        best[i] = f;
        next[i] = k;
      }
    }
  }
  std::vector<int> starts;
  for (int i = 0; i < n; i = next[i]) starts.push_back(i);
  return plan_from_starts(model, config.workers, starts);
}

FusionPlan refine_plan(const Model& model, int ranks, FusionPlan plan, double plan_score,
                       const std::function<double(const FusionPlan&)>& score, int budget) {
  const int layers = static_cast<int>(model.layers.size());
  std::vector<int> starts;
  for (const Group& g : plan) starts.push_back(g.first);
  // Scores the plan that starts groups at `s`; keeps it when it scores lower.
  auto try_starts = [&](std::vector<int> s) {
    if (budget <= 0) return false;
    --budget;
    FusionPlan candidate = plan_from_starts(model, ranks, s);
    const double v = score(candidate);
    if (v >= plan_score) return false;
    plan_score = v;
    plan = std::move(candidate);
    starts = std::move(s);
    return true;
  };
  // One change that scores lower, or false when none does (or the budget is spent).
  auto improve_once = [&] {
    for (std::size_t j = 1; j < starts.size(); ++j) {
      // Boundary j moves within (starts[j - 1], starts[j + 1]).
      const int lo = starts[j - 1] + 1;
      const int hi = j + 1 < starts.size() ? starts[j + 1] - 1 : layers - 1;
      for (int step = 1; step <= hi - lo; step *= 2) {
        for (const int d : {-step, step}) {
          const int at = starts[j] + d;
          if (at < lo || at > hi) continue;
          std::vector<int> s = starts;
          s[j] = at;
          if (try_starts(std::move(s))) return true;
        }
      }
      std::vector<int> merged = starts;
      merged.erase(merged.begin() + static_cast<std::ptrdiff_t>(j));
      if (try_starts(std::move(merged))) return true;
    }
    for (std::size_t g = 0; g < plan.size(); ++g) {
      if (plan[g].layers() < 2) continue;
      // Split where the group's parameters pass half.
      std::int64_t total = 0;
      for (int l = plan[g].first; l <= plan[g].last; ++l) total += model.layers[l].params();
      std::int64_t acc = 0;
      int at = plan[g].first + 1;
      for (int l = plan[g].first; l < plan[g].last; ++l) {
        acc += model.layers[l].params();
        at = l + 1;
        if (2 * acc >= total) break;
      }
      std::vector<int> s = starts;
      s.insert(s.begin() + static_cast<std::ptrdiff_t>(g) + 1, at);
      if (try_starts(std::move(s))) return true;
    }
    return false;
  };
  while (budget > 0 && improve_once()) {
  }
  return plan;
}

FusionPlan plan_auto(const Model& model, const SimConfig& config,
                     const std::function<double(const FusionPlan&)>& score) {
  std::vector<FusionPlan> candidates;
  candidates.push_back(plan_rs_dp(model, config));
  candidates.push_back(plan_per_layer(model, config.workers));
  // Group 0 is both the last reduce-scatter and the first all-gather, exposed twice; so
  // besides plain thresholds try a small group 0 and groups that grow geometrically from the
  // input (each AG(g+1) then hides behind the forward pass of group g).
  const int layers = static_cast<int>(model.layers.size());
  auto growing = [&](std::int64_t first_bytes, std::int64_t cap_bytes, int growth) {
    std::vector<int> starts;
    std::int64_t limit = first_bytes;
    std::int64_t bytes = 0;
    for (int l = 0; l < layers; ++l) {
      const std::int64_t b = model.layer_bytes(static_cast<std::size_t>(l));
      if (starts.empty() || bytes + b > limit) {
        if (!starts.empty()) limit = growth == 0 ? cap_bytes : std::min(cap_bytes, limit * growth);
        starts.push_back(l);
        bytes = 0;
      }
      bytes += b;
    }
    return plan_from_starts(model, config.workers, starts);
  };
  for (std::int64_t mib = 1; mib <= 256; mib *= 2) {
    const std::int64_t cap = mib << 20;
    candidates.push_back(plan_threshold(model, config.workers, cap));
    for (std::int64_t first = 256 << 10; first < cap; first *= 4) {
      candidates.push_back(growing(first, cap, 0));
      candidates.push_back(growing(first, cap, 2));
    }
  }
  candidates.push_back(plan_threshold(model, config.workers, kDefaultThresholdBytes));
  std::size_t best = 0;
  double best_score = std::numeric_limits<double>::infinity();
  for (std::size_t i = 0; i < candidates.size(); ++i) {
    const double s = score(candidates[i]);
    if (s < best_score) {
      best_score = s;
      best = i;
    }
  }
  return refine_plan(model, config.workers, candidates[best], best_score, score, kRefineBudget);
}

const std::vector<std::string>& policy_names() {
  static const std::vector<std::string> names = {
      "dear",      "dear_notf", "dear_prio", "dear_eager",    "dear_shard", "dear_auto",
      "dear_plus", "wfbp",      "ddp",       "bytescheduler", "mgwfbp"};
  return names;
}

NamedPolicy make_named_policy(const Model& model, std::string_view name, const SimConfig& config) {
  const int n = config.workers;
  const EngineModel serial;
  const EngineModel dear_engine{true, 0};
  auto dear = [&](FusionPlan plan, DearOptions options, const EngineModel& engine) {
    NamedPolicy p;
    p.policy = make_dear(model, plan, options);
    p.engine = engine;
    p.plan = std::move(plan);
    return p;
  };
  auto auto_plan = [&](DearOptions options, const EngineModel& engine) {
    return plan_auto(model, config, [&](const FusionPlan& plan) {
      auto policy = make_dear(model, plan, options);
      return simulate(model, *policy, config, engine).iteration_s;
    });
  };
  const std::int64_t threshold = config.threshold_bytes;
  if (name == "dear") return dear(plan_threshold(model, n, threshold), {}, serial);
  if (name == "dear_notf") return dear(plan_per_layer(model, n), {}, serial);
  if (name == "dear_prio") return dear(plan_threshold(model, n, threshold), {}, dear_engine);
  if (name == "dear_eager") return dear(plan_threshold(model, n, threshold), {true}, serial);
  if (name == "dear_shard") {
    return dear(plan_threshold(model, n, threshold), {false, true}, serial);
  }
  if (name == "dear_auto") return dear(auto_plan({}, serial), {}, serial);
  if (name == "dear_plus") return dear(auto_plan({true}, dear_engine), {true}, dear_engine);
  NamedPolicy p;
  p.engine = serial;
  if (name == "wfbp") {
    p.policy = make_wfbp(model);
  } else if (name == "ddp") {
    p.policy = make_ddp(model);
  } else if (name == "bytescheduler") {
    p.policy = make_bytescheduler(model);
    p.engine.credit_bytes = kByteSchedulerCredit * model.element_bytes;
  } else if (name == "mgwfbp") {
    p.policy = make_mgwfbp(model, config.net, n);
  } else {
    throw Error(ErrorCode::kInvalidArgument, "unknown policy '" + std::string(name) + "'");
  }
  return p;
}

SimResult simulate_named(const Model& model, std::string_view name, const SimConfig& config) {
  NamedPolicy p = make_named_policy(model, name, config);
  if (config.engine == EngineChoice::kSerial) p.engine = EngineModel{};
  if (config.engine == EngineChoice::kInterleaved) p.engine = EngineModel{true, 0};
  return simulate(model, *p.policy, config, p.engine);
}

}  // namespace dear::scheduler
