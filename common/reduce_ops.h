// Element-wise reduction operators and the fp16/bf16 <-> fp32 conversions they compute through.
//
// One header for host and device code, so that a CPU ring and a GPU kernel produce the same
// bits for the same inputs. Everything here is branch-free straight-line code (selects, not
// ifs) on plain integers and floats, so a compiler can turn a loop over it into SIMD code.
//
// Contract:
// - fp16 and bf16 are stored as their uint16_t bit patterns. They are computed in fp32 and
//   rounded back to nearest, ties to even. Conversions to fp32 are exact for every pattern
//   (subnormals, +-0, +-Inf included); a NaN stays a NaN of the same sign.
// - Integer sums and products wrap modulo 2^bits: computed in an unsigned type, never UB.
// - Floating min/max follow IEEE 754-2019 minimum/maximum: a NaN operand gives a NaN, and -0
//   orders below +0. Both operands are treated alike, so the result does not depend on which
//   rank's value came first in a ring.
// - kAvg is not an operator here: it reduces as SumOp and the caller divides once at the end.
#pragma once

#include <bit>
#include <cstdint>
#include <type_traits>

#include "dear/types.h"

#ifndef DEAR_HOST_DEVICE
#ifdef __CUDACC__
#define DEAR_HOST_DEVICE __host__ __device__
#else
#define DEAR_HOST_DEVICE
#endif
#endif

