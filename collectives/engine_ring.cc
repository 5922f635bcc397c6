// The step machine of the schedules on the ring links (ring, gather_reduce, bi_gather and
// the chain broadcast, ops.h): each turn it queues on every channel the messages whose
// receives they forward have completed, highest priority first, until the channel's queue
// holds enough. Their receives are placed by the dispatcher (target_for), bounced sends go
// through send slots (engine_exec.cc).
#include "collectives/engine.h"
#include "collectives/engine_internal.h"
#include "collectives/steps.h"

namespace dear::collectives {

using engine_detail::kQueueBytesPerChannel;
using engine_detail::kQueueMessagesPerChannel;
using transport::FrameHeader;

bool Engine::schedule_sends() {
  bool moved = false;
  // Direction d sends on link d: forward to the next rank, backward to the previous one.
  for (int d = 0; d < 2; ++d) {
    moved |= schedule_sends(d);
  }
  moved |= pump_slot_sends();
  moved |= send_window_credits();
  if (links_.size() > 2) moved |= advance_log_steps();
  return moved;
}

bool Engine::schedule_sends(int dir) {
  bool moved = false;
  const auto di = static_cast<std::size_t>(dir);
  auto& chans = links_[dir];
  for (std::size_t c = 0; c < chans.size(); ++c) {
    transport::Channel& ch = *chans[c];
    if (ch.closed()) continue;
    for (auto& holder : active_) {
      Op& op = *holder;
      if (static_cast<int>(c) >= op.ring.channels) continue;
      const std::uint32_t total = op.ring.messages_sent_per_channel(dir);
      std::uint32_t& next = op.ring.send_next[di][c];
      if (next >= total || !may_send(op)) continue;
      // Only a running operation sends: a starting one waits for its start copies.
      if (op.life() != OpState::kRunning) continue;
      if (op.bounced) {
        moved |= pack_sends(op, dir, static_cast<int>(c));
        continue;
      }
      while (next < total && ch.queued() < kQueueMessagesPerChannel &&
             ch.queued_bytes() < kQueueBytesPerChannel) {
        // Forwarding: message `next` carries what receive `next - dep_lag` brought.
        const auto lag = static_cast<std::uint32_t>(op.ring.dep_lag);
        if (op.ring.forwards && next >= lag && op.ring.recv_done[di][c] <= next - lag) break;
        const MessagePlan m = send_plan(op, dir, static_cast<int>(c), next);
        const FrameHeader h = data_frame(op, next, m.span.bytes);
        const std::int64_t at =
            dir == kForward && op.ring.has_peer_window ? direct_offset(op, m) : std::int64_t{-1};
        const char* src = send_source(op, m);
        const bool queued = at >= 0 ? ch.try_send_to(h, src, op.seq, op.ring.peer_window,
                                                     static_cast<std::size_t>(at))
                                    : ch.try_send(h, src, op.seq);
        if (!queued) break;
        ++next;
        moved = true;
      }
      if (ch.queued() >= kQueueMessagesPerChannel || ch.queued_bytes() >= kQueueBytesPerChannel) {
        break;
      }
    }
  }
  return moved;
}

}  // namespace dear::collectives
