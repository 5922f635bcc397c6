// Compiled, not run on RDMA hardware: see verbs_link.h.
#include "transport/verbs/verbs_link.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <infiniband/verbs.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "dear/error.h"
#include "transport/peer_exchange.h"
#include "transport/rma/channel_core.h"
#include "transport/rma/fragments.h"
#include "transport/rma/reg_cache.h"
#include "transport/rma/slot_region.h"
#include "transport/rma/slot_window.h"
#include "transport/rma/window_registrations.h"
#include "transport/socket_util.h"
#include "transport/verbs/qp_plan.h"
#include "transport/verbs/verbs_device.h"

namespace dear::transport::verbs {
namespace {

using rma::kControlSlots;
using rma::kPrefix;
using rma::Prefix;
using rma::SendQueue;

constexpr std::uint32_t kSignalEvery = 16;  // at most this many unsignalled WRs in a row
constexpr std::size_t kControlBytes = 64;   // control message buffers (a Prefix fits)
// Receive work requests carry this bit in their id (send ids count up from 0), because an
// error completion reports no opcode, only the id.
constexpr std::uint64_t kRecvId = 1ULL << 63;
// What each end publishes about one queue pair.
struct QpRecord {
  static constexpr std::uint32_t kMagic = 0x64656176;  // "deav": dear verbs
  std::uint32_t magic = kMagic;
  std::uint32_t qpn = 0;
  std::uint32_t psn = 0;
  std::uint32_t mtu = 0;
  std::uint16_t lid = 0;
  std::uint8_t link = 0;
  std::uint8_t gid_index = 0;
  std::uint8_t gid[16] = {};
  std::uint32_t reserved = 0;
  rma::SlotRegion slots;  // the receive slots the peer writes into (key: their rkey)
};
static_assert(sizeof(QpRecord) == 72, "exchanged as plain bytes, with no padding");

class VerbsChannel final : public rma::RmaChannel<VerbsChannel> {
 public:
  VerbsChannel(std::shared_ptr<Context> ctx, int self, int peer, int index, const VerbsOptions& o);
  ~VerbsChannel() override;
  VerbsChannel(const VerbsChannel&) = delete;
  VerbsChannel& operator=(const VerbsChannel&) = delete;

  [[nodiscard]] QpRecord record() const;
  // Moves the queue pair to RTR and RTS towards `remote`.
  void connect(const QpRecord& remote, const VerbsOptions& o);

  std::optional<Window> open_window(char* base, std::size_t bytes,
                                    std::size_t message_bytes) override;
  bool takes_device_windows(int) const override {
    return direct_min_ != 0 && !closed() && !ctx_->flusher_failed;
  }
  std::optional<Window> open_device_window(char* base, std::size_t bytes, std::size_t message_bytes,
                                           const DeviceMemory& memory) override;
  bool register_device_source(const char* base, std::size_t bytes,
                              const DeviceMemory& memory) override;
  void close_window(const Window& window) override { ctx_->close_window(window); }
  void forget_memory(const void* addr, std::size_t bytes) override { ctx_->forget(addr, bytes); }
  pollfd wait_spec() const override;
  bool polled() const override { return true; }
  std::string describe() const override;

 private:
  static constexpr std::uint32_t kNotHeld = 0xffffffffU;
  // A posted send work request, until a signalled completion at or after it retires it.
  struct Posted {
    std::uint32_t buf = 0;  // staging buffer it holds (a direct write holds one unused, which
                            // bounds the requests in flight as staged fragments are)
    bool control = false;
    std::uint32_t held = kNotHeld;  // a direct message's payload write: its id for sent_after()

    static Posted staged(std::uint32_t b) { return {b, false, kNotHeld}; }
    static Posted control_message(std::uint32_t b) { return {b, true, kNotHeld}; }
  };

