// The completion queue the channels of one communicator share (fabric_domain.h, Hub).
#include <rdma/fabric.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_eq.h>
#include <rdma/fi_errno.h>
#include <sys/eventfd.h>
#include <sys/timerfd.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>

#include "dear/error.h"
#include "transport/fabric/fabric_domain.h"

namespace dear::transport::fabric {

bool Hub::shareable(const Domain& dom) {
  // The send data path: every completion is of an operation of ours (a send, or a receive
  // into a channel's own buffer). The write data path: a peer's write carries no context of
  // ours unless it consumes a posted receive (FI_RX_CQ_DATA); otherwise its CQ data must hold
  // the member's number besides the 32-bit sequence number.
  if (!dom.write) return true;
  if ((dom.info->mode & FI_RX_CQ_DATA) != 0) return true;
  return dom.info->domain_attr->cq_data_size >= 8;
}

bool Hub::shares_endpoint(const Domain& dom) {
  // A write with CQ data that consumes a posted receive takes an untagged one, which a shared
  // endpoint's channels do not post.
  return shareable(dom) && (dom.info->caps & FI_TAGGED) != 0 &&
         (dom.info->mode & FI_RX_CQ_DATA) == 0;
}

Hub::Hub(std::shared_ptr<Domain> dom, std::size_t entries, int rank, bool endpoint)
    : dom_(std::move(dom)), rank_(rank) {
  routes_writes_ = dom_->write && (dom_->info->mode & FI_RX_CQ_DATA) == 0 &&
                   dom_->info->domain_attr->cq_data_size >= 8;
  fi_cq_attr cq_attr{};
  cq_attr.size = std::max<std::size_t>(entries, 64);
  cq_attr.format = FI_CQ_FORMAT_DATA;
  cq_attr.wait_obj = FI_WAIT_FD;
  cq_attr.wait_cond = FI_CQ_COND_NONE;
  fid_cq* cq = nullptr;
  int rc = fi_cq_open(dom_->domain.get(), &cq_attr, &cq, nullptr);
  if (rc == 0) {
    cq_.reset(cq);
    if (fi_control(&cq->fid, FI_GETWAIT, &wait_fd_) != 0) wait_fd_ = -1;
  } else {
    cq_attr.wait_obj = FI_WAIT_NONE;
    rc = fi_cq_open(dom_->domain.get(), &cq_attr, &cq, nullptr);
    if (rc != 0) throw_fi("fi_cq_open(" + dom_->provider + ")", rc, rank_);
    cq_.reset(cq);
  }
  ready_fd_ = Fd(::eventfd(1, EFD_CLOEXEC | EFD_NONBLOCK));
  if (!ready_fd_.valid()) {
    throw Error(ErrorCode::kSystem, "eventfd: " + std::string(std::strerror(errno)), rank_);
  }
  if (wait_fd_ < 0) {
    timer_fd_ = Fd(::timerfd_create(CLOCK_MONOTONIC, TFD_CLOEXEC | TFD_NONBLOCK));
    if (!timer_fd_.valid()) {
      throw Error(ErrorCode::kSystem, "timerfd_create: " + std::string(std::strerror(errno)),
                  rank_);
    }
  }
  if (endpoint && shares_endpoint(*dom_)) {
    fid_ep* ep = nullptr;
    rc = fi_endpoint(dom_->domain.get(), dom_->info.get(), &ep, nullptr);
    if (rc != 0) throw_fi("fi_endpoint(" + dom_->provider + ")", rc, rank_);
    ep_.reset(ep);
    rc = fi_ep_bind(ep, &dom_->av->fid, 0);
    if (rc != 0) throw_fi("fi_ep_bind(av)", rc, rank_);
    rc = fi_ep_bind(ep, &cq_->fid, FI_TRANSMIT | FI_RECV);
    if (rc != 0) throw_fi("fi_ep_bind(cq)", rc, rank_);
    rc = fi_enable(ep);
    if (rc != 0) throw_fi("fi_enable(" + dom_->provider + ")", rc, rank_);
  }
}

std::uint32_t Hub::join(const std::vector<Buf>& bufs) {
  Member m;
  m.first = bufs.data();
  m.count = bufs.size();
  members_.push_back(std::move(m));
  ++live_;
  return static_cast<std::uint32_t>(members_.size() - 1);
}

bool Hub::retire(std::uint32_t m, std::optional<Retired> left) {
  Member& mem = members_[m];
  if (mem.live) {
    mem.live = false;
    --live_;
  }
  mem.inbox.clear();
  mem.errors.clear();
  mem.left = std::move(left);
  if (!mem.left) {
    mem.first = nullptr;
    mem.count = 0;
  }
  return live_ == 0;
}

int Hub::owner(const void* ctx) const {
  const auto at = reinterpret_cast<std::uintptr_t>(ctx);
  for (std::size_t i = 0; i < members_.size(); ++i) {
    const Member& m = members_[i];
    if (m.count == 0) continue;
    const auto first = reinterpret_cast<std::uintptr_t>(m.first);
    if (at >= first && (at - first) % sizeof(Buf) == 0 && (at - first) / sizeof(Buf) < m.count) {
      return static_cast<int>(i);
    }
  }
  return -1;
}

void Hub::note_retired(Member& m, const fi_cq_data_entry& e) {
  if (!m.left || m.left->peer_bye) return;
  // Writes of the peer carry no context of ours (or a receive with no message in it).
  const Buf* b = peer_write(e.flags) ? nullptr : own(m.left->bufs, e.op_context);
  if (b != nullptr && b->recv && e.len >= rma::kPrefix) {
    rma::Prefix p;
    std::memcpy(&p, b->data, rma::kPrefix);
    if (p.tag == m.left->tag && p.kind == rma::Kind::kBye) m.left->peer_bye = true;
  }
}

int Hub::member_of(std::uint64_t flags, std::uint64_t data, const void* ctx) const {
  if (!peer_write(flags)) return owner(ctx);
  // A peer's write: the writer named the member in the data's high half, or (where such writes
  // consume a posted receive) the receive's context says whose; a hub of one member needs
  // neither.
  if (routes_writes_) return static_cast<int>(data >> 32);
  return members_.size() == 1 ? 0 : owner(ctx);
}

void Hub::route(const fi_cq_data_entry& e) {
  const int m = member_of(e.flags, e.data, e.op_context);
  if (m < 0 || static_cast<std::size_t>(m) >= members_.size()) {
    if (stray_.empty()) {
      stray_ = "a completion (flags " + std::to_string(e.flags) +
               ") whose context is none of this rank's fabric buffers";
    }
    return;
  }
  Member& mem = members_[static_cast<std::size_t>(m)];
  if (mem.live) {
    mem.inbox.push_back(e);
  } else {
    note_retired(mem, e);
  }
}

void Hub::route_error(const fi_cq_err_entry& e) {
  int m = member_of(e.flags, e.data, e.op_context);
  if (m < 0 || static_cast<std::size_t>(m) >= members_.size()) {
    // Whose it was is unknown: with one member it is that member's, else everyone fails.
    if (members_.size() == 1) {
      m = 0;
    } else {
      if (stray_.empty()) stray_ = "a failed operation of no known channel: " + error_text(e);
      return;
    }
  }
  Member& mem = members_[static_cast<std::size_t>(m)];
  if (mem.live) mem.errors.push_back(e);
}

std::string Hub::error_text(const fi_cq_err_entry& err) const {
  char buf[256] = {};
  const char* detail = fi_cq_strerror(cq_.get(), err.prov_errno, err.err_data, buf, sizeof(buf));
  return fi_text(err.err) +
         (detail != nullptr && *detail != '\0' ? std::string(" (") + detail + ")" : "");
}

void Hub::read() {
  ++reads_;
  // Not cleared: this runs every engine turn, and clearing 640 bytes was most of a channel's
  // poll (fi_cq_read fills the first n entries, the only ones read).
  std::array<fi_cq_data_entry, 16> entries;
  for (int batch = 0; batch < 64; ++batch) {
    const ssize_t n = fi_cq_read(cq_.get(), entries.data(), entries.size());
    if (n == -FI_EAGAIN) break;
    if (n == -FI_EAVAIL) {
      fi_cq_err_entry err{};
      const ssize_t r = fi_cq_readerr(cq_.get(), &err, 0);
      if (r < 0) {
        if (stray_.empty()) stray_ = "fi_cq_readerr failed: " + fi_text(static_cast<int>(r));
        break;
      }
      route_error(err);
      continue;
    }
    if (n < 0) {
      if (stray_.empty()) stray_ = "fi_cq_read failed: " + fi_text(static_cast<int>(n));
      break;
    }
    for (ssize_t i = 0; i < n; ++i) route(entries[static_cast<std::size_t>(i)]);
    if (static_cast<std::size_t>(n) < entries.size()) break;
  }
}

void Hub::take(std::uint32_t m, std::vector<fi_cq_data_entry>& out) {
  out.clear();
  out.swap(members_[m].inbox);
}

std::optional<fi_cq_err_entry> Hub::take_error(std::uint32_t m) {
  auto& errors = members_[m].errors;
  if (errors.empty()) return std::nullopt;
  const fi_cq_err_entry e = errors.front();
  errors.erase(errors.begin());
  return e;
}

pollfd Hub::wait_spec() const {
  if (wait_fd_ < 0) {
    if (!timer_armed_) {
      itimerspec t{};
      t.it_value.tv_nsec = std::chrono::nanoseconds(kTimerPeriod).count();
      ::timerfd_settime(timer_fd_.get(), 0, &t, nullptr);
      timer_armed_ = true;
      timer_due_ = Clock::now() + kTimerPeriod;
    }
    return {timer_fd_.get(), POLLIN, 0};
  }
  fid* f = &cq_->fid;
  if (fi_trywait(dom_->fabric.get(), &f, 1) != FI_SUCCESS) return {ready_fd_.get(), POLLIN, 0};
  return {wait_fd_, POLLIN, 0};
}

void Hub::tend_timer() {
  // Drain the expiration, so that the engine does not find the descriptor readable when it
  // next sleeps, once it can have happened: the engine calls progress() every turn while it has
  // work, and a read() per turn cost more than the polling it serves.
  if (!timer_fd_.valid() || !timer_armed_ || Clock::now() < timer_due_) return;
  std::uint64_t ticks = 0;
  [[maybe_unused]] const ssize_t n = ::read(timer_fd_.get(), &ticks, sizeof(ticks));
  timer_armed_ = false;
}

bool Hub::reap(Clock::time_point now) {
  if (live_ > 0) return false;
  // Up to 16 reads: what the peers sent before their goodbyes, then the goodbyes.
  for (int i = 0; i < 16; ++i) {
    std::array<fi_cq_data_entry, 16> c;
    const ssize_t n = fi_cq_read(cq_.get(), c.data(), c.size());
    if (n == -FI_EAVAIL) {
      fi_cq_err_entry err{};
      (void)fi_cq_readerr(cq_.get(), &err, 0);
      continue;
    }
    if (n <= 0) break;
    for (ssize_t k = 0; k < n; ++k) route(c[static_cast<std::size_t>(k)]);
  }
  const auto waits = [&](const Member& m) {
    return m.left && (m.left->keep || (!m.left->peer_bye && now < m.left->until));
  };
  // On a shared endpoint every member's receives stay posted until the endpoint closes, so
  // nobody's memory is freed before everybody may go.
  if (ep_ && std::any_of(members_.begin(), members_.end(), waits)) return false;
  ep_.reset();
  bool all = true;
  for (Member& m : members_) {
    if (!m.left) continue;
    if (waits(m)) {
      all = false;
      continue;
    }
    m.left.reset();
    m.first = nullptr;
    m.count = 0;
  }
  return all;
}

}  // namespace dear::transport::fabric
