// gloo-bench: Gloo's collectives over its TCP transport, measured and printed exactly like
// dear-bench.
//
//   DEAR_RANK=r DEAR_WORLD_SIZE=n gloo-bench all_reduce --store DIR [--algo ring_chunked] ...
//   mpirun -np n gloo-bench all_reduce --store DIR ...      (MPI only launches; Gloo talks)
//
// Ranks meet through a Gloo FileStore in DIR (or $DEAR_GLOO_STORE), which must be empty or
// fresh for each job; $DEAR_GLOO_PREFIX (default: Open MPI's job id when launched by mpirun)
// keys the rendezvous so that leftovers of an earlier job sharing the directory are ignored.
//
// Gloo's classic algorithms work in place on the user's buffers, so most collectives have
// only an in-place row:
//   all_reduce      AllreduceRing / AllreduceRingChunked / AllreduceHalvingDoubling /
//                   AllreduceBcube (--algo), in place only;
//   reduce_scatter  ReduceScatterHalvingDoubling (Gloo has no ring reduce-scatter), in place
//                   only, result at the start of the buffer like MPI's;
//   all_gather      AllgatherRing, both placements (in place: the input is the rank's block
//                   of the output);
//   broadcast       BroadcastOneToAll, in place only.
// Types: int8 uint8 int32 int64 half (gloo::float16) float double; bfloat16 only where no
// reduction happens. Ops: sum prod min max (Gloo has no average).
#include <gloo/algorithm.h>
#include <gloo/allgather_ring.h>
#include <gloo/allreduce_bcube.h>
#include <gloo/allreduce_halving_doubling.h>
#include <gloo/allreduce_ring.h>
#include <gloo/allreduce_ring_chunked.h>
#include <gloo/alltoall.h>
#include <gloo/barrier_all_to_one.h>
#include <gloo/broadcast_one_to_all.h>
#include <gloo/config.h>
#include <gloo/gather.h>
#include <gloo/math.h>
#include <gloo/reduce.h>
#include <gloo/reduce_scatter.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/file_store.h>
#include <gloo/rendezvous/prefix_store.h>
#include <gloo/scatter.h>
#include <gloo/transport/tcp/device.h>
#include <gloo/types.h>

#include <CLI/CLI.hpp>
#include <chrono>
#include <climits>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <system_error>
#include <vector>

#include "common/env.h"
#include "dear/error.h"
#include "driver.h"

namespace dear::bench::peers {
namespace {

// Large messages on an oversubscribed machine can take seconds; a lost rank still ends the job.
constexpr std::chrono::seconds kGlooTimeout{300};

class GlooComm final : public PeerComm {
 public:
  explicit GlooComm(std::shared_ptr<gloo::Context> context) : context_(std::move(context)) {}
  [[nodiscard]] int rank() const override { return context_->rank; }
  [[nodiscard]] int size() const override { return context_->size; }
  void barrier() override { gloo::BarrierAllToOne(context_).run(); }
  [[nodiscard]] double max_over_ranks(double value) override {
    gloo::AllreduceRing<double>(context_, {&value}, 1, gloo::ReductionFunction<double>::max).run();
    return value;
  }
  [[nodiscard]] long long sum_over_ranks(long long value) override {
    std::int64_t v = value;
    gloo::AllreduceRing<std::int64_t>(context_, {&v}, 1, gloo::ReductionFunction<std::int64_t>::sum)
        .run();
    return v;
  }
  [[nodiscard]] const std::shared_ptr<gloo::Context>& context() const noexcept { return context_; }

