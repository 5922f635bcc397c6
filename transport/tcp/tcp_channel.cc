#include "transport/tcp/tcp_channel.h"

#include <fcntl.h>
#include <linux/sockios.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "common/env.h"
#include "dear/error.h"
#include "transport/auth.h"

namespace dear::transport::tcp {
namespace {

constexpr std::size_t kHeader = sizeof(FrameHeader);
// Payload remainders at least this large are read straight into their destination; smaller
// ones go through the inbox so that one read can also pick up the next headers.
constexpr std::size_t kDirectReadMin = 4096;
constexpr std::size_t kHeaderReadBytes = 16 * 1024;
// Bytes read per progress() call at most, so one busy channel cannot starve the others.
constexpr std::size_t kReadBudget = 4 * 1024 * 1024;

bool would_block(int err) { return err == EAGAIN || err == EWOULDBLOCK || err == EINTR; }

// splice() has no MSG_NOSIGNAL: into a socket whose peer has gone it raises SIGPIPE, which
// by default ends the process. Blocks SIGPIPE on this thread for the call and takes away one
// the call raised, so the failure is only the EPIPE it returns. A SIGPIPE already pending
// before is left alone.
ssize_t splice_no_sigpipe(int from, int to, std::size_t bytes) {
  sigset_t pipe_set;
  sigset_t old;
  sigemptyset(&pipe_set);
  sigaddset(&pipe_set, SIGPIPE);
  pthread_sigmask(SIG_BLOCK, &pipe_set, &old);
  sigset_t pending;
  sigpending(&pending);
  const bool was_pending = sigismember(&pending, SIGPIPE) == 1;
  const ssize_t n = ::splice(from, nullptr, to, nullptr, bytes, SPLICE_F_MOVE | SPLICE_F_NONBLOCK);
  const int err = errno;
  if (n < 0 && err == EPIPE && !was_pending) {
    const timespec zero{0, 0};
    (void)sigtimedwait(&pipe_set, nullptr, &zero);
  }
  pthread_sigmask(SIG_SETMASK, &old, nullptr);
  errno = err;
  return n;
}

// The peer's side is gone: it closed its socket (a reset when our data, or data arriving
// after its close, found it unread) or its process ended.
bool peer_gone(int err) { return err == ECONNRESET || err == EPIPE; }

constexpr std::uint64_t kMinSocketBuffer = 4 << 10;
// What a channel asks for its splice pipe.
constexpr std::size_t kPipeBytes = 1 << 20;
constexpr std::uint64_t kMaxSocketBuffer = 1 << 30;

}  // namespace

TcpChannel::TcpChannel(Fd fd, int self_rank, int peer_rank, int index)
    : fd_(std::move(fd)),
      self_(self_rank),
      peer_(peer_rank),
      index_(index),
      inbox_(new char[kInboxBytes]) {
  set_nonblocking(fd_.get());
  set_nodelay(fd_.get());
  if (const auto b = socket_buffer_from_env()) {
    const int bytes = static_cast<int>(*b);
    ::setsockopt(fd_.get(), SOL_SOCKET, SO_SNDBUF, &bytes, sizeof(bytes));
    ::setsockopt(fd_.get(), SOL_SOCKET, SO_RCVBUF, &bytes, sizeof(bytes));
  }
  zerocopy_min_ = zerocopy_bytes_from_env();
  int p[2] = {-1, -1};
  if (zerocopy_min_ > 0 && ::pipe2(p, O_NONBLOCK | O_CLOEXEC) == 0) {
    pipe_read_.reset(p[0]);
    pipe_write_.reset(p[1]);
    // A larger pipe moves more per splice; the kernel may refuse (fs.pipe-max-size).
    (void)::fcntl(p[1], F_SETPIPE_SZ, static_cast<int>(kPipeBytes));
    const int cap = ::fcntl(p[1], F_GETPIPE_SZ);
    pipe_capacity_ = cap > 0 ? static_cast<std::size_t>(cap) : 0;
  }
  // Without a pipe (out of descriptors, say) every payload is copied as before.
  if (pipe_capacity_ == 0) zerocopy_min_ = 0;
}

std::size_t zerocopy_bytes_from_env() {
  return env::get_bytes("DEAR_TCP_ZEROCOPY_BYTES").value_or(kZeroCopyBytes);
}

std::optional<std::size_t> socket_buffer_from_env() {
  const auto b = env::get_bytes("DEAR_SOCKET_BUFFER");
  if (b && (*b < kMinSocketBuffer || *b > kMaxSocketBuffer)) {
    throw Error(ErrorCode::kInvalidArgument, "environment variable DEAR_SOCKET_BUFFER=" +
                                                 std::to_string(*b) + " is outside [4K, 1G] bytes");
  }
  return b;
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
  if (count_ + awaiting_count_ == kQueueCapacity) return false;
  if (!fd_.valid()) fail("send on a closed connection");
  Pending& m = queue_[(head_ + count_) % kQueueCapacity];
  m = {h, static_cast<const char*>(payload), token};
  if (zerocopy_min_ > 0 && h.type == FrameType::kData && h.bytes >= zerocopy_min_) {
    m.header.type = static_cast<FrameType>(static_cast<std::uint8_t>(h.type) | kAckBit);
  }
  ++count_;
  queued_bytes_ += h.bytes;
  return true;
}

pollfd TcpChannel::wait_spec() const {
  if (!fd_.valid()) return {-1, 0, 0};
  short events = POLLIN;
  const bool to_write = count_ > 0 || pipe_bytes_ > 0 || acks_owed_ > 0 || ack_left_ > 0;
  if (to_write && write_blocked_) events |= POLLOUT;
  return {fd_.get(), events, 0};
}

bool TcpChannel::progress(RecvSink& sink, bool may_read) {
  if (!fd_.valid()) return false;
  bool moved = flush(sink);
  if (fd_.valid()) moved |= receive(sink, may_read ? kReadBudget : 0);
  // What was just read may be owed a consumed notice: the peer is waiting for it.
  if (fd_.valid() && acks_owed_ > 0) moved |= flush(sink);
  return moved;
}

void TcpChannel::send_failed(const char* what) {
  if (would_block(errno)) {
    write_blocked_ = errno != EINTR;
    return;
  }
  // A peer that closed its end cannot take what is queued. What it sent before closing
  // may still wait in the socket, so the close is reported by receive() once that has
  // been read; operations that still expected to send here learn of it then.
  if (peer_gone(errno)) {
    send_gone_ = true;
    drop_queue();
    return;
  }
  fail(std::string("connection lost while ") + what + " (" + std::strerror(errno) + ")");
}

bool TcpChannel::flush_spliced(bool& moved) {
  for (;;) {
    // Bytes in the pipe go to the socket before anything else is written.
    while (pipe_bytes_ > 0) {
      const ssize_t n = splice_no_sigpipe(pipe_read_.get(), fd_.get(), pipe_bytes_);
      if (n == 0) fail("splice moved nothing out of a pipe that holds bytes");
      if (n < 0) {
        send_failed("splicing");
        return false;
      }
      moved = true;
      pipe_bytes_ -= static_cast<std::size_t>(n);
    }
    if (!splicing_) return true;
    const Pending& m = queue_[head_];
    const std::size_t off = head_offset_ - kHeader;
    if (off == m.header.bytes) {
      // All of it is the kernel's now; reported sent when the peer has read it.
      awaiting_[(awaiting_head_ + awaiting_count_) % kQueueCapacity] = pop_head();
      ++awaiting_count_;
      splicing_ = false;
      return true;
    }
    iovec v{const_cast<char*>(m.payload) + off,
            std::min<std::size_t>(m.header.bytes - off, pipe_capacity_)};
    ssize_t n = ::vmsplice(pipe_write_.get(), &v, 1, SPLICE_F_NONBLOCK);
    if (n > 0) {
      pipe_bytes_ = static_cast<std::size_t>(n);
    } else if (errno != EAGAIN && errno != EINTR) {
      // Memory the kernel cannot splice from: copy it, as every payload once was. The peer
      // still sends the notice this header asked for.
      zerocopy_min_ = 0;
      n = ::send(fd_.get(), v.iov_base, v.iov_len, MSG_NOSIGNAL | MSG_DONTWAIT);
      if (n < 0) {
        send_failed("sending");
        return false;
      }
    } else {
      write_blocked_ = true;
      return false;
    }
    moved = true;
    head_offset_ += static_cast<std::size_t>(n);
  }
}

bool TcpChannel::flush(RecvSink& sink) {
  if (send_gone_) {
    drop_queue();
    return false;
  }
  bool moved = false;
  for (;;) {
    if (!flush_spliced(moved)) return moved || send_gone_;
    // A consumed notice is due and the stream is between messages: it goes first.
    if (acks_owed_ > 0 && ack_left_ == 0 && head_offset_ == 0) {
      ack_ = FrameHeader{};
      ack_.type = FrameType::kConsumed;
      ack_.count = acks_owed_;
      acks_owed_ = 0;
      ack_left_ = kHeader;
    }
    if (count_ == 0 && ack_left_ == 0) break;
    // Gather the notice and as many queued messages as fit in one sendmsg(), up to the
    // header of a message whose payload is spliced.
    int n_iov = 0;
    std::size_t total = 0;
    if (ack_left_ > 0) {
      iov_[n_iov++] = {reinterpret_cast<char*>(&ack_) + (kHeader - ack_left_), ack_left_};
      total += ack_left_;
    }
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
      if (asks_consumed(m.header)) break;
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
      send_failed("sending");
      return moved || send_gone_;
    }
    moved = true;
    std::size_t left = static_cast<std::size_t>(n);
    const std::size_t ack_take = std::min(left, ack_left_);
    ack_left_ -= ack_take;
    left -= ack_take;
    while (count_ > 0 && !splicing_) {
      const Pending& m = queue_[head_];
      const bool spliced = asks_consumed(m.header);
      const std::size_t end = spliced ? kHeader : kHeader + m.header.bytes;
      const std::size_t take = std::min(left, end - head_offset_);
      head_offset_ += take;
      left -= take;
      if (head_offset_ < end) break;
      if (spliced) {
        splicing_ = true;  // its payload follows through the pipe
        break;
      }
      sink.on_sent(index_, pop_head());
    }
    if (static_cast<std::size_t>(n) < total) {
      write_blocked_ = true;
      return moved;
    }
    write_blocked_ = false;
  }
  return moved;
}

