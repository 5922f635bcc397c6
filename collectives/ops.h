// Operations as slice-level state machines on a ring.
//
// Every collective here is a schedule of messages on each channel of the two ring links, in
// one or both directions: direction 0 sends to the next rank and receives from the previous
// one, direction 1 (used by the small all-reduce) the other way round. In each direction an
// operation has a sequence of send steps and of receive steps. Each
// step moves one chunk (a block of the operation's element space), split over the channels
// and, within a channel, into `slices` slices; message i of a channel is (step i / slices,
// slice i % slices). A send may depend on a receive: in the ring algorithms step s forwards
// what arrived at step s - 1, so send i waits for receive i - slices; in the chain (broadcast)
// send i forwards receive i.
//
// Both ends compute the same schedule from the operation's parameters, so a slice needs no
// more than (sequence, index) on the wire to be placed, and a disagreement shows up as a
// header that does not match what the receiver expects.
#pragma once

#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "collectives/executor.h"
#include "dear/communicator.h"
#include "dear/types.h"
#include "transport/link.h"

namespace dear::collectives {

enum class OpKind : std::uint8_t {
  kAllReduce = 1,
  kReduceScatter,
  kAllGather,
  kBroadcast,
  kBarrier,
  kAllToAll,   // block j of every rank's input goes to rank j (steps.h: kPairwise, kScattered)
  kAllToAllV,  // all_to_all with a count and displacement per peer (Op::layout)
};
[[nodiscard]] constexpr bool is_all_to_all(OpKind kind) noexcept {
  return kind == OpKind::kAllToAll || kind == OpKind::kAllToAllV;
}
[[nodiscard]] const char* to_string(OpKind k) noexcept;
// Communicator::reduce is a kAllReduce with a root (>= 0) and Communicator::gather a
// kAllGather with one: they run their collective's schedules (and a tree of their own, steps.h),
// the root keeps the result and every other rank's output is the engine's sink (Op::sink),
// which nothing reads. The root travels in every frame, so a reduce never matches an
// all_reduce or a reduce to another root (likewise a gather).
[[nodiscard]] constexpr bool is_reduce(OpKind kind, int root) noexcept {
  return kind == OpKind::kAllReduce && root >= 0;
}
[[nodiscard]] constexpr bool is_gather(OpKind kind, int root) noexcept {
  return kind == OpKind::kAllGather && root >= 0;
}
// Communicator::scatter is a kReduceScatter with a root: the root's input holds every rank's
// block, and nothing is reduced. It runs one schedule, the tree (steps.h): each rank's blocks
// come down its branch of a binomial tree from the root.
[[nodiscard]] constexpr bool is_scatter(OpKind kind, int root) noexcept {
  return kind == OpKind::kReduceScatter && root >= 0;
}
// A reduce or gather: an operation whose result only the root keeps.
[[nodiscard]] constexpr bool is_rooted_result(OpKind kind, int root) noexcept {
  return is_reduce(kind, root) || is_gather(kind, root);
}
// The name of the call an operation came from ("reduce", "gather", "scatter", "gather_v"), for
// messages. An all_to_all_v with a root is a gather_v (its root travels in every frame).
[[nodiscard]] const char* call_name(OpKind kind, int root) noexcept;

// How an operation is carried out; part of what ranks must agree on.
enum class Schedule : std::uint8_t {
  kRing = 1,          // ring reduce-scatter and/or all-gather over N chunks
  kGatherReduce = 2,  // all-gather of whole inputs around the ring in both directions at once
                      // (ceil((N-1)/2) steps), then a local reduction (small sizes)
  kChain = 3,         // pipelined chain from the root along the ring (broadcast)
  kBiGather = 4,      // all_gather / barrier around the ring in both directions at once
                      // (ceil((N-1)/2) steps; small sizes)
  // Log-step schedules over the mesh links (steps.h).
  kRecursiveDoubling = 5,  // all_reduce: whole vectors exchanged, log2(N) steps;
                           // all_gather: recursive doubling of blocks
  kHalvingDoubling = 6,    // recursive halving (reduce_scatter) then doubling (all_gather):
                           // Rabenseifner's all_reduce, 2 log2(N) steps
  kTree = 7,               // all_reduce: binomial tree reduce to rank 0, then broadcast;
                           // reduce, gather and scatter: a binomial tree with the root on
                           // top, or rooted at rank 0 with a path to the root (steps.h)
  // all_to_all's own, which never travel in the frame's three bits of schedule (kind_byte):
  kPairwise = 8,   // all_to_all: N-1 steps, step k sends to rank + k and receives
                   // from rank - k
  kScattered = 9,  // all_to_all: every send at once, then every receive (one round); reduce,
                   // gather and scatter: straight between the root and every rank (one round)
  kBruck = 10,     // all_to_all (equal blocks): Bruck's ceil(log2 N) rounds (steps.h)
};
[[nodiscard]] const char* to_string(Schedule s) noexcept;

inline constexpr int kMaxChannels = 16;
// Device operations' slices are at most this large: one fits a landing slot, which is made at
// this size once and kept.
inline constexpr std::size_t kDeviceSliceBytes = std::size_t{1} << 20;
// A device operation whose vector (all_reduce, reduce) or N blocks (the others) is at most this
// large may run a log-step schedule, in host memory (Op::shadow); a larger one runs the ring.
inline constexpr std::size_t kDeviceLogStepMaxBytes = std::size_t{1} << 20;
inline constexpr int kForward = 0;   // to the next rank, from the previous one
inline constexpr int kBackward = 1;  // to the previous rank, from the next one

// Scratch buffers reused between operations (engine thread only).
class ScratchPool {
 public:
  std::unique_ptr<char[]> acquire(std::size_t bytes, std::size_t* capacity);
  void release(std::unique_ptr<char[]> buf, std::size_t capacity);

