#include "transport/auth.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>

#include <algorithm>
#include <cstring>

#include "dear/error.h"

namespace dear::transport::auth {
namespace {

// The MAC input is label || purpose || parts, assembled in a fixed buffer so that no secret-
// dependent data lands in heap memory that outlives the call.
constexpr std::size_t kMaxInput = 16 + 4 + sizeof(Claim) + kNonceBytes;

class Transcript {
 public:
  void add(const void* p, std::size_t n) {
    std::memcpy(buf_.data() + len_, p, n);
    len_ += n;
  }
  [[nodiscard]] const std::uint8_t* data() const { return buf_.data(); }
  [[nodiscard]] std::size_t size() const { return len_; }

 private:
  std::array<std::uint8_t, kMaxInput> buf_{};
  std::size_t len_ = 0;
};

Mac hmac(Secret secret, const Transcript& t) {
  Mac out{};
  unsigned len = 0;
  if (HMAC(EVP_sha256(), secret.data(), static_cast<int>(secret.size()), t.data(), t.size(),
           out.data(), &len) == nullptr ||
      len != out.size()) {
    throw Error(ErrorCode::kSystem, "HMAC-SHA256 failed in libcrypto");
  }
  return out;
}

constexpr char kConnectorLabel[16] = "dear connector";
constexpr char kListenerLabel[16] = "dear listener";

std::uint32_t load_u32(const std::uint8_t* p) {
  std::uint32_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

}  // namespace

Nonce fresh_nonce() {
  Nonce n{};
  if (RAND_bytes(n.data(), static_cast<int>(n.size())) != 1) {
    throw Error(ErrorCode::kSystem, "no random bytes from libcrypto (RAND_bytes failed)");
  }
  return n;
}

Challenge make_challenge(Purpose purpose) {
  return {static_cast<std::uint32_t>(purpose), kVersion, fresh_nonce()};
}

Mac connector_mac(Secret secret, Purpose purpose, const Nonce& listener_nonce, const Claim& claim) {
  Transcript t;
  t.add(kConnectorLabel, sizeof(kConnectorLabel));
  t.add(&purpose, sizeof(purpose));
  t.add(listener_nonce.data(), listener_nonce.size());
  t.add(&claim, sizeof(claim));
  return hmac(secret, t);
}

Mac listener_mac(Secret secret, Purpose purpose, const Claim& claim, const Nonce& listener_nonce,
                 std::uint32_t status) {
  Transcript t;
  t.add(kListenerLabel, sizeof(kListenerLabel));
  t.add(&purpose, sizeof(purpose));
  t.add(&claim, sizeof(claim));
  t.add(listener_nonce.data(), listener_nonce.size());
  t.add(&status, sizeof(status));
  return hmac(secret, t);
}

Response make_response(Secret secret, Purpose purpose, const Challenge& challenge,
                       const Claim& claim) {
  Response r{};
  r.magic = static_cast<std::uint32_t>(purpose);
  r.version = kVersion;
  r.claim = claim;
  r.mac = connector_mac(secret, purpose, challenge.nonce, claim);
  return r;
}

Welcome make_welcome(Secret secret, Purpose purpose, const Claim& claim,
                     const Nonce& listener_nonce, std::uint32_t status) {
  return {static_cast<std::uint32_t>(purpose), status,
          listener_mac(secret, purpose, claim, listener_nonce, status)};
}

bool same_mac(const Mac& a, const Mac& b) {
  return CRYPTO_memcmp(a.data(), b.data(), a.size()) == 0;
}

std::string_view describe(Check c) noexcept {
  switch (c) {
    case Check::kOk: return "ok";
    case Check::kIncomplete: return "the handshake is incomplete";
    case Check::kNotDear: return "it does not speak the dear protocol";
    case Check::kOtherVersion: return "it speaks another handshake version";
    case Check::kBadMac: return "wrong secret (another job on the same address?)";
    case Check::kRefused: return "the listener refused the connection";
  }
  return "unknown";
}

// Magic and version come first in every message, so a prefix is judged as soon as they arrive.
namespace {
Check check_prefix(const std::uint8_t* bytes, std::size_t n, Purpose purpose, bool versioned) {
  if (n >= 4 && load_u32(bytes) != static_cast<std::uint32_t>(purpose)) return Check::kNotDear;
  if (versioned && n >= 8 && load_u32(bytes + 4) != kVersion) return Check::kOtherVersion;
  return Check::kOk;
}
}  // namespace

Check check_response(const std::uint8_t* bytes, std::size_t n, Purpose purpose, const Nonce& sent,
                     Secret secret, Response* out) {
  if (const Check c = check_prefix(bytes, n, purpose, true); c != Check::kOk) return c;
  if (n < sizeof(Response)) return Check::kIncomplete;
  Response r;
  std::memcpy(&r, bytes, sizeof(r));
  if (!same_mac(r.mac, connector_mac(secret, purpose, sent, r.claim))) return Check::kBadMac;
  *out = r;
  return Check::kOk;
}

Check check_challenge(const std::uint8_t* bytes, std::size_t n, Purpose purpose, Challenge* out) {
  if (const Check c = check_prefix(bytes, n, purpose, true); c != Check::kOk) return c;
  if (n < sizeof(Challenge)) return Check::kIncomplete;
  std::memcpy(out, bytes, sizeof(*out));
  return Check::kOk;
}

Check check_welcome(const std::uint8_t* bytes, std::size_t n, Purpose purpose, Secret secret,
                    const Claim& sent, const Nonce& listener_nonce, std::uint32_t* status) {
  if (const Check c = check_prefix(bytes, n, purpose, false); c != Check::kOk) return c;
  if (n < sizeof(Welcome)) return Check::kIncomplete;
  Welcome w;
  std::memcpy(&w, bytes, sizeof(w));
  if (!same_mac(w.mac, listener_mac(secret, purpose, sent, listener_nonce, w.status))) {
    return Check::kBadMac;
  }
  if (status != nullptr) *status = w.status;
  return w.status == 0 ? Check::kOk : Check::kRefused;
}

std::optional<std::string> bootstrap_claim_problem(const Claim& c, int world_size) {
  if (c.world_size != world_size) {
    return "rank " + std::to_string(c.rank) + " says world size " + std::to_string(c.world_size) +
           ", rank 0 has " + std::to_string(world_size);
  }
  if (c.rank <= 0 || c.rank >= world_size) {
    return "a peer claims rank " + std::to_string(c.rank) + ", outside 1.." +
           std::to_string(std::int64_t{world_size} - 1);
  }
  if (c.peer != 0 || c.channel != 0 || c.tag != 0) {
    return "rank " + std::to_string(c.rank) + " sent a malformed bootstrap claim";
  }
  return std::nullopt;
}

std::optional<std::string> link_claim_problem(const Claim& c, int self_rank,
                                              const std::vector<int>& peers, int channels) {
  if (c.peer != self_rank) {
    return "rank " + std::to_string(c.rank) + " meant to reach rank " + std::to_string(c.peer) +
           ", not this one";
  }
  if (std::find(peers.begin(), peers.end(), c.rank) == peers.end()) {
    return "unexpected link connection from rank " + std::to_string(c.rank);
  }
  if (c.channel < 0 || c.channel >= channels) {
    return "rank " + std::to_string(c.rank) + " opened channel " + std::to_string(c.channel) +
           ", outside 0.." + std::to_string(std::int64_t{channels} - 1);
  }
  return std::nullopt;
}

}  // namespace dear::transport::auth
