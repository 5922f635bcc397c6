#include <cuda_runtime.h>

#include "cuda/device.h"

namespace dear::cuda {

int device_count() noexcept {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();  // clear the sticky "no driver" error
    return 0;
  }
  return n;
}

std::string unavailable_reason() {
  int n = 0;
  const cudaError_t rc = cudaGetDeviceCount(&n);
  if (rc != cudaSuccess) {
    (void)cudaGetLastError();
    return std::string("CUDA runtime reports: ") + cudaGetErrorString(rc);
  }
  if (n == 0) return "no CUDA device present";
  return {};
}

}  // namespace dear::cuda
