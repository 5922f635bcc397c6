#include "driver.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <memory>
#include <utility>
#include <vector>

#include "common/env.h"
#include "dear/error.h"

namespace dear::bench {
namespace {

// Zero-initialised so that pages are touched before timing, and so a checked run starts
// from a known state. In host memory, or where a BufferMemory puts it.
struct Buffer {
  Buffer(std::size_t bytes, const BufferMemory* memory) : bytes_(bytes), memory_(memory) {
    if (memory_ != nullptr) {
      device_ = memory_->allocate(std::max<std::size_t>(bytes, 1));
    } else {
      host_.reset(new std::byte[std::max<std::size_t>(bytes, 1)]());
    }
  }
  ~Buffer() {
    if (memory_ != nullptr) memory_->release(device_);
  }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  [[nodiscard]] void* data() noexcept { return memory_ != nullptr ? device_ : host_.get(); }
  void clear() {
    if (memory_ == nullptr) {
      std::memset(host_.get(), 0, bytes_);
    } else {
      const std::vector<std::byte> zeros(bytes_);
      memory_->upload(device_, zeros.data(), bytes_);
    }
  }

 private:
  std::size_t bytes_;
  const BufferMemory* memory_;
  std::unique_ptr<std::byte[]> host_;
  void* device_ = nullptr;
};

// fill_input on a buffer that may not be in host memory.
void fill(void* input, std::size_t bytes, const CheckSpec& spec, const BufferMemory* memory) {
  if (memory == nullptr) return fill_input(input, spec);
  std::vector<std::byte> host(std::max<std::size_t>(bytes, 1));
  fill_input(host.data(), spec);
  memory->upload(input, host.data(), bytes);
}

long long wrong_in(const void* output, std::size_t bytes, const CheckSpec& spec,
                   const BufferMemory* memory) {
  if (memory == nullptr) return count_wrong(output, spec);
  std::vector<std::byte> host(std::max<std::size_t>(bytes, 1));
  memory->download(host.data(), output, bytes);
  return count_wrong(host.data(), spec);
}

// `first`: the sweep's first measurement, which also warms up the process and the library
// under test (its threads, caches and lazily made state), not only this size.
Result measure(PeerComm& comm, const BenchArgs& args, const SizePoint& point, bool in_place,
               bool first, std::uint64_t seed, const Binder& bind, const BufferMemory* memory,
               SampleLog& log) {
  CheckSpec spec;
  spec.collective = args.collective;
  spec.dtype = args.dtype;
  spec.op = args.op;
  spec.rank = comm.rank();
  spec.nranks = comm.size();
  spec.root = args.root;
  spec.rank_count = point.rank_count;
  spec.seed = seed;

  const std::size_t elem = dtype_size(args.dtype);
  const std::size_t in_bytes = input_count(spec) * elem;
  const std::size_t out_bytes = output_count(spec) * elem;
  std::optional<Buffer> send;
  Buffer recv(in_place ? std::max(in_bytes, out_bytes) : out_bytes, memory);
  if (!in_place) send.emplace(in_bytes, memory);

  OpRequest req;
  req.collective = args.collective;
  req.dtype = args.dtype;
  req.op = args.op;
  req.root = args.root;
  req.point = point;
  req.in_place = in_place;
  req.send = send ? send->data() : nullptr;
  req.recv = recv.data();
  std::optional<BoundOp> op = bind(req);
  if (!op) return Result{};

  // Timed iterations start from ordinary numbers. In-place reductions then grow them (up to
  // infinity for 16-bit floats) but never towards denormals, the one slow path of CPU maths.
  fill(op->input, in_bytes, spec, memory);
  const Stopwatch warm;
  for (int i = 0; i < args.warmup_iters; ++i) op->run();
  int iters = args.iters;
  if (args.min_time_ms > 0 && args.warmup_iters > 0) {
    // Every rank must run the same count: the slowest rank's warm-up decides.
    const double per_iter_us = comm.max_over_ranks(warm.elapsed_us() / args.warmup_iters);
    const double wanted = args.min_time_ms * 1000.0 / std::max(per_iter_us, 0.01);
    const int filling = static_cast<int>(std::min<double>(wanted, kMaxAutoIters));
    // The first measurement of a sweep warms up as long as it will be timed: its few warm-up
    // iterations alone left its mean several times the next size's, for every library.
    if (first) {
      for (int i = 0; i < filling; ++i) op->run();
    }
    iters = std::max(iters, filling);
  }
  comm.barrier();
  Samples samples;
  samples.reserve(static_cast<std::size_t>(iters));
  const int agg = args.agg_iters;
  const int per_op = agg * hops_per_run(args.collective);
  for (int i = 0; i < iters; ++i) {
    const Stopwatch watch;
    if (agg == 1) {
      op->run();
    } else if (op->run_many) {
      op->run_many(agg);
    } else {
      for (int k = 0; k < agg; ++k) op->run();
    }
    samples.add(watch.elapsed_us() / per_op);
  }
  const double time_us = comm.max_over_ranks(samples.mean());
  log.add(point.bytes, in_place, samples);

  long long wrong = kNotChecked;
  if (args.check != 0) {
    recv.clear();
    if (send) send->clear();
    fill(op->input, in_bytes, spec, memory);
    comm.barrier();
    op->run();
    wrong = comm.sum_over_ranks(wrong_in(op->output, out_bytes, spec, memory));
  }
  return make_result(point, args.collective, comm.size(), time_us, samples.p50(), samples.p99(),
                     wrong);
}

void fill_info(RunInfo& info, const BenchArgs& args, int nranks) {
  info.collective = args.collective;
  info.nranks = nranks;
  info.dtype = args.dtype;
  info.op = args.op;
  info.root = args.root;
}

}  // namespace

int run_sweep(PeerComm& comm, const BenchArgs& args, DriverConfig config, const Binder& bind) {
  validate(args, comm.size());
  fill_info(config.info, args, comm.size());
  const auto points = size_sweep(args, args.collective, args.dtype, comm.size());
  Reporter reporter(std::move(config.info), args, comm.rank());
  SampleLog log(args.samples_path, comm.rank());
  reporter.begin();
  for (std::size_t i = 0; i < points.size(); ++i) {
    Row row = make_row(points[i], args.collective, args.dtype, args.op, args.root);
    // A distinct seed per run, so a result left over from the previous run is wrong.
    const BufferMemory* memory = config.memory ? &*config.memory : nullptr;
    // The sweep's first timed placement also warms up the sweep (see --min_time_ms).
    if (args.out_of_place) {
      row.oop = measure(comm, args, points[i], false, i == 0, 2 * i, bind, memory, log);
    }
    if (args.in_place) {
      row.ip = measure(comm, args, points[i], true, i == 0 && !args.out_of_place, 2 * i + 1, bind,
                       memory, log);
    }
    reporter.add(std::move(row));
    print_progress(config.tool, args.collective, points[i].bytes, i + 1, points.size(),
                   comm.rank());
  }
  return reporter.finish() > 0 ? 1 : 0;
}

int report_skipped(int rank, int nranks, const BenchArgs& args, DriverConfig config,
                   const std::string& reason) {
  if (rank != 0) return 0;
  fill_info(config.info, args, nranks);
  config.info.meta["skipped"] = reason;
  std::fprintf(stderr, "%s: skipped: %s\n", config.tool.c_str(), reason.c_str());
  RunReport report{std::move(config.info), {}};
  print_preamble(stdout, report.info, args);
  std::fprintf(stdout, "# skipped: %s\n", reason.c_str());
  if (!args.json_path.empty()) write_json_file(args.json_path, report);
  if (!args.csv_path.empty()) write_csv_file(args.csv_path, report);
  return 0;
}

std::optional<LaunchRank> rank_from_environment() {
  constexpr std::pair<const char*, const char*> kConventions[] = {
      {"OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"},
      {"DEAR_RANK", "DEAR_WORLD_SIZE"},
      {"RANK", "WORLD_SIZE"},
  };
  constexpr std::int64_t kMaxRanks = 1 << 20;
  for (const auto& [rank_var, size_var] : kConventions) {
    const auto size = env::get_int(size_var, 1, kMaxRanks);
    const auto rank = env::get_int(rank_var, 0, kMaxRanks - 1);
    if (!size && !rank) continue;
    if (!size || !rank) {
      throw Error(ErrorCode::kInvalidArgument,
                  std::string(rank_var) + " and " + size_var + " must be set together");
    }
    if (*rank >= *size) {
      throw Error(ErrorCode::kInvalidArgument, std::string(rank_var) + "=" + std::to_string(*rank) +
                                                   " is not below " + size_var + "=" +
                                                   std::to_string(*size));
    }
    return LaunchRank{static_cast<int>(*rank), static_cast<int>(*size)};
  }
  return std::nullopt;
}

}  // namespace dear::bench
