// Tests of the CPU reduction kernels against a scalar reference that shares no code with them.
//
// The reference decodes fp16/bf16 with ldexp and encodes by searching a sorted table of every
// representable value, does integer arithmetic in int64 with explicit wrapping, and floating
// arithmetic in double, rounded to fp32 where the kernels compute in fp32. Rounding a double
// result to fp32 equals a single fp32 rounding here because 53 >= 2 * 24 + 2 (double rounding
// is innocuous for +, *, / at that precision); the same holds for fp32 -> fp16 (24 >= 2*11+2).
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <ostream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "collectives/reduce.h"
#include "common/reduce_ops.h"
#include "dear/error.h"
#include "dear/types.h"

namespace dear {
// Readable parameter values in gtest's failure messages.
void PrintTo(DataType t, std::ostream* os) { *os << to_string(t); }
void PrintTo(ReduceOp op, std::ostream* os) { *os << to_string(op); }
}  // namespace dear

namespace dear::collectives {
namespace {

constexpr std::array<DataType, kNumDataTypes> kAllTypes = {
    DataType::kInt8,    DataType::kUint8,    DataType::kInt32,   DataType::kInt64,
    DataType::kFloat16, DataType::kBFloat16, DataType::kFloat32, DataType::kFloat64};
constexpr std::array<ReduceOp, kNumReduceOps> kAllOps = {
    ReduceOp::kSum, ReduceOp::kProd, ReduceOp::kMin, ReduceOp::kMax, ReduceOp::kAvg};
constexpr std::array<std::size_t, 6> kSizes = {0, 1, 7, 31, 1000, 4099};

// ---- reference fp16 / bf16 -------------------------------------------------------------------

// Small float formats described by their field widths, decoded by arithmetic on the fields.
struct SmallFormat {
  int mantissa_bits;
  int exponent_bits;
  int bias() const { return (1 << (exponent_bits - 1)) - 1; }
  std::uint16_t inf_bits() const {
    return static_cast<std::uint16_t>(((1u << exponent_bits) - 1u) << mantissa_bits);
  }
  std::uint16_t sign_bit() const {
    return static_cast<std::uint16_t>(1u << (mantissa_bits + exponent_bits));
  }
};
constexpr SmallFormat kHalf{10, 5};
constexpr SmallFormat kBf16{7, 8};

double ref_decode(SmallFormat fmt, std::uint16_t bits) {
  const int e = (bits >> fmt.mantissa_bits) & ((1 << fmt.exponent_bits) - 1);
  const int m = bits & ((1 << fmt.mantissa_bits) - 1);
  const bool negative = (bits & fmt.sign_bit()) != 0;
  double magnitude;
  if (e == (1 << fmt.exponent_bits) - 1) {
    magnitude =
        m != 0 ? std::numeric_limits<double>::quiet_NaN() : std::numeric_limits<double>::infinity();
  } else if (e == 0) {
    magnitude = std::ldexp(static_cast<double>(m), 1 - fmt.bias() - fmt.mantissa_bits);
  } else {
    magnitude = std::ldexp(static_cast<double>((1 << fmt.mantissa_bits) + m),
                           e - fmt.bias() - fmt.mantissa_bits);
  }
  return negative ? -magnitude : magnitude;
}

// Every non-negative finite value in pattern order (which is value order), followed by the
// value Inf stands in for when rounding: the next step of the top binade, so that ties and
// overflow are decided like any other pair of neighbours.
std::vector<double> make_table(SmallFormat fmt) {
  std::vector<double> table;
  for (std::uint32_t b = 0; b < fmt.inf_bits(); ++b) {
    table.push_back(ref_decode(fmt, static_cast<std::uint16_t>(b)));
  }
  const double top = table.back();
  const double step = top - table[table.size() - 2];
  table.push_back(top + step);
  return table;
}

const std::vector<double>& table_of(SmallFormat fmt) {
  static const std::vector<double> half = make_table(kHalf);
  static const std::vector<double> bf16 = make_table(kBf16);
  return fmt.exponent_bits == kHalf.exponent_bits ? half : bf16;
}

// Round to nearest, ties to even pattern; NaN -> the quiet NaN pattern.
std::uint16_t ref_encode(SmallFormat fmt, double x) {
  const std::uint16_t sign = std::signbit(x) ? fmt.sign_bit() : std::uint16_t{0};
  if (std::isnan(x)) {
    return static_cast<std::uint16_t>(fmt.inf_bits() | (1u << (fmt.mantissa_bits - 1)));
  }
  const double mag = std::fabs(x);
  const std::vector<double>& table = table_of(fmt);
  if (mag >= table.back()) return static_cast<std::uint16_t>(sign | fmt.inf_bits());
  // hi: first value > mag; lo: the one below. table[0] == 0 <= mag, so hi >= 1.
  const auto hi =
      static_cast<std::size_t>(std::upper_bound(table.begin(), table.end(), mag) - table.begin());
  const std::size_t lo = hi - 1;
  const double below = mag - table[lo];
  const double above = table[hi] - mag;
  std::size_t pick;
  if (below < above) {
    pick = lo;
  } else if (above < below) {
    pick = hi;
  } else {
    pick = (lo % 2 == 0) ? lo : hi;
  }
  return static_cast<std::uint16_t>(sign | pick);
}

bool is_nan_bits(SmallFormat fmt, std::uint16_t bits) {
  const std::uint16_t abs = static_cast<std::uint16_t>(bits & ~fmt.sign_bit());
  return abs > fmt.inf_bits();
}

std::string hex(std::uint64_t v) {
  std::ostringstream os;
  os << "0x" << std::hex << v;
  return os.str();
}

// ---- conversions -----------------------------------------------------------------------------

void check_to_float(SmallFormat fmt, float (*convert)(std::uint16_t)) {
  int failures = 0;
  for (std::uint32_t b = 0; b <= 0xffff; ++b) {
    const auto bits = static_cast<std::uint16_t>(b);
    const double want = ref_decode(fmt, bits);
    const float got = convert(bits);
    const bool ok = std::isnan(want) ? std::isnan(got) && std::signbit(got) == std::signbit(want)
                                     : static_cast<double>(got) == want &&
                                           std::signbit(got) == std::signbit(want);
    if (!ok && ++failures <= 5) {
      ADD_FAILURE() << "pattern " << hex(b) << ": got " << static_cast<double>(got) << ", want "
                    << want;
    }
  }
  EXPECT_EQ(failures, 0);
}

TEST(ReduceConversions, HalfToFloatAllPatterns) { check_to_float(kHalf, half_to_float); }
TEST(ReduceConversions, Bf16ToFloatAllPatterns) { check_to_float(kBf16, bf16_to_float); }

// Every pattern survives a round trip; a NaN comes back as a quiet NaN of the same sign.
void check_round_trip(SmallFormat fmt, float (*to_float)(std::uint16_t),
                      std::uint16_t (*from_float)(float)) {
  int failures = 0;
  const auto quiet = static_cast<std::uint16_t>(1u << (fmt.mantissa_bits - 1));
  for (std::uint32_t b = 0; b <= 0xffff; ++b) {
    const auto bits = static_cast<std::uint16_t>(b);
    const std::uint16_t got = from_float(to_float(bits));
    const bool ok = is_nan_bits(fmt, bits) ? is_nan_bits(fmt, got) && (got & quiet) != 0 &&
                                                 (got & fmt.sign_bit()) == (bits & fmt.sign_bit())
                                           : got == bits;
    if (!ok && ++failures <= 5) {
      ADD_FAILURE() << "pattern " << hex(b) << " came back as " << hex(got);
    }
  }
  EXPECT_EQ(failures, 0);
}

TEST(ReduceConversions, HalfRoundTrip) { check_round_trip(kHalf, half_to_float, float_to_half); }
TEST(ReduceConversions, Bf16RoundTrip) { check_round_trip(kBf16, bf16_to_float, float_to_bf16); }

// fp32 inputs that stress fp16 rounding: every fp16 value, every midpoint between neighbours
// (the ties) and the fp32 values just either side of it, fp32 subnormals, values beyond the
// fp16 range, and random bit patterns; each with both signs.
std::vector<float> half_rounding_inputs() {
  std::vector<float> in;
  const std::vector<double>& table = table_of(kHalf);
  for (std::size_t i = 0; i + 1 < table.size(); ++i) {
    const auto value = static_cast<float>(table[i]);
    const auto mid = static_cast<float>((table[i] + table[i + 1]) / 2);  // exact in fp32
    const float inf = std::numeric_limits<float>::infinity();
    for (float v : {value, mid, std::nextafter(mid, 0.0f), std::nextafter(mid, inf),
                    std::nextafter(value, inf)}) {
      in.push_back(v);
    }
  }
  for (float v : {std::numeric_limits<float>::denorm_min(), std::numeric_limits<float>::min(),
                  std::numeric_limits<float>::max(), std::numeric_limits<float>::infinity(),
                  65504.0f, 65519.996f, 65520.0f, 65535.0f, 65536.0f, 1e10f, 0x1p-25f, 0x1.8p-25f,
                  0x1.000002p-25f, 0x1p-26f, 0x1.fffffep-15f}) {
    in.push_back(v);
  }
  std::mt19937 rng(1234);
  for (int i = 0; i < 200000; ++i) {
    in.push_back(std::bit_cast<float>(static_cast<std::uint32_t>(rng())));
  }
  const std::size_t positive = in.size();
  for (std::size_t i = 0; i < positive; ++i) in.push_back(-in[i]);
  return in;
}

TEST(ReduceConversions, FloatToHalfRounding) {
  int failures = 0;
  for (float f : half_rounding_inputs()) {
    const std::uint16_t got = float_to_half(f);
    const std::uint16_t want = ref_encode(kHalf, static_cast<double>(f));
    const bool ok = std::isnan(f) ? is_nan_bits(kHalf, got) : got == want;
    if (!ok && ++failures <= 5) {
      ADD_FAILURE() << "fp32 " << hex(std::bit_cast<std::uint32_t>(f)) << ": got " << hex(got)
                    << ", want " << hex(want);
    }
  }
  EXPECT_EQ(failures, 0);
}

// Hand-written answers, so that a mistake shared by the kernel and the reference table shows.
TEST(ReduceConversions, FloatToHalfTies) {
  EXPECT_EQ(float_to_half(1.0f + 0x1p-11f), 0x3c00);             // tie, even is below
  EXPECT_EQ(float_to_half(1.0f + 3 * 0x1p-11f), 0x3c02);         // tie, even is above
  EXPECT_EQ(float_to_half(1.0f + 0x1p-11f + 0x1p-20f), 0x3c01);  // just above the tie
  EXPECT_EQ(float_to_half(-(1.0f + 0x1p-11f)), 0xbc00);
  EXPECT_EQ(float_to_half(2049.0f), 0x6800);  // 2048 + half an ulp of 2
  EXPECT_EQ(float_to_half(2051.0f), 0x6802);
  EXPECT_EQ(float_to_half(65504.0f), 0x7bff);  // largest finite
  EXPECT_EQ(float_to_half(65519.996f), 0x7bff);
  EXPECT_EQ(float_to_half(65520.0f), 0x7c00);  // tie with the would-be 65536
  EXPECT_EQ(float_to_half(0x1p-24f), 0x0001);  // smallest subnormal
  EXPECT_EQ(float_to_half(0x1p-25f), 0x0000);  // tie, even is zero
  EXPECT_EQ(float_to_half(-0x1p-25f), 0x8000);
  EXPECT_EQ(float_to_half(0x1.000002p-25f), 0x0001);
  EXPECT_EQ(float_to_half(0x1.8p-24f), 0x0002);    // 1.5 units: tie, even is 2
  EXPECT_EQ(float_to_half(0x1.4p-23f), 0x0002);    // 2.5 units: tie, even is 2
  EXPECT_EQ(float_to_half(0x1.ffcp-15f), 0x0400);  // rounds up into the normals
  EXPECT_EQ(float_to_half(0.0f), 0x0000);
  EXPECT_EQ(float_to_half(-0.0f), 0x8000);
  EXPECT_EQ(float_to_half(std::numeric_limits<float>::infinity()), 0x7c00);
  EXPECT_EQ(float_to_half(-std::numeric_limits<float>::infinity()), 0xfc00);
  EXPECT_TRUE(is_nan_bits(kHalf, float_to_half(std::numeric_limits<float>::quiet_NaN())));
  EXPECT_TRUE(is_nan_bits(kHalf, float_to_half(std::bit_cast<float>(0x7f800001u))));
}

TEST(ReduceConversions, FloatToBf16Rounding) {
  // For every bf16 pattern, the fp32 values whose dropped half is 0, 1, just below, at and just
  // above the tie, and all ones.
  int failures = 0;
  for (std::uint32_t hi = 0; hi <= 0xffff; ++hi) {
    for (std::uint32_t lo : {0x0000u, 0x0001u, 0x7fffu, 0x8000u, 0x8001u, 0xffffu}) {
      const float f = std::bit_cast<float>((hi << 16) | lo);
      const std::uint16_t got = float_to_bf16(f);
      const std::uint16_t want = ref_encode(kBf16, static_cast<double>(f));
      const bool ok = std::isnan(f) ? is_nan_bits(kBf16, got) : got == want;
      if (!ok && ++failures <= 5) {
        ADD_FAILURE() << "fp32 " << hex((hi << 16) | lo) << ": got " << hex(got) << ", want "
                      << hex(want);
      }
    }
  }
  EXPECT_EQ(failures, 0);
}

TEST(ReduceConversions, FloatToBf16Ties) {
  EXPECT_EQ(float_to_bf16(std::bit_cast<float>(0x3f808000u)), 0x3f80);  // tie, even below
  EXPECT_EQ(float_to_bf16(std::bit_cast<float>(0x3f818000u)), 0x3f82);  // tie, even above
  EXPECT_EQ(float_to_bf16(std::bit_cast<float>(0x3f808001u)), 0x3f81);
  EXPECT_EQ(float_to_bf16(std::numeric_limits<float>::max()), 0x7f80);  // rounds to Inf
  EXPECT_EQ(float_to_bf16(std::bit_cast<float>(0x00008000u)), 0x0000);  // subnormal tie
  EXPECT_EQ(float_to_bf16(std::bit_cast<float>(0x00018000u)), 0x0002);
  // A NaN whose payload lies only in the dropped half must not become Inf.
  EXPECT_TRUE(is_nan_bits(kBf16, float_to_bf16(std::bit_cast<float>(0x7f800001u))));
  EXPECT_TRUE(is_nan_bits(kBf16, float_to_bf16(std::bit_cast<float>(0xff800001u))));
}

// A second, compiler-provided reference where the compiler has one.
TEST(ReduceConversions, HalfAgreesWithCompilerFloat16) {
#if defined(__FLT16_MAX__) && !defined(__clang__)
  int failures = 0;
  for (std::uint32_t b = 0; b <= 0xffff; ++b) {
    const auto bits = static_cast<std::uint16_t>(b);
    _Float16 h;
    std::memcpy(&h, &bits, sizeof h);
    const auto want = static_cast<float>(h);
    const float got = half_to_float(bits);
    const bool ok = std::isnan(want)
                        ? std::isnan(got)
                        : std::bit_cast<std::uint32_t>(got) == std::bit_cast<std::uint32_t>(want);
    if (!ok && ++failures <= 5) ADD_FAILURE() << "half_to_float " << hex(b);
  }
  for (float f : half_rounding_inputs()) {
    if (std::isnan(f)) continue;
    const auto h = static_cast<_Float16>(f);
    std::uint16_t want;
    std::memcpy(&want, &h, sizeof want);
    if (float_to_half(f) != want && ++failures <= 5) {
      ADD_FAILURE() << "float_to_half " << hex(std::bit_cast<std::uint32_t>(f));
    }
  }
  EXPECT_EQ(failures, 0);
#else
  GTEST_SKIP() << "this compiler has no _Float16 arithmetic";
#endif
}

// ---- reference reductions --------------------------------------------------------------------

// One element, decoded: `i` for integer types, `f` for floating ones.
struct Value {
  std::int64_t i = 0;
  double f = 0;
};

bool is_signed_int(DataType t) {
  return t == DataType::kInt8 || t == DataType::kInt32 || t == DataType::kInt64;
}

std::uint64_t get_bits(const std::byte* p, std::size_t index, std::size_t width) {
  std::uint64_t v = 0;
  for (std::size_t k = 0; k < width; ++k) {
    v |= static_cast<std::uint64_t>(p[index * width + k]) << (8 * k);  // little endian
  }
  return v;
}

void put_bits(std::byte* p, std::size_t index, std::size_t width, std::uint64_t v) {
  for (std::size_t k = 0; k < width; ++k) {
    p[index * width + k] = static_cast<std::byte>((v >> (8 * k)) & 0xffu);
  }
}

// The two's-complement value of the low `width` bytes of u, by arithmetic.
std::int64_t wrap(DataType t, std::uint64_t u) {
  const int bits = static_cast<int>(8 * dtype_size(t));
  if (bits == 64) {
    if (u <= static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max())) {
      return static_cast<std::int64_t>(u);
    }
    return -static_cast<std::int64_t>(~u) - 1;
  }
  const std::uint64_t modulus = std::uint64_t{1} << bits;
  u %= modulus;
  if (is_signed_int(t) && u >= modulus / 2) {
    return static_cast<std::int64_t>(u) - static_cast<std::int64_t>(modulus);
  }
  return static_cast<std::int64_t>(u);
}

Value decode(DataType t, std::uint64_t bits) {
  Value v;
  switch (t) {
    case DataType::kInt8:
    case DataType::kUint8:
    case DataType::kInt32:
    case DataType::kInt64: v.i = wrap(t, bits); break;
    case DataType::kFloat16: v.f = ref_decode(kHalf, static_cast<std::uint16_t>(bits)); break;
    case DataType::kBFloat16: v.f = ref_decode(kBf16, static_cast<std::uint16_t>(bits)); break;
    case DataType::kFloat32:
      v.f = static_cast<double>(std::bit_cast<float>(static_cast<std::uint32_t>(bits)));
      break;
    case DataType::kFloat64: v.f = std::bit_cast<double>(bits); break;
  }
  return v;
}

// `v.f` must already be exact in fp32 for the fp32-computed types.
std::uint64_t encode(DataType t, Value v) {
  switch (t) {
    case DataType::kFloat16: return ref_encode(kHalf, v.f);
    case DataType::kBFloat16: return ref_encode(kBf16, v.f);
    case DataType::kFloat32: return std::bit_cast<std::uint32_t>(static_cast<float>(v.f));
    case DataType::kFloat64: return std::bit_cast<std::uint64_t>(v.f);
    default:
      return static_cast<std::uint64_t>(v.i) &
             (dtype_size(t) == 8 ? ~std::uint64_t{0}
                                 : (std::uint64_t{1} << (8 * dtype_size(t))) - 1);
  }
}

bool is_nan_result(DataType t, std::uint64_t bits) {
  switch (t) {
    case DataType::kFloat16: return is_nan_bits(kHalf, static_cast<std::uint16_t>(bits));
    case DataType::kBFloat16: return is_nan_bits(kBf16, static_cast<std::uint16_t>(bits));
    case DataType::kFloat32:
      return std::isnan(std::bit_cast<float>(static_cast<std::uint32_t>(bits)));
    case DataType::kFloat64: return std::isnan(std::bit_cast<double>(bits));
    default: return false;
  }
}

// IEEE 754-2019 minimum/maximum: NaN wins, -0 < +0.
double ref_min(double x, double y) {
  if (std::isnan(x) || std::isnan(y)) return std::numeric_limits<double>::quiet_NaN();
  if (x == y) return (std::signbit(x) || std::signbit(y)) ? -std::fabs(x) : x;
  return x < y ? x : y;
}

double ref_max(double x, double y) {
  if (std::isnan(x) || std::isnan(y)) return std::numeric_limits<double>::quiet_NaN();
  if (x == y) return (std::signbit(x) && std::signbit(y)) ? x : std::fabs(x);
  return x < y ? y : x;
}

// Rounds to fp32 unless the type computes in fp64.
double round_compute(DataType t, double x) {
  return t == DataType::kFloat64 ? x : static_cast<double>(static_cast<float>(x));
}

// x op y, then divided by `divisor` when it is not 1 (kAvg's final step).
Value ref_combine(DataType t, ReduceOp op, Value x, Value y, int divisor) {
  Value r;
  if (!is_floating(t)) {
    const auto ux = static_cast<std::uint64_t>(x.i);
    const auto uy = static_cast<std::uint64_t>(y.i);
    switch (op) {
      case ReduceOp::kSum:
      case ReduceOp::kAvg: r.i = wrap(t, ux + uy); break;
      case ReduceOp::kProd: r.i = wrap(t, ux * uy); break;
      case ReduceOp::kMin: r.i = std::min(x.i, y.i); break;
      case ReduceOp::kMax: r.i = std::max(x.i, y.i); break;
    }
    if (op == ReduceOp::kAvg) r.i /= divisor;
    return r;
  }
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kAvg: r.f = round_compute(t, x.f + y.f); break;
    case ReduceOp::kProd: r.f = round_compute(t, x.f * y.f); break;
    case ReduceOp::kMin: r.f = ref_min(x.f, y.f); break;
    case ReduceOp::kMax: r.f = ref_max(x.f, y.f); break;
  }
  if (op == ReduceOp::kAvg && divisor != 1) r.f = round_compute(t, r.f / divisor);
  return r;
}

