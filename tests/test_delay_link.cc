// Communicators with an emulated link delay (CommOptions::link_delay_us): every collective
// still gives the right result element by element, and a ping-pong takes the configured delay
// on each crossing on top of the undelayed time.
#include <gtest/gtest.h>
#include <stdlib.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <vector>

#include "harness.h"
#include "reference.h"

namespace dear::testing {
namespace {

constexpr int kDelayUs = 200;

// spin_us sets both the engine's and the waiters' spin (-1: the defaults).
CommOptions delayed(int us, int spin_us = -1) {
  CommOptions o;
  o.link_delay_us = us;
  if (spin_us >= 0) {
    o.spin_us = spin_us;
    o.wait_spin_us = spin_us;
  }
  o.timeout = std::chrono::seconds(60);
  return o;
}

class DelayedLink : public ::testing::TestWithParam<int> {};

TEST_P(DelayedLink, EveryCollectiveIsCorrect) {
  const int n = GetParam();
  const auto nn = static_cast<std::size_t>(n);
  // Small (one message, eager), odd-sized, and large enough for many slices per channel, so
  // that the held window fills and back-pressure is exercised.
  const std::size_t counts[] = {1, 1031, 200000};
  run_ranks(
      n,
      [&](Communicator& comm) {
        const int r = comm.rank();
        OpOptions o;
        o.slice_bytes = 16 * 1024;
        for (const auto t : {DataType::kFloat32, DataType::kInt32}) {
          for (const auto count : counts) {
            for (const auto op : {ReduceOp::kSum, ReduceOp::kMax}) {
              auto in = make_input(r, count, t, op);
              std::vector<char> out(in.size());
              comm.all_reduce(in.data(), out.data(), count, t, op, o).wait();
              Mismatches bad;
              for (std::size_t i = 0; i < count; ++i) {
                const double want = expected_reduce(i, n, t, op);
                if (!close_enough(load(out.data(), i, t), want, t)) {
                  bad.add(i, load(out.data(), i, t), want);
                }
              }
              ASSERT_EQ(bad.count, 0u)
                  << "all_reduce count=" << count << " rank=" << r << ": " << bad.first;
            }

            // reduce_scatter: rank r gets block r of the reduction of n*count inputs.
            auto rs_in = make_input(r, count * nn, t, ReduceOp::kSum);
            std::vector<char> rs_out(std::max<std::size_t>(1, count * dtype_size(t)));
            comm.reduce_scatter(rs_in.data(), rs_out.data(), count, t, ReduceOp::kSum, o).wait();
            Mismatches bad;
            for (std::size_t i = 0; i < count; ++i) {
              const std::size_t g = static_cast<std::size_t>(r) * count + i;
              const double want = expected_reduce(g, n, t, ReduceOp::kSum);
              const double got = load(rs_out.data(), i, t);
              if (!close_enough(got, want, t)) bad.add(i, got, want);
            }
            ASSERT_EQ(bad.count, 0u)
                << "reduce_scatter count=" << count << " rank=" << r << ": " << bad.first;

            // all_gather: block q holds rank q's input.
            auto ag_in = make_input(r, count, t, ReduceOp::kSum);
            std::vector<char> ag_out(std::max<std::size_t>(1, count * nn * dtype_size(t)));
            comm.all_gather(ag_in.data(), ag_out.data(), count, t, o).wait();
            for (int q = 0; q < n; ++q) {
              for (std::size_t i = 0; i < count; ++i) {
                const double want = input_value(q, i, t, ReduceOp::kSum);
                const double got = load(ag_out.data(), static_cast<std::size_t>(q) * count + i, t);
                if (got != want) bad.add(static_cast<std::size_t>(q) * count + i, got, want);
              }
            }
            ASSERT_EQ(bad.count, 0u)
                << "all_gather count=" << count << " rank=" << r << ": " << bad.first;

            // broadcast from the last rank: the one farthest along the chain from rank 0.
            const int root = n - 1;
            auto b_in = make_input(root, count, t, ReduceOp::kSum);
            std::vector<char> b_out(b_in.size());
            comm.broadcast(b_in.data(), b_out.data(), count, t, root, o).wait();
            for (std::size_t i = 0; i < count; ++i) {
              const double want = input_value(root, i, t, ReduceOp::kSum);
              const double got = load(b_out.data(), i, t);
              if (got != want) bad.add(i, got, want);
            }
            ASSERT_EQ(bad.count, 0u)
                << "broadcast count=" << count << " rank=" << r << ": " << bad.first;
          }
        }
        comm.barrier().wait();
      },
      delayed(kDelayUs));
}

INSTANTIATE_TEST_SUITE_P(Ranks, DelayedLink, ::testing::Values(2, 3, 4));

// Median round trip, seen from rank 0, of a ping-pong between two ranks: rank 0 broadcasts 8
// bytes, rank 1 waits for them and broadcasts 8 bytes back; each round trip crosses both
// links once.
double ping_pong_us(int delay_us, int iterations, int spin_us) {
  std::vector<double> samples;
  run_ranks(
      2,
      [&](Communicator& comm) {
        double mine = 0;
        double theirs = 0;
        const auto once = [&] {
          comm.broadcast(&mine, &theirs, 1, DataType::kFloat64, 0).wait();
          comm.broadcast(&mine, &theirs, 1, DataType::kFloat64, 1).wait();
        };
        for (int i = 0; i < 10; ++i) once();  // warm up: connections, buffers, caches
        for (int i = 0; i < iterations; ++i) {
          const auto start = std::chrono::steady_clock::now();
          once();
          const std::chrono::duration<double, std::micro> took =
              std::chrono::steady_clock::now() - start;
          if (comm.rank() == 0) samples.push_back(took.count());
        }
      },
      delayed(delay_us, spin_us));
  std::sort(samples.begin(), samples.end());
  return samples[samples.size() / 2];
}

// A benchmark-style check: the emulated delay adds what it says. Measured twice: with the
// default spins (printed as -1), where engines and waiting threads can fall asleep during a
// long delay and each crossing also pays their wake-ups (as it would on a real slow network),
// and with both spins longer than the round trip, which isolates what the decorator itself
// adds. Timing on a shared machine is noisy, so the assertion is loose (each crossing is held
// at least the delay); the ratios are printed for the record.
TEST(DelayedLinkTiming, PingPongAddsTheDelayOnEachCrossing) {
  const int spin_default = -1;
  const double base = ping_pong_us(0, 200, spin_default);
  for (const int delay_us : {25, 200, 1000}) {
    const int iterations = delay_us >= 1000 ? 50 : 100;
    for (const int spin_us : {spin_default, 2 * delay_us + 1000}) {
      const double measured = ping_pong_us(delay_us, iterations, spin_us);
      const double expected = base + 2.0 * delay_us;
      std::printf(
          "ping-pong: one-way delay %4d us, spin %4d us: base round trip %.1f us, "
          "measured %.1f us, expected %.1f us, ratio %.3f\n",
          delay_us, spin_us, base, measured, expected, measured / expected);
      EXPECT_GE(measured, 2.0 * delay_us);
      // No upper bound here: on a shared 2-core machine (and under sanitizers) scheduling noise
      // is unbounded; the printed ratio is the measurement, the bound above the correctness.
    }
  }
}

TEST(DelayedLinkEnv, DearLinkDelayUsIsReadAndChecked) {
  ::setenv("DEAR_LINK_DELAY_US", "25", 1);
  EXPECT_EQ(apply_env({}).link_delay_us, 25);
  ::setenv("DEAR_LINK_DELAY_US", "-3", 1);
  EXPECT_THROW((void)apply_env({}), Error);
  ::setenv("DEAR_LINK_DELAY_US", "25us", 1);
  EXPECT_THROW((void)apply_env({}), Error);
  ::unsetenv("DEAR_LINK_DELAY_US");
  EXPECT_EQ(apply_env({}).link_delay_us, 0);
}

TEST(DelayedLinkEnv, NegativeDelayIsRejected) {
  const auto errors = run_ranks_collect(
      2, [](Communicator&) {}, delayed(-1));
  for (const auto& e : errors) EXPECT_TRUE(e != nullptr);
}

}  // namespace
}  // namespace dear::testing
