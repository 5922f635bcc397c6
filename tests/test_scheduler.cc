// Scheduler tests: fusion planners, the simulated link, policy ordering, and whole iterations
// against timelines computed by hand in the comments.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>

#include "dear/error.h"
#include "dear/scheduler/simulator.h"
#include "scheduler/link.h"

namespace ds = dear::scheduler;

namespace {

ds::Model make_model(const std::vector<std::vector<std::int64_t>>& tensors, double fwd_s = 0,
                     double bwd_s = 0) {
  ds::Model m;
  m.name = "tiny";
  m.batch_size = 2;
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    m.layers.push_back({"l" + std::to_string(i), tensors[i], fwd_s, bwd_s});
  }
  return m;
}

std::vector<int> starts(const ds::FusionPlan& plan) {
  std::vector<int> out;
  for (const auto& g : plan) out.push_back(g.first);
  return out;
}

// A network easy to compute by hand: 1 ms per step, 1 us per byte, no sender gap.
ds::NetModel hand_net() {
  ds::NetModel n;
  n.name = "hand";
  n.alpha_s = 1e-3;
  n.beta_s_per_byte = 1e-6;
  n.gap_s = 0;
  n.slice_bytes = 1 << 30;
  return n;
}

}  // namespace

TEST(Fusion, ThresholdGroupsInForwardOrderAndPadsToRanks) {
  // 4-byte elements, threshold 40 elements: {10,20} = 30, +30 would exceed -> new group;
  // {30}, +100 exceeds; {100} is over the threshold alone; {5, 5}.
  const auto m = make_model({{10}, {20}, {30}, {100}, {5}, {5}});
  const auto plan = ds::plan_threshold(m, 4, 40 * 4);
  EXPECT_EQ(starts(plan), (std::vector<int>{0, 2, 3, 4}));
  ASSERT_EQ(plan.size(), 4U);
  EXPECT_EQ(plan[0].last, 1);
  EXPECT_EQ(plan[0].elements, 30);
  EXPECT_EQ(plan[0].padded, 32);
  EXPECT_EQ(plan[2].elements, 100);
  EXPECT_EQ(plan[2].padded, 100);
  EXPECT_EQ(plan[3].elements, 10);
  EXPECT_EQ(plan[3].padded, 12);
}

TEST(Fusion, ThresholdIsInclusiveAndFirstLargeLayerStandsAlone) {
  const auto m = make_model({{50}, {20}, {20}, {1}});
  // 50 > 40 alone; 20 + 20 = 40 exactly fits; 1 more does not.
  EXPECT_EQ(starts(ds::plan_threshold(m, 1, 40 * 4)), (std::vector<int>{0, 1, 3}));
  // The default threshold (25 MiB) fuses this tiny model into one group.
  EXPECT_EQ(ds::plan_threshold(m, 8).size(), 1U);
}

TEST(Fusion, PerLayerNearbyAndExplicitPlans) {
  const auto m = make_model({{3}, {3}, {3}, {3}, {3}});
  EXPECT_EQ(starts(ds::plan_per_layer(m, 2)), (std::vector<int>{0, 1, 2, 3, 4}));
  EXPECT_EQ(starts(ds::plan_nearby(m, 2, 2)), (std::vector<int>{0, 2, 4}));
  EXPECT_EQ(ds::plan_nearby(m, 2, 2)[1].padded, 6);
  EXPECT_EQ(ds::group_of_layer(ds::plan_nearby(m, 2, 2)), (std::vector<int>{0, 0, 1, 1, 2}));
  EXPECT_THROW((void)ds::plan_from_starts(m, 2, {1, 3}), dear::Error);
  EXPECT_THROW((void)ds::plan_from_starts(m, 2, {0, 3, 3}), dear::Error);
  EXPECT_THROW((void)ds::plan_nearby(m, 2, 0), dear::Error);
  EXPECT_EQ(ds::pad_to(0, 4), 0);
  EXPECT_EQ(ds::pad_to(9, 4), 12);
}

