// Compiled in builds with CUDA and NCCL; not run in this project's CI (no GPU there).
#include "scheduler/nccl_comm.h"

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "common/args.h"
#include "dear/error.h"
#include "scheduler/external_ops.h"

namespace dear::scheduler {
namespace {

ncclDataType_t nccl_type(DataType t) {
  switch (t) {
    case DataType::kInt8: return ncclInt8;
    case DataType::kUint8: return ncclUint8;
    case DataType::kInt32: return ncclInt32;
    case DataType::kInt64: return ncclInt64;
    case DataType::kFloat16: return ncclFloat16;
    case DataType::kBFloat16: return ncclBfloat16;
    case DataType::kFloat32: return ncclFloat32;
    case DataType::kFloat64: return ncclFloat64;
  }
  return ncclFloat32;
}

ncclRedOp_t nccl_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return ncclSum;
    case ReduceOp::kProd: return ncclProd;
    case ReduceOp::kMin: return ncclMin;
    case ReduceOp::kMax: return ncclMax;
    case ReduceOp::kAvg: return ncclAvg;
  }
  return ncclSum;
}

int local_rank(int rank) {
  for (const char* name : {"DEAR_LOCAL_RANK", "LOCAL_RANK"}) {
    if (const char* v = std::getenv(name)) return std::atoi(v);
  }
  return rank;
}

bool on_device(const void* p) {
  if (p == nullptr) return false;
  cudaPointerAttributes attr{};
  if (cudaPointerGetAttributes(&attr, p) != cudaSuccess) {
    (void)cudaGetLastError();  // plain host memory on older runtimes: clear the error
    return false;
  }
  return attr.type == cudaMemoryTypeDevice || attr.type == cudaMemoryTypeManaged;
}

