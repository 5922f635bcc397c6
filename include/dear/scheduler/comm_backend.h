// The policies' Backend on a real dear::Communicator: reduce-scatter, all-gather and
// all-reduce of fp32 buffers, in place, averaged (ReduceOp::kAvg), with the request's priority.
//
// Contract
// - One thread (the compute thread) calls issue(), wait(), set_priority() and drain(); the
//   same sequence of calls on every rank.
// - Operations reach the communicator in issue order, which therefore is the same on every
//   rank, as the communicator requires. An operation with `after` is handed over only once
//   that operation has completed (a reduce-scatter's shard is what its all-gather sends), and
//   every operation issued after it waits behind it: a small internal thread hands the queue
//   over so that the compute thread never blocks in issue().
// - The buffer of a request is resolver(request): `elements` floats, valid and untouched by
//   the caller until the operation has been consumed. Reduce-scatter and all-gather need
//   `elements` to be a multiple of the rank count (fusion groups are padded so).
// - The first wait() that sees an operation complete calls consumer(request) on the waiting
//   thread, exactly once per operation: that is where the trainer applies the averaged
//   gradients, i.e. exactly where the policy waits for them (with carries_parameters: where it
//   updates its shard after a reduce-scatter, and takes the parameters an all-gather brought).
//   An operation issued after that wait finds the consumer's writes in its buffer.
// - set_priority() changes the priority of an operation still in the queue, and of one the
//   communicator already holds through Communicator::set_priority (dear's engine reorders its
//   remaining slices). Changes a communicator cannot make (MPI, NCCL) are counted
//   (late_priority_changes()) and otherwise ignored.
// - A failed operation makes wait() and drain() throw its dear::Error; the back-end is then
//   unusable. The destructor waits for the operations already handed to the communicator.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include "dear/communicator.h"
#include "dear/scheduler/policy.h"

namespace dear::scheduler {

class CommBackend final : public Backend {
 public:
  using Resolver = std::function<float*(const CommRequest&)>;
  using Consumer = std::function<void(const CommRequest&)>;
  using Clock = std::chrono::steady_clock;

  // What happened to one operation, in seconds since `epoch` (for traces and ordering checks).
  struct Record {
    CommRequest request;
    int iteration = 0;    // set_iteration() at issue, minus one for previous_iteration
    int priority = 0;     // as handed to the communicator
    double issue_s = -1;  // the policy issued it
    double start_s = -1;  // handed to the communicator
    double end_s = -1;    // first seen complete (by a wait, or by the hand-over thread)
    bool consumed = false;
  };

  CommBackend(Communicator& comm, Resolver resolver, Consumer consumer,
              Clock::time_point epoch = Clock::now(), Algorithm algorithm = Algorithm::kAuto);
  ~CommBackend() override;
  CommBackend(const CommBackend&) = delete;
  CommBackend& operator=(const CommBackend&) = delete;

  [[nodiscard]] OpId issue(const CommRequest& request) override;
  void wait(OpId op) override;
  void set_priority(OpId op, int priority) override;

  // Waits for every operation issued so far (without consuming them).
  void drain();
  // Iteration that issue() files new operations under.
  void set_iteration(int iteration) { iteration_ = iteration; }

  // Waits that found their operation still running, so far (the compute thread blocked).
  [[nodiscard]] std::int64_t blocked_waits() const { return blocked_waits_; }
  [[nodiscard]] int late_priority_changes() const;
  // A copy, taken under the lock.
  [[nodiscard]] std::vector<Record> records() const;

 private:
  struct Op {
    Record record;
    Work work;
    bool launched = false;
  };

  [[nodiscard]] double now_s() const;
  void launch_locked(OpId id);
  void handover_loop();
  [[nodiscard]] Work launched_work(std::unique_lock<std::mutex>& lock, OpId id);

  Communicator& comm_;
  Resolver resolver_;
  Consumer consumer_;
  Clock::time_point epoch_;
  Algorithm algorithm_;
  int iteration_ = 0;
  std::int64_t blocked_waits_ = 0;

  mutable std::mutex mu_;
  std::condition_variable queued_;    // the hand-over thread: something to do
  std::condition_variable launched_;  // wait(): an operation reached the communicator
  std::deque<Op> ops_;                // by OpId; a deque keeps references stable
  std::deque<OpId> queue_;            // issued, not yet handed over, in issue order
  int late_priority_changes_ = 0;
  std::exception_ptr error_;
  bool stop_ = false;
  std::thread handover_;
};

}  // namespace dear::scheduler
