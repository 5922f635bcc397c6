// The progress engine: one thread per communicator that owns every operation in flight.
//
// Operations are slice-level state machines over the ring links (see ops.h). Each turn the
// engine moves bytes on every channel, then fills the send queues from the operations that can
// move a slice, highest priority first, and sleeps in poll() only when nothing can move.
// Slices carry (sequence, index) so a receiver matches them even when operations interleave.
//
// Flow control: a large operation's slices leave only once the receiver has announced that it
// posted that operation (a kPosted frame), so a receiver never has to buffer a large slice it
// cannot place. Small ("eager") operations may run ahead of the receiver by a bounded window of
// operations; their slices wait in a bounded pool until the operation is posted.
//
// Failure: any error (a peer closed or reset a link, a mismatch, a deadline) is fatal to the
// communicator, as in NCCL: every pending Work fails with it, peers are told with a kAbort
// frame carrying the reason and the rank to blame, and later calls fail at once.
//
// The implementation is a file per responsibility (docs/architecture.md, "Progress engine"):
// engine.cc (construction, starting, announcing, priorities, completion), engine_driver.cc
// (turns, sleeping, waking, threads that drive), engine_dispatch.cc (received frames,
// unexpected messages, windows), engine_ring.cc and engine_log_step.cc (the step machines of
// the ring-link and log-step schedules), engine_failure.cc (failure and deadlines) and
// engine_exec.cc (executors and landing slots); engine_internal.h holds what they share.
#pragma once

#include <pthread.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <exception>
#include <functional>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "collectives/executor.h"
#include "collectives/ops.h"
#include "dear/communicator.h"
#include "transport/link.h"
#include "transport/socket_util.h"

namespace dear {

namespace collectives {
class Engine;
}

struct Work::State {
  std::atomic<int> status{0};  // 0 pending, 1 succeeded, 2 failed
  std::mutex mu;
  std::condition_variable cv;
  std::exception_ptr error;
  std::uint64_t seq = 0;
  int source = -1;       // a receive: the rank its message came from, set before it completes
  int wait_spin_us = 0;  // wait() drives the engine (or yields) this long before it sleeps
  // The engine that runs it; empty for operations finished at once.
  std::weak_ptr<collectives::Engine> engine;
  // Small operations: their waiter makes their progress itself (Engine::drive). Large ones
  // are left to the engine thread, and their waiter only keeps it spinning (Engine::await).
  bool driven = false;

