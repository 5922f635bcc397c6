// The engine's frame: construction, how an operation starts (its scratch, its window, its
// place in the priority order), the announcements that let the next rank send, priority
// changes, and completion. The rest lives in a file per responsibility (engine.h lists them;
// docs/architecture.md describes the design).
#include "collectives/engine.h"

#include <pthread.h>
#include <sys/eventfd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <ctime>

#include "collectives/engine_internal.h"
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

using engine_detail::kAnnounceEvery;
using engine_detail::kControlToken;
using engine_detail::kNext;
using engine_detail::kPrev;
using engine_detail::kWindowToken;
using transport::FrameHeader;
using transport::FrameType;

namespace {

bool order_before(const Op& a, const Op& b) {
  if (a.priority != b.priority) return a.priority > b.priority;
  return a.seq < b.seq;
}

}  // namespace

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
  window_received_.assign(links_[kPrev].size(), 0);
  window_freed_ = window_credited_ = window_received_;
  window_sent_.assign(links_[kNext].size(), 0);
  window_credit_ = window_sent_;
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

int Engine::peer_of(int link) const {
  const int n = cfg_.size;
  if (link >= 2) return mesh_peers_[static_cast<std::size_t>(link - 2)];
  return link == kNext ? (cfg_.rank + 1) % n : (cfg_.rank - 1 + n) % n;
}

void Engine::start(std::unique_ptr<Op> op) {
  {
    std::lock_guard<std::mutex> lock(submit_mu_);
    if (failed_) {
      op->transition(OpState::kFailed);
      op->state->complete(failed_);
      return;
    }
  }
  op->transition(OpState::kStarting);
  op->deadline = transport::deadline_after(op->timeout);
  prepare_op(*op);
  if (is_rooted_result(op->kind, op->root) && op->rank != op->root) take_sink(*op);
  const bool log_step = is_log_step(op->schedule);
  const bool needs_scratch = op->schedule == Schedule::kGatherReduce ||
                             (op->kind == OpKind::kReduceScatter && op->nranks > 2 && !log_step);
  if (op->device && needs_scratch) {
    // In the device executor's memory; handed back when the operation completes.
    op->scratch = op->exec->allocate(ExecMemory::kScratch, op->ring.total * op->el);
    if (op->schedule == Schedule::kGatherReduce) op->work = op->scratch;
  } else if (log_step) {
    // The work buffer (reduce_scatter: a copy of the input; an in-place all_to_all: a copy of
    // the input for its sends, whose blocks its receives overwrite) and the staging area.
    const bool copy_in = op->kind == OpKind::kAllToAll && op->in == op->out;
    const std::size_t work =
        op->log_step.plan.work_is_scratch || copy_in ? op->log_step.plan.work_bytes : 0;
    op->scratch_owner =
        scratch_.acquire(work + op->log_step.plan.stage_bytes, &op->scratch_capacity);
    op->scratch = op->scratch_owner.get();
    if (op->log_step.plan.work_is_scratch) op->work = op->scratch;
    if (copy_in && work > 0) op->log_step.send_base = op->scratch;  // filled by start_local
    op->log_step.stage = op->scratch + work;
  } else if (needs_scratch) {
    const std::size_t bytes = op->ring.total * op->el;
    op->scratch_owner = scratch_.acquire(bytes, &op->scratch_capacity);
    op->scratch = op->scratch_owner.get();
    if (op->schedule == Schedule::kGatherReduce) op->work = op->scratch;
  }
  // A shadowed operation's input is still on its way to host memory (start_when_ready).
  if (op->shadow.in_done || op->shadow.exec == nullptr) start_local(*op);
  open_window(*op);
  posted_ = static_cast<std::int64_t>(op->seq);
  // An all_to_all_v's ranks decide by their own sizes whether it is eager, so one that is
  // eager here may be waited for by a sender that is not: it is announced all the same.
  if (!op->eager || op->kind == OpKind::kAllToAllV || op->seq % kAnnounceEvery == 0) {
    announce_ = posted_;
  }
  Op* raw = op.get();
  const auto pos = std::upper_bound(
      active_.begin(), active_.end(), raw,
      [](const Op* a, const std::unique_ptr<Op>& b) { return order_before(*a, *b); });
  active_.insert(pos, std::move(op));
  issue_start_copies(*raw);
  // With no start copy in flight (none, or an immediate executor's, already made) it runs now;
  // otherwise once the last of them completes (step_done).
  if (raw->life() == OpState::kStarting && raw->start_pending == 0) {
    raw->transition(OpState::kRunning);
  }
  replay_unexpected(*raw);
  // A neighbour that finished everything and left is fine as long as this operation has
  // nothing more to exchange with it (its slices may all have arrived before it closed).
  for (std::size_t l = 0; l < links_.size(); ++l) {
    for (std::size_t c = 0; c < links_[l].size(); ++c) {
      if (links_[l][c]->closed()) check_link_needed(*raw, static_cast<int>(l), static_cast<int>(c));
    }
  }
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

bool Engine::copy_while_waiting() {
  // In pieces, so that a turn stays short for the operations that arrive meanwhile.
  constexpr std::size_t kPiece = 256 * 1024;
  for (const auto& op : active_) {
    if (op->life() == OpState::kRunning && copy_piece(*op, kPiece)) return true;
  }
  return false;
}

void Engine::complete_finished() {
  for (auto it = active_.begin(); it != active_.end();) {
    Op& op = **it;
    if (op.life() == OpState::kRunning && op.finished()) op.transition(OpState::kFinishing);
    // A finishing operation completes once its final local steps are done (advance_finish).
    if (op.life() != OpState::kFinishing || !op.finished() || !advance_finish(op)) {
      ++it;
      continue;
    }
    close_window(op);
    release_scratch(op);
    if (op.fence) op.fence->done();
    op.transition(OpState::kDone);
    op.state->complete(nullptr);
    it = active_.erase(it);
  }
}
}  // namespace collectives
}  // namespace dear
