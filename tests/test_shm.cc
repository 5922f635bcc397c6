// The shared-memory transport's channels (transport/shm/), ranks as threads: messages both
// ways on every channel, streamed payloads handed over in whole aligned elements wherever the
// ring's end and earlier odd-sized messages put them, and a peer's close reported only after
// everything it sent. The collectives over it are the conformance suite's (shm.*) and a dead
// rank is the fault tests' (shm.Faults.*).
#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "channel_exchange.h"
#include "dear/bootstrap.h"
#include "transport/shm/shm_transport.h"
#include "transport/transport.h"

namespace dear::testing {
namespace {

using namespace std::chrono_literals;

// A mesh channel is channel 0 of its link, as the engine numbers them; exchange_with_peers
// numbers a rank's channels by their place in its list. This passes the place to the sink.
class Renumbered final : public transport::Channel {
 public:
  Renumbered(std::unique_ptr<transport::Channel> inner, int index)
      : inner_(std::move(inner)), index_(index) {}
  bool try_send(const transport::FrameHeader& h, const void* p, std::uint64_t token) override {
    return inner_->try_send(h, p, token);
  }
  std::size_t queued() const override { return inner_->queued(); }
  std::size_t queued_bytes() const override { return inner_->queued_bytes(); }
  bool progress(transport::RecvSink& sink, bool may_read) override {
    Sink s{sink, index_};
    return inner_->progress(s, may_read);
  }
  pollfd wait_spec() const override { return inner_->wait_spec(); }
  bool polled() const override { return inner_->polled(); }
  void close() override { inner_->close(); }
  bool closed() const override { return inner_->closed(); }
  std::string describe() const override { return inner_->describe(); }