// ---- inputs ----------------------------------------------------------------------------------

// Random elements of type t: mostly moderate values, plus every special the type has (both
// zeros, infinities, NaNs, subnormals, extremes) and arbitrary bit patterns.
std::vector<std::byte> make_input(DataType t, std::size_t n, std::mt19937_64& rng) {
  const std::size_t width = dtype_size(t);
  std::vector<std::byte> out(n * width);
  std::uniform_real_distribution<double> moderate(-100.0, 100.0);
  for (std::size_t i = 0; i < n; ++i) {
    const std::uint64_t raw = rng();
    const int kind = static_cast<int>(rng() % 10);  // 0: special, 1-2: raw bits, else moderate
    std::uint64_t bits = raw;
    if (!is_floating(t)) {
      if (kind == 0) {
        const std::int64_t specials[] = {0, 1, -1, 2, -2};
        bits = static_cast<std::uint64_t>(specials[raw % 5]);
        if (raw % 7 == 0) bits = ~std::uint64_t{0} >> (64 - 8 * width + 1);  // max signed
        if (raw % 11 == 0) bits = std::uint64_t{1} << (8 * width - 1);       // min signed
      } else if (kind >= 3) {
        bits = static_cast<std::uint64_t>(static_cast<std::int64_t>(moderate(rng)));
      }
    } else if (kind == 0) {
      const double specials[] = {0.0,
                                 -0.0,
                                 std::numeric_limits<double>::infinity(),
                                 -std::numeric_limits<double>::infinity(),
                                 std::numeric_limits<double>::quiet_NaN(),
                                 1.0,
                                 -1.0,
                                 1e-300,
                                 65504.0,
                                 3.4e38};
      Value v;
      v.f = specials[raw % 10];
      if (t == DataType::kFloat64) {
        bits = std::bit_cast<std::uint64_t>(v.f);
      } else if (t == DataType::kFloat32) {
        bits = std::bit_cast<std::uint32_t>(static_cast<float>(v.f));
      } else {
        bits = encode(t, v);
      }
      if (raw % 13 == 0) bits = 1;  // smallest subnormal
    } else if (kind >= 3) {
      Value v;
      v.f = moderate(rng);
      if (t == DataType::kFloat64) {
        bits = std::bit_cast<std::uint64_t>(v.f);
      } else {
        v.f = static_cast<double>(static_cast<float>(v.f));
        bits = t == DataType::kFloat32 ? std::bit_cast<std::uint32_t>(static_cast<float>(v.f))
                                       : encode(t, v);
      }
    }
    put_bits(out.data(), i, width, bits);
  }
  return out;
}

