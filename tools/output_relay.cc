#include "tools/output_relay.h"

#include <poll.h>
#include <unistd.h>

#include <cerrno>
#include <string>

namespace dear::tools {

void LineRelay::feed(std::string_view data, std::string& out) {
  std::size_t start = 0;
  for (std::size_t nl = data.find('\n'); nl != std::string_view::npos;
       nl = data.find('\n', start)) {
    out += prefix_;
    out += partial_;
    out.append(data.substr(start, nl + 1 - start));
    partial_.clear();
    start = nl + 1;
  }
  partial_.append(data.substr(start));
  while (partial_.size() >= kMaxLine) {
    out += prefix_;
    out.append(partial_, 0, kMaxLine);
    out += '\n';
    partial_.erase(0, kMaxLine);
  }
}

void LineRelay::finish(std::string& out) {
  if (partial_.empty()) return;
  out += prefix_;
  out += partial_;
  out += '\n';
  partial_.clear();
}

std::string rank_prefix(int rank, int world_size) {
  const std::size_t width = std::to_string(world_size > 1 ? world_size - 1 : 0).size();
  std::string digits = std::to_string(rank);
  if (digits.size() < width) digits.insert(0, width - digits.size(), ' ');
  return "[" + digits + "] ";
}

void OutputSink::write(std::string_view data) {
  while (!data.empty() && !broken_) {
    const ssize_t n = ::write(fd_, data.data(), data.size());
    if (n >= 0) {
      data.remove_prefix(static_cast<std::size_t>(n));
      continue;
    }
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) {
      // Inherited a non-blocking stdout: wait for room rather than lose lines.
      pollfd pfd{fd_, POLLOUT, 0};
      while (::poll(&pfd, 1, -1) < 0 && errno == EINTR) {
      }
      continue;
    }
    broken_ = true;
  }
}

}  // namespace dear::tools