class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(Bootstrap& bootstrap, CommOptions options)
      : options_(std::move(options)), rank_(bootstrap.rank()), size_(bootstrap.size()) {
    int devices = 0;
    if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
      (void)cudaGetLastError();
      throw Error(ErrorCode::kInvalidArgument, "the NCCL back-end needs a CUDA device; none found",
                  rank_);
    }
    device_ = local_rank(rank_) % devices;
    cuda(cudaSetDevice(device_), "cudaSetDevice");
    ncclUniqueId id{};
    if (rank_ == 0) nccl(ncclGetUniqueId(&id), "ncclGetUniqueId");
    std::vector<ncclUniqueId> all(static_cast<std::size_t>(size_));
    bootstrap.all_gather(&id, sizeof(id), all.data());
    nccl(ncclCommInitRank(&comm_, size_, all[0], rank_), "ncclCommInitRank");
    cuda(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
    ops_ = std::make_unique<ExternalOps>(rank_, [this] {
      (void)ncclCommAbort(comm_);
      aborted_ = true;
    });
  }

  ~NcclCommunicator() override {
    ops_.reset();  // waits for what is outstanding
    if (!aborted_) (void)ncclCommDestroy(comm_);
    (void)cudaStreamDestroy(stream_);
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  const CommOptions& options() const override { return options_; }

  Work all_reduce(const void* in, void* out, std::size_t count, DataType dtype, ReduceOp op,
                  const OpOptions& opts) override {
    const std::size_t bytes = count * dtype_size(dtype);
    return run("all_reduce", count, dtype, opts, {in, bytes}, {out, bytes}, in == out,
               [=, this](const void* s, void* r) {
                 return ncclAllReduce(s, r, count, nccl_type(dtype), nccl_op(op), comm_, stream_);
               });
  }

  Work reduce_scatter(const void* in, void* out, std::size_t recv_count, DataType dtype,
                      ReduceOp op, const OpOptions& opts) override {
    const std::size_t block = recv_count * dtype_size(dtype);
    const bool in_place =
        out == static_cast<const char*>(in) + static_cast<std::size_t>(rank_) * block;
    return run(
        "reduce_scatter", recv_count, dtype, opts, {in, block * static_cast<std::size_t>(size_)},
        {out, block}, in_place, [=, this](const void* s, void* r) {
          return ncclReduceScatter(s, r, recv_count, nccl_type(dtype), nccl_op(op), comm_, stream_);
        });
  }

  Work all_gather(const void* in, void* out, std::size_t send_count, DataType dtype,
                  const OpOptions& opts) override {
    const std::size_t block = send_count * dtype_size(dtype);
    const bool in_place =
        in == static_cast<const char*>(out) + static_cast<std::size_t>(rank_) * block;
    return run("all_gather", send_count, dtype, opts, {in, block},
               {out, block * static_cast<std::size_t>(size_)}, in_place,
               [=, this](const void* s, void* r) {
                 return ncclAllGather(s, r, send_count, nccl_type(dtype), comm_, stream_);
               });
  }

  Work broadcast(const void* in, void* out, std::size_t count, DataType dtype, int root,
                 const OpOptions& opts) override {
    dear::check_root(root, size_, rank_, "broadcast");
    const std::size_t bytes = count * dtype_size(dtype);
    return run("broadcast", count, dtype, opts, {rank_ == root ? in : nullptr, bytes}, {out, bytes},
               false, [=, this](const void* s, void* r) {
                 return ncclBroadcast(s, r, count, nccl_type(dtype), root, comm_, stream_);
               });
  }

  Work reduce(const void* in, void* out, std::size_t count, DataType dtype, ReduceOp op, int root,
              const OpOptions& opts) override {
    dear::check_root(root, size_, rank_, "reduce");
    const std::size_t bytes = count * dtype_size(dtype);
    // Off the root NCCL writes the result nowhere the caller sees: a staged buffer of its own.
    const bool root_here = rank_ == root;
    return run("reduce", count, dtype, opts, {in, bytes}, {root_here ? out : nullptr, bytes},
               root_here && in == out, [=, this](const void* s, void* r) {
                 return ncclReduce(s, r, count, nccl_type(dtype), nccl_op(op), root, comm_,
                                   stream_);
               });
  }

  Work scatter(const void* in, void* out, std::size_t recv_count, DataType dtype, int root,
               const OpOptions& opts) override {
    dear::check_root(root, size_, rank_, "scatter");
    const std::size_t block = recv_count * dtype_size(dtype);
    const auto n = static_cast<std::size_t>(size_);
    const bool root_here = rank_ == root;
    const bool in_place =
        root_here && out == static_cast<const char*>(in) + static_cast<std::size_t>(root) * block;
    // NCCL has no scatter: the root sends every other rank its block in one group of
    // point-to-point calls.
    return run(
        "scatter", recv_count, dtype, opts, {root_here ? in : nullptr, root_here ? n * block : 0},
        {out, block}, in_place, [=, this](const void* s, void* r) {
          return root_exchange(false, root, const_cast<void*>(s), r, recv_count, dtype, in_place);
        });
  }

  Work gather(const void* in, void* out, std::size_t send_count, DataType dtype, int root,
              const OpOptions& opts) override {
    dear::check_root(root, size_, rank_, "gather");
    const std::size_t block = send_count * dtype_size(dtype);
    const auto n = static_cast<std::size_t>(size_);
    const bool root_here = rank_ == root;
    const bool in_place =
        root_here && in == static_cast<const char*>(out) + static_cast<std::size_t>(root) * block;
    // NCCL has no gather: the root receives every other rank's block in one group of
    // point-to-point calls. Off the root the output is a staged buffer nobody reads.
    return run("gather", send_count, dtype, opts, {in, block},
               {root_here ? out : nullptr, root_here ? n * block : block}, in_place,
               [=, this](const void* s, void* r) {
                 return root_exchange(true, root, r, const_cast<void*>(s), send_count, dtype,
                                      in_place);
               });
  }

  Work all_to_all(const void* in, void* out, std::size_t count, DataType dtype,
                  const OpOptions& opts) override {
    const std::size_t bytes = count * dtype_size(dtype) * static_cast<std::size_t>(size_);
    const bool in_place = in == out;
    // One group of point-to-point calls (ncclAlltoAll is 2.28's): block p to and from rank p.
    // In place, the sends read a copy of the input, which the receives overwrite.
    return run("all_to_all", count, dtype, opts, {in, bytes}, {out, bytes}, in_place,
               [=, this](const void* s, void* r) {
                 const std::size_t block = count * dtype_size(dtype);
                 void* copy = nullptr;
                 if (in_place && bytes > 0) {
                   cuda(cudaMallocAsync(&copy, bytes, stream_), "cudaMallocAsync");
                   cuda(cudaMemcpyAsync(copy, s, bytes, cudaMemcpyDeviceToDevice, stream_),
                        "cudaMemcpyAsync");
                 }
                 const char* from =
                     copy != nullptr ? static_cast<const char*>(copy) : static_cast<const char*>(s);
                 char* to = static_cast<char*>(r);
                 ncclResult_t rc = ncclGroupStart();
                 for (int p = 0; p < size_ && rc == ncclSuccess; ++p) {
                   const std::size_t at = static_cast<std::size_t>(p) * block;
                   rc = ncclSend(from + at, count, nccl_type(dtype), p, comm_, stream_);
                   if (rc == ncclSuccess) {
                     rc = ncclRecv(to + at, count, nccl_type(dtype), p, comm_, stream_);
                   }
                 }
                 const ncclResult_t end = ncclGroupEnd();
                 if (copy != nullptr) cuda(cudaFreeAsync(copy, stream_), "cudaFreeAsync");
                 return rc != ncclSuccess ? rc : end;
               });
  }

  Work all_to_all_v(const void* in, std::span<const std::size_t> send_counts,
                    std::span<const std::size_t> send_displs, void* out,
                    std::span<const std::size_t> recv_counts,
                    std::span<const std::size_t> recv_displs, DataType dtype,
                    const OpOptions& opts) override {
    const std::size_t el = dtype_size(dtype);
    const char* name = "all_to_all_v";
    check_per_rank(send_counts, "send_counts", size_, rank_, name);
    check_per_rank(send_displs, "send_displs", size_, rank_, name);
    check_per_rank(recv_counts, "recv_counts", size_, rank_, name);
    check_per_rank(recv_displs, "recv_displs", size_, rank_, name);
    const AllToAllLists l(send_counts, send_displs, recv_counts, recv_displs);
    // One group of point-to-point calls, each peer's part at its displacement (out of place).
    return run(name, 0, dtype, opts, {in, layout_extent(send_counts, send_displs, el)},
               {out, layout_extent(recv_counts, recv_displs, el)}, false,
               [=, this](const void* s, void* r) {
                 const auto* from = static_cast<const char*>(s);
                 auto* to = static_cast<char*>(r);
                 ncclResult_t rc = ncclGroupStart();
                 for (int p = 0; p < size_ && rc == ncclSuccess; ++p) {
                   const auto u = static_cast<std::size_t>(p);
                   if (l.send_counts[u] > 0) {
                     rc = ncclSend(from + l.send_displs[u] * el, l.send_counts[u], nccl_type(dtype),
                                   p, comm_, stream_);
                   }
                   if (rc == ncclSuccess && l.recv_counts[u] > 0) {
                     rc = ncclRecv(to + l.recv_displs[u] * el, l.recv_counts[u], nccl_type(dtype),
                                   p, comm_, stream_);
                   }
                 }
                 const ncclResult_t end = ncclGroupEnd();
                 return rc != ncclSuccess ? rc : end;
               });
  }

  Work send(const void* buf, std::size_t count, DataType dtype, int peer,
            const OpOptions& opts) override {
    check_peer(peer, size_, rank_, "send");
    if (opts.tag != 0) {
      throw Error(ErrorCode::kInvalidArgument,
                  "OpOptions::tag=" + std::to_string(opts.tag) + ": NCCL has no tags (only 0)",
                  rank_, Error::kNone, "send");
    }
    return run("send", count, dtype, opts, {buf, count * dtype_size(dtype)}, {nullptr, 0}, false,
               [=, this](const void* s, void*) {
                 return ncclSend(s, count, nccl_type(dtype), peer, comm_, stream_);
               });
  }

  Work recv(void* buf, std::size_t count, DataType dtype, int peer,
            const OpOptions& opts) override {
    if (peer == kAnySource) {
      throw Error(ErrorCode::kInvalidArgument,
                  "peer=kAnySource: NCCL has no receive from any source (name the sender)", rank_,
                  Error::kNone, "recv");
    }
    check_peer(peer, size_, rank_, "recv");
    if (opts.tag != 0) {
      throw Error(ErrorCode::kInvalidArgument,
                  "OpOptions::tag=" + std::to_string(opts.tag) + ": NCCL has no tags (only 0)",
                  rank_, Error::kNone, "recv");
    }
    return run("recv", count, dtype, opts, {nullptr, 0}, {buf, count * dtype_size(dtype)}, false,
               [=, this](const void*, void* r) {
                 return ncclRecv(r, count, nccl_type(dtype), peer, comm_, stream_);
               });
  }

  Work barrier(const OpOptions& opts) override {
    // NCCL has no barrier: an all_reduce of one byte holds every rank back the same way.
    return run("barrier", 1, DataType::kUint8, opts, {nullptr, 1}, {nullptr, 1}, false,
               [this](const void* s, void* r) {
                 return ncclAllReduce(s, r, 1, ncclUint8, ncclSum, comm_, stream_);
               });
  }

  void abort(const std::string& reason) override {
    ops_->fail(Error(ErrorCode::kAborted, "Communicator::abort(): " + reason, rank_));
  }

 private:
  struct Buffer {
    const void* ptr;
    std::size_t bytes;
  };

  struct Pending final : ExternalOps::Op {
    cudaEvent_t done = nullptr;
    ncclComm_t comm = nullptr;
    int rank = 0;
    void* staged_in = nullptr;  // device copies of host buffers, freed on the stream
    void* staged_out = nullptr;
    ~Pending() override {
      if (done != nullptr) (void)cudaEventDestroy(done);
    }
    bool test() override {
      ncclResult_t async = ncclSuccess;
      if (ncclCommGetAsyncError(comm, &async) == ncclSuccess && async != ncclSuccess &&
          async != ncclInProgress) {
        throw Error(ErrorCode::kPeerFailed, what + ": NCCL: " + ncclGetErrorString(async), rank);
      }
      const cudaError_t e = cudaEventQuery(done);
      if (e == cudaErrorNotReady) return false;
      if (e != cudaSuccess) {
        throw Error(ErrorCode::kSystem, what + ": CUDA: " + cudaGetErrorString(e), rank);
      }
      return true;
    }
  };

  void cuda(cudaError_t e, const char* call) const {
    if (e != cudaSuccess) {
      throw Error(ErrorCode::kSystem, std::string(call) + ": " + cudaGetErrorString(e), rank_);
    }
  }
  void nccl(ncclResult_t r, const char* call) const {
    if (r != ncclSuccess) {
      throw Error(ErrorCode::kSystem, std::string(call) + ": " + ncclGetErrorString(r), rank_);
    }
  }

  // Gather (`to_root`) or scatter as one group of point-to-point calls, NCCL having neither:
  // the root's `whole` holds every rank's block of `count` elements, `own` is this rank's
  // block; the root's own block is copied between the two unless they are one (`in_place`).
  ncclResult_t root_exchange(bool to_root, int root, void* whole, void* own, std::size_t count,
                             DataType dtype, bool in_place) {
    const std::size_t block = count * dtype_size(dtype);
    char* base = static_cast<char*>(whole);
    const bool root_here = rank_ == root;
    if (root_here && !in_place && block > 0) {
      char* mine = base + static_cast<std::size_t>(root) * block;
      cuda(cudaMemcpyAsync(to_root ? mine : own, to_root ? own : mine, block,
                           cudaMemcpyDeviceToDevice, stream_),
           "cudaMemcpyAsync");
    }
    ncclResult_t rc = ncclGroupStart();
    for (int p = 0; p < size_ && rc == ncclSuccess; ++p) {
      void* at = base + static_cast<std::size_t>(p) * block;
      if (root_here && p != root) {
        rc = to_root ? ncclRecv(at, count, nccl_type(dtype), p, comm_, stream_)
                     : ncclSend(at, count, nccl_type(dtype), p, comm_, stream_);
      } else if (!root_here && p == root) {
        rc = to_root ? ncclSend(own, count, nccl_type(dtype), root, comm_, stream_)
                     : ncclRecv(own, count, nccl_type(dtype), root, comm_, stream_);
      }
    }
    const ncclResult_t end = ncclGroupEnd();
    return rc != ncclSuccess ? rc : end;
  }

  // Stages host buffers through device memory (allocated and freed on the stream), makes the
  // NCCL call, copies a staged result back, and records the completion event.
  template <typename Call>
  Work run(const char* name, std::size_t count, DataType dtype, const OpOptions& opts, Buffer in,
           Buffer out, bool in_place, Call call) {
    auto p = std::make_unique<Pending>();
    p->what = std::string(name) + " count=" + std::to_string(count) +
              " dtype=" + std::string(to_string(dtype));
    p->deadline = deadline_of(opts, options_);
    p->comm = comm_;
    p->rank = rank_;
    return ops_->submit(std::move(p), [&](ExternalOps::Op& op) {
      auto& me = static_cast<Pending&>(op);
      cuda(cudaSetDevice(device_), "cudaSetDevice");
      const auto stage = [&](Buffer b, void** staged, bool upload) -> void* {
        if (on_device(b.ptr)) return const_cast<void*>(b.ptr);
        cuda(cudaMallocAsync(staged, b.bytes, stream_), "cudaMallocAsync");
        if (upload && b.ptr != nullptr) {
          cuda(cudaMemcpyAsync(*staged, b.ptr, b.bytes, cudaMemcpyHostToDevice, stream_),
               "cudaMemcpyAsync");
        }
        return *staged;
      };
      const void* dev_in = nullptr;
      void* dev_out = nullptr;
      if (in_place) {
        // One buffer holds the other (reduce_scatter: the input holds the output; all_gather:
        // the output holds the input; all_reduce: they are one): stage the larger one whole.
        const Buffer big = out.bytes >= in.bytes ? out : in;
        char* dev_big = static_cast<char*>(stage(big, &me.staged_out, true));
        const auto* base = static_cast<const char*>(big.ptr);
        dev_in = dev_big + (static_cast<const char*>(in.ptr) - base);
        dev_out = dev_big + (static_cast<const char*>(out.ptr) - base);
      } else {
        dev_out = stage(out, &me.staged_out, false);
        // A broadcast's non-root ranks and the barrier have no input of their own.
        dev_in = in.ptr == nullptr ? dev_out : stage(in, &me.staged_in, true);
      }
      nccl(call(dev_in, dev_out), name);
      if (me.staged_out != nullptr && out.ptr != nullptr) {
        cuda(cudaMemcpyAsync(const_cast<void*>(out.ptr), dev_out, out.bytes, cudaMemcpyDeviceToHost,
                             stream_),
             "cudaMemcpyAsync");
      }
      if (me.staged_in != nullptr) cuda(cudaFreeAsync(me.staged_in, stream_), "cudaFreeAsync");
      if (me.staged_out != nullptr) cuda(cudaFreeAsync(me.staged_out, stream_), "cudaFreeAsync");
      cuda(cudaEventCreateWithFlags(&me.done, cudaEventDisableTiming), "cudaEventCreate");
      cuda(cudaEventRecord(me.done, stream_), "cudaEventRecord");
    });
  }

  CommOptions options_;
  int rank_ = 0;
  int size_ = 1;
  int device_ = 0;
  ncclComm_t comm_ = nullptr;
  cudaStream_t stream_ = nullptr;
  bool aborted_ = false;
  std::unique_ptr<ExternalOps> ops_;
};

}  // namespace

bool nccl_built() noexcept { return true; }

std::unique_ptr<Communicator> make_nccl_communicator(Bootstrap& bootstrap, CommOptions options) {
  return std::make_unique<NcclCommunicator>(bootstrap, std::move(options));
}

}  // namespace dear::scheduler