TEST(Model, JsonRoundTripAndErrors) {
  auto m = make_model({{6, 2}, {4}}, 1e-3, 2e-3);
  const auto back = ds::parse_model(ds::model_to_json(m));
  ASSERT_EQ(back.layers.size(), 2U);
  EXPECT_EQ(back.layers[0].tensors, (std::vector<std::int64_t>{6, 2}));
  EXPECT_DOUBLE_EQ(back.layers[1].backward_s, 2e-3);
  EXPECT_EQ(back.params(), 12);
  EXPECT_EQ(back.batch_size, 2);
  EXPECT_THROW((void)ds::parse_model("{\"name\": \"x\", \"layers\": []}"), dear::Error);
  EXPECT_THROW((void)ds::parse_model("{\"name\": \"x\", \"layers\": [{\"name\": \"a\"}]}"),
               dear::Error);
  EXPECT_THROW((void)ds::parse_model("not json"), dear::Error);
}

TEST(Network, RingCostModel) {
  const auto n = hand_net();
  // 8 ranks, 800 fp32 elements: chunk 100 elements = 400 bytes; 1 ms + 0.4 ms per step.
  EXPECT_NEAR(ds::op_time(n, ds::OpKind::kReduceScatter, 800, 8, 4), 7 * 1.4e-3, 1e-12);
  EXPECT_NEAR(ds::op_time(n, ds::OpKind::kAllReduce, 800, 8, 4), 14 * 1.4e-3, 1e-12);
  EXPECT_EQ(ds::ring_chunk_bytes(801, 8, 4), 404);
  // A per-operation overhead is paid once, before the steps.
  auto slow = n;
  slow.op_overhead_s = 0.25e-3;
  EXPECT_NEAR(ds::op_time(slow, ds::OpKind::kAllReduce, 800, 8, 4), 0.25e-3 + 14 * 1.4e-3, 1e-12);
  ASSERT_TRUE(ds::net_by_name("10gbe").has_value());
  EXPECT_FALSE(ds::net_by_name("carrier-pigeon").has_value());
}

TEST(Link, SerialEngineRunsWholeOperationsByPriority) {
  ds::detail::Link link(hand_net(), {});
  // A: 2 steps of 1000 B; B: 1 step, higher priority. B holds the link 0..2 ms (1 ms of
  // bytes, 1 ms of latency), then A: 2..3, 4..5, done at 6.
  const int a = link.add(2, 1000, 1000, 0, 0, -1);
  const int b = link.add(1, 1000, 1000, 5, 0, -1);
  EXPECT_NEAR(link.finish(a), 6e-3, 1e-12);
  EXPECT_NEAR(link.ops()[b].end_s, 2e-3, 1e-12);
  EXPECT_NEAR(link.ops()[a].start_s, 2e-3, 1e-12);
}

// The per-operation overhead delays an operation's first step after its issue, on both
// engines; the link stays free for operations already waiting meanwhile.
TEST(Link, OperationOverheadDelaysTheFirstStep) {
  auto net = hand_net();
  net.op_overhead_s = 0.5e-3;
  for (const bool interleave : {false, true}) {
    ds::detail::Link link(net, {interleave, 0});
    // A issued at 0: starts at 0.5 ms, 2 steps of 1 ms bytes + 1 ms latency: done at 4.5 ms.
    const int a = link.add(2, 1000, 1000, 0, 0, -1);
    EXPECT_NEAR(link.finish(a), 4.5e-3, 1e-12) << "interleave " << interleave;
    EXPECT_NEAR(link.ops()[a].start_s, 0.5e-3, 1e-12) << "interleave " << interleave;
  }
}

