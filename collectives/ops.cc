#include "collectives/ops.h"

#include <algorithm>
#include <cstring>
#include <string>

#include "collectives/reduce.h"
#include "collectives/steps.h"
#include "dear/error.h"

namespace dear::collectives {
namespace {

// Element range [begin, begin + len) of part i when `total` is split into `parts` nearly equal
// parts (the first total % parts parts one element longer).
struct Range {
  std::size_t begin;
  std::size_t len;
};
Range split(std::size_t total, std::size_t parts, std::size_t i) {
  const std::size_t base = total / parts;
  const std::size_t rem = total % parts;
  return {i * base + std::min(i, rem), base + (i < rem ? 1 : 0)};
}

int ring_mod(int x, int n) { return ((x % n) + n) % n; }

std::size_t ceil_div(std::size_t a, std::size_t b) { return (a + b - 1) / b; }

Span span_of(const Op& op, int chunk, int channel, int slice) {
  const Range c = split(op.ring.total, static_cast<std::size_t>(op.ring.nchunks),
                        static_cast<std::size_t>(chunk));
  const Range p =
      split(c.len, static_cast<std::size_t>(op.ring.channels), static_cast<std::size_t>(channel));
  const Range s =
      split(p.len, static_cast<std::size_t>(op.ring.slices), static_cast<std::size_t>(slice));
  return {(c.begin + p.begin + s.begin) * op.el, s.len * op.el};
}

// Byte offset of chunk `chunk` in the element space.
std::size_t chunk_offset(const Op& op, int chunk) {
  return split(op.ring.total, static_cast<std::size_t>(op.ring.nchunks),
               static_cast<std::size_t>(chunk))
             .begin *
         op.el;
}

}  // namespace

const char* to_string(OpKind k) noexcept {
  switch (k) {
    case OpKind::kAllReduce: return "all_reduce";
    case OpKind::kReduceScatter: return "reduce_scatter";
    case OpKind::kAllGather: return "all_gather";
    case OpKind::kBroadcast: return "broadcast";
    case OpKind::kBarrier: return "barrier";
    case OpKind::kAllToAll: return "all_to_all";
    case OpKind::kAllToAllV: return "all_to_all_v";
  }
  return "unknown";
}

const char* call_name(OpKind kind, int root) noexcept {
  if (is_reduce(kind, root)) return "reduce";
  if (is_scatter(kind, root)) return "scatter";
  if (kind == OpKind::kAllToAllV && root >= 0) return "gather_v";
  return is_gather(kind, root) ? "gather" : to_string(kind);
}

const char* to_string(Schedule s) noexcept {
  switch (s) {
    case Schedule::kRing: return "ring";
    case Schedule::kGatherReduce: return "gather_reduce";
    case Schedule::kChain: return "chain";
    case Schedule::kBiGather: return "bi_gather";
    case Schedule::kRecursiveDoubling: return "recursive_doubling";
    case Schedule::kHalvingDoubling: return "halving_doubling";
    case Schedule::kTree: return "tree";
    case Schedule::kPairwise: return "pairwise";
    case Schedule::kScattered: return "scattered";
    case Schedule::kBruck: return "bruck";
  }
  return "unknown";
}

const char* to_string(OpState s) noexcept {
  switch (s) {
    case OpState::kQueued: return "queued";
    case OpState::kStarting: return "starting";
    case OpState::kRunning: return "running";
    case OpState::kFinishing: return "finishing";
    case OpState::kDone: return "done";
    case OpState::kFailed: return "failed";
  }
  return "unknown";
}

bool transition_allowed(OpState from, OpState to) noexcept {
  switch (from) {
    case OpState::kQueued: return to == OpState::kStarting || to == OpState::kFailed;
    case OpState::kStarting: return to == OpState::kRunning || to == OpState::kFailed;
    case OpState::kRunning: return to == OpState::kFinishing || to == OpState::kFailed;
    case OpState::kFinishing: return to == OpState::kDone || to == OpState::kFailed;
    case OpState::kDone:
    case OpState::kFailed: break;
  }
  return false;
}

void Op::transition(OpState to) {
  if (!transition_allowed(life_, to)) {
    throw Error(ErrorCode::kInternal,
                std::string("operation #") + std::to_string(seq) + " (" +
                    collectives::to_string(kind) + ") on rank " + std::to_string(rank) +
                    " cannot go from " + collectives::to_string(life_) + " to " +
                    collectives::to_string(to),
                rank, Error::kNone, collectives::to_string(kind), static_cast<std::int64_t>(seq));
  }
  life_ = to;
}

std::unique_ptr<char[]> ScratchPool::acquire(std::size_t bytes, std::size_t* capacity) {
  // Best fit among the spare buffers; a new one only when none is large enough.
  auto best = free_.end();
  for (auto it = free_.begin(); it != free_.end(); ++it) {
    if (it->first >= bytes && (best == free_.end() || it->first < best->first)) best = it;
  }
  if (best != free_.end()) {
    *capacity = best->first;
    auto buf = std::move(best->second);
    free_.erase(best);
    return buf;
  }
  *capacity = std::max<std::size_t>(bytes, 64);
  return std::unique_ptr<char[]>(new char[*capacity]);
}

void ScratchPool::release(std::unique_ptr<char[]> buf, std::size_t capacity) {
  if (!buf) return;
  constexpr std::size_t kMaxSpare = 8;
  if (free_.size() >= kMaxSpare) {
    // Keep the largest buffers: they are the expensive ones to make again.
    auto smallest = std::min_element(
        free_.begin(), free_.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
    if (smallest->first >= capacity) return;
    free_.erase(smallest);
  }
  free_.emplace_back(capacity, std::move(buf));
}

std::uint8_t kind_byte(const Op& op) {
  // Three bits of schedule. all_to_all's two schedules (8 and 9, beyond them) send the same
  // messages (steps.cc), in another order only: ranks need not agree on which (all_to_all_v's
  // choice is each rank's own, by its own sizes), so none travels. A rooted operation's
  // kScattered travels as 0, which no other schedule uses (schedule_of_wire).
  const unsigned wire = is_all_to_all(op.kind) || op.schedule == Schedule::kScattered
                            ? 0U
                            : static_cast<unsigned>(op.schedule);
  // all_to_all_v's messages are the same from host and device memory, and whether a rank
  // passes device memory depends on its own sizes (one with nothing to exchange passes none):
  // its ranks need not agree on it either.
  const bool device = op.device && op.kind != OpKind::kAllToAllV;
  return static_cast<std::uint8_t>(static_cast<unsigned>(op.kind) | ((wire & 0x07U) << 4) |
                                   (device ? 0x80U : 0U));
}

Schedule schedule_of_wire(std::uint8_t kind) noexcept {
  const unsigned bits = (static_cast<unsigned>(kind) >> 4) & 0x07U;
  return bits == 0 ? Schedule::kScattered : static_cast<Schedule>(bits);
}

transport::FrameHeader data_frame(const Op& op, std::uint32_t index, std::size_t bytes) {
  transport::FrameHeader h;
  h.bytes = static_cast<std::uint32_t>(bytes);
  h.type = transport::FrameType::kData;
  h.kind = kind_byte(op);
  h.dtype = static_cast<std::uint8_t>(op.dtype);
  h.redop = static_cast<std::uint8_t>(op.redop);
  h.seq = op.seq;
  h.index = index;
  h.root = op.root;
  h.count = op.user_count;
  return h;
}

bool Op::finished() const {
  if (start_pending > 0 || local_pending > 0) return false;
  if (is_log_step(schedule)) {
    return log_step.step_next == log_step.plan.steps.size() && log_step.sends_in_flight == 0;
  }
  for (int d = 0; d < 2; ++d) {
    const auto di = static_cast<std::size_t>(d);
    const std::uint32_t ns = ring.messages_sent_per_channel(d);
    const std::uint32_t nr = ring.messages_received_per_channel(d);
    for (int c = 0; c < ring.channels; ++c) {
      const auto ci = static_cast<std::size_t>(c);
      if (ring.send_done[di][ci] != ns || ring.recv_done[di][ci] != nr) return false;
    }
  }
  return true;
}

namespace {

// A ring reduce or gather: the all-gather steps (all_reduce's second half, all_gather's only
// one) carry each block only as far as the root. At all-gather step s rank r forwards the
// block of rank r - s, which is wanted at r + 1 only if r + 1 lies on its way to the root:
// a rank d hops before the root (d = root - r mod N) sends steps 0 .. N-d-1 of them and
// receives steps 0 .. N-d-2, the root receives all N-1 and sends none. The steps kept are a
// prefix of the all-gather's, so every message keeps its index and chunk (chunk_sent).
void trim_to_root(Op& op) {
  const int n = op.nranks;
  const int d = ring_mod(op.root - op.rank, n);
  const int before = op.kind == OpKind::kAllReduce ? n - 1 : 0;  // the reduce-scatter's steps
  op.ring.send_steps[kForward] = before + (d == 0 ? 0 : n - d);
  op.ring.recv_steps[kForward] = before + (d == 0 ? n - 1 : n - d - 1);
}

}  // namespace

void plan(Op& op, int rank, int nranks, const SliceGeometryOptions& geo) {
  op.rank = rank;
  op.nranks = nranks;
  op.el = op.kind == OpKind::kBarrier ? 1 : dtype_size(op.dtype);
  const int n = nranks;
  if (is_log_step(op.schedule)) {
    // Whole messages over the mesh links; the ring part stays as made (no messages).
    op.log_step.plan =
        op.kind == OpKind::kAllToAllV
            ? plan_all_to_all_v(op.schedule, rank, nranks, *op.layout)
            : plan_steps(op.kind, op.schedule, rank, nranks, op.user_count, op.el, op.root);
    op.log_step.step_state.assign(op.log_step.plan.steps.size(), 0);
    op.eager = op.log_step.plan.work_bytes <= geo.eager_bytes;
    // A scatter's root only sends, from its input; every other rank gathers its branch in
    // scratch (work_is_scratch).
    op.work = is_scatter(op.kind, op.root) && rank == op.root ? const_cast<char*>(op.in) : op.out;
    op.log_step.send_base = op.in;  // the engine's copy instead for an in-place all_to_all
    return;
  }
  op.ring.forwards = true;
  switch (op.kind) {
    case OpKind::kAllReduce:
      if (op.schedule == Schedule::kGatherReduce) {
        // Half the blocks travel forward, the rest backward: ceil((N-1)/2) steps, not N-1.
        op.ring.total = op.user_count * static_cast<std::size_t>(n);
        op.ring.send_steps[kForward] = op.ring.recv_steps[kForward] = n / 2;
        op.ring.send_steps[kBackward] = op.ring.recv_steps[kBackward] = (n - 1) / 2;
      } else {
        op.ring.total = op.user_count;
        op.ring.send_steps[kForward] = op.ring.recv_steps[kForward] = 2 * (n - 1);
      }
      op.ring.nchunks = n;
      break;
    case OpKind::kReduceScatter:
    case OpKind::kAllGather:
    case OpKind::kBarrier:
      op.ring.total = op.user_count * static_cast<std::size_t>(n);
      op.ring.nchunks = n;
      if (op.schedule == Schedule::kBiGather) {
        op.ring.send_steps[kForward] = op.ring.recv_steps[kForward] = n / 2;
        op.ring.send_steps[kBackward] = op.ring.recv_steps[kBackward] = (n - 1) / 2;
      } else {
        op.ring.send_steps[kForward] = op.ring.recv_steps[kForward] = n - 1;
      }
      break;
    case OpKind::kBroadcast: {
      op.ring.total = op.user_count;
      op.ring.nchunks = 1;
      const int pos = ring_mod(rank - op.root, n);
      op.ring.send_steps[kForward] = pos < n - 1 ? 1 : 0;
      op.ring.recv_steps[kForward] = pos > 0 ? 1 : 0;
      op.ring.forwards = pos > 0;
      break;
    }
    case OpKind::kAllToAll:
    case OpKind::kAllToAllV: break;  // log-step schedules only (above)
  }
  const std::size_t chunk_elems =
      ceil_div(op.ring.total, static_cast<std::size_t>(op.ring.nchunks));
  const std::size_t chunk_bytes = chunk_elems * op.el;
  const std::size_t wanted =
      std::max<std::size_t>(1, chunk_bytes / std::max<std::size_t>(1, geo.min_channel_bytes));
  op.ring.channels = static_cast<int>(
      std::clamp<std::size_t>(wanted, 1, static_cast<std::size_t>(std::max(1, geo.channels))));
  const std::size_t part_bytes =
      ceil_div(chunk_elems, static_cast<std::size_t>(op.ring.channels)) * op.el;
  op.ring.slices = static_cast<int>(
      std::max<std::size_t>(1, ceil_div(part_bytes, std::max<std::size_t>(1, geo.slice_bytes))));
  op.ring.dep_lag = op.kind == OpKind::kBroadcast ? 0 : op.ring.slices;
  op.eager = chunk_bytes * static_cast<std::size_t>(std::max(op.ring.send_steps[kForward],
                                                             op.ring.recv_steps[kForward])) <=
             geo.eager_bytes;
  op.work = op.out;
  // After the eagerness, which every rank must decide alike: the step counts below differ.
  if (is_rooted_result(op.kind, op.root) && op.schedule == Schedule::kRing) trim_to_root(op);
}

namespace {

// The chunk that rank `r` sends at `step` in direction `dir`. A rank receives at each step
// what its neighbour on the other side sends, so the receive side is the same formula
// evaluated for that neighbour.
int chunk_sent(const Op& op, int dir, int r, int step) {
  const int n = op.nranks;
  const int s = step;
  // Backward, a rank sends its own block first, then forwards what its next rank sent.
  if (dir == kBackward) return ring_mod(r + s, n);
  switch (op.kind) {
    case OpKind::kAllReduce:
      if (op.schedule == Schedule::kGatherReduce) return ring_mod(r - s, n);
      return s < n - 1 ? ring_mod(r - s - 1, n) : ring_mod(r - (s - (n - 1)), n);
    case OpKind::kReduceScatter: return ring_mod(r - s - 1, n);
    case OpKind::kAllGather:
    case OpKind::kBarrier: return ring_mod(r - s, n);
    case OpKind::kBroadcast:
    case OpKind::kAllToAll:
    case OpKind::kAllToAllV: return 0;  // all_to_all never runs on the ring links
  }
  return 0;
}

MessagePlan message_plan(const Op& op, int dir, int channel, std::uint32_t index, int sender) {
  MessagePlan m;
  m.step = static_cast<int>(index / static_cast<std::uint32_t>(op.ring.slices));
  const int slice = static_cast<int>(index % static_cast<std::uint32_t>(op.ring.slices));
  m.chunk = chunk_sent(op, dir, sender, m.step);
  m.span = span_of(op, m.chunk, channel, slice);
  return m;
}

}  // namespace

MessagePlan send_plan(const Op& op, int dir, int channel, std::uint32_t index) {
  return message_plan(op, dir, channel, index, op.rank);
}

MessagePlan recv_plan(const Op& op, int dir, int channel, std::uint32_t index) {
  // What arrives is what the neighbour on the receiving side sends in that direction.
  return message_plan(op, dir, channel, index, dir == kForward ? op.rank - 1 : op.rank + 1);
}

const char* send_source(const Op& op, const MessagePlan& m) {
  const std::size_t off = m.span.offset;
  switch (op.kind) {
    case OpKind::kAllReduce:
      if (op.schedule == Schedule::kGatherReduce) return op.work + off;
      return (m.step == 0 ? op.in : op.out) + off;
    case OpKind::kReduceScatter: return m.step == 0 ? op.in + off : op.scratch + off;
    case OpKind::kAllGather:
    case OpKind::kBarrier:
      // The own block goes out from the caller's input; later steps forward what arrived.
      if (m.step == 0) return op.in + (off - chunk_offset(op, op.rank));
      return op.out + off;
    case OpKind::kBroadcast: return (op.rank == op.root ? op.in : op.out) + off;
    case OpKind::kAllToAll:
    case OpKind::kAllToAllV: break;
  }
  return nullptr;
}

RecvPlace recv_place(const Op& op, const MessagePlan& m) {
  const std::size_t off = m.span.offset;
  const int n = op.nranks;
  switch (op.kind) {
    case OpKind::kAllReduce:
      if (op.schedule == Schedule::kGatherReduce) return {op.work + off, nullptr, false};
      if (m.step < n - 1) return {op.out + off, op.in + off, m.step == n - 2};
      return {op.out + off, nullptr, false};
    case OpKind::kReduceScatter:
      if (m.step == n - 2) {
        return {op.out + (off - chunk_offset(op, op.rank)), op.in + off, true};
      }
      return {op.scratch + off, op.in + off, false};
    case OpKind::kAllGather:
    case OpKind::kBarrier:
    case OpKind::kBroadcast: return {op.out + off, nullptr, false};
    case OpKind::kAllToAll:
    case OpKind::kAllToAllV: break;
  }
  return {};
}

namespace {

// Whether direction kForward of `op` moves messages a receiver may take directly: large ring
// and chain schedules (an eager operation's slices may arrive before the receiver has posted
// it, so it has no window to offer them).
bool has_direct_messages(const Op& op) {
  if (op.eager || op.out == nullptr || op.bounced) return false;
  switch (op.kind) {
    case OpKind::kAllReduce:
    case OpKind::kAllGather: return op.schedule == Schedule::kRing;
    case OpKind::kBroadcast: return op.schedule == Schedule::kChain;
    case OpKind::kReduceScatter:
    case OpKind::kBarrier:
    case OpKind::kAllToAll:
    case OpKind::kAllToAllV: break;
  }
  return false;
}

}  // namespace

DirectRegion direct_region(const Op& op) {
  if (!has_direct_messages(op) || op.ring.recv_steps[kForward] == 0) return {};
  // No message is larger than the first slice of chunk 0 on channel 0 (the last chunk, and
  // a part's last slice, may be shorter).
  return {op.out, op.ring.total * op.el, span_of(op, 0, 0, 0).bytes};
}

DirectRegion device_window_region(const Op& op) {
  if (!op.bounced || op.eager || op.ring.recv_steps[kForward] == 0 ||
      op.ring.recv_steps[kBackward] != 0 || op.ring.send_steps[kBackward] != 0) {
    return {};
  }
  switch (op.kind) {
    case OpKind::kAllReduce:
    case OpKind::kReduceScatter:
    case OpKind::kAllGather:
      if (op.schedule != Schedule::kRing || op.root >= 0) return {};
      break;
    case OpKind::kBroadcast:
      if (op.schedule != Schedule::kChain) return {};
      break;
    case OpKind::kBarrier:
    case OpKind::kAllToAll:
    case OpKind::kAllToAllV: return {};
  }
  return {nullptr, op.ring.total * op.el, span_of(op, 0, 0, 0).bytes};
}

std::int64_t direct_offset(const Op& op, const MessagePlan& m) {
  if (!has_direct_messages(op)) return -1;
  // The receiver's recv_place() for these is op.out + span.offset, without an operand: an
  // all_reduce's all-gather steps, and every step of all_gather and broadcast.
  if (op.kind == OpKind::kAllReduce && m.step < op.nranks - 1) return -1;
  return static_cast<std::int64_t>(m.span.offset);
}

namespace {

// Copies [from, from + bytes) to `to` now, or leaves it to copy_piece() and finish_local()
// where nothing reads `to` before the operation completes: a ring all_gather sends its own
// block from the input, and a chain broadcast's root sends from its input (send_source). The
// copy then no longer holds back the operation's first messages and its window. A barrier's
// few bytes are copied at once.
void copy_or_defer(Op& op, char* to, const char* from, std::size_t bytes) {
  const bool deferrable = op.kind != OpKind::kBarrier && !is_log_step(op.schedule);
  if (!deferrable) {
    op.start_copy_to = to;
    op.start_copy_from = from;
    op.start_copy_bytes = bytes;
    return;
  }
  op.ring.copy_to = to;
  op.ring.copy_from = from;
  op.ring.copy_left = bytes;
}

}  // namespace

void start_local(Op& op) {
  const std::size_t block = op.user_count * op.el;
  if (is_log_step(op.schedule)) {
    // Steps read and reduce in the work buffer: it starts as the input, which the steps read
    // from where they have not written yet (work_source), so the first ones need no copy.
    op.log_step.input_in_place = op.kind == OpKind::kAllReduce && op.out != op.in && block > 0 &&
                                 !op.log_step.plan.work_is_scratch && op.work == op.out;
    op.log_step.written.clear();
    if (op.log_step.input_in_place) op.log_step.written.reserve(op.log_step.plan.steps.size() + 1);
    // A scatter's scratch starts empty: its blocks all arrive.
    if (op.log_step.plan.work_is_scratch && op.log_step.plan.work_bytes > 0 &&
        !is_scatter(op.kind, op.root)) {
      std::memcpy(op.work, op.in, op.log_step.plan.work_bytes);
    }
    // An in-place all_to_all sends from the engine's copy of its input (its receives overwrite
    // blocks it has still to send).
    if (op.log_step.send_base != op.in && op.log_step.plan.work_bytes > 0) {
      std::memcpy(const_cast<char*>(op.log_step.send_base), op.in, op.log_step.plan.work_bytes);
    }
  }
  switch (op.kind) {
    case OpKind::kAllReduce:
      if (op.schedule == Schedule::kGatherReduce && block > 0) {
        op.start_copy_to = op.work + static_cast<std::size_t>(op.rank) * block;
        op.start_copy_from = op.in;
        op.start_copy_bytes = block;
      }
      break;
    case OpKind::kAllGather:
    case OpKind::kBarrier: {
      // A ring or scattered gather's other ranks send their own block from the input
      // (send_source, Step::send_input) and nobody reads their sink.
      if (is_gather(op.kind, op.root) && op.rank != op.root &&
          (!is_log_step(op.schedule) || op.schedule == Schedule::kScattered)) {
        break;
      }
      char* own = op.out + static_cast<std::size_t>(op.rank) * block;
      if (own != op.in && block > 0) copy_or_defer(op, own, op.in, block);
      break;
    }
    case OpKind::kBroadcast:
      if (op.rank == op.root && op.out != op.in && block > 0) {
        copy_or_defer(op, op.out, op.in, block);
      }
      break;
    case OpKind::kReduceScatter: break;
    case OpKind::kAllToAll: {
      // The own block, out of place (in place, the sends read the engine's copy of the input).
      const std::size_t own = static_cast<std::size_t>(op.rank) * block;
      if (op.in != op.out && block > 0) {
        op.start_copy_to = op.out + own;
        op.start_copy_from = op.in + own;
        op.start_copy_bytes = block;
      }
      break;
    }
    case OpKind::kAllToAllV: {
      // The own part (the communicator checked that both sides give it the same size).
      const auto r = static_cast<std::size_t>(op.rank);
      if (op.layout->send_bytes[r] > 0) {
        op.start_copy_to = op.out + op.layout->recv_offset[r];
        op.start_copy_from = op.in + op.layout->send_offset[r];
        op.start_copy_bytes = op.layout->send_bytes[r];
      }
      break;
    }
  }
}

bool copy_piece(Op& op, std::size_t max_bytes) {
  const std::size_t n = std::min(op.ring.copy_left, max_bytes);
  if (n == 0) return false;
  std::memcpy(op.ring.copy_to, op.ring.copy_from, n);
  op.ring.copy_to += n;
  op.ring.copy_from += n;
  op.ring.copy_left -= n;
  return true;
}

namespace {

// Whether any / every byte of [lo, hi) is in op.log_step.written.
struct Coverage {
  bool any = false;
  bool all = false;
};
Coverage coverage(const Op& op, std::size_t lo, std::size_t hi) {
  std::size_t covered = 0;
  for (const auto& [b, e] : op.log_step.written) {
    const std::size_t from = std::max(b, lo);
    const std::size_t to = std::min(e, hi);
    if (from < to) covered += to - from;
  }
  return {covered > 0, covered == hi - lo};
}

// Copies from the input the parts of [offset, offset + bytes) of the work buffer that no step
// has written, and records the whole range as written.
void fill_from_input(Op& op, std::size_t offset, std::size_t bytes) {
  const std::size_t hi = offset + bytes;
  std::size_t at = offset;
  for (const auto& [b, e] : op.log_step.written) {
    if (e <= at) continue;
    if (b >= hi) break;
    if (b > at) std::memcpy(op.work + at, op.in + at, b - at);
    at = std::max(at, e);
  }
  if (at < hi) std::memcpy(op.work + at, op.in + at, hi - at);
  work_written(op, offset, bytes);
}

}  // namespace

const char* work_source(Op& op, std::size_t offset, std::size_t bytes) {
  if (!op.log_step.input_in_place || bytes == 0) return op.work + offset;
  const Coverage c = coverage(op, offset, offset + bytes);
  if (!c.any) return op.in + offset;
  if (!c.all) fill_from_input(op, offset, bytes);
  return op.work + offset;
}

void work_written(Op& op, std::size_t offset, std::size_t bytes) {
  if (!op.log_step.input_in_place || bytes == 0) return;
  std::size_t lo = offset;
  std::size_t hi = offset + bytes;
  auto& w = op.log_step.written;
  // Merge with every range that overlaps or touches [lo, hi).
  auto first = std::lower_bound(w.begin(), w.end(), lo,
                                [](const auto& r, std::size_t v) { return r.second < v; });
  auto last = first;
  while (last != w.end() && last->first <= hi) {
    lo = std::min(lo, last->first);
    hi = std::max(hi, last->second);
    ++last;
  }
  first = w.erase(first, last);
  w.insert(first, {lo, hi});
}

void finish_local(Op& op, bool reductions) {
  copy_piece(op, op.ring.copy_left);
  // Bytes no step wrote (none in dear's schedules) still hold the input's value.
  if (op.log_step.input_in_place) fill_from_input(op, 0, op.user_count * op.el);
  if (is_scatter(op.kind, op.root) && op.rank == op.root) {
    // The root's own block, unless it is in place (out == in + root * block).
    const std::size_t block = op.user_count * op.el;
    const char* own = op.in + static_cast<std::size_t>(op.rank) * block;
    if (block > 0 && own != op.out) std::memcpy(op.out, own, block);
    return;
  }
  if (op.log_step.plan.work_is_scratch) {
    const std::size_t block = op.user_count * op.el;
    if (block > 0) {
      std::memcpy(op.out, op.work + static_cast<std::size_t>(op.rank) * block, block);
    }
    return;
  }
  if (reductions) {
    for (std::size_t i = 0; i < final_step_count(op); ++i) run_on_host(final_step(op, i));
  }
}

std::size_t final_step_count(const Op& op) {
  if (op.kind != OpKind::kAllReduce || op.schedule != Schedule::kGatherReduce) return 0;
  if (is_reduce(op.kind, op.root) && op.rank != op.root) return 0;  // nobody reads the sink
  return op.nranks == 2 ? 1 : static_cast<std::size_t>(op.nranks - 1);
}

ExecStep final_step(const Op& op, std::size_t i) {
  // Every rank reduces the same blocks in the same order, so all get identical bits: step 0
  // reduces blocks 0 and 1 into the output, step i > 0 block i + 1 into it.
  const std::size_t block = op.user_count * op.el;
  const char* w = op.work;
  ExecStep s;
  s.kind = i + 1 == final_step_count(op) ? ExecStep::kReduceFinal : ExecStep::kReduce;
  s.dst = op.out;
  s.a = i == 0 ? w : op.out;
  s.b = w + (i + 1) * block;
  s.n = op.user_count;
  s.dtype = op.dtype;
  s.op = op.redop;
  s.nranks = op.nranks;
  return s;
}

}  // namespace dear::collectives
