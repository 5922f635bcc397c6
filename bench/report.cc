#include "report.h"

#include <CLI/CLI.hpp>
#include <algorithm>
#include <bit>
#include <cctype>
#include <cmath>
#include <cstring>
#include <fstream>
#include <functional>
#include <limits>
#include <sstream>
#include <stdexcept>
#include <utility>

#include "common/env.h"
#include "dear/error.h"

namespace dear::bench {
namespace {

// ---- element conversions --------------------------------------------------------------------

std::uint16_t float_to_half(float f) noexcept {
  const std::uint32_t x = std::bit_cast<std::uint32_t>(f);
  const auto sign = static_cast<std::uint16_t>((x >> 16) & 0x8000U);
  const std::uint32_t exp = (x >> 23) & 0xffU;
  std::uint32_t mant = x & 0x7fffffU;
  if (exp == 0xffU) {
    return static_cast<std::uint16_t>(sign | 0x7c00U | (mant != 0 ? 0x200U : 0U));
  }
  const int e = static_cast<int>(exp) - 127 + 15;
  if (e >= 31) return static_cast<std::uint16_t>(sign | 0x7c00U);
  if (e <= 0) {
    // Subnormal half: value = h x 2^-24.
    if (e < -10) return sign;
    mant |= 0x800000U;
    const int shift = 14 - e;
    std::uint32_t h = mant >> shift;
    const std::uint32_t rem = mant & ((1U << shift) - 1U);
    const std::uint32_t halfway = 1U << (shift - 1);
    if (rem > halfway || (rem == halfway && (h & 1U) != 0)) ++h;
    return static_cast<std::uint16_t>(sign | h);
  }
  std::uint32_t h = (static_cast<std::uint32_t>(e) << 10) | (mant >> 13);
  const std::uint32_t rem = mant & 0x1fffU;
  // A carry out of the mantissa correctly bumps the exponent (up to infinity).
  if (rem > 0x1000U || (rem == 0x1000U && (h & 1U) != 0)) ++h;
  return static_cast<std::uint16_t>(sign | h);
}

float half_to_float(std::uint16_t h) noexcept {
  const std::uint32_t sign = (static_cast<std::uint32_t>(h) & 0x8000U) << 16;
  const std::uint32_t exp = (h >> 10) & 0x1fU;
  const std::uint32_t mant = h & 0x3ffU;
  if (exp == 0) {
    const float v = std::ldexp(static_cast<float>(mant), -24);
    return sign != 0 ? -v : v;
  }
  const std::uint32_t bits = exp == 31 ? (sign | 0x7f800000U | (mant << 13))
                                       : (sign | ((exp + 112U) << 23) | (mant << 13));
  return std::bit_cast<float>(bits);
}

std::uint16_t float_to_bf16(float f) noexcept {
  const std::uint32_t x = std::bit_cast<std::uint32_t>(f);
  if (std::isnan(f)) return static_cast<std::uint16_t>((x >> 16) | 0x40U);
  const std::uint32_t rounded = x + 0x7fffU + ((x >> 16) & 1U);
  return static_cast<std::uint16_t>(rounded >> 16);
}

float bf16_to_float(std::uint16_t b) noexcept {
  return std::bit_cast<float>(static_cast<std::uint32_t>(b) << 16);
}

// Integer stores wrap (C++20 conversions are modular), matching what a C reduction loop does
// past the checker's exactness bound.
template <typename T>
T wrap_integer(double v) noexcept {
  if (!std::isfinite(v)) return T{0};
  return static_cast<T>(static_cast<std::int64_t>(v));
}

// The value `v` becomes when stored as `t`.
double round_to(double v, DataType t) noexcept {
  switch (t) {
    case DataType::kInt8: return wrap_integer<std::int8_t>(v);
    case DataType::kUint8: return wrap_integer<std::uint8_t>(v);
    case DataType::kInt32: return wrap_integer<std::int32_t>(v);
    case DataType::kInt64: return static_cast<double>(wrap_integer<std::int64_t>(v));
    case DataType::kFloat16: return half_to_float(float_to_half(static_cast<float>(v)));
    case DataType::kBFloat16: return bf16_to_float(float_to_bf16(static_cast<float>(v)));
    case DataType::kFloat32: return static_cast<float>(v);
    case DataType::kFloat64: return v;
  }
  return v;
}

double machine_epsilon(DataType t) noexcept {
  switch (t) {
    case DataType::kFloat16: return std::ldexp(1.0, -10);
    case DataType::kBFloat16: return std::ldexp(1.0, -7);
    case DataType::kFloat32: return std::ldexp(1.0, -23);
    case DataType::kFloat64: return std::ldexp(1.0, -52);
    default: return 0.0;
  }
}

std::string lower_dashless(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  for (const char ch : s) {
    if (ch == '-' || ch == '_') continue;
    out.push_back(static_cast<char>(std::tolower(static_cast<unsigned char>(ch))));
  }
  return out;
}

[[noreturn]] void invalid(const std::string& what) {
  throw Error(ErrorCode::kInvalidArgument, what);
}

// ---- table layout ---------------------------------------------------------------------------
//
// Row prefix: size(12) count(12) type(8) redop(6) root(6), two spaces between; then per
// placement: time(7) algbw(6) busbw(6) #wrong(6) p50(7) p99(7), two spaces before each.

constexpr int kPrefixWidth = 12 + 2 + 12 + 2 + 8 + 2 + 6 + 2 + 6;
constexpr int kPlacementWidth = 2 + 7 + 2 + 6 + 2 + 6 + 2 + 6 + 2 + 7 + 2 + 7;

// nccl-tests narrows the precision as times grow so that the column stays 7 wide.
std::string format_time(double us) {
  char buf[32];
  if (us >= 10000.0) {
    std::snprintf(buf, sizeof buf, "%7.0f", us);
  } else if (us >= 100.0) {
    std::snprintf(buf, sizeof buf, "%7.1f", us);
  } else {
    std::snprintf(buf, sizeof buf, "%7.2f", us);
  }
  return buf;
}

std::string format_placement(const Result& r) {
  char buf[128];
  if (!r.valid) {
    std::snprintf(buf, sizeof buf, "  %7s  %6s  %6s  %6s  %7s  %7s", "N/A", "N/A", "N/A", "N/A",
                  "N/A", "N/A");
    return buf;
  }
  const std::string wrong = r.wrong == kNotChecked ? "N/A" : std::to_string(r.wrong);
  std::snprintf(buf, sizeof buf, "  %7s  %6.2f  %6.2f  %6s  %7s  %7s",
                format_time(r.time_us).c_str(), r.algbw, r.busbw, wrong.c_str(),
                format_time(r.p50_us).c_str(), format_time(r.p99_us).c_str());
  return buf;
}

std::string centered(std::string_view text, int width) {
  const int pad = std::max(0, width - static_cast<int>(text.size()));
  return std::string(static_cast<std::size_t>(pad / 2), ' ') + std::string(text) +
         std::string(static_cast<std::size_t>(pad - pad / 2), ' ');
}

// ---- JSON helpers ---------------------------------------------------------------------------

nlohmann::json result_to_json(const Result& r) {
  if (!r.valid) return nullptr;
  nlohmann::json j = {{"time_us", r.time_us},
                      {"algbw", r.algbw},
                      {"busbw", r.busbw},
                      {"p50_us", r.p50_us},
                      {"p99_us", r.p99_us}};
  j["wrong"] = r.wrong == kNotChecked ? nlohmann::json(nullptr) : nlohmann::json(r.wrong);
  return j;
}

Result result_from_json(const nlohmann::json& j) {
  Result r;
  if (j.is_null()) return r;
  r.time_us = j.at("time_us").get<double>();
  r.algbw = j.at("algbw").get<double>();
  r.busbw = j.at("busbw").get<double>();
  r.p50_us = j.at("p50_us").get<double>();
  r.p99_us = j.at("p99_us").get<double>();
  const auto& w = j.at("wrong");
  r.wrong = w.is_null() ? kNotChecked : w.get<long long>();
  r.valid = true;
  return r;
}

std::string csv_number(double v) {
  std::ostringstream os;
  os.precision(std::numeric_limits<double>::max_digits10);
  os << v;
  return os.str();
}

std::string csv_fields(const Result& r) {
  if (!r.valid) return ",,,,,";
  const std::string wrong = r.wrong == kNotChecked ? "" : std::to_string(r.wrong);
  return csv_number(r.time_us) + "," + csv_number(r.algbw) + "," + csv_number(r.busbw) + "," +
         csv_number(r.p50_us) + "," + csv_number(r.p99_us) + "," + wrong;
}

// ---- checker internals ----------------------------------------------------------------------

// The exact reduction of every rank's pattern value at one global index; avg is the real
// quotient, before any rounding to the dtype.
double ideal_value(const CheckSpec& spec, std::uint64_t global_index) {
  double acc = pattern_value(spec.op, 0, global_index, spec.seed);
  for (int r = 1; r < spec.nranks; ++r) {
    const double v = pattern_value(spec.op, r, global_index, spec.seed);
    switch (spec.op) {
      case ReduceOp::kSum:
      case ReduceOp::kAvg: acc += v; break;
      case ReduceOp::kProd: acc *= v; break;
      case ReduceOp::kMin: acc = std::min(acc, v); break;
      case ReduceOp::kMax: acc = std::max(acc, v); break;
    }
  }
  return spec.op == ReduceOp::kAvg ? acc / spec.nranks : acc;
}

// What the dtype holds after the reduction: integer avg truncates, like sum/n in C.
double reduced_value(const CheckSpec& spec, std::uint64_t global_index) {
  const double ideal = ideal_value(spec, global_index);
  const bool int_avg = spec.op == ReduceOp::kAvg && !is_floating(spec.dtype);
  return round_to(int_avg ? std::trunc(ideal) : ideal, spec.dtype);
}

// Only avg is inexact: libraries divide before or after summing, truncate or round. It is
// compared with the real quotient; every quotient is at least 1, so a zero is always caught.
bool matches(const CheckSpec& spec, double got, double ideal, double want) noexcept {
  if (has_reduction(spec.collective) && spec.op == ReduceOp::kAvg) {
    if (!is_floating(spec.dtype)) return std::fabs(got - ideal) < 1.0;
    const double rel = std::min(0.25, spec.nranks * machine_epsilon(spec.dtype));
    return std::fabs(got - ideal) <= rel * std::max(1.0, std::fabs(ideal));
  }
  return got == want;  // false for NaN
}

template <typename Load>
long long count_wrong_with(const CheckSpec& spec, Load load) {
  const std::uint64_t n = output_count(spec);
  long long wrong = 0;
  if (has_reduction(spec.collective)) {
    // pattern_value depends on (global index + seed) mod the period only, so one period of
    // expected values covers the whole buffer.
    std::array<double, kPatternPeriod> ideal{};
    std::array<double, kPatternPeriod> want{};
    for (std::uint64_t k = 0; k < kPatternPeriod; ++k) {
      ideal[k] = ideal_value(spec, k);
      want[k] = reduced_value(spec, k);
    }
    const std::uint64_t base = spec.collective == Collective::kReduceScatter
                                   ? static_cast<std::uint64_t>(spec.rank) * spec.rank_count
                                   : 0;
    for (std::uint64_t i = 0; i < n; ++i) {
      const std::uint64_t k = (base + i) % kPatternPeriod;
      if (!matches(spec, load(i), ideal[k], want[k])) ++wrong;
    }
    return wrong;
  }
  for (std::uint64_t i = 0; i < n; ++i) {
    const double want = expected_value(spec, i);
    if (!matches(spec, load(i), want, want)) ++wrong;
  }
  return wrong;
}

template <typename T>
auto plain_loader(const void* out) {
  return [p = static_cast<const T*>(out)](std::uint64_t i) { return static_cast<double>(p[i]); };
}

}  // namespace

// ---- collectives ----------------------------------------------------------------------------

std::string_view to_string(Collective c) noexcept {
  switch (c) {
    case Collective::kAllReduce: return "all_reduce";
    case Collective::kReduceScatter: return "reduce_scatter";
    case Collective::kAllGather: return "all_gather";
    case Collective::kBroadcast: return "broadcast";
    case Collective::kReduce: return "reduce";
    case Collective::kGather: return "gather";
    case Collective::kScatter: return "scatter";
    case Collective::kAllToAll: return "all_to_all";
    case Collective::kSendRecv: return "send_recv";
    case Collective::kPingPong: return "ping_pong";
  }
  return "invalid";
}

std::optional<Collective> parse_collective(std::string_view name) noexcept {
  const std::string key = lower_dashless(name);
  for (const Collective c : kAllCollectives) {
    if (lower_dashless(to_string(c)) == key) return c;
  }
  if (key == "bcast") return Collective::kBroadcast;
  return std::nullopt;
}

bool has_reduction(Collective c) noexcept {
  return c == Collective::kAllReduce || c == Collective::kReduceScatter || c == Collective::kReduce;
}

bool has_root(Collective c) noexcept {
  return c == Collective::kBroadcast || c == Collective::kReduce || c == Collective::kGather ||
         c == Collective::kScatter;
}

int hops_per_run(Collective c) noexcept { return c == Collective::kPingPong ? 2 : 1; }

namespace {
// Whether each rank contributes a block of the result (all_gather, gather).
bool gathers(Collective c) noexcept {
  return c == Collective::kAllGather || c == Collective::kGather;
}
}  // namespace

// ---- flags ----------------------------------------------------------------------------------

int tool_main(const char* tool, int (*run)(int, char**), int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: %s\n", tool, e.what());
    return 1;
  }
}