TEST(Link, InterleavedEngineFillsLatencyWithOtherSlices) {
  auto net = hand_net();
  net.slice_bytes = 500;
  ds::detail::Link link(net, {true, 0});
  // B's two slices 0..1 ms (done at 2); A's first step 1..2 ms, ready at 3; its second
  // 3..4, done at 5: one millisecond earlier than the serial engine.
  const int a = link.add(2, 1000, 1000, 0, 0, -1);
  const int b = link.add(1, 1000, 1000, 5, 0, -1);
  EXPECT_NEAR(link.finish(a), 5e-3, 1e-12);
  EXPECT_NEAR(link.ops()[b].end_s, 2e-3, 1e-12);
  EXPECT_NEAR(link.ops()[a].start_s, 1e-3, 1e-12);
}

TEST(Link, DependencyAndCredit) {
  {
    ds::detail::Link link(hand_net(), {true, 0});
    const int rs = link.add(1, 1000, 1000, 0, 0, -1);
    const int ag = link.add(1, 1000, 1000, 9, 0, rs);  // high priority, but after rs
    EXPECT_NEAR(link.finish(ag), 4e-3, 1e-12);
    EXPECT_NEAR(link.ops()[ag].start_s, 2e-3, 1e-12);
  }
  // Credit 1500 B: A admitted at once; B and C wait. When A ends (2 ms) C, the higher
  // priority, is admitted and runs 2..4; B after it, 4..6.
  ds::detail::Link link(hand_net(), {false, 1500});
  const int a = link.add(1, 1000, 1000, 0, 0, -1);
  const int b = link.add(1, 1000, 1000, 0, 0, -1);
  const int c = link.add(1, 1000, 1000, 9, 0, -1);
  link.advance_until(ds::detail::kNever);
  EXPECT_NEAR(link.ops()[a].end_s, 2e-3, 1e-12);
  EXPECT_NEAR(link.ops()[c].end_s, 4e-3, 1e-12);
  EXPECT_NEAR(link.ops()[b].end_s, 6e-3, 1e-12);
}

// Two layers on 2 ranks: L0 1000 elements, L1 2000; forward 10 ms, backward 20 ms each.
class HandTimeline : public ::testing::Test {
 protected:
  ds::Model model = make_model({{1000}, {2000}}, 10e-3, 20e-3);
  ds::SimConfig config{hand_net(), 2, 3};
};

TEST_F(HandTimeline, Wfbp) {
  // fwd 0..20; bwd L1 20..40, AR(L1) 2 steps of 4000 B = 2 x 5 ms: 40..50; bwd L0 40..60,
  // AR(L0) 2 x (1 + 2) ms: 60..66. Step at 66 ms every iteration.
  auto p = ds::make_wfbp(model);
  const auto r = ds::simulate(model, *p, config);
  EXPECT_NEAR(r.iteration_s, 66e-3, 1e-9);
  EXPECT_NEAR(r.step_s[0], 66e-3, 1e-9);
}

TEST_F(HandTimeline, DearWithoutFusion) {
  // Step at S: AG(0) 1 step of 2000 B: S..S+3; fwd L0 S+3..S+13 (AG(1), 4000 B, S+3..S+8);
  // fwd L1 S+13..S+23; bwd L1 ..S+43, RS(1) ..S+48; bwd L0 ..S+63, RS(0) ..S+66.
  auto p = ds::make_dear(model, ds::plan_per_layer(model, 2));
  const auto r = ds::simulate(model, *p, config);
  // The first iteration has no all-gathers: backward ends at 60, RS(0) 60..63.
  EXPECT_NEAR(r.step_s[0], 63e-3, 1e-9);
  EXPECT_NEAR(r.iteration_s, 66e-3, 1e-9);
}

TEST_F(HandTimeline, DearOneGroup) {
  // One group of 3000 elements: chunk 6000 B, 7 ms per step. Step S: AG S..S+7; forward
  // S+7..S+27; backward ..S+67; RS ..S+74.
  auto p = ds::make_dear(model, ds::plan_threshold(model, 2));
  const auto r = ds::simulate(model, *p, config);
  EXPECT_NEAR(r.iteration_s, 74e-3, 1e-9);
  EXPECT_NEAR(r.step_s[0], 67e-3, 1e-9);
}

