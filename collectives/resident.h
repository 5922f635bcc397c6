// How the device wrapper (device_staging.h) hands an operation on device memory to the
// communicator's engine, where it runs slice by slice with its steps on the device executor
// (executor.h) instead of being staged whole through host memory.
#pragma once

#include <cstddef>
#include <memory>
#include <span>

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

// Whether the engine runs `call` on device memory itself (on `nranks` ranks): the ring-link
// collectives (all_reduce, reduce_scatter, all_gather, broadcast) and their rooted forms reduce
// and gather, slice by slice, or on a log-step schedule in host memory when small (Op::shadow);
// scatter and all_to_all, whose schedules are all log-step ones, when small: their N blocks at
// most kDeviceLogStepMaxBytes, a size every rank computes alike. Larger ones reach the engine
// staged in pieces (device_staging.h). all_to_all_v and its gather forms go their own way
// (ResidentCommunicator::exchange_on_device).
// Whether a device operation is small enough for a log-step schedule in host memory: its
// vector (all_reduce, reduce) or its N blocks (the others) at most kDeviceLogStepMaxBytes, a
// size every rank computes alike. False for an invalid dtype (the call reports it).
[[nodiscard]] constexpr bool fits_device_log_step(const CollectiveCall& call, int nranks) noexcept {
  const std::size_t el = dtype_size(call.dtype);
  if (el == 0) return false;
  const std::size_t blocks =
      call.kind == OpKind::kAllReduce ? 1 : static_cast<std::size_t>(nranks > 0 ? nranks : 1);
  return call.count <= kDeviceLogStepMaxBytes / el / blocks;
}

[[nodiscard]] constexpr bool runs_resident(const CollectiveCall& call, int nranks) noexcept {
  switch (call.kind) {
    case OpKind::kAllReduce:
    case OpKind::kAllGather:
    case OpKind::kBroadcast: return true;
    case OpKind::kReduceScatter:  // with a root, a scatter
    case OpKind::kAllToAll:
      if (call.kind == OpKind::kReduceScatter && call.root < 0) return true;
      return fits_device_log_step(call, nranks);
    case OpKind::kAllToAllV:
    case OpKind::kBarrier: return false;
  }
  return false;
}

class ResidentCommunicator : public Communicator {
 public:
  // `call` with the same checks and results as the public method of its kind, its buffers on
  // the CUDA device the fence names: it starts once fence->input_ready(), and fence->done()
  // is called when it ends. Every rank must issue the same operation on device memory (the
  // frames say which, and a rank that differs gets a mismatch error). A log-step schedule runs
  // it in host memory when it is small, else the ring takes its place; OpOptions::cuda_stream
  // is the fence's business.
  virtual Work issue_on_device(const CollectiveCall& call, const OpOptions& opts,
                               std::unique_ptr<OpFence> fence) = 0;
  // all_to_all_v on device memory (`root` -1), or all_gather_v (`root` -1, `called`
  // "all_gather_v") and gather_v (`root` >= 0) in the all_to_all_v lists that
  // gather_as_all_to_all_v takes, checked as those calls check them. It runs in host memory,
  // whole (Op::shadow). Its messages are those of the same call on host memory, so ranks that
  // pass host memory (or have nothing to exchange) take part with their own host call.
  virtual Work exchange_on_device(const char* called, int root, const void* in,
                                  std::span<const std::size_t> send_counts,
                                  std::span<const std::size_t> send_displs, void* out,
                                  std::span<const std::size_t> recv_counts,
                                  std::span<const std::size_t> recv_displs, DataType dtype,
                                  const OpOptions& opts, std::unique_ptr<OpFence> fence) = 0;
  // send (`send`) or recv of `buf` on device memory: the message leaves from, or lands in, host
  // memory of the engine's, whole; its frames are those of a host send or recv, so the other
  // end may pass either memory.
  virtual Work p2p_on_device(bool send, void* buf, std::size_t count, DataType dtype, int peer,
                             const OpOptions& opts, std::unique_ptr<OpFence> fence) = 0;
};

}  // namespace dear::collectives
