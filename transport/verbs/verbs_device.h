// The ibverbs side that the channels of one connect call share (verbs_link.cc): the device
// and port opened (Context), its protection domain's registrations (windows for direct writes,
// the callers' memory they are written from, GPU memory), the GPU flush, and the queue pair
// calls both the channels and the flush make. Compiled, not run on RDMA hardware: see
// verbs_link.h.
//
// Used by the engine's thread only.
#pragma once

#include <infiniband/verbs.h>

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "dear/error.h"
#include "transport/link.h"
#include "transport/rma/reg_cache.h"
#include "transport/rma/window_registrations.h"
#include "transport/verbs/qp_plan.h"
#include "transport/verbs/verbs_link.h"

namespace dear::transport::verbs {

// Registrations of windows for direct writes kept for reuse per protection domain (least
// recently used beyond).
constexpr std::size_t kWindowCacheEntries = 64;

[[nodiscard]] std::string errno_text(int e);
[[nodiscard]] std::string hex(std::uint32_t v);
[[noreturn]] void throw_sys(const std::string& call, int err, int rank, int peer = Error::kNone);

struct FreeDeleter {
  void operator()(char* p) const { std::free(p); }
};

// A random 24-bit packet sequence number to start a queue pair at.
[[nodiscard]] std::uint32_t random_psn();

// Moves `qp` (in INIT) to RTR and RTS as `p` says; `towards` names the other end in errors.
void bring_up(ibv_qp* qp, const ConnectionPlan& p, const std::string& towards, int self, int peer);
// An RC queue pair on `pd` whose queues both complete on `cq`, one scatter/gather entry per
// request, asking for `inline_bytes` of inline data and settling for none where the device
// offers none; nullptr (errno set) when it cannot be made. What inline data it got is in
// *inline_granted.
[[nodiscard]] ibv_qp* create_rc_qp(ibv_pd* pd, ibv_cq* cq, std::uint32_t send_wr,
                                   std::uint32_t recv_wr, std::uint32_t inline_bytes,
                                   std::uint32_t* inline_granted);
// Moves a new queue pair to INIT on `port`, open to the other end's writes and reads.
void to_init(ibv_qp* qp, std::uint8_t port, int self, int peer);

// The GPU flush (GPUDirect RDMA): before a consumer of device memory is told that the
// adapter's writes into it arrived, one byte of that memory is read back with RDMA READ
// through a queue pair connected to itself. The adapter completes the read only after the
// writes before it reached the memory (PCIe ordering), so its completion is the signal. One
// per opened device and port, made with the first device window; every read is signalled and
// numbered (its ticket), and RC completes them in order.
class Flusher {
 public:
  Flusher(ibv_context* ctx, ibv_pd* pd, std::uint8_t port, const QpEndpoint& self_end,
          const VerbsOptions& o, int rank)
      : rank_(rank) {
    const auto sys = [&](const std::string& call) {
      throw_sys(call + " (GPU flush)", errno, rank);
    };
    cq_ = ibv_create_cq(ctx, static_cast<int>(kDepth), nullptr, nullptr, 0);
    if (cq_ == nullptr) sys("ibv_create_cq");
    std::uint32_t no_inline = 0;
    qp_ = create_rc_qp(pd, cq_, kDepth, 1, 0, &no_inline);
    if (qp_ == nullptr) sys("ibv_create_qp");
    byte_.reset(static_cast<char*>(std::aligned_alloc(64, 64)));
    if (!byte_) throw Error(ErrorCode::kSystem, "out of memory for the GPU flush", rank);
    mr_ = ibv_reg_mr(pd, byte_.get(), 64, IBV_ACCESS_LOCAL_WRITE);
    if (mr_ == nullptr) sys("ibv_reg_mr");
    to_init(qp_, port, rank, rank);
    QpEndpoint end = self_end;
    end.qpn = qp_->qp_num;
    end.psn = random_psn();
    bring_up(qp_, plan_connection(end, end, port, o, rank, rank), "itself (GPU flush)", rank, rank);
  }
  ~Flusher() {
    if (qp_ != nullptr) ibv_destroy_qp(qp_);
    if (mr_ != nullptr) ibv_dereg_mr(mr_);
    if (cq_ != nullptr) ibv_destroy_cq(cq_);
  }
  Flusher(const Flusher&) = delete;
  Flusher& operator=(const Flusher&) = delete;