std::uint64_t TcpChannel::pop_head() {
  const Pending& m = queue_[head_];
  head_ = (head_ + 1) % kQueueCapacity;
  --count_;
  queued_bytes_ -= m.header.bytes;
  head_offset_ = 0;
  return m.token;
}

void TcpChannel::finish_message(RecvSink& sink) {
  in_payload_ = false;
  if (current_acked_) ++acks_owed_;
  sink.on_message(index_, current_);
}

void TcpChannel::on_consumed(RecvSink& sink, const FrameHeader& h) {
  if (h.bytes != 0 || h.count == 0 || h.count > awaiting_count_) {
    fail("protocol violation: a consumed notice for " + std::to_string(h.count) +
         " messages where " + std::to_string(awaiting_count_) + " wait for one");
  }
  for (std::uint64_t i = 0; i < h.count; ++i) {
    const std::uint64_t token = awaiting_[awaiting_head_];
    awaiting_head_ = (awaiting_head_ + 1) % kQueueCapacity;
    --awaiting_count_;
    sink.on_sent(index_, token);
  }
}

bool TcpChannel::consume_buffered(RecvSink& sink) {
  const std::size_t avail = wpos_ - rpos_;
  const std::size_t need = current_.bytes - done_;
  std::size_t take = std::min(avail, need);
  if (take > 0) {
    switch (target_.mode) {
      case RecvTarget::kDirect: std::memcpy(target_.dst + done_, inbox_.get() + rpos_, take); break;
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
      case RecvTarget::kDiscard: break;
    }
    rpos_ += take;
    done_ += take;
  }
  if (done_ == current_.bytes) {
    finish_message(sink);
    return true;
  }
  return false;
}

