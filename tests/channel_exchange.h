// Checks any back-end's connect_peers() must pass, shared by the transports' tests (ranks as
// threads in one process): exchange_with_peers, messages both ways on every channel, and
// write_into_window, a direct write into a window the receiver opened.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <future>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "dear/bootstrap.h"
#include "transport/link.h"

namespace dear::testing {

// Records what arrives on a set of channels: each message's payload, by channel.
struct CollectSink final : transport::RecvSink {
  std::vector<std::vector<std::vector<char>>> got;  // [channel][message] payload
  std::vector<std::vector<char>> current;           // [channel] the message being received
  std::size_t sent = 0;
  std::size_t closed = 0;
  explicit CollectSink(std::size_t channels) : got(channels), current(channels) {}
  transport::RecvTarget on_header(int channel, const transport::FrameHeader& h) override {
    auto& buf = current[static_cast<std::size_t>(channel)];
    buf.assign(h.bytes, 0);
    return {transport::RecvTarget::kDirect, buf.data(), 1};
  }
  void on_payload(int, const transport::FrameHeader&, const char*, std::size_t,
                  std::size_t) override {}
  void on_message(int channel, const transport::FrameHeader&) override {
    const auto c = static_cast<std::size_t>(channel);
    got[c].push_back(std::move(current[c]));
  }
  void on_sent(int, std::uint64_t) override { ++sent; }
  void on_closed(int) override { ++closed; }
};

// Byte i of message m from rank `from` to rank `to`.
inline char peer_byte(int from, int to, int m, std::size_t i) {
  return static_cast<char>((from * 131 + to * 31 + m * 7 + static_cast<int>(i % 251)) & 0xff);
}

using ConnectPeers = std::function<std::vector<std::unique_ptr<transport::Channel>>(
    Bootstrap&, const std::vector<int>&)>;

// Each rank joined to rank^1 and rank^2 (the links of recursive doubling) sends messages of
// several sizes (one spanning many staging slots) on every channel, both ways at once, and
// checks every byte it receives and on which channel it arrives.
// Runs the exchange over `n` ranks (a power of two, at least 4) joined by `connect`. Returns
// each rank's failure, "" where it passed.
inline std::vector<std::string> exchange_with_peers(int n, const ConnectPeers& connect) {
  using namespace std::chrono_literals;
  const std::vector<std::size_t> sizes = {0, 1, 4096, 300007};
  const UniqueId id = UniqueId::create("127.0.0.1");
  std::vector<std::string> failures(static_cast<std::size_t>(n));
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      std::string& failure = failures[static_cast<std::size_t>(r)];
      try {
        auto bs = Bootstrap::create(id, r, n);
        const std::vector<int> peers = {r ^ 1, r ^ 2};
        auto chans = connect(*bs, peers);
        if (chans.size() != peers.size()) {
          failure = "got " + std::to_string(chans.size()) + " channels";
          return;
        }
        std::vector<std::vector<std::vector<char>>> out(peers.size());
        for (std::size_t c = 0; c < peers.size(); ++c) {
          for (std::size_t m = 0; m < sizes.size(); ++m) {
            std::vector<char> p(sizes[m]);
            for (std::size_t i = 0; i < p.size(); ++i) {
              p[i] = peer_byte(r, peers[c], static_cast<int>(m), i);
            }
            out[c].push_back(std::move(p));
          }
        }
        CollectSink sink(peers.size());
        // Each channel: the messages, then (once everything from the peer is in) an
        // acknowledgement, so no rank closes before its peers have all it sent.
        std::vector<std::size_t> next(peers.size(), 0);
        std::vector<bool> acked(peers.size(), false);
        std::vector<bool> ack_sent(peers.size(), false);
        const auto deadline = std::chrono::steady_clock::now() + 20s;
        for (;;) {
          bool done = true;
          for (std::size_t c = 0; c < peers.size(); ++c) {
            auto& ch = *chans[c];
            while (next[c] < sizes.size()) {
              transport::FrameHeader h;
              h.bytes = static_cast<std::uint32_t>(sizes[next[c]]);
              h.seq = next[c];
              if (!ch.try_send(h, out[c][next[c]].data(), next[c])) break;
              ++next[c];
            }
            const bool all_in = sink.got[c].size() >= sizes.size();
            if (all_in && !ack_sent[c]) {
              transport::FrameHeader h;
              h.type = transport::FrameType::kPosted;
              h.seq = 1000;
              ack_sent[c] = ch.try_send(h, nullptr, 1000);
            }
            ch.progress(sink, true);
            acked[c] = sink.got[c].size() > sizes.size();
            done = done && next[c] == sizes.size() && ack_sent[c] && acked[c];
          }
          // Every message, the acknowledgements included, is reported sent exactly once.
          if (done && sink.sent == peers.size() * (sizes.size() + 1)) break;
          if (sink.sent > peers.size() * (sizes.size() + 1)) {
            failure = std::to_string(sink.sent) + " messages reported sent, " +
                      std::to_string(peers.size() * (sizes.size() + 1)) + " queued";
            return;
          }
          if (std::chrono::steady_clock::now() > deadline) {
            failure = "timed out: " + std::to_string(sink.sent) + " reported sent; received";
            for (std::size_t c = 0; c < peers.size(); ++c) {
              failure += " " + std::to_string(sink.got[c].size()) + " from rank " +
                         std::to_string(peers[c]);
            }
            return;
          }
          std::this_thread::yield();
        }
        for (std::size_t c = 0; c < peers.size(); ++c) {
          for (std::size_t m = 0; m < sizes.size(); ++m) {
            const auto& g = sink.got[c][m];
            if (g.size() != sizes[m]) {
              failure = "message " + std::to_string(m) + " from rank " + std::to_string(peers[c]) +
                        " has " + std::to_string(g.size()) + " bytes, want " +
                        std::to_string(sizes[m]);
              return;
            }
            for (std::size_t i = 0; i < g.size(); ++i) {
              if (g[i] != peer_byte(peers[c], r, static_cast<int>(m), i)) {
                failure = "message " + std::to_string(m) + " from rank " +
                          std::to_string(peers[c]) + ": byte " + std::to_string(i) + " wrong";
                return;
              }
            }
          }
          const std::string described = chans[c]->describe();
          if (described.find("rank " + std::to_string(peers[c])) == std::string::npos) {
            failure = "channel " + std::to_string(c) + " does not name rank " +
                      std::to_string(peers[c]) + ": " + described;
            return;
          }
        }
        for (auto& ch : chans) ch->close();
      } catch (const std::exception& e) {
        failure = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  return failures;
}

// Places each message at `base` + its header's index (where the sender names the window).
struct PlaceAtIndexSink final : transport::RecvSink {
  char* base = nullptr;
  std::size_t received = 0;
  std::size_t sent = 0;
  transport::RecvTarget on_header(int, const transport::FrameHeader& h) override {
    return {transport::RecvTarget::kDirect, base + h.index, 1};
  }
  void on_payload(int, const transport::FrameHeader&, const char*, std::size_t,
                  std::size_t) override {}
  void on_message(int, const transport::FrameHeader&) override { ++received; }
  void on_sent(int, std::uint64_t) override { ++sent; }
  void on_closed(int) override {}
};

// The memory write_into_window() works on: host memory by default; a GPUDirect check gives
// device memory. `make` returns memory holding `bytes` (freed with the pointer), `read` copies
// `n` bytes at `p` back to the host, `open` opens the receiver's window (Channel::open_window
// or open_device_window), `source` prepares the sender's message memory for sending (false:
// it could not). `small`: also send a message small enough to be staged, which only host
// memory can receive.
struct WindowMemory {
  std::function<std::shared_ptr<char>(const std::vector<char>& bytes)> make =
      [](const std::vector<char>& bytes) {
        auto p = std::shared_ptr<char>(new char[bytes.size()], std::default_delete<char[]>());
        std::copy(bytes.begin(), bytes.end(), p.get());
        return p;
      };
  std::function<std::vector<char>(const char* p, std::size_t n)> read =
      [](const char* p, std::size_t n) { return std::vector<char>(p, p + n); };
  std::function<std::optional<transport::Window>(transport::Channel&, char* base, std::size_t bytes,
                                                 std::size_t message_bytes)>
      open = [](transport::Channel& ch, char* base, std::size_t bytes, std::size_t message_bytes) {
        return ch.open_window(base, bytes, message_bytes);
      };
  std::function<bool(transport::Channel&, const char* p, std::size_t n)> source =
      [](transport::Channel&, const char*, std::size_t) { return true; };
  bool small = true;
};

// A check any back-end with direct writes (Channel::open_window, try_send_to) must pass, ranks
// as threads: rank 1 opens a window on its memory for messages of `large` bytes and hands it
// to rank 0, which names it for a message of `large` bytes (written directly, in several
// writes where the back-end was given a smaller write size) and, with `memory.small`, one of
// 100 bytes (through slots whatever the window), each at its own offset; rank 1 places each
// where it was named, then checks every byte of its memory: the messages where they belong,
// the rest untouched. `connect` gives each rank one channel to the other. Returns each rank's
// failure, "" where it passed.
inline std::vector<std::string> write_into_window(const ConnectPeers& connect, std::size_t large,
                                                  const WindowMemory& memory = {}) {
  using namespace std::chrono_literals;
  constexpr std::size_t kLargeAt = 1000;
  constexpr std::size_t kSmall = 100;
  const std::size_t small_at = kLargeAt + large + 333;
  const std::size_t window_bytes = small_at + kSmall + 4096;
  constexpr char kUntouched = 0x11;
  std::vector<char> large_msg(large);
  std::vector<char> small_msg(kSmall);
  for (std::size_t i = 0; i < large; ++i) large_msg[i] = peer_byte(0, 1, 0, i);
  for (std::size_t i = 0; i < kSmall; ++i) small_msg[i] = peer_byte(0, 1, 1, i);
  const std::shared_ptr<char> dst = memory.make(std::vector<char>(window_bytes, kUntouched));
  const std::shared_ptr<char> large_src = memory.make(large_msg);
  const std::size_t messages = memory.small ? 2 : 1;
  std::promise<std::optional<transport::Window>> opened;
  std::shared_future<std::optional<transport::Window>> window = opened.get_future().share();
  std::atomic<bool> received{false};
  const UniqueId id = UniqueId::create("127.0.0.1");
  std::vector<std::string> failures(2);
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      std::string& failure = failures[static_cast<std::size_t>(r)];
      bool told = false;  // rank 1: the window (or its absence) handed over
      try {
        auto bs = Bootstrap::create(id, r, 2);
        auto chans = connect(*bs, {1 - r});
        transport::Channel& ch = *chans.at(0);
        PlaceAtIndexSink sink;
        sink.base = dst.get();
        const auto deadline = std::chrono::steady_clock::now() + 20s;
        const auto until = [&](auto&& done, const std::string& what) {
          while (!done()) {
            ch.progress(sink, true);
            if (std::chrono::steady_clock::now() > deadline) {
              throw std::runtime_error("timed out waiting for " + what);
            }
            std::this_thread::yield();
          }
        };
        if (r == 1) {
          const auto w = memory.open(ch, dst.get(), window_bytes, large);
          opened.set_value(w);
          told = true;
          if (!w) throw std::runtime_error("the channel refused to open a window");
          until([&] { return sink.received == messages; }, "the messages");
          ch.close_window(*w);
          received = true;
          const std::vector<char> got = memory.read(dst.get(), window_bytes);
          for (std::size_t i = 0; i < got.size(); ++i) {
            char want = kUntouched;
            if (i >= kLargeAt && i < kLargeAt + large) want = large_msg[i - kLargeAt];
            if (memory.small && i >= small_at && i < small_at + kSmall) {
              want = small_msg[i - small_at];
            }
            if (got[i] != want) {
              failure = "window byte " + std::to_string(i) + " wrong";
              break;
            }
          }
        } else {
          const std::optional<transport::Window> w = window.get();
          if (!w) return;  // rank 1 says why
          const auto send = [&](std::uint64_t seq, const char* msg, std::size_t n, std::size_t at) {
            transport::FrameHeader h;
            h.bytes = static_cast<std::uint32_t>(n);
            h.seq = seq;
            h.index = static_cast<std::uint32_t>(at);
            until([&] { return ch.try_send_to(h, msg, seq, *w, at); }, "room to send");
          };
          if (!memory.source(ch, large_src.get(), large)) {
            throw std::runtime_error("the channel refused the message's memory as a source");
          }
          send(0, large_src.get(), large, kLargeAt);
          if (memory.small) send(1, small_msg.data(), kSmall, small_at);
          until([&] { return sink.sent == messages; }, "the messages to be reported sent");
          // The writes may need this side's progress until the receiver has them.
          until([&] { return received.load(); }, "the receiver");
        }
        ch.close();
      } catch (const std::exception& e) {
        failure = e.what();
        if (r == 1 && !told) opened.set_value(std::nullopt);
        if (r == 1) received = true;
      }
    });
  }
  for (auto& t : threads) t.join();
  return failures;
}

}  // namespace dear::testing
