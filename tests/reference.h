// Independent reference values for checking collectives element by element.
//
// Inputs are small integers, so that sums and products over up to 16 ranks are exact in every
// dtype (fp16 and bf16 included); results are decoded to double with code written here, apart
// from the library, and compared exactly for integer dtypes and within a few units of the
// dtype's rounding for floating ones (only avg is inexact).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "dear/types.h"

namespace dear::testing {

inline double input_value(int rank, std::size_t i, DataType t, ReduceOp op, int salt = 0) {
  const auto r = static_cast<std::size_t>(rank);
  const auto s = static_cast<std::size_t>(salt);
  if (op == ReduceOp::kProd) return ((r + i + s) % 3 == 0) ? 2.0 : 1.0;
  const int v = static_cast<int>((r * 7 + i * 13 + s * 5) % 9) - 4;  // -4..4
  return t == DataType::kUint8 ? v + 4 : v;
}

// fp16 bits of a value that fp16 represents exactly (small integers here).
inline std::uint16_t exact_half_bits(double v) {
  if (v == 0) return std::signbit(v) ? 0x8000 : 0;
  const std::uint16_t sign = v < 0 ? 0x8000 : 0;
  int e = 0;
  const double m = std::frexp(std::fabs(v), &e);  // v = m * 2^e, m in [0.5, 1)
  const auto mant = static_cast<std::uint16_t>(std::lround((m * 2 - 1) * 1024));
  return static_cast<std::uint16_t>(sign | ((e - 1 + 15) << 10) | mant);
}

inline double half_bits_value(std::uint16_t b) {
  const int sign = (b >> 15) ? -1 : 1;
  const int e = (b >> 10) & 0x1f;
  const int m = b & 0x3ff;
  if (e == 0x1f) return m ? NAN : sign * INFINITY;
  if (e == 0) return sign * std::ldexp(m, -24);
  return sign * std::ldexp(1024 + m, e - 25);
}

inline double bf16_bits_value(std::uint16_t b) {
  const std::uint32_t u = static_cast<std::uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

inline std::uint16_t exact_bf16_bits(double v) {
  const auto f = static_cast<float>(v);
  std::uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return static_cast<std::uint16_t>(u >> 16);  // exact for small integers
}

inline void store(void* buf, std::size_t i, DataType t, double v) {
  auto* p = static_cast<char*>(buf);
  switch (t) {
    case DataType::kInt8: {
      auto x = static_cast<std::int8_t>(v);
      std::memcpy(p + i, &x, 1);
      break;
    }
    case DataType::kUint8: {
      auto x = static_cast<std::uint8_t>(v);
      std::memcpy(p + i, &x, 1);
      break;
    }
    case DataType::kInt32: {
      auto x = static_cast<std::int32_t>(v);
      std::memcpy(p + 4 * i, &x, 4);
      break;
    }
    case DataType::kInt64: {
      auto x = static_cast<std::int64_t>(v);
      std::memcpy(p + 8 * i, &x, 8);
      break;
    }
    case DataType::kFloat16: {
      auto x = exact_half_bits(v);
      std::memcpy(p + 2 * i, &x, 2);
      break;
    }
    case DataType::kBFloat16: {
      auto x = exact_bf16_bits(v);
      std::memcpy(p + 2 * i, &x, 2);
      break;
    }
    case DataType::kFloat32: {
      auto x = static_cast<float>(v);
      std::memcpy(p + 4 * i, &x, 4);
      break;
    }
    case DataType::kFloat64: std::memcpy(p + 8 * i, &v, 8); break;
  }
}

inline double load(const void* buf, std::size_t i, DataType t) {
  const auto* p = static_cast<const char*>(buf);
  switch (t) {
    case DataType::kInt8: {
      std::int8_t x;
      std::memcpy(&x, p + i, 1);
      return x;
    }
    case DataType::kUint8: {
      std::uint8_t x;
      std::memcpy(&x, p + i, 1);
      return x;
    }
    case DataType::kInt32: {
      std::int32_t x;
      std::memcpy(&x, p + 4 * i, 4);
      return x;
    }
    case DataType::kInt64: {
      std::int64_t x;
      std::memcpy(&x, p + 8 * i, 8);
      return static_cast<double>(x);
    }
    case DataType::kFloat16: {
      std::uint16_t x;
      std::memcpy(&x, p + 2 * i, 2);
      return half_bits_value(x);
    }
    case DataType::kBFloat16: {
      std::uint16_t x;
      std::memcpy(&x, p + 2 * i, 2);
      return bf16_bits_value(x);
    }
    case DataType::kFloat32: {
      float x;
      std::memcpy(&x, p + 4 * i, 4);
      return x;
    }
    case DataType::kFloat64: {
      double x;
      std::memcpy(&x, p + 8 * i, 8);
      return x;
    }
  }
  return NAN;
}

// Wraps an exact integer result to the dtype's width, as two's complement hardware does.
inline double wrap(double v, DataType t) {
  const auto x = static_cast<std::int64_t>(v);
  switch (t) {
    case DataType::kInt8: return static_cast<std::int8_t>(static_cast<std::uint8_t>(x & 0xff));
    case DataType::kUint8: return static_cast<std::uint8_t>(x & 0xff);
    case DataType::kInt32: return static_cast<std::int32_t>(static_cast<std::uint32_t>(x));
    default: return v;
  }
}

// Expected element i of the reduction over `nranks` ranks' inputs.
inline double expected_reduce(std::size_t i, int nranks, DataType t, ReduceOp op, int salt = 0) {
  double acc = input_value(0, i, t, op, salt);
  for (int r = 1; r < nranks; ++r) {
    const double v = input_value(r, i, t, op, salt);
    switch (op) {
      case ReduceOp::kSum:
      case ReduceOp::kAvg: acc += v; break;
      case ReduceOp::kProd: acc *= v; break;
      case ReduceOp::kMin: acc = std::min(acc, v); break;
      case ReduceOp::kMax: acc = std::max(acc, v); break;
    }
  }
  if (!is_floating(t)) {
    acc = wrap(acc, t);
    if (op == ReduceOp::kAvg) acc = std::trunc(acc / nranks);
    return acc;
  }
  if (op == ReduceOp::kAvg) acc /= nranks;
  return acc;
}

inline bool close_enough(double got, double want, DataType t) {
  if (!is_floating(t)) return got == want;
  double tol = 0;
  switch (t) {
    case DataType::kFloat16: tol = 2e-3; break;
    case DataType::kBFloat16: tol = 1.6e-2; break;
    case DataType::kFloat32: tol = 1e-6; break;
    default: tol = 1e-12; break;
  }
  return std::fabs(got - want) <= tol * std::max(1.0, std::fabs(want));
}

// Counts mismatches and describes the first.
struct Mismatches {
  std::size_t count = 0;
  std::string first;
  void add(std::size_t i, double got, double want) {
    if (count++ == 0) {
      first = "element " + std::to_string(i) + ": got " + std::to_string(got) + ", want " +
              std::to_string(want);
    }
  }
};

// Mismatches of an all_reduce result over `count` elements of inputs made by input_value().
inline Mismatches check_all_reduce(const void* out, std::size_t count, int nranks, DataType t,
                                   ReduceOp op, int salt = 0) {
  Mismatches bad;
  for (std::size_t i = 0; i < count; ++i) {
    const double want = expected_reduce(i, nranks, t, op, salt);
    const double got = load(out, i, t);
    if (!close_enough(got, want, t)) bad.add(i, got, want);
  }
  return bad;
}

// A rank's input of `count` elements made by input_value() (at least one byte, so that data()
// is never null).
inline std::vector<char> make_input(int rank, std::size_t count, DataType t, ReduceOp op,
                                    int salt = 0) {
  std::vector<char> buf(std::max<std::size_t>(1, count * dtype_size(t)));
  for (std::size_t i = 0; i < count; ++i)
    store(buf.data(), i, t, input_value(rank, i, t, op, salt));
  return buf;
}

// One rank's all_gather buffers: `out` for `count` elements from each of `nranks` ranks
// (filled with 0x5a), and `in`, the rank's input made by make_input(): its own buffer, or in
// place the rank's block of `out`, which then holds that input.
struct AllGatherBuffers {
  std::vector<char> own;
  std::vector<char> out;
  const char* in = nullptr;
};
inline AllGatherBuffers all_gather_buffers(int rank, std::size_t count, std::size_t nranks,
                                           DataType t, bool in_place, int salt) {
  AllGatherBuffers b;
  const std::size_t el = dtype_size(t);
  b.out.assign(std::max<std::size_t>(1, count * nranks * el), 0x5a);
  b.own = make_input(rank, count, t, ReduceOp::kSum, salt);
  b.in = b.own.data();
  if (in_place) {
    char* block = b.out.data() + static_cast<std::size_t>(rank) * count * el;
    std::memcpy(block, b.own.data(), count * el);
    b.in = block;
  }
  return b;
}

// Mismatches of an all_gather result: block `src` holds rank src's make_input(..., salt).
inline Mismatches check_all_gather(const void* out, std::size_t count, int nranks, DataType t,
                                   int salt) {
  Mismatches bad;
  for (int src = 0; src < nranks; ++src) {
    for (std::size_t i = 0; i < count; ++i) {
      const std::size_t at = static_cast<std::size_t>(src) * count + i;
      const double want = input_value(src, i, t, ReduceOp::kSum, salt);
      const double got = load(out, at, t);
      if (got != want) bad.add(at, got, want);
    }
  }
  return bad;
}

}  // namespace dear::testing
