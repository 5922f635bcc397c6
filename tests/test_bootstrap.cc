// Bootstrap and link handshakes under attack: garbage, half-open and slow-loris connections
// and a client with the wrong secret must not stop a job from forming, another job on the same
// address must not join it, wrong secrets are logged, and the secret never appears in any log
// or error text. The handshake itself (transport/auth.h) is checked for replay and tampering.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <ifaddrs.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstring>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "channel_exchange.h"
#include "dear/bootstrap.h"
#include "dear/communicator.h"
#include "reference.h"
#include "transport/auth.h"
#include "transport/listener_registry.h"
#include "transport/socket_util.h"
#include "transport/tcp/tcp_channel.h"

namespace dear::testing {
namespace {

using namespace std::chrono_literals;
namespace auth = transport::auth;
using transport::Fd;

std::string secret_hex(const UniqueId& id) {
  const std::string s = id.to_string();
  return s.substr(s.size() - 32);
}

// True when text holds the secret in hex, either case.
bool leaks(const std::string& text, const UniqueId& id) {
  std::string lower = text;
  for (auto& c : lower) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return lower.find(secret_hex(id)) != std::string::npos;
}

Fd connect_to(std::uint16_t port) {
  return transport::connect_with_retry(transport::resolve("127.0.0.1", port),
                                       transport::deadline_after(2s), "attacker");
}

void send_bytes(int fd, const void* p, std::size_t n) {
  (void)::send(fd, p, n, MSG_NOSIGNAL | MSG_DONTWAIT);
}

// Reads the challenge a listener sends on accept; false if none came within a second.
bool read_challenge(int fd, auth::Challenge* c) {
  try {
    transport::read_all(fd, c, sizeof(*c), transport::deadline_after(1s), "attacker");
    return true;
  } catch (const Error&) {
    return false;
  }
}

// Opens hostile connections to a listener until told to stop: random bytes, a valid prefix
// followed by a garbage MAC, half-open connections that never send, a slow-loris that sends a
// plausible response one byte per 100 ms, and a client that answers with the wrong secret.
class Attacker {
 public:
  Attacker(std::uint16_t port, auth::Purpose purpose) : port_(port), purpose_(purpose) {
    threads_.emplace_back([this] { garbage(); });
    threads_.emplace_back([this] { slow_loris(); });
    threads_.emplace_back([this] { wrong_secret(); });
  }
  ~Attacker() { stop(); }
  void stop() {
    stop_ = true;
    for (auto& t : threads_) {
      if (t.joinable()) t.join();
    }
  }
  int wrong_secret_rejected() const { return rejected_; }

 private:
  void garbage() {
    std::mt19937 rng(7);
    std::vector<Fd> half_open;
    for (int i = 0; i < 6 && !stop_; ++i) {
      try {
        Fd fd = connect_to(port_);
        std::vector<std::uint8_t> junk(64 + rng() % 256);
        for (auto& b : junk) b = static_cast<std::uint8_t>(rng());
        if (i % 2 == 1) {
          // Right magic and version, garbage after: reaches the MAC check.
          const std::uint32_t head[2] = {static_cast<std::uint32_t>(purpose_), auth::kVersion};
          std::memcpy(junk.data(), head, sizeof(head));
        }
        send_bytes(fd.get(), junk.data(), junk.size());
        half_open.push_back(connect_to(port_));  // never sends anything
      } catch (const Error&) {
        // The listener is gone: the job formed.
      }
    }
    while (!stop_) std::this_thread::sleep_for(10ms);
  }

  void slow_loris() {
    try {
      Fd fd = connect_to(port_);
      auth::Response r{};
      r.magic = static_cast<std::uint32_t>(purpose_);
      r.version = auth::kVersion;
      const auto* p = reinterpret_cast<const std::uint8_t*>(&r);
      for (std::size_t i = 0; i < sizeof(r) && !stop_; ++i) {
        send_bytes(fd.get(), p + i, 1);
        std::this_thread::sleep_for(100ms);
      }
    } catch (const Error&) {
    }
  }

  void wrong_secret() {
    try {
      Fd fd = connect_to(port_);
      auth::Challenge c{};
      if (!read_challenge(fd.get(), &c)) return;
      std::array<std::uint8_t, 16> wrong{};
      wrong.fill(0x5a);
      auth::Claim claim{};
      claim.rank = 1;
      claim.world_size = 4;
      claim.nonce = auth::fresh_nonce();
      const auth::Response r = auth::make_response(wrong, purpose_, c, claim);
      send_bytes(fd.get(), &r, sizeof(r));
      // The listener must close on us (a FIN, or a reset if it dropped us before reading all
      // we sent) rather than welcome us (a welcome is bytes to read).
      char b;
      pollfd pfd{fd.get(), POLLIN, 0};
      if (::poll(&pfd, 1, 3000) == 1 && ::recv(fd.get(), &b, 1, 0) <= 0) ++rejected_;
    } catch (const Error&) {
    }
  }

