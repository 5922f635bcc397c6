#include "cuda/stream.h"

#include <atomic>
#include <limits>

#include "cuda/error.h"

namespace dear::cuda {

HostSignal::HostSignal() {
  void* p = nullptr;
  check(cudaHostAlloc(&p, sizeof(unsigned long long), cudaHostAllocMapped | cudaHostAllocPortable),
        "cudaHostAlloc of the stream signal");
  host_ = static_cast<unsigned long long*>(p);
  *host_ = 0;
  void* d = nullptr;
  const cudaError_t rc = cudaHostGetDevicePointer(&d, p, 0);
  if (rc != cudaSuccess) {
    (void)cudaFreeHost(p);
    check(rc, "cudaHostGetDevicePointer of the stream signal");
  }
  device_ = static_cast<unsigned long long*>(d);
}

HostSignal::~HostSignal() {
  publish(std::numeric_limits<std::uint64_t>::max());
  // A kernel may still be polling; let every stream see the final value before the memory goes.
  (void)cudaDeviceSynchronize();
  (void)cudaFreeHost(host_);
}

void HostSignal::enqueue_wait(cudaStream_t stream, std::uint64_t target) {
  enqueue_wait_counter(device_, target, stream);
}

void HostSignal::publish(std::uint64_t value) noexcept {
  // Everything the host wrote before (staged results already copied to the device) happens
  // before a stream that sees the value runs on.
  std::atomic_ref<unsigned long long>(*host_).store(value, std::memory_order_release);
}

}  // namespace dear::cuda
