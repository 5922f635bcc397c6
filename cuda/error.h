// CUDA runtime errors as dear::Error.
#pragma once

#include <cuda_runtime_api.h>

#include <string>

#include "dear/error.h"

namespace dear::cuda {

// "what: cudaErrorName (description)"; the message every CUDA failure in dear carries.
[[nodiscard]] std::string describe(cudaError_t rc, const std::string& what);

// Throws dear::Error(kSystem) naming the CUDA error, `what` was being done, and the rank
// (Error::kNone when not known). Clears the runtime's last-error state first, so a
// non-sticky error does not resurface in an unrelated later call.
void check(cudaError_t rc, const std::string& what, int rank = Error::kNone);

}  // namespace dear::cuda
