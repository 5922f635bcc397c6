// The libfabric transport: setup errors, rank disagreement, a peer that leaves, and messages
// split into many fragments, over every provider this host offers. The slot/credit protocol
// and the fragmenting it shares with verbs are tested on their own in test_rma.cc; the
// collectives themselves are checked over fabric by the conformance suite (test_collectives.cc,
// built once per provider).
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cctype>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <future>
#include <map>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "channel_exchange.h"
#include "dear/bootstrap.h"
#include "harness.h"
#include "reference.h"
#include "transport/fabric/fabric_link.h"

namespace dear::testing {
namespace {

// all_reduce (sum) and all_gather of `count` elements of type `t` on every rank of an
// `n`-rank communicator, each result checked element by element against the reference;
// `what` names the case in a failure.
void expect_reduce_and_gather(Communicator& comm, int n, DataType t, std::size_t count,
                              const std::string& what) {
  const int r = comm.rank();
  std::vector<char> in(count * dtype_size(t));
  for (std::size_t i = 0; i < count; ++i) {
    store(in.data(), i, t, input_value(r, i, t, ReduceOp::kSum));
  }
  std::vector<char> out(in.size());
  comm.all_reduce(in.data(), out.data(), count, t, ReduceOp::kSum).wait();
  Mismatches bad = check_all_reduce(out.data(), count, n, t, ReduceOp::kSum);
  ASSERT_EQ(bad.count, 0u) << "all_reduce " << what << " rank " << r << ": " << bad.first;
  std::vector<char> all(in.size() * static_cast<std::size_t>(n));
  comm.all_gather(in.data(), all.data(), count, t).wait();
  for (int src = 0; src < n; ++src) {
    for (std::size_t i = 0; i < count; ++i) {
      const double want = input_value(src, i, t, ReduceOp::kSum);
      const double got = load(all.data(), static_cast<std::size_t>(src) * count + i, t);
      if (got != want) bad.add(i, got, want);
    }
  }
  ASSERT_EQ(bad.count, 0u) << "all_gather " << what << " rank " << r << ": " << bad.first;
}

using namespace std::chrono_literals;

// Progresses `ch` into `sink` until `done()` holds; throws naming `what` once `deadline` has
// passed.
template <typename Done>
void progress_until(transport::Channel& ch, transport::RecvSink& sink,
                    std::chrono::steady_clock::time_point deadline, Done&& done, const char* what) {
  while (!done()) {
    ch.progress(sink, true);
    if (std::chrono::steady_clock::now() > deadline) {
      throw std::runtime_error(std::string("timed out waiting for ") + what);
    }
    std::this_thread::yield();
  }
}

// `n` bytes of a pattern that differs with `salt`.
std::vector<char> pattern_of(std::size_t n, int salt) {
  std::vector<char> v(n);
  for (std::size_t i = 0; i < n; ++i)
    v[i] = static_cast<char>((i * 13 + salt * 71 + i / 509) & 0xff);
  return v;
}

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
        for (const auto t : {DataType::kFloat32, DataType::kFloat64, DataType::kInt8}) {
          expect_reduce_and_gather(comm, n, t, 300007, std::string(to_string(t)));  // prime
        }
      },
      o);
}

