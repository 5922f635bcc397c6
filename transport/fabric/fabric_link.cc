#include "transport/fabric/fabric_link.h"

#include <rdma/fabric.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_errno.h>
#include <rdma/fi_rma.h>
#include <rdma/fi_tagged.h>
#include <sys/eventfd.h>
#include <sys/timerfd.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "dear/error.h"
#include "transport/fabric/fabric_domain.h"
#include "transport/fabric/fi_handles.h"
#include "transport/peer_exchange.h"
#include "transport/rma/channel_core.h"
#include "transport/rma/fragments.h"
#include "transport/rma/slot_region.h"
#include "transport/rma/slot_window.h"
#include "transport/socket_util.h"

namespace dear::transport::fabric {
namespace {

using rma::kControlSlots;
using rma::Kind;
using rma::kPrefix;
using rma::Prefix;
using rma::SendQueue;

constexpr std::size_t kMaxName = 240;  // endpoint names: sockaddrs, shm paths
// The write data path's control buffers (a Prefix fits; data goes to the slots).
constexpr std::size_t kControlBytes = 64;
// Messages received written directly, by every channel of this process (for tests).
std::atomic<std::uint64_t> g_direct_received{0};

// An endpoint name that is a socket address (providers over TCP: tcp;ofi_rxm, sockets), as one;
// nullopt for any other format.
std::optional<SockAddr> socket_address(const fi_info* info, const char* name, std::size_t len) {
  const bool is_socket = info->addr_format == FI_SOCKADDR || info->addr_format == FI_SOCKADDR_IN ||
                         info->addr_format == FI_SOCKADDR_IN6;
  if (!is_socket || len < sizeof(sockaddr) || len > sizeof(sockaddr_storage)) return std::nullopt;
  SockAddr a;
  std::memcpy(&a.storage, name, len);
  a.len = static_cast<socklen_t>(len);
  if (a.family() != AF_INET && a.family() != AF_INET6) return std::nullopt;
  return a;
}

class FabricChannel final : public rma::RmaChannel<FabricChannel> {
 public:
  // `hub`: the completion queue shared with the communicator's other channels; null for one
  // of its own.
  FabricChannel(std::shared_ptr<Domain> dom, std::shared_ptr<Hub> hub, int self, int peer,
                int index, std::uint64_t tag, const FabricOptions& o);
  ~FabricChannel() override;
  FabricChannel(const FabricChannel&) = delete;
  FabricChannel& operator=(const FabricChannel&) = delete;

  // This endpoint's name, to be given to the peer.
  [[nodiscard]] std::vector<char> name() const;
  // Write data path: where the peer writes into this channel's data slots; zeros otherwise.
  [[nodiscard]] rma::SlotRegion region() const;
  // What the peer puts in the high half of its writes' CQ data: this channel's member number
  // in its hub where the hub routes writes by it, else 0.
  [[nodiscard]] std::uint32_t route() const { return hub_->routes_writes() ? member_ : 0; }
  // The tag of the messages for this channel on a shared endpoint: its member number.
  [[nodiscard]] std::uint32_t member() const { return member_; }
  // The peer's endpoint name, (write data path) data slots, route() and member().
  void set_peer(const char* name, std::size_t len, const rma::SlotRegion& region,
                std::uint32_t route, std::uint32_t member);

  std::optional<Window> open_window(char* base, std::size_t bytes,
                                    std::size_t message_bytes) override {
    if (direct_min_ == 0 || message_bytes < direct_min_) return std::nullopt;
    return dom_->open_window(base, bytes);
  }
  void close_window(const Window& window) override { dom_->close_window(window); }
  // Device memory (fabric_domain.h, Domain::register_device): messages of any size go direct
  // into such a window (try_send_direct). The link makes no GPU flush before a message is
  // announced: the engine's cuda executor flushes before a step reads it, where the device
  // needs and offers it (Executor::remote_writes_landed).
  bool takes_device_windows(int cuda_device) const override {
    return direct_min_ != 0 && !closed() && dom_->takes_device_windows(cuda_device);
  }
  std::optional<Window> open_device_window(char* base, std::size_t bytes, std::size_t,
                                           const DeviceMemory& memory) override {
    if (direct_min_ == 0 || closed()) return std::nullopt;
    return dom_->open_device_window(base, bytes, memory);
  }
  bool register_device_source(const char* base, std::size_t bytes,
                              const DeviceMemory& memory) override {
    if (base == nullptr || bytes == 0 || direct_min_ == 0 || closed()) return false;
    return dom_->add_device_source(base, bytes, memory);
  }
  pollfd wait_spec() const override;
  // The providers here progress only inside fi_cq_read() (manual progress), and their wait
  // descriptors do not signal everything that needs it (rxm's rendezvous steps).
  bool polled() const override { return true; }
  void forget_memory(const void* addr, std::size_t bytes) override { dom_->forget(addr, bytes); }
  // Callers' memory ranges the domain has registered for in-place sends so far.
  [[nodiscard]] std::uint64_t registrations_made() const { return dom_->sends.made(); }
  [[nodiscard]] std::uint64_t window_registrations_made() const { return dom_->windows.made(); }
  [[nodiscard]] std::size_t queue_members() const { return hub_->live(); }
  [[nodiscard]] const void* endpoint() const { return ep_; }
  void begin_close() override;
  std::string describe() const override;

