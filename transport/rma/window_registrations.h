// The registrations behind the windows a receiver opens for its peers' direct writes
// (Channel::open_window, transport/link.h), kept for reuse: the bookkeeping every back-end with
// remote writes (libfabric, ibverbs) shares, unit tested here without a network.
//
// Registering memory for remote access pins it and costs tens of microseconds or more on the
// providers that need it, so the registration of a window stays after the window closes,
// cached by address range: the next operation on the same buffer (a training step's gradients)
// finds it. A registration is
// - open while any window on it is (a peer may be writing into it), and never released then;
// - cached until the cache gives it up: evicted as the least recently used of `entries`,
//   displaced by an overlapping range, or forgotten (Communicator::forget_memory: the memory
//   is about to be freed or reused);
// - released (by the back-end's `release`) once it is neither.
// Registrations are told apart by their remote key, which is what a closing window names.
//
// Not thread-safe: one engine thread owns it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <unordered_map>

#include "transport/rma/reg_cache.h"

namespace dear::transport::rma {

class WindowRegistrations {
 public:
  // What a back-end made for [base, base + bytes): its own handle (an fid_mr*, an ibv_mr*)
  // and the remote key peers write with.
  struct Made {
    std::uint64_t handle = 0;
    std::uint64_t key = 0;
  };
  // Registers [base, base + bytes) for remote writes; nullopt when it cannot.
  using Register = std::function<std::optional<Made>(char* base, std::size_t bytes)>;
  using Release = std::function<void(std::uint64_t handle)>;

  // An open window's registration: its key, and the first byte it covers (at or before the
  // window's base, when a cached registration of a larger range serves it).
  struct Opened {
    std::uint64_t key = 0;
    std::uintptr_t begin = 0;
  };

  // `entries` > 0 cached registrations at most (open ones beyond it are released on close).
  WindowRegistrations(std::size_t entries, Release release);
  ~WindowRegistrations();
  WindowRegistrations(const WindowRegistrations&) = delete;
  WindowRegistrations& operator=(const WindowRegistrations&) = delete;

  // Opens a window on [base, base + bytes) (bytes > 0): a cached registration holding the
  // range, else one made through `make`. nullopt when `make` fails, or when it hands out a key
  // that an open or cached registration already has (which it then releases): the sender then
  // goes through slots.
  [[nodiscard]] std::optional<Opened> open(char* base, std::size_t bytes, const Register& make);
  // Closes one window opened on the registration with `key`; unknown keys and registrations
  // with no open window are ignored.
  void close(std::uint64_t key);
  // The memory [p, p + n) is about to be freed or reused: registrations overlapping it leave
  // the cache (released now, or when their last window closes).
  void forget(const void* p, std::size_t n);
  // Releases everything, open or not (the back-end's resources are going away).
  void clear();

  // Registrations made through open() so far (for tests: a reused one is not made again).
  [[nodiscard]] std::uint64_t made() const { return made_; }
  // Registrations held now, open or cached.
  [[nodiscard]] std::size_t held() const { return by_key_.size(); }

 private:
  struct Held {
    std::uint64_t handle = 0;
    int open = 0;        // windows on it now
    bool cached = true;  // false once the cache gave it up
  };
  // The cache gave up the registration with `key`.
  void uncache(std::uint64_t key);

  Release release_;
  std::unordered_map<std::uint64_t, Held> by_key_;
  RegistrationCache cache_;  // ranges -> keys
  std::uint64_t made_ = 0;
};

}  // namespace dear::transport::rma
