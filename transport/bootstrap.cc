#include "dear/bootstrap.h"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <netinet/in.h>
#include <poll.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "common/env.h"
#include "dear/error.h"
#include "transport/auth.h"
#include "transport/listener_registry.h"
#include "transport/signals.h"
#include "transport/socket_util.h"

namespace dear {
namespace {

using transport::Clock;
using transport::Deadline;
using transport::Fd;

namespace auth = transport::auth;
constexpr auto kPurpose = auth::Purpose::kBootstrap;
// Welcome status telling a joined rank that rendezvous failed because rank (status - this)
// never joined.
constexpr std::uint32_t kWelcomeMissingRank = 0x100;
// A connection that has not proved the secret this quickly is dropped, so that a scanner or a
// half-open connection cannot hold rendezvous up.
constexpr auto kHandshakeTimeout = std::chrono::seconds(5);
// Connections still proving themselves at once; beyond this the oldest is dropped, so a flood
// of connections cannot exhaust rank 0's descriptors (genuine ranks answer within a round trip).
constexpr std::size_t kMaxPending = 256;

void log_rejected(const std::string& from, const char* why) {
  std::fprintf(stderr, "dear rank 0: bootstrap rejected a connection from %s: %s\n", from.c_str(),
               why);
}

class TcpBootstrap final : public Bootstrap {
 public:
  TcpBootstrap(const UniqueId& id, int rank, int size, const BootstrapOptions& options)
      : id_(id), rank_(rank), size_(size), options_(options) {
    if (size_ == 1) {
      advertise_ = options_.advertise_host.empty() ? id_.host : options_.advertise_host;
      return;
    }
    const Deadline deadline = transport::deadline_after(options_.timeout);
    if (rank_ == 0) {
      rendezvous_root(deadline);
    } else {
      rendezvous_client(deadline);
    }
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  const UniqueId& id() const override { return id_; }
  const BootstrapOptions& options() const override { return options_; }
  std::string advertise_host() const override { return advertise_; }

  void all_gather(const void* in, std::size_t bytes, void* out) override {
    auto* o = static_cast<char*>(out);
    std::memcpy(o + static_cast<std::size_t>(rank_) * bytes, in, bytes);
    if (size_ == 1) return;
    const Deadline deadline = transport::deadline_after(options_.timeout);
    const std::uint64_t len = bytes;
    // Rank 0 answers every rank with a status word, then the result: 0, or 1 + the rank whose
    // failure stopped the collective, so that every rank can name it, not only rank 0.
    if (rank_ == 0) {
      for (int r = 1; r < size_; ++r) {
        const std::string what = "bootstrap all-gather from rank " + std::to_string(r);
        std::uint64_t their = 0;
        try {
          guarded(r, [&] {
            transport::read_all(peers_[r].get(), &their, sizeof(their), deadline, what);
            if (their != len) {
              throw Error(ErrorCode::kMismatch, what + ": rank " + std::to_string(r) + " sent " +
                                                    std::to_string(their) + " bytes, rank 0 " +
                                                    std::to_string(len));
            }
            transport::read_all(peers_[r].get(), o + static_cast<std::size_t>(r) * bytes, bytes,
                                deadline, what);
          });
        } catch (const Error&) {
          tell_failure(static_cast<std::uint64_t>(r) + 1, r);
          throw;
        }
      }
      const std::uint64_t ok = 0;
      for (int r = 1; r < size_; ++r) {
        guarded(r, [&] {
          const std::string what = "bootstrap all-gather to rank " + std::to_string(r);
          transport::write_all(peers_[r].get(), &ok, sizeof(ok), deadline, what);
          transport::write_all(peers_[r].get(), o, bytes * static_cast<std::size_t>(size_),
                               deadline, what);
        });
      }
    } else {
      std::uint64_t status = 0;
      try {
        guarded(0, [&] {
          transport::write_all(root_.get(), &len, sizeof(len), deadline, "bootstrap all-gather");
          transport::write_all(root_.get(), in, bytes, deadline, "bootstrap all-gather");
          transport::read_all(root_.get(), &status, sizeof(status), deadline,
                              "bootstrap all-gather");
          if (status == 0) {
            transport::read_all(root_.get(), o, bytes * static_cast<std::size_t>(size_), deadline,
                                "bootstrap all-gather");
          }
        });
      } catch (const Error& e) {
        // Rank 0 may have closed after telling why (a write then fails): read what it said.
        if (e.code() != ErrorCode::kPeerFailed || status != 0) throw;
        try {
          transport::read_all(root_.get(), &status, sizeof(status),
                              transport::deadline_after(std::chrono::milliseconds(200)),
                              "bootstrap status");
        } catch (const Error&) {
          throw e;
        }
        if (status == 0) throw;
      }
      if (status != 0) {
        const auto blame = static_cast<std::int64_t>(status) - 1;
        const int peer = blame >= 0 && blame < size_ ? static_cast<int>(blame) : 0;
        throw Error(ErrorCode::kPeerFailed,
                    "rank 0 reports that rank " + std::to_string(peer) +
                        " failed during a bootstrap collective (it exited, crashed or lost its "
                        "connection)",
                    rank_, peer, "bootstrap");
      }
    }
  }

  void barrier() override {
    std::vector<char> out(static_cast<std::size_t>(size_));
    const char one = 1;
    all_gather(&one, 1, out.data());
  }

 private:
  // Best effort, on rank 0: tells every connected rank except `skip` the bootstrap status
  // word `status` (a failure), without waiting long for any of them.
  void tell_failure(std::uint64_t status, int skip) {
    const Deadline soon = transport::deadline_after(std::chrono::milliseconds(500));
    for (int r = 1; r < size_; ++r) {
      if (r == skip || !peers_[r].valid()) continue;
      try {
        transport::write_all(peers_[r].get(), &status, sizeof(status), soon, "bootstrap status");
      } catch (const Error&) {
        // That rank is gone too; it learns nothing more from us.
      }
    }
  }

  // Runs f, re-throwing failures with this rank and the peer named.
  template <typename F>
  void guarded(int peer, F&& f) {
    try {
      f();
    } catch (const Error& e) {
      if (e.rank() != Error::kNone) throw;
      throw Error(e.code(), e.cause(), rank_, peer, "bootstrap");
    }
  }

  // A connection rank 0 has challenged and whose response is still arriving.
  struct Pending {
    Fd fd;
    Deadline deadline;
    auth::Nonce nonce{};
    std::array<std::uint8_t, sizeof(auth::Response)> buf{};
    std::size_t got = 0;
    std::string from;
  };

  void rendezvous_root(Deadline deadline) {
    advertise_ = options_.advertise_host.empty() ? id_.host : options_.advertise_host;
    Fd listener(transport::ListenerRegistry::instance().take(id_.port));
    if (!listener.valid()) {
      try {
        listener = transport::listen_on(transport::resolve(id_.host, id_.port));
      } catch (const Error& e) {
        const std::string& why = transport::ListenerRegistry::instance().unadopted_reason();
        if (why.empty()) throw;
        throw Error(e.code(), e.cause() + " (" + why + ")");
      }
    }
    transport::set_nonblocking(listener.get());
    peers_.resize(static_cast<std::size_t>(size_));
    welcomes_.resize(static_cast<std::size_t>(size_));
    claims_.resize(static_cast<std::size_t>(size_));
    nonces_.resize(static_cast<std::size_t>(size_));
    int joined = 0;
    std::vector<Pending> pending;
    while (joined < size_ - 1) {
      const auto now = Clock::now();
      if (now >= deadline) {
        std::string missing;
        for (int r = 1; r < size_; ++r) {
          if (!peers_[r].valid()) missing += (missing.empty() ? "" : ", ") + std::to_string(r);
        }
        int first_missing = Error::kNone;
        for (int r = size_ - 1; r >= 1; --r) {
          if (!peers_[r].valid()) first_missing = r;
        }
        // The ranks that did join are told who is missing, so that they fail naming it
        // instead of only learning that rank 0 went away.
        for (int r = 1; r < size_; ++r) {
          if (!peers_[r].valid()) continue;
          const auth::Welcome w =
              auth::make_welcome(id_.secret, kPurpose, claims_[r], nonces_[r],
                                 kWelcomeMissingRank + static_cast<std::uint32_t>(first_missing));
          try {
            transport::write_all(peers_[r].get(), &w, sizeof(w),
                                 transport::deadline_after(std::chrono::milliseconds(500)),
                                 "bootstrap refusal");
          } catch (const Error&) {
            // Gone as well.
          }
        }
        throw Error(ErrorCode::kTimeout,
                    "rendezvous on " + id_.address() + " timed out after " +
                        std::to_string(options_.timeout.count()) +
                        " ms; ranks that never joined: " + missing,
                    0, first_missing, "bootstrap");
      }
      std::vector<pollfd> fds;
      fds.push_back({listener.get(), POLLIN, 0});
      Deadline wake = deadline;
      for (auto& p : pending) {
        fds.push_back({p.fd.get(), POLLIN, 0});
        wake = std::min(wake, p.deadline);
      }
      const int rc = ::poll(fds.data(), fds.size(), transport::poll_timeout_ms(wake, 200));
      if (rc < 0 && errno != EINTR) {
        throw Error(ErrorCode::kSystem, std::string("poll: ") + std::strerror(errno), 0);
      }
      if (fds[0].revents & POLLIN) accept_new(listener.get(), pending);
      for (std::size_t i = 0; i < pending.size(); ++i) {
        if (fds.size() > i + 1 && fds[i + 1].revents != 0) read_hello(pending[i]);
      }
      // Finish or drop the pending connections.
      for (auto it = pending.begin(); it != pending.end();) {
        if (it->got == sizeof(auth::Response)) {
          joined += admit(*it) ? 1 : 0;
          it = pending.erase(it);
        } else if (!it->fd.valid()) {
          it = pending.erase(it);
        } else if (Clock::now() >= it->deadline) {
          log_rejected(it->from, "it did not complete the handshake in time");
          it = pending.erase(it);
        } else {
          ++it;
        }
      }
    }
    for (int r = 1; r < size_; ++r) {
      guarded(r, [&] {
        transport::write_all(peers_[r].get(), &welcomes_[r], sizeof(welcomes_[r]), deadline,
                             "bootstrap welcome to rank " + std::to_string(r));
      });
    }
  }

  void accept_new(int listener, std::vector<Pending>& pending) {
    for (;;) {
      Fd fd(::accept4(listener, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK));
      if (!fd.valid()) return;
      // Bootstrap messages are small and answered at once: without TCP_NODELAY, a length and
      // its payload written back to back wait out the peer's delayed ACK (40 ms) per round.
      transport::set_nodelay(fd.get());
      Pending p;
      p.from = transport::peer_address(fd.get()).to_string();
      // The challenge is the first thing sent on a fresh socket, so it fits its empty buffer.
      const auth::Challenge challenge = auth::make_challenge(kPurpose);
      if (::send(fd.get(), &challenge, sizeof(challenge), MSG_NOSIGNAL | MSG_DONTWAIT) !=
          static_cast<ssize_t>(sizeof(challenge))) {
        log_rejected(p.from, "it closed before it could be challenged");
        continue;
      }
      p.nonce = challenge.nonce;
      p.fd = std::move(fd);
      p.deadline = Clock::now() + kHandshakeTimeout;
      // Dropped in place (erased after this round), as poll() results are matched by index.
      transport::drop_oldest_beyond(pending, kMaxPending, [](const Pending& q) {
        log_rejected(q.from, "too many connections are handshaking at once");
      });
      pending.push_back(std::move(p));
    }
  }

  // Reads what has arrived of the response, never beyond it: the bytes after it belong to
  // the bootstrap collectives.
  void read_hello(Pending& p) const {
    const ssize_t n = ::recv(p.fd.get(), p.buf.data() + p.got, p.buf.size() - p.got, MSG_DONTWAIT);
    if (n > 0) {
      p.got += static_cast<std::size_t>(n);
      auth::Response unused;
      const auth::Check c =
          auth::check_response(p.buf.data(), p.got, kPurpose, p.nonce, id_.secret, &unused);
      if (c != auth::Check::kOk && c != auth::Check::kIncomplete) {
        log_rejected(p.from, auth::describe(c).data());
        p.fd.reset();
      }
    } else if (n == 0 || (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) {
      p.fd.reset();  // closed before proving anything: a scanner or a dead client
    }
  }

  // Validates a complete response; true when the rank joined.
  bool admit(Pending& p) {
    auth::Response r;
    // Already checked as it arrived; read_hello() dropped it unless it was kOk.
    if (auth::check_response(p.buf.data(), p.got, kPurpose, p.nonce, id_.secret, &r) !=
        auth::Check::kOk) {
      return false;
    }
    const auth::Claim& c = r.claim;
    // The claim is proven to come from a holder of the secret: a bad one is a rank of this job
    // that is misconfigured, which must fail the job rather than be ignored.
    if (auto problem = auth::bootstrap_claim_problem(c, size_)) {
      const int blame = c.rank > 0 && c.rank < size_ ? c.rank : Error::kNone;
      throw Error(ErrorCode::kBootstrap, *problem + " (from " + p.from + ")", 0, blame,
                  "bootstrap");
    }
    if (peers_[c.rank].valid()) {
      throw Error(ErrorCode::kBootstrap,
                  "two processes claim rank " + std::to_string(c.rank) + " (the second from " +
                      p.from + ")",
                  0, c.rank, "bootstrap");
    }
    transport::set_nonblocking(p.fd.get(), false);
    peers_[c.rank] = std::move(p.fd);
    welcomes_[c.rank] = auth::make_welcome(id_.secret, kPurpose, c, p.nonce);
    claims_[c.rank] = c;
    nonces_[c.rank] = p.nonce;
    return true;
  }

  void rendezvous_client(Deadline deadline) {
    const auto addr = transport::resolve(id_.host, id_.port);
    guarded(0, [&] {
      root_ = transport::connect_with_retry(addr, deadline, "bootstrap");
      transport::set_nodelay(root_.get());  // as on rank 0's side (accept_new)
      auth::Challenge challenge{};
      read_or_refused(&challenge, sizeof(challenge), deadline, "bootstrap challenge");
      if (const auto c = auth::check_challenge(reinterpret_cast<const std::uint8_t*>(&challenge),
                                               sizeof(challenge), kPurpose, &challenge);
          c != auth::Check::kOk) {
        throw Error(ErrorCode::kBootstrap,
                    "the listener at " + id_.address() +
                        " is not a dear rank 0 of this version: " + std::string(auth::describe(c)));
      }
      auth::Claim claim{};
      claim.rank = rank_;
      claim.world_size = size_;
      claim.nonce = auth::fresh_nonce();
      const auth::Response response = auth::make_response(id_.secret, kPurpose, challenge, claim);
      transport::write_all(root_.get(), &response, sizeof(response), deadline,
                           "bootstrap response to rank 0");
      auth::Welcome w{};
      // Rank 0 may give up at its own deadline and then say which rank never came: wait a
      // little longer than it does, to hear that instead of timing out blind.
      const Deadline grace = deadline + std::max<std::chrono::milliseconds>(std::chrono::seconds(1),
                                                                            options_.timeout / 10);
      read_or_refused(&w, sizeof(w), grace, "bootstrap welcome");
      std::uint32_t status = 0;
      const auto c = auth::check_welcome(reinterpret_cast<const std::uint8_t*>(&w), sizeof(w),
                                         kPurpose, id_.secret, claim, challenge.nonce, &status);
      if (c == auth::Check::kRefused && status >= kWelcomeMissingRank) {
        const auto missing = static_cast<std::int64_t>(status - kWelcomeMissingRank);
        const int peer = missing > 0 && missing < size_ ? static_cast<int>(missing) : Error::kNone;
        throw Error(ErrorCode::kTimeout,
                    "rank 0 gave up waiting for rank " + std::to_string(missing) +
                        " to join the rendezvous on " + id_.address() +
                        " (it exited, crashed, or was never started)",
                    rank_, peer, "bootstrap");
      }
      if (c != auth::Check::kOk) {
        throw Error(ErrorCode::kBootstrap, "rank 0 at " + id_.address() +
                                               " did not prove it holds this job's secret: " +
                                               std::string(auth::describe(c)));
      }
    });
    advertise_ = options_.advertise_host.empty() ? transport::local_address(root_.get()).host()
                                                 : options_.advertise_host;
  }

  // Reads from rank 0; a close means rank 0 turned this rank away.
  void read_or_refused(void* data, std::size_t bytes, Deadline deadline, const char* what) {
    try {
      transport::read_all(root_.get(), data, bytes, deadline, what);
    } catch (const Error& e) {
      if (e.code() != ErrorCode::kPeerFailed) throw;
      throw Error(ErrorCode::kBootstrap, "rank 0 at " + id_.address() +
                                             " closed the connection during rendezvous "
                                             "(wrong secret, or rank 0 failed)");
    }
  }

  UniqueId id_;
  int rank_;
  int size_;
  BootstrapOptions options_;
  std::string advertise_;
  std::vector<Fd> peers_;                // rank 0: a connection per rank
  std::vector<auth::Welcome> welcomes_;  // rank 0: the proof owed to each rank
  std::vector<auth::Claim> claims_;      // rank 0: what each rank claimed, and the challenge
  std::vector<auth::Nonce> nonces_;      // it answered (for a refusal that it can verify)
  Fd root_;                              // other ranks: the connection to rank 0
};

// Not secret: lets a job started by a launcher without a secret tell itself apart from
// other jobs on the same address (see README, "Launching").
std::array<std::uint8_t, 16> derived_secret(const std::string& seed) {
  std::array<std::uint8_t, 16> out{};
  std::uint64_t h1 = 1469598103934665603ULL;
  std::uint64_t h2 = 1099511628211ULL * 31;
  for (const char c : seed) {
    h1 = (h1 ^ static_cast<std::uint8_t>(c)) * 1099511628211ULL;
    h2 = (h2 ^ static_cast<std::uint8_t>(c)) * 0x100000001b3ULL + 0x9e3779b97f4a7c15ULL;
  }
  std::memcpy(out.data(), &h1, 8);
  std::memcpy(out.data() + 8, &h2, 8);
  return out;
}

std::optional<std::int64_t> first_int(std::initializer_list<const char*> names, std::int64_t min,
                                      std::int64_t max, std::string* found) {
  for (const char* n : names) {
    if (auto v = env::get_int(n, min, max)) {
      *found = n;
      return v;
    }
  }
  return std::nullopt;
}

}  // namespace

std::unique_ptr<Bootstrap> Bootstrap::create(const UniqueId& id, int rank, int world_size,
                                             const BootstrapOptions& options) {
  if (world_size < 1) {
    throw Error(ErrorCode::kInvalidArgument,
                "world_size must be at least 1, got " + std::to_string(world_size), rank);
  }
  if (rank < 0 || rank >= world_size) {
    throw Error(
        ErrorCode::kInvalidArgument,
        "rank must be in [0, " + std::to_string(world_size) + "), got " + std::to_string(rank),
        rank);
  }
  if (world_size > 1 && id.port == 0) {
    throw Error(ErrorCode::kInvalidArgument, "unique id has no port", rank);
  }
  try {
    transport::check_congestion_control_env();
  } catch (const Error& e) {
    throw Error(e.code(), e.cause(), rank);
  }
  // Before the wait for the peers, the first place a Ctrl-C is likely.
  transport::reset_foreign_fatal_handlers();
  return std::make_unique<TcpBootstrap>(id, rank, world_size, options);
}

std::unique_ptr<Bootstrap> Bootstrap::from_env(const BootstrapOptions& options) {
  constexpr std::int64_t kMaxRanks = 1 << 20;
  std::string rank_var;
  std::string size_var;
  const auto rank =
      first_int({"DEAR_RANK", "RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID"}, 0,
                kMaxRanks, &rank_var);
  const auto size = first_int(
      {"DEAR_WORLD_SIZE", "WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_NTASKS"}, 1,
      kMaxRanks, &size_var);
  if (!rank || !size) {
    throw Error(ErrorCode::kInvalidArgument,
                "cannot tell this process's rank and world size from the environment: set "
                "DEAR_RANK and DEAR_WORLD_SIZE (dear-run does), or RANK and WORLD_SIZE "
                "(torchrun), or run under Open MPI (OMPI_COMM_WORLD_*) or Slurm "
                "(SLURM_PROCID, SLURM_NTASKS)");
  }
  UniqueId id;
  if (auto text = env::get("DEAR_UNIQUE_ID")) {
    id = UniqueId::parse(*text);
  } else {
    auto addr = env::get("MASTER_ADDR");
    auto port = env::get_int("MASTER_PORT", 1, 65535);
    if (!addr || !port) {
      throw Error(ErrorCode::kInvalidArgument,
                  "no rendezvous address: set DEAR_UNIQUE_ID (dear-run does) or MASTER_ADDR and "
                  "MASTER_PORT (rank from " +
                      rank_var + ")",
                  static_cast<int>(*rank));
    }
    id.host = *addr;
    id.port = static_cast<std::uint16_t>(*port);
    if (auto secret = env::get("DEAR_SECRET")) {
      id.secret = UniqueId::parse("h:1:" + *secret).secret;
    } else {
      std::string seed = *addr + ":" + std::to_string(*port);
      for (const char* v :
           {"TORCHELASTIC_RUN_ID", "SLURM_JOB_ID", "OMPI_MCA_ess_base_jobid", "PMIX_NAMESPACE"}) {
        if (auto x = env::get(v)) seed += ":" + *x;
      }
      id.secret = derived_secret(seed);
    }
  }
  BootstrapOptions opts = options;
  if (auto v = env::get_int("DEAR_TIMEOUT", 1, 365LL * 24 * 3600)) {
    opts.timeout = std::chrono::seconds(*v);
  }
  if (auto ifname = env::get("DEAR_SOCKET_IFNAME")) {
    opts.advertise_host = interface_address(*ifname, static_cast<int>(*rank));
  }
  if (auto host = env::get("DEAR_ADVERTISE_HOST")) opts.advertise_host = *host;
  return create(id, static_cast<int>(*rank), static_cast<int>(*size), opts);
}

std::string interface_address(const std::string& ifname, int rank) {
  ifaddrs* list = nullptr;
  if (::getifaddrs(&list) != 0) {
    throw Error(ErrorCode::kSystem, std::string("getifaddrs: ") + std::strerror(errno), rank);
  }
  std::string found;
  std::string names;
  for (const ifaddrs* a = list; a != nullptr; a = a->ifa_next) {
    if (a->ifa_addr == nullptr || a->ifa_addr->sa_family != AF_INET) continue;
    if (names.find(std::string(" ") + a->ifa_name + ",") == std::string::npos) {
      names += std::string(" ") + a->ifa_name + ",";
    }
    if (found.empty() && ifname == a->ifa_name) {
      char text[INET_ADDRSTRLEN] = {};
      const auto* in = reinterpret_cast<const sockaddr_in*>(a->ifa_addr);
      ::inet_ntop(AF_INET, &in->sin_addr, text, sizeof(text));
      found = text;
    }
  }
  ::freeifaddrs(list);
  if (found.empty()) {
    if (!names.empty()) names.pop_back();
    throw Error(ErrorCode::kInvalidArgument,
                "DEAR_SOCKET_IFNAME=" + ifname +
                    " names no interface with an IPv4 address (interfaces with one:" + names + ")",
                rank);
  }
  return found;
}

}  // namespace dear
