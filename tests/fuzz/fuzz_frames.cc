// Fuzzes the receive state machine of a real TcpChannel: the input is written, as a peer would
// send it, into a loopback TCP connection whose other end is the channel, and the channel is
// driven by a sink that takes every message (straight into memory, streamed in pieces, or
// discarded, chosen from the header). Beyond "no crash, no sanitizer report", the sink checks
// the link contract: pieces stay inside the message, stream pieces are multiples of the unit
// until the last, and each message completes once with all its bytes.
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <vector>

#include "dear/error.h"
#include "transport/socket_util.h"
#include "transport/tcp/tcp_channel.h"

namespace tr = dear::transport;

namespace {

void require(bool ok) {
  if (!ok) __builtin_trap();
}

// Connections close with a reset, so that millions of runs leave no TIME_WAIT behind.
void reset_on_close(int fd) {
  const linger l{1, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_LINGER, &l, sizeof(l));
}

class Sink final : public tr::RecvSink {
 public:
  tr::RecvTarget on_header(int, const tr::FrameHeader& h) override {
    require(!open_);
    open_ = true;
    got_ = 0;
    tr::RecvTarget t;
    switch (h.kind % 3) {
      case 0:
        if (h.bytes <= (1u << 20)) {
          direct_.resize(h.bytes);
          t.mode = tr::RecvTarget::kDirect;
          t.dst = direct_.data();
        }
        break;
      case 1:
        t.mode = tr::RecvTarget::kStream;
        t.unit = std::size_t{1} << (h.dtype % 4);
        break;
      default: break;
    }
    unit_ = t.mode == tr::RecvTarget::kStream ? t.unit : 1;
    return t;
  }
  void on_payload(int, const tr::FrameHeader& h, const char* data, std::size_t offset,
                  std::size_t len) override {
    require(open_ && offset == got_ && offset + len <= h.bytes);
    require(len % unit_ == 0 || offset + len == h.bytes);
    for (std::size_t i = 0; i < len; ++i) sum_ += static_cast<unsigned char>(data[i]);
    got_ += len;
  }
  void on_message(int, const tr::FrameHeader& h) override {
    require(open_);
    require(unit_ == 1 || got_ == h.bytes);
    open_ = false;
  }
  void on_sent(int, std::uint64_t) override {}
  void on_closed(int) override { closed_ = true; }
  [[nodiscard]] bool closed() const { return closed_; }

 private:
  bool open_ = false;
  bool closed_ = false;
  std::size_t got_ = 0;
  std::size_t unit_ = 1;
  unsigned sum_ = 0;
  std::vector<char> direct_;
};

tr::Fd& listener() {
  static tr::Fd fd = tr::listen_on(tr::resolve("127.0.0.1", 0));
  return fd;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const tr::SockAddr addr = tr::local_address(listener().get());
  tr::Fd writer = tr::connect_with_retry(addr, tr::deadline_after(std::chrono::seconds(5)), "fuzz");
  tr::Fd reader = tr::accept_until(listener().get(), tr::deadline_after(std::chrono::seconds(5)));
  require(writer.valid() && reader.valid());
  reset_on_close(writer.get());
  reset_on_close(reader.get());
  tr::tcp::TcpChannel channel(std::move(reader), 0, 1, 0);
  Sink sink;
  std::size_t sent = 0;
  bool eof_sent = false;
  try {
    for (int idle = 0; idle < 1000 && !channel.closed();) {
      if (sent < size) {
        const ssize_t n =
            ::send(writer.get(), data + sent, size - sent, MSG_DONTWAIT | MSG_NOSIGNAL);
        if (n > 0) sent += static_cast<std::size_t>(n);
      } else if (!eof_sent) {
        ::shutdown(writer.get(), SHUT_WR);
        eof_sent = true;
      }
      if (channel.progress(sink, true)) {
        idle = 0;
      } else if (eof_sent) {
        ++idle;
        ::usleep(10);
      }
    }
  } catch (const dear::Error&) {
    // A protocol violation or a truncated message: the channel failed as it should.
    return 0;
  }
  // The peer's FIN must be seen: a channel that stops reading would hang a job.
  require(channel.closed() && sink.closed());
  return 0;
}
