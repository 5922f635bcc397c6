// The step machine of the log-step schedules (recursive doubling, halving-doubling and the
// binomial tree, steps.h) on the mesh links: each operation's steps run one after another,
// a step's send leaving once the steps before it are complete and the step completing once
// its receive has arrived and been applied; an arriving message is placed by its tag.
#include <cstring>

#include "collectives/engine.h"
#include "collectives/engine_internal.h"
#include "collectives/steps.h"

namespace dear::collectives {

using engine_detail::kQueueMessagesPerChannel;
using engine_detail::view_of;
using transport::FrameHeader;
using transport::RecvTarget;

int Engine::mesh_link(int peer) const {
  const int l = peer >= 0 && peer < cfg_.size ? link_of_peer_[static_cast<std::size_t>(peer)] : -1;
  if (l < 0) {
    throw Error(ErrorCode::kInternal,
                "no mesh link to rank " + std::to_string(peer) + " for a log-step schedule",
                cfg_.rank, peer);
  }
  return l;
}

bool Engine::advance_log_steps() {
  bool moved = false;
  for (auto& holder : active_) {
    if (is_log_step(holder->schedule) && holder->life() == OpState::kRunning) {
      moved |= advance_log_steps(*holder);
    }
  }
  return moved;
}

bool Engine::advance_log_steps(Op& op) {
  // Steps run one after another (steps.h): a step's send leaves once the steps before it are
  // complete, and the step completes when its receive has arrived and is applied.
  bool moved = false;
  auto& steps = op.log_step.plan.steps;
  while (op.log_step.step_next < steps.size()) {
    const std::size_t k = op.log_step.step_next;
    const Step& s = steps[k];
    std::uint8_t& st = op.log_step.step_state[k];
    if (s.send_peer >= 0 && (st & LogStepState::kStepSent) == 0) {
      if (!may_send(op)) break;
      transport::Channel& ch = *links_[static_cast<std::size_t>(mesh_link(s.send_peer))][0];
      if (ch.closed() || ch.queued() >= kQueueMessagesPerChannel) break;
      const FrameHeader h = data_frame(op, static_cast<std::uint32_t>(s.tag), s.send_bytes);
      const char* src = s.send_input ? op.log_step.send_base + s.send_offset
                                     : work_source(op, s.send_offset, s.send_bytes);
      if (!s.send_pieces.empty()) {
        // Bruck: the blocks gathered into the staging area once (the steps before this one are
        // complete, so they hold their value), sent from there.
        char* packed = op.log_step.stage + s.pack_offset;
        if ((st & LogStepState::kStepPacked) == 0) {
          std::size_t at = 0;
          for (const StepPiece& p : s.send_pieces) {
            const char* from =
                p.input ? op.log_step.send_base + p.offset : work_source(op, p.offset, p.bytes);
            std::memcpy(packed + at, from, p.bytes);
            at += p.bytes;
          }
          st |= LogStepState::kStepPacked;
        }
        src = packed;
      }
      if (!ch.try_send(h, src, (op.seq << 8) | k)) break;
      st |= LogStepState::kStepSent;
      ++op.log_step.sends_in_flight;
      moved = true;
    }
    if (s.recv_peer >= 0) {
      if ((st & LogStepState::kStepReceived) == 0) break;
      if (s.wait_send && (st & LogStepState::kStepSendDone) == 0) break;
      if (s.reduce && (st & LogStepState::kStepApplied) == 0) {
        // Through the executor; the step is complete once the reduction is.
        if ((st & LogStepState::kStepApplying) == 0) {
          st |= LogStepState::kStepApplying;
          ExecStep e;
          e.kind = s.final ? ExecStep::kReduceFinal : ExecStep::kReduce;
          e.dst = op.work + s.recv_offset;
          e.a = work_source(op, s.recv_offset, s.recv_bytes);
          e.b = op.log_step.stage + s.stage_offset;
          e.n = s.recv_bytes / op.el;
          e.dtype = op.dtype;
          e.op = op.redop;
          e.nranks = op.nranks;
          issue_step(*op.exec, e, log_step_token(op.seq, k));
        }
        if ((st & LogStepState::kStepApplied) == 0) break;
      }
      if (!s.recv_pieces.empty()) {
        // Bruck: the message waited in the staging area; its blocks go to their places now
        // (the send of this step was packed before, so it reads none of them).
        if ((st & LogStepState::kStepApplied) == 0) {
          const char* from = op.log_step.stage + s.stage_offset;
          for (const StepPiece& p : s.recv_pieces) {
            std::memcpy(op.work + p.offset, from, p.bytes);
            from += p.bytes;
            work_written(op, p.offset, p.bytes);
          }
          st |= LogStepState::kStepApplied;
        }
      } else {
        // A copied receive wrote its range when it arrived; no earlier step touches it.
        work_written(op, s.recv_offset, s.recv_bytes);
      }
    }
    ++op.log_step.step_next;
    moved = true;
  }
  return moved;
}

RecvTarget Engine::log_step_target(Op& op, int link, const FrameHeader& h, RecvCtx& ctx) {
  const int peer = peer_of(link);
  if (!is_log_step(op.schedule)) {
    throw Error(ErrorCode::kMismatch,
                "a log-step message of operation #" + std::to_string(op.seq) +
                    " arrived from rank " + std::to_string(peer) + " but this rank runs it as " +
                    view_of(op),
                cfg_.rank, peer, op.name(), static_cast<std::int64_t>(op.seq));
  }
  check_header(op, peer, h);
  const auto& steps = op.log_step.plan.steps;
  for (std::size_t k = 0; k < steps.size(); ++k) {
    const Step& s = steps[k];
    if (s.recv_peer != peer || s.tag != static_cast<int>(h.index)) continue;
    const bool received = (op.log_step.step_state[k] & LogStepState::kStepReceived) != 0;
    if (!received && s.recv_bytes != h.bytes && op.kind == OpKind::kAllToAllV) {
      // The two ends' counts disagree (their sizes are not computed from shared parameters).
      throw Error(ErrorCode::kMismatch,
                  "rank " + std::to_string(peer) + " sends " + std::to_string(h.bytes) +
                      " bytes to rank " + std::to_string(cfg_.rank) + " in " + view_of(op) +
                      ", whose recv_counts[" + std::to_string(peer) + "] make it expect " +
                      std::to_string(s.recv_bytes),
                  cfg_.rank, peer, op.name(), static_cast<std::int64_t>(op.seq));
    }
    if (received || s.recv_bytes != h.bytes) break;
    ctx.op = &op;
    ctx.step = static_cast<int>(k);
    char* dst = s.reduce || !s.recv_pieces.empty() ? op.log_step.stage + s.stage_offset
                                                   : op.work + s.recv_offset;
    return {RecvTarget::kDirect, dst, 1};
  }
  throw Error(ErrorCode::kMismatch,
              "message " + std::to_string(h.index) + " (" + std::to_string(h.bytes) +
                  " bytes) of " + view_of(op) + " from rank " + std::to_string(peer) +
                  " matches no step this rank expects from it: the ranks disagree about the "
                  "operation",
              cfg_.rank, peer, op.name(), static_cast<std::int64_t>(op.seq));
}

}  // namespace dear::collectives
