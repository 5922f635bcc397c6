#include "cuda/error.h"

namespace dear::cuda {

std::string describe(cudaError_t rc, const std::string& what) {
  return what + ": " + cudaGetErrorName(rc) + " (" + cudaGetErrorString(rc) + ")";
}

void check(cudaError_t rc, const std::string& what, int rank) {
  if (rc == cudaSuccess) return;
  (void)cudaGetLastError();
  throw Error(ErrorCode::kSystem, describe(rc, what), rank);
}

}  // namespace dear::cuda
