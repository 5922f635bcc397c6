// dear-bench: dear's collectives in the nccl-tests table format.
//
//   dear-run -n 4 dear-bench all_reduce -b 8 -e 64M -f 2 -c 1 [--json out.json]
//   dear-run -n 4 dear-bench --calibrate --json alpha_beta.json   (see calibrate.h)
//   dear-run -n 4 dear-bench all_reduce --compare ring,tree,auto -b 8 -e 64M -f 4 [--csv out.csv]
//
// Measured by the same driver as the peer benchmarks (bench/driver.h), so rows from dear,
// Open MPI and Gloo are comparable line by line. Ranks come from the launcher's environment
// (dear-run, torchrun, Open MPI or Slurm); knobs default to the communicator's defaults and
// to DEAR_* overrides.
#include <CLI/CLI.hpp>
#include <algorithm>
#include <cstdio>
#include <exception>
#include <fstream>
#include <functional>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "calibrate.h"
#include "common/env.h"
#include "dear/communicator.h"
#include "dear/error.h"
#include "driver.h"
#ifdef DEAR_HAVE_CUDA
#include <cuda_runtime_api.h>

#include "cuda/device.h"
#include "cuda/error.h"
#endif

namespace dear::bench {
namespace {

class DearComm final : public PeerComm {
 public:
  explicit DearComm(Communicator& comm) : comm_(comm) {}
  [[nodiscard]] int rank() const override { return comm_.rank(); }
  [[nodiscard]] int size() const override { return comm_.size(); }
  void barrier() override { comm_.barrier().wait(); }
  [[nodiscard]] double max_over_ranks(double value) override {
    comm_.all_reduce(&value, &value, 1, DataType::kFloat64, ReduceOp::kMax).wait();
    return value;
  }
  [[nodiscard]] long long sum_over_ranks(long long value) override {
    std::int64_t v = value;
    comm_.all_reduce(&v, &v, 1, DataType::kInt64, ReduceOp::kSum).wait();
    return v;
  }