CLI::Option* add_bytes_flag(CLI::App& app, const std::string& names, std::uint64_t& target,
                            const std::string& help, bool positive) {
  return app
      .add_option_function<std::string>(
          names,
          [&target, names, positive](const std::string& text) {
            const auto v = env::parse_bytes(text);
            if (!v || (positive && *v == 0)) {
              throw CLI::ValidationError(names, "'" + text + "' is not a size (8, 4K, 64M)");
            }
            target = *v;
          },
          help)
      ->default_str(std::to_string(target));
}

void add_bench_flags(CLI::App& app, BenchArgs& args) {
  add_bytes_flag(app, "-b,--minbytes", args.min_bytes, "Smallest size in bytes (K/M/G suffixes)");
  add_bytes_flag(app, "-e,--maxbytes", args.max_bytes, "Largest size in bytes (K/M/G suffixes)");
  app.add_option("-f,--stepfactor", args.step_factor, "Multiply the size by this each step")
      ->check(CLI::Range(std::uint64_t{1}, std::uint64_t{1} << 20))
      ->capture_default_str();
  add_bytes_flag(app, "-i,--stepbytes", args.step_bytes,
                 "Add this many bytes each step (0: use -f)");
  app.add_option("-n,--iters", args.iters, "Timed iterations per size")
      ->check(CLI::Range(1, 1 << 24))
      ->capture_default_str();
  app.add_option("-w,--warmup_iters", args.warmup_iters, "Untimed iterations before timing")
      ->check(CLI::Range(0, 1 << 24))
      ->capture_default_str();
  app.add_option("-m,--agg_iters", args.agg_iters,
                 "Operations issued back to back per timed iteration, then waited for "
                 "together (same buffers); times are per operation")
      ->check(CLI::Range(1, 1 << 20))
      ->capture_default_str();
  app.add_option("--min_time_ms", args.min_time_ms,
                 "Time at least this long per size and placement: sizes where -n iterations "
                 "would take less get more (estimated from the warm-up; 0: exactly -n); the "
                 "sweep's first size also warms up that long")
      ->check(CLI::Range(0.0, 3.6e6))
      ->capture_default_str();
  app.add_option("-c,--check", args.check, "Run one checked iteration per placement (0/1)")
      ->check(CLI::Range(0, 1 << 24))
      ->capture_default_str();
  app.add_option_function<std::string>(
         "-d,--datatype",
         [&args](const std::string& text) {
           const auto t = parse_dtype(text);
           if (!t) {
             throw CLI::ValidationError(
                 "--datatype",
                 "'" + text + "' is not one of int8 uint8 int32 int64 half bfloat16 float double");
           }
           args.dtype = *t;
         },
         "Element type: int8 uint8 int32 int64 half bfloat16 float double")
      ->default_str(std::string(to_string(args.dtype)));
  app.add_option_function<std::string>(
         "-o,--op",
         [&args](const std::string& text) {
           const auto op = parse_reduce_op(text);
           if (!op) {
             throw CLI::ValidationError("--op",
                                        "'" + text + "' is not one of sum prod max min avg");
           }
           args.op = *op;
         },
         "Reduction: sum prod max min avg")
      ->default_str(std::string(to_string(args.op)));
  app.add_option("-r,--root", args.root, "Root rank of broadcast, reduce, gather and scatter")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  app.add_option("--json", args.json_path, "Also write the results as JSON to FILE");
  app.add_option("--csv", args.csv_path, "Also write the results as CSV to FILE");
  app.add_option("--samples", args.samples_path,
                 "Also write every timed iteration's time on rank 0 to FILE (CSV: size, "
                 "placement, iteration, us), the samples behind p50/p99");
  app.add_option_function<std::string>(
         "--placement",
         [&args](const std::string& text) {
           args.out_of_place = text != "in";
           args.in_place = text != "out";
         },
         "Time out of place, in place or both; the other placement's columns print N/A (for "
         "profiling one of them)")
      ->check(CLI::IsMember({"both", "out", "in"}))
      ->default_str("both");
  app.add_option_function<std::string>(
         "collective",
         [&args](const std::string& text) {
           const auto c = parse_collective(text);
           if (!c) {
             throw CLI::ValidationError("COLLECTIVE",
                                        "'" + text +
                                            "' is not one of all_reduce reduce_scatter all_gather "
                                            "broadcast reduce gather scatter all_to_all "
                                            "send_recv ping_pong");
           }
           args.collective = *c;
         },
         "all_reduce | reduce_scatter | all_gather | broadcast | reduce | gather | scatter | "
         "all_to_all | send_recv | ping_pong")
      ->required();
}

