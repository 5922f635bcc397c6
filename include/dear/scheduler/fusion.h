// Tensor fusion: which consecutive layers share one communication buffer.
//
// A plan is a list of groups in forward order that covers every layer exactly once, each a
// contiguous range of layers. A group's buffer is padded to a multiple of the rank count so
// that reduce-scatter and all-gather give every rank an equal shard.
#pragma once

#include <cstdint>
#include <vector>

#include "dear/scheduler/model.h"

namespace dear::scheduler {

struct Group {
  int first = 0;              // first layer, forward order
  int last = 0;               // last layer, inclusive
  std::int64_t elements = 0;  // parameters of the layers in the group
  std::int64_t padded = 0;    // elements rounded up to a multiple of the rank count

  [[nodiscard]] int layers() const { return last - first + 1; }
};
using FusionPlan = std::vector<Group>;

inline constexpr std::int64_t kDefaultThresholdBytes = 25LL * 1024 * 1024;  // DeAR and DDP

// Smallest multiple of `ranks` that is at least `elements`.
[[nodiscard]] std::int64_t pad_to(std::int64_t elements, int ranks);

// DeAR's reference rule: layers join the current group in forward order while the group's
// bytes stay at or under `threshold_bytes`; a layer that would push it over starts a new
// group, so a layer larger than the threshold forms a group of its own.
[[nodiscard]] FusionPlan plan_threshold(const Model& model, int ranks,
                                        std::int64_t threshold_bytes = kDefaultThresholdBytes);
// One group per layer ("DeAR without tensor fusion").
[[nodiscard]] FusionPlan plan_per_layer(const Model& model, int ranks);
// Every `layers_per_group` neighbouring layers form a group (the last may be shorter).
[[nodiscard]] FusionPlan plan_nearby(const Model& model, int ranks, int layers_per_group);
// Groups starting at the given layers (ascending, the first must be 0).
[[nodiscard]] FusionPlan plan_from_starts(const Model& model, int ranks,
                                          const std::vector<int>& starts);

// group_of_layer(plan)[layer] is the index of the group holding that layer.
[[nodiscard]] std::vector<int> group_of_layer(const FusionPlan& plan);

}  // namespace dear::scheduler
