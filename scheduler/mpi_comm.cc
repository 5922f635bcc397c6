#include "scheduler/mpi_comm.h"

#include <mpi.h>

#include <array>
#include <climits>
#include <cstring>
#include <mutex>
#include <string>
#include <vector>

#include "collectives/reduce.h"
#include "common/args.h"
#include "dear/error.h"
#include "scheduler/external_ops.h"

namespace dear::scheduler {
namespace {

// MPI is initialised once per process; the last communicator made here finalises it if this
// file initialised it.
std::mutex g_init_mu;
int g_live = 0;
bool g_initialised_here = false;

std::string mpi_error_text(int rc) {
  std::array<char, MPI_MAX_ERROR_STRING> text{};
  int len = 0;
  if (MPI_Error_string(rc, text.data(), &len) != MPI_SUCCESS)
    return "MPI error " + std::to_string(rc);
  return std::string(text.data(), static_cast<std::size_t>(len));
}

MPI_Datatype mpi_type(DataType t) {
  switch (t) {
    case DataType::kInt8: return MPI_INT8_T;
    case DataType::kUint8: return MPI_UINT8_T;
    case DataType::kInt32: return MPI_INT32_T;
    case DataType::kInt64: return MPI_INT64_T;
    case DataType::kFloat16:
    case DataType::kBFloat16: return MPI_UINT16_T;  // reduced by user operations below
    case DataType::kFloat32: return MPI_FLOAT;
    case DataType::kFloat64: return MPI_DOUBLE;
  }
  return MPI_DATATYPE_NULL;
}

// 16-bit floats have no MPI type: MPI moves them as 16-bit integers and reduces them with
// dear's own kernels (fp32 arithmetic, rounded once), so results match dear's engine.
template <DataType T, ReduceOp Op>
void reduce_16(void* in, void* inout, int* len, MPI_Datatype* /*type*/) {
  collectives::reduce(inout, inout, in, static_cast<std::size_t>(*len), T, Op);
}

constexpr ReduceOp kBaseOps[] = {ReduceOp::kSum, ReduceOp::kProd, ReduceOp::kMin, ReduceOp::kMax};

template <DataType T>
MPI_User_function* user_function(ReduceOp op) {
  switch (op) {
    case ReduceOp::kProd: return &reduce_16<T, ReduceOp::kProd>;
    case ReduceOp::kMin: return &reduce_16<T, ReduceOp::kMin>;
    case ReduceOp::kMax: return &reduce_16<T, ReduceOp::kMax>;
    default: return &reduce_16<T, ReduceOp::kSum>;
  }
}

class MpiCommunicator final : public Communicator {
 public:
  explicit MpiCommunicator(CommOptions options) : options_(std::move(options)) {
    {
      std::lock_guard<std::mutex> lock(g_init_mu);
      int initialised = 0;
      MPI_Initialized(&initialised);
      if (initialised == 0) {
        int provided = 0;
        check(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_SERIALIZED, &provided),
              "MPI_Init_thread");
        g_initialised_here = true;
        if (provided < MPI_THREAD_SERIALIZED) {
          throw Error(ErrorCode::kSystem,
                      "MPI provides thread level " + std::to_string(provided) +
                          ", below MPI_THREAD_SERIALIZED, which the progress thread needs");
        }
      }
      ++g_live;
    }
    check(MPI_Comm_dup(MPI_COMM_WORLD, &comm_), "MPI_Comm_dup");
    check(MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN), "MPI_Comm_set_errhandler");
    check(MPI_Comm_rank(comm_, &rank_), "MPI_Comm_rank");
    check(MPI_Comm_size(comm_, &size_), "MPI_Comm_size");
    for (std::size_t i = 0; i < std::size(kBaseOps); ++i) {
      check(MPI_Op_create(user_function<DataType::kFloat16>(kBaseOps[i]), 1, &half_ops_[i]),
            "MPI_Op_create");
      check(MPI_Op_create(user_function<DataType::kBFloat16>(kBaseOps[i]), 1, &bf16_ops_[i]),
            "MPI_Op_create");
    }
    ops_ = std::make_unique<ExternalOps>(rank_);
  }