// With no spinning anywhere (spin_us = wait_spin_us = 0: a waiting thread sleeps at once and
// the engine sleeps as soon as nothing moves), after the ranks were idle long enough for their
// engines to sleep deeply (on shm, which has no wait descriptor, on the channel's one-shot timer),
// and with one rank arriving late, every operation is carried to the end by the engine threads.
TEST_P(Fabric, SleepingEnginesCarryOperationsAfterIdlePeriods) {
  CommOptions o = options();
  o.spin_us = 0;
  o.wait_spin_us = 0;
  const int n = 3;
  run_ranks(
      n,
      [&](Communicator& comm) {
        for (int round = 0; round < 3; ++round) {
          comm.barrier().wait();
          std::this_thread::sleep_for(30ms);  // longer than the engine's idle ticks
          if (comm.rank() == round % n) std::this_thread::sleep_for(20ms);
          expect_reduce_and_gather(comm, n, DataType::kFloat32, 1000 + 77 * round,
                                   "round " + std::to_string(round));
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
  const auto errors = run_bootstraps(2, [&](Bootstrap& bs) {
    transport::fabric::FabricOptions fo;
    fo.provider = GetParam();
    auto chans = transport::fabric::connect_peers(
        bs, bs.rank() == 0 ? std::vector<int>{1} : std::vector<int>{}, fo);
  });
  EXPECT_NE(what_of(errors[0]).find("does not list rank 0"), std::string::npos)
      << what_of(errors[0]);
  EXPECT_EQ(what_of(errors[1]), "");
}

// ---- the data paths (FabricOptions::data_path, CommOptions::fabric_data_path)
// ----------------------------------------------------------------

// Every rank refuses options `o` with kInvalidArgument naming itself, `named` (the setting as
// given) and `env` (the variable that sets it).
void expect_refused_on_every_rank(const CommOptions& o, const std::string& named,
                                  const std::string& env) {
  const auto errors = run_ranks_collect(
      2, [](Communicator&) {}, o);
  for (std::size_t r = 0; r < errors.size(); ++r) {
    ASSERT_TRUE(errors[r]) << "rank " << r << " accepted " << named;
    Error err(ErrorCode::kInternal, "");
    ASSERT_NE(as_error(errors[r], err), nullptr) << what_of(errors[r]);
    EXPECT_EQ(err.code(), ErrorCode::kInvalidArgument) << what_of(errors[r]);
    EXPECT_EQ(err.rank(), static_cast<int>(r)) << what_of(errors[r]);
    EXPECT_NE(what_of(errors[r]).find(named), std::string::npos) << what_of(errors[r]);
    EXPECT_NE(what_of(errors[r]).find(env), std::string::npos) << what_of(errors[r]);
  }
}

TEST(FabricSetup, UnknownHmemSettingIsRefusedNamingItAndTheRank) {
  CommOptions o;
  o.transport = "fabric";
  o.fabric_hmem = "yes";
  expect_refused_on_every_rank(o, "fabric_hmem='yes'", "DEAR_FABRIC_HMEM");
}

TEST(FabricSetup, UnknownDataPathIsRefusedNamingItAndTheRank) {
  CommOptions o;
  o.transport = "fabric";
  o.fabric_data_path = "rdma";
  expect_refused_on_every_rank(o, "fabric_data_path='rdma'", "DEAR_FABRIC_DATA_PATH");
}

TEST(FabricSetup, DataPathNamesAndTheEnvironmentOverride) {
  using transport::fabric::DataPath;
  EXPECT_EQ(transport::fabric::parse_data_path("auto"), DataPath::kAuto);
  EXPECT_EQ(transport::fabric::parse_data_path("write"), DataPath::kWrite);
  EXPECT_EQ(transport::fabric::parse_data_path("send"), DataPath::kSend);
  EXPECT_FALSE(transport::fabric::parse_data_path("Write"));
  EXPECT_FALSE(transport::fabric::parse_data_path(""));
  for (const DataPath p : {DataPath::kAuto, DataPath::kWrite, DataPath::kSend}) {
    EXPECT_EQ(transport::fabric::parse_data_path(transport::fabric::data_path_name(p)), p);
  }
  EXPECT_EQ(CommOptions{}.fabric_data_path, "auto");
  ::setenv("DEAR_FABRIC_DATA_PATH", "send", 1);
  EXPECT_EQ(apply_env(CommOptions{}).fabric_data_path, "send");
  ::unsetenv("DEAR_FABRIC_DATA_PATH");
  EXPECT_EQ(apply_env(CommOptions{}).fabric_data_path, "auto");
}

TEST(FabricSetup, DirectBytesFromTheEnvironment) {
  EXPECT_EQ(CommOptions{}.fabric_direct_bytes, -1) << "the transport's default";
  ::setenv("DEAR_FABRIC_DIRECT_BYTES", "0", 1);
  EXPECT_EQ(apply_env(CommOptions{}).fabric_direct_bytes, 0);
  ::setenv("DEAR_FABRIC_DIRECT_BYTES", "64K", 1);
  EXPECT_EQ(apply_env(CommOptions{}).fabric_direct_bytes, 64 * 1024);
  ::setenv("DEAR_FABRIC_DIRECT_BYTES", "lots", 1);
  try {
    (void)apply_env(CommOptions{});
    ADD_FAILURE() << "a malformed DEAR_FABRIC_DIRECT_BYTES was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find("DEAR_FABRIC_DIRECT_BYTES"), std::string::npos)
        << e.what();
  }
  ::unsetenv("DEAR_FABRIC_DIRECT_BYTES");
  EXPECT_EQ(apply_env(CommOptions{}).fabric_direct_bytes, -1);
}

TEST_P(Fabric, MediumThresholdDefaultsToTheTransports) {
  // -1 becomes 256 KiB over fabric (4 or 1 MiB over TCP: InvalidArguments.MediumThreshold...); a
  // value set is kept.
  run_ranks(
      2, [](Communicator& c) { EXPECT_EQ(c.options().halving_max_bytes, 256 * 1024); }, options());
  CommOptions o = options();
  o.halving_max_bytes = 4096;
  run_ranks(
      2, [](Communicator& c) { EXPECT_EQ(c.options().halving_max_bytes, 4096); }, o);
}

TEST(FabricSetup, NegativeDirectBytesAreRefusedNamingTheOptionAndTheRank) {
  CommOptions o;
  o.transport = "fabric";
  o.fabric_direct_bytes = -2;
  const auto errors = run_ranks_collect(
      2, [](Communicator&) {}, o);
  for (int r = 0; r < 2; ++r) {
    Error e(ErrorCode::kInternal, "");
    const Error* x = as_error(errors[static_cast<std::size_t>(r)], e);
    ASSERT_NE(x, nullptr) << "rank " << r << " accepted fabric_direct_bytes=-2";
    EXPECT_EQ(x->code(), ErrorCode::kInvalidArgument);
    EXPECT_NE(std::string(x->what()).find("CommOptions::fabric_direct_bytes=-2"), std::string::npos)
        << x->what();
    EXPECT_EQ(x->rank(), r);
  }
}

// Every provider that runs here, on each data path it offers.
const std::vector<std::string> kPathProviders = {"tcp;ofi_rxm", "shm", "sockets"};

// Places message m at base + its FrameHeader::index, where the sender put the offset it wrote
// to; message `misplaced` (its seq; -1: none) one byte off.
struct WindowSink final : transport::RecvSink {
  char* base = nullptr;
  std::int64_t misplaced = -1;
  std::size_t received = 0;
  std::size_t sent = 0;
  transport::RecvTarget on_header(int, const transport::FrameHeader& h) override {
    const bool off = static_cast<std::int64_t>(h.seq) == misplaced;
    return {transport::RecvTarget::kDirect, base + h.index - (off ? 1 : 0), 1};
  }
  void on_payload(int, const transport::FrameHeader&, const char*, std::size_t,
                  std::size_t) override {}
  void on_message(int, const transport::FrameHeader&) override { ++received; }
  void on_sent(int, std::uint64_t) override { ++sent; }
  void on_closed(int) override {}
};

class FabricPath : public ::testing::TestWithParam<std::tuple<std::string, std::string>> {
 protected:
  void SetUp() override {
    if (auto why = transport::fabric::unavailable_reason(provider())) GTEST_SKIP() << *why;
    if (path() == "write") {
      if (auto why = transport::fabric::write_unavailable_reason(provider())) GTEST_SKIP() << *why;
    }
  }
  std::string provider() const { return std::get<0>(GetParam()); }
  std::string path() const { return std::get<1>(GetParam()); }
  transport::fabric::FabricOptions fabric_options() const {
    transport::fabric::FabricOptions fo;
    fo.provider = provider();
    fo.data_path = *transport::fabric::parse_data_path(path());
    return fo;
  }
  // One channel to the other of two ranks, with direct writes from 4 KiB in writes of 64 KiB.
  std::vector<std::unique_ptr<transport::Channel>> direct_channel(Bootstrap& bs) const {
    auto fo = fabric_options();
    fo.direct_bytes = 4096;
    fo.direct_write_bytes = 64 * 1024;
    return transport::fabric::connect_peers(bs, {1 - bs.rank()}, fo);
  }
  CommOptions options() const {
    CommOptions o;
    o.transport = "fabric";
    o.fabric_provider = provider();
    o.fabric_data_path = path();
    o.timeout = 20s;
    return o;
  }
};

// The channels run the path asked for (their description says which), and messages of every
// size, one of many slots, arrive byte for byte both ways: copied into the staging buffer, sent
// from the caller's memory, and from memory registered for it.
TEST_P(FabricPath, ChannelsTakeThePathAndCarryEveryByte) {
  struct Variant {
    std::size_t in_place_bytes;
    bool register_in_place;
  };
  for (const Variant v : {Variant{0, false}, Variant{8 * 1024, false}, Variant{1, true}}) {
    std::vector<std::string> described(4);
    const auto failures = exchange_with_peers(4, [&](Bootstrap& bs, const std::vector<int>& peers) {
      auto fo = fabric_options();
      fo.slot_bytes = 16 * 1024;  // the 300007-byte message spans many slots and wraps the ring
      fo.in_place_bytes = v.in_place_bytes;
      fo.register_in_place = v.register_in_place;
      auto chans = transport::fabric::connect_peers(bs, peers, fo);
      described[static_cast<std::size_t>(bs.rank())] = chans.at(0)->describe();
      return chans;
    });
    for (std::size_t r = 0; r < failures.size(); ++r) {
      EXPECT_EQ(failures[r], "") << "rank " << r << " in_place_bytes=" << v.in_place_bytes;
      EXPECT_NE(described[r].find(", " + path() + ")"), std::string::npos) << described[r];
    }
  }
}

// FabricOptions::hmem: the domain is opened for CUDA device memory (FI_HMEM) where the provider
// offers it on the write data path, and its channels say so; elsewhere they run without it.
// Either way messages of every size arrive byte for byte.
TEST_P(FabricPath, DeviceMemoryDomainWhereTheProviderOffersIt) {
  const auto why = transport::fabric::hmem_unavailable_reason(provider());
  const bool offered = path() == "write" && !why;
  std::vector<std::string> described(4);
  const auto failures = exchange_with_peers(4, [&](Bootstrap& bs, const std::vector<int>& peers) {
    auto fo = fabric_options();
    fo.hmem = true;
    auto chans = transport::fabric::connect_peers(bs, peers, fo);
    described[static_cast<std::size_t>(bs.rank())] = chans.at(0)->describe();
    return chans;
  });
  for (std::size_t r = 0; r < failures.size(); ++r) {
    EXPECT_EQ(failures[r], "") << "rank " << r;
    EXPECT_EQ(described[r].find("FI_HMEM") != std::string::npos, offered)
        << described[r] << (why ? " (" + *why + ")" : std::string());
  }
}

// all_reduce and all_gather over the path, element by element against the reference, with
// slices spread over several slots and a ring of uneven size.
TEST_P(FabricPath, CollectivesMatchTheReference) {
  CommOptions o = options();
  o.slice_bytes = 256 * 1024 + 5 * 64;
  o.fabric_slot_bytes = 64 * 1024;
  const int n = 3;
  run_ranks(
      n,
      [&](Communicator& comm) {
        for (const auto t : {DataType::kFloat32, DataType::kInt32}) {
          for (const std::size_t count : {std::size_t{1}, std::size_t{1000}, std::size_t{200003}}) {
            expect_reduce_and_gather(comm, n, t, count,
                                     std::string(to_string(t)) + " count " + std::to_string(count));
          }
        }
      },
      o);
}

// The TCP sockets of this process, by inode, with the congestion control each runs.
std::map<std::string, std::string> tcp_sockets() {
  std::map<std::string, std::string> out;
  std::error_code ec;
  for (std::filesystem::directory_iterator it("/proc/self/fd", ec), end; !ec && it != end;
       it.increment(ec)) {
    std::error_code lec;
    const std::string target = std::filesystem::read_symlink(it->path(), lec).string();
    if (lec || target.rfind("socket:", 0) != 0) continue;
    const int fd = std::stoi(it->path().filename().string());
    int protocol = 0;
    socklen_t len = sizeof(protocol);
    if (::getsockopt(fd, SOL_SOCKET, SO_PROTOCOL, &protocol, &len) != 0 ||
        protocol != IPPROTO_TCP) {
      continue;
    }
    char name[32] = {};
    len = sizeof(name);
    if (::getsockopt(fd, IPPROTO_TCP, TCP_CONGESTION, name, &len) == 0) out[target] = name;
  }
  return out;
}

// Providers over TCP open their own sockets, which dear never creates: they still get dear's
// congestion control (DEAR_TCP_CONGESTION; "reno" here, which every kernel has and every user
// may pick), the listeners before they accept and the connections once they exist.
TEST_P(FabricPath, ProviderSocketsTakeDearsCongestionControl) {
  if (provider() == "shm") GTEST_SKIP() << "shm moves data through shared memory, not TCP";
  const auto before = tcp_sockets();
  std::map<std::string, std::string> during;
  ::setenv("DEAR_TCP_CONGESTION", "reno", 1);
  const int n = 3;
  run_ranks(
      n,
      [&](Communicator& comm) {
        expect_reduce_and_gather(comm, n, DataType::kFloat32, 100003, "float count 100003");
        comm.barrier().wait();
        if (comm.rank() == 0) {
          for (const auto& [inode, cc] : tcp_sockets()) {
            if (before.count(inode) == 0) during[inode] = cc;
          }
        }
        comm.barrier().wait();
      },
      options());
  ::unsetenv("DEAR_TCP_CONGESTION");
  // A ring of three: three connections, both ends in this process, plus a listener per endpoint.
  EXPECT_GE(during.size(), 2u * n) << "too few sockets to be the provider's";
  for (const auto& [inode, cc] : during) EXPECT_EQ(cc, "reno") << inode;
}

// A rank that leaves in the middle: the others fail, naming it, in bounded time.
TEST_P(FabricPath, PeerThatLeavesIsNamed) {
  const auto start = std::chrono::steady_clock::now();
  const auto errors = run_ranks_collect(
      3,
      [](Communicator& comm) {
        if (comm.rank() == 1) return;
        std::this_thread::sleep_for(50ms);
        std::vector<float> buf(100000, 1.0f);
        comm.all_reduce(buf.data(), buf.data(), buf.size(), DataType::kFloat32, ReduceOp::kSum)
            .wait();
      },
      options());
  EXPECT_LT(std::chrono::steady_clock::now() - start, 15s) << "a departed peer took too long";
  EXPECT_FALSE(errors[1]);
  for (const std::size_t r : {std::size_t{0}, std::size_t{2}}) {
    ASSERT_TRUE(errors[r]) << "rank " << r << " did not fail";
    EXPECT_NE(what_of(errors[r]).find("rank 1"), std::string::npos) << what_of(errors[r]);
  }
}

// A write the peer's provider refuses (a wrong key) fails this rank with kPeerFailed, naming
// the peer and the provider's reason, within bounded time; nothing hangs or aborts. Of the
// providers here only sockets reports the refusal: tcp;ofi_rxm completes such a write at the
// sender and drops it at the target, shm neither completes nor fails it (the communicator's
// deadline ends what waits on it there).
TEST(FabricWrite, RefusedWriteFailsNamingThePeer) {
  const std::string provider = "sockets";
  if (auto why = transport::fabric::write_unavailable_reason(provider)) GTEST_SKIP() << *why;
  const UniqueId id = UniqueId::create("127.0.0.1");
  std::vector<std::string> failures(2);
  std::vector<int> codes(2, -1);
  std::atomic<bool> done{false};
  const auto start = std::chrono::steady_clock::now();
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      try {
        auto bs = Bootstrap::create(id, r, 2);
        transport::fabric::FabricOptions fo;
        fo.provider = provider;
        fo.data_path = transport::fabric::DataPath::kWrite;
        if (r == 0) fo.corrupt_write_key = 0x5a5a5a5a;
        auto chans = transport::fabric::connect_peers(*bs, {1 - r}, fo);
        CollectSink sink(1);
        std::vector<char> payload(50000, 'x');
        transport::FrameHeader h{};
        h.bytes = payload.size();
        if (r == 0 && !chans[0]->try_send(h, payload.data(), 1)) {
          failures[0] = "try_send refused the first message";
          return;
        }
        const auto deadline = std::chrono::steady_clock::now() + 10s;
        while (!done && std::chrono::steady_clock::now() < deadline && !chans[0]->closed()) {
          chans[0]->progress(sink, true);
          std::this_thread::sleep_for(100us);
        }
        if (r == 0) failures[0] = "no error";
      } catch (const Error& e) {
        failures[static_cast<std::size_t>(r)] = e.what();
        codes[static_cast<std::size_t>(r)] = static_cast<int>(e.code());
      }
      if (r == 0) done = true;
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_LT(std::chrono::steady_clock::now() - start, 12s);
  EXPECT_EQ(codes[0], static_cast<int>(ErrorCode::kPeerFailed)) << failures[0];
  EXPECT_NE(failures[0].find("an RMA write to rank 1 failed: "), std::string::npos) << failures[0];
  // Rank 1 may learn of it too (some providers fail the target's side as well); when it does,
  // the error names rank 0.
  if (!failures[1].empty()) {
    EXPECT_NE(failures[1].find("rank 0"), std::string::npos) << failures[1];
  }
}

// Communicator::forget_memory reaches the registration cache: messages sent from one buffer
// register it once; once the buffer is forgotten the next message from the same address
// registers it again (a new allocation there may sit on other pages). Every byte is checked.
TEST_P(FabricPath, ForgottenMemoryIsRegisteredAgain) {
  constexpr int kMessages = 3;
  constexpr std::size_t kBytes = 64 * 1024;
  std::vector<std::uint64_t> registered;  // rank 0: registrations after each message
  const auto errors = run_bootstraps(2, [&](Bootstrap& bs) {
    const int r = bs.rank();
    auto fo = fabric_options();
    fo.in_place_bytes = 1;  // every payload from the caller's memory
    fo.register_in_place = true;
    auto chans = transport::fabric::connect_peers(bs, {1 - r}, fo);
    transport::Channel& ch = *chans.at(0);
    CollectSink sink(1);
    const auto deadline = std::chrono::steady_clock::now() + 20s;
    auto until = [&](auto&& done, const char* what) {
      progress_until(ch, sink, deadline, done, what);
    };
    auto send = [&](transport::FrameHeader h, const void* payload, std::uint64_t token) {
      until([&] { return ch.try_send(h, payload, token); }, "room to send");
    };
    if (r == 0) {
      std::vector<char> buf(kBytes);
      for (int m = 0; m < kMessages; ++m) {
        if (m == kMessages - 1) ch.forget_memory(buf.data(), buf.size());
        for (std::size_t i = 0; i < kBytes; ++i) buf[i] = peer_byte(0, 1, m, i);
        transport::FrameHeader h;
        h.bytes = static_cast<std::uint32_t>(kBytes);
        h.seq = static_cast<std::uint64_t>(m);
        send(h, buf.data(), static_cast<std::uint64_t>(m));
        until([&] { return sink.sent == static_cast<std::size_t>(m) + 1; }, "a send");
        registered.push_back(transport::fabric::registrations_made(ch));
      }
      until([&] { return !sink.got[0].empty(); }, "the acknowledgement");
    } else {
      until([&] { return sink.got[0].size() == kMessages; }, "the messages");
      for (int m = 0; m < kMessages; ++m) {
        const auto& g = sink.got[0][static_cast<std::size_t>(m)];
        for (std::size_t i = 0; i < kBytes; ++i) {
          if (g.size() != kBytes || g[i] != peer_byte(0, 1, m, i)) {
            throw std::runtime_error("message " + std::to_string(m) + " differs at byte " +
                                     std::to_string(i));
          }
        }
      }
      transport::FrameHeader ack;
      ack.type = transport::FrameType::kPosted;
      send(ack, nullptr, 0);
      until([&] { return sink.sent == 1; }, "the acknowledgement to leave");
    }
    ch.close();
  });
  EXPECT_EQ(what_of(errors[0]), "");
  EXPECT_EQ(what_of(errors[1]), "");
  EXPECT_EQ(registered, (std::vector<std::uint64_t>{1, 1, 2}))
      << "registrations after each message (the buffer forgotten before the third)";
}

// The check every back-end with direct writes shares (tests/channel_exchange.h; the verbs
// transport's tests run it on a device), here on the write data path: a message in five
// writes, a small one through slots, every byte of the window checked.
TEST_P(FabricPath, SharedWindowCheckPasses) {
  if (path() != "write") GTEST_SKIP() << "direct writes need the write data path";
  const std::uint64_t before = transport::fabric::direct_received_total();
  const auto failures = write_into_window(
      [&](Bootstrap& bs, const std::vector<int>& peers) {
        auto fo = fabric_options();
        fo.direct_bytes = 4096;
        fo.direct_write_bytes = 64 * 1024;
        return transport::fabric::connect_peers(bs, peers, fo);
      },
      300007);
  for (std::size_t r = 0; r < failures.size(); ++r) EXPECT_EQ(failures[r], "") << "rank " << r;
  EXPECT_EQ(transport::fabric::direct_received_total() - before, 1U)
      << "the large message, and only it, was written directly";
}

// Direct writes at the channel level (write data path): the receiver opens a window on its
// memory and the sender names it. A large message lands in the window in several writes
// without passing through a slot; a small one goes through slots even when named so; and a
// message the receiver's sink places elsewhere than where it was written fails the receiver
// as a protocol violation. Every byte of the window is checked.
TEST_P(FabricPath, DirectWritesLandInTheWindowAndAreChecked) {
  if (path() != "write") GTEST_SKIP() << "direct writes need the write data path";
  constexpr std::size_t kWindow = 400000;
  constexpr std::size_t kLarge = 300007;  // in five writes of 64 KiB
  constexpr std::size_t kLargeAt = 1000;
  constexpr std::size_t kSmall = 100;  // under direct_bytes: through a slot
  constexpr std::size_t kMisplacedAt = 350000;
  constexpr std::size_t kMisplaced = 40000;
  std::promise<transport::Window> opened;
  std::shared_future<transport::Window> window = opened.get_future().share();
  // The window and the payloads outlive the test on purpose: a write the receiver refused may
  // still be in the provider's hands (sockets progresses on a thread of its own) after the
  // channels are gone, and it must not read or write freed memory.
  static auto* const kept =
      new std::array<std::vector<char>, 4>{std::vector<char>(kWindow, 0x11), pattern_of(kLarge, 1),
                                           pattern_of(kSmall, 2), pattern_of(kMisplaced, 3)};
  std::vector<char>& dst = (*kept)[0];
  std::fill(dst.begin(), dst.end(), char{0x11});
  const std::vector<char>& large = (*kept)[1];
  const std::vector<char>& small = (*kept)[2];
  const std::vector<char>& misplaced = (*kept)[3];
  std::uint64_t direct_before = 0;
  std::uint64_t direct_after_two = 0;
  std::string receiver_error;
  std::size_t received_before_error = 0;
  std::atomic<bool> receiver_done{false};
  const auto errors = run_bootstraps(2, [&](Bootstrap& bs) {
    const int r = bs.rank();
    auto chans = direct_channel(bs);
    transport::Channel& ch = *chans.at(0);
    WindowSink sink;
    sink.base = dst.data();
    sink.misplaced = 2;
    const auto deadline = std::chrono::steady_clock::now() + 20s;
    auto until = [&](auto&& done, const char* what) {
      progress_until(ch, sink, deadline, done, what);
    };
    if (r == 1) {
      direct_before = transport::fabric::direct_received_total();
      if (ch.open_window(dst.data(), dst.size(), 4095)) {
        throw std::runtime_error("open_window opened a window for messages under direct_bytes");
      }
      const auto w = ch.open_window(dst.data(), dst.size(), kLarge);
      if (!w) throw std::runtime_error("open_window refused a window on the write data path");
      opened.set_value(*w);
      try {
        until([&] { return sink.received == 3; }, "the misplaced message");
        receiver_error = "no error";
      } catch (const Error& e) {
        receiver_error = e.what();
      }
      received_before_error = sink.received;
      direct_after_two = transport::fabric::direct_received_total();
      ch.close_window(*w);
      receiver_done = true;
      return;
    }
    const transport::Window w = window.get();
    auto send = [&](std::uint64_t seq, const std::vector<char>& payload, std::size_t at) {
      transport::FrameHeader h;
      h.bytes = static_cast<std::uint32_t>(payload.size());
      h.seq = seq;
      h.index = static_cast<std::uint32_t>(at);
      until([&] { return ch.try_send_to(h, payload.data(), seq, w, at); }, "room to send");
    };
    send(0, large, kLargeAt);
    send(1, small, 0);
    send(2, misplaced, kMisplacedAt);
    // Progress until the receiver has judged message 2 (the writes need this side's progress);
    // its channel then fails, and this side may or may not see the peer go.
    try {
      until([&] { return receiver_done.load(); }, "the receiver to finish");
    } catch (const Error&) {
    }
  });
  EXPECT_EQ(what_of(errors[0]), "");
  EXPECT_EQ(what_of(errors[1]), "");
  EXPECT_EQ(received_before_error, 2u) << "the first two messages arrive, the third fails";
  EXPECT_EQ(direct_after_two - direct_before, 1u) << "the large message only was written directly";
  EXPECT_NE(receiver_error.find("directly where this rank does not place it"), std::string::npos)
      << receiver_error;
  for (std::size_t i = 0; i < kMisplacedAt; ++i) {
    char want = 0x11;
    if (i < kSmall) want = small[i];
    if (i >= kLargeAt && i < kLargeAt + kLarge) want = large[i - kLargeAt];
    ASSERT_EQ(dst[i], want) << "byte " << i << " of the window";
  }
}

// A window's registration is cached (write data path): a second window on the same memory, or
// on part of it, reuses it, and once the memory is forgotten (Communicator::forget_memory) the
// next window registers it afresh. Each round the sender writes a message straight into the
// round's window; every byte of it is checked where the receiver expects it.
TEST_P(FabricPath, WindowsReuseTheirRegistrationUntilForgotten) {
  if (path() != "write") GTEST_SKIP() << "direct writes need the write data path";
  constexpr int kRounds = 3;
  constexpr std::size_t kWindow = 256 * 1024;
  constexpr std::size_t kPart = 4096;  // round 1's window starts this far in
  constexpr std::size_t kMessage = 100003;
  constexpr std::size_t kAt = 777;  // the message's offset in each window
  std::vector<char> dst(kWindow);
  std::array<std::promise<transport::Window>, kRounds> opened;
  std::array<std::shared_future<transport::Window>, kRounds> windows;
  for (int k = 0; k < kRounds; ++k) windows[k] = opened[k].get_future().share();
  std::vector<std::uint64_t> registered;  // the receiver's window registrations after each open
  std::vector<std::string> wrong;
  const auto errors = run_bootstraps(2, [&](Bootstrap& bs) {
    const int r = bs.rank();
    auto chans = direct_channel(bs);
    transport::Channel& ch = *chans.at(0);
    WindowSink sink;  // its base: the current round's window
    const auto deadline = std::chrono::steady_clock::now() + 20s;
    auto until = [&](auto&& done, const char* what) {
      progress_until(ch, sink, deadline, done, what);
    };
    if (r == 1) {
      for (int k = 0; k < kRounds; ++k) {
        if (k == 2) ch.forget_memory(dst.data(), dst.size());
        char* base = dst.data() + (k == 1 ? kPart : 0);
        std::fill(dst.begin(), dst.end(), char{0x5a});
        const auto w = ch.open_window(base, kWindow - (k == 1 ? kPart : 0), kMessage);
        if (!w) throw std::runtime_error("open_window refused a window on the write data path");
        registered.push_back(transport::fabric::window_registrations_made(ch));
        sink.base = base;
        opened[k].set_value(*w);
        until([&] { return sink.received == static_cast<std::size_t>(k) + 1; }, "a message");
        ch.close_window(*w);
        const std::vector<char> want = pattern_of(kMessage, k);
        for (std::size_t i = 0; i < kMessage; ++i) {
          if (base[kAt + i] != want[i]) {
            wrong.push_back("round " + std::to_string(k) + ", byte " + std::to_string(i));
            break;
          }
        }
      }
      // The sender may leave once its last message is delivered.
      transport::FrameHeader ack;
      ack.type = transport::FrameType::kPosted;
      until([&] { return ch.try_send(ack, nullptr, 0); }, "room to send");
      until([&] { return sink.sent == 1; }, "the acknowledgement to leave");
    } else {
      for (int k = 0; k < kRounds; ++k) {
        const transport::Window w = windows[k].get();
        const std::vector<char> payload = pattern_of(kMessage, k);
        transport::FrameHeader h;
        h.bytes = static_cast<std::uint32_t>(kMessage);
        h.seq = static_cast<std::uint64_t>(k);
        h.index = static_cast<std::uint32_t>(kAt);
        until([&] { return ch.try_send_to(h, payload.data(), k, w, kAt); }, "room to send");
        until([&] { return sink.sent == static_cast<std::size_t>(k) + 1; }, "a send");
      }
      until([&] { return sink.received == 1; }, "the acknowledgement");
    }
    ch.close();
  });
  EXPECT_EQ(what_of(errors[0]), "");
  EXPECT_EQ(what_of(errors[1]), "");
  EXPECT_TRUE(wrong.empty()) << wrong.front();
  EXPECT_EQ(registered, (std::vector<std::uint64_t>{1, 1, 2}))
      << "registrations after each window (part of the memory in round 1, the memory forgotten "
         "before round 2)";
}

// Collectives over the write data path with direct writes on and off: every result checked
// against the reference, out of place and in place, and the receivers took messages straight
// into their destination exactly when it is on.
TEST_P(FabricPath, CollectivesWriteStraightIntoTheirDestination) {
  if (path() != "write") GTEST_SKIP() << "direct writes need the write data path";
  const int n = 3;
  for (const std::int64_t direct : {std::int64_t{0}, std::int64_t{1024}}) {
    CommOptions o = options();
    o.slice_bytes = 64 * 1024;
    o.fabric_direct_bytes = direct;
    const std::uint64_t before = transport::fabric::direct_received_total();
    run_ranks(
        n,
        [&](Communicator& comm) {
          expect_reduce_and_gather(comm, n, DataType::kFloat32, 200003, "direct");
          expect_reduce_and_gather(comm, n, DataType::kInt32, 30011, "direct");
          // In place, and a broadcast from every root.
          const std::size_t count = 70001;
          std::vector<float> buf(count * n);
          for (std::size_t i = 0; i < count; ++i) {
            buf[static_cast<std::size_t>(comm.rank()) * count + i] =
                static_cast<float>(input_value(comm.rank(), i, DataType::kFloat32, ReduceOp::kSum));
          }
          comm.all_gather(buf.data() + static_cast<std::size_t>(comm.rank()) * count, buf.data(),
                          count, DataType::kFloat32)
              .wait();
          for (int src = 0; src < n; ++src) {
            for (std::size_t i = 0; i < count; ++i) {
              const auto want =
                  static_cast<float>(input_value(src, i, DataType::kFloat32, ReduceOp::kSum));
              ASSERT_EQ(buf[static_cast<std::size_t>(src) * count + i], want)
                  << "in-place all_gather, rank " << comm.rank() << " block " << src;
            }
          }
          for (int root = 0; root < n; ++root) {
            std::vector<std::int32_t> b(count, -1);
            if (comm.rank() == root) {
              for (std::size_t i = 0; i < count; ++i)
                b[i] = static_cast<std::int32_t>(i * 3 + root);
            }
            comm.broadcast(b.data(), b.data(), count, DataType::kInt32, root).wait();
            for (std::size_t i = 0; i < count; ++i) {
              ASSERT_EQ(b[i], static_cast<std::int32_t>(i * 3 + root))
                  << "broadcast from " << root << " at rank " << comm.rank();
            }
          }
        },
        o);
    const std::uint64_t taken = transport::fabric::direct_received_total() - before;
    if (direct == 0) {
      EXPECT_EQ(taken, 0u) << "direct writes switched off";
    } else {
      EXPECT_GT(taken, 0u) << "no message was written directly";
    }
  }
}

// Operations that bounce (device memory; here host memory under deferred_bounce, the deferred
// executor standing in for the GPU) take their messages into a window on the executor's memory
// on the write data path: the sender packs each slice into a send slot registered as a device
// source and writes it there whatever its size (try_send_direct), the receiver's step reads it
// there. On the send data path there is no window: landing slots in host memory, as over TCP.
// Every element is checked either way, reduce-scatter included.
TEST_P(FabricPath, BouncedOperationsTakeMessagesIntoWindowsOnExecutorMemory) {
  const int n = 3;
  for (const char* hmem : {"off", "on"}) {
    SCOPED_TRACE(std::string("fabric_hmem=") + hmem);
    CommOptions o = options();
    o.executor = "deferred_bounce";
    o.slice_bytes = 64 * 1024;
    o.fabric_hmem = hmem;  // a domain for device memory, where offered, takes host memory alike
    std::vector<std::uint64_t> windowed(n);
    run_ranks(
        n,
        [&](Communicator& comm) {
          const int r = comm.rank();
          expect_reduce_and_gather(comm, n, DataType::kFloat32, 200003, "windowed");
          expect_reduce_and_gather(comm, n, DataType::kInt64, 777, "windowed, small slices");
          const std::size_t count = 50021;
          std::vector<std::int32_t> in(count * n);
          for (std::size_t i = 0; i < in.size(); ++i) in[i] = static_cast<std::int32_t>(i + r);
          std::vector<std::int32_t> out(count, -1);
          comm.reduce_scatter(in.data(), out.data(), count, DataType::kInt32, ReduceOp::kSum)
              .wait();
          for (std::size_t i = 0; i < count; ++i) {
            const std::size_t at = static_cast<std::size_t>(r) * count + i;
            const auto want =
                static_cast<std::int32_t>(at * n + static_cast<std::size_t>(n * (n - 1) / 2));
            ASSERT_EQ(out[i], want) << "reduce_scatter, rank " << r << " element " << i;
          }
          for (int root = 0; root < n; ++root) {
            std::vector<std::int32_t> b(count, -1);
            if (r == root) {
              for (std::size_t i = 0; i < count; ++i)
                b[i] = static_cast<std::int32_t>(i * 7 + root);
            }
            comm.broadcast(b.data(), b.data(), count, DataType::kInt32, root).wait();
            for (std::size_t i = 0; i < count; ++i) {
              ASSERT_EQ(b[i], static_cast<std::int32_t>(i * 7 + root))
                  << "broadcast from " << root << " at rank " << r;
            }
          }
          const auto stats = comm.engine_stats();
          windowed[static_cast<std::size_t>(r)] = stats.device_window_messages;
          // The ring of device landing slots, whatever the operations' sizes (a 2.4 MB
          // all_reduce here): channels x landing_slots x 1 MiB (one channel by default).
          const std::size_t ring = path() == "write" ? std::size_t{4} << 20 : 0;
          EXPECT_EQ(stats.device_window_bytes, ring) << "rank " << r;
        },
        o);
    for (int r = 0; r < n; ++r) {
      if (path() == "write") {
        EXPECT_GT(windowed[static_cast<std::size_t>(r)], 0u) << "rank " << r << " took none";
      } else {
        EXPECT_EQ(windowed[static_cast<std::size_t>(r)], 0u) << "rank " << r << " had a window";
      }
    }
  }
}

// The ring of a device window has landing_slots slots per channel on both ends: a rank whose
// setting differs fails its operation with a mismatch naming it, and every rank fails within
// bounded time instead of writing into slots the receiver does not have.
TEST_P(FabricPath, DeviceWindowRingsOfDifferentSizesAreAMismatch) {
  if (path() != "write") GTEST_SKIP() << "device windows need the write data path";
  CommOptions o = options();
  o.executor = "deferred_bounce";
  o.slice_bytes = 64 * 1024;
  const auto start = std::chrono::steady_clock::now();
  const auto errors = run_ranks_collect(
      3,
      [](Communicator& comm) {
        std::vector<float> buf(300000, 1.0f);
        comm.all_reduce(buf.data(), buf.data(), buf.size(), DataType::kFloat32, ReduceOp::kSum)
            .wait();
      },
      o,
      [](std::unique_ptr<Bootstrap>& boot, CommOptions c) {
        if (boot->rank() == 1) c.landing_slots = 2;
        return Communicator::create(std::move(boot), c);
      });
  EXPECT_LT(std::chrono::steady_clock::now() - start, 15s) << "the ranks took too long to fail";
  bool named = false;
  for (std::size_t r = 0; r < errors.size(); ++r) {
    ASSERT_TRUE(errors[r]) << "rank " << r << " did not fail";
    Error err(ErrorCode::kInternal, "");
    if (as_error(errors[r], err) != nullptr && err.code() == ErrorCode::kMismatch &&
        what_of(errors[r]).find("landing_slots") != std::string::npos) {
      named = true;
    }
  }
  EXPECT_TRUE(named) << "no rank named the differing landing_slots: " << what_of(errors[0]);
}

// A communicator's links on one endpoint and completion queue (transport::fabric::connect): 4
// ranks, two ring channels each way and a mesh link to every other rank, so that each neighbour
// is reached over three channels, all on the same pair of endpoints. Every channel carries messages
// of several sizes both ways at once, each with bytes that name the pair of ranks and the kind of
// channel; every byte is checked, on the channel it must arrive on, so a completion handed to the
// wrong channel fails the test (or the protocol's own checks).
TEST_P(FabricPath, SharedCompletionQueueHandsEveryCompletionToItsChannel) {
  const int n = 4;
  const std::vector<std::size_t> sizes = {0, 1, 4096, 300007};
  const auto fo = fabric_options();
  const UniqueId id = UniqueId::create("127.0.0.1");
  std::vector<std::string> failures(n);
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      std::string& failure = failures[static_cast<std::size_t>(r)];
      try {
        auto bs = Bootstrap::create(id, r, n);
        std::vector<int> others;
        for (int p = 0; p < n; ++p) {
          if (p != r) others.push_back(p);
        }
        auto links = transport::fabric::connect(*bs, 2, fo, others, fo);
        // Every channel with its sink, its peer and the salt both of its ends agree on.
        struct End {
          transport::Channel* ch;
          CollectSink* sink;
          int index;
          int peer;
          int salt;
        };
        CollectSink next_sink(2), prev_sink(2), mesh_sink(others.size());
        std::vector<End> ends;
        for (int c = 0; c < 2; ++c) {
          ends.push_back({links.ring.to_next[static_cast<std::size_t>(c)].get(), &next_sink, c,
                          (r + 1) % n, c + 1});
          ends.push_back({links.ring.from_prev[static_cast<std::size_t>(c)].get(), &prev_sink, c,
                          (r + n - 1) % n, c + 1});
        }
        for (std::size_t i = 0; i < others.size(); ++i) {
          ends.push_back({links.mesh[i].get(), &mesh_sink, static_cast<int>(i), others[i], 9});
        }
        const void* const endpoint = transport::fabric::endpoint_of(*ends.front().ch);
        for (const End& e : ends) {
          const std::size_t shared = transport::fabric::queue_members(*e.ch);
          if (shared != ends.size()) {
            failure = e.ch->describe() + " shares its completion queue with " +
                      std::to_string(shared) + " channels, want " + std::to_string(ends.size());
            return;
          }
          // Every provider tested here has tagged messages and no FI_RX_CQ_DATA mode.
          if (endpoint == nullptr || transport::fabric::endpoint_of(*e.ch) != endpoint) {
            failure = e.ch->describe() + " has an endpoint of its own, not the rank's shared one";
            return;
          }
        }
        const auto payload = [&](int from, int to, int salt, std::size_t m) {
          std::vector<char> p(sizes[m]);
          for (std::size_t i = 0; i < p.size(); ++i) {
            p[i] = peer_byte(from, to, static_cast<int>(m) + 16 * salt, i);
          }
          return p;
        };
        std::vector<std::vector<std::vector<char>>> out;
        for (const End& e : ends) {
          out.emplace_back();
          for (std::size_t m = 0; m < sizes.size(); ++m) {
            out.back().push_back(payload(r, e.peer, e.salt, m));
          }
        }
        // The messages, then (once everything from the peer is in) an acknowledgement, so that
        // no rank closes before its peers have all it sent.
        std::vector<std::size_t> next(ends.size(), 0);
        std::vector<bool> ack_sent(ends.size(), false);
        const auto deadline = std::chrono::steady_clock::now() + 30s;
        for (;;) {
          bool done = true;
          for (std::size_t k = 0; k < ends.size(); ++k) {
            const End& e = ends[k];
            while (next[k] < sizes.size()) {
              transport::FrameHeader h;
              h.bytes = static_cast<std::uint32_t>(sizes[next[k]]);
              h.seq = next[k];
              if (!e.ch->try_send(h, out[k][next[k]].data(), next[k])) break;
              ++next[k];
            }
            const auto& got = e.sink->got[static_cast<std::size_t>(e.index)];
            if (got.size() >= sizes.size() && !ack_sent[k]) {
              transport::FrameHeader h;
              h.type = transport::FrameType::kPosted;
              h.seq = 1000;
              ack_sent[k] = e.ch->try_send(h, nullptr, 1000);
            }
            e.ch->progress(*e.sink, true);
            done = done && next[k] == sizes.size() && ack_sent[k] && got.size() > sizes.size();
          }
          if (done) break;
          if (std::chrono::steady_clock::now() > deadline) {
            failure = "timed out; received";
            for (const End& e : ends) {
              failure += " " +
                         std::to_string(e.sink->got[static_cast<std::size_t>(e.index)].size()) +
                         " on " + e.ch->describe() + ";";
            }
            return;
          }
          std::this_thread::yield();
        }
        for (const End& e : ends) {
          const auto& got = e.sink->got[static_cast<std::size_t>(e.index)];
          if (got.size() != sizes.size() + 1) {
            failure = std::to_string(got.size()) + " messages on " + e.ch->describe();
            return;
          }
          for (std::size_t m = 0; m < sizes.size(); ++m) {
            if (got[m] != payload(e.peer, r, e.salt, m)) {
              failure = "message " + std::to_string(m) + " on " + e.ch->describe() +
                        " is not the one its peer sent on it";
              return;
            }
          }
        }
        for (const End& e : ends) e.ch->close();
      } catch (const std::exception& e) {
        failure = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < n; ++r) EXPECT_EQ(failures[static_cast<std::size_t>(r)], "") << "rank " << r;
}

INSTANTIATE_TEST_SUITE_P(
    Providers, FabricPath,
    ::testing::Combine(::testing::ValuesIn(kPathProviders), ::testing::Values("write", "send")),
    [](const ::testing::TestParamInfo<std::tuple<std::string, std::string>>& p) {
      std::string s = std::get<0>(p.param) + "_" + std::get<1>(p.param);
      std::replace_if(
          s.begin(), s.end(), [](char c) { return !std::isalnum(c); }, '_');
      return s;
    });

// "auto" takes the write path exactly where the provider offers it.
TEST_P(Fabric, AutoWritesWhereTheProviderOffersIt) {
  const bool writes = !transport::fabric::write_unavailable_reason(GetParam());
  std::vector<std::string> described(4);
  const auto failures = exchange_with_peers(4, [&](Bootstrap& bs, const std::vector<int>& peers) {
    transport::fabric::FabricOptions fo;
    fo.provider = GetParam();
    auto chans = transport::fabric::connect_peers(bs, peers, fo);
    described[static_cast<std::size_t>(bs.rank())] = chans.at(0)->describe();
    return chans;
  });
  for (std::size_t r = 0; r < failures.size(); ++r) {
    EXPECT_EQ(failures[r], "") << "rank " << r;
    EXPECT_NE(described[r].find(writes ? ", write)" : ", send)"), std::string::npos)
        << described[r];
  }
}

// Ranks on different data paths are told so (both paths named), not left to misread each
// other's fragments.
TEST_P(Fabric, RanksOnDifferentDataPathsFailNamingBoth) {
  if (auto why = transport::fabric::write_unavailable_reason(GetParam())) GTEST_SKIP() << *why;
  const auto errors = run_bootstraps(2, [&](Bootstrap& bs) {
    transport::fabric::FabricOptions fo;
    fo.provider = GetParam();
    fo.data_path =
        bs.rank() == 0 ? transport::fabric::DataPath::kWrite : transport::fabric::DataPath::kSend;
    auto chans = transport::fabric::connect_peers(bs, {1 - bs.rank()}, fo);
  });
  for (std::size_t r = 0; r < 2; ++r) {
    const std::string what = what_of(errors[r]);
    EXPECT_EQ(code_of(errors[r]), ErrorCode::kMismatch) << "rank " << r << ": " << what;
    EXPECT_NE(what.find("'write'"), std::string::npos) << "rank " << r << ": " << what;
    EXPECT_NE(what.find("'send'"), std::string::npos) << "rank " << r << ": " << what;
  }
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
