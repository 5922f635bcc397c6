// The measurement loop shared by dear-bench and the peer benchmarks (mpi-bench, gloo-bench).
//
// A peer library supplies two things: a PeerComm for the few cross-rank steps the driver
// needs outside the timed region, and a Binder that turns a request (collective, size,
// placement, buffers) into a call bound to those buffers. The driver owns the buffers, the
// sweep, the timing and the check, so every peer is measured exactly the same way:
//   1. bind the call to fresh buffers, fill the input with the check pattern;
//   2. warm-up iterations, then a barrier;
//   3. `iters` iterations, each completed before the next starts, each timed on its own
//      (with -m k: k operations issued back to back, waited for together, time / k);
//   4. outside the timed region: time = max over ranks of the per-rank mean; p50/p99 are
//      rank 0's;
//   5. with -c, refill the input, zero the rest, one more run, and the sum over ranks of
//      wrong elements.
#pragma once

#include <functional>
#include <optional>
#include <string>

#include "report.h"

namespace dear::bench {

// The cross-rank steps the driver needs; all are collective (every rank calls them).
class PeerComm {
 public:
  virtual ~PeerComm() = default;
  [[nodiscard]] virtual int rank() const = 0;
  [[nodiscard]] virtual int size() const = 0;
  virtual void barrier() = 0;
  [[nodiscard]] virtual double max_over_ranks(double value) = 0;
  [[nodiscard]] virtual long long sum_over_ranks(long long value) = 0;
};

// What the driver asks a library to bind. Buffers follow nccl-tests: out-of-place has `send`
// (input_count elements) and `recv` (output_count elements); in-place has `recv` alone, large
// enough for both, and `send` is null. Buffers stay put until the call is dropped.
struct OpRequest {
  Collective collective = Collective::kAllReduce;
  DataType dtype = DataType::kFloat32;
  ReduceOp op = ReduceOp::kSum;
  int root = 0;
  SizePoint point;
  bool in_place = false;
  void* send = nullptr;
  void* recv = nullptr;
};

// A call bound to its buffers, run many times.
struct BoundOp {
  std::function<void()> run;
  // Issues k calls back to back and waits for all of them (-m/--agg_iters); unset: a library
  // with blocking calls only, which runs them one after another.
  std::function<void(int k)> run_many;
  void* input = nullptr;         // where this rank's contribution lives
  const void* output = nullptr;  // where this rank's result lands
};

// nullopt when the library has no such form (an in-place or out-of-place variant it lacks):
// the driver prints N/A for it. Must answer the same on every rank.
using Binder = std::function<std::optional<BoundOp>(const OpRequest&)>;

// Where the benchmark's buffers live when not in ordinary host memory (dear-bench --device
// cuda). The driver fills inputs and checks outputs in host memory and moves them with
// upload/download, outside the timed region.
struct BufferMemory {
  std::function<void*(std::size_t bytes)> allocate;  // zeroed
  std::function<void(void*)> release;
  std::function<void(void* dst, const void* host, std::size_t bytes)> upload;
  std::function<void(void* host, const void* src, std::size_t bytes)> download;
};

struct DriverConfig {
  std::string tool;  // "mpi-bench", for progress lines
  RunInfo info;      // library, transport, meta; collective/dtype/op/nranks are filled in
  std::optional<BufferMemory> memory;  // unset: host memory
};

// Runs the whole sweep and prints through the report library. Returns the process exit
// status: 0, or 1 on rank 0 when any element was wrong.
int run_sweep(PeerComm& comm, const BenchArgs& args, DriverConfig config, const Binder& bind);

// For a configuration the library cannot run at all (e.g. MPI has no half type): rank 0 says
// so on stderr and in the table, writes a --json file with no rows and meta.skipped; returns 0.
// Takes no PeerComm so that a library can decide before it connects its ranks.
int report_skipped(int rank, int nranks, const BenchArgs& args, DriverConfig config,
                   const std::string& reason);

// Rank and world size from the launcher: OMPI_COMM_WORLD_RANK/SIZE, DEAR_RANK/DEAR_WORLD_SIZE
// or RANK/WORLD_SIZE, in that order; nullopt when none is set.
struct LaunchRank {
  int rank = 0;
  int size = 1;
};
[[nodiscard]] std::optional<LaunchRank> rank_from_environment();

}  // namespace dear::bench
