// dear-tcp-ring: what the bytes of a ring collective cost over plain TCP sockets on this host,
// with no collective library on top: the transport's own cost, next to which dear's TCP link and
// its peers can be read.
//
//   dear-run -n 4 dear-tcp-ring [--all-reduce 1M | --all-gather 64M | -s BYTES]
//                               [--iters 20] [--warmup 3] [--rounds 3] [--json FILE]
//
// Rank r streams messages to rank r + 1 and receives as many from rank r - 1, all ranks at
// once, one connection per direction, blocking send()/recv() of up to 1 MiB per call, a sending
// thread next to the receiving one. --all-reduce S sends 2(N-1)/N * S bytes per rank per
// iteration, what any bandwidth-optimal all_reduce of S bytes must move out of (and into) every
// rank; --all-gather S (also a reduce_scatter's input size) (N-1)/N * S. The ranks stream
// these back to back: no step waits for another and nothing is reduced. It is a reference, not
// a lower bound: a library that schedules its sockets from one thread can still be faster
// (dear's all_reduce is, at 64 MiB on 4 ranks of a 2-core host). Each message is checked on
// arrival (stream.h). Time runs from the arrival of the last warm-up message to that of the
// last timed one, on the slowest rank; with --rounds the median round is the figure.
#include <CLI/CLI.hpp>
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "common/env.h"
#include "common/stats.h"
#include "dear/bootstrap.h"
#include "dear/error.h"
#include "report.h"
#include "stream.h"

namespace dear::bench {
namespace {

constexpr const char* kTool = "dear-tcp-ring";

struct Args {
  std::uint64_t bytes = 0;       // per rank per iteration, each way
  std::uint64_t all_reduce = 0;  // the collective size it stands for (0: none)
  std::uint64_t all_gather = 0;
  int iters = 20;
  int warmup = 3;
  int rounds = 3;
  std::string json_path;
};

int run(int argc, char** argv) {
  CLI::App app{
      "dear-tcp-ring: the ranks stream a ring collective's bytes around a ring of plain TCP "
      "connections, no library on top (what the transport alone costs)"};
  Args args;
  auto* s_opt = add_bytes_flag(app, "-s,--size", args.bytes,
                               "Bytes each rank sends (and receives) per iteration", true);
  auto* ar_opt = add_bytes_flag(
      app, "--all-reduce", args.all_reduce,
      "Stream what an all_reduce of this many bytes must move: 2(N-1)/N of it", true);
  auto* ag_opt =
      add_bytes_flag(app, "--all-gather", args.all_gather,
                     "Stream what an all_gather (or a reduce_scatter) of this many bytes "
                     "must move: (N-1)/N of it",
                     true);
  s_opt->excludes(ar_opt)->excludes(ag_opt);
  ar_opt->excludes(ag_opt);
  app.add_option("--iters", args.iters, "Timed iterations per round")
      ->check(CLI::Range(1, 1 << 24))
      ->capture_default_str();
  app.add_option("--warmup", args.warmup,
                 "Untimed iterations before the timed ones (the clock starts when the last of "
                 "them has arrived)")
      ->check(CLI::Range(1, 1 << 24))
      ->capture_default_str();
  app.add_option("--rounds", args.rounds, "Rounds; the median one is the figure")
      ->check(CLI::Range(1, 1000))
      ->capture_default_str();
  app.add_option("--json", args.json_path, "Also write the result to this JSON file (rank 0)");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }

  auto boot = Bootstrap::from_env();
  const int n = boot->size();
  if (n < 2) {
    std::fprintf(stderr, "%s: needs at least 2 ranks (got %d)\n", kTool, n);
    return 2;
  }
  const auto ranks = static_cast<std::uint64_t>(n);
  std::string stands_for = "-s";
  if (args.all_reduce > 0) {
    args.bytes = args.all_reduce * 2 * (ranks - 1) / ranks;
    stands_for = "all_reduce of " + std::to_string(args.all_reduce) + " B";
  } else if (args.all_gather > 0) {
    args.bytes = args.all_gather * (ranks - 1) / ranks;
    stands_for = "all_gather of " + std::to_string(args.all_gather) + " B";
  } else if (args.bytes == 0) {
    args.bytes = 2ULL << 20;
  }
  if (args.bytes < 2 * stream::kStamp) {
    // Every rank says it (see flags_valid in report.h).
    std::fprintf(stderr, "%s: rank %d: %llu bytes per rank is too few; at least %zu\n", kTool,
                 boot->rank(), static_cast<unsigned long long>(args.bytes), 2 * stream::kStamp);
    return 2;
  }

  std::unique_ptr<stream::TcpStream> ring;
  if (!stream::all_ok(*boot, kTool, [&] {
        ring = std::make_unique<stream::TcpStream>(args.bytes, boot->rank());
      })) {
    return 1;
  }
  if (!stream::connect_ring(*boot, kTool, *ring)) return 1;

  const auto warmup = static_cast<std::uint64_t>(args.warmup);
  const auto iters = static_cast<std::uint64_t>(args.iters);
  std::vector<double> us_per_iter;
  for (int r = 0; r < args.rounds; ++r) {
    boot->barrier();
    double seconds = 0;
    if (!stream::all_ok(*boot, kTool,
                        [&] { seconds = ring->run(true, true, warmup + iters, warmup); })) {
      return 1;
    }
    us_per_iter.push_back(stream::max_over_ranks(*boot, seconds) * 1e6 /
                          static_cast<double>(iters));
  }
  const double med = median(us_per_iter);
  const double gbps = static_cast<double>(args.bytes) / (med * 1e3);
  if (boot->rank() == 0) {
    std::printf(
        "# %s: %d ranks in a ring over 127.0.0.1, %llu B per rank per iteration each way "
        "(%s), %d timed after %d warm-up, %d round(s); GB = 1e9 bytes\n",
        kTool, n, static_cast<unsigned long long>(args.bytes), stands_for.c_str(), args.iters,
        args.warmup, args.rounds);
    std::printf("# round  us/iter\n");
    for (std::size_t r = 0; r < us_per_iter.size(); ++r) {
      std::printf("%7zu  %.1f\n", r, us_per_iter[r]);
    }
    std::printf(
        "median %.1f us per iteration, %.3f GB/s per rank each way, %.3f GB/s through "
        "loopback in all\n",
        med, gbps, gbps * n);
    if (!args.json_path.empty()) {
      nlohmann::json j;
      j["tool"] = kTool;
      j["ranks"] = n;
      j["bytes_per_rank"] = args.bytes;
      j["all_reduce_bytes"] = args.all_reduce;
      j["all_gather_bytes"] = args.all_gather;
      j["iters"] = args.iters;
      j["warmup"] = args.warmup;
      j["rounds_us"] = us_per_iter;
      j["median_us"] = med;
      j["gbps_per_rank"] = gbps;
      std::ofstream f(args.json_path, std::ios::trunc);
      f << j.dump(2) << '\n';
      if (!f.flush())
        throw Error(ErrorCode::kSystem, "--json: cannot write '" + args.json_path + "'");
    }
  }
  boot->barrier();
  return 0;
}

}  // namespace
}  // namespace dear::bench

int main(int argc, char** argv) {
  return dear::bench::tool_main("dear-tcp-ring", dear::bench::run, argc, argv);
}
