// The alpha-beta cost model: the calibration fit, the schedules' step counts against hand
// computation and against plan(), the choice kAuto makes, and the model file.
#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <exception>
#include <fstream>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "collectives/cost_model.h"
#include "collectives/ops.h"
#include "dear/bootstrap.h"
#include "dear/communicator.h"
#include "dear/error.h"

namespace dear::collectives {
namespace {

ModelGeometry geometry(int n, int channels = 1, std::size_t slice = 512 * 1024) {
  ModelGeometry g;
  g.nranks = n;
  g.channels = channels;
  g.slice_bytes = slice;
  return g;
}

CostModel synthetic(double alpha, double beta, double noise) {
  CostModel m;
  const ModelGeometry g = geometry(4);
  int i = 0;
  for (double bytes : {8.0, 64.0, 512.0, 4096.0, 32768.0, 262144.0, 1048576.0, 4194304.0}) {
    CalibrationPoint p;
    p.bytes = bytes;
    p.slices = slices_for(static_cast<std::size_t>(bytes), 1, g);
    // Deterministic +-noise, alternating in sign.
    const double factor = 1 + ((i++ % 2 == 0) ? noise : -noise);
    p.step_us = (alpha * p.slices + beta * bytes) * factor;
    m.points.push_back(p);
  }
  return m;
}

TEST(CostModelFit, RecoversExactAlphaBeta) {
  CostModel m = synthetic(7.5, 0.0008, 0);
  fit_alpha_beta(m);
  EXPECT_NEAR(m.alpha_us, 7.5, 1e-9);
  EXPECT_NEAR(m.beta_us_per_byte, 0.0008, 1e-12);
  EXPECT_LT(m.median_rel_error, 1e-9);
  EXPECT_EQ(m.points[7].slices, 8);  // 4 MiB in 512 KiB slices
}

TEST(CostModelFit, RecoversAlphaBetaFromNoisyPoints) {
  CostModel m = synthetic(12, 0.002, 0.03);
  fit_alpha_beta(m);
  EXPECT_NEAR(m.alpha_us, 12, 12 * 0.05);
  EXPECT_NEAR(m.beta_us_per_byte, 0.002, 0.002 * 0.05);
  EXPECT_NEAR(m.median_rel_error, 0.03, 0.01);
  for (const auto& p : m.points) {
    EXPECT_NEAR(p.model_us, m.alpha_us * p.slices + m.beta_us_per_byte * p.bytes, 1e-9);
    EXPECT_NEAR(p.rel_error, std::abs(p.model_us - p.step_us) / p.step_us, 1e-12);
  }
}

TEST(CostModelFit, NegativeInterceptIsPinnedAtZero) {
  // Points on a line through (0, -5): the unconstrained fit would give alpha < 0.
  CostModel m;
  for (double bytes : {1000.0, 2000.0, 4000.0}) m.points.push_back({bytes, 1, bytes * 0.01 - 5});
  fit_alpha_beta(m);
  EXPECT_EQ(m.alpha_us, 0);
  EXPECT_GT(m.beta_us_per_byte, 0);
}

TEST(CostModelFit, RejectsDegenerateInput) {
  CostModel one;
  one.points.push_back({64, 1, 10});
  EXPECT_THROW(fit_alpha_beta(one), std::invalid_argument);
  CostModel same;
  same.points = {{64, 1, 10}, {64, 1, 11}};
  EXPECT_THROW(fit_alpha_beta(same), std::invalid_argument);
  CostModel bad;
  bad.points = {{64, 1, 10}, {128, 1, 0}};
  EXPECT_THROW(fit_alpha_beta(bad), std::invalid_argument);
}

// Hand-computed step counts per direction for N = 2..8 (non-powers of two included).
TEST(CostModelSteps, MatchHandComputation) {
  struct Case {
    int n;
    int ring_allreduce;
    int gr_forward;
    int gr_backward;
  };
  for (const Case c : {Case{2, 2, 1, 0}, Case{3, 4, 1, 1}, Case{4, 6, 2, 1}, Case{5, 8, 2, 2},
                       Case{6, 10, 3, 2}, Case{7, 12, 3, 3}, Case{8, 14, 4, 3}}) {
    SCOPED_TRACE("n=" + std::to_string(c.n));
    const ModelGeometry g = geometry(c.n);
    const auto ring = schedule_plan(OpKind::kAllReduce, Schedule::kRing, 4000, 4, g);
    EXPECT_EQ(ring.forward_steps, c.ring_allreduce);
    EXPECT_EQ(ring.backward_steps, 0);
    const auto gr = schedule_plan(OpKind::kAllReduce, Schedule::kGatherReduce, 4000, 4, g);
    EXPECT_EQ(gr.forward_steps, c.gr_forward);
    EXPECT_EQ(gr.backward_steps, c.gr_backward);
    EXPECT_EQ(gr.chunk_bytes, 4000U);
    EXPECT_EQ(gr.reduced_bytes, static_cast<std::size_t>(c.n - 1) * 4000);
    const auto bi = schedule_plan(OpKind::kAllGather, Schedule::kBiGather, 100, 4, g);
    EXPECT_EQ(bi.forward_steps + bi.backward_steps, c.n - 1);
    EXPECT_EQ(schedule_plan(OpKind::kAllGather, Schedule::kRing, 100, 4, g).forward_steps, c.n - 1);
    EXPECT_EQ(schedule_plan(OpKind::kReduceScatter, Schedule::kRing, 100, 4, g).forward_steps,
              c.n - 1);
  }
  // Ring chunks round up to whole elements: 1003 floats over 5 ranks -> 201 floats a chunk.
  EXPECT_EQ(schedule_plan(OpKind::kAllReduce, Schedule::kRing, 4012, 4, geometry(5)).chunk_bytes,
            804U);
  EXPECT_THROW((void)schedule_plan(OpKind::kReduceScatter, Schedule::kBiGather, 8, 4, geometry(3)),
               std::invalid_argument);
}

TEST(CostModelSteps, PredictionsMatchHandComputation) {
  CostModel m;
  m.alpha_us = 10;
  m.beta_us_per_byte = 0.001;
  m.reduce_us_per_byte = 0.0001;
  // Ring, N=5, 4000 bytes: 8 steps of 800 bytes, 4 chunks of 800 reduced.
  EXPECT_NEAR(predict_us(m, OpKind::kAllReduce, Schedule::kRing, 4000, 4, geometry(5)),
              8 * 10 + 8 * 800 * 0.001 + 4 * 800 * 0.0001, 1e-9);
  // Gather-reduce, N=5: 2 steps each way (alphas overlap), 4 whole inputs out of each rank,
  // 4 reductions and one copy of 4000 bytes.
  EXPECT_NEAR(predict_us(m, OpKind::kAllReduce, Schedule::kGatherReduce, 4000, 4, geometry(5)),
              2 * 10 + 4 * 4000 * 0.001 + 5 * 4000 * 0.0001, 1e-9);
  // Ring, N=4, 64 MiB, 512 KiB slices: chunks of 16 MiB, 32 slices a step.
  const double mib = 1024.0 * 1024;
  EXPECT_NEAR(predict_us(m, OpKind::kAllReduce, Schedule::kRing, 64 << 20, 4, geometry(4)),
              6 * (32 * 10 + 16 * mib * 0.001) + 3 * 16 * mib * 0.0001, 1e-6);
  // Four channels: each carries a quarter of a chunk, 8 slices of 512 KiB.
  EXPECT_EQ(schedule_plan(OpKind::kAllReduce, Schedule::kRing, 64 << 20, 4, geometry(4, 4)).slices,
            8);
  // Broadcast, N=3, 1 MiB in 2 slices: a chain of 2 hops plus 1 slice of pipeline fill.
  EXPECT_NEAR(predict_us(m, OpKind::kBroadcast, Schedule::kChain, 1 << 20, 1, geometry(3)),
              3 * (10 + 512 * 1024 * 0.001), 1e-9);
}

// The model's shapes must be what ops.cc's plan() schedules.
TEST(CostModelSteps, AgreeWithPlan) {
  struct Kind {
    OpKind kind;
    Schedule schedule;
  };
  for (const Kind k :
       {Kind{OpKind::kAllReduce, Schedule::kRing},
        Kind{OpKind::kAllReduce, Schedule::kGatherReduce},
        Kind{OpKind::kReduceScatter, Schedule::kRing}, Kind{OpKind::kAllGather, Schedule::kRing},
        Kind{OpKind::kAllGather, Schedule::kBiGather}}) {
    for (int n : {2, 3, 5, 6, 8}) {
      for (int channels : {1, 3}) {
        for (std::size_t count : {1UL, 1000UL, 300000UL, 5000001UL}) {
          SCOPED_TRACE(std::string(to_string(k.kind)) + " " + to_string(k.schedule) +
                       " n=" + std::to_string(n) + " channels=" + std::to_string(channels) +
                       " count=" + std::to_string(count));
          Op op;
          op.kind = k.kind;
          op.schedule = k.schedule;
          op.dtype = DataType::kFloat32;
          op.user_count = count;
          SliceGeometryOptions geo;
          geo.channels = channels;
          geo.slice_bytes = 256 * 1024;
          plan(op, 0, n, geo);
          const auto p =
              schedule_plan(k.kind, k.schedule, count * 4, 4, geometry(n, channels, 256 * 1024));
          EXPECT_EQ(p.forward_steps, op.ring.send_steps[kForward]);
          EXPECT_EQ(p.backward_steps, op.ring.send_steps[kBackward]);
          EXPECT_EQ(p.slices, op.ring.slices);
        }
      }
    }
  }
}

TEST(CostModelSelect, ForcedChoicesAreHonoured) {
  CostModel latency;  // alpha dominates: gather_reduce predicted faster
  latency.alpha_us = 1000;
  latency.beta_us_per_byte = 1e-6;
  CostModel bandwidth;  // beta dominates: ring predicted faster
  bandwidth.alpha_us = 0.001;
  bandwidth.beta_us_per_byte = 1;
  const ModelGeometry g = geometry(6);
  const CostModel* const models[] = {&latency, &bandwidth, nullptr};
  for (const CostModel* m : models) {
    EXPECT_EQ(select_schedule(OpKind::kAllReduce, Algorithm::kRing, 64, 4, g, m, 1 << 20),
              Schedule::kRing);
    EXPECT_EQ(select_schedule(OpKind::kAllReduce, Algorithm::kGatherReduce, 64 << 20, 4, g, m, 0),
              Schedule::kGatherReduce);
    EXPECT_EQ(select_schedule(OpKind::kAllGather, Algorithm::kRing, 8, 4, g, m, 1 << 20),
              Schedule::kRing);
  }
  EXPECT_EQ(select_schedule(OpKind::kAllReduce, Algorithm::kAuto, 1 << 20, 4, g, &latency, 0),
            Schedule::kGatherReduce);
  EXPECT_EQ(select_schedule(OpKind::kAllReduce, Algorithm::kAuto, 65536, 4, g, &bandwidth, 1 << 20),
            Schedule::kRing);
}

TEST(CostModelSelect, AutoPicksThePredictedMinimum) {
  CostModel m;
  m.alpha_us = 10;
  m.beta_us_per_byte = 0.001;
  m.reduce_us_per_byte = 0.0002;
  int small = 0;
  int ring = 0;
  int within_margin = 0;
  for (int n = 2; n <= 8; ++n) {
    const ModelGeometry g = geometry(n);
    for (std::size_t bytes = 8; bytes <= (64U << 20); bytes *= 2) {
      const double r = predict_us(m, OpKind::kAllReduce, Schedule::kRing, bytes, 4, g);
      const double gr = predict_us(m, OpKind::kAllReduce, Schedule::kGatherReduce, bytes, 4, g);
      // The ring keeps a margin: another schedule must be predicted faster by more than it.
      const Schedule want =
          r > (1 + m.ring_margin) * gr ? Schedule::kGatherReduce : Schedule::kRing;
      EXPECT_EQ(select_schedule(OpKind::kAllReduce, Algorithm::kAuto, bytes, 4, g, &m, 0), want)
          << "n=" << n << " bytes=" << bytes;
      (want == Schedule::kRing ? ring : small)++;
      // Within the margin but faster: the ring still; with no margin, the faster one.
      if (gr < r && r <= (1 + m.ring_margin) * gr) {
        ++within_margin;
        CostModel exact = m;
        exact.ring_margin = 0;
        EXPECT_EQ(select_schedule(OpKind::kAllReduce, Algorithm::kAuto, bytes, 4, g, &exact, 0),
                  Schedule::kGatherReduce)
            << "n=" << n << " bytes=" << bytes;
      }
    }
  }
  EXPECT_GT(within_margin, 0);
  // The grid must exercise both outcomes, or the test proves nothing.
  EXPECT_GT(small, 0);
  EXPECT_GT(ring, 0);
  // By hand, N=2: the two schedules send the same bytes in the same one step... except that
  // ring splits it into two steps of half, so gather_reduce wins on alpha while it is cheap.
  EXPECT_EQ(select_schedule(OpKind::kAllReduce, Algorithm::kAuto, 64, 4, geometry(2), &m, 0),
            Schedule::kGatherReduce);
  EXPECT_EQ(
      select_schedule(OpKind::kAllReduce, Algorithm::kAuto, 64 << 20, 4, geometry(8), &m, 1 << 30),
      Schedule::kRing);
}

// Per-schedule latencies (calibrated from each schedule's 8-byte all_reduce) replace alpha for
// that schedule only, and auto then follows them.
TEST(CostModelSelect, PerScheduleAlphaDecidesSmallSizes) {
  CostModel m;
  m.alpha_us = 10;
  m.beta_us_per_byte = 0.001;
  ModelGeometry g = geometry(8);
  g.log_steps = true;
  // 8 ranks: ring 14 steps, gather_reduce 4, recursive doubling 3, halving-doubling and tree 6.
  EXPECT_EQ(latency_steps(OpKind::kAllReduce, Schedule::kRing, 8, 4, g), 14);
  EXPECT_EQ(latency_steps(OpKind::kAllReduce, Schedule::kGatherReduce, 8, 4, g), 4);
  EXPECT_EQ(latency_steps(OpKind::kAllReduce, Schedule::kRecursiveDoubling, 8, 4, g), 3);
  EXPECT_EQ(latency_steps(OpKind::kAllReduce, Schedule::kTree, 8, 4, g), 6);
  // With one alpha for all, the fewest steps win.
  EXPECT_EQ(select_schedule(OpKind::kAllReduce, Algorithm::kAuto, 8, 4, g, &m, 0),
            Schedule::kRecursiveDoubling);
  // A tree step measured at a third of the others' makes the tree cheapest.
  m.schedule_alpha_us = {{"recursive_doubling", 30},
                         {"tree", 10},
                         {"halving_doubling", 30},
                         {"gather_reduce", 30},
                         {"ring", 30}};
  EXPECT_DOUBLE_EQ(step_alpha_us(m, Schedule::kTree), 10);
  EXPECT_DOUBLE_EQ(step_alpha_us(m, Schedule::kBiGather), 30);  // gather_reduce's
  EXPECT_NEAR(predict_us(m, OpKind::kAllReduce, Schedule::kTree, 8, 4, g), 6 * 10 + 6 * 8 * 0.001,
              1e-9);
  EXPECT_EQ(select_schedule(OpKind::kAllReduce, Algorithm::kAuto, 8, 4, g, &m, 0), Schedule::kTree);
  // Large sizes are decided by bytes: between the ring and gather_reduce, the ring.
  g.log_steps = false;
  EXPECT_EQ(select_schedule(OpKind::kAllReduce, Algorithm::kAuto, 64 << 20, 4, g, &m, 0),
            Schedule::kRing);
  g.log_steps = true;
  // They survive the file.
  const CostModel back = parse_cost_model(to_json_text(m), "mem.json");
  EXPECT_EQ(back.schedule_alpha_us, m.schedule_alpha_us);
  EXPECT_THROW((void)parse_cost_model(R"({"alpha_us":1,"beta_us_per_byte":1,
                                           "schedule_alpha_us":{"tree":-1}})",
                                      "bad.json"),
               Error);
}

