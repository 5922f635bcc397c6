#include <sys/random.h>

#include <cerrno>
#include <charconv>
#include <cstring>
#include <string>

#include "dear/bootstrap.h"
#include "dear/error.h"
#include "transport/listener_registry.h"

namespace dear {
namespace {

constexpr char kHex[] = "0123456789abcdef";

int hex_value(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

std::string bracketed(const std::string& host) {
  return host.find(':') != std::string::npos ? "[" + host + "]" : host;
}

[[noreturn]] void bad_id(std::string_view text, const std::string& why) {
  // Never echo the text itself: it holds the secret.
  (void)text;
  throw Error(ErrorCode::kInvalidArgument, "unique id (DEAR_UNIQUE_ID) is malformed: " + why +
                                               "; expected host:port:32-hex-digit-secret");
}

}  // namespace

std::array<std::uint8_t, 16> transport::random_secret() {
  std::array<std::uint8_t, 16> secret{};
  std::size_t got = 0;
  while (got < secret.size()) {
    const ssize_t n = getrandom(secret.data() + got, secret.size() - got, 0);
    if (n < 0) {
      if (errno == EINTR) continue;
      throw Error(ErrorCode::kSystem, std::string("getrandom failed: ") + std::strerror(errno));
    }
    got += static_cast<std::size_t>(n);
  }
  return secret;
}

UniqueId UniqueId::create(const std::string& host, std::uint16_t port) {
  UniqueId id;
  id.host = host;
  id.secret = transport::random_secret();
  id.port = transport::ListenerRegistry::instance().open(host, port);
  return id;
}

UniqueId UniqueId::parse(std::string_view text) {
  UniqueId id;
  std::string_view rest = text;
  if (!rest.empty() && rest.front() == '[') {
    const auto close = rest.find(']');
    if (close == std::string_view::npos) bad_id(text, "unclosed '[' around the host");
    id.host = std::string(rest.substr(1, close - 1));
    rest = rest.substr(close + 1);
    if (rest.empty() || rest.front() != ':') bad_id(text, "no ':' after the host");
    rest = rest.substr(1);
  } else {
    const auto colon = rest.find(':');
    if (colon == std::string_view::npos) bad_id(text, "no ':' after the host");
    id.host = std::string(rest.substr(0, colon));
    rest = rest.substr(colon + 1);
  }
  if (id.host.empty()) bad_id(text, "empty host");
  const auto colon = rest.find(':');
  if (colon == std::string_view::npos) bad_id(text, "no ':' between port and secret");
  const std::string_view port = rest.substr(0, colon);
  unsigned value = 0;
  const auto [p, ec] = std::from_chars(port.data(), port.data() + port.size(), value);
  if (ec != std::errc() || p != port.data() + port.size() || value == 0 || value > 65535) {
    bad_id(text, "port is not a number in 1..65535");
  }
  id.port = static_cast<std::uint16_t>(value);
  const std::string_view secret = rest.substr(colon + 1);
  if (secret.size() != 2 * id.secret.size()) bad_id(text, "secret is not 32 hex digits");
  for (std::size_t i = 0; i < id.secret.size(); ++i) {
    const int hi = hex_value(secret[2 * i]);
    const int lo = hex_value(secret[2 * i + 1]);
    if (hi < 0 || lo < 0) bad_id(text, "secret is not 32 hex digits");
    id.secret[i] = static_cast<std::uint8_t>(hi * 16 + lo);
  }
  return id;
}

std::string UniqueId::address() const { return bracketed(host) + ":" + std::to_string(port); }

std::string UniqueId::to_string() const {
  std::string s = address() + ":";
  for (const auto b : secret) {
    s += kHex[b >> 4];
    s += kHex[b & 15];
  }
  return s;
}

}  // namespace dear