 private:
  Communicator& comm_;
};

std::optional<BoundOp> bind_dear(const OpRequest& r, Communicator& comm, const OpOptions& o) {
  const std::size_t count = r.point.rank_count;
  const DataType t = r.dtype;
  const ReduceOp op = r.op;
  const std::size_t el = dtype_size(t);
  void* recv = r.recv;
  const void* send = r.in_place ? r.recv : r.send;
  BoundOp bound;
  bound.output = recv;
  // -m: issue k operations, then wait for them all; the engine overlaps their steps.
  const auto many = [](auto issue) {
    return [issue](int k) {
      std::vector<Work> works;
      works.reserve(static_cast<std::size_t>(k));
      for (int i = 0; i < k; ++i) works.push_back(issue());
      for (auto& w : works) w.wait();
    };
  };
  switch (r.collective) {
    case Collective::kAllReduce:
      bound.run = [&comm, send, recv, count, t, op, o] {
        comm.all_reduce(send, recv, count, t, op, o).wait();
      };
      bound.run_many = many([&comm, send, recv, count, t, op, o] {
        return comm.all_reduce(send, recv, count, t, op, o);
      });
      bound.input = const_cast<void*>(send);
      return bound;
    case Collective::kReduceScatter: {
      // In place: the result lands in this rank's block of the input (NCCL's convention).
      void* out =
          r.in_place ? static_cast<char*>(recv) + static_cast<std::size_t>(comm.rank()) * count * el
                     : recv;
      bound.run = [&comm, send, out, count, t, op, o] {
        comm.reduce_scatter(send, out, count, t, op, o).wait();
      };
      bound.run_many = many([&comm, send, out, count, t, op, o] {
        return comm.reduce_scatter(send, out, count, t, op, o);
      });
      bound.input = const_cast<void*>(send);
      bound.output = out;
      return bound;
    }
    case Collective::kAllGather: {
      const void* in = r.in_place ? static_cast<const char*>(recv) +
                                        static_cast<std::size_t>(comm.rank()) * count * el
                                  : send;
      bound.run = [&comm, in, recv, count, t, o] { comm.all_gather(in, recv, count, t, o).wait(); };
      bound.run_many =
          many([&comm, in, recv, count, t, o] { return comm.all_gather(in, recv, count, t, o); });
      bound.input = const_cast<void*>(in);
      return bound;
    }
    case Collective::kAllToAll:
      bound.run = [&comm, send, recv, count, t, o] {
        comm.all_to_all(send, recv, count, t, o).wait();
      };
      bound.run_many = many(
          [&comm, send, recv, count, t, o] { return comm.all_to_all(send, recv, count, t, o); });
      bound.input = const_cast<void*>(send);
      return bound;
    case Collective::kSendRecv: {
      // In place it has no meaning (a send and a receive into one buffer): out of place only.
      if (r.in_place) return std::nullopt;
      const int next = (comm.rank() + 1) % comm.size();
      const int prev = (comm.rank() - 1 + comm.size()) % comm.size();
      const auto exchange = [&comm, send, recv, count, t, next, prev, o] {
        Work rw = comm.recv(recv, count, t, prev, o);
        Work sw = comm.send(send, count, t, next, o);
        return std::pair{std::move(sw), std::move(rw)};
      };
      bound.run = [exchange] {
        auto [sw, rw] = exchange();
        sw.wait();
        rw.wait();
      };
      bound.input = const_cast<void*>(send);
      return bound;
    }
    case Collective::kPingPong: {
      if (r.in_place) return std::nullopt;
      // Rank 2k sends its input and receives it back; rank 2k + 1 receives it and sends what
      // it received back.
      const int partner = comm.rank() ^ 1;
      if (comm.rank() % 2 == 0) {
        bound.run = [&comm, send, recv, count, t, partner, o] {
          Work rw = comm.recv(recv, count, t, partner, o);
          comm.send(send, count, t, partner, o).wait();
          rw.wait();
        };
      } else {
        bound.run = [&comm, recv, count, t, partner, o] {
          comm.recv(recv, count, t, partner, o).wait();
          comm.send(recv, count, t, partner, o).wait();
        };
      }
      bound.input = const_cast<void*>(send);
      return bound;
    }
    case Collective::kScatter: {
      // In place: the root's output is its own block of the input (NCCL's convention for
      // reduce_scatter); elsewhere the block at the same place of a buffer of that size.
      void* out =
          r.in_place ? static_cast<char*>(recv) + static_cast<std::size_t>(comm.rank()) * count * el
                     : recv;
      const void* in = comm.rank() == r.root ? send : nullptr;
      bound.run = [&comm, in, out, count, t, root = r.root, o] {
        comm.scatter(in, out, count, t, root, o).wait();
      };
      bound.run_many = many([&comm, in, out, count, t, root = r.root, o] {
        return comm.scatter(in, out, count, t, root, o);
      });
      bound.input = const_cast<void*>(send);
      bound.output = out;
      return bound;
    }
    case Collective::kGather: {
      // In place: each rank's block already where the root's output keeps it.
      const void* in = r.in_place ? static_cast<const char*>(recv) +
                                        static_cast<std::size_t>(comm.rank()) * count * el
                                  : send;
      bound.run = [&comm, in, recv, count, t, root = r.root, o] {
        comm.gather(in, recv, count, t, root, o).wait();
      };
      bound.run_many = many([&comm, in, recv, count, t, root = r.root, o] {
        return comm.gather(in, recv, count, t, root, o);
      });
      bound.input = const_cast<void*>(in);
      return bound;
    }
    case Collective::kReduce:
      bound.run = [&comm, send, recv, count, t, op, root = r.root, o] {
        comm.reduce(send, recv, count, t, op, root, o).wait();
      };
      bound.run_many = many([&comm, send, recv, count, t, op, root = r.root, o] {
        return comm.reduce(send, recv, count, t, op, root, o);
      });
      bound.input = const_cast<void*>(send);
      return bound;
    case Collective::kBroadcast:
      bound.run = [&comm, send, recv, count, t, root = r.root, o] {
        comm.broadcast(send, recv, count, t, root, o).wait();
      };
      bound.run_many = many([&comm, send, recv, count, t, root = r.root, o] {
        return comm.broadcast(send, recv, count, t, root, o);
      });
      bound.input = const_cast<void*>(send);
      return bound;
  }
  return std::nullopt;
}

// --compare: the listed algorithms timed interleaved at each size of the sweep (calibrate.h's
// interleaved_median_us; -w warm-up, -n and --min_time_ms per algorithm), out of place, so
// that a slow spell of a shared machine hits them alike. Rank 0 prints one row per size: each
// algorithm's median time per operation, the best forced one and auto's ratio to it; --csv FILE
// gets collective,nranks,size,algo,median_us rows. An algorithm the collective cannot run here
// is refused on every rank alike and shows "-". Times only; the conformance tests check results.
int run_compare(Communicator& comm, const BenchArgs& args, const std::vector<std::string>& algos) {
  const int rank = comm.rank();
  const int n = comm.size();
  CalibrateOptions timing;
  timing.warmup = std::max(args.warmup_iters, 1);
  timing.min_iters = std::max(args.iters, 1);
  timing.min_time_ms = args.min_time_ms;
  std::ofstream csv;
  if (rank == 0 && !args.csv_path.empty()) {
    csv.open(args.csv_path, std::ios::trunc);
    if (!csv) throw Error(ErrorCode::kSystem, "--csv: cannot write '" + args.csv_path + "'", rank);
    csv << "collective,nranks,size,algo,median_us\n";
  }
  if (rank == 0) {
    std::printf(
        "# dear-bench --compare: %s, %d ranks, %s %s, median us per operation, "
        "algorithms interleaved\n",
        std::string(to_string(args.collective)).c_str(), n,
        std::string(to_string(args.dtype)).c_str(), std::string(to_string(args.op)).c_str());
    std::printf("%12s", "size");
    for (const auto& a : algos) std::printf(" %18s", a.c_str());
    std::printf(" %18s %9s\n", "best forced", "auto/best");
  }
  const std::vector<SizePoint> points = size_sweep(args, args.collective, args.dtype, n);
  const std::size_t el = dtype_size(args.dtype);
  for (std::size_t i = 0; i < points.size(); ++i) {
    CheckSpec spec;
    spec.collective = args.collective;
    spec.dtype = args.dtype;
    spec.op = args.op;
    spec.rank = rank;
    spec.nranks = n;
    spec.root = args.root;
    spec.rank_count = points[i].rank_count;
    std::vector<char> send(std::max<std::size_t>(input_count(spec) * el, 1));
    std::vector<char> recv(std::max<std::size_t>(output_count(spec) * el, 1));
    fill_input(send.data(), spec);
    OpRequest req;
    req.collective = args.collective;
    req.dtype = args.dtype;
    req.op = args.op;
    req.root = args.root;
    req.point = points[i];
    req.send = send.data();
    req.recv = recv.data();
    std::vector<std::function<void()>> runs;
    std::vector<std::size_t> which;  // index into algos of each run
    for (std::size_t a = 0; a < algos.size(); ++a) {
      OpOptions o;
      o.algorithm = *parse_algorithm(algos[a]);
      std::optional<BoundOp> op = bind_dear(req, comm, o);
      if (!op) continue;
      try {
        op->run();
      } catch (const Error& e) {
        if (e.code() != ErrorCode::kInvalidArgument) throw;
        continue;  // this collective has no such algorithm here
      }
      runs.push_back(op->run);
      which.push_back(a);
    }
    const std::vector<double> t = interleaved_median_us(comm, timing, runs);
    if (rank != 0) continue;
    std::vector<double> by_algo(algos.size(), -1);
    for (std::size_t k = 0; k < which.size(); ++k) by_algo[which[k]] = t[k];
    double best = -1;
    double automatic = -1;
    std::printf("%12llu", static_cast<unsigned long long>(points[i].bytes));
    for (std::size_t a = 0; a < algos.size(); ++a) {
      if (by_algo[a] < 0) {
        std::printf(" %18s", "-");
        continue;
      }
      std::printf(" %18.2f", by_algo[a]);
      if (csv.is_open()) {
        csv << to_string(args.collective) << ',' << n << ',' << points[i].bytes << ',' << algos[a]
            << ',' << by_algo[a] << '\n';
      }
      if (algos[a] == "auto") {
        automatic = by_algo[a];
      } else if (best < 0 || by_algo[a] < best) {
        best = by_algo[a];
      }
    }
    if (best > 0 && automatic > 0) {
      std::printf(" %18.2f %9.2f\n", best, automatic / best);
    } else {
      std::printf(" %18s %9s\n", best > 0 ? std::to_string(best).c_str() : "-", "-");
    }
    std::fflush(stdout);
    print_progress("dear-bench --compare", args.collective, points[i].bytes, i + 1, points.size(),
                   rank);
  }
  comm.barrier().wait();
  return 0;
}

#ifdef DEAR_HAVE_CUDA
// --device cuda: buffers from cudaMalloc on device 0 (ranks of one host share it).
BufferMemory cuda_memory() {
  if (cuda::device_count() == 0) {
    throw Error(ErrorCode::kInvalidArgument,
                "--device cuda: no CUDA device (" + cuda::unavailable_reason() + ")");
  }
  cuda::check(cudaSetDevice(0), "cudaSetDevice(0)");
  BufferMemory m;
  m.allocate = [](std::size_t bytes) {
    void* p = nullptr;
    cuda::check(cudaMalloc(&p, bytes), "cudaMalloc of " + std::to_string(bytes) + " bytes");
    cuda::check(cudaMemset(p, 0, bytes), "cudaMemset");
    return p;
  };
  m.release = [](void* p) { (void)cudaFree(p); };
  m.upload = [](void* dst, const void* host, std::size_t bytes) {
    cuda::check(cudaMemcpy(dst, host, bytes, cudaMemcpyHostToDevice), "cudaMemcpy to device");
  };
  m.download = [](void* host, const void* src, std::size_t bytes) {
    cuda::check(cudaMemcpy(host, src, bytes, cudaMemcpyDeviceToHost), "cudaMemcpy to host");
  };
  return m;
}
#endif

int run(int argc, char** argv) {
  CLI::App app{"dear-bench: dear collectives in the nccl-tests table format"};
  BenchArgs args;
  add_bench_flags(app, args);
  std::string transport;
  int channels = 0;
  std::string slice;
  std::string algo = "auto";
  int timeout_s = 0;
  std::string device = "host";
  int split = 1;
  bool calibrate_only = false;
  app.add_flag("--calibrate", calibrate_only,
               "Measure alpha and beta of a ring step, and each all_reduce schedule at sizes up "
               "to -e (default 16 MiB), on these ranks instead of a sweep; rank 0 prints the fit "
               "and writes it to --json FILE (a DEAR_COST_MODEL file)");
  app.get_option("collective")->required(false);
  app.add_option(
      "--transport", transport,
      "Link transport: tcp, shm (shared memory within a host, TCP between hosts), fabric "
      "(libfabric; see --fabric-provider) or verbs (ibverbs; see --ib-device); default "
      "DEAR_TRANSPORT or tcp");
  std::string fabric_provider;
  app.add_option("--fabric-provider", fabric_provider,
                 "libfabric provider for --transport fabric, as fi_info names it: tcp;ofi_rxm, "
                 "shm, sockets, verbs;ofi_rxm, efa; default DEAR_FABRIC_PROVIDER or the first "
                 "one libfabric offers that reaches other hosts");
  std::string ib_device;
  app.add_option("--ib-device", ib_device,
                 "RDMA device for --transport verbs, optionally with its port (mlx5_0, "
                 "mlx5_0:1); default DEAR_IB_DEVICE or the first with an active port");
  app.add_option("--channels", channels,
                 "Parallel rings (sockets per link); default DEAR_CHANNELS or 1")
      ->check(CLI::Range(1, 16));
  app.add_option("--slice", slice, "Pipelining slice size, e.g. 512K; default DEAR_SLICE_BYTES");
  app.add_option("--algo", algo,
                 "Algorithm: auto, ring, gather_reduce (all_reduce), halving_doubling, "
                 "recursive_doubling, tree (all_reduce), pairwise, scattered, bruck (all_to_all)")
      ->check(CLI::IsMember({"auto", "ring", "gather_reduce", "halving_doubling",
                             "recursive_doubling", "tree", "pairwise", "scattered", "bruck"}));
  std::string compare;
  app.add_option("--compare", compare,
                 "Time these algorithms (comma-separated --algo names) interleaved at each size "
                 "instead of the nccl-tests sweep: one row per size with each one's median time "
                 "and auto's ratio to the best forced one");
  app.add_option("--timeout", timeout_s, "Per-operation deadline in seconds; default DEAR_TIMEOUT");
  app.add_option("--split", split,
                 "Split the ranks into K equal groups of consecutive ranks (Communicator::split) "
                 "and run the sweep in every group at once; each group's rank 0 prints its "
                 "table (and writes --json FILE.groupG)")
      ->check(CLI::PositiveNumber);
  app.add_option("--device", device,
                 "Where the buffers live: host, or cuda (device memory, reduced on the device "
                 "slice by slice; DEAR_CUDA_STAGING=1 stages it whole through host memory "
                 "instead; builds with CUDA only)")
      ->check(CLI::IsMember({"host", "cuda"}));
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  if (!calibrate_only && app.count("collective") == 0) {
    std::fprintf(stderr, "dear-bench: COLLECTIVE is required (or --calibrate)\n");
    return 2;
  }

  std::vector<std::string> compare_algos;
  {
    std::stringstream list(compare);
    for (std::string a; std::getline(list, a, ',');) {
      if (!parse_algorithm(a)) {
        std::fprintf(stderr,
                     "dear-bench: --compare: '%s' is not an algorithm (auto, ring, "
                     "gather_reduce, halving_doubling, recursive_doubling, tree, pairwise, "
                     "scattered, bruck)\n",
                     a.c_str());
        return 2;
      }
      compare_algos.push_back(a);
    }
  }
  for (const char* sweep_only : {"--samples", "--placement"}) {
    if (app.count(sweep_only) > 0 && (calibrate_only || !compare_algos.empty())) {
      std::fprintf(stderr, "dear-bench: %s applies to the sweep; it does not go with --%s\n",
                   sweep_only, calibrate_only ? "calibrate" : "compare");
      return 2;
    }
  }
  if (!compare_algos.empty() && device != "host") {
    std::fprintf(stderr, "dear-bench: --compare times host buffers only (not --device %s)\n",
                 device.c_str());
    return 2;
  }

  auto bootstrap = Bootstrap::from_env();
  const int rank = bootstrap->rank();
  const int nranks = bootstrap->size();
  if (!flags_valid("dear-bench", args, nranks, rank)) return 2;
  // Command-line flags win over DEAR_* variables, which win over the defaults.
  CommOptions options = apply_env(CommOptions{});
  if (!transport.empty()) options.transport = transport;
  // A device or provider for a transport this run does not use would be ignored without a
  // word, and the figures read as if it had been used. Refused as flags_valid() refuses: every
  // rank says why.
  const auto applies = [&](const char* flag, const std::string& value, const char* wants) {
    if (value.empty() || options.transport == wants) return true;
    std::fprintf(stderr,
                 "dear-bench: rank %d: %s '%s' applies to --transport %s, and this run's "
                 "transport is %s (--transport or DEAR_TRANSPORT)\n",
                 rank, flag, value.c_str(), wants, options.transport.c_str());
    return false;
  };
  if (!applies("--fabric-provider", fabric_provider, "fabric") ||
      !applies("--ib-device", ib_device, "verbs")) {
    return 2;
  }
  if (!fabric_provider.empty()) options.fabric_provider = fabric_provider;
  if (!ib_device.empty()) options.ib_device = ib_device;
  if (channels > 0) options.channels = channels;
  if (!slice.empty()) {
    const auto bytes = env::parse_bytes(slice);
    if (!bytes) throw Error(ErrorCode::kInvalidArgument, "--slice '" + slice + "' is not a size");
    options.slice_bytes = *bytes;
  }
  if (timeout_s > 0) options.timeout = std::chrono::seconds(timeout_s);
  if (calibrate_only) {
    auto comm = Communicator::create(std::move(bootstrap), calibration_options(options));
    // -e bounds the sizes each schedule is calibrated at (calibrate_up_to).
    CalibrateOptions copts;
    if (app.count("--maxbytes") > 0) copts = calibrate_up_to(copts, args.max_bytes);
    const collectives::CostModel model = calibrate(*comm, copts);
    if (rank == 0) {
      print_calibration(stdout, model);
      if (!args.json_path.empty()) {
        std::ofstream f(args.json_path, std::ios::trunc);
        f << collectives::to_json_text(model);
        if (!f.flush()) {
          throw Error(ErrorCode::kSystem, "--json: cannot write '" + args.json_path + "'", rank);
        }
        std::printf("# wrote %s (use it with DEAR_COST_MODEL=%s)\n", args.json_path.c_str(),
                    args.json_path.c_str());
      }
    }
    comm->barrier().wait();
    return 0;
  }
  auto world = Communicator::create(std::move(bootstrap), options);
  std::unique_ptr<Communicator> group;
  if (split > 1) {
    if (nranks % split != 0) {
      std::fprintf(stderr, "dear-bench: rank %d: --split %d does not divide %d ranks\n", rank,
                   split, nranks);
      return 2;
    }
    const int g = rank / (nranks / split);
    group = world->split(g, rank);
    if (!args.json_path.empty()) args.json_path += ".group" + std::to_string(g);
    if (!args.csv_path.empty()) args.csv_path += ".group" + std::to_string(g);
    if (group->rank() == 0) {
      std::printf("# group %d of %d: ranks %d..%d of %d, running beside the others\n", g, split,
                  rank, rank + group->size() - 1, nranks);
    }
  }
  Communicator* comm = group ? group.get() : world.get();
  if (!compare_algos.empty()) return run_compare(*comm, args, compare_algos);
  OpOptions op_options;
  op_options.algorithm = *parse_algorithm(algo);

  const CommOptions& used = comm->options();
  DriverConfig config;
  config.tool = "dear-bench";
  config.info.library = "dear";
  config.info.transport = used.transport;
  config.info.meta = {{"channels", used.channels},
                      {"slice_bytes", used.slice_bytes},
                      {"algorithm", algo},
                      {"gather_reduce_max_bytes", used.gather_reduce_max_bytes},
                      {"halving_max_bytes", used.halving_max_bytes},
                      {"cost_model", used.cost_model_file}};
  config.info.meta["device"] = device;
  // What was asked for; empty: the transport's own default choice.
  if (used.transport == "fabric") config.info.meta["fabric_provider"] = used.fabric_provider;
  if (used.transport == "verbs") config.info.meta["ib_device"] = used.ib_device;
  if (device == "cuda") {
#ifdef DEAR_HAVE_CUDA
    config.memory = cuda_memory();
#else
    throw Error(ErrorCode::kInvalidArgument, "--device cuda: this build of dear has no CUDA");
#endif
  }
  DearComm peer(*comm);
  const int rc = run_sweep(peer, args, std::move(config),
                           [&](const OpRequest& r) { return bind_dear(r, *comm, op_options); });
  // What the engine thread spent on the sweep (scripts/gpu-check.sh compares host and device
  // buffers by it), the landing memory it held, and the messages that arrived straight in
  // device memory (RDMA links).
  const Communicator::EngineStats stats = comm->engine_stats();
  std::printf(
      "# rank %d engine: cpu %.3f s, landing peak %zu bytes, device-window messages %llu "
      "(window %zu bytes)\n",
      comm->rank(), stats.cpu_seconds, stats.peak_landing_bytes,
      static_cast<unsigned long long>(stats.device_window_messages), stats.device_window_bytes);
  return rc;
}

}  // namespace
}  // namespace dear::bench

int main(int argc, char** argv) {
  return dear::bench::tool_main("dear-bench", dear::bench::run, argc, argv);
}
