// The executor seam: every step of an operation that touches payload goes through one of these.
//
// The engine decides what a step is and when it may run; an executor carries it out:
// - reduce a received slice into its accumulator (reduce, or reduce_final with kAvg's division),
// - copy a slice to its destination (from a landing slot, or a local copy such as the own
//   block of an all_gather),
// - pack a slice to send (copy it from the operation's memory into a send slot).
// Steps complete asynchronously: issue() returns at once, and poll() later hands back the
// token of each completed step. The engine only issues a step once every step it depends on
// has completed, so the steps in flight at any moment are independent of each other and an
// executor may complete them in any order. Until a step's token comes back the engine neither
// sends what it writes, nor reads it, nor reuses the slot it reads from.
//
// Contract:
// - Threading: issue(), poll(), allocate() and release() are called on the engine's thread
//   (one at a time); set_waker()'s function may be called from any thread.
// - Every issued step completes exactly once: its token comes back from poll(), or poll()
//   throws dear::Error (the step failed; the engine then fails the communicator), after
//   which drain() still waits for the rest.
// - drain() blocks until no step is in flight (used when the engine fails or shuts down, so
//   that no step writes into memory that is about to be handed back to the caller).
//
// Executors: host (the CPU kernels, done inside issue(): immediate()), deferred (testing: each
// step done later on a thread of its own, in a shuffled order, with its destination poisoned
// while it is pending), and cuda (kernels and copies on a stream of the communicator's,
// collectives/cuda_executor.cc). See docs/architecture.md, "Executors".
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "dear/types.h"
#include "transport/link.h"

namespace dear::collectives {

struct ExecStep {
  enum Kind : std::uint8_t { kReduce, kReduceFinal, kCopy };
  Kind kind = kCopy;
  char* dst = nullptr;
  const char* a = nullptr;  // kCopy: the source
  const char* b = nullptr;  // reductions: the second operand
  std::size_t n = 0;        // elements (reductions) or bytes (kCopy)
  DataType dtype = DataType::kUint8;
  ReduceOp op = ReduceOp::kSum;
  int nranks = 1;  // kReduceFinal: kAvg divides by it
};

// Where memory from allocate() lives.
enum class ExecMemory : std::uint8_t {
  kScratch,  // the executor's own memory space (device memory for cuda): an operation's scratch
  kLanding,  // memory both the links and the executor reach (pinned host memory for cuda)
  // The executor's memory space (device memory for cuda), for the links to register for
  // direct writes into it and from it (Channel::open_device_window, register_device_source):
  // cuda allocates it on its own (cudaMalloc), never from a stream-ordered pool, and
  // link_memory() describes it to them.
  kLinked,
};

class Executor {
 public:
  virtual ~Executor() = default;
  [[nodiscard]] virtual const char* name() const noexcept = 0;
  // True when a step is done before issue() returns and poll() never has anything: the engine
  // then reduces straight out of the transport's buffers and needs no landing slots.
  [[nodiscard]] virtual bool immediate() const noexcept = 0;
  virtual void issue(const ExecStep& step, std::uint64_t token) = 0;
  // Appends the tokens of the steps completed since the last call; never blocks.
  virtual void poll(std::vector<std::uint64_t>& done) = 0;
  [[nodiscard]] virtual std::size_t in_flight() const noexcept = 0;
  virtual void drain() noexcept = 0;
  // Called (from any thread) when a step completes, so that a sleeping engine wakes up. An
  // executor that cannot call it returns, from poll_interval(), how long the engine may sleep
  // at most while steps are in flight; zero for one that calls it.
  virtual void set_waker(std::function<void()> wake) = 0;
  [[nodiscard]] virtual std::chrono::microseconds poll_interval() const noexcept { return {}; }
  // Memory for steps (see ExecMemory); throws dear::Error when none can be had.
  [[nodiscard]] virtual char* allocate(ExecMemory where, std::size_t bytes) = 0;
  virtual void release(ExecMemory where, char* p) noexcept = 0;
  // A peer's adapter has written into kLinked memory, and the link reported those messages
  // complete: before a step reads them, make the writes visible to the executor. cuda:
  // cudaDeviceFlushGPUDirectRDMAWrites where the device does not order such writes for its own
  // consumers and offers the flush; nothing elsewhere.
  virtual void remote_writes_landed() {}
  // How a link may register [p, p + bytes) of kLinked memory (transport/link.h, DeviceMemory):
  // cuda exports the pages as a dma-buf where the driver can (the caller closes dmabuf_fd) and
  // names its device; others hand over host memory standing in for device memory.
  [[nodiscard]] virtual transport::DeviceMemory link_memory(const char* p, std::size_t bytes) {
    (void)p;
    (void)bytes;
    return {};
  }
};

// Runs one step with the CPU kernels, now (the host executor's work, also the deferred one's).
void run_on_host(const ExecStep& step);

// The host executor: the CPU kernels inside issue().
[[nodiscard]] std::unique_ptr<Executor> make_host_executor();

// The deferred executor, for testing the asynchronous path on a CPU: each step is done on a
// worker thread at least a moment after it was issued, in a random order among the steps in
// flight (seeded by `seed`), and until then its destination holds a poison pattern, so a step
// whose result is sent or read too early shows up as a wrong element.
[[nodiscard]] std::unique_ptr<Executor> make_deferred_executor(std::uint64_t seed);

// An executor by name, as CommOptions::executor / DEAR_EXECUTOR spell it: "host", "deferred"
// and "deferred_bounce" (both the deferred executor; with _bounce the links are also kept away
// from the operations' memory, as for device memory over TCP). Throws kInvalidArgument naming
// the value and what is accepted.
struct ExecutorChoice {
  std::unique_ptr<Executor> executor;
  bool bounce = false;  // host operations go through landing slots as device ones would
};
[[nodiscard]] ExecutorChoice make_executor(const std::string& name, std::uint64_t seed, int rank);
// make_executor()'s check of the name alone (it starts no thread).
void check_executor_name(const std::string& name, int rank);

// What makes the executor of a communicator's device operations (collectives/cuda_executor.cc):
// empty in a build without CUDA.
// It is called with the CUDA device of the first device operation.
[[nodiscard]] std::function<std::unique_ptr<Executor>(int device)> device_executor_factory(
    int rank);

}  // namespace dear::collectives
