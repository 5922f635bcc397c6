#include "stream.h"

#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <sys/time.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <set>
#include <thread>
#include <utility>
#include <vector>

#include "dear/error.h"

namespace dear::bench::stream {
namespace {

using Clock = std::chrono::steady_clock;

// What the first and last 8 bytes of message `seq` hold: different values, so that a message
// put together from the wrong pieces fails too.
std::uint64_t front_stamp(std::uint64_t seq) { return seq * 0x9e3779b97f4a7c15ULL + 1; }
std::uint64_t back_stamp(std::uint64_t seq) { return ~front_stamp(seq); }

// Blocking from here; a dead peer ends a call within the stall limit instead of never.
void make_blocking(int fd) {
  transport::set_nonblocking(fd, false);
  timeval tv{};
  tv.tv_sec = std::chrono::duration_cast<std::chrono::seconds>(kStallLimit).count();
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  ::setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
}

}  // namespace

void stamp(char* msg, std::size_t size, std::uint64_t seq) {
  const std::uint64_t f = front_stamp(seq);
  const std::uint64_t b = back_stamp(seq);
  std::memcpy(msg, &f, kStamp);
  std::memcpy(msg + size - kStamp, &b, kStamp);
}

void clear_stamp(char* msg, std::size_t size) {
  std::memset(msg, 0, kStamp);
  std::memset(msg + size - kStamp, 0, kStamp);
}

void check_stamp(const char* msg, std::size_t size, std::uint64_t seq, int rank, int from,
                 const std::string& what) {
  std::uint64_t f = 0;
  std::uint64_t b = 0;
  std::memcpy(&f, msg, kStamp);
  std::memcpy(&b, msg + size - kStamp, kStamp);
  if (f != front_stamp(seq) || b != back_stamp(seq)) {
    throw Error(ErrorCode::kMismatch,
                what + ": message " + std::to_string(seq) + " arrived with wrong first/last bytes",
                rank, from);
  }
}

void FreeDeleter::operator()(char* p) const { std::free(p); }

Memory allocate(std::size_t bytes, int fill, int rank) {
  const std::size_t rounded = (std::max<std::size_t>(bytes, 1) + 4095) / 4096 * 4096;
  Memory m(static_cast<char*>(std::aligned_alloc(4096, rounded)));
  if (!m) {
    throw Error(ErrorCode::kSystem, "out of memory for " + std::to_string(bytes) + " bytes", rank);
  }
  std::memset(m.get(), fill, rounded);
  return m;
}

bool all_ok(Bootstrap& boot, const char* tool, const std::function<void()>& step) {
  struct Status {
    std::int32_t ok = 1;
    char reason[500] = {};
  };
  Status mine;
  try {
    step();
  } catch (const Error& e) {
    mine.ok = 0;  // the bare cause: ranks often fail alike, and it is said once
    std::snprintf(mine.reason, sizeof(mine.reason), "%s", e.cause().c_str());
  } catch (const std::exception& e) {
    mine.ok = 0;
    std::snprintf(mine.reason, sizeof(mine.reason), "%s", e.what());
  }
  std::vector<Status> all(static_cast<std::size_t>(boot.size()));
  boot.all_gather(&mine, sizeof(mine), all.data());
  bool ok = true;
  std::set<std::string> said;
  for (std::size_t r = 0; r < all.size(); ++r) {
    if (all[r].ok != 0) continue;
    ok = false;
    const std::string reason(all[r].reason, strnlen(all[r].reason, sizeof(all[r].reason)));
    if (boot.rank() == 0 && said.insert(reason).second) {
      std::fprintf(stderr, "%s: rank %zu: %s\n", tool, r, reason.c_str());
    }
  }
  return ok;
}

double max_over_ranks(Bootstrap& boot, double value) {
  std::vector<double> all(static_cast<std::size_t>(boot.size()));
  boot.all_gather(&value, sizeof(value), all.data());
  return *std::max_element(all.begin(), all.end());
}

TcpStream::TcpStream(std::size_t size, int rank)
    : rank_(rank),
      size_(size),
      chunk_(std::min(kTcpChunk, size)),
      send_buf_(allocate(size, 0xa5, rank)),
      recv_buf_(allocate(size, 0, rank)) {}

void TcpStream::attach(transport::Fd send, int send_peer, transport::Fd recv, int recv_peer) {
  send_ = std::move(send);
  recv_ = std::move(recv);
  send_peer_ = send_peer;
  recv_peer_ = recv_peer;
  make_blocking(send_.get());
  if (recv_.valid()) make_blocking(recv_.get());
}

double TcpStream::run(bool send, bool recv, std::uint64_t messages, std::uint64_t timed_from) {
  double seconds = 0;
  std::exception_ptr send_error;
  std::thread sender;
  if (send && recv) {
    sender = std::thread([&] {
      try {
        send_messages(messages);
      } catch (...) {
        send_error = std::current_exception();
      }
    });
  } else if (send) {
    send_messages(messages);
  }
  std::exception_ptr recv_error;
  if (recv) {
    try {
      seconds = recv_messages(messages, timed_from);
    } catch (...) {
      // The sender may be blocked on a peer that stopped reading: unblock it.
      ::shutdown(send_.get(), SHUT_RDWR);
      recv_error = std::current_exception();
    }
  }
  if (sender.joinable()) sender.join();
  if (recv_error) std::rethrow_exception(recv_error);
  if (send_error) std::rethrow_exception(send_error);
  return seconds;
}

void TcpStream::fail(const char* call, int err, int peer) const {
  throw Error(ErrorCode::kPeerFailed, std::string("tcp: ") + call + ": " + std::strerror(err),
              rank_, peer);
}

void TcpStream::send_messages(std::uint64_t messages) {
  char* msg = send_buf_.get();
  for (std::uint64_t m = 0; m < messages; ++m) {
    stamp(msg, size_, m);
    for (std::size_t off = 0; off < size_;) {
      const std::size_t want = std::min(chunk_, size_ - off);
      std::size_t sent = 0;
      while (sent < want) {
        const ssize_t n = ::send(send_.get(), msg + off + sent, want - sent, MSG_NOSIGNAL);
        if (n < 0) {
          if (errno == EINTR) continue;
          fail("send", errno, send_peer_);
        }
        sent += static_cast<std::size_t>(n);
      }
      off += want;
    }
  }
  // Nagle holds the stream's last partial segment until the peer acknowledges what is in
  // flight, and the peer may delay that acknowledgement by 40 ms: a stall at the end of every
  // run that is no part of the streaming rate. Setting TCP_NODELAY sends what is held at once;
  // it is cleared again for the next run.
  for (const int on : {1, 0}) {
    if (::setsockopt(send_.get(), IPPROTO_TCP, TCP_NODELAY, &on, sizeof(on)) != 0) {
      fail("setsockopt(TCP_NODELAY)", errno, send_peer_);
    }
  }
}

double TcpStream::recv_messages(std::uint64_t messages, std::uint64_t timed_from) {
  char* msg = recv_buf_.get();
  auto from = Clock::now();
  for (std::uint64_t m = 0; m < messages; ++m) {
    clear_stamp(msg, size_);
    for (std::size_t off = 0; off < size_;) {
      const std::size_t want = std::min(chunk_, size_ - off);
      const ssize_t n = ::recv(recv_fd(), msg + off, want, MSG_WAITALL);
      if (n == 0) {
        throw Error(ErrorCode::kPeerFailed, "tcp: rank closed the connection", rank_, recv_peer_);
      }
      if (n < 0) {
        if (errno == EINTR) continue;
        fail("recv", errno, recv_peer_);
      }
      off += static_cast<std::size_t>(n);
    }
    check_stamp(msg, size_, m, rank_, recv_peer_, "tcp");
    if (m + 1 == timed_from) from = Clock::now();
  }
  return std::chrono::duration<double>(Clock::now() - from).count();
}

namespace {

// Every rank listens on an ephemeral port of 127.0.0.1; returns all the ports, by rank.
// Collective; `listener` is left invalid on a failure.
bool listen_all(Bootstrap& boot, const char* tool, bool listens, transport::Fd& listener,
                std::vector<std::uint16_t>& ports) {
  std::uint16_t port = 0;
  if (!all_ok(boot, tool, [&] {
        if (!listens) return;
        listener = transport::listen_on(transport::resolve("127.0.0.1", 0), 1);
        port = transport::local_address(listener.get()).port();
      })) {
    return false;
  }
  ports.assign(static_cast<std::size_t>(boot.size()), 0);
  boot.all_gather(&port, sizeof(port), ports.data());
  return true;
}

transport::Fd accept_from(int listener, int rank, int peer) {
  transport::Fd fd = transport::accept_until(listener, transport::deadline_after(kStallLimit));
  if (!fd.valid()) throw Error(ErrorCode::kTimeout, "tcp: the peer did not connect", rank, peer);
  return fd;
}

}  // namespace

bool connect_pair(Bootstrap& boot, const char* tool, TcpStream& stream) {
  const int rank = boot.rank();
  transport::Fd listener;
  std::vector<std::uint16_t> ports;
  if (!listen_all(boot, tool, rank == 1, listener, ports)) return false;
  return all_ok(boot, tool, [&] {
    transport::Fd fd =
        rank == 0 ? transport::connect_with_retry(transport::resolve("127.0.0.1", ports[1]),
                                                  transport::deadline_after(kStallLimit),
                                                  "tcp stream to rank 1")
                  : accept_from(listener.get(), rank, 0);
    stream.attach(std::move(fd), 1 - rank, transport::Fd(), 1 - rank);
  });
}

bool connect_ring(Bootstrap& boot, const char* tool, TcpStream& stream) {
  const int rank = boot.rank();
  const int n = boot.size();
  const int next = (rank + 1) % n;
  const int prev = (rank + n - 1) % n;
  transport::Fd listener;
  std::vector<std::uint16_t> ports;
  if (!listen_all(boot, tool, true, listener, ports)) return false;
  return all_ok(boot, tool, [&] {
    // The connection completes in the listener's backlog, so every rank can connect before
    // any accepts.
    transport::Fd out = transport::connect_with_retry(
        transport::resolve("127.0.0.1", ports[static_cast<std::size_t>(next)]),
        transport::deadline_after(kStallLimit), "tcp stream to rank " + std::to_string(next));
    transport::Fd in = accept_from(listener.get(), rank, prev);
    stream.attach(std::move(out), next, std::move(in), prev);
  });
}

}  // namespace dear::bench::stream