// ---- the kernels against the reference -------------------------------------------------------

enum class Layout { kSeparate, kDstIsA, kDstIsB, kInputsShared, kAllShared };
constexpr std::array<Layout, 5> kAllLayouts = {Layout::kSeparate, Layout::kDstIsA, Layout::kDstIsB,
                                               Layout::kInputsShared, Layout::kAllShared};

const char* layout_name(Layout l) {
  switch (l) {
    case Layout::kSeparate: return "separate";
    case Layout::kDstIsA: return "dst==a";
    case Layout::kDstIsB: return "dst==b";
    case Layout::kInputsShared: return "a==b";
    case Layout::kAllShared: return "dst==a==b";
  }
  return "?";
}

constexpr std::byte kGuard{0xa5};
constexpr std::size_t kGuardElems = 9;

// One buffer holding n elements at element offset `offset`, with guard bytes around them so
// that writes outside [0, n) are caught.
struct Buffer {
  Buffer(std::size_t width, std::size_t n, std::size_t offset)
      : width_(width), offset_(offset), bytes_((n + offset + kGuardElems) * width, kGuard) {}
  std::byte* data() { return bytes_.data() + offset_ * width_; }
  void fill(const std::vector<std::byte>& v) { std::copy(v.begin(), v.end(), data()); }
  bool guards_intact(std::size_t n) const {
    for (std::size_t k = 0; k < bytes_.size(); ++k) {
      const bool inside = k >= offset_ * width_ && k < (offset_ + n) * width_;
      if (!inside && bytes_[k] != kGuard) return false;
    }
    return true;
  }
  std::size_t width_;
  std::size_t offset_;
  std::vector<std::byte> bytes_;
};

