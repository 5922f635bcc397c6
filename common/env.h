// Reading DEAR_* (and launcher) environment variables with errors that name the variable.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

namespace dear::env {

// The variable's value, or nullopt when unset or empty.
[[nodiscard]] std::optional<std::string> get(const char* name);
// Parses a whole decimal integer; throws dear::Error(kInvalidArgument) naming the variable
// when the value is not one or lies outside [min, max].
[[nodiscard]] std::optional<std::int64_t> get_int(const char* name, std::int64_t min,
                                                  std::int64_t max);
// Parses a byte size with an optional K/M/G suffix (powers of 1024), e.g. "512K".
[[nodiscard]] std::optional<std::uint64_t> get_bytes(const char* name);
// Shared by get_bytes and command lines: "64M" -> 67108864; nullopt when malformed.
[[nodiscard]] std::optional<std::uint64_t> parse_bytes(const std::string& text);

}  // namespace dear::env
