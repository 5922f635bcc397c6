// The libfabric side that the channels of one connect call share (fabric_link.cc): the
// provider and data path chosen, the fabric, domain and address vector opened for it, the
// domain's registrations (windows for direct writes, callers' memory for in-place sends), and
// the endpoints of destroyed channels, kept until their peer has closed too.
//
// Used by the engine's thread only, except the Graveyard (any thread: channels retire wherever
// they are destroyed).
#pragma once

#include <poll.h>
#include <rdma/fabric.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_errno.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include "dear/error.h"
#include "transport/fabric/fabric_link.h"
#include "transport/fabric/fi_handles.h"
#include "transport/rma/fragments.h"
#include "transport/rma/reg_cache.h"
#include "transport/rma/slot_region.h"
#include "transport/rma/window_registrations.h"
#include "transport/socket_util.h"

namespace dear::transport::fabric {

[[noreturn]] void throw_fi(const std::string& call, int rc, int rank, int peer = Error::kNone);
// Providers that only reach ranks of this host, skipped by the default choice.
[[nodiscard]] bool single_host(const std::string& prov);
// What libfabric offers for `provider` ("" = any) as RDM endpoints (with `writes`: RMA writes
// with remote CQ data); null, with *rc_out (when given) its error, when nothing.
// `hmem`: also CUDA device memory (FI_HMEM).
[[nodiscard]] InfoPtr query(const std::string& provider, int* rc_out, bool writes = false,
                            bool hmem = false);
// "'a', 'b'", or "none".
[[nodiscard]] std::string join(const std::vector<std::string>& v);

// Registrations of windows for direct writes kept for reuse per domain (least recently used
// dropped first); a training step's buffers for one communicator are far fewer.
constexpr std::size_t kWindowCacheEntries = 64;
// The fabric and domain shared by the channels of one communicator (used by its engine's
// thread only).
struct Domain {
  InfoPtr info;
  FidPtr<fid_fabric> fabric;
  FidPtr<fid_domain> domain;
  // One address vector for all channels (some providers, shm among them, expect
  // one per domain); each peer endpoint is inserted once (address_of).
  FidPtr<fid_av> av;
  std::map<std::string, fi_addr_t> addresses;
  std::string provider;
  // The data path (FabricOptions::data_path as resolved for this provider): RMA writes into
  // the peers' slots, or sends.
  bool write = false;
  // Requested registration keys, unique in this domain (providers without FI_MR_PROV_KEY).
  std::uint64_t next_key = 1;

  // Registers [p, p + n) for `access` (see register_region; `ep` is required where
  // registrations belong to endpoints). Returns the fi_* code, 0 on success.
  int register_memory(const void* p, std::size_t n, std::uint64_t access, fid_ep* ep,
                      fid_mr** out) {
    return register_region(domain.get(), info->domain_attr->mr_mode, p, n, access, next_key++, ep,
                           out);
  }

  // The address of the endpoint named [name, name + len), inserted into `av` the first time;
  // FI_ADDR_UNSPEC, with *rc the provider's answer, when it is refused.
  fi_addr_t address_of(const char* name, std::size_t len, int* rc) {
    std::string key(name, len);
    if (const auto it = addresses.find(key); it != addresses.end()) return it->second;
    fi_addr_t a = FI_ADDR_UNSPEC;
    const int n = fi_av_insert(av.get(), name, 1, &a, 0, nullptr);
    *rc = n < 0 ? n : 0;
    if (n != 1) return FI_ADDR_UNSPEC;
    addresses.emplace(std::move(key), a);
    return a;
  }

  // Windows opened for the peers' direct writes (Channel::open_window), their registrations
  // kept for reuse (rma/window_registrations.h): on providers that pin memory (verbs;ofi_rxm,
  // efa) that saves a registration per operation on a buffer used before.
  rma::WindowRegistrations windows{
      kWindowCacheEntries, [](std::uint64_t h) { fi_close(&reinterpret_cast<fid_mr*>(h)->fid); }};