 private:
  // What the channel core asks of its back-end (rma/channel_core.h).
  friend class rma::RmaChannel<FabricChannel>;
  using Source = void*;  // a registration's descriptor (null where the provider needs none)
  // The peer may release its endpoint once it has heard this end's goodbye (see Graveyard).
  static constexpr bool kAnswersBye = true;
  void check_staged(const FrameHeader& h, const void* payload) const {
    refuse_staged_device_memory(h, dom_->in_device_memory(payload, h.bytes));
  }
  bool opened() const { return ep_ != nullptr; }
  bool connected() const { return peer_addr_ != FI_ADDR_UNSPEC; }
  bool can_post() const { return !free_data_.empty(); }
  char* staging() { return bufs_[free_data_.back()].data; }
  std::optional<void*> source(const char* p, std::size_t n) { return dom_->descriptor(p, n); }
  // A fragment into the peer's slot for `seq` (write data path) or a send.
  bool post_fragment(std::uint32_t seq, std::size_t staged, const rma::Gather<void*>* gather);
  bool post_write(std::uint32_t seq, const SendQueue::Piece& piece, void* source,
                  std::uint64_t addr, std::uint64_t key);
  void hold_posted(std::uint32_t id) {
    bufs_[last_posted_].held = id;
    dom_->sends.hold();
  }
  bool post_control(const Prefix& p);
  void flush() {}
  const char* slot_base(std::uint32_t buffer) const {
    // Write path: the slot the fragment was written into; send path: the receive it landed in.
    return write_ ? slot_mem_ + static_cast<std::size_t>(buffer) * slot_bytes_ : bufs_[buffer].data;
  }
  std::optional<std::size_t> written(std::uint32_t) const { return std::nullopt; }
  void slot_consumed(std::uint32_t buffer) {
    if (!write_) post_recv(bufs_[buffer]);
  }
  void direct_started(const char*) { g_direct_received.fetch_add(1, std::memory_order_relaxed); }
  bool writes_visible() { return true; }
  void begin_progress(bool may_read) { first_poll_ = may_read; }
  bool poll(RecvSink& sink) {
    bool m = repost_pending();
    m |= poll_cq(sink);
    return m;
  }
  void end_progress() { hub_->tend_timer(); }
  void drain() {
    NullSink null_sink;
    hub_->read();
    poll_cq(null_sink);
  }
  bool in_flight() const { return in_flight_ > 0; }

  void check(const char* call, int rc) const {
    if (rc != 0) {
      throw Error(ErrorCode::kSystem,
                  std::string(call) + " failed: " + fi_text(rc) + " on " + describe(), self_, peer_,
                  "fabric setup");
    }
  }
  void* desc() const { return mr_ ? fi_mr_desc(mr_.get()) : nullptr; }
  void post_recv(Buf& b);
  bool repost_pending();
  // Handles what the hub has routed to this channel (reading the queue first when no other
  // channel did since this one last looked).
  bool poll_cq(RecvSink& sink);
  [[noreturn]] void fail_completion(const fi_cq_err_entry& err);
  void on_arrival(Buf& b, std::size_t len);
  void on_written(const fi_cq_data_entry& e);
  // A post of buffer `b` the provider answered `rc` to: true once taken, false when it said try
  // again; a failure is thrown naming `call`.
  bool posted(Buf& b, ssize_t rc, const char* call);
  // A message to the peer's channel, gathered from `iov` (tagged with the peer channel's number
  // on a shared endpoint). The provider's return code.
  ssize_t send_msg(const iovec* iov, void** descs, std::size_t count, void* ctx);
  // [p, p + n) to the peer's channel, injected (copied at once, no completion): true once
  // taken, false when the provider says try again; a failure is thrown.
  bool inject_msg(const void* p, std::size_t n);
  // An RMA write of `bytes` gathered from `iov` to the peer's [addr, addr + bytes) under `key`,
  // announced by `seq` as remote CQ data. The provider's return code.
  ssize_t write_msg(Buf& b, std::uint32_t seq, const iovec* iov, void** descs, std::size_t count,
                    std::uint64_t addr, std::size_t bytes, std::uint64_t key);
  bool is_control(const Buf& b) const { return b.index >= bufs_.size() - kControlSlots; }

  std::shared_ptr<Domain> dom_;  // first: outlives the endpoint resources below
  std::shared_ptr<Hub> hub_;     // the completion queue (before the endpoint: outlives it)
  bool write_;                   // the write data path (else send)
  std::uint64_t corrupt_key_;    // FabricOptions::corrupt_write_key
  std::uint32_t recv_bufs_;      // receive buffers kept posted
  std::size_t recv_bytes_;       // bytes of each
  std::size_t inject_max_;       // data fragments up to this size are injected (send path)

