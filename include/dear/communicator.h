// The communicator: a group of ranks and the collectives they run together.
//
// Contract
// - Collectives are issued in the same order on every rank (as with NCCL and MPI). Each call
//   takes the next sequence number; ranks that disagree about an operation (count, dtype, op,
//   root, collective) all fail with ErrorCode::kMismatch naming both views.
// - Every call returns at once with a Work handle. The operation runs on the communicator's
//   progress engine, which advances all operations in flight slice by slice, the one with the
//   highest priority first; operations of equal priority run in issue order.
// - Buffers must stay valid and untouched (the receive buffer unread) until the Work completes.
// - Every Work completes exactly once: successfully, or with a dear::Error. A peer that dies,
//   stalls past the deadline or reports an error fails every pending Work on every rank; after
//   such an error the communicator is unusable (as an NCCL communicator after ncclCommAbort).
// - Methods are thread-safe: several threads may issue operations, as long as the resulting
//   order is the same on every rank.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>

#include "dear/bootstrap.h"
#include "dear/error.h"
#include "dear/types.h"

namespace dear {

enum class Algorithm : std::uint8_t {
  kAuto = 0,      // the communicator chooses
  kRing,          // ring reduce-scatter + all-gather: bandwidth-optimal, 2(N-1) steps
  kGatherReduce,  // all_reduce only: ring all-gather of whole inputs, then a local reduction:
                  // N-1 steps, for small messages
  // Log-step algorithms over direct links between ranks (2^k apart), for small messages:
  kHalvingDoubling,    // recursive halving (reduce_scatter), recursive doubling (all_gather),
                       // both in turn for all_reduce (Rabenseifner): 2 log2(N) steps
  kRecursiveDoubling,  // all_reduce: whole vectors exchanged, log2(N) steps (the fewest);
                       // all_gather: as kHalvingDoubling
  kTree,               // all_reduce only: binomial tree reduce then broadcast, 2 log2(N) steps
  // all_to_all only, over direct links to every rank:
  kPairwise,   // N-1 steps, step k sends to rank + k and receives from rank - k (large)
  kScattered,  // every send at once, then every receive: one round of latency (small)
  kBruck,      // all_to_all (equal blocks) only: Bruck's log2(N) rounds, each sending about
               // half the blocks packed into one message (small blocks, many ranks)
};
[[nodiscard]] const char* to_string(Algorithm a) noexcept;
[[nodiscard]] std::optional<Algorithm> parse_algorithm(std::string_view name) noexcept;

// Per-operation knobs. Zero means "the communicator's default".
struct OpOptions {
  int priority = 0;  // larger runs first
  Algorithm algorithm = Algorithm::kAuto;
  int channels = 0;                      // parallel rings, each on its own socket
  std::size_t slice_bytes = 0;           // pipelining unit
  std::chrono::milliseconds timeout{0};  // deadline from issue; 0 = communicator's
  // A cudaStream_t (builds with CUDA only): the operation starts after the work already on
  // this stream and work enqueued on it later waits for the result, without the host waiting
  // for the stream. Null: the operation starts after the work already on the legacy default
  // stream. Device buffers (in, out) are detected automatically, with or without a stream; see
  // collectives/device_staging.h.
  void* cuda_stream = nullptr;
  // send/recv only: messages match per pair of ranks and tag, in issue order (MPI's tags, >= 0;
  // the NCCL communicator has none but 0).
  int tag = 0;
};

struct CommOptions {
  // Defaults chosen by measurement (see README); DEAR_CHANNELS, DEAR_SLICE_BYTES and
  // DEAR_TIMEOUT (seconds) override them.
  int channels = 1;
  std::size_t slice_bytes = 512 * 1024;
  std::chrono::milliseconds timeout{std::chrono::minutes(5)};
  // "tcp", "shm" (shared memory within a host, TCP between hosts), "fabric" (libfabric) or "verbs"
  // (ibverbs RC; needs an RDMA device); the last two in builds with their libraries only
  // (DEAR_TRANSPORT).
  std::string transport = "tcp";
  // transport "fabric": the libfabric provider, e.g. "tcp;ofi_rxm", "shm", "sockets",
  // "verbs;ofi_rxm"; empty = the first one libfabric offers that reaches other hosts
  // (DEAR_FABRIC_PROVIDER).
  std::string fabric_provider;
  // transport "fabric": bytes per staging slot, the largest fragment a message is cut into
  // (DEAR_FABRIC_SLOT_BYTES); 0 = the transport's default.
  std::size_t fabric_slot_bytes = 0;
  // transport "fabric": how fragments reach the peer's staging slots: "write" (RMA writes into
  // slots the receiver registered, announced by remote CQ data), "send" (sends into receives
  // the receiver keeps posted), or "auto" (write where the provider offers it, else send)
  // (DEAR_FABRIC_DATA_PATH). Every rank must end up on the same path.
  std::string fabric_data_path = "auto";
  // transport "fabric": whether the domain is opened for CUDA device memory (FI_HMEM), so that
  // device operations' messages are written straight into device memory (GPUDirect RDMA)
  // instead of passing through pinned host memory: "auto" (where this build has CUDA and sees
  // a GPU), "on", "off" (DEAR_FABRIC_HMEM). A provider without FI_HMEM is used without it.
  std::string fabric_hmem = "auto";
  // transports "fabric" (write data path) and "verbs": messages of at least this many bytes
  // that the receiver copies into their destination unchanged (all_gather, broadcast,
  // all_reduce's all-gather steps) are written straight into it, saving the receiver a copy;
  // 0 = never; -1 = the transport's default (DEAR_FABRIC_DIRECT_BYTES).
  std::int64_t fabric_direct_bytes = -1;
  // transport "verbs": the RDMA device, optionally with its port ("mlx5_0", "mlx5_0:1"); empty
  // = the first with an active port (DEAR_IB_DEVICE).
  std::string ib_device;
  // transport "verbs": GID table index; -1 = automatic (RoCE v2 with an IPv4 address)
  // (DEAR_IB_GID_INDEX).
  int ib_gid_index = -1;
  // kAuto picks kGatherReduce for all_reduce up to this many bytes, kRing (or, below
  // halving_max_bytes, kHalvingDoubling) above (DEAR_ALGO forces one; DEAR_SMALL_BYTES
  // overrides the threshold).
  Algorithm algorithm = Algorithm::kAuto;
  std::size_t gather_reduce_max_bytes = 16 * 1024;
  // Without a cost model, from 4 ranks on and where the communicator has its mesh links, kAuto
  // runs all_reduce above gather_reduce_max_bytes and up to this many bytes as recursive
  // halving + doubling, all_gather as recursive doubling, and reduce_scatter up to a quarter
  // of it as halving; the ring above. 0 = the ring from gather_reduce_max_bytes on; -1 = the
  // transport's default: over tcp 4 MiB up to 4 ranks and 1 MiB above, 256 KiB over fabric
  // and verbs, whose mesh links carry fragments of at most 128 KiB (chosen by measurement:
  // docs/results.md) (DEAR_MEDIUM_BYTES). create() replaces -1 with the value.
  std::int64_t halving_max_bytes = -1;
  // A calibrated alpha-beta cost model (`dear-bench --calibrate --json FILE`) replaces that
  // threshold: kAuto then runs the schedule with the lowest predicted time (all_reduce: ring or
  // gather_reduce; all_gather: ring or both directions). A file (DEAR_COST_MODEL), or the
  // numbers themselves (alpha_us and beta_us_per_byte not both 0). Every rank must use the same
  // model. See collectives/cost_model.h.
  std::string cost_model_file;
  double alpha_us = 0;            // per ring step (message)
  double beta_us_per_byte = 0;    // per byte through a rank's egress
  double reduce_us_per_byte = 0;  // local reduction, per byte of an operand
  // Small operations are sent before the receiver has posted them, up to this many bytes per
  // slice and this many operations ahead; larger ones wait for the receiver to be ready.
  std::size_t eager_bytes = 64 * 1024;
  int eager_window = 64;
  // How long the engine thread yields the CPU, once it has moved something, before it sleeps in
  // the kernel (microseconds; DEAR_SPIN_US). Yielding saves a wake-up on every hop of a small
  // operation; 0 sleeps at once. While a thread is yielding in Work::wait() on a large
  // operation, the engine thread yields up to wait_spin_us instead.
  int spin_us = 100;
  // How long a thread in Work::wait() makes progress itself (small operations) or yields (large
  // ones) while nothing moves, before it sleeps until the operation completes (microseconds;
  // DEAR_WAIT_SPIN_US); 0 sleeps at once. The waiter has nothing else to do meanwhile, and a
  // sleep costs a wake-up through the kernel: with 100 µs, a 4-rank 8-byte all_reduce on 2 CPUs
  // had a mean of 106-213 µs and a p99 of 0.3-1.5 ms; with 1000 µs, 100-125 µs and 0.3-0.4 ms.
  // Meanwhile the engine thread, too, yields this long instead of spin_us before it sleeps.
  int wait_spin_us = 1000;
  // Extra one-way latency added to every message on every link, in microseconds
  // (DEAR_LINK_DELAY_US), to emulate slower networks over any transport; 0 adds none. All ranks
  // should use the same value. See transport/delay_channel.h.
  int link_delay_us = 0;
  // What carries out the steps that touch payload of host-memory operations (DEAR_EXECUTOR):
  // "host", the CPU kernels as the engine goes; "deferred", for testing the asynchronous path
  // device memory takes, each step done later on another thread in a shuffled order; and
  // "deferred_bounce", the same with every slice packed into and landed in slots, as for
  // device memory over TCP. Device memory always goes to the CUDA executor.
  std::string executor = "host";
  // Device memory: the whole operation copied to host memory and reduced there (the fallback
  // before device-resident collectives) instead of reduced on the device slice by slice
  // (DEAR_CUDA_STAGING=1). Every rank must choose alike.
  bool cuda_staging = false;
  // Landing slots per channel and direction for operations whose steps complete later
  // (device memory, the deferred executors): bounds the pinned memory a device operation
  // holds, whatever its size (DEAR_LANDING_SLOTS).
  int landing_slots = 4;
  // The communicator's name in the errors its operations fail with ("[comm NAME] ..."); empty
  // for none. split() names each child after its parent and color ("world/1", "world/1/0").
  std::string name;
};

// `options` with the DEAR_* environment overrides applied (DEAR_CHANNELS, DEAR_SLICE_BYTES,
// DEAR_TIMEOUT, DEAR_EAGER_BYTES, DEAR_SMALL_BYTES, DEAR_MEDIUM_BYTES, DEAR_SPIN_US,
// DEAR_TRANSPORT, DEAR_FABRIC_PROVIDER, DEAR_IB_DEVICE, DEAR_IB_GID_INDEX, DEAR_ALGO,
// DEAR_COST_MODEL). Throws dear::Error(kInvalidArgument) naming a variable whose value is
// malformed.
[[nodiscard]] CommOptions apply_env(CommOptions options);

class Work {
 public:
  Work() = default;