// Calibration times a size in between wherever the measured fastest schedule changes from
// one size to the next: the power of two nearest the geometric midpoint, only across gaps of
// at least a factor 4, smallest gaps first, at most as many as asked for.
TEST(CostModelFit, RefinementSizesSplitTheGapsWhereTheWinnerChanges) {
  const std::vector<std::size_t> sizes{8, 256, 4096, 1 << 20, 1 << 22, (1 << 22) + 4};
  // Two schedules; 'a' wins at 8, 256 and 1 MiB, 'b' at 4096 and from 4 MiB on.
  const auto at = [](std::initializer_list<double> us) {
    std::vector<ScheduleSample> v;
    for (const double t : us) {
      ScheduleSample s;
      s.measured_us = t;
      v.push_back(s);
    }
    return v;
  };
  const std::vector<std::vector<ScheduleSample>> samples{at({1, 2, 9, 100, 900, 901}),
                                                         at({2, 3, 8, 200, 800, 800})};
  // Gaps 256-4096 (midpoint 1024), 4096-1 MiB (65536) and 1-4 MiB (2 MiB) change winner;
  // 8-256 does not, and 4 MiB to 4 MiB + 4 is too narrow to split.
  EXPECT_EQ(refinement_sizes(sizes, samples, 8),
            (std::vector<std::size_t>{1024, 65536, std::size_t{1} << 21}));
  EXPECT_EQ(refinement_sizes(sizes, samples, 1), (std::vector<std::size_t>{1024}));
  EXPECT_TRUE(refinement_sizes(sizes, samples, 0).empty());
  EXPECT_TRUE(refinement_sizes(sizes, {samples[0]}, 8).empty());  // one schedule: no choice
}