// Calls reduce (divisor 0) or reduce_final (divisor = nranks) with the given aliasing and
// checks every element and the guards.
void run_case(DataType t, ReduceOp op, std::size_t n, Layout layout, std::size_t offset, int nranks,
              std::mt19937_64& rng) {
  SCOPED_TRACE(testing::Message() << to_string(t) << " " << to_string(op) << " n=" << n << " "
                                  << layout_name(layout) << " offset=" << offset
                                  << (nranks > 0 ? " final nranks=" : " partial")
                                  << (nranks > 0 ? std::to_string(nranks) : ""));
  const std::size_t width = dtype_size(t);
  const std::vector<std::byte> in_a = make_input(t, n, rng);
  const bool shared_inputs = layout == Layout::kInputsShared || layout == Layout::kAllShared;
  const std::vector<std::byte> in_b = shared_inputs ? in_a : make_input(t, n, rng);

  Buffer a(width, n, offset);
  Buffer b(width, n, offset + 1);  // a different alignment than a
  Buffer d(width, n, 0);
  a.fill(in_a);
  b.fill(in_b);
  std::byte* pa = a.data();
  std::byte* pb = b.data();
  std::byte* pd = d.data();
  Buffer* out = &d;
  switch (layout) {
    case Layout::kSeparate: break;
    case Layout::kDstIsA:
      pd = pa;
      out = &a;
      break;
    case Layout::kDstIsB:
      pd = pb;
      out = &b;
      break;
    case Layout::kInputsShared: pb = pa; break;
    case Layout::kAllShared:
      pb = pa;
      pd = pa;
      out = &a;
      break;
  }
  if (nranks > 0) {
    reduce_final(pd, pa, pb, n, t, op, nranks);
  } else {
    reduce(pd, pa, pb, n, t, op);
  }

  int failures = 0;
  for (std::size_t i = 0; i < n; ++i) {
    const Value x = decode(t, get_bits(in_a.data(), i, width));
    const Value y = decode(t, get_bits(in_b.data(), i, width));
    const Value want = ref_combine(t, op, x, y, nranks > 0 ? nranks : 1);
    const std::uint64_t got = get_bits(pd, i, width);
    const bool want_nan = is_floating(t) && std::isnan(want.f);
    const std::uint64_t want_bits = encode(t, want);
    const bool ok = want_nan ? is_nan_result(t, got) : got == want_bits;
    if (!ok && ++failures <= 5) {
      ADD_FAILURE() << "element " << i << ": " << hex(get_bits(in_a.data(), i, width)) << " "
                    << to_string(op) << " " << hex(get_bits(in_b.data(), i, width)) << " gave "
                    << hex(got) << ", want " << (want_nan ? "NaN" : hex(want_bits));
    }
  }
  EXPECT_EQ(failures, 0);
  EXPECT_TRUE(out->guards_intact(n)) << "wrote outside the n elements";
  if (out != &a) {
    EXPECT_TRUE(std::equal(in_a.begin(), in_a.end(), a.data())) << "input a changed";
  }
  if (out != &b && !shared_inputs) {
    EXPECT_TRUE(std::equal(in_b.begin(), in_b.end(), b.data())) << "input b changed";
  }
}