  void complete(std::exception_ptr e);
};

namespace collectives {

struct EngineConfig {
  int rank = 0;
  int size = 1;
  int channels = 1;
  std::size_t eager_bytes = 64 * 1024;
  int eager_window = 64;
  int spin_us = 0;                // CommOptions::spin_us
  int wait_spin_us = 0;           // CommOptions::wait_spin_us
  std::string executor = "host";  // CommOptions::executor, for host operations
  // Makes the executor of device operations when the first one starts; empty in a build
  // without CUDA. Device operations go through landing slots (bounced).
  std::function<std::unique_ptr<Executor>(int device)> make_device_executor;
  // Landing slots per channel and direction for operations whose steps are asynchronous.
  int landing_slots = 4;
  // CommOptions::name: the failure every operation gets names the communicator.
  std::string name;
};

class Engine : public std::enable_shared_from_this<Engine> {
 public:
  // links[0] = channels to the next rank, links[1] = channels to the previous rank. Data of
  // direction kForward goes out on links[0] and comes in on links[1]; kBackward the other way;
  // announcements (kPosted) go to the previous rank. `mesh[i]` is one channel to rank
  // `mesh_peers[i]`, for the log-step schedules (steps.h); they need every rank of
  // step_peers(rank, size) and cannot run without them.
  Engine(EngineConfig config, std::vector<std::unique_ptr<transport::Channel>> to_next,
         std::vector<std::unique_ptr<transport::Channel>> from_prev,
         std::vector<int> mesh_peers = {},
         std::vector<std::unique_ptr<transport::Channel>> mesh = {});
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Takes the operation and returns its handle; thread-safe. Sequence numbers are assigned
  // here, in submission order.
  Work submit(std::unique_ptr<Op> op);
  // A send to or receive from one peer (Communicator::send/recv; engine_p2p.cc): outside the
  // collectives' sequence, matched by its place among the pair's sends, in issue order.
  struct P2pCall {
    bool send = false;
    int peer = 0;  // a receive's kAnySource: the first message of its tag from any rank
    const char* src = nullptr;  // send
    char* dst = nullptr;        // receive
    std::uint64_t count = 0;
    DataType dtype = DataType::kFloat32;
    int tag = 0;  // messages match per (pair, tag); it travels in the frame's root
    std::chrono::milliseconds timeout{0};
  };
  // `fence`: the buffer is device memory (collectives/resident.h). The message then leaves
  // from, or lands in, host memory of the engine's, which the device executor fills from the
  // buffer once the fence's input is ready, or copies back to it before the receive completes.
  Work submit_p2p(const P2pCall& call, std::unique_ptr<OpFence> fence = nullptr);
  // Fails everything with kAborted; thread-safe, returns at once.
  void abort(const std::string& reason);
  // Runs engine turns on the calling thread until `state` completes, `until` passes or no
  // turn has moved anything for `idle`, while the engine thread stands aside; returns whether
  // the operation has completed. A thread waiting for a small operation makes its progress
  // itself instead of yielding the CPU to the engine thread and being woken by it: on a
  // machine with fewer cores than threads those hand-offs are most of a small operation's
  // latency.
  // One turn on the calling thread if no other thread is running one; never blocks.
  void poke();
  // Queues a priority change for operation `seq`, applied at the next turn (the active list
  // is re-sorted then); thread-safe. False when that operation has already completed.
  bool set_priority(std::uint64_t seq, int priority);
  // Queues Communicator::forget_memory for every link: applied on the engine's thread before
  // any operation submitted after this call starts; thread-safe, returns at once.
  void forget_memory(const void* addr, std::size_t bytes);
  bool drive(const Work::State& state, std::chrono::steady_clock::time_point until,
             std::chrono::microseconds idle);
  // CPU seconds the engine thread has used; thread-safe.
  [[nodiscard]] double cpu_seconds() const;
  // The most landing memory (bytes) this engine has held at once; thread-safe.
  [[nodiscard]] std::size_t peak_landing_bytes() const {
    return peak_landing_atomic_.load(std::memory_order_relaxed);
  }
  // Messages received into device windows so far (Op::ring.device_window); thread-safe.
  [[nodiscard]] std::uint64_t device_window_messages() const {
    return device_window_messages_.load(std::memory_order_relaxed);
  }
  // The device memory of the window ring (0 before one is made); thread-safe.
  [[nodiscard]] std::size_t device_window_bytes() const {
    return device_window_bytes_.load(std::memory_order_relaxed);
  }
  // Yields until `state` completes, `until`, or `spin` has passed; meanwhile the engine
  // thread spins for wait_spin_us instead of spin_us before it sleeps. True when completed.
  bool await(const Work::State& state, std::chrono::steady_clock::time_point until,
             std::chrono::microseconds spin);

 private:
  class LinkSink;
  friend class LinkSink;
  struct Unexpected;
  struct P2p;
  struct P2pEarly;
  struct RecvCtx {
    Op* op = nullptr;             // null: unexpected or control message
    int slot = -1;                // the landing slot the payload goes to
    int dir = 0;                  // direction the message travels (collectives::kForward, ...)
    char* dst = nullptr;          // reduce destination / direct destination
    const char* other = nullptr;  // reduce operand from local memory
    bool final = false;
    bool reduce = false;
    int step = -1;                         // log-step schedules: the local step being received
    struct Unexpected* pending = nullptr;  // an unexpected message being stored
    struct P2p* p2p = nullptr;             // a receive being filled
    struct P2pEarly* early = nullptr;      // an early point-to-point message being stored
  };
  struct Unexpected {
    transport::FrameHeader header;
    int link;
    int channel;
    std::vector<char> data;
    bool complete = false;  // all of its payload has arrived
  };