void validate(const BenchArgs& args, int nranks) {
  if (nranks < 1) invalid("the number of ranks must be at least 1, got " + std::to_string(nranks));
  if (args.max_bytes < args.min_bytes) {
    invalid("--maxbytes (" + std::to_string(args.max_bytes) + ") is below --minbytes (" +
            std::to_string(args.min_bytes) + ")");
  }
  if (args.step_bytes == 0 && args.step_factor < 2 && args.max_bytes > args.min_bytes) {
    invalid("--stepfactor must be at least 2 when --stepbytes is 0, or sizes never grow");
  }
  if (args.min_bytes == 0 && args.step_bytes == 0 && args.max_bytes > 0) {
    invalid("--minbytes 0 with a step factor never grows; use --stepbytes");
  }
  if (has_root(args.collective) && (args.root < 0 || args.root >= nranks)) {
    invalid("--root " + std::to_string(args.root) + " is not a rank of " + std::to_string(nranks));
  }
  if (args.iters < 1) invalid("--iters must be at least 1");
  if (args.warmup_iters < 0) invalid("--warmup_iters must not be negative");
  if (args.agg_iters < 1) invalid("--agg_iters must be at least 1");
  if (args.collective == Collective::kPingPong && nranks % 2 != 0) {
    invalid("ping_pong pairs rank 2k with rank 2k+1, so it needs an even number of ranks, got " +
            std::to_string(nranks));
  }
}

