// The engine's driver: who runs a turn and when. The engine thread runs turns, spins a
// moment after moving something, and sleeps (on the links while operations are in flight, on
// a tick while idle) until woken; a caller's thread may run turns itself (submit, poke,
// drive) or keep the engine thread spinning while it waits (await). One turn drains the
// submissions, moves bytes on every link, fills the send queues and completes what finished.
#include <poll.h>
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "collectives/engine.h"
#include "collectives/engine_internal.h"
#include "collectives/steps.h"

namespace dear::collectives {

using engine_detail::kFencePoll;

Work Engine::submit(std::unique_ptr<Op> op) {
  // A device operation's steps go to its executor on the engine thread only.
  const bool eager = op->eager && !op->device;
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
    op->transition(OpState::kFailed);
    state->complete(failed);
    return Work(state);
  }
  // A small operation starts on this thread when the engine is free: its first slices leave
  // now, without waiting for the engine thread to wake up, and the rest is left to the thread
  // that waits for it (or to the engine's next idle tick). Anything else, or an engine in deep
  // sleep, gets the engine thread's attention at once.
  bool started = false;
  if (eager && turn_mu_.try_lock()) {
    // Sends only: reading the links here cost a poll() per operation on TCP, and the thread
    // that waits for it reads them a moment later (2 ranks, 8 B all_reduce over TCP, p50 7.45
    // against 7.85 us over ten alternating rounds; send_recv 9.0 against 10.9 us).
    turn(false);
    turn_mu_.unlock();
    started = true;
  }
  if (!wake_if(kActiveSleep) && !wake_if(kDeepSleep) && !started) wake_if(kIdleSleep);
  return Work(state);
}

void Engine::forget_memory(const void* addr, std::size_t bytes) {
  {
    std::lock_guard<std::mutex> lock(submit_mu_);
    forgotten_.push_back({addr, bytes, next_seq_});
    pending_submissions_.fetch_add(1);  // the engine's next turn looks at the queues
  }
  if (!wake_if(kActiveSleep)) wake_if(kDeepSleep);
}

