// What the engine's source files share and nobody else sees: the link roles, the channel
// tokens of control frames, the engine's limits, the LinkSink that routes a link's callbacks,
// and the one-line views of an operation printed in errors. The engine's parts are described
// in docs/architecture.md ("Progress engine").
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>

#include "collectives/engine.h"

namespace dear::collectives::engine_detail {

inline constexpr int kNext = 0;  // link to the next rank: forward data out, announcements in
inline constexpr int kPrev = 1;  // link to the previous rank: forward data in, announcements out
inline constexpr std::uint64_t kControlToken = std::numeric_limits<std::uint64_t>::max();
// A kPosted frame carrying a window (its payload lives in window_wire_ until it is sent).
inline constexpr std::uint64_t kWindowToken = kControlToken - 1;
// Announce every this many eager operations (large ones are always announced), so a sender
// running ahead learns how far the receiver has got without a frame per small operation.
inline constexpr std::uint64_t kAnnounceEvery = 16;
// A send queue is refilled only while it holds less than this many payload bytes, so that a
// newly posted high-priority operation waits behind at most this much.
inline constexpr std::size_t kQueueBytesPerChannel = 1024 * 1024;
inline constexpr std::size_t kQueueMessagesPerChannel = 32;
inline constexpr std::size_t kMaxUnexpectedBytes = 256 * 1024 * 1024;
inline constexpr std::size_t kMaxAbortText = 4096;
// How often the engine looks whether a device operation's input is ready.
inline constexpr std::chrono::microseconds kFencePoll{50};

// One rank's view of an operation, as printed in mismatch and timeout errors; the same text
// for a received header and for a local operation, so the two can be compared by eye
// (engine_failure.cc).
[[nodiscard]] std::string view_of(const transport::FrameHeader& h);
[[nodiscard]] std::string view_of(const Op& op);

}  // namespace dear::collectives::engine_detail

namespace dear::collectives {

// Routes a link's callbacks to the engine with the link's index (engine_dispatch.cc). A mesh
// link has one channel, whatever index its back-end gave it.
class Engine::LinkSink final : public transport::RecvSink {
 public:
  LinkSink(Engine& e, int link) : e_(e), link_(link), mesh_(link >= 2) {}
  transport::RecvTarget on_header(int channel, const transport::FrameHeader& h) override;
  void on_payload(int channel, const transport::FrameHeader& h, const char* data,
                  std::size_t offset, std::size_t len) override;
  void on_message(int channel, const transport::FrameHeader& h) override;
  void on_sent(int channel, std::uint64_t token) override;
  void on_closed(int channel) override;

 private:
  [[nodiscard]] int ch(int channel) const { return mesh_ ? 0 : channel; }
  Engine& e_;
  int link_;
  bool mesh_;
};

}  // namespace dear::collectives