  fid_ep* ep_ = nullptr;   // the hub's (tagged_), or own_ep_
  FidPtr<fid_ep> own_ep_;  // where the hub has no endpoint to share
  bool tagged_ = false;    // a shared endpoint: messages tagged with the receiver's member()
  std::uint64_t peer_member_ = 0;  // the tag of the peer channel's messages
  FidPtr<fid_mr> mr_;              // local buffers, where the provider needs that (FI_MR_LOCAL)
  FidPtr<fid_mr> slot_mr_;         // write data path: the data slots, for the peer's writes
  char* slot_mem_ = nullptr;
  rma::SlotRegion remote_{};  // write data path: the peer's data slots
  fi_addr_t peer_addr_ = FI_ADDR_UNSPEC;
  std::uint32_t peer_route_ = 0;           // the high half of this end's writes' CQ data (route())
  std::uint32_t member_ = 0;               // in hub_
  std::uint64_t seen_ = 0;                 // the hub's reads when this channel last looked
  bool first_poll_ = false;                // the next poll is the first of a progress() call
  std::vector<fi_cq_data_entry> arrived_;  // poll_cq's scratch
  // Providers over TCP sockets (tcp;ofi_rxm, sockets): both endpoints' socket addresses, for
  // giving the provider's connection dear's congestion control once it exists (at the first
  // completion); empty once done, or for other providers.
  std::vector<SockAddr> socket_ends_;
  std::unique_ptr<char, FreeDeleter> memory_;
  // [0, recv_bufs_): receives; then `slots` data sends, then kControlSlots control sends.
  std::vector<Buf> bufs_;
  std::vector<std::uint32_t> free_data_;
  std::vector<std::uint32_t> free_ctrl_;
  std::vector<std::uint32_t> repost_;  // receive buffers the provider refused for now
  std::uint32_t in_flight_ = 0;        // sends handed to the provider, not yet completed
  std::uint32_t last_posted_ = 0;      // the buffer of the last data fragment or write posted
};

rma::ChannelCore::Params core_params(const Domain& dom, int self, int peer, int index,
                                     std::uint64_t tag, const FabricOptions& o) {
  rma::ChannelCore::Params p;
  p.self = self;
  p.peer = peer;
  p.index = index;
  p.tag = tag;
  p.slot_bytes = o.slot_bytes;
  p.slots = o.slots;
  p.direct_min = dom.write ? o.direct_bytes : 0;
  p.write_max = std::min<std::size_t>(dom.info->ep_attr->max_msg_size,
                                      std::max<std::size_t>(1, o.direct_write_bytes));
  p.in_place_min = o.in_place_bytes;
  p.iov_limit = dom.info->tx_attr->iov_limit;
  p.written = dom.write;
  return p;
}

FabricChannel::FabricChannel(std::shared_ptr<Domain> dom, std::shared_ptr<Hub> hub, int self,
                             int peer, int index, std::uint64_t tag, const FabricOptions& o)
    : RmaChannel(core_params(*dom, self, peer, index, tag, o)),
      dom_(std::move(dom)),
      hub_(std::move(hub)),
      write_(dom_->write),
      corrupt_key_(o.corrupt_write_key),
      recv_bufs_(o.slots + kControlSlots),
      recv_bytes_(write_ ? kControlBytes : o.slot_bytes),
      inject_max_(write_ ? 0 : dom_->info->tx_attr->inject_size) {
  const fi_info* info = dom_->info.get();
  const std::uint32_t pool = slots_ + kControlSlots;
  if (!hub_) hub_ = std::make_shared<Hub>(dom_, 4 * pool, self_, false);

  ep_ = hub_->endpoint();
  tagged_ = ep_ != nullptr;
  if (!tagged_) {
    fid_ep* ep = nullptr;
    check("fi_endpoint", fi_endpoint(dom_->domain.get(), dom_->info.get(), &ep, nullptr));
    own_ep_.reset(ep);
    ep_ = ep;
    check("fi_ep_bind(av)", fi_ep_bind(ep, &dom_->av->fid, 0));
    check("fi_ep_bind(cq)", fi_ep_bind(ep, &hub_->cq()->fid, FI_TRANSMIT | FI_RECV));
    check("fi_enable", fi_enable(ep));
  }

  // One allocation for every buffer. Send path: the receives (data slots and control
  // buffers), then the data and control send buffers, each a slot. Write path: the data slots
  // the peer writes into, the data send buffers (a slot each), then the small control
  // buffers: receives, then sends.
  const std::size_t slot_area = static_cast<std::size_t>(slots_) * slot_bytes_;
  const std::size_t small = (static_cast<std::size_t>(recv_bufs_) + kControlSlots) * kControlBytes;
  const std::size_t total =
      write_ ? 2 * slot_area + small : 2 * static_cast<std::size_t>(pool) * slot_bytes_;
  memory_.reset(static_cast<char*>(std::aligned_alloc(4096, (total + 4095) / 4096 * 4096)));
  if (!memory_) throw Error(ErrorCode::kSystem, "out of memory for fabric staging", self_);
  char* const local = write_ ? memory_.get() + slot_area : memory_.get();
  const std::size_t local_bytes = write_ ? slot_area + small : total;
  if (info->domain_attr->mr_mode & FI_MR_LOCAL) {
    fid_mr* mr = nullptr;
    check("fi_mr_reg",
          dom_->register_memory(local, local_bytes, FI_SEND | FI_RECV | (write_ ? FI_WRITE : 0),
                                ep_, &mr));
    mr_.reset(mr);
  }
  if (write_) {
    slot_mem_ = memory_.get();
    fid_mr* mr = nullptr;
    check("fi_mr_reg(data slots)",
          dom_->register_memory(slot_mem_, slot_area, FI_REMOTE_WRITE, ep_, &mr));
    slot_mr_.reset(mr);
  }
  bufs_.resize(static_cast<std::size_t>(recv_bufs_) + slots_ + kControlSlots);
  for (std::uint32_t i = 0; i < bufs_.size(); ++i) {
    Buf& b = bufs_[i];
    b.ctx = {};
    b.index = i;
    b.recv = i < recv_bufs_;
    if (!write_) {
      b.data = memory_.get() + static_cast<std::size_t>(i) * slot_bytes_;
    } else if (i >= recv_bufs_ && i < recv_bufs_ + slots_) {
      b.data = local + static_cast<std::size_t>(i - recv_bufs_) * slot_bytes_;
    } else {
      // receives [0, recv_bufs_), then control sends: consecutive small buffers
      const std::uint32_t k = i < recv_bufs_ ? i : i - slots_;
      b.data = local + slot_area + static_cast<std::size_t>(k) * kControlBytes;
    }
  }
  for (std::uint32_t i = 0; i < slots_; ++i) free_data_.push_back(recv_bufs_ + slots_ - 1 - i);
  for (std::uint32_t i = 0; i < kControlSlots; ++i) {
    free_ctrl_.push_back(static_cast<std::uint32_t>(bufs_.size()) - 1 - i);
  }
  member_ = hub_->join(bufs_);
  try {
    for (std::uint32_t i = 0; i < recv_bufs_; ++i) post_recv(bufs_[i]);
  } catch (...) {
    (void)hub_->retire(member_, std::nullopt);
    throw;
  }
}

FabricChannel::~FabricChannel() {
  close();
  Retired left;
  left.memory = std::move(memory_);
  left.bufs = std::move(bufs_);  // the completions' contexts point into this storage: kept
  left.slot_mr = std::move(slot_mr_);
  left.mr = std::move(mr_);
  left.ep = std::move(own_ep_);  // null on a shared endpoint: the hub closes that one
  left.tag = tag_;
  left.peer_bye = peer_bye_;
  left.keep = dom_->provider == "shm";
  left.until = Clock::now() + kRetireFor;
  // The last channel of the hub hands it to the Graveyard, which keeps what still waits for
  // a peer's goodbye.
  if (hub_->retire(member_, std::move(left))) Graveyard::get().retire(std::move(hub_));
}

std::vector<char> FabricChannel::name() const {
  std::vector<char> n(kMaxName);
  std::size_t len = n.size();
  const int rc = fi_getname(&ep_->fid, n.data(), &len);
  if (rc != 0) {
    throw Error(ErrorCode::kSystem,
                "fi_getname failed: " + fi_text(rc) + " (endpoint name of " + std::to_string(len) +
                    " bytes, at most " + std::to_string(kMaxName) + " supported)",
                self_, peer_, "fabric setup");
  }
  n.resize(len);
  return n;
}

rma::SlotRegion FabricChannel::region() const {
  rma::SlotRegion r;
  if (!write_) return r;
  const bool virtual_addresses = (dom_->info->domain_attr->mr_mode & FI_MR_VIRT_ADDR) != 0;
  r.base = rma::region_base(slot_mem_, 0, virtual_addresses);
  r.key = fi_mr_key(slot_mr_.get());
  r.slot_bytes = slot_bytes_;
  r.slots = slots_;
  return r;
}

void FabricChannel::set_peer(const char* name, std::size_t len, const rma::SlotRegion& region,
                             std::uint32_t route, std::uint32_t member) {
  peer_route_ = route;
  peer_member_ = member;
  if (write_) {
    if (auto bad = rma::check_region(region, slot_bytes_, slots_, self_, peer_)) {
      throw Error(ErrorCode::kMismatch, *bad + " on " + describe(), self_, peer_, "create");
    }
    remote_ = region;
    remote_.key ^= corrupt_key_;
  }
  const std::vector<char> mine = this->name();
  if (const auto own = socket_address(dom_->info.get(), mine.data(), mine.size())) {
    if (const auto other = socket_address(dom_->info.get(), name, len)) {
      // The listener now, before it accepts; the connection the endpoint makes itself once it
      // exists (see poll_cq).
      (void)adopt_congestion_control(*own, *other);
      socket_ends_ = {*own, *other};
    }
  }
  int rc = 0;
  peer_addr_ = dom_->address_of(name, len, &rc);
  if (peer_addr_ == FI_ADDR_UNSPEC) {
    throw Error(ErrorCode::kSystem,
                "fi_av_insert of rank " + std::to_string(peer_) + "'s endpoint failed: " +
                    (rc < 0 ? fi_text(rc) : std::string("address not accepted")),
                self_, peer_, "fabric setup");
  }
}

std::string FabricChannel::describe() const {
  return "fabric (" + dom_->provider + ", " +
         (write_ ? (dom_->hmem ? "write, FI_HMEM" : "write") : "send") + ") channel " +
         std::to_string(index_) + " between rank " + std::to_string(self_) + " and rank " +
         std::to_string(peer_);
}

void FabricChannel::post_recv(Buf& b) {
  const int rc = static_cast<int>(
      tagged_ ? fi_trecv(ep_, b.data, recv_bytes_, desc(), FI_ADDR_UNSPEC, member_, 0, &b.ctx)
              : fi_recv(ep_, b.data, recv_bytes_, desc(), FI_ADDR_UNSPEC, &b.ctx));
  if (rc == -FI_EAGAIN) {
    repost_.push_back(b.index);
    return;
  }
  if (rc != 0) fail("fi_recv failed: " + fi_text(rc));
}

bool FabricChannel::repost_pending() {
  if (repost_.empty()) return false;
  std::vector<std::uint32_t> again;
  again.swap(repost_);
  for (const std::uint32_t i : again) post_recv(bufs_[i]);
  return repost_.size() < again.size();
}

pollfd FabricChannel::wait_spec() const {
  if (closed()) return {-1, 0, 0};
  // Sends in the provider's hands may need this side's progress to leave
  // (manual progress).
  if (in_flight_ > 0 || !repost_.empty()) return {hub_->ready_fd(), POLLIN, 0};
  return hub_->wait_spec();
}

bool FabricChannel::poll_cq(RecvSink& sink) {
  // At most once per progress() call: a read progresses every endpoint on the queue, and
  // reading again in each of progress()'s rounds (and again for the sends flushed later in
  // the turn) made a 4-rank 8 B all_reduce over tcp;ofi_rxm a fifth slower than with a queue
  // per channel (docs/transports.md).
  if (first_poll_) hub_->read_for(seen_);
  first_poll_ = false;
  if (const auto err = hub_->take_error(member_)) fail_completion(*err);
  if (!hub_->stray().empty()) fail(hub_->stray());
  hub_->take(member_, arrived_);
  if (arrived_.empty()) return false;
  for (const fi_cq_data_entry& e : arrived_) {
    if (peer_write(e.flags)) {
      on_written(e);
      continue;
    }
    Buf* const b = own(bufs_, e.op_context);
    if (b == nullptr) {
      fail("a completion (flags " + std::to_string(e.flags) +
           ") whose context is none of this channel's buffers");
    } else if (b->recv) {
      on_arrival(*b, e.len);
    } else {
      --in_flight_;
      if (b->held != kNotHeld) {
        const std::uint32_t id = b->held;
        b->held = kNotHeld;
        dom_->sends.done();
        if (const auto sent = in_place_.completed(id)) sink.on_sent(index_, *sent);
      }
      if (is_control(*b)) {
        free_ctrl_.push_back(b->index);
      } else {
        free_data_.push_back(b->index);
      }
    }
  }
  if (!socket_ends_.empty()) {
    // The provider opens its connection on first use; a completion says it is there.
    (void)adopt_congestion_control(socket_ends_[0], socket_ends_[1]);
    socket_ends_.clear();
  }
  return true;
}

void FabricChannel::fail_completion(const fi_cq_err_entry& err) {
  // What failed: a write of the peer's arriving here carries no context of ours (or, where
  // such writes consume a receive, a receive's), so flags say it first.
  const Buf* b = peer_write(err.flags) ? nullptr : own(bufs_, err.op_context);
  std::string what;
  if (b != nullptr && !b->recv) {
    what = write_ && !is_control(*b) ? "an RMA write to rank " : "a send to rank ";
  } else if (b != nullptr) {
    what = "a receive from rank ";
  } else if (write_) {
    what = "an RMA write from rank ";
  } else {
    what = "an operation with rank ";
  }
  fail(what + std::to_string(peer_) + " failed: " + hub_->error_text(err));
}

void FabricChannel::on_written(const fi_cq_data_entry& e) {
  if (!write_) fail("protocol violation: an RMA write arrived on a channel of the send data path");
  // Where writes with CQ data consume a posted receive (FI_RX_CQ_DATA), it is posted again.
  if ((dom_->info->mode & FI_RX_CQ_DATA) != 0) {
    if (Buf* b = own(bufs_, e.op_context); b != nullptr && b->recv) post_recv(*b);
  }
  // Only recorded here: what the write left in its slot is read when its turn comes, as the
  // write may be one of a direct message's, which leave their slot untouched, and that is
  // known only once the message's first fragment has been read.
  (void)on_slot_written(static_cast<std::uint32_t>(e.data));
}

void FabricChannel::on_arrival(Buf& b, std::size_t len) {
  Prefix p;
  if (len < kPrefix) {
    post_recv(b);  // not one of ours
    return;
  }
  std::memcpy(&p, b.data, kPrefix);
  if (p.tag != tag_) {
    std::fprintf(stderr, "dear rank %d: dropped a fabric message of another job on %s\n", self_,
                 describe().c_str());
    post_recv(b);
    return;
  }
  if (p.bytes != len - kPrefix) {
    fail("protocol violation: a message of " + std::to_string(len) + " bytes says it holds " +
         std::to_string(p.bytes) + " after its prefix");
  }
  if (on_control(p)) {
    post_recv(b);
    return;
  }
  if (p.kind != Kind::kData) {
    fail("protocol violation: unknown message kind " + std::to_string(static_cast<int>(p.kind)));
  }
  if (write_) fail("protocol violation: a data fragment sent on the write data path");
  if (auto bad = rma::accept_fragment(recvw_, p.seq, b.index)) fail(*bad);
}

bool FabricChannel::post_fragment(std::uint32_t seq, std::size_t staged,
                                  const rma::Gather<void*>* gather) {
  Buf& b = bufs_[free_data_.back()];
  std::array<iovec, 2> iov{};
  std::array<void*, 2> descs{desc(), nullptr};
  iov[0] = {b.data, staged};
  std::size_t count = 1;
  std::size_t bytes = staged;
  if (gather != nullptr) {
    iov[1] = {const_cast<char*>(gather->data), gather->bytes};
    descs[1] = gather->source;
    count = 2;
    bytes += gather->bytes;
  }
  // A small fragment is injected: the provider copies it at once and reports no completion, so
  // its buffer stays free (RMA writes are not: a refused one would go unreported).
  if (count == 1 && staged <= inject_max_) return inject_msg(b.data, staged);
  const ssize_t rc = write_ ? write_msg(b, seq, iov.data(), descs.data(), count,
                                        rma::slot_address(remote_, seq), bytes, remote_.key)
                            : send_msg(iov.data(), descs.data(), count, &b.ctx);
  return posted(b, rc, write_ ? "fi_writemsg" : "fi_send");
}

ssize_t FabricChannel::send_msg(const iovec* iov, void** descs, std::size_t count, void* ctx) {
  if (tagged_) return fi_tsendv(ep_, iov, descs, count, peer_addr_, peer_member_, ctx);
  if (count == 1) return fi_send(ep_, iov[0].iov_base, iov[0].iov_len, descs[0], peer_addr_, ctx);
  return fi_sendv(ep_, iov, descs, count, peer_addr_, ctx);
}

bool FabricChannel::inject_msg(const void* p, std::size_t n) {
  const ssize_t rc =
      tagged_ ? fi_tinject(ep_, p, n, peer_addr_, peer_member_) : fi_inject(ep_, p, n, peer_addr_);
  if (rc == -FI_EAGAIN) return false;
  if (rc != 0) {
    fail("fi_inject to rank " + std::to_string(peer_) +
         " failed: " + fi_text(static_cast<int>(rc)));
  }
  return true;
}

bool FabricChannel::post_write(std::uint32_t seq, const SendQueue::Piece& piece, void* source,
                               std::uint64_t addr, std::uint64_t key) {
  Buf& b = bufs_[free_data_.back()];
  iovec iov{const_cast<char*>(piece.data), piece.bytes};
  void* descs[1] = {source};
  return posted(b, write_msg(b, seq, &iov, descs, 1, addr, piece.bytes, key), "fi_writemsg");
}

bool FabricChannel::posted(Buf& b, ssize_t rc, const char* call) {
  if (rc == -FI_EAGAIN) return false;
  if (rc != 0) {
    fail(std::string(call) + " to rank " + std::to_string(peer_) +
         " failed: " + fi_text(static_cast<int>(rc)));
  }
  free_data_.pop_back();
  ++in_flight_;
  last_posted_ = b.index;
  return true;
}

ssize_t FabricChannel::write_msg(Buf& b, std::uint32_t seq, const iovec* iov, void** descs,
                                 std::size_t count, std::uint64_t addr, std::size_t bytes,
                                 std::uint64_t key) {
  fi_rma_iov target{};
  target.addr = addr;
  target.len = bytes;
  target.key = key;
  fi_msg_rma msg{};
  msg.msg_iov = iov;
  msg.desc = descs;
  msg.iov_count = count;
  msg.addr = peer_addr_;
  msg.rma_iov = &target;
  msg.rma_iov_count = 1;
  msg.context = &b.ctx;
  msg.data = (static_cast<std::uint64_t>(peer_route_) << 32) | seq;
  return fi_writemsg(ep_, &msg, FI_REMOTE_CQ_DATA | FI_COMPLETION);
}

bool FabricChannel::post_control(const Prefix& p) {
  if (p.kind == Kind::kCredit && kPrefix <= dom_->info->tx_attr->inject_size) {
    // A credit return is injected: the provider copies it at once and reports no completion,
    // so it holds no control buffer and costs no completion to read. (A goodbye is sent
    // with one: close() waits until it has left.)
    return inject_msg(&p, kPrefix);
  }
  if (free_ctrl_.empty()) return false;
  Buf& b = bufs_[free_ctrl_.back()];
  std::memcpy(b.data, &p, kPrefix);
  const iovec iov{b.data, kPrefix};
  void* d = desc();
  const ssize_t rc = send_msg(&iov, &d, 1, &b.ctx);
  if (rc == -FI_EAGAIN) return false;
  if (rc != 0)
    fail("fi_send to rank " + std::to_string(peer_) + " failed: " + fi_text(static_cast<int>(rc)));
  free_ctrl_.pop_back();
  ++in_flight_;
  return true;
}

// What close() does first, without waiting: hands over what the peer's credits allow and,
// once nothing is queued, says goodbye. Over rxm a goodbye may be a channel's first message,
// which connects first; started on every channel before any close() waits, the connections
// are made side by side instead of one after another.
void FabricChannel::begin_close() {
  if (closed_ || !ep_ || peer_addr_ == FI_ADDR_UNSPEC || bye_sent_) return;
  NullSink null_sink;
  try {
    poll_cq(null_sink);
    pump(null_sink);
    if (sendq_.empty()) bye_sent_ = send_control(Kind::kBye, sendw_.next_seq(), 0);
  } catch (const Error&) {
    // close() closes it anyway.
  }
}

// What one end of a channel tells the other: its endpoint's name and, on the write data path,
// where its data slots are.
struct EndpointRecord {
  std::uint32_t len = 0;
  std::uint32_t route = 0;   // FabricChannel::route()
  std::uint32_t member = 0;  // FabricChannel::member()
  std::uint32_t reserved = 0;
  char bytes[kMaxName] = {};
  rma::SlotRegion region;

