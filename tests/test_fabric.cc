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

#include "channel_exchange.h"
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
  o.fabric_slot_bytes = 128 * 1024;      // (by default a ring slot holds a whole slice)
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

// Every rank joined to rank^1 and rank^2 exchanges messages of several sizes both ways on every
// channel (tests/channel_exchange.h).
TEST_P(Fabric, ConnectPeersExchangesBothWaysOnEveryChannel) {
  const std::string provider = GetParam();
  const auto failures = exchange_with_peers(4, [&](Bootstrap& bs, const std::vector<int>& peers) {
    transport::fabric::FabricOptions fo;
    fo.provider = provider;
    return transport::fabric::connect_peers(bs, peers, fo);
  });
  for (std::size_t r = 0; r < failures.size(); ++r) EXPECT_EQ(failures[r], "") << "rank " << r;
}

// The same exchange with every payload fragment copied into its slot, and with payloads sent
// in place from registered memory (the path of providers that need FI_MR_LOCAL), from the
// smallest fragments on.
TEST_P(Fabric, ConnectPeersExchangesWithCopiedAndRegisteredPayloads) {
  const std::string provider = GetParam();
  for (const bool in_place : {false, true}) {
    const auto failures = exchange_with_peers(4, [&](Bootstrap& bs, const std::vector<int>& peers) {
      transport::fabric::FabricOptions fo;
      fo.provider = provider;
      fo.in_place_bytes = in_place ? 1 : 0;
      fo.register_in_place = in_place;
      return transport::fabric::connect_peers(bs, peers, fo);
    });
    for (std::size_t r = 0; r < failures.size(); ++r) {
      EXPECT_EQ(failures[r], "") << "rank " << r << (in_place ? " in place" : " copied");
    }
  }
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
