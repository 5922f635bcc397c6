// Work handles for operations that another library carries out (MPI, NCCL): the part the
// scheduler's MPI and NCCL communicators share.
//
// Contract
// - submit() starts an operation under the library lock (start() makes the library call and
//   fills the Op) and returns its Work at once; a start() that throws dear::Error fails that
//   Work and nothing else.
// - One progress thread tests the outstanding operations in submission order, under the
//   library lock (libraries such as MPI progress only inside their own calls and allow one
//   calling thread at a time), calls finish() on each completed one and completes its Work
//   outside the lock. It sleeps while nothing is outstanding and polls every kPollInterval
//   otherwise.
// - Failure is final, as in dear's engine: an Op whose test() throws, an operation past its
//   deadline (then on_timeout() runs first, e.g. to abort the library's communicator), or
//   fail() fails every outstanding and every later operation with that error.
// - The destructor waits for the outstanding operations (bounded by their deadlines).
#pragma once

#include <chrono>
#include <condition_variable>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "dear/communicator.h"
#include "dear/error.h"

namespace dear::scheduler {

class ExternalOps {
 public:
  using Clock = std::chrono::steady_clock;
  static constexpr std::chrono::microseconds kPollInterval{50};

  struct Op {
    virtual ~Op() = default;
    // True once the library has completed it; throws dear::Error when it failed.
    virtual bool test() = 0;
    // Local work after completion (copies, scaling), under the library lock.
    virtual void finish() {}
    std::string what;  // "all_reduce count=... dtype=..." for errors
    Clock::time_point deadline = Clock::time_point::max();
    std::shared_ptr<Work::State> state;
    int source = -1;  // a receive's sender, set by test() or finish() (Work::source)
  };

  // `on_timeout` runs under the library lock before an expired operation fails everything.
  ExternalOps(int rank, std::function<void()> on_timeout = {});
  ~ExternalOps();
  ExternalOps(const ExternalOps&) = delete;
  ExternalOps& operator=(const ExternalOps&) = delete;

  Work submit(std::unique_ptr<Op> op, const std::function<void(Op&)>& start);
  void fail(const Error& e);
  [[nodiscard]] bool failed() const;
  // The lock every call into the library takes (the progress thread holds it while testing).
  [[nodiscard]] std::mutex& library_lock() { return mu_; }

 private:
  void fail_locked(const Error& e, std::deque<std::unique_ptr<Op>>& done);
  void progress_loop();

  int rank_;
  std::function<void()> on_timeout_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::unique_ptr<Op>> pending_;
  std::uint64_t next_seq_ = 0;
  std::exception_ptr failed_;
  bool stop_ = false;
  std::thread progress_;
};

// Deadline of an operation: its OpOptions timeout, else the communicator's.
[[nodiscard]] ExternalOps::Clock::time_point deadline_of(const OpOptions& opts,
                                                         const CommOptions& comm);

}  // namespace dear::scheduler
