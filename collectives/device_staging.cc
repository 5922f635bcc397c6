#include "collectives/device_staging.h"

#ifdef DEAR_HAVE_CUDA

#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <exception>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "collectives/engine.h"  // Work::State
#include "collectives/staging_pieces.h"
#include "cuda/device.h"
#include "cuda/error.h"
#include "cuda/memory.h"
#include "cuda/stream.h"

namespace dear::collectives {
namespace {

// The wrapped communicator's call, given the pointers and the (per-rank) count it should use.
using Issue = std::function<Work(Communicator&, const void* in, void* out, std::size_t count)>;

struct Job {
  const char* name = "";
  Issue issue;
  StagedKind kind = StagedKind::kOther;
  std::size_t count = 0;  // per-rank count of the whole operation
  bool split = false;     // may be split into pieces (a device buffer is involved)
  StagingSpan in;
  StagingSpan out;
  std::size_t elem = 1;
  int device = -1;                // of the staged buffers; -1 when none is staged
  cudaEvent_t ready = nullptr;    // recorded on the caller's stream; null without one
  std::uint64_t ticket = 0;       // published to release the caller's stream; 0: none
  bool peers_told = false;        // the wrapped communicator was aborted for this job
  std::chrono::milliseconds timeout{0};
  std::shared_ptr<Work::State> state;
};

class DeviceCommunicator final : public Communicator {
 public:
  DeviceCommunicator(std::unique_ptr<Communicator> inner, const PieceOptions& pieces)
      : inner_(std::move(inner)), pieces_(pieces), have_device_(cuda::device_count() > 0) {}

  ~DeviceCommunicator() override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stopping_ = true;
    }
    cv_.notify_all();
    if (worker_.joinable()) worker_.join();
    for (cudaEvent_t e : events_) (void)cudaEventDestroy(e);
    if (in_stream_ != nullptr) (void)cudaStreamDestroy(in_stream_);
    if (out_stream_ != nullptr) (void)cudaStreamDestroy(out_stream_);
  }

  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  const CommOptions& options() const override { return inner_->options(); }

  Work all_reduce(const void* in, void* out, std::size_t count, DataType dtype, ReduceOp op,
                  const OpOptions& opts) override {
    const std::size_t b = count * dtype_size(dtype);
    return route("all_reduce", StagedKind::kAllReduce, count, in, b, out, b, dtype, opts,
                 [=](Communicator& c, const void* i, void* o, std::size_t n, const OpOptions& x) {
                   return c.all_reduce(i, o, n, dtype, op, x);
                 });
  }

  Work reduce_scatter(const void* in, void* out, std::size_t recv_count, DataType dtype,
                      ReduceOp op, const OpOptions& opts) override {
    const std::size_t b = recv_count * dtype_size(dtype);
    return route("reduce_scatter", StagedKind::kReduceScatter, recv_count, in,
                 b * static_cast<std::size_t>(size()), out, b, dtype, opts,
                 [=](Communicator& c, const void* i, void* o, std::size_t n, const OpOptions& x) {
                   return c.reduce_scatter(i, o, n, dtype, op, x);
                 });
  }

  Work all_gather(const void* in, void* out, std::size_t send_count, DataType dtype,
                  const OpOptions& opts) override {
    const std::size_t b = send_count * dtype_size(dtype);
    return route("all_gather", StagedKind::kAllGather, send_count, in, b, out,
                 b * static_cast<std::size_t>(size()), dtype, opts,
                 [=](Communicator& c, const void* i, void* o, std::size_t n, const OpOptions& x) {
                   return c.all_gather(i, o, n, dtype, x);
                 });
  }

  Work broadcast(const void* in, void* out, std::size_t count, DataType dtype, int root,
                 const OpOptions& opts) override {
    const std::size_t b = count * dtype_size(dtype);
    // Only the root reads `in`; elsewhere it may be anything and is passed on untouched.
    return route("broadcast", StagedKind::kBroadcast, count, in, rank() == root ? b : 0, out, b,
                 dtype, opts,
                 [=](Communicator& c, const void* i, void* o, std::size_t n, const OpOptions& x) {
                   return c.broadcast(i, o, n, dtype, root, x);
                 });
  }

