// The one error type of the library.
//
// Every failure that reaches a user is a dear::Error. It says which rank saw it, which peer
// (if any) is to blame, which operation and sequence number were affected, and why, so that a
// message from any rank of a failed job can be read on its own.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <string_view>

namespace dear {

enum class ErrorCode : std::uint8_t {
  kInvalidArgument,  // the caller passed something that cannot work (names the argument)
  kMismatch,         // ranks disagree about an operation (count, dtype, op, root, order)
  kPeerFailed,       // a peer closed its connection, died, or reported an error itself
  kTimeout,          // an operation or the bootstrap ran past its deadline
  kAborted,          // Communicator::abort() or a fatal error elsewhere ended the work
  kBootstrap,        // rendezvous failed (bad id, wrong secret, address in use, ...)
  kSystem,           // an operating-system call failed
  kInternal,         // a broken invariant inside dear: please report it
};

[[nodiscard]] std::string_view to_string(ErrorCode code) noexcept;

class Error : public std::runtime_error {
 public:
  static constexpr int kNone = -1;

  Error(ErrorCode code, std::string cause, int rank = kNone, int peer = kNone, std::string op = {},
        std::int64_t seq = kNone);

  [[nodiscard]] ErrorCode code() const noexcept { return code_; }
  [[nodiscard]] int rank() const noexcept { return rank_; }
  [[nodiscard]] int peer() const noexcept { return peer_; }
  [[nodiscard]] const std::string& op() const noexcept { return op_; }
  [[nodiscard]] std::int64_t seq() const noexcept { return seq_; }
  // The bare reason, without the rank/peer/op prefix that what() carries.
  [[nodiscard]] const std::string& cause() const noexcept { return cause_; }

 private:
  ErrorCode code_;
  int rank_;
  int peer_;
  std::string op_;
  std::int64_t seq_;
  std::string cause_;
};

}  // namespace dear
