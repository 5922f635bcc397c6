// Argument checks every communicator makes alike, with the error that names the argument.
#pragma once

#include <string>

#include "dear/error.h"

namespace dear {

// Throws Error(kInvalidArgument) unless 0 <= root < size, naming the call `op` and the rank.
inline void check_root(int root, int size, int rank, const char* op) {
  if (root < 0 || root >= size) {
    throw Error(ErrorCode::kInvalidArgument,
                "root=" + std::to_string(root) + " is outside [0, " + std::to_string(size) + ")",
                rank, Error::kNone, op);
  }
}

}  // namespace dear