// fit_schedule recovers a schedule's alpha and bandwidth multiplier from samples built with
// known ones (by hand, from the step counts and bandwidth parts), and auto follows the fit.
TEST(CostModelFit, ScheduleFitRecoversAlphaAndScale) {
  CostModel m;
  m.alpha_us = 10;
  m.beta_us_per_byte = 0.001;
  m.reduce_us_per_byte = 0.0002;
  ModelGeometry g = geometry(8);
  g.log_steps = true;
  constexpr double kAlpha = 17;
  constexpr double kScale = 2.5;
  std::vector<ScheduleSample> samples;
  for (const double bytes : {8.0, 4096.0, 65536.0, 1048576.0}) {
    const auto b = static_cast<std::size_t>(bytes);
    // Tree on 8 ranks, along rank 0: 3 reduce steps, 3 broadcast steps, each moving the whole
    // vector; a reduce step stages its operand and reduces it (2 passes); the input is read
    // where the output is not yet written, never copied.
    const double band = 6 * bytes * m.beta_us_per_byte + 3 * 2 * bytes * m.reduce_us_per_byte;
    ASSERT_NEAR(bandwidth_us(m, OpKind::kAllReduce, Schedule::kTree, b, 4, g), band,
                1e-9 * band + 1e-12);
    ScheduleSample s;
    s.bytes = bytes;
    s.measured_us = 6 * kAlpha + kScale * band;
    samples.push_back(s);
  }
  const double err = fit_schedule(m, Schedule::kTree, samples, 4, g);
  EXPECT_LT(err, 1e-9);
  EXPECT_NEAR(step_alpha_us(m, Schedule::kTree), kAlpha, 1e-6);
  EXPECT_NEAR(beta_scale(m, Schedule::kTree), kScale, 1e-9);
  EXPECT_DOUBLE_EQ(beta_scale(m, Schedule::kRing), 1);  // no entry: 1
  ASSERT_EQ(m.schedule_samples.at("tree").size(), 4U);
  EXPECT_NEAR(m.schedule_samples.at("tree")[3].model_us, samples[3].measured_us, 1e-6);
  // The prediction is the fitted line, at sizes not sampled too.
  const std::size_t b = 300000;
  EXPECT_NEAR(predict_us(m, OpKind::kAllReduce, Schedule::kTree, b, 4, g),
              6 * kAlpha + kScale * bandwidth_us(m, OpKind::kAllReduce, Schedule::kTree, b, 4, g),
              1e-6);
  // A multiplier that makes the tree's bytes dear hands large sizes to another schedule.
  m.schedule_beta_scale["tree"] = 100;
  EXPECT_NE(select_schedule(OpKind::kAllReduce, Algorithm::kAuto, 1 << 20, 4, g, &m, 0),
            Schedule::kTree);
  // Fits and samples survive the file; a negative multiplier is refused naming the field.
  m.ring_margin = 0.25;
  const CostModel back = parse_cost_model(to_json_text(m), "mem.json");
  EXPECT_DOUBLE_EQ(back.ring_margin, 0.25);
  EXPECT_EQ(back.schedule_beta_scale, m.schedule_beta_scale);
  ASSERT_EQ(back.schedule_samples.at("tree").size(), 4U);
  EXPECT_DOUBLE_EQ(back.schedule_samples.at("tree")[2].measured_us, samples[2].measured_us);
  try {
    (void)parse_cost_model(R"({"alpha_us":1,"beta_us_per_byte":1,
                               "schedule_beta_scale":{"ring":-2}})",
                           "bad.json");
    ADD_FAILURE() << "a negative multiplier was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("schedule_beta_scale"), std::string::npos) << e.what();
  }
  // Too few sizes.
  EXPECT_THROW((void)fit_schedule(m, Schedule::kTree, {samples[0]}, 4, g), std::invalid_argument);
}

