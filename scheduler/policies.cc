// The communication policies: DeAR and the baselines it is measured against.
#include <algorithm>
#include <utility>

#include "dear/error.h"
#include "dear/scheduler/policy.h"

namespace dear::scheduler {
namespace {

// Tensors in gradient-ready order: layers from the last to the first, and within a layer
// from its last tensor to its first (autograd produces them in reverse of registration).
struct TensorRef {
  int layer;
  std::int64_t elements;
  std::int64_t offset;  // in the flat forward-order layout
};

std::vector<TensorRef> tensors_ready_order(const Model& model) {
  const auto offsets = layer_offsets(model);
  std::vector<TensorRef> out;
  for (int l = static_cast<int>(model.layers.size()) - 1; l >= 0; --l) {
    const auto& t = model.layers[l].tensors;
    std::int64_t end = offsets[static_cast<std::size_t>(l) + 1];
    for (auto it = t.rbegin(); it != t.rend(); ++it) {
      end -= *it;
      out.push_back({l, *it, end});
    }
  }
  return out;
}

// Policies whose step waits for every operation of the iteration.
class WaitAllAtStep : public Policy {
 public:
  void before_forward(Backend&, int) override {}
  void step(Backend& backend) override {
    for (OpId op : inflight_) backend.wait(op);
    inflight_.clear();
  }

 protected:
  std::vector<OpId> inflight_;
};

class DearPolicy final : public Policy {
 public:
  DearPolicy(const Model& model, FusionPlan plan, DearOptions options)
      : plan_(std::move(plan)),
        offsets_(layer_offsets(model)),
        options_(options),
        group_of_(group_of_layer(plan_)),
        ready_(plan_.size(), 0),
        rs_(plan_.size(), kNoOp),
        ag_(plan_.size(), kNoOp) {}

  void before_forward(Backend& backend, int layer) override {
    const int g = group_of_.at(layer);
    if (!gathering_ || plan_[g].first != layer) return;
    // Gradients reach a group's layers in forward order: AG(g) must have landed before the
    // optimizer applies them, and only then is AG(g+1) launched (the reference's pipeline).
    backend.wait(ag_[g]);
    if (!options_.eager_all_gather && g + 1 < static_cast<int>(plan_.size())) {
      CommRequest ag = all_gather(g + 1, kNoOp, kAllGatherPriority - (g + 1));
      ag.previous_iteration = true;
      ag_[g + 1] = backend.issue(ag);
    }
    if (g + 1 == static_cast<int>(plan_.size())) gathering_ = false;
  }

  void gradient_ready(Backend& backend, int layer) override {
    const int g = group_of_.at(layer);
    if (++ready_[g] < plan_[g].layers()) return;
    ready_[g] = 0;
    CommRequest rs{OpKind::kReduceScatter,   plan_[g].padded,         0, kNoOp,
                   plan_[g].first,           plan_[g].last,           g, false,
                   offsets_[plan_[g].first], options_.shard_optimizer};
    rs_[g] = backend.issue(rs);
    if (options_.eager_all_gather) ag_[g] = backend.issue(all_gather(g, rs_[g], kEagerPriority));
  }

  void step(Backend& backend) override {
    if (options_.shard_optimizer) {
      // Consuming RS(g) updates this rank's shard of group g on the compute stream: in issue
      // (gradient-ready) order, so that the first shards' updates overlap the reduce-scatters
      // still running.
      for (auto it = rs_.rbegin(); it != rs_.rend(); ++it) backend.wait(*it);
    } else {
      for (OpId op : rs_) backend.wait(op);
    }
    if (options_.eager_all_gather) {
      // The eager all-gathers yielded to the reduce-scatters; now the next forward pass
      // needs them, group 0 first.
      for (std::size_t g = 0; g < plan_.size(); ++g) {
        backend.set_priority(ag_[g], kAllGatherPriority - static_cast<int>(g));
      }
    } else {
      ag_[0] = backend.issue(all_gather(0, kNoOp, kAllGatherPriority));
    }
    gathering_ = true;
  }

 private:
  [[nodiscard]] CommRequest all_gather(int g, OpId after, int priority) const {
    return {OpKind::kAllGather,       plan_[g].padded,         priority, after,
            plan_[g].first,           plan_[g].last,           g,        false,
            offsets_[plan_[g].first], options_.shard_optimizer};
  }

