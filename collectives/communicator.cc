#include "dear/communicator.h"

#include <sched.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <mutex>
#include <tuple>

#include "collectives/cost_model.h"
#include "collectives/device_staging.h"
#include "collectives/engine.h"
#include "collectives/ops.h"
#include "collectives/reduce.h"
#include "collectives/resident.h"
#include "collectives/steps.h"
#include "common/args.h"
#include "common/env.h"
#include "transport/delay_channel.h"
#include "transport/signals.h"
#include "transport/transport.h"
#if defined(DEAR_HAVE_CUDA)
#include "cuda/device.h"
#endif

namespace dear {

const char* to_string(Algorithm a) noexcept {
  switch (a) {
    case Algorithm::kAuto: return "auto";
    case Algorithm::kRing: return "ring";
    case Algorithm::kGatherReduce: return "gather_reduce";
    case Algorithm::kHalvingDoubling: return "halving_doubling";
    case Algorithm::kRecursiveDoubling: return "recursive_doubling";
    case Algorithm::kTree: return "tree";
    case Algorithm::kPairwise: return "pairwise";
    case Algorithm::kScattered: return "scattered";
    case Algorithm::kBruck: return "bruck";
  }
  return "invalid";
}

std::optional<Algorithm> parse_algorithm(std::string_view name) noexcept {
  for (const auto a : {Algorithm::kAuto, Algorithm::kRing, Algorithm::kGatherReduce,
                       Algorithm::kHalvingDoubling, Algorithm::kRecursiveDoubling, Algorithm::kTree,
                       Algorithm::kPairwise, Algorithm::kScattered, Algorithm::kBruck}) {
    if (name == to_string(a)) return a;
  }
  return std::nullopt;
}

bool Work::test() const {
  if (!state_) return true;
  if (state_->status.load(std::memory_order_acquire) != 0) return true;
  // A small operation advances when its caller polls it (as MPI_Test does), not only on the
  // engine thread's next idle tick.
  if (state_->driven) {
    if (auto engine = state_->engine.lock()) engine->poke();
  }
  return state_->status.load(std::memory_order_acquire) != 0;
}

bool Work::wait(std::chrono::milliseconds timeout) const {
  if (!state_) return true;
  const auto start = std::chrono::steady_clock::now();
  // Before sleeping, make progress on this thread (small operations: until done, or until
  // nothing has moved for wait_spin_us) or yield for wait_spin_us while the engine thread,
  // kept spinning meanwhile, carries the operation (large ones): a sleep costs a wake-up
  // through the kernel on top, on each side.
  const int spin_us = state_->wait_spin_us;
  if (spin_us > 0 && state_->status.load(std::memory_order_acquire) == 0) {
    const auto limit = timeout == std::chrono::milliseconds::max()
                           ? std::chrono::steady_clock::time_point::max()
                           : start + timeout;
    if (auto engine = state_->engine.lock()) {
      if (state_->driven) {
        engine->drive(*state_, limit, std::chrono::microseconds(spin_us));
      } else {
        engine->await(*state_, limit, std::chrono::microseconds(spin_us));
      }
    }
  }
  if (state_->status.load(std::memory_order_acquire) == 0) {
    std::unique_lock<std::mutex> lock(state_->mu);
    const auto done = [&] { return state_->status.load(std::memory_order_acquire) != 0; };
    if (timeout == std::chrono::milliseconds::max()) {
      state_->cv.wait(lock, done);
    } else if (!state_->cv.wait_until(lock, start + timeout, done)) {
      return false;
    }
  }
  if (state_->status.load(std::memory_order_acquire) == 2) {
    std::exception_ptr e;
    {
      std::lock_guard<std::mutex> lock(state_->mu);
      e = state_->error;
    }
    std::rethrow_exception(e);
  }
  return true;
}

std::exception_ptr Work::error() const {
  if (!state_ || state_->status.load(std::memory_order_acquire) != 2) return nullptr;
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->error;
}

std::uint64_t Work::seq() const { return state_ ? state_->seq : 0; }

int Work::source() const {
  if (!state_ || state_->status.load(std::memory_order_acquire) != 1) return -1;
  return state_->source;
}

namespace {

using collectives::Op;
using collectives::OpKind;
using collectives::Schedule;

constexpr std::uint64_t kMaxMedium = std::uint64_t{1} << 62;

bool overlaps(const char* a, std::size_t an, const char* b, std::size_t bn) {
  return an > 0 && bn > 0 && a < b + bn && b < a + an;
}

class CommunicatorImpl final : public collectives::ResidentCommunicator {
 public:
  CommunicatorImpl(std::unique_ptr<Bootstrap> bootstrap, CommOptions options)
      : bootstrap_(std::move(bootstrap)), requested_(options), options_(std::move(options)) {
    rank_ = bootstrap_->rank();
    size_ = bootstrap_->size();
    validate_options();
    load_cost_model();
    if (size_ > 1) connect();
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  const CommOptions& options() const override { return options_; }

  Work all_reduce(const void* in, void* out, std::size_t count, DataType dtype, ReduceOp op,
                  const OpOptions& opts) override {
    return issue({OpKind::kAllReduce, in, out, count, dtype, op, -1}, opts, nullptr);
  }

  Work reduce_scatter(const void* in, void* out, std::size_t recv_count, DataType dtype,
                      ReduceOp op, const OpOptions& opts) override {
    return issue({OpKind::kReduceScatter, in, out, recv_count, dtype, op, -1}, opts, nullptr);
  }

  Work all_gather(const void* in, void* out, std::size_t send_count, DataType dtype,
                  const OpOptions& opts) override {
    return issue({OpKind::kAllGather, in, out, send_count, dtype, ReduceOp::kSum, -1}, opts,
                 nullptr);
  }

  Work broadcast(const void* in, void* out, std::size_t count, DataType dtype, int root,
                 const OpOptions& opts) override {
    return issue({OpKind::kBroadcast, in, out, count, dtype, ReduceOp::kSum, root}, opts, nullptr);
  }

  Work reduce(const void* in, void* out, std::size_t count, DataType dtype, ReduceOp op, int root,
              const OpOptions& opts) override {
    dear::check_root(root, size_, rank_, "reduce");
    return issue({OpKind::kAllReduce, in, out, count, dtype, op, root}, opts, nullptr);
  }

  Work scatter(const void* in, void* out, std::size_t recv_count, DataType dtype, int root,
               const OpOptions& opts) override {
    dear::check_root(root, size_, rank_, "scatter");
    return issue({OpKind::kReduceScatter, in, out, recv_count, dtype, ReduceOp::kSum, root}, opts,
                 nullptr);
  }

  Work gather(const void* in, void* out, std::size_t send_count, DataType dtype, int root,
              const OpOptions& opts) override {
    dear::check_root(root, size_, rank_, "gather");
    return issue({OpKind::kAllGather, in, out, send_count, dtype, ReduceOp::kSum, root}, opts,
                 nullptr);
  }

  Work all_to_all(const void* in, void* out, std::size_t count, DataType dtype,
                  const OpOptions& opts) override {
    return issue({OpKind::kAllToAll, in, out, count, dtype, ReduceOp::kSum, -1}, opts, nullptr);
  }

  Work all_to_all_v(const void* in, std::span<const std::size_t> send_counts,
                    std::span<const std::size_t> send_displs, void* out,
                    std::span<const std::size_t> recv_counts,
                    std::span<const std::size_t> recv_displs, DataType dtype,
                    const OpOptions& opts) override {
    return exchange_v(nullptr, -1, in, send_counts, send_displs, out, recv_counts, recv_displs,
                      dtype, opts);
  }

  Work exchange_on_device(const char* called, int root, const void* in,
                          std::span<const std::size_t> send_counts,
                          std::span<const std::size_t> send_displs, void* out,
                          std::span<const std::size_t> recv_counts,
                          std::span<const std::size_t> recv_displs, DataType dtype,
                          const OpOptions& opts,
                          std::unique_ptr<collectives::OpFence> fence) override {
    return exchange_v(called, root, in, send_counts, send_displs, out, recv_counts, recv_displs,
                      dtype, opts, std::move(fence));
  }

  // all_gather_v and gather_v, their arguments checked (Communicator): all_to_all_v's messages
  // under their own names in errors; a gather_v's only to the root, N-1 instead of N(N-1).
  Work gather_as_all_to_all_v(int root, const void* in, std::span<const std::size_t> send_counts,
                              std::span<const std::size_t> send_displs, void* out,
                              std::span<const std::size_t> recv_counts,
                              std::span<const std::size_t> recv_displs, DataType dtype,
                              const OpOptions& opts) override {
    return exchange_v(root < 0 ? "all_gather_v" : nullptr, root, in, send_counts, send_displs, out,
                      recv_counts, recv_displs, dtype, opts);
  }

  // all_to_all_v's operation: `called` names the public call where it is not all_to_all_v or
  // (`root` >= 0, only the messages to the root) gather_v. `fence`: on device memory.
  Work exchange_v(const char* called, int root, const void* in,
                  std::span<const std::size_t> send_counts,
                  std::span<const std::size_t> send_displs, void* out,
                  std::span<const std::size_t> recv_counts,
                  std::span<const std::size_t> recv_displs, DataType dtype, const OpOptions& opts,
                  std::unique_ptr<collectives::OpFence> fence = nullptr) {
    auto o = make(OpKind::kAllToAllV, in, out, 0, dtype, ReduceOp::kSum, root, opts,
                  fence != nullptr, called);
    const char* name = o->name();
    const std::size_t el = dtype_size(dtype);
    auto layout = std::make_shared<collectives::AllToAllLayout>();
    layout->root = root;
    const std::size_t send_extent =
        to_bytes(send_counts, send_displs, el, "send_counts", "send_displs", layout->send_bytes,
                 layout->send_offset, name);
    const std::size_t recv_extent =
        to_bytes(recv_counts, recv_displs, el, "recv_counts", "recv_displs", layout->recv_bytes,
                 layout->recv_offset, name);
    const auto me = static_cast<std::size_t>(rank_);
    if (layout->send_bytes[me] != layout->recv_bytes[me]) {
      throw Error(ErrorCode::kInvalidArgument,
                  "send_counts[" + std::to_string(rank_) + "]=" + std::to_string(send_counts[me]) +
                      " differs from recv_counts[" + std::to_string(rank_) +
                      "]=" + std::to_string(recv_counts[me]) + " (what this rank sends itself)",
                  rank_, Error::kNone, name);
    }
    if (send_extent > 0 && in == nullptr) null_arg("in", send_extent / el, name);
    if (recv_extent > 0 && out == nullptr) null_arg("out", recv_extent / el, name);
    if (overlaps(o->in, send_extent, o->out, recv_extent)) {
      throw Error(ErrorCode::kInvalidArgument,
                  "in and out overlap; " + std::string(name) + " runs out of place only", rank_,
                  Error::kNone, name);
    }
    if (size_ > 1) {
      check_full_mesh(name);
      // Each rank's own choice (kind_byte: the two schedules send the same messages).
      std::size_t largest = 0;
      for (std::size_t b : layout->send_bytes) largest = std::max(largest, b);
      const Algorithm a = opts.algorithm != Algorithm::kAuto ? opts.algorithm : options_.algorithm;
      o->schedule = all_to_all_schedule(a, largest);
    }
    o->layout = std::move(layout);
    o->fence = std::move(fence);
    return launch(std::move(o), opts);
  }

  Work send(const void* buf, std::size_t count, DataType dtype, int peer,
            const OpOptions& opts) override {
    return point_to_point(true, const_cast<void*>(buf), count, dtype, peer, opts);
  }

  Work recv(void* buf, std::size_t count, DataType dtype, int peer,
            const OpOptions& opts) override {
    return point_to_point(false, buf, count, dtype, peer, opts);
  }

  Work p2p_on_device(bool send, void* buf, std::size_t count, DataType dtype, int peer,
                     const OpOptions& opts, std::unique_ptr<collectives::OpFence> fence) override {
    return point_to_point(send, buf, count, dtype, peer, opts, std::move(fence));
  }

  Work issue_on_device(const collectives::CollectiveCall& call, const OpOptions& opts,
                       std::unique_ptr<collectives::OpFence> fence) override {
    if (!collectives::runs_resident(call, size_)) {
      // Its exchanges keep their work in host memory; device buffers come staged.
      throw Error(ErrorCode::kInternal,
                  std::string("a ") + collectives::call_name(call.kind, call.root) +
                      " reached the engine with device memory",
                  rank_, Error::kNone, collectives::call_name(call.kind, call.root));
    }
    return issue(call, opts, std::move(fence));
  }

  Work barrier(const OpOptions& opts) override {
    auto o = std::make_unique<Op>();
    o->kind = OpKind::kBarrier;
    o->dtype = DataType::kUint8;
    o->user_count = 1;
    o->priority = opts.priority;
    o->tiny.assign(static_cast<std::size_t>(size_) + 1, 1);
    o->in = o->tiny.data() + size_;
    o->out = o->tiny.data();
    o->schedule = Schedule::kBiGather;  // every block seen means every rank arrived
    return launch(std::move(o), opts);
  }

  void abort(const std::string& reason) override {
    if (engine_) engine_->abort(reason);
  }

  std::unique_ptr<Communicator> split(int color, int key) override {
    const char* name = "split";
    if (color < kNoColor) {
      throw Error(ErrorCode::kInvalidArgument,
                  "color=" + std::to_string(color) + " is negative (kNoColor, -1, joins no child)",
                  rank_, Error::kNone, name);
    }
    // The bootstrap's collectives are the parent's, in its order (they are not thread-safe).
    std::lock_guard lock(split_mu_);
    const auto n = static_cast<std::size_t>(size_);
    std::vector<std::int32_t> mine{color, key}, all(2 * n);
    bootstrap_->all_gather(mine.data(), sizeof(std::int32_t) * 2, all.data());
    // The child's members: this color's ranks, by key, then by rank here.
    std::vector<int> members;
    for (int r = 0; r < size_ && color != kNoColor; ++r) {
      if (all[2 * static_cast<std::size_t>(r)] == color) members.push_back(r);
    }
    std::stable_sort(members.begin(), members.end(), [&](int a, int b) {
      return all[2 * static_cast<std::size_t>(a) + 1] < all[2 * static_cast<std::size_t>(b) + 1];
    });
    const auto me = std::find(members.begin(), members.end(), rank_);
    const int child_rank = me == members.end() ? -1 : static_cast<int>(me - members.begin());
    // Each child's rank 0 opens its rendezvous and tells its members where (one fixed-size
    // slot per parent rank).
    constexpr std::size_t kIdBytes = 512;
    std::string id_text;
    if (child_rank == 0) {
      id_text = UniqueId::create(bootstrap_->advertise_host(), 0).to_string();
      if (id_text.size() >= kIdBytes) {
        throw Error(ErrorCode::kInternal, "split: the rendezvous address is too long", rank_,
                    Error::kNone, name);
      }
    }
    std::vector<char> slot(kIdBytes, 0), ids(kIdBytes * n);
    std::copy(id_text.begin(), id_text.end(), slot.begin());
    bootstrap_->all_gather(slot.data(), kIdBytes, ids.data());
    if (child_rank < 0) return nullptr;
    const char* leader = ids.data() + kIdBytes * static_cast<std::size_t>(members.front());
    const UniqueId id = UniqueId::parse(std::string(leader, strnlen(leader, kIdBytes)));
    CommOptions child = requested_;
    child.name = (options_.name.empty() ? std::string("world") : options_.name) + "/" +
                 std::to_string(color);
    return Communicator::create(
        Bootstrap::create(id, child_rank, static_cast<int>(members.size()), bootstrap_->options()),
        std::move(child));
  }

  EngineStats engine_stats() const override {
    if (!engine_) return {};
    return {engine_->cpu_seconds(), engine_->peak_landing_bytes(),
            engine_->device_window_messages(), engine_->device_window_bytes()};
  }

  void forget_memory(const void* addr, std::size_t bytes) override {
    if (addr == nullptr && bytes > 0) {
      throw Error(ErrorCode::kInvalidArgument,
                  "forget_memory: addr is null with bytes=" + std::to_string(bytes), rank_);
    }
    if (engine_ && bytes > 0) engine_->forget_memory(addr, bytes);
  }

  bool set_priority(const Work& work, int priority) override {
    const Work::State* s = work.state();
    if (s == nullptr || !engine_ || s->engine.lock() != engine_) return false;
    if (s->status.load(std::memory_order_acquire) != 0) return false;
    return engine_->set_priority(s->seq, priority);
  }

 private:
  // Every collective but the barrier: checks, the schedule, and the launch. `fence`: the
  // operation is on device memory (collectives/resident.h).
  Work issue(const collectives::CollectiveCall& c, const OpOptions& opts,
             std::unique_ptr<collectives::OpFence> fence) {
    const std::size_t n = static_cast<std::size_t>(size_);
    const Algorithm a = opts.algorithm != Algorithm::kAuto ? opts.algorithm : options_.algorithm;
    std::unique_ptr<Op> o;
    switch (c.kind) {
      case OpKind::kAllReduce:
        // With a root, a reduce (collectives::is_reduce): `out` is the root's only.
        if (c.root >= 0) dear::check_root(c.root, size_, rank_, "reduce");
        o = make(c.kind, c.in, c.out, c.count, c.dtype, c.op, c.root, opts, fence != nullptr);
        check_buffers(*o, "in", c.count, "out", c.root < 0 || c.root == rank_ ? c.count : 0, true);
        break;
      case OpKind::kReduceScatter: {
        // With a root, a scatter (collectives::is_scatter): `in` is the root's only.
        if (c.root >= 0) dear::check_root(c.root, size_, rank_, "scatter");
        const bool has_in = c.root < 0 || c.root == rank_;
        o = make(c.kind, c.in, c.out, c.count, c.dtype, c.op, c.root, opts, fence != nullptr);
        check_total(c.count, c.dtype, "recv_count");
        check_buffers(*o, "in", has_in ? c.count * n : 0, "out", c.count, false);
        if (has_in) check_in_place_block(o->in, c.count * n, o->out, c.count, c.dtype, "out", "in");
        if (c.root >= 0 && size_ > 1 && !mesh_) {
          throw Error(ErrorCode::kInvalidArgument,
                      "scatter needs direct links between ranks 2^k apart, which transport '" +
                          options_.transport + "' does not build",
                      rank_, Error::kNone, "scatter");
        }
        break;
      }
      case OpKind::kAllGather: {
        // With a root, a gather (collectives::is_gather): `out` is the root's only.
        if (c.root >= 0) dear::check_root(c.root, size_, rank_, "gather");
        const bool has_out = c.root < 0 || c.root == rank_;
        o = make(c.kind, c.in, c.out, c.count, c.dtype, ReduceOp::kSum, c.root, opts,
                 fence != nullptr);
        check_total(c.count, c.dtype, "send_count");
        check_buffers(*o, "in", c.count, "out", has_out ? c.count * n : 0, false);
        if (has_out)
          check_in_place_block(o->out, c.count * n, o->in, c.count, c.dtype, "in", "out");
        break;
      }
      case OpKind::kBroadcast: {
        dear::check_root(c.root, size_, rank_, "broadcast");
        o = make(c.kind, c.in, c.out, c.count, c.dtype, ReduceOp::kSum, c.root, opts,
                 fence != nullptr);
        o->schedule = Schedule::kChain;
        if (c.count > 0 && c.out == nullptr) null_arg("out", c.count, "broadcast");
        if (rank_ == c.root && c.count > 0 && c.in == nullptr) null_arg("in", c.count, "broadcast");
        if (rank_ == c.root && c.in != c.out) {
          const std::size_t b = c.count * dtype_size(c.dtype);
          if (overlaps(o->in, b, o->out, b)) partial_overlap("broadcast");
        }
        break;
      }
      case OpKind::kAllToAll: {
        o = make(c.kind, c.in, c.out, c.count, c.dtype, ReduceOp::kSum, -1, opts, fence != nullptr);
        check_total(c.count, c.dtype, "count");
        check_buffers(*o, "in", c.count * n, "out", c.count * n, true);
        if (size_ > 1) check_full_mesh("all_to_all");
        o->schedule = equal_all_to_all_schedule(a, c.count * dtype_size(c.dtype));
        o->fence = std::move(fence);
        return launch(std::move(o), opts);
      }
      case OpKind::kBarrier:
      case OpKind::kAllToAllV:
        throw Error(ErrorCode::kInternal, "issue() makes no barrier and no all_to_all_v", rank_);
    }
    if (size_ > 1 && c.kind != OpKind::kBroadcast) {
      o->schedule = schedule_of(c, a, opts);
      // A log-step schedule works in host memory (Op::shadow): on device memory, only small
      // operations run one, the others the ring in its place. Every rank decides alike.
      if (fence && is_log_step(o->schedule) && !collectives::fits_device_log_step(c, size_)) {
        o->schedule = Schedule::kRing;
      }
    }
    o->fence = std::move(fence);
    return launch(std::move(o), opts);
  }

  // The schedule of an all_reduce, reduce_scatter, all_gather, reduce, gather or scatter on
  // more than one rank (before a device operation's move to the ring). A forced algorithm runs
  // as asked; a scatter's only others are the tree and scattered. Measured on 4 and 5 ranks
  // over TCP (docs/results.md, "reduce" and "gather").
  Schedule schedule_of(const collectives::CollectiveCall& c, Algorithm a,
                       const OpOptions& opts) const {
    const bool scatter = collectives::is_scatter(c.kind, c.root);
    const bool gather = collectives::is_gather(c.kind, c.root);
    if (!collectives::is_rooted_result(c.kind, c.root) && !scatter) {
      return select(c.kind, a, c.count, c.dtype, opts);
    }
    if (a == Algorithm::kScattered) return Schedule::kScattered;
    // A gather and a scatter go straight between the root and every rank once the blocks
    // together pass kDirectMinBytes: each block then crosses one link instead of climbing
    // the tree.
    const std::size_t total = c.count * dtype_size(c.dtype) * static_cast<std::size_t>(size_);
    if ((gather || scatter) && a == Algorithm::kAuto && full_mesh_ && total > kDirectMinBytes) {
      return Schedule::kScattered;
    }
    // A gather's tree is its own (the all_gather has none): select() does not know it.
    if (scatter || (a == Algorithm::kTree && mesh_)) return Schedule::kTree;
    const Schedule s = select(c.kind, a, c.count, c.dtype, opts);
    // A reduce takes the tree, which ends at the root, wherever the all_reduce would not take
    // the ring (whose reduce-scatter halves what each link carries); a gather below that takes it
    // at every size: the other schedules bring the result to every rank (steps.h), and the
    // gather's tree moves each block up its subtrees only.
    if (a == Algorithm::kAuto && mesh_ && (s != Schedule::kRing || gather)) return Schedule::kTree;
    return s;
  }

  void validate_options() {
    if (options_.channels < 1 || options_.channels > collectives::kMaxChannels) {
      throw Error(ErrorCode::kInvalidArgument,
                  "CommOptions::channels=" + std::to_string(options_.channels) +
                      " is outside [1, " + std::to_string(collectives::kMaxChannels) + "]",
                  rank_);
    }
    if (options_.slice_bytes < 64 || options_.slice_bytes > (1U << 30)) {
      throw Error(ErrorCode::kInvalidArgument,
                  "CommOptions::slice_bytes=" + std::to_string(options_.slice_bytes) +
                      " is outside [64, 1 GiB]",
                  rank_);
    }
    transport_ = &transport::find_transport(options_.transport, rank_, "CommOptions::transport");
    // Every back-end checks its own options, whichever is selected: a bad value fails now
    // rather than on the day that back-end is chosen.
    const transport::TransportOptions to = transport_options(transport::Deadline::max());
    for (const transport::Transport* t : transport::transports()) {
      try {
        t->check(to);
      } catch (const Error& e) {
        throw Error(e.code(), e.cause(), rank_, Error::kNone, "create");
      }
    }
    collectives::check_executor_name(options_.executor, rank_);
    if (options_.landing_slots < 1) {
      throw Error(ErrorCode::kInvalidArgument,
                  "CommOptions::landing_slots=" + std::to_string(options_.landing_slots) +
                      " must be at least 1",
                  rank_);
    }
    if (options_.eager_window < 1) {
      throw Error(ErrorCode::kInvalidArgument, "CommOptions::eager_window must be at least 1",
                  rank_);
    }
    if (options_.fabric_direct_bytes < -1) {
      throw Error(
          ErrorCode::kInvalidArgument,
          "CommOptions::fabric_direct_bytes=" + std::to_string(options_.fabric_direct_bytes) +
              " is neither a byte count, 0 (off) nor -1 (the default)",
          rank_);
    }
    if (options_.halving_max_bytes < -1) {
      throw Error(ErrorCode::kInvalidArgument,
                  "CommOptions::halving_max_bytes=" + std::to_string(options_.halving_max_bytes) +
                      " is neither a byte count, 0 (the ring) nor -1 (the transport's default)",
                  rank_);
    }
    if (options_.halving_max_bytes == -1) {
      options_.halving_max_bytes = transport_->log_step_max_bytes(size_);
    }
  }

  void connect() {
    namespace tr = transport;
    if (options_.link_delay_us < 0) {
      throw Error(
          ErrorCode::kInvalidArgument,
          "CommOptions::link_delay_us=" + std::to_string(options_.link_delay_us) + " is negative",
          rank_);
    }
    const auto deadline = tr::deadline_after(options_.timeout);
    // Direct links to the ranks the log-step schedules exchange with (steps.h).
    std::vector<int> mesh_peers = collectives::step_peers(rank_, size_);
    tr::Links links = transport_->connect(*bootstrap_, mesh_peers, transport_options(deadline));
    std::vector<std::unique_ptr<tr::Channel>> to_next = std::move(links.to_next);
    std::vector<std::unique_ptr<tr::Channel>> from_prev = std::move(links.from_prev);
    std::vector<std::unique_ptr<tr::Channel>> mesh = std::move(links.mesh);
    if (mesh.size() != mesh_peers.size()) {
      mesh.clear();
      mesh_peers.clear();
    }
    mesh_ = !mesh_peers.empty();
    full_mesh_ = mesh_ && static_cast<int>(mesh_peers.size()) == size_ - 1;
    // Emulated latency wraps the channels of both links, so every message a rank sends is
    // held once, whichever direction it travels.
    const std::chrono::microseconds delay(options_.link_delay_us);
    to_next = tr::with_delay(std::move(to_next), delay);
    from_prev = tr::with_delay(std::move(from_prev), delay);
    mesh = tr::with_delay(std::move(mesh), delay);
    collectives::EngineConfig cfg;
    cfg.rank = rank_;
    cfg.size = size_;
    cfg.channels = options_.channels;
    cfg.eager_bytes = options_.eager_bytes;
    cfg.eager_window = options_.eager_window;
    cfg.spin_us = options_.spin_us;
    cfg.wait_spin_us = options_.wait_spin_us;
    cfg.executor = options_.executor;
    cfg.landing_slots = options_.landing_slots;
    cfg.make_device_executor = collectives::device_executor_factory(rank_);
    cfg.name = options_.name;
    engine_ = std::make_shared<collectives::Engine>(cfg, std::move(to_next), std::move(from_prev),
                                                    std::move(mesh_peers), std::move(mesh));
  }

  transport::TransportOptions transport_options(transport::Deadline deadline) const {
    transport::TransportOptions o;
    o.channels = options_.channels;
    o.slice_bytes = options_.slice_bytes;
    o.deadline = deadline;
    o.fabric_provider = options_.fabric_provider;
    o.fabric_slot_bytes = options_.fabric_slot_bytes;
    o.fabric_data_path = options_.fabric_data_path;
    o.fabric_hmem = options_.fabric_hmem;
#if defined(DEAR_HAVE_CUDA)
    if (o.fabric_hmem == "auto") o.fabric_hmem = cuda::device_count() > 0 ? "on" : "off";
#endif
    o.direct_bytes = options_.fabric_direct_bytes;
    o.ib_device = options_.ib_device;
    o.ib_gid_index = options_.ib_gid_index;
    return o;
  }

  // What every call checks alike: the dtype, the deadline, and a stream this build cannot use
  // (with CUDA the device wrapper consumes it before this point, for `device` memory).
  void check_call(DataType dtype, const OpOptions& opts, bool device, const char* name) const {
    if (!is_valid(dtype)) {
      throw Error(ErrorCode::kInvalidArgument,
                  "dtype=" + std::to_string(static_cast<int>(dtype)) + " is not a DataType", rank_,
                  Error::kNone, name);
    }
    if (opts.timeout.count() < 0) {
      throw Error(ErrorCode::kInvalidArgument, "OpOptions::timeout is negative", rank_,
                  Error::kNone, name);
    }
    if (opts.cuda_stream != nullptr && !device) {
      throw Error(ErrorCode::kInvalidArgument,
                  "OpOptions::cuda_stream is set but this build of dear has no CUDA support", rank_,
                  Error::kNone, name);
    }
  }

  // `called`: the public call's name where it is not call_name()'s (all_gather_v).
  std::unique_ptr<Op> make(OpKind kind, const void* in, void* out, std::size_t count,
                           DataType dtype, ReduceOp op, int root, const OpOptions& opts,
                           bool device = false, const char* called = nullptr) const {
    const char* name = called != nullptr ? called : collectives::call_name(kind, root);
    check_call(dtype, opts, device, name);
    if ((kind == OpKind::kAllReduce || kind == OpKind::kReduceScatter) && !is_valid(op)) {
      throw Error(ErrorCode::kInvalidArgument,
                  "op=" + std::to_string(static_cast<int>(op)) + " is not a ReduceOp", rank_,
                  Error::kNone, name);
    }
    if (count > static_cast<std::size_t>(std::numeric_limits<std::int64_t>::max())) {
      throw Error(ErrorCode::kInvalidArgument,
                  "count=" + std::to_string(count) +
                      " is out of range (a negative count converted to size_t?)",
                  rank_, Error::kNone, name);
    }
    if (opts.channels < 0 || opts.channels > options_.channels) {
      throw Error(ErrorCode::kInvalidArgument,
                  "OpOptions::channels=" + std::to_string(opts.channels) + " is outside [0, " +
                      std::to_string(options_.channels) + "] (the communicator's channels)",
                  rank_, Error::kNone, name);
    }
    if (opts.slice_bytes != 0 && opts.slice_bytes < 64) {
      throw Error(ErrorCode::kInvalidArgument,
                  "OpOptions::slice_bytes=" + std::to_string(opts.slice_bytes) +
                      " is below the minimum of 64",
                  rank_, Error::kNone, name);
    }
    check_algorithm(opts.algorithm, kind, root, "OpOptions::algorithm");
    auto o = std::make_unique<Op>();
    o->kind = kind;
    o->dtype = dtype;
    o->redop = op;
    o->user_count = count;
    o->root = root;
    o->priority = opts.priority;
    o->in = static_cast<const char*>(in);
    o->out = static_cast<char*>(out);
    o->device = device;
    o->called = called;
    return o;
  }

  void check_total(std::size_t count, DataType dtype, const char* arg) const {
    const std::size_t el = dtype_size(dtype);
    if (count > std::numeric_limits<std::size_t>::max() / el / static_cast<std::size_t>(size_)) {
      throw Error(ErrorCode::kInvalidArgument,
                  std::string(arg) + "=" + std::to_string(count) + " times " +
                      std::to_string(size_) + " ranks overflows the address space",
                  rank_);
    }
  }

  [[noreturn]] void null_arg(const char* arg, std::size_t count, const char* op) const {
    throw Error(ErrorCode::kInvalidArgument,
                std::string(arg) + " is null but count=" + std::to_string(count), rank_,
                Error::kNone, op);
  }

  [[noreturn]] void partial_overlap(const char* op) const {
    throw Error(ErrorCode::kInvalidArgument,
                "in and out overlap partially; use the same pointer for in-place operation", rank_,
                Error::kNone, op);
  }

  void check_buffers(const Op& o, const char* in_name, std::size_t in_count, const char* out_name,
                     std::size_t out_count, bool same_allowed) const {
    const char* name = o.name();
    if (in_count > 0 && o.in == nullptr) null_arg(in_name, in_count, name);
    if (out_count > 0 && o.out == nullptr) null_arg(out_name, out_count, name);
    const std::size_t el = dtype_size(o.dtype);
    if (same_allowed && o.in == o.out) return;
    if (same_allowed && overlaps(o.in, in_count * el, o.out, out_count * el)) {
      partial_overlap(name);
    }
  }

  // In place for RS/AG means the small buffer is exactly the rank's block of the large one.
  void check_in_place_block(const char* big, std::size_t big_count, const char* small,
                            std::size_t small_count, DataType dtype, const char* small_name,
                            const char* big_name) const {
    const std::size_t el = dtype_size(dtype);
    if (!overlaps(big, big_count * el, small, small_count * el)) return;
    if (small != big + static_cast<std::size_t>(rank_) * small_count * el) {
      throw Error(ErrorCode::kInvalidArgument,
                  std::string(small_name) + " overlaps " + big_name +
                      " but is not this rank's block of it (in place requires " + small_name +
                      " == " + big_name + " + rank * count elements)",
                  rank_);
    }
  }

  // A file (CommOptions::cost_model_file, DEAR_COST_MODEL) wins over numbers set directly.
  void load_cost_model() {
    if (!options_.cost_model_file.empty()) {
      try {
        model_ = collectives::load_cost_model(options_.cost_model_file);
      } catch (const Error& e) {
        throw Error(e.code(), e.cause() + " (CommOptions::cost_model_file / DEAR_COST_MODEL)",
                    rank_, Error::kNone, "create");
      }
      return;
    }
    const double params[] = {options_.alpha_us, options_.beta_us_per_byte,
                             options_.reduce_us_per_byte};
    for (double v : params) {
      if (!std::isfinite(v) || v < 0) {
        throw Error(ErrorCode::kInvalidArgument,
                    "CommOptions alpha_us, beta_us_per_byte and reduce_us_per_byte must be "
                    "finite and >= 0",
                    rank_, Error::kNone, "create");
      }
    }
    if (options_.alpha_us > 0 || options_.beta_us_per_byte > 0) {
      collectives::CostModel m;
      m.alpha_us = options_.alpha_us;
      m.beta_us_per_byte = options_.beta_us_per_byte;
      m.reduce_us_per_byte = options_.reduce_us_per_byte;
      model_ = m;
    }
  }

  // Whether `kind` (with `root`: collectives::is_reduce, is_gather) can run `a`: throws
  // kInvalidArgument naming `what` when it cannot.
  void check_algorithm(Algorithm a, OpKind kind, int root, const char* what) const {
    const char* name = collectives::call_name(kind, root);
    if (!algorithm_fits(a, kind, root)) {
      throw Error(
          ErrorCode::kInvalidArgument,
          std::string(what) + "=" + to_string(a) + " does not apply to " + name +
              (collectives::is_scatter(kind, root) ? " (a scatter runs the tree or scattered)"
               : kind == OpKind::kAllToAllV        ? " (an all_to_all_v runs pairwise or scattered)"
               : collectives::is_all_to_all(kind)
                   ? " (an all_to_all runs pairwise, scattered or bruck)"
               : a == Algorithm::kPairwise || a == Algorithm::kBruck ? " (all_to_all only)"
               : a == Algorithm::kScattered    ? " (all_to_all, reduce, gather and scatter only)"
               : a == Algorithm::kGatherReduce ? " (all_reduce and reduce only)"
               : a == Algorithm::kTree
                   ? " (all_reduce, reduce and gather only)"
                   : " (all_reduce, reduce_scatter, all_gather, reduce and gather only)"),
          rank_, Error::kNone, name);
    }
    // A rooted kScattered exchanges with every rank, as all_to_all does.
    if (a == Algorithm::kScattered && size_ > 1) check_full_mesh(name);
    const bool log_step = a == Algorithm::kHalvingDoubling || a == Algorithm::kRecursiveDoubling ||
                          a == Algorithm::kTree;
    if (log_step && size_ > 1 && !mesh_) {
      throw Error(ErrorCode::kInvalidArgument,
                  std::string(what) + "=" + to_string(a) +
                      " needs direct links between ranks 2^k apart, which transport '" +
                      options_.transport + "' does not build",
                  rank_, Error::kNone, name);
    }
  }

  static bool algorithm_fits(Algorithm a, OpKind kind, int root = -1) {
    if (collectives::is_all_to_all(kind)) {
      return a == Algorithm::kAuto || a == Algorithm::kPairwise || a == Algorithm::kScattered ||
             (a == Algorithm::kBruck && kind == OpKind::kAllToAll);
    }
    switch (a) {
      case Algorithm::kAuto: return true;
      case Algorithm::kPairwise:
      case Algorithm::kBruck: return false;
      case Algorithm::kScattered:
        return collectives::is_rooted_result(kind, root) || collectives::is_scatter(kind, root);
      case Algorithm::kRing: return !collectives::is_scatter(kind, root);
      case Algorithm::kGatherReduce: return kind == OpKind::kAllReduce;
      case Algorithm::kTree:
        return kind == OpKind::kAllReduce || collectives::is_gather(kind, root) ||
               collectives::is_scatter(kind, root);
      case Algorithm::kHalvingDoubling:
      case Algorithm::kRecursiveDoubling:
        return kind == OpKind::kAllReduce ||
               (kind == OpKind::kReduceScatter && !collectives::is_scatter(kind, root)) ||
               kind == OpKind::kAllGather;
    }
    return false;
  }

  // `fence`: `buf` is device memory (Engine::submit_p2p).
  Work point_to_point(bool is_send, void* buf, std::size_t count, DataType dtype, int peer,
                      const OpOptions& opts,
                      std::unique_ptr<collectives::OpFence> fence = nullptr) {
    const char* name = is_send ? "send" : "recv";
    check_call(dtype, opts, fence != nullptr, name);
    check_peer(peer, size_, rank_, name, !is_send);
    // A message's size travels in 32 bits.
    if (count > std::numeric_limits<std::uint32_t>::max() / dtype_size(dtype)) {
      throw Error(ErrorCode::kInvalidArgument,
                  "count=" + std::to_string(count) + " is more than one message carries (" +
                      std::to_string(std::numeric_limits<std::uint32_t>::max()) + " bytes)",
                  rank_, Error::kNone, name);
    }
    if (count > 0 && buf == nullptr) null_arg("buf", count, name);
    if (opts.tag < 0) {
      throw Error(ErrorCode::kInvalidArgument,
                  "OpOptions::tag=" + std::to_string(opts.tag) + " is negative", rank_,
                  Error::kNone, name);
    }
    check_full_mesh(name);
    collectives::Engine::P2pCall call;
    call.tag = opts.tag;
    call.send = is_send;
    call.peer = peer;
    call.src = is_send ? static_cast<const char*>(buf) : nullptr;
    call.dst = is_send ? nullptr : static_cast<char*>(buf);
    call.count = count;
    call.dtype = dtype;
    call.timeout = opts.timeout.count() > 0 ? opts.timeout : options_.timeout;
    return engine_->submit_p2p(call, std::move(fence));
  }
  void check_full_mesh(const char* name) const {
    if (full_mesh_) return;
    throw Error(ErrorCode::kInvalidArgument,
                std::string(name) + " needs direct links to every rank, which " +
                    (size_ > collectives::kFullMeshMaxRanks
                         ? std::to_string(size_) + " ranks (more than " +
                               std::to_string(collectives::kFullMeshMaxRanks) + ") do not get"
                         : "transport '" + options_.transport + "' does not build"),
                rank_, Error::kNone, name);
  }

  // all_to_all_v: one side's counts and displacements (elements) as byte sizes and offsets;
  // returns the extent of the buffer they describe. Names the argument that is wrong.
  std::size_t to_bytes(std::span<const std::size_t> counts, std::span<const std::size_t> displs,
                       std::size_t el, const char* counts_name, const char* displs_name,
                       std::vector<std::size_t>& bytes, std::vector<std::size_t>& offsets,
                       const char* name) const {
    const auto n = static_cast<std::size_t>(size_);
    check_per_rank(counts, counts_name, size_, rank_, name);
    check_per_rank(displs, displs_name, size_, rank_, name);
    // A message's size travels in 32 bits; a displacement must keep the end addressable.
    const std::size_t limit = std::numeric_limits<std::uint32_t>::max() / el;
    std::size_t extent = 0;
    bytes.resize(n);
    offsets.resize(n);
    for (std::size_t j = 0; j < n; ++j) {
      if (counts[j] > limit ||
          displs[j] > std::numeric_limits<std::size_t>::max() / el - counts[j]) {
        throw Error(ErrorCode::kInvalidArgument,
                    std::string(counts_name) + "[" + std::to_string(j) +
                        "]=" + std::to_string(counts[j]) + " with " + displs_name + "[" +
                        std::to_string(j) + "]=" + std::to_string(displs[j]) +
                        " is out of range (at most " + std::to_string(limit) +
                        " elements per peer)",
                    rank_, Error::kNone, name);
      }
      bytes[j] = counts[j] * el;
      offsets[j] = displs[j] * el;
      if (bytes[j] > 0) extent = std::max(extent, offsets[j] + bytes[j]);
    }
    return extent;
  }

  // An all_to_all's schedule: the one asked for, else by the size of one block. A communicator-
  // wide algorithm that is not an all_to_all's counts as kAuto (as in select()).
  static Schedule all_to_all_schedule(Algorithm a, std::size_t block_bytes) {
    if (a == Algorithm::kPairwise) return Schedule::kPairwise;
    if (a == Algorithm::kScattered) return Schedule::kScattered;
    return block_bytes <= kScatteredMaxBlockBytes ? Schedule::kScattered : Schedule::kPairwise;
  }
  // An all_to_all's (equal blocks): Bruck's where asked for or, under auto, for blocks of at
  // most kBruckMaxBlockBytes on at least kBruckMinRanks ranks; else as all_to_all_v's.
  Schedule equal_all_to_all_schedule(Algorithm a, std::size_t block_bytes) const {
    if (a == Algorithm::kBruck) return Schedule::kBruck;
    if (a == Algorithm::kAuto && size_ >= kBruckMinRanks && block_bytes <= kBruckMaxBlockBytes) {
      return Schedule::kBruck;
    }
    return all_to_all_schedule(a, block_bytes);
  }
  // Measured on 4 ranks over TCP loopback (docs/results.md, "all_to_all").
  static constexpr std::size_t kScatteredMaxBlockBytes = 64 * 1024;
  // Where auto takes Bruck's all_to_all: log2(N) packed messages in turn against N-1 at once.
  // Measured over TCP loopback (docs/results.md, "all_to_all"): on 6 ranks Bruck's took
  // 0.64-0.77x scattered's time up to 2 KiB blocks and lost at 8 KiB; on 8 ranks 0.57-0.88x up
  // to 8 KiB and lost at 16 KiB; on 4 ranks it was level with pairwise.
  static constexpr int kBruckMinRanks = 6;
  static constexpr std::size_t kBruckMaxBlockBytes = 2 * 1024;
  static constexpr std::size_t kDirectMinBytes = 32 * 1024;

  // The schedule of an all_reduce, reduce_scatter or all_gather: see
  // collectives::select_schedule. The communicator-wide choice (CommOptions::algorithm) falls
  // back to kAuto for collectives it does not apply to; a per-operation one was checked.
  Schedule select(OpKind kind, Algorithm a, std::size_t count, DataType dtype,
                  const OpOptions& opts) const {
    if (!algorithm_fits(a, kind) || (a != Algorithm::kRing && a != Algorithm::kAuto &&
                                     a != Algorithm::kGatherReduce && !mesh_)) {
      a = Algorithm::kAuto;
    }
    collectives::ModelGeometry g;
    g.log_steps = mesh_;
    g.nranks = size_;
    g.channels = opts.channels > 0 ? opts.channels : options_.channels;
    g.slice_bytes = opts.slice_bytes > 0 ? opts.slice_bytes : options_.slice_bytes;
    g.min_channel_bytes = collectives::SliceGeometryOptions{}.min_channel_bytes;
    const std::size_t el = dtype_size(dtype);
    if (!model_) {
      return collectives::select_schedule(kind, a, count * el, el, g, nullptr,
                                          options_.gather_reduce_max_bytes,
                                          static_cast<std::size_t>(options_.halving_max_bytes));
    }
    // With a model the choice plans and predicts every candidate (about a microsecond, which
    // on an oversubscribed host is a fifth of a small all_reduce); training repeats a few
    // sizes, so each choice is remembered.
    const SelectKey key{static_cast<int>(kind), static_cast<int>(a), count * el, el, g.channels,
                        g.slice_bytes};
    std::lock_guard lock(select_mu_);
    const auto it = select_cache_.find(key);
    if (it != select_cache_.end()) return it->second;
    const Schedule s = collectives::select_schedule(kind, a, count * el, el, g, &*model_,
                                                    options_.gather_reduce_max_bytes);
    if (select_cache_.size() >= kSelectCacheMax) select_cache_.clear();
    select_cache_.emplace(key, s);
    return s;
  }

  Work launch(std::unique_ptr<Op> o, const OpOptions& opts) {
    o->timeout = opts.timeout.count() > 0 ? opts.timeout : options_.timeout;
    if (size_ == 1) return run_single(*o);
    collectives::SliceGeometryOptions geo;
    geo.channels = opts.channels > 0 ? opts.channels : options_.channels;
    geo.slice_bytes = opts.slice_bytes > 0 ? opts.slice_bytes : options_.slice_bytes;
    geo.eager_bytes = options_.eager_bytes;
    if (o->device) {
      // Device slices pass through landing slots of at most this size, and none runs ahead
      // of its receiver (it would have to wait in host memory the device cannot read). A
      // log-step operation works in host memory and may.
      geo.slice_bytes = std::min(geo.slice_bytes, collectives::kDeviceSliceBytes);
    }
    collectives::plan(*o, rank_, size_, geo);
    if (o->device && !collectives::is_log_step(o->schedule)) o->eager = false;
    return engine_->submit(std::move(o));
  }

  // One rank: the result is the input (or a copy of it), finished locally.
  Work run_single(Op& o) {
    auto state = std::make_shared<Work::State>();
    state->seq = single_seq_++;
    const std::size_t el = dtype_size(o.dtype);
    switch (o.kind) {
      case OpKind::kAllReduce:
      case OpKind::kReduceScatter:
        collectives::finish_single(o.out, o.in, o.user_count, o.dtype, o.redop, 1);
        break;
      case OpKind::kAllGather:
      case OpKind::kBroadcast:
        if (o.out != o.in && o.user_count > 0) std::memmove(o.out, o.in, o.user_count * el);
        break;
      case OpKind::kAllToAll:
        if (o.out != o.in && o.user_count > 0) std::memmove(o.out, o.in, o.user_count * el);
        break;
      case OpKind::kAllToAllV:
        if (o.layout->send_bytes[0] > 0) {
          std::memcpy(o.out + o.layout->recv_offset[0], o.in + o.layout->send_offset[0],
                      o.layout->send_bytes[0]);
        }
        break;
      case OpKind::kBarrier: break;
    }
    state->complete(nullptr);
    return Work(state);
  }

  std::unique_ptr<Bootstrap> bootstrap_;
  CommOptions requested_;  // as given (split() hands them to its children)
  CommOptions options_;    // as validated (defaults resolved for this size and transport)
  std::mutex split_mu_;
  int rank_ = 0;
  int size_ = 1;
  std::uint64_t single_seq_ = 0;
  std::optional<collectives::CostModel> model_;
  // select()'s remembered choices under a model: (kind, algorithm, bytes, element size,
  // channels, slice bytes) -> schedule; emptied when it reaches kSelectCacheMax entries.
  using SelectKey = std::tuple<int, int, std::size_t, std::size_t, int, std::size_t>;
  static constexpr std::size_t kSelectCacheMax = 4096;
  mutable std::mutex select_mu_;
  mutable std::map<SelectKey, Schedule> select_cache_;
  std::shared_ptr<collectives::Engine> engine_;
  const transport::Transport* transport_ = nullptr;  // the registry's, for options_.transport
  bool mesh_ = false;       // the engine has the log-step schedules' direct links
  bool full_mesh_ = false;  // ... to every rank (all_to_all)
};

}  // namespace

// all_gather_v and gather_v are all_to_all_v's with every send reading the one input block
// (gather_as_all_to_all_v), and the size checks their own (gather_as_all_to_all_v_lists).
Work Communicator::all_gather_v(const void* in, std::size_t send_count, void* out,
                                std::span<const std::size_t> recv_counts,
                                std::span<const std::size_t> recv_displs, DataType dtype,
                                const OpOptions& opts) {
  const AllToAllLists l =
      gather_as_all_to_all_v_lists(-1, send_count, recv_counts, recv_displs, size(), rank());
  return gather_as_all_to_all_v(-1, in, l.send_counts, l.send_displs, out, l.recv_counts,
                                l.recv_displs, dtype, opts);
}

Work Communicator::gather_v(const void* in, std::size_t send_count, void* out,
                            std::span<const std::size_t> recv_counts,
                            std::span<const std::size_t> recv_displs, DataType dtype, int root,
                            const OpOptions& opts) {
  check_root(root, size(), rank(), "gather_v");  // -1 is all_gather_v's to the lists
  const AllToAllLists l =
      gather_as_all_to_all_v_lists(root, send_count, recv_counts, recv_displs, size(), rank());
  return gather_as_all_to_all_v(root, in, l.send_counts, l.send_displs, out, l.recv_counts,
                                l.recv_displs, dtype, opts);
}

std::unique_ptr<Communicator> Communicator::split(int color, int key) {
  (void)color;
  (void)key;
  throw Error(ErrorCode::kInvalidArgument, "this communicator cannot split", rank(), Error::kNone,
              "split");
}

std::unique_ptr<Communicator> Communicator::create(std::unique_ptr<Bootstrap> bootstrap,
                                                   CommOptions options) {
  if (!bootstrap) {
    throw Error(ErrorCode::kInvalidArgument, "Communicator::create: bootstrap is null");
  }
  transport::reset_foreign_fatal_handlers();  // also for bootstraps of the caller's own
  // Device buffers and CUDA streams are handled around the host communicator.
  return collectives::with_device_support(
      std::make_unique<CommunicatorImpl>(std::move(bootstrap), std::move(options)));
}

CommOptions apply_env(CommOptions options) {
  if (auto v = env::get_int("DEAR_CHANNELS", 1, collectives::kMaxChannels)) {
    options.channels = static_cast<int>(*v);
  }
  if (auto v = env::get_bytes("DEAR_SLICE_BYTES")) options.slice_bytes = *v;
  if (auto v = env::get_int("DEAR_TIMEOUT", 1, 365LL * 24 * 3600)) {
    options.timeout = std::chrono::seconds(*v);
  }
  if (auto v = env::get_bytes("DEAR_EAGER_BYTES")) options.eager_bytes = *v;
  if (auto v = env::get_int("DEAR_SPIN_US", 0, 1000000)) options.spin_us = static_cast<int>(*v);
  if (auto v = env::get_int("DEAR_WAIT_SPIN_US", 0, 1000000)) {
    options.wait_spin_us = static_cast<int>(*v);
  }
  if (auto v = env::get_bytes("DEAR_SMALL_BYTES")) options.gather_reduce_max_bytes = *v;
  if (auto v = env::get_bytes("DEAR_MEDIUM_BYTES")) {
    options.halving_max_bytes = static_cast<std::int64_t>(std::min<std::uint64_t>(*v, kMaxMedium));
  }
  if (auto v = env::get("DEAR_TRANSPORT")) options.transport = *v;
  if (auto v = env::get("DEAR_FABRIC_PROVIDER")) options.fabric_provider = *v;
  if (auto v = env::get_bytes("DEAR_FABRIC_SLOT_BYTES")) options.fabric_slot_bytes = *v;
  if (auto v = env::get("DEAR_FABRIC_DATA_PATH")) options.fabric_data_path = *v;
  if (auto v = env::get("DEAR_FABRIC_HMEM")) options.fabric_hmem = *v;
  if (auto v = env::get_bytes("DEAR_FABRIC_DIRECT_BYTES")) {
    options.fabric_direct_bytes = static_cast<std::int64_t>(*v);
  }
  if (auto v = env::get("DEAR_IB_DEVICE")) options.ib_device = *v;
  if (auto v = env::get_int("DEAR_IB_GID_INDEX", 0, 255)) {
    options.ib_gid_index = static_cast<int>(*v);
  }
  if (auto v = env::get_int("DEAR_LINK_DELAY_US", 0, 10000000)) {
    options.link_delay_us = static_cast<int>(*v);
  }
  if (auto v = env::get("DEAR_COST_MODEL")) options.cost_model_file = *v;
  if (auto v = env::get("DEAR_EXECUTOR")) options.executor = *v;
  if (auto v = env::get_int("DEAR_CUDA_STAGING", 0, 1)) options.cuda_staging = *v != 0;
  if (auto v = env::get_int("DEAR_LANDING_SLOTS", 1, 1024)) {
    options.landing_slots = static_cast<int>(*v);
  }
  if (auto v = env::get("DEAR_ALGO")) {
    const auto a = parse_algorithm(*v);
    if (!a) {
      throw Error(ErrorCode::kInvalidArgument,
                  "environment variable DEAR_ALGO='" + *v +
                      "' is not one of auto, ring, gather_reduce, halving_doubling, "
                      "recursive_doubling, tree");
    }
    options.algorithm = *a;
  }
  return options;
}

std::unique_ptr<Communicator> Communicator::create_from_env(std::unique_ptr<Bootstrap> bootstrap,
                                                            CommOptions options) {
  return create(std::move(bootstrap), apply_env(std::move(options)));
}

}  // namespace dear