  // True once the operation has completed (successfully or not). Never blocks.
  [[nodiscard]] bool test() const;
  // Blocks until the operation completes or `timeout` passes. Returns true when it completed
  // successfully, false on timeout (the operation is still in flight); throws dear::Error if
  // the operation failed.
  bool wait(std::chrono::milliseconds timeout = std::chrono::milliseconds::max()) const;
  // The failure, or null while pending or after success.
  [[nodiscard]] std::exception_ptr error() const;
  [[nodiscard]] std::uint64_t seq() const;
  // A receive's sender (the rank a Communicator::kAnySource receive took its message from),
  // once it has completed; -1 for every other operation and while pending.
  [[nodiscard]] int source() const;
  [[nodiscard]] bool valid() const noexcept { return state_ != nullptr; }

  struct State;
  [[nodiscard]] const State* state() const noexcept { return state_.get(); }
  explicit Work(std::shared_ptr<State> state) : state_(std::move(state)) {}

 private:
  std::shared_ptr<State> state_;
};

class Communicator {
 public:
  virtual ~Communicator() = default;

  // Connects the links this communicator needs (collective over the bootstrap's ranks).
  [[nodiscard]] static std::unique_ptr<Communicator> create(std::unique_ptr<Bootstrap> bootstrap,
                                                            CommOptions options = {});
  // As create(), with options overridden from DEAR_* environment variables.
  [[nodiscard]] static std::unique_ptr<Communicator> create_from_env(
      std::unique_ptr<Bootstrap> bootstrap, CommOptions options = {});

