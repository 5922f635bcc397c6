// Profile replay on real collectives (ranks as threads over loopback): after K iterations of
// every policy the parameters equal a single-process SGD on the averaged synthetic gradients,
// and the real back-end keeps the policies' orderings.
#include <gtest/gtest.h>
#include <sys/prctl.h>

#include <cmath>
#include <map>
#include <mutex>
#include <ostream>
#include <string>
#include <vector>

#include "dear/scheduler/comm_backend.h"
#include "dear/scheduler/replay.h"
#include "harness.h"
#include "replay_reference.h"

namespace ds = dear::scheduler;
using dear::testing::loopback_net;
using dear::testing::param_mismatches;
using dear::testing::reference_params;
using dear::testing::run_ranks;
using dear::testing::tiny_model;

namespace {

struct Case {
  std::string policy;
  int ranks;
  bool sleep;  // replay compute by sleeping (else none)
};

void PrintTo(const Case& c, std::ostream* os) {
  *os << c.policy << " on " << c.ranks << " ranks" << (c.sleep ? ", compute sleeping" : "");
}

std::string case_name(const ::testing::TestParamInfo<Case>& info) {
  return info.param.policy + "_" + std::to_string(info.param.ranks) + "ranks" +
         (info.param.sleep ? "_sleep" : "");
}

std::vector<Case> all_cases() {
  std::vector<Case> out;
  for (const auto& p : ds::policy_names()) {
    out.push_back({p, 2, false});
    out.push_back({p, 3, true});
  }
  for (const char* p :
       {"dear", "dear_notf", "dear_eager", "dear_shard", "dear_plus", "wfbp", "bytescheduler"}) {
    out.push_back({p, 4, false});
  }
  return out;
}

}  // namespace

class ReplayEquivalence : public ::testing::TestWithParam<Case> {};

TEST_P(ReplayEquivalence, FinalParametersMatchSingleProcessSgd) {
  const Case c = GetParam();
  const ds::Model model = tiny_model(c.sleep ? 100e-6 : 0, c.sleep ? 200e-6 : 0);
  ds::ReplayOptions opt;
  opt.warmup = 1;
  opt.iterations = 3;
  opt.compute = c.sleep ? ds::ComputeMode::kSleep : ds::ComputeMode::kNone;
  opt.learning_rate = 0.125F;
  opt.net = loopback_net();
  opt.record_trace = true;
  const int k = opt.warmup + opt.iterations;
  std::vector<ds::ReplayResult> results(static_cast<std::size_t>(c.ranks));
  run_ranks(c.ranks, [&](dear::Communicator& comm) {
    results[static_cast<std::size_t>(comm.rank())] = ds::replay(comm, model, c.policy, opt);
  });
  const auto ref = reference_params(model.params(), c.ranks, k, opt.learning_rate);
  for (int r = 0; r < c.ranks; ++r) {
    const auto& got = results[static_cast<std::size_t>(r)].params;
    EXPECT_EQ(param_mismatches(got, ref, c.policy + " rank " + std::to_string(r)), 0);
    // dear's engine takes every priority change, also for operations it already holds.
    EXPECT_EQ(results[static_cast<std::size_t>(r)].late_priority_changes, 0) << c.policy;
    EXPECT_EQ(results[static_cast<std::size_t>(r)].iteration_s.size(), 3U);
  }
}

// Ordering on the real back-end, from the recorded trace: no all-gather is handed to the
// communicator before its reduce-scatter was seen complete, and no layer's forward pass starts
// before the collective that carries its previous gradients was seen complete.
class ReplayOrdering : public ::testing::TestWithParam<std::string> {};

