// Cache of memory registrations keyed by address range: registering memory with the NIC
// (ibv_reg_mr) pins pages and costs tens of microseconds or more, so a buffer used again is
// looked up instead of registered again.
//
// Pure bookkeeping: a handle is an opaque number (a back-end stores its registration in it: an
// ibv_mr*, an fid_mr*), and every handle the cache gives up (evicted, invalidated, cleared) is
// returned to the caller, who deregisters it. Entries never overlap: inserting a range evicts every
// entry it overlaps, so a lookup is one ordered-map search. Capacity is bounded; the least recently
// used entry goes first.
//
// Invalidation is the caller's job: memory freed or reused through our API must be
// invalidated before the range is registered again, because a registration pins the old pages
// and a new allocation at the same address may sit on others. Entries handed out are not
// reference counted: do not invalidate a range while a work request uses it.
//
// Not thread-safe.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <vector>

namespace dear::transport::rma {

class RegistrationCache {
 public:
  struct Entry {
    std::uintptr_t begin = 0;  // [begin, end)
    std::uintptr_t end = 0;
    std::uint64_t handle = 0;
  };

  // `capacity` > 0 entries.
  explicit RegistrationCache(std::size_t capacity = 1024);

  // The entry whose range holds all of [addr, addr + bytes), or nullopt; marks it used.
  [[nodiscard]] std::optional<Entry> lookup(const void* addr, std::size_t bytes);
  // Records `handle` for [addr, addr + bytes) (bytes > 0). Returns the handles it displaced:
  // entries overlapping the range, and the least recently used ones beyond capacity.
  [[nodiscard]] std::vector<std::uint64_t> insert(const void* addr, std::size_t bytes,
                                                  std::uint64_t handle);
  // Forgets every entry overlapping [addr, addr + bytes); returns their handles.
  [[nodiscard]] std::vector<std::uint64_t> invalidate(const void* addr, std::size_t bytes);
  // Forgets everything; returns every handle.
  [[nodiscard]] std::vector<std::uint64_t> clear();

  [[nodiscard]] std::size_t size() const { return entries_.size(); }
  [[nodiscard]] std::size_t capacity() const { return capacity_; }

  // The page-aligned range around [addr, addr + bytes) that a registration should cover.
  [[nodiscard]] static Entry page_span(const void* addr, std::size_t bytes,
                                       std::size_t page = 4096);

 private:
  struct Value {
    std::uintptr_t end;
    std::uint64_t handle;
    std::uint64_t used;  // tick of the last lookup or insert
  };
  // Removes entries overlapping [b, e) into `out`.
  void remove_overlapping(std::uintptr_t b, std::uintptr_t e, std::vector<std::uint64_t>& out);

  std::size_t capacity_;
  std::uint64_t tick_ = 0;
  std::map<std::uintptr_t, Value> entries_;  // by begin
};

// The registrations of callers' memory that a back-end sends from without copying (fabric's
// in-place fragments, the payload writes of direct messages): one per page span around what
// was asked for, cached (RegistrationCache) and looked up after. A registration the cache gives
// up (displaced, evicted, forgotten) may still be read by a send in flight, so it is released
// only once no send of this cache's owner is (hold() and done() count them). Once a
// registration has failed, later misses fail at once: the caller copies instead.
class SendRegistrations {
 public:
  // Registers [begin, begin + bytes) for the adapter to read; the handle, or nullopt.
  using Register =
      std::function<std::optional<std::uint64_t>(const void* begin, std::size_t bytes)>;
  using Release = std::function<void(std::uint64_t handle)>;

  explicit SendRegistrations(Release release);
  ~SendRegistrations();
  SendRegistrations(const SendRegistrations&) = delete;
  SendRegistrations& operator=(const SendRegistrations&) = delete;

  // The handle of a registration holding [p, p + n), made through `make` when there is none;
  // nullopt when it cannot be made.
  [[nodiscard]] std::optional<std::uint64_t> find(const char* p, std::size_t n,
                                                  const Register& make);
  // The memory [p, p + n) is about to be freed or reused: registrations overlapping it leave
  // the cache (released now, or once no send is in flight).
  void forget(const void* p, std::size_t n);
  // Releases `handle`, a registration of the caller's own, as the cache's are: now, or once no
  // send is in flight.
  void release_later(std::uint64_t handle);
  // A send reading registered memory was handed over; done() once it completed.
  void hold() { ++in_flight_; }
  void done();
  // Releases every registration now, in flight or not (the back-end's resources go away).
  void clear();
  // Registrations made so far (for tests).
  [[nodiscard]] std::uint64_t made() const { return made_; }

 private:
  void release_displaced();

  Release release_;
  RegistrationCache cache_;
  std::vector<std::uint64_t> displaced_;
  std::uint64_t in_flight_ = 0;
  std::uint64_t made_ = 0;
  bool failed_ = false;
};

// Device memory registered as a source of direct messages (Channel::register_device_source),
// by range and never evicted: a message from it cannot fall back to a staged copy, which the
// CPU would have to read. Kept until forgotten, then released through the owner's
// SendRegistrations once no send reads it. The bookkeeping the back-ends with remote writes
// (libfabric, ibverbs) share; not thread-safe.
class DeviceSources {
 public:
  // The handle of the registration holding [p, p + n), if any.
  [[nodiscard]] std::optional<std::uint64_t> find(const void* p, std::size_t n) const;
  // True when [p, p + n) overlaps a registration.
  [[nodiscard]] bool overlaps(const void* p, std::size_t n) const;
  void add(const void* p, std::size_t n, std::uint64_t handle);
  // The memory [p, p + n) is about to be freed or reused: registrations overlapping it leave,
  // handed to `sends` (SendRegistrations::release_later).
  void forget(const void* p, std::size_t n, SendRegistrations& sends);
  // Every handle, for the back-end to release as its resources go away; empties it.
  [[nodiscard]] std::vector<std::uint64_t> take_all();

 private:
  struct Entry {
    std::uintptr_t begin = 0;
    std::uintptr_t end = 0;
    std::uint64_t handle = 0;
  };
  std::vector<Entry> entries_;
};

}  // namespace dear::transport::rma
