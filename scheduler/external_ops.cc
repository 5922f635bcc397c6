#include "scheduler/external_ops.h"

#include <vector>

#include "collectives/engine.h"  // Work::State

namespace dear::scheduler {

ExternalOps::ExternalOps(int rank, std::function<void()> on_timeout)
    : rank_(rank), on_timeout_(std::move(on_timeout)) {
  progress_ = std::thread([this] { progress_loop(); });
}

ExternalOps::~ExternalOps() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (progress_.joinable()) progress_.join();
}

Work ExternalOps::submit(std::unique_ptr<Op> op, const std::function<void(Op&)>& start) {
  auto state = std::make_shared<Work::State>();
  op->state = state;
  std::exception_ptr failed;
  {
    std::lock_guard<std::mutex> lock(mu_);
    state->seq = next_seq_++;
    if (failed_) {
      failed = failed_;
    } else {
      try {
        start(*op);
        pending_.push_back(std::move(op));
      } catch (const Error&) {
        failed = std::current_exception();
      }
    }
  }
  if (failed) {
    state->complete(failed);
  } else {
    cv_.notify_one();
  }
  return Work(state);
}

void ExternalOps::fail(const Error& e) {
  std::deque<std::unique_ptr<Op>> done;
  std::exception_ptr err;
  {
    std::lock_guard<std::mutex> lock(mu_);
    fail_locked(e, done);
    err = failed_;
  }
  for (auto& op : done) op->state->complete(err);
}

bool ExternalOps::failed() const {
  std::lock_guard<std::mutex> lock(mu_);
  return failed_ != nullptr;
}

void ExternalOps::fail_locked(const Error& e, std::deque<std::unique_ptr<Op>>& done) {
  if (!failed_) failed_ = std::make_exception_ptr(e);
  for (auto& op : pending_) done.push_back(std::move(op));
  pending_.clear();
}

void ExternalOps::progress_loop() {
  std::vector<std::shared_ptr<Work::State>> succeeded;
  std::deque<std::unique_ptr<Op>> failed;
  for (;;) {
    std::exception_ptr error;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return stop_ || !pending_.empty(); });
      if (stop_ && pending_.empty()) return;
      // Libraries complete collectives in issue order on every rank; testing in that order
      // keeps each call's progress useful.
      for (auto it = pending_.begin(); it != pending_.end();) {
        bool done = false;
        try {
          done = (*it)->test();
          if (done) (*it)->finish();
        } catch (const Error& e) {
          fail_locked(e, failed);
          break;
        }
        if (!done) {
          ++it;
          continue;
        }
        (*it)->state->source = (*it)->source;
        succeeded.push_back((*it)->state);
        it = pending_.erase(it);
      }
      if (!pending_.empty() && Clock::now() >= pending_.front()->deadline) {
        const std::string what = pending_.front()->what;
        if (on_timeout_) on_timeout_();
        fail_locked(Error(ErrorCode::kTimeout,
                          what + " did not complete within its deadline; a rank is dead, "
                                 "stalled, or did not issue it",
                          rank_),
                    failed);
      }
      error = failed_;
    }
    for (auto& s : succeeded) s->complete(nullptr);
    for (auto& op : failed) op->state->complete(error);
    succeeded.clear();
    failed.clear();
    // Test again soon, without spinning a core that the ranks' compute needs.
    std::this_thread::sleep_for(kPollInterval);
  }
}

ExternalOps::Clock::time_point deadline_of(const OpOptions& opts, const CommOptions& comm) {
  const auto timeout = opts.timeout.count() > 0 ? opts.timeout : comm.timeout;
  return ExternalOps::Clock::now() + timeout;
}

}  // namespace dear::scheduler
