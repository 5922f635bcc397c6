// Device discovery for the optional CUDA layer.
#pragma once

#include <string>

namespace dear::cuda {

// Number of CUDA devices usable by this process; 0 when there is no driver or no device.
[[nodiscard]] int device_count() noexcept;
// Why no device is usable ("no CUDA driver", ...), or empty when one is.
[[nodiscard]] std::string unavailable_reason();

// Makes `device` current for the calling thread for its lifetime and restores the previous one
// (defined in error.cc). Throws dear::Error naming the CUDA error, with `rank`.
class CurrentDevice {
 public:
  CurrentDevice(int device, int rank);
  ~CurrentDevice();
  CurrentDevice(const CurrentDevice&) = delete;
  CurrentDevice& operator=(const CurrentDevice&) = delete;

 private:
  int previous_ = 0;
  int device_ = 0;
};

}  // namespace dear::cuda