// The size correction: measured / line at each sample, interpolated in log2(bytes), held
// beyond the ends; a prediction at a sample's size is then that sample's measurement.
TEST(CostModelFit, SizeCorrectionInterpolatesTheSamples) {
  CostModel m;
  m.alpha_us = 10;
  m.beta_us_per_byte = 0.001;
  ModelGeometry g = geometry(4);
  g.log_steps = true;
  EXPECT_DOUBLE_EQ(size_correction(m, Schedule::kRing, 4096), 1);  // no samples
  // Ring samples: 1 KiB measured at twice its line, 64 KiB at the line, 1 MiB at half.
  const auto line = [&](std::size_t b) {
    return latency_steps(OpKind::kAllReduce, Schedule::kRing, b, 4, g) * m.alpha_us +
           bandwidth_us(m, OpKind::kAllReduce, Schedule::kRing, b, 4, g);
  };
  for (const auto& [bytes, factor] : {std::pair{65536.0, 1.0}, {1024.0, 2.0}, {1048576.0, 0.5}}) {
    ScheduleSample s;
    s.bytes = bytes;
    s.model_us = line(static_cast<std::size_t>(bytes));
    s.measured_us = factor * s.model_us;
    m.schedule_samples["ring"].push_back(s);
  }
  // parse_cost_model sorts the samples by size (fit_schedule does too).
  m = parse_cost_model(to_json_text(m), "mem.json");
  EXPECT_DOUBLE_EQ(size_correction(m, Schedule::kRing, 8), 2);  // below the first
  EXPECT_DOUBLE_EQ(size_correction(m, Schedule::kRing, 1024), 2);
  EXPECT_NEAR(size_correction(m, Schedule::kRing, 8192), 1.5, 1e-12);  // 2^13: halfway 2^10..2^16
  EXPECT_NEAR(size_correction(m, Schedule::kRing, 262144), 0.75, 1e-12);
  EXPECT_DOUBLE_EQ(size_correction(m, Schedule::kRing, 1 << 26), 0.5);  // beyond the last
  EXPECT_DOUBLE_EQ(size_correction(m, Schedule::kTree, 8192), 1);       // another schedule
  EXPECT_NEAR(predict_us(m, OpKind::kAllReduce, Schedule::kRing, 1024, 4, g), 2 * line(1024), 1e-9);
  EXPECT_NEAR(predict_us(m, OpKind::kAllReduce, Schedule::kRing, 8192, 4, g), 1.5 * line(8192),
              1e-9);
  // reduce_scatter looks up its whole input: a 16 KiB block on 4 ranks is 64 KiB in all.
  const double rs_line =
      latency_steps(OpKind::kReduceScatter, Schedule::kRing, 16384, 4, g) * m.alpha_us +
      bandwidth_us(m, OpKind::kReduceScatter, Schedule::kRing, 16384, 4, g);
  EXPECT_NEAR(predict_us(m, OpKind::kReduceScatter, Schedule::kRing, 16384, 4, g), rs_line, 1e-9);
}

