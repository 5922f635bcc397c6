// A rank program for the multi-process tests, started once per rank (by dear-run or by the
// test itself) with the launcher environment.
//
//   dear-test-worker ring ITERS        all_reduce / reduce_scatter / all_gather / broadcast,
//                                      each result checked; prints "ok" and exits 0
//   dear-test-worker die RANK ITERS    as ring, but RANK kills itself with SIGKILL in the
//                                      middle of iteration ITERS (after issuing an operation)
//   dear-test-worker kill RANK POINT ITERS
//                                      RANK kills itself at POINT: boot (before joining the
//                                      rendezvous), link (joined, before the links are made),
//                                      mid (as die) or between (after iteration ITERS, before
//                                      the next one)
//   dear-test-worker slow ITERS MS     as ring with small operations, sleeping MS between
//                                      iterations; prints "ready" once connected
//
// On a dear::Error it prints "error code=<n> peer=<p> <what>" and exits 3.
#include <signal.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "dear/bootstrap.h"
#include "dear/communicator.h"

namespace {

struct Plan {
  int victim = -1;    // rank that kills itself, or -1
  std::string point;  // boot, link, mid, between
  int iters = 0;
  int sleep_ms = 0;
  std::size_t count = 1 << 18;
};

void die_if(const Plan& p, int rank, const char* point) {
  if (rank == p.victim && p.point == point) ::raise(SIGKILL);
}

int run(int argc, char** argv) {
  const char* usage =
      "usage: dear-test-worker ring ITERS | die RANK ITERS | kill RANK POINT ITERS | "
      "slow ITERS MS\n";
  if (argc < 3) {
    std::fprintf(stderr, "%s", usage);
    return 2;
  }
  const std::string mode = argv[1];
  Plan p;
  if (mode == "ring") {
    p.iters = std::atoi(argv[2]);
  } else if (mode == "die" && argc >= 4) {
    p.victim = std::atoi(argv[2]);
    p.point = "mid";
    p.iters = std::atoi(argv[3]);
  } else if (mode == "kill" && argc >= 5) {
    p.victim = std::atoi(argv[2]);
    p.point = argv[3];
    p.iters = std::atoi(argv[4]);
  } else if (mode == "slow" && argc >= 4) {
    p.iters = std::atoi(argv[2]);
    p.sleep_ms = std::atoi(argv[3]);
    p.count = 1024;
  } else {
    std::fprintf(stderr, "%s", usage);
    return 2;
  }
  const int env_rank =
      std::getenv("DEAR_RANK") != nullptr ? std::atoi(std::getenv("DEAR_RANK")) : -1;
  die_if(p, env_rank, "boot");
  auto boot = dear::Bootstrap::from_env();
  die_if(p, boot->rank(), "link");
  auto comm = dear::Communicator::create_from_env(std::move(boot));
  const int r = comm->rank();
  const int n = comm->size();
  std::printf("ready rank %d\n", r);
  std::fflush(stdout);
  const std::size_t count = p.count;
  // "between" kills after the last checked iteration, so that one more is issued after it.
  const int iters = p.point == "between" ? p.iters + 1 : p.iters;
  std::vector<float> a(count * static_cast<std::size_t>(n));
  std::vector<float> b(count * static_cast<std::size_t>(n));
  for (int it = 0; it < iters; ++it) {
    if (p.point == "between" && it == p.iters) die_if(p, r, "between");
    for (std::size_t i = 0; i < count; ++i)
      a[i] = static_cast<float>((i + static_cast<std::size_t>(r + it)) % 5);
    auto w =
        comm->all_reduce(a.data(), b.data(), count, dear::DataType::kFloat32, dear::ReduceOp::kSum);
    if (it == iters - 1) die_if(p, r, "mid");
    w.wait();
    for (std::size_t i = 0; i < count; ++i) {
      float want = 0;
      for (int q = 0; q < n; ++q)
        want += static_cast<float>((i + static_cast<std::size_t>(q + it)) % 5);
      if (b[i] != want) {
        std::printf("wrong all_reduce element %zu: %f != %f\n", i, static_cast<double>(b[i]),
                    static_cast<double>(want));
        return 1;
      }
    }
    comm->reduce_scatter(b.data(), a.data(), count / static_cast<std::size_t>(n),
                         dear::DataType::kFloat32, dear::ReduceOp::kMax)
        .wait();
    comm->all_gather(a.data(), b.data(), count / static_cast<std::size_t>(n),
                     dear::DataType::kFloat32)
        .wait();
    comm->broadcast(b.data(), a.data(), count, dear::DataType::kFloat32, it % n).wait();
    comm->barrier().wait();
    if (p.sleep_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(p.sleep_ms));
  }
  std::printf("ok rank %d\n", r);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const dear::Error& e) {
    std::printf("error code=%d peer=%d %s\n", static_cast<int>(e.code()), e.peer(), e.what());
    return 3;
  }
}