namespace dear {

// ---- bit views -------------------------------------------------------------------------------

DEAR_HOST_DEVICE inline std::uint32_t to_bits(float f) {
#ifdef __CUDA_ARCH__
  return __float_as_uint(f);
#else
  return std::bit_cast<std::uint32_t>(f);
#endif
}

DEAR_HOST_DEVICE inline std::uint64_t to_bits(double f) {
#ifdef __CUDA_ARCH__
  return static_cast<std::uint64_t>(__double_as_longlong(f));
#else
  return std::bit_cast<std::uint64_t>(f);
#endif
}

DEAR_HOST_DEVICE inline float float_from_bits(std::uint32_t u) {
#ifdef __CUDA_ARCH__
  return __uint_as_float(u);
#else
  return std::bit_cast<float>(u);
#endif
}

DEAR_HOST_DEVICE inline double double_from_bits(std::uint64_t u) {
#ifdef __CUDA_ARCH__
  return __longlong_as_double(static_cast<long long>(u));
#else
  return std::bit_cast<double>(u);
#endif
}

DEAR_HOST_DEVICE inline float from_bits(std::uint32_t u) { return float_from_bits(u); }
DEAR_HOST_DEVICE inline double from_bits(std::uint64_t u) { return double_from_bits(u); }

// c ? x : y without a branch. With a plain ?: the compiler sinks the floating-point arithmetic
// that feeds only one side into a branch, and then (under the default -ftrapping-math) will not
// execute it unconditionally again, which stops vectorisation of the conversions below.
DEAR_HOST_DEVICE inline std::uint32_t select_bits(bool c, std::uint32_t x, std::uint32_t y) {
  const std::uint32_t mask = 0u - static_cast<std::uint32_t>(c);
  return (x & mask) | (y & ~mask);
}

// ---- fp16 ------------------------------------------------------------------------------------

// Exact for all 65536 patterns.
DEAR_HOST_DEVICE inline float half_to_float(std::uint16_t h) {
  const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
  // Exponent and mantissa moved to their fp32 positions; the exponent is still biased by 15.
  const std::uint32_t shifted = static_cast<std::uint32_t>(h & 0x7fffu) << 13;
  const std::uint32_t exponent = shifted & 0x0f800000u;
  std::uint32_t normal = shifted + ((127u - 15u) << 23);
  // Inf and NaN need the all-ones fp32 exponent; the mantissa (a NaN's payload) carries over.
  normal = exponent == 0x0f800000u ? normal + ((128u - 16u) << 23) : normal;
  // A zero or subnormal is m * 2^-24. Writing m under the exponent of 2^-14 gives the normal
  // number 2^-14 * (1 + m/1024); subtracting 2^-14 leaves m * 2^-24 exactly, with no need for
  // a leading-zero count (which SSE2/AVX2 lack).
  const float two_m14 = float_from_bits(113u << 23);
  const float subnormal = float_from_bits(shifted + (113u << 23)) - two_m14;
  const std::uint32_t magnitude = select_bits(exponent == 0, to_bits(subnormal), normal);
  return float_from_bits(magnitude | sign);
}

// Round to nearest, ties to even; overflow gives Inf, NaN gives a quiet NaN that keeps the sign
// and the top of the payload (as F16C's vcvtps2ph does).
DEAR_HOST_DEVICE inline std::uint16_t float_to_half(float f) {
  const std::uint32_t bits = to_bits(f);
  const std::uint32_t sign = (bits >> 16) & 0x8000u;
  const std::uint32_t abs = bits & 0x7fffffffu;
  // Normal results: rebias, then round away the low 13 mantissa bits. Adding 0xfff plus the
  // lowest kept bit carries exactly when rounding to nearest-even goes up; a carry out of the
  // mantissa correctly bumps the exponent, up to Inf for values in [65520, 65536).
  // Wraps (harmlessly, unsigned) for inputs the selects below discard.
  const std::uint32_t normal = (abs - ((127u - 15u) << 23) + 0xfffu + ((abs >> 13) & 1u)) >> 13;
  // Subnormal results (|f| < 2^-14): in 0.5 + |f| the fp32 mantissa's unit is 2^-24, the unit
  // of an fp16 subnormal, so the FPU's own nearest-even addition does the rounding and the
  // difference of the bit patterns is the fp16 pattern (0x400 when it rounds up to 2^-14).
  // An fp32 subnormal input that a flush-to-zero mode reads as 0 rounds to 0 either way.
  const float half_one = 0.5f;
  const std::uint32_t subnormal = to_bits(float_from_bits(abs) + half_one) - to_bits(half_one);
  std::uint32_t magnitude = select_bits(abs < (113u << 23), subnormal, normal);
  magnitude = select_bits(abs >= (143u << 23), 0x7c00u, magnitude);  // |f| >= 65536: Inf
  magnitude = select_bits(abs > 0x7f800000u, 0x7e00u | ((abs >> 13) & 0x3ffu), magnitude);  // NaN
  return static_cast<std::uint16_t>(magnitude | sign);
}

// ---- bf16 ------------------------------------------------------------------------------------

// Exact: bf16 is the top half of an fp32.
DEAR_HOST_DEVICE inline float bf16_to_float(std::uint16_t b) {
  return float_from_bits(static_cast<std::uint32_t>(b) << 16);
}

// Round to nearest, ties to even (a carry into the exponent is correct, up to Inf); NaN gives a
// quiet NaN with the sign and top of the payload, never the Inf that rounding its bits could.
// The bf16 pattern is returned in the top 16 bits (the low 16 are garbage), which lets a kernel
// keep two bf16 results in one 32-bit lane without narrowing.
DEAR_HOST_DEVICE inline std::uint32_t float_to_bf16_high(float f) {
  const std::uint32_t bits = to_bits(f);
  const bool is_nan = (bits & 0x7fffffffu) > 0x7f800000u;
  const std::uint32_t nan_mask = 0u - static_cast<std::uint32_t>(is_nan);
  // A NaN is truncated, not rounded, and gets the quiet bit so it cannot become Inf.
  const std::uint32_t increment = (0x7fffu + ((bits >> 16) & 1u)) & ~nan_mask;
  return (bits + increment) | (nan_mask & 0x00400000u);
}

DEAR_HOST_DEVICE inline std::uint16_t float_to_bf16(float f) {
  return static_cast<std::uint16_t>(float_to_bf16_high(f) >> 16);
}

// ---- elements: how a DataType is stored and computed -----------------------------------------

// Element<t>::Storage is the type in memory, Compute the type an operator sees; load/store
// convert between them (identity except for fp16/bf16).
template <DataType kType>
struct Element;

template <class T>
struct PlainElement {
  using Storage = T;
  using Compute = T;
  DEAR_HOST_DEVICE static Compute load(Storage v) { return v; }
  DEAR_HOST_DEVICE static Storage store(Compute v) { return v; }
};

template <>
struct Element<DataType::kInt8> : PlainElement<std::int8_t> {};
template <>
struct Element<DataType::kUint8> : PlainElement<std::uint8_t> {};
template <>
struct Element<DataType::kInt32> : PlainElement<std::int32_t> {};
template <>
struct Element<DataType::kInt64> : PlainElement<std::int64_t> {};
template <>
struct Element<DataType::kFloat32> : PlainElement<float> {};
template <>
struct Element<DataType::kFloat64> : PlainElement<double> {};

template <>
struct Element<DataType::kFloat16> {
  using Storage = std::uint16_t;
  using Compute = float;
  // On the device, the hardware's conversions (PTX cvt: exact, and round to nearest even with
  // subnormals kept), which give the same bits as the ones above for every non-NaN value; the
  // bit arithmetic above costs the kernels about a third of their bandwidth.
  DEAR_HOST_DEVICE static Compute load(Storage v) {
#ifdef __CUDA_ARCH__
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(v));
    return f;
#else
    return half_to_float(v);
#endif
  }
  DEAR_HOST_DEVICE static Storage store(Compute v) {
#ifdef __CUDA_ARCH__
    Storage h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(v));
    return h;
#else
    return float_to_half(v);
#endif
  }
};

