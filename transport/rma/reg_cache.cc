#include "transport/rma/reg_cache.h"

#include <algorithm>
#include <limits>
#include <utility>

#include "dear/error.h"

namespace dear::transport::rma {
namespace {

std::uintptr_t end_of(std::uintptr_t b, std::size_t bytes) {
  // Ranges that would wrap the address space end at its top.
  return bytes > std::numeric_limits<std::uintptr_t>::max() - b
             ? std::numeric_limits<std::uintptr_t>::max()
             : b + bytes;
}

}  // namespace

RegistrationCache::RegistrationCache(std::size_t capacity) : capacity_(capacity) {
  if (capacity == 0) {
    throw Error(ErrorCode::kInvalidArgument, "RegistrationCache: capacity must be > 0");
  }
}

std::optional<RegistrationCache::Entry> RegistrationCache::lookup(const void* addr,
                                                                  std::size_t bytes) {
  const auto b = reinterpret_cast<std::uintptr_t>(addr);
  const auto e = end_of(b, bytes);
  auto it = entries_.upper_bound(b);  // first entry starting after b
  if (it == entries_.begin()) return std::nullopt;
  --it;  // the last entry starting at or before b; entries do not overlap, so the only one
  if (it->second.end < e || (bytes == 0 && it->second.end == b)) return std::nullopt;
  it->second.used = ++tick_;
  return Entry{it->first, it->second.end, it->second.handle};
}

void RegistrationCache::remove_overlapping(std::uintptr_t b, std::uintptr_t e,
                                           std::vector<std::uint64_t>& out) {
  auto it = entries_.upper_bound(b);
  if (it != entries_.begin()) {
    auto prev = std::prev(it);
    if (prev->second.end > b) it = prev;
  }
  while (it != entries_.end() && it->first < e) {
    out.push_back(it->second.handle);
    it = entries_.erase(it);
  }
}

std::vector<std::uint64_t> RegistrationCache::insert(const void* addr, std::size_t bytes,
                                                     std::uint64_t handle) {
  if (bytes == 0) {
    throw Error(ErrorCode::kInvalidArgument, "RegistrationCache::insert of an empty range");
  }
  const auto b = reinterpret_cast<std::uintptr_t>(addr);
  const auto e = end_of(b, bytes);
  std::vector<std::uint64_t> out;
  remove_overlapping(b, e, out);
  while (entries_.size() >= capacity_) {
    auto oldest = std::min_element(
        entries_.begin(), entries_.end(),
        [](const auto& x, const auto& y) { return x.second.used < y.second.used; });
    out.push_back(oldest->second.handle);
    entries_.erase(oldest);
  }
  entries_.emplace(b, Value{e, handle, ++tick_});
  return out;
}

std::vector<std::uint64_t> RegistrationCache::invalidate(const void* addr, std::size_t bytes) {
  std::vector<std::uint64_t> out;
  if (bytes == 0) return out;
  const auto b = reinterpret_cast<std::uintptr_t>(addr);
  remove_overlapping(b, end_of(b, bytes), out);
  return out;
}

std::vector<std::uint64_t> RegistrationCache::clear() {
  std::vector<std::uint64_t> out;
  out.reserve(entries_.size());
  for (const auto& [b, v] : entries_) out.push_back(v.handle);
  entries_.clear();
  return out;
}

RegistrationCache::Entry RegistrationCache::page_span(const void* addr, std::size_t bytes,
                                                      std::size_t page) {
  const auto b = reinterpret_cast<std::uintptr_t>(addr);
  const std::uintptr_t lo = b - b % page;
  std::uintptr_t hi = end_of(b, bytes);
  if (hi % page != 0) hi = end_of(hi - hi % page, page);
  return Entry{lo, hi, 0};
}

SendRegistrations::SendRegistrations(Release release) : release_(std::move(release)) {}

SendRegistrations::~SendRegistrations() { clear(); }

std::optional<std::uint64_t> SendRegistrations::find(const char* p, std::size_t n,
                                                     const Register& make) {
  if (const auto e = cache_.lookup(p, n)) return e->handle;
  if (failed_) return std::nullopt;
  const auto span = RegistrationCache::page_span(p, n);
  const auto* begin = reinterpret_cast<const void*>(span.begin);
  const std::optional<std::uint64_t> handle = make(begin, span.end - span.begin);
  if (!handle) {
    failed_ = true;
    return std::nullopt;
  }
  ++made_;
  for (const std::uint64_t h : cache_.insert(begin, span.end - span.begin, *handle)) {
    displaced_.push_back(h);
  }
  release_displaced();
  return handle;
}

void SendRegistrations::forget(const void* p, std::size_t n) {
  for (const std::uint64_t h : cache_.invalidate(p, n)) displaced_.push_back(h);
  release_displaced();
}

void SendRegistrations::release_later(std::uint64_t handle) {
  displaced_.push_back(handle);
  release_displaced();
}

void SendRegistrations::done() {
  if (--in_flight_ == 0) release_displaced();
}

void SendRegistrations::clear() {
  in_flight_ = 0;
  for (const std::uint64_t h : cache_.clear()) displaced_.push_back(h);
  release_displaced();
}

void SendRegistrations::release_displaced() {
  if (in_flight_ > 0) return;
  for (const std::uint64_t h : displaced_) release_(h);
  displaced_.clear();
}

std::optional<std::uint64_t> DeviceSources::find(const void* p, std::size_t n) const {
  const auto lo = reinterpret_cast<std::uintptr_t>(p);
  for (const Entry& e : entries_) {
    if (lo >= e.begin && lo + n <= e.end) return e.handle;
  }
  return std::nullopt;
}

bool DeviceSources::overlaps(const void* p, std::size_t n) const {
  if (p == nullptr || n == 0) return false;
  const auto lo = reinterpret_cast<std::uintptr_t>(p);
  return std::any_of(entries_.begin(), entries_.end(),
                     [&](const Entry& e) { return lo < e.end && lo + n > e.begin; });
}

void DeviceSources::add(const void* p, std::size_t n, std::uint64_t handle) {
  const auto lo = reinterpret_cast<std::uintptr_t>(p);
  entries_.push_back({lo, lo + n, handle});
}

void DeviceSources::forget(const void* p, std::size_t n, SendRegistrations& sends) {
  if (n == 0) return;
  const auto lo = reinterpret_cast<std::uintptr_t>(p);
  std::erase_if(entries_, [&](const Entry& e) {
    if (e.end <= lo || e.begin >= lo + n) return false;
    sends.release_later(e.handle);
    return true;
  });
}

std::vector<std::uint64_t> DeviceSources::take_all() {
  std::vector<std::uint64_t> out;
  out.reserve(entries_.size());
  for (const Entry& e : entries_) out.push_back(e.handle);
  entries_.clear();
  return out;
}

}  // namespace dear::transport::rma
