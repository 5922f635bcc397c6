// CPU-side tests of the CUDA support, run in every build and on machines without a GPU:
// the staging planner, pointer-location dispatch with host pointers, and the equivalence of
// the shared host/device functors (what a GPU kernel computes per element) with the CPU
// kernels and with independently written references, for every dtype x op.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "collectives/device_staging.h"
#include "collectives/reduce.h"
#include "collectives/reduce_ops.h"
#include "collectives/staging_plan.h"
#include "harness.h"
#include "reference.h"

namespace dear::collectives {
namespace {

const void* at(std::uintptr_t a) { return reinterpret_cast<const void*>(a); }

// ---- staging planner -------------------------------------------------------------------------

TEST(StagingPlan, HostBuffersAreNotStaged) {
  const auto p = plan_staging({at(0x1000), 64, false}, {at(0x2000), 64, false}, 4);
  EXPECT_EQ(p.pinned_bytes, 0u);
  EXPECT_EQ(p.in_offset, StagingPlan::kUnstaged);
  EXPECT_EQ(p.out_offset, StagingPlan::kUnstaged);
  EXPECT_TRUE(p.copy_in.empty());
  EXPECT_TRUE(p.copy_out.empty());
}

TEST(StagingPlan, SeparateDeviceBuffersGetSeparateRegions) {
  const auto p = plan_staging({at(0x10000), 1000, true}, {at(0x90000), 24, true}, 4);
  EXPECT_EQ(p.in_offset, 0u);
  EXPECT_EQ(p.out_offset, 1024u);  // after the input, on a 256-byte boundary
  EXPECT_EQ(p.pinned_bytes, 1024u + 24u);
  ASSERT_EQ(p.copy_in.size(), 1u);
  EXPECT_EQ(p.copy_in[0].device, 0x10000u);
  EXPECT_EQ(p.copy_in[0].bytes, 1000u);
  ASSERT_EQ(p.copy_out.size(), 1u);
  EXPECT_EQ(p.copy_out[0].device, 0x90000u);
  EXPECT_EQ(p.copy_out[0].pinned_offset, 1024u);
}

TEST(StagingPlan, MixedHostAndDevice) {
  const auto p = plan_staging({at(0x1000), 64, false}, {at(0x90000), 64, true}, 8);
  EXPECT_EQ(p.in_offset, StagingPlan::kUnstaged);
  EXPECT_EQ(p.out_offset, 0u);
  EXPECT_TRUE(p.copy_in.empty());
  ASSERT_EQ(p.copy_out.size(), 1u);
}

TEST(StagingPlan, InPlaceAllReduceSharesOneRegion) {
  const auto p = plan_staging({at(0x4000), 4096, true}, {at(0x4000), 4096, true}, 4);
  EXPECT_EQ(p.pinned_bytes, 4096u);
  EXPECT_EQ(p.in_offset, 0u);
  EXPECT_EQ(p.out_offset, 0u);
}

TEST(StagingPlan, InPlaceReduceScatterKeepsTheLayout) {
  // 4 ranks, 100 floats each, rank 2: out == in + 2 * 400 bytes; only the block is copied out.
  const std::uintptr_t in = 0x100000;
  const auto p = plan_staging({at(in), 1600, true}, {at(in + 800), 400, true}, 4);
  EXPECT_EQ(p.pinned_bytes, 1600u);
  EXPECT_EQ(p.in_offset, 0u);
  EXPECT_EQ(p.out_offset, 800u);
  ASSERT_EQ(p.copy_out.size(), 1u);
  EXPECT_EQ(p.copy_out[0].device, in + 800);
  EXPECT_EQ(p.copy_out[0].pinned_offset, 800u);
  EXPECT_EQ(p.copy_out[0].bytes, 400u);
}

TEST(StagingPlan, InPlaceAllGatherCopiesOnlyTheOwnBlockIn) {
  const std::uintptr_t out = 0x200000;
  const auto p = plan_staging({at(out + 3 * 256), 256, true}, {at(out), 1024, true}, 2);
  EXPECT_EQ(p.pinned_bytes, 1024u);
  EXPECT_EQ(p.in_offset, 768u);
  ASSERT_EQ(p.copy_in.size(), 1u);
  EXPECT_EQ(p.copy_in[0].bytes, 256u);
  EXPECT_EQ(p.copy_in[0].pinned_offset, 768u);
  ASSERT_EQ(p.copy_out.size(), 1u);
  EXPECT_EQ(p.copy_out[0].bytes, 1024u);
}

TEST(StagingPlan, ChunksCoverTheBufferOnElementBoundaries) {
  for (const std::size_t elem : {1u, 2u, 4u, 8u}) {
    for (const std::size_t bytes : {elem, 1000 * elem, 12345 * elem}) {
      const std::size_t chunk = 1000;  // not a multiple of 8: rounded down per element size
      const auto p = plan_staging({at(0x8000), bytes, true}, {}, elem, chunk);
      std::size_t next = 0;
      for (const auto& c : p.copy_in) {
        EXPECT_EQ(c.device, 0x8000u + next);
        EXPECT_EQ(c.pinned_offset, next);
        EXPECT_GT(c.bytes, 0u);
        EXPECT_LE(c.bytes, chunk);
        EXPECT_EQ(c.bytes % elem, 0u);
        next += c.bytes;
      }
      EXPECT_EQ(next, bytes) << "elem " << elem;
    }
  }
  // A chunk smaller than one element still moves whole elements.
  const auto p = plan_staging({at(0x8000), 64, true}, {}, 8, 3);
  ASSERT_EQ(p.copy_in.size(), 8u);
  EXPECT_EQ(p.copy_in[0].bytes, 8u);
}

TEST(StagingPlan, NothingToStageForEmptyOrUnreadBuffers) {
  // Broadcast on a non-root rank passes in = 0 bytes.
  const auto p = plan_staging({at(0x8000), 0, true}, {at(0x9000), 16, true}, 4);
  EXPECT_EQ(p.in_offset, StagingPlan::kUnstaged);
  EXPECT_TRUE(p.copy_in.empty());
  EXPECT_EQ(p.out_offset, 0u);
}

// ---- pointer-location dispatch with host pointers ----------------------------------------------

TEST(DeviceDispatch, HostPointersAreNotDevicePointers) {
  int on_stack = 0;
  std::vector<float> on_heap(16);
  EXPECT_FALSE(is_device_pointer(nullptr));
  EXPECT_FALSE(is_device_pointer(&on_stack));
  EXPECT_FALSE(is_device_pointer(on_heap.data()));
}

TEST(DeviceDispatch, HostBuffersRunOnTheHostPath) {
  dear::testing::run_ranks(3, [](Communicator& comm) {
    std::vector<float> in(1000), out(1000, -1.0f);
    for (std::size_t i = 0; i < in.size(); ++i) in[i] = static_cast<float>(comm.rank() + i);
    comm.all_reduce(in.data(), out.data(), in.size(), DataType::kFloat32, ReduceOp::kSum).wait();
    for (std::size_t i = 0; i < out.size(); ++i) {
      ASSERT_EQ(out[i], static_cast<float>(3 * i + 3)) << "element " << i;
    }
    // In place through the same dispatch.
    comm.all_reduce(in.data(), in.data(), in.size(), DataType::kFloat32, ReduceOp::kMax).wait();
    for (std::size_t i = 0; i < in.size(); ++i) ASSERT_EQ(in[i], static_cast<float>(2 + i));
  });
}

TEST(DeviceDispatch, StreamWithoutUsableCudaIsRejected) {
  dear::testing::run_ranks(1, [](Communicator& comm) {
    float x = 1;
    OpOptions o;
    o.cuda_stream = reinterpret_cast<void*>(0x1);  // cudaStreamLegacy's value
    try {
      // Only completes in a CUDA build on a machine with a device.
      comm.all_reduce(&x, &x, 1, DataType::kFloat32, ReduceOp::kSum, o).wait();
      EXPECT_EQ(x, 1.0f);
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
      EXPECT_NE(std::string(e.what()).find("cuda_stream"), std::string::npos) << e.what();
    }
  });
}

// ---- functor equivalence ---------------------------------------------------------------------

constexpr DataType kTypes[] = {DataType::kInt8,    DataType::kUint8,    DataType::kInt32,
                               DataType::kInt64,   DataType::kFloat16,  DataType::kBFloat16,
                               DataType::kFloat32, DataType::kFloat64};
constexpr ReduceOp kOps[] = {ReduceOp::kSum, ReduceOp::kProd, ReduceOp::kMin, ReduceOp::kMax,
                             ReduceOp::kAvg};

// What one GPU thread computes for one element: the shared functors, applied one at a time.
template <DataType kType>
void scalar_functors(void* dst, const void* a, const void* b, std::size_t n, ReduceOp op,
                     int divisor) {
  using E = Element<kType>;
  using S = typename E::Storage;
  using C = typename E::Compute;
  auto* d = static_cast<S*>(dst);
  const auto* pa = static_cast<const S*>(a);
  const auto* pb = static_cast<const S*>(b);
  for (std::size_t i = 0; i < n; ++i) {
    const C x = E::load(pa[i]);
    const C y = E::load(pb[i]);
    C r{};
    switch (op) {
      case ReduceOp::kSum: r = SumOp{}(x, y); break;
      case ReduceOp::kProd: r = ProdOp{}(x, y); break;
      case ReduceOp::kMin: r = MinOp{}(x, y); break;
      case ReduceOp::kMax: r = MaxOp{}(x, y); break;
      case ReduceOp::kAvg: r = divisor > 1 ? AvgFinalOp<C>{divisor}(x, y) : SumOp{}(x, y); break;
    }
    d[i] = E::store(r);
  }
}

void scalar(void* dst, const void* a, const void* b, std::size_t n, DataType t, ReduceOp op,
            int divisor) {
  switch (t) {
    case DataType::kInt8: return scalar_functors<DataType::kInt8>(dst, a, b, n, op, divisor);
    case DataType::kUint8: return scalar_functors<DataType::kUint8>(dst, a, b, n, op, divisor);
    case DataType::kInt32: return scalar_functors<DataType::kInt32>(dst, a, b, n, op, divisor);
    case DataType::kInt64: return scalar_functors<DataType::kInt64>(dst, a, b, n, op, divisor);
    case DataType::kFloat16: return scalar_functors<DataType::kFloat16>(dst, a, b, n, op, divisor);
    case DataType::kBFloat16:
      return scalar_functors<DataType::kBFloat16>(dst, a, b, n, op, divisor);
    case DataType::kFloat32: return scalar_functors<DataType::kFloat32>(dst, a, b, n, op, divisor);
    case DataType::kFloat64: return scalar_functors<DataType::kFloat64>(dst, a, b, n, op, divisor);
  }
}

// Random bit patterns (NaN, Inf, subnormals included) plus a share of ordinary values, so that
// rounding, not only special values, is exercised.
std::vector<std::byte> random_bytes(std::size_t n, std::size_t elem, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<std::byte> v(n * elem);
  for (auto& b : v) b = static_cast<std::byte>(rng());
  return v;
}

// NaN results agree as NaNs only: which operand's payload an addition keeps depends on
// operand order, which compilers may swap (x86), and GPUs return one canonical NaN.
bool is_nan(const std::byte* p, DataType t) {
  switch (t) {
    case DataType::kFloat16: { std::uint16_t h; std::memcpy(&h, p, 2); return (h & 0x7fff) > 0x7c00; }
    case DataType::kBFloat16: { std::uint16_t h; std::memcpy(&h, p, 2); return (h & 0x7fff) > 0x7f80; }
    case DataType::kFloat32: { float f; std::memcpy(&f, p, 4); return std::isnan(f); }
    case DataType::kFloat64: { double f; std::memcpy(&f, p, 8); return std::isnan(f); }
    default: return false;
  }
}

// Bit for bit apart from NaN payloads (see is_nan).
TEST(FunctorEquivalence, ScalarFunctorsMatchTheCpuKernelsBitForBit) {
  constexpr std::size_t kN = 4099;  // odd: vector bodies and tails
  for (const DataType t : kTypes) {
    const std::size_t el = dtype_size(t);
    const auto a = random_bytes(kN, el, 1 + static_cast<int>(t));
    const auto b = random_bytes(kN, el, 100 + static_cast<int>(t));
    for (const ReduceOp op : kOps) {
      for (const int nranks : {1, 3}) {
        std::vector<std::byte> want(kN * el), got(kN * el);
        scalar(want.data(), a.data(), b.data(), kN, t, op, op == ReduceOp::kAvg ? nranks : 1);
        reduce_final(got.data(), a.data(), b.data(), kN, t, op, nranks);
        for (std::size_t i = 0; i < kN; ++i) {
          if (is_nan(want.data() + i * el, t)) {
            ASSERT_TRUE(is_nan(got.data() + i * el, t)) << to_string(t) << " element " << i;
            continue;
          }
          ASSERT_EQ(std::memcmp(want.data() + i * el, got.data() + i * el, el), 0)
              << to_string(t) << " " << to_string(op) << " nranks " << nranks << " element "
              << i;
        }
      }
    }
  }
}

// Independent rounding of an fp32 value to bf16: the nearer neighbour, ties to the even one,
// decided by exact arithmetic in double.
std::uint16_t independent_bf16(float f) {
  if (std::isnan(f)) return 0x7fc0;
  std::uint32_t u;
  std::memcpy(&u, &f, 4);
  const std::uint32_t lo_bits = u & 0xffff0000u;
  const std::uint32_t hi_bits = lo_bits + 0x10000u;
  float lo, hi;
  std::memcpy(&lo, &lo_bits, 4);
  std::memcpy(&hi, &hi_bits, 4);
  const double dlo = std::fabs(static_cast<double>(f) - static_cast<double>(lo));
  const double dhi = std::fabs(static_cast<double>(hi) - static_cast<double>(f));
  if (dlo < dhi || (dlo == dhi && ((lo_bits >> 16) & 1u) == 0)) {
    return static_cast<std::uint16_t>(lo_bits >> 16);
  }
  return static_cast<std::uint16_t>(hi_bits >> 16);
}

double finite_value(std::mt19937_64& rng) {
  std::uniform_real_distribution<double> d(-300.0, 300.0);
  return d(rng);
}

TEST(FunctorEquivalence, SixteenBitFloatsRoundOnceFromFp32) {
  std::mt19937_64 rng(7);
  for (int k = 0; k < 200000; ++k) {
    const auto fa = static_cast<float>(finite_value(rng));
    const auto fb = static_cast<float>(finite_value(rng));
    // bf16: inputs rounded independently, fp32 arithmetic, then rounded once.
    const std::uint16_t ba = independent_bf16(fa), bb = independent_bf16(fb);
    const auto bf = [](std::uint16_t x) {
      return static_cast<float>(dear::testing::bf16_bits_value(x));
    };
    using B = Element<DataType::kBFloat16>;
    EXPECT_EQ(B::store(SumOp{}(B::load(ba), B::load(bb))), independent_bf16(bf(ba) + bf(bb)));
    EXPECT_EQ(B::store(ProdOp{}(B::load(ba), B::load(bb))), independent_bf16(bf(ba) * bf(bb)));
    EXPECT_EQ(B::store(AvgFinalOp<float>{3}(B::load(ba), B::load(bb))),
              independent_bf16((bf(ba) + bf(bb)) / 3.0f));
#ifdef __FLT16_MAX__
    // fp16: the compiler's own _Float16 conversions are the reference.
    const auto ha = static_cast<_Float16>(fa / 8), hb = static_cast<_Float16>(fb / 8);
    std::uint16_t ua, ub;
    std::memcpy(&ua, &ha, 2);
    std::memcpy(&ub, &hb, 2);
    const auto ref = [](float r) {
      const auto h = static_cast<_Float16>(r);
      std::uint16_t u;
      std::memcpy(&u, &h, 2);
      return u;
    };
    using H = Element<DataType::kFloat16>;
    const float xa = static_cast<float>(ha), xb = static_cast<float>(hb);
    EXPECT_EQ(H::store(SumOp{}(H::load(ua), H::load(ub))), ref(xa + xb));
    EXPECT_EQ(H::store(ProdOp{}(H::load(ua), H::load(ub))), ref(xa * xb));
    EXPECT_EQ(H::store(AvgFinalOp<float>{3}(H::load(ua), H::load(ub))), ref((xa + xb) / 3.0f));
    EXPECT_EQ(H::store(MinOp{}(H::load(ua), H::load(ub))), ref(std::fmin(xa, xb)));
    EXPECT_EQ(H::store(MaxOp{}(H::load(ua), H::load(ub))), ref(std::fmax(xa, xb)));
#endif
    if (::testing::Test::HasFailure()) return;
  }
}

TEST(FunctorEquivalence, IntegersAgreeWithWideArithmetic) {
  std::mt19937_64 rng(11);
  for (int k = 0; k < 100000; ++k) {
    const auto a = static_cast<std::int64_t>(rng());
    const auto b = static_cast<std::int64_t>(rng());
    const auto a8 = static_cast<std::int8_t>(a), b8 = static_cast<std::int8_t>(b);
    ASSERT_EQ(SumOp{}(a8, b8), static_cast<std::int8_t>((a8 + b8) & 0xff));
    ASSERT_EQ(ProdOp{}(a8, b8), static_cast<std::int8_t>((a8 * b8) & 0xff));
    const auto u8a = static_cast<std::uint8_t>(a), u8b = static_cast<std::uint8_t>(b);
    ASSERT_EQ(ProdOp{}(u8a, u8b), static_cast<std::uint8_t>((u8a * u8b) & 0xff));
    const auto a32 = static_cast<std::int32_t>(a), b32 = static_cast<std::int32_t>(b);
    ASSERT_EQ(SumOp{}(a32, b32), static_cast<std::int32_t>(static_cast<std::int64_t>(a32) + b32));
    ASSERT_EQ(MinOp{}(a32, b32), std::min(a32, b32));
    ASSERT_EQ(MaxOp{}(a, b), std::max(a, b));
    ASSERT_EQ(AvgFinalOp<std::int32_t>{3}(a32 / 4, b32 / 4),
              static_cast<std::int32_t>((static_cast<std::int64_t>(a32 / 4) + b32 / 4) / 3));
  }
}

}  // namespace
}  // namespace dear::collectives