  [[nodiscard]] virtual int rank() const = 0;
  [[nodiscard]] virtual int size() const = 0;
  [[nodiscard]] virtual const CommOptions& options() const = 0;

  // out[count] = op over ranks of in[count]. in == out is allowed (in place).
  virtual Work all_reduce(const void* in, void* out, std::size_t count, DataType dtype, ReduceOp op,
                          const OpOptions& opts = {}) = 0;
  // NCCL convention: in holds size()*recv_count elements, out receives the reduced block
  // rank()*recv_count. In place when out == in + rank()*recv_count*dtype_size.
  virtual Work reduce_scatter(const void* in, void* out, std::size_t recv_count, DataType dtype,
                              ReduceOp op, const OpOptions& opts = {}) = 0;
  // NCCL convention: out holds size()*send_count elements; rank r's block lands at
  // r*send_count. In place when in == out + rank()*send_count*dtype_size.
  virtual Work all_gather(const void* in, void* out, std::size_t send_count, DataType dtype,
                          const OpOptions& opts = {}) = 0;
  // Root's in[count] lands in every rank's out[count]; in is read on the root only.
  virtual Work broadcast(const void* in, void* out, std::size_t count, DataType dtype, int root,
                         const OpOptions& opts = {}) = 0;
  // Root's out[count] = op over ranks of in[count]; out is written on the root only (elsewhere
  // it is ignored and may be null), and in is never written. In place on the root when
  // in == out. Runs the all_reduce's schedules; only the root keeps the result.
  virtual Work reduce(const void* in, void* out, std::size_t count, DataType dtype, ReduceOp op,
                      int root, const OpOptions& opts = {}) = 0;
  // Root's out[size()*send_count] gets rank r's in[send_count] at r*send_count; out is written
  // on the root only (elsewhere it is ignored and may be null). In place on the root when
  // in == out + root*send_count*dtype_size. Runs the all_gather's schedules and a tree of its
  // own; only the root keeps the result.
  virtual Work gather(const void* in, void* out, std::size_t send_count, DataType dtype, int root,
                      const OpOptions& opts = {}) = 0;
  // Every rank's out[recv_count] gets block r of the root's in[size()*recv_count]; in is read on
  // the root only (elsewhere it may be null). In place on the root when
  // out == in + root*recv_count*dtype_size. Runs a binomial tree from the root over the mesh
  // links (host memory; device buffers are staged through host memory whole).
  virtual Work scatter(const void* in, void* out, std::size_t recv_count, DataType dtype, int root,
                       const OpOptions& opts = {}) = 0;
  // Block j of in[size()*count] goes to rank j, and block j of out[size()*count] comes from
  // rank j (MPI_Alltoall). In place when in == out. Runs over direct links to every rank
  // (kPairwise or kScattered; communicators of up to 64 ranks); device buffers are staged
  // through host memory whole.
  virtual Work all_to_all(const void* in, void* out, std::size_t count, DataType dtype,
                          const OpOptions& opts = {}) = 0;
  // all_to_all with a count and a displacement per peer, in elements (MPI_Alltoallv): rank j
  // gets send_counts[j] elements from in + send_displs[j], and recv_counts[j] elements from
  // rank j land at out + recv_displs[j]. Each span has size() entries and is copied at the
  // call; send_counts[j] here must equal recv_counts[rank()] on rank j (a difference is an
  // error on both, naming the sizes). Out of place only: in and out must not overlap.
  virtual Work all_to_all_v(const void* in, std::span<const std::size_t> send_counts,
                            std::span<const std::size_t> send_displs, void* out,
                            std::span<const std::size_t> recv_counts,
                            std::span<const std::size_t> recv_displs, DataType dtype,
                            const OpOptions& opts = {}) = 0;
  // Point-to-point (ncclSend/ncclRecv, MPI_Isend/MPI_Irecv): `count` elements of `buf` to rank
  // `peer`, or from it into `buf`. A rank's sends to a peer match that peer's receives from it
  // of the same OpOptions::tag in issue order, whatever else runs meanwhile, and a count or
  // dtype that differs fails both
  // ends, naming both views. Sends of up to CommOptions::eager_bytes leave at once (and wait in
  // the receiver's memory if they arrive first); larger ones wait until the receive is posted
  // and land straight in its buffer. Over the direct link between the two ranks (communicators
  // of up to 64 ranks); device buffers are staged whole. `peer` must be another rank.
  // MPI_Allgatherv: rank j's in[send_count] lands at out + recv_displs[j] on every rank, whose
  // recv_counts[j] must equal rank j's send_count (a difference fails both, naming the sizes).
  // Out of place only. Runs as all_to_all_v (each rank's block straight to every rank); its
  // errors name all_gather_v (those of the MPI and NCCL communicators: all_to_all_v).
  virtual Work all_gather_v(const void* in, std::size_t send_count, void* out,
                            std::span<const std::size_t> recv_counts,
                            std::span<const std::size_t> recv_displs, DataType dtype,
                            const OpOptions& opts = {});
  // MPI_Gatherv: as all_gather_v, into the root's out only. Elsewhere recv_counts and
  // recv_displs are not read (they may be empty) and out may be null. Only the N-1 parts to
  // the root travel; a rank that names another root fails with a mismatch once a part reaches
  // a rank that expects none.
  virtual Work gather_v(const void* in, std::size_t send_count, void* out,
                        std::span<const std::size_t> recv_counts,
                        std::span<const std::size_t> recv_displs, DataType dtype, int root,
                        const OpOptions& opts = {});
  // A receive's `peer` may be kAnySource (MPI_ANY_SOURCE): it takes the first message of its
  // tag that any rank sends it and that no receive posted before it takes; receives of that
  // tag posted after it wait until it has one. Work::source() names the sender.
  static constexpr int kAnySource = -1;
  virtual Work send(const void* buf, std::size_t count, DataType dtype, int peer,
                    const OpOptions& opts = {}) = 0;
  virtual Work recv(void* buf, std::size_t count, DataType dtype, int peer,
                    const OpOptions& opts = {}) = 0;
  virtual Work barrier(const OpOptions& opts = {}) = 0;