 private:
  std::vector<std::pair<std::size_t, std::unique_ptr<char[]>>> free_;
};

// all_to_all_v's layout, in bytes per peer j: send_bytes[j] from in + send_offset[j] go to rank
// j, recv_bytes[j] from rank j land at out + recv_offset[j].
struct AllToAllLayout {
  std::vector<std::size_t> send_bytes, send_offset, recv_bytes, recv_offset;
  // gather_v: only the messages to this rank exist (every other rank sends it its part, the
  // root receives them all, nothing else travels); -1: all_to_all_v's N(N-1) messages.
  int root = -1;
};

// A piece of a Bruck step's message (steps.h): `bytes` at `offset` of the work buffer, or
// (`input`, sends only) of what steps with send_input read.
struct StepPiece {
  std::size_t offset = 0;
  std::size_t bytes = 0;
  bool input = false;
};

// One step of a log-step schedule (steps.h), from one rank's point of view. Offsets are bytes
// in the operation's work buffer.
struct Step {
  int tag = 0;         // schedule-wide id of the message (the frame's index)
  int send_peer = -1;  // -1: this step sends nothing
  std::size_t send_offset = 0;
  std::size_t send_bytes = 0;
  int recv_peer = -1;           // -1: this step receives nothing
  std::size_t recv_offset = 0;  // where the received bytes go (or are reduced into)
  std::size_t recv_bytes = 0;
  bool reduce = false;           // reduce into the work buffer (else copy)
  bool final = false;            // the last reduction of these elements (avg divides here)
  std::size_t stage_offset = 0;  // reduce: where the operand waits in the staging area
  bool wait_send = false;        // the send must have left before the receive is applied
  bool send_input = false;       // the send reads the input (LogStepState::send_base), not work
  // Bruck's all_to_all: the message gathers `send_pieces`, packed into the staging area at
  // `pack_offset` as the send leaves, and scatters into `recv_pieces`: it lands in the staging
  // area at `stage_offset` and is copied out when its step comes. Empty for every other
  // schedule (send_offset and recv_offset say where).
  std::vector<StepPiece> send_pieces, recv_pieces;
  std::size_t pack_offset = 0;
};

struct StepPlan {
  std::vector<Step> steps;
  std::size_t work_bytes = 0;    // the work buffer: the vector (all_reduce) or all N blocks
  std::size_t stage_bytes = 0;   // staging area for operands that arrive before their step
  bool work_is_scratch = false;  // reduce_scatter: works on a copy of the input
};

// A device operation's edges, for the engine to poll and signal (collectives/cuda_executor.cc):
// its input is ready once the work its caller queued before it is done, and its end releases
// the caller's stream. Engine thread; neither blocks.
class OpFence {
 public:
  virtual ~OpFence() = default;
  [[nodiscard]] virtual bool input_ready() = 0;
  [[nodiscard]] virtual int device() const noexcept = 0;  // the CUDA device of its memory
  // Exactly once, before the operation's Work completes, whether it succeeded or not.
  virtual void done() noexcept = 0;
};

// Where an operation is in its life. The engine moves it forward only through
// Op::transition(), which refuses any move not listed here:
//   kQueued    submitted, not started yet (it may wait for its device input, or behind one
//              that does)                                  -> kStarting, kFailed
//   kStarting  started and among the engine's active operations; the local copies its sends
//              read are in flight, so nothing leaves yet    -> kRunning, kFailed
//   kRunning   exchanging its messages                      -> kFinishing, kFailed
//   kFinishing every message is through and every local step done; its final local steps
//              run (an asynchronous executor's final reductions, one at a time)
//                                                           -> kDone, kFailed
//   kDone      its Work has succeeded; kFailed: its Work has failed. Both are final.
// Receives do not wait for the state: a message that arrives for a starting operation is
// placed at once.
enum class OpState : std::uint8_t { kQueued, kStarting, kRunning, kFinishing, kDone, kFailed };
[[nodiscard]] const char* to_string(OpState s) noexcept;
[[nodiscard]] bool transition_allowed(OpState from, OpState to) noexcept;

// The part of an operation that only the schedules on the ring links use (kRing,
// kGatherReduce, kChain, kBiGather): its messages are streamed in slices over the channels of
// the two ring links. A log-step operation leaves it as made: no messages, one channel.
struct RingState {
  // Filled in by plan().
  std::size_t total = 0;  // elements in the chunked space
  int nchunks = 1;
  int channels = 1;
  int slices = 1;
  std::array<int, 2> send_steps{};  // per direction
  std::array<int, 2> recv_steps{};
  int dep_lag = 0;        // send i waits for receive i - dep_lag (ring: slices)
  bool forwards = false;  // whether sends after the first step depend on receives

