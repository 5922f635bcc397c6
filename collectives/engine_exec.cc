// The engine's executor side: which executor an operation's steps go to, the landing slots
// that its slices pass through when the links may not touch its memory or a step completes
// later, and what each completed step unblocks. See collectives/executor.h for the contract
// and docs/architecture.md ("Executors and landing slots") for the design.
#include <unistd.h>

#include <algorithm>
#include <bit>

#include "collectives/engine.h"
#include "collectives/engine_internal.h"
#include "collectives/steps.h"

namespace dear::collectives {

using engine_detail::kNext;
using engine_detail::kPrev;
using engine_detail::view_of;

namespace {

// Executor tokens: what kind of step in the top bits, then what it belongs to.
constexpr int kTokenShift = 58;
constexpr std::uint64_t kPayloadMask = (std::uint64_t{1} << kTokenShift) - 1;
enum TokenKind : std::uint64_t {
  kTokReceive = 1,  // a receive slot's reduction or copy out (payload: slot)
  kTokPack = 2,     // a send slot's pack (payload: slot)
  kTokStart = 3,    // a copy the sends wait for (payload: sequence)
  kTokLocal = 4,    // another local step (payload: sequence)
  kTokLogStep = 5,  // a log-step reduction (payload: sequence << 8 | step)
  kTokP2p = 6,      // a point-to-point message's copy to or from host memory (payload: copy id)
};
std::uint64_t token(TokenKind k, std::uint64_t payload) {
  return (static_cast<std::uint64_t>(k) << kTokenShift) | (payload & kPayloadMask);
}

// Channel tokens of messages sent from a send slot (ring links only): bit 62 set, bit 63
// clear, apart from operation sequences (below 2^62) and the control tokens (all ones).
constexpr std::uint64_t kSlotSendBit = std::uint64_t{1} << 62;

// Landing slots are allocated in multiples of this, so that one serves nearby sizes.
constexpr std::size_t kSlotGrain = 64 * 1024;

}  // namespace

ExecStep Engine::reduce_step(const Op& op, const RecvCtx& ctx, char* dst, const char* received,
                             const char* other, std::size_t n) {
  ExecStep e;
  e.kind = ctx.final ? ExecStep::kReduceFinal : ExecStep::kReduce;
  e.dst = dst;
  e.a = received;
  e.b = other;
  e.n = n;
  e.dtype = op.dtype;
  e.op = op.redop;
  e.nranks = op.nranks;
  return e;
}

ExecStep Engine::copy_step(char* dst, const char* src, std::size_t bytes) {
  ExecStep e;
  e.kind = ExecStep::kCopy;
  e.dst = dst;
  e.a = src;
  e.n = bytes;
  return e;
}

std::uint64_t Engine::log_step_token(std::uint64_t seq, std::size_t step) {
  return token(kTokLogStep, (seq << 8) | step);
}

std::uint64_t Engine::p2p_copy_token(std::uint64_t id) { return token(kTokP2p, id); }

bool Engine::is_slot_token(std::uint64_t t) { return (t >> 62) == 1; }

Executor& Engine::device_executor(int device) {
  if (!device_exec_) {
    if (!cfg_.make_device_executor) {
      throw Error(ErrorCode::kInternal,
                  "a device operation reached an engine that has no device executor", cfg_.rank);
    }
    device_exec_ = cfg_.make_device_executor(device);
    device_exec_->set_waker([this] { wake(); });
  }
  return *device_exec_;
}

void Engine::prepare_op(Op& op) {
  if (op.device) {
    (void)device_executor(op.fence ? op.fence->device() : 0);
    if (is_log_step(op.schedule)) {
      // A small operation: its steps run in host memory, the device executor copies in and out.
      op.exec = host_exec_.executor.get();
      shadow_op(op, *device_exec_);
      return;
    }
    op.exec = device_exec_.get();
    op.bounced = true;
    return;
  }
  op.exec = host_exec_.executor.get();
  if (host_exec_.bounce && is_log_step(op.schedule)) {
    shadow_op(op, *op.exec);  // as a device operation would
    return;
  }
  op.bounced = host_exec_.bounce;
}

void Engine::shadow_op(Op& op, Executor& copier) {
  const std::size_t block = op.user_count * op.el;
  const auto n = static_cast<std::size_t>(op.nranks);
  const bool has_out = op.root < 0 || op.rank == op.root;
  std::size_t in_bytes = 0;
  std::size_t out_bytes = 0;
  switch (op.kind) {
    case OpKind::kAllReduce:
      in_bytes = block;
      out_bytes = has_out ? block : 0;
      break;
    case OpKind::kReduceScatter:  // with a root, a scatter: the root's input only
      in_bytes = op.root < 0 || op.rank == op.root ? block * n : 0;
      out_bytes = block;
      break;
    case OpKind::kAllGather:
      in_bytes = block;
      out_bytes = has_out ? block * n : 0;
      break;
    case OpKind::kAllToAll: in_bytes = out_bytes = block * n; break;
    case OpKind::kAllToAllV:
      for (std::size_t q = 0; q < n; ++q) {
        in_bytes = std::max(in_bytes, op.layout->send_offset[q] + op.layout->send_bytes[q]);
        out_bytes = std::max(out_bytes, op.layout->recv_offset[q] + op.layout->recv_bytes[q]);
      }
      break;
    case OpKind::kBroadcast:
    case OpKind::kBarrier:
      throw Error(
          ErrorCode::kInternal,
          std::string("a ") + op.name() + " on a log-step schedule cannot work in host memory",
          cfg_.rank, Error::kNone, op.name(), static_cast<std::int64_t>(op.seq));
  }
  if (in_bytes == 0 && out_bytes == 0) return;  // nothing to touch
  // The host input lies inside the host output where an in-place all_gather's does (its own
  // block, which no message lands in), and takes the output's place for an all_reduce, whose
  // steps then work in place (its messages wait in the staging area): one copy in, and the
  // output holds the input's value until a step writes it. Every other operation gets regions
  // of its own: messages may land in its output while the copy in is still being made.
  const auto in_at = reinterpret_cast<std::uintptr_t>(op.in);
  const auto out_at = reinterpret_cast<std::uintptr_t>(op.out);
  const bool inside = op.kind == OpKind::kAllGather && out_bytes > 0 && in_bytes > 0 &&
                      in_at >= out_at && in_at + in_bytes <= out_at + out_bytes;
  const bool onto = op.kind == OpKind::kAllReduce && out_bytes > 0;
  const std::size_t bytes = out_bytes + (inside || onto ? 0 : in_bytes);

  const int pick = acquire_shadow_buffer(copier, bytes);
  const ShadowBuffer& b = shadow_buffers_[static_cast<std::size_t>(pick)];
  Op::Shadow& sh = op.shadow;
  sh.exec = &copier;
  sh.buffer = pick;
  sh.user_in = op.in;
  sh.user_out = op.out;
  sh.in_bytes = in_bytes;
  sh.out_bytes = out_bytes;
  sh.in_done = in_bytes == 0;
  char* host_out = b.data;
  char* host_in = inside ? b.data + (in_at - out_at) : onto ? b.data : b.data + out_bytes;
  // plan() pointed the schedule at the caller's memory; a rank without an output keeps its
  // `out`, which take_sink() replaces.
  if (is_scatter(op.kind, op.root) && op.rank == op.root) {
    op.work = host_in;  // a scatter's root works in its input (its output may be inside it)
  } else if (out_bytes > 0 && op.work == op.out) {
    op.work = host_out;
  }
  if (out_bytes > 0) op.out = host_out;
  if (in_bytes > 0) {
    if (op.log_step.send_base == op.in) op.log_step.send_base = host_in;
    op.in = host_in;
  }
  // What is copied back: the whole output, or only the parts an all_to_all_v receives (the
  // caller's bytes between them stay as they were).
  sh.out_ranges.clear();
  if (op.kind == OpKind::kAllToAllV) {
    for (std::size_t q = 0; q < n; ++q) {
      if (op.layout->recv_bytes[q] > 0) {
        sh.out_ranges.emplace_back(op.layout->recv_offset[q], op.layout->recv_bytes[q]);
      }
    }
    std::sort(sh.out_ranges.begin(), sh.out_ranges.end());
    std::size_t kept = 0;  // touching parts merged into one copy
    for (const auto& r : sh.out_ranges) {
      auto& last = sh.out_ranges[kept - (kept > 0 ? 1 : 0)];
      if (kept > 0 && r.first <= last.first + last.second) {
        last.second = std::max(last.second, r.first + r.second - last.first);
      } else {
        sh.out_ranges[kept++] = r;
      }
    }
    sh.out_ranges.resize(kept);
  } else if (out_bytes > 0) {
    sh.out_ranges.emplace_back(0, out_bytes);
  }
}

int Engine::acquire_shadow_buffer(Executor& copier, std::size_t bytes, ExecMemory where) {
  int best = -1;  // the smallest free one that holds it
  for (std::size_t i = 0; i < shadow_buffers_.size(); ++i) {
    const ShadowBuffer& b = shadow_buffers_[i];
    if (!b.busy && b.owner == &copier && b.where == where && b.capacity >= bytes &&
        (best < 0 || b.capacity < shadow_buffers_[static_cast<std::size_t>(best)].capacity)) {
      best = static_cast<int>(i);
    }
  }
  if (best >= 0) {
    shadow_buffers_[static_cast<std::size_t>(best)].busy = true;
    return best;
  }
  // Kept until the engine ends: freeing pinned memory can wait for the whole device, which may
  // be waiting for this very engine (acquire_slot). Powers of two up to 64 MiB, so that one
  // serves nearby sizes; multiples of 16 MiB beyond.
  constexpr std::size_t kLarge = std::size_t{64} << 20;
  ShadowBuffer b;
  b.capacity = bytes >= kLarge ? (bytes + kLarge / 4 - 1) / (kLarge / 4) * (kLarge / 4)
                               : std::max(kSlotGrain, std::bit_ceil(bytes));
  b.data = copier.allocate(where, b.capacity);
  b.owner = &copier;
  b.where = where;
  if (where == ExecMemory::kLinked) b.linked = copier.link_memory(b.data, b.capacity);
  b.busy = true;
  shadow_buffers_.push_back(b);
  if (where == ExecMemory::kLanding) count_landing(static_cast<std::ptrdiff_t>(b.capacity));
  return static_cast<int>(shadow_buffers_.size() - 1);
}

void Engine::release_shadow(Op& op) noexcept {
  if (op.shadow.buffer < 0) return;
  shadow_buffers_[static_cast<std::size_t>(op.shadow.buffer)].busy = false;
  op.shadow.buffer = -1;
}

void Engine::start_when_ready(Op& op) {
  if (op.life() != OpState::kStarting || op.start_pending > 0) return;
  if (op.shadow.exec != nullptr && !op.shadow.in_done) {
    // The input is in host memory now: the operation starts there.
    op.shadow.in_done = true;
    start_local(op);
    issue_start_copies(op);  // an immediate executor's complete inside, and start it
    if (op.life() != OpState::kStarting || op.start_pending > 0) return;
  }
  op.transition(OpState::kRunning);
}

void Engine::issue_start_copies(Op& op) {
  if (op.shadow.exec != nullptr && !op.shadow.in_done) {
    // Only the copy in, for now: start_when_ready() does the rest once it is done.
    ++op.start_pending;
    issue_step(*op.shadow.exec,
               copy_step(const_cast<char*>(op.in), op.shadow.user_in, op.shadow.in_bytes),
               token(kTokStart, op.seq));
    return;
  }
  if (op.start_copy_bytes > 0) {
    ++op.start_pending;
    issue_step(*op.exec, copy_step(op.start_copy_to, op.start_copy_from, op.start_copy_bytes),
               token(kTokStart, op.seq));
  }
  // The deferrable copy: an immediate executor makes it in pieces while the engine waits for
  // the network (copy_piece); any other gets it now, and the operation completes after it.
  if (op.ring.copy_left > 0 && !op.exec->immediate()) {
    ++op.local_pending;
    issue_step(*op.exec, copy_step(op.ring.copy_to, op.ring.copy_from, op.ring.copy_left),
               token(kTokLocal, op.seq));
    op.ring.copy_left = 0;
  }
}

void Engine::take_sink(Op& op) {
  // A gather's output holds every rank's block.
  const std::size_t rows = op.kind == OpKind::kAllGather ? static_cast<std::size_t>(op.nranks) : 1;
  const std::size_t bytes = op.user_count * op.el * rows;
  if (bytes == 0) return;
  if (op.device && op.shadow.exec == nullptr) {
    op.sink = op.exec->allocate(ExecMemory::kScratch, bytes);
  } else {
    op.sink_owner = scratch_.acquire(bytes, &op.sink_capacity);
    op.sink = op.sink_owner.get();
  }
  // plan() pointed the schedule at the caller's output; the sink takes its place.
  if (op.work == op.out) op.work = op.sink;
  op.out = op.sink;
}

void Engine::release_scratch(Op& op) noexcept {
  release_shadow(op);
  if (op.sink != nullptr) {
    if (op.device && op.shadow.exec == nullptr) {
      op.exec->release(ExecMemory::kScratch, op.sink);
    } else {
      scratch_.release(std::move(op.sink_owner), op.sink_capacity);
    }
    op.sink = nullptr;
  }
  if (op.device && op.scratch != nullptr) {
    op.exec->release(ExecMemory::kScratch, op.scratch);
    op.scratch = nullptr;
    return;
  }
  scratch_.release(std::move(op.scratch_owner), op.scratch_capacity);
}

void Engine::issue_step(Executor& exec, const ExecStep& step, std::uint64_t t) {
  exec.issue(step, t);
  if (exec.immediate()) step_done(t);
}

bool Engine::poll_executors() {
  bool moved = false;
  for (Executor* exec : {host_exec_.executor.get(), device_exec_.get()}) {
    if (exec == nullptr || exec->in_flight() == 0) continue;
    exec_done_.clear();
    exec->poll(exec_done_);
    for (const std::uint64_t t : exec_done_) step_done(t);
    moved = moved || !exec_done_.empty();
  }
  return moved;
}

void Engine::step_done(std::uint64_t t) {
  const auto kind = static_cast<TokenKind>(t >> kTokenShift);
  const std::uint64_t payload = t & kPayloadMask;
  switch (kind) {
    case kTokReceive: {
      Slot& slot = slots_[static_cast<std::size_t>(payload)];
      slot.done = true;
      pop_done_receives(slot.link, slot.channel);
      return;
    }
    case kTokPack: slots_[static_cast<std::size_t>(payload)].done = true; return;
    case kTokStart:
      // An operation that failed meanwhile is gone; so is the need to count. The last of its
      // start copies lets a starting operation send.
      if (Op* op = find(payload); op != nullptr && --op->start_pending == 0) {
        start_when_ready(*op);
      }
      return;
    case kTokLocal:
      if (Op* op = find(payload)) --op->local_pending;
      return;
    case kTokLogStep:
      if (Op* op = find(payload >> 8)) {
        op->log_step.step_state.at(payload & 0xff) |= LogStepState::kStepApplied;
      }
      return;
    case kTokP2p: p2p_copy_done(payload); return;
  }
  throw Error(ErrorCode::kInternal, "an executor returned a token it was never given", cfg_.rank);
}

int Engine::acquire_slot(Op& op, int link, int channel, std::size_t bytes, bool send,
                         ExecMemory where) {
  SlotQueues& q = slot_queues_[static_cast<std::size_t>(link)][static_cast<std::size_t>(channel)];
  int pick = -1;
  for (std::size_t i = 0; i < q.free.size(); ++i) {
    const Slot& s = slots_[static_cast<std::size_t>(q.free[i])];
    if (s.owner == op.exec && s.where == where && s.capacity >= bytes) {
      pick = q.free[i];
      q.free.erase(q.free.begin() + static_cast<std::ptrdiff_t>(i));
      break;
    }
  }
  if (pick < 0) {
    // A free slot of another size or executor is made anew rather than kept beside a new one,
    // so a channel holds no more slots than it ever had busy at once. Not a device
    // executor's: freeing pinned memory can wait for the whole device, which may be waiting
    // for this very engine (another rank's stream, in the same process).
    const auto host_free = std::find_if(q.free.begin(), q.free.end(), [&](int i) {
      return slots_[static_cast<std::size_t>(i)].owner != device_exec_.get();
    });
    if (host_free != q.free.end()) {
      pick = *host_free;
      q.free.erase(host_free);
      Slot& s = slots_[static_cast<std::size_t>(pick)];
      if (s.where == ExecMemory::kLinked) forget_linked(s.data, s.capacity);
      s.owner->release(s.where, s.data);
      if (s.where == ExecMemory::kLanding) count_landing(-static_cast<std::ptrdiff_t>(s.capacity));
      s.data = nullptr;
      s.capacity = 0;
    } else {
      pick = static_cast<int>(slots_.size());
      slots_.emplace_back();
    }
    Slot& s = slots_[static_cast<std::size_t>(pick)];
    // Device slots are made once, at the largest device slice (the communicator caps them).
    const std::size_t capacity =
        std::max<std::size_t>(op.device ? kDeviceSliceBytes : kSlotGrain,
                              (bytes + kSlotGrain - 1) / kSlotGrain * kSlotGrain);
    s.data = op.exec->allocate(where, capacity);
    s.capacity = capacity;
    s.owner = op.exec;
    s.where = where;
    if (where == ExecMemory::kLanding) count_landing(static_cast<std::ptrdiff_t>(capacity));
    if (where == ExecMemory::kLinked) register_send_slot(op, s, link);
  }
  Slot& s = slots_[static_cast<std::size_t>(pick)];
  s.seq = op.seq;
  s.link = link;
  s.channel = channel;
  s.dir = send ? link : 1 - link;
  s.send = send;
  s.done = false;
  s.busy = true;
  ++(send ? q.send_busy : q.recv_busy);
  return pick;
}

int Engine::borrow_slot(Op& op, int link, int channel, char* data) {
  int pick = -1;
  if (!borrowed_free_.empty()) {
    pick = borrowed_free_.back();
    borrowed_free_.pop_back();
  } else {
    pick = static_cast<int>(slots_.size());
    slots_.emplace_back();
  }
  Slot& s = slots_[static_cast<std::size_t>(pick)];
  s.data = data;
  s.capacity = 0;
  s.owner = op.exec;
  s.borrowed = true;
  s.seq = op.seq;
  s.link = link;
  s.channel = channel;
  s.dir = 1 - link;
  s.send = false;
  s.done = false;
  s.busy = true;
  return pick;
}

void Engine::register_send_slot(const Op& op, const Slot& slot, int link) {
  transport::Channel& ch = *links_[static_cast<std::size_t>(link)][0];
  const transport::DeviceMemory m = slot.owner->link_memory(slot.data, slot.capacity);
  bool ok = false;
  try {
    ok = ch.register_device_source(slot.data, slot.capacity, m);
  } catch (...) {
    if (m.dmabuf_fd >= 0) ::close(m.dmabuf_fd);
    throw;
  }
  if (m.dmabuf_fd >= 0) ::close(m.dmabuf_fd);
  if (!ok) {
    const int peer = peer_of(link);
    throw Error(ErrorCode::kSystem,
                "rank " + std::to_string(peer) + " opened a window in " + slot.owner->name() +
                    " executor memory for " + view_of(op) + ", but " + ch.describe() +
                    " cannot register this rank's memory of that kind to write into it "
                    "(GPUDirect RDMA needs dma-buf export or the peer-memory module on every "
                    "rank; DEAR_CUDA_STAGING=1 stages device memory instead)",
                cfg_.rank, peer, op.name(), static_cast<std::int64_t>(op.seq));
  }
}

void Engine::forget_linked(const char* p, std::size_t bytes) noexcept {
  // Every link: those of one back-end share their registrations, and which one registered it
  // is not kept.
  for (auto& link : links_) {
    if (link.empty()) continue;
    try {
      link[0]->forget_memory(p, bytes);
    } catch (...) {
      // A registration that cannot be dropped goes with its link.
    }
  }
}

void Engine::count_landing(std::ptrdiff_t bytes) {
  landing_bytes_ = static_cast<std::size_t>(static_cast<std::ptrdiff_t>(landing_bytes_) + bytes);
  peak_landing_bytes_ = std::max(peak_landing_bytes_, landing_bytes_);
  peak_landing_atomic_.store(peak_landing_bytes_, std::memory_order_relaxed);
}

void Engine::release_slot(int link, int channel, int id) {
  Slot& s = slots_[static_cast<std::size_t>(id)];
  if (s.borrowed) {
    s.busy = false;
    s.done = false;
    borrowed_free_.push_back(id);
    return;
  }
  SlotQueues& q = slot_queues_[static_cast<std::size_t>(link)][static_cast<std::size_t>(channel)];
  --(s.send ? q.send_busy : q.recv_busy);
  s.busy = false;
  s.done = false;
  q.free.push_back(id);
}

bool Engine::landing_full(int link, int channel) const {
  if (link >= 2) return false;
  const SlotQueues& q =
      slot_queues_[static_cast<std::size_t>(link)][static_cast<std::size_t>(channel)];
  return q.recv_busy >= cfg_.landing_slots;
}

void Engine::arrive(Op& op, int link, int channel, RecvCtx& ctx) {
  const auto dir = static_cast<std::size_t>(ctx.dir);
  const auto c = static_cast<std::size_t>(channel);
  ++op.ring.recv_next[dir][c];
  SlotQueues& q = slot_queues_[static_cast<std::size_t>(link)][c];
  if (ctx.slot < 0 && q.recv.empty()) {
    ++op.ring.recv_done[dir][c];  // nothing before it on this channel is still in flight
    return;
  }
  q.recv.push_back({ctx.slot, op.seq, ctx.dir});
  if (ctx.slot >= 0) {
    const int s = ctx.slot;
    ctx.slot = -1;
    // Written into a device window by the previous rank's adapter: visible before it is read.
    if (slots_[static_cast<std::size_t>(s)].borrowed) op.exec->remote_writes_landed();
    issue_step(*op.exec, slots_[static_cast<std::size_t>(s)].step, token(kTokReceive, s));
  } else {
    pop_done_receives(link, channel);
  }
}

void Engine::pop_done_receives(int link, int channel) {
  SlotQueues& q = slot_queues_[static_cast<std::size_t>(link)][static_cast<std::size_t>(channel)];
  while (!q.recv.empty()) {
    const RecvEntry e = q.recv.front();
    if (e.slot >= 0 && !slots_[static_cast<std::size_t>(e.slot)].done) break;
    q.recv.pop_front();
    if (Op* op = find(e.seq)) {
      ++op->ring.recv_done[static_cast<std::size_t>(e.dir)][static_cast<std::size_t>(channel)];
    }
    if (e.slot >= 0 && slots_[static_cast<std::size_t>(e.slot)].borrowed) {
      ++window_freed_[static_cast<std::size_t>(channel)];  // its ring slot may be written again
    }
    if (e.slot >= 0) release_slot(link, channel, e.slot);
  }
}

bool Engine::pack_sends(Op& op, int dir, int channel) {
  // A bounced operation's messages leave from send slots: each is packed by the executor
  // first, and pump_slot_sends() queues it once that is done, in the order packed.
  bool moved = false;
  const auto di = static_cast<std::size_t>(dir);
  const auto c = static_cast<std::size_t>(channel);
  SlotQueues& q = slot_queues_[di][c];
  const std::uint32_t total = op.ring.messages_sent_per_channel(dir);
  std::uint32_t& next = op.ring.send_next[di][c];
  while (next < total && q.send_busy < cfg_.landing_slots) {
    const auto lag = static_cast<std::uint32_t>(op.ring.dep_lag);
    if (op.ring.forwards && next >= lag && op.ring.recv_done[di][c] <= next - lag) break;
    const MessagePlan m = send_plan(op, dir, channel, next);
    // Into the next rank's window on device memory, where it opened one: from a send slot
    // the link reads directly (registered), never through the host, into the channel's next
    // slot of the window's ring once the next rank has finished with what was there.
    const bool direct = dir == kForward && op.ring.has_peer_window;
    const auto k = static_cast<std::uint64_t>(cfg_.landing_slots);
    if (direct) {
      if (op.ring.peer_window.bytes != window_ring_bytes(kNext)) {
        throw Error(ErrorCode::kMismatch,
                    "rank " + std::to_string(peer_of(kNext)) + " opened a device window of " +
                        std::to_string(op.ring.peer_window.bytes) + " bytes, this rank expects " +
                        std::to_string(window_ring_bytes(kNext)) +
                        ": the ranks use different channels or landing_slots",
                    cfg_.rank, peer_of(kNext), op.name(), static_cast<std::int64_t>(op.seq));
      }
      if (window_sent_[c] >= window_credit_[c] + k) break;
    }
    const int s = acquire_slot(op, dir, channel, m.span.bytes, true,
                               direct ? ExecMemory::kLinked : ExecMemory::kLanding);
    Slot& slot = slots_[static_cast<std::size_t>(s)];
    slot.header = data_frame(op, next, m.span.bytes);
    slot.direct = direct;
    slot.window = op.ring.peer_window;
    if (direct) {
      const std::uint64_t n = window_sent_[c]++;
      slot.direct_at =
          (c * static_cast<std::size_t>(k) + static_cast<std::size_t>(n % k)) * kDeviceSliceBytes;
    }
    q.send.push_back(s);
    issue_step(*op.exec, copy_step(slot.data, send_source(op, m), m.span.bytes),
               token(kTokPack, static_cast<std::uint64_t>(s)));
    ++next;
    moved = true;
  }
  return moved;
}

bool Engine::send_window_credits() {
  bool moved = false;
  for (std::size_t c = 0; c < window_freed_.size(); ++c) {
    if (window_freed_[c] == window_credited_[c]) continue;
    transport::Channel& ch = *links_[kPrev][c];
    if (ch.closed()) continue;
    transport::FrameHeader h;
    h.type = transport::FrameType::kCredit;
    h.count = window_freed_[c];
    if (!ch.try_send(h, nullptr, engine_detail::kControlToken)) continue;  // a later turn
    window_credited_[c] = window_freed_[c];
    moved = true;
  }
  return moved;
}

bool Engine::pump_slot_sends() {
  bool moved = false;
  for (std::size_t l = 0; l < slot_queues_.size(); ++l) {
    for (std::size_t c = 0; c < slot_queues_[l].size(); ++c) {
      SlotQueues& q = slot_queues_[l][c];
      transport::Channel& ch = *links_[l][c];
      while (!q.send.empty() && !ch.closed()) {
        const int s = q.send.front();
        const Slot& slot = slots_[static_cast<std::size_t>(s)];
        if (!slot.done) break;
        const std::uint64_t t = kSlotSendBit | static_cast<std::uint64_t>(s);
        const bool queued =
            slot.direct ? ch.try_send_direct(slot.header, slot.data, t, slot.window, slot.direct_at)
                        : ch.try_send(slot.header, slot.data, t);
        if (!queued) break;
        q.send.pop_front();
        moved = true;
      }
    }
  }
  return moved;
}

void Engine::slot_sent(int link, int channel, std::uint64_t t) {
  const int s = static_cast<int>(t & ~kSlotSendBit);
  if (Op* op = find(slots_[static_cast<std::size_t>(s)].seq)) {
    ++op->ring.send_done[static_cast<std::size_t>(link)][static_cast<std::size_t>(channel)];
  }
  release_slot(link, channel, s);
}

bool Engine::advance_finish(Op& op) {
  if (op.shadow.out_issued) return true;  // and done: the operation is finished()
  if (!op.exec->immediate()) {
    // The final local reductions, one at a time: each reads what the one before wrote.
    if (op.finish_next < final_step_count(op)) {
      ++op.local_pending;
      issue_step(*op.exec, final_step(op, op.finish_next++), token(kTokLocal, op.seq));
      return false;
    }
  }
  finish_local(op, op.exec->immediate());
  if (op.shadow.exec != nullptr && !op.shadow.out_ranges.empty()) {
    // The result back to the caller's memory; the operation completes once it is there.
    op.shadow.out_issued = true;
    op.local_pending += static_cast<int>(op.shadow.out_ranges.size());
    for (const auto& [at, bytes] : op.shadow.out_ranges) {
      issue_step(*op.shadow.exec, copy_step(op.shadow.user_out + at, op.out + at, bytes),
                 token(kTokLocal, op.seq));
    }
    return op.local_pending == 0;
  }
  return true;
}

bool Engine::steps_in_flight() const {
  for (const Executor* exec : {host_exec_.executor.get(), device_exec_.get()}) {
    if (exec != nullptr && exec->in_flight() > 0) return true;
  }
  return false;
}

std::chrono::microseconds Engine::executor_poll_interval() const {
  std::chrono::microseconds nap{0};
  for (const Executor* exec : {host_exec_.executor.get(), device_exec_.get()}) {
    if (exec == nullptr || exec->in_flight() == 0) continue;
    const auto i = exec->poll_interval();
    if (i.count() > 0) nap = nap.count() > 0 ? std::min(nap, i) : i;
  }
  return nap;
}

void Engine::drain_executors() noexcept {
  for (Executor* exec : {host_exec_.executor.get(), device_exec_.get()}) {
    if (exec != nullptr) exec->drain();
  }
  // Every slot's step is over; what the slots held belongs to operations that are failing.
  for (auto& link : slot_queues_) {
    for (auto& q : link) {
      q.recv.clear();
      q.send.clear();
    }
  }
  for (std::size_t i = 0; i < slots_.size(); ++i) {
    Slot& s = slots_[i];
    if (!s.busy) continue;
    release_slot(s.link, s.channel, static_cast<int>(i));
  }
}

void Engine::free_slots() noexcept {
  drain_executors();
  for (Slot& s : slots_) {
    if (s.data != nullptr && !s.borrowed) {
      if (s.where == ExecMemory::kLinked) forget_linked(s.data, s.capacity);
      s.owner->release(s.where, s.data);
    }
    s.data = nullptr;
  }
  slots_.clear();
  borrowed_free_.clear();
  for (ShadowBuffer& b : shadow_buffers_) {
    if (b.where == ExecMemory::kLinked) forget_linked(b.data, b.capacity);
    if (b.linked.dmabuf_fd >= 0) ::close(b.linked.dmabuf_fd);
    b.owner->release(b.where, b.data);
  }
  shadow_buffers_.clear();
}

}  // namespace dear::collectives
