// One simulated ring link and the engine that feeds it (see simulator.h for the two engines).
// Private to the scheduler library.
#pragma once

#include <cstdint>
#include <limits>
#include <vector>

#include "dear/scheduler/network.h"
#include "dear/scheduler/simulator.h"

namespace dear::scheduler::detail {

inline constexpr double kNever = std::numeric_limits<double>::infinity();

struct LinkOp {
  int steps = 0;
  std::int64_t chunk_bytes = 0;
  std::int64_t credit_bytes = 0;  // what it holds of the engine's credit
  int priority = 0;
  double issue_s = 0;
  int after = -1;
  std::int64_t admit_order = -1;  // credit engines: admission order; -1 = waiting
  int step = 0;
  std::int64_t step_left = 0;  // bytes of the current step still to send
  double ready_s = 0;          // the current step may not start before this
  double start_s = kNever;
  double end_s = kNever;
  bool done = false;
};

class Link {
 public:
  Link(const NetModel& net, const EngineModel& engine) : net_(net), engine_(engine) {}

  int add(int steps, std::int64_t chunk_bytes, std::int64_t credit_bytes, int priority,
          double issue_s, int after);
  void set_priority(int op, int priority) { ops_.at(op).priority = priority; }
  // Makes every engine decision that falls before time t.
  void advance_until(double t);
  // Makes decisions until `op` has completed; returns its end time.
  double finish(int op);
  [[nodiscard]] const std::vector<LinkOp>& ops() const { return ops_; }

 private:
  bool decide_one(double limit);
  void admit(double now);
  [[nodiscard]] bool movable(const LinkOp& op) const;
  [[nodiscard]] double ready_time(const LinkOp& op) const;
  [[nodiscard]] bool better(const LinkOp& a, int ia, const LinkOp& b, int ib) const;
  void complete(LinkOp& op, double end);

  NetModel net_;
  EngineModel engine_;
  std::vector<LinkOp> ops_;
  std::vector<int> active_;   // not done
  std::vector<int> waiting_;  // credit engines: issued, not yet admitted
  double busy_until_ = 0;
  int current_ = -1;  // serial engines: the operation holding the link
  std::int64_t admitted_ = 0;
};

}  // namespace dear::scheduler::detail