class ReduceKernel : public testing::TestWithParam<std::tuple<DataType, ReduceOp>> {};

TEST_P(ReduceKernel, MatchesReference) {
  const auto [t, op] = GetParam();
  std::mt19937_64 rng(static_cast<std::uint64_t>(t) * 131 + static_cast<std::uint64_t>(op));
  for (std::size_t n : kSizes) {
    for (Layout layout : kAllLayouts) {
      for (std::size_t offset : {std::size_t{0}, std::size_t{1}}) {
        run_case(t, op, n, layout, offset, 0, rng);
        // The final step: the same for every op but kAvg, which divides.
        for (int nranks : {1, 3}) run_case(t, op, n, layout, offset, nranks, rng);
        if (op == ReduceOp::kAvg) {
          for (int nranks : {2, 7, 300}) run_case(t, op, n, layout, offset, nranks, rng);
        }
      }
    }
  }
}

TEST_P(ReduceKernel, FinishSingle) {
  const auto [t, op] = GetParam();
  const std::size_t width = dtype_size(t);
  std::mt19937_64 rng(99 + static_cast<std::uint64_t>(t) * 7 + static_cast<std::uint64_t>(op));
  for (std::size_t n : kSizes) {
    for (int nranks : {1, 2, 3, 300}) {
      for (bool in_place : {false, true}) {
        SCOPED_TRACE(testing::Message() << to_string(t) << " " << to_string(op) << " n=" << n
                                        << " nranks=" << nranks << " in_place=" << in_place);
        const std::vector<std::byte> in = make_input(t, n, rng);
        Buffer src(width, n, 1);
        Buffer dst(width, n, 0);
        src.fill(in);
        std::byte* out = in_place ? src.data() : dst.data();
        finish_single(out, src.data(), n, t, op, nranks);
        int failures = 0;
        for (std::size_t i = 0; i < n; ++i) {
          const std::uint64_t in_bits = get_bits(in.data(), i, width);
          const std::uint64_t got = get_bits(out, i, width);
          bool ok;
          std::uint64_t want_bits = in_bits;
          if (op == ReduceOp::kAvg && nranks > 1) {
            Value v = decode(t, in_bits);
            if (is_floating(t)) {
              v.f = round_compute(t, v.f / nranks);
            } else {
              v.i /= nranks;
            }
            want_bits = encode(t, v);
            ok = is_floating(t) && std::isnan(v.f) ? is_nan_result(t, got) : got == want_bits;
          } else {
            ok = got == in_bits;  // a copy keeps every bit, NaN payloads included
          }
          if (!ok && ++failures <= 5) {
            ADD_FAILURE() << "element " << i << ": " << hex(in_bits) << " gave " << hex(got)
                          << ", want " << hex(want_bits);
          }
        }
        EXPECT_EQ(failures, 0);
        EXPECT_TRUE((in_place ? src : dst).guards_intact(n));
      }
    }
  }
}

