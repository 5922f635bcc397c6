// The engine's receive dispatcher: where each arriving frame goes. A data frame of an
// operation in flight is placed by its schedule (ring slices by target_for, log-step messages
// by log_step_target); one of an operation not posted here yet is kept as unexpected and
// replayed when it is posted; kPosted frames move the flow-control window and carry direct
// placement windows; kAbort frames fail the communicator. Also the windows this rank opens,
// the links' progress each turn, and what a closed link means for the operations in flight.
#include <poll.h>

#include <algorithm>
#include <cstring>

#include "collectives/engine.h"
#include "collectives/engine_internal.h"
#include "collectives/steps.h"

namespace dear::collectives {

using engine_detail::kControlToken;
using engine_detail::kMaxAbortText;
using engine_detail::kMaxUnexpectedBytes;
using engine_detail::kNext;
using engine_detail::kPrev;
using engine_detail::kWindowToken;
using engine_detail::view_of;
using transport::FrameHeader;
using transport::FrameType;
using transport::RecvTarget;

RecvTarget Engine::LinkSink::on_header(int channel, const FrameHeader& h) {
  return e_.on_header(link_, ch(channel), h);
}

void Engine::LinkSink::on_payload(int channel, const FrameHeader&, const char* data,
                                  std::size_t offset, std::size_t len) {
  e_.on_payload(link_, ch(channel), data, offset, len);
}

void Engine::LinkSink::on_message(int channel, const FrameHeader& h) {
  e_.on_message(link_, ch(channel), h);
}

void Engine::LinkSink::on_sent(int channel, std::uint64_t token) {
  e_.on_sent(link_, ch(channel), token);
}

void Engine::LinkSink::on_closed(int channel) { e_.on_closed(link_, ch(channel)); }

void Engine::open_window(Op& op) {
  // This rank's window for what the previous rank sends it, announced with the operation.
  if (links_[kPrev].empty() || links_[kPrev][0]->closed()) return;
  const DirectRegion r = direct_region(op);
  if (op.bounced) {
    (void)open_device_window(op);
  } else if (r.bytes > 0) {
    if (auto w = links_[kPrev][0]->open_window(r.base, r.bytes, r.message_bytes)) {
      op.ring.window = *w;
      op.ring.window_open = true;
      windows_to_announce_.emplace_back(op.seq, *w);
    }
  }
  // The next rank may have announced its window before this rank posted the operation.
  if (const auto it = peer_windows_.find(op.seq); it != peer_windows_.end()) {
    op.ring.peer_window = it->second;
    op.ring.has_peer_window = true;
    peer_windows_.erase(it);
  }
}

std::size_t Engine::window_ring_bytes(int link) const {
  return links_[static_cast<std::size_t>(link)].size() *
         static_cast<std::size_t>(cfg_.landing_slots) * kDeviceSliceBytes;
}

bool Engine::open_device_window(Op& op) {
  const DirectRegion r = device_window_region(op);
  if (r.bytes == 0 || r.message_bytes > kDeviceSliceBytes || windows_refused_) return false;
  transport::Channel& ch = *links_[kPrev][0];
  const int device = op.device ? (op.fence ? op.fence->device() : 0) : -1;
  if (!ch.takes_device_windows(device)) {
    windows_refused_ = true;  // landing slots in host memory, as over TCP
    return false;
  }
  // The ring, made once and kept: the link's registration of it is reused by every window.
  if (window_ring_ < 0) {
    window_ring_ = acquire_shadow_buffer(*op.exec, window_ring_bytes(kPrev), ExecMemory::kLinked);
    device_window_bytes_.store(shadow_buffers_[static_cast<std::size_t>(window_ring_)].capacity,
                               std::memory_order_relaxed);
  }
  const ShadowBuffer& ring = shadow_buffers_[static_cast<std::size_t>(window_ring_)];
  if (ring.owner != op.exec) return false;  // another executor's (tests mixing them)
  const auto w =
      ch.open_device_window(ring.data, window_ring_bytes(kPrev), r.message_bytes, ring.linked);
  if (!w) {
    windows_refused_ = true;
    return false;
  }
  op.ring.window = *w;
  op.ring.window_open = true;
  op.ring.device_window = true;
  op.ring.landing = ring.data;
  windows_to_announce_.emplace_back(op.seq, *w);
  return true;
}

void Engine::close_window(Op& op) noexcept {
  // Before the operation completes: once the caller has its memory back, no peer may write
  // there (the peer writes only into windows of operations in flight; a back-end may keep the
  // registration cached for the next operation on that memory).
  if (!op.ring.window_open) return;
  op.ring.window_open = false;
  try {
    links_[kPrev][0]->close_window(op.ring.window);
  } catch (...) {
    // Closing a registration does not fail in a way that could be acted on here.
  }
}

void Engine::flush_links() {
  // Only sends: the sockets were read a moment ago, in this turn's progress_links().
  for (std::size_t l = 0; l < links_.size(); ++l) {
    for (auto& ch : links_[l]) {
      if (!ch->closed() && ch->queued() > 0) ch->progress(*sinks_[l], false);
    }
  }
}

bool Engine::progress_links() {
  // One poll() tells which channels have something to read, instead of a read attempt on
  // every channel each turn: on a small operation those system calls are the latency.
  // Channels that move data only when asked (polled(): libfabric's manual progress) are
  // progressed every turn anyway, so they stay out of it, and with only such channels there
  // is no system call at all.
  ready_fds_.clear();
  bool any = false;
  for (std::size_t l = 0; l < links_.size(); ++l) {
    for (auto& ch : links_[l]) {
      pollfd p{-1, 0, 0};  // poll() skips it and leaves revents 0
      if (!ch->polled()) {
        p = ch->wait_spec();
        p.events = POLLIN;
        any = any || p.fd >= 0;
      }
      ready_fds_.push_back(p);
    }
  }
  if (any && ::poll(ready_fds_.data(), ready_fds_.size(), 0) < 0) {
    for (auto& p : ready_fds_) p.revents = POLLIN;  // unknown: try them all
  }
  bool moved = false;
  std::size_t i = 0;
  for (std::size_t l = 0; l < links_.size(); ++l) {
    for (std::size_t c = 0; c < links_[l].size(); ++c) {
      auto& ch = links_[l][c];
      // A channel whose landing slots are all waiting for their steps is not read: its
      // messages wait in the transport (back-pressure) until a slot is free again.
      const bool ready = (ch->polled() || ready_fds_[i].revents != 0) &&
                         !landing_full(static_cast<int>(l), static_cast<int>(c));
      ++i;
      if (!ch->closed() && (ready || ch->queued() > 0)) {
        moved |= ch->progress(*sinks_[l], ready);
      }
    }
  }
  return moved;
}

RecvTarget Engine::on_header(int link, int channel, const FrameHeader& h) {
  RecvCtx& ctx = recv_ctx_[link][static_cast<std::size_t>(channel)];
  ctx = RecvCtx{};
  const int peer = peer_of(link);
  switch (h.type) {
    case FrameType::kPosted:
      // With a window (from the next rank only: it receives this rank's kForward messages).
      if (h.bytes == sizeof(transport::Window) && link == kNext) {
        return {RecvTarget::kDirect, reinterpret_cast<char*>(&window_in_), 1};
      }
      if (h.bytes != 0) break;
      return {RecvTarget::kDiscard, nullptr, 1};
    case FrameType::kAbort: {
      auto& text = abort_text_[link];
      text.assign(std::min<std::size_t>(h.bytes, kMaxAbortText), '\0');
      if (h.bytes > kMaxAbortText) return {RecvTarget::kDiscard, nullptr, 1};
      return {RecvTarget::kDirect, text.data(), 1};
    }
    case FrameType::kData: {
      Op* op = find(h.seq);
      if (op != nullptr) {
        if (link >= 2) return log_step_target(*op, link, h, ctx);
        return target_for(*op, 1 - link, channel, h, ctx);
      }
      if (static_cast<std::int64_t>(h.seq) <= posted_) {
        throw Error(ErrorCode::kMismatch,
                    "received a slice of operation #" + std::to_string(h.seq) + " (" + view_of(h) +
                        ") from rank " + std::to_string(peer) +
                        " after this rank had finished it: the ranks disagree about that "
                        "operation's size or schedule",
                    cfg_.rank, peer, call_name(static_cast<OpKind>(h.kind & 0x0f), h.root),
                    static_cast<std::int64_t>(h.seq));
      }
      // Not posted here yet: an eager slice that ran ahead. Keep it until the op is posted.
      unexpected_bytes_ += h.bytes;
      if (unexpected_bytes_ > kMaxUnexpectedBytes) {
        throw Error(ErrorCode::kMismatch,
                    "rank " + std::to_string(peer) + " sent more than " +
                        std::to_string(kMaxUnexpectedBytes >> 20) +
                        " MiB for operations this rank has not issued (are the ranks issuing "
                        "the same operations?)",
                    cfg_.rank, peer);
      }
      if (spare_unexpected_.empty()) spare_unexpected_.emplace_back();
      unexpected_.splice(unexpected_.end(), spare_unexpected_, std::prev(spare_unexpected_.end()));
      Unexpected& u = unexpected_.back();
      u.header = h;
      u.link = link;
      u.channel = channel;
      u.complete = false;
      u.data.resize(h.bytes);
      ctx.pending = &u;
      return {RecvTarget::kDirect, u.data.data(), 1};
    }
    case FrameType::kP2pData:
    case FrameType::kP2pReady:
    case FrameType::kP2pRequest:
      if (link >= 2) return p2p_target(link, h, ctx);
      break;  // only on the mesh links
    case FrameType::kCredit:
      if (link == kNext && h.bytes == 0) return {RecvTarget::kDiscard, nullptr, 1};
      break;
    case FrameType::kConsumed: break;  // the TCP channel's own; never reaches the engine
  }
  throw Error(ErrorCode::kPeerFailed,
              "protocol violation: unexpected frame type " +
                  std::to_string(static_cast<int>(h.type)) + " from rank " + std::to_string(peer),
              cfg_.rank, peer);
}

void Engine::check_header(const Op& op, int peer, const FrameHeader& h) const {
  if (h.kind != kind_byte(op) || h.count != op.user_count || h.root != op.root ||
      (op.kind != OpKind::kBarrier && h.dtype != static_cast<std::uint8_t>(op.dtype)) ||
      ((op.kind == OpKind::kAllReduce || op.kind == OpKind::kReduceScatter) &&
       h.redop != static_cast<std::uint8_t>(op.redop))) {
    throw Error(ErrorCode::kMismatch,
                "operation #" + std::to_string(op.seq) + " differs between ranks: rank " +
                    std::to_string(peer) + " has " + view_of(h) + ", rank " +
                    std::to_string(cfg_.rank) + " has " + view_of(op),
                cfg_.rank, peer, op.name(), static_cast<std::int64_t>(op.seq));
  }
}

RecvTarget Engine::target_for(Op& op, int dir, int channel, const FrameHeader& h, RecvCtx& ctx) {
  const int peer = peer_of(1 - dir);
  const auto di = static_cast<std::size_t>(dir);
  if (is_log_step(op.schedule)) {
    throw Error(ErrorCode::kMismatch,
                "a ring slice of operation #" + std::to_string(op.seq) + " arrived from rank " +
                    std::to_string(peer) + " but this rank runs it as " + view_of(op),
                cfg_.rank, peer, op.name(), static_cast<std::int64_t>(op.seq));
  }
  check_header(op, peer, h);
  const auto c = static_cast<std::size_t>(channel);
  if (channel >= op.ring.channels || h.index != op.ring.recv_next[di][c] ||
      h.index >= op.ring.messages_received_per_channel(dir)) {
    throw Error(ErrorCode::kMismatch,
                "slice " + std::to_string(h.index) + " of " + view_of(op) + " arrived on channel " +
                    std::to_string(channel) + " from rank " + std::to_string(peer) +
                    " where slice " + std::to_string(op.ring.recv_next[di][c]) +
                    " was expected: the ranks use different channel or slice settings",
                cfg_.rank, peer, op.name(), static_cast<std::int64_t>(op.seq));
  }
  const MessagePlan m = recv_plan(op, dir, channel, h.index);
  if (m.span.bytes != h.bytes) {
    throw Error(ErrorCode::kMismatch,
                "slice " + std::to_string(h.index) + " from rank " + std::to_string(peer) +
                    " has " + std::to_string(h.bytes) + " bytes, this rank expects " +
                    std::to_string(m.span.bytes) +
                    ": the ranks use different channel or slice settings",
                cfg_.rank, peer, op.name(), static_cast<std::int64_t>(op.seq));
  }
  const RecvPlace p = recv_place(op, m);
  ctx.op = &op;
  ctx.dir = dir;
  ctx.dst = p.dst;
  ctx.other = p.other;
  ctx.final = p.final;
  ctx.reduce = p.other != nullptr;
  if (op.ring.device_window && dir == kForward) {
    // Written by the previous rank into this channel's next slot of the ring (the windowed
    // messages of a channel take its slots in turn, on both ends); the step reads it there.
    if (h.bytes > kDeviceSliceBytes) {
      throw Error(ErrorCode::kInternal,
                  "a windowed message of " + std::to_string(h.bytes) + " bytes, more than a slot",
                  cfg_.rank, peer, op.name(), static_cast<std::int64_t>(op.seq));
    }
    const std::uint64_t n = window_received_[c]++;
    char* at = op.ring.landing +
               (c * static_cast<std::size_t>(cfg_.landing_slots) +
                static_cast<std::size_t>(n % static_cast<std::uint64_t>(cfg_.landing_slots))) *
                   kDeviceSliceBytes;
    device_window_messages_.fetch_add(1, std::memory_order_relaxed);
    const int s = borrow_slot(op, 1 - dir, channel, at);
    Slot& slot = slots_[static_cast<std::size_t>(s)];
    slot.step = ctx.reduce ? reduce_step(op, ctx, p.dst, at, p.other, h.bytes / op.el)
                           : copy_step(p.dst, at, h.bytes);
    ctx.slot = s;
    return {RecvTarget::kDirect, at, 1};
  }
  // A bounced operation's receives, and a reduction whose step completes later, land in a
  // slot; the step is issued once the payload is in (arrive).
  if (op.bounced || (ctx.reduce && !op.exec->immediate())) {
    const int s = acquire_slot(op, 1 - dir, channel, h.bytes, false);
    Slot& slot = slots_[static_cast<std::size_t>(s)];
    slot.step = ctx.reduce ? reduce_step(op, ctx, p.dst, slot.data, p.other, h.bytes / op.el)
                           : copy_step(p.dst, slot.data, h.bytes);
    ctx.slot = s;
    return {RecvTarget::kDirect, slot.data, 1};
  }
  if (ctx.reduce) return {RecvTarget::kStream, nullptr, op.el};
  return {RecvTarget::kDirect, p.dst, 1};
}

void Engine::on_payload(int link, int channel, const char* data, std::size_t offset,
                        std::size_t len) {
  RecvCtx& ctx = recv_ctx_[link][static_cast<std::size_t>(channel)];
  Op& op = *ctx.op;
  // Streamed only for an immediate executor: the piece is reduced before this returns.
  op.exec->issue(reduce_step(op, ctx, ctx.dst + offset, data, ctx.other + offset, len / op.el), 0);
}

void Engine::on_message(int link, int channel, const FrameHeader& h) {
  RecvCtx& ctx = recv_ctx_[link][static_cast<std::size_t>(channel)];
  if (h.type == FrameType::kP2pData || h.type == FrameType::kP2pReady ||
      h.type == FrameType::kP2pRequest) {
    p2p_arrived(link, h, ctx);
    return;
  }
  if (h.type == FrameType::kCredit) {
    auto& credit = window_credit_[static_cast<std::size_t>(channel)];
    credit = std::max(credit, h.count);
    return;
  }
  if (h.type == FrameType::kPosted) {
    peer_posted_ = std::max(peer_posted_, static_cast<std::int64_t>(h.seq));
    if (h.bytes == sizeof(transport::Window)) {
      if (Op* op = find(h.seq)) {
        op->ring.peer_window = window_in_;
        op->ring.has_peer_window = true;
      } else if (static_cast<std::int64_t>(h.seq) > posted_) {
        peer_windows_[h.seq] = window_in_;
      }
    }
    return;
  }
  if (h.type == FrameType::kAbort) {
    const int blame = h.root >= 0 && h.root < cfg_.size ? h.root : peer_of(link);
    // Mismatches and timeouts keep their kind as they travel around the ring (a timeout must
    // stay recognisable for the hand-back below); anything else is the peer's failure.
    const auto code =
        h.count == static_cast<std::uint64_t>(ErrorCode::kMismatch)  ? ErrorCode::kMismatch
        : h.count == static_cast<std::uint64_t>(ErrorCode::kTimeout) ? ErrorCode::kTimeout
                                                                     : ErrorCode::kPeerFailed;
    std::string text(abort_text_[link].data(), abort_text_[link].size());
    if (h.count == static_cast<std::uint64_t>(ErrorCode::kTimeout) && blame == cfg_.rank &&
        !active_.empty()) {
      // A neighbour gave up waiting for this rank, which is alive and waiting itself: pass on
      // this rank's own view, so the blame moves towards the rank that really is stuck.
      throw timeout_error(*active_.front(), "rank " + std::to_string(peer_of(link)) +
                                                " timed out waiting for this rank; ");
    }
    throw Error(code, "rank " + std::to_string(peer_of(link)) + " reported: " + text, cfg_.rank,
                blame);
  }
  if (ctx.op != nullptr && ctx.step >= 0) {
    ctx.op->log_step.step_state[static_cast<std::size_t>(ctx.step)] |= LogStepState::kStepReceived;
  } else if (ctx.op != nullptr) {
    arrive(*ctx.op, link, channel, ctx);
  } else if (ctx.pending != nullptr) {
    // Stored whole now. Its operation may have been posted while the payload was arriving:
    // then it is placed at once (a partial one is never replayed).
    ctx.pending->complete = true;
    if (Op* op = find(h.seq)) replay_unexpected(*op);
  }
  ctx = RecvCtx{};
}

void Engine::replay_unexpected(Op& op) {
  for (auto it = unexpected_.begin(); it != unexpected_.end();) {
    // An incomplete one (its channel is still reading the payload into it) is the last of its
    // channel; it is replayed when it completes.
    if (it->header.seq != op.seq || !it->complete) {
      ++it;
      continue;
    }
    RecvCtx ctx;
    if (it->link >= 2) {
      const RecvTarget t = log_step_target(op, it->link, it->header, ctx);
      if (it->header.bytes > 0) std::memcpy(t.dst, it->data.data(), it->header.bytes);
      op.log_step.step_state[static_cast<std::size_t>(ctx.step)] |= LogStepState::kStepReceived;
      unexpected_bytes_ -= it->header.bytes;
      it = recycle_unexpected(it);
      continue;
    }
    const int dir = 1 - it->link;
    const RecvTarget t = target_for(op, dir, it->channel, it->header, ctx);
    if (t.mode == RecvTarget::kDirect) {
      // Into its destination, or the landing slot whose step arrive() issues.
      if (it->header.bytes > 0) std::memcpy(t.dst, it->data.data(), it->header.bytes);
    } else {
      op.exec->issue(
          reduce_step(op, ctx, ctx.dst, it->data.data(), ctx.other, it->header.bytes / op.el), 0);
    }
    arrive(op, it->link, it->channel, ctx);
    unexpected_bytes_ -= it->header.bytes;
    it = recycle_unexpected(it);
  }
}

std::list<Engine::Unexpected>::iterator Engine::recycle_unexpected(
    std::list<Unexpected>::iterator it) {
  const auto next = std::next(it);
  spare_unexpected_.splice(spare_unexpected_.end(), unexpected_, it);
  return next;
}

void Engine::on_sent(int link, int channel, std::uint64_t token) {
  if (token == kControlToken) return;
  if (token == kWindowToken) {
    // Frames of one channel are sent in the order queued.
    if (!window_wire_.empty()) window_wire_.pop_front();
    return;
  }
  if (is_p2p_token(token)) {
    p2p_sent(link, token);
    return;
  }
  if (link < 2 && is_slot_token(token)) {
    slot_sent(link, channel, token);
    return;
  }
  if (link >= 2) {
    // Mesh sends carry (sequence, step).
    Op* op = find(token >> 8);
    if (op != nullptr) {
      op->log_step.step_state[static_cast<std::size_t>(token & 0xff)] |=
          LogStepState::kStepSendDone;
      --op->log_step.sends_in_flight;
    }
    return;
  }
  Op* op = find(token);
  // Link l carries the sends of direction l.
  if (op != nullptr)
    ++op->ring.send_done[static_cast<std::size_t>(link)][static_cast<std::size_t>(channel)];
}

void Engine::on_closed(int link, int channel) {
  // A peer that finished its part and destroyed its communicator closes cleanly; that is an
  // error only for an operation that still needs this link.
  for (const auto& holder : active_) check_link_needed(*holder, link, channel);
  if (link >= 2 && !p2p_.empty()) {
    const int peer = peer_of(link);
    const PeerP2p& p = p2p_[static_cast<std::size_t>(peer)];
    if (!p.sends.empty() || !p.recvs.empty()) {
      throw Error(ErrorCode::kPeerFailed,
                  "rank " + std::to_string(peer) + " closed its link with " +
                      std::to_string(p.sends.size()) + " send(s) and " +
                      std::to_string(p.recvs.size()) + " receive(s) to it pending",
                  cfg_.rank, peer, p.sends.empty() ? "recv" : "send");
    }
  }
}

void Engine::check_link_needed(const Op& op, int link, int channel) {
  bool needs = false;
  if (is_log_step(op.schedule)) {
    if (link < 2) return;
    const int peer = peer_of(link);
    for (std::size_t k = 0; k < op.log_step.plan.steps.size(); ++k) {
      const Step& s = op.log_step.plan.steps[k];
      const std::uint8_t st = op.log_step.step_state[k];
      needs = needs || (s.send_peer == peer && (st & LogStepState::kStepSendDone) == 0) ||
              (s.recv_peer == peer && (st & LogStepState::kStepReceived) == 0);
    }
  } else {
    if (link >= 2 || channel >= op.ring.channels) return;
    // A link carries the sends of direction `link` and the receives of the other direction.
    const auto i = static_cast<std::size_t>(channel);
    const auto send_dir = static_cast<std::size_t>(link);
    const auto recv_dir = static_cast<std::size_t>(1 - link);
    needs = op.ring.send_done[send_dir][i] < op.ring.messages_sent_per_channel(link) ||
            op.ring.recv_next[recv_dir][i] < op.ring.messages_received_per_channel(1 - link);
  }
  if (!needs) return;
  const int peer = peer_of(link);
  throw Error(ErrorCode::kPeerFailed,
              "connection to rank " + std::to_string(peer) + " (channel " +
                  std::to_string(channel) + ")" +
                  " is closed but this operation still needs it: that rank exited, crashed or "
                  "destroyed its communicator early; " +
                  describe_progress(op),
              cfg_.rank, peer, op.name(), static_cast<std::int64_t>(op.seq));
}

}  // namespace dear::collectives