  std::uint16_t port_;
  auth::Purpose purpose_;
  std::atomic<bool> stop_{false};
  std::atomic<int> rejected_{0};
  std::vector<std::thread> threads_;
};

TEST(Handshake, RejectsReplayTamperingAndWrongSecret) {
  const auto secret = transport::random_secret();
  const auto purpose = auth::Purpose::kBootstrap;
  const auth::Challenge c1 = auth::make_challenge(purpose);
  const auth::Challenge c2 = auth::make_challenge(purpose);
  ASSERT_NE(c1.nonce, c2.nonce) << "nonces must be fresh";
  auth::Claim claim{};
  claim.rank = 2;
  claim.world_size = 4;
  claim.nonce = auth::fresh_nonce();
  const auth::Response r = auth::make_response(secret, purpose, c1, claim);
  const auto* bytes = reinterpret_cast<const std::uint8_t*>(&r);
  auth::Response got{};
  EXPECT_EQ(auth::check_response(bytes, sizeof(r), purpose, c1.nonce, secret, &got),
            auth::Check::kOk);
  EXPECT_EQ(got.claim.rank, 2);
  // The same response replayed on a connection that sent another challenge.
  EXPECT_EQ(auth::check_response(bytes, sizeof(r), purpose, c2.nonce, secret, &got),
            auth::Check::kBadMac);
  // A claim changed in flight.
  auth::Response t = r;
  t.claim.rank = 3;
  EXPECT_EQ(auth::check_response(reinterpret_cast<const std::uint8_t*>(&t), sizeof(t), purpose,
                                 c1.nonce, secret, &got),
            auth::Check::kBadMac);
  // Another secret; the other purpose; garbage judged on its first word.
  auto other = secret;
  other[0] ^= 1;
  EXPECT_EQ(auth::check_response(bytes, sizeof(r), purpose, c1.nonce, other, &got),
            auth::Check::kBadMac);
  EXPECT_EQ(auth::check_response(bytes, sizeof(r), auth::Purpose::kLink, c1.nonce, secret, &got),
            auth::Check::kNotDear);
  const std::uint8_t junk[4] = {'G', 'E', 'T', ' '};
  EXPECT_EQ(auth::check_response(junk, sizeof(junk), purpose, c1.nonce, secret, &got),
            auth::Check::kNotDear);
  EXPECT_EQ(auth::check_response(bytes, 10, purpose, c1.nonce, secret, &got),
            auth::Check::kIncomplete);
  // The listener's proof: valid for this exchange only, and not a reflected connector proof.
  const auth::Welcome w = auth::make_welcome(secret, purpose, claim, c1.nonce);
  const auto* wb = reinterpret_cast<const std::uint8_t*>(&w);
  EXPECT_EQ(auth::check_welcome(wb, sizeof(w), purpose, secret, claim, c1.nonce), auth::Check::kOk);
  EXPECT_EQ(auth::check_welcome(wb, sizeof(w), purpose, secret, claim, c2.nonce),
            auth::Check::kBadMac);
  auth::Welcome reflected = w;
  reflected.mac = r.mac;
  EXPECT_EQ(auth::check_welcome(reinterpret_cast<const std::uint8_t*>(&reflected),
                                sizeof(reflected), purpose, secret, claim, c1.nonce),
            auth::Check::kBadMac);
}

TEST(Bootstrap, JobFormsDespiteGarbageConnections) {
  constexpr int kRanks = 4;
  const UniqueId id = UniqueId::create("127.0.0.1");
  ::testing::internal::CaptureStderr();
  Attacker attacker(id.port, auth::Purpose::kBootstrap);
  std::this_thread::sleep_for(300ms);  // the hostile connections are queued first

  std::vector<std::string> errors(kRanks);
  std::vector<std::size_t> wrong(kRanks, 0);
  const auto start = std::chrono::steady_clock::now();
  std::atomic<std::int64_t> formed_ms{0};
  std::vector<std::thread> ranks;
  for (int r = 0; r < kRanks; ++r) {
    ranks.emplace_back([&, r] {
      try {
        BootstrapOptions bo;
        bo.timeout = 20s;
        CommOptions co;
        co.timeout = 20s;
        auto comm = Communicator::create(Bootstrap::create(id, r, kRanks, bo), co);
        const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(
                            std::chrono::steady_clock::now() - start)
                            .count();
        formed_ms = std::max<std::int64_t>(formed_ms.load(), ms);
        constexpr std::size_t kCount = 4096;
        std::vector<float> in(kCount);
        std::vector<float> out(kCount);
        for (std::size_t i = 0; i < kCount; ++i) {
          in[i] = static_cast<float>(input_value(r, i, DataType::kFloat32, ReduceOp::kSum));
        }
        comm->all_reduce(in.data(), out.data(), kCount, DataType::kFloat32, ReduceOp::kSum).wait();
        for (std::size_t i = 0; i < kCount; ++i) {
          const double want = expected_reduce(i, kRanks, DataType::kFloat32, ReduceOp::kSum);
          if (!close_enough(out[i], want, DataType::kFloat32)) ++wrong[static_cast<std::size_t>(r)];
        }
      } catch (const std::exception& e) {
        errors[static_cast<std::size_t>(r)] = e.what();
      }
    });
  }
  for (auto& t : ranks) t.join();
  attacker.stop();
  const std::string log = ::testing::internal::GetCapturedStderr();

  for (int r = 0; r < kRanks; ++r) {
    EXPECT_EQ(errors[static_cast<std::size_t>(r)], "") << "rank " << r;
    EXPECT_EQ(wrong[static_cast<std::size_t>(r)], 0u) << "rank " << r;
  }
  // The slow-loris takes 9.6 s to finish its response and connections are given 5 s to prove
  // themselves: forming sooner shows that nothing waited on them.
  EXPECT_LT(formed_ms.load(), 4500) << log;
  EXPECT_EQ(attacker.wrong_secret_rejected(), 1) << log;
  EXPECT_NE(log.find("wrong secret"), std::string::npos) << log;
  EXPECT_NE(log.find("does not speak the dear protocol"), std::string::npos) << log;
  EXPECT_FALSE(leaks(log, id)) << "the secret was logged";
}

TEST(Bootstrap, SecondJobOnTheSameAddressCannotJoin) {
  constexpr int kRanks = 4;
  const UniqueId id = UniqueId::create("127.0.0.1");
  UniqueId intruder = id;
  intruder.secret = transport::random_secret();
  ::testing::internal::CaptureStderr();

  std::string root_error;
  std::unique_ptr<Bootstrap> root;
  std::thread root_thread([&] {
    try {
      BootstrapOptions bo;
      bo.timeout = 20s;
      root = Bootstrap::create(id, 0, kRanks, bo);
      root->barrier();
    } catch (const std::exception& e) {
      root_error = e.what();
    }
  });

  // The other job's ranks 1..3 point at the same address and must be turned away quickly.
  std::vector<std::string> intruder_errors(kRanks);
  std::vector<ErrorCode> intruder_codes(kRanks, ErrorCode::kInternal);
  const auto start = std::chrono::steady_clock::now();
  {
    std::vector<std::thread> others;
    for (int r = 1; r < kRanks; ++r) {
      others.emplace_back([&, r] {
        try {
          BootstrapOptions bo;
          bo.timeout = 3s;
          auto b = Bootstrap::create(intruder, r, kRanks, bo);
          intruder_errors[static_cast<std::size_t>(r)] = "joined";
        } catch (const Error& e) {
          intruder_errors[static_cast<std::size_t>(r)] = e.what();
          intruder_codes[static_cast<std::size_t>(r)] = e.code();
        }
      });
    }
    for (auto& t : others) t.join();
  }
  const auto took = std::chrono::steady_clock::now() - start;

  // The real ranks still join.
  std::vector<std::string> errors(kRanks);
  {
    std::vector<std::thread> ranks;
    for (int r = 1; r < kRanks; ++r) {
      ranks.emplace_back([&, r] {
        try {
          BootstrapOptions bo;
          bo.timeout = 20s;
          auto b = Bootstrap::create(id, r, kRanks, bo);
          b->barrier();
        } catch (const std::exception& e) {
          errors[static_cast<std::size_t>(r)] = e.what();
        }
      });
    }
    for (auto& t : ranks) t.join();
  }
  root_thread.join();
  const std::string log = ::testing::internal::GetCapturedStderr();

  EXPECT_EQ(root_error, "");
  EXPECT_LT(took, 4s);
  for (int r = 1; r < kRanks; ++r) {
    const auto i = static_cast<std::size_t>(r);
    EXPECT_EQ(errors[i], "") << "rank " << r;
    EXPECT_TRUE(intruder_codes[i] == ErrorCode::kBootstrap ||
                intruder_codes[i] == ErrorCode::kTimeout)
        << intruder_errors[i];
    EXPECT_FALSE(leaks(intruder_errors[i], id) || leaks(intruder_errors[i], intruder))
        << "a secret in an error: " << intruder_errors[i];
  }
  EXPECT_NE(log.find("wrong secret"), std::string::npos) << log;
  EXPECT_FALSE(leaks(log, id) || leaks(log, intruder)) << "a secret was logged";
}

// Two ranks set up their links (each connects, then accepts) while one's link listener is
// under attack: the concurrent accept serves them without waiting on the hostile connections.
TEST(Links, FormDespiteGarbageConnections) {
  const auto secret = transport::random_secret();
  const std::uint64_t tag = 0x1234;
  Fd listeners[2] = {transport::listen_on(transport::resolve("127.0.0.1", 0)),
                     transport::listen_on(transport::resolve("127.0.0.1", 0))};
  const std::uint16_t ports[2] = {transport::local_address(listeners[0].get()).port(),
                                  transport::local_address(listeners[1].get()).port()};
  ::testing::internal::CaptureStderr();
  Attacker attacker(ports[1], auth::Purpose::kLink);
  std::this_thread::sleep_for(300ms);
  std::string errors[2];
  std::size_t links[2] = {0, 0};
  const auto start = std::chrono::steady_clock::now();
  std::vector<std::thread> ranks;
  for (int r = 0; r < 2; ++r) {
    ranks.emplace_back([&, r] {
      try {
        const auto deadline = transport::deadline_after(10s);
        auto out = transport::tcp::connect_link(transport::resolve("127.0.0.1", ports[1 - r]), r,
                                                1 - r, 2, secret.data(), tag, deadline);
        auto in = transport::tcp::accept_links(listeners[r].get(), r, {1 - r}, 2, secret.data(),
                                               tag, deadline);
        links[r] = out.size() + in[0].size();
      } catch (const std::exception& e) {
        errors[r] = e.what();
      }
    });
  }
  for (auto& t : ranks) t.join();
  const auto took = std::chrono::steady_clock::now() - start;
  attacker.stop();
  const std::string log = ::testing::internal::GetCapturedStderr();
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(errors[r], "") << "rank " << r;
    EXPECT_EQ(links[r], 4u) << "rank " << r;
  }
  EXPECT_LT(took, 4s) << log;
  EXPECT_EQ(attacker.wrong_secret_rejected(), 1) << log;
  EXPECT_NE(log.find("wrong secret"), std::string::npos) << log;
}

// One TCP channel each way between two ranks of this process: [r] is rank r's end of the
// connection rank 0 opened.
std::array<std::unique_ptr<transport::Channel>, 2> tcp_channel_pair() {
  const auto secret = transport::random_secret();
  Fd listeners[2] = {transport::listen_on(transport::resolve("127.0.0.1", 0)),
                     transport::listen_on(transport::resolve("127.0.0.1", 0))};
  std::vector<std::unique_ptr<transport::Channel>> out[2];
  std::vector<std::vector<std::unique_ptr<transport::Channel>>> in[2];
  std::vector<std::thread> ranks;
  for (int r = 0; r < 2; ++r) {
    ranks.emplace_back([&, r] {
      const auto deadline = transport::deadline_after(10s);
      const auto port = transport::local_address(listeners[1 - r].get()).port();
      out[r] = transport::tcp::connect_link(transport::resolve("127.0.0.1", port), r, 1 - r, 1,
                                            secret.data(), 0x77, deadline);
      in[r] = transport::tcp::accept_links(listeners[r].get(), r, {1 - r}, 1, secret.data(), 0x77,
                                           deadline);
    });
  }
  for (auto& t : ranks) t.join();
  return {std::move(out[0][0]), std::move(in[1][0][0])};
}

// A rank that finished and closed while its neighbour was still sending to it resets the
// connection (its socket held data it never read). The neighbour must still receive every
// byte the closed rank sent, and learn of the close as a close, not as a broken link: whether
// that is an error depends on whether an operation still needed the link.
TEST(Links, APeerThatClosesWithUnreadDataStillDeliversWhatItSent) {
  auto pair = tcp_channel_pair();
  transport::Channel& early = *pair[0];
  transport::Channel& late = *pair[1];
  CollectSink early_sink(1);
  CollectSink late_sink(1);
  std::vector<char> last(64 * 1024);
  for (std::size_t i = 0; i < last.size(); ++i) last[i] = peer_byte(0, 1, 0, i);
  transport::FrameHeader h;
  h.bytes = static_cast<std::uint32_t>(last.size());
  ASSERT_TRUE(early.try_send(h, last.data(), 1));
  const auto deadline = std::chrono::steady_clock::now() + 10s;
  while (early.queued() > 0 && std::chrono::steady_clock::now() < deadline) {
    early.progress(early_sink, false);
  }
  ASSERT_EQ(early.queued(), 0u);
  // The neighbour sends more than the closing rank's socket can hold, which it never reads.
  std::vector<char> flood(32u << 20, 'f');
  h.bytes = static_cast<std::uint32_t>(flood.size());
  ASSERT_TRUE(late.try_send(h, flood.data(), 2));
  for (int i = 0; i < 50; ++i) {
    late.progress(late_sink, false);
    std::this_thread::sleep_for(1ms);
  }
  early.close();
  std::string error;
  try {
    while (late_sink.closed == 0 && std::chrono::steady_clock::now() < deadline) {
      late.progress(late_sink, true);
      std::this_thread::sleep_for(1ms);
    }
  } catch (const std::exception& e) {
    error = e.what();
  }
  EXPECT_EQ(error, "");
  EXPECT_EQ(late_sink.closed, 1u);
  EXPECT_TRUE(late.closed());
  EXPECT_EQ(late_sink.sent, 0u) << "the flood cannot have been delivered";
  ASSERT_EQ(late_sink.got[0].size(), 1u);
  EXPECT_TRUE(late_sink.got[0][0] == last) << "the closed rank's last message arrived damaged";
}

// Large payloads leave without a copy (the kernel sends from the caller's pages), so they
// count as sent only once the peer has read them: not while it reads nothing, and then
// exactly once, before its close is reported, with every byte as it was.
TEST(Links, ASplicedPayloadIsReportedSentOnlyOnceThePeerHasReadIt) {
  ASSERT_GE(std::size_t{1} << 20, transport::tcp::zerocopy_bytes_from_env())
      << "DEAR_TCP_ZEROCOPY_BYTES is set above this test's message";
  ASSERT_GT(transport::tcp::zerocopy_bytes_from_env(), 0u) << "DEAR_TCP_ZEROCOPY_BYTES=0";
  // Socket buffers that hold the whole message: it is all handed over without a read, and
  // only the notice can tell the sender that it was read.
  ::setenv("DEAR_SOCKET_BUFFER", "8M", 1);
  auto pair = tcp_channel_pair();
  ::unsetenv("DEAR_SOCKET_BUFFER");
  transport::Channel& from = *pair[0];
  transport::Channel& to = *pair[1];
  CollectSink from_sink(1);
  CollectSink to_sink(1);
  std::vector<char> big(1 << 20);
  for (std::size_t i = 0; i < big.size(); ++i) big[i] = peer_byte(0, 1, 3, i);
  transport::FrameHeader h;
  h.type = transport::FrameType::kData;
  h.bytes = static_cast<std::uint32_t>(big.size());
  ASSERT_TRUE(from.try_send(h, big.data(), 7));
  for (int i = 0; i < 100; ++i) {
    from.progress(from_sink, true);
    std::this_thread::sleep_for(1ms);
  }
  EXPECT_EQ(from_sink.sent, 0u) << "reported sent while the peer had read nothing";
  EXPECT_EQ(from.queued(), 1u);

  const auto deadline = std::chrono::steady_clock::now() + 10s;
  while (to_sink.got[0].empty() && std::chrono::steady_clock::now() < deadline) {
    from.progress(from_sink, true);
    to.progress(to_sink, true);
  }
  ASSERT_EQ(to_sink.got[0].size(), 1u);
  EXPECT_TRUE(to_sink.got[0][0] == big) << "the spliced payload arrived damaged";
  to.close();  // the consumed notice went out with the read, before the FIN
  while (from_sink.closed == 0 && std::chrono::steady_clock::now() < deadline) {
    from.progress(from_sink, true);
    std::this_thread::sleep_for(1ms);
  }
  EXPECT_EQ(from_sink.sent, 1u);
  EXPECT_EQ(from_sink.closed, 1u);
  EXPECT_EQ(to_sink.sent, 0u);
}

// A consumed notice for messages that were never spliced is a protocol violation that names
// the peer, not a miscount.
TEST(Links, AConsumedNoticeForNothingIsAProtocolViolation) {
  auto pair = tcp_channel_pair();
  CollectSink sink(1);
  transport::FrameHeader h;
  h.type = transport::FrameType::kConsumed;
  h.count = 1;
  ASSERT_TRUE(pair[0]->try_send(h, nullptr, 1));
  const auto deadline = std::chrono::steady_clock::now() + 10s;
  std::string error;
  try {
    while (std::chrono::steady_clock::now() < deadline) {
      pair[0]->progress(sink, true);
      pair[1]->progress(sink, true);
    }
  } catch (const Error& e) {
    error = e.what();
  }
  EXPECT_NE(error.find("protocol violation: a consumed notice for 1 messages"), std::string::npos)
      << error;
  EXPECT_NE(error.find("rank 0"), std::string::npos) << error;
}

// Closing waits for the peer to acknowledge what was sent, but boundedly: channels closed with
// one shared deadline to a peer that reads nothing wait for that deadline once, not each in
// turn (a communicator's teardown closes all its channels so).
TEST(Links, ClosingToAPeerThatReadsNothingWaitsOneSharedDeadline) {
  constexpr int kPairs = 4;
  std::vector<std::array<std::unique_ptr<transport::Channel>, 2>> pairs;
  for (int i = 0; i < kPairs; ++i) pairs.push_back(tcp_channel_pair());
  std::vector<char> flood(32u << 20, 'f');
  transport::FrameHeader h;
  h.bytes = static_cast<std::uint32_t>(flood.size());
  CollectSink sink(1);
  for (auto& p : pairs) {
    ASSERT_TRUE(p[0]->try_send(h, flood.data(), 1));
    for (int i = 0; i < 20; ++i) p[0]->progress(sink, false);  // fills the socket buffers
    ASSERT_EQ(p[0]->queued(), 1u) << "the peer's buffers took 32 MiB";
  }
  constexpr auto kLinger = 300ms;
  const auto start = std::chrono::steady_clock::now();
  for (auto& p : pairs) p[0]->close_by(start + kLinger);
  const auto took = std::chrono::steady_clock::now() - start;
  for (auto& p : pairs) EXPECT_TRUE(p[0]->closed());
  EXPECT_GE(took, kLinger - 10ms) << "closed before the deadline with unacknowledged data";
  EXPECT_LT(took, kLinger + 700ms) << "the waits added up";
  EXPECT_EQ(sink.sent, 0u);
}

// The congestion control a socket runs.
std::string congestion_of(int fd) {
  char name[32] = {};
  socklen_t len = sizeof name;
  EXPECT_EQ(::getsockopt(fd, IPPROTO_TCP, TCP_CONGESTION, name, &len), 0);
  return std::string(name);
}

std::vector<std::string> words_of_file(const char* path) {
  std::ifstream in(path);
  std::vector<std::string> out;
  for (std::string w; in >> w;) out.push_back(w);
  return out;
}

bool has_word(const std::vector<std::string>& words, const std::string& w) {
  return std::find(words.begin(), words.end(), w) != words.end();
}

// A connection over loopback made with listen_on / connect_with_retry / accept_until, with
// DEAR_TCP_CONGESTION set to `value` (nullptr: unset): the congestion control of both ends.
std::pair<std::string, std::string> loopback_congestion(const char* value) {
  if (value != nullptr) {
    ::setenv("DEAR_TCP_CONGESTION", value, 1);
  } else {
    ::unsetenv("DEAR_TCP_CONGESTION");
  }
  const auto deadline = dear::transport::deadline_after(std::chrono::seconds(10));
  auto listener = dear::transport::listen_on(dear::transport::resolve("127.0.0.1", 0));
  const auto addr = dear::transport::local_address(listener.get());
  auto client = dear::transport::connect_with_retry(addr, deadline, "test");
  auto server = dear::transport::accept_until(listener.get(), deadline);
  ::unsetenv("DEAR_TCP_CONGESTION");
  EXPECT_TRUE(server.valid());
  return {congestion_of(client.get()), server.valid() ? congestion_of(server.get()) : ""};
}

TEST(CongestionControl, LoopbackConnectionsRunUnpacedByDefault) {
  const auto available = words_of_file("/proc/sys/net/ipv4/tcp_available_congestion_control");
  const auto allowed = words_of_file("/proc/sys/net/ipv4/tcp_allowed_congestion_control");
  // cubic where this process may pick it (allowed to all, or root), else reno.
  const bool cubic =
      has_word(available, "cubic") && (has_word(allowed, "cubic") || ::geteuid() == 0);
  const std::string want = cubic ? "cubic" : "reno";
  for (const char* value : {static_cast<const char*>(nullptr), "auto"}) {
    const auto [client, server] = loopback_congestion(value);
    EXPECT_EQ(client, want) << (value ? value : "unset");
    EXPECT_EQ(server, want) << (value ? value : "unset");
  }
}

// The IPv4 addresses of this host's interfaces other than loopback, as text.
std::vector<std::string> non_loopback_ipv4() {
  std::vector<std::string> out;
  ifaddrs* list = nullptr;
  if (::getifaddrs(&list) != 0) return out;
  for (const ifaddrs* i = list; i != nullptr; i = i->ifa_next) {
    if (i->ifa_addr == nullptr || i->ifa_addr->sa_family != AF_INET) continue;
    char text[INET_ADDRSTRLEN] = {};
    const auto* in = reinterpret_cast<const sockaddr_in*>(i->ifa_addr);
    if ((ntohl(in->sin_addr.s_addr) >> 24) == 127) continue;
    if (::inet_ntop(AF_INET, &in->sin_addr, text, sizeof(text)) != nullptr) out.emplace_back(text);
  }
  ::freeifaddrs(list);
  return out;
}

// A host's own non-loopback address is routed over loopback too: connections to it, and a
// listener whose peers all have such addresses, run unpaced; a listener expecting a peer of
// another host keeps the system's choice.
TEST(CongestionControl, ConnectionsToThisHostsOwnAddressesRunUnpaced) {
  const auto own = non_loopback_ipv4();
  if (own.empty()) GTEST_SKIP() << "this host has no IPv4 address other than loopback";
  const std::string elsewhere = "203.0.113.9";  // TEST-NET-3, never this host's
  if (std::find(own.begin(), own.end(), elsewhere) != own.end()) {
    GTEST_SKIP() << "this host holds " << elsewhere;
  }
  EXPECT_TRUE(transport::on_this_host(transport::resolve(own[0], 0)));
  EXPECT_TRUE(transport::on_this_host(transport::resolve("127.0.0.1", 0)));
  EXPECT_TRUE(transport::on_this_host(transport::resolve("::1", 0)));
  EXPECT_FALSE(transport::on_this_host(transport::resolve(elsewhere, 0)));

  const auto available = words_of_file("/proc/sys/net/ipv4/tcp_available_congestion_control");
  const auto allowed = words_of_file("/proc/sys/net/ipv4/tcp_allowed_congestion_control");
  const bool cubic =
      has_word(available, "cubic") && (has_word(allowed, "cubic") || ::geteuid() == 0);
  const std::string unpaced = cubic ? "cubic" : "reno";
  const auto system = words_of_file("/proc/sys/net/ipv4/tcp_congestion_control");
  ASSERT_EQ(system.size(), 1u);
  ::unsetenv("DEAR_TCP_CONGESTION");
  const auto deadline = transport::deadline_after(std::chrono::seconds(10));
  for (const bool peers_here : {true, false}) {
    Fd listener = transport::bind_unlistened(transport::resolve(own[0], 0));
    const auto addr = transport::local_address(listener.get());
    transport::listen_for(listener.get(), {transport::resolve(peers_here ? own[0] : elsewhere, 0)});
    Fd client = transport::connect_with_retry(addr, deadline, "test");
    Fd server = transport::accept_until(listener.get(), deadline);
    ASSERT_TRUE(server.valid());
    EXPECT_EQ(congestion_of(client.get()), unpaced) << "the connecting end";
    EXPECT_EQ(congestion_of(server.get()), peers_here ? unpaced : system[0])
        << (peers_here ? "peers on this host" : "a peer elsewhere");
  }
  // A listener that does not listen yet refuses; connect_with_retry tries until it listens.
  Fd late = transport::bind_unlistened(transport::resolve("127.0.0.1", 0));
  const auto late_addr = transport::local_address(late.get());
  std::thread opener([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    transport::listen_for(late.get(), {transport::resolve("127.0.0.1", 0)});
  });
  Fd client = transport::connect_with_retry(late_addr, deadline, "test");
  opener.join();
  EXPECT_TRUE(client.valid());
  EXPECT_TRUE(transport::accept_until(late.get(), deadline).valid());
}

TEST(CongestionControl, SystemAndNamedValues) {
  const auto system = words_of_file("/proc/sys/net/ipv4/tcp_congestion_control");
  ASSERT_EQ(system.size(), 1u);
  const auto [client, server] = loopback_congestion("system");
  EXPECT_EQ(client, system[0]);
  EXPECT_EQ(server, system[0]);
  const auto [c2, s2] = loopback_congestion("reno");  // every kernel has it, every user may pick it
  EXPECT_EQ(c2, "reno");
  EXPECT_EQ(s2, "reno");
  ::setenv("DEAR_TCP_CONGESTION", "no-such-algorithm", 1);
  try {
    dear::transport::check_congestion_control_env();
    ADD_FAILURE() << "an unknown algorithm was accepted";
  } catch (const dear::Error& e) {
    EXPECT_EQ(e.code(), dear::ErrorCode::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find("DEAR_TCP_CONGESTION=no-such-algorithm"),
              std::string::npos)
        << e.what();
  }
  ::unsetenv("DEAR_TCP_CONGESTION");
}

// A loopback listener and one connection to it made with plain sockets, as a library dear
// drives would make them (the system's congestion control, nothing of dear's).
struct PlainConnection {
  Fd listener;
  Fd client;
  Fd server;
  transport::SockAddr listen_addr;
};

Fd plain_listener(transport::SockAddr* addr) {
  Fd l(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  sockaddr_in in{};
  in.sin_family = AF_INET;
  in.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  EXPECT_EQ(::bind(l.get(), reinterpret_cast<const sockaddr*>(&in), sizeof(in)), 0);
  EXPECT_EQ(::listen(l.get(), 8), 0);
  *addr = transport::local_address(l.get());
  return l;
}

PlainConnection plain_connection() {
  PlainConnection c;
  c.listener = plain_listener(&c.listen_addr);
  c.client = Fd(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  EXPECT_EQ(::connect(c.client.get(), c.listen_addr.get(), c.listen_addr.len), 0);
  c.server = Fd(::accept(c.listener.get(), nullptr, nullptr));
  EXPECT_TRUE(c.server.valid());
  return c;
}

// Another library's sockets between two endpoints get dear's choice: the listener (and what
// it accepts later) and the connection both ways; sockets of other endpoints keep theirs.
TEST(CongestionControl, AnotherLibrarysSocketsBetweenTwoEndpointsAdoptIt) {
  PlainConnection ours = plain_connection();
  PlainConnection other = plain_connection();
  const std::string before = congestion_of(other.client.get());
  const auto peer = transport::peer_address(ours.client.get());  // the listener's address
  const auto own = peer;  // seen from the accepting end: its own address
  const auto own_client = transport::local_address(ours.client.get());

  ::setenv("DEAR_TCP_CONGESTION", "system", 1);
  EXPECT_EQ(transport::adopt_congestion_control(own, own_client), 0);

  ::setenv("DEAR_TCP_CONGESTION", "reno", 1);  // every kernel has it, every user may pick it
  // The accepting end's view: its own address is the listener's; the connecting end is the peer.
  EXPECT_EQ(transport::adopt_congestion_control(own, own_client), 2)
      << "the listener and the accepted connection";
  EXPECT_EQ(congestion_of(ours.listener.get()), "reno");
  EXPECT_EQ(congestion_of(ours.server.get()), "reno");
  // The connecting end's view: the peer is the listener.
  transport::SockAddr nowhere = transport::resolve("127.0.0.2", 1);
  EXPECT_EQ(transport::adopt_congestion_control(nowhere, peer), 1) << "the connecting end";
  EXPECT_EQ(congestion_of(ours.client.get()), "reno");
  EXPECT_EQ(congestion_of(other.client.get()), before);
  EXPECT_EQ(congestion_of(other.server.get()), before);
  EXPECT_EQ(congestion_of(other.listener.get()), before);

  // A connection the listener accepts afterwards has it from the start.
  Fd late(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  ASSERT_EQ(::connect(late.get(), ours.listen_addr.get(), ours.listen_addr.len), 0);
  Fd accepted(::accept(ours.listener.get(), nullptr, nullptr));
  ASSERT_TRUE(accepted.valid());
  EXPECT_EQ(congestion_of(accepted.get()), "reno");

  // auto: only between ends on this host.
  ::setenv("DEAR_TCP_CONGESTION", "auto", 1);
  EXPECT_EQ(transport::adopt_congestion_control(other.listen_addr,
                                                transport::resolve("192.0.2.77", 4000)),
            0)
      << "a peer on another host keeps the system's choice";
  EXPECT_EQ(congestion_of(other.listener.get()), before);
  EXPECT_GE(transport::adopt_congestion_control(other.listen_addr,
                                                transport::local_address(other.client.get())),
            2)
      << "the listener and the accepted connection";
  const std::string unpaced = congestion_of(other.server.get());
  EXPECT_TRUE(unpaced == "cubic" || unpaced == "reno") << unpaced;
  ::unsetenv("DEAR_TCP_CONGESTION");
}

TEST(Interface, LoopbackResolvesAndAnUnknownNameIsNamedInTheError) {
  EXPECT_EQ(interface_address("lo", 0), "127.0.0.1");
  try {
    (void)interface_address("no-such-if0", 3);
    ADD_FAILURE() << "an unknown interface was accepted";
  } catch (const Error& e) {
    const std::string what = e.what();
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
    EXPECT_EQ(e.rank(), 3);
    EXPECT_NE(what.find("DEAR_SOCKET_IFNAME=no-such-if0"), std::string::npos) << what;
    EXPECT_NE(what.find("lo"), std::string::npos) << what;  // lists what does exist
  }
}

TEST(Welcome, ARefusalIsProvenAndCarriesItsStatus) {
  const std::array<std::uint8_t, 16> key = transport::random_secret();
  const auth::Secret secret{key.data(), key.size()};
  const auto purpose = auth::Purpose::kBootstrap;
  auth::Claim claim{};
  claim.rank = 2;
  claim.world_size = 4;
  const auth::Nonce nonce = auth::fresh_nonce();
  const auth::Welcome w = auth::make_welcome(secret, purpose, claim, nonce, 0x101);
  const auto* wb = reinterpret_cast<const std::uint8_t*>(&w);
  std::uint32_t status = 0;
  EXPECT_EQ(auth::check_welcome(wb, sizeof(w), purpose, secret, claim, nonce, &status),
            auth::Check::kRefused);
  EXPECT_EQ(status, 0x101U);
  // A status changed on the way does not verify.
  auth::Welcome forged = w;
  forged.status = 0;
  EXPECT_EQ(auth::check_welcome(reinterpret_cast<const std::uint8_t*>(&forged), sizeof(forged),
                                purpose, secret, claim, nonce, &status),
            auth::Check::kBadMac);
}

}  // namespace
}  // namespace dear::testing
