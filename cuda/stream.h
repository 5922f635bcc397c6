// Making a caller's CUDA stream wait for work the host finishes, without blocking the host.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace dear::cuda {

// A monotonic counter in mapped pinned memory. enqueue_wait() puts on a stream a one-thread
// kernel that polls the counter until it reaches a target (a stream-side wait: later work on
// that stream starts only after it); publish() raises the counter from the host. Values must
// be published in increasing order. The destructor releases every waiting stream first
// (publishes the maximum), so a stream never waits on a counter that no longer exists.
class HostSignal {
 public:
  HostSignal();  // throws dear::Error naming the CUDA error
  ~HostSignal();
  HostSignal(const HostSignal&) = delete;
  HostSignal& operator=(const HostSignal&) = delete;

  void enqueue_wait(cudaStream_t stream, std::uint64_t target);
  void publish(std::uint64_t value) noexcept;

 private:
  unsigned long long* host_ = nullptr;
  unsigned long long* device_ = nullptr;
};

// The kernel behind HostSignal::enqueue_wait (defined in reduce.cu).
void enqueue_wait_counter(const unsigned long long* device_counter, unsigned long long target,
                          cudaStream_t stream);

}  // namespace dear::cuda
