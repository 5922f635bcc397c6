// Throughput of the CUDA reduction kernels next to cudaMemcpy device-to-device of the same
// buffer size, timed with CUDA events (manual time).
//
// Bytes are memory traffic, as in reduce-bench: a reduction reads two buffers and writes one
// (3 x size), a copy reads one and writes one (2 x size), so the GB/s columns compare directly
// and reduce GB/s / memcpy GB/s says how close a kernel runs to the memory system. Sizes are
// per input buffer. Without a CUDA device it says so and exits 0.
#include <benchmark/benchmark.h>
#include <cuda_runtime_api.h>

#include <cstdio>
#include <string>

#include "cuda/device.h"
#include "cuda/error.h"
#include "cuda/reduce.h"
#include "dear/types.h"

namespace dear::cuda {
namespace {

constexpr int kRepeats = 20;  // launches per timed batch, so launch gaps amortise

struct Buffers {
  explicit Buffers(std::size_t size) : bytes(size) {
    check(cudaMalloc(&a, bytes), "cudaMalloc a");
    check(cudaMalloc(&b, bytes), "cudaMalloc b");
    check(cudaMalloc(&d, bytes), "cudaMalloc dst");
    // Small integers in every type: no NaN or subnormal slow paths, no overflow to Inf.
    check(cudaMemset(a, 1, bytes), "cudaMemset a");
    check(cudaMemset(b, 1, bytes), "cudaMemset b");
    check(cudaEventCreate(&start), "cudaEventCreate");
    check(cudaEventCreate(&stop), "cudaEventCreate");
  }
  ~Buffers() {
    (void)cudaFree(a);
    (void)cudaFree(b);
    (void)cudaFree(d);
    (void)cudaEventDestroy(start);
    (void)cudaEventDestroy(stop);
  }
  Buffers(const Buffers&) = delete;
  Buffers& operator=(const Buffers&) = delete;
  std::size_t bytes;
  void* a = nullptr;
  void* b = nullptr;
  void* d = nullptr;
  cudaEvent_t start = nullptr;
  cudaEvent_t stop = nullptr;
};

template <class Fn>
void timed(benchmark::State& state, Buffers& buf, double traffic_per_call, Fn fn) {
  fn();  // warm-up (first launch loads the module)
  check(cudaDeviceSynchronize(), "warm-up");
  for (auto _ : state) {
    check(cudaEventRecord(buf.start, nullptr), "cudaEventRecord");
    for (int i = 0; i < kRepeats; ++i) fn();
    check(cudaEventRecord(buf.stop, nullptr), "cudaEventRecord");
    check(cudaEventSynchronize(buf.stop), "cudaEventSynchronize");
    float ms = 0;
    check(cudaEventElapsedTime(&ms, buf.start, buf.stop), "cudaEventElapsedTime");
    state.SetIterationTime(static_cast<double>(ms) / 1e3 / kRepeats);
  }
  state.counters["GB/s"] =
      benchmark::Counter(traffic_per_call, benchmark::Counter::kIsIterationInvariantRate);
}

void BM_Reduce(benchmark::State& state, DataType t, ReduceOp op) {
  const auto bytes = static_cast<std::size_t>(state.range(0));
  Buffers buf(bytes);
  const std::size_t n = bytes / dtype_size(t);
  timed(state, buf, 3.0 * static_cast<double>(bytes),
        [&] { reduce_final(buf.d, buf.a, buf.b, n, t, op, 4, nullptr); });
}

void BM_MemcpyD2D(benchmark::State& state) {
  const auto bytes = static_cast<std::size_t>(state.range(0));
  Buffers buf(bytes);
  timed(state, buf, 2.0 * static_cast<double>(bytes), [&] {
    check(cudaMemcpyAsync(buf.d, buf.a, bytes, cudaMemcpyDeviceToDevice, nullptr),
          "cudaMemcpyAsync");
  });
}

void register_all() {
  const std::int64_t sizes[] = {1 << 20, 16 << 20, 256 << 20};
  auto* copy = benchmark::RegisterBenchmark("memcpy_d2d", BM_MemcpyD2D);
  for (const auto s : sizes) copy->Arg(s);
  copy->UseManualTime()->Unit(benchmark::kMicrosecond);
  const DataType types[] = {DataType::kInt8,    DataType::kInt32,    DataType::kInt64,
                            DataType::kFloat16, DataType::kBFloat16, DataType::kFloat32,
                            DataType::kFloat64};
  for (const DataType t : types) {
    for (const ReduceOp op : {ReduceOp::kSum, ReduceOp::kMax, ReduceOp::kAvg}) {
      const std::string name =
          "reduce/" + std::string(to_string(t)) + "/" + std::string(to_string(op));
      auto* b = benchmark::RegisterBenchmark(name.c_str(), BM_Reduce, t, op);
      for (const auto s : sizes) b->Arg(s);
      b->UseManualTime()->Unit(benchmark::kMicrosecond);
    }
  }
}

}  // namespace
}  // namespace dear::cuda

int main(int argc, char** argv) {
  if (dear::cuda::device_count() == 0) {
    std::printf("cuda-reduce-bench: skipped: no CUDA device (%s)\n",
                dear::cuda::unavailable_reason().c_str());
    return 0;
  }
  dear::cuda::register_all();
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