TEST(CostModelSelect, WithoutModelFromThreeRanksSmallOperationsUseLogSteps) {
  ModelGeometry g = geometry(8);
  g.log_steps = true;
  EXPECT_EQ(select_schedule(OpKind::kAllReduce, Algorithm::kAuto, 4096, 4, g, nullptr, 16384),
            Schedule::kTree);
  EXPECT_EQ(select_schedule(OpKind::kAllGather, Algorithm::kAuto, 512, 4, g, nullptr, 16384),
            Schedule::kRecursiveDoubling);
  EXPECT_EQ(select_schedule(OpKind::kReduceScatter, Algorithm::kAuto, 512, 4, g, nullptr, 16384),
            Schedule::kHalvingDoubling);
  EXPECT_EQ(select_schedule(OpKind::kAllReduce, Algorithm::kAuto, 1 << 20, 4, g, nullptr, 16384),
            Schedule::kRing);
  g = geometry(5);
  g.log_steps = true;
  EXPECT_EQ(select_schedule(OpKind::kAllReduce, Algorithm::kAuto, 4096, 4, g, nullptr, 16384),
            Schedule::kTree);
  for (const int n : {3, 4}) {
    g = geometry(n);
    g.log_steps = true;
    EXPECT_EQ(select_schedule(OpKind::kAllReduce, Algorithm::kAuto, 4096, 4, g, nullptr, 16384),
              Schedule::kTree)
        << n << " ranks";
  }
  // Two ranks: one peer, nothing for log steps to gain.
  g = geometry(2);
  g.log_steps = true;
  EXPECT_EQ(select_schedule(OpKind::kAllReduce, Algorithm::kAuto, 4096, 4, g, nullptr, 16384),
            Schedule::kGatherReduce);
  // Without mesh links, gather_reduce at any rank count.
  EXPECT_EQ(
      select_schedule(OpKind::kAllReduce, Algorithm::kAuto, 4096, 4, geometry(8), nullptr, 16384),
      Schedule::kGatherReduce);
}

