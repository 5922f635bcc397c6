#include "collectives/engine.h"

#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <ctime>
#include <limits>

#include "collectives/reduce.h"
#include "collectives/steps.h"

namespace dear {

void Work::State::complete(std::exception_ptr e) {
  {
    std::lock_guard<std::mutex> lock(mu);
    error = std::move(e);
    status.store(error ? 2 : 1, std::memory_order_release);
  }
  cv.notify_all();
}

namespace collectives {
namespace {

using transport::FrameHeader;
using transport::FrameType;
using transport::RecvTarget;

constexpr int kNext = 0;  // link to the next rank: forward data out, announcements in
constexpr int kPrev = 1;  // link to the previous rank: forward data in, announcements out
constexpr std::uint64_t kControlToken = std::numeric_limits<std::uint64_t>::max();
// A kPosted frame carrying a window (its payload lives in window_wire_ until it is sent).
constexpr std::uint64_t kWindowToken = kControlToken - 1;
// Announce every this many eager operations (large ones are always announced), so a sender
// running ahead learns how far the receiver has got without a frame per small operation.
constexpr std::uint64_t kAnnounceEvery = 16;
// A send queue is refilled only while it holds less than this many payload bytes, so that a
// newly posted high-priority operation waits behind at most this much.
constexpr std::size_t kQueueBytesPerChannel = 1024 * 1024;
constexpr std::size_t kQueueMessagesPerChannel = 32;
constexpr std::size_t kMaxUnexpectedBytes = 256 * 1024 * 1024;
constexpr std::size_t kMaxAbortText = 4096;
// How often the engine looks whether a device operation's input is ready.
constexpr std::chrono::microseconds kFencePoll{50};

bool order_before(const Op& a, const Op& b) {
  if (a.priority != b.priority) return a.priority > b.priority;
  return a.seq < b.seq;
}

// One rank's view of an operation, as printed in mismatch and timeout errors; the same text
// for a received header and for a local operation, so the two can be compared by eye.
std::string view_of(OpKind kind, Schedule schedule, std::uint64_t count, DataType dtype,
                    ReduceOp redop, int root, bool device) {
  return std::string(to_string(kind)) + " count=" + std::to_string(count) +
         " dtype=" + std::string(dear::to_string(dtype)) +
         " op=" + std::string(dear::to_string(redop)) + " root=" + std::to_string(root) +
         " schedule=" + to_string(schedule) + (device ? " memory=device" : " memory=host");
}

std::string view_of(const FrameHeader& h) {
  return view_of(static_cast<OpKind>(h.kind & 0x0f), static_cast<Schedule>((h.kind >> 4) & 0x07),
                 h.count, static_cast<DataType>(h.dtype), static_cast<ReduceOp>(h.redop), h.root,
                 (h.kind & 0x80) != 0);
}

std::string view_of(const Op& op) {
  return view_of(op.kind, op.schedule, op.user_count, op.dtype, op.redop, op.root, op.device);
}

}  // namespace

// Routes a link's callbacks to the engine with the link's index. A mesh link has one channel,
// whatever index its back-end gave it.
class Engine::LinkSink final : public transport::RecvSink {
 public:
  LinkSink(Engine& e, int link) : e_(e), link_(link), mesh_(link >= 2) {}
  RecvTarget on_header(int channel, const FrameHeader& h) override {
    return e_.on_header(link_, ch(channel), h);
  }
  void on_payload(int channel, const FrameHeader&, const char* data, std::size_t offset,
                  std::size_t len) override {
    e_.on_payload(link_, ch(channel), data, offset, len);
  }
  void on_message(int channel, const FrameHeader& h) override {
    e_.on_message(link_, ch(channel), h);
  }
  void on_sent(int channel, std::uint64_t token) override { e_.on_sent(link_, ch(channel), token); }
  void on_closed(int channel) override { e_.on_closed(link_, ch(channel)); }