  Work barrier(const OpOptions& opts) override {
    return route("barrier", StagedKind::kOther, 0, nullptr, 0, nullptr, 0, DataType::kUint8, opts,
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

 private:
  using Call =
      std::function<Work(Communicator&, const void*, void*, std::size_t, const OpOptions&)>;

  Work route(const char* name, StagedKind kind, std::size_t count, const void* in,
             std::size_t in_bytes, void* out, std::size_t out_bytes, DataType dtype,
             const OpOptions& opts, const Call& call) {
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

    std::unique_lock<std::mutex> lock(mu_);
    if (!in_dev && !out_dev && opts.cuda_stream == nullptr && queued_ == 0) {
      // Plain host operation with nothing queued before it: issued at once, in order.
      return call(*inner_, in, out, count, inner_opts);
    }
    if (aborted_.load(std::memory_order_acquire)) {
      throw Error(ErrorCode::kAborted, "the communicator was aborted", rank(), Error::kNone,
                  name);
    }

    Job job;
    job.name = name;
    job.issue = [call, inner_opts](Communicator& c, const void* i, void* o, std::size_t n) {
      return call(c, i, o, n, inner_opts);
    };
    job.kind = kind;
    job.count = count;
    // Decided by where this rank's buffers live, never by timing (a host operation queued
    // behind staged ones is not split): every rank that passes device memory splits alike.
    job.split = in_dev || out_dev;
    job.in = {in, in_bytes, in_dev};
    job.out = {out, out_bytes, out_dev};
    job.elem = std::max<std::size_t>(dtype_size(dtype), 1);
    job.device = in_dev ? in_loc.device : out_dev ? out_loc.device : -1;
    job.timeout = opts.timeout.count() > 0 ? opts.timeout : options().timeout;
    job.state = std::make_shared<Work::State>();
    if (stream != nullptr) {
      // The staging side starts after the work already on the caller's stream...
      cuda::check(cudaEventCreateWithFlags(&job.ready, cudaEventDisableTiming),
                  std::string(name) + ": cudaEventCreate", rank());
      try {
        cuda::check(cudaEventRecord(job.ready, stream),
                    std::string(name) + ": cudaEventRecord on OpOptions::cuda_stream", rank());
        // ...and work enqueued later on that stream waits for the result. (A ticket lost to a
        // failure here is harmless: later, larger ones release every wait.)
        if (!signal_) signal_ = std::make_unique<cuda::HostSignal>();
        job.ticket = ++last_ticket_;
        signal_->enqueue_wait(stream, job.ticket);
      } catch (...) {
        (void)cudaEventDestroy(job.ready);
        throw;
      }
    }
    Work work(job.state);
    jobs_.push_back(std::move(job));
    ++queued_;
    if (!worker_.joinable()) worker_ = std::thread([this] { run(); });
    lock.unlock();
    cv_.notify_all();
    return work;
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
          throw Error(ErrorCode::kAborted, "the communicator was destroyed", rank(),
                      Error::kNone, job.name);
        }
        execute(job, issued);
      } catch (...) {
        error = std::current_exception();
      }
      if (!issued) {
        std::lock_guard<std::mutex> lock(mu_);
        --queued_;
      }
      if (error && !issued) tell_peers(job, error);
      if (job.ready != nullptr) (void)cudaEventDestroy(job.ready);
      job.state->complete(error);
      if (job.ticket != 0) signal_->publish(job.ticket);
    }
  }

  // Waits for the caller's stream up to the operation's deadline, polling so that abort() and
  // destruction are noticed.
  void wait_ready(const Job& job) {
    if (job.ready == nullptr) return;
    const auto deadline = std::chrono::steady_clock::now() + job.timeout;
    for (;;) {
      const cudaError_t rc = cudaEventQuery(job.ready);
      if (rc == cudaSuccess) return;
      if (rc != cudaErrorNotReady) {
        cuda::check(rc, std::string(job.name) + ": waiting for OpOptions::cuda_stream", rank());
      }
      if (aborted_.load(std::memory_order_acquire) || stopping_) {
        throw Error(ErrorCode::kAborted, "aborted while waiting for OpOptions::cuda_stream",
                    rank(), Error::kNone, job.name);
      }
      if (std::chrono::steady_clock::now() > deadline) {
        throw Error(ErrorCode::kTimeout,
                    "the work before it on OpOptions::cuda_stream did not finish within " +
                        std::to_string(job.timeout.count()) + " ms",
                    rank(), Error::kNone, job.name);
      }
      std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
  }

  // Fails the peers of an operation this rank will not (fully) hand to the engine, rather
  // than let them time out waiting for its pieces.
  void tell_peers(Job& job, const std::exception_ptr& error) {
    if (job.peers_told) return;
    job.peers_told = true;
    try {
      std::rethrow_exception(error);
    } catch (const std::exception& e) {
      inner_->abort(std::string(job.name) + " could not be staged on rank " +
                    std::to_string(rank()) + ": " + e.what());
    }
  }

  void use_device(const Job& job) {
    if (job.device < 0) return;
    if (device_ < 0) {
      cuda::check(cudaSetDevice(job.device), "cudaSetDevice for staging", rank());
      cuda::check(cudaStreamCreateWithFlags(&in_stream_, cudaStreamNonBlocking),
                  "creating the staging copy-in stream", rank());
      cuda::check(cudaStreamCreateWithFlags(&out_stream_, cudaStreamNonBlocking),
                  "creating the staging copy-out stream", rank());
      int pitch = 0;
      if (cudaDeviceGetAttribute(&pitch, cudaDevAttrMaxPitch, job.device) == cudaSuccess &&
          pitch > 0) {
        max_pitch_ = static_cast<std::size_t>(pitch);
      }
      (void)cudaGetLastError();
      device_ = job.device;
    } else if (device_ != job.device) {
      throw Error(ErrorCode::kInvalidArgument,
                  "buffers on CUDA device " + std::to_string(job.device) +
                      ", but this communicator stages for device " + std::to_string(device_),
                  rank(), Error::kNone, job.name);
    }
  }

  cudaEvent_t event(std::size_t i, const Job& job) {
    while (events_.size() <= i) {
      cudaEvent_t e = nullptr;
      cuda::check(cudaEventCreateWithFlags(&e, cudaEventDisableTiming),
                  std::string(job.name) + ": cudaEventCreate for staging", rank());
      events_.push_back(e);
    }
    return events_[i];
  }

  // True once `e` has completed; throws on a CUDA error (a failed copy).
  bool done(cudaEvent_t e, const Job& job, const std::string& what) {
    const cudaError_t rc = cudaEventQuery(e);
    if (rc == cudaSuccess) return true;
    if (rc != cudaErrorNotReady) cuda::check(rc, std::string(job.name) + ": " + what, rank());
    return false;
  }

  static std::string piece_name(const PiecePlan& plan, std::size_t i) {
    if (plan.pieces.size() == 1) return "";
    const StagedPiece& p = plan.pieces[i];
    return "piece " + std::to_string(i + 1) + " of " + std::to_string(plan.pieces.size()) +
           " (elements [" + std::to_string(p.first) + ", " + std::to_string(p.first + p.count) +
           ") of each rank's data)";
  }

  void enqueue_copy(const PieceCopy& c, bool to_pinned, cudaStream_t stream, const Job& job,
                    const PiecePlan& plan, std::size_t piece) {
    std::byte* pinned = pinned_.data() + c.pinned_offset;
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
      const std::string where = piece_name(plan, piece);
      cuda::check(rc,
                  std::string(job.name) + ": staging copy of " + std::to_string(c.rows) + " x " +
                      std::to_string(c.row_bytes) +
                      (to_pinned ? " bytes device->pinned" : " bytes pinned->device") +
                      (where.empty() ? "" : ", " + where),
                  rank());
    }
  }

  // A piece's failure as the operation's: the same code, peer and sequence, the piece named.
  [[noreturn]] void rethrow_piece(const std::exception_ptr& error, const Job& job,
                                  const PiecePlan& plan, std::size_t i) {
    if (plan.pieces.size() == 1) std::rethrow_exception(error);
    try {
      std::rethrow_exception(error);
    } catch (const Error& e) {
      throw Error(e.code(), piece_name(plan, i) + ": " + e.cause(),
                  e.rank() != Error::kNone ? e.rank() : rank(), e.peer(), job.name, e.seq());
    }
  }

  // After a failure: lets every issued piece finish (the engine completes each, at the latest
  // at its deadline) and every copy drain, so that nothing still uses the pinned buffer when
  // the next operation reuses it.
  void drain(std::vector<Work>& works) {
    for (const Work& w : works) {
      try {
        (void)w.wait();
      } catch (...) {  // NOLINT(bugprone-empty-catch): the first error is already reported
      }
    }
    if (in_stream_ != nullptr) (void)cudaStreamSynchronize(in_stream_);
    if (out_stream_ != nullptr) (void)cudaStreamSynchronize(out_stream_);
    (void)cudaGetLastError();
  }

  // One staged operation, as pieces (staging_pieces.h) in a pipeline over two streams:
  // - every piece's copy-in is enqueued at once on in_stream_, an event after each;
  // - piece i is handed to the wrapped communicator as soon as its copy-in event completes
  //   (pieces in order, so every rank issues the same sequence);
  // - when piece i's host collective completes, its copy-out is enqueued on out_stream_, an
  //   event after it; the operation is done when the last copy-out's event completes.
  // So copy-in of later pieces, host collectives and copy-out of earlier pieces overlap. The
  // staging thread polls events with short sleeps, or blocks in Work::wait for a bounded time
  // once everything is issued. `issued_all` is set when the last piece is issued.
  void execute(Job& job, bool& issued_all) {
    use_device(job);
    wait_ready(job);
    const PiecePlan plan = plan_pieces(job.kind, job.in, job.out, job.count, job.elem, rank(),
                                       size(), job.split, pieces_);
    const std::size_t n = plan.pieces.size();
    if (plan.pinned_bytes > 0) pinned_.reserve(plan.pinned_bytes);
    // Without a device (host buffers on a stream) nothing is copied and no event is needed.
    const bool copies = job.device >= 0;
    const auto in_event = [&](std::size_t i) { return event(2 * i, job); };
    const auto out_event = [&](std::size_t i) { return event(2 * i + 1, job); };
    std::vector<Work> works;
    works.reserve(n);
    try {
      if (copies) {
        for (std::size_t i = 0; i < n; ++i) {
          for (const auto& c : plan.pieces[i].copy_in) {
            enqueue_copy(c, true, in_stream_, job, plan, i);
          }
          cuda::check(cudaEventRecord(in_event(i), in_stream_),
                      std::string(job.name) + ": cudaEventRecord after a copy-in", rank());
        }
      }
      std::size_t out_queued = 0;  // pieces whose copy-out is enqueued
      for (;;) {
        bool moved = false;
        while (works.size() < n &&
               (!copies || done(in_event(works.size()), job, "staging copy device->pinned"))) {
          const StagedPiece& p = plan.pieces[works.size()];
          const void* in = p.in_offset == StagingPlan::kUnstaged
                               ? job.in.ptr
                               : pinned_.data() + p.in_offset;
          void* out = p.out_offset == StagingPlan::kUnstaged
                          ? const_cast<void*>(job.out.ptr)
                          : pinned_.data() + p.out_offset;
          std::lock_guard<std::mutex> lock(mu_);
          works.push_back(job.issue(*inner_, in, out, p.count));
          if (works.size() == n) {
            issued_all = true;
            --queued_;
          }
          moved = true;
        }
        while (out_queued < works.size() && works[out_queued].test()) {
          if (auto e = works[out_queued].error()) rethrow_piece(e, job, plan, out_queued);
          if (copies) {
            for (const auto& c : plan.pieces[out_queued].copy_out) {
              enqueue_copy(c, false, out_stream_, job, plan, out_queued);
            }
            cuda::check(cudaEventRecord(out_event(out_queued), out_stream_),
                        std::string(job.name) + ": cudaEventRecord after a copy-out", rank());
          }
          ++out_queued;
          moved = true;
        }
        if (out_queued == n &&
            (!copies || done(out_event(n - 1), job, "staging copy pinned->device"))) {
          return;
        }
        if (moved) continue;
        if (works.size() < n && (aborted_.load(std::memory_order_acquire) || stopping_)) {
          throw Error(ErrorCode::kAborted, "aborted while staging", rank(), Error::kNone,
                      job.name);
        }
        if (works.size() == n && out_queued < n) {
          // Only the network is left to wait for: block on it (woken when it completes).
          try {
            (void)works[out_queued].wait(std::chrono::milliseconds(1));
          } catch (...) {  // NOLINT(bugprone-empty-catch): reported through error() above
          }
        } else {
          std::this_thread::sleep_for(std::chrono::microseconds(20));
        }
      }
    } catch (...) {
      const std::exception_ptr error = std::current_exception();
      if (!issued_all && !works.empty()) tell_peers(job, error);
      drain(works);
      throw;
    }
  }

  std::unique_ptr<Communicator> inner_;
  const PieceOptions pieces_;
  const bool have_device_;
  std::atomic<bool> aborted_{false};
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Job> jobs_;
  std::size_t queued_ = 0;  // jobs not yet handed to inner_
  std::atomic<bool> stopping_{false};
  std::uint64_t last_ticket_ = 0;
  std::unique_ptr<cuda::HostSignal> signal_;
  // Staging thread only:
  int device_ = -1;
  cudaStream_t in_stream_ = nullptr;   // device -> pinned copies
  cudaStream_t out_stream_ = nullptr;  // pinned -> device copies
  std::size_t max_pitch_ = 0;          // cudaMemcpy2D's limit; larger strides copy row by row
  std::vector<cudaEvent_t> events_;    // two per piece: after its copy-in, after its copy-out
  cuda::PinnedBuffer pinned_;
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