bool TcpChannel::receive(RecvSink& sink, std::size_t budget) {
  bool moved = false;
  bool drained = false;  // a read returned less than asked: the socket had no more then
  // The budget limits reads from the socket only: messages already in the inbox are always
  // handed over, so that a caller may skip progress() until the socket is readable again.
  while (fd_.valid()) {
    if (!in_payload_) {
      if (wpos_ - rpos_ >= kHeader) {
        std::memcpy(&current_, inbox_.get() + rpos_, kHeader);
        rpos_ += kHeader;
        moved = true;
        if (current_.type == FrameType::kConsumed) {
          on_consumed(sink, current_);
          continue;
        }
        const auto type = static_cast<std::uint8_t>(current_.type);
        current_acked_ = (type & kAckBit) != 0;
        current_.type = static_cast<FrameType>(type & ~kAckBit);
        in_payload_ = true;
        done_ = 0;
        target_ = sink.on_header(index_, current_);
        if (target_.unit == 0) target_.unit = 1;
        consume_buffered(sink);
        continue;
      }
    } else if (wpos_ > rpos_) {
      moved = true;
      if (consume_buffered(sink)) continue;
    }
    // Need more bytes from the socket. Between messages, after a short read, what arrives
    // later is reported by the next poll(); asking now would only cost a system call that
    // returns EAGAIN. Within a payload more is usually on its way: keep reading.
    if (budget == 0 || (drained && !in_payload_)) break;
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
      drained = static_cast<std::size_t>(n) < want;
      budget -= std::min(budget, static_cast<std::size_t>(n));
      if (into == inbox_.get() + wpos_) {
        wpos_ += static_cast<std::size_t>(n);
      } else {
        done_ += static_cast<std::size_t>(n);
        if (done_ == current_.bytes) finish_message(sink);
      }
      continue;
    }
    // The kernel hands over every byte that arrived before it reports the peer's close or
    // reset, so either means the peer has sent all it ever will.
    if (n == 0 || peer_gone(errno)) {
      if (in_payload_ || wpos_ != rpos_) {
        fail(std::string("connection ") + (n == 0 ? "closed" : "reset") +
             " in the middle of a message");
      }
      return peer_closed(sink);
    }
    if (would_block(errno)) break;
    fail(std::string("connection lost while receiving (") + std::strerror(errno) + ")");
  }
  return moved;
}

