#include "collectives/cost_model.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <stdexcept>

#include "collectives/steps.h"
#include "common/stats.h"
#include "dear/error.h"

namespace dear::collectives {
namespace {

std::size_t ceil_div(std::size_t a, std::size_t b) { return (a + b - 1) / b; }

constexpr int kFileVersion = 1;

}  // namespace

int slices_for(std::size_t chunk_bytes, std::size_t el, const ModelGeometry& g) {
  // As plan(): channels by chunk size (at least min_channel_bytes each), then slices of at
  // most slice_bytes within a channel.
  el = std::max<std::size_t>(el, 1);
  const std::size_t chunk_elems = ceil_div(chunk_bytes, el);
  const std::size_t wanted =
      std::max<std::size_t>(1, chunk_elems * el / std::max<std::size_t>(1, g.min_channel_bytes));
  const auto channels =
      std::clamp<std::size_t>(wanted, 1, static_cast<std::size_t>(std::max(1, g.channels)));
  const std::size_t part_bytes = ceil_div(chunk_elems, channels) * el;
  return static_cast<int>(
      std::max<std::size_t>(1, ceil_div(part_bytes, std::max<std::size_t>(1, g.slice_bytes))));
}

SchedulePlan schedule_plan(OpKind kind, Schedule schedule, std::size_t bytes, std::size_t el,
                           const ModelGeometry& g) {
  const int n = std::max(g.nranks, 1);
  const auto nz = static_cast<std::size_t>(n);
  el = std::max<std::size_t>(el, 1);
  SchedulePlan p;
  const auto bad = [&] {
    throw std::invalid_argument(std::string("cost model: ") + to_string(kind) +
                                " has no schedule " + to_string(schedule));
  };
  switch (kind) {
    case OpKind::kAllReduce:
      if (schedule == Schedule::kRing) {
        // Reduce-scatter then all-gather over N chunks of the vector.
        p.forward_steps = 2 * (n - 1);
        p.chunk_bytes = ceil_div(bytes / el, nz) * el;
        p.reduced_bytes = static_cast<std::size_t>(n - 1) * p.chunk_bytes;
      } else if (schedule == Schedule::kGatherReduce) {
        // Whole inputs gathered both ways round the ring, then N-1 local reductions.
        p.forward_steps = n / 2;
        p.backward_steps = (n - 1) / 2;
        p.chunk_bytes = bytes;
        p.copied_bytes = bytes;
        p.reduced_bytes = static_cast<std::size_t>(n - 1) * bytes;
      } else {
        bad();
      }
      break;
    case OpKind::kReduceScatter:
      if (schedule != Schedule::kRing) bad();
      p.forward_steps = n - 1;
      p.chunk_bytes = bytes;
      p.reduced_bytes = static_cast<std::size_t>(n - 1) * bytes;
      break;
    case OpKind::kAllGather:
    case OpKind::kBarrier:
      if (schedule == Schedule::kRing) {
        p.forward_steps = n - 1;
      } else if (schedule == Schedule::kBiGather) {
        p.forward_steps = n / 2;
        p.backward_steps = (n - 1) / 2;
      } else {
        bad();
      }
      p.chunk_bytes = bytes;
      p.copied_bytes = bytes;
      break;
    case OpKind::kBroadcast:
      if (schedule != Schedule::kChain) bad();
      // A pipelined chain: N-1 hops, the last slice leaves the root slices-1 messages late.
      p.forward_steps = n - 1;
      p.chunk_bytes = bytes;
      break;
    case OpKind::kAllToAll:
    case OpKind::kAllToAllV: bad();  // no ring schedule: its own over the mesh (steps.h)
  }
  if (n == 1) p = SchedulePlan{};
  p.slices = slices_for(p.chunk_bytes, el, g);
  return p;
}

double step_alpha_us(const CostModel& m, Schedule schedule) {
  const auto it = m.schedule_alpha_us.find(to_string(schedule));
  if (it != m.schedule_alpha_us.end()) return it->second;
  if (schedule == Schedule::kBiGather) return step_alpha_us(m, Schedule::kGatherReduce);
  return m.alpha_us;
}

double beta_scale(const CostModel& m, Schedule schedule) {
  const auto it = m.schedule_beta_scale.find(to_string(schedule));
  if (it != m.schedule_beta_scale.end()) return it->second;
  if (schedule == Schedule::kBiGather) return beta_scale(m, Schedule::kGatherReduce);
  return 1;
}

namespace {

// latency_steps and bandwidth_us together, from one plan of the schedule (the log-step plan
// builds a step list; predict_us and fit_schedule need both parts).
struct Parts {
  int steps = 0;
  double bandwidth_us = 0;
};

Parts parts(const CostModel& m, OpKind kind, Schedule schedule, std::size_t bytes, std::size_t el,
            const ModelGeometry& g) {
  el = std::max<std::size_t>(el, 1);
  if (is_log_step(schedule)) {
    const StepCost c = step_cost(kind, schedule, std::max(g.nranks, 1), bytes / el, el);
    return {c.steps,
            static_cast<double>(c.wire_bytes) * m.beta_us_per_byte +
                static_cast<double>(c.reduced_bytes + c.copied_bytes) * m.reduce_us_per_byte};
  }
  const SchedulePlan p = schedule_plan(kind, schedule, bytes, el, g);
  const double local = static_cast<double>(p.reduced_bytes + p.copied_bytes) * m.reduce_us_per_byte;
  if (kind == OpKind::kBroadcast) {
    // A pipelined chain: every message (forward_steps + slices - 1 of them on the critical
    // path) carries one slice.
    if (p.forward_steps == 0) return {0, local};
    const int messages = p.forward_steps + p.slices - 1;
    return {messages,
            messages * static_cast<double>(p.chunk_bytes) / p.slices * m.beta_us_per_byte + local};
  }
  // Both directions at once: latencies overlap, bytes share the egress.
  const int byte_steps = p.forward_steps + p.backward_steps;
  return {std::max(p.forward_steps, p.backward_steps) * p.slices,
          byte_steps * static_cast<double>(p.chunk_bytes) * m.beta_us_per_byte + local};
}

}  // namespace

int latency_steps(OpKind kind, Schedule schedule, std::size_t bytes, std::size_t el,
                  const ModelGeometry& g) {
  return parts(CostModel{}, kind, schedule, bytes, el, g).steps;
}

double bandwidth_us(const CostModel& m, OpKind kind, Schedule schedule, std::size_t bytes,
                    std::size_t el, const ModelGeometry& g) {
  return parts(m, kind, schedule, bytes, el, g).bandwidth_us;
}

double size_correction(const CostModel& m, Schedule schedule, double total_bytes) {
  auto it = m.schedule_samples.find(to_string(schedule));
  if (it == m.schedule_samples.end() && schedule == Schedule::kBiGather) {
    it = m.schedule_samples.find(to_string(Schedule::kGatherReduce));
  }
  if (it == m.schedule_samples.end()) return 1;
  const double x = std::log2(std::max(total_bytes, 1.0));
  double prev_x = 0;
  double prev_r = 0;
  bool have_prev = false;
  for (const ScheduleSample& s : it->second) {
    if (!(s.model_us > 0) || !(s.measured_us > 0)) continue;
    const double sx = std::log2(std::max(s.bytes, 1.0));
    const double r = s.measured_us / s.model_us;
    if (x <= sx) {
      if (!have_prev || sx <= prev_x) return r;
      return prev_r + (r - prev_r) * (x - prev_x) / (sx - prev_x);
    }
    prev_x = sx;
    prev_r = r;
    have_prev = true;
  }
  return have_prev ? prev_r : 1;
}

double predict_us(const CostModel& m, OpKind kind, Schedule schedule, std::size_t bytes,
                  std::size_t el, const ModelGeometry& g) {
  const double total =
      static_cast<double>(bytes) *
      (kind == OpKind::kReduceScatter || kind == OpKind::kAllGather ? std::max(g.nranks, 1) : 1);
  const Parts p = parts(m, kind, schedule, bytes, el, g);
  return (p.steps * step_alpha_us(m, schedule) + beta_scale(m, schedule) * p.bandwidth_us) *
         size_correction(m, schedule, total);
}

Schedule select_schedule(OpKind kind, Algorithm requested, std::size_t bytes, std::size_t el,
                         const ModelGeometry& g, const CostModel* model,
                         std::size_t threshold_bytes, std::size_t medium_bytes) {
  const int n = std::max(g.nranks, 1);
  std::size_t total = bytes;           // what the threshold compares: the operation's whole buffer
  Schedule two_way = Schedule::kRing;  // the collective's two-way gather, where it has one
  // The small schedule without a model, with log steps (from 3 ranks on): the tree for
  // all_reduce (it measured fastest on small operations, alone and
  // back to back, on an oversubscribed host), else the log-step schedule of the collective.
  const Schedule log_small = kind == OpKind::kAllReduce       ? Schedule::kTree
                             : kind == OpKind::kReduceScatter ? Schedule::kHalvingDoubling
                                                              : Schedule::kRecursiveDoubling;
  switch (kind) {
    case OpKind::kAllReduce:
      two_way = Schedule::kGatherReduce;
      if (requested == Algorithm::kGatherReduce) return Schedule::kGatherReduce;
      break;
    case OpKind::kAllGather:
      two_way = Schedule::kBiGather;
      total = bytes * static_cast<std::size_t>(n);
      break;
    case OpKind::kReduceScatter: total = bytes * static_cast<std::size_t>(n); break;
    default:
      throw std::invalid_argument(std::string("select_schedule: ") + to_string(kind) +
                                  " has one schedule");
  }
  if (requested == Algorithm::kRing) return Schedule::kRing;
  Schedule small = two_way;
  const auto forced = [&](Schedule s) {
    if (!g.log_steps || !log_step_supports(kind, s)) {
      throw std::invalid_argument(std::string("select_schedule: ") + to_string(kind) +
                                  " cannot run " + to_string(s) + " here");
    }
    return s;
  };
  if (requested == Algorithm::kHalvingDoubling) return forced(Schedule::kHalvingDoubling);
  if (requested == Algorithm::kRecursiveDoubling) {
    return forced(kind == OpKind::kAllGather || kind == OpKind::kAllReduce
                      ? Schedule::kRecursiveDoubling
                      : Schedule::kHalvingDoubling);
  }
  if (requested == Algorithm::kTree) return forced(Schedule::kTree);
  if (g.log_steps && n > 1) {
    // From 3 ranks on, the log-step schedules beat the ring's N - 1 steps (and the two-way
    // gather's, and gather_reduce's ceil((N - 1) / 2) two-way steps) on small operations,
    // since a waiting thread's turns read only the channels a log step uses (see
    // docs/benchmarks.md).
    if (n >= 3) small = log_small;
  }
  if (model == nullptr) {
    if (total <= threshold_bytes) return small;
    // Medium all_reduces: from 4 ranks on, halving + doubling's 2 log2(N) steps beat the
    // ring's 2(N - 1) where each ring step is short (measured on loopback, see docs/benchmarks.md).
    // Its messages are at most half the operation (the whole of it where ranks beyond a power
    // of two fold in), so at the default 1 MiB a step holds a link about as long as one or two
    // of the ring's default slices.
    // all_gather's recursive doubling measured ahead of the ring over the same range;
    // reduce_scatter's halving only up to about a quarter of it (level from 256 KiB on, behind
    // at 512 KiB and 1 MiB on 8 ranks).
    if (!g.log_steps || n < 4) return Schedule::kRing;
    switch (kind) {
      case OpKind::kAllReduce:
        return total <= medium_bytes ? Schedule::kHalvingDoubling : Schedule::kRing;
      case OpKind::kAllGather:
        return total <= medium_bytes ? Schedule::kRecursiveDoubling : Schedule::kRing;
      default: return total <= medium_bytes / 4 ? Schedule::kHalvingDoubling : Schedule::kRing;
    }
  }
  // With a model (the caller remembers its choice per size, so this runs once per size): the
  // ring, the collective's two-way gather, and its log-step schedules where there are mesh links.
  std::vector<Schedule> candidates{Schedule::kRing};
  if (two_way != Schedule::kRing) candidates.push_back(two_way);
  if (g.log_steps && n > 1) {
    for (Schedule s : {Schedule::kRecursiveDoubling, Schedule::kHalvingDoubling, Schedule::kTree}) {
      if (log_step_supports(kind, s)) candidates.push_back(s);
    }
  }
  Schedule best = Schedule::kRing;
  double best_us = 0;
  double ring_us = 0;
  for (Schedule s : candidates) {
    const double t = predict_us(*model, kind, s, bytes, el, g);
    if (s == Schedule::kRing) ring_us = t;
    if (s == Schedule::kRing || t < best_us) {
      best = s;
      best_us = t;
    }
  }
  return ring_us <= (1 + model->ring_margin) * best_us ? Schedule::kRing : best;
}

namespace {

// Non-negative least squares of y = a * x1 + b * x2, each point weighted by 1/y^2 so that it
// counts by its relative error (small times are not drowned by large ones). A negative
// unknown is pinned at zero and the other refitted alone. `what` names the caller in errors.
struct TwoFit {
  double a = 0;
  double b = 0;
};
TwoFit fit_two(const std::vector<double>& x1, const std::vector<double>& x2,
               const std::vector<double>& y, const char* what) {
  double s11 = 0;
  double s12 = 0;
  double s22 = 0;
  double s1y = 0;
  double s2y = 0;
  for (std::size_t i = 0; i < y.size(); ++i) {
    if (!(y[i] > 0) || !std::isfinite(y[i]) || !(x1[i] >= 0) || !(x2[i] >= 0)) {
      throw std::invalid_argument(std::string(what) + ": a point has x1=" + std::to_string(x1[i]) +
                                  " x2=" + std::to_string(x2[i]) + " time=" + std::to_string(y[i]));
    }
    const double w = 1.0 / (y[i] * y[i]);
    s11 += w * x1[i] * x1[i];
    s12 += w * x1[i] * x2[i];
    s22 += w * x2[i] * x2[i];
    s1y += w * x1[i] * y[i];
    s2y += w * x2[i] * y[i];
  }
  const double det = s11 * s22 - s12 * s12;
  if (y.size() < 2 || !(det > 1e-12 * s11 * s22)) {
    throw std::invalid_argument(std::string(what) +
                                ": needs at least two points of different sizes");
  }
  TwoFit f{(s1y * s22 - s12 * s2y) / det, (s11 * s2y - s12 * s1y) / det};
  if (f.a < 0) {
    f = {0, s2y / s22};
  } else if (f.b < 0) {
    f = {s1y / s11, 0};
  }
  return f;
}

}  // namespace

void fit_alpha_beta(CostModel& m) {
  std::vector<double> slices;
  std::vector<double> bytes;
  std::vector<double> times;
  for (const auto& p : m.points) {
    if (p.slices < 1 || p.bytes < 0) {
      throw std::invalid_argument("fit_alpha_beta: a point has bytes=" + std::to_string(p.bytes) +
                                  " slices=" + std::to_string(p.slices) +
                                  " step_us=" + std::to_string(p.step_us));
    }
    slices.push_back(p.slices);
    bytes.push_back(p.bytes);
    times.push_back(p.step_us);
  }
  const TwoFit f = fit_two(slices, bytes, times, "fit_alpha_beta");
  m.alpha_us = f.a;
  m.beta_us_per_byte = f.b;
  std::vector<double> errors;
  for (auto& p : m.points) {
    p.model_us = f.a * p.slices + f.b * p.bytes;
    p.rel_error = std::abs(p.model_us - p.step_us) / p.step_us;
    errors.push_back(p.rel_error);
  }
  m.median_rel_error = median(std::move(errors));
}

std::vector<std::size_t> refinement_sizes(const std::vector<std::size_t>& sizes,
                                          const std::vector<std::vector<ScheduleSample>>& samples,
                                          int max_refinements) {
  // samples[s][k] is schedule s at sizes[k] (sorted). Where the fastest schedule measured at
  // one size differs from the fastest at the next, their crossover lies in between, and
  // interpolating each schedule's correction across a factor of 4 or more in size can put it
  // on the wrong side: the geometric midpoint, rounded to a power of two, is timed too. The
  // first max_refinements such gaps, smallest sizes first.
  std::vector<std::size_t> extra;
  if (samples.size() < 2) return extra;
  const auto winner = [&](std::size_t k) {
    std::size_t best = 0;
    for (std::size_t s = 1; s < samples.size(); ++s) {
      if (samples[s][k].measured_us < samples[best][k].measured_us) best = s;
    }
    return best;
  };
  for (std::size_t k = 0; k + 1 < sizes.size(); ++k) {
    if (static_cast<int>(extra.size()) >= max_refinements) break;
    if (sizes[k + 1] < 4 * std::max<std::size_t>(sizes[k], 1) || winner(k) == winner(k + 1)) {
      continue;
    }
    const double mid = std::sqrt(static_cast<double>(sizes[k]) * static_cast<double>(sizes[k + 1]));
    const auto pow2 = static_cast<std::size_t>(std::exp2(std::round(std::log2(mid))));
    if (pow2 > sizes[k] && pow2 < sizes[k + 1]) extra.push_back(pow2);
  }
  return extra;
}

double fit_schedule(CostModel& m, Schedule schedule, std::vector<ScheduleSample> samples,
                    std::size_t el, const ModelGeometry& g) {
  std::vector<double> steps;
  std::vector<double> band;
  std::vector<double> times;
  el = std::max<std::size_t>(el, 1);
  std::sort(samples.begin(), samples.end(),
            [](const ScheduleSample& a, const ScheduleSample& b) { return a.bytes < b.bytes; });
  for (const auto& s : samples) {
    if (!(s.bytes >= 0)) throw std::invalid_argument("fit_schedule: a sample has negative bytes");
    const Parts p =
        parts(m, OpKind::kAllReduce, schedule, static_cast<std::size_t>(s.bytes), el, g);
    steps.push_back(p.steps);
    band.push_back(p.bandwidth_us);
    times.push_back(s.measured_us);
  }
  const TwoFit f = fit_two(steps, band, times, "fit_schedule");
  const std::string name = to_string(schedule);
  m.schedule_alpha_us[name] = f.a;
  m.schedule_beta_scale[name] = f.b;
  std::vector<double> errors;
  for (std::size_t i = 0; i < samples.size(); ++i) {
    samples[i].model_us = f.a * steps[i] + f.b * band[i];
    samples[i].rel_error = std::abs(samples[i].model_us - times[i]) / times[i];
    errors.push_back(samples[i].rel_error);
  }
  m.schedule_samples[name] = std::move(samples);
  return median(std::move(errors));
}

std::string to_json_text(const CostModel& m) {
  nlohmann::json j;
  j["version"] = kFileVersion;
  j["transport"] = m.transport;
  j["ranks"] = m.ranks;
  j["alpha_us"] = m.alpha_us;
  j["beta_us_per_byte"] = m.beta_us_per_byte;
  // Derived, for people: GB/s = 1e9 bytes per second.
  j["gbytes_per_s"] = m.beta_us_per_byte > 0 ? 1e-3 / m.beta_us_per_byte : 0.0;
  j["reduce_us_per_byte"] = m.reduce_us_per_byte;
  j["slice_bytes"] = m.slice_bytes;
  j["median_rel_error"] = m.median_rel_error;
  j["ring_margin"] = m.ring_margin;
  if (!m.schedule_alpha_us.empty()) j["schedule_alpha_us"] = m.schedule_alpha_us;
  if (!m.schedule_beta_scale.empty()) j["schedule_beta_scale"] = m.schedule_beta_scale;
  if (!m.schedule_samples.empty()) {
    nlohmann::json samples = nlohmann::json::object();
    for (const auto& [name, list] : m.schedule_samples) {
      nlohmann::json rows = nlohmann::json::array();
      for (const auto& s : list) {
        rows.push_back({{"bytes", s.bytes},
                        {"measured_us", s.measured_us},
                        {"model_us", s.model_us},
                        {"rel_error", s.rel_error}});
      }
      samples[name] = std::move(rows);
    }
    j["schedule_samples"] = std::move(samples);
  }
  nlohmann::json points = nlohmann::json::array();
  for (const auto& p : m.points) {
    points.push_back({{"bytes", p.bytes},
                      {"slices", p.slices},
                      {"step_us", p.step_us},
                      {"model_us", p.model_us},
                      {"rel_error", p.rel_error}});
  }
  j["points"] = std::move(points);
  return j.dump(2) + "\n";
}

CostModel parse_cost_model(const std::string& text, const std::string& source) {
  const auto fail = [&](const std::string& why) {
    throw Error(ErrorCode::kInvalidArgument, "cost model '" + source + "': " + why);
  };
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    fail(std::string("not valid JSON (") + e.what() + ")");
  }
  if (!j.is_object()) fail("not a JSON object");
  const auto number = [&](const char* field, bool required, double fallback) {
    const auto it = j.find(field);
    if (it == j.end()) {
      if (required) fail(std::string("field '") + field + "' is missing");
      return fallback;
    }
    if (!it->is_number()) fail(std::string("field '") + field + "' is not a number");
    const double v = it->get<double>();
    if (!std::isfinite(v) || v < 0) {
      fail(std::string("field '") + field + "' = " + it->dump() + " is not a finite number >= 0");
    }
    return v;
  };
  CostModel m;
  if (const auto it = j.find("version"); it != j.end() && *it != kFileVersion) {
    fail("field 'version' = " + it->dump() + " is not " + std::to_string(kFileVersion));
  }
  m.alpha_us = number("alpha_us", true, 0);
  m.beta_us_per_byte = number("beta_us_per_byte", true, 0);
  if (m.alpha_us == 0 && m.beta_us_per_byte == 0) {
    fail("fields 'alpha_us' and 'beta_us_per_byte' are both 0");
  }
  m.reduce_us_per_byte = number("reduce_us_per_byte", false, 0);
  m.ranks = static_cast<int>(number("ranks", false, 0));
  m.slice_bytes = static_cast<std::size_t>(number("slice_bytes", false, 0));
  m.median_rel_error = number("median_rel_error", false, 0);
  m.ring_margin = number("ring_margin", false, CostModel{}.ring_margin);
  if (const auto it = j.find("transport"); it != j.end()) {
    if (!it->is_string()) fail("field 'transport' is not a string");
    m.transport = it->get<std::string>();
  }
  const auto per_schedule = [&](const char* field, std::map<std::string, double>& into) {
    const auto it = j.find(field);
    if (it == j.end()) return;
    if (!it->is_object()) fail(std::string("field '") + field + "' is not an object");
    for (const auto& [name, v] : it->items()) {
      if (!v.is_number() || !std::isfinite(v.get<double>()) || v.get<double>() < 0) {
        fail(std::string("field '") + field + "' has '" + name + "' = " + v.dump() +
             ", not a finite number >= 0");
      }
      into[name] = v.get<double>();
    }
  };
  per_schedule("schedule_alpha_us", m.schedule_alpha_us);
  per_schedule("schedule_beta_scale", m.schedule_beta_scale);
  if (const auto it = j.find("schedule_samples"); it != j.end()) {
    if (!it->is_object()) fail("field 'schedule_samples' is not an object");
    for (const auto& [name, rows] : it->items()) {
      if (!rows.is_array()) fail("field 'schedule_samples' has '" + name + "', not an array");
      for (const auto& e : rows) {
        if (!e.is_object() || !e.value("bytes", nlohmann::json()).is_number() ||
            !e.value("measured_us", nlohmann::json()).is_number()) {
          fail("field 'schedule_samples' has an entry of '" + name +
               "' without numeric 'bytes' and 'measured_us'");
        }
        ScheduleSample s;
        s.bytes = e["bytes"].get<double>();
        s.measured_us = e["measured_us"].get<double>();
        s.model_us = e.value("model_us", 0.0);
        s.rel_error = e.value("rel_error", 0.0);
        m.schedule_samples[name].push_back(s);
      }
      auto& list = m.schedule_samples[name];
      std::sort(list.begin(), list.end(),
                [](const ScheduleSample& a, const ScheduleSample& b) { return a.bytes < b.bytes; });
    }
  }
  if (const auto it = j.find("points"); it != j.end()) {
    if (!it->is_array()) fail("field 'points' is not an array");
    for (const auto& e : *it) {
      if (!e.is_object() || !e.value("slices", nlohmann::json(1)).is_number_integer() ||
          !e.value("model_us", nlohmann::json(0.0)).is_number() ||
          !e.value("rel_error", nlohmann::json(0.0)).is_number()) {
        fail("field 'points' has an entry with a malformed 'slices', 'model_us' or 'rel_error'");
      }
      if (!e.is_object() || !e.contains("bytes") || !e.contains("step_us") ||
          !e["bytes"].is_number() || !e["step_us"].is_number()) {
        fail("field 'points' has an entry without numeric 'bytes' and 'step_us'");
      }
      CalibrationPoint p;
      p.bytes = e["bytes"].get<double>();
      p.slices = e.value("slices", 1);
      p.step_us = e["step_us"].get<double>();
      p.model_us = e.value("model_us", 0.0);
      p.rel_error = e.value("rel_error", 0.0);
      m.points.push_back(p);
    }
  }
  return m;
}

CostModel load_cost_model(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) throw Error(ErrorCode::kInvalidArgument, "cost model '" + path + "': cannot open it");
  std::stringstream text;
  text << f.rdbuf();
  return parse_cost_model(text.str(), path);
}

}  // namespace dear::collectives