template <>
struct Element<DataType::kBFloat16> {
  using Storage = std::uint16_t;
  using Compute = float;
  DEAR_HOST_DEVICE static Compute load(Storage v) { return bf16_to_float(v); }
  DEAR_HOST_DEVICE static Storage store(Compute v) { return float_to_bf16(v); }
};

// ---- operators on compute types --------------------------------------------------------------

namespace detail {
// The unsigned type integer arithmetic wraps in. At least `unsigned int`, so that uint8_t and
// uint16_t operands are not promoted to a signed int whose product could overflow.
template <class T>
using WrapType = decltype(std::make_unsigned_t<T>{} + 0u);
}  // namespace detail

struct SumOp {
  template <class T>
  DEAR_HOST_DEVICE T operator()(T a, T b) const {
    if constexpr (std::is_integral_v<T>) {
      using W = detail::WrapType<T>;
      return static_cast<T>(static_cast<W>(static_cast<W>(a) + static_cast<W>(b)));
    } else {
      return a + b;
    }
  }
};

struct ProdOp {
  template <class T>
  DEAR_HOST_DEVICE T operator()(T a, T b) const {
    if constexpr (std::is_integral_v<T>) {
      using W = detail::WrapType<T>;
      return static_cast<T>(static_cast<W>(static_cast<W>(a) * static_cast<W>(b)));
    } else {
      return a * b;
    }
  }
};

struct MinOp {
  template <class T>
  DEAR_HOST_DEVICE T operator()(T a, T b) const {
    if constexpr (std::is_integral_v<T>) {
      return b < a ? b : a;
    } else {
      T r = a < b ? a : b;  // b when unordered, so a NaN in b is already there
      // Equal values have equal bits except for +0 == -0; or-ing the bits picks -0.
      r = a == b ? from_bits(to_bits(a) | to_bits(b)) : r;
      return a != a ? a : r;  // NaN in a
    }
  }
};

struct MaxOp {
  template <class T>
  DEAR_HOST_DEVICE T operator()(T a, T b) const {
    if constexpr (std::is_integral_v<T>) {
      return a < b ? b : a;
    } else {
      T r = a > b ? a : b;  // b when unordered, so a NaN in b is already there
      // Equal values have equal bits except for +0 == -0; and-ing the bits picks +0.
      r = a == b ? from_bits(to_bits(a) & to_bits(b)) : r;
      return a != a ? a : r;  // NaN in a
    }
  }
};

// 128-bit arithmetic for the 64-bit divider (a GCC and Clang extension that nvcc has too).
__extension__ typedef unsigned __int128 Uint128;

