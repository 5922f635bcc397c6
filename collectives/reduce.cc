// CPU reduction kernels: one switch on (dtype, op, aliasing) per call, then a plain loop that
// the compiler vectorises. The whole dispatcher is compiled twice (AVX2 and baseline x86-64)
// where the compiler can; the loader picks one per process, so the hot loops carry no per-call
// feature test. fp16 goes through the F16C instructions where the CPU has them.
//
// Float min/max are IEEE 754-2019 minimum/maximum (NaN-propagating, -0 < +0); see
// reduce_ops.h. Compile with -DDEAR_NO_TARGET_CLONES / -DDEAR_NO_F16C to test the portable
// paths on a machine that has AVX2 and F16C.
#include "collectives/reduce.h"

#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>

#include "common/reduce_ops.h"
#include "dear/error.h"

// Force the per-type loops into the cloned dispatcher: a loop compiled outside it would be
// built for baseline x86-64 only and the AVX2 clone would call that.
#if defined(__GNUC__) || defined(__clang__)
#define DEAR_ALWAYS_INLINE inline __attribute__((always_inline))
#else
#define DEAR_ALWAYS_INLINE inline
#endif

#if defined(__x86_64__) && defined(__has_attribute) && !defined(DEAR_NO_TARGET_CLONES)
#if __has_attribute(target_clones)
#define DEAR_TARGET_CLONES __attribute__((target_clones("avx2", "default")))
#endif
#endif
#ifndef DEAR_TARGET_CLONES
#define DEAR_TARGET_CLONES
#endif

// fp16 through the F16C conversion instructions when the CPU has them (checked at run time);
// the portable integer conversions otherwise. Both round to nearest-even, so results agree.
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) && !defined(DEAR_NO_F16C)
#define DEAR_F16C_PATH 1
#include <cpuid.h>
#include <immintrin.h>
#endif