void TcpChannel::drop_queue() {
  count_ = 0;
  queued_bytes_ = 0;
  head_offset_ = 0;
  splicing_ = false;
  awaiting_count_ = 0;
  acks_owed_ = 0;
  ack_left_ = 0;
  // What the pipe still holds would otherwise lead the next splice; the channel is done.
  if (pipe_bytes_ > 0) {
    pipe_read_.reset();
    pipe_write_.reset();
    pipe_bytes_ = 0;
    zerocopy_min_ = 0;
  }
}

bool TcpChannel::peer_closed(RecvSink& sink) {
  fd_.reset();
  drop_queue();
  sink.on_closed(index_);
  return true;
}

void TcpChannel::close() { close_by(std::chrono::steady_clock::now() + kCloseLinger); }

// Hands over what is queued if the socket takes it at once, then sends a FIN.
void TcpChannel::begin_close() {
  if (!fd_.valid() || fin_sent_) return;
  NullSink null_sink;
  try {
    flush(null_sink);
  } catch (const Error&) {
    // Closing anyway.
  }
  fin_sent_ = true;
  if (!send_gone_) ::shutdown(fd_.get(), SHUT_WR);
}

// Sends a FIN after what is queued (begin_close), then waits until `linger_until` at most for
// the peer to acknowledge every byte sent, and closes.
void TcpChannel::close_by(std::chrono::steady_clock::time_point linger_until) {
  if (!fd_.valid()) return;
  begin_close();
  if (send_gone_) {
    fd_.reset();
    return;
  }
  // Anything the peer sends from now on (an announcement of its next operation, say) finds
  // this socket closed and draws a reset, and a reset throws away what the kernel has not yet
  // delivered. So wait, boundedly, until the peer has acknowledged every byte handed over,
  // discarding what arrives meanwhile; after that a reset can only reach data the peer's
  // kernel already holds, which it still hands to the reader before reporting the reset.
  char buf[4096];
  for (;;) {
    ssize_t n = 0;
    for (int i = 0; i < 64 && (n = ::recv(fd_.get(), buf, sizeof(buf), MSG_DONTWAIT)) > 0; ++i) {
    }
    if (n == 0 || (n < 0 && !would_block(errno))) break;  // the peer closed, or the link is gone
    int unacknowledged = 0;
    if (::ioctl(fd_.get(), SIOCOUTQ, &unacknowledged) != 0 || unacknowledged == 0) break;
    if (std::chrono::steady_clock::now() >= linger_until) break;
    pollfd p{fd_.get(), POLLIN, 0};
    (void)::poll(&p, 1, 1);
  }
  fd_.reset();
  drop_queue();
}