TEST(CostModelSelect, WithoutModelKeepsTheThreshold) {
  const ModelGeometry g = geometry(4);
  EXPECT_EQ(select_schedule(OpKind::kAllReduce, Algorithm::kAuto, 16384, 4, g, nullptr, 16384),
            Schedule::kGatherReduce);
  EXPECT_EQ(select_schedule(OpKind::kAllReduce, Algorithm::kAuto, 16388, 4, g, nullptr, 16384),
            Schedule::kRing);
  // all_gather compares the whole output: 4 ranks x 4096 bytes.
  EXPECT_EQ(select_schedule(OpKind::kAllGather, Algorithm::kAuto, 4096, 4, g, nullptr, 16384),
            Schedule::kBiGather);
  EXPECT_EQ(select_schedule(OpKind::kAllGather, Algorithm::kAuto, 4100, 4, g, nullptr, 16384),
            Schedule::kRing);
  // A communicator-wide gather_reduce does not apply to all_gather: threshold as for kAuto.
  EXPECT_EQ(
      select_schedule(OpKind::kAllGather, Algorithm::kGatherReduce, 4100, 4, g, nullptr, 16384),
      Schedule::kRing);
}

TEST(CostModelSelect, WithoutModelMediumAllReducesHalveAndDoubleFromFourRanks) {
  constexpr std::size_t kSmall = 16384;
  constexpr std::size_t kMedium = 1 << 20;
  ModelGeometry g = geometry(4);
  g.log_steps = true;
  // Up to the small threshold the small schedule, then halving + doubling up to the medium one
  // (inclusive), then the ring.
  EXPECT_EQ(
      select_schedule(OpKind::kAllReduce, Algorithm::kAuto, kSmall, 4, g, nullptr, kSmall, kMedium),
      Schedule::kTree);
  EXPECT_EQ(select_schedule(OpKind::kAllReduce, Algorithm::kAuto, kSmall + 4, 4, g, nullptr, kSmall,
                            kMedium),
            Schedule::kHalvingDoubling);
  EXPECT_EQ(select_schedule(OpKind::kAllReduce, Algorithm::kAuto, kMedium, 4, g, nullptr, kSmall,
                            kMedium),
            Schedule::kHalvingDoubling);
  EXPECT_EQ(select_schedule(OpKind::kAllReduce, Algorithm::kAuto, kMedium + 4, 4, g, nullptr,
                            kSmall, kMedium),
            Schedule::kRing);
  // A forced ring, 0 as the medium threshold, fewer than 4 ranks and a communicator without
  // mesh links keep the ring.
  EXPECT_EQ(
      select_schedule(OpKind::kAllReduce, Algorithm::kRing, 65536, 4, g, nullptr, kSmall, kMedium),
      Schedule::kRing);
  EXPECT_EQ(select_schedule(OpKind::kAllReduce, Algorithm::kAuto, 65536, 4, g, nullptr, kSmall, 0),
            Schedule::kRing);
  EXPECT_EQ(select_schedule(OpKind::kAllGather, Algorithm::kAuto, 8192, 4, g, nullptr, kSmall, 0),
            Schedule::kRing);
  ModelGeometry three = geometry(3);
  three.log_steps = true;
  EXPECT_EQ(select_schedule(OpKind::kAllReduce, Algorithm::kAuto, 65536, 4, three, nullptr, kSmall,
                            kMedium),
            Schedule::kRing);
  EXPECT_EQ(select_schedule(OpKind::kAllReduce, Algorithm::kAuto, 65536, 4, geometry(8), nullptr,
                            kSmall, kMedium),
            Schedule::kRing);
  // From 8 ranks the tree below the small threshold, halving + doubling above it.
  g = geometry(8);
  g.log_steps = true;
  EXPECT_EQ(
      select_schedule(OpKind::kAllReduce, Algorithm::kAuto, 4096, 4, g, nullptr, kSmall, kMedium),
      Schedule::kTree);
  EXPECT_EQ(
      select_schedule(OpKind::kAllReduce, Algorithm::kAuto, 65536, 4, g, nullptr, kSmall, kMedium),
      Schedule::kHalvingDoubling);
}