// A worker that blocked in a wait goes on wake_s after the operation ended; a wait that finds
// its operation done costs nothing.
TEST_F(HandTimeline, WakeUpAfterABlockedWait) {
  config.net.wake_s = 1e-3;
  // WFBP: AR(L1) 40..50 is over when the step waits for it at 60; AR(L0) 60..66 is not: 67.
  auto wfbp = ds::make_wfbp(model);
  EXPECT_NEAR(ds::simulate(model, *wfbp, config).iteration_s, 67e-3, 1e-9);
  // DeAR, one group: first iteration RS 60..67, the step at 68. Then AG S..S+7, the forward
  // pass waits for it: S+8..S+28; backward ..S+68; RS ..S+75, the step at S+76.
  auto dear = ds::make_dear(model, ds::plan_threshold(model, 2));
  const auto r = ds::simulate(model, *dear, config);
  EXPECT_NEAR(r.step_s[0], 68e-3, 1e-9);
  EXPECT_NEAR(r.iteration_s, 76e-3, 1e-9);
}

TEST_F(HandTimeline, EagerAllGatherAndBound) {
  // Per layer, eager: RS(1) 40..45 then AG(1) 45..50 during L0's backward; RS(0) 60..63,
  // AG(0) 63..66 (issued at 60, after RS(0)); the step at 63 waits only for RS(0).
  // Next forward waits AG(0) until 66: iteration = 66 - 63 + 63 = 66 ms, step at 63 + 66.
  auto p = ds::make_dear(model, ds::plan_per_layer(model, 2), {true});
  const auto r = ds::simulate(model, *p, config);
  EXPECT_NEAR(r.step_s[0], 63e-3, 1e-9);
  EXPECT_NEAR(r.iteration_s, 66e-3, 1e-9);
  // Bound: compute 60 ms + AR(L0) 6 ms = 66; bandwidth 2*(1/2)*12000 B * 1 us = 12 ms.
  EXPECT_NEAR(ds::ideal_bound_s(model, config), 66e-3, 1e-9);
}

