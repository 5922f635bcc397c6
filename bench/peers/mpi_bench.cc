// mpi-bench: the MPI library's collectives, measured and printed exactly like dear-bench.
//
//   mpirun -np 4 mpi-bench all_reduce -b 8 -e 64M [--json out.json]
//
// all_reduce = MPI_Allreduce, reduce_scatter = MPI_Reduce_scatter_block, all_gather =
// MPI_Allgather, broadcast = MPI_Bcast; the in-place forms use MPI_IN_PLACE. MPI's in-place
// reduce-scatter leaves the result at the start of the buffer (NCCL's at rank x count); the
// check reads it where MPI puts it. MPI_Bcast has only one buffer, so broadcast is reported as
// in-place only.
#include <mpi.h>

#include <CLI/CLI.hpp>
#include <climits>
#include <cstdio>
#include <exception>
#include <optional>
#include <string>

#include "common/env.h"
#include "dear/error.h"
#include "driver.h"

namespace dear::bench::peers {
namespace {

void check_mpi(int rc, const char* call) {
  if (rc == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(rc, text, &len);
  throw Error(ErrorCode::kPeerFailed, std::string(call) + " failed: " + std::string(text, len));
}

class MpiComm final : public PeerComm {
 public:
  explicit MpiComm(MPI_Comm comm) : comm_(comm) {
    check_mpi(MPI_Comm_rank(comm_, &rank_), "MPI_Comm_rank");
    check_mpi(MPI_Comm_size(comm_, &size_), "MPI_Comm_size");
  }
  [[nodiscard]] int rank() const override { return rank_; }
  [[nodiscard]] int size() const override { return size_; }
  void barrier() override { check_mpi(MPI_Barrier(comm_), "MPI_Barrier"); }
  [[nodiscard]] double max_over_ranks(double value) override {
    check_mpi(MPI_Allreduce(MPI_IN_PLACE, &value, 1, MPI_DOUBLE, MPI_MAX, comm_),
              "MPI_Allreduce(max)");
    return value;
  }
  [[nodiscard]] long long sum_over_ranks(long long value) override {
    check_mpi(MPI_Allreduce(MPI_IN_PLACE, &value, 1, MPI_LONG_LONG, MPI_SUM, comm_),
              "MPI_Allreduce(sum)");
    return value;
  }
  [[nodiscard]] MPI_Comm comm() const noexcept { return comm_; }

 private:
  MPI_Comm comm_;
  int rank_ = 0;
  int size_ = 1;
};

// MPI has no standard 16-bit floating type. Collectives that only move data carry half and
// bfloat16 as 16-bit integers (same bytes on the wire); reductions cannot.
std::optional<MPI_Datatype> mpi_type(DataType t, bool reduces) {
  switch (t) {
    case DataType::kInt8: return MPI_INT8_T;
    case DataType::kUint8: return MPI_UINT8_T;
    case DataType::kInt32: return MPI_INT32_T;
    case DataType::kInt64: return MPI_INT64_T;
    case DataType::kFloat32: return MPI_FLOAT;
    case DataType::kFloat64: return MPI_DOUBLE;
    case DataType::kFloat16:
    case DataType::kBFloat16:
      if (reduces) return std::nullopt;
      return MPI_UINT16_T;
  }
  return std::nullopt;
}

std::optional<MPI_Op> mpi_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return MPI_SUM;
    case ReduceOp::kProd: return MPI_PROD;
    case ReduceOp::kMin: return MPI_MIN;
    case ReduceOp::kMax: return MPI_MAX;
    case ReduceOp::kAvg: return std::nullopt;
  }
  return std::nullopt;
}

// Why this configuration cannot run on MPI at all, if it cannot.
std::optional<std::string> unsupported(const BenchArgs& args, int nranks) {
  const bool reduces = has_reduction(args.collective);
  if (!mpi_type(args.dtype, reduces)) {
    return "MPI has no standard " + std::string(to_string(args.dtype)) +
           " type to reduce (it is only moved, by all_gather and broadcast)";
  }
  if (reduces && !mpi_op(args.op)) return "MPI has no average reduction operator";
  const SizePoint largest = size_point(args.max_bytes, args.collective, args.dtype, nranks);
  if (largest.rank_count > static_cast<std::uint64_t>(INT_MAX)) {
    return "counts above 2^31-1 elements need MPI-4 large-count calls; lower --maxbytes";
  }
  return std::nullopt;
}

std::optional<BoundOp> bind_mpi(const OpRequest& r, const MpiComm& world) {
  const MPI_Comm comm = world.comm();
  const bool reduces = has_reduction(r.collective);
  const MPI_Datatype type = *mpi_type(r.dtype, reduces);
  const MPI_Op op = reduces ? *mpi_op(r.op) : MPI_OP_NULL;
  const int count = static_cast<int>(r.point.rank_count);
  void* send = r.send;
  void* recv = r.recv;
  // This rank's block of a buffer holding every rank's (the in-place forms of all_gather,
  // gather and scatter).
  const auto own_block = [&]() -> void* {
    int size_of = 0;
    check_mpi(MPI_Type_size(type, &size_of), "MPI_Type_size");
    return static_cast<std::byte*>(recv) + static_cast<std::size_t>(world.rank()) *
                                               r.point.rank_count *
                                               static_cast<std::size_t>(size_of);
  };
  BoundOp bound;
  switch (r.collective) {
    case Collective::kAllReduce:
      if (r.in_place) {
        bound.run = [=] {
          check_mpi(MPI_Allreduce(MPI_IN_PLACE, recv, count, type, op, comm), "MPI_Allreduce");
        };
        bound.input = recv;
      } else {
        bound.run = [=] {
          check_mpi(MPI_Allreduce(send, recv, count, type, op, comm), "MPI_Allreduce");
        };
        bound.input = send;
      }
      bound.output = recv;
      return bound;
    case Collective::kReduceScatter:
      if (r.in_place) {
        bound.run = [=] {
          check_mpi(MPI_Reduce_scatter_block(MPI_IN_PLACE, recv, count, type, op, comm),
                    "MPI_Reduce_scatter_block");
        };
        bound.input = recv;
      } else {
        bound.run = [=] {
          check_mpi(MPI_Reduce_scatter_block(send, recv, count, type, op, comm),
                    "MPI_Reduce_scatter_block");
        };
        bound.input = send;
      }
      bound.output = recv;
      return bound;
    case Collective::kAllGather:
      if (r.in_place) {
        bound.run = [=] {
          check_mpi(MPI_Allgather(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, recv, count, type, comm),
                    "MPI_Allgather");
        };
        bound.input = own_block();
      } else {
        bound.run = [=] {
          check_mpi(MPI_Allgather(send, count, type, recv, count, type, comm), "MPI_Allgather");
        };
        bound.input = send;
      }
      bound.output = recv;
      return bound;
    case Collective::kScatter: {
      // In place, the root passes MPI_IN_PLACE as its output (its block stays in the input);
      // the others receive where their own block of such a buffer would be.
      const bool root_here = world.rank() == r.root;
      void* own = own_block();
      const void* in = r.in_place ? recv : send;
      void* out = r.in_place ? (root_here ? MPI_IN_PLACE : own) : recv;
      bound.run = [=, root = r.root] {
        check_mpi(MPI_Scatter(in, count, type, out, count, type, root, comm), "MPI_Scatter");
      };
      bound.input = const_cast<void*>(in);
      bound.output = r.in_place ? own : recv;
      return bound;
    }
    case Collective::kSendRecv: {
      if (r.in_place) return std::nullopt;
      const int next = (world.rank() + 1) % world.size();
      const int prev = (world.rank() - 1 + world.size()) % world.size();
      bound.run = [=] {
        check_mpi(MPI_Sendrecv(send, count, type, next, 0, recv, count, type, prev, 0, comm,
                               MPI_STATUS_IGNORE),
                  "MPI_Sendrecv");
      };
      bound.input = const_cast<void*>(send);
      bound.output = recv;
      return bound;
    }
    case Collective::kPingPong: {
      // As dear-bench's: rank 2k sends and gets its message back, rank 2k + 1 echoes it.
      if (r.in_place) return std::nullopt;
      const int partner = world.rank() ^ 1;
      if (world.rank() % 2 == 0) {
        bound.run = [=] {
          check_mpi(MPI_Send(send, count, type, partner, 0, comm), "MPI_Send");
          check_mpi(MPI_Recv(recv, count, type, partner, 0, comm, MPI_STATUS_IGNORE), "MPI_Recv");
        };
      } else {
        bound.run = [=] {
          check_mpi(MPI_Recv(recv, count, type, partner, 0, comm, MPI_STATUS_IGNORE), "MPI_Recv");
          check_mpi(MPI_Send(recv, count, type, partner, 0, comm), "MPI_Send");
        };
      }
      bound.input = const_cast<void*>(send);
      bound.output = recv;
      return bound;
    }
    case Collective::kAllToAll: {
      const void* in = r.in_place ? MPI_IN_PLACE : send;
      bound.run = [=] {
        check_mpi(MPI_Alltoall(in, count, type, recv, count, type, comm), "MPI_Alltoall");
      };
      bound.input = r.in_place ? recv : send;
      bound.output = recv;
      return bound;
    }
    case Collective::kGather: {
      // In place, the root passes MPI_IN_PLACE (its block already in place); the others send
      // the block where their own output would hold it.
      const bool root_here = world.rank() == r.root;
      void* own = own_block();
      const void* in = r.in_place ? (root_here ? MPI_IN_PLACE : own) : send;
      bound.run = [=, root = r.root] {
        check_mpi(MPI_Gather(in, count, type, recv, count, type, root, comm), "MPI_Gather");
      };
      bound.input = r.in_place ? own : send;
      bound.output = recv;
      return bound;
    }
    case Collective::kReduce: {
      // In place, the root passes MPI_IN_PLACE; the others' input is their own buffer either way.
      const bool root_here = world.rank() == r.root;
      const void* in = r.in_place ? (root_here ? MPI_IN_PLACE : recv) : send;
      bound.run = [=, root = r.root] {
        check_mpi(MPI_Reduce(in, recv, count, type, op, root, comm), "MPI_Reduce");
      };
      bound.input = r.in_place ? recv : send;
      bound.output = recv;
      return bound;
    }
    case Collective::kBroadcast:
      if (!r.in_place) return std::nullopt;
      bound.run = [=, root = r.root] {
        check_mpi(MPI_Bcast(recv, count, type, root, comm), "MPI_Bcast");
      };
      bound.input = recv;
      bound.output = recv;
      return bound;
  }
  return std::nullopt;
}

// What mpirun was told about the wire, so a JSON file says what was measured.
std::string describe_transport() {
  std::string text;
  for (const auto& [var, label] :
       {std::pair{"OMPI_MCA_pml", "pml="}, std::pair{"OMPI_MCA_btl", "btl="},
        std::pair{"OMPI_MCA_btl_tcp_if_include", "if="}}) {
    if (const auto v = env::get(var)) text += (text.empty() ? "" : " ") + std::string(label) + *v;
  }
  return text.empty() ? "mpi defaults" : text;
}

std::string library_version() {
  char text[MPI_MAX_LIBRARY_VERSION_STRING];
  int len = 0;
  MPI_Get_library_version(text, &len);
  std::string version(text, static_cast<std::size_t>(len));
  const auto end = version.find_first_of(",\n");
  return version.substr(0, end);
}

int run(int argc, char** argv) {
  MpiComm world(MPI_COMM_WORLD);
  check_mpi(MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN), "MPI_Comm_set_errhandler");