  // What this communicator's progress engine has used so far, for benchmarks: the CPU time of
  // its thread (turns that waiting threads ran themselves are theirs), and the most landing-slot
  // memory it has held at once (pinned host memory for device operations). Zero where a
  // communicator has no engine of dear's.
  struct EngineStats {
    double cpu_seconds = 0;
    std::size_t peak_landing_bytes = 0;
    // Messages of device operations received straight into a window in device memory (verbs
    // or libfabric with GPUDirect RDMA: no pass through host memory), not into landing slots.
    std::uint64_t device_window_messages = 0;
    // The device memory those windows take (channels x landing_slots x 1 MiB, whatever the
    // operations' sizes); 0 where none was opened.
    std::size_t device_window_bytes = 0;
  };
  [[nodiscard]] virtual EngineStats engine_stats() const { return {}; }

  // A color for split(): this rank joins no child (MPI_UNDEFINED, NCCL_SPLIT_NOCOLOR).
  static constexpr int kNoColor = -1;
  // MPI_Comm_split / ncclCommSplit: collective over this communicator, called by every rank in
  // the same order as its other split() calls. The ranks that pass one color (>= 0) form a
  // child, ranked by key and then by their rank here; a rank passing kNoColor gets null. The
  // child rendezvous through this communicator's bootstrap (no launcher is involved) and
  // connects links of its own, so it and its parent run operations concurrently, each in its
  // own order; it has this communicator's options, named "NAME/COLOR" (CommOptions::name).
  // A child can split in turn. Thread-safe against this communicator's other calls.
  virtual std::unique_ptr<Communicator> split(int color, int key);

