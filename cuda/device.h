// Device discovery for the optional CUDA layer.
#pragma once

#include <string>

namespace dear::cuda {

// Number of CUDA devices usable by this process; 0 when there is no driver or no device.
[[nodiscard]] int device_count() noexcept;
// Why no device is usable ("no CUDA driver", ...), or empty when one is.
[[nodiscard]] std::string unavailable_reason();

}  // namespace dear::cuda