bool flags_valid(std::string_view tool, const BenchArgs& args, int nranks, int rank) {
  try {
    validate(args, nranks);
    return true;
  } catch (const Error& e) {
    std::fprintf(stderr, "%.*s: rank %d: %s\n", static_cast<int>(tool.size()), tool.data(), rank,
                 e.what());
    return false;
  }
}

// ---- sizes ----------------------------------------------------------------------------------

SizePoint size_point(std::uint64_t bytes, Collective c, DataType t, int nranks) {
  const std::uint64_t elem = dtype_size(t);
  if (elem == 0) invalid("size_point: invalid dtype");
  if (nranks < 1) invalid("size_point: nranks must be at least 1");
  SizePoint p;
  if (c == Collective::kReduceScatter || c == Collective::kScatter || c == Collective::kAllToAll ||
      gathers(c)) {
    const auto n = static_cast<std::uint64_t>(nranks);
    p.rank_count = bytes / (elem * n);
    p.count = p.rank_count * n;
  } else {
    p.rank_count = bytes / elem;
    p.count = p.rank_count;
  }
  p.bytes = p.count * elem;
  return p;
}

std::vector<SizePoint> size_sweep(const BenchArgs& args, Collective c, DataType t, int nranks) {
  std::vector<SizePoint> out;
  std::uint64_t size = args.min_bytes;
  while (size <= args.max_bytes) {
    const SizePoint p = size_point(size, c, t, nranks);
    const bool first = out.empty();
    const bool repeat = !first && out.back().bytes == p.bytes;
    if (first || (p.count > 0 && !repeat)) out.push_back(p);
    std::uint64_t next = 0;
    if (args.step_bytes > 0) {
      next = size + args.step_bytes;
    } else if (args.step_factor >= 2) {
      next = size * args.step_factor;
      if (size != 0 && next / args.step_factor != size) break;  // overflow
    }
    if (next <= size) break;  // no growth: one point only
    size = next;
  }
  return out;
}

