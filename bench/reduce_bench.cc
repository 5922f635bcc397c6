// Throughput of the CPU reduction kernels, next to memcpy of the same buffer size.
//
// A ring all-reduce on a host is bounded by how fast one core can stream through its
// reductions, and memcpy is the ceiling for a streaming loop on that machine. Bytes are
// counted as memory traffic, so the two rates compare directly: reduce() reads two buffers and
// writes one (3 x size), memcpy reads one and writes one (2 x size). The ratio
// reduce GB/s / memcpy GB/s at the same size says how close a kernel is to the memory system;
// sizes are per input buffer: 64 KiB (in L2), 1 MiB (L2/L3), 16 MiB (DRAM on most machines).
#include <benchmark/benchmark.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <new>
#include <random>

#include "collectives/reduce.h"
#include "common/reduce_ops.h"
#include "dear/types.h"

namespace dear::collectives {
namespace {

constexpr std::size_t kAlignment = 64;

struct AlignedDelete {
  void operator()(std::byte* p) const { ::operator delete[](p, std::align_val_t{kAlignment}); }
};
using AlignedBytes = std::unique_ptr<std::byte[], AlignedDelete>;

AlignedBytes allocate(std::size_t bytes) {
  return AlignedBytes(new (std::align_val_t{kAlignment}) std::byte[bytes]);
}

// Moderate values of the element type: no NaNs or subnormals, which some CPUs process through
// slow microcode paths and which gradients rarely hold.
void fill(std::byte* p, std::size_t bytes, DataType t, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> value(-4.0f, 4.0f);
  const std::size_t n = bytes / dtype_size(t);
  for (std::size_t i = 0; i < n; ++i) {
    const float v = value(rng);
    switch (t) {
      case DataType::kFloat16: {
        const std::uint16_t h = float_to_half(v);
        std::memcpy(p + 2 * i, &h, 2);
        break;
      }
      case DataType::kBFloat16: {
        const std::uint16_t h = float_to_bf16(v);
        std::memcpy(p + 2 * i, &h, 2);
        break;
      }
      case DataType::kFloat32: std::memcpy(p + 4 * i, &v, 4); break;
      case DataType::kFloat64: {
        const auto d = static_cast<double>(v);
        std::memcpy(p + 8 * i, &d, 8);
        break;
      }
      default: {
        const std::uint64_t bits = rng();
        std::memcpy(p + dtype_size(t) * i, &bits, dtype_size(t));  // little endian: low bytes
        break;
      }
    }
  }
}

// `divisor` > 1: kAvg's final step (the sum divided by the rank count), as reduce_final does it.
void bm_reduce(benchmark::State& state, DataType t, ReduceOp op, int divisor = 1) {
  const auto bytes = static_cast<std::size_t>(state.range(0));
  const std::size_t n = bytes / dtype_size(t);
  AlignedBytes a = allocate(bytes);
  AlignedBytes b = allocate(bytes);
  AlignedBytes dst = allocate(bytes);
  fill(a.get(), bytes, t, 1);
  fill(b.get(), bytes, t, 2);
  std::memset(dst.get(), 0, bytes);
  for (auto _ : state) {
    if (divisor > 1) {
      reduce_final(dst.get(), a.get(), b.get(), n, t, op, divisor);
    } else {
      reduce(dst.get(), a.get(), b.get(), n, t, op);
    }
    benchmark::DoNotOptimize(dst.get());
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations()) *
                          static_cast<std::int64_t>(3 * bytes));
  state.SetLabel("3 streams");
}

void bm_memcpy(benchmark::State& state) {
  const auto bytes = static_cast<std::size_t>(state.range(0));
  AlignedBytes src = allocate(bytes);
  AlignedBytes dst = allocate(bytes);
  fill(src.get(), bytes, DataType::kFloat32, 1);
  std::memset(dst.get(), 0, bytes);
  for (auto _ : state) {
    std::memcpy(dst.get(), src.get(), bytes);
    benchmark::DoNotOptimize(dst.get());
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations()) *
                          static_cast<std::int64_t>(2 * bytes));
  state.SetLabel("2 streams");
}

void sizes(benchmark::internal::Benchmark* b) {
  b->ArgName("bytes");
  for (std::int64_t kib : {64, 1024, 16 * 1024}) b->Arg(kib * 1024);
}

BENCHMARK(bm_memcpy)->Apply(sizes);
BENCHMARK_CAPTURE(bm_reduce, float_sum, DataType::kFloat32, ReduceOp::kSum)->Apply(sizes);
BENCHMARK_CAPTURE(bm_reduce, half_sum, DataType::kFloat16, ReduceOp::kSum)->Apply(sizes);
BENCHMARK_CAPTURE(bm_reduce, bfloat16_sum, DataType::kBFloat16, ReduceOp::kSum)->Apply(sizes);
BENCHMARK_CAPTURE(bm_reduce, int8_sum, DataType::kInt8, ReduceOp::kSum)->Apply(sizes);
BENCHMARK_CAPTURE(bm_reduce, double_max, DataType::kFloat64, ReduceOp::kMax)->Apply(sizes);
// kAvg's last step on 3 ranks (the CPU's way of dividing; common/reduce_ops.h, Divider).
BENCHMARK_CAPTURE(bm_reduce, int8_avg_final, DataType::kInt8, ReduceOp::kAvg, 3)->Apply(sizes);
BENCHMARK_CAPTURE(bm_reduce, int32_avg_final, DataType::kInt32, ReduceOp::kAvg, 3)->Apply(sizes);
BENCHMARK_CAPTURE(bm_reduce, int64_avg_final, DataType::kInt64, ReduceOp::kAvg, 3)->Apply(sizes);
BENCHMARK_CAPTURE(bm_reduce, float_avg_final, DataType::kFloat32, ReduceOp::kAvg, 3)->Apply(sizes);

}  // namespace
}  // namespace dear::collectives

BENCHMARK_MAIN();