TEST_P(ReduceKernel, ZeroCountAcceptsNullPointers) {
  const auto [t, op] = GetParam();
  EXPECT_NO_THROW(reduce(nullptr, nullptr, nullptr, 0, t, op));
  EXPECT_NO_THROW(reduce_final(nullptr, nullptr, nullptr, 0, t, op, 4));
  EXPECT_NO_THROW(finish_single(nullptr, nullptr, 0, t, op, 4));
}

std::string param_name(const testing::TestParamInfo<ReduceKernel::ParamType>& info) {
  return std::string(to_string(std::get<0>(info.param))) + "_" +
         std::string(to_string(std::get<1>(info.param)));
}

INSTANTIATE_TEST_SUITE_P(AllTypesAndOps, ReduceKernel,
                         testing::Combine(testing::ValuesIn(kAllTypes), testing::ValuesIn(kAllOps)),
                         param_name);

// ---- known answers ---------------------------------------------------------------------------

template <class T>
T reduce_one(T a, T b, DataType t, ReduceOp op) {
  T out{};
  reduce(&out, &a, &b, 1, t, op);
  return out;
}

TEST(ReduceKnownAnswers, IntegersWrap) {
  EXPECT_EQ(reduce_one<std::int8_t>(127, 1, DataType::kInt8, ReduceOp::kSum), -128);
  EXPECT_EQ(reduce_one<std::int8_t>(-128, -1, DataType::kInt8, ReduceOp::kSum), 127);
  EXPECT_EQ(reduce_one<std::int8_t>(16, 8, DataType::kInt8, ReduceOp::kProd), -128);
  EXPECT_EQ(reduce_one<std::uint8_t>(200, 100, DataType::kUint8, ReduceOp::kSum), 44);
  EXPECT_EQ(reduce_one<std::uint8_t>(255, 255, DataType::kUint8, ReduceOp::kProd), 1);
  EXPECT_EQ(reduce_one<std::int32_t>(65536, 65536, DataType::kInt32, ReduceOp::kProd), 0);
  EXPECT_EQ(reduce_one<std::int32_t>(std::numeric_limits<std::int32_t>::max(), 1, DataType::kInt32,
                                     ReduceOp::kSum),
            std::numeric_limits<std::int32_t>::min());
  EXPECT_EQ(reduce_one<std::int64_t>(std::numeric_limits<std::int64_t>::min(), -1, DataType::kInt64,
                                     ReduceOp::kProd),
            std::numeric_limits<std::int64_t>::min());
  EXPECT_EQ(reduce_one<std::int8_t>(-5, 3, DataType::kInt8, ReduceOp::kMin), -5);
  EXPECT_EQ(reduce_one<std::uint8_t>(250, 3, DataType::kUint8, ReduceOp::kMax), 250);
}

