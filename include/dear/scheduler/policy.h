// Communication policies and the back-end they drive.
//
// A policy sees the training step through three hooks, called by whoever runs the step (the
// simulator, or a real training loop) on the compute thread:
//   before_forward(layer)  just before the layer's forward pass (its parameters must be fresh)
//   gradient_ready(layer)  just after the layer's backward pass produced all its gradients
//   step()                 after the whole backward pass, where the optimizer step sits
// and answers them by issuing collectives on a Backend and waiting for them. Waiting is the
// only way a policy delays compute; issuing never blocks.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "dear/scheduler/fusion.h"
#include "dear/scheduler/model.h"
#include "dear/scheduler/network.h"

namespace dear::scheduler {

using OpId = int;
inline constexpr OpId kNoOp = -1;

struct CommRequest {
  OpKind kind = OpKind::kAllReduce;
  std::int64_t elements = 0;  // whole buffer (all shards); the back-end pads if it must
  int priority = 0;           // larger first, as OpOptions::priority
  OpId after = kNoOp;         // do not start before this operation has completed
  int first_layer = 0;        // layers whose gradients the buffer holds (for traces, checks)
  int last_layer = 0;
  int group = -1;  // fusion group, when the policy fuses
  // The buffer holds the previous iteration's gradients (DeAR's all-gathers issued during
  // the next forward pass); traces file the operation under that iteration.
  bool previous_iteration = false;
  // Where the buffer starts in the model's gradients laid out flat in forward order (layer by
  // layer, each layer's tensors in order), in elements. A real back-end finds the buffer from
  // it (see layer_offsets()); for a fusion group it is the offset of the group's first layer.
  std::int64_t offset = 0;
  // The sharded optimizer step (DearOptions::shard_optimizer). On a reduce-scatter: whoever
  // consumes it (the first wait that sees it complete) applies the optimizer to this rank's
  // shard of the parameters, with its shard of the averaged gradients, and leaves the updated
  // parameters in that shard of the buffer. On an all-gather: the buffer carries parameters,
  // not gradients; once consumed they replace the model's parameters of the range, and no
  // optimizer work remains for it. False everywhere else: the averaged gradients are applied
  // in full where the all-gather or all-reduce that carries them is consumed.
  bool carries_parameters = false;
};

// Contract: issue() returns at once; operations run in the back-end's own order (priority,
// then issue order) and each completes exactly once; wait() returns when it has.
class Backend {
 public:
  virtual ~Backend() = default;
  [[nodiscard]] virtual OpId issue(const CommRequest& request) = 0;
  virtual void wait(OpId op) = 0;
  // Changes the priority of an operation that has not finished (no effect on finished ones).
  virtual void set_priority(OpId op, int priority) = 0;
};

class Policy {
 public:
  virtual ~Policy() = default;
  virtual void before_forward(Backend& backend, int layer) = 0;
  virtual void gradient_ready(Backend& backend, int layer) = 0;
  virtual void step(Backend& backend) = 0;
};

struct DearOptions {
  // AG(g) is issued as soon as RS(g) completes, at a priority below every RS, and raised to
  // forward order at the step barrier (instead of being issued one group at a time during
  // the next forward pass).
  bool eager_all_gather = false;
  // The sharded optimizer step: once RS(g) is consumed, each rank updates only its shard of
  // group g's parameters (1/N of the optimizer work and state), and AG(g) gathers the updated
  // parameters instead of the averaged gradients (the same bytes). The shards are updated at
  // step(), which waits for the RSs in issue (gradient-ready) order and updates each shard as
  // its RS is consumed, so early shards overlap the last RSs on the wire. The AGs are issued
  // as without it (AG(0) at the step, AG(g+1) once AG(g) is consumed before the forward pass
  // of group g), so after AG(g) a rank's parameters of group g are current and nothing is
  // left to apply before forward. RS and AG both carry CommRequest::carries_parameters. Not
  // combinable with eager_all_gather (an eager AG would leave before its shard is updated).
  bool shard_optimizer = false;
};

// Priorities the policies use; all-gathers of the next forward pass outrank everything.
inline constexpr int kAllGatherPriority = 1 << 20;  // AG(g) gets kAllGatherPriority - g
inline constexpr int kEagerPriority = -1;           // eager AG before the step barrier

// Throws dear::Error(kInvalidArgument) unless `plan` covers the model's layers, or when
// options asks for both eager_all_gather and shard_optimizer.
[[nodiscard]] std::unique_ptr<Policy> make_dear(const Model& model, FusionPlan plan,
                                                DearOptions options = {});
// One all-reduce per parameter tensor as soon as it is ready, first come first served.
[[nodiscard]] std::unique_ptr<Policy> make_wfbp(const Model& model);
// PyTorch DDP: tensors in reverse (gradient-ready) order filled into buckets of
// `bucket_bytes`, the first one capped at `first_bucket_bytes`; buckets reduced in order.
[[nodiscard]] std::unique_ptr<Policy> make_ddp(const Model& model,
                                               std::int64_t bucket_bytes = kDefaultThresholdBytes,
                                               std::int64_t first_bucket_bytes = 1 << 20);
// ByteScheduler: tensors cut into partitions of at most `partition_elements`, priority to
// layers nearer the input. Its credit (in-flight limit) is a property of the engine it runs
// on: see EngineModel::credit_bytes.
inline constexpr std::int64_t kByteSchedulerPartition = 4LL << 20;
inline constexpr std::int64_t kByteSchedulerCredit = 16LL << 20;  // elements
[[nodiscard]] std::unique_ptr<Policy> make_bytescheduler(
    const Model& model, std::int64_t partition_elements = kByteSchedulerPartition);
// MG-WFBP: tensors in gradient-ready order; a tensor joins the previous group when that
// group's all-reduce would not start before the tensor is ready, or when the
// tensor's transfer time is under one all-reduce's startup latency.
[[nodiscard]] std::unique_ptr<Policy> make_mgwfbp(const Model& model, const NetModel& net,
                                                  int ranks);

// The merge groups MG-WFBP uses, as tensor counts per group in gradient-ready order
// (exposed for tests).
[[nodiscard]] std::vector<int> mgwfbp_groups(const Model& model, const NetModel& net, int ranks);

}  // namespace dear::scheduler
