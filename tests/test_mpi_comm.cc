// The MPI communicator (scheduler/mpi_comm.h), run under mpirun (tests/scheduler.cmake): every
// collective, dtype and op against the independent reference of reference.h, in place and out
// of place; then profile replay of the policies on MPI against the single-process SGD
// reference, as tests/test_replay.cc does on dear's engine.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <memory>
#include <vector>

#include "dear/scheduler/replay.h"
#include "reference.h"
#include "replay_reference.h"
#include "scheduler/mpi_comm.h"

namespace dear::testing {
namespace {

// One communicator for the whole process: MPI is initialised once and finalised at the end.
Communicator* g_comm = nullptr;

class MpiEnvironment final : public ::testing::Environment {
 public:
  void SetUp() override {
    comm_ = scheduler::make_mpi_communicator();
    g_comm = comm_.get();
  }
  void TearDown() override {
    g_comm = nullptr;
    comm_.reset();
  }

 private:
  std::unique_ptr<Communicator> comm_;
};

constexpr DataType kAllTypes[] = {DataType::kInt8,    DataType::kUint8,   DataType::kInt32,
                                  DataType::kInt64,   DataType::kFloat16, DataType::kBFloat16,
                                  DataType::kFloat32, DataType::kFloat64};
constexpr ReduceOp kAllOps[] = {ReduceOp::kSum, ReduceOp::kProd, ReduceOp::kMin, ReduceOp::kMax,
                                ReduceOp::kAvg};
constexpr std::size_t kCounts[] = {0, 1, 7, 1031};

std::string what(const char* name, DataType t, ReduceOp op, std::size_t count, bool in_place) {
  return std::string(name) + " dtype=" + std::string(to_string(t)) +
         " op=" + std::string(to_string(op)) + " count=" + std::to_string(count) +
         (in_place ? " in-place" : "") + " rank=" + std::to_string(g_comm->rank());
}

TEST(MpiCommunicator, AllReduceEveryTypeOpAndSize) {
  Communicator& comm = *g_comm;
  const int n = comm.size();
  for (const auto t : kAllTypes) {
    for (const auto op : kAllOps) {
      for (const auto count : kCounts) {
        for (const bool in_place : {false, true}) {
          auto in = make_input(comm.rank(), count, t, op);
          std::vector<char> out_buf(in.size(), 0x5a);
          char* out = in_place ? in.data() : out_buf.data();
          comm.all_reduce(in.data(), out, count, t, op).wait();
          Mismatches bad;
          for (std::size_t i = 0; i < count; ++i) {
            const double want = expected_reduce(i, n, t, op);
            const double got = load(out, i, t);
            if (!close_enough(got, want, t)) bad.add(i, got, want);
          }
          ASSERT_EQ(bad.count, 0U)
              << what("all_reduce", t, op, count, in_place) << ": " << bad.first;
        }
      }
    }
  }
}

TEST(MpiCommunicator, ReduceScatterEveryTypeOpAndSize) {
  Communicator& comm = *g_comm;
  const int n = comm.size();
  const int r = comm.rank();
  const auto nn = static_cast<std::size_t>(n);
  for (const auto t : kAllTypes) {
    for (const auto op : kAllOps) {
      for (const std::size_t rc : {std::size_t{0}, std::size_t{1}, std::size_t{257}}) {
        for (const bool in_place : {false, true}) {
          auto in = make_input(r, rc * nn, t, op);
          std::vector<char> out_buf(std::max<std::size_t>(1, rc * dtype_size(t)), 0x5a);
          char* out = in_place ? in.data() + static_cast<std::size_t>(r) * rc * dtype_size(t)
                               : out_buf.data();
          comm.reduce_scatter(in.data(), out, rc, t, op).wait();
          Mismatches bad;
          for (std::size_t i = 0; i < rc; ++i) {
            const double want = expected_reduce(static_cast<std::size_t>(r) * rc + i, n, t, op);
            const double got = load(out, i, t);
            if (!close_enough(got, want, t)) bad.add(i, got, want);
          }
          ASSERT_EQ(bad.count, 0U)
              << what("reduce_scatter", t, op, rc, in_place) << ": " << bad.first;
        }
      }
    }
  }
}

TEST(MpiCommunicator, AllGatherBroadcastAndBarrier) {
  Communicator& comm = *g_comm;
  const int n = comm.size();
  const int r = comm.rank();
  const auto nn = static_cast<std::size_t>(n);
  for (const auto t : kAllTypes) {
    for (const std::size_t sc : kCounts) {
      for (const bool in_place : {false, true}) {
        auto b = all_gather_buffers(r, sc, nn, t, in_place, 3);
        comm.all_gather(b.in, b.out.data(), sc, t).wait();
        const Mismatches bad = check_all_gather(b.out.data(), sc, n, t, 3);
        ASSERT_EQ(bad.count, 0U) << what("all_gather", t, ReduceOp::kSum, sc, in_place) << ": "
                                 << bad.first;
      }
      for (int root = 0; root < n; ++root) {
        std::vector<char> in = make_input(root, sc, t, ReduceOp::kSum, 5);
        std::vector<char> out(in.size(), 0x5a);
        comm.broadcast(in.data(), out.data(), sc, t, root).wait();
        for (std::size_t i = 0; i < sc; ++i) {
          ASSERT_EQ(load(out.data(), i, t), input_value(root, i, t, ReduceOp::kSum, 5))
              << what("broadcast", t, ReduceOp::kSum, sc, false) << " root=" << root;
        }
      }
    }
  }
  comm.barrier().wait();
}

TEST(MpiCommunicator, RootedCollectivesAndAllToAll) {
  // reduce, gather and scatter to every root, and all_to_all in place and not, and
  // all_to_all_v, against the reference inputs.
  Communicator& comm = *g_comm;
  const int n = comm.size();
  const int r = comm.rank();
  const auto nn = static_cast<std::size_t>(n);
  for (const auto t : kAllTypes) {
    const std::size_t el = dtype_size(t);
    for (const std::size_t c : kCounts) {
      for (int root = 0; root < n; ++root) {
        const std::string at = " root=" + std::to_string(root);
        std::vector<char> in = make_input(r, c, t, ReduceOp::kMax);
        std::vector<char> out(in.size(), 0x5a);
        comm.reduce(in.data(), out.data(), c, t, ReduceOp::kMax, root).wait();
        for (std::size_t i = 0; r == root && i < c; ++i) {
          ASSERT_TRUE(
              close_enough(load(out.data(), i, t), expected_reduce(i, n, t, ReduceOp::kMax), t))
              << what("reduce", t, ReduceOp::kMax, c, false) << at;
        }
        std::vector<char> whole(std::max<std::size_t>(1, c * nn * el), 0x5a);
        comm.gather(in.data(), whole.data(), c, t, root).wait();
        for (int j = 0; r == root && j < n; ++j) {
          const auto theirs = make_input(j, c, t, ReduceOp::kMax);
          ASSERT_EQ(0, std::memcmp(whole.data() + static_cast<std::size_t>(j) * c * el,
                                   theirs.data(), c * el))
              << what("gather", t, ReduceOp::kSum, c, false) << at << " block " << j;
        }
        std::vector<char> src;
        for (int j = 0; r == root && j < n; ++j) {
          const auto part = make_input(j, c, t, ReduceOp::kSum);
          src.insert(src.end(), part.begin(), part.begin() + static_cast<std::ptrdiff_t>(c * el));
        }
        src.resize(std::max<std::size_t>(1, src.size()));
        comm.scatter(src.data(), out.data(), c, t, root).wait();
        const auto mine = make_input(r, c, t, ReduceOp::kSum);
        ASSERT_EQ(0, std::memcmp(out.data(), mine.data(), c * el))
            << what("scatter", t, ReduceOp::kSum, c, false) << at;
      }
      for (const bool in_place : {false, true}) {
        auto a2a = make_input(r, c * nn, t, ReduceOp::kSum);
        std::vector<char> res(a2a.size(), 0x5a);
        char* dst = in_place ? a2a.data() : res.data();
        comm.all_to_all(a2a.data(), dst, c, t).wait();
        for (int j = 0; j < n; ++j) {
          const auto theirs = make_input(j, c * nn, t, ReduceOp::kSum);
          ASSERT_EQ(0, std::memcmp(dst + static_cast<std::size_t>(j) * c * el,
                                   theirs.data() + static_cast<std::size_t>(r) * c * el, c * el))
              << what("all_to_all", t, ReduceOp::kSum, c, in_place) << " block " << j;
        }
      }
    }
    // all_to_all_v: rank r sends r + 1 elements to every rank, the first of each part at
    // index j * 8 of its input.
    std::vector<std::size_t> send_counts(nn, static_cast<std::size_t>(r) + 1), send_displs(nn),
        recv_counts(nn), recv_displs(nn);
    std::size_t total = 0;
    for (std::size_t j = 0; j < nn; ++j) {
      send_displs[j] = j * 8;
      recv_counts[j] = j + 1;
      recv_displs[j] = total;
      total += j + 1;
    }
    const auto v_in = make_input(r, nn * 8, t, ReduceOp::kSum);
    std::vector<char> v_out(total * el, 0x5a);
    comm.all_to_all_v(v_in.data(), send_counts, send_displs, v_out.data(), recv_counts, recv_displs,
                      t)
        .wait();
    for (std::size_t j = 0; j < nn; ++j) {
      for (std::size_t e = 0; e <= j; ++e) {
        ASSERT_EQ(load(v_out.data(), recv_displs[j] + e, t),
                  input_value(static_cast<int>(j), static_cast<std::size_t>(r) * 8 + e, t,
                              ReduceOp::kSum))
            << what("all_to_all_v", t, ReduceOp::kSum, j + 1, false) << " from " << j;
      }
    }
  }
}

TEST(MpiCommunicator, SendRecvAroundTheRing) {
  Communicator& comm = *g_comm;
  const int n = comm.size();
  const int r = comm.rank();
  for (const std::size_t count : {std::size_t{1}, std::size_t{100000}}) {
    std::vector<std::int64_t> out(count), in(count, -1);
    for (std::size_t i = 0; i < count; ++i) out[i] = r * 1000003 + static_cast<std::int64_t>(i);
    // The large one from any source: its only sender is the previous rank, which it names.
    const int peer = count == 1 ? (r - 1 + n) % n : Communicator::kAnySource;
    Work rw = comm.recv(in.data(), count, DataType::kInt64, peer);
    Work sw = comm.send(out.data(), count, DataType::kInt64, (r + 1) % n);
    sw.wait();
    rw.wait();
    const int from = (r - 1 + n) % n;
    EXPECT_EQ(rw.source(), from);
    for (std::size_t i = 0; i < count; ++i) {
      ASSERT_EQ(in[i], from * 1000003 + static_cast<std::int64_t>(i)) << "element " << i;
    }
  }
}

TEST(MpiCommunicator, AllGatherVAndGatherV) {
  // Rank j gives j + 1 elements, placed in reverse rank order; gather_v to the last rank.
  Communicator& comm = *g_comm;
  const int n = comm.size();
  const int r = comm.rank();
  const auto nn = static_cast<std::size_t>(n);
  std::vector<std::size_t> counts(nn), displs(nn);
  std::size_t at = 0;
  for (int j = n - 1; j >= 0; --j) {
    counts[static_cast<std::size_t>(j)] = static_cast<std::size_t>(j) + 1;
    displs[static_cast<std::size_t>(j)] = at;
    at += static_cast<std::size_t>(j) + 1;
  }
  std::vector<std::int64_t> in(counts[static_cast<std::size_t>(r)]);
  for (std::size_t i = 0; i < in.size(); ++i) in[i] = r * 1000 + static_cast<std::int64_t>(i);
  std::vector<std::int64_t> want(at);
  for (int j = 0; j < n; ++j) {
    for (std::size_t i = 0; i < counts[static_cast<std::size_t>(j)]; ++i) {
      want[displs[static_cast<std::size_t>(j)] + i] = j * 1000 + static_cast<std::int64_t>(i);
    }
  }
  std::vector<std::int64_t> out(at, -1);
  comm.all_gather_v(in.data(), in.size(), out.data(), counts, displs, DataType::kInt64).wait();
  EXPECT_EQ(out, want) << "all_gather_v on rank " << r;
  std::vector<std::int64_t> g(at, -1);
  comm.gather_v(in.data(), in.size(), g.data(), counts, displs, DataType::kInt64, n - 1).wait();
  if (r == n - 1) {
    EXPECT_EQ(g, want) << "gather_v on the root";
  } else {
    EXPECT_EQ(g, std::vector<std::int64_t>(at, -1)) << "gather_v wrote rank " << r << "'s output";
  }
}

TEST(MpiCommunicator, BadArgumentsNameTheArgumentAndRank) {
  Communicator& comm = *g_comm;
  float x = 0;
  try {
    (void)comm.broadcast(&x, &x, 1, DataType::kFloat32, comm.size());
    FAIL() << "an out-of-range root was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find("root="), std::string::npos) << e.what();
  }
  try {
    (void)comm.all_reduce(nullptr, &x, 4, DataType::kFloat32, ReduceOp::kSum);
    FAIL() << "a null input was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("in is null"), std::string::npos) << e.what();
  }
}

// The policies on MPI end where single-process SGD ends (the replay also checks, as it runs,
// that no forward pass uses parameters missing an update).
TEST(MpiCommunicator, ReplayedPoliciesMatchSingleProcessSgd) {
  Communicator& comm = *g_comm;
  const scheduler::Model model = tiny_model(0, 0);
  scheduler::ReplayOptions opt;
  opt.warmup = 1;
  opt.iterations = 3;
  opt.compute = scheduler::ComputeMode::kNone;
  opt.learning_rate = 0.125F;
  opt.net = loopback_net();
  const auto ref =
      reference_params(model.params(), comm.size(), opt.warmup + opt.iterations, opt.learning_rate);
  for (const auto& policy : scheduler::policy_names()) {
    const scheduler::ReplayResult r = scheduler::replay(comm, model, policy, opt);
    EXPECT_EQ(param_mismatches(r.params, ref, policy + " rank " + std::to_string(comm.rank())), 0);
  }
}

}  // namespace
}  // namespace dear::testing

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  ::testing::AddGlobalTestEnvironment(new dear::testing::MpiEnvironment);
  return RUN_ALL_TESTS();
}