TEST_F(HandTimeline, ShardedOptimizerStep) {
  // Optimizer at 1 us per parameter: L0 1 ms, L1 2 ms; a shard on 2 workers is half.
  config.optimizer_us_per_mparam = 1e6;
  // dear, per layer: the step at 63 (RS waits cost nothing), AG(0) 63..66; then before the
  // forward of L0 the optimizer of L0 66..67, AG(1) 67..72, fwd L0 67..77; before L1 the
  // optimizer of L1 77..79, fwd L1 79..89; bwd ..129, RS(0) ..132: 69 ms.
  auto dear = ds::make_dear(model, ds::plan_per_layer(model, 2));
  const auto d = ds::simulate(model, *dear, config);
  EXPECT_NEAR(d.step_s[0], 63e-3, 1e-9);
  EXPECT_NEAR(d.iteration_s, 69e-3, 1e-9);
  // dear_shard: RS(1) 40..45 and RS(0) 60..63 as in dear. At the step (60) L1's shard (1000
  // of 2000) 60..61 while RS(0) runs, L0's shard (500) 63..63.5; AG(0) 63.5..66.5, then AG(1)
  // 66.5..71.5 under fwd L0 66.5..76.5, fwd L1 ..86.5 with nothing to apply; bwd ..126.5,
  // RS(0) ..129.5, shard ..130: 66.5 ms.
  auto shard = ds::make_dear(model, ds::plan_per_layer(model, 2), {false, true});
  const auto s = ds::simulate(model, *shard, config);
  EXPECT_NEAR(s.step_s[0], 63.5e-3, 1e-9);
  EXPECT_NEAR(s.iteration_s, 66.5e-3, 1e-9);
  // The optimizer on the compute stream: whole groups for dear, shards at the step for
  // dear_shard, and the same bytes on the wire.
  auto optimizer = [](const ds::SimResult& r, int iteration) {
    std::vector<std::pair<std::int64_t, double>> out;  // elements, start
    for (const auto& e : r.events) {
      if (e.kind == ds::EventKind::kOptimizer && e.iteration == iteration) {
        out.emplace_back(e.elements, e.start_s);
      }
    }
    return out;
  };
  const auto expect_spans = [](const std::vector<std::pair<std::int64_t, double>>& got,
                               const std::vector<std::pair<std::int64_t, double>>& want) {
    ASSERT_EQ(got.size(), want.size());
    for (std::size_t i = 0; i < want.size(); ++i) {
      EXPECT_EQ(got[i].first, want[i].first) << "span " << i;
      EXPECT_NEAR(got[i].second, want[i].second, 1e-9) << "span " << i;
    }
  };
  expect_spans(optimizer(d, 0), {{1000, 66e-3}, {2000, 77e-3}});
  expect_spans(optimizer(s, 1), {{1000, 126.5e-3}, {500, 129.5e-3}});
  std::int64_t bytes_d = 0;
  std::int64_t bytes_s = 0;
  for (const auto& e : d.events) bytes_d += e.kind == ds::EventKind::kComm ? e.elements : 0;
  for (const auto& e : s.events) bytes_s += e.kind == ds::EventKind::kComm ? e.elements : 0;
  EXPECT_EQ(bytes_s, bytes_d);
  // Free optimizer (the default): no optimizer spans, and dear_shard times as dear does.
  config.optimizer_us_per_mparam = 0;
  auto fresh = ds::make_dear(model, ds::plan_per_layer(model, 2), {false, true});
  const auto free = ds::simulate(model, *fresh, config);
  EXPECT_NEAR(free.iteration_s, 66e-3, 1e-9);
  for (const auto& e : free.events) EXPECT_NE(e.kind, ds::EventKind::kOptimizer);
  // Eager all-gathers would leave before their shards are updated.
  EXPECT_THROW((void)ds::make_dear(model, ds::plan_per_layer(model, 2), {true, true}), dear::Error);
}

TEST_F(HandTimeline, Ddp) {
  // Buckets of 4 KiB (first 4 KiB too): L1's 8000 B is alone, then L0's 4000 B: the same
  // operations as WFBP.
  auto p = ds::make_ddp(model, 4096, 4096);
  EXPECT_NEAR(ds::simulate(model, *p, config).iteration_s, 66e-3, 1e-9);
  // One bucket of both: AR of 3000 elements after the backward pass: 2 x 7 ms after 60.
  auto one = ds::make_ddp(model, 1 << 20, 1 << 20);
  EXPECT_NEAR(ds::simulate(model, *one, config).iteration_s, 74e-3, 1e-9);
}

TEST(MgWfbp, MergeRule) {
  auto net = hand_net();
  // Tiny tensors: each one's transfer is under one startup latency -> one group.
  const auto tiny = make_model({{1}, {1}, {1}, {1}}, 1e-3, 1e-3);
  EXPECT_EQ(ds::mgwfbp_groups(tiny, net, 2), (std::vector<int>{4}));
  // Large tensors far apart in time: each all-reduce (2 x (1 + 4) ms) is over before the
  // next gradient (100 ms later) is ready -> no merging.
  const auto apart = make_model({{2000}, {2000}, {2000}}, 1e-3, 100e-3);
  EXPECT_EQ(ds::mgwfbp_groups(apart, net, 2), (std::vector<int>{1, 1, 1}));
  // Large tensors ready together: the second would start after the first is ready, merge.
  const auto together = make_model({{2000}, {2000}}, 1e-3, 0);
  EXPECT_EQ(ds::mgwfbp_groups(together, net, 2), (std::vector<int>{2}));
}

