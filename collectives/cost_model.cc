#include "collectives/cost_model.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <sstream>
#include <stdexcept>

#include <nlohmann/json.hpp>

#include "collectives/steps.h"
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

int latency_steps(OpKind kind, Schedule schedule, std::size_t bytes, std::size_t el,
                  const ModelGeometry& g) {
  if (is_log_step(schedule)) {
    el = std::max<std::size_t>(el, 1);
    return step_cost(kind, schedule, std::max(g.nranks, 1), bytes / el, el).steps;
  }
  const SchedulePlan p = schedule_plan(kind, schedule, bytes, el, g);
  if (kind == OpKind::kBroadcast) return p.forward_steps == 0 ? 0 : p.forward_steps + p.slices - 1;
  return std::max(p.forward_steps, p.backward_steps) * p.slices;
}

double predict_us(const CostModel& m, OpKind kind, Schedule schedule, std::size_t bytes,
                  std::size_t el, const ModelGeometry& g) {
  const double alpha = step_alpha_us(m, schedule);
  if (is_log_step(schedule)) {
    el = std::max<std::size_t>(el, 1);
    const StepCost c = step_cost(kind, schedule, std::max(g.nranks, 1), bytes / el, el);
    return c.steps * alpha + static_cast<double>(c.wire_bytes) * m.beta_us_per_byte +
           static_cast<double>(c.reduced_bytes + c.copied_bytes) * m.reduce_us_per_byte;
  }
  const SchedulePlan p = schedule_plan(kind, schedule, bytes, el, g);
  const double local = static_cast<double>(p.reduced_bytes + p.copied_bytes) * m.reduce_us_per_byte;
  if (kind == OpKind::kBroadcast) {
    if (p.forward_steps == 0) return local;
    const double message =
        alpha + static_cast<double>(p.chunk_bytes) / p.slices * m.beta_us_per_byte;
    return (p.forward_steps + p.slices - 1) * message + local;
  }
  // Both directions at once: latencies overlap, bytes share the egress.
  const int alpha_steps = std::max(p.forward_steps, p.backward_steps);
  const int byte_steps = p.forward_steps + p.backward_steps;
  return alpha_steps * p.slices * alpha +
         byte_steps * static_cast<double>(p.chunk_bytes) * m.beta_us_per_byte + local;
}

Schedule select_schedule(OpKind kind, Algorithm requested, std::size_t bytes, std::size_t el,
                         const ModelGeometry& g, const CostModel* model,
                         std::size_t threshold_bytes) {
  const int n = std::max(g.nranks, 1);
  std::vector<Schedule> candidates{Schedule::kRing};
  std::size_t total = bytes;  // what the threshold compares: the operation's whole buffer
  Schedule small = Schedule::kRing;
  // Without a model, from 8 ranks on: the tree for all_reduce (it measured fastest on small
  // operations, alone and back to back, on an oversubscribed host), else the log-step
  // schedule of the collective.
  const Schedule log_small = kind == OpKind::kAllReduce       ? Schedule::kTree
                             : kind == OpKind::kReduceScatter ? Schedule::kHalvingDoubling
                                                              : Schedule::kRecursiveDoubling;
  switch (kind) {
    case OpKind::kAllReduce:
      small = Schedule::kGatherReduce;
      if (requested == Algorithm::kGatherReduce) return Schedule::kGatherReduce;
      candidates.push_back(Schedule::kGatherReduce);
      break;
    case OpKind::kAllGather:
      small = Schedule::kBiGather;
      candidates.push_back(Schedule::kBiGather);
      total = bytes * static_cast<std::size_t>(n);
      break;
    case OpKind::kReduceScatter:
      total = bytes * static_cast<std::size_t>(n);
      break;
    default:
      throw std::invalid_argument(std::string("select_schedule: ") + to_string(kind) +
                                  " has one schedule");
  }
  if (requested == Algorithm::kRing) return Schedule::kRing;
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
    for (Schedule s : {Schedule::kRecursiveDoubling, Schedule::kHalvingDoubling, Schedule::kTree}) {
      if (log_step_supports(kind, s)) candidates.push_back(s);
    }
    if (n >= 8) small = log_small;
  }
  if (model == nullptr) return total <= threshold_bytes ? small : Schedule::kRing;
  Schedule best = Schedule::kRing;
  double best_us = 0;
  for (Schedule s : candidates) {
    const double t = predict_us(*model, kind, s, bytes, el, g);
    if (s == Schedule::kRing || t < best_us) {
      best = s;
      best_us = t;
    }
  }
  return best;
}

void fit_alpha_beta(CostModel& m) {
  auto& pts = m.points;
  double sss = 0;
  double ssx = 0;
  double sxx = 0;
  double ssy = 0;
  double sxy = 0;
  for (const auto& p : pts) {
    if (!(p.step_us > 0) || !std::isfinite(p.step_us) || p.bytes < 0 || p.slices < 1) {
      throw std::invalid_argument("fit_alpha_beta: a point has bytes=" + std::to_string(p.bytes) +
                                  " slices=" + std::to_string(p.slices) +
                                  " step_us=" + std::to_string(p.step_us));
    }
    const double w = 1.0 / (p.step_us * p.step_us);
    const double s = p.slices;
    sss += w * s * s;
    ssx += w * s * p.bytes;
    sxx += w * p.bytes * p.bytes;
    ssy += w * s * p.step_us;
    sxy += w * p.bytes * p.step_us;
  }
  const double det = sss * sxx - ssx * ssx;
  if (pts.size() < 2 || !(det > 1e-12 * sss * sxx)) {
    throw std::invalid_argument("fit_alpha_beta: needs at least two points of different sizes");
  }
  double alpha = (ssy * sxx - ssx * sxy) / det;
  double beta = (sss * sxy - ssx * ssy) / det;
  // Non-negative least squares in two unknowns: a negative one is pinned at zero and the
  // other refitted alone.
  if (alpha < 0) {
    alpha = 0;
    beta = sxy / sxx;
  } else if (beta < 0) {
    beta = 0;
    alpha = ssy / sss;
  }
  m.alpha_us = alpha;
  m.beta_us_per_byte = beta;
  std::vector<double> errors;
  for (auto& p : pts) {
    p.model_us = alpha * p.slices + beta * p.bytes;
    p.rel_error = std::abs(p.model_us - p.step_us) / p.step_us;
    errors.push_back(p.rel_error);
  }
  std::sort(errors.begin(), errors.end());
  const std::size_t k = errors.size();
  m.median_rel_error = k % 2 == 1 ? errors[k / 2] : (errors[k / 2 - 1] + errors[k / 2]) / 2;
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
  if (!m.schedule_alpha_us.empty()) j["schedule_alpha_us"] = m.schedule_alpha_us;
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
  if (const auto it = j.find("transport"); it != j.end()) {
    if (!it->is_string()) fail("field 'transport' is not a string");
    m.transport = it->get<std::string>();
  }
  if (const auto it = j.find("schedule_alpha_us"); it != j.end()) {
    if (!it->is_object()) fail("field 'schedule_alpha_us' is not an object");
    for (const auto& [name, v] : it->items()) {
      if (!v.is_number() || !std::isfinite(v.get<double>()) || v.get<double>() < 0) {
        fail("field 'schedule_alpha_us' has '" + name + "' = " + v.dump() +
             ", not a finite number >= 0");
      }
      m.schedule_alpha_us[name] = v.get<double>();
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
