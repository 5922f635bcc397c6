// dear-socket-stream: one plain TCP stream on loopback between two processes of its own (no
// library, no launcher), moving its bytes either through one small buffer that each side reuses
// (as iperf3 does: it stays in the CPU caches) or by walking a buffer of a large message's size
// (as any library moving a message of that size must: every byte comes from and goes to
// memory). The pair of figures says how much of a cache-resident stream's speed a large
// message can have on this host at all.
//
//   dear-socket-stream [--message 64M] [--chunk 128K] [--bytes 4G] [--rounds 3]
//                      [--congestion cubic]
//
// Each round runs both layouts, alternating which goes first; every chunk carries its sequence
// number in its first 8 bytes, checked on arrival. Time runs from the receiver's first byte to
// its last. Both sockets use cubic, as dear's loopback links do (DEAR_TCP_CONGESTION=auto) and
// iperf3 -C cubic; `system` leaves the system's choice.
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "common/stats.h"
#include "report.h"

namespace dear::bench {
namespace {

struct Args {
  std::uint64_t message = 64 << 20;  // the walked buffer
  std::uint64_t chunk = 128 << 10;   // bytes per send()/recv() call, and the reused buffer
  std::uint64_t bytes = std::uint64_t{4} << 30;
  int rounds = 3;
  std::string congestion = "cubic";
};

[[noreturn]] void die(const std::string& what) {
  throw std::runtime_error(what + ": " + std::strerror(errno));
}

bool set_congestion(int fd, const std::string& name) {
  return name == "system" || ::setsockopt(fd, IPPROTO_TCP, TCP_CONGESTION, name.data(),
                                          static_cast<socklen_t>(name.size())) == 0;
}

// Moves args.bytes from a child process to this one through `buffer_bytes` of memory on each
// side, args.chunk per call; returns GB/s.
double stream_once(const Args& args, std::size_t buffer_bytes) {
  const int ls = ::socket(AF_INET, SOCK_STREAM, 0);
  if (ls < 0) die("socket");
  if (!set_congestion(ls, args.congestion)) die("TCP congestion control " + args.congestion);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof a;
  if (::bind(ls, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 ||
      ::getsockname(ls, reinterpret_cast<sockaddr*>(&a), &len) != 0 || ::listen(ls, 1) != 0) {
    die("listen");
  }
  std::vector<char> buf(buffer_bytes, 1);  // touched: no page fault is timed
  const std::size_t chunk = args.chunk;
  const pid_t child = ::fork();
  if (child < 0) die("fork");
  if (child == 0) {
    const int s = ::socket(AF_INET, SOCK_STREAM, 0);
    if (s < 0 || !set_congestion(s, args.congestion) ||
        ::connect(s, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) {
      ::_exit(2);
    }
    std::uint64_t seq = 0;
    for (std::uint64_t sent = 0; sent < args.bytes; sent += chunk) {
      char* at = buf.data() + sent % buffer_bytes;
      std::memcpy(at, &seq, sizeof seq);
      ++seq;
      for (std::size_t done = 0; done < chunk;) {
        const ssize_t n = ::send(s, at + done, chunk - done, 0);
        if (n <= 0) ::_exit(3);
        done += static_cast<std::size_t>(n);
      }
    }
    ::close(s);
    ::_exit(0);
  }
  const int c = ::accept(ls, nullptr, nullptr);
  ::close(ls);
  if (c < 0) die("accept");
  std::chrono::steady_clock::time_point t0;
  std::uint64_t seq = 0;
  for (std::uint64_t got = 0; got < args.bytes; got += chunk) {
    char* at = buf.data() + got % buffer_bytes;
    for (std::size_t done = 0; done < chunk;) {
      const ssize_t n = ::recv(c, at + done, chunk - done, 0);
      if (n <= 0) throw std::runtime_error("the sending process stopped early");
      if (got == 0 && done == 0) t0 = std::chrono::steady_clock::now();
      done += static_cast<std::size_t>(n);
    }
    std::uint64_t stamp = 0;
    std::memcpy(&stamp, at, sizeof stamp);
    if (stamp != seq++) throw std::runtime_error("chunk " + std::to_string(seq - 1) + " is wrong");
  }
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  ::close(c);
  int status = 0;
  ::waitpid(child, &status, 0);
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    throw std::runtime_error("the sending process failed");
  }
  return static_cast<double>(args.bytes) / s / 1e9;
}

int run(int argc, char** argv) {
  CLI::App app{
      "dear-socket-stream: one loopback TCP stream through a reused small buffer (cache-resident, "
      "as iperf3's) and through a walked buffer of a large message's size"};
  Args args;
  add_bytes_flag(app, "--message", args.message, "Size of the walked buffer (a message's size)");
  add_bytes_flag(app, "--chunk", args.chunk, "Bytes per send()/recv(), and the reused buffer");
  add_bytes_flag(app, "--bytes", args.bytes, "Bytes streamed per run");
  app.add_option("--rounds", args.rounds, "Rounds, each running both")->check(CLI::Range(1, 100));
  app.add_option("--congestion", args.congestion,
                 "TCP congestion control of both sockets (system: the system's)")
      ->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  if (args.chunk < 8 || args.message < args.chunk || args.message % args.chunk != 0) {
    throw std::invalid_argument("--chunk must be at least 8 bytes and divide --message");
  }
  args.bytes = std::max(args.bytes / args.chunk, std::uint64_t{1}) * args.chunk;
  std::vector<double> reused, walked;
  std::printf(
      "# %llu bytes per run in %llu-byte calls; reused: one %llu-byte buffer, walked: %llu\n",
      static_cast<unsigned long long>(args.bytes), static_cast<unsigned long long>(args.chunk),
      static_cast<unsigned long long>(args.chunk), static_cast<unsigned long long>(args.message));
  std::printf("%6s %12s %12s %8s\n", "round", "reused GB/s", "walked GB/s", "ratio");
  for (int r = 0; r < args.rounds; ++r) {
    double u = 0;
    double w = 0;
    if (r % 2 == 0) {
      u = stream_once(args, args.chunk);
      w = stream_once(args, args.message);
    } else {
      w = stream_once(args, args.message);
      u = stream_once(args, args.chunk);
    }
    reused.push_back(u);
    walked.push_back(w);
    std::printf("%6d %12.3f %12.3f %8.2f\n", r, u, w, w / u);
  }
  std::printf("median %12.3f %12.3f %8.2f\n", median(reused), median(walked),
              median(walked) / median(reused));
  return 0;
}

}  // namespace
}  // namespace dear::bench

int main(int argc, char** argv) {
  return dear::bench::tool_main("dear-socket-stream", dear::bench::run, argc, argv);
}
