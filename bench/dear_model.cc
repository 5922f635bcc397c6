// dear-model: what the cost model predicts, without running anything.
//
//   dear-model --model alpha_beta.json --ranks 2,4,8 -b 8 -e 64M -f 4 [--csv out.csv]
//   dear-model --model alpha_beta.json --ranks 2..1024 -b 8 -e 1M -f 8
//
// One row per rank count, all_reduce size and schedule (ring, gather_reduce, and, unless
// --no-log-steps, halving_doubling, recursive_doubling and tree) with the predicted time, plus
// the schedule kAuto would pick from the same model: the model lines of
// scripts/latency-study.sh's plots and the "predicted" column of scripts/check-auto.sh.
// Rank counts need not be ones this machine can run: the rows are the model's, not
// measurements, which is how the study extends its curves to 1024 workers.
#include <CLI/CLI.hpp>
#include <algorithm>
#include <cstdio>
#include <exception>
#include <fstream>
#include <string>
#include <vector>

#include "collectives/cost_model.h"
#include "common/env.h"
#include "dear/communicator.h"

namespace {

using dear::collectives::OpKind;
using dear::collectives::Schedule;

int run(int argc, char** argv) {
  CLI::App app{"dear-model: predicted all_reduce times from a dear-bench --calibrate model"};
  std::string model_path;
  std::string ranks_text = "2,4,8";
  std::string min = "8";
  std::string max = "64M";
  std::uint64_t factor = 4;
  std::string slice;
  int channels = 0;
  std::string csv_path;
  bool no_log_steps = false;
  app.add_option("--model", model_path, "Model file (dear-bench --calibrate --json)")->required();
  app.add_option("--ranks", ranks_text,
                 "Rank counts, comma-separated; A..B is every power of two times A from A to B, "
                 "e.g. 2,3,4 or 2..1024 or 3,5..40");
  app.add_option("-b,--minbytes", min, "Smallest size (K/M/G suffixes)");
  app.add_option("-e,--maxbytes", max, "Largest size");
  app.add_option("-f,--stepfactor", factor, "Multiply the size by this each step")
      ->check(CLI::Range(std::uint64_t{2}, std::uint64_t{1} << 20));
  app.add_option("--slice", slice, "Pipelining slice size; default DEAR_SLICE_BYTES or 512K");
  app.add_option("--channels", channels, "Channels; default DEAR_CHANNELS or 1")
      ->check(CLI::Range(1, 16));
  app.add_option("--csv", csv_path, "Write the rows to FILE instead of stdout");
  app.add_flag("--no-log-steps", no_log_steps,
               "Model a communicator without mesh links: ring and gather_reduce only");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  std::vector<int> ranks;
  const auto parse_rank = [](const std::string& item) -> int {
    const auto n = dear::env::parse_bytes(item);  // a plain number
    if (item.empty() || item.find_first_not_of("0123456789") != item.npos || !n || *n < 2 ||
        *n > (1U << 20)) {
      return 0;
    }
    return static_cast<int>(*n);
  };
  for (std::size_t at = 0; at <= ranks_text.size();) {
    const std::size_t end = std::min(ranks_text.find(',', at), ranks_text.size());
    const std::string item = ranks_text.substr(at, end - at);
    at = end + 1;
    const std::size_t dots = item.find("..");
    const int first = parse_rank(item.substr(0, dots));
    const int last = dots == item.npos ? first : parse_rank(item.substr(dots + 2));
    if (first == 0 || last < first) {
      std::fprintf(stderr,
                   "dear-model: --ranks: '%s' is not a rank count >= 2 or a range A..B with "
                   "2 <= A <= B\n",
                   item.c_str());
      return 2;
    }
    for (long long n = first; n <= last; n *= 2) ranks.push_back(static_cast<int>(n));
  }
  const auto lo = dear::env::parse_bytes(min);
  const auto hi = dear::env::parse_bytes(max);
  if (!lo || !hi || *lo == 0 || *hi < *lo) {
    std::fprintf(stderr, "dear-model: -b '%s' and -e '%s' must be sizes with 0 < b <= e\n",
                 min.c_str(), max.c_str());
    return 2;
  }
  const dear::CommOptions options = dear::apply_env(dear::CommOptions{});
  dear::collectives::ModelGeometry g;
  g.channels = channels > 0 ? channels : options.channels;
  g.slice_bytes = options.slice_bytes;
  g.log_steps = !no_log_steps;
  if (!slice.empty()) {
    const auto s = dear::env::parse_bytes(slice);
    if (!s) {
      std::fprintf(stderr, "dear-model: --slice '%s' is not a size\n", slice.c_str());
      return 2;
    }
    g.slice_bytes = *s;
  }
  const auto model = dear::collectives::load_cost_model(model_path);
  std::string text = "nranks,size,algo,predicted_us,auto_choice\n";
  constexpr std::size_t kEl = 4;  // float, as dear-bench's default
  for (const int n : ranks) {
    g.nranks = n;
    for (std::uint64_t bytes = *lo; bytes <= *hi; bytes *= factor) {
      const std::size_t b = bytes / kEl * kEl;
      const Schedule pick = dear::collectives::select_schedule(
          OpKind::kAllReduce, dear::Algorithm::kAuto, b, kEl, g, &model, 0);
      for (const Schedule s : {Schedule::kRing, Schedule::kGatherReduce, Schedule::kHalvingDoubling,
                               Schedule::kRecursiveDoubling, Schedule::kTree}) {
        if (!g.log_steps && s != Schedule::kRing && s != Schedule::kGatherReduce) continue;
        const double t = dear::collectives::predict_us(model, OpKind::kAllReduce, s, b, kEl, g);
        text += std::to_string(n) + "," + std::to_string(b) + "," + to_string(s) + "," +
                std::to_string(t) + "," + to_string(pick) + "\n";
      }
    }
  }
  if (csv_path.empty()) {
    std::fputs(text.c_str(), stdout);
  } else {
    std::ofstream f(csv_path, std::ios::trunc);
    f << text;
    if (!f.flush()) {
      std::fprintf(stderr, "dear-model: cannot write '%s'\n", csv_path.c_str());
      return 1;
    }
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "dear-model: %s\n", e.what());
    return 1;
  }
}
