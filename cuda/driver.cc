#include "cuda/driver.h"

#include <cuda_runtime_api.h>

namespace dear::cuda {

void* driver_entry_point(const char* symbol) noexcept {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult found{};
  if (cudaGetDriverEntryPointByVersion(symbol, &fn, 12000, cudaEnableDefault, &found) !=
          cudaSuccess ||
      found != cudaDriverEntryPointSuccess) {
    (void)cudaGetLastError();
    return nullptr;
  }
  return fn;
}

}  // namespace dear::cuda