  // Construction, starting, announcing, priorities and completion (engine.cc).
  void apply_priorities();
  void announce();
  void start(std::unique_ptr<Op> op);
  void complete_finished();
  // A piece of the first deferred local copy (RingState::copy_left) among the active operations;
  // false when there is none.
  bool copy_while_waiting();
  Op* find(std::uint64_t seq);
  [[nodiscard]] bool may_send(const Op& op) const;
  [[nodiscard]] int peer_of(int link) const;

  // The driver: turns, sleeping and waking (engine_driver.cc).
  void run();
  // One turn of the engine; the caller holds turn_mu_. `read_links` false: a submitting
  // thread's turn, which starts what was submitted and hands its first messages to the links
  // without reading them (the waiting thread or the engine thread reads them next).
  bool turn(bool read_links = true);
  // A turn for a thread waiting while only point-to-point operations are in flight: it reads
  // and flushes just the channels of the peers they wait on, with no poll() first, and moves
  // the point-to-point queues. nullopt where it does not apply (collectives in flight,
  // submissions queued, a receive from any source, a failure to report): run turn() then.
  std::optional<bool> p2p_turn();
  // The point-to-point part of a turn alone (drain_p2p, advance_p2p), for the thread that
  // submits a small send or receive (submit_p2p).
  bool p2p_submit_turn();
  // The same for a thread waiting while only log-step collectives are in flight (the small
  // operations' schedules on the mesh links): it reads and flushes just the channels of the
  // peers their current steps exchange with, advances their steps and completes what ended.
  // nullopt where it does not apply (anything else in flight or queued, steps with the
  // executor, an announcement due, a send held back for the peer's post): run turn() then.
  std::optional<bool> log_step_turn();
  // What both narrow turns need: no submission or priority change queued, no receive from any
  // source, no abort asked for, no executor step in flight.
  [[nodiscard]] bool narrow_turn_allowed() const;
  // A narrow turn's progress of the mesh channel on link `l`: reading it (with no poll() first;
  // not while its landing slots are full), or only sending what it has queued.
  bool progress_mesh(int l, bool may_read);
  // Runs a turn's `work` (returns whether it moved anything): an error from it fails the
  // communicator and counts as movement; then records whether anything is left in flight.
  template <typename Fn>
  bool guarded_turn(Fn&& work);
  void sleep_idle();
  bool drain_submissions();
  void wait_for_events(std::unique_lock<std::mutex>& turn);
  bool wake_if(int mode);  // wakes the engine thread if it is in `mode`
  void wake();

  // The receive dispatcher (engine_dispatch.cc), called by LinkSink, and the links' progress.
  transport::RecvTarget on_header(int link, int channel, const transport::FrameHeader& h);
  void on_payload(int link, int channel, const char* data, std::size_t offset, std::size_t len);
  void on_message(int link, int channel, const transport::FrameHeader& h);
  void on_sent(int link, int channel, std::uint64_t token);
  void on_closed(int link, int channel);
  void check_link_needed(const Op& op, int link, int channel);
  void check_header(const Op& op, int peer, const transport::FrameHeader& h) const;
  transport::RecvTarget target_for(Op& op, int dir, int channel, const transport::FrameHeader& h,
                                   RecvCtx& ctx);
  void replay_unexpected(Op& op);
  // Moves a replayed message's node to spare_unexpected_; returns the node after it.
  std::list<Unexpected>::iterator recycle_unexpected(std::list<Unexpected>::iterator it);
  void open_window(Op& op);
  void close_window(Op& op) noexcept;
  bool progress_links();
  void flush_links();

  // The ring links' step machine (engine_ring.cc).
  bool schedule_sends();
  bool schedule_sends(int dir);

  // The log-step schedules' step machine (steps.h) on the mesh links (engine_log_step.cc).
  bool advance_log_steps();
  bool advance_log_steps(Op& op);
  transport::RecvTarget log_step_target(Op& op, int link, const transport::FrameHeader& h,
                                        RecvCtx& ctx);
  [[nodiscard]] int mesh_link(int peer) const;  // link index of the mesh channel to `peer`

