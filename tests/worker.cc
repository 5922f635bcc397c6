// A rank program for the multi-process tests, started once per rank (by dear-run or by the
// test itself) with the launcher environment.
//
//   dear-test-worker ring ITERS        all_reduce / reduce_scatter / all_gather / broadcast,
//                                      each result checked; prints "ok" and exits 0
//   dear-test-worker die RANK ITERS    as ring, but RANK kills itself with SIGKILL in the
//                                      middle of iteration ITERS (after issuing an operation)
//
// On a dear::Error it prints "error code=<n> peer=<p> <what>" and exits 3.
#include <signal.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "dear/communicator.h"

namespace {

int run(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr, "usage: dear-test-worker ring ITERS | die RANK ITERS\n");
    return 2;
  }
  const std::string mode = argv[1];
  const int die_rank = mode == "die" ? std::atoi(argv[2]) : -1;
  const int iters = std::atoi(argv[mode == "die" ? 3 : 2]);
  auto comm = dear::Communicator::create_from_env(dear::Bootstrap::from_env());
  const int r = comm->rank();
  const int n = comm->size();
  const std::size_t count = 1 << 18;
  std::vector<float> a(count * static_cast<std::size_t>(n));
  std::vector<float> b(count * static_cast<std::size_t>(n));
  for (int it = 0; it < iters; ++it) {
    for (std::size_t i = 0; i < count; ++i) a[i] = static_cast<float>((i + static_cast<std::size_t>(r + it)) % 5);
    auto w = comm->all_reduce(a.data(), b.data(), count, dear::DataType::kFloat32, dear::ReduceOp::kSum);
    if (r == die_rank && it == iters - 1) ::raise(SIGKILL);
    w.wait();
    for (std::size_t i = 0; i < count; ++i) {
      float want = 0;
      for (int q = 0; q < n; ++q) want += static_cast<float>((i + static_cast<std::size_t>(q + it)) % 5);
      if (b[i] != want) {
        std::printf("wrong all_reduce element %zu: %f != %f\n", i, static_cast<double>(b[i]), static_cast<double>(want));
        return 1;
      }
    }
    comm->reduce_scatter(b.data(), a.data(), count / static_cast<std::size_t>(n), dear::DataType::kFloat32,
                         dear::ReduceOp::kMax).wait();
    comm->all_gather(a.data(), b.data(), count / static_cast<std::size_t>(n), dear::DataType::kFloat32).wait();
    comm->broadcast(b.data(), a.data(), count, dear::DataType::kFloat32, it % n).wait();
    comm->barrier().wait();
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