TEST(CostModelSelect, WithoutModelSmallAndMediumGathersAndScattersTakeLogStepsFromFourRanks) {
  constexpr std::size_t kSmall = 16384;
  constexpr std::size_t kMedium = 1 << 20;
  ModelGeometry g = geometry(4);
  g.log_steps = true;
  // `bytes` is one rank's block; the thresholds compare the whole buffer (4 blocks here).
  const auto pick = [&](OpKind kind, std::size_t block, const ModelGeometry& geo) {
    return select_schedule(kind, Algorithm::kAuto, block, 4, geo, nullptr, kSmall, kMedium);
  };
  // all_gather: recursive doubling from the smallest size up to the medium threshold.
  EXPECT_EQ(pick(OpKind::kAllGather, 64, g), Schedule::kRecursiveDoubling);
  EXPECT_EQ(pick(OpKind::kAllGather, kSmall / 4 + 4, g), Schedule::kRecursiveDoubling);
  EXPECT_EQ(pick(OpKind::kAllGather, kMedium / 4, g), Schedule::kRecursiveDoubling);
  EXPECT_EQ(pick(OpKind::kAllGather, kMedium / 4 + 4, g), Schedule::kRing);
  // reduce_scatter: halving up to a quarter of the medium threshold.
  EXPECT_EQ(pick(OpKind::kReduceScatter, 64, g), Schedule::kHalvingDoubling);
  EXPECT_EQ(pick(OpKind::kReduceScatter, kMedium / 16, g), Schedule::kHalvingDoubling);
  EXPECT_EQ(pick(OpKind::kReduceScatter, kMedium / 16 + 4, g), Schedule::kRing);
  // Three ranks: the log-step schedules for small operations only, the ring above them.
  ModelGeometry three = geometry(3);
  three.log_steps = true;
  EXPECT_EQ(pick(OpKind::kAllGather, 64, three), Schedule::kRecursiveDoubling);
  EXPECT_EQ(pick(OpKind::kAllGather, 65536, three), Schedule::kRing);
  EXPECT_EQ(pick(OpKind::kReduceScatter, 64, three), Schedule::kHalvingDoubling);
  EXPECT_EQ(pick(OpKind::kReduceScatter, 65536, three), Schedule::kRing);
  // Two ranks, or no mesh links: the two-way gather and the ring.
  ModelGeometry two = geometry(2);
  two.log_steps = true;
  EXPECT_EQ(pick(OpKind::kAllGather, 64, two), Schedule::kBiGather);
  EXPECT_EQ(pick(OpKind::kReduceScatter, 64, two), Schedule::kRing);
  EXPECT_EQ(pick(OpKind::kAllGather, 64, geometry(4)), Schedule::kBiGather);
  EXPECT_EQ(pick(OpKind::kReduceScatter, 4096, geometry(4)), Schedule::kRing);
  // Five ranks (folding in the one beyond a power of two) take them too.
  ModelGeometry five = geometry(5);
  five.log_steps = true;
  EXPECT_EQ(pick(OpKind::kAllGather, 4096, five), Schedule::kRecursiveDoubling);
  EXPECT_EQ(pick(OpKind::kReduceScatter, 4096, five), Schedule::kHalvingDoubling);
}

TEST(CostModelFile, JsonRoundTrip) {
  CostModel m = synthetic(9.25, 0.00125, 0.02);
  fit_alpha_beta(m);
  m.reduce_us_per_byte = 0.000125;
  m.transport = "tcp";
  m.ranks = 5;
  m.slice_bytes = 524288;
  const CostModel back = parse_cost_model(to_json_text(m), "mem.json");
  EXPECT_DOUBLE_EQ(back.alpha_us, m.alpha_us);
  EXPECT_DOUBLE_EQ(back.beta_us_per_byte, m.beta_us_per_byte);
  EXPECT_DOUBLE_EQ(back.reduce_us_per_byte, m.reduce_us_per_byte);
  EXPECT_DOUBLE_EQ(back.median_rel_error, m.median_rel_error);
  EXPECT_EQ(back.transport, "tcp");
  EXPECT_EQ(back.ranks, 5);
  EXPECT_EQ(back.slice_bytes, 524288U);
  ASSERT_EQ(back.points.size(), m.points.size());
  for (std::size_t i = 0; i < m.points.size(); ++i) {
    EXPECT_DOUBLE_EQ(back.points[i].bytes, m.points[i].bytes);
    EXPECT_EQ(back.points[i].slices, m.points[i].slices);
    EXPECT_DOUBLE_EQ(back.points[i].step_us, m.points[i].step_us);
    EXPECT_DOUBLE_EQ(back.points[i].rel_error, m.points[i].rel_error);
  }
}

std::string error_of(const std::string& text, const std::string& source) {
  try {
    (void)parse_cost_model(text, source);
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
    return e.what();
  }
  ADD_FAILURE() << "no error for " << text;
  return {};
}

TEST(CostModelFile, BadModelNamesFileAndField) {
  const std::string f = "models/bad.json";
  auto has = [](const std::string& msg, const std::string& part) {
    return msg.find(part) != std::string::npos;
  };
  std::string e = error_of(R"({"beta_us_per_byte": 0.001})", f);
  EXPECT_TRUE(has(e, f) && has(e, "'alpha_us'") && has(e, "missing")) << e;
  e = error_of(R"({"alpha_us": 5, "beta_us_per_byte": "fast"})", f);
  EXPECT_TRUE(has(e, f) && has(e, "'beta_us_per_byte'") && has(e, "not a number")) << e;
  e = error_of(R"({"alpha_us": -1, "beta_us_per_byte": 0.001})", f);
  EXPECT_TRUE(has(e, "'alpha_us'") && has(e, ">= 0")) << e;
  e = error_of(R"({"alpha_us": 0, "beta_us_per_byte": 0})", f);
  EXPECT_TRUE(has(e, "both 0")) << e;
  e = error_of(R"({"alpha_us": 5, "beta_us_per_byte": 0.1, "points": [{"bytes": 8}]})", f);
  EXPECT_TRUE(has(e, "'points'")) << e;
  e = error_of("{not json", f);
  EXPECT_TRUE(has(e, f) && has(e, "not valid JSON")) << e;
  e = error_of("[1, 2]", f);
  EXPECT_TRUE(has(e, "not a JSON object")) << e;
}