 private:
  std::shared_ptr<gloo::Context> context_;
};

template <typename T>
const gloo::ReductionFunction<T>* gloo_fn(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return gloo::ReductionFunction<T>::sum;
    case ReduceOp::kProd: return gloo::ReductionFunction<T>::product;
    case ReduceOp::kMin: return gloo::ReductionFunction<T>::min;
    case ReduceOp::kMax: return gloo::ReductionFunction<T>::max;
    case ReduceOp::kAvg: return nullptr;
  }
  return nullptr;
}

// The same operators for Gloo's functional collectives (gloo::reduce), which take c = a op b.
template <typename T>
gloo::ReduceOptions::Func gloo_reduce_fn(ReduceOp op) {
  using Fn = void (*)(void*, const void*, const void*, std::size_t);
  switch (op) {
    case ReduceOp::kSum: return static_cast<Fn>(&gloo::sum<T>);
    case ReduceOp::kProd: return static_cast<Fn>(&gloo::product<T>);
    case ReduceOp::kMin: return static_cast<Fn>(&gloo::min<T>);
    case ReduceOp::kMax: return static_cast<Fn>(&gloo::max<T>);
    case ReduceOp::kAvg: break;
  }
  return nullptr;
}

// Calls f(T{}) with the Gloo element type for `t`. 16-bit types that are only moved travel as
// uint16_t; half reduces as gloo::float16; bfloat16 cannot reduce (unsupported() says so).
template <typename F>
std::optional<BoundOp> with_type(DataType t, bool reduces, F&& f) {
  switch (t) {
    case DataType::kInt8: return f(std::int8_t{});
    case DataType::kUint8: return f(std::uint8_t{});
    case DataType::kInt32: return f(std::int32_t{});
    case DataType::kInt64: return f(std::int64_t{});
    case DataType::kFloat32: return f(float{});
    case DataType::kFloat64: return f(double{});
    case DataType::kFloat16:
      if (reduces) return f(gloo::float16{});
      return f(std::uint16_t{});
    case DataType::kBFloat16:
      if (reduces) return std::nullopt;
      return f(std::uint16_t{});
  }
  return std::nullopt;
}

enum class AllreduceAlgo { kRing, kRingChunked, kHalvingDoubling, kBcube };

std::optional<std::string> unsupported(const BenchArgs& args, int nranks, AllreduceAlgo algo) {
  const bool reduces = has_reduction(args.collective);
  // Gloo's bcube (base 2) silently returns wrong sums on other rank counts.
  const bool power_of_two = (nranks & (nranks - 1)) == 0;
  if (args.collective == Collective::kAllReduce && algo == AllreduceAlgo::kBcube && !power_of_two) {
    return "Gloo's bcube all_reduce needs a power-of-two rank count (it returns wrong results "
           "on " +
           std::to_string(nranks) + " ranks)";
  }
  if (reduces && args.dtype == DataType::kBFloat16) {
    return "Gloo has no bfloat16 type to reduce (it is only moved, by all_gather and broadcast)";
  }
  if (reduces && args.op == ReduceOp::kAvg) return "Gloo has no average reduction";
  const SizePoint largest = size_point(args.max_bytes, args.collective, args.dtype, nranks);
  if (largest.count > static_cast<std::uint64_t>(INT_MAX)) {
    return "Gloo counts are int; lower --maxbytes below 2^31 elements";
  }
  return std::nullopt;
}

std::optional<BoundOp> bind_gloo(const OpRequest& r, const GlooComm& comm, AllreduceAlgo algo) {
  const auto& ctx = comm.context();
  // Gloo's algorithms assume at least one element (some divide the buffer into chunks).
  if (r.point.rank_count == 0) return std::nullopt;
  const bool reduces = has_reduction(r.collective);
  return with_type(r.dtype, reduces, [&](auto tag) -> std::optional<BoundOp> {
    using T = decltype(tag);
    const int count = static_cast<int>(r.point.rank_count);
    T* recv = static_cast<T*>(r.recv);
    std::shared_ptr<gloo::Algorithm> algorithm;
    BoundOp bound;
    switch (r.collective) {
      case Collective::kAllReduce: {
        if (!r.in_place) return std::nullopt;
        const std::vector<T*> ptrs{recv};
        const auto* fn = gloo_fn<T>(r.op);
        switch (algo) {
          case AllreduceAlgo::kRing:
            algorithm = std::make_shared<gloo::AllreduceRing<T>>(ctx, ptrs, count, fn);
            break;
          case AllreduceAlgo::kRingChunked:
            algorithm = std::make_shared<gloo::AllreduceRingChunked<T>>(ctx, ptrs, count, fn);
            break;
          case AllreduceAlgo::kHalvingDoubling:
            algorithm = std::make_shared<gloo::AllreduceHalvingDoubling<T>>(ctx, ptrs, count, fn);
            break;
          case AllreduceAlgo::kBcube:
            algorithm = std::make_shared<gloo::AllreduceBcube<T>>(ctx, ptrs, count, fn);
            break;
        }
        bound.input = recv;
        bound.output = recv;
        break;
      }
      case Collective::kReduceScatter: {
        if (!r.in_place) return std::nullopt;
        const std::vector<int> per_rank(static_cast<std::size_t>(comm.size()), count);
        algorithm = std::make_shared<gloo::ReduceScatterHalvingDoubling<T>>(
            ctx, std::vector<T*>{recv}, count * comm.size(), per_rank, gloo_fn<T>(r.op));
        bound.input = recv;
        bound.output = recv;
        break;
      }
      case Collective::kAllGather: {
        T* input = r.in_place ? recv + static_cast<std::size_t>(comm.rank()) * r.point.rank_count
                              : static_cast<T*>(r.send);
        algorithm = std::make_shared<gloo::AllgatherRing<T>>(ctx, std::vector<const T*>{input},
                                                             recv, count);
        bound.input = input;
        bound.output = recv;
        break;
      }
      case Collective::kReduce: {
        // Gloo's reduce (gloo/reduce.h) with one buffer as input and output.
        if (!r.in_place) return std::nullopt;
        auto opts = std::make_shared<gloo::ReduceOptions>(ctx);
        opts->setInput(recv, r.point.rank_count);
        opts->setOutput(recv, r.point.rank_count);
        opts->setRoot(r.root);
        opts->setReduceFunction(gloo_reduce_fn<T>(r.op));
        bound.input = recv;
        bound.output = recv;
        bound.run = [opts] { gloo::reduce(*opts); };
        return bound;
      }
      case Collective::kSendRecv:
      case Collective::kPingPong: return std::nullopt;  // not compared: no call of its own
      case Collective::kAllToAll: {
        // Gloo's alltoall (gloo/alltoall.h): out of place only (its own block is copied from
        // the input to the output while the others travel).
        if (r.in_place) return std::nullopt;
        auto opts = std::make_shared<gloo::AlltoallOptions>(ctx);
        T* input = static_cast<T*>(r.send);
        opts->setInput(input, r.point.count);
        opts->setOutput(recv, r.point.count);
        bound.input = input;
        bound.output = recv;
        bound.run = [opts] { gloo::alltoall(*opts); };
        return bound;
      }
      case Collective::kScatter: {
        // Gloo's scatter (gloo/scatter.h): out of place only; the root passes one pointer per
        // rank into its input.
        if (r.in_place) return std::nullopt;
        auto opts = std::make_shared<gloo::ScatterOptions>(ctx);
        T* input = static_cast<T*>(r.send);
        if (comm.rank() == r.root) {
          std::vector<T*> parts;
          for (int p = 0; p < comm.size(); ++p) {
            parts.push_back(input + static_cast<std::size_t>(p) * r.point.rank_count);
          }
          opts->setInputs(parts, r.point.rank_count);
        }
        opts->setOutput(recv, r.point.rank_count);
        opts->setRoot(r.root);
        bound.input = input;
        bound.output = recv;
        bound.run = [opts] { gloo::scatter(*opts); };
        return bound;
      }
      case Collective::kGather: {
        // Gloo's gather (gloo/gather.h): out of place only (it sends from its input and writes
        // the root's whole output).
        if (r.in_place) return std::nullopt;
        auto opts = std::make_shared<gloo::GatherOptions>(ctx);
        T* input = static_cast<T*>(r.send);
        opts->setInput(input, r.point.rank_count);
        if (comm.rank() == r.root) {
          opts->setOutput(recv, r.point.rank_count * static_cast<std::size_t>(comm.size()));
        }
        opts->setRoot(r.root);
        bound.input = input;
        bound.output = recv;
        bound.run = [opts] { gloo::gather(*opts); };
        return bound;
      }
      case Collective::kBroadcast: {
        if (!r.in_place) return std::nullopt;
        algorithm = std::make_shared<gloo::BroadcastOneToAll<T>>(ctx, std::vector<T*>{recv},
                                                                 r.point.rank_count, r.root);
        bound.input = recv;
        bound.output = recv;
        break;
      }
    }
    bound.run = [algorithm] { algorithm->run(); };
    return bound;
  });
}

std::string algorithm_name(Collective c, const std::string& allreduce_algo) {
  switch (c) {
    case Collective::kAllReduce: return allreduce_algo;
    case Collective::kReduceScatter: return "halving_doubling";
    case Collective::kAllGather: return "ring";
    case Collective::kBroadcast: return "one_to_all";
    case Collective::kReduce: return "reduce";
    case Collective::kGather: return "gather";
    case Collective::kScatter: return "scatter";
    case Collective::kAllToAll: return "alltoall";
    case Collective::kSendRecv:
    case Collective::kPingPong: return "none";
  }
  return "?";
}

// The rendezvous key: fresh per job so stale files in a shared directory are never read.
std::string store_prefix() {
  if (auto v = env::get("DEAR_GLOO_PREFIX")) return *v;
  if (auto v = env::get("OMPI_MCA_ess_base_jobid")) return "ompi-" + *v;
  return "dear-gloo-bench";
}

int run(int argc, char** argv) {
  CLI::App app{"gloo-bench: Gloo collectives in the nccl-tests table format"};
  BenchArgs args;
  add_bench_flags(app, args);
  std::string store_dir = env::get("DEAR_GLOO_STORE").value_or("");
  std::string algo_name = "ring_chunked";
  app.add_option("--store", store_dir,
                 "Directory for Gloo's FileStore rendezvous (default: $DEAR_GLOO_STORE)");
  app.add_option("--algo", algo_name, "all_reduce algorithm")
      ->check(CLI::IsMember({"ring", "ring_chunked", "halving_doubling", "bcube"}))
      ->capture_default_str();

  const auto launch = rank_from_environment();
  const int rank = launch ? launch->rank : 0;
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    // One copy of --help is enough; each rank reports an error itself (see flags_valid).
    return rank == 0 || e.get_exit_code() != 0 ? app.exit(e) : e.get_exit_code();
  }
  if (!launch) {
    throw Error(ErrorCode::kInvalidArgument,
                "no rank: set DEAR_RANK and DEAR_WORLD_SIZE (or RANK/WORLD_SIZE), or launch "
                "with mpirun");
  }
  if (!flags_valid("gloo-bench", args, launch->size, rank)) return 2;
  if (store_dir.empty()) {
    throw Error(ErrorCode::kInvalidArgument,
                "no rendezvous directory: pass --store DIR or set DEAR_GLOO_STORE");
  }
  std::error_code ec;
  std::filesystem::create_directories(store_dir, ec);  // racing ranks: existing is fine
  if (!std::filesystem::is_directory(store_dir)) {
    throw Error(ErrorCode::kSystem, "--store '" + store_dir + "' is not a usable directory");
  }
  const AllreduceAlgo algo = algo_name == "ring"               ? AllreduceAlgo::kRing
                             : algo_name == "halving_doubling" ? AllreduceAlgo::kHalvingDoubling
                             : algo_name == "bcube"            ? AllreduceAlgo::kBcube
                                                               : AllreduceAlgo::kRingChunked;