  CLI::App app{"mpi-bench: MPI collectives in the nccl-tests table format"};
  BenchArgs args;
  add_bench_flags(app, args);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    // Every rank parses the same line: one copy of --help is enough, but each rank reports an
    // error itself (see flags_valid).
    return world.rank() == 0 || e.get_exit_code() != 0 ? app.exit(e) : e.get_exit_code();
  }

  if (!flags_valid("mpi-bench", args, world.size(), world.rank())) return 2;

  DriverConfig config;
  config.tool = "mpi-bench";
  config.info.library = "mpi";
  config.info.transport = describe_transport();
  config.info.meta = {{"mpi_library", library_version()}};
  if (const auto why = unsupported(args, world.size())) {
    return report_skipped(world.rank(), world.size(), args, std::move(config), *why);
  }
  return run_sweep(world, args, std::move(config),
                   [&world](const OpRequest& r) { return bind_mpi(r, world); });
}

}  // namespace
}  // namespace dear::bench::peers

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  int rc = 0;
  try {
    rc = dear::bench::peers::run(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "mpi-bench: rank %d: %s\n", rank, e.what());
    // Other ranks may be blocked in a collective; only an abort ends them.
    MPI_Abort(MPI_COMM_WORLD, 1);
  }
  MPI_Finalize();
  return rc;
}
