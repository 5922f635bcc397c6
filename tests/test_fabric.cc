// The libfabric transport: setup errors, rank disagreement, a peer that leaves, and messages
// split into many fragments, over every provider this host offers. The slot/credit protocol
// and the fragmenting it shares with verbs are tested on their own in test_rma.cc; the
// collectives themselves are checked over fabric by the conformance suite (test_collectives.cc,
// built once per provider).
#include <gtest/gtest.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <thread>
#include <vector>

#include "dear/bootstrap.h"
#include "harness.h"
#include "reference.h"
#include "transport/fabric/fabric_link.h"

namespace dear::testing {
namespace {

using namespace std::chrono_literals;

// ---- the fabric transport
// ----------------------------------------------------------------

const std::vector<std::string> kProviders = {"tcp;ofi_rxm", "shm"};

class Fabric : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    if (auto why = transport::fabric::unavailable_reason(GetParam())) GTEST_SKIP() << *why;
  }
  CommOptions options() const {
    CommOptions o;
    o.transport = "fabric";
    o.fabric_provider = GetParam();
    o.timeout = 20s;
    return o;
  }
};

std::string what_of(const std::exception_ptr& e) {
  try {
    std::rethrow_exception(e);
  } catch (const std::exception& x) {
    return x.what();
  }
}

const Error* as_error(const std::exception_ptr& e, Error& storage) {
  try {
    std::rethrow_exception(e);
  } catch (const Error& x) {
    storage = x;
    return &storage;
  } catch (...) {
    return nullptr;
  }
}

TEST(FabricSetup, UnknownProviderNamesItAndTheAvailableOnes) {
  if (!transport::fabric::built()) GTEST_SKIP() << "this build has no libfabric transport";
  CommOptions o;
  o.transport = "fabric";
  o.fabric_provider = "no-such-provider";
  const auto errors = run_ranks_collect(
      2, [](Communicator&) {}, o);
  for (const auto& e : errors) {
    ASSERT_TRUE(e) << "creating a communicator on a missing provider must fail";
    Error err(ErrorCode::kInternal, "");
    ASSERT_NE(as_error(e, err), nullptr) << what_of(e);
    EXPECT_EQ(err.code(), ErrorCode::kInvalidArgument) << what_of(e);
    EXPECT_NE(what_of(e).find("'no-such-provider'"), std::string::npos) << what_of(e);
    EXPECT_NE(what_of(e).find("available:"), std::string::npos) << what_of(e);
  }
}

TEST(FabricSetup, TransportNameIsCheckedAgainstTheBuild) {
  CommOptions o;
  o.transport = "carrier-pigeon";
  const auto errors = run_ranks_collect(
      1, [](Communicator&) {}, o);
  ASSERT_TRUE(errors[0]);
  EXPECT_NE(what_of(errors[0]).find("available: tcp"), std::string::npos) << what_of(errors[0]);
  if (transport::fabric::built()) {
    EXPECT_NE(what_of(errors[0]).find("fabric"), std::string::npos) << what_of(errors[0]);
  }
}

TEST_P(Fabric, MismatchedCountsFailEveryRank) {
  const auto start = std::chrono::steady_clock::now();
  const auto errors = run_ranks_collect(
      3,
      [](Communicator& comm) {
        std::vector<float> buf(64, 1.0f);
        const std::size_t count = comm.rank() == 1 ? 10 : 12;
        comm.all_reduce(buf.data(), buf.data(), count, DataType::kFloat32, ReduceOp::kSum).wait();
      },
      options());
  EXPECT_LT(std::chrono::steady_clock::now() - start, 10s) << "the mismatch took the deadline";
  for (std::size_t r = 0; r < errors.size(); ++r) {
    ASSERT_TRUE(errors[r]) << "rank " << r << " did not fail";
    Error err(ErrorCode::kInternal, "");
    ASSERT_NE(as_error(errors[r], err), nullptr) << what_of(errors[r]);
    EXPECT_EQ(err.code(), ErrorCode::kMismatch) << what_of(errors[r]);
    EXPECT_NE(what_of(errors[r]).find("count=10"), std::string::npos) << what_of(errors[r]);
    EXPECT_NE(what_of(errors[r]).find("count=12"), std::string::npos) << what_of(errors[r]);
  }
}