  // What the channel core asks of its back-end (rma/channel_core.h).
  friend class rma::RmaChannel<VerbsChannel>;
  using Source = std::uint32_t;  // a registration's local key
  // A peer that said goodbye first has nothing left to hear (its queue pair may be gone).
  static constexpr bool kAnswersBye = false;
  // Refuses a staged message from registered device memory, which the CPU cannot read.
  void check_staged(const FrameHeader& h, const void* payload) const;
  bool opened() const { return qp_ != nullptr; }
  bool connected() const { return connected_; }
  bool can_post() const { return !free_data_.empty() && chain_n_ + 1 < chain_.size(); }
  char* staging() { return data_staging(free_data_.back()); }
  std::optional<std::uint32_t> source(const char* p, std::size_t n) {
    return ctx_->source_key(p, n);
  }
  bool post_fragment(std::uint32_t seq, std::size_t staged,
                     const rma::Gather<std::uint32_t>* gather);
  bool post_write(std::uint32_t seq, const SendQueue::Piece& piece, std::uint32_t lkey,
                  std::uint64_t addr, std::uint64_t key);
  void hold_posted(std::uint32_t id) {
    sq_[(sq_next_ - 1) % sq_.size()].held = id;
    ctx_->sources.hold();
  }
  bool post_control(const Prefix& p);
  void flush() { flush_chain(); }
  const char* slot_base(std::uint32_t buffer) const { return slot(buffer); }
  std::optional<std::size_t> written(std::uint32_t buffer) const { return written_[buffer]; }
  void slot_consumed(std::uint32_t) {}
  void direct_started(const char* destination) {
    if (!ctx_->device_windows.empty()) {
      flush_window_ = ctx_->device_window_at(reinterpret_cast<std::uint64_t>(destination));
    }
  }
  // Before the last write of a direct message into a device window is placed: true once the
  // GPU flush behind it completed (posting it first, then polling for it), false while it has
  // not.
  bool writes_visible();
  // Polling the completion queue is cheap (no progress engine behind it): every call polls.
  void begin_progress(bool) { arm(); }
  bool poll(RecvSink& sink) {
    const bool m = poll_cq();
    for (const std::uint64_t t : sent_) sink.on_sent(index_, t);
    sent_.clear();
    return m;
  }
  void end_progress() { flush_chain(); }
  void drain() { poll_cq(); }
  bool in_flight() const { return sq_head_ < sq_next_; }

  char* data_staging(std::uint32_t i) const { return send_mem_.get() + i * slot_bytes_; }
  char* ctrl_staging(std::uint32_t i) const {
    return send_mem_.get() + slots_ * slot_bytes_ + i * kControlBytes;
  }
  char* ctrl_recv(std::uint32_t i) const {
    return send_mem_.get() + slots_ * slot_bytes_ + (kControlSlots + i) * kControlBytes;
  }
  char* slot(std::uint32_t i) const { return recv_mem_.get() + i * slot_bytes_; }
  void post_recv(std::uint32_t i);
  void add_wr(const ibv_sge& sge, ibv_wr_opcode op, std::uint32_t imm, std::uint64_t raddr,
              std::uint64_t rkey, Posted what);
  bool flush_chain();
  void arm();
  bool poll_cq();
  void retire(std::uint64_t id);
  // A window on [base, base + bytes) for messages of `message_bytes` (`any_size`: of any size,
  // a device window), registered through `make` unless a cached registration holds it; nullopt
  // where such messages do not go direct or the memory cannot be registered.
  std::optional<Window> open_registered(char* base, std::size_t bytes, std::size_t message_bytes,
                                        bool any_size,
                                        const rma::WindowRegistrations::Register& make);

  std::shared_ptr<Context> ctx_;  // first: outlives the resources below
  std::uint32_t psn_;

