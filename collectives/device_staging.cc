#include "collectives/device_staging.h"

#ifdef DEAR_HAVE_CUDA

#include <cuda_runtime_api.h>

#include <atomic>
#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <utility>

#include "collectives/engine.h"  // Work::State
#include "collectives/staging_plan.h"
#include "cuda/device.h"
#include "cuda/error.h"
#include "cuda/memory.h"
#include "cuda/stream.h"

namespace dear::collectives {
namespace {

// The wrapped communicator's call, given the pointers it should use.
using Issue = std::function<Work(Communicator&, const void* in, void* out)>;

struct Job {
  const char* name = "";
  Issue issue;
  StagingSpan in;
  StagingSpan out;
  std::size_t elem = 1;
  int device = -1;                // of the staged buffers; -1 when none is staged
  cudaEvent_t ready = nullptr;    // recorded on the caller's stream; null without one
  std::uint64_t ticket = 0;       // published to release the caller's stream; 0: none
  std::chrono::milliseconds timeout{0};
  std::shared_ptr<Work::State> state;
};

class DeviceCommunicator final : public Communicator {
 public:
  explicit DeviceCommunicator(std::unique_ptr<Communicator> inner)
      : inner_(std::move(inner)), have_device_(cuda::device_count() > 0) {}

  ~DeviceCommunicator() override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stopping_ = true;
    }
    cv_.notify_all();
    if (worker_.joinable()) worker_.join();
    if (stream_ != nullptr) (void)cudaStreamDestroy(stream_);
  }

  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  const CommOptions& options() const override { return inner_->options(); }

  Work all_reduce(const void* in, void* out, std::size_t count, DataType dtype, ReduceOp op,
                  const OpOptions& opts) override {
    const std::size_t b = count * dtype_size(dtype);
    return route("all_reduce", in, b, out, b, dtype, opts,
                 [=](Communicator& c, const void* i, void* o, const OpOptions& x) {
                   return c.all_reduce(i, o, count, dtype, op, x);
                 });
  }

  Work reduce_scatter(const void* in, void* out, std::size_t recv_count, DataType dtype,
                      ReduceOp op, const OpOptions& opts) override {
    const std::size_t b = recv_count * dtype_size(dtype);
    return route("reduce_scatter", in, b * static_cast<std::size_t>(size()), out, b, dtype, opts,
                 [=](Communicator& c, const void* i, void* o, const OpOptions& x) {
                   return c.reduce_scatter(i, o, recv_count, dtype, op, x);
                 });
  }

  Work all_gather(const void* in, void* out, std::size_t send_count, DataType dtype,
                  const OpOptions& opts) override {
    const std::size_t b = send_count * dtype_size(dtype);
    return route("all_gather", in, b, out, b * static_cast<std::size_t>(size()), dtype, opts,
                 [=](Communicator& c, const void* i, void* o, const OpOptions& x) {
                   return c.all_gather(i, o, send_count, dtype, x);
                 });
  }

  Work broadcast(const void* in, void* out, std::size_t count, DataType dtype, int root,
                 const OpOptions& opts) override {
    const std::size_t b = count * dtype_size(dtype);
    // Only the root reads `in`; elsewhere it may be anything and is passed on untouched.
    return route("broadcast", in, rank() == root ? b : 0, out, b, dtype, opts,
                 [=](Communicator& c, const void* i, void* o, const OpOptions& x) {
                   return c.broadcast(i, o, count, dtype, root, x);
                 });
  }