 private:
  [[nodiscard]] int ch(int channel) const { return mesh_ ? 0 : channel; }
  Engine& e_;
  int link_;
  bool mesh_;
};

Engine::Engine(EngineConfig config, std::vector<std::unique_ptr<transport::Channel>> to_next,
               std::vector<std::unique_ptr<transport::Channel>> from_prev,
               std::vector<int> mesh_peers, std::vector<std::unique_ptr<transport::Channel>> mesh)
    : cfg_(config),
      host_exec_(
          make_executor(config.executor, static_cast<std::uint64_t>(config.rank) + 1, config.rank)),
      mesh_peers_(std::move(mesh_peers)),
      link_of_peer_(static_cast<std::size_t>(std::max(config.size, 1)), -1),
      wake_fd_(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC)) {
  if (!wake_fd_.valid()) {
    throw Error(ErrorCode::kSystem, std::string("eventfd: ") + std::strerror(errno), cfg_.rank);
  }
  if (mesh.size() != mesh_peers_.size()) {
    throw Error(ErrorCode::kInternal, "Engine: mesh channels and peers differ in number",
                cfg_.rank);
  }
  links_.resize(2 + mesh.size());
  links_[kNext] = std::move(to_next);
  links_[kPrev] = std::move(from_prev);
  for (std::size_t i = 0; i < mesh.size(); ++i) {
    links_[2 + i].push_back(std::move(mesh[i]));
    link_of_peer_.at(static_cast<std::size_t>(mesh_peers_[i])) = static_cast<int>(2 + i);
  }
  sinks_.resize(links_.size());
  recv_ctx_.resize(links_.size());
  abort_text_.resize(links_.size());
  slot_queues_.resize(2);
  for (std::size_t l = 0; l < links_.size(); ++l) {
    sinks_[l] = std::make_unique<LinkSink>(*this, static_cast<int>(l));
    recv_ctx_[l].resize(links_[l].size());
    if (l < 2) slot_queues_[l].resize(links_[l].size());
  }
  host_exec_.executor->set_waker([this] { wake(); });
  thread_ = std::thread([this] { run(); });
  thread_handle_ = thread_.native_handle();
}

Engine::~Engine() {
  stop_.store(true);
  wake();
  if (thread_.joinable()) thread_.join();
  free_slots();
}

Work Engine::submit(std::unique_ptr<Op> op) {
  const bool eager = op->eager;
  auto state = std::make_shared<Work::State>();
  op->state = state;
  state->wait_spin_us = cfg_.wait_spin_us;
  state->engine = weak_from_this();
  state->driven = eager;
  std::exception_ptr failed;
  {
    std::lock_guard<std::mutex> lock(submit_mu_);
    op->seq = next_seq_++;
    state->seq = op->seq;
    if (failed_) {
      failed = failed_;
    } else {
      submitted_.push_back(std::move(op));
      pending_submissions_.fetch_add(1);
    }
  }
  if (failed) {
    state->complete(failed);
    return Work(state);
  }
  // A small operation starts on this thread when the engine is free: its first slices leave
  // now, without waiting for the engine thread to wake up, and the rest is left to the thread
  // that waits for it (or to the engine's next idle tick). Anything else, or an engine in deep
  // sleep, gets the engine thread's attention at once.
  bool started = false;
  if (eager && turn_mu_.try_lock()) {
    turn();
    turn_mu_.unlock();
    started = true;
  }
  if (!wake_if(kActiveSleep) && !wake_if(kDeepSleep) && !started) wake_if(kIdleSleep);
  return Work(state);
}

double Engine::cpu_seconds() const {
  clockid_t id{};
  timespec ts{};
  if (::pthread_getcpuclockid(thread_handle_, &id) != 0 || ::clock_gettime(id, &ts) != 0) {
    return 0;
  }
  return static_cast<double>(ts.tv_sec) + static_cast<double>(ts.tv_nsec) * 1e-9;
}

bool Engine::set_priority(std::uint64_t seq, int priority) {
  {
    std::lock_guard<std::mutex> lock(submit_mu_);
    if (seq >= next_seq_ || failed_) return false;
    reprioritise_.emplace_back(seq, priority);
    reprioritise_pending_.store(true, std::memory_order_release);
    pending_submissions_.fetch_add(1);  // the engine's next turn looks at the queues
  }
  if (!wake_if(kActiveSleep)) wake_if(kDeepSleep);
  return true;
}

void Engine::forget_memory(const void* addr, std::size_t bytes) {
  {
    std::lock_guard<std::mutex> lock(submit_mu_);
    forgotten_.push_back({addr, bytes, next_seq_});
    pending_submissions_.fetch_add(1);  // the engine's next turn looks at the queues
  }
  if (!wake_if(kActiveSleep)) wake_if(kDeepSleep);
}

void Engine::apply_priorities() {
  // Priority is local (only this rank's send order), so an operation may change it at any
  // point of its life: the active list is re-sorted and the next slices follow it.
  // Once per engine turn: no lock unless set_priority() queued something.
  if (!reprioritise_pending_.load(std::memory_order_acquire)) return;
  std::vector<std::pair<std::uint64_t, int>> changes;
  {
    std::lock_guard<std::mutex> lock(submit_mu_);
    reprioritise_pending_.store(false, std::memory_order_relaxed);
    changes.swap(reprioritise_);
  }
  bool changed = false;
  for (const auto& [seq, priority] : changes) {
    if (Op* op = find(seq); op != nullptr && op->priority != priority) {
      op->priority = priority;
      changed = true;
    }
  }
  if (changed) {
    std::stable_sort(active_.begin(), active_.end(),
                     [](const std::unique_ptr<Op>& a, const std::unique_ptr<Op>& b) {
                       return order_before(*a, *b);
                     });
  }
}

void Engine::abort(const std::string& reason) {
  {
    std::lock_guard<std::mutex> lock(submit_mu_);
    if (abort_requested_.load()) return;
    abort_reason_ = reason;
  }
  abort_requested_.store(true);
  wake();
}

void Engine::wake() {
  const std::uint64_t one = 1;
  [[maybe_unused]] const ssize_t n = ::write(wake_fd_.get(), &one, sizeof(one));
}

int Engine::peer_of(int link) const {
  const int n = cfg_.size;
  if (link >= 2) return mesh_peers_[static_cast<std::size_t>(link - 2)];
  return link == kNext ? (cfg_.rank + 1) % n : (cfg_.rank - 1 + n) % n;
}

int Engine::mesh_link(int peer) const {
  const int l = peer >= 0 && peer < cfg_.size ? link_of_peer_[static_cast<std::size_t>(peer)] : -1;
  if (l < 0) {
    throw Error(ErrorCode::kInternal,
                "no mesh link to rank " + std::to_string(peer) + " for a log-step schedule",
                cfg_.rank, peer);
  }
  return l;
}

void Engine::run() {
  while (!stop_.load()) {
    if (drivers_.load() == 0) {
      std::unique_lock<std::mutex> lock(turn_mu_);
      const auto now = transport::Clock::now();
      if (turn()) {
        last_moved_ = now;
        idle_ticks_ = 0;
        continue;
      }
      // Briefly yield instead of sleeping after the engine thread itself moved something: a
      // peer's reply or the caller's next operation usually comes within a few microseconds,
      // and waking from poll() costs a context switch on each hop.
      // While a thread waits for an operation (await), the caller has nothing else to run and
      // the engine spins as long as that thread does.
      const int spin_us = awaiters_.load(std::memory_order_relaxed) > 0
                              ? std::max(cfg_.spin_us, cfg_.wait_spin_us)
                              : cfg_.spin_us;
      if (now - last_moved_ < std::chrono::microseconds(spin_us)) {
        lock.unlock();
        sched_yield();
        continue;
      }
      if (!active_.empty() || pending_submissions_.load() > 0 || fence_wait_) {
        idle_ticks_ = 0;
        wait_for_events(lock);
        continue;
      }
    }
    // Nothing in flight, or a waiting thread is making the progress itself.
    sleep_idle();
  }
  // Shutting down. The channels close first: a channel's close may still send what is queued,
  // straight out of pending operations' memory, so those operations fail (and their waiters
  // may free that memory) only once no channel can read it any more.
  std::lock_guard<std::mutex> lock(turn_mu_);
  const auto each_channel = [&](const auto& fn) {
    for (auto& link : links_) {
      for (auto& ch : link) {
        try {
          fn(*ch);
        } catch (const std::exception&) {
          // Closing anyway; the operations fail below.
        }
      }
    }
  };
  // Every channel starts closing before any waits for its peer: see Channel::begin_close().
  each_channel([](transport::Channel& ch) { ch.begin_close(); });
  // One deadline for all: a stalled peer costs the linger once, not once per channel.
  const auto linger_until = std::chrono::steady_clock::now() + transport::kCloseLinger;
  each_channel([&](transport::Channel& ch) { ch.close_by(linger_until); });
  // Whatever is still pending can no longer finish.
  fail_all(std::make_exception_ptr(
      Error(ErrorCode::kAborted, "the communicator was destroyed with this operation pending",
            cfg_.rank)));
}

bool Engine::turn() {
  bool moved = false;
  try {
    if (abort_requested_.load()) {
      std::string reason;
      {
        std::lock_guard<std::mutex> lock(submit_mu_);
        reason = abort_reason_;
      }
      fail(Error(ErrorCode::kAborted, "Communicator::abort(): " + reason, cfg_.rank));
      abort_requested_.store(false);
    }
    moved = drain_submissions();
    apply_priorities();
    announce();
    moved |= progress_links();
    moved |= poll_executors();
    // Hand newly queued slices to the sockets in the same turn; an idle turn skips it.
    if (schedule_sends()) {
      moved = true;
      flush_links();
    }
    // A turn that moved nothing is waiting for the network: time for the deferred copies.
    if (!moved) moved = copy_while_waiting();
    complete_finished();
    check_deadlines();
  } catch (const Error& e) {
    fail(e);
    moved = true;
  } catch (const std::exception& e) {
    fail(Error(ErrorCode::kInternal, e.what(), cfg_.rank));
    moved = true;
  }
  has_active_.store(!active_.empty());
  return moved;
}

void Engine::sleep_idle() {
  // While it may soon be needed again, the engine does not watch the sockets: what arrives
  // meanwhile (slices of operations not posted here yet, announcements) waits in the kernel
  // until there is an operation to progress, and a thread in drive() reads the sockets
  // itself, so arrivals cost no wake-ups here. It wakes every tick in case an operation was
  // started by its caller (Engine::submit) and nobody waits for it: often while no thread
  // drives, rarely while one does (the last driver to leave wakes it if work is left). After
  // enough quiet ticks it sleeps on the sockets too, so that an abort or a closed link is
  // noticed while idle; even then it looks round every kDeepTick, so that a wake-up lost to
  // a race nobody foresaw costs a moment, never a hang. (No timer is armed per operation: on
  // virtual machines that costs more than the operation.)
  constexpr int kTicks = 50;
  constexpr auto kTick = std::chrono::microseconds(200);
  constexpr auto kDrivenTick = std::chrono::milliseconds(1);
  constexpr auto kDeepTick = std::chrono::milliseconds(100);
  std::unique_lock<std::mutex> lock(turn_mu_, std::defer_lock);
  const bool driven = drivers_.load() > 0;
  const bool deep = idle_ticks_ >= kTicks && !driven && lock.try_lock();
  pollfds_.clear();
  pollfds_.push_back({wake_fd_.get(), POLLIN, 0});
  if (deep) {
    for (auto& link : links_) {
      for (auto& ch : link) {
        const pollfd p = ch->wait_spec();
        if (p.fd >= 0) pollfds_.push_back(p);
      }
    }
    lock.unlock();
  }
  mode_.store(deep ? kDeepSleep : kIdleSleep);
  const bool work = drivers_.load() == 0 && (pending_submissions_.load() > 0 || has_active_.load());
  if (!work && !stop_.load() && !abort_requested_.load()) {
    const std::chrono::nanoseconds wait = deep     ? std::chrono::nanoseconds(kDeepTick)
                                          : driven ? std::chrono::nanoseconds(kDrivenTick)
                                                   : std::chrono::nanoseconds(kTick);
    const timespec tick{0, static_cast<long>(wait.count())};
    const int rc = ::ppoll(pollfds_.data(), pollfds_.size(), &tick, nullptr);
    if (rc > 0 && (pollfds_[0].revents & POLLIN) != 0) {
      std::uint64_t v = 0;
      [[maybe_unused]] const ssize_t n = ::read(wake_fd_.get(), &v, sizeof(v));
    }
    // Something arrived on a socket while deep asleep: let the next turn read it.
    const bool socket = deep && rc > 0 && (pollfds_[0].revents & POLLIN) == 0;
    idle_ticks_ = socket ? 0 : idle_ticks_ + (driven ? 0 : 1);
  }
  mode_.store(kRunning);
}

bool Engine::wake_if(int mode) {
  if (mode_.load() != mode) return false;
  wake();
  return true;
}

void Engine::poke() {
  if (!turn_mu_.try_lock()) return;
  turn();
  turn_mu_.unlock();
}

bool Engine::drive(const Work::State& state, std::chrono::steady_clock::time_point until,
                   std::chrono::microseconds idle) {
  drivers_.fetch_add(1);
  bool done = false;
  auto last_moved = std::chrono::steady_clock::now();
  for (;;) {
    if (state.status.load(std::memory_order_acquire) != 0) {
      done = true;
      break;
    }
    const auto now = std::chrono::steady_clock::now();
    if (stop_.load() || now >= until || now - last_moved >= idle) break;
    bool moved = false;
    if (turn_mu_.try_lock()) {
      moved = turn();
      turn_mu_.unlock();
    }
    if (moved) {
      last_moved = now;
    } else {
      sched_yield();
    }
  }
  // The last driver to leave hands what is still in flight back to the engine thread.
  if (drivers_.fetch_sub(1) == 1 && has_active_.load()) {
    if (!wake_if(kIdleSleep)) wake_if(kDeepSleep);
  }
  return done;
}

bool Engine::await(const Work::State& state, std::chrono::steady_clock::time_point until,
                   std::chrono::microseconds spin) {
  awaiters_.fetch_add(1);
  const auto limit = std::min(until, std::chrono::steady_clock::now() + spin);
  while (state.status.load(std::memory_order_acquire) == 0 && !stop_.load() &&
         std::chrono::steady_clock::now() < limit) {
    sched_yield();
  }
  awaiters_.fetch_sub(1);
  return state.status.load(std::memory_order_acquire) != 0;
}

bool Engine::drain_submissions() {
  if (pending_submissions_.load() == 0 && !fence_wait_) return false;
  pending_submissions_.store(0);
  fence_wait_ = false;
  // One operation at a time leaves the queue: every operation is always in exactly one of
  // submitted_, active_ or completed. Starting one can fail the communicator (a slice that
  // arrived early disagrees with it); fail() then completes those still queued, and none is
  // lost on the way (a lost operation's wait() would never return).
  for (;;) {
    std::unique_ptr<Op> op;
    std::vector<Forget> forget;
    {
      std::lock_guard<std::mutex> lock(submit_mu_);
      // Ranges forgotten before the next queued operation was submitted go first.
      const std::uint64_t next = submitted_.empty() ? next_seq_ : submitted_.front()->seq;
      while (!forgotten_.empty() && forgotten_.front().before <= next) {
        forget.push_back(forgotten_.front());
        forgotten_.pop_front();
      }
      if (forget.empty()) {
        if (submitted_.empty()) break;
        // Operations start in issue order: one whose device input is not ready yet holds up
        // the ones behind it (the peers number them in the same order).
        const auto& front = submitted_.front();
        if (front->fence && !front->fence->input_ready()) {
          fence_wait_ = true;
          break;
        }
        op = std::move(submitted_.front());
        submitted_.pop_front();
      }
    }
    if (!forget.empty()) {
      for (const Forget& f : forget) {
        for (auto& link : links_) {
          for (auto& ch : link) ch->forget_memory(f.addr, f.bytes);
        }
      }
      continue;
    }
    const std::shared_ptr<Work::State> state = op->state;
    try {
      start(std::move(op));
    } catch (...) {
      // Failed before it reached active_, where fail() would find it: complete it here.
      if (state->status.load(std::memory_order_acquire) == 0 && find(state->seq) == nullptr) {
        state->complete(std::current_exception());
      }
      throw;
    }
  }
  return true;
}

void Engine::start(std::unique_ptr<Op> op) {
  {
    std::lock_guard<std::mutex> lock(submit_mu_);
    if (failed_) {
      op->state->complete(failed_);
      return;
    }
  }
  op->deadline = transport::deadline_after(op->timeout);
  prepare_op(*op);
  const bool log_step = is_log_step(op->schedule);
  const bool needs_scratch = op->schedule == Schedule::kGatherReduce ||
                             (op->kind == OpKind::kReduceScatter && op->nranks > 2 && !log_step);
  if (op->device && needs_scratch) {
    // In the device executor's memory; handed back when the operation completes.
    op->scratch = op->exec->allocate(ExecMemory::kScratch, op->total * op->el);
    if (op->schedule == Schedule::kGatherReduce) op->work = op->scratch;
  } else if (log_step) {
    // The work buffer (reduce_scatter: a copy of the input) and the staging area.
    const std::size_t work = op->log.work_is_scratch ? op->log.work_bytes : 0;
    op->scratch_owner = scratch_.acquire(work + op->log.stage_bytes, &op->scratch_capacity);
    op->scratch = op->scratch_owner.get();
    if (op->log.work_is_scratch) op->work = op->scratch;
    op->stage = op->scratch + work;
  } else if (needs_scratch) {
    const std::size_t bytes = op->total * op->el;
    op->scratch_owner = scratch_.acquire(bytes, &op->scratch_capacity);
    op->scratch = op->scratch_owner.get();
    if (op->schedule == Schedule::kGatherReduce) op->work = op->scratch;
  }
  start_local(*op);
  open_window(*op);
  posted_ = static_cast<std::int64_t>(op->seq);
  if (!op->eager || op->seq % kAnnounceEvery == 0) announce_ = posted_;
  Op* raw = op.get();
  const auto pos = std::upper_bound(
      active_.begin(), active_.end(), raw,
      [](const Op* a, const std::unique_ptr<Op>& b) { return order_before(*a, *b); });
  active_.insert(pos, std::move(op));
  issue_start_copies(*raw);
  replay_unexpected(*raw);
  // A neighbour that finished everything and left is fine as long as this operation has
  // nothing more to exchange with it (its slices may all have arrived before it closed).
  for (std::size_t l = 0; l < links_.size(); ++l) {
    for (std::size_t c = 0; c < links_[l].size(); ++c) {
      if (links_[l][c]->closed()) check_link_needed(*raw, static_cast<int>(l), static_cast<int>(c));
    }
  }
}

void Engine::open_window(Op& op) {
  // This rank's window for what the previous rank sends it, announced with the operation.
  if (links_[kPrev].empty() || links_[kPrev][0]->closed()) return;
  const DirectRegion r = direct_region(op);
  if (r.bytes > 0) {
    if (auto w = links_[kPrev][0]->open_window(r.base, r.bytes, r.message_bytes)) {
      op.window = *w;
      op.window_open = true;
      windows_to_announce_.emplace_back(op.seq, *w);
    }
  }
  // The next rank may have announced its window before this rank posted the operation.
  if (const auto it = peer_windows_.find(op.seq); it != peer_windows_.end()) {
    op.peer_window = it->second;
    op.has_peer_window = true;
    peer_windows_.erase(it);
  }
}

void Engine::close_window(Op& op) noexcept {
  // Before the operation completes: once the caller has its memory back, no peer may write
  // there (the peer writes only into windows of operations in flight; a back-end may keep the
  // registration cached for the next operation on that memory).
  if (!op.window_open) return;
  op.window_open = false;
  try {
    links_[kPrev][0]->close_window(op.window);
  } catch (...) {
    // Closing a registration does not fail in a way that could be acted on here.
  }
}

void Engine::check_link_needed(const Op& op, int link, int channel) {
  bool needs = false;
  if (is_log_step(op.schedule)) {
    if (link < 2) return;
    const int peer = peer_of(link);
    for (std::size_t k = 0; k < op.log.steps.size(); ++k) {
      const Step& s = op.log.steps[k];
      const std::uint8_t st = op.step_state[k];
      needs = needs || (s.send_peer == peer && (st & Op::kStepSendDone) == 0) ||
              (s.recv_peer == peer && (st & Op::kStepReceived) == 0);
    }
  } else {
    if (link >= 2 || channel >= op.channels) return;
    // A link carries the sends of direction `link` and the receives of the other direction.
    const auto i = static_cast<std::size_t>(channel);
    const auto send_dir = static_cast<std::size_t>(link);
    const auto recv_dir = static_cast<std::size_t>(1 - link);
    needs = op.send_done[send_dir][i] < op.messages_sent_per_channel(link) ||
            op.recv_next[recv_dir][i] < op.messages_received_per_channel(1 - link);
  }
  if (!needs) return;
  const int peer = peer_of(link);
  throw Error(ErrorCode::kPeerFailed,
              "connection to rank " + std::to_string(peer) + " (channel " +
                  std::to_string(channel) + ")" +
                  " is closed but this operation still needs it: that rank exited, crashed or "
                  "destroyed its communicator early; " +
                  describe_progress(op),
              cfg_.rank, peer, to_string(op.kind), static_cast<std::int64_t>(op.seq));
}

Op* Engine::find(std::uint64_t seq) {
  for (auto& op : active_) {
    if (op->seq == seq) return op.get();
  }
  return nullptr;
}

void Engine::announce() {
  // Announcements are cumulative ("posted everything up to seq"), so only the latest matters:
  // one frame covers a burst of posts, and a full control queue merely delays it.
  auto& chans = links_[kPrev];
  if (chans.empty() || chans[0]->closed()) return;
  // An operation's window travels in its own kPosted frame, ahead of any later announcement.
  while (!windows_to_announce_.empty()) {
    const auto& [seq, window] = windows_to_announce_.front();
    FrameHeader w;
    w.type = FrameType::kPosted;
    w.seq = seq;
    w.bytes = sizeof(transport::Window);
    window_wire_.push_back(window);
    if (!chans[0]->try_send(w, &window_wire_.back(), kWindowToken)) {
      window_wire_.pop_back();
      return;
    }
    announced_ = std::max(announced_, static_cast<std::int64_t>(seq));
    windows_to_announce_.pop_front();
  }
  if (announce_ <= announced_) return;
  FrameHeader h;
  h.type = FrameType::kPosted;
  h.seq = static_cast<std::uint64_t>(announce_);
  if (chans[0]->try_send(h, nullptr, kControlToken)) announced_ = announce_;
}

bool Engine::may_send(const Op& op) const {
  const auto seq = static_cast<std::int64_t>(op.seq);
  if (seq <= peer_posted_) return true;
  return op.eager && seq <= peer_posted_ + cfg_.eager_window;
}

bool Engine::schedule_sends() {
  bool moved = false;
  // Direction d sends on link d: forward to the next rank, backward to the previous one.
  for (int d = 0; d < 2; ++d) {
    moved |= schedule_sends(d);
  }
  moved |= pump_slot_sends();
  if (links_.size() > 2) moved |= advance_log_steps();
  return moved;
}

bool Engine::schedule_sends(int dir) {
  bool moved = false;
  const auto di = static_cast<std::size_t>(dir);
  auto& chans = links_[dir];
  for (std::size_t c = 0; c < chans.size(); ++c) {
    transport::Channel& ch = *chans[c];
    if (ch.closed()) continue;
    for (auto& holder : active_) {
      Op& op = *holder;
      if (static_cast<int>(c) >= op.channels) continue;
      const std::uint32_t total = op.messages_sent_per_channel(dir);
      std::uint32_t& next = op.send_next[di][c];
      if (next >= total || !may_send(op)) continue;
      if (op.start_pending > 0) continue;
      if (op.bounced) {
        moved |= pack_sends(op, dir, static_cast<int>(c));
        continue;
      }
      while (next < total && ch.queued() < kQueueMessagesPerChannel &&
             ch.queued_bytes() < kQueueBytesPerChannel) {
        // Forwarding: message `next` carries what receive `next - dep_lag` brought.
        const auto lag = static_cast<std::uint32_t>(op.dep_lag);
        if (op.forwards && next >= lag && op.recv_done[di][c] <= next - lag) break;
        const MessagePlan m = send_plan(op, dir, static_cast<int>(c), next);
        const FrameHeader h = data_frame(op, next, m.span.bytes);
        const std::int64_t at =
            dir == kForward && op.has_peer_window ? direct_offset(op, m) : std::int64_t{-1};
        const char* src = send_source(op, m);
        const bool queued =
            at >= 0 ? ch.try_send_to(h, src, op.seq, op.peer_window, static_cast<std::size_t>(at))
                    : ch.try_send(h, src, op.seq);
        if (!queued) break;
        ++next;
        moved = true;
      }
      if (ch.queued() >= kQueueMessagesPerChannel || ch.queued_bytes() >= kQueueBytesPerChannel) {
        break;
      }
    }
  }
  return moved;
}

bool Engine::advance_log_steps() {
  bool moved = false;
  for (auto& holder : active_) {
    if (is_log_step(holder->schedule) && holder->start_pending == 0) {
      moved |= advance_log_steps(*holder);
    }
  }
  return moved;
}

bool Engine::advance_log_steps(Op& op) {
  // Steps run one after another (steps.h): a step's send leaves once the steps before it are
  // complete, and the step completes when its receive has arrived and is applied.
  bool moved = false;
  auto& steps = op.log.steps;
  while (op.step_next < steps.size()) {
    const std::size_t k = op.step_next;
    const Step& s = steps[k];
    std::uint8_t& st = op.step_state[k];
    if (s.send_peer >= 0 && (st & Op::kStepSent) == 0) {
      if (!may_send(op)) break;
      transport::Channel& ch = *links_[static_cast<std::size_t>(mesh_link(s.send_peer))][0];
      if (ch.closed() || ch.queued() >= kQueueMessagesPerChannel) break;
      const FrameHeader h = data_frame(op, static_cast<std::uint32_t>(s.tag), s.send_bytes);
      const char* src = work_source(op, s.send_offset, s.send_bytes);
      if (!ch.try_send(h, src, (op.seq << 8) | k)) break;
      st |= Op::kStepSent;
      ++op.sends_in_flight;
      moved = true;
    }
    if (s.recv_peer >= 0) {
      if ((st & Op::kStepReceived) == 0) break;
      if (s.wait_send && (st & Op::kStepSendDone) == 0) break;
      if (s.reduce && (st & Op::kStepApplied) == 0) {
        // Through the executor; the step is complete once the reduction is.
        if ((st & Op::kStepApplying) == 0) {
          st |= Op::kStepApplying;
          ExecStep e;
          e.kind = s.final ? ExecStep::kReduceFinal : ExecStep::kReduce;
          e.dst = op.work + s.recv_offset;
          e.a = work_source(op, s.recv_offset, s.recv_bytes);
          e.b = op.stage + s.stage_offset;
          e.n = s.recv_bytes / op.el;
          e.dtype = op.dtype;
          e.op = op.redop;
          e.nranks = op.nranks;
          issue_step(*op.exec, e, log_step_token(op.seq, k));
        }
        if ((st & Op::kStepApplied) == 0) break;
      }
      // A copied receive wrote its range when it arrived; no earlier step touches it.
      work_written(op, s.recv_offset, s.recv_bytes);
    }
    ++op.step_next;
    moved = true;
  }
  return moved;
}

RecvTarget Engine::log_step_target(Op& op, int link, const FrameHeader& h, RecvCtx& ctx) {
  const int peer = peer_of(link);
  if (!is_log_step(op.schedule)) {
    throw Error(ErrorCode::kMismatch,
                "a log-step message of operation #" + std::to_string(op.seq) +
                    " arrived from rank " + std::to_string(peer) + " but this rank runs it as " +
                    view_of(op),
                cfg_.rank, peer, to_string(op.kind), static_cast<std::int64_t>(op.seq));
  }
  check_header(op, peer, h);
  const auto& steps = op.log.steps;
  for (std::size_t k = 0; k < steps.size(); ++k) {
    const Step& s = steps[k];
    if (s.recv_peer != peer || s.tag != static_cast<int>(h.index)) continue;
    if ((op.step_state[k] & Op::kStepReceived) != 0 || s.recv_bytes != h.bytes) break;
    ctx.op = &op;
    ctx.step = static_cast<int>(k);
    char* dst = s.reduce ? op.stage + s.stage_offset : op.work + s.recv_offset;
    return {RecvTarget::kDirect, dst, 1};
  }
  throw Error(ErrorCode::kMismatch,
              "message " + std::to_string(h.index) + " (" + std::to_string(h.bytes) +
                  " bytes) of " + view_of(op) + " from rank " + std::to_string(peer) +
                  " matches no step this rank expects from it: the ranks disagree about the "
                  "operation",
              cfg_.rank, peer, to_string(op.kind), static_cast<std::int64_t>(op.seq));
}

void Engine::flush_links() {
  // Only sends: the sockets were read a moment ago, in this turn's progress_links().
  for (std::size_t l = 0; l < links_.size(); ++l) {
    for (auto& ch : links_[l]) {
      if (!ch->closed() && ch->queued() > 0) ch->progress(*sinks_[l], false);
    }
  }
}

bool Engine::progress_links() {
  // One poll() tells which channels have something to read, instead of a read attempt on
  // every channel each turn: on a small operation those system calls are the latency.
  // Channels that move data only when asked (polled(): libfabric's manual progress) are
  // progressed every turn anyway, so they stay out of it, and with only such channels there
  // is no system call at all.
  ready_fds_.clear();
  bool any = false;
  for (std::size_t l = 0; l < links_.size(); ++l) {
    for (auto& ch : links_[l]) {
      pollfd p{-1, 0, 0};  // poll() skips it and leaves revents 0
      if (!ch->polled()) {
        p = ch->wait_spec();
        p.events = POLLIN;
        any = any || p.fd >= 0;
      }
      ready_fds_.push_back(p);
    }
  }
  if (any && ::poll(ready_fds_.data(), ready_fds_.size(), 0) < 0) {
    for (auto& p : ready_fds_) p.revents = POLLIN;  // unknown: try them all
  }
  bool moved = false;
  std::size_t i = 0;
  for (std::size_t l = 0; l < links_.size(); ++l) {
    for (std::size_t c = 0; c < links_[l].size(); ++c) {
      auto& ch = links_[l][c];
      // A channel whose landing slots are all waiting for their steps is not read: its
      // messages wait in the transport (back-pressure) until a slot is free again.
      const bool ready = (ch->polled() || ready_fds_[i].revents != 0) &&
                         !landing_full(static_cast<int>(l), static_cast<int>(c));
      ++i;
      if (!ch->closed() && (ready || ch->queued() > 0)) {
        moved |= ch->progress(*sinks_[l], ready);
      }
    }
  }
  return moved;
}

RecvTarget Engine::on_header(int link, int channel, const FrameHeader& h) {
  RecvCtx& ctx = recv_ctx_[link][static_cast<std::size_t>(channel)];
  ctx = RecvCtx{};
  const int peer = peer_of(link);
  switch (h.type) {
    case FrameType::kPosted:
      // With a window (from the next rank only: it receives this rank's kForward messages).
      if (h.bytes == sizeof(transport::Window) && link == kNext) {
        return {RecvTarget::kDirect, reinterpret_cast<char*>(&window_in_), 1};
      }
      if (h.bytes != 0) break;
      return {RecvTarget::kDiscard, nullptr, 1};
    case FrameType::kAbort: {
      auto& text = abort_text_[link];
      text.assign(std::min<std::size_t>(h.bytes, kMaxAbortText), '\0');
      if (h.bytes > kMaxAbortText) return {RecvTarget::kDiscard, nullptr, 1};
      return {RecvTarget::kDirect, text.data(), 1};
    }
    case FrameType::kData: {
      Op* op = find(h.seq);
      if (op != nullptr) {
        if (link >= 2) return log_step_target(*op, link, h, ctx);
        return target_for(*op, 1 - link, channel, h, ctx);
      }
      if (static_cast<std::int64_t>(h.seq) <= posted_) {
        throw Error(ErrorCode::kMismatch,
                    "received a slice of operation #" + std::to_string(h.seq) + " (" + view_of(h) +
                        ") from rank " + std::to_string(peer) +
                        " after this rank had finished it: the ranks disagree about that "
                        "operation's size or schedule",
                    cfg_.rank, peer, to_string(static_cast<OpKind>(h.kind & 0x0f)),
                    static_cast<std::int64_t>(h.seq));
      }
      // Not posted here yet: an eager slice that ran ahead. Keep it until the op is posted.
      unexpected_bytes_ += h.bytes;
      if (unexpected_bytes_ > kMaxUnexpectedBytes) {
        throw Error(ErrorCode::kMismatch,
                    "rank " + std::to_string(peer) + " sent more than " +
                        std::to_string(kMaxUnexpectedBytes >> 20) +
                        " MiB for operations this rank has not issued (are the ranks issuing "
                        "the same operations?)",
                    cfg_.rank, peer);
      }
      if (spare_unexpected_.empty()) spare_unexpected_.emplace_back();
      unexpected_.splice(unexpected_.end(), spare_unexpected_, std::prev(spare_unexpected_.end()));
      Unexpected& u = unexpected_.back();
      u.header = h;
      u.link = link;
      u.channel = channel;
      u.complete = false;
      u.data.resize(h.bytes);
      ctx.pending = &u;
      return {RecvTarget::kDirect, u.data.data(), 1};
    }
    case FrameType::kConsumed: break;  // the TCP channel's own; never reaches the engine
  }
  throw Error(ErrorCode::kPeerFailed,
              "protocol violation: unexpected frame type " +
                  std::to_string(static_cast<int>(h.type)) + " from rank " + std::to_string(peer),
              cfg_.rank, peer);
}

void Engine::check_header(const Op& op, int peer, const FrameHeader& h) const {
  if (h.kind != kind_byte(op) || h.count != op.user_count || h.root != op.root ||
      (op.kind != OpKind::kBarrier && h.dtype != static_cast<std::uint8_t>(op.dtype)) ||
      ((op.kind == OpKind::kAllReduce || op.kind == OpKind::kReduceScatter) &&
       h.redop != static_cast<std::uint8_t>(op.redop))) {
    throw Error(ErrorCode::kMismatch,
                "operation #" + std::to_string(op.seq) + " differs between ranks: rank " +
                    std::to_string(peer) + " has " + view_of(h) + ", rank " +
                    std::to_string(cfg_.rank) + " has " + view_of(op),
                cfg_.rank, peer, to_string(op.kind), static_cast<std::int64_t>(op.seq));
  }
}

RecvTarget Engine::target_for(Op& op, int dir, int channel, const FrameHeader& h, RecvCtx& ctx) {
  const int peer = peer_of(1 - dir);
  const auto di = static_cast<std::size_t>(dir);
  if (is_log_step(op.schedule)) {
    throw Error(ErrorCode::kMismatch,
                "a ring slice of operation #" + std::to_string(op.seq) + " arrived from rank " +
                    std::to_string(peer) + " but this rank runs it as " + view_of(op),
                cfg_.rank, peer, to_string(op.kind), static_cast<std::int64_t>(op.seq));
  }
  check_header(op, peer, h);
  const auto c = static_cast<std::size_t>(channel);
  if (channel >= op.channels || h.index != op.recv_next[di][c] ||
      h.index >= op.messages_received_per_channel(dir)) {
    throw Error(ErrorCode::kMismatch,
                "slice " + std::to_string(h.index) + " of " + view_of(op) + " arrived on channel " +
                    std::to_string(channel) + " from rank " + std::to_string(peer) +
                    " where slice " + std::to_string(op.recv_next[di][c]) +
                    " was expected: the ranks use different channel or slice settings",
                cfg_.rank, peer, to_string(op.kind), static_cast<std::int64_t>(op.seq));
  }
  const MessagePlan m = recv_plan(op, dir, channel, h.index);
  if (m.span.bytes != h.bytes) {
    throw Error(ErrorCode::kMismatch,
                "slice " + std::to_string(h.index) + " from rank " + std::to_string(peer) +
                    " has " + std::to_string(h.bytes) + " bytes, this rank expects " +
                    std::to_string(m.span.bytes) +
                    ": the ranks use different channel or slice settings",
                cfg_.rank, peer, to_string(op.kind), static_cast<std::int64_t>(op.seq));
  }
  const RecvPlace p = recv_place(op, m);
  ctx.op = &op;
  ctx.dir = dir;
  ctx.dst = p.dst;
  ctx.other = p.other;
  ctx.final = p.final;
  ctx.reduce = p.other != nullptr;
  // A bounced operation's receives, and a reduction whose step completes later, land in a
  // slot; the step is issued once the payload is in (arrive).
  if (op.bounced || (ctx.reduce && !op.exec->immediate())) {
    const int s = acquire_slot(op, 1 - dir, channel, h.bytes, false);
    Slot& slot = slots_[static_cast<std::size_t>(s)];
    slot.step = ctx.reduce ? reduce_step(op, ctx, p.dst, slot.data, p.other, h.bytes / op.el)
                           : copy_step(p.dst, slot.data, h.bytes);
    ctx.slot = s;
    return {RecvTarget::kDirect, slot.data, 1};
  }
  if (ctx.reduce) return {RecvTarget::kStream, nullptr, op.el};
  return {RecvTarget::kDirect, p.dst, 1};
}

void Engine::on_payload(int link, int channel, const char* data, std::size_t offset,
                        std::size_t len) {
  RecvCtx& ctx = recv_ctx_[link][static_cast<std::size_t>(channel)];
  Op& op = *ctx.op;
  // Streamed only for an immediate executor: the piece is reduced before this returns.
  op.exec->issue(reduce_step(op, ctx, ctx.dst + offset, data, ctx.other + offset, len / op.el), 0);
}

void Engine::on_message(int link, int channel, const FrameHeader& h) {
  RecvCtx& ctx = recv_ctx_[link][static_cast<std::size_t>(channel)];
  if (h.type == FrameType::kPosted) {
    peer_posted_ = std::max(peer_posted_, static_cast<std::int64_t>(h.seq));
    if (h.bytes == sizeof(transport::Window)) {
      if (Op* op = find(h.seq)) {
        op->peer_window = window_in_;
        op->has_peer_window = true;
      } else if (static_cast<std::int64_t>(h.seq) > posted_) {
        peer_windows_[h.seq] = window_in_;
      }
    }
    return;
  }
  if (h.type == FrameType::kAbort) {
    const int blame = h.root >= 0 && h.root < cfg_.size ? h.root : peer_of(link);
    // Mismatches and timeouts keep their kind as they travel around the ring (a timeout must
    // stay recognisable for the hand-back below); anything else is the peer's failure.
    const auto code =
        h.count == static_cast<std::uint64_t>(ErrorCode::kMismatch)  ? ErrorCode::kMismatch
        : h.count == static_cast<std::uint64_t>(ErrorCode::kTimeout) ? ErrorCode::kTimeout
                                                                     : ErrorCode::kPeerFailed;
    std::string text(abort_text_[link].data(), abort_text_[link].size());
    if (h.count == static_cast<std::uint64_t>(ErrorCode::kTimeout) && blame == cfg_.rank &&
        !active_.empty()) {
      // A neighbour gave up waiting for this rank, which is alive and waiting itself: pass on
      // this rank's own view, so the blame moves towards the rank that really is stuck.
      throw timeout_error(*active_.front(), "rank " + std::to_string(peer_of(link)) +
                                                " timed out waiting for this rank; ");
    }
    throw Error(code, "rank " + std::to_string(peer_of(link)) + " reported: " + text, cfg_.rank,
                blame);
  }
  if (ctx.op != nullptr && ctx.step >= 0) {
    ctx.op->step_state[static_cast<std::size_t>(ctx.step)] |= Op::kStepReceived;
  } else if (ctx.op != nullptr) {
    arrive(*ctx.op, link, channel, ctx);
  } else if (ctx.pending != nullptr) {
    // Stored whole now. Its operation may have been posted while the payload was arriving:
    // then it is placed at once (a partial one is never replayed).
    ctx.pending->complete = true;
    if (Op* op = find(h.seq)) replay_unexpected(*op);
  }
  ctx = RecvCtx{};
}

void Engine::replay_unexpected(Op& op) {
  for (auto it = unexpected_.begin(); it != unexpected_.end();) {
    // An incomplete one (its channel is still reading the payload into it) is the last of its
    // channel; it is replayed when it completes.
    if (it->header.seq != op.seq || !it->complete) {
      ++it;
      continue;
    }
    RecvCtx ctx;
    if (it->link >= 2) {
      const RecvTarget t = log_step_target(op, it->link, it->header, ctx);
      if (it->header.bytes > 0) std::memcpy(t.dst, it->data.data(), it->header.bytes);
      op.step_state[static_cast<std::size_t>(ctx.step)] |= Op::kStepReceived;
      unexpected_bytes_ -= it->header.bytes;
      it = recycle_unexpected(it);
      continue;
    }
    const int dir = 1 - it->link;
    const RecvTarget t = target_for(op, dir, it->channel, it->header, ctx);
    if (t.mode == RecvTarget::kDirect) {
      // Into its destination, or the landing slot whose step arrive() issues.
      if (it->header.bytes > 0) std::memcpy(t.dst, it->data.data(), it->header.bytes);
    } else {
      op.exec->issue(
          reduce_step(op, ctx, ctx.dst, it->data.data(), ctx.other, it->header.bytes / op.el), 0);
    }
    arrive(op, it->link, it->channel, ctx);
    unexpected_bytes_ -= it->header.bytes;
    it = recycle_unexpected(it);
  }
}

std::list<Engine::Unexpected>::iterator Engine::recycle_unexpected(
    std::list<Unexpected>::iterator it) {
  const auto next = std::next(it);
  spare_unexpected_.splice(spare_unexpected_.end(), unexpected_, it);
  return next;
}

void Engine::on_sent(int link, int channel, std::uint64_t token) {
  if (token == kControlToken) return;
  if (token == kWindowToken) {
    // Frames of one channel are sent in the order queued.
    if (!window_wire_.empty()) window_wire_.pop_front();
    return;
  }
  if (link < 2 && is_slot_token(token)) {
    slot_sent(link, channel, token);
    return;
  }
  if (link >= 2) {
    // Mesh sends carry (sequence, step).
    Op* op = find(token >> 8);
    if (op != nullptr) {
      op->step_state[static_cast<std::size_t>(token & 0xff)] |= Op::kStepSendDone;
      --op->sends_in_flight;
    }
    return;
  }
  Op* op = find(token);
  // Link l carries the sends of direction l.
  if (op != nullptr)
    ++op->send_done[static_cast<std::size_t>(link)][static_cast<std::size_t>(channel)];
}

void Engine::on_closed(int link, int channel) {
  // A peer that finished its part and destroyed its communicator closes cleanly; that is an
  // error only for an operation that still needs this link.
  for (const auto& holder : active_) check_link_needed(*holder, link, channel);
}

bool Engine::copy_while_waiting() {
  // In pieces, so that a turn stays short for the operations that arrive meanwhile.
  constexpr std::size_t kPiece = 256 * 1024;
  for (const auto& op : active_) {
    if (op->start_pending == 0 && copy_piece(*op, kPiece)) return true;
  }
  return false;
}

void Engine::complete_finished() {
  for (auto it = active_.begin(); it != active_.end();) {
    Op& op = **it;
    if (!op.finished() || !advance_finish(op)) {
      ++it;
      continue;
    }
    close_window(op);
    release_scratch(op);
    if (op.fence) op.fence->done();
    op.state->complete(nullptr);
    it = active_.erase(it);
  }
}

std::string Engine::describe_progress(const Op& op) const {
  std::string text;
  if (is_log_step(op.schedule)) {
    const auto k = static_cast<std::size_t>(op.step_next);
    text = "completed " + std::to_string(op.step_next) + "/" + std::to_string(op.log.steps.size()) +
           " steps of " + to_string(op.schedule);
    if (k < op.log.steps.size()) {
      const Step& s = op.log.steps[k];
      const std::uint8_t st = op.step_state[k];
      if (s.recv_peer >= 0 && (st & Op::kStepReceived) == 0) {
        text += ", waiting for " + std::to_string(s.recv_bytes) + " bytes from rank " +
                std::to_string(s.recv_peer);
      } else if (s.send_peer >= 0) {
        text += ", sending " + std::to_string(s.send_bytes) + " bytes to rank " +
                std::to_string(s.send_peer);
      }
    }
    return text;
  }
  for (int d = 0; d < 2; ++d) {
    const auto di = static_cast<std::size_t>(d);
    if (op.send_steps[di] == 0 && op.recv_steps[di] == 0) continue;
    std::uint32_t got = 0;
    std::uint32_t sent = 0;
    for (int c = 0; c < op.channels; ++c) {
      got += op.recv_next[di][static_cast<std::size_t>(c)];
      sent += op.send_done[di][static_cast<std::size_t>(c)];
    }
    const auto chans = static_cast<std::uint32_t>(op.channels);
    if (!text.empty()) text += "; ";
    text += "received " + std::to_string(got) + "/" +
            std::to_string(op.messages_received_per_channel(d) * chans) + " slices from rank " +
            std::to_string(peer_of(1 - d)) + ", sent " + std::to_string(sent) + "/" +
            std::to_string(op.messages_sent_per_channel(d) * chans) + " to rank " +
            std::to_string(peer_of(d));
  }
  return text;
}

int Engine::blame_link(const Op& op) const {
  if (is_log_step(op.schedule)) {
    const auto k = static_cast<std::size_t>(op.step_next);
    if (k >= op.log.steps.size()) return 2;
    const Step& s = op.log.steps[k];
    const bool waiting = s.recv_peer >= 0 && (op.step_state[k] & Op::kStepReceived) == 0;
    const int peer = waiting || s.send_peer < 0 ? s.recv_peer : s.send_peer;
    return peer >= 0 ? mesh_link(peer) : 2;
  }
  // The side we are waiting on: a receive outstanding points at the previous rank.
  int link = kNext;
  for (int c = 0; c < op.channels; ++c) {
    const auto ci = static_cast<std::size_t>(c);
    if (op.recv_next[kForward][ci] < op.messages_received_per_channel(kForward)) return kPrev;
    if (op.recv_next[kBackward][ci] < op.messages_received_per_channel(kBackward)) link = kNext;
  }
  return link;
}

Error Engine::timeout_error(const Op& op, const std::string& prefix) const {
  const int blame = peer_of(blame_link(op));
  return Error(ErrorCode::kTimeout,
               prefix + view_of(op) + " did not complete within " +
                   std::to_string(op.timeout.count()) + " ms: " + describe_progress(op) +
                   "; rank " + std::to_string(blame) +
                   " is dead, stalled, or did not issue this operation",
               cfg_.rank, blame, to_string(op.kind), static_cast<std::int64_t>(op.seq));
}

void Engine::check_deadlines() {
  if (active_.empty()) return;
  const auto now = transport::Clock::now();
  for (const auto& holder : active_) {
    if (now < holder->deadline) continue;
    const Op& op = *holder;
    // The neighbour this rank waits on may itself be waiting on a rank further up the ring:
    // ask it first (a timeout notice naming it), so that it answers with its own view and
    // every rank ends up naming the rank that is really stuck. A neighbour that does not
    // answer within the grace period is the one to blame.
    if (probe_deadline_ == transport::Clock::time_point{}) {
      const auto grace = std::clamp<std::chrono::milliseconds>(
          op.timeout / 10, std::chrono::milliseconds(100), std::chrono::milliseconds(2000));
      probe_deadline_ = now + grace;
      const int link = blame_link(op);
      probe_text_ = timeout_error(op, "").what();  // must outlive the send
      if (probe_text_.size() > kMaxAbortText) probe_text_.resize(kMaxAbortText);
      send_control(link, FrameType::kAbort, 0, probe_text_, peer_of(link),
                   static_cast<int>(ErrorCode::kTimeout));
      flush_links();
      return;
    }
    if (now >= probe_deadline_) throw timeout_error(op, "");
  }
}

void Engine::wait_for_events(std::unique_lock<std::mutex>& turn) {
  pollfds_.clear();
  pollfds_.push_back({wake_fd_.get(), POLLIN, 0});
  for (auto& link : links_) {
    for (auto& ch : link) {
      if (ch->polled() && !ch->closed()) {
        // A transport that moves data only when asked: keep asking, yielding the CPU in
        // between (and without asking it for a descriptor to sleep on).
        turn.unlock();
        sched_yield();
        return;
      }
    }
  }
  for (std::size_t l = 0; l < links_.size(); ++l) {
    for (std::size_t c = 0; c < links_[l].size(); ++c) {
      // A channel left unread for want of landing slots would wake the engine at once.
      if (landing_full(static_cast<int>(l), static_cast<int>(c))) continue;
      const pollfd p = links_[l][c]->wait_spec();
      if (p.fd >= 0) pollfds_.push_back(p);
    }
  }
  auto deadline = transport::Deadline::max();
  for (const auto& op : active_) deadline = std::min(deadline, op->deadline);
  if (probe_deadline_ != transport::Clock::time_point{}) deadline = probe_deadline_;
  // Executors that cannot wake the engine, and device input that nobody signals, are looked
  // at again after a short sleep.
  auto nap = executor_poll_interval();
  if (fence_wait_) nap = nap.count() > 0 ? std::min(nap, kFencePoll) : kFencePoll;
  mode_.store(kActiveSleep);
  // Sleep without the turn lock, so a thread in drive() can run turns meanwhile.
  turn.unlock();
  int rc = 0;
  if (pending_submissions_.load() == 0 && !stop_.load() && !abort_requested_.load() &&
      drivers_.load() == 0) {
    const int ms = transport::poll_timeout_ms(deadline);
    if (nap.count() > 0 && (ms < 0 || std::chrono::milliseconds(ms) > nap)) {
      const timespec ts{0, static_cast<long>(nap.count() * 1000)};
      rc = ::ppoll(pollfds_.data(), pollfds_.size(), &ts, nullptr);
    } else {
      rc = ::poll(pollfds_.data(), pollfds_.size(), ms);
    }
  }
  mode_.store(kRunning);
  if (rc < 0 && errno != EINTR) {
    turn.lock();
    fail(Error(ErrorCode::kSystem, std::string("poll: ") + std::strerror(errno), cfg_.rank));
    return;
  }
  if (pollfds_[0].revents & POLLIN) {
    std::uint64_t v = 0;
    [[maybe_unused]] const ssize_t n = ::read(wake_fd_.get(), &v, sizeof(v));
  }
}

void Engine::send_control(int link, FrameType type, std::uint64_t seq, const std::string& text,
                          int blame, int code) {
  auto& chans = links_[link];
  if (chans.empty() || chans[0]->closed()) return;
  FrameHeader h;
  h.type = type;
  h.seq = seq;
  h.bytes = static_cast<std::uint32_t>(text.size());
  h.root = blame;
  h.count = static_cast<std::uint64_t>(code);
  // Control frames carry no pointer into operation memory; text must outlive the send, so
  // abort texts are kept in abort_text_ until the channel is closed.
  const void* payload = text.empty() ? nullptr : text.data();
  if (!chans[0]->try_send(h, payload, kControlToken)) {
    // Queue full: progress once and retry; a full queue on the control direction means the
    // peer stopped reading, which the deadline will report.
    chans[0]->progress(*sinks_[link], true);
    (void)chans[0]->try_send(h, payload, kControlToken);
  }
}

void Engine::fail(const Error& e) {
  bool first = false;
  {
    std::lock_guard<std::mutex> lock(submit_mu_);
    if (!failed_) {
      failed_ = std::make_exception_ptr(e);
      first = true;
    }
  }
  if (first) {
    // Tell both neighbours, so the failure travels around the ring instead of waiting for
    // each rank's deadline. Best effort: the links may be the thing that broke.
    const int blame = e.peer() != Error::kNone ? e.peer() : cfg_.rank;
    static thread_local std::string text;
    text = e.what();
    if (text.size() > kMaxAbortText) text.resize(kMaxAbortText);
    for (std::size_t li = 0; li < links_.size(); ++li) {
      const int l = static_cast<int>(li);
      try {
        send_control(l, FrameType::kAbort, 0, text, blame, static_cast<int>(e.code()));
        for (auto& ch : links_[l]) {
          if (!ch->closed()) ch->abandon();
        }
      } catch (const Error&) {
        // The link is already broken; the peer learns from that.
      }
    }
  }
  std::exception_ptr err;
  {
    std::lock_guard<std::mutex> lock(submit_mu_);
    err = failed_;
  }
  fail_all(err);
}

void Engine::fail_all(std::exception_ptr e) {
  std::deque<std::unique_ptr<Op>> batch;
  {
    std::lock_guard<std::mutex> lock(submit_mu_);
    if (!failed_) failed_ = e;
    batch.swap(submitted_);
    pending_submissions_.store(0);
  }
  fence_wait_ = false;
  // No step may still write into an operation's memory once its caller has it back.
  drain_executors();
  for (auto& op : batch) {
    if (op->fence) op->fence->done();
    op->state->complete(e);
  }
  for (auto& op : active_) {
    close_window(*op);
    release_scratch(*op);
    if (op->fence) op->fence->done();
    op->state->complete(e);
  }
  active_.clear();
}

}  // namespace collectives
}  // namespace dear