  DriverConfig config;
  config.tool = "gloo-bench";
  config.info.library = "gloo";
  config.info.transport = "tcp 127.0.0.1";
  config.info.meta = {{"algorithm", algorithm_name(args.collective, algo_name)},
                      {"gloo_version", std::to_string(GLOO_VERSION_MAJOR) + "." +
                                           std::to_string(GLOO_VERSION_MINOR) + "." +
                                           std::to_string(GLOO_VERSION_PATCH)}};
  // Decided before connecting: a rank that leaves early would break the others' rendezvous.
  if (const auto why = unsupported(args, launch->size, algo)) {
    return report_skipped(rank, launch->size, args, std::move(config), *why);
  }

  gloo::transport::tcp::attr attr;
  attr.hostname = "127.0.0.1";
  auto device = gloo::transport::tcp::CreateDevice(attr);
  gloo::rendezvous::FileStore file_store(store_dir);
  gloo::rendezvous::PrefixStore store(store_prefix(), file_store);
  auto context = std::make_shared<gloo::rendezvous::Context>(rank, launch->size);
  context->setTimeout(kGlooTimeout);
  context->connectFullMesh(store, device);
  GlooComm comm(context);
  const int rc = run_sweep(comm, args, std::move(config),
                           [&comm, algo](const OpRequest& r) { return bind_gloo(r, comm, algo); });
  // Ranks leave together, so none closes its pairs while another still waits on them.
  comm.barrier();
  return rc;
}

}  // namespace
}  // namespace dear::bench::peers

int main(int argc, char** argv) {
  try {
    return dear::bench::peers::run(argc, argv);
  } catch (const std::exception& e) {
    std::string rank = "?";
    try {
      if (const auto launch = dear::bench::rank_from_environment()) {
        rank = std::to_string(launch->rank);
      }
    } catch (const std::exception&) {
      // The environment was the problem; the message below says so.
    }
    std::fprintf(stderr, "gloo-bench: rank %s: %s\n", rank.c_str(), e.what());
    return 1;
  }
}
