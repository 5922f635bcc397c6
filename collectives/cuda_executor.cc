// The CUDA executor: an operation's steps as kernels and copies on one stream of the
// communicator's, completion seen through events the engine polls (executor.h).
//
// - One non-blocking stream per communicator's engine, on the device of its first device
//   operation; steps are issued in the order the engine makes them and complete in that order.
// - reduce / reduce_final: the kernels of cuda/reduce.h, reading a landing slot (mapped pinned
//   memory, addressed by the device as it is by the host) and device memory. Copies:
//   cudaMemcpyAsync, device to pinned (packing a send) or pinned to device (a received slice).
// - Completion: an event recorded after each step; poll() queries them oldest first and stops
//   at the first not yet done (cudaEventQuery, which never waits). A step that failed on the
//   device fails the poll with the CUDA error named.
// - Scratch in device memory comes from the stream-ordered allocator (cudaMallocAsync): freed on
//   the stream after the steps that use it, with no device-wide synchronisation.
// - The engine calls it from whichever thread runs a turn; every call makes the executor's
//   device current for its duration and restores the caller's.
#include "collectives/executor.h"

#ifdef DEAR_HAVE_CUDA

#include <cuda_runtime_api.h>

#include <deque>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "collectives/device_fence.h"
#include "cuda/device.h"
#include "cuda/dmabuf.h"
#include "cuda/error.h"
#include "cuda/memory.h"
#include "cuda/reduce.h"
#include "cuda/stream.h"

namespace dear::collectives {
namespace {

using DeviceGuard = cuda::CurrentDevice;

class CudaExecutor final : public Executor {
 public:
  CudaExecutor(int device, int rank) : device_(device), rank_(rank) {
    const DeviceGuard g(device_, rank_);
    cuda::check(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking),
                "creating the device executor's stream", rank_);
    // GPUDirect RDMA writes need the flush below only where the device does not order them
    // for its own consumers; it is offered on some devices only (the verbs link also reads
    // its device windows back before it reports a message).
    int ordering = 0;
    int options = 0;
    if (cudaDeviceGetAttribute(&ordering, cudaDevAttrGPUDirectRDMAWritesOrdering, device_) ==
            cudaSuccess &&
        cudaDeviceGetAttribute(&options, cudaDevAttrGPUDirectRDMAFlushWritesOptions, device_) ==
            cudaSuccess) {
      flush_remote_writes_ = ordering < cudaGPUDirectRDMAWritesOrderingOwner &&
                             (options & cudaFlushGPUDirectRDMAWritesOptionHost) != 0;
    }
    (void)cudaGetLastError();
  }
  ~CudaExecutor() override {
    drain();
    int previous = device_;
    (void)cudaGetDevice(&previous);
    (void)cudaSetDevice(device_);
    for (cudaEvent_t e : spare_) (void)cudaEventDestroy(e);
    (void)cudaStreamDestroy(stream_);
    (void)cudaSetDevice(previous);
  }
  CudaExecutor(const CudaExecutor&) = delete;
  CudaExecutor& operator=(const CudaExecutor&) = delete;

  const char* name() const noexcept override { return "cuda"; }
  bool immediate() const noexcept override { return false; }

  void issue(const ExecStep& s, std::uint64_t token) override {
    const DeviceGuard g(device_, rank_);
    switch (s.kind) {
      case ExecStep::kReduce: cuda::reduce(s.dst, s.a, s.b, s.n, s.dtype, s.op, stream_); break;
      case ExecStep::kReduceFinal:
        cuda::reduce_final(s.dst, s.a, s.b, s.n, s.dtype, s.op, s.nranks, stream_);
        break;
      case ExecStep::kCopy:
        if (s.n > 0 && s.dst != s.a) {
          cuda::check(cudaMemcpyAsync(s.dst, s.a, s.n, cudaMemcpyDefault, stream_),
                      "device executor: copying " + std::to_string(s.n) + " bytes", rank_);
        }
        break;
    }
    cudaEvent_t e = take_event();
    cuda::check(cudaEventRecord(e, stream_), "device executor: cudaEventRecord", rank_);
    pending_.push_back({e, token});
  }

