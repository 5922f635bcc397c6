#include "dear/scheduler/fusion.h"

#include <string>

#include "dear/error.h"

namespace dear::scheduler {

std::int64_t pad_to(std::int64_t elements, int ranks) {
  if (ranks < 1) throw Error(ErrorCode::kInvalidArgument, "pad_to: ranks must be >= 1");
  return (elements + ranks - 1) / ranks * ranks;
}

FusionPlan plan_from_starts(const Model& model, int ranks, const std::vector<int>& starts) {
  const int n = static_cast<int>(model.layers.size());
  if (starts.empty() || starts.front() != 0) {
    throw Error(ErrorCode::kInvalidArgument, "fusion plan: the first group must start at 0");
  }
  FusionPlan plan;
  for (std::size_t i = 0; i < starts.size(); ++i) {
    const int end = i + 1 < starts.size() ? starts[i + 1] : n;
    if (end <= starts[i] || end > n) {
      throw Error(ErrorCode::kInvalidArgument,
                  "fusion plan: group starts must ascend within the model's " + std::to_string(n) +
                      " layers");
    }
    Group g;
    g.first = starts[i];
    g.last = end - 1;
    for (int l = g.first; l <= g.last; ++l) g.elements += model.layers[l].params();
    g.padded = pad_to(g.elements, ranks);
    plan.push_back(g);
  }
  return plan;
}

FusionPlan plan_threshold(const Model& model, int ranks, std::int64_t threshold_bytes) {
  std::vector<int> starts;
  std::int64_t group_bytes = 0;
  for (int l = 0; l < static_cast<int>(model.layers.size()); ++l) {
    const std::int64_t bytes = model.layer_bytes(l);
    if (starts.empty() || group_bytes + bytes > threshold_bytes) {
      starts.push_back(l);
      group_bytes = 0;
    }
    group_bytes += bytes;
  }
  return plan_from_starts(model, ranks, starts);
}

FusionPlan plan_per_layer(const Model& model, int ranks) { return plan_nearby(model, ranks, 1); }

FusionPlan plan_nearby(const Model& model, int ranks, int layers_per_group) {
  if (layers_per_group < 1) {
    throw Error(ErrorCode::kInvalidArgument, "plan_nearby: layers_per_group must be >= 1");
  }
  std::vector<int> starts;
  for (int l = 0; l < static_cast<int>(model.layers.size()); l += layers_per_group) {
    starts.push_back(l);
  }
  return plan_from_starts(model, ranks, starts);
}

std::vector<int> group_of_layer(const FusionPlan& plan) {
  std::vector<int> of(plan.empty() ? 0 : static_cast<std::size_t>(plan.back().last + 1), -1);
  for (std::size_t g = 0; g < plan.size(); ++g) {
    for (int l = plan[g].first; l <= plan[g].last; ++l) of[l] = static_cast<int>(g);
  }
  return of;
}

}  // namespace dear::scheduler
