// Element types and reduction operators understood by every collective.
//
// Names follow nccl-tests (`half`, `bfloat16`, `float`, ...) so that command lines and
// result tables are interchangeable with theirs.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string_view>

namespace dear {

enum class DataType : std::uint8_t {
  kInt8 = 0,
  kUint8,
  kInt32,
  kInt64,
  kFloat16,
  kBFloat16,
  kFloat32,
  kFloat64,
};
inline constexpr int kNumDataTypes = 8;

enum class ReduceOp : std::uint8_t {
  kSum = 0,
  kProd,
  kMin,
  kMax,
  kAvg,
};
inline constexpr int kNumReduceOps = 5;

// Size of one element in bytes; 0 for a value outside the enum.
[[nodiscard]] constexpr std::size_t dtype_size(DataType t) noexcept {
  switch (t) {
    case DataType::kInt8:
    case DataType::kUint8: return 1;
    case DataType::kFloat16:
    case DataType::kBFloat16: return 2;
    case DataType::kInt32:
    case DataType::kFloat32: return 4;
    case DataType::kInt64:
    case DataType::kFloat64: return 8;
  }
  return 0;
}

[[nodiscard]] constexpr bool is_valid(DataType t) noexcept { return dtype_size(t) != 0; }
[[nodiscard]] constexpr bool is_valid(ReduceOp op) noexcept {
  return static_cast<unsigned>(op) < static_cast<unsigned>(kNumReduceOps);
}
[[nodiscard]] constexpr bool is_floating(DataType t) noexcept {
  return t == DataType::kFloat16 || t == DataType::kBFloat16 || t == DataType::kFloat32 ||
         t == DataType::kFloat64;
}

// nccl-tests names: int8 uint8 int32 int64 half bfloat16 float double.
[[nodiscard]] std::string_view to_string(DataType t) noexcept;
// nccl-tests names: sum prod min max avg.
[[nodiscard]] std::string_view to_string(ReduceOp op) noexcept;
// Accept the nccl-tests names and common aliases (fp16, bf16, fp32, float32, fp64, ...).
[[nodiscard]] std::optional<DataType> parse_dtype(std::string_view name) noexcept;
[[nodiscard]] std::optional<ReduceOp> parse_reduce_op(std::string_view name) noexcept;

}  // namespace dear