  std::optional<Window> open_window(char* base, std::size_t bytes) {
    return open_registered(base, bytes, [&](char* b, std::size_t n, fid_mr** mr) {
      return register_memory(b, n, FI_REMOTE_WRITE, nullptr, mr);
    });
  }
  // A window on [base, base + bytes), its registration made by `make` (an fi_* code back)
  // unless a cached one holds the range.
  template <class Make>
  std::optional<Window> open_registered(char* base, std::size_t bytes, Make&& make) {
    // A registration shared by the domain's endpoints: not where registrations belong to one.
    if (!write || (info->domain_attr->mr_mode & FI_MR_ENDPOINT) != 0) return std::nullopt;
    const auto o = windows.open(
        base, bytes, [&](char* b, std::size_t n) -> std::optional<rma::WindowRegistrations::Made> {
          fid_mr* mr = nullptr;
          if (make(b, n, &mr) != 0) return std::nullopt;
          const std::uint64_t key = fi_mr_key(mr);
          if (key == FI_KEY_NOTAVAIL) {
            fi_close(&mr->fid);
            return std::nullopt;
          }
          return rma::WindowRegistrations::Made{reinterpret_cast<std::uint64_t>(mr), key};
        });
    if (!o) return std::nullopt;
    Window w;
    w.addr = rma::region_base(reinterpret_cast<const void*>(o->begin),
                              reinterpret_cast<std::uintptr_t>(base) - o->begin,
                              (info->domain_attr->mr_mode & FI_MR_VIRT_ADDR) != 0);
    w.key = o->key;
    w.local = reinterpret_cast<std::uint64_t>(base);
    w.bytes = bytes;
    return w;
  }
  void close_window(const Window& w) { windows.close(w.key); }

  // Device memory (Channel::open_device_window, register_device_source). CUDA memory needs a
  // domain opened with FI_HMEM (`hmem`, FabricOptions::hmem, where the provider offers it),
  // and is registered with its interface and device (fi_mr_regattr); host memory standing in
  // for device memory (DeviceMemory::cuda_device -1, the engine's tests) is registered as
  // host memory. Compiled, not run with CUDA memory (no GPU and no FI_HMEM provider where it
  // was written).
  bool hmem = false;
  bool takes_device_windows(int cuda_device) const {
    return write && (info->domain_attr->mr_mode & FI_MR_ENDPOINT) == 0 && (cuda_device < 0 || hmem);
  }
  int register_device(const void* p, std::size_t n, std::uint64_t access, const DeviceMemory& m,
                      fid_mr** out) {
    if (m.cuda_device < 0) return register_memory(p, n, access, nullptr, out);
    if (!hmem) return -FI_EOPNOTSUPP;
    return register_hmem(domain.get(), info->domain_attr->mr_mode, p, n, access, next_key++,
                         m.cuda_device, out);
  }
  std::optional<Window> open_device_window(char* base, std::size_t bytes, const DeviceMemory& m) {
    return open_registered(base, bytes, [&](char* b, std::size_t n, fid_mr** mr) {
      return register_device(b, n, FI_REMOTE_WRITE, m, mr);
    });
  }
  // Registered device memory that direct messages are written from, kept until forgotten (a
  // message from it cannot fall back to a copy through staging, which the CPU would read).
  rma::DeviceSources device_sources;  // handles: fid_mr*
  bool add_device_source(const char* p, std::size_t n, const DeviceMemory& m) {
    if (device_sources.find(p, n)) return true;
    if (!write || (info->domain_attr->mr_mode & FI_MR_ENDPOINT) != 0) return false;
    fid_mr* mr = nullptr;
    if (register_device(p, n, FI_WRITE, m, &mr) != 0) return false;
    device_sources.add(p, n, reinterpret_cast<std::uint64_t>(mr));
    return true;
  }
  // True when [p, p + n) overlaps registered device memory (which the CPU may not read).
  bool in_device_memory(const void* p, std::size_t n) const {
    return device_sources.overlaps(p, n);
  }

  // In-place sends (FabricOptions::in_place_bytes) on a provider that needs local
  // registrations: the callers' memory, registered once per range and looked up after, each
  // registration kept until no in-place send of this domain may read it
  // (rma/reg_cache.h).
  bool register_sends = false;
  rma::SendRegistrations sends{
      [](std::uint64_t h) { fi_close(&reinterpret_cast<fid_mr*>(h)->fid); }};