  // Progress (engine thread).
  using Counters = std::array<std::array<std::uint32_t, kMaxChannels>, 2>;  // [direction][ch]
  Counters send_next{};
  Counters send_done{};
  Counters recv_next{};  // receives that arrived
  Counters recv_done{};  // receives whose step (reduce, copy out of a slot) has completed, in order
  // Direct placement (direct_region): the window this rank opened for its previous rank, and
  // the one its next rank opened for this rank's kForward messages.
  transport::Window window{};
  bool window_open = false;
  transport::Window peer_window{};
  bool has_peer_window = false;
  // A bounced operation's window on the executor's memory (device_window_region): the
  // engine's ring of device landing slots, where its kForward receives land; the next rank's
  // window for this rank's messages is then one too (has_peer_window: they go there, direct).
  bool device_window = false;
  char* landing = nullptr;
  // A copy that start_local() left for later (a ring all_gather's own block, a chain
  // broadcast root's data): no message reads its destination, so the engine makes it in
  // pieces while it waits for the network (copy_piece) and finish_local() makes the rest.
  const char* copy_from = nullptr;
  char* copy_to = nullptr;
  std::size_t copy_left = 0;

  [[nodiscard]] std::uint32_t messages_sent_per_channel(int dir) const {
    return static_cast<std::uint32_t>(send_steps[static_cast<std::size_t>(dir)] * slices);
  }
  [[nodiscard]] std::uint32_t messages_received_per_channel(int dir) const {
    return static_cast<std::uint32_t>(recv_steps[static_cast<std::size_t>(dir)] * slices);
  }
};

// The part of an operation that only the log-step schedules use (steps.h).
struct LogStepState {
  StepPlan plan;          // filled in by plan()
  char* stage = nullptr;  // where early operands wait (in the operation's scratch)
  // Where steps with send_input read: the input, or an in-place all_to_all's copy of it in
  // scratch (its receives overwrite blocks it has still to send).
  const char* send_base = nullptr;
  // Progress (engine thread): steps before step_next are complete; per step, kStep* flags.
  static constexpr std::uint8_t kStepSent = 1;      // its send is queued
  static constexpr std::uint8_t kStepSendDone = 2;  // the transport is done with it
  static constexpr std::uint8_t kStepReceived = 4;  // its receive arrived (and was copied)
  static constexpr std::uint8_t kStepApplying = 8;  // its reduction is issued
  static constexpr std::uint8_t kStepApplied = 16;  // its reduction (or unpacking) is done
  static constexpr std::uint8_t kStepPacked = 32;   // its send's pieces are packed
  std::vector<std::uint8_t> step_state;
  std::uint32_t step_next = 0;
  std::uint32_t sends_in_flight = 0;
  // An out-of-place all_reduce's work buffer (its output) starts as the input without a copy
  // of its own: a step sends from the input where the work buffer does not yet hold the bytes
  // it sends, and reduces input and operand into it (work_source, work_written). `written`
  // lists the byte ranges of the work buffer that hold their value, as [begin, end) pairs,
  // sorted and disjoint.
  bool input_in_place = false;
  std::vector<std::pair<std::size_t, std::size_t>> written;
};

// One collective operation. The top level holds what every schedule uses; `ring` and
// `log_step` what only one family of schedules does.
struct Op {
  // What the caller asked for (identical on every rank).
  OpKind kind = OpKind::kAllReduce;
  Schedule schedule = Schedule::kRing;
  DataType dtype = DataType::kFloat32;
  ReduceOp redop = ReduceOp::kSum;
  std::uint64_t user_count = 0;
  int root = -1;
  int priority = 0;
  std::chrono::milliseconds timeout{0};
  std::shared_ptr<const AllToAllLayout> layout;  // kAllToAllV only (user_count is 0)
  const char* in = nullptr;
  char* out = nullptr;
  // Device memory (the ranks must agree: it travels in the frame's kind byte). Its steps go to
  // the device executor, its slices through landing slots unless the links reach device memory.
  bool device = false;
  std::unique_ptr<OpFence> fence;