namespace {

const ds::TraceEvent* find(const ds::SimResult& r, ds::EventKind kind, ds::OpKind op, int it,
                           int layer) {
  for (const auto& e : r.events) {
    if (e.kind != kind || e.iteration != it) continue;
    if (kind == ds::EventKind::kComm && e.op != op) continue;
    if (layer >= e.first_layer && layer <= e.last_layer) return &e;
  }
  return nullptr;
}

ds::Model ordering_model() {
  // Uneven layers and times so that groups and priorities matter.
  ds::Model m = make_model({{300}, {50}, {700}, {20}, {400}, {80}});
  for (std::size_t i = 0; i < m.layers.size(); ++i) {
    m.layers[i].forward_s = 1e-3 * static_cast<double>(i + 1);
    m.layers[i].backward_s = 2e-3 * static_cast<double>(i + 1);
  }
  return m;
}

}  // namespace

class DearOrdering : public ::testing::TestWithParam<std::string> {};

TEST_P(DearOrdering, NoAllGatherBeforeItsReduceScatterNoForwardBeforeItsAllGather) {
  const auto m = ordering_model();
  const ds::SimConfig config{hand_net(), 4, 4};
  const auto r = ds::simulate_named(m, GetParam(), config);
  int rs_count = 0;
  int ag_count = 0;
  for (const auto& e : r.events) {
    if (e.kind != ds::EventKind::kComm) continue;
    ASSERT_NE(e.op, ds::OpKind::kAllReduce);
    ASSERT_GE(e.group, 0);
    // Each op covers whole layers and starts after it is issued.
    EXPECT_GE(e.start_s, e.issue_s);
    if (e.op == ds::OpKind::kReduceScatter) {
      ++rs_count;
      // Not before the backward pass of its first layer (the last of its group to finish).
      const auto* b = find(r, ds::EventKind::kBackward, e.op, e.iteration, e.first_layer);
      ASSERT_NE(b, nullptr);
      EXPECT_GE(e.issue_s, b->end_s - 1e-12);
      continue;
    }
    ++ag_count;
    const auto* rs =
        find(r, ds::EventKind::kComm, ds::OpKind::kReduceScatter, e.iteration, e.first_layer);
    ASSERT_NE(rs, nullptr);
    EXPECT_EQ(rs->first_layer, e.first_layer);
    EXPECT_EQ(rs->last_layer, e.last_layer);
    EXPECT_GE(e.start_s, rs->end_s - 1e-12) << "AG of group " << e.group << " before its RS";
    // Every layer of the group: its next forward pass starts after this AG ended.
    for (int l = e.first_layer; l <= e.last_layer; ++l) {
      const auto* f = find(r, ds::EventKind::kForward, e.op, e.iteration + 1, l);
      if (f == nullptr) continue;  // the last iteration's AGs have no forward after them
      EXPECT_GE(f->start_s, e.end_s - 1e-12) << "forward of layer " << l << " before its AG";
    }
  }
  // Every iteration reduce-scatters every group once, and all-gathers them all once the step
  // is over (for the last iteration, only those issued before the simulation ends).
  const int groups = rs_count / config.iterations;
  EXPECT_EQ(rs_count, groups * config.iterations);
  EXPECT_GE(ag_count, groups * (config.iterations - 1) + 1);
  EXPECT_LE(ag_count, rs_count);
  if (GetParam() == "dear_notf") {
    EXPECT_EQ(groups, 6);
  }
  // Forward of iteration k + 1 starts after the step of iteration k.
  for (int it = 1; it < config.iterations; ++it) {
    const auto* f = find(r, ds::EventKind::kForward, ds::OpKind::kAllGather, it, 0);
    ASSERT_NE(f, nullptr);
    EXPECT_GE(f->start_s, r.step_s[static_cast<std::size_t>(it - 1)] - 1e-12);
  }
}

INSTANTIATE_TEST_SUITE_P(Policies, DearOrdering,
                         ::testing::Values("dear", "dear_notf", "dear_prio", "dear_eager",
                                           "dear_shard", "dear_auto", "dear_plus"));

class BaselineOrdering : public ::testing::TestWithParam<std::string> {};

