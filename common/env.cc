#include "common/env.h"

#include <cctype>
#include <cstdlib>
#include <limits>

#include "dear/error.h"

namespace dear::env {

std::optional<std::string> get(const char* name) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return std::nullopt;
  return std::string(v);
}

std::optional<std::int64_t> get_int(const char* name, std::int64_t min, std::int64_t max) {
  auto v = get(name);
  if (!v) return std::nullopt;
  char* end = nullptr;
  errno = 0;
  const long long x = std::strtoll(v->c_str(), &end, 10);
  if (errno != 0 || end == v->c_str() || *end != '\0' || x < min || x > max) {
    throw Error(ErrorCode::kInvalidArgument, std::string("environment variable ") + name + "='" +
                                                 *v + "' is not a whole number in [" +
                                                 std::to_string(min) + ", " + std::to_string(max) +
                                                 "]");
  }
  return x;
}

std::optional<std::uint64_t> parse_bytes(const std::string& text) {
  if (text.empty() || !std::isdigit(static_cast<unsigned char>(text[0]))) return std::nullopt;
  char* end = nullptr;
  errno = 0;
  const unsigned long long x = std::strtoull(text.c_str(), &end, 10);
  if (errno != 0) return std::nullopt;
  std::uint64_t mult = 1;
  std::string suffix(end);
  if (!suffix.empty() && (suffix.back() == 'B' || suffix.back() == 'b')) suffix.pop_back();
  if (suffix == "")
    mult = 1;
  else if (suffix == "K" || suffix == "k" || suffix == "Ki")
    mult = 1ULL << 10;
  else if (suffix == "M" || suffix == "m" || suffix == "Mi")
    mult = 1ULL << 20;
  else if (suffix == "G" || suffix == "g" || suffix == "Gi")
    mult = 1ULL << 30;
  else
    return std::nullopt;
  if (x > std::numeric_limits<std::uint64_t>::max() / mult) return std::nullopt;
  return x * mult;
}

std::optional<std::uint64_t> get_bytes(const char* name) {
  auto v = get(name);
  if (!v) return std::nullopt;
  auto b = parse_bytes(*v);
  if (!b) {
    throw Error(ErrorCode::kInvalidArgument, std::string("environment variable ") + name + "='" +
                                                 *v + "' is not a byte size (e.g. 512K, 4M)");
  }
  return b;
}

}  // namespace dear::env