  // Set by the engine when the operation starts.
  Executor* exec = nullptr;
  // The links never touch this operation's memory: every send is packed into a landing slot
  // by the executor first, and every receive lands in one and is then reduced or copied out.
  bool bounced = false;
  // A device operation on a log-step schedule (and, with a bouncing test executor, a host one)
  // works in host memory: its input is copied there by `shadow.exec` before it starts, its
  // steps run on host memory with the host executor, and its result is copied back before it
  // completes (docs/architecture.md, "Executors and landing slots"). `in` and `out` then point
  // into the host copy; the caller's pointers are kept here.
  struct Shadow {
    Executor* exec = nullptr;  // makes the two copies; null: no shadow
    const char* user_in = nullptr;
    char* user_out = nullptr;
    std::size_t in_bytes = 0;                                     // copied in, from user_in
    std::size_t out_bytes = 0;                                    // its extent at user_out
    std::vector<std::pair<std::size_t, std::size_t>> out_ranges;  // copied back: offset, bytes
    int buffer = -1;          // the engine's pooled host memory it uses
    bool in_done = false;     // the copy in has completed
    bool out_issued = false;  // the copy back is issued
  } shadow;

  // Filled in by plan().
  std::uint64_t seq = 0;
  int rank = 0;
  int nranks = 1;
  std::size_t el = 1;  // element size
  bool eager = false;
  char* work = nullptr;  // the buffer the schedule works in (out, or scratch)
  char* scratch = nullptr;
  std::unique_ptr<char[]> scratch_owner;
  std::size_t scratch_capacity = 0;
  std::vector<char> tiny;  // barrier payloads
  // A reduce or gather on a rank other than the root: where its result goes instead of the
  // caller's `out` (is_rooted_result); host memory from the engine's scratch pool, or the device
  // executor's.
  char* sink = nullptr;
  std::unique_ptr<char[]> sink_owner;
  std::size_t sink_capacity = 0;

  // Progress (engine thread).
  // Local steps in flight (executor steps of the operation's own: start copies, the deferred
  // own-block copy, the final reductions): the operation runs (sends) once start_pending is
  // 0, and completes once both are.
  int start_pending = 0;
  int local_pending = 0;
  std::size_t finish_next = 0;  // asynchronous executors: final steps issued so far
  // A copy the sends read from (kGatherReduce's own block into the work buffer), made by
  // start_local's caller through the executor before any send leaves.
  const char* start_copy_from = nullptr;
  char* start_copy_to = nullptr;
  std::size_t start_copy_bytes = 0;
  std::chrono::steady_clock::time_point deadline{};
  std::shared_ptr<dear::Work::State> state;

  RingState ring;
  LogStepState log_step;

  // The public call it came from where that is not call_name()'s (all_gather_v).
  const char* called = nullptr;

  [[nodiscard]] const char* name() const noexcept {
    return called != nullptr ? called : call_name(kind, root);
  }
  [[nodiscard]] OpState life() const noexcept { return life_; }
  // Moves the operation to `to`. A move that transition_allowed() refuses throws
  // Error(kInternal) naming the rank, the operation and both states: the engine's record of
  // the operation has gone wrong, and the communicator fails rather than guess.
  void transition(OpState to);
  // Every message is through and no local step is in flight: a running operation may finish,
  // a finishing one may issue its next final step or complete.
  [[nodiscard]] bool finished() const;

