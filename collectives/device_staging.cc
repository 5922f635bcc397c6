#include "collectives/device_staging.h"

#ifdef DEAR_HAVE_CUDA

#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "collectives/device_fence.h"
#include "collectives/engine.h"  // Work::State
#include "collectives/resident.h"
#include "collectives/staging_pieces.h"
#include "common/args.h"
#include "cuda/device.h"
#include "cuda/error.h"
#include "cuda/memory.h"
#include "cuda/stream.h"

namespace dear::collectives {
namespace {

// The wrapped communicator's call, given the pointers and the (per-rank) count it should use.
using Issue = std::function<Work(Communicator&, const void* in, void* out, std::size_t count)>;

// Pinned, mapped host memory for staged operations. A block serves one operation at a time
// and is recycled once its copies have drained; blocks are freed only with the pool (after the
// device is synchronised), never while an operation may be on a stream: freeing pinned memory
// waits for the whole device.
class PinnedPool {
 public:
  struct Block {
    std::byte* host = nullptr;
    std::byte* device = nullptr;  // the same memory as the device addresses it
    std::size_t size = 0;
    bool busy = false;
  };

  PinnedPool() = default;
  PinnedPool(const PinnedPool&) = delete;
  PinnedPool& operator=(const PinnedPool&) = delete;
  ~PinnedPool() {
    for (const auto& b : blocks_) (void)cudaFreeHost(b->host);
  }

  // The smallest idle block of at least `bytes`, or a new one (sizes rounded up so that blocks
  // are reused across nearby sizes). Caller's thread.
  Block* take(std::size_t bytes, int rank) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      Block* best = nullptr;
      for (const auto& b : blocks_) {
        if (!b->busy && b->size >= bytes && (best == nullptr || b->size < best->size)) {
          best = b.get();
        }
      }
      if (best != nullptr) {
        best->busy = true;
        return best;
      }
    }
    const std::size_t size = rounded(bytes);
    const cuda::MappedMemory m = cuda::alloc_mapped(size, "pinned staging", rank);
    auto block = std::make_unique<Block>();
    block->host = static_cast<std::byte*>(m.host);
    block->device = static_cast<std::byte*>(m.device);
    block->size = size;
    block->busy = true;
    std::lock_guard<std::mutex> lock(mu_);
    blocks_.push_back(std::move(block));
    return blocks_.back().get();
  }

  // Staging thread; no CUDA call.
  void give_back(Block* b) {
    std::lock_guard<std::mutex> lock(mu_);
    b->busy = false;
  }

 private:
  static std::size_t rounded(std::size_t bytes) {
    constexpr std::size_t kSmall = std::size_t{64} << 10;
    constexpr std::size_t kLarge = std::size_t{64} << 20;
    if (bytes >= kLarge) return (bytes + (kLarge / 4) - 1) / (kLarge / 4) * (kLarge / 4);
    std::size_t size = kSmall;
    while (size < bytes) size *= 2;
    return size;
  }

  std::mutex mu_;
  std::vector<std::unique_ptr<Block>> blocks_;
};

// What a staged operation puts on its stream, and how far the stream has got. The caller's
// thread fills it before the job is queued; after that only `enqueued` and the flags in the
// block change, so both threads read it without a lock.
struct Staging {
  PiecePlan plan;
  // Its first bytes are the flags the stream sets (flag i: piece i is in pinned memory; flag
  // n: every copy-out is done), then the plan's pinned regions from `data`.
  PinnedPool::Block* block = nullptr;
  std::size_t data = 0;
  std::uint64_t first_ticket = 0;  // piece i's copy-out waits for first_ticket + i
  // Set by the caller's thread once everything is on the stream (kEnqueued), or when that
  // failed part way (kFailed: the stream may hold part of it).
  enum : int { kEnqueuing, kEnqueued, kFailed };
  std::atomic<int> enqueued{kEnqueuing};

  [[nodiscard]] std::size_t pieces() const { return plan.pieces.size(); }
  [[nodiscard]] bool flag_set(std::size_t i) const {
    auto* flags = reinterpret_cast<std::uint64_t*>(block->host);
    return std::atomic_ref<std::uint64_t>(flags[i]).load(std::memory_order_acquire) != 0;
  }
  [[nodiscard]] bool failed() const { return enqueued.load(std::memory_order_acquire) == kFailed; }
};

struct Job {
  const char* name = "";
  Issue issue;
  std::size_t count = 0;  // per-rank count of the whole operation
  const void* in = nullptr;
  void* out = nullptr;
  // Null: a host operation queued behind staged ones (nothing on a stream).
  std::shared_ptr<Staging> staging;
  bool peers_told = false;  // the wrapped communicator was aborted for this job
  std::chrono::milliseconds timeout{0};
  std::shared_ptr<Work::State> state;
  int source = -1;  // a receive's sender (Work::source), from the wrapped communicator's Work
};

using cuda::CurrentDevice;