namespace {

constexpr auto kLinkPurpose = auth::Purpose::kLink;
constexpr std::size_t kSecretBytes = 16;  // UniqueId::secret
// An accepted connection that has not proved the secret this quickly is not one of ours.
constexpr auto kLinkHandshakeTimeout = std::chrono::seconds(5);
// Accepted connections proving themselves at once; beyond this the oldest is dropped.
constexpr std::size_t kMaxIncoming = 256;

auth::Secret secret_span(const std::uint8_t* secret) { return {secret, kSecretBytes}; }

// Sends all of a small handshake message now or reports that the socket would not take it.
bool send_small(int fd, const void* data, std::size_t bytes) {
  return ::send(fd, data, bytes, MSG_NOSIGNAL | MSG_DONTWAIT) == static_cast<ssize_t>(bytes);
}

// Receives into buf[got, want) without waiting and without reading past `want` (what follows
// belongs to the channel). Returns false when the peer closed or the connection broke.
bool recv_some(int fd, std::uint8_t* buf, std::size_t want, std::size_t& got) {
  const ssize_t n = ::recv(fd, buf + got, want - got, MSG_DONTWAIT);
  if (n > 0) {
    got += static_cast<std::size_t>(n);
    return true;
  }
  return n < 0 && would_block(errno);
}

// The connector's side of a link handshake opened by connect_link(), advanced by the
// accept_links() that follows on the same thread.
struct Outgoing {
  enum class Stage : std::uint8_t { kChallenge, kRespond, kWelcome, kDone };
  Fd fd;  // a duplicate of the channel's descriptor, closed once the handshake is done
  int self = 0;
  int peer = 0;
  int channel = 0;
  std::uint64_t tag = 0;
  std::string what;
  Stage stage = Stage::kChallenge;
  std::array<std::uint8_t, sizeof(auth::Response)> buf{};
  std::size_t got = 0;
  std::size_t sent = 0;
  auth::Challenge challenge{};
  auth::Claim claim{};
  auth::Response response{};

  [[noreturn]] void fail(const std::string& why) const {
    throw Error(ErrorCode::kBootstrap, what + ": " + why, self, peer, "link setup");
  }

  // Moves the handshake on as far as the socket allows.
  void advance(const std::uint8_t* secret) {
    if (stage == Stage::kChallenge) {
      if (!recv_some(fd.get(), buf.data(), sizeof(auth::Challenge), got)) {
        fail("the peer closed the connection before it sent a challenge");
      }
      const auth::Check c = auth::check_challenge(buf.data(), got, kLinkPurpose, &challenge);
      if (c == auth::Check::kIncomplete) return;
      if (c != auth::Check::kOk) {
        fail("the listener is not a dear link: " + std::string(auth::describe(c)));
      }
      claim.rank = self;
      claim.peer = peer;
      claim.channel = channel;
      claim.tag = tag;
      claim.nonce = auth::fresh_nonce();
      response = auth::make_response(secret_span(secret), kLinkPurpose, challenge, claim);
      stage = Stage::kRespond;
    }
    if (stage == Stage::kRespond) {
      const auto* p = reinterpret_cast<const char*>(&response);
      const ssize_t n =
          ::send(fd.get(), p + sent, sizeof(response) - sent, MSG_NOSIGNAL | MSG_DONTWAIT);
      if (n < 0 && !would_block(errno)) fail("connection lost while answering the challenge");
      if (n > 0) sent += static_cast<std::size_t>(n);
      if (sent < sizeof(response)) return;
      stage = Stage::kWelcome;
      got = 0;
    }
    if (stage == Stage::kWelcome) {
      if (!recv_some(fd.get(), buf.data(), sizeof(auth::Welcome), got)) {
        fail(
            "the peer closed the connection during the handshake (it rejected this rank's "
            "proof, or failed)");
      }
      const auth::Check c = auth::check_welcome(buf.data(), got, kLinkPurpose, secret_span(secret),
                                                claim, challenge.nonce);
      if (c == auth::Check::kIncomplete) return;
      if (c != auth::Check::kOk) {
        fail("the peer did not prove the job's secret: " + std::string(auth::describe(c)));
      }
      stage = Stage::kDone;
      fd.reset();
    }
  }