  // The descriptor for sending from [p, p + n), registering the range when it is not yet;
  // nullopt when it cannot be registered (the caller copies instead).
  std::optional<void*> descriptor(const char* p, std::size_t n) {
    if (const auto d = device_sources.find(p, n)) return fi_mr_desc(reinterpret_cast<fid_mr*>(*d));
    if (!register_sends) return nullptr;
    const auto h =
        sends.find(p, n, [&](const void* b, std::size_t len) -> std::optional<std::uint64_t> {
          fid_mr* mr = nullptr;
          // Shared by the domain's endpoints, so not possible where registrations belong to one
          // (FI_MR_ENDPOINT): those providers copy.
          if (register_memory(b, len, write ? FI_WRITE : FI_SEND, nullptr, &mr) != 0) {
            return std::nullopt;
          }
          return reinterpret_cast<std::uint64_t>(mr);
        });
    if (!h) return std::nullopt;
    return fi_mr_desc(reinterpret_cast<fid_mr*>(*h));
  }
  // Communicator::forget_memory: the registrations overlapping [p, p + n) leave the caches
  // (and are closed once nothing in flight may read them).
  void forget(const void* p, std::size_t n) {
    if (n == 0) return;
    sends.forget(p, n);
    device_sources.forget(p, n, sends);
    windows.forget(p, n);
  }

  ~Domain() {
    windows.clear();
    sends.clear();
    for (const std::uint64_t h : device_sources.take_all()) {
      fi_close(&reinterpret_cast<fid_mr*>(h)->fid);
    }
    av.reset();
    domain.reset();
    fabric.reset();
  }
};

struct FreeDeleter {
  void operator()(char* p) const { std::free(p); }
};

constexpr std::uint32_t kNotHeld = 0xffffffffU;

struct Buf {
  fi_context2 ctx;  // first: a completion's op_context points here
  char* data;
  std::uint32_t index;
  bool recv;
  std::uint32_t held = kNotHeld;  // an in-place send: its id in InPlaceSends
};
static_assert(std::is_standard_layout_v<Buf>, "completions map back to Buf by address");

// The buffer of `bufs` whose context `ctx` is, or null when it is none of them. Completions are
// checked this way rather than trusted: some providers hand back a context that is not one
// given to them (shm reports 0x1 for some writes of its peers).
inline Buf* own(std::vector<Buf>& bufs, void* ctx) {
  const auto at = reinterpret_cast<std::uintptr_t>(ctx);
  const auto first = reinterpret_cast<std::uintptr_t>(bufs.data());
  if (bufs.empty() || at < first || (at - first) % sizeof(Buf) != 0 ||
      (at - first) / sizeof(Buf) >= bufs.size()) {
    return nullptr;
  }
  return &bufs[(at - first) / sizeof(Buf)];
}

// A completion announcing a peer's write into this end's data slots, as opposed to the
// completion of one of this end's own operations (which sockets also flags with
// FI_REMOTE_CQ_DATA when the write carried data).
inline bool peer_write(std::uint64_t flags) {
  return (flags & FI_REMOTE_CQ_DATA) != 0 &&
         ((flags & FI_REMOTE_WRITE) != 0 || (flags & (FI_WRITE | FI_SEND)) == 0);
}

// A destroyed channel's endpoint and memory are kept (see Retired) until the peer has said
// goodbye too, or for this long.
constexpr auto kRetireFor = std::chrono::seconds(10);
// Without a wait descriptor (shm) an engine asleep with nothing in flight wakes on a timer to
// progress the provider. An engine with work in flight never sleeps on such a channel (it keeps
// polling, see Channel::polled()), so the timer need not be fast, and it runs only while the
// engine sleeps: armed, once, when the engine asks what to sleep on (wait_spec). A periodic
// 50 us timer while traffic flowed cost its interrupts on every period: an 8-byte all_reduce
// over shm (2 ranks) took 20-40 us instead of 2.
constexpr auto kTimerPeriod = std::chrono::milliseconds(2);

// What a destroyed channel leaves behind: its endpoint and memory, kept until its peer has
// closed too. Why: a peer may still send before it learns of the close (its engine may be busy
// closing its other channels), and with some providers (shm, ranks in one process) such a send
// writes into this endpoint's memory directly, so releasing it at once could crash the peer.
struct Retired {
  std::unique_ptr<char, FreeDeleter> memory;
  std::vector<Buf> bufs;  // the completions' contexts point into this storage
  FidPtr<fid_mr> slot_mr;
  FidPtr<fid_mr> mr;
  FidPtr<fid_ep> ep;  // last: closed first
  std::uint64_t tag = 0;
  bool peer_bye = false;
  // shm: kept, untouched, until exit. Its peers (other endpoints of this host, possibly in
  // this process) may still be progressing sends into this endpoint's memory after they saw
  // its goodbye; freeing it then crashed them inside the provider.
  bool keep = false;
  Clock::time_point until{};
};

// The endpoint and completion queue the channels of one communicator share (one per rank and
// provider, as Open MPI's BTLs and NCCL's net plugins keep one per device): an engine turn reads
// the queue once, and each completion goes to the channel it belongs to, found by its context
// (the channel's own buffers) or, for a peer's RMA write that carries no context of ours, by the
// member number the writer put in the high half of the remote CQ data. On the shared endpoint
// every message is tagged with the receiving channel's member number, and each channel's
// receives take only its own tag, so two channels to one peer (ring and mesh, or both ring
// directions on 2 ranks) never take each other's messages. Channels whose completions cannot
// be told apart that way (providers with 4 bytes of CQ data on the write data path) get a hub
// of their own; where RMA writes consume posted receives (FI_RX_CQ_DATA) or the provider has no
// tagged messages, channels share the queue but each keeps an endpoint of its own.
//
// Used by one thread at a time: the engine's, or the thread that destroys the communicator, or
// (once no channel is left) the Graveyard's.
class Hub {
 public:
  // `entries`: completions the queue must hold (every member's posts together). Opens the
  // shared endpoint where shares_endpoint(); `endpoint`: whether to (false: a hub of one).
  Hub(std::shared_ptr<Domain> dom, std::size_t entries, int rank, bool endpoint);
  Hub(const Hub&) = delete;
  Hub& operator=(const Hub&) = delete;

