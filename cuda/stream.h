// Making a caller's CUDA stream wait for work the host finishes, without blocking the host.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace dear::cuda {

// A monotonic counter in mapped pinned memory. enqueue_wait() puts on a stream a wait until the
// counter reaches a target (a one-thread kernel that polls it; with DEAR_CUDA_MEMOPS=1,
// cuStreamWaitValue64 where the device has stream memory operations): later work on that
// stream starts only after it. publish() raises the counter from the host. Values must be
// published in increasing order and stay below 2^63. The destructor releases every waiting
// stream first (publishes 2^63 - 1), so a stream never waits on a counter that no longer exists.
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

// Stores `value` into `device_flag` (mapped pinned memory) once the work before it on `stream`
// is done, for the host to poll without a CUDA call: enqueue_set_flag's kernel, or a stream
// memory operation when uses_stream_memops().
void set_flag(unsigned long long* device_flag, unsigned long long value, cudaStream_t stream);

// True when waits and flags use the driver's stream memory operations rather than kernels.
[[nodiscard]] bool uses_stream_memops();

// Puts on `stream` a one-thread kernel that stores `value` into `device_flag` (mapped pinned
// memory) once the work before it on the stream is done, for the host to poll without a CUDA
// call (defined in reduce.cu).
void enqueue_set_flag(unsigned long long* device_flag, unsigned long long value,
                      cudaStream_t stream);

// The kernel behind HostSignal::enqueue_wait (defined in reduce.cu).
void enqueue_wait_counter(const unsigned long long* device_counter, unsigned long long target,
                          cudaStream_t stream);

}  // namespace dear::cuda
