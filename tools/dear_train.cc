// dear-train: training iterations of a model profile on real collectives.
//
//   dear-run -n 4 dear-train --model resnet50 --policy dear --time-scale 0.1
//   mpirun -np 4 dear-train --backend mpi --model resnet50 --policy dear --time-scale 0.1
//   dear-run -n 4 dear-train --backend nccl ...   (one CUDA device per rank)
//
// Each rank replays the profile's compute (sleeping or busy), issues the policy's collectives
// on a dear::Communicator, applies SGD to synthetic gradients where the policy says, and rank 0
// prints each policy's iteration time (mean and median after warm-up) and throughput. See
// include/dear/scheduler/replay.h for what exactly runs.
//
// --tune-threshold N then tunes the dear policy's fusion threshold online, as the reference
// DeAR does: N replays (each --warmup + --iterations iterations) at the thresholds a
// ThresholdTuner proposes (1 MiB, 256 MiB and the default 25 MiB first), each measured as the
// median iteration time, the maximum over ranks so that every rank feeds the tuner the same
// value and proposes the same next threshold; then the default and the tuned threshold are
// measured once more, back to back.
#include <CLI/CLI.hpp>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "dear/bootstrap.h"
#include "dear/communicator.h"
#include "dear/error.h"
#include "dear/scheduler/replay.h"
#include "dear/scheduler/simulator.h"
#include "dear/scheduler/tuner.h"
#include "scheduler/mpi_comm.h"
#include "scheduler/nccl_comm.h"
#include "tools/tool_util.h"

namespace {

namespace ds = dear::scheduler;

#ifndef DEAR_PROFILES_DIR
#define DEAR_PROFILES_DIR "profiles"
#endif

using dear::tools::profile_path;
using dear::tools::split;

double mib(std::int64_t bytes) { return static_cast<double>(bytes) / (1 << 20); }

// The dear policy's median iteration time at a threshold, in ms: the largest over ranks, so
// that every rank returns the same value.
double dear_p50_ms(dear::Communicator& comm, const ds::Model& model, ds::ReplayOptions options,
                   std::int64_t threshold) {
  options.threshold_bytes = threshold;
  options.record_trace = false;
  options.progress = nullptr;
  double ms = ds::replay(comm, model, "dear", options).p50_s * 1e3;
  comm.all_reduce(&ms, &ms, 1, dear::DataType::kFloat64, dear::ReduceOp::kMax).wait();
  return ms;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"dear-train: DeAR and its baselines on real collectives, compute replayed"};
  std::string model_name = "resnet50";
  std::string profiles = DEAR_PROFILES_DIR;
  std::string policy_arg = "dear";
  std::string compute = "sleep";
  std::string net_name = "10gbe";
  std::string algo = "auto";
  std::string backend = "dear";
  std::string json_file;
  std::string trace_file;
  std::string trace_policy = "dear";
  double time_scale = 1;
  double param_scale = 1;
  double alpha_us = -1;
  double gbps = -1;
  bool calibrate = false;
  int tune_trials = 0;
  ds::ReplayOptions options;
  app.add_option("--model,-m", model_name, "profile name in --profiles, or a profile file");
  app.add_option("--profiles", profiles, "folder of model profiles");
  app.add_option("--policy,-p", policy_arg, "a policy, a comma-separated list, or 'all'");
  app.add_option("--warmup,-w", options.warmup, "iterations before timing (>= 1)")
      ->check(CLI::Range(1, 1000));
  app.add_option("--iterations,-i", options.iterations, "timed iterations")
      ->check(CLI::Range(1, 100000));
  app.add_option("--time-scale", time_scale, "multiply every compute time by this")
      ->check(CLI::PositiveNumber);
  app.add_option("--param-scale", param_scale, "multiply every tensor's size by this")
      ->check(CLI::PositiveNumber);
  app.add_option("--compute", compute, "compute replay: sleep, busy or none")
      ->check(CLI::IsMember({"sleep", "busy", "none"}));
  app.add_option("--lr", options.learning_rate, "SGD learning rate");
  app.add_option("--net", net_name, "network model the planning policies use: 10gbe or 100gib");
  app.add_option("--alpha-us", alpha_us, "override: latency per ring step, microseconds");
  app.add_option("--gbps", gbps, "override: payload bandwidth per link, Gb/s");
  app.add_flag("--calibrate", calibrate,
               "measure alpha and beta on this communicator first and plan with them");
  app.add_option("--algo", algo,
                 "all_reduce algorithm: auto, ring, gather_reduce, halving_doubling, "
                 "recursive_doubling or tree");
  app.add_option("--backend", backend,
                 "collectives library: dear (launch with dear-run), mpi (MPI-3 non-blocking "
                 "collectives, whole operation by whole operation; launch with mpirun) or nccl "
                 "(one CUDA device per rank; launch with dear-run)")
      ->check(CLI::IsMember({"dear", "mpi", "nccl"}));
  app.add_option("--json", json_file, "write the results as JSON here (rank 0)");
  app.add_option("--trace", trace_file, "write a Chrome trace of --trace-policy here (rank 0)");
  app.add_option("--trace-policy", trace_policy, "policy whose run --trace records");
  app.add_option("--tune-threshold", tune_trials,
                 "then tune the dear policy's fusion threshold online in N trials (Bayesian "
                 "optimisation over 1-256 MiB) and compare it with the default 25 MiB")
      ->check(CLI::Range(1, 100));
  CLI11_PARSE(app, argc, argv);

