// Proof of job membership for connections between ranks: HMAC-SHA256 challenge-response over
// the job's secret, shared by the bootstrap and the link handshakes.
//
// Protocol, for a connector C (the side that called connect) and a listener L:
//   L -> C  Challenge  {magic, version, nonce_L}            as soon as L accepts
//   C -> L  Response   {magic, version, claim, mac_C}       claim = who C says it is + nonce_C
//   L -> C  Welcome    {magic, status, mac_L}               only once L has verified mac_C
// mac_C = HMAC(secret, "connector" || purpose || nonce_L || claim) and
// mac_L = HMAC(secret, "listener" || purpose || claim || nonce_L). Both nonces are fresh random
// bytes for every connection, so a captured exchange proves nothing on a later connection (no
// replay), and the role labels keep one side's proof from being reflected as the other's. The
// secret itself never crosses the wire, and nothing here puts it in a message or a log.
//
// Messages travel in host byte order, as every dear wire header does (all ranks of a job run
// the same build); MACs cover the exact bytes sent, so a receiver verifies what it received.
//
// Everything in this header is pure computation without I/O, so that it can be fuzzed alone.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace dear::transport::auth {

inline constexpr std::uint32_t kVersion = 2;
inline constexpr std::size_t kNonceBytes = 32;
inline constexpr std::size_t kMacBytes = 32;
using Nonce = std::array<std::uint8_t, kNonceBytes>;
using Mac = std::array<std::uint8_t, kMacBytes>;
using Secret = std::span<const std::uint8_t>;

// What a handshake is for; also the magic of its messages, so that a bootstrap exchange can
// never be mistaken for a link one.
enum class Purpose : std::uint32_t {
  kBootstrap = 0x544f4f42,  // "BOOT"
  kLink = 0x4b4e4c44,       // "DLNK"
};

struct Challenge {
  std::uint32_t magic;
  std::uint32_t version;
  Nonce nonce;
};
static_assert(sizeof(Challenge) == 40);

// Who the connector says it is; believed only once the MAC over it checks out.
struct Claim {
  std::int32_t rank;        // the connector's rank
  std::int32_t peer;        // the rank it means to reach (bootstrap: 0)
  std::int32_t world_size;  // its view of the job's size (links: 0, not checked)
  std::int32_t channel;     // links: the channel index; bootstrap: 0
  std::uint64_t tag;        // links: the communicator's tag; bootstrap: 0
  Nonce nonce;              // the connector's own challenge, answered in the Welcome
};
static_assert(sizeof(Claim) == 56);

struct Response {
  std::uint32_t magic;
  std::uint32_t version;
  Claim claim;
  Mac mac;
};
static_assert(sizeof(Response) == 96);

struct Welcome {
  std::uint32_t magic;
  std::uint32_t status;  // 0 = accepted
  Mac mac;
};
static_assert(sizeof(Welcome) == 40);

// Fresh random bytes from OpenSSL's CSPRNG (seeded by the OS). Throws dear::Error(kSystem).
[[nodiscard]] Nonce fresh_nonce();

[[nodiscard]] Challenge make_challenge(Purpose purpose);
[[nodiscard]] Mac connector_mac(Secret secret, Purpose purpose, const Nonce& listener_nonce,
                                const Claim& claim);
// The status (0 = accepted) is part of what the MAC covers, so a refusal cannot be forged.
[[nodiscard]] Mac listener_mac(Secret secret, Purpose purpose, const Claim& claim,
                               const Nonce& listener_nonce, std::uint32_t status = 0);
[[nodiscard]] Response make_response(Secret secret, Purpose purpose, const Challenge& challenge,
                                     const Claim& claim);
[[nodiscard]] Welcome make_welcome(Secret secret, Purpose purpose, const Claim& claim,
                                   const Nonce& listener_nonce, std::uint32_t status = 0);
// Constant-time equality of two MACs.
[[nodiscard]] bool same_mac(const Mac& a, const Mac& b);

// Outcome of checking bytes received during a handshake.
enum class Check : std::uint8_t {
  kOk,
  kIncomplete,    // a valid prefix; more bytes needed
  kNotDear,       // wrong magic: a scanner, or another protocol on this port
  kOtherVersion,  // a dear peer speaking another handshake version
  kBadMac,        // does not know the secret (another job on the same address?)
  kRefused,       // Welcome with a non-zero status
};
[[nodiscard]] std::string_view describe(Check c) noexcept;

// A listener's check of the first n bytes it received on a connection (n may be less than a
// Response, to reject garbage as soon as its first word arrives). On kOk, *out holds the
// verified response.
[[nodiscard]] Check check_response(const std::uint8_t* bytes, std::size_t n, Purpose purpose,
                                   const Nonce& sent, Secret secret, Response* out);
// A connector's check of the challenge it received (no secret involved yet).
[[nodiscard]] Check check_challenge(const std::uint8_t* bytes, std::size_t n, Purpose purpose,
                                    Challenge* out);
// A connector's check of the listener's proof, for the claim it sent and the challenge it got.
// A proven Welcome with a non-zero status is kRefused, its status stored in *status if given.
[[nodiscard]] Check check_welcome(const std::uint8_t* bytes, std::size_t n, Purpose purpose,
                                  Secret secret, const Claim& sent, const Nonce& listener_nonce,
                                  std::uint32_t* status = nullptr);

// What is wrong with a verified bootstrap claim for a job of world_size ranks (rank 0
// listening), or nullopt. A verified claim that is wrong comes from a rank of this very job that
// is misconfigured, so callers treat it as fatal rather than as a stranger to drop.
[[nodiscard]] std::optional<std::string> bootstrap_claim_problem(const Claim& c, int world_size);
// The same for a link claim arriving at self_rank, which expects `channels` channels from each
// of `peers` (the communicator tag is checked apart: a wrong one is a stale connection).
[[nodiscard]] std::optional<std::string> link_claim_problem(const Claim& c, int self_rank,
                                                            const std::vector<int>& peers,
                                                            int channels);

}  // namespace dear::transport::auth