  // Point-to-point (engine_p2p.cc). Small sends go at once; one larger than eager_bytes asks
  // (kP2pRequest) and waits for its receive's kP2pReady, so its bytes land straight in the
  // receive buffer. Either end sees a size that differs from its own in what the other sent
  // (the data, the request, the ready), so it fails rather than waits.
  struct P2p {
    P2pCall call;
    std::size_t bytes = 0;
    std::uint64_t pseq = 0;  // its place among the pair's sends (receives) of its tag
    std::uint64_t id = 0;    // send: its channel token, unique per peer
    transport::Clock::time_point deadline{};
    std::shared_ptr<Work::State> state;
    bool ready = false;      // send: may leave (eager, or its receive is posted)
    bool queued = false;     // send: handed to the channel
    bool requested = false;  // large send: its kP2pRequest is queued
    bool answer = false;     // receive: its sender asked (a kP2pReady is due)
    bool answered = false;   // receive: its kP2pReady is queued
    // Through host memory (device memory, or a bouncing test executor): `copier` copies the
    // caller's buffer `user` into shadow buffer `buffer` (a send, before it leaves: `held`
    // until then), or back from it (a receive, once its bytes are in: in p2p_back_).
    std::unique_ptr<OpFence> fence;
    Executor* copier = nullptr;
    int buffer = -1;
    char* user = nullptr;
    bool held = false;
    bool copying = false;
    std::uint64_t copy_id = 0;
  };
  struct P2pEarly {  // an eager message that arrived before its receive was posted
    transport::FrameHeader header;
    std::vector<char> data;
    bool complete = false;
  };
  struct PeerP2p {
    std::map<int, std::uint64_t> next_send;  // per tag
    std::map<int, std::uint64_t> next_recv;
    std::uint64_t next_id = 0;
    std::deque<std::unique_ptr<P2p>> sends;  // posted, not complete, in order
    std::deque<std::unique_ptr<P2p>> recvs;
    std::deque<transport::FrameHeader> requests;  // kP2pRequest for receives not posted yet
    std::list<P2pEarly> early;                    // a list: the one being filled keeps its place
  };
  PeerP2p& p2p_peer(int rank);
  // Receives of one tag that wait for a sender: one from any source (kAnySource) and every
  // receive posted after it, which may not take a message before it does (MPI's order).
  std::map<int, std::deque<std::unique_ptr<P2p>>> p2p_waiting_;
  int p2p_any_next_ = 0;  // where the next any-source receive starts looking (round robin)
  // Posts the waiting receives of `tag` in order, each any-source one with the first rank that
  // has an unclaimed message of that tag here, until one finds none.
  void bind_waiting(int tag);
  // The rank with an unclaimed message of `tag` (its next receive's), or -1.
  [[nodiscard]] int p2p_sender_of(int tag) const;
  void post_p2p_recv(std::unique_ptr<P2p> p);
  bool drain_p2p();
  bool advance_p2p();
  void post_p2p(std::unique_ptr<P2p> p);
  transport::RecvTarget p2p_target(int link, const transport::FrameHeader& h, RecvCtx& ctx);
  void p2p_arrived(int link, const transport::FrameHeader& h, RecvCtx& ctx);
  void p2p_ready(int link, const transport::FrameHeader& h);
  void p2p_request(int link, const transport::FrameHeader& h);
  void p2p_sent(int link, std::uint64_t token);
  void check_p2p(const P2p& p, const transport::FrameHeader& h) const;
  void complete_p2p(std::deque<std::unique_ptr<P2p>>& queue, const P2p* p);
  // A receive whose bytes are in: complete, or (through host memory) on its way back.
  void p2p_received(std::unique_ptr<P2p> p);
  // Issues the copies of point-to-point messages through host memory whose fence allows.
  bool advance_p2p_copies();
  void p2p_copy_done(std::uint64_t id);
  void end_p2p(P2p& p) noexcept;               // its fence's end and its shadow buffer
  std::deque<std::unique_ptr<P2p>> p2p_back_;  // receives copying back (counted as pending)
  std::uint64_t next_p2p_copy_ = 1;
  void check_p2p_deadlines(transport::Clock::time_point now);
  void fail_p2p(std::exception_ptr e);
  [[nodiscard]] transport::Clock::time_point p2p_deadline() const;
  [[nodiscard]] static bool is_p2p_token(std::uint64_t token) { return (token >> 62) == 2; }