TEST_P(BaselineOrdering, AllReduceAfterGradientAndBeforeNextUse) {
  const auto m = ordering_model();
  const ds::SimConfig config{hand_net(), 4, 3};
  const auto r = ds::simulate_named(m, GetParam(), config);
  std::map<int, std::int64_t> reduced;  // elements all-reduced per iteration
  for (const auto& e : r.events) {
    if (e.kind != ds::EventKind::kComm) continue;
    ASSERT_EQ(e.op, ds::OpKind::kAllReduce);
    reduced[e.iteration] += e.elements;
    // Issued once the gradients of all its layers exist: after the first layer's backward.
    const auto* b = find(r, ds::EventKind::kBackward, e.op, e.iteration, e.first_layer);
    ASSERT_NE(b, nullptr);
    EXPECT_GE(e.issue_s, b->end_s - 1e-12);
    EXPECT_GE(e.start_s, e.issue_s);
    for (int l = e.first_layer; l <= e.last_layer; ++l) {
      const auto* f = find(r, ds::EventKind::kForward, e.op, e.iteration + 1, l);
      if (f != nullptr) {
        EXPECT_GE(f->start_s, e.end_s - 1e-12);
      }
    }
  }
  for (int it = 0; it < config.iterations; ++it) EXPECT_EQ(reduced[it], m.params());
}

INSTANTIATE_TEST_SUITE_P(Policies, BaselineOrdering,
                         ::testing::Values("wfbp", "ddp", "bytescheduler", "mgwfbp"));

TEST(ByteScheduler, PartitionsAndPriorities) {
  // 10 elements with partitions of 4: 4 + 3 + 3, each with priority -layer.
  const auto m = make_model({{2}, {10}}, 1e-3, 1e-3);
  auto p = ds::make_bytescheduler(m, 4);
  const auto r = ds::simulate(m, *p, {hand_net(), 2, 2});
  std::vector<std::int64_t> sizes;
  for (const auto& e : r.events) {
    if (e.kind == ds::EventKind::kComm && e.iteration == 0 && e.first_layer == 1) {
      sizes.push_back(e.elements);
      EXPECT_EQ(e.priority, -1);
    }
  }
  EXPECT_EQ(sizes, (std::vector<std::int64_t>{4, 3, 3}));
}

TEST(Planner, DynamicProgrammingOverBoundaries) {
  auto m = make_model({{1000}, {1000}, {1000}, {1000}}, 1e-3, 10e-3);
  ds::SimConfig config{hand_net(), 2, 3};
  // Startup dominates (1 s per step): one group.
  config.net.alpha_s = 1.0;
  EXPECT_EQ(ds::plan_rs_dp(m, config).size(), 1U);
  // No startup: every reduce-scatter hides behind the next layer's backward (2 ms of bytes
  // under 10 ms of compute), so only layer 0's is exposed and it is kept alone.
  config.net.alpha_s = 0;
  const auto plan = ds::plan_rs_dp(m, config);
  ASSERT_GE(plan.size(), 2U);
  EXPECT_EQ(plan.front().last, 0);
  // The automatic plan scores no worse than the reference threshold plan.
  auto score = [&](const ds::FusionPlan& p) {
    auto policy = ds::make_dear(m, p);
    return ds::simulate(m, *policy, config).iteration_s;
  };
  EXPECT_LE(score(ds::plan_auto(m, config, score)), score(ds::plan_threshold(m, 2)) + 1e-12);
}

// The boundaries of a plan, for comparing plans in the tests below.
std::vector<int> starts_of(const ds::FusionPlan& plan) {
  std::vector<int> starts;
  for (const auto& g : plan) starts.push_back(g.first);
  return starts;
}