  EndpointRecord() = default;
  explicit EndpointRecord(const FabricChannel& ch) {
    const std::vector<char> n = ch.name();
    len = static_cast<std::uint32_t>(n.size());
    std::memcpy(bytes, n.data(), n.size());
    region = ch.region();
    route = ch.route();
    member = ch.member();
  }
};

// What each rank gives the ring: its choices (all must agree) and its channels' endpoints.
struct NameRecord {
  static constexpr std::uint32_t kMagic = 0x64656166;  // "deaf": dear fabric
  std::uint32_t magic = kMagic;
  std::int32_t channels = 0;
  std::uint64_t tag = 0;
  char provider[64] = {};
  std::uint32_t write = 0;  // the write data path
  std::uint32_t reserved = 0;
  using Name = EndpointRecord;
  std::array<Name, rma::kMaxChannels> to_next{};
  std::array<Name, rma::kMaxChannels> from_prev{};
};

}  // namespace

bool built() { return true; }

std::uint64_t direct_received_total() { return g_direct_received.load(); }

std::uint64_t registrations_made(const Channel& channel) {
  const auto* f = dynamic_cast<const FabricChannel*>(&channel);
  return f != nullptr ? f->registrations_made() : 0;
}

std::size_t queue_members(const Channel& channel) {
  const auto* f = dynamic_cast<const FabricChannel*>(&channel);
  return f != nullptr ? f->queue_members() : 0;
}

const void* endpoint_of(const Channel& channel) {
  const auto* f = dynamic_cast<const FabricChannel*>(&channel);
  return f != nullptr ? f->endpoint() : nullptr;
}

std::uint64_t window_registrations_made(const Channel& channel) {
  const auto* f = dynamic_cast<const FabricChannel*>(&channel);
  return f != nullptr ? f->window_registrations_made() : 0;
}

namespace {

void check_options(const FabricOptions& options, int rank) {
  rma::check_slot_options("fabric", options.slot_bytes, options.slots, rank);
}

std::string data_path_disagreement(int peer, bool peer_writes, int self, bool self_writes) {
  const auto name = [](bool w) { return w ? "'write'" : "'send'"; };
  return "rank " + std::to_string(peer) + " uses the fabric data path " + name(peer_writes) +
         ", rank " + std::to_string(self) + " " + name(self_writes) +
         " (DEAR_FABRIC_DATA_PATH must agree, and 'auto' needs the same libfabric on every host)";
}

// Channels stamp rank 0's tag on every message, so it is gathered before they are made.
std::uint64_t gather_tag(Bootstrap& bootstrap) {
  const std::uint64_t mine = random_u64();
  std::vector<std::uint64_t> tags(static_cast<std::size_t>(bootstrap.size()));
  bootstrap.all_gather(&mine, sizeof(mine), tags.data());
  return tags[0];
}

}  // namespace

namespace {

// What the channels of one connect share: the domain (and its address vector), and the
// completion queue where the provider lets channels share one (Hub::shareable; else null, and
// each channel opens its own).
struct Shared {
  std::shared_ptr<Domain> dom;
  std::shared_ptr<Hub> hub;
};

// `channels` endpoints to each ring neighbour with `ring` slots, and one to each of `peers`
// with `mesh` slots (the provider and data path are the ring's: both ask for the same).
Shared open_shared(int rank, int channels, const FabricOptions& ring, std::size_t peers,
                   const FabricOptions& mesh) {
  Shared sh;
  const std::size_t endpoints = 2 * static_cast<std::size_t>(channels) + peers;
  sh.dom = open_domain(ring, rank, endpoints);
  if (Hub::shareable(*sh.dom)) {
    // What every member may have posted at once: as many completions as its buffers, each
    // channel's queue having held 4 times that before they were shared.
    const std::size_t entries =
        4 * (2 * static_cast<std::size_t>(channels) * (ring.slots + kControlSlots) +
             peers * (mesh.slots + kControlSlots));
    sh.hub = std::make_shared<Hub>(sh.dom, entries, rank, true);
  }
  return sh;
}

RingLinks ring_part(Bootstrap& bootstrap, const Shared& sh, int channels,
                    const FabricOptions& options, const FabricOptions& o) {
  const int rank = bootstrap.rank();
  const int size = bootstrap.size();
  const auto& dom = sh.dom;
  const int next = (rank + 1) % size;
  const int prev = (rank - 1 + size) % size;
  NameRecord mine;
  mine.channels = channels;
  mine.write = dom->write ? 1 : 0;
  std::snprintf(mine.provider, sizeof(mine.provider), "%s", dom->provider.c_str());
  std::vector<NameRecord> all(static_cast<std::size_t>(size));
  // The endpoints exist (with receives posted) before any peer learns their
  // names.
  std::vector<std::unique_ptr<FabricChannel>> to_next, from_prev;
  const std::uint64_t tag = gather_tag(bootstrap);
  mine.tag = tag;
  for (int c = 0; c < channels; ++c) {
    to_next.push_back(std::make_unique<FabricChannel>(dom, sh.hub, rank, next, c, tag, o));
    from_prev.push_back(std::make_unique<FabricChannel>(dom, sh.hub, rank, prev, c, tag, o));
    mine.to_next[static_cast<std::size_t>(c)] = EndpointRecord(*to_next.back());
    mine.from_prev[static_cast<std::size_t>(c)] = EndpointRecord(*from_prev.back());
  }
  rma::check_setup_deadline("fabric", options.deadline, rank);
  bootstrap.all_gather(&mine, sizeof(mine), all.data());
  for (int r = 0; r < size; ++r) {
    const NameRecord& rec = all[static_cast<std::size_t>(r)];
    if (rec.magic != NameRecord::kMagic) {
      throw Error(ErrorCode::kMismatch,
                  "rank " + std::to_string(r) +
                      " sent no fabric endpoint names (does it use "
                      "transport 'fabric' too?)",
                  rank, r, "create");
    }
    if (rec.channels != channels || std::strncmp(rec.provider, mine.provider, 64) != 0) {
      throw Error(ErrorCode::kMismatch,
                  "rank " + std::to_string(r) + " uses provider '" +
                      std::string(rec.provider, strnlen(rec.provider, 64)) +
                      "' with channels=" + std::to_string(rec.channels) + ", rank " +
                      std::to_string(rank) + " uses provider '" + dom->provider +
                      "' with channels=" + std::to_string(channels) +
                      " (DEAR_FABRIC_PROVIDER and DEAR_CHANNELS must agree)",
                  rank, r, "create");
    }
    if (rec.write != mine.write) {
      throw Error(ErrorCode::kMismatch, data_path_disagreement(r, rec.write != 0, rank, dom->write),
                  rank, r, "create");
    }
  }
  for (int c = 0; c < channels; ++c) {
    const auto& n = all[static_cast<std::size_t>(next)].from_prev[static_cast<std::size_t>(c)];
    const auto& p = all[static_cast<std::size_t>(prev)].to_next[static_cast<std::size_t>(c)];
    to_next[static_cast<std::size_t>(c)]->set_peer(n.bytes, n.len, n.region, n.route, n.member);
    from_prev[static_cast<std::size_t>(c)]->set_peer(p.bytes, p.len, p.region, p.route, p.member);
  }
  return rma::ring_links(to_next, from_prev);
}

std::vector<std::unique_ptr<Channel>> peers_part(Bootstrap& bootstrap, const Shared& sh,
                                                 const std::vector<int>& peers,
                                                 const FabricOptions& options,
                                                 const FabricOptions& o) {
  const int rank = bootstrap.rank();
  const auto& dom = sh.dom;
  const std::uint64_t tag = gather_tag(bootstrap);

  // What each end tells the other: its provider (both must agree) and its endpoint's name.
  struct PeerName {
    char provider[64] = {};
    std::uint32_t write = 0;  // the write data path
    std::uint32_t reserved = 0;
    EndpointRecord name;
  };
  std::vector<std::unique_ptr<FabricChannel>> chans;
  std::vector<std::vector<char>> mine;
  for (std::size_t i = 0; i < peers.size(); ++i) {
    chans.push_back(
        std::make_unique<FabricChannel>(dom, sh.hub, rank, peers[i], static_cast<int>(i), tag, o));
    PeerName rec;
    std::snprintf(rec.provider, sizeof(rec.provider), "%s", dom->provider.c_str());
    rec.write = dom->write ? 1 : 0;
    rec.name = EndpointRecord(*chans.back());
    const char* raw = reinterpret_cast<const char*>(&rec);
    mine.emplace_back(raw, raw + sizeof(rec));
  }
  rma::check_setup_deadline("fabric", options.deadline, rank);
  const auto theirs =
      exchange_with_peers(bootstrap, peers, mine, sizeof(PeerName), "fabric connect_peers");
  std::vector<std::unique_ptr<Channel>> out;
  for (std::size_t i = 0; i < peers.size(); ++i) {
    PeerName rec;
    std::memcpy(&rec, theirs[i].data(), sizeof(rec));
    if (std::strncmp(rec.provider, dom->provider.c_str(), sizeof(rec.provider)) != 0) {
      throw Error(ErrorCode::kMismatch,
                  "rank " + std::to_string(peers[i]) + " uses provider '" +
                      std::string(rec.provider, strnlen(rec.provider, sizeof(rec.provider))) +
                      "', rank " + std::to_string(rank) + " uses provider '" + dom->provider +
                      "' (DEAR_FABRIC_PROVIDER must agree)",
                  rank, peers[i], "create");
    }
    if ((rec.write != 0) != dom->write) {
      throw Error(ErrorCode::kMismatch,
                  data_path_disagreement(peers[i], rec.write != 0, rank, dom->write), rank,
                  peers[i], "create");
    }
    if (rec.name.len > kMaxName) {
      throw Error(ErrorCode::kMismatch,
                  "rank " + std::to_string(peers[i]) + " sent a malformed endpoint name", rank,
                  peers[i], "create");
    }
    chans[i]->set_peer(rec.name.bytes, rec.name.len, rec.name.region, rec.name.route,
                       rec.name.member);
    out.push_back(std::move(chans[i]));
  }
  return out;
}

}  // namespace

RingLinks connect_ring(Bootstrap& bootstrap, int channels, const FabricOptions& options) {
  const int rank = bootstrap.rank();
  Graveyard::get().reap();
  rma::check_channel_count("fabric", channels, rank);
  check_options(options, rank);
  const Shared sh = open_shared(rank, channels, options, 0, options);
  return ring_part(bootstrap, sh, channels, options, fitted(*sh.dom, options, rank));
}

std::vector<std::unique_ptr<Channel>> connect_peers(Bootstrap& bootstrap,
                                                    const std::vector<int>& peers,
                                                    const FabricOptions& options) {
  const int rank = bootstrap.rank();
  Graveyard::get().reap();
  check_peer_list(peers, rank, bootstrap.size(), "fabric connect_peers");
  check_options(options, rank);
  const Shared sh = open_shared(rank, 0, options, peers.size(), options);
  return peers_part(bootstrap, sh, peers, options, fitted(*sh.dom, options, rank));
}

Connected connect(Bootstrap& bootstrap, int channels, const FabricOptions& ring,
                  const std::vector<int>& peers, const FabricOptions& mesh) {
  const int rank = bootstrap.rank();
  Graveyard::get().reap();
  rma::check_channel_count("fabric", channels, rank);
  check_peer_list(peers, rank, bootstrap.size(), "fabric connect");
  check_options(ring, rank);
  check_options(mesh, rank);
  const Shared sh = open_shared(rank, channels, ring, peers.size(), mesh);
  Connected out;
  out.ring = ring_part(bootstrap, sh, channels, ring, fitted(*sh.dom, ring, rank));
  out.mesh = peers_part(bootstrap, sh, peers, mesh, fitted(*sh.dom, mesh, rank));
  return out;
}

}  // namespace dear::transport::fabric
