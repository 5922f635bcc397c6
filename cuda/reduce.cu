// Reduction kernels: one grid-stride kernel per (dtype, operator), instantiated from the
// functors shared with the CPU kernels.
//
// Each thread handles whole 16-byte vectors of the aligned middle of the buffers, then the
// scalar head (before the first 16-byte boundary) and tail. Build with --fmad=false: nothing
// here multiplies and adds, and the flag makes sure no contraction ever changes a result.
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "common/reduce_ops.h"
#include "cuda/error.h"
#include "cuda/reduce.h"

namespace dear::cuda {
namespace {

constexpr int kThreads = 256;
constexpr std::size_t kVectorBytes = 16;

template <class E, class Fn>
__device__ __forceinline__ typename E::Storage apply(typename E::Storage x, typename E::Storage y,
                                                     Fn fn) {
  return E::store(fn(E::load(x), E::load(y)));
}

// Elements [0, head) and [head + vectors * V, n) one by one; [head, head + vectors * V) as
// uint4 vectors of V elements.
template <class E, class Fn>
__global__ void __launch_bounds__(kThreads)
    reduce_kernel(typename E::Storage* dst, const typename E::Storage* a,
                  const typename E::Storage* b, std::size_t n, std::size_t head,
                  std::size_t vectors, Fn fn) {
  using S = typename E::Storage;
  constexpr std::size_t kPer = kVectorBytes / sizeof(S);
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  const std::size_t first = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x;

  const auto* va = reinterpret_cast<const uint4*>(a + head);
  const auto* vb = reinterpret_cast<const uint4*>(b + head);
  auto* vd = reinterpret_cast<uint4*>(dst + head);
  for (std::size_t v = first; v < vectors; v += stride) {
    const uint4 x = va[v];
    const uint4 y = vb[v];
    S xs[kPer];
    S ys[kPer];
    S rs[kPer];
    memcpy(xs, &x, sizeof x);
    memcpy(ys, &y, sizeof y);
#pragma unroll
    for (std::size_t k = 0; k < kPer; ++k) rs[k] = apply<E>(xs[k], ys[k], fn);
    uint4 r;
    memcpy(&r, rs, sizeof r);
    vd[v] = r;
  }

  const std::size_t body_end = head + vectors * kPer;
  const std::size_t scalars = head + (n - body_end);
  for (std::size_t j = first; j < scalars; j += stride) {
    const std::size_t i = j < head ? j : body_end + (j - head);
    dst[i] = apply<E>(a[i], b[i], fn);
  }
}

int max_blocks() {
  int device = 0;
  check(cudaGetDevice(&device), "cudaGetDevice");
  int sms = 0;
  check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device),
        "cudaDeviceGetAttribute(multiProcessorCount)");
  // Enough resident threads per SM to keep loads in flight; the grid-stride loop covers the
  // rest.
  return sms * 8;
}

template <class E, class Fn>
void launch(void* dst, const void* a, const void* b, std::size_t n, Fn fn, cudaStream_t stream) {
  using S = typename E::Storage;
  constexpr std::size_t kPer = kVectorBytes / sizeof(S);
  auto* d = static_cast<S*>(dst);
  const auto* pa = static_cast<const S*>(a);
  const auto* pb = static_cast<const S*>(b);
  const auto addr = [](const void* p) { return reinterpret_cast<std::uintptr_t>(p); };
  std::size_t head = 0;
  std::size_t vectors = 0;
  const std::uintptr_t mis = addr(a) % kVectorBytes;
  if (mis == addr(b) % kVectorBytes && mis == addr(dst) % kVectorBytes) {
    head = ((kVectorBytes - mis) % kVectorBytes) / sizeof(S);
    if (head > n) head = n;
    vectors = (n - head) / kPer;
  }
  const std::size_t work = vectors + (n - vectors * kPer);
  const std::size_t wanted = (work + kThreads - 1) / kThreads;
  const std::size_t cap = static_cast<std::size_t>(max_blocks());
  const unsigned blocks = static_cast<unsigned>(wanted < cap ? wanted : cap);
  reduce_kernel<E><<<blocks, kThreads, 0, stream>>>(d, pa, pb, n, head, vectors, fn);
  check(cudaGetLastError(), "launching the reduction kernel");
}

