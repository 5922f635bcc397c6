#include "transport/rma/window_registrations.h"

#include <utility>

namespace dear::transport::rma {

WindowRegistrations::WindowRegistrations(std::size_t entries, Release release)
    : release_(std::move(release)), cache_(entries) {}

WindowRegistrations::~WindowRegistrations() { clear(); }

std::optional<WindowRegistrations::Opened> WindowRegistrations::open(char* base, std::size_t bytes,
                                                                     const Register& make) {
  if (base == nullptr || bytes == 0) return std::nullopt;
  Opened o;
  if (const auto e = cache_.lookup(base, bytes)) {
    o.key = e->handle;
    o.begin = e->begin;
  } else {
    const std::optional<Made> m = make(base, bytes);
    if (!m) return std::nullopt;
    if (!by_key_.emplace(m->key, Held{m->handle}).second) {
      release_(m->handle);
      return std::nullopt;
    }
    ++made_;
    o.key = m->key;
    o.begin = reinterpret_cast<std::uintptr_t>(base);
    for (const std::uint64_t k : cache_.insert(base, bytes, m->key)) uncache(k);
  }
  ++by_key_.at(o.key).open;
  return o;
}

void WindowRegistrations::close(std::uint64_t key) {
  const auto it = by_key_.find(key);
  if (it == by_key_.end() || it->second.open == 0) return;
  if (--it->second.open == 0 && !it->second.cached) {
    release_(it->second.handle);
    by_key_.erase(it);
  }
}

void WindowRegistrations::uncache(std::uint64_t key) {
  const auto it = by_key_.find(key);
  if (it == by_key_.end()) return;
  it->second.cached = false;
  if (it->second.open == 0) {
    release_(it->second.handle);
    by_key_.erase(it);
  }
}

void WindowRegistrations::forget(const void* p, std::size_t n) {
  if (n == 0) return;
  for (const std::uint64_t k : cache_.invalidate(p, n)) uncache(k);
}

void WindowRegistrations::clear() {
  (void)cache_.clear();
  for (const auto& [key, h] : by_key_) release_(h.handle);
  by_key_.clear();
}

}  // namespace dear::transport::rma
