#include "transport/tcp/tcp_channel.h"

#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "dear/error.h"

namespace dear::transport::tcp {
namespace {

constexpr std::uint32_t kLinkMagic = 0x4b4e4c44;  // "DLNK"
constexpr std::uint32_t kLinkVersion = 1;
constexpr std::size_t kHeader = sizeof(FrameHeader);
// Payload remainders at least this large are read straight into their destination; smaller
// ones go through the inbox so that one read can also pick up the next headers.
constexpr std::size_t kDirectReadMin = 4096;
constexpr std::size_t kHeaderReadBytes = 16 * 1024;
// Bytes read per progress() call at most, so one busy channel cannot starve the others.
constexpr std::size_t kReadBudget = 4 * 1024 * 1024;

bool would_block(int err) { return err == EAGAIN || err == EWOULDBLOCK || err == EINTR; }

}  // namespace

TcpChannel::TcpChannel(Fd fd, int self_rank, int peer_rank, int index)
    : fd_(std::move(fd)),
      self_(self_rank),
      peer_(peer_rank),
      index_(index),
      inbox_(new char[kInboxBytes]) {
  set_nonblocking(fd_.get());
  set_nodelay(fd_.get());
  if (const char* b = std::getenv("DEAR_SOCKET_BUFFER")) {
    const int bytes = std::atoi(b);
    ::setsockopt(fd_.get(), SOL_SOCKET, SO_SNDBUF, &bytes, sizeof(bytes));
    ::setsockopt(fd_.get(), SOL_SOCKET, SO_RCVBUF, &bytes, sizeof(bytes));
  }
}

TcpChannel::~TcpChannel() { close(); }

std::string TcpChannel::describe() const {
  return "tcp channel " + std::to_string(index_) + " between rank " + std::to_string(self_) +
         " and rank " + std::to_string(peer_);
}

void TcpChannel::fail(const std::string& why) const {
  throw Error(ErrorCode::kPeerFailed, why + " on " + describe(), self_, peer_);
}

bool TcpChannel::try_send(const FrameHeader& h, const void* payload, std::uint64_t token) {
  if (count_ == kQueueCapacity) return false;
  if (!fd_.valid()) fail("send on a closed connection");
  queue_[(head_ + count_) % kQueueCapacity] = {h, static_cast<const char*>(payload), token};
  ++count_;
  queued_bytes_ += h.bytes;
  return true;
}

pollfd TcpChannel::wait_spec() const {
  if (!fd_.valid()) return {-1, 0, 0};
  short events = POLLIN;
  if (count_ > 0 && write_blocked_) events |= POLLOUT;
  return {fd_.get(), events, 0};
}

bool TcpChannel::progress(RecvSink& sink) {
  if (!fd_.valid()) return false;
  bool moved = flush(sink);
  if (fd_.valid()) moved |= receive(sink);
  return moved;
}

bool TcpChannel::flush(RecvSink& sink) {
  bool moved = false;
  while (count_ > 0) {
    // Gather as many queued messages as fit in one sendmsg().
    int n_iov = 0;
    std::size_t total = 0;
    for (std::size_t i = 0; i < count_ && n_iov + 2 <= kMaxIov; ++i) {
      const Pending& m = queue_[(head_ + i) % kQueueCapacity];
      std::size_t skip = i == 0 ? head_offset_ : 0;
      if (skip < kHeader) {
        iov_[n_iov++] = {const_cast<char*>(reinterpret_cast<const char*>(&m.header)) + skip,
                         kHeader - skip};
        total += kHeader - skip;
        skip = 0;
      } else {
        skip -= kHeader;
      }
      if (m.header.bytes > skip) {
        iov_[n_iov++] = {const_cast<char*>(m.payload) + skip, m.header.bytes - skip};
        total += m.header.bytes - skip;
      }
    }
    msghdr msg{};
    msg.msg_iov = iov_.data();
    msg.msg_iovlen = static_cast<std::size_t>(n_iov);
    const ssize_t n = ::sendmsg(fd_.get(), &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n < 0) {
      if (would_block(errno)) {
        write_blocked_ = errno != EINTR;
        return moved;
      }
      fail(std::string("connection lost while sending (") + std::strerror(errno) + ")");
    }
    moved = true;
    std::size_t left = static_cast<std::size_t>(n);
    while (left > 0 || (count_ > 0 && head_offset_ == kHeader + queue_[head_].header.bytes)) {
      const Pending& m = queue_[head_];
      const std::size_t msg_left = kHeader + m.header.bytes - head_offset_;
      const std::size_t take = std::min(left, msg_left);
      head_offset_ += take;
      left -= take;
      if (head_offset_ == kHeader + m.header.bytes) {
        const std::uint64_t token = m.token;
        head_ = (head_ + 1) % kQueueCapacity;
        --count_;
        queued_bytes_ -= m.header.bytes;
        head_offset_ = 0;
        sink.on_sent(index_, token);
      } else {
        break;
      }
    }
    if (static_cast<std::size_t>(n) < total) {
      write_blocked_ = true;
      return moved;
    }
    write_blocked_ = false;
  }
  return moved;
}

bool TcpChannel::consume_buffered(RecvSink& sink) {
  const std::size_t avail = wpos_ - rpos_;
  const std::size_t need = current_.bytes - done_;
  std::size_t take = std::min(avail, need);
  if (take > 0) {
    switch (target_.mode) {
      case RecvTarget::kDirect:
        std::memcpy(target_.dst + done_, inbox_.get() + rpos_, take);
        break;
      case RecvTarget::kStream:
        // Pieces must start aligned to the element size (the reduction kernels read typed
        // elements); after odd-sized messages the inbox position may not be.
        if (reinterpret_cast<std::uintptr_t>(inbox_.get() + rpos_) % target_.unit != 0) {
          std::memmove(inbox_.get(), inbox_.get() + rpos_, avail);
          wpos_ = avail;
          rpos_ = 0;
        }
        if (take < need) take -= take % target_.unit;
        if (take > 0) sink.on_payload(index_, current_, inbox_.get() + rpos_, done_, take);
        break;
      case RecvTarget::kDiscard:
        break;
    }
    rpos_ += take;
    done_ += take;
  }
  if (done_ == current_.bytes) {
    in_payload_ = false;
    sink.on_message(index_, current_);
    return true;
  }
  return false;
}

bool TcpChannel::receive(RecvSink& sink) {
  bool moved = false;
  std::size_t budget = kReadBudget;
  while (budget > 0 && fd_.valid()) {
    if (!in_payload_) {
      if (wpos_ - rpos_ >= kHeader) {
        std::memcpy(&current_, inbox_.get() + rpos_, kHeader);
        rpos_ += kHeader;
        in_payload_ = true;
        done_ = 0;
        target_ = sink.on_header(index_, current_);
        if (target_.unit == 0) target_.unit = 1;
        moved = true;
        consume_buffered(sink);
        continue;
      }
    } else if (wpos_ > rpos_) {
      moved = true;
      if (consume_buffered(sink)) continue;
    }
    // Need more bytes from the socket.
    char* into;
    std::size_t want;
    const std::size_t need = in_payload_ ? current_.bytes - done_ : 0;
    if (in_payload_ && target_.mode == RecvTarget::kDirect && rpos_ == wpos_ &&
        need >= kDirectReadMin) {
      into = target_.dst + done_;
      want = need;
    } else {
      if (rpos_ > 0) {
        std::memmove(inbox_.get(), inbox_.get() + rpos_, wpos_ - rpos_);
        wpos_ -= rpos_;
        rpos_ = 0;
      }
      into = inbox_.get() + wpos_;
      want = kInboxBytes - wpos_;
      // Between messages, read a little: enough to batch small messages, not so much that a
      // large payload bound for its destination gets copied through the inbox.
      if (!in_payload_ || target_.mode == RecvTarget::kDirect) {
        want = std::min(want, kHeaderReadBytes);
      }
    }
    const ssize_t n = ::recv(fd_.get(), into, want, MSG_DONTWAIT);
    if (n > 0) {
      moved = true;
      budget -= std::min(budget, static_cast<std::size_t>(n));
      if (into == inbox_.get() + wpos_) {
        wpos_ += static_cast<std::size_t>(n);
      } else {
        done_ += static_cast<std::size_t>(n);
        if (done_ == current_.bytes) {
          in_payload_ = false;
          sink.on_message(index_, current_);
        }
      }
      continue;
    }
    if (n == 0) {
      if (in_payload_ || wpos_ != rpos_) fail("connection closed in the middle of a message");
      fd_.reset();
      sink.on_closed(index_);
      return true;
    }
    if (would_block(errno)) break;
    fail(std::string("connection lost while receiving (") + std::strerror(errno) + ")");
  }
  return moved;
}

void TcpChannel::close() {
  if (!fd_.valid()) return;
  // Hand over what is queued if the socket takes it at once; then drain what has arrived, so
  // the close is a FIN and not a reset that could destroy data the peer has yet to read.
  struct NullSink final : RecvSink {
    RecvTarget on_header(int, const FrameHeader&) override { return {}; }
    void on_payload(int, const FrameHeader&, const char*, std::size_t, std::size_t) override {}
    void on_message(int, const FrameHeader&) override {}
    void on_sent(int, std::uint64_t) override {}
    void on_closed(int) override {}
  } null_sink;
  try {
    flush(null_sink);
  } catch (const Error&) {
    // Closing anyway.
  }
  ::shutdown(fd_.get(), SHUT_WR);
  char buf[4096];
  for (int i = 0; i < 64; ++i) {
    const ssize_t n = ::recv(fd_.get(), buf, sizeof(buf), MSG_DONTWAIT);
    if (n <= 0) break;
  }
  fd_.reset();
  count_ = 0;
  queued_bytes_ = 0;
}

std::vector<std::unique_ptr<Channel>> connect_link(const SockAddr& peer_addr, int self_rank,
                                                   int peer_rank, int channels,
                                                   const std::uint8_t* secret,
                                                   std::uint64_t comm_tag, Deadline deadline) {
  std::vector<std::unique_ptr<Channel>> out;
  for (int c = 0; c < channels; ++c) {
    const std::string what = "link to rank " + std::to_string(peer_rank) + " at " +
                             peer_addr.to_string();
    Fd fd = connect_with_retry(peer_addr, deadline, what);
    LinkHello h{};
    h.magic = kLinkMagic;
    h.version = kLinkVersion;
    std::memcpy(h.secret, secret, sizeof(h.secret));
    h.rank = self_rank;
    h.channel = c;
    h.comm_tag = comm_tag;
    write_all(fd.get(), &h, sizeof(h), deadline, what);
    out.push_back(std::make_unique<TcpChannel>(std::move(fd), self_rank, peer_rank, c));
  }
  return out;
}

std::vector<std::vector<std::unique_ptr<Channel>>> accept_links(
    int listen_fd, int self_rank, const std::vector<int>& peers, int channels,
    const std::uint8_t* secret, std::uint64_t comm_tag, Deadline deadline) {
  std::vector<std::vector<std::unique_ptr<Channel>>> out(peers.size());
  for (auto& v : out) v.resize(static_cast<std::size_t>(channels));
  std::size_t missing = peers.size() * static_cast<std::size_t>(channels);
  while (missing > 0) {
    Fd fd = accept_until(listen_fd, deadline);
    if (!fd.valid()) {
      throw Error(ErrorCode::kTimeout,
                  "links: " + std::to_string(missing) +
                      " connection(s) from peers never arrived before the deadline",
                  self_rank);
    }
    const std::string from = peer_address(fd.get()).to_string();
    LinkHello h{};
    try {
      // A connection that does not introduce itself quickly is not one of ours.
      read_all(fd.get(), &h, sizeof(h),
               std::min(deadline, Clock::now() + std::chrono::seconds(5)), "link handshake");
    } catch (const Error&) {
      std::fprintf(stderr, "dear rank %d: dropped a link connection from %s: no handshake\n",
                   self_rank, from.c_str());
      continue;
    }
    if (h.magic != kLinkMagic || h.version != kLinkVersion ||
        !equal_secret(h.secret, secret, sizeof(h.secret)) || h.comm_tag != comm_tag) {
      std::fprintf(stderr,
                   "dear rank %d: dropped a link connection from %s: wrong secret or "
                   "communicator\n",
                   self_rank, from.c_str());
      continue;
    }
    const auto it = std::find(peers.begin(), peers.end(), h.rank);
    if (it == peers.end() || h.channel < 0 || h.channel >= channels ||
        out[static_cast<std::size_t>(it - peers.begin())][static_cast<std::size_t>(h.channel)]) {
      throw Error(ErrorCode::kBootstrap,
                  "unexpected link connection from rank " + std::to_string(h.rank) +
                      " channel " + std::to_string(h.channel),
                  self_rank, h.rank);
    }
    out[static_cast<std::size_t>(it - peers.begin())][static_cast<std::size_t>(h.channel)] =
        std::make_unique<TcpChannel>(std::move(fd), self_rank, h.rank, h.channel);
    --missing;
  }
  return out;
}

}  // namespace dear::transport::tcp
