// Fuzzes the handshake parsers of transport/auth.h, which read bytes from anyone who can reach
// a dear port: the listener's check of a response (fed as it would arrive, in growing
// prefixes), the connector's checks of a challenge and a welcome, and the claim checks run
// after a MAC verifies. Invariants beyond "no crash": a response signed with the secret always
// verifies, and one changed in any byte never does.
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "dear/error.h"
#include "transport/auth.h"

namespace auth = dear::transport::auth;

namespace {

constexpr std::uint8_t kSecret[16] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16};
constexpr auth::Nonce kNonce = {7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7,
                                9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9};

void require(bool ok) {
  if (!ok) __builtin_trap();
}

void claim_checks(const auth::Claim& c) {
  (void)auth::bootstrap_claim_problem(c, 4);
  (void)auth::bootstrap_claim_problem(c, c.world_size);
  (void)auth::link_claim_problem(c, 1, {0, 2}, 2);
  (void)auth::link_claim_problem(c, c.peer, {c.rank},
                                 c.channel < 0 || c.channel > 64 ? 2 : c.channel + 1);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size < 1) return 0;
  const std::uint8_t mode = data[0];
  ++data;
  --size;
  const auth::Purpose purpose = (mode & 1) ? auth::Purpose::kLink : auth::Purpose::kBootstrap;
  const std::size_t step = 1 + (mode >> 4);
  auth::Response r{};
  switch ((mode >> 1) & 3) {
    case 0: {
      // A response arriving over the network, judged after every read.
      for (std::size_t n = 0;; n = std::min(size, n + step)) {
        const auth::Check c = auth::check_response(data, n, purpose, kNonce, kSecret, &r);
        if (c == auth::Check::kOk) claim_checks(r.claim);
        if (c != auth::Check::kIncomplete || n == size) break;
      }
      break;
    }
    case 1: {
      // A claim signed with the secret must verify; with one byte flipped it must not.
      auth::Claim claim{};
      std::memcpy(&claim, data, std::min(size, sizeof(claim)));
      const auth::Challenge ch{static_cast<std::uint32_t>(purpose), auth::kVersion, kNonce};
      auth::Response good = auth::make_response(kSecret, purpose, ch, claim);
      auto* bytes = reinterpret_cast<std::uint8_t*>(&good);
      require(auth::check_response(bytes, sizeof(good), purpose, kNonce, kSecret, &r) ==
              auth::Check::kOk);
      claim_checks(r.claim);
      const auth::Welcome w = auth::make_welcome(kSecret, purpose, claim, kNonce);
      require(auth::check_welcome(reinterpret_cast<const std::uint8_t*>(&w), sizeof(w), purpose,
                                  kSecret, claim, kNonce) == auth::Check::kOk);
      if (size > sizeof(claim)) {
        const std::size_t at = data[sizeof(claim)] % sizeof(good);
        const auto flip =
            static_cast<std::uint8_t>(size > sizeof(claim) + 1 ? data[sizeof(claim) + 1] : 1);
        bytes[at] ^= flip == 0 ? 1 : flip;
        require(auth::check_response(bytes, sizeof(good), purpose, kNonce, kSecret, &r) !=
                auth::Check::kOk);
      }
      break;
    }
    case 2: {
      auth::Challenge ch{};
      for (std::size_t n = 0;; n = std::min(size, n + step)) {
        const auth::Check c = auth::check_challenge(data, n, purpose, &ch);
        if (c != auth::Check::kIncomplete || n == size) break;
      }
      break;
    }
    default: {
      auth::Claim claim{};
      claim.rank = 1;
      claim.world_size = 4;
      for (std::size_t n = 0;; n = std::min(size, n + step)) {
        const auth::Check c = auth::check_welcome(data, n, purpose, kSecret, claim, kNonce);
        require(c != auth::Check::kOk);  // nobody without the secret can forge it
        if (c != auth::Check::kIncomplete || n == size) break;
      }
      break;
    }
  }
  return 0;
}
