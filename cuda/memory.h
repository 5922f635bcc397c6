// Where a pointer lives, and pinned host memory for staging device buffers.
#pragma once

#include <cstddef>
#include <string>

namespace dear::cuda {

enum class MemoryKind {
  kHost,    // ordinary, pinned or managed memory: the CPU can read and write it directly
  kDevice,  // cudaMalloc'd memory of `device`: must be staged for a transport on the CPU
};

struct Location {
  MemoryKind kind = MemoryKind::kHost;
  int device = -1;  // for kDevice
};

// Asks the CUDA runtime (cudaPointerGetAttributes). Null, unregistered host memory, and any
// pointer when no driver or device is present are kHost; so is managed memory, which the CPU
// can touch (more slowly) without staging. Never throws.
[[nodiscard]] Location locate(const void* p) noexcept;

// Page-locked host memory that the device addresses too (cudaHostAlloc, portable and mapped):
// `host` for the CPU, `device` for kernels and stream operations. Freed with cudaFreeHost(host).
// Throws dear::Error naming the CUDA error and `what`, with `rank`.
struct MappedMemory {
  void* host = nullptr;
  void* device = nullptr;
};
[[nodiscard]] MappedMemory alloc_mapped(std::size_t bytes, const std::string& what, int rank = -1);

}  // namespace dear::cuda