TEST(CostModelFile, LoadsAFileAndNamesAMissingOne) {
  const std::string path =
      testing::TempDir() + "cost_model_" + std::to_string(::getpid()) + ".json";
  {
    std::ofstream out(path);
    out << R"({"alpha_us": 4.5, "beta_us_per_byte": 0.0005})";
  }
  const CostModel m = load_cost_model(path);
  EXPECT_DOUBLE_EQ(m.alpha_us, 4.5);
  EXPECT_DOUBLE_EQ(m.beta_us_per_byte, 0.0005);
  EXPECT_EQ(m.reduce_us_per_byte, 0);
  std::remove(path.c_str());
  try {
    (void)load_cost_model(path);
    ADD_FAILURE() << "no error for a missing file";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(path), std::string::npos) << e.what();
  }
}

// Ranks as threads over loopback, each with its own options; returns each rank's failure.
std::vector<std::exception_ptr> run_with(const std::vector<CommOptions>& options,
                                         const std::function<void(Communicator&)>& fn) {
  const int n = static_cast<int>(options.size());
  const UniqueId id = UniqueId::create("127.0.0.1");
  std::vector<std::exception_ptr> errors(options.size());
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      try {
        auto comm =
            Communicator::create(Bootstrap::create(id, r, n), options[static_cast<std::size_t>(r)]);
        fn(*comm);
      } catch (...) {
        errors[static_cast<std::size_t>(r)] = std::current_exception();
      }
    });
  }
  for (auto& t : threads) t.join();
  return errors;
}

std::string message(const std::exception_ptr& e) {
  try {
    std::rethrow_exception(e);
  } catch (const std::exception& x) {
    return x.what();
  }
}

CommOptions latency_bound_model() {
  CommOptions o;
  o.timeout = std::chrono::seconds(20);
  o.alpha_us = 1000;  // alpha dominates: gather_reduce at 64 KiB, where the threshold says ring
  o.beta_us_per_byte = 1e-6;
  return o;
}

// The communicator chooses from its model: a rank with one and ranks without it pick different
// schedules for the same all_reduce, which every rank reports as a mismatch naming both.
TEST(CostModelCommunicator, AutoUsesTheModel) {
  CommOptions plain;
  plain.timeout = std::chrono::seconds(20);
  const auto errors = run_with({latency_bound_model(), plain, plain}, [](Communicator& c) {
    std::vector<float> v(16384, 1.0F);
    c.all_reduce(v.data(), v.data(), v.size(), DataType::kFloat32, ReduceOp::kSum).wait();
  });
  for (const auto& e : errors) {
    ASSERT_TRUE(e) << "a rank completed an all_reduce whose schedule the ranks disagreed on";
    const std::string m = message(e);
    EXPECT_NE(m.find("gather_reduce"), std::string::npos) << m;
    EXPECT_NE(m.find("mismatch"), std::string::npos) << m;
  }
}

// With the same model everywhere the choice agrees and results are right, forced or not.
TEST(CostModelCommunicator, SameModelEverywhereGivesCorrectResults) {
  const int n = 3;
  const auto errors =
      run_with(std::vector<CommOptions>(n, latency_bound_model()), [n](Communicator& c) {
        for (const Algorithm a : {Algorithm::kAuto, Algorithm::kRing, Algorithm::kGatherReduce}) {
          OpOptions o;
          o.algorithm = a;
          std::vector<float> v(16384, static_cast<float>(c.rank() + 1));
          c.all_reduce(v.data(), v.data(), v.size(), DataType::kFloat32, ReduceOp::kSum, o).wait();
          for (float x : v) ASSERT_EQ(x, static_cast<float>(n * (n + 1) / 2));
          std::vector<std::int32_t> mine(100, c.rank());
          std::vector<std::int32_t> all(100 * n, -1);
          c.all_gather(mine.data(), all.data(), 100, DataType::kInt32,
                       a == Algorithm::kGatherReduce ? OpOptions{} : o)
              .wait();
          for (int i = 0; i < 100 * n; ++i) ASSERT_EQ(all[static_cast<std::size_t>(i)], i / 100);
        }
      });
  for (const auto& e : errors) EXPECT_FALSE(e) << message(e);
}

TEST(CostModelCommunicator, BadModelFileFailsCreateNamingFileFieldAndRank) {
  const std::string path = testing::TempDir() + "bad_model_" + std::to_string(::getpid()) + ".json";
  {
    std::ofstream out(path);
    out << R"({"alpha_us": 3})";
  }
  CommOptions o;
  o.cost_model_file = path;
  const auto errors = run_with({o, o}, [](Communicator&) {});
  std::remove(path.c_str());
  for (int r = 0; r < 2; ++r) {
    ASSERT_TRUE(errors[static_cast<std::size_t>(r)]) << "rank " << r;
    const std::string m = message(errors[static_cast<std::size_t>(r)]);
    EXPECT_NE(m.find(path), std::string::npos) << m;
    EXPECT_NE(m.find("beta_us_per_byte"), std::string::npos) << m;
    EXPECT_NE(m.find("rank " + std::to_string(r)), std::string::npos) << m;
  }
}

}  // namespace
}  // namespace dear::collectives
