// dear-sim: simulated iteration time of DeAR and its baselines on N workers.
//
//   dear-sim --model resnet50 --workers 64 --net 10gbe [--json] [--trace out.json]
//            [--tune-threshold] [--optimizer-us-per-mparam X]
//
// --model takes a name from profiles/ or a profile path. Without --json it prints a table
// with each policy's iteration time, throughput, efficiency against the ideal-overlap bound
// and DeAR's speedup over it. --tune-threshold then tunes DeAR's fusion threshold as the
// reference DeAR does online (ThresholdTuner, 10 trials from 1 to 256 MiB, each a simulated
// run of the dear policy, the default 25 MiB among the first three) and compares the tuned
// threshold with the default. --optimizer-us-per-mparam charges the optimizer on the compute
// stream (SimConfig::optimizer_us_per_mparam), which is what dear_shard saves.
#include <CLI/CLI.hpp>
#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "dear/error.h"
#include "dear/scheduler/simulator.h"
#include "dear/scheduler/tuner.h"
#include "tools/tool_util.h"

namespace {

namespace ds = dear::scheduler;

#ifndef DEAR_PROFILES_DIR
#define DEAR_PROFILES_DIR "profiles"
#endif

using dear::tools::profile_path;
using dear::tools::split;

// The dear policy's simulated iteration time at each threshold the tuner proposes. The
// default threshold is one of the fixed first trials, so the tuned one is never worse.
ds::TuneResult tune_dear(const ds::Model& model, ds::SimConfig config) {
  ds::TunerOptions options;
  options.middle_bytes = ds::kDefaultThresholdBytes;
  return ds::tune_threshold(options, ds::kDefaultThresholdBytes,
                            [&](std::int64_t threshold) {
                              config.threshold_bytes = threshold;
                              return ds::simulate_named(model, "dear", config).iteration_s * 1e3;
                            },
                            {});
}

double mib(std::int64_t bytes) { return static_cast<double>(bytes) / (1 << 20); }

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"dear-sim: discrete-event simulation of DeAR and its baselines"};
  std::string model_name = "resnet50";
  std::string profiles = DEAR_PROFILES_DIR;
  std::string net_name = "10gbe";
  std::string policies_arg;
  std::string trace_file;
  std::string trace_policy = "dear";
  int workers = 64;
  int iterations = 3;
  double alpha_us = -1;
  double gbps = -1;
  double gap_us = -1;
  double op_overhead_us = -1;
  double wake_us = -1;
  double time_scale = 1;
  double param_scale = 1;
  double optimizer_us_per_mparam = 0;
  std::string engine = "policy";
  std::string slice = "";
  bool json_out = false;
  bool tune = false;
  app.add_option("--model,-m", model_name, "profile name in --profiles, or a profile file");
  app.add_option("--profiles", profiles, "folder of model profiles");
  app.add_option("--workers,-n", workers, "number of workers")->check(CLI::Range(1, 1 << 20));
  app.add_option("--net", net_name, "network: 10gbe or 100gib");
  app.add_option("--alpha-us", alpha_us, "override: latency per ring step, microseconds");
  app.add_option("--gbps", gbps, "override: payload bandwidth per link, Gb/s");
  app.add_option("--slice-bytes", slice, "override: engine slice size in bytes");
  app.add_option("--gap-us", gap_us, "override: sender-busy part of alpha, microseconds");
  app.add_option("--op-overhead-us", op_overhead_us,
                 "override: software cost of one operation beyond its steps, microseconds "
                 "(dear-train --calibrate measures it; default 0)");
  app.add_option("--wake-us", wake_us,
                 "override: a worker blocked in a wait goes on this long after the operation "
                 "ended, microseconds (dear-train --calibrate measures it; default 0)");
  app.add_option("--engine", engine,
                 "engine: policy (each policy's own), serial, or interleaved (dear's, for all)")
      ->check(CLI::IsMember({"policy", "serial", "interleaved"}));
  app.add_option("--time-scale", time_scale, "multiply every compute time by this (as dear-train)")
      ->check(CLI::PositiveNumber);
  app.add_option("--param-scale", param_scale,
                 "multiply every tensor's size by this (as dear-train)")
      ->check(CLI::PositiveNumber);
  app.add_option("--optimizer-us-per-mparam", optimizer_us_per_mparam,
                 "optimizer cost on the compute stream, microseconds per million parameters "
                 "updated (default 0: free)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--policies", policies_arg, "comma-separated subset of the policies");
  app.add_option("--iterations", iterations, "iterations simulated (>= 2)")
      ->check(CLI::Range(2, 100));
  app.add_option("--trace", trace_file, "write a Chrome trace of --trace-policy here");
  app.add_option("--trace-policy", trace_policy, "policy whose run --trace records");
  app.add_flag("--json", json_out, "print one JSON object instead of a table");
  app.add_flag("--tune-threshold", tune,
               "tune the dear policy's fusion threshold (Bayesian optimisation, 10 trials over "
               "1-256 MiB) and compare it with the default 25 MiB");
  CLI11_PARSE(app, argc, argv);

  try {
    auto net = ds::net_by_name(net_name);
    if (!net) throw dear::Error(dear::ErrorCode::kInvalidArgument, "--net: unknown " + net_name);
    if (alpha_us >= 0) net->alpha_s = alpha_us * 1e-6;
    if (gbps > 0) net->beta_s_per_byte = 8.0 / (gbps * 1e9);
    if (!slice.empty()) net->slice_bytes = std::stoll(slice);
    if (gap_us >= 0) net->gap_s = gap_us * 1e-6;
    if (op_overhead_us >= 0) net->op_overhead_s = op_overhead_us * 1e-6;
    if (wake_us >= 0) net->wake_s = wake_us * 1e-6;
    const ds::Model model = ds::scale_model(ds::load_model(profile_path(model_name, profiles)),
                                            time_scale, param_scale);
    ds::SimConfig config{*net, workers, iterations};
    config.optimizer_us_per_mparam = optimizer_us_per_mparam;
    config.engine = engine == "serial"        ? ds::EngineChoice::kSerial
                    : engine == "interleaved" ? ds::EngineChoice::kInterleaved
                                              : ds::EngineChoice::kPolicy;
    const std::vector<std::string> names =
        policies_arg.empty() ? ds::policy_names() : split(policies_arg);

    const double bound = ds::ideal_bound_s(model, config);
    std::map<std::string, double> iter;
    std::map<std::string, int> ops_per_iter;
    for (const auto& name : names) {
      const ds::SimResult r = ds::simulate_named(model, name, config);
      iter[name] = r.iteration_s;
      // The collectives of one iteration's gradients: the first iteration's, whose last
      // all-gathers go out during the second (at least two are simulated).
      ops_per_iter[name] = static_cast<int>(
          std::count_if(r.events.begin(), r.events.end(), [&](const ds::TraceEvent& e) {
            return e.kind == ds::EventKind::kComm && e.iteration == 0;
          }));
      if (!trace_file.empty() && name == trace_policy) {
        std::ofstream out(trace_file);
        ds::write_chrome_trace(r, model, out);
        if (!out) throw dear::Error(dear::ErrorCode::kSystem, "cannot write " + trace_file);
      }
    }
    const double samples = static_cast<double>(workers) * model.batch_size;
    std::optional<ds::TuneResult> tuning;
    if (tune) tuning = tune_dear(model, config);
    if (json_out) {
      nlohmann::ordered_json doc;
      doc["model"] = model.name;
      doc["workers"] = workers;
      doc["engine"] = engine;
      doc["net"] = {{"name", net->name},
                    {"alpha_us", net->alpha_s * 1e6},
                    {"gbps", 8.0 / net->beta_s_per_byte / 1e9},
                    {"gap_us", net->gap_s * 1e6},
                    {"op_overhead_us", net->op_overhead_s * 1e6},
                    {"wake_us", net->wake_s * 1e6},
                    {"slice_bytes", net->slice_bytes}};
      doc["compute_ms"] = (model.forward_s() + model.backward_s()) * 1e3;
      doc["optimizer_us_per_mparam"] = optimizer_us_per_mparam;
      doc["bound_ms"] = bound * 1e3;
      nlohmann::ordered_json pol = nlohmann::ordered_json::object();
      for (const auto& name : names) {
        pol[name] = {{"iter_ms", iter[name] * 1e3},
                     {"samples_per_s", samples / iter[name]},
                     {"efficiency", bound / iter[name]},
                     {"ops_per_iteration", ops_per_iter[name]}};
      }
      doc["policies"] = std::move(pol);
      if (tuning) {
        nlohmann::ordered_json trials = nlohmann::ordered_json::array();
        for (const auto& t : tuning->trials) {
          trials.push_back({{"threshold_bytes", t.threshold_bytes}, {"iter_ms", t.iter_ms}});
        }
        doc["tuned"] = {{"policy", "dear"},
                        {"threshold_bytes", tuning->threshold_bytes},
                        {"iter_ms", tuning->iter_ms},
                        {"default_threshold_bytes", ds::kDefaultThresholdBytes},
                        {"default_iter_ms", tuning->default_ms},
                        {"trials", std::move(trials)}};
      }
      std::cout << doc.dump(1) << "\n";
    } else {
      std::printf("%s, %d workers, %s (alpha %.1f us, %.2f Gb/s): compute %.1f ms, bound %.1f ms\n",
                  model.name.c_str(), workers, net->name.c_str(), net->alpha_s * 1e6,
                  8.0 / net->beta_s_per_byte / 1e9, (model.forward_s() + model.backward_s()) * 1e3,
                  bound * 1e3);
      std::printf("%-14s %10s %12s %10s %12s\n", "policy", "iter_ms", "samples/s", "eff",
                  "dear_speedup");
      const bool have_dear = iter.count("dear") != 0;
      for (const auto& name : names) {
        std::printf("%-14s %10.2f %12.1f %10.3f", name.c_str(), iter[name] * 1e3,
                    samples / iter[name], bound / iter[name]);
        if (have_dear) std::printf(" %11.3fx", iter[name] / iter["dear"]);
        std::printf("\n");
      }
      if (tuning) {
        std::printf("\ntuning dear's fusion threshold (%zu trials):\n", tuning->trials.size());
        int i = 0;
        for (const auto& t : tuning->trials) {
          std::printf("  trial %2d: threshold %8.2f MiB  iter %10.2f ms\n", ++i,
                      mib(t.threshold_bytes), t.iter_ms);
        }
        std::printf("dear at the default %.0f MiB: %.2f ms; tuned %.2f MiB: %.2f ms (%.3fx)\n",
                    mib(ds::kDefaultThresholdBytes), tuning->default_ms,
                    mib(tuning->threshold_bytes), tuning->iter_ms,
                    tuning->default_ms / tuning->iter_ms);
      }
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "dear-sim: %s\n", e.what());
    return 1;
  }
  return 0;
}
