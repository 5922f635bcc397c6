#include "cuda/memory.h"

#include <cuda_runtime_api.h>

#include <utility>

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

PinnedBuffer::PinnedBuffer(std::size_t bytes) { reserve(bytes); }

PinnedBuffer::~PinnedBuffer() { release(); }

PinnedBuffer::PinnedBuffer(PinnedBuffer&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)), size_(std::exchange(other.size_, 0)) {}

PinnedBuffer& PinnedBuffer::operator=(PinnedBuffer&& other) noexcept {
  if (this != &other) {
    release();
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
  }
  return *this;
}

void PinnedBuffer::reserve(std::size_t bytes) {
  if (bytes <= size_) return;
  release();
  void* p = nullptr;
  check(cudaHostAlloc(&p, bytes, cudaHostAllocPortable),
        "cudaHostAlloc of " + std::to_string(bytes) + " pinned staging bytes");
  data_ = static_cast<std::byte*>(p);
  size_ = bytes;
}

void PinnedBuffer::release() noexcept {
  if (data_ != nullptr) (void)cudaFreeHost(data_);
  data_ = nullptr;
  size_ = 0;
}

}  // namespace dear::cuda