  // Failure and deadlines (engine_failure.cc).
  void fail(const Error& e);
  void fail_all(std::exception_ptr e);
  void send_control(int link, transport::FrameType type, std::uint64_t seq,
                    const std::string& text = {}, int blame = -1, int code = 0);
  void check_deadlines();
  [[nodiscard]] Error timeout_error(const Op& op, const std::string& prefix) const;
  [[nodiscard]] int blame_link(const Op& op) const;  // the link this operation waits on
  [[nodiscard]] std::string describe_progress(const Op& op) const;

  // Executor steps and landing slots (engine_exec.cc).
  struct Slot {
    char* data = nullptr;
    std::size_t capacity = 0;
    Executor* owner = nullptr;  // whose landing memory `data` is
    // kLanding; kLinked for a send slot of a direct send (registered with the link it leaves
    // on); `borrowed`: a receive into a device window, `data` in the operation's landing
    // buffer (no memory of the slot's own, and not counted against the channel's slots).
    ExecMemory where = ExecMemory::kLanding;
    bool borrowed = false;
    bool direct = false;  // a send slot written into `window` at `direct_at`
    transport::Window window{};
    std::size_t direct_at = 0;
    std::uint64_t seq = 0;  // the operation it serves
    int dir = 0;
    int link = 0;
    int channel = 0;
    bool send = false;
    bool done = false;  // its step has completed
    bool busy = false;
    transport::FrameHeader header;  // a send slot's frame
    ExecStep step;                  // a receive slot's step, issued when the payload is in
  };
  // A receive whose step may still be in flight, in the order its channel delivered it:
  // recv_done counts a channel's receives only as far as every one before them is done.
  struct RecvEntry {
    int slot = -1;  // -1: it needed no step
    std::uint64_t seq = 0;
    int dir = 0;
  };
  struct SlotQueues {
    std::vector<int> free;
    std::deque<RecvEntry> recv;
    std::deque<int> send;  // send slots in the order their messages leave
    int recv_busy = 0;
    int send_busy = 0;
  };
  void prepare_op(Op& op);  // its executor, and whether it bounces
  void issue_start_copies(Op& op);
  // A starting operation whose start copies are done: it runs (a shadowed one first starts in
  // host memory once its input is there).
  void start_when_ready(Op& op);
  // Op::shadow: host memory from a pool of `copier`'s landing memory, reused by size.
  void shadow_op(Op& op, Executor& copier);
  void release_shadow(Op& op) noexcept;
  [[nodiscard]] int acquire_shadow_buffer(Executor& copier, std::size_t bytes,
                                          ExecMemory where = ExecMemory::kLanding);
  // A bounced operation's receives in a window on the executor's memory, where the link can
  // open one (device_window_region); false when it takes landing slots instead.
  bool open_device_window(Op& op);
  // The memory of a direct send slot is registered with the link it leaves on (all of its
  // channels).
  void register_send_slot(const Op& op, const Slot& slot, int link);
  // The bytes of a device window ring for the channels of `link` (both ends compute it).
  [[nodiscard]] std::size_t window_ring_bytes(int link) const;
  // Tells the previous rank how many windowed messages' steps completed (kCredit), per
  // channel, where that grew.
  bool send_window_credits();
  // Memory of kind kLinked about to be freed: the links drop what they registered there.
  void forget_linked(const char* p, std::size_t bytes) noexcept;
  void count_landing(std::ptrdiff_t bytes);  // landing (pinned) memory allocated or freed
  // The device executor, made for `device` with the first device operation.
  Executor& device_executor(int device);
  // A reduce's or gather's result on a rank other than its root goes to a sink of the engine's
  // (Op::sink); release_scratch() hands it back with the scratch.
  void take_sink(Op& op);
  void release_scratch(Op& op) noexcept;
  void slot_sent(int link, int channel, std::uint64_t token);
  [[nodiscard]] static ExecStep reduce_step(const Op& op, const RecvCtx& ctx, char* dst,
                                            const char* received, const char* other, std::size_t n);
  [[nodiscard]] static ExecStep copy_step(char* dst, const char* src, std::size_t bytes);
  [[nodiscard]] static std::uint64_t log_step_token(std::uint64_t seq, std::size_t step);
  [[nodiscard]] static std::uint64_t p2p_copy_token(std::uint64_t id);
  [[nodiscard]] static bool is_slot_token(std::uint64_t token);
  void issue_step(Executor& exec, const ExecStep& step, std::uint64_t token);
  bool poll_executors();
  void step_done(std::uint64_t token);
  int acquire_slot(Op& op, int link, int channel, std::size_t bytes, bool send,
                   ExecMemory where = ExecMemory::kLanding);
  // A receive slot for a message that lands at `data` in the operation's device window.
  int borrow_slot(Op& op, int link, int channel, char* data);
  void release_slot(int link, int channel, int s);
  void pop_done_receives(int link, int channel);
  bool pack_sends(Op& op, int dir, int channel);
  bool pump_slot_sends();
  void arrive(Op& op, int link, int channel, RecvCtx& ctx);
  [[nodiscard]] bool landing_full(int link, int channel) const;
  [[nodiscard]] bool steps_in_flight() const;
  [[nodiscard]] std::chrono::microseconds executor_poll_interval() const;
  void drain_executors() noexcept;
  bool advance_finish(Op& op);  // false while the operation's final steps are in flight
  void free_slots() noexcept;