  // Reads one byte at `addr` of the registration with remote key `rkey`: its ticket, or
  // nullopt while kDepth reads are in flight.
  std::optional<std::uint64_t> post(std::uint64_t addr, std::uint32_t rkey) {
    if (posted_ - done_ >= kDepth) return std::nullopt;
    ibv_sge sge{};
    sge.addr = reinterpret_cast<std::uintptr_t>(byte_.get());
    sge.length = 1;
    sge.lkey = mr_->lkey;
    ibv_send_wr wr{};
    wr.wr_id = posted_ + 1;
    wr.sg_list = &sge;
    wr.num_sge = 1;
    wr.opcode = IBV_WR_RDMA_READ;
    wr.send_flags = IBV_SEND_SIGNALED;
    wr.wr.rdma.remote_addr = addr;
    wr.wr.rdma.rkey = rkey;
    ibv_send_wr* bad = nullptr;
    const int rc = ibv_post_send(qp_, &wr, &bad);
    if (rc != 0) {
      throw Error(ErrorCode::kSystem, "ibv_post_send (GPU flush) failed: " + errno_text(rc), rank_);
    }
    return ++posted_;
  }
  // Takes the completions there are: what went wrong, or nullopt.
  std::optional<std::string> poll() {
    std::array<ibv_wc, 16> wc{};
    const int n = ibv_poll_cq(cq_, static_cast<int>(wc.size()), wc.data());
    if (n < 0) return std::string("ibv_poll_cq (GPU flush) failed");
    for (int i = 0; i < n; ++i) {
      const ibv_wc& c = wc[static_cast<std::size_t>(i)];
      if (c.status != IBV_WC_SUCCESS) {
        return std::string("the GPU flush (RDMA READ on the loopback queue pair) failed: ") +
               ibv_wc_status_str(c.status) + " (vendor error 0x" + hex(c.vendor_err) + ")";
      }
      done_ = std::max<std::uint64_t>(done_, c.wr_id);
    }
    return std::nullopt;
  }
  [[nodiscard]] bool done(std::uint64_t ticket) const { return done_ >= ticket; }

 private:
  static constexpr std::uint32_t kDepth = 64;
  int rank_;
  ibv_cq* cq_ = nullptr;
  ibv_qp* qp_ = nullptr;
  ibv_mr* mr_ = nullptr;
  std::unique_ptr<char, FreeDeleter> byte_;
  std::uint64_t posted_ = 0;
  std::uint64_t done_ = 0;
};

// The completion queue (and its completion channel, the engine's wait descriptor) that every
// queue pair of one connect call completes on, as NCCL's and Open MPI's IB transports keep one
// per device: an engine turn polls it once, whichever channel it progresses first, and each
// completion goes to the channel of its queue pair (ibv_wc::qp_num; a peer's write with
// immediate consumes a receive of the queue pair it arrived on). Completions of a queue pair
// no longer here are dropped. Used by one thread at a time, as its channels are.
class CompletionQueue {
 public:
  // Room for `entries` completions; throws dear::Error(kSystem) naming the failed call.
  CompletionQueue(ibv_context* ctx, std::size_t entries, int rank);
  ~CompletionQueue();
  CompletionQueue(const CompletionQueue&) = delete;
  CompletionQueue& operator=(const CompletionQueue&) = delete;

  [[nodiscard]] ibv_cq* cq() const { return cq_; }
  [[nodiscard]] int fd() const { return cc_->fd; }
  // The queue pair `qpn` completes here from now on; returns its member number.
  std::uint32_t join(std::uint32_t qpn);
  // The member's queue pair is destroyed: what arrives for it is dropped.
  void leave(std::uint32_t m);
  // Takes the completion channel's events and asks for the next one (before polling, so that
  // nothing completing afterwards goes unsignalled). Empty, or what failed.
  [[nodiscard]] std::string arm();
  // Polls the queue unless another member polled it since `seen` (the polls counted when this
  // member last looked), then hands over what arrived for member `m` (into `out`, cleared
  // first). Empty, or what failed.
  [[nodiscard]] std::string take(std::uint32_t m, std::uint64_t& seen, std::vector<ibv_wc>& out);

 private:
  struct Member {
    std::uint32_t qpn = 0;
    bool live = true;
    std::vector<ibv_wc> inbox;
  };
  [[nodiscard]] std::string poll();

  int rank_;
  ibv_comp_channel* cc_ = nullptr;
  ibv_cq* cq_ = nullptr;
  bool armed_ = false;
  std::uint64_t polls_ = 0;
  std::vector<Member> members_;
};

// One opened device and port, shared by the channels of one connect call.
struct Context {
  ibv_context* ctx = nullptr;
  ibv_pd* pd = nullptr;
  int rank = -1;
  VerbsOptions options;  // what the connect call asked for (the GPU flush's queue pair uses it)
  std::string device;
  std::uint8_t port = 1;
  LinkLayer link = LinkLayer::kInfiniBand;
  std::uint16_t lid = 0;
  std::uint32_t mtu = 0;
  std::uint32_t max_msg = 0;  // the port's largest message
  int gid_index = 0;
  Gid gid{};

  // Windows opened for the peers' direct writes (Channel::open_window), their registrations
  // kept for reuse: an operation on a buffer used before (a training step's gradients) finds
  // it registered instead of pinning it again.
  rma::WindowRegistrations windows{
      kWindowCacheEntries, [](std::uint64_t h) { ibv_dereg_mr(reinterpret_cast<ibv_mr*>(h)); }};

  // The callers' memory that direct messages are written from, registered once per range and
  // looked up after, each registration kept until no direct write of these channels may read
  // it (rma/reg_cache.h); once a registration failed, direct messages go through slots.
  rma::SendRegistrations sources{
      [](std::uint64_t h) { ibv_dereg_mr(reinterpret_cast<ibv_mr*>(h)); }};

