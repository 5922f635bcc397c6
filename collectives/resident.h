// How the device wrapper (device_staging.h) hands an operation on device memory to the
// communicator's engine, where it runs slice by slice with its steps on the device executor
// (executor.h) instead of being staged whole through host memory.
#pragma once

#include <cstddef>
#include <memory>

#include "collectives/ops.h"
#include "dear/communicator.h"

namespace dear::collectives {

// One collective call, as the public methods take it (barrier excluded).
struct CollectiveCall {
  OpKind kind = OpKind::kAllReduce;
  const void* in = nullptr;
  void* out = nullptr;
  std::size_t count = 0;  // as the method for `kind` counts
  DataType dtype = DataType::kFloat32;
  ReduceOp op = ReduceOp::kSum;
  int root = -1;
};

// Whether the engine runs `call` slice by slice on device memory: the ring-link collectives
// (all_reduce, reduce_scatter, all_gather, broadcast) and their rooted forms reduce and gather.
// scatter and the all-to-alls keep their exchanges in host memory (steps.h), so device buffers
// reach them staged (device_staging.h).
[[nodiscard]] constexpr bool runs_resident(const CollectiveCall& call) noexcept {
  switch (call.kind) {
    case OpKind::kAllReduce:
    case OpKind::kAllGather:
    case OpKind::kBroadcast: return true;
    case OpKind::kReduceScatter: return call.root < 0;  // with a root, a scatter
    default: return false;
  }
}

class ResidentCommunicator : public Communicator {
 public:
  // `call` with the same checks and results as the public method of its kind, its buffers on
  // the CUDA device the fence names: it starts once fence->input_ready(), and fence->done()
  // is called when it ends. Every rank must issue the same operation on device memory (the
  // frames say which, and a rank that differs gets a mismatch error). The log-step schedules
  // are replaced by the ring for it; OpOptions::cuda_stream is the fence's business.
  virtual Work issue_on_device(const CollectiveCall& call, const OpOptions& opts,
                               std::unique_ptr<OpFence> fence) = 0;
};

}  // namespace dear::collectives
