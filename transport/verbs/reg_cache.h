// Cache of memory registrations keyed by address range: registering memory with the NIC
// (ibv_reg_mr) pins pages and costs tens of microseconds or more, so a buffer used again is
// looked up instead of registered again.
//
// Pure bookkeeping: a handle is an opaque number (verbs_link.cc stores an ibv_mr*), and every
// handle the cache gives up (evicted, invalidated, cleared) is returned to the caller, who
// deregisters it. Entries never overlap: inserting a range evicts every entry it overlaps, so a
// lookup is one ordered-map search. Capacity is bounded; the least recently used entry goes
// first.
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
#include <map>
#include <optional>
#include <vector>

namespace dear::transport::verbs {

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

}  // namespace dear::transport::verbs