namespace dear::collectives {
namespace {

// Which pointers are the same buffer. Each case gets its own loop whose pointers are all
// __restrict, so the compiler neither versions the loop nor falls back to scalar code when
// its run-time overlap check sees dst == a (clang's check treats exact aliasing as overlap).
enum class Alias : std::uint8_t { kNone, kDstIsA, kDstIsB, kAll };

Alias alias_of(const void* dst, const void* a, const void* b) {
  if (dst == a) return dst == b ? Alias::kAll : Alias::kDstIsA;
  if (dst == b) return Alias::kDstIsB;
  return Alias::kNone;
}

// dst[i] = store(fn(load(a[i]), load(b[i]))).
template <class E, class Fn>
DEAR_ALWAYS_INLINE void loop_none(typename E::Storage* __restrict dst,
                                  const typename E::Storage* __restrict a,
                                  const typename E::Storage* __restrict b, std::size_t n, Fn fn) {
  for (std::size_t i = 0; i < n; ++i) dst[i] = E::store(fn(E::load(a[i]), E::load(b[i])));
}

template <class E, class Fn>
DEAR_ALWAYS_INLINE void loop_dst_is_a(typename E::Storage* __restrict dst,
                                      const typename E::Storage* __restrict b, std::size_t n,
                                      Fn fn) {
  for (std::size_t i = 0; i < n; ++i) dst[i] = E::store(fn(E::load(dst[i]), E::load(b[i])));
}

template <class E, class Fn>
DEAR_ALWAYS_INLINE void loop_dst_is_b(typename E::Storage* __restrict dst,
                                      const typename E::Storage* __restrict a, std::size_t n,
                                      Fn fn) {
  for (std::size_t i = 0; i < n; ++i) dst[i] = E::store(fn(E::load(a[i]), E::load(dst[i])));
}

template <class E, class Fn>
DEAR_ALWAYS_INLINE void loop_all(typename E::Storage* dst, std::size_t n, Fn fn) {
  for (std::size_t i = 0; i < n; ++i) {
    const auto x = E::load(dst[i]);
    dst[i] = E::store(fn(x, x));
  }
}

#ifdef DEAR_F16C_PATH
bool cpu_has_f16c() {
  static const bool has = [] {
    // cpuid for F16C: clang's __builtin_cpu_supports does not know the name. The AVX2 test
    // also covers the operating system saving the AVX registers, which F16C needs too.
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    if (__get_cpuid(1, &eax, &ebx, &ecx, &edx) == 0) return false;
    __builtin_cpu_init();
    return (ecx & bit_F16C) != 0 && __builtin_cpu_supports("avx2");
  }();
  return has;
}

// The integer conversions cost about twenty instructions per element each way, which makes
// fp16 compute-bound at a fraction of memory speed; F16C converts eight per instruction.
// Blocks of 32: both inputs are converted into fp32 scratch (read completely before dst is
// written, so exact aliasing is safe), the operator runs as a plain fp32 loop that the
// compiler vectorises like the fp32 kernels, and the result is converted back.
template <class Fn>
__attribute__((target("avx2,f16c"))) void half_loop_f16c(std::uint16_t* dst, const std::uint16_t* a,
                                                         const std::uint16_t* b, std::size_t n,
                                                         Fn fn) {
  constexpr std::size_t kVectors = 4;
  constexpr std::size_t kBlock = 8 * kVectors;
  std::size_t i = 0;
  for (; i + kBlock <= n; i += kBlock) {
    alignas(32) float fa[kBlock];
    alignas(32) float fb[kBlock];
    // memcpy rather than a cast to __m128i*: any alignment, no aliasing question; it compiles
    // to one unaligned vector load or store.
    for (std::size_t v = 0; v < kVectors; ++v) {
      __m128i ha;
      __m128i hb;
      std::memcpy(&ha, a + i + 8 * v, sizeof ha);
      std::memcpy(&hb, b + i + 8 * v, sizeof hb);
      _mm256_store_ps(fa + 8 * v, _mm256_cvtph_ps(ha));
      _mm256_store_ps(fb + 8 * v, _mm256_cvtph_ps(hb));
    }
    for (std::size_t j = 0; j < kBlock; ++j) fa[j] = fn(fa[j], fb[j]);
    for (std::size_t v = 0; v < kVectors; ++v) {
      const __m128i hd = _mm256_cvtps_ph(_mm256_load_ps(fa + 8 * v), _MM_FROUND_TO_NEAREST_INT);
      std::memcpy(dst + i + 8 * v, &hd, sizeof hd);
    }
  }
  using E = Element<DataType::kFloat16>;
  for (; i < n; ++i) dst[i] = E::store(fn(E::load(a[i]), E::load(b[i])));
}
#endif

// bf16 two elements per 32-bit lane: widening is a shift or a mask and narrowing an or, so
// the loop never shuffles between 16- and 32-bit lanes (which GCC otherwise does several
// times per vector). Loads and stores go through memcpy: any alignment, no aliasing question.
template <class Fn>
DEAR_ALWAYS_INLINE std::uint32_t bf16_pair(std::uint32_t x, std::uint32_t y, Fn fn) {
  const float lo = fn(float_from_bits(x << 16), float_from_bits(y << 16));
  const float hi = fn(float_from_bits(x & 0xffff0000u), float_from_bits(y & 0xffff0000u));
  return (float_to_bf16_high(lo) >> 16) | (float_to_bf16_high(hi) & 0xffff0000u);
}

DEAR_ALWAYS_INLINE std::uint32_t load_pair(const std::uint16_t* p, std::size_t i) {
  std::uint32_t v;
  std::memcpy(&v, p + 2 * i, sizeof v);
  return v;
}

DEAR_ALWAYS_INLINE void store_pair(std::uint16_t* p, std::size_t i, std::uint32_t v) {
  std::memcpy(p + 2 * i, &v, sizeof v);
}

template <class Fn>
DEAR_ALWAYS_INLINE void bf16_pairs_none(std::uint16_t* __restrict dst,
                                        const std::uint16_t* __restrict a,
                                        const std::uint16_t* __restrict b, std::size_t pairs,
                                        Fn fn) {
  for (std::size_t i = 0; i < pairs; ++i) {
    store_pair(dst, i, bf16_pair(load_pair(a, i), load_pair(b, i), fn));
  }
}

template <class Fn>
DEAR_ALWAYS_INLINE void bf16_pairs_dst_is_a(std::uint16_t* __restrict dst,
                                            const std::uint16_t* __restrict b, std::size_t pairs,
                                            Fn fn) {
  for (std::size_t i = 0; i < pairs; ++i) {
    store_pair(dst, i, bf16_pair(load_pair(dst, i), load_pair(b, i), fn));
  }
}

template <class Fn>
DEAR_ALWAYS_INLINE void bf16_pairs_dst_is_b(std::uint16_t* __restrict dst,
                                            const std::uint16_t* __restrict a, std::size_t pairs,
                                            Fn fn) {
  for (std::size_t i = 0; i < pairs; ++i) {
    store_pair(dst, i, bf16_pair(load_pair(a, i), load_pair(dst, i), fn));
  }
}

template <class Fn>
DEAR_ALWAYS_INLINE void bf16_pairs_all(std::uint16_t* dst, std::size_t pairs, Fn fn) {
  for (std::size_t i = 0; i < pairs; ++i) {
    const std::uint32_t x = load_pair(dst, i);
    store_pair(dst, i, bf16_pair(x, x, fn));
  }
}

template <class Fn>
DEAR_ALWAYS_INLINE void bf16_binary(std::uint16_t* dst, const std::uint16_t* a,
                                    const std::uint16_t* b, std::size_t n, Alias alias, Fn fn) {
  const std::size_t pairs = n / 2;
  switch (alias) {
    case Alias::kNone: bf16_pairs_none(dst, a, b, pairs, fn); break;
    case Alias::kDstIsA: bf16_pairs_dst_is_a(dst, b, pairs, fn); break;
    case Alias::kDstIsB: bf16_pairs_dst_is_b(dst, a, pairs, fn); break;
    case Alias::kAll: bf16_pairs_all(dst, pairs, fn); break;
  }
  if (n % 2 != 0) {
    using E = Element<DataType::kBFloat16>;
    dst[n - 1] = E::store(fn(E::load(a[n - 1]), E::load(b[n - 1])));
  }
}

template <class E, class Fn>
DEAR_ALWAYS_INLINE void binary(void* dst, const void* a, const void* b, std::size_t n, Alias alias,
                               Fn fn) {
  using S = typename E::Storage;
  auto* d = static_cast<S*>(dst);
  const auto* pa = static_cast<const S*>(a);
  const auto* pb = static_cast<const S*>(b);
  if constexpr (std::is_same_v<E, Element<DataType::kBFloat16>>) {
    bf16_binary(d, pa, pb, n, alias, fn);
    return;
  }
#ifdef DEAR_F16C_PATH
  if constexpr (std::is_same_v<E, Element<DataType::kFloat16>>) {
    if (cpu_has_f16c()) {
      half_loop_f16c(d, pa, pb, n, fn);
      return;
    }
  }
#endif
  switch (alias) {
    case Alias::kNone: loop_none<E>(d, pa, pb, n, fn); return;
    case Alias::kDstIsA: loop_dst_is_a<E>(d, pb, n, fn); return;
    case Alias::kDstIsB: loop_dst_is_b<E>(d, pa, n, fn); return;
    case Alias::kAll: loop_all<E>(d, n, fn); return;
  }
}

// `divisor` > 1 only for the final step of kAvg; otherwise kAvg reduces as kSum.
template <DataType kType>
DEAR_ALWAYS_INLINE void reduce_typed(void* dst, const void* a, const void* b, std::size_t n,
                                     Alias alias, ReduceOp op, int divisor) {
  using E = Element<kType>;
  switch (op) {
    case ReduceOp::kAvg:
      if (divisor > 1) {
        binary<E>(dst, a, b, n, alias, AvgFinalOp<typename E::Compute>(divisor));
        return;
      }
      [[fallthrough]];
    case ReduceOp::kSum: binary<E>(dst, a, b, n, alias, SumOp{}); return;
    case ReduceOp::kProd: binary<E>(dst, a, b, n, alias, ProdOp{}); return;
    case ReduceOp::kMin: binary<E>(dst, a, b, n, alias, MinOp{}); return;
    case ReduceOp::kMax: binary<E>(dst, a, b, n, alias, MaxOp{}); return;
  }
}

DEAR_TARGET_CLONES
void reduce_dispatch(void* dst, const void* a, const void* b, std::size_t n, DataType dtype,
                     ReduceOp op, int divisor) {
  const Alias alias = alias_of(dst, a, b);
  switch (dtype) {
    case DataType::kInt8: return reduce_typed<DataType::kInt8>(dst, a, b, n, alias, op, divisor);
    case DataType::kUint8: return reduce_typed<DataType::kUint8>(dst, a, b, n, alias, op, divisor);
    case DataType::kInt32: return reduce_typed<DataType::kInt32>(dst, a, b, n, alias, op, divisor);
    case DataType::kInt64: return reduce_typed<DataType::kInt64>(dst, a, b, n, alias, op, divisor);
    case DataType::kFloat16:
      return reduce_typed<DataType::kFloat16>(dst, a, b, n, alias, op, divisor);
    case DataType::kBFloat16:
      return reduce_typed<DataType::kBFloat16>(dst, a, b, n, alias, op, divisor);
    case DataType::kFloat32:
      return reduce_typed<DataType::kFloat32>(dst, a, b, n, alias, op, divisor);
    case DataType::kFloat64:
      return reduce_typed<DataType::kFloat64>(dst, a, b, n, alias, op, divisor);
  }
}

// dst[i] = src[i] / divisor; dst == src or disjoint.
template <DataType kType>
DEAR_ALWAYS_INLINE void divide_typed(void* dst, const void* src, std::size_t n, int divisor) {
  using E = Element<kType>;
  using S = typename E::Storage;
  auto* d = static_cast<S*>(dst);
  const auto* s = static_cast<const S*>(src);
  const Divider<typename E::Compute> divide(divisor);
  const auto fn = [divide](typename E::Compute x, typename E::Compute) { return divide(x); };
  // The second operand is ignored; passing src twice keeps one loop shape.
  binary<E>(d, s, s, n, d == s ? Alias::kAll : Alias::kNone, fn);
}

DEAR_TARGET_CLONES
void divide_dispatch(void* dst, const void* src, std::size_t n, DataType dtype, int divisor) {
  switch (dtype) {
    case DataType::kInt8: return divide_typed<DataType::kInt8>(dst, src, n, divisor);
    case DataType::kUint8: return divide_typed<DataType::kUint8>(dst, src, n, divisor);
    case DataType::kInt32: return divide_typed<DataType::kInt32>(dst, src, n, divisor);
    case DataType::kInt64: return divide_typed<DataType::kInt64>(dst, src, n, divisor);
    case DataType::kFloat16: return divide_typed<DataType::kFloat16>(dst, src, n, divisor);
    case DataType::kBFloat16: return divide_typed<DataType::kBFloat16>(dst, src, n, divisor);
    case DataType::kFloat32: return divide_typed<DataType::kFloat32>(dst, src, n, divisor);
    case DataType::kFloat64: return divide_typed<DataType::kFloat64>(dst, src, n, divisor);
  }
}

void check_args(DataType dtype, ReduceOp op) {
  if (!is_valid(dtype)) {
    throw Error(ErrorCode::kInvalidArgument,
                "reduce: invalid dtype " + std::to_string(static_cast<int>(dtype)));
  }
  if (!is_valid(op)) {
    throw Error(ErrorCode::kInvalidArgument,
                "reduce: invalid op " + std::to_string(static_cast<int>(op)));
  }
}

void check_nranks(int nranks) {
  if (nranks < 1) {
    throw Error(ErrorCode::kInvalidArgument,
                "reduce: nranks must be at least 1, got " + std::to_string(nranks));
  }
}

}  // namespace

void reduce(void* dst, const void* a, const void* b, std::size_t n, DataType dtype, ReduceOp op) {
  check_args(dtype, op);
  if (n == 0) return;
  reduce_dispatch(dst, a, b, n, dtype, op, 1);
}

void reduce_final(void* dst, const void* a, const void* b, std::size_t n, DataType dtype,
                  ReduceOp op, int nranks) {
  check_args(dtype, op);
  check_nranks(nranks);
  if (n == 0) return;
  reduce_dispatch(dst, a, b, n, dtype, op, op == ReduceOp::kAvg ? nranks : 1);
}

void finish_single(void* dst, const void* src, std::size_t n, DataType dtype, ReduceOp op,
                   int nranks) {
  check_args(dtype, op);
  check_nranks(nranks);
  if (n == 0) return;
  if (op == ReduceOp::kAvg && nranks > 1) {
    divide_dispatch(dst, src, n, dtype, nranks);
  } else if (dst != src) {
    // A copy keeps every bit, NaN payloads included; exact aliasing needs nothing.
    std::memcpy(dst, src, n * dtype_size(dtype));
  }
}

}  // namespace dear::collectives
