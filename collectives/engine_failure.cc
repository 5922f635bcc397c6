// The engine's failure side. Any error is fatal to the communicator: fail() tells the
// neighbours with a kAbort frame naming the rank to blame, and every pending operation fails
// with it. Deadlines: an operation past its deadline first asks the neighbour it waits on
// (whose answer carries that rank's own view), then blames it; the errors say how far each
// operation got and which rank it waits on.
#include <algorithm>

#include "collectives/engine.h"
#include "collectives/engine_internal.h"
#include "collectives/steps.h"

namespace dear::collectives {

using engine_detail::kControlToken;
using engine_detail::kMaxAbortText;
using engine_detail::kNext;
using engine_detail::kPrev;
using transport::FrameHeader;
using transport::FrameType;

namespace engine_detail {
namespace {

std::string view_of(const char* name, OpKind kind, Schedule schedule, std::uint64_t count,
                    DataType dtype, ReduceOp redop, int root, bool device) {
  // An all-to-all's schedule is each rank's own (kind_byte): not part of what must agree.
  return std::string(name) + " count=" + std::to_string(count) +
         " dtype=" + std::string(dear::to_string(dtype)) +
         " op=" + std::string(dear::to_string(redop)) + " root=" + std::to_string(root) +
         (is_all_to_all(kind) ? std::string() : std::string(" schedule=") + to_string(schedule)) +
         (device ? " memory=device" : " memory=host");
}

}  // namespace

std::string view_of(const FrameHeader& h) {
  const auto kind = static_cast<OpKind>(h.kind & 0x0f);
  return view_of(call_name(kind, h.root), kind, schedule_of_wire(h.kind), h.count,
                 static_cast<DataType>(h.dtype), static_cast<ReduceOp>(h.redop), h.root,
                 (h.kind & 0x80) != 0);
}

std::string view_of(const Op& op) {
  return view_of(op.name(), op.kind, op.schedule, op.user_count, op.dtype, op.redop, op.root,
                 op.device);
}

}  // namespace engine_detail

using engine_detail::view_of;

void Engine::abort(const std::string& reason) {
  {
    std::lock_guard<std::mutex> lock(submit_mu_);
    if (abort_requested_.load()) return;
    abort_reason_ = reason;
  }
  abort_requested_.store(true);
  wake();
}

std::string Engine::describe_progress(const Op& op) const {
  std::string text;
  if (is_log_step(op.schedule)) {
    const auto k = static_cast<std::size_t>(op.log_step.step_next);
    text = "completed " + std::to_string(op.log_step.step_next) + "/" +
           std::to_string(op.log_step.plan.steps.size()) + " steps of " + to_string(op.schedule);
    if (k < op.log_step.plan.steps.size()) {
      const Step& s = op.log_step.plan.steps[k];
      const std::uint8_t st = op.log_step.step_state[k];
      if (s.recv_peer >= 0 && (st & LogStepState::kStepReceived) == 0) {
        text += ", waiting for " + std::to_string(s.recv_bytes) + " bytes from rank " +
                std::to_string(s.recv_peer);
      } else if (s.send_peer >= 0) {
        text += ", sending " + std::to_string(s.send_bytes) + " bytes to rank " +
                std::to_string(s.send_peer);
      }
    }
    return text;
  }
  for (int d = 0; d < 2; ++d) {
    const auto di = static_cast<std::size_t>(d);
    if (op.ring.send_steps[di] == 0 && op.ring.recv_steps[di] == 0) continue;
    std::uint32_t got = 0;
    std::uint32_t sent = 0;
    for (int c = 0; c < op.ring.channels; ++c) {
      got += op.ring.recv_next[di][static_cast<std::size_t>(c)];
      sent += op.ring.send_done[di][static_cast<std::size_t>(c)];
    }
    const auto chans = static_cast<std::uint32_t>(op.ring.channels);
    if (!text.empty()) text += "; ";
    text += "received " + std::to_string(got) + "/" +
            std::to_string(op.ring.messages_received_per_channel(d) * chans) +
            " slices from rank " + std::to_string(peer_of(1 - d)) + ", sent " +
            std::to_string(sent) + "/" +
            std::to_string(op.ring.messages_sent_per_channel(d) * chans) + " to rank " +
            std::to_string(peer_of(d));
  }
  return text;
}

int Engine::blame_link(const Op& op) const {
  if (is_log_step(op.schedule)) {
    const auto k = static_cast<std::size_t>(op.log_step.step_next);
    if (k >= op.log_step.plan.steps.size()) return 2;
    const Step& s = op.log_step.plan.steps[k];
    const bool waiting =
        s.recv_peer >= 0 && (op.log_step.step_state[k] & LogStepState::kStepReceived) == 0;
    const int peer = waiting || s.send_peer < 0 ? s.recv_peer : s.send_peer;
    return peer >= 0 ? mesh_link(peer) : 2;
  }
  // The side we are waiting on: a receive outstanding points at the previous rank.
  const RingState& r = op.ring;
  int link = kNext;
  for (int c = 0; c < r.channels; ++c) {
    const auto ci = static_cast<std::size_t>(c);
    if (r.recv_next[kForward][ci] < r.messages_received_per_channel(kForward)) return kPrev;
    if (r.recv_next[kBackward][ci] < r.messages_received_per_channel(kBackward)) link = kNext;
  }
  return link;
}

Error Engine::timeout_error(const Op& op, const std::string& prefix) const {
  const int blame = peer_of(blame_link(op));
  return Error(ErrorCode::kTimeout,
               prefix + view_of(op) + " did not complete within " +
                   std::to_string(op.timeout.count()) + " ms: " + describe_progress(op) +
                   "; rank " + std::to_string(blame) +
                   " is dead, stalled, or did not issue this operation",
               cfg_.rank, blame, op.name(), static_cast<std::int64_t>(op.seq));
}

void Engine::check_deadlines() {
  if (active_.empty() && p2p_pending_ == 0) return;
  const auto now = transport::Clock::now();
  check_p2p_deadlines(now);
  for (const auto& holder : active_) {
    if (now < holder->deadline) continue;
    const Op& op = *holder;
    // The neighbour this rank waits on may itself be waiting on a rank further up the ring:
    // ask it first (a timeout notice naming it), so that it answers with its own view and
    // every rank ends up naming the rank that is really stuck. A neighbour that does not
    // answer within the grace period is the one to blame.
    if (probe_deadline_ == transport::Clock::time_point{}) {
      const auto grace = std::clamp<std::chrono::milliseconds>(
          op.timeout / 10, std::chrono::milliseconds(100), std::chrono::milliseconds(2000));
      probe_deadline_ = now + grace;
      const int link = blame_link(op);
      probe_text_ = timeout_error(op, "").what();  // must outlive the send
      if (probe_text_.size() > kMaxAbortText) probe_text_.resize(kMaxAbortText);
      send_control(link, FrameType::kAbort, 0, probe_text_, peer_of(link),
                   static_cast<int>(ErrorCode::kTimeout));
      flush_links();
      return;
    }
    if (now >= probe_deadline_) throw timeout_error(op, "");
  }
}

void Engine::send_control(int link, FrameType type, std::uint64_t seq, const std::string& text,
                          int blame, int code) {
  auto& chans = links_[link];
  if (chans.empty() || chans[0]->closed()) return;
  FrameHeader h;
  h.type = type;
  h.seq = seq;
  h.bytes = static_cast<std::uint32_t>(text.size());
  h.root = blame;
  h.count = static_cast<std::uint64_t>(code);
  // Control frames carry no pointer into operation memory; text must outlive the send, so
  // abort texts are kept in abort_text_ until the channel is closed.
  const void* payload = text.empty() ? nullptr : text.data();
  if (!chans[0]->try_send(h, payload, kControlToken)) {
    // Queue full: progress once and retry; a full queue on the control direction means the
    // peer stopped reading, which the deadline will report.
    chans[0]->progress(*sinks_[link], true);
    (void)chans[0]->try_send(h, payload, kControlToken);
  }
}

void Engine::fail(const Error& e) {
  bool first = false;
  {
    std::lock_guard<std::mutex> lock(submit_mu_);
    if (!failed_) {
      // A named communicator (a split's child) says which it was.
      const std::string prefix = "[comm " + cfg_.name + "] ";
      failed_ = cfg_.name.empty() || e.cause().starts_with(prefix)
                    ? std::make_exception_ptr(e)
                    : std::make_exception_ptr(
                          Error(e.code(), prefix + e.cause(), e.rank(), e.peer(), e.op(), e.seq()));
      first = true;
    }
  }
  if (first) {
    // Tell both neighbours, so the failure travels around the ring instead of waiting for
    // each rank's deadline. Best effort: the links may be the thing that broke.
    const int blame = e.peer() != Error::kNone ? e.peer() : cfg_.rank;
    static thread_local std::string text;
    text = e.what();
    if (text.size() > kMaxAbortText) text.resize(kMaxAbortText);
    for (std::size_t li = 0; li < links_.size(); ++li) {
      const int l = static_cast<int>(li);
      try {
        send_control(l, FrameType::kAbort, 0, text, blame, static_cast<int>(e.code()));
        for (auto& ch : links_[l]) {
          if (!ch->closed()) ch->abandon();
        }
      } catch (const Error&) {
        // The link is already broken; the peer learns from that.
      }
    }
  }
  std::exception_ptr err;
  {
    std::lock_guard<std::mutex> lock(submit_mu_);
    err = failed_;
  }
  fail_all(err);
}

void Engine::fail_all(std::exception_ptr e) {
  std::deque<std::unique_ptr<Op>> batch;
  {
    std::lock_guard<std::mutex> lock(submit_mu_);
    if (!failed_) failed_ = e;
    batch.swap(submitted_);
    pending_submissions_.store(0);
  }
  fence_wait_ = false;
  // No step may still write into an operation's memory once its caller has it back.
  drain_executors();
  for (auto& op : batch) {
    if (op->fence) op->fence->done();
    op->transition(OpState::kFailed);
    op->state->complete(e);
  }
  for (auto& op : active_) {
    close_window(*op);
    release_scratch(*op);
    if (op->fence) op->fence->done();
    op->transition(OpState::kFailed);
    op->state->complete(e);
  }
  active_.clear();
  fail_p2p(e);
}

}  // namespace dear::collectives
