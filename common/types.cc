#include "dear/types.h"

#include <algorithm>
#include <array>
#include <cctype>
#include <string>
#include <utility>

namespace dear {
namespace {

std::string lower(std::string_view s) {
  std::string out(s);
  std::transform(out.begin(), out.end(), out.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return out;
}

}  // namespace

std::string_view to_string(DataType t) noexcept {
  switch (t) {
    case DataType::kInt8: return "int8";
    case DataType::kUint8: return "uint8";
    case DataType::kInt32: return "int32";
    case DataType::kInt64: return "int64";
    case DataType::kFloat16: return "half";
    case DataType::kBFloat16: return "bfloat16";
    case DataType::kFloat32: return "float";
    case DataType::kFloat64: return "double";
  }
  return "invalid";
}

std::string_view to_string(ReduceOp op) noexcept {
  switch (op) {
    case ReduceOp::kSum: return "sum";
    case ReduceOp::kProd: return "prod";
    case ReduceOp::kMin: return "min";
    case ReduceOp::kMax: return "max";
    case ReduceOp::kAvg: return "avg";
  }
  return "invalid";
}

std::optional<DataType> parse_dtype(std::string_view name) noexcept {
  static constexpr std::array<std::pair<std::string_view, DataType>, 18> kNames{{
      {"int8", DataType::kInt8},
      {"char", DataType::kInt8},
      {"uint8", DataType::kUint8},
      {"int32", DataType::kInt32},
      {"int", DataType::kInt32},
      {"int64", DataType::kInt64},
      {"half", DataType::kFloat16},
      {"fp16", DataType::kFloat16},
      {"float16", DataType::kFloat16},
      {"bfloat16", DataType::kBFloat16},
      {"bf16", DataType::kBFloat16},
      {"float", DataType::kFloat32},
      {"fp32", DataType::kFloat32},
      {"float32", DataType::kFloat32},
      {"double", DataType::kFloat64},
      {"fp64", DataType::kFloat64},
      {"float64", DataType::kFloat64},
      {"uint8_t", DataType::kUint8},
  }};
  const std::string key = lower(name);
  for (const auto& [n, t] : kNames) {
    if (n == key) return t;
  }
  return std::nullopt;
}

std::optional<ReduceOp> parse_reduce_op(std::string_view name) noexcept {
  const std::string key = lower(name);
  for (int i = 0; i < kNumReduceOps; ++i) {
    const auto op = static_cast<ReduceOp>(i);
    if (to_string(op) == key) return op;
  }
  if (key == "mean") return ReduceOp::kAvg;
  return std::nullopt;
}

}  // namespace dear