  FusionPlan plan_;
  std::vector<std::int64_t> offsets_;
  DearOptions options_;
  std::vector<int> group_of_;
  std::vector<int> ready_;  // layers of the group whose gradients are in its buffer
  std::vector<OpId> rs_;
  std::vector<OpId> ag_;
  bool gathering_ = false;  // all-gathers of the last step still to be consumed
};

class WfbpPolicy final : public WaitAllAtStep {
 public:
  explicit WfbpPolicy(const Model& model) : model_(model), offsets_(layer_offsets(model)) {}
  void gradient_ready(Backend& backend, int layer) override {
    const auto& t = model_.layers[layer].tensors;
    std::int64_t end = offsets_[static_cast<std::size_t>(layer) + 1];
    for (auto it = t.rbegin(); it != t.rend(); ++it) {
      end -= *it;
      inflight_.push_back(
          backend.issue({OpKind::kAllReduce, *it, 0, kNoOp, layer, layer, -1, false, end}));
    }
  }

 private:
  const Model& model_;
  std::vector<std::int64_t> offsets_;
};

// A policy that all-reduces fixed runs of tensors (in gradient-ready order) once all their
// tensors are ready: DDP buckets and MG-WFBP groups.
class BucketPolicy final : public WaitAllAtStep {
 public:
  BucketPolicy(const Model& model, const std::vector<int>& tensors_per_bucket) {
    const auto tensors = tensors_ready_order(model);
    std::size_t next = 0;
    for (int count : tensors_per_bucket) {
      Bucket b;
      b.last_layer = tensors[next].layer;
      for (int i = 0; i < count; ++i, ++next) {
        b.elements += tensors[next].elements;
        b.first_layer = tensors[next].layer;
        b.offset = tensors[next].offset;  // tensors go backwards: the last is the lowest
      }
      // The bucket is complete once its earliest layer (the last to produce gradients) is.
      b.tensors = count;
      buckets_.push_back(b);
    }
    if (next != tensors.size()) {
      throw Error(ErrorCode::kInternal, "bucket plan does not cover every tensor");
    }
    tensors_of_layer_.resize(model.layers.size());
    for (std::size_t l = 0; l < model.layers.size(); ++l) {
      tensors_of_layer_[l] = static_cast<int>(model.layers[l].tensors.size());
    }
  }

  void gradient_ready(Backend& backend, int layer) override {
    ready_tensors_ += tensors_of_layer_[layer];
    // Buckets are reduced strictly in order, each once all its tensors are ready.
    while (next_ < buckets_.size() && ready_tensors_ >= covered_ + buckets_[next_].tensors) {
      const Bucket& b = buckets_[next_];
      inflight_.push_back(backend.issue({OpKind::kAllReduce, b.elements, 0, kNoOp, b.first_layer,
                                         b.last_layer, -1, false, b.offset}));
      covered_ += b.tensors;
      ++next_;
    }
    if (layer == 0) {  // the backward pass is over: the next one starts from bucket 0
      ready_tensors_ = 0;
      covered_ = 0;
      next_ = 0;
    }
  }

 private:
  struct Bucket {
    int first_layer = 0;
    int last_layer = 0;
    int tensors = 0;
    std::int64_t elements = 0;
    std::int64_t offset = 0;
  };
  std::vector<Bucket> buckets_;
  std::vector<int> tensors_of_layer_;
  int ready_tensors_ = 0;
  int covered_ = 0;
  std::size_t next_ = 0;
};

// ByteScheduler holds each layer's forward pass until that layer's partitions are reduced,
// instead of waiting for all of them at the step: that is what makes its priorities matter.
class ByteSchedulerPolicy final : public Policy {
 public:
  ByteSchedulerPolicy(const Model& model, std::int64_t partition)
      : model_(model),
        partition_(partition),
        offsets_(layer_offsets(model)),
        ops_of_layer_(model.layers.size()) {}

  void before_forward(Backend& backend, int layer) override {
    for (OpId op : ops_of_layer_[layer]) backend.wait(op);
    ops_of_layer_[layer].clear();
  }