TEST(Planner, RefinementWalksToTheBestBoundaries) {
  std::vector<std::vector<std::int64_t>> tensors(20, std::vector<std::int64_t>{10});
  const auto m = make_model(tensors);
  // A score whose only minimum is groups starting at layers 0, 5 and 12: the distance of
  // each boundary from its target, and a large cost per group too many or too few.
  const std::vector<int> target{0, 5, 12};
  int calls = 0;
  auto score = [&](const ds::FusionPlan& p) {
    ++calls;
    const std::vector<int> s = starts_of(p);
    const auto extra = static_cast<double>(s.size()) - static_cast<double>(target.size());
    double v = 100.0 * extra * extra;
    for (std::size_t j = 0; j < std::min(s.size(), target.size()); ++j) {
      v += std::abs(s[j] - target[j]);
    }
    return v;
  };
  // From one group (split twice, then boundaries moved) and from one group per layer
  // (groups merged, then moved).
  for (const auto& start :
       {ds::plan_threshold(m, 2, std::int64_t{1} << 40), ds::plan_per_layer(m, 2)}) {
    calls = 0;
    const auto refined = ds::refine_plan(m, 2, start, score(start), score, 10000);
    EXPECT_EQ(starts_of(refined), target);
    EXPECT_EQ(score(refined), 0.0);
    EXPECT_LT(calls, 10000);
  }
  // The budget bounds the calls, and what comes back never scores worse than the start.
  const auto start = ds::plan_per_layer(m, 2);
  const double start_score = score(start);
  calls = 0;
  const auto cut_short = ds::refine_plan(m, 2, start, start_score, score, 5);
  EXPECT_EQ(calls, 5);
  calls = 0;
  EXPECT_LE(score(cut_short), start_score);
  // Where nothing scores lower, the plan comes back unchanged.
  const auto flat = ds::refine_plan(
      m, 2, start, 1.0, [](const ds::FusionPlan&) { return 1.0; }, 100);
  EXPECT_EQ(starts_of(flat), starts_of(start));
}

TEST(Simulator, ChromeTraceAndNames) {
  const auto m = ordering_model();
  const ds::SimConfig config{hand_net(), 4, 2};
  const auto r = ds::simulate_named(m, "dear_plus", config);
  std::stringstream out;
  ds::write_chrome_trace(r, m, out);
  const auto doc = nlohmann::json::parse(out.str());
  std::size_t spans = 0;
  for (const auto& e : doc.at("traceEvents")) {
    if (e.at("ph") == "X") {
      ++spans;
      EXPECT_GE(e.at("dur").get<double>(), 0.0);
    }
  }
  EXPECT_EQ(spans, r.events.size());
  // Optimizer spans appear on the compute track when the optimizer is charged.
  ds::SimConfig charged = config;
  charged.optimizer_us_per_mparam = 1e6;
  const auto o = ds::simulate_named(m, "dear_shard", charged);
  std::stringstream out_o;
  ds::write_chrome_trace(o, m, out_o);
  std::size_t optimizer_spans = 0;
  const auto doc_o = nlohmann::json::parse(out_o.str());
  for (const auto& e : doc_o.at("traceEvents")) {
    if (e.at("ph") == "X" && e.at("cat") == "optimizer") ++optimizer_spans;
  }
  EXPECT_GT(optimizer_spans, 0U);
  EXPECT_GE(o.iteration_s, ds::ideal_bound_s(m, charged) - 1e-12);
  EXPECT_THROW((void)ds::simulate_named(m, "nope", config), dear::Error);
  for (const auto& name : ds::policy_names()) {
    const auto res = ds::simulate_named(m, name, config);
    EXPECT_GE(res.iteration_s, ds::ideal_bound_s(m, config) - 1e-12) << name;
  }
}

TEST(Simulator, ScalesToThousandsOfWorkers) {
  const auto m = ordering_model();
  ds::SimConfig config{ds::net_10gbe(), 1024, 3};
  for (const char* name : {"dear", "dear_plus", "wfbp"}) {
    const auto r = ds::simulate_named(m, name, config);
    EXPECT_GE(r.iteration_s, ds::ideal_bound_s(m, config) - 1e-12) << name;
  }
  config.workers = 1;  // one worker: no communication at all
  EXPECT_NEAR(ds::simulate_named(m, "dear", config).iteration_s, m.forward_s() + m.backward_s(),
              1e-12);
}