  EngineConfig cfg_;
  ExecutorChoice host_exec_;
  std::unique_ptr<Executor> device_exec_;  // made with the first device operation
  std::vector<Slot> slots_;
  std::vector<int> borrowed_free_;  // borrowed slots not in use
  // Device windows (docs/architecture.md, "Device memory over RDMA links"): the ring of
  // landing slots that the previous rank writes into, landing_slots per channel of
  // kDeviceSliceBytes each, in executor memory (a pooled buffer, made with the first
  // operation that opens a window, kept); per channel of that link, the windowed messages
  // received, those whose steps completed in order, and how many of those the previous rank
  // was told (kCredit); per channel of the link to the next rank, the windowed messages sent
  // and the credits it gave.
  int window_ring_ = -1;
  bool windows_refused_ = false;  // the link cannot open one: not asked again
  std::vector<std::uint64_t> window_received_, window_freed_, window_credited_;
  std::vector<std::uint64_t> window_sent_, window_credit_;
  std::vector<std::vector<SlotQueues>> slot_queues_;  // [link][channel]
  struct ShadowBuffer {
    char* data = nullptr;
    std::size_t capacity = 0;
    Executor* owner = nullptr;
    ExecMemory where = ExecMemory::kLanding;
    // kLinked: how the links register it (exported once; its dma-buf closed with it).
    transport::DeviceMemory linked{};
    bool busy = false;
  };
  std::vector<ShadowBuffer> shadow_buffers_;
  std::vector<std::uint64_t> exec_done_;
  std::size_t landing_bytes_ = 0;       // landing memory allocated now
  std::size_t peak_landing_bytes_ = 0;  // and at most
  bool fence_wait_ = false;             // the next operation waits for its device input
  // Windows announced to the previous rank (kPosted payloads) until their frame is sent: the
  // channel reads them until then, so they outlive the links' closing.
  std::deque<transport::Window> window_wire_;
  // Links 0 and 1 are the ring's (each `channels` channels); links 2.. the mesh's (one each).
  std::vector<std::vector<std::unique_ptr<transport::Channel>>> links_;
  std::vector<std::unique_ptr<LinkSink>> sinks_;
  std::vector<std::vector<RecvCtx>> recv_ctx_;
  std::vector<int> mesh_peers_;    // peer of link 2 + i
  std::vector<int> link_of_peer_;  // mesh link index per rank, -1 for none

