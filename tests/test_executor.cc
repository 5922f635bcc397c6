// The executors (collectives/executor.h): every step completes exactly once with the CPU
// kernels' result, whatever order the deferred executor picks; names are checked.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "collectives/executor.h"
#include "collectives/reduce.h"
#include "dear/error.h"

namespace dear::collectives {
namespace {

TEST(Executor, DeferredCompletesEveryStepOnceWithTheHostResult) {
  auto exec = make_deferred_executor(7);
  EXPECT_FALSE(exec->immediate());
  constexpr std::size_t kSteps = 200;
  constexpr std::size_t kN = 513;
  std::vector<std::vector<float>> a(kSteps), b(kSteps), dst(kSteps), want(kSteps);
  std::vector<std::uint64_t> done;
  for (std::size_t s = 0; s < kSteps; ++s) {
    a[s].resize(kN);
    b[s].resize(kN);
    dst[s].assign(kN, 0);
    want[s].resize(kN);
    for (std::size_t i = 0; i < kN; ++i) {
      a[s][i] = static_cast<float>(s + i);
      b[s][i] = static_cast<float>(3 * i) - static_cast<float>(s);
    }
    ExecStep e;
    e.kind = s % 3 == 0 ? ExecStep::kCopy : s % 3 == 1 ? ExecStep::kReduce : ExecStep::kReduceFinal;
    e.dst = reinterpret_cast<char*>(dst[s].data());
    e.a = reinterpret_cast<const char*>(a[s].data());
    e.b = reinterpret_cast<const char*>(b[s].data());
    e.n = e.kind == ExecStep::kCopy ? kN * sizeof(float) : kN;
    e.dtype = DataType::kFloat32;
    e.op = ReduceOp::kAvg;
    e.nranks = 4;
    if (e.kind == ExecStep::kCopy) {
      want[s] = a[s];
    } else if (e.kind == ExecStep::kReduce) {
      reduce(want[s].data(), a[s].data(), b[s].data(), kN, e.dtype, e.op);
    } else {
      reduce_final(want[s].data(), a[s].data(), b[s].data(), kN, e.dtype, e.op, 4);
    }
    exec->issue(e, 1000 + s);
    exec->poll(done);
  }
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (done.size() < kSteps && std::chrono::steady_clock::now() < until) exec->poll(done);
  ASSERT_EQ(done.size(), kSteps);
  EXPECT_EQ(exec->in_flight(), 0U);
  std::vector<std::uint64_t> sorted = done;
  std::sort(sorted.begin(), sorted.end());
  for (std::size_t s = 0; s < kSteps; ++s) {
    ASSERT_EQ(sorted[s], 1000 + s) << "a token missing or repeated";
    ASSERT_EQ(std::memcmp(dst[s].data(), want[s].data(), kN * sizeof(float)), 0) << "step " << s;
  }
  // Shuffled: the completion order is not the issue order.
  EXPECT_NE(done, sorted);
}

TEST(Executor, DrainWaitsForEveryStep) {
  auto exec = make_deferred_executor(3);
  std::vector<char> src(1 << 20, 7), dst(1 << 20, 0);
  ExecStep e;
  e.kind = ExecStep::kCopy;
  e.dst = dst.data();
  e.a = src.data();
  e.n = src.size();
  exec->issue(e, 1);
  exec->drain();
  EXPECT_EQ(exec->in_flight(), 0U);
  EXPECT_EQ(dst, src);
}

TEST(Executor, HostIsImmediate) {
  auto exec = make_host_executor();
  EXPECT_TRUE(exec->immediate());
  int src = 42;
  int dst = 0;
  ExecStep e;
  e.kind = ExecStep::kCopy;
  e.dst = reinterpret_cast<char*>(&dst);
  e.a = reinterpret_cast<const char*>(&src);
  e.n = sizeof(int);
  exec->issue(e, 1);
  EXPECT_EQ(dst, 42);
}

TEST(Executor, UnknownNameIsRefusedNamingTheChoices) {
  try {
    (void)make_executor("gpu", 0, 3);
    FAIL() << "an unknown executor was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
    EXPECT_EQ(e.rank(), 3);
    EXPECT_NE(std::string(e.what()).find("deferred_bounce"), std::string::npos) << e.what();
  }
  EXPECT_TRUE(make_executor("deferred_bounce", 0, 0).bounce);
  EXPECT_FALSE(make_executor("host", 0, 0).bounce);
}

}  // namespace
}  // namespace dear::collectives
