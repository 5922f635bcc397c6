#include "transport/rma/channel_core.h"

#include "transport/rma/slot_region.h"

namespace dear::transport::rma {

void check_channel_count(std::string_view transport, int channels, int rank) {
  if (channels < 1 || channels > kMaxChannels) {
    throw Error(ErrorCode::kInvalidArgument,
                std::string(transport) + ": channels=" + std::to_string(channels) +
                    " is outside [1, " + std::to_string(kMaxChannels) + "]",
                rank);
  }
}

void check_setup_deadline(std::string_view transport, Clock::time_point deadline, int rank) {
  if (Clock::now() >= deadline) {
    throw Error(ErrorCode::kTimeout, std::string(transport) + ": setup ran past its deadline",
                rank);
  }
}

ChannelCore::ChannelCore(const Params& p)
    : self_(p.self),
      peer_(p.peer),
      index_(p.index),
      tag_(p.tag),
      slot_bytes_(p.slot_bytes),
      slots_(p.slots),
      direct_min_(p.direct_min),
      write_max_(p.write_max),
      in_place_min_(p.in_place_min),
      iov_limit_(p.iov_limit),
      written_slots_(p.written),
      sendw_(p.slots),
      recvw_(p.slots, std::max<std::uint32_t>(1, p.slots / 2)),
      in_place_(p.slots + 1),
      reasm_(p.slot_bytes) {}

void ChannelCore::fail(const std::string& why) const {
  throw Error(ErrorCode::kPeerFailed, why + " on " + describe(), self_, peer_);
}

void ChannelCore::refuse_staged_device_memory(const FrameHeader& h, bool in_device) const {
  if (!in_device) return;
  throw Error(ErrorCode::kInvalidArgument,
              "a message of " + std::to_string(h.bytes) +
                  " bytes from registered device memory cannot be staged through the host on " +
                  describe() + "; send it with try_send_direct() into a window the peer opened",
              self_, peer_);
}

bool ChannelCore::queue(const FrameHeader& h, const void* payload, std::uint64_t token,
                        const std::optional<DirectTarget>& d) {
  if (sendq_.full()) return false;
  if (closed()) fail("send on a closed channel");
  sendq_.push(h, payload, token, d);
  return true;
}

bool ChannelCore::on_control(const Prefix& p) {
  if (auto bad = accept_credits(sendw_, p.credits, peer_)) fail(*bad);
  switch (p.kind) {
    case Kind::kCredit: return true;
    case Kind::kBye:
      peer_bye_ = true;
      bye_seq_ = p.seq;
      return true;
    case Kind::kData: break;
  }
  return false;
}

std::uint32_t ChannelCore::on_slot_written(std::uint32_t seq) {
  const std::uint32_t slot = seq % slots_;
  if (auto bad = accept_fragment(recvw_, seq, slot)) fail(*bad);
  return slot;
}

Prefix ChannelCore::slot_prefix(const char* base, std::uint32_t seq,
                                std::optional<std::size_t> written) {
  Prefix p;
  std::memcpy(&p, base, kPrefix);
  if (auto bad = check_written(p, seq, tag_, slot_bytes_, written)) fail(*bad);
  if (auto bad = accept_credits(sendw_, p.credits, peer_)) fail(*bad);
  return p;
}

Prefix ChannelCore::data_prefix(const SendQueue::Fragment& f) const {
  Prefix p;
  p.tag = tag_;
  p.seq = sendw_.next_seq();
  p.credits = recvw_.owed();
  p.bytes = f.bytes;
  p.kind = Kind::kData;
  p.first = f.first ? 1 : 0;
  return p;
}

Prefix ChannelCore::control_prefix(Kind kind, std::uint32_t seq, std::uint32_t credits) const {
  Prefix p;
  p.tag = tag_;
  p.seq = seq;
  p.credits = credits;
  p.kind = kind;
  return p;
}

void ChannelCore::took(bool with_prefix) {
  sendw_.take();
  if (with_prefix) recvw_.take_owed();
}

void ChannelCore::report(RecvSink& sink, std::optional<std::uint64_t> token) {
  if (!token) return;
  if (const auto sent = in_place_.finished(*token)) sink.on_sent(index_, *sent);
}

void ChannelCore::drop_queued() {
  sendq_.clear();
  in_place_.clear();
}

}  // namespace dear::transport::rma
