#include "dear/error.h"

#include <sstream>
#include <utility>

namespace dear {
namespace {

std::string describe(ErrorCode code, const std::string& cause, int rank, int peer,
                     const std::string& op, std::int64_t seq) {
  std::ostringstream s;
  s << "dear";
  if (rank != Error::kNone) s << " rank " << rank;
  if (!op.empty()) {
    s << " " << op;
    if (seq != Error::kNone) s << " #" << seq;
  }
  if (peer != Error::kNone) s << " (peer " << peer << ")";
  s << ": " << to_string(code) << ": " << cause;
  return s.str();
}

}  // namespace

std::string_view to_string(ErrorCode code) noexcept {
  switch (code) {
    case ErrorCode::kInvalidArgument: return "invalid argument";
    case ErrorCode::kMismatch: return "mismatch between ranks";
    case ErrorCode::kPeerFailed: return "peer failed";
    case ErrorCode::kTimeout: return "timeout";
    case ErrorCode::kAborted: return "aborted";
    case ErrorCode::kBootstrap: return "bootstrap failed";
    case ErrorCode::kSystem: return "system error";
    case ErrorCode::kInternal: return "internal error";
  }
  return "unknown error";
}

Error::Error(ErrorCode code, std::string cause, int rank, int peer, std::string op,
             std::int64_t seq)
    : std::runtime_error(describe(code, cause, rank, peer, op, seq)),
      code_(code),
      rank_(rank),
      peer_(peer),
      op_(std::move(op)),
      seq_(seq),
      cause_(std::move(cause)) {}

}  // namespace dear
