// Profile replay's reference (shared by the replay tests on dear's engine and on MPI): a tiny
// model with uneven layers, a network model for planning, and the final parameters of a
// single-process SGD on the averaged synthetic gradients, computed from the formulas in
// include/dear/scheduler/replay.h in double precision.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "dear/scheduler/model.h"
#include "dear/scheduler/network.h"

namespace dear::testing {

// Uneven layers, several tensors per layer, sizes that do not divide by 3 or 4 (padding).
inline dear::scheduler::Model tiny_model(double fwd_s, double bwd_s) {
  const std::vector<std::vector<std::int64_t>> tensors = {{300, 7}, {50},      {701, 3},
                                                          {20},     {401, 11}, {83}};
  dear::scheduler::Model m;
  m.name = "tiny";
  m.batch_size = 4;
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    m.layers.push_back({"l" + std::to_string(i), tensors[i], fwd_s, bwd_s});
  }
  return m;
}

inline dear::scheduler::NetModel loopback_net() {
  dear::scheduler::NetModel n;
  n.name = "test";
  n.alpha_s = 30e-6;
  n.gap_s = 30e-6;
  n.beta_s_per_byte = 1e-9;
  return n;
}

// The reference, written out from the formulas in replay.h, in double precision.
inline std::vector<double> reference_params(std::int64_t count, int ranks, int iterations,
                                            double lr) {
  std::vector<double> p(static_cast<std::size_t>(count));
  for (std::int64_t i = 0; i < count; ++i) {
    p[static_cast<std::size_t>(i)] = static_cast<double>((i * 37) % 101 - 50) / 128.0;
  }
  for (int k = 0; k < iterations; ++k) {
    for (std::int64_t i = 0; i < count; ++i) {
      double& x = p[static_cast<std::size_t>(i)];
      double sum = 0;
      for (int r = 0; r < ranks; ++r) {
        sum += 0.25 * x + static_cast<double>((i + 13 * k + 29 * r) % 61 - 30) / 64.0;
      }
      x -= lr * sum / ranks;
    }
  }
  return p;
}

// How many of a replay's final parameters miss the reference: fp32 sums in a collective's order
// against a double reference differ by a few ulps per step, so 2e-5 is the bound. The first
// five misses are reported as failures, each named by `what`.
inline int param_mismatches(const std::vector<float>& got, const std::vector<double>& ref,
                            const std::string& what) {
  if (got.size() != ref.size()) {
    ADD_FAILURE() << what << ": " << got.size() << " parameters, expected " << ref.size();
    return static_cast<int>(ref.size());
  }
  int wrong = 0;
  for (std::size_t i = 0; i < ref.size(); ++i) {
    if (std::fabs(static_cast<double>(got[i]) - ref[i]) > 2e-5 && ++wrong <= 5) {
      ADD_FAILURE() << what << " element " << i << ": got " << got[i] << ", expected " << ref[i];
    }
  }
  return wrong;
}

}  // namespace dear::testing