  Work barrier(const OpOptions& opts) override {
    return route("barrier", nullptr, 0, nullptr, 0, DataType::kUint8, opts,
                 [](Communicator& c, const void*, void*, const OpOptions& x) {
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
  bool set_priority(const Work& work, int priority) override {
    return inner_->set_priority(work, priority);
  }

 private:
  using Call = std::function<Work(Communicator&, const void*, void*, const OpOptions&)>;

  Work route(const char* name, const void* in, std::size_t in_bytes, void* out,
             std::size_t out_bytes, DataType dtype, const OpOptions& opts, const Call& call) {
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
      return call(*inner_, in, out, inner_opts);
    }
    if (aborted_.load(std::memory_order_acquire)) {
      throw Error(ErrorCode::kAborted, "the communicator was aborted", rank(), Error::kNone,
                  name);
    }

    Job job;
    job.name = name;
    job.issue = [call, inner_opts](Communicator& c, const void* i, void* o) {
      return call(c, i, o, inner_opts);
    };
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
      if (error && !issued) {
        // The peers will run this operation; fail them too rather than let them time out.
        try {
          std::rethrow_exception(error);
        } catch (const std::exception& e) {
          inner_->abort(std::string(job.name) + " could not be staged on rank " +
                        std::to_string(rank()) + ": " + e.what());
        }
      }
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

  void copy(const std::vector<StagingCopy>& copies, bool to_pinned, const Job& job) {
    if (copies.empty()) return;
    for (const auto& c : copies) {
      std::byte* pinned = pinned_.data() + c.pinned_offset;
      auto* dev = reinterpret_cast<std::byte*>(c.device);
      const cudaError_t rc =
          to_pinned ? cudaMemcpyAsync(pinned, dev, c.bytes, cudaMemcpyDeviceToHost, stream_)
                    : cudaMemcpyAsync(dev, pinned, c.bytes, cudaMemcpyHostToDevice, stream_);
      cuda::check(rc, std::string(job.name) + ": cudaMemcpyAsync of " + std::to_string(c.bytes) +
                          (to_pinned ? " bytes device->pinned" : " bytes pinned->device"),
                  rank());
    }
    cuda::check(cudaStreamSynchronize(stream_),
                std::string(job.name) + ": staging copies " +
                    (to_pinned ? "device->pinned" : "pinned->device"),
                rank());
  }

  void execute(Job& job, bool& issued) {
    if (job.device >= 0) {
      if (device_ < 0) {
        cuda::check(cudaSetDevice(job.device), "cudaSetDevice for staging", rank());
        cuda::check(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking),
                    "creating the staging stream", rank());
        device_ = job.device;
      } else if (device_ != job.device) {
        throw Error(ErrorCode::kInvalidArgument,
                    "buffers on CUDA device " + std::to_string(job.device) +
                        ", but this communicator stages for device " + std::to_string(device_),
                    rank(), Error::kNone, job.name);
      }
    }
    wait_ready(job);
    const StagingPlan plan = plan_staging(job.in, job.out, job.elem);
    if (plan.pinned_bytes > 0) pinned_.reserve(plan.pinned_bytes);
    copy(plan.copy_in, true, job);
    const void* in = plan.in_offset == StagingPlan::kUnstaged
                         ? job.in.ptr
                         : pinned_.data() + plan.in_offset;
    void* out = plan.out_offset == StagingPlan::kUnstaged
                    ? const_cast<void*>(job.out.ptr)
                    : pinned_.data() + plan.out_offset;
    Work work;
    {
      std::lock_guard<std::mutex> lock(mu_);
      issued = true;
      --queued_;
      work = job.issue(*inner_, in, out);
    }
    work.wait();  // the engine enforces the operation's deadline
    copy(plan.copy_out, false, job);
  }

  std::unique_ptr<Communicator> inner_;
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
  cudaStream_t stream_ = nullptr;
  cuda::PinnedBuffer pinned_;
  std::thread worker_;  // last: joined before the rest is destroyed
};

}  // namespace

std::unique_ptr<Communicator> with_device_support(std::unique_ptr<Communicator> comm) {
  return std::make_unique<DeviceCommunicator>(std::move(comm));
}

bool is_device_pointer(const void* p) noexcept {
  return cuda::locate(p).kind == cuda::MemoryKind::kDevice;
}

}  // namespace dear::collectives

#else  // no CUDA in this build

namespace dear::collectives {

std::unique_ptr<Communicator> with_device_support(std::unique_ptr<Communicator> comm) {
  return comm;
}

bool is_device_pointer(const void*) noexcept { return false; }

}  // namespace dear::collectives

#endif
