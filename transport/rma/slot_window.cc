#include "transport/rma/slot_window.h"

#include <algorithm>
#include <string>

#include "dear/error.h"

namespace dear::transport::rma {

SendWindow::SendWindow(std::uint32_t slots, std::uint32_t first_seq)
    : slots_(slots), credits_(slots), next_seq_(first_seq) {
  if (slots == 0) throw Error(ErrorCode::kInvalidArgument, "SendWindow: slots must be > 0");
}

std::uint32_t SendWindow::take() {
  if (credits_ == 0) throw Error(ErrorCode::kInternal, "SendWindow::take without a credit");
  --credits_;
  return next_seq_++;
}

bool SendWindow::on_returned(std::uint32_t n) {
  if (n > unacknowledged()) return false;
  credits_ += n;
  return true;
}

RecvWindow::RecvWindow(std::uint32_t slots, std::uint32_t return_threshold, std::uint32_t first_seq)
    : slots_(slots), threshold_(return_threshold), expected_(first_seq), buffer_of_(slots, kEmpty) {
  if (slots == 0 || return_threshold == 0 || return_threshold > slots) {
    throw Error(ErrorCode::kInvalidArgument,
                "RecvWindow: slots=" + std::to_string(slots) + " and return_threshold=" +
                    std::to_string(return_threshold) + " need 1 <= threshold <= slots");
  }
}

bool RecvWindow::arrived(std::uint32_t seq, std::uint32_t buffer) {
  // The sender holds at most `slots` unacknowledged fragments, and credits for
  // fragments not yet consumed here are not returned, so seq lies in [expected,
  // expected + slots).
  if (buffer == kEmpty || static_cast<std::uint32_t>(seq - expected_) >= slots_) return false;
  std::uint32_t& b = buffer_of_[seq % slots_];
  if (b != kEmpty) return false;
  b = buffer;
  return true;
}

std::optional<std::uint32_t> RecvWindow::next_ready() const {
  const std::uint32_t b = buffer_of_[expected_ % slots_];
  if (b == kEmpty) return std::nullopt;
  return b;
}

void RecvWindow::consume() {
  std::uint32_t& b = buffer_of_[expected_ % slots_];
  if (b == kEmpty) throw Error(ErrorCode::kInternal, "RecvWindow::consume before arrival");
  b = kEmpty;
  ++expected_;
  ++owed_;
}

std::uint32_t RecvWindow::take_owed() {
  const std::uint32_t n = owed_;
  owed_ = 0;
  return n;
}

}  // namespace dear::transport::rma