 private:
  OpState life_ = OpState::kQueued;
};

// Where a message's bytes live.
struct Span {
  std::size_t offset = 0;  // byte offset in the chunked element space
  std::size_t bytes = 0;
};

struct SliceGeometryOptions {
  int channels = 1;
  std::size_t slice_bytes = 512 * 1024;
  std::size_t min_channel_bytes = 64 * 1024;
  std::size_t eager_bytes = 64 * 1024;
};

// The frame kind byte: collective, schedule, and whether the memory is device memory, which
// every rank must agree on (a header that differs is a mismatch).
[[nodiscard]] std::uint8_t kind_byte(const Op& op);
// The schedule a kind byte carries (an all-to-all's carries none that matters).
[[nodiscard]] Schedule schedule_of_wire(std::uint8_t kind) noexcept;
// The header of data message `index` of `op`, carrying `bytes` of payload.
[[nodiscard]] transport::FrameHeader data_frame(const Op& op, std::uint32_t index,
                                                std::size_t bytes);

// Fills in the schedule fields of `op` for this rank.
void plan(Op& op, int rank, int nranks, const SliceGeometryOptions& geo);

// The chunk and byte span of message i of a channel, for the send or receive side.
struct MessagePlan {
  int step = 0;
  int chunk = 0;
  Span span;
};
[[nodiscard]] MessagePlan send_plan(const Op& op, int dir, int channel, std::uint32_t index);
[[nodiscard]] MessagePlan recv_plan(const Op& op, int dir, int channel, std::uint32_t index);

// Source pointer of a send; destination, reduce operand and finality of a receive.
[[nodiscard]] const char* send_source(const Op& op, const MessagePlan& m);
struct RecvPlace {
  char* dst = nullptr;
  const char* other = nullptr;  // non-null: dst = received op other
  bool final = false;
};
[[nodiscard]] RecvPlace recv_place(const Op& op, const MessagePlan& m);

// Direct placement (transport::Window). A receiver may let its previous rank write the
// messages of direction kForward that it only copies (never reduces) straight into their
// destination; both ends know which those are from the schedule alone.
// The receiver's side: the memory those messages land in (the operation's output), or
// bytes = 0 when the operation has none (reduce_scatter, small and log-step schedules).
struct DirectRegion {
  char* base = nullptr;
  std::size_t bytes = 0;
  std::size_t message_bytes = 0;  // the largest message placed there
};
[[nodiscard]] DirectRegion direct_region(const Op& op);
// The sender's side: for message `m` of direction kForward, its offset in the receiver's
// direct region, or -1 when the receiver does not place it there (it reduces it).
[[nodiscard]] std::int64_t direct_offset(const Op& op, const MessagePlan& m);
// Whether a bounced operation (device memory, or the deferred_bounce tests) may take its
// messages in a window on the executor's memory instead of landing slots in host memory
// (Channel::open_device_window: device memory over verbs or libfabric, no host bounce), and
// its largest message. Empty (bytes 0) unless the operation runs a ring or chain schedule
// whose messages all travel forward and it receives some.
[[nodiscard]] DirectRegion device_window_region(const Op& op);

// Work done locally when the operation starts and ends. start_local() sets up the log-step work
// buffer and leaves the copies to its caller, who makes them through the executor: the one the
// sends read (Op::start_copy_*) and the deferrable one (RingState::copy_*). finish_local() makes
// what is left of the deferred copy, the log-step work buffer's, and with `reductions` the final
// local reduction of kGatherReduce (final_step(); an asynchronous executor has made them).
void start_local(Op& op);
void finish_local(Op& op, bool reductions);
// kGatherReduce all_reduce: the final local reductions, one after another (each reads the
// one before); none for every other schedule.
// Step i < final_step_count(op); built on demand, so that no small operation allocates.
[[nodiscard]] std::size_t final_step_count(const Op& op);
[[nodiscard]] ExecStep final_step(const Op& op, std::size_t i);
// Makes up to `max_bytes` of the operation's deferred copy; false when none is left.
bool copy_piece(Op& op, std::size_t max_bytes);

// Log-step work buffer (LogStepState::input_in_place): where bytes [offset, offset + bytes) of the
// work buffer are to be read from: the input where none of them is written yet, else the work
// buffer, after copying in from the input whatever part of them is not. Without
// input_in_place, the work buffer.
[[nodiscard]] const char* work_source(Op& op, std::size_t offset, std::size_t bytes);
// Records that [offset, offset + bytes) of the work buffer now holds its value.
void work_written(Op& op, std::size_t offset, std::size_t bytes);

}  // namespace dear::collectives