 private:
  struct Sink final : transport::RecvSink {
    transport::RecvSink& to;
    int index;
    Sink(transport::RecvSink& t, int i) : to(t), index(i) {}
    transport::RecvTarget on_header(int, const transport::FrameHeader& h) override {
      return to.on_header(index, h);
    }
    void on_payload(int, const transport::FrameHeader& h, const char* d, std::size_t o,
                    std::size_t n) override {
      to.on_payload(index, h, d, o, n);
    }
    void on_message(int, const transport::FrameHeader& h) override { to.on_message(index, h); }
    void on_sent(int, std::uint64_t token) override { to.on_sent(index, token); }
    void on_closed(int) override { to.on_closed(index); }
  };
  std::unique_ptr<transport::Channel> inner_;
  int index_;
};

std::vector<std::unique_ptr<transport::Channel>> connect_shm(Bootstrap& bs,
                                                             const std::vector<int>& peers) {
  const transport::Transport& t = transport::find_transport("shm", bs.rank(), "test");
  transport::TransportOptions o;
  o.deadline = transport::deadline_after(std::chrono::milliseconds(20000));
  auto mesh = t.connect(bs, peers, o).mesh;
  std::vector<std::unique_ptr<transport::Channel>> out;
  for (std::size_t i = 0; i < mesh.size(); ++i) {
    out.push_back(std::make_unique<Renumbered>(std::move(mesh[i]), static_cast<int>(i)));
  }
  return out;
}

// Ranks 0 and 1 name one host, 2 and 3 another: each rank's channel to rank^1 is a
// shared-memory one, its channel to rank^2 stays TCP, and messages cross both.
TEST(Shm, RanksOnOtherHostsAreReachedOverTcp) {
  const auto failures = exchange_with_peers(4, [](Bootstrap& bs, const std::vector<int>& peers) {
    transport::TransportOptions o;
    o.deadline = transport::deadline_after(std::chrono::milliseconds(20000));
    const std::string host = bs.rank() < 2 ? "host-a" : "host-b";
    auto mesh = transport::shm::connect_links(bs, peers, o, host).mesh;
    std::vector<std::unique_ptr<transport::Channel>> out;
    for (std::size_t i = 0; i < mesh.size(); ++i) {
      const bool same = (peers[i] < 2) == (bs.rank() < 2);
      const std::string kind = mesh[i]->describe().substr(0, 4);
      if (kind != (same ? "shm " : "tcp ")) {
        throw std::runtime_error("channel to rank " + std::to_string(peers[i]) + " is '" +
                                 mesh[i]->describe() + "', want " + (same ? "shm" : "tcp"));
      }
      out.push_back(std::make_unique<Renumbered>(std::move(mesh[i]), static_cast<int>(i)));
    }
    return out;
  });
  for (std::size_t r = 0; r < failures.size(); ++r) EXPECT_EQ(failures[r], "") << "rank " << r;
}

TEST(Shm, ExchangesBothWaysOnEveryChannel) {
  const auto failures = exchange_with_peers(4, connect_shm);
  for (std::size_t r = 0; r < failures.size(); ++r) EXPECT_EQ(failures[r], "") << "rank " << r;
}

// What rank 0 sends rank 1: messages of random sizes, some of them odd, some larger than a
// ring, several rings' worth in all; every third one is streamed to the sink in elements of
// 2, 4, 8 or 16 bytes (the header's dtype says which).
struct Plan {
  struct Message {
    std::size_t bytes;
    std::size_t unit;  // 0: placed whole (kDirect)
  };
  std::vector<Message> messages;
  Plan() {
    std::mt19937 rng(20261207);
    const std::size_t units[] = {2, 4, 8, 16};
    for (int m = 0; m < 120; ++m) {
      const bool streamed = m % 3 == 0;
      const std::size_t unit = streamed ? units[rng() % 4] : 0;
      std::size_t bytes = rng() % 2 == 0 ? rng() % 300 : rng() % (3 << 20);
      if (streamed) bytes -= bytes % unit;
      messages.push_back({bytes, unit});
    }
  }
};

char byte_of(std::size_t m, std::size_t i) {
  return static_cast<char>((m * 41 + i * 7 + i / 251) & 0xff);
}

// Checks each piece of a streamed message as the engine's reductions need it, and every byte.
struct CheckingSink final : transport::RecvSink {
  const Plan& plan;
  std::size_t received = 0;
  std::vector<char> current;
  std::string failure;
  bool closed_early = false;
  std::size_t closed = 0;
  explicit CheckingSink(const Plan& p) : plan(p) {}
  transport::RecvTarget on_header(int, const transport::FrameHeader& h) override {
    current.assign(h.bytes, 0);
    const std::size_t unit = h.dtype;
    if (unit == 0) return {transport::RecvTarget::kDirect, current.data(), 1};
    return {transport::RecvTarget::kStream, nullptr, unit};
  }
  void on_payload(int, const transport::FrameHeader& h, const char* data, std::size_t offset,
                  std::size_t len) override {
    const std::size_t unit = h.dtype;
    const bool last = offset + len == h.bytes;
    if (offset % unit != 0 || (!last && len % unit != 0) ||
        reinterpret_cast<std::uintptr_t>(data) % unit != 0 || len == 0) {
      if (failure.empty()) {
        failure = "message " + std::to_string(h.seq) + ": piece at " + std::to_string(offset) +
                  " of " + std::to_string(len) + " bytes breaks elements of " +
                  std::to_string(unit);
      }
    }
    std::memcpy(current.data() + offset, data, len);
  }
  void on_message(int, const transport::FrameHeader& h) override {
    const auto m = static_cast<std::size_t>(h.seq);
    if (m != received && failure.empty()) failure = "message " + std::to_string(m) + " early";
    for (std::size_t i = 0; i < current.size() && failure.empty(); ++i) {
      if (current[i] != byte_of(m, i)) {
        failure = "message " + std::to_string(m) + ": byte " + std::to_string(i) + " wrong";
      }
    }
    ++received;
  }
  void on_sent(int, std::uint64_t) override {}
  void on_closed(int) override {
    ++closed;
    if (received != plan.messages.size()) closed_early = true;
  }
};

// Rank 0 sends the plan and closes; rank 1 checks every piece and byte, and hears of the close
// once, after the last message.
TEST(Shm, StreamedPiecesAreWholeAlignedElementsAndThePeersCloseComesLast) {
  const Plan plan;
  std::vector<std::vector<char>> payloads;
  for (std::size_t m = 0; m < plan.messages.size(); ++m) {
    std::vector<char> p(plan.messages[m].bytes);
    for (std::size_t i = 0; i < p.size(); ++i) p[i] = byte_of(m, i);
    payloads.push_back(std::move(p));
  }
  const UniqueId id = UniqueId::create("127.0.0.1");
  std::vector<std::string> failures(2);
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      std::string& failure = failures[static_cast<std::size_t>(r)];
      try {
        auto bs = Bootstrap::create(id, r, 2);
        auto chans = connect_shm(*bs, {1 - r});
        transport::Channel& ch = *chans.at(0);
        const auto deadline = std::chrono::steady_clock::now() + 60s;
        if (r == 0) {
          CollectSink sink(1);
          std::size_t next = 0;
          while (sink.sent < plan.messages.size()) {
            while (next < plan.messages.size()) {
              transport::FrameHeader h;
              h.bytes = static_cast<std::uint32_t>(plan.messages[next].bytes);
              h.dtype = static_cast<std::uint8_t>(plan.messages[next].unit);
              h.seq = next;
              if (!ch.try_send(h, payloads[next].data(), next)) break;
              ++next;
            }
            ch.progress(sink, true);
            if (std::chrono::steady_clock::now() > deadline) {
              failure = "timed out with " + std::to_string(sink.sent) + " sent";
              return;
            }
          }
          ch.close();
          return;
        }
        CheckingSink sink(plan);
        while (sink.closed == 0 && std::chrono::steady_clock::now() < deadline) {
          ch.progress(sink, true);
        }
        if (!sink.failure.empty()) {
          failure = sink.failure;
        } else if (sink.closed != 1 || sink.closed_early) {
          failure = "received " + std::to_string(sink.received) + " of " +
                    std::to_string(plan.messages.size()) + ", closes heard " +
                    std::to_string(sink.closed) + (sink.closed_early ? " (early)" : "");
        } else if (!ch.closed()) {
          failure = "the channel does not say it is closed";
        }
      } catch (const std::exception& e) {
        failure = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (std::size_t r = 0; r < failures.size(); ++r) EXPECT_EQ(failures[r], "") << "rank " << r;
}

}  // namespace
}  // namespace dear::testing