  // Fails every pending Work (here and, through the links, on the peers) with kAborted and
  // `reason`; later calls fail at once. Safe from any thread; returns without waiting.
  virtual void abort(const std::string& reason) = 0;

  // Changes the priority of an operation already issued on this communicator, so that its
  // remaining slices go out in the new order (OpOptions::priority: larger first). Local: each
  // rank decides its own send order, nothing needs to agree. Safe from any thread; takes
  // effect at the engine's next turn. Returns false when it cannot: `work` is done, not from
  // this communicator, or the communicator cannot reorder operations it holds (the default,
  // e.g. the MPI and NCCL communicators of the scheduler).
  virtual bool set_priority(const Work& work, int priority) {
    (void)work;
    (void)priority;
    return false;
  }

  // The caller is about to free or reuse [addr, addr + bytes): transports that register
  // callers' memory with the NIC and cache the registrations by address (libfabric providers
  // that need local registration, e.g. verbs;ofi_rxm and efa) drop those overlapping it, so
  // that memory allocated there later is registered afresh instead of being reached through a
  // registration of the old pages. Call it once the operations that used the memory have
  // completed; it takes effect before any operation issued after it starts. Local (nothing
  // needs to agree across ranks) and cheap where nothing is cached (TCP; the default, e.g.
  // the MPI and NCCL communicators of the scheduler). Throws dear::Error(kInvalidArgument)
  // for a null addr with bytes > 0.
  virtual void forget_memory(const void* addr, std::size_t bytes) {
    (void)addr;
    (void)bytes;
  }

 protected:
  // all_gather_v (`root` -1) and gather_v once their arguments are checked, as all_to_all_v
  // lists: this rank's block to every rank (to the root only for gather_v), and what it
  // receives (nothing off a gather_v's root). This runs all_to_all_v; a communicator may run
  // them otherwise (dear's sends a gather_v's parts to the root only and names the call in
  // its errors).
  virtual Work gather_as_all_to_all_v(int root, const void* in,
                                      std::span<const std::size_t> send_counts,
                                      std::span<const std::size_t> send_displs, void* out,
                                      std::span<const std::size_t> recv_counts,
                                      std::span<const std::size_t> recv_displs, DataType dtype,
                                      const OpOptions& opts) {
    (void)root;
    return all_to_all_v(in, send_counts, send_displs, out, recv_counts, recv_displs, dtype, opts);
  }
};

}  // namespace dear