// A rank that leaves: the others fail (not hang), and the error names the rank
// that left.
TEST_P(Fabric, PeerThatLeavesIsNamed) {
  const auto start = std::chrono::steady_clock::now();
  const auto errors = run_ranks_collect(
      3,
      [](Communicator& comm) {
        if (comm.rank() == 2) return;  // destroys its communicator at once
        std::this_thread::sleep_for(50ms);
        std::vector<float> buf(1000, 1.0f);
        comm.all_reduce(buf.data(), buf.data(), buf.size(), DataType::kFloat32, ReduceOp::kSum)
            .wait();
      },
      options());
  EXPECT_LT(std::chrono::steady_clock::now() - start, 15s) << "a departed peer took too long";
  EXPECT_FALSE(errors[2]);
  for (std::size_t r = 0; r < 2; ++r) {
    ASSERT_TRUE(errors[r]) << "rank " << r << " did not fail";
    EXPECT_NE(what_of(errors[r]).find("rank 2"), std::string::npos) << what_of(errors[r]);
  }
}

// Slices far larger than a staging slot: every message is split into many
// fragments (kStream reduction and kDirect copies across fragment boundaries),
// checked element by element.
TEST_P(Fabric, LargeSlicesSplitIntoFragments) {
  CommOptions o = options();
  o.slice_bytes = 1024 * 1024 + 7 * 64;  // several 128 KiB slots per message, uneven
  o.channels = 2;
  const int n = 3;
  run_ranks(
      n,
      [&](Communicator& comm) {
        const int r = comm.rank();
        for (const auto t : {DataType::kFloat32, DataType::kFloat64, DataType::kInt8}) {
          const std::size_t count = 300007;  // prime
          std::vector<char> in(count * dtype_size(t));
          for (std::size_t i = 0; i < count; ++i) {
            store(in.data(), i, t, input_value(r, i, t, ReduceOp::kSum));
          }
          std::vector<char> out(in.size());
          comm.all_reduce(in.data(), out.data(), count, t, ReduceOp::kSum).wait();
          Mismatches bad = check_all_reduce(out.data(), count, n, t, ReduceOp::kSum);
          ASSERT_EQ(bad.count, 0u) << to_string(t) << " rank " << r << ": " << bad.first;
          std::vector<char> all(in.size() * static_cast<std::size_t>(n));
          comm.all_gather(in.data(), all.data(), count, t).wait();
          for (int src = 0; src < n; ++src) {
            for (std::size_t i = 0; i < count; ++i) {
              const double want = input_value(src, i, t, ReduceOp::kSum);
              const double got = load(all.data(), static_cast<std::size_t>(src) * count + i, t);
              if (got != want) bad.add(i, got, want);
            }
          }
          ASSERT_EQ(bad.count, 0u) << "all_gather " << to_string(t) << ": " << bad.first;
        }
      },
      o);
}

// ---- links to arbitrary peers (connect_peers)
// ----------------------------------------------------------------

// Records what arrives on a set of channels: each message's payload, by channel.
struct CollectSink final : transport::RecvSink {
  std::vector<std::vector<std::vector<char>>> got;  // [channel][message] payload
  std::vector<std::vector<char>> current;           // [channel] the message being received
  std::size_t sent = 0;
  std::size_t closed = 0;
  explicit CollectSink(std::size_t channels) : got(channels), current(channels) {}
  transport::RecvTarget on_header(int channel, const transport::FrameHeader& h) override {
    auto& buf = current[static_cast<std::size_t>(channel)];
    buf.assign(h.bytes, 0);
    return {transport::RecvTarget::kDirect, buf.data(), 1};
  }
  void on_payload(int, const transport::FrameHeader&, const char*, std::size_t,
                  std::size_t) override {}
  void on_message(int channel, const transport::FrameHeader&) override {
    const auto c = static_cast<std::size_t>(channel);
    got[c].push_back(std::move(current[c]));
  }
  void on_sent(int, std::uint64_t) override { ++sent; }
  void on_closed(int) override { ++closed; }
};

// Byte i of message m from rank `from` to rank `to`.
char peer_byte(int from, int to, int m, std::size_t i) {
  return static_cast<char>((from * 131 + to * 31 + m * 7 + static_cast<int>(i % 251)) & 0xff);
}