// x / divisor for the final step of kAvg: truncating for integers, in the compute type for
// floats (so fp32 for fp16/bf16, rounded once on store). Made once per kernel call (host
// code), applied per element on the host or the device; exact, so both give the same bits.
//
// Integers: on a GPU a division instruction is a long software sequence (for 64 bits, dozens
// of instructions with branches; for 8 and 32 bits here a double division), so the device
// divides by a multiply and shifts (by_multiply): Granlund and Montgomery's unsigned division
// by an invariant integer ("Division by invariant integers using multiplication", 1994,
// figure 4.1), exact for every N-bit dividend and divisor 1 <= d < 2^N: with
// l = ceil(log2 d) and m = floor(2^N (2^l - d) / d) + 1, t = mulhi(m, n) and
// n / d = (t + ((n - t) >> min(l, 1))) >> max(l - 1, 0). A signed dividend divides its
// magnitude (truncation is towards zero), which fits the unsigned type even for the most
// negative value; 8- and 32-bit types work in 32 bits, 64-bit ones in 64. The CPU keeps what
// measured faster there (reduce-bench, kAvg's last step on 3 ranks: int8 4.8 against 3.9 GB/s,
// int32 19 against 17, int64 7.7 against 4.6 at 1 MiB): for 8 and 32 bits a division in double,
// which vectorises (x / d in double is within 2^-53 relative of the true quotient, and a
// non-integer quotient of |x| < 2^53 is at least 1/d away from an integer, so truncating it
// gives the exact quotient), for 64 bits the division instruction.
template <class T, bool kInteger = std::is_integral_v<T>>
class Divider {
 public:
  explicit Divider(int divisor) : divisor_(static_cast<T>(divisor)) {}
  DEAR_HOST_DEVICE T operator()(T x) const { return x / divisor_; }

 private:
  T divisor_;
};

template <class T>
class Divider<T, true> {
  using U = std::conditional_t<(sizeof(T) <= 4), std::uint32_t, std::uint64_t>;
  static constexpr int kBits = sizeof(U) * 8;

 public:
  // `divisor` >= 1 (the caller checks it).
  explicit Divider(int divisor) : divisor_(divisor) {
    const auto d = static_cast<U>(divisor);
    int l = 0;
    while (l < kBits && (U{1} << l) < d) ++l;
    // 2^N (2^l - d) / d in twice the width; l <= 31 here, as d < 2^31.
    using Wide = std::conditional_t<(kBits == 32), std::uint64_t, Uint128>;
    const Wide num = (Wide{1} << kBits) * ((Wide{1} << l) - Wide{d});
    magic_ = static_cast<U>(num / Wide{d} + 1);
    shift1_ = l < 1 ? l : 1;
    shift2_ = l > 1 ? l - 1 : 0;
  }
  DEAR_HOST_DEVICE T operator()(T x) const {
#ifdef __CUDA_ARCH__
    return by_multiply(x);
#else
    if constexpr (sizeof(T) <= 4) {
      return static_cast<T>(static_cast<double>(x) / static_cast<double>(divisor_));
    } else {
      return static_cast<T>(x / static_cast<T>(divisor_));
    }
#endif
  }
  // The device's way, public so that the CPU tests check it against the compiler's division.
  DEAR_HOST_DEVICE T by_multiply(T x) const {
    if constexpr (std::is_signed_v<T>) {
      const bool negative = x < 0;
      const U n = negative ? U{0} - static_cast<U>(x) : static_cast<U>(x);
      const U q = divide(n);
      return static_cast<T>(negative ? U{0} - q : q);
    } else {
      return static_cast<T>(divide(static_cast<U>(x)));
    }
  }

 private:
  DEAR_HOST_DEVICE U divide(U n) const {
    const U t = mulhi(magic_, n);
    return (t + ((n - t) >> shift1_)) >> shift2_;
  }
  DEAR_HOST_DEVICE static U mulhi(U a, U b) {
    if constexpr (kBits == 32) {
#ifdef __CUDA_ARCH__
      return __umulhi(a, b);
#else
      return static_cast<U>((std::uint64_t{a} * b) >> 32);
#endif
    } else {
#ifdef __CUDA_ARCH__
      return __umul64hi(a, b);
#else
      return static_cast<U>((static_cast<Uint128>(a) * b) >> 64);
#endif
    }
  }

  int divisor_;
  U magic_ = 0;
  int shift1_ = 0;
  int shift2_ = 0;
};

// The final step of kAvg: the wrapped or rounded sum, divided once in the compute type. The
// GPU kernels use it as is; the CPU kernels compute the same expression.
template <class T>
struct AvgFinalOp {
  explicit AvgFinalOp(int divisor) : divide(divisor) {}
  Divider<T> divide;
  DEAR_HOST_DEVICE T operator()(T a, T b) const { return divide(SumOp{}(a, b)); }
};

}  // namespace dear