TEST_P(ReplayOrdering, OnTheRealBackend) {
  const Case c{GetParam(), 2, true};
  const ds::Model model = tiny_model(50e-6, 100e-6);
  ds::ReplayOptions opt;
  opt.warmup = 1;
  opt.iterations = 2;
  opt.net = loopback_net();
  opt.record_trace = true;
  ds::ReplayResult result;
  run_ranks(2, [&](dear::Communicator& comm) {
    auto r = ds::replay(comm, model, c.policy, opt);
    if (comm.rank() == 1) result = std::move(r);
  });
  const auto offsets = ds::layer_offsets(model);
  std::map<std::pair<int, int>, const ds::TraceEvent*> rs;  // (iteration, group)
  std::map<std::pair<int, int>, double> forward;            // (iteration, layer) -> start
  for (const auto& e : result.trace.events) {
    if (e.kind == ds::EventKind::kForward) forward[{e.iteration, e.first_layer}] = e.start_s;
    if (e.kind == ds::EventKind::kComm && e.op == ds::OpKind::kReduceScatter) {
      rs[{e.iteration, e.group}] = &e;
    }
  }
  const int total = opt.warmup + opt.iterations;
  std::vector<std::int64_t> covered(static_cast<std::size_t>(total));
  for (const auto& e : result.trace.events) {
    if (e.kind != ds::EventKind::kComm) continue;
    ASSERT_GE(e.start_s, e.issue_s);
    ASSERT_GE(e.end_s, e.start_s) << "every operation completes";
    if (e.op == ds::OpKind::kReduceScatter) continue;
    if (e.op == ds::OpKind::kAllGather) {
      const auto it = rs.find({e.iteration, e.group});
      ASSERT_NE(it, rs.end()) << "AG of group " << e.group << " without its RS";
      EXPECT_GE(e.start_s, it->second->end_s) << "AG of group " << e.group << " iteration "
                                              << e.iteration << " before its RS completed";
    }
    if (e.iteration >= 0 && e.iteration < total) {
      covered[static_cast<std::size_t>(e.iteration)] +=
          e.group >= 0 ? offsets[static_cast<std::size_t>(e.last_layer) + 1] -
                             offsets[static_cast<std::size_t>(e.first_layer)]
                       : e.elements;
    }
    for (int l = e.first_layer; l <= e.last_layer; ++l) {
      const auto f = forward.find({e.iteration + 1, l});
      if (f == forward.end()) continue;  // the last iteration's: applied after the loop
      EXPECT_GE(f->second, e.end_s) << c.policy << ": forward of layer " << l << " in iteration "
                                    << e.iteration + 1 << " before its collective completed";
    }
  }
  // Every iteration's gradients were averaged and applied exactly once.
  for (int it = 0; it < total; ++it) {
    EXPECT_EQ(covered[static_cast<std::size_t>(it)], model.params()) << "iteration " << it;
  }
}

INSTANTIATE_TEST_SUITE_P(Policies, ReplayEquivalence, ::testing::ValuesIn(all_cases()), case_name);
INSTANTIATE_TEST_SUITE_P(Policies, ReplayOrdering, ::testing::ValuesIn(ds::policy_names()));

// The back-end alone: an all-gather after its reduce-scatter, an all-reduce queued behind it,
// averaged data, one consumption per operation, and argument errors that name the rank.
TEST(CommBackend, DependencyQueueDataAndConsumption) {
  constexpr int kRanks = 3;
  constexpr std::int64_t kElems = 3 * 40000;  // large enough that the RS is still running
  run_ranks(kRanks, [&](dear::Communicator& comm) {
    const int rank = comm.rank();
    std::vector<float> a(kElems);
    std::vector<float> b(1001);
    for (std::int64_t i = 0; i < kElems; ++i) {
      a[static_cast<std::size_t>(i)] = static_cast<float>((i % 7) + 3 * rank);
    }
    for (std::size_t i = 0; i < b.size(); ++i) b[i] = static_cast<float>(rank * 2 + 1);
    std::map<int, int> consumed;
    std::mutex mu;
    ds::CommBackend backend(
        comm, [&](const ds::CommRequest& r) { return r.group == 0 ? a.data() : b.data(); },
        [&](const ds::CommRequest& r) {
          std::lock_guard<std::mutex> lock(mu);
          ++consumed[static_cast<int>(r.kind)];
        });
    ds::CommRequest rs{ds::OpKind::kReduceScatter, kElems, 0, ds::kNoOp, 0, 0, 0, false, 0};
    const ds::OpId rs_id = backend.issue(rs);
    ds::CommRequest ag = rs;
    ag.kind = ds::OpKind::kAllGather;
    ag.after = rs_id;
    ag.priority = -1;
    const ds::OpId ag_id = backend.issue(ag);
    ds::CommRequest ar{ds::OpKind::kAllReduce, 1001, 0, ds::kNoOp, 1, 1, 1, false, 0};
    const ds::OpId ar_id = backend.issue(ar);
    backend.set_priority(ag_id, 5);  // may be queued (taken) or running (counted)
    backend.wait(ar_id);
    backend.wait(ag_id);
    backend.wait(ag_id);  // a second wait consumes nothing
    backend.wait(rs_id);
    const auto rec = backend.records();
    ASSERT_EQ(rec.size(), 3U);
    EXPECT_GE(rec[1].start_s, rec[0].end_s) << "rank " << rank << ": AG before its RS";
    EXPECT_GE(rec[2].start_s, rec[1].start_s) << "rank " << rank << ": issue order broken";
    EXPECT_EQ(consumed[static_cast<int>(ds::OpKind::kReduceScatter)], 1);
    EXPECT_EQ(consumed[static_cast<int>(ds::OpKind::kAllGather)], 1);
    EXPECT_EQ(consumed[static_cast<int>(ds::OpKind::kAllReduce)], 1);
    for (std::int64_t i = 0; i < kElems; ++i) {
      const float want = static_cast<float>((i % 7) + 3);  // mean of 3 * rank over 0..2 is 3
      ASSERT_EQ(a[static_cast<std::size_t>(i)], want) << "rank " << rank << " element " << i;
    }
    for (float x : b) ASSERT_EQ(x, 3.0F) << "rank " << rank;  // mean of 1, 3, 5
    // A reduce-scatter that does not divide by the ranks is refused, naming the rank.
    ds::CommRequest bad{ds::OpKind::kReduceScatter, 1000, 0, ds::kNoOp, 1, 1, 1, false, 0};
    try {
      (void)backend.issue(bad);
      ADD_FAILURE() << "rank " << rank << ": unpadded RS accepted";
    } catch (const dear::Error& e) {
      EXPECT_EQ(e.rank(), rank);
      EXPECT_NE(std::string(e.what()).find("multiple of the 3 ranks"), std::string::npos)
          << e.what();
    }
  });
}

