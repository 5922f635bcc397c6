#include "cuda/error.h"

#include "cuda/device.h"

namespace dear::cuda {

std::string describe(cudaError_t rc, const std::string& what) {
  return what + ": " + cudaGetErrorName(rc) + " (" + cudaGetErrorString(rc) + ")";
}

void check(cudaError_t rc, const std::string& what, int rank) {
  if (rc == cudaSuccess) return;
  (void)cudaGetLastError();
  throw Error(ErrorCode::kSystem, describe(rc, what), rank);
}

CurrentDevice::CurrentDevice(int device, int rank) {
  check(cudaGetDevice(&previous_), "cudaGetDevice", rank);
  if (device != previous_) check(cudaSetDevice(device), "cudaSetDevice", rank);
  device_ = device;
}

CurrentDevice::~CurrentDevice() {
  if (device_ != previous_) (void)cudaSetDevice(previous_);
}

}  // namespace dear::cuda