TEST(ReduceKnownAnswers, AverageTruncatesIntegers) {
  std::int32_t a[2] = {7, -7};
  std::int32_t b[2] = {0, 0};
  std::int32_t out[2];
  reduce_final(out, a, b, 2, DataType::kInt32, ReduceOp::kAvg, 2);
  EXPECT_EQ(out[0], 3);
  EXPECT_EQ(out[1], -3);
  std::int8_t c = 100, d = 100, e = 0;  // the wrapped sum -56, then divided
  reduce_final(&e, &c, &d, 1, DataType::kInt8, ReduceOp::kAvg, 2);
  EXPECT_EQ(e, -28);
}

// Divider (kAvg's last step) against the compiler's division, the host's way and the device's
// (by_multiply): every dividend of the 8-bit types for divisors 1-1100 and a spread of large
// ones, and for 32 and 64 bits the edges (the most negative value, multiples of the divisor and
// their neighbours) and random dividends.
template <class T>
void check_divider_exhaustive(int d) {
  const Divider<T> divide(d);
  for (int x = std::numeric_limits<T>::min(); x <= std::numeric_limits<T>::max(); ++x) {
    const auto v = static_cast<T>(x);
    ASSERT_EQ(divide(v), static_cast<T>(x / d)) << "x=" << x << " d=" << d;
    ASSERT_EQ(divide.by_multiply(v), static_cast<T>(x / d)) << "x=" << x << " d=" << d;
  }
}

template <class T>
void check_divider_sampled(int d, std::mt19937_64& rng) {
  const Divider<T> divide(d);
  using L = std::numeric_limits<T>;
  std::vector<T> xs = {L::min(), static_cast<T>(L::min() + 1), -1, 0, 1,
                       L::max(), static_cast<T>(L::max() - 1)};
  const T dd = static_cast<T>(d);
  // k * d - 1, k * d, k * d + 1 and their negatives, wrapping where they pass the type's ends.
  using U = std::make_unsigned_t<T>;
  for (const T k : {T{1}, T{2}, T{1000}, static_cast<T>(L::max() / dd)}) {
    const U kd = static_cast<U>(static_cast<U>(k) * static_cast<U>(dd));
    for (const U off : {U{0} - U{1}, U{0}, U{1}}) {
      xs.push_back(static_cast<T>(static_cast<U>(kd + off)));
      xs.push_back(static_cast<T>(static_cast<U>(U{0} - kd + off)));
    }
  }
  for (int i = 0; i < 2000; ++i) xs.push_back(static_cast<T>(rng()));
  for (int i = 0; i < 200; ++i) xs.push_back(static_cast<T>(static_cast<int>(rng() % 4096) - 2048));
  for (const T x : xs) {
    ASSERT_EQ(divide(x), static_cast<T>(x / dd)) << "x=" << x << " d=" << d;
    ASSERT_EQ(divide.by_multiply(x), static_cast<T>(x / dd)) << "x=" << x << " d=" << d;
  }
}