  ~MpiCommunicator() override {
    const bool failed = ops_->failed();
    ops_.reset();  // waits for what is outstanding
    // A communicator that failed may have requests MPI still holds: it cannot be freed
    // safely then, so it is left to the end of the process.
    if (!failed) {
      for (auto& op : half_ops_) MPI_Op_free(&op);
      for (auto& op : bf16_ops_) MPI_Op_free(&op);
      MPI_Comm_free(&comm_);
    }
    std::lock_guard<std::mutex> lock(g_init_mu);
    if (--g_live == 0 && g_initialised_here && !failed) {
      int finalized = 0;
      MPI_Finalized(&finalized);
      if (finalized == 0) MPI_Finalize();
      g_initialised_here = false;
    }
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  const CommOptions& options() const override { return options_; }

  Work all_reduce(const void* in, void* out, std::size_t count, DataType dtype, ReduceOp op,
                  const OpOptions& opts) override {
    const int n = int_count(count, "all_reduce");
    check_pointers(in, out, count, "all_reduce");
    auto p = pending("all_reduce", count, dtype, op, opts);
    p->avg_at = op == ReduceOp::kAvg ? out : nullptr;
    const void* send = in == out ? MPI_IN_PLACE : in;
    return submit(std::move(p), [&](MPI_Request* req) {
      return MPI_Iallreduce(send, out, n, mpi_type(dtype), mpi_op(dtype, op), comm_, req);
    });
  }

  Work reduce_scatter(const void* in, void* out, std::size_t recv_count, DataType dtype,
                      ReduceOp op, const OpOptions& opts) override {
    (void)int_count(recv_count * static_cast<std::size_t>(size_), "reduce_scatter");
    check_pointers(in, out, recv_count, "reduce_scatter");
    auto p = pending("reduce_scatter", recv_count, dtype, op, opts);
    const std::size_t bytes = recv_count * dtype_size(dtype);
    void* dst = out;
    // In place, dear's result lands in this rank's block of the input; MPI's would land at its
    // start, so the result goes through a buffer of its own and is copied on completion.
    if (out == static_cast<const char*>(in) + static_cast<std::size_t>(rank_) * bytes &&
        bytes > 0) {
      p->scratch.resize(bytes);
      dst = p->scratch.data();
      p->copy_to = out;
    }
    p->avg_at = op == ReduceOp::kAvg ? out : nullptr;
    return submit(std::move(p), [&](MPI_Request* req) {
      return MPI_Ireduce_scatter_block(in, dst, static_cast<int>(recv_count), mpi_type(dtype),
                                       mpi_op(dtype, op), comm_, req);
    });
  }

  Work all_gather(const void* in, void* out, std::size_t send_count, DataType dtype,
                  const OpOptions& opts) override {
    (void)int_count(send_count * static_cast<std::size_t>(size_), "all_gather");
    check_pointers(in, out, send_count, "all_gather");
    auto p = pending("all_gather", send_count, dtype, ReduceOp::kSum, opts);
    const std::size_t bytes = send_count * dtype_size(dtype);
    const bool in_place =
        in == static_cast<const char*>(out) + static_cast<std::size_t>(rank_) * bytes;
    const void* send = in_place ? MPI_IN_PLACE : in;
    const int n = static_cast<int>(send_count);
    return submit(std::move(p), [&](MPI_Request* req) {
      return MPI_Iallgather(send, n, mpi_type(dtype), out, n, mpi_type(dtype), comm_, req);
    });
  }

  Work broadcast(const void* in, void* out, std::size_t count, DataType dtype, int root,
                 const OpOptions& opts) override {
    const int n = int_count(count, "broadcast");
    dear::check_root(root, size_, rank_, "broadcast");
    if (count > 0 && out == nullptr) null_arg("out", count, "broadcast");
    if (rank_ == root && count > 0 && in == nullptr) null_arg("in", count, "broadcast");
    if (rank_ == root && in != out && count > 0) std::memcpy(out, in, count * dtype_size(dtype));
    auto p = pending("broadcast", count, dtype, ReduceOp::kSum, opts);
    return submit(std::move(p), [&](MPI_Request* req) {
      return MPI_Ibcast(out, n, mpi_type(dtype), root, comm_, req);
    });
  }

  Work reduce(const void* in, void* out, std::size_t count, DataType dtype, ReduceOp op, int root,
              const OpOptions& opts) override {
    const int n = int_count(count, "reduce");
    dear::check_root(root, size_, rank_, "reduce");
    if (count > 0 && in == nullptr) null_arg("in", count, "reduce");
    if (rank_ == root && count > 0 && out == nullptr) null_arg("out", count, "reduce");
    auto p = pending("reduce", count, dtype, op, opts);
    p->avg_at = op == ReduceOp::kAvg && rank_ == root ? out : nullptr;
    const void* send = rank_ == root && in == out ? MPI_IN_PLACE : in;
    return submit(std::move(p), [&](MPI_Request* req) {
      return MPI_Ireduce(send, out, n, mpi_type(dtype), mpi_op(dtype, op), root, comm_, req);
    });
  }

  Work scatter(const void* in, void* out, std::size_t recv_count, DataType dtype, int root,
               const OpOptions& opts) override {
    const int n = int_count(recv_count, "scatter");
    (void)int_count(recv_count * static_cast<std::size_t>(size_), "scatter");
    dear::check_root(root, size_, rank_, "scatter");
    if (rank_ == root && recv_count > 0 && in == nullptr) null_arg("in", recv_count, "scatter");
    if (recv_count > 0 && out == nullptr) null_arg("out", recv_count, "scatter");
    auto p = pending("scatter", recv_count, dtype, ReduceOp::kSum, opts);
    const std::size_t bytes = recv_count * dtype_size(dtype);
    const bool in_place =
        rank_ == root && static_cast<const char*>(out) ==
                             static_cast<const char*>(in) + static_cast<std::size_t>(root) * bytes;
    void* recv = in_place ? MPI_IN_PLACE : out;
    return submit(std::move(p), [&](MPI_Request* req) {
      return MPI_Iscatter(in, n, mpi_type(dtype), recv, n, mpi_type(dtype), root, comm_, req);
    });
  }

  Work gather(const void* in, void* out, std::size_t send_count, DataType dtype, int root,
              const OpOptions& opts) override {
    const int n = int_count(send_count, "gather");
    (void)int_count(send_count * static_cast<std::size_t>(size_), "gather");
    dear::check_root(root, size_, rank_, "gather");
    if (send_count > 0 && in == nullptr) null_arg("in", send_count, "gather");
    if (rank_ == root && send_count > 0 && out == nullptr) null_arg("out", send_count, "gather");
    auto p = pending("gather", send_count, dtype, ReduceOp::kSum, opts);
    const std::size_t bytes = send_count * dtype_size(dtype);
    const bool in_place = rank_ == root && in == static_cast<const char*>(out) +
                                                     static_cast<std::size_t>(root) * bytes;
    const void* send = in_place ? MPI_IN_PLACE : in;
    return submit(std::move(p), [&](MPI_Request* req) {
      return MPI_Igather(send, n, mpi_type(dtype), out, n, mpi_type(dtype), root, comm_, req);
    });
  }

  Work all_to_all(const void* in, void* out, std::size_t count, DataType dtype,
                  const OpOptions& opts) override {
    const int n = int_count(count, "all_to_all");
    (void)int_count(count * static_cast<std::size_t>(size_), "all_to_all");
    check_pointers(in, out, count, "all_to_all");
    auto p = pending("all_to_all", count, dtype, ReduceOp::kSum, opts);
    const void* send = in == out ? MPI_IN_PLACE : in;
    return submit(std::move(p), [&](MPI_Request* req) {
      return MPI_Ialltoall(send, n, mpi_type(dtype), out, n, mpi_type(dtype), comm_, req);
    });
  }

  Work all_to_all_v(const void* in, std::span<const std::size_t> send_counts,
                    std::span<const std::size_t> send_displs, void* out,
                    std::span<const std::size_t> recv_counts,
                    std::span<const std::size_t> recv_displs, DataType dtype,
                    const OpOptions& opts) override {
    const char* name = "all_to_all_v";
    auto p = pending(name, 0, dtype, ReduceOp::kSum, opts);
    const auto n = static_cast<std::size_t>(size_);
    // MPI's int counts and displacements: send counts, send displs, recv counts, recv displs.
    p->layout.reserve(4 * n);
    check_per_rank(send_counts, "send_counts", size_, rank_, name);
    check_per_rank(send_displs, "send_displs", size_, rank_, name);
    check_per_rank(recv_counts, "recv_counts", size_, rank_, name);
    check_per_rank(recv_displs, "recv_displs", size_, rank_, name);
    for (const auto& list : {send_counts, send_displs, recv_counts, recv_displs}) {
      for (std::size_t v : list) p->layout.push_back(int_count(v, name));
    }
    const int* l = p->layout.data();
    return submit(std::move(p), [&](MPI_Request* req) {
      return MPI_Ialltoallv(in, l, l + n, mpi_type(dtype), out, l + 2 * n, l + 3 * n,
                            mpi_type(dtype), comm_, req);
    });
  }

  Work send(const void* buf, std::size_t count, DataType dtype, int peer,
            const OpOptions& opts) override {
    return point_to_point(true, const_cast<void*>(buf), count, dtype, peer, opts);
  }

  Work recv(void* buf, std::size_t count, DataType dtype, int peer,
            const OpOptions& opts) override {
    return point_to_point(false, buf, count, dtype, peer, opts);
  }

  Work barrier(const OpOptions& opts) override {
    auto p = pending("barrier", 0, DataType::kUint8, ReduceOp::kSum, opts);
    return submit(std::move(p), [&](MPI_Request* req) { return MPI_Ibarrier(comm_, req); });
  }

  void abort(const std::string& reason) override {
    ops_->fail(Error(ErrorCode::kAborted, "Communicator::abort(): " + reason, rank_));
  }

 private:
  struct Pending final : ExternalOps::Op {
    MPI_Request request = MPI_REQUEST_NULL;
    int rank = 0;
    int nranks = 1;
    std::size_t count = 0;
    DataType dtype = DataType::kFloat32;
    void* avg_at = nullptr;     // kAvg: divide these `count` elements on completion
    std::vector<char> scratch;  // in-place reduce_scatter: where MPI writes the block
    void* copy_to = nullptr;    // ... and where it goes on completion
    std::vector<int> layout;    // all_to_all_v: counts and displacements, alive until done
    bool recv = false;          // a receive: its sender becomes Work::source()
    MPI_Status status{};

    bool test() override {
      int flag = 0;
      const int rc = MPI_Test(&request, &flag, recv ? &status : MPI_STATUS_IGNORE);
      if (rc != MPI_SUCCESS)
        throw Error(ErrorCode::kPeerFailed, what + ": " + mpi_error_text(rc), rank);
      return flag != 0;
    }
    void finish() override {
      if (recv) source = status.MPI_SOURCE;
      if (copy_to != nullptr) std::memcpy(copy_to, scratch.data(), scratch.size());
      if (avg_at != nullptr) {
        collectives::finish_single(avg_at, avg_at, count, dtype, ReduceOp::kAvg, nranks);
      }
    }
  };

  // MPI_Isend / MPI_Irecv: MPI matches them in order per pair and tag, as dear does, and
  // kAnySource is MPI_ANY_SOURCE.
  Work point_to_point(bool is_send, void* buf, std::size_t count, DataType dtype, int peer,
                      const OpOptions& opts) {
    const char* name = is_send ? "send" : "recv";
    const int n = int_count(count, name);
    check_peer(peer, size_, rank_, name, !is_send);
    if (count > 0 && buf == nullptr) null_arg("buf", count, name);
    auto p = pending(name, count, dtype, ReduceOp::kSum, opts);
    p->recv = !is_send;
    if (opts.tag < 0) {
      throw Error(ErrorCode::kInvalidArgument,
                  "OpOptions::tag=" + std::to_string(opts.tag) + " is negative", rank_,
                  Error::kNone, name);
    }
    return submit(std::move(p), [&](MPI_Request* req) {
      return is_send ? MPI_Isend(buf, n, mpi_type(dtype), peer, opts.tag, comm_, req)
                     : MPI_Irecv(buf, n, mpi_type(dtype),
                                 peer == kAnySource ? MPI_ANY_SOURCE : peer, opts.tag, comm_, req);
    });
  }

  void check(int rc, const char* call) const {
    if (rc != MPI_SUCCESS) {
      throw Error(ErrorCode::kSystem, std::string(call) + ": " + mpi_error_text(rc), rank_);
    }
  }

  int int_count(std::size_t count, const char* what) const {
    if (count > static_cast<std::size_t>(INT_MAX)) {
      throw Error(ErrorCode::kInvalidArgument,
                  "count=" + std::to_string(count) + " exceeds MPI's int counts (" +
                      std::to_string(INT_MAX) + ")",
                  rank_, Error::kNone, what);
    }
    return static_cast<int>(count);
  }

  [[noreturn]] void null_arg(const char* arg, std::size_t count, const char* what) const {
    throw Error(ErrorCode::kInvalidArgument,
                std::string(arg) + " is null but count=" + std::to_string(count), rank_,
                Error::kNone, what);
  }

  void check_pointers(const void* in, const void* out, std::size_t count, const char* what) const {
    if (count == 0) return;
    if (in == nullptr) null_arg("in", count, what);
    if (out == nullptr) null_arg("out", count, what);
  }

  MPI_Op mpi_op(DataType t, ReduceOp op) const {
    const ReduceOp base = op == ReduceOp::kAvg ? ReduceOp::kSum : op;
    if (t == DataType::kFloat16 || t == DataType::kBFloat16) {
      const auto& ops = t == DataType::kFloat16 ? half_ops_ : bf16_ops_;
      for (std::size_t i = 0; i < std::size(kBaseOps); ++i) {
        if (kBaseOps[i] == base) return ops[i];
      }
    }
    switch (base) {
      case ReduceOp::kProd: return MPI_PROD;
      case ReduceOp::kMin: return MPI_MIN;
      case ReduceOp::kMax: return MPI_MAX;
      default: return MPI_SUM;
    }
  }

  std::unique_ptr<Pending> pending(const char* name, std::size_t count, DataType dtype, ReduceOp op,
                                   const OpOptions& opts) const {
    if (!is_valid(dtype)) {
      throw Error(ErrorCode::kInvalidArgument,
                  "dtype=" + std::to_string(static_cast<int>(dtype)) + " is not a DataType", rank_,
                  Error::kNone, name);
    }
    if (!is_valid(op)) {
      throw Error(ErrorCode::kInvalidArgument,
                  "op=" + std::to_string(static_cast<int>(op)) + " is not a ReduceOp", rank_,
                  Error::kNone, name);
    }
    auto p = std::make_unique<Pending>();
    p->what = std::string(name) + " count=" + std::to_string(count) +
              " dtype=" + std::string(to_string(dtype));
    p->rank = rank_;
    p->nranks = size_;
    p->count = count;
    p->dtype = dtype;
    p->deadline = deadline_of(opts, options_);
    return p;
  }

  // Starts the MPI call under the library lock; a failed start fails that Work alone.
  template <typename Issue>
  Work submit(std::unique_ptr<Pending> p, Issue issue) {
    return ops_->submit(std::move(p), [&](ExternalOps::Op& op) {
      auto& mine = static_cast<Pending&>(op);
      const int rc = issue(&mine.request);
      if (rc != MPI_SUCCESS) {
        throw Error(ErrorCode::kPeerFailed, mine.what + ": " + mpi_error_text(rc), rank_);
      }
    });
  }

  CommOptions options_;
  MPI_Comm comm_ = MPI_COMM_NULL;
  int rank_ = 0;
  int size_ = 1;
  std::array<MPI_Op, std::size(kBaseOps)> half_ops_{};
  std::array<MPI_Op, std::size(kBaseOps)> bf16_ops_{};

  // Every MPI call after construction runs under ops_'s library lock.
  std::unique_ptr<ExternalOps> ops_;
};

}  // namespace

bool mpi_built() noexcept { return true; }

std::unique_ptr<Communicator> make_mpi_communicator(CommOptions options) {
  return std::make_unique<MpiCommunicator>(std::move(options));
}

}  // namespace dear::scheduler