  // Adds a member whose operations carry contexts in `bufs` (kept in place until it leaves);
  // returns its number.
  std::uint32_t join(const std::vector<Buf>& bufs);
  // The member `m` is gone: what it left behind waits here for its peer's goodbye. False while
  // other members are still live.
  bool retire(std::uint32_t m, std::optional<Retired> left);

  // Reads the queue unless another member read it since `seen` (the reads counted when this
  // member last looked), so that each engine turn reads it about once; `seen` is updated.
  void read_for(std::uint64_t& seen) {
    if (seen == reads_) read();
    seen = reads_;
  }
  // Reads what the queue holds now (up to 64 batches) and routes it.
  void read();
  // What arrived for member `m` since it last took them (swapped into `out`, which is cleared
  // first), and an error completion for it, if one came.
  void take(std::uint32_t m, std::vector<fi_cq_data_entry>& out);
  [[nodiscard]] std::optional<fi_cq_err_entry> take_error(std::uint32_t m);
  // An error completion no member owns: its text (every member fails with it).
  [[nodiscard]] const std::string& stray() const { return stray_; }
  [[nodiscard]] std::string error_text(const fi_cq_err_entry& err) const;

  // Routes peer writes by the high half of their CQ data (see above); else by context.
  [[nodiscard]] bool routes_writes() const { return routes_writes_; }
  // Whether channels of this domain can share one hub at all.
  [[nodiscard]] static bool shareable(const Domain& dom);
  // Whether they can also share one endpoint (see above).
  [[nodiscard]] static bool shares_endpoint(const Domain& dom);
  // The shared endpoint; null where each member has its own.
  [[nodiscard]] fid_ep* endpoint() const { return ep_.get(); }

  [[nodiscard]] fid_cq* cq() const { return cq_.get(); }
  // Members not yet retired.
  [[nodiscard]] std::size_t live() const { return live_; }
  // What the engine sleeps on when no member has work in flight (see FabricChannel::wait_spec).
  [[nodiscard]] pollfd wait_spec() const;
  [[nodiscard]] int ready_fd() const { return ready_fd_.get(); }
  void tend_timer();

