// Point-to-point sends and receives (Communicator::send/recv) on the mesh channel between two
// ranks, outside the collectives' sequence: each pair numbers its messages by their place among
// its sends, in issue order, and a receive takes the message of its own place (NCCL's
// matching; with tags, per pair and tag, MPI's). A send of at most eager_bytes leaves at once and
// waits in the receiver's memory if it arrives first (P2pEarly): one frame, nothing back. A larger
// one sends a request and waits for its receive's ready, so its bytes land straight in the receive
// buffer. Each frame carries its end's count and dtype, so the end that gets one sees a difference.
// A receive from any source takes the unclaimed message of its tag that some rank has sent here
// (p2p_waiting_). See docs/architecture.md ("Point-to-point").
#include <algorithm>
#include <cstring>
#include <limits>

#include "collectives/engine.h"
#include "collectives/engine_internal.h"

namespace dear::collectives {

using engine_detail::kControlToken;
using engine_detail::kMaxUnexpectedBytes;
using engine_detail::kQueueMessagesPerChannel;
using transport::FrameHeader;
using transport::FrameType;
using transport::RecvTarget;

namespace {

constexpr std::uint64_t kP2pTokenBase = std::uint64_t{2} << 62;

std::string view_of(bool send, std::uint64_t pseq, int tag, std::uint64_t count,
                    std::uint8_t dtype) {
  return std::string(send ? "send" : "recv") + " #" + std::to_string(pseq) +
         (tag != 0 ? " tag=" + std::to_string(tag) : std::string()) +
         " count=" + std::to_string(count) +
         " dtype=" + std::string(dear::to_string(static_cast<DataType>(dtype)));
}

}  // namespace

Engine::PeerP2p& Engine::p2p_peer(int rank) {
  // Made with the first message: the vector never grows (its elements do not move).
  if (p2p_.empty()) p2p_ = std::vector<PeerP2p>(static_cast<std::size_t>(cfg_.size));
  return p2p_[static_cast<std::size_t>(rank)];
}

Work Engine::submit_p2p(const P2pCall& call, std::unique_ptr<OpFence> fence) {
  auto p = std::make_unique<P2p>();
  p->call = call;
  p->bytes = call.count * dtype_size(call.dtype);
  p->fence = std::move(fence);
  auto state = std::make_shared<Work::State>();
  p->state = state;
  state->wait_spin_us = cfg_.wait_spin_us;
  state->engine = weak_from_this();
  // A device buffer's copies go to the device executor on the engine thread only.
  state->driven = p->bytes <= cfg_.eager_bytes && !p->fence;
  // Not a collective's sequence number: set_priority() finds no operation by it.
  state->seq = std::numeric_limits<std::uint64_t>::max();
  std::exception_ptr failed;
  {
    std::lock_guard<std::mutex> lock(submit_mu_);
    if (failed_) {
      failed = failed_;
    } else {
      submitted_p2p_.push_back(std::move(p));
      p2p_submitted_.store(true, std::memory_order_release);
      pending_submissions_.fetch_add(1);
    }
  }
  if (failed) {
    state->complete(failed);
    return Work(state);
  }
  // As Engine::submit: a small one leaves from this thread when the engine is free, through
  // the point-to-point part of a turn only (the rest is the next turn's, which the waiting
  // thread runs while the message travels).
  bool started = false;
  if (state->driven && turn_mu_.try_lock()) {
    (void)p2p_submit_turn();
    turn_mu_.unlock();
    started = true;
  }
  if (!wake_if(kActiveSleep) && !wake_if(kDeepSleep) && !started) wake_if(kIdleSleep);
  return Work(state);
}

bool Engine::drain_p2p() {
  // Every turn passes here: the lock is taken only when something was queued.
  if (!p2p_submitted_.exchange(false, std::memory_order_acq_rel)) return false;
  std::deque<std::unique_ptr<P2p>>& batch = p2p_batch_;
  {
    std::lock_guard<std::mutex> lock(submit_mu_);
    batch.swap(submitted_p2p_);
  }
  if (batch.empty()) return false;
  while (!batch.empty()) {
    std::unique_ptr<P2p> p = std::move(batch.front());
    batch.pop_front();
    const std::shared_ptr<Work::State> state = p->state;
    try {
      post_p2p(std::move(p));
    } catch (...) {
      // Not posted: fail() would not find it. The ones behind it go back to the queue, where
      // fail() completes them.
      if (state->status.load(std::memory_order_acquire) == 0) {
        state->complete(std::current_exception());
      }
      std::lock_guard<std::mutex> lock(submit_mu_);
      while (!batch.empty()) {
        submitted_p2p_.push_front(std::move(batch.back()));
        batch.pop_back();
      }
      p2p_submitted_.store(true, std::memory_order_release);
      throw;
    }
  }
  return true;
}

void Engine::post_p2p(std::unique_ptr<P2p> p) {
  p->deadline = transport::deadline_after(p->call.timeout);
  if (p->call.peer != Communicator::kAnySource) {
    (void)mesh_link(p->call.peer);  // throws where there is no direct link
  }
  if (p->bytes > 0 && (p->fence || host_exec_.bounce)) {
    // Through host memory of the engine's (the message's frames are the same).
    p->copier = p->fence ? &device_executor(p->fence->device()) : host_exec_.executor.get();
    p->buffer = acquire_shadow_buffer(*p->copier, p->bytes);
    char* host = shadow_buffers_[static_cast<std::size_t>(p->buffer)].data;
    if (p->call.send) {
      p->user = const_cast<char*>(p->call.src);
      p->call.src = host;
      p->held = true;  // until the copy in (advance_p2p_copies)
    } else {
      p->user = p->call.dst;
      p->call.dst = host;
    }
  }
  if (p->call.send) {
    PeerP2p& peer = p2p_peer(p->call.peer);
    p->pseq = peer.next_send[p->call.tag]++;
    p->id = peer.next_id++;
    p->ready = p->bytes <= cfg_.eager_bytes;  // else it asks first (advance_p2p)
    peer.sends.push_back(std::move(p));
    ++p2p_pending_;
    return;
  }
  // Behind an any-source receive of its tag, or one itself: it waits its turn (bind_waiting).
  const auto waiting = p2p_waiting_.find(p->call.tag);
  if (p->call.peer == Communicator::kAnySource ||
      (waiting != p2p_waiting_.end() && !waiting->second.empty())) {
    const int tag = p->call.tag;
    p2p_waiting_[tag].push_back(std::move(p));
    ++p2p_pending_;
    bind_waiting(tag);
    return;
  }
  post_p2p_recv(std::move(p));
}

int Engine::p2p_sender_of(int tag) const {
  // A rank's messages of one tag arrive in their order (one channel), so its unclaimed one,
  // if any, is its next receive's: waiting whole or in part, or asked for.
  const int n = static_cast<int>(p2p_.size());
  for (int i = 0; i < n; ++i) {
    const int r = (p2p_any_next_ + i) % n;
    const PeerP2p& peer = p2p_[static_cast<std::size_t>(r)];
    const auto next = peer.next_recv.find(tag);
    const std::uint64_t seq = next == peer.next_recv.end() ? 0 : next->second;
    const auto unclaimed = [&](const FrameHeader& h) { return h.seq == seq && h.root == tag; };
    if (std::any_of(peer.early.begin(), peer.early.end(),
                    [&](const P2pEarly& e) { return unclaimed(e.header); }) ||
        std::any_of(peer.requests.begin(), peer.requests.end(), unclaimed)) {
      return r;
    }
  }
  return -1;
}

void Engine::bind_waiting(int tag) {
  const auto it = p2p_waiting_.find(tag);
  if (it == p2p_waiting_.end()) return;
  auto& queue = it->second;
  while (!queue.empty()) {
    P2p& p = *queue.front();
    if (p.call.peer == Communicator::kAnySource) {
      const int from = p2p_.empty() ? -1 : p2p_sender_of(tag);
      if (from < 0) break;
      p.call.peer = from;
      p2p_any_next_ = (from + 1) % cfg_.size;
    }
    std::unique_ptr<P2p> bound = std::move(queue.front());
    queue.pop_front();
    --p2p_pending_;
    const std::shared_ptr<Work::State> state = bound->state;
    try {
      post_p2p_recv(std::move(bound));
    } catch (...) {
      // Posted nowhere (its sizes differ from its message's): fail() would not find it.
      state->complete(std::current_exception());
      throw;
    }
  }
  if (queue.empty()) p2p_waiting_.erase(it);
}

void Engine::post_p2p_recv(std::unique_ptr<P2p> p) {
  PeerP2p& peer = p2p_peer(p->call.peer);
  p->state->source = p->call.peer;
  p->pseq = peer.next_recv[p->call.tag]++;
  // Its message may be here already, whole or in part.
  for (auto it = peer.early.begin(); it != peer.early.end(); ++it) {
    if (it->header.seq != p->pseq || it->header.root != p->call.tag) continue;
    check_p2p(*p, it->header);
    if (it->complete) {
      if (p->bytes > 0) std::memcpy(p->call.dst, it->data.data(), p->bytes);
      unexpected_bytes_ -= it->data.size();
      peer.early.erase(it);
      ++p2p_pending_;  // as if posted: p2p_received() counts it off
      p2p_received(std::move(p));
      return;
    }
    break;  // arriving now: p2p_arrived() copies it
  }
  // Its large sender may have asked already.
  for (auto it = peer.requests.begin(); it != peer.requests.end(); ++it) {
    if (it->seq != p->pseq || it->root != p->call.tag) continue;
    check_p2p(*p, *it);
    p->answer = true;
    peer.requests.erase(it);
    break;
  }
  peer.recvs.push_back(std::move(p));
  ++p2p_pending_;
}

bool Engine::advance_p2p() {
  if (p2p_pending_ == 0) return false;
  bool moved = advance_p2p_copies();
  for (std::size_t r = 0; r < p2p_.size(); ++r) {
    PeerP2p& peer = p2p_[r];
    if (peer.sends.empty() && peer.recvs.empty()) continue;
    transport::Channel& ch = *links_[static_cast<std::size_t>(mesh_link(static_cast<int>(r)))][0];
    if (ch.closed()) continue;  // on_closed() fails what still needs it
    // Each frame carries this end's view (count, dtype) for the other end to check.
    const auto frame = [](FrameType type, const P2p& p) {
      FrameHeader h;
      h.type = type;
      h.seq = p.pseq;
      h.root = p.call.tag;
      h.count = p.call.count;
      h.dtype = static_cast<std::uint8_t>(p.call.dtype);
      return h;
    };
    for (auto& p : peer.recvs) {
      if (!p->answer || p->answered) continue;
      if (ch.queued() >= kQueueMessagesPerChannel ||
          !ch.try_send(frame(FrameType::kP2pReady, *p), nullptr, kControlToken)) {
        break;
      }
      p->answered = true;
      moved = true;
    }
    for (auto& p : peer.sends) {
      if (p->held) break;  // its bytes are on their way to host memory; the rest wait behind
      // Left: its data, or (a large one not asked yet) its request.
      if (p->queued || (!p->ready && p->requested)) continue;
      if (ch.queued() >= kQueueMessagesPerChannel) break;
      if (!p->ready) {
        if (!ch.try_send(frame(FrameType::kP2pRequest, *p), nullptr, kControlToken)) break;
        p->requested = true;
      } else {
        FrameHeader h = frame(FrameType::kP2pData, *p);
        h.bytes = static_cast<std::uint32_t>(p->bytes);
        if (!ch.try_send(h, p->call.src, kP2pTokenBase | p->id)) break;
        p->queued = true;
      }
      moved = true;
    }
  }
  if (moved) flush_links();
  return moved;
}

void Engine::check_p2p(const P2p& p, const FrameHeader& h) const {
  // h is the other end's view: a kP2pReady (a receive) for a send, a kP2pData (a send) for a
  // receive.
  if (h.count == p.call.count && h.dtype == static_cast<std::uint8_t>(p.call.dtype)) return;
  const int peer = p.call.peer;
  throw Error(ErrorCode::kMismatch,
              "point-to-point message #" + std::to_string(p.pseq) + " between ranks " +
                  std::to_string(cfg_.rank) + " and " + std::to_string(peer) + " differs: rank " +
                  std::to_string(peer) + " has " +
                  view_of(!p.call.send, h.seq, h.root, h.count, h.dtype) + ", rank " +
                  std::to_string(cfg_.rank) + " has " +
                  view_of(p.call.send, p.pseq, p.call.tag, p.call.count,
                          static_cast<std::uint8_t>(p.call.dtype)),
              cfg_.rank, peer, p.call.send ? "send" : "recv");
}

RecvTarget Engine::p2p_target(int link, const FrameHeader& h, RecvCtx& ctx) {
  const int from = peer_of(link);
  PeerP2p& peer = p2p_peer(from);
  if (h.type != FrameType::kP2pData) {
    if (h.bytes != 0) {
      throw Error(ErrorCode::kPeerFailed,
                  "protocol violation: a point-to-point control frame with a payload from rank " +
                      std::to_string(from),
                  cfg_.rank, from);
    }
    return {RecvTarget::kDiscard, nullptr, 1};
  }
  const auto same = [&](const std::unique_ptr<P2p>& p) {
    return p->pseq == h.seq && p->call.tag == h.root;
  };
  for (auto& p : peer.recvs) {
    if (!same(p)) continue;
    check_p2p(*p, h);
    if (h.bytes != p->bytes) {
      throw Error(ErrorCode::kMismatch,
                  "point-to-point message #" + std::to_string(h.seq) + " from rank " +
                      std::to_string(from) + " has " + std::to_string(h.bytes) +
                      " bytes, this rank's receive " + std::to_string(p->bytes),
                  cfg_.rank, from, "recv");
    }
    ctx.p2p = p.get();
    return {RecvTarget::kDirect, p->call.dst, 1};
  }
  if (h.seq < peer.next_recv[h.root] && std::none_of(peer.recvs.begin(), peer.recvs.end(), same)) {
    throw Error(ErrorCode::kMismatch,
                "rank " + std::to_string(from) + " sent point-to-point message #" +
                    std::to_string(h.seq) + " again, or after its receive completed",
                cfg_.rank, from, "recv");
  }
  if (h.bytes > cfg_.eager_bytes) {
    throw Error(ErrorCode::kPeerFailed,
                "protocol violation: rank " + std::to_string(from) + " sent " +
                    std::to_string(h.bytes) + " bytes of point-to-point message #" +
                    std::to_string(h.seq) + " before this rank posted its receive",
                cfg_.rank, from);
  }
  unexpected_bytes_ += h.bytes;
  if (unexpected_bytes_ > kMaxUnexpectedBytes) {
    throw Error(ErrorCode::kMismatch,
                "rank " + std::to_string(from) + " sent more than " +
                    std::to_string(kMaxUnexpectedBytes >> 20) +
                    " MiB that this rank has posted no receive for",
                cfg_.rank, from, "recv");
  }
  peer.early.push_back(P2pEarly{h, std::vector<char>(h.bytes), false});
  ctx.early = &peer.early.back();
  // An any-source receive may take it (p2p_arrived copies it once it is whole).
  if (!p2p_waiting_.empty()) bind_waiting(h.root);
  return {RecvTarget::kDirect, ctx.early->data.data(), 1};
}

void Engine::p2p_arrived(int link, const FrameHeader& h, RecvCtx& ctx) {
  const int from = peer_of(link);
  PeerP2p& peer = p2p_peer(from);
  if (h.type == FrameType::kP2pReady) {
    p2p_ready(link, h);
    return;
  }
  if (h.type == FrameType::kP2pRequest) {
    p2p_request(link, h);
    return;
  }
  if (ctx.p2p != nullptr) {
    const P2p* p = ctx.p2p;
    for (auto it = peer.recvs.begin(); it != peer.recvs.end(); ++it) {
      if (it->get() != p) continue;
      std::unique_ptr<P2p> done = std::move(*it);
      peer.recvs.erase(it);
      p2p_received(std::move(done));
      return;
    }
    return;
  }
  if (ctx.early == nullptr) return;
  ctx.early->complete = true;
  // Its receive may have been posted while the payload was arriving.
  for (auto& p : peer.recvs) {
    if (p->pseq != h.seq || p->call.tag != h.root) continue;
    if (p->bytes > 0) std::memcpy(p->call.dst, ctx.early->data.data(), p->bytes);
    unexpected_bytes_ -= ctx.early->data.size();
    for (auto it = peer.early.begin(); it != peer.early.end(); ++it) {
      if (&*it == ctx.early) {
        peer.early.erase(it);
        break;
      }
    }
    std::unique_ptr<P2p> done = std::move(p);
    std::erase_if(peer.recvs, [](const std::unique_ptr<P2p>& q) { return q == nullptr; });
    p2p_received(std::move(done));
    return;
  }
}

void Engine::p2p_ready(int link, const FrameHeader& h) {
  const int from = peer_of(link);
  PeerP2p& peer = p2p_peer(from);
  for (auto& p : peer.sends) {
    if (p->pseq != h.seq || p->call.tag != h.root || !p->requested) continue;
    check_p2p(*p, h);
    p->ready = true;
    return;
  }
  throw Error(ErrorCode::kPeerFailed,
              "protocol violation: rank " + std::to_string(from) +
                  " is ready for point-to-point message #" + std::to_string(h.seq) +
                  ", which this rank did not ask to send",
              cfg_.rank, from);
}

void Engine::p2p_request(int link, const FrameHeader& h) {
  const int from = peer_of(link);
  PeerP2p& peer = p2p_peer(from);
  for (auto& p : peer.recvs) {
    if (p->pseq != h.seq || p->call.tag != h.root) continue;
    check_p2p(*p, h);
    p->answer = true;
    return;
  }
  if (h.seq < peer.next_recv[h.root]) {
    throw Error(ErrorCode::kMismatch,
                "rank " + std::to_string(from) + " asks to send point-to-point message #" +
                    std::to_string(h.seq) + ", whose receive has completed here",
                cfg_.rank, from, "recv");
  }
  peer.requests.push_back(h);  // for a receive not posted yet
  if (!p2p_waiting_.empty()) bind_waiting(h.root);
}

void Engine::p2p_sent(int link, std::uint64_t token) {
  PeerP2p& peer = p2p_peer(peer_of(link));
  const std::uint64_t id = token & ~kP2pTokenBase;
  for (auto& p : peer.sends) {
    if (p->id != id) continue;
    p->state->complete(nullptr);
    complete_p2p(peer.sends, p.get());
    return;
  }
}

void Engine::complete_p2p(std::deque<std::unique_ptr<P2p>>& queue, const P2p* p) {
  for (auto it = queue.begin(); it != queue.end(); ++it) {
    if (it->get() == p) {
      end_p2p(**it);
      queue.erase(it);
      --p2p_pending_;
      return;
    }
  }
}

void Engine::end_p2p(P2p& p) noexcept {
  if (p.fence) p.fence->done();
  if (p.buffer >= 0) shadow_buffers_[static_cast<std::size_t>(p.buffer)].busy = false;
  p.buffer = -1;
}

void Engine::p2p_received(std::unique_ptr<P2p> p) {
  if (p->copier == nullptr) {
    p->state->complete(nullptr);
    end_p2p(*p);
    --p2p_pending_;
    return;
  }
  p2p_back_.push_back(std::move(p));  // advance_p2p_copies() copies it back
}

bool Engine::advance_p2p_copies() {
  bool moved = false;
  const auto issue = [&](P2p& p, char* dst, const char* src) {
    // Not before the work the caller queued on its stream ahead of the message is done.
    if (p.fence && !p.fence->input_ready()) {
      fence_wait_ = true;
      return;
    }
    p.copying = true;
    p.copy_id = next_p2p_copy_++;
    issue_step(*p.copier, copy_step(dst, src, p.bytes), p2p_copy_token(p.copy_id));
    moved = true;
  };
  for (PeerP2p& peer : p2p_) {
    for (auto& p : peer.sends) {
      if (p->held && !p->copying) issue(*p, const_cast<char*>(p->call.src), p->user);
      if (p->held) break;  // the sends behind it leave after it
    }
  }
  // An executor that completes inside issue() takes a receive off p2p_back_ at once.
  std::vector<P2p*> back;
  for (auto& p : p2p_back_) {
    if (!p->copying) back.push_back(p.get());
  }
  for (P2p* p : back) issue(*p, p->user, p->call.dst);
  return moved;
}

void Engine::p2p_copy_done(std::uint64_t id) {
  for (PeerP2p& peer : p2p_) {
    for (auto& p : peer.sends) {
      if (p->copying && p->copy_id == id) {
        p->copying = false;
        p->held = false;  // it may leave
        return;
      }
    }
  }
  for (auto it = p2p_back_.begin(); it != p2p_back_.end(); ++it) {
    if ((*it)->copying && (*it)->copy_id == id) {
      (*it)->state->complete(nullptr);
      end_p2p(**it);
      p2p_back_.erase(it);
      --p2p_pending_;
      return;
    }
  }
  // A message whose communicator failed meanwhile: gone, and nothing to do.
}

transport::Clock::time_point Engine::p2p_deadline() const {
  auto deadline = transport::Deadline::max();
  if (p2p_pending_ == 0) return deadline;
  for (const PeerP2p& peer : p2p_) {
    for (const auto& p : peer.sends) deadline = std::min(deadline, p->deadline);
    for (const auto& p : peer.recvs) deadline = std::min(deadline, p->deadline);
  }
  for (const auto& [tag, queue] : p2p_waiting_) {
    for (const auto& p : queue) deadline = std::min(deadline, p->deadline);
  }
  return deadline;
}

void Engine::check_p2p_deadlines(transport::Clock::time_point now) {
  if (p2p_pending_ == 0) return;
  for (const auto& [tag, queue] : p2p_waiting_) {
    for (const auto& p : queue) {
      if (now < p->deadline) continue;
      const bool any = p->call.peer == Communicator::kAnySource;
      throw Error(ErrorCode::kTimeout,
                  "recv" + (tag != 0 ? " tag=" + std::to_string(tag) : std::string()) +
                      " count=" + std::to_string(p->call.count) +
                      " dtype=" + std::string(dear::to_string(p->call.dtype)) +
                      (any ? " from any rank" : " from rank " + std::to_string(p->call.peer)) +
                      " timed out after " + std::to_string(p->call.timeout.count()) + " ms: " +
                      (any ? "no rank has sent it"
                           : "it waits behind a receive from any rank that no rank has sent"),
                  cfg_.rank, any ? Error::kNone : p->call.peer, "recv");
    }
  }
  for (const PeerP2p& peer : p2p_) {
    for (const auto* queue : {&peer.sends, &peer.recvs}) {
      // A send whose device input is not in host memory yet holds back the sends behind it
      // (advance_p2p_copies): their timeout says so rather than blame the peer.
      bool behind_held = false;
      for (const auto& p : *queue) {
        if (now < p->deadline) {
          behind_held = behind_held || p->held;
          continue;
        }
        const bool send = p->call.send;
        const std::string what = view_of(send, p->pseq, p->call.tag, p->call.count,
                                         static_cast<std::uint8_t>(p->call.dtype));
        const std::string peer_text = "rank " + std::to_string(p->call.peer);
        std::string why;
        if (!send) {
          why = peer_text + " has not sent it";
        } else if (p->held) {
          why = p->copying ? "its device memory is still being copied to host memory"
                           : "the work queued before it on its CUDA stream has not finished";
        } else if (behind_held) {
          why = "it waits behind an earlier send to " + peer_text +
                " whose device memory is not in host memory yet";
        } else {
          why = p->queued ? "its bytes are still on their way"
                          : peer_text + " has posted no receive for it";
        }
        throw Error(ErrorCode::kTimeout,
                    what + (send ? " to " : " from ") + peer_text + " timed out after " +
                        std::to_string(p->call.timeout.count()) + " ms: " + why,
                    cfg_.rank, p->call.peer, send ? "send" : "recv");
      }
    }
  }
}

void Engine::fail_p2p(std::exception_ptr e) {
  std::deque<std::unique_ptr<P2p>> queued;
  {
    std::lock_guard<std::mutex> lock(submit_mu_);
    queued.swap(submitted_p2p_);
  }
  for (auto& p : queued) p->state->complete(e);
  for (PeerP2p& peer : p2p_) {
    for (auto* queue : {&peer.sends, &peer.recvs}) {
      for (auto& p : *queue) {
        p->state->complete(e);
        end_p2p(*p);
      }
      queue->clear();
    }
    peer.early.clear();
    peer.requests.clear();
  }
  for (auto& [tag, queue] : p2p_waiting_) {
    for (auto& p : queue) {
      p->state->complete(e);
      end_p2p(*p);
    }
  }
  p2p_waiting_.clear();
  for (auto& p : p2p_back_) {
    p->state->complete(e);
    end_p2p(*p);
  }
  p2p_back_.clear();
  p2p_pending_ = 0;
}

}  // namespace dear::collectives
