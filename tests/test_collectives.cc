// Conformance suite: every collective, dtype and op, rank counts 1..8, sizes from 0 through
// primes to many slices, in place and out of place, checked element by element against the
// independent reference in reference.h. Ranks are threads over TCP loopback, or over the
// transport that the binary's suite_config() names (compiled once, linked into one binary per
// transport; see harness.h).
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <numeric>
#include <random>
#include <vector>

#include "harness.h"
#include "reference.h"

namespace dear::testing {
namespace {

constexpr DataType kAllTypes[] = {DataType::kInt8,    DataType::kUint8,   DataType::kInt32,
                                  DataType::kInt64,   DataType::kFloat16, DataType::kBFloat16,
                                  DataType::kFloat32, DataType::kFloat64};
constexpr ReduceOp kAllOps[] = {ReduceOp::kSum, ReduceOp::kProd, ReduceOp::kMin, ReduceOp::kMax,
                                ReduceOp::kAvg};
// 0, 1, primes, and (with 256-byte slices) sizes spanning many slices per chunk.
constexpr std::size_t kCounts[] = {0, 1, 7, 13, 1031};

std::string label(const char* what, DataType t, ReduceOp op, std::size_t count, bool in_place,
                  int rank) {
  return std::string(what) + " dtype=" + std::string(to_string(t)) +
         " op=" + std::string(to_string(op)) + " count=" + std::to_string(count) +
         (in_place ? " in-place" : " out-of-place") + " rank=" + std::to_string(rank);
}

// Algorithms per collective. The log-step ones run over the mesh links, which every transport
// of these suites builds.
const std::vector<Algorithm> kAllReduceAlgorithms{Algorithm::kRing, Algorithm::kGatherReduce,
                                                  Algorithm::kHalvingDoubling,
                                                  Algorithm::kRecursiveDoubling, Algorithm::kTree};
const std::vector<Algorithm> kReduceScatterAlgorithms{Algorithm::kRing,
                                                      Algorithm::kHalvingDoubling};
const std::vector<Algorithm> kAllGatherAlgorithms{Algorithm::kRing, Algorithm::kRecursiveDoubling};

class Conformance : public ::testing::TestWithParam<int> {
 protected:
  void SetUp() override { DEAR_SKIP_UNLESS_SUITE_TRANSPORT(); }
};

TEST_P(Conformance, AllReduceEveryTypeOpSizeAndAlgorithm) {
  const int n = GetParam();
  run_ranks(n, [&](Communicator& comm) {
    const int r = comm.rank();
    for (const auto algo : kAllReduceAlgorithms) {
      for (const auto t : kAllTypes) {
        for (const auto op : kAllOps) {
          for (const auto count : kCounts) {
            for (const bool in_place : {false, true}) {
              auto in = make_input(r, count, t, op);
              std::vector<char> out_buf(in.size(), 0x5a);
              char* out = in_place ? in.data() : out_buf.data();
              OpOptions o;
              o.algorithm = algo;
              o.slice_bytes = 256;
              comm.all_reduce(in.data(), out, count, t, op, o).wait();
              Mismatches bad;
              for (std::size_t i = 0; i < count; ++i) {
                const double want = expected_reduce(i, n, t, op);
                const double got = load(out, i, t);
                if (!close_enough(got, want, t)) bad.add(i, got, want);
              }
              ASSERT_EQ(bad.count, 0u)
                  << label(to_string(algo), t, op, count, in_place, r) << ": " << bad.first;
            }
          }
        }
      }
    }
  });
}

TEST_P(Conformance, ReduceScatterEveryTypeOpAndSize) {
  const int n = GetParam();
  run_ranks(n, [&](Communicator& comm) {
    const int r = comm.rank();
    const auto nn = static_cast<std::size_t>(n);
    for (const auto algo : kReduceScatterAlgorithms) {
      for (const auto t : kAllTypes) {
        for (const auto op : kAllOps) {
          for (const std::size_t rc :
               {std::size_t{0}, std::size_t{1}, std::size_t{7}, std::size_t{257}}) {
            for (const bool in_place : {false, true}) {
              auto in = make_input(r, rc * nn, t, op);
              std::vector<char> out_buf(std::max<std::size_t>(1, rc * dtype_size(t)), 0x5a);
              char* out = in_place ? in.data() + static_cast<std::size_t>(r) * rc * dtype_size(t)
                                   : out_buf.data();
              OpOptions o;
              o.slice_bytes = 128;
              o.algorithm = algo;
              comm.reduce_scatter(in.data(), out, rc, t, op, o).wait();
              Mismatches bad;
              for (std::size_t i = 0; i < rc; ++i) {
                const double want = expected_reduce(static_cast<std::size_t>(r) * rc + i, n, t, op);
                const double got = load(out, i, t);
                if (!close_enough(got, want, t)) bad.add(i, got, want);
              }
              ASSERT_EQ(bad.count, 0u) << label("reduce_scatter", t, op, rc, in_place, r) << " "
                                       << to_string(algo) << ": " << bad.first;
            }
          }
        }
      }
    }
  });
}

TEST_P(Conformance, AllGatherEveryTypeAndSize) {
  const int n = GetParam();
  run_ranks(n, [&](Communicator& comm) {
    const int r = comm.rank();
    const auto nn = static_cast<std::size_t>(n);
    for (const auto algo : kAllGatherAlgorithms) {
      for (const auto t : kAllTypes) {
        for (const std::size_t sc :
             {std::size_t{0}, std::size_t{1}, std::size_t{13}, std::size_t{1031}}) {
          for (const bool in_place : {false, true}) {
            auto b = all_gather_buffers(r, sc, nn, t, in_place, 3);
            OpOptions o;
            o.slice_bytes = 256;
            o.algorithm = algo;
            comm.all_gather(b.in, b.out.data(), sc, t, o).wait();
            const Mismatches bad = check_all_gather(b.out.data(), sc, n, t, 3);
            ASSERT_EQ(bad.count, 0u) << label("all_gather", t, ReduceOp::kSum, sc, in_place, r)
                                     << " " << to_string(algo) << ": " << bad.first;
          }
        }
      }
    }
  });
}

TEST_P(Conformance, BroadcastFromEveryRoot) {
  const int n = GetParam();
  run_ranks(n, [&](Communicator& comm) {
    const int r = comm.rank();
    for (int root = 0; root < n; ++root) {
      for (const auto t : {DataType::kInt8, DataType::kFloat16, DataType::kFloat64}) {
        for (const std::size_t count : {std::size_t{0}, std::size_t{1}, std::size_t{4099}}) {
          for (const bool in_place : {false, true}) {
            auto in = r == root ? make_input(root, count, t, ReduceOp::kMax, 9)
                                : std::vector<char>(std::max<std::size_t>(1, count * 8), 0x11);
            std::vector<char> out_buf(std::max<std::size_t>(1, count * dtype_size(t)), 0x5a);
            char* out = in_place ? in.data() : out_buf.data();
            OpOptions o;
            o.slice_bytes = 1024;
            comm.broadcast(in.data(), out, count, t, root, o).wait();
            Mismatches bad;
            for (std::size_t i = 0; i < count; ++i) {
              const double want = input_value(root, i, t, ReduceOp::kMax, 9);
              const double got = load(out, i, t);
              if (got != want) bad.add(i, got, want);
            }
            ASSERT_EQ(bad.count, 0u) << label("broadcast", t, ReduceOp::kMax, count, in_place, r)
                                     << " root=" << root << ": " << bad.first;
          }
        }
      }
    }
  });
}

TEST_P(Conformance, ReduceToEveryRootEveryTypeOpAndAlgorithm) {
  // The root's output against the reference; elsewhere the output is never written and, in
  // place, the input keeps its value. The root moves with every combination, so every rank
  // is the root of some.
  const int n = GetParam();
  run_ranks(n, [&](Communicator& comm) {
    const int r = comm.rank();
    int next_root = 0;
    std::vector<Algorithm> algos = kAllReduceAlgorithms;
    algos.push_back(Algorithm::kScattered);
    for (const auto algo : algos) {
      for (const auto t : kAllTypes) {
        for (const auto op : kAllOps) {
          const int root = next_root++ % n;
          for (const std::size_t count : {std::size_t{0}, std::size_t{7}, std::size_t{1031}}) {
            for (const bool in_place : {false, true}) {
              auto in = make_input(r, count, t, op);
              const auto original = in;
              std::vector<char> out_buf(in.size(), 0x5a);
              char* out = in_place ? in.data() : out_buf.data();
              OpOptions o;
              o.algorithm = algo;
              o.slice_bytes = 256;
              comm.reduce(in.data(), out, count, t, op, root, o).wait();
              const std::string what = label(to_string(algo), t, op, count, in_place, r) +
                                       " root=" + std::to_string(root);
              if (r == root) {
                Mismatches bad;
                for (std::size_t i = 0; i < count; ++i) {
                  const double want = expected_reduce(i, n, t, op);
                  const double got = load(out, i, t);
                  if (!close_enough(got, want, t)) bad.add(i, got, want);
                }
                ASSERT_EQ(bad.count, 0u) << "reduce " << what << ": " << bad.first;
              } else {
                ASSERT_EQ(in, original) << "reduce " << what << ": a non-root input was written";
                if (!in_place) {
                  ASSERT_EQ(out_buf, std::vector<char>(in.size(), 0x5a))
                      << "reduce " << what << ": a non-root output was written";
                }
              }
            }
          }
        }
      }
    }
  });
}

TEST_P(Conformance, GatherToEveryRootEveryTypeAndAlgorithm) {
  // The root's output holds every rank's block; elsewhere the output is never written. In
  // place on the root: its block already in the output.
  const int n = GetParam();
  const std::vector<Algorithm> algos{Algorithm::kAuto, Algorithm::kRing,
                                     Algorithm::kRecursiveDoubling, Algorithm::kTree,
                                     Algorithm::kScattered};
  run_ranks(n, [&](Communicator& comm) {
    const int r = comm.rank();
    int next_root = 0;
    for (const auto algo : algos) {
      for (const auto t : kAllTypes) {
        const int root = next_root++ % n;
        for (const std::size_t count : {std::size_t{0}, std::size_t{5}, std::size_t{1031}}) {
          for (const bool in_place : {false, true}) {
            const std::size_t el = dtype_size(t);
            const auto in = make_input(r, count, t, ReduceOp::kSum);
            const auto original = in;
            std::vector<char> out(count * el * static_cast<std::size_t>(n), 0x5a);
            const char* src = in.data();
            if (in_place && r == root && count > 0) {
              std::copy(in.begin(), in.begin() + static_cast<std::ptrdiff_t>(count * el),
                        out.begin() + static_cast<std::ptrdiff_t>(r * count * el));
              src = out.data() + static_cast<std::size_t>(r) * count * el;
            }
            OpOptions o;
            o.algorithm = algo;
            o.slice_bytes = 256;
            comm.gather(src, out.data(), count, t, root, o).wait();
            const std::string what = label(to_string(algo), t, ReduceOp::kSum, count, in_place, r) +
                                     " root=" + std::to_string(root);
            ASSERT_EQ(in, original) << "gather " << what << ": the input was written";
            // (Empty vectors are not compared: libstdc++ hands memcmp their null data.)
            if (count == 0) continue;
            if (r != root) {
              ASSERT_EQ(out, std::vector<char>(out.size(), 0x5a))
                  << "gather " << what << ": a non-root output was written";
              continue;
            }
            for (int b = 0; b < n; ++b) {
              const auto want = make_input(b, count, t, ReduceOp::kSum);
              const auto first = out.begin() + static_cast<std::ptrdiff_t>(b * count * el);
              const auto bytes = static_cast<std::ptrdiff_t>(count * el);
              ASSERT_EQ(std::vector<char>(first, first + bytes),
                        std::vector<char>(want.begin(), want.begin() + bytes))
                  << "gather " << what << ": block " << b;
            }
          }
        }
      }
    }
  });
}

TEST_P(Conformance, ScatterFromEveryRootEveryType) {
  // Every rank's output is block r of the root's input; no rank's input is written. In place
  // on the root: its output is its own block of the input.
  const int n = GetParam();
  run_ranks(n, [&](Communicator& comm) {
    const int r = comm.rank();
    int next_root = 0;
    for (const auto algo : {Algorithm::kAuto, Algorithm::kTree, Algorithm::kScattered}) {
      for (const auto t : kAllTypes) {
        const int root = next_root++ % n;
        for (const std::size_t count : {std::size_t{0}, std::size_t{5}, std::size_t{1031}}) {
          for (const bool in_place : {false, true}) {
            const std::size_t el = dtype_size(t);
            const std::size_t block = count * el;
            // The root's input: rank b's block is what make_input gives rank b.
            std::vector<char> in;
            if (r == root) {
              for (int b = 0; b < n; ++b) {
                const auto part = make_input(b, count, t, ReduceOp::kSum);
                in.insert(in.end(), part.begin(), part.end());
              }
            }
            const auto original = in;
            std::vector<char> out_buf(block, 0x5a);
            char* out = in_place && r == root ? in.data() + static_cast<std::size_t>(r) * block
                                              : out_buf.data();
            OpOptions o;
            o.algorithm = algo;
            comm.scatter(r == root ? in.data() : nullptr, out, count, t, root, o).wait();
            const std::string what = label(to_string(algo), t, ReduceOp::kSum, count, in_place, r) +
                                     " root=" + std::to_string(root);
            if (count == 0) continue;  // nothing to compare (see the gather test)
            ASSERT_EQ(in, original) << "scatter " << what << ": the root's input was written";
            const auto want = make_input(r, count, t, ReduceOp::kSum);
            ASSERT_EQ(
                std::vector<char>(out, out + block),
                std::vector<char>(want.begin(), want.begin() + static_cast<std::ptrdiff_t>(block)))
                << "scatter " << what;
          }
        }
      }
    }
  });
}

TEST_P(Conformance, AllToAllEveryTypeAndAlgorithm) {
  // Block j of every rank's output is block r of rank j's input, in place or not; the input of
  // an out-of-place call is not written.
  const int n = GetParam();
  const auto nn = static_cast<std::size_t>(n);
  run_ranks(n, [&](Communicator& comm) {
    const int r = comm.rank();
    for (const auto algo :
         {Algorithm::kAuto, Algorithm::kPairwise, Algorithm::kScattered, Algorithm::kBruck}) {
      for (const auto t : kAllTypes) {
        for (const std::size_t count :
             {std::size_t{0}, std::size_t{1}, std::size_t{7}, std::size_t{4099}}) {
          for (const bool in_place : {false, true}) {
            const std::size_t block = count * dtype_size(t);
            auto in = make_input(r, count * nn, t, ReduceOp::kSum);
            const auto original = in;
            std::vector<char> out_buf(std::max<std::size_t>(1, block * nn), 0x5a);
            char* out = in_place ? in.data() : out_buf.data();
            OpOptions o;
            o.algorithm = algo;
            comm.all_to_all(in.data(), out, count, t, o).wait();
            const std::string what = label(to_string(algo), t, ReduceOp::kSum, count, in_place, r);
            if (!in_place) {
              ASSERT_EQ(in, original) << "all_to_all " << what << ": input written";
            }
            for (int j = 0; j < n; ++j) {
              const auto theirs = make_input(j, count * nn, t, ReduceOp::kSum);
              const std::size_t at = static_cast<std::size_t>(j) * block;
              ASSERT_EQ(0, std::memcmp(out + at,
                                       theirs.data() + static_cast<std::size_t>(r) * block, block))
                  << "all_to_all " << what << " block " << j;
            }
          }
        }
      }
    }
  });
}

TEST_P(Conformance, AllToAllVEveryTypeAndAlgorithmWithUnevenParts) {
  // Rank r sends part(r, j) = (r + 2 j + k) % 5 elements to rank j (some parts empty), packed
  // in reverse rank order with a gap of 3 elements after each, and receives rank j's part
  // for it at displacements in rank order with a gap of 1: every element lands where its
  // sender's layout and this rank's layout say, and the gaps stay untouched.
  const int n = GetParam();
  const auto nn = static_cast<std::size_t>(n);
  run_ranks(n, [&](Communicator& comm) {
    const int r = comm.rank();
    for (const auto algo : {Algorithm::kAuto, Algorithm::kPairwise, Algorithm::kScattered}) {
      for (const auto t : kAllTypes) {
        for (const std::size_t scale : {std::size_t{1}, std::size_t{700}}) {
          const auto part = [&](int from, int to) {
            return static_cast<std::size_t>((from + 2 * to + static_cast<int>(scale)) % 5) * scale;
          };
          const std::size_t el = dtype_size(t);
          std::vector<std::size_t> send_counts(nn), send_displs(nn), recv_counts(nn),
              recv_displs(nn);
          std::size_t at = 0;
          for (int j = n - 1; j >= 0; --j) {
            const auto u = static_cast<std::size_t>(j);
            send_counts[u] = part(r, j);
            send_displs[u] = at;
            at += send_counts[u] + 3;
          }
          const std::size_t in_count = at;
          at = 0;
          for (int j = 0; j < n; ++j) {
            const auto u = static_cast<std::size_t>(j);
            recv_counts[u] = part(j, r);
            recv_displs[u] = at;
            at += recv_counts[u] + 1;
          }
          const std::size_t out_count = at;
          // Element e of the part rank `from` sends to rank `to`: the reference input of rank
          // `from` at index to * 5000 + e, the same on both ends.
          const auto value_of = [&](int from, int to, std::size_t e) {
            return input_value(from, static_cast<std::size_t>(to) * 5000 + e, t, ReduceOp::kSum);
          };
          std::vector<char> in(std::max<std::size_t>(1, in_count * el), 0x11);
          for (int j = 0; j < n; ++j) {
            const auto u = static_cast<std::size_t>(j);
            for (std::size_t e = 0; e < send_counts[u]; ++e) {
              store(in.data(), send_displs[u] + e, t, value_of(r, j, e));
            }
          }
          const auto original = in;
          std::vector<char> out(std::max<std::size_t>(1, out_count * el), 0x5a);
          OpOptions o;
          o.algorithm = algo;
          comm.all_to_all_v(in.data(), send_counts, send_displs, out.data(), recv_counts,
                            recv_displs, t, o)
              .wait();
          const std::string what = label(to_string(algo), t, ReduceOp::kSum, scale, false, r);
          ASSERT_EQ(in, original) << "all_to_all_v " << what << ": input written";
          std::vector<char> want(out.size(), 0x5a);
          for (int j = 0; j < n; ++j) {
            const auto u = static_cast<std::size_t>(j);
            for (std::size_t e = 0; e < recv_counts[u]; ++e) {
              store(want.data(), recv_displs[u] + e, t, value_of(j, r, e));
            }
          }
          ASSERT_EQ(out, want) << "all_to_all_v " << what;
        }
      }
    }
  });
}

TEST_P(Conformance, SplitChildrenRunBesideTheirParentAndSplitAgain) {
  // Colors r % 2 (the last rank of an odd count joins none), keys in reverse: a child's ranks
  // run the other way round. The parent and the child each run an all_reduce at once, then
  // the child splits into halves that all_gather.
  const int n = GetParam();
  run_ranks(n, [&](Communicator& comm) {
    const int r = comm.rank();
    const bool out = n % 2 == 1 && n > 1 && r == n - 1;
    auto child = comm.split(out ? Communicator::kNoColor : r % 2, -r);
    if (out) {
      ASSERT_EQ(child, nullptr);
    } else {
      ASSERT_NE(child, nullptr);
    }
    // The members of this rank's color, in the child's order.
    std::vector<int> members;
    for (int p = n - 1; p >= 0 && !out; --p) {
      if (p % 2 == r % 2 && !(n % 2 == 1 && n > 1 && p == n - 1)) members.push_back(p);
    }
    std::vector<float> world(1000), part(1000);
    for (std::size_t i = 0; i < world.size(); ++i) {
      world[i] = static_cast<float>(r + 1) * static_cast<float>(i % 13);
      part[i] = world[i];
    }
    Work parent_work = comm.all_reduce(world.data(), world.data(), world.size(), DataType::kFloat32,
                                       ReduceOp::kSum);
    if (child) {
      ASSERT_EQ(child->size(), static_cast<int>(members.size()));
      const auto pos = std::find(members.begin(), members.end(), r) - members.begin();
      ASSERT_EQ(child->rank(), static_cast<int>(pos));
      EXPECT_EQ(child->options().name, "world/" + std::to_string(r % 2));
      child->all_reduce(part.data(), part.data(), part.size(), DataType::kFloat32, ReduceOp::kSum)
          .wait();
    }
    parent_work.wait();
    int world_sum = 0;
    for (int p = 0; p < n; ++p) world_sum += p + 1;
    int part_sum = 0;
    for (int p : members) part_sum += p + 1;
    for (std::size_t i = 0; i < world.size(); ++i) {
      const auto v = static_cast<float>(i % 13);
      ASSERT_EQ(world[i], static_cast<float>(world_sum) * v) << "parent element " << i;
      if (child) {
        ASSERT_EQ(part[i], static_cast<float>(part_sum) * v) << "child element " << i;
      }
    }
    if (!child) return;
    // Nested: the child's first half and second half, by the child's rank.
    const int cr = child->rank();
    const int half = cr < child->size() / 2 ? 0 : 1;
    auto grandchild = child->split(half, cr);
    ASSERT_NE(grandchild, nullptr);
    EXPECT_EQ(grandchild->options().name,
              "world/" + std::to_string(r % 2) + "/" + std::to_string(half));
    const int first = half == 0 ? 0 : child->size() / 2;
    ASSERT_EQ(grandchild->rank(), cr - first);
    std::vector<std::int32_t> mine{r}, gathered(static_cast<std::size_t>(grandchild->size()));
    grandchild->all_gather(mine.data(), gathered.data(), 1, DataType::kInt32).wait();
    for (int g = 0; g < grandchild->size(); ++g) {
      ASSERT_EQ(gathered[static_cast<std::size_t>(g)], members[static_cast<std::size_t>(first + g)])
          << "grandchild rank " << g;
    }
  });
}

TEST_P(Conformance, AllToAllVWhoseRanksDisagreeAboutEagerness) {
  // Rank 0 receives far more than eager_bytes, the others next to nothing: each rank decides
  // by its own sizes whether its messages may run ahead, and whoever waits for its receivers
  // must hear from them (after an operation that used the announcement every 16th gets).
  const int n = GetParam();
  if (n < 2) GTEST_SKIP() << "needs a peer";
  const auto nn = static_cast<std::size_t>(n);
  run_ranks(n, [&](Communicator& comm) {
    const int r = comm.rank();
    comm.barrier().wait();
    std::vector<std::size_t> send_counts(nn, 1), send_displs(nn), recv_counts(nn, 1),
        recv_displs(nn);
    if (r != 0) send_counts[0] = 50000;  // to rank 0
    if (r == 0) {
      for (std::size_t j = 1; j < nn; ++j) recv_counts[j] = 50000;
    }
    std::size_t in_total = 0;
    std::size_t out_total = 0;
    for (std::size_t j = 0; j < nn; ++j) {
      send_displs[j] = in_total;
      in_total += send_counts[j];
      recv_displs[j] = out_total;
      out_total += recv_counts[j];
    }
    std::vector<std::int32_t> in(in_total), out(out_total, -1);
    for (std::size_t j = 0; j < nn; ++j) {
      for (std::size_t e = 0; e < send_counts[j]; ++e) {
        in[send_displs[j] + e] = r * 1000000 + static_cast<int>(j) * 100000 + static_cast<int>(e);
      }
    }
    comm.all_to_all_v(in.data(), send_counts, send_displs, out.data(), recv_counts, recv_displs,
                      DataType::kInt32)
        .wait();
    for (std::size_t j = 0; j < nn; ++j) {
      for (std::size_t e = 0; e < recv_counts[j]; ++e) {
        ASSERT_EQ(out[recv_displs[j] + e],
                  static_cast<int>(j) * 1000000 + r * 100000 + static_cast<int>(e))
            << "from rank " << j << " element " << e;
      }
    }
  });
}

TEST_P(Conformance, SendRecvMatchInIssueOrderPerPairBesideCollectives) {
  // Every rank sends to every other rank messages of several sizes (eager ones and ones that
  // wait for their receive), with an all_reduce issued between them, and receives the same
  // from every rank: message k from rank j holds j, this rank and k. Half the ranks post their
  // receives first, the others their sends; every byte is checked.
  const int n = GetParam();
  if (n < 2) GTEST_SKIP() << "send and recv need a peer";
  const std::size_t sizes[] = {0, 1, 700, 20000, 300000};
  constexpr int kRounds = 2;
  run_ranks(n, [&](Communicator& comm) {
    const int r = comm.rank();
    const auto value = [](int from, int to, std::size_t k, std::size_t i) {
      return static_cast<std::int32_t>(from * 1000003 + to * 1009 + static_cast<int>(k) * 31 +
                                       static_cast<int>(i % 977));
    };
    std::vector<std::vector<std::int32_t>> out, in;
    std::vector<Work> sends, recvs;
    const auto post_sends = [&] {
      for (int round = 0; round < kRounds; ++round) {
        for (std::size_t k = 0; k < std::size(sizes); ++k) {
          for (int p = 0; p < n; ++p) {
            if (p == r) continue;
            const std::size_t m = static_cast<std::size_t>(round) * std::size(sizes) + k;
            auto& buf = out.emplace_back(sizes[k]);
            for (std::size_t i = 0; i < buf.size(); ++i) buf[i] = value(r, p, m, i);
            sends.push_back(comm.send(buf.data(), buf.size(), DataType::kInt32, p));
          }
        }
      }
    };
    const auto post_recvs = [&] {
      for (int round = 0; round < kRounds; ++round) {
        for (std::size_t k = 0; k < std::size(sizes); ++k) {
          for (int p = 0; p < n; ++p) {
            if (p == r) continue;
            auto& buf = in.emplace_back(sizes[k], -1);
            recvs.push_back(comm.recv(buf.data(), buf.size(), DataType::kInt32, p));
          }
        }
      }
    };
    out.reserve(static_cast<std::size_t>(kRounds * n) * std::size(sizes));
    in.reserve(out.capacity());
    std::vector<float> sum(100, 1.0f);
    if (r % 2 == 0) {
      post_recvs();
      Work ar =
          comm.all_reduce(sum.data(), sum.data(), sum.size(), DataType::kFloat32, ReduceOp::kSum);
      post_sends();
      ar.wait();
    } else {
      post_sends();
      Work ar =
          comm.all_reduce(sum.data(), sum.data(), sum.size(), DataType::kFloat32, ReduceOp::kSum);
      post_recvs();
      ar.wait();
    }
    for (auto& w : sends) w.wait();
    for (auto& w : recvs) w.wait();
    for (float v : sum) ASSERT_EQ(v, static_cast<float>(n)) << "the all_reduce between them";
    std::size_t at = 0;
    for (int round = 0; round < kRounds; ++round) {
      for (std::size_t k = 0; k < std::size(sizes); ++k) {
        for (int p = 0; p < n; ++p) {
          if (p == r) continue;
          const std::size_t m = static_cast<std::size_t>(round) * std::size(sizes) + k;
          const auto& buf = in[at++];
          for (std::size_t i = 0; i < buf.size(); ++i) {
            ASSERT_EQ(buf[i], value(p, r, m, i))
                << "message " << m << " from rank " << p << " element " << i;
          }
        }
      }
    }
  });
}

TEST_P(Conformance, SendRecvMatchPerTag) {
  // Rank r sends to r + 1: tag 1 a small message, tag 2 a large one, tag 1 a large one, tag 2
  // a small one; the receiver posts tag 2's two first, then tag 1's: each takes its tag's
  // messages in their order.
  const int n = GetParam();
  if (n < 2) GTEST_SKIP() << "send and recv need a peer";
  run_ranks(n, [&](Communicator& comm) {
    const int r = comm.rank();
    const int next = (r + 1) % n;
    const int prev = (r - 1 + n) % n;
    struct Message {
      int tag;
      std::size_t count;
    };
    const Message sent[] = {{1, 5}, {2, 40000}, {1, 30000}, {2, 3}};
    std::vector<std::vector<std::int64_t>> out, in;
    std::vector<Work> works;
    const auto fill = [](int from, std::size_t k, std::size_t i) {
      return static_cast<std::int64_t>(from) * 100000000 + static_cast<std::int64_t>(k) * 1000000 +
             static_cast<std::int64_t>(i);
    };
    for (std::size_t k = 0; k < std::size(sent); ++k) {
      auto& b = out.emplace_back(sent[k].count);
      for (std::size_t i = 0; i < b.size(); ++i) b[i] = fill(r, k, i);
      OpOptions o;
      o.tag = sent[k].tag;
      works.push_back(comm.send(b.data(), b.size(), DataType::kInt64, next, o));
    }
    // Receives: tag 2 (messages 1 and 3), then tag 1 (messages 0 and 2).
    const std::size_t order[] = {1, 3, 0, 2};
    in.resize(std::size(sent));
    for (std::size_t k : order) {
      in[k].assign(sent[k].count, -1);
      OpOptions o;
      o.tag = sent[k].tag;
      works.push_back(comm.recv(in[k].data(), in[k].size(), DataType::kInt64, prev, o));
    }
    for (auto& w : works) w.wait();
    for (std::size_t k = 0; k < std::size(sent); ++k) {
      for (std::size_t i = 0; i < in[k].size(); ++i) {
        ASSERT_EQ(in[k][i], fill(prev, k, i)) << "message " << k << " element " << i;
      }
    }
  });
}

TEST_P(Conformance, RecvFromAnySourceTakesEachMessageOnceAndNamesItsSender) {
  // Every other rank sends rank 0 a small message (tag 3) and a large one (tag 4, beyond the
  // eager size: asked for, then sent into the receive); rank 0 takes both kinds with receives
  // from any source. Its receives from each rank by name (tag 3 again), posted behind the
  // any-source ones, must not take a first message: their count differs, so taking one would
  // fail. The senders send those second messages only after the barrier, which rank 0 enters
  // once its any-source receives have completed.
  const int n = GetParam();
  if (n < 2) GTEST_SKIP() << "send and recv need a peer";
  run_ranks(n, [&](Communicator& comm) {
    const int r = comm.rank();
    const auto fill = [](int from, int k, std::size_t i) {
      return static_cast<std::int64_t>(from) * 100000000 + static_cast<std::int64_t>(k) * 1000000 +
             static_cast<std::int64_t>(i);
    };
    const std::size_t counts[] = {7, 30000, 9};
    const int tags[] = {3, 4, 3};
    const auto opts = [&](int k) {
      OpOptions o;
      o.tag = tags[k];
      return o;
    };
    if (r != 0) {
      std::vector<std::vector<std::int64_t>> out(3);
      for (int k = 0; k < 3; ++k) {
        out[static_cast<std::size_t>(k)].resize(counts[k]);
        for (std::size_t i = 0; i < counts[k]; ++i)
          out[static_cast<std::size_t>(k)][i] = fill(r, k, i);
      }
      Work a = comm.send(out[0].data(), counts[0], DataType::kInt64, 0, opts(0));
      Work b = comm.send(out[1].data(), counts[1], DataType::kInt64, 0, opts(1));
      comm.barrier().wait();
      Work c = comm.send(out[2].data(), counts[2], DataType::kInt64, 0, opts(2));
      for (Work* w : {&a, &b, &c}) {
        w->wait();
        EXPECT_EQ(w->source(), -1) << "a send has no source";
      }
      return;
    }
    const auto nn = static_cast<std::size_t>(n);
    std::vector<std::vector<std::int64_t>> small(nn - 1), large(nn - 1), named(nn - 1);
    std::vector<Work> any, by_name;
    for (std::size_t j = 0; j + 1 < nn; ++j) {
      small[j].assign(counts[0], -1);
      any.push_back(comm.recv(small[j].data(), counts[0], DataType::kInt64,
                              Communicator::kAnySource, opts(0)));
      large[j].assign(counts[1], -1);
      any.push_back(comm.recv(large[j].data(), counts[1], DataType::kInt64,
                              Communicator::kAnySource, opts(1)));
    }
    for (std::size_t j = 0; j + 1 < nn; ++j) {
      named[j].assign(counts[2], -1);
      by_name.push_back(comm.recv(named[j].data(), counts[2], DataType::kInt64,
                                  static_cast<int>(j) + 1, opts(2)));
    }
    std::vector<int> seen_small, seen_large;
    for (std::size_t j = 0; j + 1 < nn; ++j) {
      for (int k = 0; k < 2; ++k) {
        Work& w = any[2 * j + static_cast<std::size_t>(k)];
        w.wait();
        const int from = w.source();
        ASSERT_GE(from, 1) << "any-source receive " << j << " kind " << k;
        ASSERT_LT(from, n);
        const auto& got = k == 0 ? small[j] : large[j];
        for (std::size_t i = 0; i < got.size(); ++i) {
          ASSERT_EQ(got[i], fill(from, k, i))
              << "from rank " << from << " kind " << k << " element " << i;
        }
        (k == 0 ? seen_small : seen_large).push_back(from);
      }
    }
    std::sort(seen_small.begin(), seen_small.end());
    std::sort(seen_large.begin(), seen_large.end());
    std::vector<int> everyone(nn - 1);
    std::iota(everyone.begin(), everyone.end(), 1);
    EXPECT_EQ(seen_small, everyone) << "each rank's small message taken exactly once";
    EXPECT_EQ(seen_large, everyone) << "each rank's large message taken exactly once";
    comm.barrier().wait();
    for (std::size_t j = 0; j + 1 < nn; ++j) {
      by_name[j].wait();
      EXPECT_EQ(by_name[j].source(), static_cast<int>(j) + 1);
      for (std::size_t i = 0; i < counts[2]; ++i) {
        ASSERT_EQ(named[j][i], fill(static_cast<int>(j) + 1, 2, i)) << "element " << i;
      }
    }
  });
}

TEST_P(Conformance, AllGatherVAndGatherVPlaceEveryRanksBlock) {
  // Rank j sends (j * 3 + round) % 5 elements (zero included), placed in reverse rank order
  // with a gap of 2 before each block; gather_v to every root, where only the root's output is
  // written.
  const int n = GetParam();
  run_ranks(n, [&](Communicator& comm) {
    const int r = comm.rank();
    const auto nn = static_cast<std::size_t>(n);
    for (int round = 0; round < 3; ++round) {
      std::vector<std::size_t> counts(nn), displs(nn);
      std::size_t at = 0;
      for (int j = n - 1; j >= 0; --j) {
        const auto u = static_cast<std::size_t>(j);
        counts[u] = static_cast<std::size_t>(j * 3 + round) % 5;
        at += 2;
        displs[u] = at;
        at += counts[u];
      }
      const auto value = [&](int j, std::size_t i) {
        return static_cast<std::int32_t>(j * 1000 + round * 100) + static_cast<std::int32_t>(i);
      };
      std::vector<std::int32_t> in(counts[static_cast<std::size_t>(r)]);
      for (std::size_t i = 0; i < in.size(); ++i) in[i] = value(r, i);
      const auto check = [&](const std::vector<std::int32_t>& out, const std::string& what) {
        std::vector<std::int32_t> want(at, -7);
        for (int j = 0; j < n; ++j) {
          const auto u = static_cast<std::size_t>(j);
          for (std::size_t i = 0; i < counts[u]; ++i) want[displs[u] + i] = value(j, i);
        }
        ASSERT_EQ(out, want) << what << " round " << round << " rank " << r;
      };
      std::vector<std::int32_t> out(at, -7);
      comm.all_gather_v(in.data(), in.size(), out.data(), counts, displs, DataType::kInt32).wait();
      check(out, "all_gather_v");
      const int root = round % n;
      std::vector<std::int32_t> g(at, -7);
      comm.gather_v(in.data(), in.size(), g.data(), counts, displs, DataType::kInt32, root).wait();
      if (r == root) {
        check(g, "gather_v root=" + std::to_string(root));
      } else {
        ASSERT_EQ(g, std::vector<std::int32_t>(at, -7)) << "gather_v wrote a non-root output";
      }
    }
  });
}

TEST_P(Conformance, BarrierHoldsEveryRankBack) {
  const int n = GetParam();
  constexpr int kRounds = 20;
  std::vector<std::atomic<int>> arrived(kRounds);
  run_ranks(n, [&](Communicator& comm) {
    for (int round = 0; round < kRounds; ++round) {
      arrived[static_cast<std::size_t>(round)].fetch_add(1);
      comm.barrier().wait();
      ASSERT_EQ(arrived[static_cast<std::size_t>(round)].load(), n)
          << "rank " << comm.rank() << " left barrier " << round << " early";
    }
  });
}

// Large enough for several slices per chunk on every channel with the default settings.
TEST_P(Conformance, LargeMultiChannelAllReduceReduceScatterAllGather) {
  const int n = GetParam();
  CommOptions options;
  options.channels = 3;
  options.slice_bytes = 64 * 1024;
  run_ranks(
      n,
      [&](Communicator& comm) {
        const int r = comm.rank();
        const auto nn = static_cast<std::size_t>(n);
        const std::size_t count = 300007;  // prime: uneven chunks, channels and slices
        for (const auto t : {DataType::kFloat32, DataType::kBFloat16, DataType::kInt64}) {
          auto in = make_input(r, count, t, ReduceOp::kSum);
          std::vector<char> out(in.size());
          comm.all_reduce(in.data(), out.data(), count, t, ReduceOp::kSum).wait();
          Mismatches bad = check_all_reduce(out.data(), count, n, t, ReduceOp::kSum);
          ASSERT_EQ(bad.count, 0u) << "all_reduce " << to_string(t) << ": " << bad.first;

          const std::size_t rc = count / nn + 1;
          auto rs_in = make_input(r, rc * nn, t, ReduceOp::kMax);
          std::vector<char> rs_out(rc * dtype_size(t));
          comm.reduce_scatter(rs_in.data(), rs_out.data(), rc, t, ReduceOp::kMax).wait();
          for (std::size_t i = 0; i < rc; ++i) {
            const double want =
                expected_reduce(static_cast<std::size_t>(r) * rc + i, n, t, ReduceOp::kMax);
            const double got = load(rs_out.data(), i, t);
            if (got != want) bad.add(i, got, want);
          }
          ASSERT_EQ(bad.count, 0u) << "reduce_scatter " << to_string(t) << ": " << bad.first;

          std::vector<char> ag_out(rc * nn * dtype_size(t));
          comm.all_gather(rs_out.data(), ag_out.data(), rc, t).wait();
          for (std::size_t i = 0; i < rc * nn; ++i) {
            const double want = expected_reduce(i, n, t, ReduceOp::kMax);
            const double got = load(ag_out.data(), i, t);
            if (got != want) bad.add(i, got, want);
          }
          ASSERT_EQ(bad.count, 0u) << "all_gather " << to_string(t) << ": " << bad.first;

          // Out of place from the last rank, which copies its input into its output in pieces
          // while the chain runs (as all_gather does its own block above).
          const int root = n - 1;
          auto bc_in = make_input(root, count, t, ReduceOp::kMax, 9);
          std::vector<char> bc_out(bc_in.size(), 0x5a);
          comm.broadcast(bc_in.data(), bc_out.data(), count, t, root).wait();
          for (std::size_t i = 0; i < count; ++i) {
            const double want = input_value(root, i, t, ReduceOp::kMax, 9);
            const double got = load(bc_out.data(), i, t);
            if (got != want) bad.add(i, got, want);
          }
          ASSERT_EQ(bad.count, 0u) << "broadcast " << to_string(t) << ": " << bad.first;
        }
      },
      options);
}

// Beyond the eager size, over several channels and slices, to every root: the ring reduce and
// gather carry each block only as far as the root (ops.cc, trim_to_root), and the receivers
// place what they only copy through their windows.
TEST_P(Conformance, LargeRingReduceAndGatherToEveryRoot) {
  const int n = GetParam();
  CommOptions options;
  options.channels = 3;
  options.slice_bytes = 16 * 1024;
  run_ranks(
      n,
      [&](Communicator& comm) {
        const int r = comm.rank();
        const auto nn = static_cast<std::size_t>(n);
        OpOptions ring;
        ring.algorithm = Algorithm::kRing;
        for (int root = 0; root < n; ++root) {
          const DataType t = root % 2 == 0 ? DataType::kFloat32 : DataType::kInt32;
          const ReduceOp op = root % 2 == 0 ? ReduceOp::kSum : ReduceOp::kMax;
          const std::size_t count = 100003;  // prime: uneven chunks, channels and slices
          const std::string what = std::string(to_string(t)) + " root=" + std::to_string(root) +
                                   " rank=" + std::to_string(r);
          auto in = make_input(r, count, t, op);
          std::vector<char> out(in.size(), 0x5a);
          comm.reduce(in.data(), out.data(), count, t, op, root, ring).wait();
          if (r == root) {
            Mismatches bad = check_all_reduce(out.data(), count, n, t, op);
            ASSERT_EQ(bad.count, 0u) << "reduce " << what << ": " << bad.first;
          } else {
            ASSERT_EQ(out, std::vector<char>(out.size(), 0x5a)) << "reduce " << what;
          }

          const std::size_t gc = count / nn + 1;
          const auto g_in = make_input(r, gc, t, ReduceOp::kSum, root);
          std::vector<char> g_out(gc * nn * dtype_size(t), 0x5a);
          comm.gather(g_in.data(), g_out.data(), gc, t, root, ring).wait();
          if (r != root) {
            ASSERT_EQ(g_out, std::vector<char>(g_out.size(), 0x5a)) << "gather " << what;
            continue;
          }
          for (int b = 0; b < n; ++b) {
            const auto want = make_input(b, gc, t, ReduceOp::kSum, root);
            const auto first = g_out.begin() + static_cast<std::ptrdiff_t>(
                                                   static_cast<std::size_t>(b) * want.size());
            ASSERT_TRUE(std::equal(want.begin(), want.end(), first))
                << "gather " << what << ": block " << b;
          }
        }
      },
      options);
}

// Many operations in flight at once, with different priorities: all complete, all correct.
TEST_P(Conformance, ConcurrentOperationsWithPriorities) {
  const int n = GetParam();
  run_ranks(n, [&](Communicator& comm) {
    const int r = comm.rank();
    const auto nn = static_cast<std::size_t>(n);
    std::mt19937 rng(1234);  // same sequence on every rank: same operations in the same order
    struct Pending {
      Work work;
      int kind;
      DataType t;
      ReduceOp op;
      std::size_t count;
      int salt;
      std::vector<char> in, out;
    };
    std::vector<Pending> pending(48);
    for (std::size_t k = 0; k < pending.size(); ++k) {
      Pending& p = pending[k];
      p.kind = static_cast<int>(rng() % 3);
      p.t = kAllTypes[rng() % 8];
      p.op = p.kind == 2 ? ReduceOp::kSum : kAllOps[rng() % 5];
      p.count = (rng() % 4 == 0) ? 40000 + rng() % 1000 : rng() % 300;
      p.salt = static_cast<int>(k);
      OpOptions o;
      o.priority = static_cast<int>(rng() % 5);
      o.slice_bytes = 4096;
      // Ring and log-step schedules interleave on the engine.
      const auto& algos = p.kind == 0   ? kAllReduceAlgorithms
                          : p.kind == 1 ? kReduceScatterAlgorithms
                                        : kAllGatherAlgorithms;
      o.algorithm = algos[rng() % algos.size()];
      const std::size_t el = dtype_size(p.t);
      if (p.kind == 0) {
        p.in = make_input(r, p.count, p.t, p.op, p.salt);
        p.out.assign(p.in.size(), 0);
        p.work = comm.all_reduce(p.in.data(), p.out.data(), p.count, p.t, p.op, o);
      } else if (p.kind == 1) {
        p.in = make_input(r, p.count * nn, p.t, p.op, p.salt);
        p.out.assign(std::max<std::size_t>(1, p.count * el), 0);
        p.work = comm.reduce_scatter(p.in.data(), p.out.data(), p.count, p.t, p.op, o);
      } else {
        p.in = make_input(r, p.count, p.t, p.op, p.salt);
        p.out.assign(std::max<std::size_t>(1, p.count * nn * el), 0);
        p.work = comm.all_gather(p.in.data(), p.out.data(), p.count, p.t, o);
      }
    }
    for (std::size_t k = 0; k < pending.size(); ++k) {
      Pending& p = pending[k];
      p.work.wait();
      Mismatches bad;
      if (p.kind == 0) {
        for (std::size_t i = 0; i < p.count; ++i) {
          const double want = expected_reduce(i, n, p.t, p.op, p.salt);
          const double got = load(p.out.data(), i, p.t);
          if (!close_enough(got, want, p.t)) bad.add(i, got, want);
        }
      } else if (p.kind == 1) {
        for (std::size_t i = 0; i < p.count; ++i) {
          const double want =
              expected_reduce(static_cast<std::size_t>(r) * p.count + i, n, p.t, p.op, p.salt);
          const double got = load(p.out.data(), i, p.t);
          if (!close_enough(got, want, p.t)) bad.add(i, got, want);
        }
      } else {
        for (int src = 0; src < n; ++src) {
          for (std::size_t i = 0; i < p.count; ++i) {
            const double want = input_value(src, i, p.t, p.op, p.salt);
            const double got = load(p.out.data(), static_cast<std::size_t>(src) * p.count + i, p.t);
            if (got != want) bad.add(i, got, want);
          }
        }
      }
      ASSERT_EQ(bad.count, 0u) << "operation " << k << " kind " << p.kind << " "
                               << label("", p.t, p.op, p.count, false, r) << ": " << bad.first;
    }
  });
}

// Priorities changed after issue (Communicator::set_priority): the operations still complete
// correctly, a pending one can be changed, a finished one cannot.
TEST_P(Conformance, PriorityChangedInFlight) {
  const int n = GetParam();
  run_ranks(n, [&](Communicator& comm) {
    const int r = comm.rank();
    constexpr std::size_t kCount = 1 << 20;  // 4 MiB of floats: many slices each
    std::vector<std::vector<char>> in, out;
    std::vector<Work> works;
    OpOptions o;
    o.slice_bytes = 64 * 1024;
    for (int k = 0; k < 4; ++k) {
      in.push_back(make_input(r, kCount, DataType::kFloat32, ReduceOp::kSum, k));
      out.emplace_back(in.back().size(), 0);
      works.push_back(comm.all_reduce(in.back().data(), out.back().data(), kCount,
                                      DataType::kFloat32, ReduceOp::kSum, o));
    }
    // The last one first, then the others reversed: every rank changes its own order.
    for (int k = 3; k >= 0; --k) {
      if (n > 1 && !works[static_cast<std::size_t>(k)].test()) {
        (void)comm.set_priority(works[static_cast<std::size_t>(k)], 10 + k);
      }
    }
    for (int k = 0; k < 4; ++k) {
      works[static_cast<std::size_t>(k)].wait();
      Mismatches bad;
      for (std::size_t i = 0; i < kCount; i += 97) {
        const double want = expected_reduce(i, n, DataType::kFloat32, ReduceOp::kSum, k);
        const double got = load(out[static_cast<std::size_t>(k)].data(), i, DataType::kFloat32);
        if (!close_enough(got, want, DataType::kFloat32)) bad.add(i, got, want);
      }
      ASSERT_EQ(bad.count, 0U) << "operation " << k << " rank " << r << ": " << bad.first;
      EXPECT_FALSE(comm.set_priority(works[static_cast<std::size_t>(k)], 99))
          << "a finished operation accepted a priority";
    }
    EXPECT_FALSE(comm.set_priority(Work(), 1)) << "an empty Work accepted a priority";
  });
}

INSTANTIATE_TEST_SUITE_P(Ranks, Conformance, ::testing::ValuesIn(suite_config().ranks),
                         [](const ::testing::TestParamInfo<int>& p) {
                           return std::to_string(p.param) + "ranks";
                         });

}  // namespace
}  // namespace dear::testing