double bus_factor(Collective c, int nranks) noexcept {
  if (nranks < 1) return 0.0;
  const double n = nranks;
  switch (c) {
    case Collective::kAllReduce: return 2.0 * (n - 1.0) / n;
    case Collective::kReduceScatter:
    case Collective::kAllGather:
    case Collective::kGather:
    case Collective::kScatter:
    case Collective::kAllToAll: return (n - 1.0) / n;
    case Collective::kBroadcast:
    case Collective::kReduce:
    case Collective::kSendRecv:
    case Collective::kPingPong: return 1.0;  // nccl-tests' factor: the root's link carries it all
  }
  return 0.0;
}

double algbw_gbps(std::uint64_t bytes, double time_us) noexcept {
  if (!(time_us > 0.0)) return 0.0;
  return static_cast<double>(bytes) / (time_us * 1e3);
}

// ---- timing ---------------------------------------------------------------------------------

double Samples::mean() const noexcept {
  if (values_.empty()) return 0.0;
  double sum = 0.0;
  for (const double v : values_) sum += v;
  return sum / static_cast<double>(values_.size());
}

double Samples::min() const noexcept {
  return values_.empty() ? 0.0 : *std::min_element(values_.begin(), values_.end());
}

double Samples::max() const noexcept {
  return values_.empty() ? 0.0 : *std::max_element(values_.begin(), values_.end());
}

double Samples::percentile(double p) const {
  if (values_.empty()) return 0.0;
  if (!(p > 0.0 && p <= 100.0)) invalid("percentile must lie in (0, 100]");
  std::vector<double> sorted = values_;
  const auto n = sorted.size();
  auto rank = static_cast<std::size_t>(std::ceil(p / 100.0 * static_cast<double>(n)));
  rank = std::clamp<std::size_t>(rank, 1, n);
  std::nth_element(sorted.begin(), sorted.begin() + static_cast<std::ptrdiff_t>(rank - 1),
                   sorted.end());
  return sorted[rank - 1];
}

// ---- rows -----------------------------------------------------------------------------------

Result make_result(const SizePoint& point, Collective c, int nranks, double time_us, double p50_us,
                   double p99_us, long long wrong) {
  Result r;
  r.time_us = time_us;
  r.algbw = algbw_gbps(point.bytes, time_us);
  r.busbw = r.algbw * bus_factor(c, nranks);
  r.p50_us = p50_us;
  r.p99_us = p99_us;
  r.wrong = wrong;
  r.valid = true;
  return r;
}

Row make_row(const SizePoint& point, Collective c, DataType t, ReduceOp op, int root) {
  Row row;
  row.point = point;
  row.type = std::string(to_string(t));
  row.redop = has_reduction(c) ? std::string(to_string(op)) : "none";
  row.root = has_root(c) ? root : -1;
  return row;
}

// ---- output ---------------------------------------------------------------------------------

void print_preamble(std::FILE* out, const RunInfo& info, const BenchArgs& args) {
  std::fprintf(out, "# library %s  collective %s  nranks %d  transport %s\n", info.library.c_str(),
               std::string(to_string(info.collective)).c_str(), info.nranks,
               info.transport.empty() ? "-" : info.transport.c_str());
  if (args.step_bytes > 0) {
    std::fprintf(out, "# minBytes %llu maxBytes %llu step: %llu(bytes)",
                 static_cast<unsigned long long>(args.min_bytes),
                 static_cast<unsigned long long>(args.max_bytes),
                 static_cast<unsigned long long>(args.step_bytes));
  } else {
    std::fprintf(out, "# minBytes %llu maxBytes %llu step: %llu(factor)",
                 static_cast<unsigned long long>(args.min_bytes),
                 static_cast<unsigned long long>(args.max_bytes),
                 static_cast<unsigned long long>(args.step_factor));
  }
  std::fprintf(out, " warmup iters: %d iters: %d agg iters: %d validation: %d\n", args.warmup_iters,
               args.iters, args.agg_iters, args.check);
  if (args.min_time_ms > 0) {
    std::fprintf(out, "# iters raised per size to fill at least %g ms (up to %d)\n",
                 args.min_time_ms, kMaxAutoIters);
  }
  std::fprintf(out, "# time: mean over iterations, max over ranks; p50/p99: rank 0\n");
  if (!info.meta.empty()) std::fprintf(out, "# meta: %s\n", info.meta.dump().c_str());
  std::fprintf(out, "#\n");
}

void print_header(std::FILE* out) {
  const std::string groups = std::string(static_cast<std::size_t>(kPrefixWidth), ' ') +
                             centered("out-of-place", kPlacementWidth) +
                             centered("in-place", kPlacementWidth);
  std::fprintf(out, "#%s\n", groups.substr(1).c_str());
  std::fprintf(out, "# %10s  %12s  %8s  %6s  %6s", "size", "count", "type", "redop", "root");
  for (int i = 0; i < 2; ++i) {
    std::fprintf(out, "  %7s  %6s  %6s  %6s  %7s  %7s", "time", "algbw", "busbw", "#wrong", "p50",
                 "p99");
  }
  std::fprintf(out, "\n# %10s  %12s  %8s  %6s  %6s", "(B)", "(elements)", "", "", "");
  for (int i = 0; i < 2; ++i) {
    std::fprintf(out, "  %7s  %6s  %6s  %6s  %7s  %7s", "(us)", "(GB/s)", "(GB/s)", "", "(us)",
                 "(us)");
  }
  std::fprintf(out, "\n");
  std::fflush(out);
}