  int rank = -1;
  try {
    auto net = ds::net_by_name(net_name);
    if (!net) throw dear::Error(dear::ErrorCode::kInvalidArgument, "--net: unknown " + net_name);
    const auto algorithm = dear::parse_algorithm(algo);
    if (!algorithm) throw dear::Error(dear::ErrorCode::kInvalidArgument, "--algo: unknown " + algo);
    options.algorithm = *algorithm;
    options.compute = compute == "busy"   ? ds::ComputeMode::kBusy
                      : compute == "none" ? ds::ComputeMode::kNone
                                          : ds::ComputeMode::kSleep;
    const ds::Model model = ds::scale_model(ds::load_model(profile_path(model_name, profiles)),
                                            time_scale, param_scale);
    const std::vector<std::string> names =
        policy_arg == "all" ? ds::policy_names() : split(policy_arg);
    if (names.empty()) throw dear::Error(dear::ErrorCode::kInvalidArgument, "--policy: empty");

    std::unique_ptr<dear::Bootstrap> bootstrap;
    std::unique_ptr<dear::Communicator> comm;
    if (backend == "mpi") {
      comm = ds::make_mpi_communicator(dear::apply_env({}));
    } else if (backend == "nccl") {
      bootstrap = dear::Bootstrap::from_env();
      comm = ds::make_nccl_communicator(*bootstrap, dear::apply_env({}));
    } else {
      comm = dear::Communicator::create_from_env(dear::Bootstrap::from_env());
    }
    rank = comm->rank();
    const int n = comm->size();
    const bool lead = rank == 0;
    if (calibrate) {
      if (lead) std::fprintf(stderr, "dear-train: calibrating alpha and beta on %d ranks\n", n);
      *net = ds::calibrate_network(*comm);
    }
    if (alpha_us >= 0) net->alpha_s = alpha_us * 1e-6;
    if (gbps > 0) net->beta_s_per_byte = 8.0 / (gbps * 1e9);
    options.net = *net;

    if (lead) {
      std::printf(
          "%s x%g time, x%g params (%lld parameters), %d ranks, compute %s: "
          "compute %.2f ms/iteration\n",
          model.name.c_str(), time_scale, param_scale, static_cast<long long>(model.params()), n,
          compute.c_str(), (model.forward_s() + model.backward_s()) * 1e3);
      std::printf("network model for planning: %s, alpha %.1f us, %.3f Gb/s\n", net->name.c_str(),
                  net->alpha_s * 1e6, 8.0 / net->beta_s_per_byte / 1e9);
      std::printf("%-14s %10s %10s %12s %10s %10s\n", "policy", "mean_ms", "p50_ms", "samples/s",
                  "hooks_ms", "late_prio");
      std::fflush(stdout);
    }
    nlohmann::ordered_json results = nlohmann::ordered_json::object();
    for (const auto& name : names) {
      ds::ReplayOptions o = options;
      o.record_trace = lead && !trace_file.empty() && name == trace_policy;
      if (lead) {
        // One line when warm-up ends and one at the end (dear-run prefixes every line).
        o.progress = [&name, warmup = o.warmup](int done, int total, double last_s) {
          if (done != warmup && done != total) return;
          std::fprintf(stderr, "dear-train: %s %d/%d iterations (%s), last %.2f ms\n", name.c_str(),
                       done, total, done == total ? "done" : "warm-up done", last_s * 1e3);
        };
      }
      const ds::ReplayResult r = ds::replay(*comm, model, name, o);
      if (o.record_trace) {
        std::ofstream out(trace_file);
        ds::write_chrome_trace(r.trace, model, out);
        if (!out) throw dear::Error(dear::ErrorCode::kSystem, "cannot write " + trace_file);
      }
      if (!lead) continue;
      std::printf("%-14s %10.3f %10.3f %12.1f %10.3f %10d\n", name.c_str(), r.mean_s * 1e3,
                  r.p50_s * 1e3, r.samples_per_s, r.hooks_s * 1e3, r.late_priority_changes);
      std::fflush(stdout);
      std::vector<double> its_ms;
      for (double s : r.iteration_s) its_ms.push_back(s * 1e3);
      results[name] = {{"iter_ms_mean", r.mean_s * 1e3},
                       {"iter_ms_p50", r.p50_s * 1e3},
                       {"samples_per_s", r.samples_per_s},
                       {"hooks_ms", r.hooks_s * 1e3},
                       {"gradient_ms", r.gradient_s * 1e3},
                       {"optimizer_ms", r.optimizer_s * 1e3},
                       {"late_priority_changes", r.late_priority_changes},
                       {"iterations_ms", its_ms}};
    }
    nlohmann::ordered_json tuned;
    if (tune_trials > 0) {
      ds::TunerOptions to;
      to.trials = tune_trials;
      to.middle_bytes = ds::kDefaultThresholdBytes;  // measured among the first trials
      if (lead) {
        std::printf("\ntuning dear's fusion threshold (%d trials of %d+%d iterations):\n",
                    tune_trials, options.warmup, options.iterations);
        std::fflush(stdout);
      }
      nlohmann::ordered_json trials = nlohmann::ordered_json::array();
      const ds::TuneResult r = ds::tune_threshold(
          to, ds::kDefaultThresholdBytes,
          [&](std::int64_t threshold) { return dear_p50_ms(*comm, model, options, threshold); },
          [&](const ds::TunerTrial& t) {
            trials.push_back({{"threshold_bytes", t.threshold_bytes}, {"iter_ms", t.iter_ms}});
            if (lead) {
              std::printf("  trial %2zu: threshold %8.2f MiB  p50 %10.3f ms\n", trials.size(),
                          mib(t.threshold_bytes), t.iter_ms);
              std::fflush(stdout);
            }
          });
      const std::int64_t best = r.threshold_bytes;
      const double default_ms = r.default_ms;
      const double best_ms = r.iter_ms;
      if (lead) {
        std::printf(
            "dear at the default %.0f MiB: p50 %.3f ms; tuned %.2f MiB: p50 %.3f ms "
            "(%.3fx)\n",
            mib(ds::kDefaultThresholdBytes), default_ms, mib(best), best_ms, default_ms / best_ms);
        std::fflush(stdout);
      }
      tuned = {{"policy", "dear"},
               {"threshold_bytes", best},
               {"iter_ms", best_ms},
               {"default_threshold_bytes", ds::kDefaultThresholdBytes},
               {"default_iter_ms", default_ms},
               {"trials", std::move(trials)}};
    }
    if (lead && !json_file.empty()) {
      nlohmann::ordered_json doc;
      doc["model"] = model.name;
      doc["workers"] = n;
      doc["backend"] = backend;
      doc["time_scale"] = time_scale;
      doc["param_scale"] = param_scale;
      doc["params"] = model.params();
      doc["compute"] = compute;
      doc["compute_ms"] = (model.forward_s() + model.backward_s()) * 1e3;
      doc["warmup"] = options.warmup;
      doc["iterations"] = options.iterations;
      doc["net"] = {{"name", net->name},
                    {"alpha_us", net->alpha_s * 1e6},
                    {"gap_us", net->gap_s * 1e6},
                    {"op_overhead_us", net->op_overhead_s * 1e6},
                    {"wake_us", net->wake_s * 1e6},
                    {"gbps", 8.0 / net->beta_s_per_byte / 1e9},
                    {"slice_bytes", net->slice_bytes}};
      doc["policies"] = std::move(results);
      if (!tuned.is_null()) doc["tuned"] = std::move(tuned);
      std::ofstream out(json_file);
      out << doc.dump(1) << "\n";
      if (!out) throw dear::Error(dear::ErrorCode::kSystem, "cannot write " + json_file);
    }
  } catch (const std::exception& e) {
    if (rank >= 0) {
      std::fprintf(stderr, "dear-train (rank %d): %s\n", rank, e.what());
    } else {
      std::fprintf(stderr, "dear-train: %s\n", e.what());
    }
    return 1;
  }
  return 0;
}
