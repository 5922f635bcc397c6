// Collectives on CUDA device buffers and on callers' CUDA streams, for transports that can
// only touch host memory (tcp today).
//
// Communicator::create() passes every communicator through with_device_support(). In a build
// with CUDA it returns a wrapper that, per operation:
// - finds where `in` and `out` live (cudaPointerGetAttributes); host buffers without a stream
//   go straight to the wrapped communicator, at the cost of that one query;
// - otherwise queues the operation to one staging thread per communicator, which, in issue
//   order: waits (on the device) for the work already on OpOptions::cuda_stream, copies the
//   device input into pinned host memory, runs the host collective on the pinned buffers,
//   copies the result back to the device, completes the Work and releases the caller's
//   stream. Operations issued while staged ones are queued are queued behind them, so every
//   rank hands the same order to the engine.
// - Not yet overlapped: the copies are chunked (staging_plan.h) but each phase finishes before
//   the next starts, and staged operations run one at a time. Pipelining copy slices with the
//   network slices of the engine is the next step.
// Without CUDA it returns `comm` unchanged.
#pragma once

#include <memory>

#include "dear/communicator.h"

namespace dear::collectives {

[[nodiscard]] std::unique_ptr<Communicator> with_device_support(std::unique_ptr<Communicator> comm);

// True when `p` is CUDA device memory (always false in a build without CUDA, or without a
// device). Pinned, managed and ordinary host memory are all "not device".
[[nodiscard]] bool is_device_pointer(const void* p) noexcept;

}  // namespace dear::collectives