std::string format_row(const Row& row) {
  char buf[128];
  std::snprintf(buf, sizeof buf, "%12llu  %12llu  %8s  %6s  %6d",
                static_cast<unsigned long long>(row.point.bytes),
                static_cast<unsigned long long>(row.point.count), row.type.c_str(),
                row.redop.c_str(), row.root);
  return std::string(buf) + format_placement(row.oop) + format_placement(row.ip);
}

void print_row(std::FILE* out, const Row& row) {
  std::fprintf(out, "%s\n", format_row(row).c_str());
  std::fflush(out);
}

double average_busbw(const std::vector<Row>& rows) noexcept {
  double sum = 0.0;
  int n = 0;
  for (const Row& row : rows) {
    for (const Result* r : {&row.oop, &row.ip}) {
      if (!r->valid) continue;
      sum += r->busbw;
      ++n;
    }
  }
  return n == 0 ? 0.0 : sum / n;
}

long long total_wrong(const std::vector<Row>& rows) noexcept {
  long long wrong = 0;
  for (const Row& row : rows) {
    for (const Result* r : {&row.oop, &row.ip}) {
      if (r->valid && r->wrong != kNotChecked) wrong += r->wrong;
    }
  }
  return wrong;
}

void print_footer(std::FILE* out, const std::vector<Row>& rows) {
  const long long wrong = total_wrong(rows);
  std::fprintf(out, "# Out of bounds values : %lld %s\n", wrong, wrong == 0 ? "OK" : "FAILED");
  std::fprintf(out, "# Avg bus bandwidth    : %g \n", average_busbw(rows));
  std::fprintf(out, "#\n");
  std::fflush(out);
}

nlohmann::json to_json(const RunReport& report) {
  const RunInfo& info = report.info;
  nlohmann::json doc = {
      {"library", info.library},
      {"collective", std::string(to_string(info.collective))},
      {"nranks", info.nranks},
      {"dtype", std::string(to_string(info.dtype))},
      {"op", std::string(to_string(info.op))},
      {"root", info.root},
      {"transport", info.transport},
      {"meta", info.meta.is_null() ? nlohmann::json::object() : info.meta},
  };
  nlohmann::json rows = nlohmann::json::array();
  for (const Row& row : report.rows) {
    rows.push_back({{"size", row.point.bytes},
                    {"count", row.point.count},
                    {"rank_count", row.point.rank_count},
                    {"type", row.type},
                    {"redop", row.redop},
                    {"root", row.root},
                    {"oop", result_to_json(row.oop)},
                    {"ip", result_to_json(row.ip)}});
  }
  doc["rows"] = std::move(rows);
  return doc;
}

RunReport report_from_json(const nlohmann::json& doc) {
  try {
    RunReport report;
    RunInfo& info = report.info;
    info.library = doc.at("library").get<std::string>();
    const auto coll = parse_collective(doc.at("collective").get<std::string>());
    const auto dtype = parse_dtype(doc.at("dtype").get<std::string>());
    const auto op = parse_reduce_op(doc.at("op").get<std::string>());
    if (!coll || !dtype || !op) invalid("report JSON names an unknown collective, dtype or op");
    info.collective = *coll;
    info.dtype = *dtype;
    info.op = *op;
    info.nranks = doc.at("nranks").get<int>();
    info.root = doc.value("root", 0);
    info.transport = doc.value("transport", std::string());
    info.meta = doc.value("meta", nlohmann::json::object());
    for (const auto& j : doc.at("rows")) {
      Row row;
      row.point.bytes = j.at("size").get<std::uint64_t>();
      row.point.count = j.at("count").get<std::uint64_t>();
      row.point.rank_count = j.value("rank_count", row.point.count);
      row.type = j.value("type", std::string(to_string(info.dtype)));
      row.redop = j.value("redop", std::string(to_string(info.op)));
      row.root = j.value("root", -1);
      row.oop = result_from_json(j.at("oop"));
      row.ip = result_from_json(j.value("ip", nlohmann::json(nullptr)));
      report.rows.push_back(std::move(row));
    }
    return report;
  } catch (const nlohmann::json::exception& e) {
    invalid(std::string("malformed report JSON: ") + e.what());
  }
}

std::string csv_header() {
  std::string h = "library,collective,nranks,size,count,rank_count,type,redop,root";
  for (const char* p : {"oop", "ip"}) {
    for (const char* f : {"time_us", "algbw", "busbw", "p50_us", "p99_us", "wrong"}) {
      h += std::string(",") + p + "_" + f;
    }
  }
  return h;
}

std::string csv_line(const RunInfo& info, const Row& row) {
  return info.library + "," + std::string(to_string(info.collective)) + "," +
         std::to_string(info.nranks) + "," + std::to_string(row.point.bytes) + "," +
         std::to_string(row.point.count) + "," + std::to_string(row.point.rank_count) + "," +
         row.type + "," + row.redop + "," + std::to_string(row.root) + "," + csv_fields(row.oop) +
         "," + csv_fields(row.ip);
}

namespace {

void write_text_file(const std::string& path, const std::string& text) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  if (!f) throw Error(ErrorCode::kSystem, "cannot open '" + path + "' for writing");
  f << text;
  f.close();
  if (!f) throw Error(ErrorCode::kSystem, "cannot write '" + path + "'");
}

}  // namespace