  // The Graveyard: true once every retired member is released (peer's goodbye, or timed out).
  bool reap(Clock::time_point now);

 private:
  struct Member {
    const Buf* first = nullptr;
    std::size_t count = 0;
    bool live = true;
    std::vector<fi_cq_data_entry> inbox;
    std::vector<fi_cq_err_entry> errors;
    std::optional<Retired> left;
  };
  // The member whose buffer `ctx` is, or -1.
  [[nodiscard]] int owner(const void* ctx) const;
  // The member a completion with these flags, CQ data and context belongs to, or -1.
  [[nodiscard]] int member_of(std::uint64_t flags, std::uint64_t data, const void* ctx) const;
  void route(const fi_cq_data_entry& e);
  void route_error(const fi_cq_err_entry& e);
  // A completion for a retired member: notes its peer's goodbye.
  static void note_retired(Member& m, const fi_cq_data_entry& e);

  std::shared_ptr<Domain> dom_;  // first: released last
  int rank_;
  FidPtr<fid_cq> cq_;  // before the members: closed after their endpoints
  int wait_fd_ = -1;   // the CQ's, owned by the provider; -1 when it has none
  Fd ready_fd_;        // always readable
  Fd timer_fd_;        // providers without a wait descriptor; one-shot, see kTimerPeriod
  // Armed and not yet drained, and when it expires (wait_spec() arms it).
  mutable bool timer_armed_ = false;
  mutable Clock::time_point timer_due_{};
  bool routes_writes_ = false;
  std::uint64_t reads_ = 0;
  std::size_t live_ = 0;
  std::deque<Member> members_;
  std::string stray_;
  // Last: closed before the members' memory, into which its posted receives point, is freed.
  FidPtr<fid_ep> ep_;
};

// Hubs whose channels are all destroyed but some of whose endpoints still wait for their
// peer's goodbye (see Retired). Entries are freed once their queue shows the peer's goodbye,
// or after kRetireFor, or at exit. Any thread.
class Graveyard {
 public:
  static Graveyard& get() {
    // Never destroyed: channels may retire during static destruction. What is left at exit is
    // released by an exit handler, which runs before libfabric's own finalisation.
    static auto* g = [] {
      auto* y = new Graveyard;
      std::atexit([] { get().release_all(); });
      return y;
    }();
    return *g;
  }
  void release_all() {
    std::lock_guard<std::mutex> lock(mu_);
    hubs_.clear();
  }
  void retire(std::shared_ptr<Hub> hub) {
    std::lock_guard<std::mutex> lock(mu_);
    reap_locked();
    if (!hub->reap(Clock::now())) hubs_.push_back(std::move(hub));
  }
  void reap() {
    std::lock_guard<std::mutex> lock(mu_);
    reap_locked();
  }

 private:
  void reap_locked() {
    const auto now = Clock::now();
    std::erase_if(hubs_, [&](const std::shared_ptr<Hub>& h) { return h->reap(now); });
  }
  std::mutex mu_;
  std::list<std::shared_ptr<Hub>> hubs_;
};

// The provider `provider` names ("" = the first that reaches other hosts) in `list`.
[[nodiscard]] const fi_info* choose(const fi_info* list, const std::string& provider);

// The write data path's description of `chosen`'s provider and domain: RMA writes with remote
// CQ data that holds a sequence number. Null, with `why` saying what is missing, when there is
// none. `hmem`: with CUDA device memory too (FI_HMEM).
[[nodiscard]] InfoPtr write_info(const fi_info* chosen, std::string* why, bool hmem = false);

// Chooses the provider (the one asked for, or the first that reaches other hosts) and opens
// its fabric, domain and an address vector for `endpoints` peers.
[[nodiscard]] std::shared_ptr<Domain> open_domain(const FabricOptions& options, int rank,
                                                  std::size_t endpoints);
// `options` with the slot size the domain's provider allows; throws kInvalidArgument where its
// messages cannot hold a fragment.
[[nodiscard]] FabricOptions fitted(const Domain& dom, const FabricOptions& options, int rank);

}  // namespace dear::transport::fabric