  void gradient_ready(Backend& backend, int layer) override {
    const auto& t = model_.layers[layer].tensors;
    std::int64_t end = offsets_[static_cast<std::size_t>(layer) + 1];
    for (auto it = t.rbegin(); it != t.rend(); ++it) {
      end -= *it;
      const std::int64_t parts = (*it + partition_ - 1) / partition_;
      std::int64_t offset = end;
      for (std::int64_t p = 0; p < parts; ++p) {
        const std::int64_t size = *it / parts + (p < *it % parts ? 1 : 0);
        // Layers nearer the input are needed first in the next forward pass.
        ops_of_layer_[layer].push_back(backend.issue(
            {OpKind::kAllReduce, size, -layer, kNoOp, layer, layer, -1, false, offset}));
        offset += size;
      }
    }
  }

  void step(Backend&) override {}

 private:
  const Model& model_;
  std::int64_t partition_;
  std::vector<std::int64_t> offsets_;
  std::vector<std::vector<OpId>> ops_of_layer_;
};

}  // namespace

std::unique_ptr<Policy> make_dear(const Model& model, FusionPlan plan, DearOptions options) {
  if (plan.empty() || plan.front().first != 0 ||
      plan.back().last + 1 != static_cast<int>(model.layers.size())) {
    throw Error(ErrorCode::kInvalidArgument, "make_dear: the plan must cover the model's layers");
  }
  if (options.eager_all_gather && options.shard_optimizer) {
    throw Error(ErrorCode::kInvalidArgument,
                "make_dear: options.eager_all_gather and options.shard_optimizer exclude each "
                "other (an eager all-gather would leave before its shard is updated)");
  }
  return std::make_unique<DearPolicy>(model, std::move(plan), options);
}

std::unique_ptr<Policy> make_wfbp(const Model& model) {
  return std::make_unique<WfbpPolicy>(model);
}

std::unique_ptr<Policy> make_ddp(const Model& model, std::int64_t bucket_bytes,
                                 std::int64_t first_bucket_bytes) {
  std::vector<int> counts;
  std::int64_t bytes = 0;
  for (const auto& t : tensors_ready_order(model)) {
    // DDP caps its first bucket lower so that communication starts early.
    const std::int64_t cap = counts.size() == 1 ? first_bucket_bytes : bucket_bytes;
    const std::int64_t tb = t.elements * model.element_bytes;
    if (counts.empty() || bytes + tb > cap) {
      counts.push_back(0);
      bytes = 0;
    }
    counts.back() += 1;
    bytes += tb;
  }
  return std::make_unique<BucketPolicy>(model, counts);
}

std::unique_ptr<Policy> make_bytescheduler(const Model& model, std::int64_t partition_elements) {
  if (partition_elements < 1) {
    throw Error(ErrorCode::kInvalidArgument, "make_bytescheduler: partition must be >= 1");
  }
  return std::make_unique<ByteSchedulerPolicy>(model, partition_elements);
}

std::vector<int> mgwfbp_groups(const Model& model, const NetModel& net, int ranks) {
  // Gradient-ready time of each layer, from the start of the backward pass.
  std::vector<double> ready(model.layers.size());
  double t = 0;
  for (int l = static_cast<int>(model.layers.size()) - 1; l >= 0; --l) {
    t += model.layers[l].backward_s;
    ready[l] = t;
  }
  const double startup = ring_steps(OpKind::kAllReduce, ranks) * net.alpha_s;
  std::vector<int> counts;
  std::int64_t elements = 0;
  double start = 0;     // the current group's all-reduce start, as planned so far
  double prev_end = 0;  // end of the group before it
  for (const auto& tensor : tensors_ready_order(model)) {
    const double r = ready[tensor.layer];
    const double transfer =
        op_time(net, OpKind::kAllReduce, tensor.elements, ranks, model.element_bytes) - startup;
    const bool merge = !counts.empty() && (start >= r || transfer < startup);
    if (merge) {
      elements += tensor.elements;
      counts.back() += 1;
    } else {
      if (!counts.empty()) {
        prev_end = start + op_time(net, OpKind::kAllReduce, elements, ranks, model.element_bytes);
      }
      counts.push_back(1);
      elements = tensor.elements;
    }
    start = std::max(r, prev_end);
  }
  return counts;
}

std::unique_ptr<Policy> make_mgwfbp(const Model& model, const NetModel& net, int ranks) {
  return std::make_unique<BucketPolicy>(model, mgwfbp_groups(model, net, ranks));
}

}  // namespace dear::scheduler