  ibv_qp* qp_ = nullptr;
  std::uint32_t member_ = 0;     // in ctx_->completions
  std::uint64_t seen_ = 0;       // its polls when this channel last looked
  std::vector<ibv_wc> arrived_;  // poll_cq's scratch
  ibv_mr* recv_mr_ = nullptr;
  ibv_mr* send_mr_ = nullptr;
  std::unique_ptr<char, FreeDeleter> recv_mem_;  // data slots the peer writes into
  std::unique_ptr<char, FreeDeleter> send_mem_;  // data staging, control staging, control recv
  rma::SlotRegion remote_{};                     // the peer's receive slots
  std::uint32_t max_inline_ = 0;
  // Bytes each data slot's last write placed (from its completion), checked when its turn
  // comes; a direct message's payload writes leave their slot untouched.
  std::vector<std::uint32_t> written_;
  // Direct messages whose last write completed, reported sent by the next progress().
  std::vector<std::uint64_t> sent_;
  // Receiving a direct message into a device window: the window, and the ticket of the GPU
  // flush once posted.
  std::optional<Window> flush_window_;
  std::optional<std::uint64_t> flush_ticket_;
  bool connected_ = false;

  std::vector<std::uint32_t> free_data_;
  std::vector<std::uint32_t> free_ctrl_;
  // Send queue: ids are consecutive; [sq_head_, sq_next_) posted and not retired.
  std::vector<Posted> sq_;
  std::uint64_t sq_head_ = 0;
  std::uint64_t sq_next_ = 0;
  std::uint32_t unsignalled_ = 0;
  // The chain being built, posted by flush_chain() with one ibv_post_send.
  std::vector<ibv_send_wr> chain_;
  std::vector<ibv_sge> chain_sge_;
  std::size_t chain_n_ = 0;
};

rma::ChannelCore::Params core_params(const Context& ctx, int self, int peer, int index,
                                     const VerbsOptions& o) {
  rma::ChannelCore::Params p;
  p.self = self;
  p.peer = peer;
  p.index = index;
  p.tag = 0;  // a queue pair has one peer
  p.slot_bytes = o.slot_bytes;
  p.slots = o.slots;
  p.direct_min = o.direct_bytes;
  p.write_max = std::max<std::size_t>(
      1, std::min<std::size_t>(o.direct_write_bytes,
                               ctx.max_msg > 0 ? ctx.max_msg : o.direct_write_bytes));
  // Staged fragments only: the queue pairs take one gather entry per request.
  p.in_place_min = 0;
  p.iov_limit = 1;
  p.written = true;
  return p;
}

VerbsChannel::VerbsChannel(std::shared_ptr<Context> ctx, int self, int peer, int index,
                           const VerbsOptions& o)
    : RmaChannel(core_params(*ctx, self, peer, index, o)),
      ctx_(std::move(ctx)),
      psn_(random_psn()),
      written_(o.slots, 0) {
  const std::uint32_t sq_depth = slots_ + kControlSlots;
  const std::uint32_t rq_depth = slots_ + kControlSlots;
  const auto sys = [&](const std::string& call) { throw_sys(call, errno, self_, peer_); };

  qp_ = create_rc_qp(ctx_->pd, ctx_->completions->cq(), sq_depth, rq_depth,
                     static_cast<std::uint32_t>(kControlBytes), &max_inline_);
  if (qp_ == nullptr) sys("ibv_create_qp");
  member_ = ctx_->completions->join(qp_->qp_num);

  const std::size_t recv_bytes = static_cast<std::size_t>(slots_) * slot_bytes_;
  const std::size_t send_bytes = recv_bytes + (2 * kControlSlots + rq_depth) * kControlBytes;
  const auto alloc = [&](std::size_t n) {
    char* p = static_cast<char*>(std::aligned_alloc(4096, (n + 4095) / 4096 * 4096));
    if (p == nullptr) throw Error(ErrorCode::kSystem, "out of memory for verbs slots", self_);
    return p;
  };
  recv_mem_.reset(alloc(recv_bytes));
  send_mem_.reset(alloc(send_bytes));
  recv_mr_ = ibv_reg_mr(ctx_->pd, recv_mem_.get(), recv_bytes,
                        IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
  if (recv_mr_ == nullptr) sys("ibv_reg_mr(receive slots)");
  send_mr_ = ibv_reg_mr(ctx_->pd, send_mem_.get(), send_bytes, IBV_ACCESS_LOCAL_WRITE);
  if (send_mr_ == nullptr) sys("ibv_reg_mr(staging)");

  to_init(qp_, ctx_->port, self_, peer_);

  sq_.resize(sq_depth);
  chain_.resize(sq_depth);
  chain_sge_.resize(sq_depth);
  for (std::uint32_t i = 0; i < slots_; ++i) free_data_.push_back(slots_ - 1 - i);
  for (std::uint32_t i = 0; i < kControlSlots; ++i) free_ctrl_.push_back(kControlSlots - 1 - i);
  // Receives are posted in INIT, before the peer learns this queue pair exists.
  for (std::uint32_t i = 0; i < rq_depth; ++i) post_recv(i);
}

VerbsChannel::~VerbsChannel() {
  close();
  if (qp_ != nullptr) {
    ibv_destroy_qp(qp_);
    ctx_->completions->leave(member_);
  }
  if (recv_mr_ != nullptr) ibv_dereg_mr(recv_mr_);
  if (send_mr_ != nullptr) ibv_dereg_mr(send_mr_);
}

QpRecord VerbsChannel::record() const {
  QpRecord r;
  r.qpn = qp_->qp_num;
  r.psn = psn_;
  r.mtu = ctx_->mtu;
  r.lid = ctx_->lid;
  r.link = static_cast<std::uint8_t>(ctx_->link);
  r.gid_index = static_cast<std::uint8_t>(ctx_->gid_index);
  std::memcpy(r.gid, ctx_->gid.data(), 16);
  // ibverbs addresses registered memory by virtual address.
  r.slots.base = rma::region_base(recv_mem_.get(), 0, true);
  r.slots.key = recv_mr_->rkey;
  r.slots.slot_bytes = slot_bytes_;
  r.slots.slots = slots_;
  return r;
}

void VerbsChannel::connect(const QpRecord& remote, const VerbsOptions& o) {
  if (remote.magic != QpRecord::kMagic) {
    throw Error(ErrorCode::kMismatch,
                "rank " + std::to_string(peer_) +
                    " sent no verbs connection record (does it use transport 'verbs' too?)",
                self_, peer_, "create");
  }
  if (auto bad = rma::check_region(remote.slots, slot_bytes_, slots_, self_, peer_)) {
    throw Error(ErrorCode::kMismatch, *bad, self_, peer_, "create");
  }
  const QpEndpoint local = ctx_->endpoint(qp_->qp_num, psn_);
  QpEndpoint peer;
  peer.link_layer = static_cast<LinkLayer>(remote.link);
  peer.lid = remote.lid;
  peer.mtu = remote.mtu;
  peer.qpn = remote.qpn;
  peer.psn = remote.psn;
  std::memcpy(peer.gid.data(), remote.gid, 16);
  peer.gid_index = remote.gid_index;
  bring_up(qp_, plan_connection(local, peer, ctx_->port, o, self_, peer_),
           "rank " + std::to_string(peer_), self_, peer_);
  remote_ = remote.slots;
  connected_ = true;
}

std::string VerbsChannel::describe() const {
  return "verbs (" + ctx_->device + ":" + std::to_string(ctx_->port) + ") channel " +
         std::to_string(index_) + " between rank " + std::to_string(self_) + " and rank " +
         std::to_string(peer_);
}

void VerbsChannel::post_recv(std::uint32_t i) {
  ibv_sge sge{};
  sge.addr = reinterpret_cast<std::uintptr_t>(ctrl_recv(i));
  sge.length = kControlBytes;
  sge.lkey = send_mr_->lkey;
  ibv_recv_wr wr{};
  wr.wr_id = kRecvId | i;
  wr.sg_list = &sge;
  wr.num_sge = 1;
  ibv_recv_wr* bad = nullptr;
  const int rc = ibv_post_recv(qp_, &wr, &bad);
  if (rc != 0) fail("ibv_post_recv failed: " + errno_text(rc));
}

void VerbsChannel::add_wr(const ibv_sge& sge, ibv_wr_opcode op, std::uint32_t imm,
                          std::uint64_t raddr, std::uint64_t rkey, Posted what) {
  const std::size_t k = chain_n_++;
  chain_sge_[k] = sge;
  ibv_send_wr& wr = chain_[k];
  wr = {};
  wr.wr_id = sq_next_;
  wr.sg_list = &chain_sge_[k];
  wr.num_sge = 1;
  wr.opcode = op;
  if (sge.length <= max_inline_) wr.send_flags |= IBV_SEND_INLINE;
  if (op == IBV_WR_RDMA_WRITE_WITH_IMM) {
    wr.imm_data = htonl(imm);
    wr.wr.rdma.remote_addr = raddr;
    wr.wr.rdma.rkey = static_cast<std::uint32_t>(rkey);
  }
  sq_[sq_next_ % sq_.size()] = std::move(what);
  ++sq_next_;
}

bool VerbsChannel::flush_chain() {
  if (chain_n_ == 0) return false;
  // Signal every kSignalEvery-th request and always the last, so every posted request is
  // retired by some completion and staging buffers come back.
  for (std::size_t k = 0; k < chain_n_; ++k) {
    chain_[k].next = k + 1 < chain_n_ ? &chain_[k + 1] : nullptr;
    if (++unsignalled_ >= kSignalEvery || k + 1 == chain_n_) {
      chain_[k].send_flags |= IBV_SEND_SIGNALED;
      unsignalled_ = 0;
    }
  }
  ibv_send_wr* bad = nullptr;
  const int rc = ibv_post_send(qp_, chain_.data(), &bad);
  chain_n_ = 0;
  if (rc != 0)
    fail("ibv_post_send to rank " + std::to_string(peer_) + " failed: " + errno_text(rc));
  return true;
}

void VerbsChannel::arm() {
  if (auto bad = ctx_->completions->arm(); !bad.empty()) fail(bad);
}

void VerbsChannel::retire(std::uint64_t id) {
  while (sq_head_ <= id && sq_head_ < sq_next_) {
    const Posted& p = sq_[sq_head_ % sq_.size()];
    (p.control ? free_ctrl_ : free_data_).push_back(p.buf);
    if (p.held != kNotHeld) {
      // The caller's memory is read no more.
      ctx_->sources.done();
      if (const auto sent = sent_after(p.held)) sent_.push_back(*sent);
    }
    ++sq_head_;
  }
}

bool VerbsChannel::poll_cq() {
  if (auto bad = ctx_->completions->take(member_, seen_, arrived_); !bad.empty()) fail(bad);
  if (arrived_.empty()) return false;
  {
    const ibv_wc* failed = nullptr;
    for (const ibv_wc& c : arrived_) {
      if (c.status != IBV_WC_SUCCESS) {
        // The first error is the cause; flushed requests behind it only follow from it.
        if (failed == nullptr ||
            (failed->status == IBV_WC_WR_FLUSH_ERR && c.status != IBV_WC_WR_FLUSH_ERR)) {
          failed = &c;
        }
        continue;
      }
      const auto recv_index = static_cast<std::uint32_t>(c.wr_id & ~kRecvId);
      if (c.opcode == IBV_WC_RECV_RDMA_WITH_IMM) {
        // Only recorded here: what the write left in its slot is read when its turn comes,
        // as the write may be one of a direct message's, which leave their slot untouched, and
        // that is known only once the message's first fragment has been read.
        written_[on_slot_written(ntohl(c.imm_data))] = c.byte_len;
        post_recv(recv_index);
      } else if (c.opcode == IBV_WC_RECV) {
        Prefix p;
        std::memcpy(&p, ctrl_recv(recv_index), kPrefix);
        if (c.byte_len < kPrefix) fail("protocol violation: a short control message");
        const bool control = on_control(p);
        post_recv(recv_index);
        if (!control) {
          fail("protocol violation: control message of kind " +
               std::to_string(static_cast<int>(p.kind)));
        }
      } else {
        retire(c.wr_id);
      }
    }
    if (failed != nullptr) {
      // A peer that said goodbye may have torn its queue pair down under our last writes.
      if (peer_bye_ || closed_) {
        peer_closed_ = peer_closed_ || peer_bye_;
        return true;
      }
      const bool recv = (failed->wr_id & kRecvId) != 0;
      fail(std::string(recv ? "a receive from" : "a write or send to") + " rank " +
           std::to_string(peer_) + " failed: " + ibv_wc_status_str(failed->status) +
           " (vendor error 0x" + hex(failed->vendor_err) + ")");
    }
  }
  return true;
}

void VerbsChannel::check_staged(const FrameHeader& h, const void* payload) const {
  refuse_staged_device_memory(h, ctx_->in_device_memory(payload, h.bytes));
}

std::optional<Window> VerbsChannel::open_registered(
    char* base, std::size_t bytes, std::size_t message_bytes, bool any_size,
    const rma::WindowRegistrations::Register& make) {
  // A device window takes messages of any size (try_send_direct).
  if (direct_min_ == 0 || (!any_size && message_bytes < direct_min_) || closed()) {
    return std::nullopt;
  }
  const auto o = ctx_->windows.open(base, bytes, make);
  if (!o) return std::nullopt;
  // ibverbs addresses registered memory by virtual address, whatever the registration's start.
  Window w;
  w.addr = reinterpret_cast<std::uint64_t>(base);
  w.key = o->key;
  w.local = reinterpret_cast<std::uint64_t>(base);
  w.bytes = bytes;
  return w;
}

std::optional<Window> VerbsChannel::open_window(char* base, std::size_t bytes,
                                                std::size_t message_bytes) {
  return open_registered(
      base, bytes, message_bytes, false,
      [&](char* b, std::size_t n) -> std::optional<rma::WindowRegistrations::Made> {
        ibv_mr* mr = ibv_reg_mr(ctx_->pd, b, n, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
        if (mr == nullptr) return std::nullopt;
        return rma::WindowRegistrations::Made{reinterpret_cast<std::uint64_t>(mr), mr->rkey};
      });
}

std::optional<Window> VerbsChannel::open_device_window(char* base, std::size_t bytes,
                                                       std::size_t message_bytes,
                                                       const DeviceMemory& memory) {
  if (ctx_->gpu_flusher() == nullptr) return std::nullopt;
  auto w = open_registered(
      base, bytes, message_bytes, true,
      [&](char* b, std::size_t n) -> std::optional<rma::WindowRegistrations::Made> {
        GpuRegistration g = register_gpu_memory(ctx_->pd, b, n, memory.dmabuf_fd,
                                                memory.offset + static_cast<std::size_t>(b - base));
        if (g.mr == nullptr) return std::nullopt;
        return rma::WindowRegistrations::Made{reinterpret_cast<std::uint64_t>(g.mr), g.mr->rkey};
      });
  if (w) ctx_->device_windows.push_back(*w);
  return w;
}

bool VerbsChannel::register_device_source(const char* base, std::size_t bytes,
                                          const DeviceMemory& memory) {
  if (base == nullptr || bytes == 0 || closed()) return false;
  return ctx_->add_device_source(base, bytes, memory);
}

pollfd VerbsChannel::wait_spec() const {
  if (closed()) return {-1, 0, 0};
  return {ctx_->completions->fd(), POLLIN, 0};
}

bool VerbsChannel::writes_visible() {
  if (!flush_window_) return true;
  if (!flush_ticket_) {
    // The window is this rank's own: the loopback queue pair reads it with its remote key.
    flush_ticket_ =
        ctx_->flusher->post(flush_window_->local, static_cast<std::uint32_t>(flush_window_->key));
    if (!flush_ticket_) return false;  // as many reads in flight as the flusher takes: later
  }
  if (auto bad = ctx_->flusher->poll()) fail(*bad);
  if (!ctx_->flusher->done(*flush_ticket_)) return false;
  flush_ticket_.reset();
  flush_window_.reset();
  return true;
}

bool VerbsChannel::post_fragment(std::uint32_t seq, std::size_t staged,
                                 const rma::Gather<std::uint32_t>* gather) {
  if (gather != nullptr) {
    throw Error(ErrorCode::kInternal, "verbs: a fragment to gather from two places on " +
                                          describe() + " (its queue pair takes one entry)");
  }
  const std::uint32_t b = free_data_.back();
  free_data_.pop_back();
  ibv_sge sge{};
  sge.addr = reinterpret_cast<std::uintptr_t>(data_staging(b));
  sge.length = static_cast<std::uint32_t>(staged);
  sge.lkey = send_mr_->lkey;
  add_wr(sge, IBV_WR_RDMA_WRITE_WITH_IMM, seq, rma::slot_address(remote_, seq), remote_.key,
         Posted::staged(b));
  return true;
}

bool VerbsChannel::post_write(std::uint32_t seq, const SendQueue::Piece& piece, std::uint32_t lkey,
                              std::uint64_t addr, std::uint64_t key) {
  const std::uint32_t b = free_data_.back();
  free_data_.pop_back();
  ibv_sge sge{};
  sge.addr = reinterpret_cast<std::uintptr_t>(piece.data);
  sge.length = static_cast<std::uint32_t>(piece.bytes);
  sge.lkey = lkey;
  add_wr(sge, IBV_WR_RDMA_WRITE_WITH_IMM, seq, addr, key, Posted::staged(b));
  return true;
}

bool VerbsChannel::post_control(const Prefix& p) {
  if (free_ctrl_.empty() || chain_n_ >= chain_.size()) return false;
  const std::uint32_t b = free_ctrl_.back();
  free_ctrl_.pop_back();
  std::memcpy(ctrl_staging(b), &p, kPrefix);
  ibv_sge sge{};
  sge.addr = reinterpret_cast<std::uintptr_t>(ctrl_staging(b));
  sge.length = kPrefix;
  sge.lkey = send_mr_->lkey;
  add_wr(sge, IBV_WR_SEND, 0, 0, 0, Posted::control_message(b));
  return true;
}

void check_options(const VerbsOptions& o, int rank) {
  rma::check_slot_options("verbs", o.slot_bytes, o.slots, rank);
}

struct RingRecord {
  static constexpr std::uint32_t kMagic = 0x64657672;  // "devr"
  std::uint32_t magic = kMagic;
  std::int32_t channels = 0;
  std::array<QpRecord, rma::kMaxChannels> to_next{};
  std::array<QpRecord, rma::kMaxChannels> from_prev{};
};

}  // namespace

bool built() { return true; }

namespace {

// Opens the device for `channels` queue pairs to each ring neighbour and one to each of
// `peers`, all completing on one queue.
std::shared_ptr<Context> open_shared(const VerbsOptions& options, int rank, int channels,
                                     std::size_t peers) {
  auto ctx = open_context(options, rank);
  const std::size_t qps = 2 * static_cast<std::size_t>(channels) + peers;
  // Each queue pair's send and receive queues, (slots + kControlSlots) deep each.
  const std::size_t per_qp = 2 * (static_cast<std::size_t>(options.slots) + kControlSlots);
  ctx->completions = std::make_unique<CompletionQueue>(ctx->ctx, qps * per_qp, rank);
  return ctx;
}

RingLinks ring_part(Bootstrap& bootstrap, const std::shared_ptr<Context>& ctx, int channels,
                    const VerbsOptions& options) {
  const int rank = bootstrap.rank();
  const int size = bootstrap.size();
  const int next = (rank + 1) % size;
  const int prev = (rank - 1 + size) % size;
  std::vector<std::unique_ptr<VerbsChannel>> to_next, from_prev;
  RingRecord mine;
  mine.channels = channels;
  for (int c = 0; c < channels; ++c) {
    to_next.push_back(std::make_unique<VerbsChannel>(ctx, rank, next, c, options));
    from_prev.push_back(std::make_unique<VerbsChannel>(ctx, rank, prev, c, options));
    mine.to_next[static_cast<std::size_t>(c)] = to_next.back()->record();
    mine.from_prev[static_cast<std::size_t>(c)] = from_prev.back()->record();
  }
  rma::check_setup_deadline("verbs", options.deadline, rank);
  std::vector<RingRecord> all(static_cast<std::size_t>(size));
  bootstrap.all_gather(&mine, sizeof(mine), all.data());
  for (int r = 0; r < size; ++r) {
    const RingRecord& rec = all[static_cast<std::size_t>(r)];
    if (rec.magic != RingRecord::kMagic || rec.channels != channels) {
      throw Error(ErrorCode::kMismatch,
                  "rank " + std::to_string(r) + " uses channels=" + std::to_string(rec.channels) +
                      " over verbs, rank " + std::to_string(rank) + " channels=" +
                      std::to_string(channels) + " (DEAR_TRANSPORT and DEAR_CHANNELS must agree)",
                  rank, r, "create");
    }
  }
  for (int c = 0; c < channels; ++c) {
    const auto k = static_cast<std::size_t>(c);
    to_next[k]->connect(all[static_cast<std::size_t>(next)].from_prev[k], options);
    from_prev[k]->connect(all[static_cast<std::size_t>(prev)].to_next[k], options);
  }
  // No rank writes before every queue pair it writes to is ready to receive.
  bootstrap.barrier();
  return rma::ring_links(to_next, from_prev);
}

std::vector<std::unique_ptr<Channel>> peers_part(Bootstrap& bootstrap,
                                                 const std::shared_ptr<Context>& ctx,
                                                 const std::vector<int>& peers,
                                                 const VerbsOptions& options) {
  const int rank = bootstrap.rank();
  std::vector<std::unique_ptr<VerbsChannel>> chans;
  std::vector<std::vector<char>> mine;
  for (std::size_t i = 0; i < peers.size(); ++i) {
    chans.push_back(
        std::make_unique<VerbsChannel>(ctx, rank, peers[i], static_cast<int>(i), options));
    const QpRecord r = chans.back()->record();
    const char* raw = reinterpret_cast<const char*>(&r);
    mine.emplace_back(raw, raw + sizeof(r));
  }
  rma::check_setup_deadline("verbs", options.deadline, rank);
  const auto theirs =
      exchange_with_peers(bootstrap, peers, mine, sizeof(QpRecord), "verbs connect_peers");
  for (std::size_t i = 0; i < peers.size(); ++i) {
    QpRecord r;
    std::memcpy(&r, theirs[i].data(), sizeof(r));
    chans[i]->connect(r, options);
  }
  bootstrap.barrier();
  std::vector<std::unique_ptr<Channel>> out;
  for (auto& ch : chans) out.push_back(std::move(ch));
  return out;
}

}  // namespace

RingLinks connect_ring(Bootstrap& bootstrap, int channels, const VerbsOptions& options) {
  const int rank = bootstrap.rank();
  rma::check_channel_count("verbs", channels, rank);
  check_options(options, rank);
  return ring_part(bootstrap, open_shared(options, rank, channels, 0), channels, options);
}

std::vector<std::unique_ptr<Channel>> connect_peers(Bootstrap& bootstrap,
                                                    const std::vector<int>& peers,
                                                    const VerbsOptions& options) {
  const int rank = bootstrap.rank();
  check_peer_list(peers, rank, bootstrap.size(), "verbs connect_peers");
  check_options(options, rank);
  return peers_part(bootstrap, open_shared(options, rank, 0, peers.size()), peers, options);
}

Connected connect(Bootstrap& bootstrap, int channels, const std::vector<int>& peers,
                  const VerbsOptions& options) {
  const int rank = bootstrap.rank();
  rma::check_channel_count("verbs", channels, rank);
  check_peer_list(peers, rank, bootstrap.size(), "verbs connect");
  check_options(options, rank);
  const auto ctx = open_shared(options, rank, channels, peers.size());
  Connected out;
  out.ring = ring_part(bootstrap, ctx, channels, options);
  out.mesh = peers_part(bootstrap, ctx, peers, options);
  return out;
}

}  // namespace dear::transport::verbs