  void poll(std::vector<std::uint64_t>& done) override {
    while (!pending_.empty()) {
      const cudaError_t rc = cudaEventQuery(pending_.front().event);
      if (rc == cudaErrorNotReady) {
        (void)cudaGetLastError();
        return;
      }
      cuda::check(rc, "device executor: a step failed on the device", rank_);
      spare_.push_back(pending_.front().event);
      done.push_back(pending_.front().token);
      pending_.pop_front();
    }
  }

  std::size_t in_flight() const noexcept override { return pending_.size(); }

  void drain() noexcept override {
    if (pending_.empty()) return;
    int previous = device_;
    (void)cudaGetDevice(&previous);
    (void)cudaSetDevice(device_);
    (void)cudaStreamSynchronize(stream_);
    (void)cudaGetLastError();
    for (const auto& p : pending_) spare_.push_back(p.event);
    pending_.clear();
    (void)cudaSetDevice(previous);
  }

  void set_waker(std::function<void()>) override {}
  std::chrono::microseconds poll_interval() const noexcept override {
    return std::chrono::microseconds(20);
  }

  char* allocate(ExecMemory where, std::size_t bytes) override {
    const DeviceGuard g(device_, rank_);
    if (where == ExecMemory::kLanding) {
      const cuda::MappedMemory m = cuda::alloc_mapped(bytes, "a landing slot", rank_);
      if (m.host != m.device) {
        (void)cudaFreeHost(m.host);
        throw Error(ErrorCode::kSystem,
                    "pinned memory has a device address other than its host address (no "
                    "unified addressing); device-resident collectives need it: set "
                    "DEAR_CUDA_STAGING=1",
                    rank_);
      }
      return static_cast<char*>(m.host);
    }
    void* p = nullptr;
    if (where == ExecMemory::kLinked) {
      // Its own allocation, which the driver can export as a dma-buf (pool memory may not be).
      cuda::check(cudaMalloc(&p, std::max<std::size_t>(bytes, 1)),
                  "device executor: cudaMalloc of " + std::to_string(bytes) +
                      " bytes for the links to write into and from",
                  rank_);
      return static_cast<char*>(p);
    }
    cuda::check(
        cudaMallocAsync(&p, std::max<std::size_t>(bytes, 1), stream_),
        "device executor: cudaMallocAsync of " + std::to_string(bytes) + " bytes of scratch",
        rank_);
    return static_cast<char*>(p);
  }

  void remote_writes_landed() override {
    if (!flush_remote_writes_) return;
    const DeviceGuard g(device_, rank_);
    cuda::check(cudaDeviceFlushGPUDirectRDMAWrites(cudaFlushGPUDirectRDMAWritesTargetCurrentDevice,
                                                   cudaFlushGPUDirectRDMAWritesToOwner),
                "device executor: cudaDeviceFlushGPUDirectRDMAWrites", rank_);
  }

  transport::DeviceMemory link_memory(const char* p, std::size_t bytes) override {
    const cuda::DmaBuf d = cuda::export_dmabuf(p, bytes);
    transport::DeviceMemory m;
    m.dmabuf_fd = d.fd;  // -1: the link tries its peer-memory path
    m.offset = d.offset;
    m.cuda_device = device_;
    return m;
  }

  void release(ExecMemory where, char* p) noexcept override {
    if (p == nullptr) return;
    int previous = device_;
    (void)cudaGetDevice(&previous);
    (void)cudaSetDevice(device_);
    if (where == ExecMemory::kLanding) {
      // Only a slot whose steps are done is released (the engine's rule), and the memory is
      // waited for by cudaFreeHost itself.
      (void)cudaFreeHost(p);
    } else if (where == ExecMemory::kLinked) {
      // Only at the engine's end (it keeps such memory): nothing of its is in flight then.
      (void)cudaFree(p);
    } else {
      (void)cudaFreeAsync(p, stream_);
    }
    (void)cudaGetLastError();
    (void)cudaSetDevice(previous);
  }

 private:
  struct Pending {
    cudaEvent_t event;
    std::uint64_t token;
  };