std::size_t flags_bytes(std::size_t pieces) {
  return ((pieces + 1) * sizeof(std::uint64_t) + 255) / 256 * 256;
}

class DeviceCommunicator final : public Communicator {
 public:
  DeviceCommunicator(std::unique_ptr<Communicator> inner, const PieceOptions& pieces)
      : inner_(std::move(inner)),
        resident_(dynamic_cast<ResidentCommunicator*>(inner_.get())),
        pieces_(pieces),
        have_device_(cuda::device_count() > 0) {}

  ~DeviceCommunicator() override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stopping_ = true;
    }
    cv_.notify_all();
    if (worker_.joinable()) worker_.join();
    if (device_ < 0) return;
    // Releases every stream still waiting and synchronises the device, so that no copy still
    // uses the pool when it is freed (after this body).
    int previous = device_;
    (void)cudaGetDevice(&previous);
    (void)cudaSetDevice(device_);
    signal_.reset();
    tickets_.reset();
    (void)cudaStreamDestroy(own_stream_);
    (void)cudaEventDestroy(order_event_);
    (void)cudaSetDevice(previous);
  }

  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  const CommOptions& options() const override { return inner_->options(); }

  Work all_reduce(const void* in, void* out, std::size_t count, DataType dtype, ReduceOp op,
                  const OpOptions& opts) override {
    const std::size_t b = count * dtype_size(dtype);
    return route({OpKind::kAllReduce, in, out, count, dtype, op, -1}, "all_reduce",
                 StagedKind::kAllReduce, count, in, b, out, b, dtype, opts,
                 [=](Communicator& c, const void* i, void* o, std::size_t n, const OpOptions& x) {
                   return c.all_reduce(i, o, n, dtype, op, x);
                 });
  }

  Work reduce_scatter(const void* in, void* out, std::size_t recv_count, DataType dtype,
                      ReduceOp op, const OpOptions& opts) override {
    const std::size_t b = recv_count * dtype_size(dtype);
    return route({OpKind::kReduceScatter, in, out, recv_count, dtype, op, -1}, "reduce_scatter",
                 StagedKind::kReduceScatter, recv_count, in, b * static_cast<std::size_t>(size()),
                 out, b, dtype, opts,
                 [=](Communicator& c, const void* i, void* o, std::size_t n, const OpOptions& x) {
                   return c.reduce_scatter(i, o, n, dtype, op, x);
                 });
  }

  Work all_gather(const void* in, void* out, std::size_t send_count, DataType dtype,
                  const OpOptions& opts) override {
    const std::size_t b = send_count * dtype_size(dtype);
    return route({OpKind::kAllGather, in, out, send_count, dtype, ReduceOp::kSum, -1}, "all_gather",
                 StagedKind::kAllGather, send_count, in, b, out,
                 b * static_cast<std::size_t>(size()), dtype, opts,
                 [=](Communicator& c, const void* i, void* o, std::size_t n, const OpOptions& x) {
                   return c.all_gather(i, o, n, dtype, x);
                 });
  }

  Work broadcast(const void* in, void* out, std::size_t count, DataType dtype, int root,
                 const OpOptions& opts) override {
    const std::size_t b = count * dtype_size(dtype);
    // Only the root reads `in`; elsewhere it may be anything and is passed on untouched.
    return route({OpKind::kBroadcast, in, out, count, dtype, ReduceOp::kSum, root}, "broadcast",
                 StagedKind::kBroadcast, count, in, rank() == root ? b : 0, out, b, dtype, opts,
                 [=](Communicator& c, const void* i, void* o, std::size_t n, const OpOptions& x) {
                   return c.broadcast(i, o, n, dtype, root, x);
                 });
  }

  Work reduce(const void* in, void* out, std::size_t count, DataType dtype, ReduceOp op, int root,
              const OpOptions& opts) override {
    const std::size_t b = count * dtype_size(dtype);
    // Only the root's `out` is written; elsewhere it may be anything and is passed on untouched.
    return route({OpKind::kAllReduce, in, out, count, dtype, op, root}, "reduce",
                 StagedKind::kAllReduce, count, in, b, out, rank() == root ? b : 0, dtype, opts,
                 [=](Communicator& c, const void* i, void* o, std::size_t n, const OpOptions& x) {
                   return c.reduce(i, o, n, dtype, op, root, x);
                 });
  }

  Work scatter(const void* in, void* out, std::size_t recv_count, DataType dtype, int root,
               const OpOptions& opts) override {
    const std::size_t b = recv_count * dtype_size(dtype);
    const std::size_t in_b = rank() == root ? b * static_cast<std::size_t>(size()) : 0;
    // Only the root's `in` is read. Its exchanges run on host memory (steps.h): device buffers
    // are staged, in pieces as a reduce_scatter's (the root's input is N blocks).
    return route({OpKind::kReduceScatter, in, out, recv_count, dtype, ReduceOp::kSum, root},
                 "scatter", StagedKind::kReduceScatter, recv_count, in, in_b, out, b, dtype, opts,
                 [=](Communicator& c, const void* i, void* o, std::size_t n, const OpOptions& x) {
                   return c.scatter(i, o, n, dtype, root, x);
                 });
  }

  Work gather(const void* in, void* out, std::size_t send_count, DataType dtype, int root,
              const OpOptions& opts) override {
    const std::size_t b = send_count * dtype_size(dtype);
    const std::size_t out_b = rank() == root ? b * static_cast<std::size_t>(size()) : 0;
    // Only the root's `out` is written; elsewhere it may be anything and is passed on untouched.
    return route({OpKind::kAllGather, in, out, send_count, dtype, ReduceOp::kSum, root}, "gather",
                 StagedKind::kAllGather, send_count, in, b, out, out_b, dtype, opts,
                 [=](Communicator& c, const void* i, void* o, std::size_t n, const OpOptions& x) {
                   return c.gather(i, o, n, dtype, root, x);
                 });
  }

  Work all_to_all(const void* in, void* out, std::size_t count, DataType dtype,
                  const OpOptions& opts) override {
    const std::size_t b = count * dtype_size(dtype) * static_cast<std::size_t>(size());
    // Its exchanges run on host memory (steps.h): device buffers are staged, in pieces that
    // each cover the same range of every block.
    return route({OpKind::kAllToAll, in, out, count, dtype, ReduceOp::kSum, -1}, "all_to_all",
                 StagedKind::kAllToAll, count, in, b, out, b, dtype, opts,
                 [=](Communicator& c, const void* i, void* o, std::size_t n, const OpOptions& x) {
                   return c.all_to_all(i, o, n, dtype, x);
                 });
  }

  Work all_to_all_v(const void* in, std::span<const std::size_t> send_counts,
                    std::span<const std::size_t> send_displs, void* out,
                    std::span<const std::size_t> recv_counts,
                    std::span<const std::size_t> recv_displs, DataType dtype,
                    const OpOptions& opts) override {
    // Staged whole like all_to_all, over the extents the layouts describe; the inner call
    // checks the layouts (a bad one fails when the staging thread issues it).
    const std::size_t el = dtype_size(dtype);
    const AllToAllLists l(send_counts, send_displs, recv_counts, recv_displs);
    return route(
        {OpKind::kAllToAllV, in, out, 0, dtype, ReduceOp::kSum, -1}, "all_to_all_v",
        StagedKind::kOther, 0, in, layout_extent(send_counts, send_displs, el), out,
        layout_extent(recv_counts, recv_displs, el), dtype, opts,
        [=](Communicator& c, const void* i, void* o, std::size_t, const OpOptions& x) {
          return c.all_to_all_v(i, l.send_counts, l.send_displs, o, l.recv_counts, l.recv_displs,
                                dtype, x);
        },
        [&] { return exchange(nullptr, -1, in, out, l, dtype); });
  }

  // Staged whole as all_to_all_v is, and issued as the inner communicator's own all_gather_v
  // and gather_v (whose messages and errors are theirs).
  Work all_gather_v(const void* in, std::size_t send_count, void* out,
                    std::span<const std::size_t> recv_counts,
                    std::span<const std::size_t> recv_displs, DataType dtype,
                    const OpOptions& opts) override {
    return gather_lists(-1, in, send_count, out, recv_counts, recv_displs, dtype, opts);
  }

  Work gather_v(const void* in, std::size_t send_count, void* out,
                std::span<const std::size_t> recv_counts, std::span<const std::size_t> recv_displs,
                DataType dtype, int root, const OpOptions& opts) override {
    dear::check_root(root, size(), rank(), "gather_v");
    return gather_lists(root, in, send_count, out, recv_counts, recv_displs, dtype, opts);
  }

  Work send(const void* buf, std::size_t count, DataType dtype, int peer,
            const OpOptions& opts) override {
    const std::size_t b = count * dtype_size(dtype);
    return route(
        {OpKind::kBarrier}, "send", StagedKind::kOther, count, buf, b, nullptr, 0, dtype, opts,
        [=](Communicator& c, const void* i, void*, std::size_t n, const OpOptions& x) {
          return c.send(i, n, dtype, peer, x);
        },
        [&] { return point_to_point(true, const_cast<void*>(buf), count, dtype, peer); });
  }

  Work recv(void* buf, std::size_t count, DataType dtype, int peer,
            const OpOptions& opts) override {
    const std::size_t b = count * dtype_size(dtype);
    return route(
        {OpKind::kBarrier}, "recv", StagedKind::kOther, count, nullptr, 0, buf, b, dtype, opts,
        [=](Communicator& c, const void*, void* o, std::size_t n, const OpOptions& x) {
          return c.recv(o, n, dtype, peer, x);
        },
        [&] { return point_to_point(false, buf, count, dtype, peer); });
  }

  Work barrier(const OpOptions& opts) override {
    return route({OpKind::kBarrier}, "barrier", StagedKind::kOther, 0, nullptr, 0, nullptr, 0,
                 DataType::kUint8, opts,
                 [](Communicator& c, const void*, void*, std::size_t, const OpOptions& x) {
                   return c.barrier(x);
                 });
  }

  void abort(const std::string& reason) override {
    aborted_.store(true, std::memory_order_release);
    inner_->abort(reason);
    cv_.notify_all();
  }

  // Host operations run on the inner communicator; staged device operations have Work of
  // their own, which it does not know (and reports so).
  void forget_memory(const void* addr, std::size_t bytes) override {
    inner_->forget_memory(addr, bytes);
  }
  bool set_priority(const Work& work, int priority) override {
    return inner_->set_priority(work, priority);
  }
  // The child comes with device support of its own (Communicator::create).
  std::unique_ptr<Communicator> split(int color, int key) override {
    return inner_->split(color, key);
  }
  EngineStats engine_stats() const override { return inner_->engine_stats(); }

 private:
  using Call =
      std::function<Work(Communicator&, const void*, void*, std::size_t, const OpOptions&)>;

  // all_gather_v (`root` -1) or gather_v (a valid root): the lists are read where this rank
  // receives (a gather_v's root only).
  Work gather_lists(int root, const void* in, std::size_t send_count, void* out,
                    std::span<const std::size_t> recv_counts,
                    std::span<const std::size_t> recv_displs, DataType dtype,
                    const OpOptions& opts) {
    const char* name = root < 0 ? "all_gather_v" : "gather_v";
    const std::size_t el = dtype_size(dtype);
    const bool receives = root < 0 || root == rank();
    const std::vector<std::size_t> counts(recv_counts.begin(), recv_counts.end());
    const std::vector<std::size_t> displs(recv_displs.begin(), recv_displs.end());
    const std::size_t out_bytes = receives ? layout_extent(counts, displs, el) : 0;
    // On device memory in the engine, as all_to_all_v lists (checked as the calls check them).
    const auto on_device = [&] {
      return exchange(
          root < 0 ? name : nullptr, root, in, out,
          gather_as_all_to_all_v_lists(root, send_count, recv_counts, recv_displs, size(), rank()),
          dtype);
    };
    return route(
        {OpKind::kAllToAllV, in, out, 0, dtype, ReduceOp::kSum, root}, name, StagedKind::kOther, 0,
        in, send_count * el, out, out_bytes, dtype, opts,
        [=](Communicator& c, const void* i, void* o, std::size_t, const OpOptions& x) {
          return root < 0 ? c.all_gather_v(i, send_count, o, counts, displs, dtype, x)
                          : c.gather_v(i, send_count, o, counts, displs, dtype, root, x);
        },
        on_device);
  }

  // Issues an operation on device memory in the engine, with its fence.
  using Resident = std::function<Work(const OpOptions&, std::unique_ptr<OpFence>)>;

  // send or recv on device memory (ResidentCommunicator::p2p_on_device).
  Resident point_to_point(bool send, void* buf, std::size_t count, DataType dtype, int peer) {
    if (resident_ == nullptr) return {};
    return
        [this, send, buf, count, dtype, peer](const OpOptions& x, std::unique_ptr<OpFence> fence) {
          return resident_->p2p_on_device(send, buf, count, dtype, peer, x, std::move(fence));
        };
  }

  // all_to_all_v's operation on device memory (ResidentCommunicator::exchange_on_device).
  Resident exchange(const char* called, int root, const void* in, void* out, AllToAllLists l,
                    DataType dtype) {
    if (resident_ == nullptr) return {};
    return [this, called, root, in, out, l = std::move(l), dtype](const OpOptions& x,
                                                                  std::unique_ptr<OpFence> fence) {
      return resident_->exchange_on_device(called, root, in, l.send_counts, l.send_displs, out,
                                           l.recv_counts, l.recv_displs, dtype, x,
                                           std::move(fence));
    };
  }

  // No operation of its own on device memory: the collective `cc` is issued there.
  struct NoResident {
    Resident operator()() const { return {}; }
  };

  // `make_resident()`: how the operation runs on device memory in the engine, where it is not
  // the collective `cc` (ResidentCommunicator::issue_on_device, where runs_resident says so);
  // asked only once a buffer is found in device memory, so that a host call builds none of it.
  template <typename MakeResident = NoResident>
  Work route(const CollectiveCall& cc, const char* name, StagedKind kind, std::size_t count,
             const void* in, std::size_t in_bytes, void* out, std::size_t out_bytes, DataType dtype,
             const OpOptions& opts, const Call& call, const MakeResident& make_resident = {}) {
    OpOptions inner_opts = opts;
    inner_opts.cuda_stream = nullptr;
    const auto stream = static_cast<cudaStream_t>(opts.cuda_stream);
    const cuda::Location in_loc = have_device_ ? cuda::locate(in) : cuda::Location{};
    const cuda::Location out_loc = have_device_ ? cuda::locate(out) : cuda::Location{};
    const bool in_dev = in_loc.kind == cuda::MemoryKind::kDevice && in_bytes > 0;
    const bool out_dev = out_loc.kind == cuda::MemoryKind::kDevice && out_bytes > 0;

    if (opts.cuda_stream != nullptr && !have_device_) {
      throw Error(ErrorCode::kInvalidArgument,
                  "OpOptions::cuda_stream is set but no CUDA device is usable (" +
                      cuda::unavailable_reason() + ")",
                  rank(), Error::kNone, name);
    }
    if (in_dev && out_dev && in_loc.device != out_loc.device) {
      throw Error(ErrorCode::kInvalidArgument,
                  "in is on CUDA device " + std::to_string(in_loc.device) + " but out on " +
                      std::to_string(out_loc.device),
                  rank(), Error::kNone, name);
    }

    const auto make_job = [&] {
      Job job;
      job.name = name;
      job.issue = [call, inner_opts](Communicator& c, const void* i, void* o, std::size_t n) {
        return call(c, i, o, n, inner_opts);
      };
      job.count = count;
      job.in = in;
      job.out = out;
      job.timeout = opts.timeout.count() > 0 ? opts.timeout : options().timeout;
      job.state = std::make_shared<Work::State>();
      return job;
    };

    if (!in_dev && !out_dev && stream == nullptr) {
      std::lock_guard<std::mutex> lock(mu_);
      // Plain host operation with nothing queued before it: issued at once, in order.
      if (queued_ == 0) return call(*inner_, in, out, count, inner_opts);
      check_not_aborted(name);
      Job job = make_job();
      Work work(job.state);
      push(std::move(job));
      return work;
    }

    // Device-resident: every buffer that is read or written is device memory, more than one
    // rank, and staging not asked for. The engine runs it slice by slice, its steps on the
    // device (resident.h); it keeps its place in the order behind staged operations.
    const bool all_dev = (in_bytes == 0 || in_dev) && (out_bytes == 0 || out_dev);
    Resident resident = in_dev || out_dev ? make_resident() : Resident{};
    if (!resident && resident_ != nullptr && runs_resident(cc, size())) {
      resident = [this, cc](const OpOptions& x, std::unique_ptr<OpFence> fence) {
        return resident_->issue_on_device(cc, x, std::move(fence));
      };
    }
    if (resident && (in_dev || out_dev) && all_dev && size() > 1 && !options().cuda_staging) {
      const int device = in_dev ? in_loc.device : out_loc.device;
      const CurrentDevice current(device, rank());
      use_device(device, name);
      auto fence = std::make_shared<std::unique_ptr<OpFence>>(
          make_device_fence(tickets_, opts.cuda_stream, device, rank()));
      std::lock_guard<std::mutex> lock(mu_);
      if (queued_ == 0) return resident(inner_opts, std::move(*fence));
      check_not_aborted(name);
      Job job = make_job();
      job.issue = [resident, inner_opts, fence](Communicator&, const void*, void*, std::size_t) {
        return resident(inner_opts, std::move(*fence));
      };
      Work work(job.state);
      push(std::move(job));
      return work;
    }

    Job job = make_job();
    // Decided by where this rank's buffers live, never by timing (a host operation queued
    // behind staged ones is not split): every rank that passes device memory splits alike.
    const bool split = in_dev || out_dev;
    auto st = std::make_shared<Staging>();
    st->plan =
        plan_pieces(kind, {in, in_bytes, in_dev}, {out, out_bytes, out_dev}, count,
                    std::max<std::size_t>(dtype_size(dtype), 1), rank(), size(), split, pieces_);
    const std::size_t n = st->pieces();
    // CUDA calls that may wait for the device (allocations) are made before the job is
    // queued and without mu_, which the staging thread needs to move earlier jobs on.
    int device = in_dev ? in_loc.device : out_dev ? out_loc.device : device_of_streams();
    const CurrentDevice current(device, rank());
    use_device(device, name);
    st->data = flags_bytes(n);
    st->block = pool_.take(st->data + st->plan.pinned_bytes, rank());
    std::memset(st->block->host, 0, st->data);
    job.staging = st;
    Work work(job.state);
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (aborted_.load(std::memory_order_acquire)) {
        pool_.give_back(st->block);
        check_not_aborted(name);
      }
      // Tickets in queue order: the staging thread publishes them job after job.
      st->first_ticket = last_ticket_ + 1;
      last_ticket_ += n;
      push(std::move(job));
    }
    try {
      enqueue(*st, stream, name);
    } catch (const std::exception& e) {
      st->enqueued.store(Staging::kFailed, std::memory_order_release);
      abort_peers(name, e);  // this rank will not take part
      throw;
    }
    st->enqueued.store(Staging::kEnqueued, std::memory_order_release);
    return work;
  }

  void check_not_aborted(const char* name) const {
    if (aborted_.load(std::memory_order_acquire)) {
      throw Error(ErrorCode::kAborted, "the communicator was aborted", rank(), Error::kNone, name);
    }
  }

  void push(Job job) {
    jobs_.push_back(std::move(job));
    ++queued_;
    if (!worker_.joinable()) worker_ = std::thread([this] { run(); });
    cv_.notify_all();
  }

  // Operations on a stream with host buffers stage on the communicator's device, or the
  // caller's current one before the first staged operation.
  int device_of_streams() {
    std::lock_guard<std::mutex> lock(setup_mu_);
    if (device_ >= 0) return device_;
    int device = 0;
    cuda::check(cudaGetDevice(&device), "cudaGetDevice", rank());
    return device;
  }

  // The first staged operation fixes the device; the communicator's stream and the signal
  // are made for it.
  void use_device(int device, const char* name) {
    std::lock_guard<std::mutex> lock(setup_mu_);
    if (device_ < 0) {
      cuda::check(cudaStreamCreateWithFlags(&own_stream_, cudaStreamNonBlocking),
                  "creating the staging stream", rank());
      cuda::check(cudaEventCreateWithFlags(&order_event_, cudaEventDisableTiming),
                  "creating the staging stream's event", rank());
      int pitch = 0;
      if (cudaDeviceGetAttribute(&pitch, cudaDevAttrMaxPitch, device) == cudaSuccess && pitch > 0) {
        max_pitch_ = static_cast<std::size_t>(pitch);
      }
      (void)cudaGetLastError();
      signal_ = std::make_unique<cuda::HostSignal>();
      tickets_ = make_device_tickets(rank());
      device_ = device;
    } else if (device_ != device) {
      throw Error(ErrorCode::kInvalidArgument,
                  "buffers on CUDA device " + std::to_string(device) +
                      ", but this communicator stages for device " + std::to_string(device_),
                  rank(), Error::kNone, name);
    }
  }

  // Puts the whole operation on `stream`, in the caller's thread: every piece's copy-in and
  // then a flag the staging thread polls; then, per piece, a wait for its ticket (published by
  // the staging thread once the piece's host collective is done) and its copy-out; then a last
  // flag. The staging thread makes no CUDA call at all, so an operation in flight never
  // depends on a CUDA call that could wait for the device (cudaFree in another thread waits
  // for every stream, these waits included).
  void enqueue(const Staging& st, cudaStream_t user_stream, const char* name) {
    cudaStream_t stream = user_stream;
    if (stream == nullptr) {
      // No stream given: the operation comes after the work already on the legacy default
      // stream (a cudaMemcpy that filled the input may still be landing), while later work
      // there does not wait for it.
      stream = own_stream_;
      cuda::check(cudaEventRecord(order_event_, cudaStreamLegacy),
                  std::string(name) + ": cudaEventRecord on the default stream", rank());
      cuda::check(cudaStreamWaitEvent(stream, order_event_, 0),
                  std::string(name) + ": cudaStreamWaitEvent", rank());
    }
    const std::size_t n = st.pieces();
    const auto flag = [&](std::size_t i) {
      return reinterpret_cast<unsigned long long*>(st.block->device) + i;
    };
    for (std::size_t i = 0; i < n; ++i) {
      for (const auto& c : st.plan.pieces[i].copy_in) enqueue_copy(c, true, stream, st, i, name);
      cuda::set_flag(flag(i), 1, stream);
    }
    for (std::size_t i = 0; i < n; ++i) {
      signal_->enqueue_wait(stream, st.first_ticket + i);
      for (const auto& c : st.plan.pieces[i].copy_out) {
        enqueue_copy(c, false, stream, st, i, name);
      }
    }
    cuda::set_flag(flag(n), 1, stream);
  }

  void enqueue_copy(const PieceCopy& c, bool to_pinned, cudaStream_t stream, const Staging& st,
                    std::size_t piece, const char* name) {
    std::byte* pinned = st.block->host + st.data + c.pinned_offset;
    auto* user = reinterpret_cast<std::byte*>(c.user);
    void* dst = to_pinned ? pinned : user;
    const void* src = to_pinned ? static_cast<const void*>(user) : pinned;
    const std::size_t dpitch = to_pinned ? c.pinned_pitch : c.user_pitch;
    const std::size_t spitch = to_pinned ? c.user_pitch : c.pinned_pitch;
    // cudaMemcpyDefault: the user side may be host memory in a split operation.
    cudaError_t rc = cudaSuccess;
    if (c.rows == 1) {
      rc = cudaMemcpyAsync(dst, src, c.row_bytes, cudaMemcpyDefault, stream);
    } else if (std::max(dpitch, spitch) <= max_pitch_) {
      rc = cudaMemcpy2DAsync(dst, dpitch, src, spitch, c.row_bytes, c.rows, cudaMemcpyDefault,
                             stream);
    } else {
      for (std::size_t r = 0; r < c.rows && rc == cudaSuccess; ++r) {
        rc = cudaMemcpyAsync(static_cast<std::byte*>(dst) + r * dpitch,
                             static_cast<const std::byte*>(src) + r * spitch, c.row_bytes,
                             cudaMemcpyDefault, stream);
      }
    }
    if (rc != cudaSuccess) {
      const std::string where = piece_name(st.plan, piece);
      cuda::check(rc,
                  std::string(name) + ": staging copy of " + std::to_string(c.rows) + " x " +
                      std::to_string(c.row_bytes) +
                      (to_pinned ? " bytes device->pinned" : " bytes pinned->device") +
                      (where.empty() ? "" : ", " + where),
                  rank());
    }
  }

  void run() {
    for (;;) {
      Job job;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return stopping_ || !jobs_.empty(); });
        if (jobs_.empty()) return;
        job = std::move(jobs_.front());
        jobs_.pop_front();
      }
      std::exception_ptr error;
      bool issued = false;
      try {
        if (stopping_) {
          throw Error(ErrorCode::kAborted, "the communicator was destroyed", rank(), Error::kNone,
                      job.name);
        }
        if (!job.staging) {
          run_host(job, issued);
        } else {
          run_staged(job, issued);
        }
      } catch (...) {
        error = std::current_exception();
      }
      if (!issued) {
        std::lock_guard<std::mutex> lock(mu_);
        --queued_;
      }
      if (error && !issued) tell_peers(job, error);
      // Whatever happened, the stream moves on (its copy-outs then carry no result).
      if (job.staging) {
        const Staging& st = *job.staging;
        signal_->publish(st.first_ticket + st.pieces() - 1);
      }
      job.state->source = job.source;
      job.state->complete(error);
    }
  }

  // A host operation queued behind staged ones: issued in its turn, waited for here so that
  // its Work completes with it.
  void run_host(Job& job, bool& issued) {
    Work w;
    {
      std::lock_guard<std::mutex> lock(mu_);
      w = job.issue(*inner_, job.in, job.out, job.count);
      issued = true;
      --queued_;
    }
    (void)w.wait();
    job.source = w.source();
  }

  // Fails the peers of an operation this rank will not (fully) hand to the engine, rather
  // than let them time out waiting for its pieces.
  void abort_peers(const char* name, const std::exception& e) {
    inner_->abort(std::string(name) + " could not be staged on rank " + std::to_string(rank()) +
                  ": " + e.what());
  }

  void tell_peers(Job& job, const std::exception_ptr& error) {
    if (job.peers_told) return;
    job.peers_told = true;
    try {
      std::rethrow_exception(error);
    } catch (const std::exception& e) {
      abort_peers(job.name, e);
    }
  }

  static std::string piece_name(const PiecePlan& plan, std::size_t i) {
    if (plan.pieces.size() == 1) return "";
    const StagedPiece& p = plan.pieces[i];
    return "piece " + std::to_string(i + 1) + " of " + std::to_string(plan.pieces.size()) +
           " (elements [" + std::to_string(p.first) + ", " + std::to_string(p.first + p.count) +
           ") of each rank's data)";
  }

  // A piece's failure as the operation's: the same code, peer and sequence, the piece named.
  [[noreturn]] void rethrow_piece(const std::exception_ptr& error, const Job& job, std::size_t i) {
    const PiecePlan& plan = job.staging->plan;
    if (plan.pieces.size() == 1) std::rethrow_exception(error);
    try {
      std::rethrow_exception(error);
    } catch (const Error& e) {
      throw Error(e.code(), piece_name(plan, i) + ": " + e.cause(),
                  e.rank() != Error::kNone ? e.rank() : rank(), e.peer(), job.name, e.seq());
    }
  }

  // One staged operation, with no CUDA call: piece i is handed to the wrapped communicator
  // once the stream has set its flag (its copy-in is done; pieces in order, so every rank
  // issues the same sequence); when piece i's host collective completes its ticket is
  // published and the stream copies it out, overlapping the later pieces. The operation is
  // done when the stream has set the last flag. Polls with short sleeps, or blocks in
  // Work::wait for a bounded time once only the network is left.
  void run_staged(Job& job, bool& issued_all) {
    const Staging& st = *job.staging;
    const std::size_t n = st.pieces();
    const auto deadline = std::chrono::steady_clock::now() + job.timeout;
    const auto late = [&](const std::string& what) {
      return Error(ErrorCode::kTimeout,
                   what + " did not finish within " + std::to_string(job.timeout.count()) + " ms",
                   rank(), Error::kNone, job.name);
    };
    std::vector<Work> works;
    works.reserve(n);
    std::size_t published = 0;
    try {
      for (;;) {
        bool moved = false;
        while (works.size() < n && st.flag_set(works.size())) {
          const StagedPiece& p = st.plan.pieces[works.size()];
          std::byte* data = st.block->host + st.data;
          const void* in = p.in_offset == StagingPlan::kUnstaged ? job.in : data + p.in_offset;
          void* out = p.out_offset == StagingPlan::kUnstaged ? job.out : data + p.out_offset;
          std::lock_guard<std::mutex> lock(mu_);
          works.push_back(job.issue(*inner_, in, out, p.count));
          if (works.size() == n) {
            issued_all = true;
            --queued_;
          }
          moved = true;
        }
        while (published < works.size() && works[published].test()) {
          if (auto e = works[published].error()) rethrow_piece(e, job, published);
          signal_->publish(st.first_ticket + published);
          ++published;
          moved = true;
        }
        if (published == n) break;
        if (moved) continue;
        if (works.size() < n) {
          if (st.failed()) {
            throw Error(ErrorCode::kSystem, "could not be put on its CUDA stream", rank(),
                        Error::kNone, job.name);
          }
          if (aborted_.load(std::memory_order_acquire) || stopping_) {
            throw Error(ErrorCode::kAborted, "aborted while staging", rank(), Error::kNone,
                        job.name);
          }
          if (std::chrono::steady_clock::now() > deadline) {
            throw late("the work before it on its CUDA stream and the copy of " +
                       (n == 1 ? std::string("its input") : piece_name(st.plan, works.size())) +
                       " to pinned memory");
          }
          std::this_thread::sleep_for(std::chrono::microseconds(20));
        } else {
          // Only the network is left to wait for: block on it (woken when it completes).
          try {
            (void)works[published].wait(std::chrono::milliseconds(1));
          } catch (...) {  // NOLINT(bugprone-empty-catch): reported through error() above
          }
        }
      }
    } catch (...) {
      const std::exception_ptr error = std::current_exception();
      if (!issued_all && !works.empty()) tell_peers(job, error);
      // The engine completes every issued piece (at the latest at its deadline) before the
      // pinned memory is left to the stream.
      for (const Work& w : works) {
        try {
          (void)w.wait();
        } catch (...) {  // NOLINT(bugprone-empty-catch): the first error is already reported
        }
      }
      // The block is not reused: the stream may still copy into and out of it.
      throw;
    }
    // Every ticket is published, so every copy-out is on its way; the operation completes once
    // they are done.
    const auto drained = std::chrono::steady_clock::now() + job.timeout;
    while (!st.flag_set(n)) {
      if (st.failed()) {
        throw Error(ErrorCode::kSystem, "its last flag could not be put on its CUDA stream", rank(),
                    Error::kNone, job.name);
      }
      if (std::chrono::steady_clock::now() > drained) {
        throw late("the copy of its result from pinned memory to the device");
      }
      std::this_thread::sleep_for(std::chrono::microseconds(10));
    }
    pool_.give_back(st.block);
    // A receive is one piece (StagedKind::kOther), so one message and one sender.
    if (!works.empty()) job.source = works.back().source();
  }

  std::unique_ptr<Communicator> inner_;
  ResidentCommunicator* const resident_;  // inner_, when it takes device-resident operations
  const PieceOptions pieces_;
  const bool have_device_;
  std::atomic<bool> aborted_{false};
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Job> jobs_;
  std::size_t queued_ = 0;  // jobs not yet handed to inner_
  std::atomic<bool> stopping_{false};
  std::uint64_t last_ticket_ = 0;  // under mu_
  // Set once, by the first staged operation, under setup_mu_:
  std::mutex setup_mu_;
  int device_ = -1;
  cudaStream_t own_stream_ = nullptr;  // for operations without OpOptions::cuda_stream
  cudaEvent_t order_event_ = nullptr;  // orders them after the legacy default stream
  std::size_t max_pitch_ = 0;          // cudaMemcpy2D's limit; larger strides copy row by row
  std::unique_ptr<cuda::HostSignal> signal_;  // published by the staging thread only
  std::shared_ptr<DeviceTickets> tickets_;    // device-resident operations' ends
  PinnedPool pool_;
  std::thread worker_;  // last: joined before the rest is destroyed
};

}  // namespace

std::unique_ptr<Communicator> with_device_support(std::unique_ptr<Communicator> comm,
                                                  const PieceOptions& pieces) {
  return std::make_unique<DeviceCommunicator>(std::move(comm), pieces);
}

bool is_device_pointer(const void* p) noexcept {
  return cuda::locate(p).kind == cuda::MemoryKind::kDevice;
}

}  // namespace dear::collectives

#else  // no CUDA in this build

namespace dear::collectives {

std::unique_ptr<Communicator> with_device_support(std::unique_ptr<Communicator> comm,
                                                  const PieceOptions&) {
  return comm;
}

bool is_device_pointer(const void*) noexcept { return false; }

}  // namespace dear::collectives

#endif
