// Errors: bad arguments, ranks that disagree, ranks that never show up, abort and teardown.
// Every failure must reach every rank as a dear::Error that names what went wrong, within a
// bounded time; nothing may hang.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <thread>
#include <vector>

#include "dear/bootstrap.h"
#include "harness.h"
#include "reference.h"
#include "transport/transport.h"

namespace dear::testing {
namespace {

using namespace std::chrono_literals;

// Runs fn and returns the dear::Error it throws (fails the test when it throws none).
template <typename F>
Error expect_error(F&& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e;
  }
  ADD_FAILURE() << "expected a dear::Error";
  return Error(ErrorCode::kInternal, "none thrown");
}

TEST(InvalidArguments, NameTheArgumentAndTheRank) {
  run_ranks(2, [](Communicator& comm) {
    std::vector<float> buf(16);
    const std::string rank = "rank " + std::to_string(comm.rank());

    auto e = expect_error(
        [&] { comm.all_reduce(nullptr, buf.data(), 4, DataType::kFloat32, ReduceOp::kSum); });
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find("in is null"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find(rank), std::string::npos) << e.what();

    e = expect_error([&] {
      comm.all_reduce(buf.data(), buf.data(), 4, static_cast<DataType>(42), ReduceOp::kSum);
    });
    EXPECT_NE(std::string(e.what()).find("dtype=42"), std::string::npos) << e.what();

    e = expect_error([&] {
      comm.all_reduce(buf.data(), buf.data(), 4, DataType::kFloat32, static_cast<ReduceOp>(9));
    });
    EXPECT_NE(std::string(e.what()).find("op=9"), std::string::npos) << e.what();

    e = expect_error([&] {
      comm.all_reduce(buf.data(), buf.data(), static_cast<std::size_t>(-1), DataType::kFloat32,
                      ReduceOp::kSum);
    });
    EXPECT_NE(std::string(e.what()).find("count="), std::string::npos) << e.what();

    e = expect_error([&] { comm.broadcast(buf.data(), buf.data(), 4, DataType::kFloat32, 7); });
    EXPECT_NE(std::string(e.what()).find("root=7"), std::string::npos) << e.what();

    e = expect_error(
        [&] { comm.reduce(buf.data(), buf.data(), 4, DataType::kFloat32, ReduceOp::kSum, -1); });
    EXPECT_NE(std::string(e.what()).find("root=-1"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("reduce"), std::string::npos) << e.what();
    // The root's output must be there; elsewhere it is not read.
    if (comm.rank() == 1) {
      e = expect_error(
          [&] { comm.reduce(buf.data(), nullptr, 4, DataType::kFloat32, ReduceOp::kSum, 1); });
      EXPECT_NE(std::string(e.what()).find("out is null"), std::string::npos) << e.what();
    }
    e = expect_error([&] { comm.gather(buf.data(), buf.data(), 1, DataType::kFloat32, 9); });
    EXPECT_NE(std::string(e.what()).find("root=9"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("gather"), std::string::npos) << e.what();
    if (comm.rank() == 0) {
      e = expect_error([&] { comm.gather(buf.data(), nullptr, 1, DataType::kFloat32, 0); });
      EXPECT_NE(std::string(e.what()).find("out is null"), std::string::npos) << e.what();
    }
    e = expect_error([&] { comm.scatter(buf.data(), buf.data(), 1, DataType::kFloat32, -2); });
    EXPECT_NE(std::string(e.what()).find("root=-2"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("scatter"), std::string::npos) << e.what();
    if (comm.rank() == 1) {
      e = expect_error([&] { comm.scatter(nullptr, buf.data(), 1, DataType::kFloat32, 1); });
      EXPECT_NE(std::string(e.what()).find("in is null"), std::string::npos) << e.what();
    }
    {
      OpOptions ring;
      ring.algorithm = Algorithm::kRing;
      e = expect_error(
          [&] { comm.scatter(buf.data(), buf.data(), 1, DataType::kFloat32, 0, ring); });
      EXPECT_NE(std::string(e.what()).find("tree or scattered"), std::string::npos) << e.what();
    }
    e = expect_error([&] { comm.all_to_all(nullptr, buf.data(), 1, DataType::kFloat32); });
    EXPECT_NE(std::string(e.what()).find("in is null"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("all_to_all"), std::string::npos) << e.what();
    {
      OpOptions ring;
      ring.algorithm = Algorithm::kRing;
      e = expect_error(
          [&] { comm.all_to_all(buf.data(), buf.data(), 1, DataType::kFloat32, ring); });
      EXPECT_NE(std::string(e.what()).find("pairwise, scattered or bruck"), std::string::npos)
          << e.what();
      OpOptions pairwise;
      pairwise.algorithm = Algorithm::kPairwise;
      e = expect_error([&] {
        comm.all_reduce(buf.data(), buf.data(), 1, DataType::kFloat32, ReduceOp::kSum, pairwise);
      });
      EXPECT_NE(std::string(e.what()).find("all_to_all only"), std::string::npos) << e.what();
    }
    e = expect_error([&] { comm.send(buf.data(), 1, DataType::kFloat32, comm.rank()); });
    EXPECT_NE(std::string(e.what()).find("is this rank"), std::string::npos) << e.what();
    {
      OpOptions negative;
      negative.tag = -3;
      e = expect_error([&] {
        comm.send(buf.data(), 1, DataType::kFloat32, (comm.rank() + 1) % comm.size(), negative);
      });
      EXPECT_NE(std::string(e.what()).find("tag=-3"), std::string::npos) << e.what();
    }
    e = expect_error([&] { comm.recv(buf.data(), 1, DataType::kFloat32, comm.size()); });
    EXPECT_NE(std::string(e.what()).find("peer="), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("recv"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("kAnySource"), std::string::npos) << e.what();
    // Only a receive may come from any source.
    e = expect_error(
        [&] { comm.send(buf.data(), 1, DataType::kFloat32, Communicator::kAnySource); });
    EXPECT_NE(std::string(e.what()).find("peer=-1"), std::string::npos) << e.what();
    {
      // all_gather_v / gather_v: one entry per rank, and this rank's own count its send_count.
      const std::vector<std::size_t> ones(static_cast<std::size_t>(comm.size()), 1);
      std::vector<std::size_t> displs(ones.size());
      for (std::size_t j = 0; j < displs.size(); ++j) displs[j] = j;
      std::vector<float> gathered(ones.size());
      e = expect_error([&] {
        comm.all_gather_v(buf.data(), 2, gathered.data(), ones, displs, DataType::kFloat32);
      });
      EXPECT_NE(std::string(e.what()).find("differs from send_count=2"), std::string::npos)
          << e.what();
      EXPECT_NE(std::string(e.what()).find("all_gather_v"), std::string::npos) << e.what();
      e = expect_error([&] {
        comm.gather_v(buf.data(), 1, gathered.data(), std::span(ones).first(1), displs,
                      DataType::kFloat32, comm.rank());
      });
      EXPECT_NE(std::string(e.what()).find("recv_counts"), std::string::npos) << e.what();
      e = expect_error([&] {
        comm.gather_v(buf.data(), 1, gathered.data(), ones, displs, DataType::kFloat32, -1);
      });
      EXPECT_NE(std::string(e.what()).find("root=-1"), std::string::npos) << e.what();
    }
    e = expect_error([&] { (void)comm.split(-2, 0); });
    EXPECT_NE(std::string(e.what()).find("color=-2"), std::string::npos) << e.what();
    {
      // all_to_all_v: one entry per rank, its own part the same both ways, out of place.
      const std::vector<std::size_t> ones(static_cast<std::size_t>(comm.size()), 1);
      std::vector<std::size_t> displs(ones.size());
      for (std::size_t j = 0; j < displs.size(); ++j) displs[j] = j;
      const std::vector<std::size_t> short_list(ones.size() + 1, 1);
      std::vector<float> big(64, 1.0f);
      e = expect_error([&] {
        comm.all_to_all_v(big.data(), short_list, displs, big.data() + 32, ones, displs,
                          DataType::kFloat32);
      });
      EXPECT_NE(std::string(e.what()).find("send_counts has"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("all_to_all_v"), std::string::npos) << e.what();
      std::vector<std::size_t> twos = ones;
      twos[static_cast<std::size_t>(comm.rank())] = 2;
      e = expect_error([&] {
        comm.all_to_all_v(big.data(), twos, displs, big.data() + 32, ones, displs,
                          DataType::kFloat32);
      });
      EXPECT_NE(std::string(e.what()).find("differs from recv_counts"), std::string::npos)
          << e.what();
      e = expect_error([&] {
        comm.all_to_all_v(big.data(), ones, displs, big.data() + 1, ones, displs,
                          DataType::kFloat32);
      });
      EXPECT_NE(std::string(e.what()).find("out of place only"), std::string::npos) << e.what();
      e = expect_error([&] {
        comm.all_to_all_v(nullptr, ones, displs, big.data(), ones, displs, DataType::kFloat32);
      });
      EXPECT_NE(std::string(e.what()).find("in is null"), std::string::npos) << e.what();
    }
    // The gather's own tree; an all_gather has none.
    OpOptions tree;
    tree.algorithm = Algorithm::kTree;
    e = expect_error([&] { comm.all_gather(buf.data(), buf.data(), 1, DataType::kFloat32, tree); });
    EXPECT_NE(std::string(e.what()).find("does not apply to all_gather"), std::string::npos)
        << e.what();
    // Bruck's exchange needs equal blocks: all_to_all only, never all_to_all_v or all_reduce.
    {
      OpOptions bruck;
      bruck.algorithm = Algorithm::kBruck;
      const std::vector<std::size_t> ones(static_cast<std::size_t>(comm.size()), 1);
      std::vector<std::size_t> displs(ones.size());
      for (std::size_t j = 0; j < displs.size(); ++j) displs[j] = j;
      std::vector<float> src(ones.size()), dst(ones.size());
      e = expect_error([&] {
        comm.all_to_all_v(src.data(), ones, displs, dst.data(), ones, displs, DataType::kFloat32,
                          bruck);
      });
      EXPECT_NE(std::string(e.what()).find("OpOptions::algorithm=bruck does not apply to "
                                           "all_to_all_v (an all_to_all_v runs pairwise or "
                                           "scattered)"),
                std::string::npos)
          << e.what();
      e = expect_error([&] {
        comm.all_reduce(buf.data(), buf.data(), 4, DataType::kFloat32, ReduceOp::kSum, bruck);
      });
      EXPECT_NE(std::string(e.what()).find("bruck does not apply to all_reduce (all_to_all only)"),
                std::string::npos)
          << e.what();
    }

    e = expect_error([&] {
      comm.all_reduce(buf.data(), buf.data() + 2, 8, DataType::kFloat32, ReduceOp::kSum);
    });
    EXPECT_NE(std::string(e.what()).find("overlap"), std::string::npos) << e.what();

    e = expect_error([&] {
      comm.reduce_scatter(buf.data(), buf.data() + 1, 4, DataType::kFloat32, ReduceOp::kSum);
    });
    EXPECT_NE(std::string(e.what()).find("block"), std::string::npos) << e.what();

    OpOptions o;
    o.channels = 99;
    e = expect_error(
        [&] { comm.all_reduce(buf.data(), buf.data(), 4, DataType::kFloat32, ReduceOp::kSum, o); });
    EXPECT_NE(std::string(e.what()).find("OpOptions::channels=99"), std::string::npos) << e.what();

    // A rejected call takes no sequence number: the ranks still agree afterwards.
    std::fill(buf.begin(), buf.end(), 1.0f);
    comm.all_reduce(buf.data(), buf.data(), 16, DataType::kFloat32, ReduceOp::kSum).wait();
    for (const float v : buf) ASSERT_EQ(v, 2.0f);
  });
}

TEST(InvalidArguments, BadCommunicatorOptions) {
  CommOptions o;
  o.channels = 0;
  const auto errors = run_ranks_collect(
      1, [](Communicator&) {}, o);
  ASSERT_TRUE(errors[0]);
  EXPECT_NE(what_of(errors[0]).find("CommOptions::channels=0"), std::string::npos);
}

// The transport registry: every back-end registered once by name; TCP always built; a name
// this build lacks is refused listing every built back-end and why each other one is missing.
TEST(InvalidArguments, TransportRegistryListsWhatThisBuildHasAndWhy) {
  const auto& all = transport::transports();
  ASSERT_GE(all.size(), 3u);
  std::vector<std::string> names;
  for (const transport::Transport* t : all) {
    for (const auto& n : names) EXPECT_NE(n, t->name()) << "registered twice";
    names.emplace_back(t->name());
    if (auto why = t->missing()) {
      EXPECT_FALSE(why->empty()) << t->name();
    }
  }
  EXPECT_EQ(names.front(), "tcp");
  EXPECT_FALSE(all.front()->missing().has_value());
  const Error e = expect_error(
      [] { (void)transport::find_transport("carrier-pigeon", 3, "CommOptions::transport"); });
  EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
  EXPECT_EQ(e.rank(), 3);
  const std::string what = e.what();
  EXPECT_NE(what.find("CommOptions::transport='carrier-pigeon'"), std::string::npos) << what;
  for (const transport::Transport* t : all) {
    const std::string name(t->name());
    if (auto why = t->missing()) {
      EXPECT_NE(what.find(name + ": " + *why), std::string::npos) << what;
      const Error m = expect_error([&] { (void)transport::find_transport(name, 0, "x"); });
      EXPECT_NE(std::string(m.what()).find("not available in this build"), std::string::npos);
    } else {
      EXPECT_EQ(&transport::find_transport(name, 0, "x"), t);
      EXPECT_NE(what.find(name), std::string::npos) << what;
    }
  }
}

// CommOptions::halving_max_bytes: -1 becomes the transport's default (over TCP 4 MiB up to 4
// ranks, 1 MiB above); below -1 is refused naming the option.
TEST(InvalidArguments, MediumThresholdTakesTheTransportsDefaultAndRefusesBelowMinusOne) {
  run_ranks(4, [](Communicator& c) { EXPECT_EQ(c.options().halving_max_bytes, 4 << 20); });
  run_ranks(5, [](Communicator& c) { EXPECT_EQ(c.options().halving_max_bytes, 1 << 20); });
  CommOptions o;
  o.halving_max_bytes = -2;
  const auto errors = run_ranks_collect(
      2, [](Communicator&) {}, o);
  for (const auto& e : errors) {
    ASSERT_TRUE(e);
    EXPECT_NE(what_of(e).find("halving_max_bytes=-2"), std::string::npos) << what_of(e);
  }
}

// A malformed or out-of-range DEAR_SOCKET_BUFFER fails every rank's create naming the
// variable, instead of turning into a socket buffer of nothing (a crawl) or of garbage.
TEST(InvalidArguments, BadSocketBufferNamesTheVariable) {
  CommOptions o;
  o.timeout = 20s;
  for (const char* value : {"lots", "1", "2G"}) {
    ::setenv("DEAR_SOCKET_BUFFER", value, 1);
    const auto errors = run_ranks_collect(
        2, [](Communicator&) {}, o);
    for (int r = 0; r < 2; ++r) {
      ASSERT_TRUE(errors[static_cast<std::size_t>(r)]) << value << ": rank " << r;
      EXPECT_NE(what_of(errors[static_cast<std::size_t>(r)]).find("DEAR_SOCKET_BUFFER"),
                std::string::npos)
          << value << ": " << what_of(errors[static_cast<std::size_t>(r)]);
    }
  }
  ::unsetenv("DEAR_SOCKET_BUFFER");
}

// A congestion control the kernel does not have fails every rank's bootstrap, before any
// connection, naming the variable and the rank.
TEST(InvalidArguments, UnknownCongestionControlNamesTheVariableAndRank) {
  const UniqueId id = UniqueId::create();
  ::setenv("DEAR_TCP_CONGESTION", "no-such-algorithm", 1);
  for (int r = 0; r < 2; ++r) {
    try {
      (void)Bootstrap::create(id, r, 2);
      ADD_FAILURE() << "rank " << r << " accepted an unknown congestion control";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
      const std::string what = e.what();
      EXPECT_NE(what.find("DEAR_TCP_CONGESTION=no-such-algorithm"), std::string::npos) << what;
      EXPECT_NE(what.find("rank " + std::to_string(r)), std::string::npos) << what;
    }
  }
  ::unsetenv("DEAR_TCP_CONGESTION");
}

// forget_memory refuses a null range naming the argument, and queued between operations it
// neither drops nor reorders them (they all complete with the right sums).
TEST(InvalidArguments, ForgetMemoryChecksItsRangeAndKeepsTheQueue) {
  run_ranks(3, [](Communicator& comm) {
    try {
      comm.forget_memory(nullptr, 16);
      ADD_FAILURE() << "a null range was accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
      EXPECT_NE(std::string(e.what()).find("addr"), std::string::npos) << e.what();
      EXPECT_EQ(e.rank(), comm.rank());
    }
    comm.forget_memory(nullptr, 0);  // an empty range is nothing to forget
    std::vector<float> a(1000);
    std::vector<float> b(3000);
    for (int round = 0; round < 20; ++round) {
      std::fill(a.begin(), a.end(), static_cast<float>(comm.rank() + round));
      std::fill(b.begin(), b.end(), 1.0F);
      Work wa = comm.all_reduce(a.data(), a.data(), a.size(), DataType::kFloat32, ReduceOp::kSum);
      comm.forget_memory(b.data(), b.size() * sizeof(float));
      Work wb = comm.all_reduce(b.data(), b.data(), b.size(), DataType::kFloat32, ReduceOp::kSum);
      comm.forget_memory(a.data(), a.size() * sizeof(float));
      wa.wait();
      wb.wait();
      const float want = static_cast<float>(0 + 1 + 2 + 3 * round);
      for (const float v : a) ASSERT_EQ(v, want) << "round " << round;
      for (const float v : b) ASSERT_EQ(v, 3.0F) << "round " << round;
    }
  });
}

TEST(Mismatch, DifferentCountsFailEveryRankNamingBothViews) {
  CommOptions o;
  o.timeout = 20s;
  const auto start = std::chrono::steady_clock::now();
  const auto errors = run_ranks_collect(
      3,
      [](Communicator& comm) {
        std::vector<float> buf(64, 1.0f);
        const std::size_t count = comm.rank() == 1 ? 10 : 12;
        comm.all_reduce(buf.data(), buf.data(), count, DataType::kFloat32, ReduceOp::kSum).wait();
      },
      o);
  EXPECT_LT(std::chrono::steady_clock::now() - start, 10s) << "mismatch took the deadline";
  for (int r = 0; r < 3; ++r) {
    ASSERT_TRUE(errors[static_cast<std::size_t>(r)]) << "rank " << r << " did not fail";
    const std::string what = what_of(errors[static_cast<std::size_t>(r)]);
    EXPECT_EQ(code_of(errors[static_cast<std::size_t>(r)]), ErrorCode::kMismatch) << what;
    EXPECT_NE(what.find("count=10"), std::string::npos) << what;
    EXPECT_NE(what.find("count=12"), std::string::npos) << what;
  }
}

TEST(Mismatch, DifferentDtypesAndOrders) {
  CommOptions o;
  o.timeout = 20s;
  auto errors = run_ranks_collect(
      2,
      [](Communicator& comm) {
        std::vector<double> buf(8, 1.0);
        const DataType t = comm.rank() == 0 ? DataType::kFloat64 : DataType::kInt64;
        comm.all_reduce(buf.data(), buf.data(), 8, t, ReduceOp::kMax).wait();
      },
      o);
  for (const auto& e : errors) {
    ASSERT_TRUE(e);
    EXPECT_EQ(code_of(e), ErrorCode::kMismatch) << what_of(e);
    EXPECT_NE(what_of(e).find("dtype=double"), std::string::npos) << what_of(e);
    EXPECT_NE(what_of(e).find("dtype=int64"), std::string::npos) << what_of(e);
  }
  // Rank 0 issues all_reduce then all_gather, rank 1 the other way round.
  errors = run_ranks_collect(
      2,
      [](Communicator& comm) {
        std::vector<float> a(8, 1.0f);
        std::vector<float> b(16, 1.0f);
        Work w1;
        Work w2;
        if (comm.rank() == 0) {
          w1 = comm.all_reduce(a.data(), a.data(), 8, DataType::kFloat32, ReduceOp::kSum);
          w2 = comm.all_gather(a.data(), b.data(), 8, DataType::kFloat32);
        } else {
          w2 = comm.all_gather(a.data(), b.data(), 8, DataType::kFloat32);
          w1 = comm.all_reduce(a.data(), a.data(), 8, DataType::kFloat32, ReduceOp::kSum);
        }
        w1.wait();
        w2.wait();
      },
      o);
  for (const auto& e : errors) {
    ASSERT_TRUE(e);
    EXPECT_EQ(code_of(e), ErrorCode::kMismatch) << what_of(e);
    EXPECT_NE(what_of(e).find("all_gather"), std::string::npos) << what_of(e);
    EXPECT_NE(what_of(e).find("all_reduce"), std::string::npos) << what_of(e);
  }
}

TEST(Mismatch, ReduceAgainstAllReduceOrAnotherRootNamesBothViews) {
  CommOptions o;
  o.timeout = 20s;
  // Rank 2 calls all_reduce where the others reduce to rank 0; then rank 1 picks another root.
  // On the ring every rank exchanges with its neighbours, so every rank hears of it. (Under the
  // tree a rank whose only step is its send may finish first: its part was done.)
  OpOptions ring;
  ring.algorithm = Algorithm::kRing;
  for (const bool other_root : {false, true}) {
    const auto errors = run_ranks_collect(
        3,
        [&](Communicator& comm) {
          std::vector<float> in(32, 1.0f);
          std::vector<float> out(32);
          if (!other_root && comm.rank() == 2) {
            comm.all_reduce(in.data(), out.data(), 32, DataType::kFloat32, ReduceOp::kSum, ring)
                .wait();
          } else {
            const int root = other_root && comm.rank() == 1 ? 1 : 0;
            comm.reduce(in.data(), out.data(), 32, DataType::kFloat32, ReduceOp::kSum, root, ring)
                .wait();
          }
        },
        o);
    for (int r = 0; r < 3; ++r) {
      const auto& e = errors[static_cast<std::size_t>(r)];
      ASSERT_TRUE(e) << "rank " << r << " did not fail (other_root=" << other_root << ")";
      const std::string what = what_of(e);
      EXPECT_EQ(code_of(e), ErrorCode::kMismatch) << what;
      EXPECT_NE(what.find("reduce"), std::string::npos) << what;
      if (other_root) {
        EXPECT_NE(what.find("root=1"), std::string::npos) << what;
        EXPECT_NE(what.find("root=0"), std::string::npos) << what;
      } else {
        EXPECT_NE(what.find("all_reduce"), std::string::npos) << what;
      }
    }
  }
}

TEST(Mismatch, GatherAgainstAllGatherNamesBothViews) {
  CommOptions o;
  o.timeout = 20s;
  OpOptions ring;
  ring.algorithm = Algorithm::kRing;
  const auto errors = run_ranks_collect(
      3,
      [&](Communicator& comm) {
        std::vector<float> in(8, 1.0f);
        std::vector<float> out(24);
        if (comm.rank() == 1) {
          comm.all_gather(in.data(), out.data(), 8, DataType::kFloat32, ring).wait();
        } else {
          comm.gather(in.data(), out.data(), 8, DataType::kFloat32, 0, ring).wait();
        }
      },
      o);
  for (int r = 0; r < 3; ++r) {
    const auto& e = errors[static_cast<std::size_t>(r)];
    ASSERT_TRUE(e) << "rank " << r << " did not fail";
    const std::string what = what_of(e);
    EXPECT_EQ(code_of(e), ErrorCode::kMismatch) << what;
    EXPECT_NE(what.find("has gather count=8"), std::string::npos) << what;
    EXPECT_NE(what.find("has all_gather count=8"), std::string::npos) << what;
  }
}

TEST(Mismatch, AllToAllVSizesThatDisagreeFailEveryRankNamingBoth) {
  // Every part is 4 floats, but rank 0 sends 3 to rank 1 and rank 2 sends none to rank 0:
  // both receivers fail naming the sizes, and nobody waits for the deadline.
  CommOptions o;
  o.timeout = 20s;
  const auto start = std::chrono::steady_clock::now();
  const auto errors = run_ranks_collect(
      3,
      [](Communicator& comm) {
        const int r = comm.rank();
        std::vector<float> in(12, 1.0f);
        std::vector<float> out(12);
        std::vector<std::size_t> send_counts(3, 4), displs{0, 4, 8}, recv_counts(3, 4);
        if (r == 0) send_counts[1] = 3;
        if (r == 2) send_counts[0] = 0;
        comm.all_to_all_v(in.data(), send_counts, displs, out.data(), recv_counts, displs,
                          DataType::kFloat32)
            .wait();
      },
      o);
  EXPECT_LT(std::chrono::steady_clock::now() - start, 10s) << "mismatch took the deadline";
  // Rank 2's own receives matched: it may finish before the failure reaches it.
  for (int r = 0; r < 2; ++r) {
    ASSERT_TRUE(errors[static_cast<std::size_t>(r)]) << "rank " << r << " did not fail";
  }
  const std::string at1 = what_of(errors[1]);
  const std::string at0 = what_of(errors[0]);
  EXPECT_EQ(code_of(errors[1]), ErrorCode::kMismatch) << at1;
  EXPECT_EQ(code_of(errors[0]), ErrorCode::kMismatch) << at0;
  // Whichever error a rank saw first: its own receive's, or the one its peer reported.
  EXPECT_TRUE(at1.find("sends 12 bytes") != std::string::npos ||
              at1.find("sends 0 bytes") != std::string::npos)
      << at1;
  EXPECT_NE(at1.find("expect 16"), std::string::npos) << at1;
}

// all_gather_v: rank 1 gives 3 elements where the others expect 2 from it. The ranks that
// receive them name the call they made (not all_to_all_v, which carries it), and nobody waits
// for the deadline.
TEST(Mismatch, AllGatherVSizesThatDisagreeNameAllGatherV) {
  CommOptions o;
  o.timeout = 20s;
  const auto start = std::chrono::steady_clock::now();
  const auto errors = run_ranks_collect(
      3,
      [&](Communicator& comm) {
        const auto u = static_cast<std::size_t>(comm.rank());
        std::vector<float> in(4, 1.0f), out(12);
        std::vector<std::size_t> counts(3, 2), displs{0, 4, 8};
        counts[u] = comm.rank() == 1 ? 3 : 2;
        comm.all_gather_v(in.data(), counts[u], out.data(), counts, displs, DataType::kFloat32)
            .wait();
      },
      o);
  EXPECT_LT(std::chrono::steady_clock::now() - start, 10s) << "the mismatch took the deadline";
  for (const int r : {0, 2}) {
    ASSERT_TRUE(errors[static_cast<std::size_t>(r)]) << "rank " << r << " did not fail";
    const std::string e = what_of(errors[static_cast<std::size_t>(r)]);
    EXPECT_EQ(code_of(errors[static_cast<std::size_t>(r)]), ErrorCode::kMismatch) << e;
    EXPECT_NE(e.find("all_gather_v"), std::string::npos) << "rank " << r << ": " << e;
    EXPECT_EQ(e.find("all_to_all_v"), std::string::npos) << "rank " << r << ": " << e;
  }
}

// gather_v where rank 2 names root 1 and the others root 0. Rank 2's part reaches rank 1,
// which (a non-root of root 0) expects none: once it arrives, while rank 1 goes on to a
// barrier, rank 1 fails with a mismatch naming gather_v and root 1, every rank fails, and none
// waits for the deadline. (gather_v sends only to the root, so this is found when the stray
// part arrives, not by an exchange between every pair of ranks.)
TEST(Mismatch, GatherVRootsThatDisagreeFailEveryRank) {
  CommOptions o;
  o.timeout = 20s;
  const auto start = std::chrono::steady_clock::now();
  const auto errors = run_ranks_collect(
      3,
      [&](Communicator& comm) {
        std::vector<float> in(4, 1.0f), out(12);
        const std::vector<std::size_t> counts(3, 2), displs{0, 4, 8};
        comm.gather_v(in.data(), 2, out.data(), counts, displs, DataType::kFloat32,
                      comm.rank() == 2 ? 1 : 0)
            .wait();
        comm.barrier().wait();
      },
      o);
  EXPECT_LT(std::chrono::steady_clock::now() - start, 10s) << "the mismatch took the deadline";
  for (int r = 0; r < 3; ++r) {
    ASSERT_TRUE(errors[static_cast<std::size_t>(r)]) << "rank " << r << " did not fail";
  }
  const std::string e = what_of(errors[1]);
  EXPECT_EQ(code_of(errors[1]), ErrorCode::kMismatch) << e;
  EXPECT_NE(e.find("gather_v"), std::string::npos) << e;
  EXPECT_EQ(e.find("all_to_all_v"), std::string::npos) << e;
  EXPECT_NE(e.find("root=1"), std::string::npos) << e;
}

TEST(Mismatch, AChildsFailureNamesTheChildAndSparesItsParentAndSibling) {
  // 4 ranks split into {0, 2} and {1, 3}; in the first, the ranks disagree about a count.
  CommOptions o;
  o.timeout = 20s;
  std::vector<std::string> child_errors(4);
  const auto errors = run_ranks_collect(
      4,
      [&](Communicator& comm) {
        const int r = comm.rank();
        auto child = comm.split(r % 2, r);
        std::vector<float> buf(16, 1.0f);
        try {
          const std::size_t count = r == 2 ? 5 : 4;
          child->all_reduce(buf.data(), buf.data(), count, DataType::kFloat32, ReduceOp::kSum)
              .wait();
        } catch (const Error& e) {
          child_errors[static_cast<std::size_t>(r)] = e.what();
        }
        // The parent is untouched.
        std::vector<float> one(3, 1.0f);
        comm.all_reduce(one.data(), one.data(), 3, DataType::kFloat32, ReduceOp::kSum).wait();
        for (float v : one) ASSERT_EQ(v, 4.0f) << "parent after the child failed";
      },
      o);
  for (int r = 0; r < 4; ++r) {
    EXPECT_FALSE(errors[static_cast<std::size_t>(r)])
        << what_of(errors[static_cast<std::size_t>(r)]);
  }
  for (int r : {0, 2}) {
    const auto& e = child_errors[static_cast<std::size_t>(r)];
    EXPECT_NE(e.find("[comm world/0]"), std::string::npos) << "rank " << r << ": " << e;
    EXPECT_NE(e.find("count=5"), std::string::npos) << "rank " << r << ": " << e;
  }
  for (int r : {1, 3}) EXPECT_EQ(child_errors[static_cast<std::size_t>(r)], "") << "rank " << r;
}

TEST(Mismatch, SendAndRecvOfDifferentSizesFailBothNamingBoth) {
  // A small send against a larger receive (the receiver sees it), and a large send against a
  // smaller receive (the sender sees it in the receive's announcement).
  for (const std::size_t sent : {std::size_t{10}, std::size_t{100000}}) {
    CommOptions o;
    o.timeout = 20s;
    const std::size_t expected = sent == 10 ? 12 : 90000;
    const auto start = std::chrono::steady_clock::now();
    const auto errors = run_ranks_collect(
        2,
        [&](Communicator& comm) {
          std::vector<float> buf(200000, 1.0f);
          if (comm.rank() == 0) {
            comm.send(buf.data(), sent, DataType::kFloat32, 1).wait();
          } else {
            comm.recv(buf.data(), expected, DataType::kFloat32, 0).wait();
          }
          // The failure reaches the other rank through the links at the latest here.
          comm.barrier().wait();
        },
        o);
    EXPECT_LT(std::chrono::steady_clock::now() - start, 10s) << "mismatch took the deadline";
    for (int r = 0; r < 2; ++r) {
      const auto& e = errors[static_cast<std::size_t>(r)];
      ASSERT_TRUE(e) << "rank " << r << " did not fail (sent " << sent << ")";
      const std::string what = what_of(e);
      EXPECT_EQ(code_of(e), ErrorCode::kMismatch) << what;
      EXPECT_NE(what.find("count=" + std::to_string(sent)), std::string::npos) << what;
      EXPECT_NE(what.find("count=" + std::to_string(expected)), std::string::npos) << what;
    }
  }
}

TEST(Timeout, ASendNobodyReceivesFailsWithinItsDeadlineNamingThePeer) {
  CommOptions o;
  o.timeout = 2s;
  const auto start = std::chrono::steady_clock::now();
  const auto errors = run_ranks_collect(
      2,
      [&](Communicator& comm) {
        std::vector<float> buf(100000, 1.0f);
        if (comm.rank() == 0) comm.send(buf.data(), buf.size(), DataType::kFloat32, 1).wait();
        // The others' barrier starts later, so that its own deadline (which would be reported
        // to rank 0 too) cannot pass before the send's.
        if (comm.rank() != 0) std::this_thread::sleep_for(300ms);
        comm.barrier().wait();
      },
      o);
  EXPECT_LT(std::chrono::steady_clock::now() - start, 10s);
  ASSERT_TRUE(errors[0]) << "the send did not fail";
  const std::string what = what_of(errors[0]);
  EXPECT_NE(what.find("has posted no receive"), std::string::npos) << what;
  ASSERT_TRUE(errors[1]) << "rank 1 did not fail";
}

TEST(Timeout, ARecvFromAnySourceNobodySendsFailsWithinItsDeadline) {
  CommOptions o;
  o.timeout = 1s;
  const auto start = std::chrono::steady_clock::now();
  const auto errors = run_ranks_collect(
      3,
      [&](Communicator& comm) {
        std::vector<float> buf(10, 1.0f);
        if (comm.rank() == 0) {
          comm.recv(buf.data(), buf.size(), DataType::kFloat32, Communicator::kAnySource).wait();
        }
        // As above: the others' barrier must not time out (and report it) before the receive.
        // Under ASan it once did, and rank 0 failed with their barrier's timeout instead.
        if (comm.rank() != 0) std::this_thread::sleep_for(300ms);
        comm.barrier().wait();
      },
      o);
  EXPECT_LT(std::chrono::steady_clock::now() - start, 10s);
  ASSERT_TRUE(errors[0]) << "the receive did not fail";
  const std::string what = what_of(errors[0]);
  EXPECT_NE(what.find("from any rank"), std::string::npos) << what;
  EXPECT_NE(what.find("no rank has sent it"), std::string::npos) << what;
  ASSERT_TRUE(errors[1]) << "rank 1 did not fail";
  ASSERT_TRUE(errors[2]) << "rank 2 did not fail";
}

// A rank that never issues the operation: the others fail at their deadline, naming it.
TEST(Timeout, SilentRankIsNamedWithinTheDeadline) {
  CommOptions o;
  o.timeout = 700ms;
  std::atomic<int> done{0};
  const auto start = std::chrono::steady_clock::now();
  const auto errors = run_ranks_collect(
      3,
      [&](Communicator& comm) {
        if (comm.rank() == 2) {
          // Stay connected but silent until the others have given up.
          while (done.load() < 2 && std::chrono::steady_clock::now() - start < 20s) {
            std::this_thread::sleep_for(10ms);
          }
          return;
        }
        std::vector<float> buf(1 << 16, 1.0f);
        try {
          comm.all_reduce(buf.data(), buf.data(), buf.size(), DataType::kFloat32, ReduceOp::kSum)
              .wait();
        } catch (...) {
          done.fetch_add(1);
          throw;
        }
      },
      o);
  EXPECT_LT(std::chrono::steady_clock::now() - start, 10s);
  ASSERT_TRUE(errors[0]);
  ASSERT_TRUE(errors[1]);
  EXPECT_FALSE(errors[2]);
  // Rank 0 waits on rank 2 directly; rank 1 may time out on rank 0 or hear from it first.
  EXPECT_EQ(code_of(errors[0]), ErrorCode::kTimeout) << what_of(errors[0]);
  EXPECT_NE(what_of(errors[0]).find("rank 2"), std::string::npos) << what_of(errors[0]);
  EXPECT_NE(what_of(errors[1]).find("700 ms"), std::string::npos) << what_of(errors[1]);
}

TEST(Abort, FailsPendingWorkQuicklyAndLaterCallsAtOnce) {
  CommOptions o;
  o.timeout = 30s;
  run_ranks(
      2,
      [](Communicator& comm) {
        std::vector<float> buf(1024, 1.0f);
        // Rank 1 never issues the all_reduce, so rank 0's stays pending until aborted.
        if (comm.rank() == 0) {
          Work w = comm.all_reduce(buf.data(), buf.data(), buf.size(), DataType::kFloat32,
                                   ReduceOp::kSum);
          EXPECT_FALSE(w.wait(50ms));
          const auto t0 = std::chrono::steady_clock::now();
          std::thread t([&] { comm.abort("test says stop"); });
          const Error e = expect_error([&] { w.wait(); });
          t.join();
          // Quickly against the 30 s timeout; loose enough for a sanitizer build on a busy host.
          EXPECT_LT(std::chrono::steady_clock::now() - t0, 1s);
          EXPECT_EQ(e.code(), ErrorCode::kAborted) << e.what();
          EXPECT_NE(std::string(e.what()).find("test says stop"), std::string::npos);
          const Error later = expect_error([&] { comm.barrier().wait(); });
          EXPECT_EQ(later.code(), ErrorCode::kAborted);
        } else {
          // The abort reaches this rank through the link; its next call fails at once.
          std::this_thread::sleep_for(500ms);
          const Error e = expect_error([&] { comm.barrier().wait(5s); });
          EXPECT_NE(std::string(e.what()).find("test says stop"), std::string::npos) << e.what();
        }
      },
      o);
}

TEST(Teardown, DestroyWithWorkInFlightFailsTheWorkAndReturns) {
  CommOptions o;
  o.timeout = 30s;
  const UniqueId id = UniqueId::create("127.0.0.1");
  std::vector<Work> works(2);
  std::vector<std::thread> ts;
  std::vector<std::vector<float>> bufs(2, std::vector<float>(4096, 1.0f));
  for (int r = 0; r < 2; ++r) {
    ts.emplace_back([&, r] {
      auto comm = Communicator::create(Bootstrap::create(id, r, 2), o);
      if (r == 0) {
        works[0] = comm->all_reduce(bufs[0].data(), bufs[0].data(), 4096, DataType::kFloat32,
                                    ReduceOp::kSum);
      }
      // Destroyed here with rank 0's operation pending.
    });
  }
  for (auto& t : ts) t.join();
  ASSERT_TRUE(works[0].test());
  const Error e = expect_error([&] { works[0].wait(); });
  EXPECT_TRUE(e.code() == ErrorCode::kAborted || e.code() == ErrorCode::kPeerFailed) << e.what();
}

// The root of a small broadcast sends it without waiting for the others to post it, so it may
// finish and destroy its communicator before its neighbour has even posted the operation (that
// neighbour may then announce the operation to a closed socket, which answers with a reset:
// Links.APeerThatClosesWithUnreadDataStillDeliversWhatItSent pins that case down). The late
// ranks must still complete with the root's data: a departure after the last operation a rank
// takes part in is no failure. Staggered posting delays cover several orders of events.
TEST(Teardown, ARankThatLeavesAfterItsLastOperationFailsNoOne) {
  constexpr std::size_t kCount = 64;
  for (int round = 0; round < 24; ++round) {
    const auto delay = std::chrono::microseconds(round % 8 * 300);
    run_ranks(3, [&](Communicator& comm) {
      const int r = comm.rank();
      std::vector<float> buf(kCount, -1.0f);
      if (r == 0) {
        for (std::size_t i = 0; i < kCount; ++i) buf[i] = static_cast<float>(round * 1000 + i);
      } else {
        std::this_thread::sleep_for(delay * r);
      }
      comm.broadcast(buf.data(), buf.data(), kCount, DataType::kFloat32, 0).wait();
      Mismatches bad;
      for (std::size_t i = 0; i < kCount; ++i) {
        const auto want = static_cast<float>(round * 1000 + i);
        if (buf[i] != want) bad.add(i, buf[i], want);
      }
      ASSERT_EQ(bad.count, 0u) << "rank " << r << " round " << round << ": " << bad.first;
      // Rank 0 destroys its communicator now, possibly before the others have posted.
    });
  }
}

}  // namespace
}  // namespace dear::testing
