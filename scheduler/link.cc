#include "link.h"

#include <algorithm>

#include "dear/error.h"

namespace dear::scheduler::detail {

int Link::add(int steps, std::int64_t chunk_bytes, std::int64_t credit_bytes, int priority,
              double issue_s, int after) {
  LinkOp op;
  op.steps = steps;
  op.chunk_bytes = chunk_bytes;
  op.credit_bytes = credit_bytes;
  op.priority = priority;
  op.issue_s = issue_s;
  op.after = after;
  op.step_left = chunk_bytes;
  op.ready_s = issue_s + net_.op_overhead_s;  // the operation's software cost comes first
  const int id = static_cast<int>(ops_.size());
  if (after >= id) throw Error(ErrorCode::kInternal, "link: dependency on a later operation");
  ops_.push_back(op);
  if (steps == 0 || chunk_bytes == 0) {
    // Nothing to send (one rank, or an empty buffer): done once its dependency is.
    LinkOp& o = ops_.back();
    if (after >= 0 && !ops_[after].done) {
      throw Error(ErrorCode::kInternal, "link: empty operation after an unfinished one");
    }
    complete(o, after >= 0 ? std::max(issue_s, ops_[after].end_s) : issue_s);
    o.start_s = o.end_s;
    return id;
  }
  active_.push_back(id);
  if (engine_.credit_bytes > 0) {
    waiting_.push_back(id);
    admit(issue_s);
  } else {
    ops_.back().admit_order = 0;
  }
  return id;
}

void Link::complete(LinkOp& op, double end) {
  op.done = true;
  op.end_s = end;
}

void Link::admit(double now) {
  // Bytes admitted and still unfinished at `now` hold the credit.
  std::int64_t held = 0;
  for (int i : active_) {
    const LinkOp& o = ops_[i];
    if (o.admit_order >= 0 && !(o.done && o.end_s <= now)) held += o.credit_bytes;
  }
  std::stable_sort(waiting_.begin(), waiting_.end(),
                   [&](int a, int b) { return ops_[a].priority > ops_[b].priority; });
  for (int i : waiting_) {
    LinkOp& o = ops_[i];
    if (o.issue_s > now) continue;  // not issued yet at `now`
    // Strict priority: a large operation that does not fit holds back the smaller ones.
    if (held > 0 && held + o.credit_bytes > engine_.credit_bytes) break;
    held += o.credit_bytes;
    o.admit_order = admitted_++;
    o.ready_s = std::max(o.ready_s, now);
  }
  std::erase_if(waiting_, [&](int i) { return ops_[i].admit_order >= 0; });
}

bool Link::movable(const LinkOp& op) const {
  return !op.done && op.admit_order >= 0 && (op.after < 0 || ops_[op.after].done);
}

double Link::ready_time(const LinkOp& op) const {
  return op.after < 0 ? op.ready_s : std::max(op.ready_s, ops_[op.after].end_s);
}

bool Link::better(const LinkOp& a, int ia, const LinkOp& b, int ib) const {
  if (engine_.credit_bytes > 0) return a.admit_order < b.admit_order;
  if (a.priority != b.priority) return a.priority > b.priority;
  return ia < ib;  // issue order
}

bool Link::decide_one(double limit) {
  int pick = -1;
  double when = kNever;
  if (current_ >= 0) {
    pick = current_;
    when = std::max(busy_until_, ready_time(ops_[pick]));
  } else {
    if (engine_.credit_bytes > 0 && !waiting_.empty()) admit(busy_until_);
    double earliest = kNever;
    for (int i : active_) {
      if (movable(ops_[i])) earliest = std::min(earliest, ready_time(ops_[i]));
    }
    if (earliest == kNever && !waiting_.empty()) {
      // Nothing admitted can move: the credit is free by the time the next one is issued.
      double next_issue = kNever;
      for (int i : waiting_) next_issue = std::min(next_issue, ops_[i].issue_s);
      admit(std::max(busy_until_, next_issue));
      for (int i : active_) {
        if (movable(ops_[i])) earliest = std::min(earliest, ready_time(ops_[i]));
      }
    }
    if (earliest == kNever) return false;
    when = std::max(busy_until_, earliest);
    for (int i : active_) {
      const LinkOp& o = ops_[i];
      if (!movable(o) || ready_time(o) > when) continue;
      if (pick < 0 || better(o, i, ops_[pick], pick)) pick = i;
    }
  }
  if (when >= limit) return false;
  LinkOp& op = ops_[pick];
  op.start_s = std::min(op.start_s, when);
  // The serial engine moves a whole step at once (nobody else may use the link); dear's
  // engine one slice, after which it chooses again.
  const std::int64_t bytes =
      engine_.interleave ? std::min(op.step_left, net_.slice_bytes) : op.step_left;
  // Alone on the link a step costs alpha + beta * bytes: the sender's share of alpha (gap)
  // before the bytes, the flight time after them.
  const double gap = std::min(net_.gap_s, net_.alpha_s);
  busy_until_ = when + gap + net_.beta_s_per_byte * static_cast<double>(bytes);
  op.step_left -= bytes;
  if (!engine_.interleave) current_ = pick;
  if (op.step_left == 0) {
    ++op.step;
    op.step_left = op.chunk_bytes;
    op.ready_s = busy_until_ + net_.alpha_s - gap;  // the step's data reaches the next rank
    if (op.step == op.steps) {
      complete(op, op.ready_s);
      if (!engine_.interleave) {
        busy_until_ = op.end_s;
        current_ = -1;
      }
      active_.erase(std::find(active_.begin(), active_.end(), pick));
    }
  }
  return true;
}

void Link::advance_until(double t) {
  while (decide_one(t)) {
  }
}

double Link::finish(int op) {
  while (!ops_.at(op).done) {
    if (!decide_one(kNever)) {
      throw Error(ErrorCode::kInternal, "simulator: waiting for an operation that cannot run");
    }
  }
  return ops_[op].end_s;
}

}  // namespace dear::scheduler::detail