void write_json_file(const std::string& path, const RunReport& report) {
  write_text_file(path, to_json(report).dump(2) + "\n");
}

void write_csv_file(const std::string& path, const RunReport& report) {
  std::string text = csv_header() + "\n";
  for (const Row& row : report.rows) text += csv_line(report.info, row) + "\n";
  write_text_file(path, text);
}

Reporter::Reporter(RunInfo info, const BenchArgs& args, int rank, std::FILE* out)
    : args_(args), rank_(rank), out_(out) {
  report_.info = std::move(info);
}

void Reporter::begin() {
  if (rank_ != 0) return;
  print_preamble(out_, report_.info, args_);
  print_header(out_);
}

void Reporter::add(Row row) {
  if (rank_ != 0) return;
  print_row(out_, row);
  report_.rows.push_back(std::move(row));
}

long long Reporter::finish() {
  if (rank_ != 0) return 0;
  print_footer(out_, report_.rows);
  if (!args_.json_path.empty()) write_json_file(args_.json_path, report_);
  if (!args_.csv_path.empty()) write_csv_file(args_.csv_path, report_);
  return total_wrong(report_.rows);
}

SampleLog::SampleLog(const std::string& path, int rank) : path_(path) {
  if (rank != 0 || path.empty()) return;
  out_.open(path, std::ios::binary | std::ios::trunc);
  if (!out_) {
    throw Error(ErrorCode::kSystem, "--samples: cannot open '" + path + "' for writing", rank);
  }
  out_ << "size,placement,iteration,us\n";
}

void SampleLog::add(std::uint64_t bytes, bool in_place, const Samples& samples) {
  if (!out_.is_open()) return;
  const char* placement = in_place ? "ip" : "oop";
  std::string text;
  char line[96];
  for (std::size_t i = 0; i < samples.size(); ++i) {
    const int n =
        std::snprintf(line, sizeof(line), "%llu,%s,%zu,%.3f\n",
                      static_cast<unsigned long long>(bytes), placement, i, samples.values()[i]);
    text.append(line, static_cast<std::size_t>(n));
  }
  out_ << text;
  out_.flush();
  if (!out_) throw Error(ErrorCode::kSystem, "--samples: cannot write '" + path_ + "'", 0);
}

void print_progress(std::string_view tool, Collective c, std::uint64_t bytes, std::size_t done,
                    std::size_t total, int rank) {
  if (rank != 0) return;
  std::fprintf(stderr, "[%.*s] %s %llu B done (%zu/%zu)\n", static_cast<int>(tool.size()),
               tool.data(), std::string(to_string(c)).c_str(),
               static_cast<unsigned long long>(bytes), done, total);
  std::fflush(stderr);
}

// ---- checking -------------------------------------------------------------------------------

std::uint64_t input_count(const CheckSpec& spec) noexcept {
  return spec.collective == Collective::kReduceScatter || spec.collective == Collective::kScatter ||
                 spec.collective == Collective::kAllToAll
             ? spec.rank_count * static_cast<std::uint64_t>(spec.nranks)
             : spec.rank_count;
}

std::uint64_t output_count(const CheckSpec& spec) noexcept {
  return gathers(spec.collective) || spec.collective == Collective::kAllToAll
             ? spec.rank_count * static_cast<std::uint64_t>(spec.nranks)
             : spec.rank_count;
}

double pattern_value(ReduceOp op, int rank, std::uint64_t index, std::uint64_t seed) noexcept {
  const std::uint64_t k = (index + seed) % kPatternPeriod;
  const auto r = static_cast<std::uint64_t>(rank);
  if (op == ReduceOp::kProd) return (k + r) % 4 == 0 ? 2.0 : 1.0;
  // 3r mod 5 visits every residue as r grows, so no rank contributes a constant.
  return static_cast<double>((k % 7 + 3 * r) % 5 + 1);
}

void store_value(void* buf, std::uint64_t index, DataType dtype, double value) {
  switch (dtype) {
    case DataType::kInt8:
      static_cast<std::int8_t*>(buf)[index] = wrap_integer<std::int8_t>(value);
      return;
    case DataType::kUint8:
      static_cast<std::uint8_t*>(buf)[index] = wrap_integer<std::uint8_t>(value);
      return;
    case DataType::kInt32:
      static_cast<std::int32_t*>(buf)[index] = wrap_integer<std::int32_t>(value);
      return;
    case DataType::kInt64:
      static_cast<std::int64_t*>(buf)[index] = wrap_integer<std::int64_t>(value);
      return;
    case DataType::kFloat16:
      static_cast<std::uint16_t*>(buf)[index] = float_to_half(static_cast<float>(value));
      return;
    case DataType::kBFloat16:
      static_cast<std::uint16_t*>(buf)[index] = float_to_bf16(static_cast<float>(value));
      return;
    case DataType::kFloat32: static_cast<float*>(buf)[index] = static_cast<float>(value); return;
    case DataType::kFloat64: static_cast<double*>(buf)[index] = value; return;
  }
  invalid("store_value: invalid dtype");
}

