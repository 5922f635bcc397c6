#include "collectives/executor.h"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <random>
#include <thread>

#include "collectives/reduce.h"
#include "dear/error.h"

namespace dear::collectives {

void run_on_host(const ExecStep& s) {
  switch (s.kind) {
    case ExecStep::kReduce: reduce(s.dst, s.a, s.b, s.n, s.dtype, s.op); break;
    case ExecStep::kReduceFinal: reduce_final(s.dst, s.a, s.b, s.n, s.dtype, s.op, s.nranks); break;
    case ExecStep::kCopy:
      if (s.n > 0 && s.dst != s.a) std::memmove(s.dst, s.a, s.n);
      break;
  }
}

namespace {

std::size_t step_bytes(const ExecStep& s) {
  return s.kind == ExecStep::kCopy ? s.n : s.n * dtype_size(s.dtype);
}

bool overlaps(const char* x, std::size_t xn, const char* y, std::size_t yn) {
  return x != nullptr && y != nullptr && xn > 0 && yn > 0 && x < y + yn && y < x + xn;
}

char* allocate_host(std::size_t bytes) {
  // 64-byte alignment, as the CPU kernels' vector loads like it.
  return static_cast<char*>(
      ::operator new[](std::max<std::size_t>(bytes, 1), std::align_val_t{64}));
}

void release_host(char* p) noexcept { ::operator delete[](p, std::align_val_t{64}); }

class HostExecutor final : public Executor {
 public:
  const char* name() const noexcept override { return "host"; }
  bool immediate() const noexcept override { return true; }
  void issue(const ExecStep& step, std::uint64_t) override { run_on_host(step); }
  void poll(std::vector<std::uint64_t>&) override {}
  std::size_t in_flight() const noexcept override { return 0; }
  void drain() noexcept override {}
  void set_waker(std::function<void()>) override {}
  char* allocate(ExecMemory, std::size_t bytes) override { return allocate_host(bytes); }
  void release(ExecMemory, char* p) noexcept override { release_host(p); }
};

class DeferredExecutor final : public Executor {
 public:
  explicit DeferredExecutor(std::uint64_t seed) : rng_(seed) {
    worker_ = std::thread([this] { run(); });
  }
  ~DeferredExecutor() override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    worker_.join();
  }

  const char* name() const noexcept override { return "deferred"; }
  bool immediate() const noexcept override { return false; }

  void issue(const ExecStep& step, std::uint64_t token) override {
    // Until it is done, the destination holds a pattern no correct result has everywhere; a
    // destination that is also an operand is left alone (the step reads it).
    const std::size_t bytes = step_bytes(step);
    const std::size_t operand = bytes;  // operands span as many bytes as the destination
    if (bytes > 0 && !overlaps(step.dst, bytes, step.a, operand) &&
        !overlaps(step.dst, bytes, step.b, operand)) {
      std::memset(step.dst, 0xa5, bytes);
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      pending_.push_back({step, token});
      in_flight_.fetch_add(1, std::memory_order_relaxed);
    }
    cv_.notify_one();
  }

  void poll(std::vector<std::uint64_t>& done) override {
    if (completed_count_.load(std::memory_order_acquire) == 0) return;
    std::lock_guard<std::mutex> lock(mu_);
    done.insert(done.end(), completed_.begin(), completed_.end());
    in_flight_.fetch_sub(completed_.size(), std::memory_order_relaxed);
    completed_.clear();
    completed_count_.store(0, std::memory_order_release);
  }

  std::size_t in_flight() const noexcept override {
    return in_flight_.load(std::memory_order_relaxed);
  }

  void drain() noexcept override {
    std::unique_lock<std::mutex> lock(mu_);
    idle_cv_.wait(lock, [&] { return pending_.empty() && !running_; });
    in_flight_.fetch_sub(completed_.size(), std::memory_order_relaxed);
    completed_.clear();
    completed_count_.store(0, std::memory_order_release);
  }

  void set_waker(std::function<void()> wake) override {
    std::lock_guard<std::mutex> lock(mu_);
    wake_ = std::move(wake);
  }

  char* allocate(ExecMemory, std::size_t bytes) override { return allocate_host(bytes); }
  void release(ExecMemory, char* p) noexcept override { release_host(p); }

 private:
  struct Pending {
    ExecStep step;
    std::uint64_t token;
  };

  void run() {
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      cv_.wait(lock, [&] { return stop_ || !pending_.empty(); });
      if (stop_ && pending_.empty()) return;
      // Let a few more steps be issued, so that the pick below has a choice to shuffle.
      lock.unlock();
      std::this_thread::sleep_for(std::chrono::microseconds(rng_() % 50));
      lock.lock();
      if (pending_.empty()) continue;
      const std::size_t i = rng_() % pending_.size();
      const Pending p = pending_[i];
      pending_[i] = pending_.back();
      pending_.pop_back();
      running_ = true;
      lock.unlock();
      run_on_host(p.step);
      lock.lock();
      running_ = false;
      completed_.push_back(p.token);
      completed_count_.store(completed_.size(), std::memory_order_release);
      if (wake_) wake_();
      idle_cv_.notify_all();
    }
  }

  std::mt19937_64 rng_;  // worker thread only
  std::mutex mu_;
  std::condition_variable cv_;
  std::condition_variable idle_cv_;
  std::vector<Pending> pending_;
  std::vector<std::uint64_t> completed_;
  std::atomic<std::size_t> completed_count_{0};
  std::atomic<std::size_t> in_flight_{0};
  std::function<void()> wake_;
  bool running_ = false;
  bool stop_ = false;
  std::thread worker_;
};

}  // namespace

std::unique_ptr<Executor> make_host_executor() { return std::make_unique<HostExecutor>(); }

std::unique_ptr<Executor> make_deferred_executor(std::uint64_t seed) {
  return std::make_unique<DeferredExecutor>(seed);
}

void check_executor_name(const std::string& name, int rank) {
  if (name.empty() || name == "host" || name == "deferred" || name == "deferred_bounce") return;
  throw Error(ErrorCode::kInvalidArgument,
              "CommOptions::executor='" + name +
                  "' is not one of host, deferred, deferred_bounce (DEAR_EXECUTOR)",
              rank);
}

ExecutorChoice make_executor(const std::string& name, std::uint64_t seed, int rank) {
  check_executor_name(name, rank);
  if (name == "deferred") return {make_deferred_executor(seed), false};
  if (name == "deferred_bounce") return {make_deferred_executor(seed), true};
  return {make_host_executor(), false};
}

#ifndef DEAR_HAVE_CUDA
std::function<std::unique_ptr<Executor>(int)> device_executor_factory(int) { return {}; }
#endif

}  // namespace dear::collectives