std::vector<int> divider_divisors() {
  std::vector<int> ds;
  for (int d = 1; d <= 1100; ++d) ds.push_back(d);
  for (int b = 11; b < 31; ++b) {
    for (const int off : {-1, 0, 1}) ds.push_back((1 << b) + off);
  }
  ds.push_back(std::numeric_limits<int>::max());
  ds.push_back(1000003);
  ds.push_back(123456789);
  return ds;
}

TEST(ReduceDivider, EightBitTypesEveryDividend) {
  for (const int d : divider_divisors()) {
    check_divider_exhaustive<std::int8_t>(d);
    check_divider_exhaustive<std::uint8_t>(d);
  }
}

TEST(ReduceDivider, WideTypesEdgesAndRandomDividends) {
  std::mt19937_64 rng(7);
  for (const int d : divider_divisors()) {
    check_divider_sampled<std::int32_t>(d, rng);
    check_divider_sampled<std::int64_t>(d, rng);
  }
}

TEST(ReduceDivider, FloatsDivideAsTheCompilerDoes) {
  std::mt19937_64 rng(11);
  std::uniform_real_distribution<double> value(-1e6, 1e6);
  for (const int d : {1, 2, 3, 7, 10, 1000, 65537}) {
    const Divider<float> f(d);
    const Divider<double> g(d);
    for (int i = 0; i < 1000; ++i) {
      const double x = value(rng);
      ASSERT_EQ(f(static_cast<float>(x)), static_cast<float>(x) / static_cast<float>(d));
      ASSERT_EQ(g(x), x / static_cast<double>(d));
    }
  }
}

TEST(ReduceKnownAnswers, HalfSumRoundsOnceToEven) {
  using H = std::uint16_t;
  EXPECT_EQ(reduce_one<H>(0x3c00, 0x1000, DataType::kFloat16, ReduceOp::kSum), 0x3c00);  // tie
  EXPECT_EQ(reduce_one<H>(0x3c01, 0x1000, DataType::kFloat16, ReduceOp::kSum), 0x3c02);  // tie
  EXPECT_EQ(reduce_one<H>(0x7bff, 0x7bff, DataType::kFloat16, ReduceOp::kSum), 0x7c00);  // Inf
  EXPECT_EQ(reduce_one<H>(0x0001, 0x8001, DataType::kFloat16, ReduceOp::kSum), 0x0000);
  EXPECT_TRUE(
      is_nan_bits(kHalf, reduce_one<H>(0x7c00, 0xfc00, DataType::kFloat16, ReduceOp::kSum)));
  // avg over 3 ranks of 1 and 2^-12: the sum stays in fp32 (1 + 2^-12) and is divided there,
  // giving 0x3556; rounding the sum to fp16 first (1.0) would give 0x3555.
  H out = 0;
  const H a = 0x3c00, b = 0x0c00;
  reduce_final(&out, &a, &b, 1, DataType::kFloat16, ReduceOp::kAvg, 3);
  EXPECT_EQ(out, 0x3556);
  EXPECT_EQ(reduce_one<H>(0x3f80, 0x3b80, DataType::kBFloat16, ReduceOp::kSum), 0x3f80);
  EXPECT_EQ(reduce_one<H>(0x3f81, 0x3b80, DataType::kBFloat16, ReduceOp::kSum), 0x3f82);
}

TEST(ReduceKnownAnswers, FloatMinMaxIgnoreOperandOrder) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (auto [x, y] : {std::pair{-0.0f, 0.0f}, std::pair{0.0f, -0.0f}}) {
    EXPECT_TRUE(std::signbit(reduce_one(x, y, DataType::kFloat32, ReduceOp::kMin)));
    EXPECT_FALSE(std::signbit(reduce_one(x, y, DataType::kFloat32, ReduceOp::kMax)));
  }
  for (auto [x, y] : {std::pair{nan, 1.0f}, std::pair{1.0f, nan}}) {
    EXPECT_TRUE(std::isnan(reduce_one(x, y, DataType::kFloat32, ReduceOp::kMin)));
    EXPECT_TRUE(std::isnan(reduce_one(x, y, DataType::kFloat32, ReduceOp::kMax)));
  }
  EXPECT_EQ(reduce_one(-2.0, 3.0, DataType::kFloat64, ReduceOp::kMax), 3.0);
  EXPECT_EQ(reduce_one(-2.0, 3.0, DataType::kFloat64, ReduceOp::kMin), -2.0);
}

TEST(ReduceArguments, InvalidValuesThrow) {
  float x = 1.0f;
  EXPECT_THROW(reduce(&x, &x, &x, 1, static_cast<DataType>(99), ReduceOp::kSum), Error);
  EXPECT_THROW(reduce(&x, &x, &x, 1, DataType::kFloat32, static_cast<ReduceOp>(99)), Error);
  EXPECT_THROW(reduce_final(&x, &x, &x, 1, DataType::kFloat32, ReduceOp::kAvg, 0), Error);
  EXPECT_THROW(finish_single(&x, &x, 1, DataType::kFloat32, ReduceOp::kAvg, -1), Error);
  EXPECT_EQ(x, 1.0f);
}

}  // namespace
}  // namespace dear::collectives