TEST(Replay, ScaledModelAndArgumentErrors) {
  const ds::Model m = tiny_model(1e-3, 2e-3);
  const ds::Model s = ds::scale_model(m, 0.5, 0.1);
  EXPECT_DOUBLE_EQ(s.layers[0].forward_s, 0.5e-3);
  EXPECT_EQ(s.layers[0].tensors, (std::vector<std::int64_t>{30, 1}));
  EXPECT_EQ(ds::layer_offsets(s).back(), s.params());
  EXPECT_THROW((void)ds::scale_model(m, 0, 1), dear::Error);
  ds::ReplayOptions opt;
  opt.warmup = 0;
  run_ranks(1, [&](dear::Communicator& comm) {
    EXPECT_THROW((void)ds::replay(comm, m, "dear", opt), dear::Error);
    opt.warmup = 1;
    opt.iterations = 1;
    opt.compute = ds::ComputeMode::kNone;
    EXPECT_THROW((void)ds::replay(comm, m, "no_such_policy", opt), dear::Error);
    // One rank: no communication at all, SGD on its own gradients.
    const auto r = ds::replay(comm, m, "dear", opt);
    const auto ref = reference_params(m.params(), 1, 2, opt.learning_rate);
    for (std::size_t i = 0; i < ref.size(); ++i) {
      ASSERT_NEAR(r.params[i], ref[i], 2e-5) << "element " << i;
    }
  });
}

// A sleeping replay tightens its thread's timer slack while it runs (so that short layers'
// sleeps do not overshoot) and gives the caller's setting back afterwards, also when it fails.
TEST(Replay, SleepingReplayRestoresTheTimerSlack) {
  const ds::Model m = tiny_model(20e-6, 40e-6);
  constexpr unsigned long kSlack = 123457;
  run_ranks(1, [&](dear::Communicator& comm) {
    ASSERT_EQ(::prctl(PR_SET_TIMERSLACK, kSlack, 0, 0, 0), 0);
    ds::ReplayOptions opt;
    opt.warmup = 1;
    opt.iterations = 1;
    opt.compute = ds::ComputeMode::kSleep;
    std::vector<int> during;  // the slack seen from inside the replay, once per iteration
    opt.progress = [&during](int, int, double) {
      during.push_back(::prctl(PR_GET_TIMERSLACK, 0, 0, 0, 0));
    };
    const auto r = ds::replay(comm, m, "dear", opt);
    EXPECT_EQ(r.iteration_s.size(), 1U);
    EXPECT_EQ(during, (std::vector<int>{1, 1}));
    EXPECT_EQ(::prctl(PR_GET_TIMERSLACK, 0, 0, 0, 0), static_cast<int>(kSlack));
    EXPECT_THROW((void)ds::replay(comm, m, "no_such_policy", opt), dear::Error);
    EXPECT_EQ(::prctl(PR_GET_TIMERSLACK, 0, 0, 0, 0), static_cast<int>(kSlack));
  });
}

// The calibration's fit is rank 0's on every rank (every rank must plan with the same
// numbers), and each term is a finite time of the right sign.
TEST(Replay, CalibrationIsRankZerosOnEveryRank) {
  constexpr int kRanks = 3;
  std::vector<ds::NetModel> fits(kRanks);
  run_ranks(kRanks, [&](dear::Communicator& comm) {
    fits[static_cast<std::size_t>(comm.rank())] = ds::calibrate_network(comm, 3);
  });
  for (int r = 0; r < kRanks; ++r) {
    const ds::NetModel& f = fits[static_cast<std::size_t>(r)];
    SCOPED_TRACE("rank " + std::to_string(r));
    EXPECT_EQ(f.alpha_s, fits[0].alpha_s);
    EXPECT_EQ(f.beta_s_per_byte, fits[0].beta_s_per_byte);
    EXPECT_EQ(f.op_overhead_s, fits[0].op_overhead_s);
    EXPECT_EQ(f.wake_s, fits[0].wake_s);
    EXPECT_TRUE(std::isfinite(f.alpha_s) && f.alpha_s > 0 && f.alpha_s < 1);
    EXPECT_TRUE(std::isfinite(f.beta_s_per_byte) && f.beta_s_per_byte > 0);
    EXPECT_TRUE(std::isfinite(f.op_overhead_s) && f.op_overhead_s >= 0 && f.op_overhead_s < 1);
    EXPECT_TRUE(std::isfinite(f.wake_s) && f.wake_s >= 0 && f.wake_s < 1);
  }
}
