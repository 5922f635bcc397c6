#include "dear/scheduler/comm_backend.h"

#include <string>
#include <utility>

#include "dear/error.h"

namespace dear::scheduler {

CommBackend::CommBackend(Communicator& comm, Resolver resolver, Consumer consumer,
                         Clock::time_point epoch, Algorithm algorithm)
    : comm_(comm),
      resolver_(std::move(resolver)),
      consumer_(std::move(consumer)),
      epoch_(epoch),
      algorithm_(algorithm),
      handover_([this] { handover_loop(); }) {}

CommBackend::~CommBackend() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  queued_.notify_all();
  handover_.join();
  // The communicator may still write into the caller's buffers: wait for what it holds.
  for (auto& op : ops_) {
    if (!op.launched) continue;
    try {
      op.work.wait();
    } catch (...) {  // NOLINT(bugprone-empty-catch): a destructor reports nothing
    }
  }
}

double CommBackend::now_s() const {
  return std::chrono::duration<double>(Clock::now() - epoch_).count();
}

OpId CommBackend::issue(const CommRequest& request) {
  std::lock_guard<std::mutex> lock(mu_);
  if (error_) std::rethrow_exception(error_);
  const OpId id = static_cast<OpId>(ops_.size());
  if (request.after != kNoOp && (request.after < 0 || request.after >= id)) {
    throw Error(ErrorCode::kInvalidArgument,
                "CommBackend::issue: 'after' (" + std::to_string(request.after) +
                    ") is not an earlier operation",
                comm_.rank());
  }
  Op& op = ops_.emplace_back();
  op.record.request = request;
  op.record.iteration = iteration_ - (request.previous_iteration ? 1 : 0);
  op.record.priority = request.priority;
  op.record.issue_s = now_s();
  bool ready = queue_.empty();
  if (ready && request.after != kNoOp) {
    Op& dep = ops_[static_cast<std::size_t>(request.after)];
    ready = dep.launched && dep.work.test();
    if (ready && dep.record.end_s < 0) dep.record.end_s = now_s();
  }
  if (ready) {
    try {
      launch_locked(id);
    } catch (...) {
      error_ = std::current_exception();
      launched_.notify_all();
      throw;
    }
  } else {
    queue_.push_back(id);
    queued_.notify_one();
  }
  return id;
}

void CommBackend::launch_locked(OpId id) {
  Op& op = ops_[static_cast<std::size_t>(id)];
  const CommRequest& r = op.record.request;
  float* buf = resolver_(r);
  const int n = comm_.size();
  const auto count = static_cast<std::size_t>(r.elements);
  OpOptions o;
  o.priority = r.priority;
  if (r.kind == OpKind::kAllReduce) {
    o.algorithm = algorithm_;
    op.work = comm_.all_reduce(buf, buf, count, DataType::kFloat32, ReduceOp::kAvg, o);
  } else {
    if (r.elements % n != 0) {
      throw Error(ErrorCode::kInvalidArgument,
                  std::string("CommBackend: ") + to_string(r.kind) + " request of " +
                      std::to_string(r.elements) + " elements is not a multiple of the " +
                      std::to_string(n) + " ranks (pad the buffer)",
                  comm_.rank());
    }
    const std::size_t shard = count / static_cast<std::size_t>(n);
    float* mine = buf + static_cast<std::size_t>(comm_.rank()) * shard;
    op.work = r.kind == OpKind::kReduceScatter
                  ? comm_.reduce_scatter(buf, mine, shard, DataType::kFloat32, ReduceOp::kAvg, o)
                  : comm_.all_gather(mine, buf, shard, DataType::kFloat32, o);
  }
  op.launched = true;
  op.record.priority = r.priority;
  op.record.start_s = now_s();
  launched_.notify_all();
}

void CommBackend::handover_loop() {
  std::unique_lock<std::mutex> lock(mu_);
  while (true) {
    queued_.wait(lock, [&] { return stop_ || !queue_.empty(); });
    if (stop_) return;
    const OpId id = queue_.front();
    const OpId dep = ops_[static_cast<std::size_t>(id)].record.request.after;
    try {
      if (dep != kNoOp) {
        // Operations are handed over in issue order, so the dependency already has been.
        Work w = ops_[static_cast<std::size_t>(dep)].work;
        lock.unlock();
        w.wait();
        lock.lock();
        auto& rec = ops_[static_cast<std::size_t>(dep)].record;
        if (rec.end_s < 0) rec.end_s = now_s();
        if (stop_) return;
      }
      launch_locked(id);
    } catch (...) {
      if (!lock.owns_lock()) lock.lock();
      error_ = std::current_exception();
      launched_.notify_all();
      return;
    }
    queue_.pop_front();
  }
}

Work CommBackend::launched_work(std::unique_lock<std::mutex>& lock, OpId id) {
  if (id < 0 || id >= static_cast<OpId>(ops_.size())) {
    throw Error(ErrorCode::kInvalidArgument, "CommBackend: unknown operation " + std::to_string(id),
                comm_.rank());
  }
  Op& op = ops_[static_cast<std::size_t>(id)];
  if (!op.launched) ++blocked_waits_;
  launched_.wait(lock, [&] { return op.launched || error_ != nullptr; });
  if (!op.launched) std::rethrow_exception(error_);
  return op.work;
}

void CommBackend::wait(OpId id) {
  if (id == kNoOp) return;
  std::unique_lock<std::mutex> lock(mu_);
  Work w = launched_work(lock, id);
  lock.unlock();
  if (!w.test()) ++blocked_waits_;
  w.wait();
  lock.lock();
  Record& rec = ops_[static_cast<std::size_t>(id)].record;
  if (rec.end_s < 0) rec.end_s = now_s();
  if (rec.consumed) return;
  rec.consumed = true;
  const CommRequest request = rec.request;
  lock.unlock();
  if (consumer_) consumer_(request);
}

void CommBackend::drain() {
  std::unique_lock<std::mutex> lock(mu_);
  for (std::size_t i = 0; i < ops_.size(); ++i) {
    Work w = launched_work(lock, static_cast<OpId>(i));
    lock.unlock();
    w.wait();
    lock.lock();
    if (ops_[i].record.end_s < 0) ops_[i].record.end_s = now_s();
  }
}

void CommBackend::set_priority(OpId id, int priority) {
  if (id == kNoOp) return;
  std::lock_guard<std::mutex> lock(mu_);
  if (id < 0 || id >= static_cast<OpId>(ops_.size())) {
    throw Error(ErrorCode::kInvalidArgument,
                "CommBackend::set_priority: unknown operation " + std::to_string(id), comm_.rank());
  }
  Op& op = ops_[static_cast<std::size_t>(id)];
  if (!op.launched) {
    op.record.request.priority = priority;
  } else if (op.record.priority != priority && !op.work.test()) {
    // Already with the communicator: dear's engine reorders its remaining slices; a
    // communicator that cannot (MPI, NCCL) leaves it, and that is counted.
    if (comm_.set_priority(op.work, priority)) {
      op.record.priority = priority;
    } else if (!op.work.test()) {  // not merely finished meanwhile
      ++late_priority_changes_;
    }
  }
}

int CommBackend::late_priority_changes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return late_priority_changes_;
}

std::vector<CommBackend::Record> CommBackend::records() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<Record> out;
  out.reserve(ops_.size());
  for (const auto& op : ops_) out.push_back(op.record);
  return out;
}

}  // namespace dear::scheduler