  [[nodiscard]] short events() const { return stage == Stage::kRespond ? POLLOUT : POLLIN; }
};

// Per thread, because connect_link() and its accept_links() run on the thread that creates the
// communicator, and communicators created on different threads must not see each other's.
thread_local std::vector<Outgoing> t_outgoing;

// An accepted connection that has been challenged and whose response is still arriving.
struct Incoming {
  Fd fd;
  Deadline deadline;
  auth::Nonce nonce{};
  std::array<std::uint8_t, sizeof(auth::Response)> buf{};
  std::size_t got = 0;
  std::string from;
};

void log_dropped(int self_rank, const std::string& from, std::string_view why) {
  std::fprintf(stderr, "dear rank %d: dropped a link connection from %s: %.*s\n", self_rank,
               from.c_str(), static_cast<int>(why.size()), why.data());
}

}  // namespace

std::vector<std::unique_ptr<Channel>> connect_link(const SockAddr& peer_addr, int self_rank,
                                                   int peer_rank, int channels,
                                                   const std::uint8_t* secret,
                                                   std::uint64_t comm_tag, Deadline deadline) {
  (void)secret;  // used by accept_links(), which answers the challenges
  // Handshakes of another communicator left here by a setup that failed half-way.
  std::erase_if(t_outgoing, [&](const Outgoing& o) { return o.tag != comm_tag; });
  std::vector<std::unique_ptr<Channel>> out;
  for (int c = 0; c < channels; ++c) {
    Outgoing o;
    o.what = "link to rank " + std::to_string(peer_rank) + " at " + peer_addr.to_string() +
             " (channel " + std::to_string(c) + ")";
    Fd fd = connect_with_retry(peer_addr, deadline, o.what);
    o.fd = Fd(::fcntl(fd.get(), F_DUPFD_CLOEXEC, 0));
    if (!o.fd.valid()) {
      throw Error(ErrorCode::kSystem, o.what + ": dup: " + std::strerror(errno), self_rank);
    }
    o.self = self_rank;
    o.peer = peer_rank;
    o.channel = c;
    o.tag = comm_tag;
    t_outgoing.push_back(std::move(o));
    out.push_back(std::make_unique<TcpChannel>(std::move(fd), self_rank, peer_rank, c));
  }
  return out;
}