void Engine::wake() {
  const std::uint64_t one = 1;
  [[maybe_unused]] const ssize_t n = ::write(wake_fd_.get(), &one, sizeof(one));
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

template <typename Fn>
bool Engine::guarded_turn(Fn&& work) {
  bool moved = false;
  try {
    moved = work();
  } catch (const Error& e) {
    fail(e);
    moved = true;
  } catch (const std::exception& e) {
    fail(Error(ErrorCode::kInternal, e.what(), cfg_.rank));
    moved = true;
  }
  has_active_.store(!active_.empty() || p2p_pending_ > 0);
  return moved;
}

bool Engine::turn(bool read_links) {
  return guarded_turn([&] {
    if (abort_requested_.load()) {
      std::string reason;
      {
        std::lock_guard<std::mutex> lock(submit_mu_);
        reason = abort_reason_;
      }
      fail(Error(ErrorCode::kAborted, "Communicator::abort(): " + reason, cfg_.rank));
      abort_requested_.store(false);
    }
    bool moved = drain_submissions();
    moved |= drain_p2p();
    apply_priorities();
    announce();
    if (read_links) moved |= progress_links();
    moved |= poll_executors();
    // Hand newly queued slices to the sockets in the same turn; an idle turn skips it.
    if (schedule_sends()) {
      moved = true;
      flush_links();
    }
    moved |= advance_p2p();
    // A turn that moved nothing is waiting for the network: time for the deferred copies.
    if (!moved) moved = copy_while_waiting();
    complete_finished();
    check_deadlines();
    return moved;
  });
}

void Engine::sleep_idle() {
  // While it may soon be needed again, the engine does not watch the sockets: what arrives
  // meanwhile (slices of operations not posted here yet, announcements) waits in the kernel
  // until there is an operation to progress, and a thread in drive() reads the sockets
  // itself, so arrivals cost no wake-ups here. It wakes every tick in case an operation was
  // started by its caller (Engine::submit) and nobody waits for it, while no thread drives.
  // While one does, that thread's turns move every operation and the last driver to leave
  // wakes the engine if work is left, so the engine sleeps as long as in deep sleep: each
  // wake-up took the CPU from a spinning driver (with a 1 ms tick, 2 ranks, 8 B ping-pong:
  // p99 28-32 us against 9-11 us with 20 ms, four alternating rounds). After
  // enough quiet ticks it sleeps on the sockets too, so that an abort or a closed link is
  // noticed while idle; even then it looks round every kDeepTick, so that a wake-up lost to
  // a race nobody foresaw costs a moment, never a hang. (No timer is armed per operation: on
  // virtual machines that costs more than the operation.)
  constexpr int kTicks = 50;
  constexpr auto kTick = std::chrono::microseconds(200);
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
    const std::chrono::nanoseconds wait =
        deep || driven ? std::chrono::nanoseconds(kDeepTick) : std::chrono::nanoseconds(kTick);
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
  deadline = std::min(deadline, p2p_deadline());
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

bool Engine::narrow_turn_allowed() const {
  return p2p_waiting_.empty() && pending_submissions_.load() == 0 && !abort_requested_.load() &&
         !steps_in_flight();
}

bool Engine::progress_mesh(int l, bool may_read) {
  transport::Channel& ch = *links_[static_cast<std::size_t>(l)][0];
  if (ch.closed()) return false;
  if (may_read ? landing_full(l, 0) : ch.queued() == 0) return false;
  return ch.progress(*sinks_[static_cast<std::size_t>(l)], may_read);
}

std::optional<bool> Engine::p2p_turn() {
  if (p2p_pending_ == 0 || !active_.empty() || !narrow_turn_allowed()) return std::nullopt;
  return guarded_turn([&] {
    bool moved = false;
    for (std::size_t r = 0; r < p2p_.size(); ++r) {
      const PeerP2p& peer = p2p_[r];
      if (peer.sends.empty() && peer.recvs.empty()) continue;
      moved |= progress_mesh(mesh_link(static_cast<int>(r)), true);
    }
    moved |= advance_p2p();
    return moved;
  });
}

bool Engine::p2p_submit_turn() {
  return guarded_turn([&] {
    const bool posted = drain_p2p();
    return advance_p2p() || posted;
  });
}

std::optional<bool> Engine::log_step_turn() {
  if (active_.empty() || !is_log_step(active_.front()->schedule) || p2p_pending_ > 0 ||
      !narrow_turn_allowed() || announce_ > announced_ || !windows_to_announce_.empty()) {
    return std::nullopt;
  }
  narrow_links_.clear();
  for (const auto& holder : active_) {
    const Op& op = *holder;
    if (!is_log_step(op.schedule) || op.life() != OpState::kRunning || !may_send(op)) {
      return std::nullopt;
    }
    const auto& steps = op.log_step.plan.steps;
    const std::size_t k = op.log_step.step_next;
    if (k >= steps.size()) return std::nullopt;  // finishing: a full turn completes it
    for (const int peer : {steps[k].send_peer, steps[k].recv_peer}) {
      if (peer < 0) continue;
      const int l = mesh_link(peer);
      if (std::find(narrow_links_.begin(), narrow_links_.end(), l) == narrow_links_.end()) {
        narrow_links_.push_back(l);
      }
    }
  }
  return guarded_turn([&] {
    bool moved = false;
    for (const int l : narrow_links_) moved |= progress_mesh(l, true);
    for (auto& holder : active_) {
      if (holder->life() == OpState::kRunning) moved |= advance_log_steps(*holder);
    }
    // What the steps queued leaves now; the next turn reads the replies.
    for (const int l : narrow_links_) (void)progress_mesh(l, false);
    complete_finished();
    return moved;
  });
}

bool Engine::drive(const Work::State& state, std::chrono::steady_clock::time_point until,
                   std::chrono::microseconds idle) {
  // While only point-to-point operations wait, most turns are p2p_turn()'s: a recv() that
  // finds the message saves the poll() a full turn makes before it. While only log-step
  // collectives are in flight, they are log_step_turn()'s, which read one or two channels
  // instead of all of them (4 ranks over shm, 8 B recursive doubling: 10-14 against 12-21 us).
  // Every kFullTurnEvery-th turn is a full one, which reads every channel and checks the deadlines.
  constexpr unsigned kFullTurnEvery = 8;
  unsigned turns = 0;
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
      std::optional<bool> narrow;
      if (++turns % kFullTurnEvery != 0) {
        narrow = p2p_turn();
        if (!narrow) narrow = log_step_turn();
      }
      moved = narrow ? *narrow : turn();
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

}  // namespace dear::collectives