  // Submission queue, shared with caller threads.
  std::mutex submit_mu_;
  std::deque<std::unique_ptr<Op>> submitted_;
  std::deque<std::unique_ptr<P2p>> submitted_p2p_;
  // drain_p2p()'s batch, kept so that a drain allocates nothing (an empty deque does).
  std::deque<std::unique_ptr<P2p>> p2p_batch_;
  std::atomic<bool> p2p_submitted_{false};  // submitted_p2p_ may hold entries
  // Ranges to forget (forget_memory), each before the operation with sequence number `before`.
  struct Forget {
    const void* addr;
    std::size_t bytes;
    std::uint64_t before;
  };
  std::deque<Forget> forgotten_;
  std::vector<std::pair<std::uint64_t, int>> reprioritise_;  // (seq, priority), for the engine
  // Whether reprioritise_ may hold entries: lets the engine's turn skip submit_mu_ when not.
  std::atomic<bool> reprioritise_pending_{false};
  std::uint64_t next_seq_ = 0;
  std::atomic<int> pending_submissions_{0};
  // What the engine thread is doing, so that wakers write the eventfd only when it sleeps.
  enum Mode : int { kRunning, kActiveSleep, kIdleSleep, kDeepSleep };
  std::atomic<int> mode_{kRunning};
  std::atomic<bool> stop_{false};
  std::atomic<bool> abort_requested_{false};
  std::string abort_reason_;   // guarded by submit_mu_
  std::exception_ptr failed_;  // guarded by submit_mu_ once set
  transport::Fd wake_fd_;

  // Whoever runs a turn (the engine thread, a submitting thread, or a thread in drive())
  // holds turn_mu_. The engine thread stands aside while drivers_ > 0.
  std::mutex turn_mu_;
  std::atomic<int> drivers_{0};
  // Threads in await(): while any waits, the caller has nothing else to run, so the engine
  // thread keeps spinning as long as they do rather than sleeping between arrivals.
  std::atomic<int> awaiters_{0};
  std::atomic<bool> has_active_{false};  // active_ is not empty (updated each turn)
  int idle_ticks_ = 0;                   // engine thread only

  // Engine state, touched only under turn_mu_.
  std::vector<std::unique_ptr<Op>> active_;  // sorted: priority desc, seq asc
  std::int64_t peer_posted_ = -1;            // highest seq the next rank announced
  std::int64_t posted_ = -1;                 // highest seq posted here
  std::int64_t announce_ = -1;               // highest seq to announce to the previous rank
  std::int64_t announced_ = -1;              // highest seq announced so far
  std::list<Unexpected> unexpected_;
  std::vector<PeerP2p> p2p_;     // per rank
  std::size_t p2p_pending_ = 0;  // sends and receives posted and not complete
  // Direct placement: windows opened by this rank, to announce (in the order posted); windows
  // the next rank announced for operations not started here yet; a kPosted payload arriving.
  std::deque<std::pair<std::uint64_t, transport::Window>> windows_to_announce_;
  std::map<std::uint64_t, transport::Window> peer_windows_;
  transport::Window window_in_{};
  std::size_t unexpected_bytes_ = 0;
  // Nodes of unexpected_ that have been replayed, their buffers kept: a slice that runs
  // ahead reuses one instead of allocating a node and a buffer.
  std::list<Unexpected> spare_unexpected_;
  ScratchPool scratch_;
  std::vector<std::vector<char>> abort_text_;
  std::vector<pollfd> pollfds_;
  std::vector<pollfd> ready_fds_;
  std::vector<int> narrow_links_;  // log_step_turn(): the mesh links it reads

  transport::Clock::time_point last_moved_{};
  // Set when an operation passed its deadline and the neighbour it waits on was asked why.
  transport::Clock::time_point probe_deadline_{};
  std::string probe_text_;  // the engine thread's last turn that moved
  std::atomic<std::size_t> peak_landing_atomic_{0};
  std::atomic<std::uint64_t> device_window_messages_{0};
  std::atomic<std::size_t> device_window_bytes_{0};
  std::thread thread_;
  pthread_t thread_handle_{};  // thread_'s, for cpu_seconds() (joined only in the destructor)
};

}  // namespace collectives
}  // namespace dear