std::vector<std::vector<std::unique_ptr<Channel>>> accept_links(
    int listen_fd, int self_rank, const std::vector<int>& peers, int channels,
    const std::uint8_t* secret, std::uint64_t comm_tag, Deadline deadline) {
  // This call owns this tag's connector handshakes from here on, whatever happens.
  std::vector<Outgoing> outgoing;
  for (auto& o : t_outgoing) {
    if (o.tag == comm_tag) outgoing.push_back(std::move(o));
  }
  std::erase_if(t_outgoing, [&](const Outgoing& o) { return o.tag == comm_tag || !o.fd.valid(); });

  std::vector<std::vector<std::unique_ptr<Channel>>> out(peers.size());
  for (auto& v : out) v.resize(static_cast<std::size_t>(channels));
  std::size_t missing = peers.size() * static_cast<std::size_t>(channels);
  const auto connecting = [&] {
    return std::any_of(outgoing.begin(), outgoing.end(),
                       [](const Outgoing& o) { return o.stage != Outgoing::Stage::kDone; });
  };
  std::vector<Incoming> incoming;
  std::vector<pollfd> fds;
  // Drained until it would block, and never allowed to block this loop.
  set_nonblocking(listen_fd);
  while (missing > 0 || connecting()) {
    if (Clock::now() >= deadline) {
      std::string what;
      if (missing > 0) {
        what = std::to_string(missing) + " connection(s) from peers never arrived";
      }
      for (const auto& o : outgoing) {
        if (o.stage == Outgoing::Stage::kDone) continue;
        what += (what.empty() ? "" : "; ") + o.what + " was never accepted";
      }
      throw Error(ErrorCode::kTimeout, "links: " + what + " before the deadline", self_rank);
    }
    // Wait for any connection to be ready: the listener, the challenged, the connecting.
    fds.clear();
    Deadline wake = deadline;
    fds.push_back({missing > 0 ? listen_fd : -1, POLLIN, 0});
    for (const auto& in : incoming) {
      fds.push_back({in.fd.get(), POLLIN, 0});
      wake = std::min(wake, in.deadline);
    }
    for (const auto& o : outgoing) {
      fds.push_back({o.stage == Outgoing::Stage::kDone ? -1 : o.fd.get(), o.events(), 0});
    }
    const int rc = ::poll(fds.data(), fds.size(), poll_timeout_ms(wake, 200));
    if (rc < 0 && errno != EINTR) {
      throw Error(ErrorCode::kSystem, std::string("poll: ") + std::strerror(errno), self_rank);
    }
    for (std::size_t i = 0; i < outgoing.size(); ++i) {
      if (fds[1 + incoming.size() + i].revents != 0) outgoing[i].advance(secret);
    }
    for (std::size_t i = 0; i < incoming.size(); ++i) {
      Incoming& in = incoming[i];
      if (fds[1 + i].revents == 0) continue;
      if (!recv_some(in.fd.get(), in.buf.data(), in.buf.size(), in.got)) {
        log_dropped(self_rank, in.from, "it closed before proving the secret");
        in.fd.reset();
        continue;
      }
      auth::Response r;
      const auth::Check c = auth::check_response(in.buf.data(), in.got, kLinkPurpose, in.nonce,
                                                 secret_span(secret), &r);
      if (c == auth::Check::kIncomplete) continue;
      if (c != auth::Check::kOk) {
        log_dropped(self_rank, in.from, auth::describe(c));
        in.fd.reset();
        continue;
      }
      if (r.claim.tag != comm_tag) {
        log_dropped(self_rank, in.from, "it belongs to another communicator of this job");
        in.fd.reset();
        continue;
      }
      // Proven to hold the secret: a wrong claim is a broken rank of this job, not a stranger.
      if (auto problem = auth::link_claim_problem(r.claim, self_rank, peers, channels)) {
        throw Error(ErrorCode::kBootstrap, *problem + " (from " + in.from + ")", self_rank,
                    r.claim.rank, "link setup");
      }
      const auto pos = static_cast<std::size_t>(
          std::find(peers.begin(), peers.end(), r.claim.rank) - peers.begin());
      auto& slot = out[pos][static_cast<std::size_t>(r.claim.channel)];
      if (slot) {
        throw Error(ErrorCode::kBootstrap,
                    "two link connections from rank " + std::to_string(r.claim.rank) +
                        " claim channel " + std::to_string(r.claim.channel) + " (the second from " +
                        in.from + ")",
                    self_rank, r.claim.rank, "link setup");
      }
      const auth::Welcome w =
          auth::make_welcome(secret_span(secret), kLinkPurpose, r.claim, in.nonce);
      if (!send_small(in.fd.get(), &w, sizeof(w))) {
        log_dropped(self_rank, in.from, "it could not be sent the welcome");
        in.fd.reset();
        continue;
      }
      slot =
          std::make_unique<TcpChannel>(std::move(in.fd), self_rank, r.claim.rank, r.claim.channel);
      --missing;
    }
    if (fds[0].revents & POLLIN) {
      for (;;) {
        Fd fd(::accept4(listen_fd, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK));
        if (!fd.valid()) break;
        Incoming in;
        in.from = peer_address(fd.get()).to_string();
        // The challenge is the first thing sent on a fresh socket, so it fits its empty buffer.
        const auth::Challenge ch = auth::make_challenge(kLinkPurpose);
        if (!send_small(fd.get(), &ch, sizeof(ch))) {
          log_dropped(self_rank, in.from, "it closed before it could be challenged");
          continue;
        }
        in.nonce = ch.nonce;
        in.fd = std::move(fd);
        in.deadline = Clock::now() + kLinkHandshakeTimeout;
        drop_oldest_beyond(incoming, kMaxIncoming, [&](const Incoming& q) {
          log_dropped(self_rank, q.from, "too many connections are handshaking at once");
        });
        incoming.push_back(std::move(in));
      }
    }
    const auto now = Clock::now();
    std::erase_if(incoming, [&](const Incoming& in) {
      if (!in.fd.valid()) return true;
      if (now < in.deadline) return false;
      log_dropped(self_rank, in.from, "it did not prove the secret in time");
      return true;
    });
  }
  return out;
}

}  // namespace dear::transport::tcp
