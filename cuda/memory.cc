#include "cuda/memory.h"

#include <cuda_runtime_api.h>

#include <string>

#include "cuda/error.h"

namespace dear::cuda {

Location locate(const void* p) noexcept {
  if (p == nullptr) return {};
  cudaPointerAttributes attr{};
  if (cudaPointerGetAttributes(&attr, p) != cudaSuccess) {
    (void)cudaGetLastError();  // no driver, no device: it cannot be device memory
    return {};
  }
  if (attr.type == cudaMemoryTypeDevice) return {MemoryKind::kDevice, attr.device};
  return {};
}

MappedMemory alloc_mapped(std::size_t bytes, const std::string& what, int rank) {
  MappedMemory m;
  check(cudaHostAlloc(&m.host, bytes, cudaHostAllocPortable | cudaHostAllocMapped),
        "cudaHostAlloc of " + std::to_string(bytes) + " bytes for " + what, rank);
  const cudaError_t rc = cudaHostGetDevicePointer(&m.device, m.host, 0);
  if (rc != cudaSuccess) {
    (void)cudaFreeHost(m.host);
    check(rc, "cudaHostGetDevicePointer for " + what, rank);
  }
  return m;
}

}  // namespace dear::cuda