double load_value(const void* buf, std::uint64_t index, DataType dtype) {
  switch (dtype) {
    case DataType::kInt8: return static_cast<const std::int8_t*>(buf)[index];
    case DataType::kUint8: return static_cast<const std::uint8_t*>(buf)[index];
    case DataType::kInt32: return static_cast<const std::int32_t*>(buf)[index];
    case DataType::kInt64: return static_cast<double>(static_cast<const std::int64_t*>(buf)[index]);
    case DataType::kFloat16: return half_to_float(static_cast<const std::uint16_t*>(buf)[index]);
    case DataType::kBFloat16: return bf16_to_float(static_cast<const std::uint16_t*>(buf)[index]);
    case DataType::kFloat32: return static_cast<const float*>(buf)[index];
    case DataType::kFloat64: return static_cast<const double*>(buf)[index];
  }
  invalid("load_value: invalid dtype");
}

void fill_pattern(void* buf, std::uint64_t count, DataType dtype, ReduceOp op, int rank,
                  std::uint64_t seed, std::uint64_t first_index) {
  if (!is_valid(dtype)) invalid("fill_pattern: invalid dtype");
  // Encode one period once, then copy it: conversions per element would dominate large fills.
  const std::size_t elem = dtype_size(dtype);
  std::array<unsigned char, kPatternPeriod * 8> period{};
  for (std::uint64_t k = 0; k < kPatternPeriod; ++k) {
    store_value(period.data(), k, dtype, pattern_value(op, rank, first_index + k, seed));
  }
  auto* out = static_cast<unsigned char*>(buf);
  for (std::uint64_t done = 0; done < count; done += kPatternPeriod) {
    const std::uint64_t n = std::min(kPatternPeriod, count - done);
    std::memcpy(out + done * elem, period.data(), n * elem);
  }
}

void fill_input(void* buf, const CheckSpec& spec) {
  // all_gather contributions are numbered by their place in the gathered result, so every
  // block of the output differs from its neighbours.
  const std::uint64_t first =
      gathers(spec.collective) ? static_cast<std::uint64_t>(spec.rank) * spec.rank_count : 0;
  fill_pattern(buf, input_count(spec), spec.dtype, spec.op, spec.rank, spec.seed, first);
}

double expected_value(const CheckSpec& spec, std::uint64_t out_index) {
  switch (spec.collective) {
    case Collective::kAllReduce:
    case Collective::kReduce: return reduced_value(spec, out_index);
    case Collective::kReduceScatter:
      return reduced_value(spec,
                           static_cast<std::uint64_t>(spec.rank) * spec.rank_count + out_index);
    case Collective::kAllGather:
    case Collective::kGather: {
      const auto src = spec.rank_count == 0 ? 0 : static_cast<int>(out_index / spec.rank_count);
      return round_to(pattern_value(spec.op, src, out_index, spec.seed), spec.dtype);
    }
    case Collective::kBroadcast:
      return round_to(pattern_value(spec.op, spec.root, out_index, spec.seed), spec.dtype);
    case Collective::kScatter:
      return round_to(
          pattern_value(spec.op, spec.root,
                        static_cast<std::uint64_t>(spec.rank) * spec.rank_count + out_index,
                        spec.seed),
          spec.dtype);
    case Collective::kSendRecv: {
      // What rank - 1 sent.
      const int from = (spec.rank - 1 + spec.nranks) % spec.nranks;
      return round_to(pattern_value(spec.op, from, out_index, spec.seed), spec.dtype);
    }
    case Collective::kPingPong: {
      // Rank 2k gets its own message back; rank 2k + 1 keeps what rank 2k sent.
      const int from = spec.rank - spec.rank % 2;
      return round_to(pattern_value(spec.op, from, out_index, spec.seed), spec.dtype);
    }
    case Collective::kAllToAll: {
      // Block j came from rank j, which sent this rank's block of its input.
      if (spec.rank_count == 0) return 0;
      const auto src = static_cast<int>(out_index / spec.rank_count);
      return round_to(pattern_value(spec.op, src,
                                    static_cast<std::uint64_t>(spec.rank) * spec.rank_count +
                                        out_index % spec.rank_count,
                                    spec.seed),
                      spec.dtype);
    }
  }
  invalid("expected_value: invalid collective");
}

long long count_wrong(const void* out, const CheckSpec& spec) {
  if (output_count(spec) == 0) return 0;
  // Off the root a reduce's or gather's output holds nothing the call defines.
  if ((spec.collective == Collective::kReduce || spec.collective == Collective::kGather) &&
      spec.rank != spec.root) {
    return 0;
  }
  switch (spec.dtype) {
    case DataType::kInt8: return count_wrong_with(spec, plain_loader<std::int8_t>(out));
    case DataType::kUint8: return count_wrong_with(spec, plain_loader<std::uint8_t>(out));
    case DataType::kInt32: return count_wrong_with(spec, plain_loader<std::int32_t>(out));
    case DataType::kInt64: return count_wrong_with(spec, plain_loader<std::int64_t>(out));
    case DataType::kFloat32: return count_wrong_with(spec, plain_loader<float>(out));
    case DataType::kFloat64: return count_wrong_with(spec, plain_loader<double>(out));
    case DataType::kFloat16:
      return count_wrong_with(spec, [p = static_cast<const std::uint16_t*>(out)](std::uint64_t i) {
        return half_to_float(p[i]);
      });
    case DataType::kBFloat16:
      return count_wrong_with(spec, [p = static_cast<const std::uint16_t*>(out)](std::uint64_t i) {
        return bf16_to_float(p[i]);
      });
  }
  invalid("count_wrong: invalid dtype");
}

}  // namespace dear::bench