// 4 ranks as threads, each joined to rank^1 and rank^2 (the links of recursive doubling): every
// rank sends messages of several sizes (one spanning many slots) on every channel, both ways at
// once, and checks every byte it receives and on which channel it arrives.
TEST_P(Fabric, ConnectPeersExchangesBothWaysOnEveryChannel) {
  const int n = 4;
  const std::vector<std::size_t> sizes = {0, 1, 4096, 300007};
  const UniqueId id = UniqueId::create("127.0.0.1");
  std::vector<std::string> failures(static_cast<std::size_t>(n));
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      std::string& failure = failures[static_cast<std::size_t>(r)];
      try {
        auto bs = Bootstrap::create(id, r, n);
        const std::vector<int> peers = {r ^ 1, r ^ 2};
        transport::fabric::FabricOptions fo;
        fo.provider = GetParam();
        auto chans = transport::fabric::connect_peers(*bs, peers, fo);
        if (chans.size() != peers.size()) {
          failure = "got " + std::to_string(chans.size()) + " channels";
          return;
        }
        std::vector<std::vector<std::vector<char>>> out(peers.size());
        for (std::size_t c = 0; c < peers.size(); ++c) {
          for (std::size_t m = 0; m < sizes.size(); ++m) {
            std::vector<char> p(sizes[m]);
            for (std::size_t i = 0; i < p.size(); ++i) {
              p[i] = peer_byte(r, peers[c], static_cast<int>(m), i);
            }
            out[c].push_back(std::move(p));
          }
        }
        CollectSink sink(peers.size());
        // Each channel: the messages, then (once everything from the peer is in) an
        // acknowledgement, so no rank closes before its peers have all it sent.
        std::vector<std::size_t> next(peers.size(), 0);
        std::vector<bool> acked(peers.size(), false);
        std::vector<bool> ack_sent(peers.size(), false);
        const auto deadline = std::chrono::steady_clock::now() + 20s;
        for (;;) {
          bool done = true;
          for (std::size_t c = 0; c < peers.size(); ++c) {
            auto& ch = *chans[c];
            while (next[c] < sizes.size()) {
              transport::FrameHeader h;
              h.bytes = static_cast<std::uint32_t>(sizes[next[c]]);
              h.seq = next[c];
              if (!ch.try_send(h, out[c][next[c]].data(), next[c])) break;
              ++next[c];
            }
            const bool all_in = sink.got[c].size() >= sizes.size();
            if (all_in && !ack_sent[c]) {
              transport::FrameHeader h;
              h.type = transport::FrameType::kPosted;
              h.seq = 1000;
              ack_sent[c] = ch.try_send(h, nullptr, 1000);
            }
            ch.progress(sink, true);
            acked[c] = sink.got[c].size() > sizes.size();
            done = done && next[c] == sizes.size() && ack_sent[c] && acked[c];
          }
          if (done) break;
          if (std::chrono::steady_clock::now() > deadline) {
            failure = "timed out: received";
            for (std::size_t c = 0; c < peers.size(); ++c) {
              failure += " " + std::to_string(sink.got[c].size()) + " from rank " +
                         std::to_string(peers[c]);
            }
            return;
          }
          std::this_thread::yield();
        }
        for (std::size_t c = 0; c < peers.size(); ++c) {
          for (std::size_t m = 0; m < sizes.size(); ++m) {
            const auto& g = sink.got[c][m];
            if (g.size() != sizes[m]) {
              failure = "message " + std::to_string(m) + " from rank " + std::to_string(peers[c]) +
                        " has " + std::to_string(g.size()) + " bytes, want " +
                        std::to_string(sizes[m]);
              return;
            }
            for (std::size_t i = 0; i < g.size(); ++i) {
              if (g[i] != peer_byte(peers[c], r, static_cast<int>(m), i)) {
                failure = "message " + std::to_string(m) + " from rank " +
                          std::to_string(peers[c]) + ": byte " + std::to_string(i) + " wrong";
                return;
              }
            }
          }
          EXPECT_NE(chans[c]->describe().find("rank " + std::to_string(peers[c])),
                    std::string::npos)
              << chans[c]->describe();
        }
        for (auto& ch : chans) ch->close();
      } catch (const std::exception& e) {
        failure = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < n; ++r) EXPECT_EQ(failures[static_cast<std::size_t>(r)], "") << "rank " << r;
}

// Asymmetric lists are named, not hung: rank 0 lists rank 1, rank 1 lists nobody.
TEST_P(Fabric, ConnectPeersNamesAPeerThatDoesNotListThisRank) {
  const UniqueId id = UniqueId::create("127.0.0.1");
  std::vector<std::string> failures(2);
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      try {
        auto bs = Bootstrap::create(id, r, 2);
        transport::fabric::FabricOptions fo;
        fo.provider = GetParam();
        auto chans = transport::fabric::connect_peers(
            *bs, r == 0 ? std::vector<int>{1} : std::vector<int>{}, fo);
      } catch (const std::exception& e) {
        failures[static_cast<std::size_t>(r)] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_NE(failures[0].find("does not list rank 0"), std::string::npos) << failures[0];
  EXPECT_EQ(failures[1], "");
}

INSTANTIATE_TEST_SUITE_P(Providers, Fabric, ::testing::ValuesIn(kProviders),
                         [](const ::testing::TestParamInfo<std::string>& p) {
                           std::string s = p.param;
                           std::replace_if(
                               s.begin(), s.end(), [](char c) { return !std::isalnum(c); }, '_');
                           return s;
                         });

}  // namespace
}  // namespace dear::testing
