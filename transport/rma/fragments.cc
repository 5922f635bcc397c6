#include "transport/rma/fragments.h"

#include <algorithm>
#include <cstring>

#include "dear/error.h"

namespace dear::transport::rma {
namespace {
constexpr std::size_t kHeader = sizeof(FrameHeader);
}  // namespace

void SendQueue::push(const FrameHeader& h, const void* payload, std::uint64_t token,
                     const std::optional<DirectTarget>& direct) {
  if (full()) throw Error(ErrorCode::kInternal, "SendQueue::push on a full queue");
  queue_[(head_ + count_) % kCapacity] = {h, static_cast<const char*>(payload), token,
                                          direct.has_value(), direct.value_or(DirectTarget{})};
  ++count_;
  bytes_ += h.bytes;
}

const DirectTarget* SendQueue::direct() const {
  if (empty()) throw Error(ErrorCode::kInternal, "SendQueue::direct on an empty queue");
  const Pending& m = queue_[head_];
  return m.direct ? &m.target : nullptr;
}

void SendQueue::drop_direct() {
  if (empty() || head_started_) {
    throw Error(ErrorCode::kInternal, "SendQueue::drop_direct on a message already started");
  }
  queue_[head_].direct = false;
}

SendQueue::Fragment SendQueue::fill_direct_header(char* dst, std::uint64_t write_bytes) const {
  if (empty() || head_started_ || direct() == nullptr || write_bytes == 0) {
    throw Error(ErrorCode::kInternal, "SendQueue::fill_direct_header: no direct message to start");
  }
  const Pending& m = queue_[head_];
  std::memcpy(dst, &m.header, kHeader);
  const DirectInfo info{m.target.local, write_bytes};
  std::memcpy(dst + kHeader, &info, sizeof(info));
  return {static_cast<std::uint32_t>(kHeader + sizeof(info)), true};
}

SendQueue::Piece SendQueue::piece(std::size_t most) const {
  if (empty()) throw Error(ErrorCode::kInternal, "SendQueue::piece on an empty queue");
  const Pending& m = queue_[head_];
  Piece p;
  p.first = !head_started_;
  p.bytes = std::min<std::size_t>(most, m.header.bytes - head_offset_);
  p.data = m.payload + head_offset_;
  return p;
}

std::optional<std::uint64_t> SendQueue::commit_direct(std::size_t payload_bytes) {
  return advance(payload_bytes);
}

SendQueue::Fragment SendQueue::fill(char* dst, std::size_t room) const {
  if (empty()) throw Error(ErrorCode::kInternal, "SendQueue::fill on an empty queue");
  if (room <= kHeader) throw Error(ErrorCode::kInternal, "SendQueue::fill: no room for payload");
  const Pending& m = queue_[head_];
  Fragment f;
  f.first = !head_started_;
  if (f.first) {
    std::memcpy(dst, &m.header, kHeader);
    dst += kHeader;
    room -= kHeader;
  }
  const std::size_t take = std::min<std::size_t>(room, m.header.bytes - head_offset_);
  if (take > 0) std::memcpy(dst, m.payload + head_offset_, take);
  f.bytes = static_cast<std::uint32_t>((f.first ? kHeader : 0) + take);
  return f;
}

SendQueue::Piece SendQueue::peek(std::size_t room) const {
  if (empty()) throw Error(ErrorCode::kInternal, "SendQueue::peek on an empty queue");
  if (room <= kHeader) throw Error(ErrorCode::kInternal, "SendQueue::peek: no room for payload");
  const Pending& m = queue_[head_];
  Piece p;
  p.first = !head_started_;
  if (p.first) room -= kHeader;
  p.bytes = std::min<std::size_t>(room, m.header.bytes - head_offset_);
  p.data = p.bytes > 0 ? m.payload + head_offset_ : nullptr;
  return p;
}

SendQueue::Fragment SendQueue::fill_header(char* dst, std::size_t room) const {
  const Piece p = peek(room);
  if (p.first) std::memcpy(dst, &queue_[head_].header, kHeader);
  Fragment f;
  f.first = p.first;
  f.bytes = static_cast<std::uint32_t>((p.first ? kHeader : 0) + p.bytes);
  return f;
}

SendQueue::Piece SendQueue::message() const {
  if (empty()) throw Error(ErrorCode::kInternal, "SendQueue::message on an empty queue");
  const Pending& m = queue_[head_];
  return {m.payload, m.header.bytes, !head_started_};
}

std::optional<std::uint64_t> SendQueue::commit(const Fragment& f) {
  return advance(f.bytes - (f.first ? kHeader : 0));
}

std::optional<std::uint64_t> SendQueue::advance(std::size_t payload_bytes) {
  const Pending& m = queue_[head_];
  const bool was_started = head_started_;
  head_started_ = true;
  head_offset_ += payload_bytes;
  // A direct message's first fragment carries no payload, so it never ends one (a message of
  // 0 bytes is never direct).
  if (head_offset_ < m.header.bytes || (m.direct && !was_started)) return std::nullopt;
  const std::uint64_t token = m.token;
  bytes_ -= m.header.bytes;
  head_ = (head_ + 1) % kCapacity;
  --count_;
  head_offset_ = 0;
  head_started_ = false;
  return token;
}

void SendQueue::clear() {
  head_ = 0;
  count_ = 0;
  bytes_ = 0;
  head_offset_ = 0;
  head_started_ = false;
}

bool send_in_place(std::size_t piece_bytes, std::size_t min_bytes, std::size_t iov_limit) {
  return min_bytes > 0 && piece_bytes >= min_bytes && iov_limit >= 2;
}

InPlaceSends::InPlaceSends(std::uint32_t capacity) : records_(capacity) {
  if (capacity == 0) throw Error(ErrorCode::kInvalidArgument, "InPlaceSends: capacity must be > 0");
  free_.reserve(capacity);
  for (std::uint32_t i = capacity; i-- > 0;) free_.push_back(i);
}

std::uint32_t InPlaceSends::posted() {
  if (current_ == kNone) {
    if (free_.empty()) {
      throw Error(ErrorCode::kInternal,
                  "InPlaceSends: more fragments outstanding than its capacity");
    }
    current_ = free_.back();
    free_.pop_back();
    records_[current_] = Record{};
  }
  ++records_[current_].outstanding;
  return current_;
}

std::optional<std::uint64_t> InPlaceSends::finished(std::uint64_t token) {
  const std::uint32_t id = current_;
  current_ = kNone;
  if (id == kNone) return token;
  Record& r = records_[id];
  if (r.outstanding == 0) {
    free_.push_back(id);
    return token;
  }
  r.token = token;
  r.finished = true;
  ++held_;
  return std::nullopt;
}

std::optional<std::uint64_t> InPlaceSends::completed(std::uint32_t id) {
  if (id >= records_.size() || records_[id].outstanding == 0) {
    throw Error(ErrorCode::kInternal, "InPlaceSends: completion of an unknown fragment");
  }
  Record& r = records_[id];
  if (--r.outstanding > 0 || !r.finished) return std::nullopt;
  free_.push_back(id);
  --held_;
  return r.token;
}

void InPlaceSends::clear() {
  free_.clear();
  for (auto i = static_cast<std::uint32_t>(records_.size()); i-- > 0;) free_.push_back(i);
  current_ = kNone;
  held_ = 0;
}

Reassembler::Reassembler(std::size_t max_body)
    : bounce_(static_cast<char*>(
          std::aligned_alloc(kMaxUnit, (max_body + kMaxUnit - 1) / kMaxUnit * kMaxUnit))) {
  if (!bounce_) throw Error(ErrorCode::kSystem, "out of memory for a receive bounce buffer");
}

std::optional<std::string> Reassembler::on_fragment(RecvSink& sink, int channel, const char* body,
                                                    std::size_t n, bool first) {
  if (!in_msg_) {
    if (!first || n < kHeader) return "protocol violation: a message starts mid-message";
    std::memcpy(&current_, body, kHeader);
    body += kHeader;
    n -= kHeader;
    in_msg_ = true;
    done_ = 0;
    delivered_ = 0;
    carry_n_ = 0;
    target_ = sink.on_header(channel, current_);
    if (target_.unit == 0) target_.unit = 1;
    if (target_.mode == RecvTarget::kStream && target_.unit > carry_.size()) {
      return "stream unit of " + std::to_string(target_.unit) + " bytes is not supported";
    }
  } else if (first) {
    return "protocol violation: a message starts inside another";
  } else if (direct_) {
    return "protocol violation: a slot fragment inside a direct message";
  }
  if (n > current_.bytes - done_) {
    return "protocol violation: more payload than the header's " + std::to_string(current_.bytes) +
           " bytes";
  }
  payload(sink, channel, body, n);
  if (done_ == current_.bytes) {
    if (target_.mode == RecvTarget::kStream && carry_n_ > 0) {
      sink.on_payload(channel, current_, carry_.data(), delivered_, carry_n_);
      carry_n_ = 0;
    }
    in_msg_ = false;
    sink.on_message(channel, current_);
  }
  return std::nullopt;
}

std::optional<std::string> Reassembler::on_direct_header(RecvSink& sink, int channel,
                                                         const char* body, std::size_t n,
                                                         std::size_t* write_bytes) {
  if (in_msg_) return "protocol violation: a message starts inside another";
  if (n != kHeader + sizeof(DirectInfo)) {
    return "protocol violation: a direct message's first fragment holds " + std::to_string(n) +
           " bytes";
  }
  DirectInfo info;
  std::memcpy(&current_, body, kHeader);
  std::memcpy(&info, body + kHeader, sizeof(info));
  if (current_.bytes == 0 || info.write_bytes == 0) {
    return "protocol violation: a direct message of " + std::to_string(current_.bytes) +
           " bytes in writes of " + std::to_string(info.write_bytes);
  }
  in_msg_ = true;
  direct_ = true;
  done_ = 0;
  delivered_ = 0;
  carry_n_ = 0;
  target_ = sink.on_header(channel, current_);
  if (target_.mode != RecvTarget::kDirect ||
      reinterpret_cast<std::uint64_t>(target_.dst) != info.local) {
    return "protocol violation: the peer wrote a message of " + std::to_string(current_.bytes) +
           " bytes (operation #" + std::to_string(current_.seq) + ", slice " +
           std::to_string(current_.index) + ") directly where this rank does not place it";
  }
  *write_bytes = static_cast<std::size_t>(info.write_bytes);
  return std::nullopt;
}

std::optional<std::string> Reassembler::on_placed(RecvSink& sink, int channel, std::size_t n) {
  if (!in_msg_ || !direct_ || n > current_.bytes - done_) {
    return "protocol violation: a direct write outside a direct message";
  }
  done_ += n;
  if (done_ == current_.bytes) {
    in_msg_ = false;
    direct_ = false;
    sink.on_message(channel, current_);
  }
  return std::nullopt;
}

void Reassembler::payload(RecvSink& sink, int channel, const char* data, std::size_t n) {
  const std::size_t total = n;
  switch (target_.mode) {
    case RecvTarget::kDirect:
      if (n > 0) std::memcpy(target_.dst + done_, data, n);
      break;
    case RecvTarget::kDiscard: break;
    case RecvTarget::kStream: {
      // Pieces must be whole units starting at unit-aligned addresses; fragment bodies are
      // multiples of 32 bytes into the slot, so the carry is only used for units that do not
      // divide that, and the bounce buffer for slots that are not aligned to the unit.
      const std::size_t unit = target_.unit;
      if (carry_n_ > 0) {
        const std::size_t k = std::min(unit - carry_n_, n);
        std::memcpy(carry_.data() + carry_n_, data, k);
        carry_n_ += k;
        data += k;
        n -= k;
        if (carry_n_ == unit) {
          sink.on_payload(channel, current_, carry_.data(), delivered_, unit);
          delivered_ += unit;
          carry_n_ = 0;
        }
      }
      const std::size_t whole = n - n % unit;
      if (whole > 0) {
        const char* piece = data;
        if (reinterpret_cast<std::uintptr_t>(data) % unit != 0) {
          std::memcpy(bounce_.get(), data, whole);
          piece = bounce_.get();
        }
        sink.on_payload(channel, current_, piece, delivered_, whole);
        delivered_ += whole;
      }
      if (n > whole) {
        std::memcpy(carry_.data() + carry_n_, data + whole, n - whole);
        carry_n_ += n - whole;
      }
      break;
    }
  }
  done_ += total;
}

std::optional<std::string> accept_credits(SendWindow& w, std::uint32_t credits, int peer) {
  if (w.on_returned(credits)) return std::nullopt;
  return "protocol violation: rank " + std::to_string(peer) + " returned " +
         std::to_string(credits) + " credits with only " + std::to_string(w.unacknowledged()) +
         " outstanding";
}

std::optional<std::string> accept_fragment(RecvWindow& w, std::uint32_t seq, std::uint32_t buffer) {
  if (w.arrived(seq, buffer)) return std::nullopt;
  return "protocol violation: fragment " + std::to_string(seq) +
         " outside the receive window (next expected " + std::to_string(w.expected()) + ")";
}

void check_slot_options(std::string_view transport, std::size_t slot_bytes, std::uint32_t slots,
                        int rank) {
  const std::string name(transport);
  if (slots < 2 || slots > 1024) {
    throw Error(ErrorCode::kInvalidArgument,
                name + ": slots=" + std::to_string(slots) + " is outside [2, 1024]", rank);
  }
  // Fragment seq lives in slot seq % slots; across the wrap of the 32-bit sequence numbers
  // consecutive fragments keep distinct slots only when slots divides 2^32.
  if ((slots & (slots - 1)) != 0) {
    throw Error(ErrorCode::kInvalidArgument,
                name + ": slots=" + std::to_string(slots) + " is not a power of two", rank);
  }
  if (slot_bytes < 1024 || slot_bytes > (64U << 20) || slot_bytes % 64 != 0) {
    throw Error(ErrorCode::kInvalidArgument,
                name + ": slot_bytes=" + std::to_string(slot_bytes) +
                    " must be a multiple of 64 in [1 KiB, 64 MiB]",
                rank);
  }
}

}  // namespace dear::transport::rma