  // GPUDirect RDMA (compiled, not run): device memory registered as a source of direct
  // messages, never evicted (a message from it cannot fall back to staging); the device
  // windows open now (one entry per open_device_window call), which tell a receiver that a
  // direct message needs the GPU flush; the flush itself, made with the first device window.
  rma::DeviceSources device_sources;  // handles: ibv_mr*
  std::vector<Window> device_windows;
  std::unique_ptr<Flusher> flusher;
  bool flusher_failed = false;  // once failed, device windows are refused
  // Where the channels' queue pairs complete; made by the connect call (open_shared in
  // verbs_link.cc) before any channel, sized for them all.
  std::unique_ptr<CompletionQueue> completions;

  Context() = default;
  Context(const Context&) = delete;
  Context& operator=(const Context&) = delete;
  ~Context() {
    completions.reset();  // every queue pair completing on it is gone by now
    flusher.reset();
    windows.clear();
    sources.clear();
    for (const std::uint64_t h : device_sources.take_all()) {
      ibv_dereg_mr(reinterpret_cast<ibv_mr*>(h));
    }
    if (pd != nullptr) ibv_dealloc_pd(pd);
    if (ctx != nullptr) ibv_close_device(ctx);
  }

  // The local key for writing from [p, p + n), registering the range when it is not yet;
  // nullopt when it cannot be registered.
  std::optional<std::uint32_t> source_key(const char* p, std::size_t n) {
    if (const auto d = device_sources.find(p, n)) return reinterpret_cast<ibv_mr*>(*d)->lkey;
    const auto h =
        sources.find(p, n, [&](const void* b, std::size_t len) -> std::optional<std::uint64_t> {
          // Read by the local adapter only; the page span may reach read-only pages.
          ibv_mr* mr = ibv_reg_mr(pd, const_cast<void*>(b), len, 0);
          if (mr == nullptr) return std::nullopt;
          return reinterpret_cast<std::uint64_t>(mr);
        });
    if (!h) return std::nullopt;
    return reinterpret_cast<ibv_mr*>(*h)->lkey;
  }
  // Communicator::forget_memory: registrations overlapping [p, p + n) leave both caches.
  void forget(const void* p, std::size_t n) {
    if (n == 0) return;
    sources.forget(p, n);
    device_sources.forget(p, n, sources);
    windows.forget(p, n);
  }
  // True when [p, p + n) overlaps registered device memory (which the CPU cannot read).
  bool in_device_memory(const void* p, std::size_t n) const {
    return device_sources.overlaps(p, n);
  }
  bool add_device_source(const char* p, std::size_t n, const DeviceMemory& m) {
    if (device_sources.find(p, n)) return true;
    // Registered for reading only by this adapter; ibv_reg_* take a non-const address.
    GpuRegistration g = register_gpu_memory(pd, const_cast<char*>(p), n, m.dmabuf_fd, m.offset);
    if (g.mr == nullptr) return false;
    device_sources.add(p, n, reinterpret_cast<std::uint64_t>(g.mr));
    return true;
  }
  // The open device window holding the local address `at`, if any.
  std::optional<Window> device_window_at(std::uint64_t at) const {
    for (const Window& w : device_windows) {
      if (at >= w.local && at - w.local < w.bytes) return w;
    }
    return std::nullopt;
  }
  void close_window(const Window& w) {
    const auto it =
        std::find_if(device_windows.begin(), device_windows.end(), [&](const Window& d) {
          return d.key == w.key && d.local == w.local && d.bytes == w.bytes;
        });
    if (it != device_windows.end()) device_windows.erase(it);
    windows.close(w.key);
  }
  // A queue pair `qpn` of this port, sending from `psn`, as plan_connection() sees it.
  QpEndpoint endpoint(std::uint32_t qpn, std::uint32_t psn) const {
    QpEndpoint e;
    e.link_layer = link;
    e.lid = lid;
    e.mtu = mtu;
    e.qpn = qpn;
    e.psn = psn;
    e.gid = gid;
    e.gid_index = gid_index;
    return e;
  }
  // The GPU flush, made on first use; nullptr when it cannot be made (device windows are then
  // refused, and the caller stages through host memory).
  Flusher* gpu_flusher() {
    if (flusher || flusher_failed) return flusher.get();
    try {
      flusher = std::make_unique<Flusher>(ctx, pd, port, endpoint(0, 0), options, rank);
    } catch (const Error&) {
      flusher_failed = true;
    }
    return flusher.get();
  }
};

// Names of this host's RDMA devices.
[[nodiscard]] std::vector<std::string> device_names();
// "'a', 'b'", or "none".
[[nodiscard]] std::string join(const std::vector<std::string>& v);
// Opens the device and port `o` asks for (or the first with an active port) and chooses the
// GID. Throws dear::Error(kInvalidArgument) when there is none, naming what there is.
[[nodiscard]] std::shared_ptr<Context> open_context(const VerbsOptions& o, int rank);

}  // namespace dear::transport::verbs