template <DataType kType>
void reduce_typed(void* dst, const void* a, const void* b, std::size_t n, ReduceOp op, int divisor,
                  cudaStream_t stream) {
  using E = Element<kType>;
  switch (op) {
    case ReduceOp::kAvg:
      if (divisor > 1) {
        launch<E>(dst, a, b, n, AvgFinalOp<typename E::Compute>(divisor), stream);
        return;
      }
      launch<E>(dst, a, b, n, SumOp{}, stream);
      return;
    case ReduceOp::kSum: launch<E>(dst, a, b, n, SumOp{}, stream); return;
    case ReduceOp::kProd: launch<E>(dst, a, b, n, ProdOp{}, stream); return;
    case ReduceOp::kMin: launch<E>(dst, a, b, n, MinOp{}, stream); return;
    case ReduceOp::kMax: launch<E>(dst, a, b, n, MaxOp{}, stream); return;
  }
}

void dispatch(void* dst, const void* a, const void* b, std::size_t n, DataType dtype, ReduceOp op,
              int divisor, cudaStream_t stream) {
  if (!is_valid(dtype)) {
    throw Error(
        ErrorCode::kInvalidArgument,
        "cuda::reduce: dtype=" + std::to_string(static_cast<int>(dtype)) + " is not a DataType");
  }
  if (!is_valid(op)) {
    throw Error(ErrorCode::kInvalidArgument,
                "cuda::reduce: op=" + std::to_string(static_cast<int>(op)) + " is not a ReduceOp");
  }
  if (n == 0) return;
  const char* null_arg = dst == nullptr ? "dst" : a == nullptr ? "a" : b == nullptr ? "b" : nullptr;
  if (null_arg != nullptr) {
    throw Error(ErrorCode::kInvalidArgument,
                std::string("cuda::reduce: ") + null_arg + " is null but n=" + std::to_string(n));
  }
  switch (dtype) {
    case DataType::kInt8: return reduce_typed<DataType::kInt8>(dst, a, b, n, op, divisor, stream);
    case DataType::kUint8: return reduce_typed<DataType::kUint8>(dst, a, b, n, op, divisor, stream);
    case DataType::kInt32: return reduce_typed<DataType::kInt32>(dst, a, b, n, op, divisor, stream);
    case DataType::kInt64: return reduce_typed<DataType::kInt64>(dst, a, b, n, op, divisor, stream);
    case DataType::kFloat16:
      return reduce_typed<DataType::kFloat16>(dst, a, b, n, op, divisor, stream);
    case DataType::kBFloat16:
      return reduce_typed<DataType::kBFloat16>(dst, a, b, n, op, divisor, stream);
    case DataType::kFloat32:
      return reduce_typed<DataType::kFloat32>(dst, a, b, n, op, divisor, stream);
    case DataType::kFloat64:
      return reduce_typed<DataType::kFloat64>(dst, a, b, n, op, divisor, stream);
  }
}

// Waits on the device until the host has published `target` in a mapped counter. One thread;
// the sleep keeps it off the memory system between polls.
__global__ void wait_counter_kernel(const volatile unsigned long long* counter,
                                    unsigned long long target) {
  while (*counter < target) __nanosleep(2000);
}

// Tells the host that the work before it on the stream is done (its copies to pinned memory
// included): a system-wide fence, then the store.
__global__ void set_flag_kernel(volatile unsigned long long* flag, unsigned long long value) {
  __threadfence_system();
  *flag = value;
  __threadfence_system();
}

}  // namespace

void reduce(void* dst, const void* a, const void* b, std::size_t n, DataType dtype, ReduceOp op,
            cudaStream_t stream) {
  dispatch(dst, a, b, n, dtype, op, 1, stream);
}

void reduce_final(void* dst, const void* a, const void* b, std::size_t n, DataType dtype,
                  ReduceOp op, int nranks, cudaStream_t stream) {
  if (nranks < 1) {
    throw Error(ErrorCode::kInvalidArgument,
                "cuda::reduce_final: nranks must be at least 1, got " + std::to_string(nranks));
  }
  dispatch(dst, a, b, n, dtype, op, op == ReduceOp::kAvg ? nranks : 1, stream);
}

void enqueue_set_flag(unsigned long long* device_flag, unsigned long long value,
                      cudaStream_t stream) {
  set_flag_kernel<<<1, 1, 0, stream>>>(device_flag, value);
  check(cudaGetLastError(), "launching the flag kernel");
}

void enqueue_wait_counter(const unsigned long long* device_counter, unsigned long long target,
                          cudaStream_t stream) {
  wait_counter_kernel<<<1, 1, 0, stream>>>(device_counter, target);
  check(cudaGetLastError(), "launching the stream-wait kernel");
}

}  // namespace dear::cuda