  cudaEvent_t take_event() {
    if (!spare_.empty()) {
      cudaEvent_t e = spare_.back();
      spare_.pop_back();
      return e;
    }
    cudaEvent_t e = nullptr;
    cuda::check(cudaEventCreateWithFlags(&e, cudaEventDisableTiming),
                "device executor: cudaEventCreate", rank_);
    return e;
  }

  int device_;
  int rank_;
  cudaStream_t stream_ = nullptr;
  bool flush_remote_writes_ = false;  // remote_writes_landed() flushes
  std::deque<Pending> pending_;
  std::vector<cudaEvent_t> spare_;
};

}  // namespace

class DeviceTickets {
 public:
  std::uint64_t next() {
    std::lock_guard<std::mutex> lock(mu_);
    return ++issued_;
  }
  void enqueue_wait(cudaStream_t stream, std::uint64_t ticket) {
    signal_.enqueue_wait(stream, ticket);
  }
  void end(std::uint64_t ticket) noexcept {
    std::lock_guard<std::mutex> lock(mu_);
    ended_.insert(ticket);
    std::uint64_t top = published_;
    while (!ended_.empty() && *ended_.begin() == top + 1) {
      ended_.erase(ended_.begin());
      ++top;
    }
    if (top != published_) {
      published_ = top;
      signal_.publish(top);
    }
  }

 private:
  cuda::HostSignal signal_;
  std::mutex mu_;
  std::uint64_t issued_ = 0;
  std::uint64_t published_ = 0;
  std::set<std::uint64_t> ended_;
};

namespace {

class DeviceFence final : public OpFence {
 public:
  DeviceFence(std::shared_ptr<DeviceTickets> tickets, cudaEvent_t input, std::uint64_t ticket,
              int device, int rank)
      : tickets_(std::move(tickets)),
        input_(input),
        ticket_(ticket),
        device_(device),
        rank_(rank) {}
  ~DeviceFence() override {
    done();
    (void)cudaEventDestroy(input_);
  }
  DeviceFence(const DeviceFence&) = delete;
  DeviceFence& operator=(const DeviceFence&) = delete;

  bool input_ready() override {
    const cudaError_t rc = cudaEventQuery(input_);
    if (rc == cudaErrorNotReady) {
      (void)cudaGetLastError();
      return false;
    }
    cuda::check(rc, "the work queued before a device operation on its stream failed", rank_);
    return true;
  }
  int device() const noexcept override { return device_; }
  void done() noexcept override {
    if (ended_) return;
    ended_ = true;
    tickets_->end(ticket_);
  }

 private:
  std::shared_ptr<DeviceTickets> tickets_;
  cudaEvent_t input_;
  std::uint64_t ticket_;
  int device_;
  int rank_;
  bool ended_ = false;
};

}  // namespace

std::shared_ptr<DeviceTickets> make_device_tickets(int) {
  return std::make_shared<DeviceTickets>();
}

std::unique_ptr<OpFence> make_device_fence(const std::shared_ptr<DeviceTickets>& tickets,
                                           void* cuda_stream, int device, int rank) {
  const auto stream = static_cast<cudaStream_t>(cuda_stream);
  cudaEvent_t input = nullptr;
  cuda::check(cudaEventCreateWithFlags(&input, cudaEventDisableTiming),
              "creating a device operation's input event", rank);
  const cudaError_t rc = cudaEventRecord(input, stream != nullptr ? stream : cudaStreamLegacy);
  if (rc != cudaSuccess) {
    (void)cudaEventDestroy(input);
    cuda::check(rc, "recording a device operation's input event", rank);
  }
  const std::uint64_t ticket = tickets->next();
  auto fence = std::make_unique<DeviceFence>(tickets, input, ticket, device, rank);
  if (stream != nullptr) tickets->enqueue_wait(stream, ticket);
  return fence;
}

std::function<std::unique_ptr<Executor>(int)> device_executor_factory(int rank) {
  return [rank](int device) -> std::unique_ptr<Executor> {
    return std::make_unique<CudaExecutor>(device, rank);
  };
}

}  // namespace dear::collectives

#endif  // DEAR_HAVE_CUDA
