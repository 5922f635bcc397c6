// The CUDA driver's functions, reached through the runtime's entry points (cudaGetDriverEntryPoint)
// rather than by linking libcuda: a build links the runtime only, and a machine whose driver
// lacks a function finds it missing here instead of failing to load.
#pragma once

namespace dear::cuda {

// The driver function `symbol` ("cuMemGetHandleForAddressRange", ...) as of CUDA 12.0, or
// nullptr where the driver has none (or there is no driver). Never throws.
[[nodiscard]] void* driver_entry_point(const char* symbol) noexcept;

}  // namespace dear::cuda
