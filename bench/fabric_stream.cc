// dear-fabric-stream: how fast a libfabric provider itself moves bytes between processes of this
// host, next to a plain TCP stream between the same processes, in one run.
//
//   dear-run -n N dear-fabric-stream [--provider 'tcp;ofi_rxm'] [-s 64M] [--window 4]
//                                    [--iters 20] [--warmup 3] [--chunk 1M] [--rounds 1]
//                                    [--op send|write] [--json FILE]
//
// No collective library on top: the provider's own rate for this traffic. Not a strict ceiling:
// on a ring of 4 ranks sharing 2 CPUs dear over rxm moved the same bytes faster
// (docs/transports.md).
//   - fabric: one reliable-datagram endpoint per rank (FI_MSG), sends from and receives into
//     buffers posted up front (registered where the provider asks for FI_MR_LOCAL), names
//     exchanged through the bootstrap and inserted into an address vector. Up to --window messages
//     are in flight; each message goes as chunks of min(--chunk, the provider's max_msg_size).
//     "uni": rank 0 sends, rank 1 receives. "bidi": every rank sends to the next one and receives
//     from the previous one at once, as every step of a ring does (on 2 ranks: both directions
//     of the pair); its figure is the sum over the ranks.
//     With --op write the chunks go as RMA writes with remote CQ data (what the fabric transport
//     does by default where offered) into the receiver's registered message slots; the receiver
//     counts the chunks of each message from its completion queue and, once a message is
//     checked, tells the sender with a small message (a credit) that its slot is free again.
//   - tcp: one connection over 127.0.0.1 (Nagle on, kernel buffer sizes), the same messages
//     with blocking send()/recv() of 1 MiB; "bidi" uses the connection full duplex,
//     a sending thread next to the receiving one (more than 2 ranks: a ring of connections,
//     one per direction, as dear-tcp-ring makes). Only the tail of each run is pushed out
//     at once (TCP_NODELAY set and cleared), so that no delayed acknowledgement is timed.
// With --rounds N both transports are measured N times, alternating which goes first, and the
// ratios are of the medians: on a shared machine a slow spell then hits both alike.
// Each receiver checks the first and last 8 bytes of every message against a stamp that names
// the message, so no figure can come out without the data having moved. Warm-up and timed
// messages form one stream; time is taken where the data arrives, from the arrival of the last
// warm-up message to that of the last timed one, so the stream is in full flow when the clock
// starts and no start-up skew between the ranks is timed (bidi: the slower receiver's time).
// GB = 1e9 bytes.
// Rank 0 prints one row per measurement and the provider/tcp ratio per direction. Both
// streams are open for the whole run; the provider busy-polls its completion queue (its
// progress is manual), the TCP calls block.
#include <rdma/fabric.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_errno.h>
#include <rdma/fi_rma.h>
#include <sched.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <array>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <fstream>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <type_traits>
#include <vector>

#include "common/env.h"
#include "common/stats.h"
#include "dear/bootstrap.h"
#include "dear/error.h"
#include "report.h"
#include "stream.h"
#include "transport/fabric/fabric_link.h"
#include "transport/fabric/fi_handles.h"
#include "transport/rma/slot_region.h"

namespace dear::bench {
namespace {

using Clock = std::chrono::steady_clock;

constexpr std::size_t kMaxName = 256;  // endpoint names: sockaddrs, shm paths
constexpr const char* kTool = "dear-fabric-stream";

using stream::allocate;
using stream::check_stamp;
using stream::clear_stamp;
using stream::kStallLimit;
using stream::kStamp;
using stream::max_over_ranks;
using stream::Memory;
using stream::stamp;
using stream::TcpStream;

struct Args {
  std::string provider = "tcp;ofi_rxm";
  std::uint64_t size = 64ULL << 20;
  int window = 4;
  int iters = 20;
  int warmup = 3;
  int rounds = 1;
  std::uint64_t chunk = 1ULL << 20;
  bool write = false;  // --op write
  std::string json_path;
};

// One row of the table: `bytes` (both directions for bidi) moved in `seconds`.
struct Measurement {
  std::string transport;
  std::string direction;
  int round = 0;
  double seconds = 0;
  std::uint64_t bytes = 0;
  [[nodiscard]] double gbps() const { return algbw_gbps(bytes, seconds * 1e6); }
};

// Runs `step` on this rank and tells every rank whether all succeeded (stream::all_ok).
bool all_ok(Bootstrap& boot, const std::function<void()>& step) {
  return stream::all_ok(boot, kTool, step);
}

// ---- libfabric ------------------------------------------------------------------------------

using transport::fabric::fi_text;
using transport::fabric::FidPtr;
using transport::fabric::InfoPtr;
using transport::fabric::kApiVersion;

// The same endpoint the fabric transport asks for (transport/fabric/fi_handles.h), so that
// the ceiling is measured on what the library would get; one thread per endpoint here.
// Messages from one sender must match receives in the order they were sent (FI_ORDER_SAS):
// the stamps check that.
InfoPtr make_hints(const std::string& provider, bool write) {
  InfoPtr hints = transport::fabric::rdm_hints(provider, FI_THREAD_DOMAIN, write);
  hints->tx_attr->msg_order = FI_ORDER_SAS;
  hints->rx_attr->msg_order = FI_ORDER_SAS;
  return hints;
}

std::string available_providers() {
  std::string s;
  for (const auto& n : transport::fabric::available_providers()) {
    s += (s.empty() ? "'" : ", '") + n + "'";
  }
  return s.empty() ? "none" : s;
}

std::string mr_mode_text(int mode) {
  static const std::pair<int, const char*> kBits[] = {{FI_MR_LOCAL, "local"},
                                                      {FI_MR_VIRT_ADDR, "virt_addr"},
                                                      {FI_MR_ALLOCATED, "allocated"},
                                                      {FI_MR_PROV_KEY, "prov_key"},
                                                      {FI_MR_RAW, "raw"},
                                                      {FI_MR_ENDPOINT, "endpoint"}};
  std::string s;
  for (const auto& [bit, name] : kBits) {
    if ((mode & bit) != 0) s += (s.empty() ? "" : "|") + std::string(name);
  }
  return s.empty() ? "none" : s;
}

// Completions map back to the operation by address: the context comes first.
struct Op {
  fi_context2 ctx;
  bool recv = false;
  bool credit = false;  // --op write: a receive posted for the peer's credits
  std::uint32_t slot = 0;
  std::uint32_t chunk = 0;
};
static_assert(std::is_standard_layout_v<Op>, "a completion's op_context is the Op's address");

// --op write: what a receiver tells the sender, with fi_inject, after checking a message: in
// run `run`, messages [0, done) have arrived, so their slots may be written again.
struct Credit {
  std::uint32_t run = 0;
  std::uint32_t done = 0;
};

// --op write: where the peer's message slots are, for the writes.
struct Target {
  std::uint64_t addr = 0;
  std::uint64_t key = 0;
};

// One endpoint, its completion queue and window x message-size buffers for each direction.
class FabricStream {
 public:
  FabricStream(const Args& args, int rank) : rank_(rank), size_(args.size), write_(args.write) {
    InfoPtr hints = make_hints(args.provider, write_);
    fi_info* found = nullptr;
    int rc = fi_getinfo(kApiVersion, nullptr, nullptr, 0, hints.get(), &found);
    if (rc != 0 || found == nullptr) {
      throw Error(ErrorCode::kInvalidArgument,
                  "libfabric provider '" + args.provider +
                      "' is not available here for FI_EP_RDM with FI_MSG" +
                      (write_ ? " and FI_RMA with remote CQ data" : "") + " (" + fi_text(rc) +
                      "); available: " + available_providers(),
                  rank);
    }
    info_.reset(found);
    provider_ = info_->fabric_attr->prov_name;
    if (write_ && (info_->mode & FI_RX_CQ_DATA) != 0) {
      throw Error(ErrorCode::kInvalidArgument,
                  "--op write: provider '" + provider_ +
                      "' consumes a posted receive for each write's CQ data (FI_RX_CQ_DATA), "
                      "which this tool does not post; use --op send",
                  rank);
    }
    max_msg_ = info_->ep_attr->max_msg_size;
    chunk_ = static_cast<std::size_t>(std::min<std::uint64_t>(args.chunk, max_msg_));
    chunks_ = (size_ + chunk_ - 1) / chunk_;
    window_ = static_cast<std::uint32_t>(args.window);
    // Each write's remote CQ data names its slot and chunk (window x chunks values).
    const std::size_t data_bits = 8 * std::min<std::size_t>(info_->domain_attr->cq_data_size, 8);
    if (write_ && data_bits < 64 && window_ * chunks_ > (std::uint64_t{1} << data_bits)) {
      throw Error(ErrorCode::kInvalidArgument,
                  "--op write: --window " + std::to_string(window_) + " x " +
                      std::to_string(chunks_) + " chunks per message do not fit the provider's " +
                      std::to_string(data_bits) + "-bit remote CQ data; use a larger --chunk",
                  rank);
    }

    fid_fabric* fabric = nullptr;
    check("fi_fabric", fi_fabric(info_->fabric_attr, &fabric, nullptr));
    fabric_.reset(fabric);
    fid_domain* domain = nullptr;
    check("fi_domain", fi_domain(fabric, info_.get(), &domain, nullptr));
    domain_.reset(domain);
    fi_av_attr av_attr{};
    av_attr.type = FI_AV_TABLE;
    av_attr.count = 2;
    fid_av* av = nullptr;
    check("fi_av_open", fi_av_open(domain, &av_attr, &av, nullptr));
    av_.reset(av);
    // Room for a completion of every operation that can be outstanding at once.
    fi_cq_attr cq_attr{};
    cq_attr.format = FI_CQ_FORMAT_DATA;
    cq_attr.wait_obj = FI_WAIT_NONE;
    cq_attr.size = 2 * window_ * chunks_ + 2 * window_ + 64;
    fid_cq* cq = nullptr;
    check("fi_cq_open", fi_cq_open(domain, &cq_attr, &cq, nullptr));
    cq_.reset(cq);
    fid_ep* ep = nullptr;
    check("fi_endpoint", fi_endpoint(domain, info_.get(), &ep, nullptr));
    ep_.reset(ep);
    check("fi_ep_bind(av)", fi_ep_bind(ep, &av->fid, 0));
    check("fi_ep_bind(cq)", fi_ep_bind(ep, &cq->fid, FI_TRANSMIT | FI_RECV));
    check("fi_enable", fi_enable(ep));

    // [0, window) send slots, then [window, 2 window) receive slots, then (writes) the
    // receives for credits, all in one registration.
    const std::size_t data_bytes = 2 * static_cast<std::size_t>(window_) * size_;
    credit_bufs_ = write_ ? 2 * static_cast<std::size_t>(window_) + 2 : 0;
    const std::size_t bytes = data_bytes + credit_bufs_ * sizeof(Credit);
    memory_ = allocate(bytes, 0xa5, rank);
    std::memset(memory_.get() + data_bytes / 2, 0, bytes - data_bytes / 2);
    credits_in_ = memory_.get() + data_bytes;
    const std::uint64_t mr_mode = info_->domain_attr->mr_mode;
    if (write_ || (mr_mode & FI_MR_LOCAL) != 0) {
      // Writes: the receive slots are the peers' targets, so registered for them (and, where
      // registrations belong to endpoints, bound to this one).
      const std::uint64_t access =
          FI_SEND | FI_RECV | (write_ ? FI_WRITE | FI_REMOTE_WRITE : std::uint64_t{0});
      fid_mr* mr = nullptr;
      check("fi_mr_reg", transport::fabric::register_region(domain, mr_mode, memory_.get(), bytes,
                                                            access, 1, ep, &mr));
      mr_.reset(mr);
    }
    ops_.resize(2 * static_cast<std::size_t>(window_) * chunks_);
    for (std::size_t i = 0; i < ops_.size(); ++i) {
      Op& op = ops_[i];
      op.recv = i >= ops_.size() / 2;
      op.slot = static_cast<std::uint32_t>((i % (ops_.size() / 2)) / chunks_);
      op.chunk = static_cast<std::uint32_t>(i % chunks_);
    }
    if (write_) {
      // Receives for the peer's credits, kept posted for the stream's whole life: with writes
      // nothing else is received, so every message that arrives is a credit.
      credit_ops_.resize(credit_bufs_);
      for (std::size_t i = 0; i < credit_ops_.size(); ++i) {
        credit_ops_[i].recv = true;
        credit_ops_[i].credit = true;
        credit_ops_[i].slot = static_cast<std::uint32_t>(i);
        post_credit_recv(credit_ops_[i]);
      }
    }
  }
  FabricStream(const FabricStream&) = delete;
  FabricStream& operator=(const FabricStream&) = delete;
  ~FabricStream() {
    // Endpoint before what it is bound to, memory last.
    ep_.reset();
    mr_.reset();
    cq_.reset();
    av_.reset();
    domain_.reset();
    fabric_.reset();
  }

  [[nodiscard]] const std::string& provider() const { return provider_; }
  // --op write: where this rank's receive slots are, for the peer; and where the peer's are.
  [[nodiscard]] Target target() const {
    Target t;
    if (!write_) return t;
    const bool virt = (info_->domain_attr->mr_mode & FI_MR_VIRT_ADDR) != 0;
    t.addr = transport::rma::region_base(memory_.get(), window_ * size_, virt);
    t.key = fi_mr_key(mr_.get());
    if (t.key == FI_KEY_NOTAVAIL) check("fi_mr_key", -FI_ENOKEY);
    return t;
  }
  void set_target(const Target& t) { target_ = t; }
  [[nodiscard]] std::size_t chunk() const { return chunk_; }
  [[nodiscard]] std::string describe() const {
    const fi_info& i = *info_;
    return "provider " + provider_ + " (fabric " + i.fabric_attr->name + ", domain " +
           i.domain_attr->name + "), max_msg_size " + std::to_string(i.ep_attr->max_msg_size) +
           ", mr_mode " + mr_mode_text(i.domain_attr->mr_mode) + ", inject_size " +
           std::to_string(i.tx_attr->inject_size) + ", tx_size " + std::to_string(i.tx_attr->size) +
           ", rx_size " + std::to_string(i.rx_attr->size) + ", chunk " + std::to_string(chunk_) +
           " (" + std::to_string(chunks_) + " per message)" +
           (write_ ? ", RMA writes with remote CQ data" : ", sends");
  }

  [[nodiscard]] std::vector<char> name() const {
    std::vector<char> n(kMaxName);
    std::size_t len = n.size();
    check("fi_getname", fi_getname(&ep_->fid, n.data(), &len));
    n.resize(len);
    return n;
  }
  // The ranks this one writes or sends to (next) and receives from (prev): the same one on 2
  // ranks. Credits go back to prev.
  void set_peers(int next, const char* next_name, int prev, const char* prev_name) {
    next_rank_ = next;
    prev_rank_ = prev;
    next_ = insert(next, next_name);
    prev_ = prev == next ? next_ : insert(prev, prev_name);
  }

  // Streams messages [0, messages): sends them when `send`, receives and checks them when
  // `recv`. Returns the receiving side's seconds from the arrival of message timed_from - 1
  // (from the call when timed_from is 0) to the arrival of the last; 0 when not receiving.
  double run(bool send, bool recv, std::uint64_t messages, std::uint64_t timed_from) {
    const auto start = Clock::now();
    arrived_from_ = start;
    arrived_last_ = start;
    timed_from_ = timed_from;
    Side tx;
    Side rx;
    tx.active = send;
    rx.active = recv;
    rx.recv = true;
    tx.done.assign(window_, 0);
    rx.done.assign(window_, 0);
    tx.limit = std::max<std::size_t>(1, info_->tx_attr->size);
    rx.limit = std::max<std::size_t>(1, info_->rx_attr->size);
    messages_ = messages;
    ++run_;
    credited_ = 0;
    received_ = 0;
    if (write_) rx.next = messages;  // the slots are written to, nothing is posted for them
    auto last_moved = start;
    std::uint64_t idle = 0;
    while ((tx.active && tx.oldest < messages) || (rx.active && rx.oldest < messages)) {
      bool moved = poll(tx, rx);
      if (tx.active) moved |= post(tx);
      if (rx.active && !write_) moved |= post(rx);
      moved |= send_credits();
      if (moved) {
        idle = 0;
        continue;
      }
      // Nothing moved: let the other ranks' processes run (with more ranks than CPUs, a rank
      // that polls without yielding holds back the ones it waits for).
      sched_yield();
      if (++idle % 4096 != 0) continue;
      const auto now = Clock::now();
      if (idle == 4096) last_moved = now;
      if (now - last_moved > kStallLimit) {
        throw Error(ErrorCode::kTimeout,
                    provider_ + ": no completion for " + std::to_string(kStallLimit.count()) +
                        " s; sent " + std::to_string(tx.oldest) + ", received " +
                        std::to_string(rx.oldest) + " of " + std::to_string(messages) + " messages",
                    rank_, prev_rank_);
      }
    }
    // The last credits too, or the sender's next run would count them.
    const auto flush_from = Clock::now();
    while (credit_owed_ > 0) {
      if (!poll(tx, rx) && !send_credits() && Clock::now() - flush_from > kStallLimit) {
        throw Error(ErrorCode::kTimeout,
                    provider_ + ": the last credits could not be sent for " +
                        std::to_string(kStallLimit.count()) + " s",
                    rank_, next_rank_);
      }
    }
    if (!recv) return 0;
    return std::chrono::duration<double>(arrived_last_ - arrived_from_).count();
  }

 private:
  // One direction of a run: messages are posted in order, chunk by chunk, while fewer than
  // `window` of them are incomplete; a message is complete once all its chunks are.
  struct Side {
    bool active = false;
    bool recv = false;
    std::uint64_t next = 0;         // the message being posted
    std::size_t next_chunk = 0;     // its chunks posted so far
    std::uint64_t oldest = 0;       // the oldest incomplete message
    std::vector<std::size_t> done;  // completed chunks per slot
    // Operations posted and not completed, and how many the provider's queue holds (its
    // tx_attr/rx_attr size): shm fails a receive beyond that with FI_ENOMEM, not FI_EAGAIN.
    std::size_t outstanding = 0;
    std::size_t limit = 0;
  };

  fi_addr_t insert(int peer, const char* name) {
    fi_addr_t addr = FI_ADDR_UNSPEC;
    const int n = fi_av_insert(av_.get(), name, 1, &addr, 0, nullptr);
    if (n != 1) {
      throw Error(ErrorCode::kSystem,
                  "fi_av_insert of rank " + std::to_string(peer) + "'s endpoint failed: " +
                      (n < 0 ? fi_text(n) : std::string("address not accepted")),
                  rank_, peer);
    }
    return addr;
  }

  void check(const char* call, long rc) const {
    if (rc != 0) {
      throw Error(ErrorCode::kSystem,
                  std::string(call) + " failed: " + fi_text(rc) + " (provider " + provider_ + ")",
                  rank_);
    }
  }
  char* slot(bool recv, std::uint64_t message) const {
    const std::size_t s = static_cast<std::size_t>(message % window_) + (recv ? window_ : 0);
    return memory_.get() + s * size_;
  }
  std::size_t chunk_len(std::size_t c) const { return std::min(chunk_, size_ - c * chunk_); }
  void* desc() const { return mr_ ? fi_mr_desc(mr_.get()) : nullptr; }

  bool post(Side& s) {
    bool moved = false;
    while (s.next < messages_ && s.next < s.oldest + window_ && s.outstanding < s.limit &&
           (!write_ || s.next < credited_ + window_)) {
      char* msg = slot(s.recv, s.next);
      if (s.next_chunk == 0) {
        if (s.recv) {
          clear_stamp(msg, size_);
        } else {
          stamp(msg, size_, s.next);
        }
      }
      const std::size_t off = s.next_chunk * chunk_;
      const std::size_t len = chunk_len(s.next_chunk);
      Op& op = ops_[(s.recv ? ops_.size() / 2 : 0) +
                    static_cast<std::size_t>(s.next % window_) * chunks_ + s.next_chunk];
      ssize_t rc = 0;
      if (s.recv) {
        rc = fi_recv(ep_.get(), msg + off, len, desc(), FI_ADDR_UNSPEC, &op.ctx);
      } else if (write_) {
        // The CQ data names the slot and chunk (checked to fit when the stream was opened).
        const std::uint64_t data =
            static_cast<std::uint64_t>(s.next % window_) * chunks_ + s.next_chunk;
        const std::uint64_t remote = target_.addr + (s.next % window_) * size_ + off;
        rc = fi_writedata(ep_.get(), msg + off, len, desc(), data, next_, remote, target_.key,
                          &op.ctx);
      } else {
        rc = fi_send(ep_.get(), msg + off, len, desc(), next_, &op.ctx);
      }
      if (rc == -FI_EAGAIN) break;  // the provider's queue is full: progress, then again
      if (rc != 0) check(s.recv ? "fi_recv" : (write_ ? "fi_writedata" : "fi_send"), rc);
      moved = true;
      ++s.outstanding;
      if (++s.next_chunk == chunks_) {
        s.next_chunk = 0;
        ++s.next;
      }
    }
    return moved;
  }

  bool poll(Side& tx, Side& rx) {
    auto& c = entries_;
    const ssize_t n = fi_cq_read(cq_.get(), c.data(), c.size());
    if (n == -FI_EAGAIN) return false;
    if (n == -FI_EAVAIL) {
      fi_cq_err_entry err{};
      const ssize_t r = fi_cq_readerr(cq_.get(), &err, 0);
      if (r < 0) check("fi_cq_readerr", r);
      char buf[256] = {};
      const char* detail =
          fi_cq_strerror(cq_.get(), err.prov_errno, err.err_data, buf, sizeof(buf));
      const bool recv = err.op_context != nullptr && static_cast<Op*>(err.op_context)->recv;
      const std::string why =
          detail != nullptr && *detail != '\0' ? std::string(" (") + detail + ")" : "";
      throw Error(
          ErrorCode::kPeerFailed,
          provider_ + ": a " + (recv ? "receive" : "send") + " failed: " + fi_text(err.err) + why,
          rank_, recv ? prev_rank_ : next_rank_);
    }
    if (n < 0) check("fi_cq_read", n);
    for (ssize_t k = 0; k < n; ++k) {
      const fi_cq_data_entry& e = c[static_cast<std::size_t>(k)];
      if ((e.flags & FI_REMOTE_WRITE) != 0) {
        // A chunk the peer wrote into this rank's slot `data / chunks`.
        const std::size_t slot = static_cast<std::size_t>(e.data / chunks_);
        if ((e.flags & FI_REMOTE_CQ_DATA) == 0 || slot >= window_) {
          throw Error(ErrorCode::kMismatch,
                      provider_ + ": a write arrived without a slot in its CQ data", rank_,
                      prev_rank_);
        }
        ++rx.done[slot];
        continue;
      }
      Op& op = *static_cast<Op*>(e.op_context);
      if (op.credit) {
        Credit cr;
        std::memcpy(&cr, credits_in_ + op.slot * sizeof(Credit), sizeof(cr));
        if (cr.run == run_) credited_ = std::max<std::uint64_t>(credited_, cr.done);
        post_credit_recv(op);
        continue;
      }
      Side& s = op.recv ? rx : tx;
      if (op.recv && e.len != chunk_len(op.chunk)) {
        throw Error(ErrorCode::kMismatch,
                    provider_ + ": a chunk arrived with " + std::to_string(e.len) + " bytes, " +
                        std::to_string(chunk_len(op.chunk)) + " expected",
                    rank_, prev_rank_);
      }
      ++s.done[op.slot];
      --s.outstanding;
    }
    for (Side* s : {&tx, &rx}) {
      while (s->oldest < s->next && s->done[s->oldest % window_] == chunks_) {
        s->done[s->oldest % window_] = 0;
        if (s->recv) {
          check_stamp(slot(true, s->oldest), size_, s->oldest, rank_, prev_rank_, provider_);
          const auto now = Clock::now();
          if (s->oldest + 1 == timed_from_) arrived_from_ = now;
          arrived_last_ = now;
          if (write_) {
            // The slot is free for message oldest + window: cleared before the peer may write.
            clear_stamp(slot(true, s->oldest), size_);
            ++credit_owed_;
          }
        }
        ++s->oldest;
      }
    }
    return n > 0;
  }

  // --op write: receives for credits, and the credits this rank owes the sender.
  void post_credit_recv(Op& op) {
    void* buf = credits_in_ + op.slot * sizeof(Credit);
    check("fi_recv", fi_recv(ep_.get(), buf, sizeof(Credit), desc(), FI_ADDR_UNSPEC, &op.ctx));
  }
  bool send_credits() {
    if (credit_owed_ == 0) return false;
    Credit cr;
    cr.run = static_cast<std::uint32_t>(run_);
    cr.done = static_cast<std::uint32_t>(received_ + credit_owed_);
    const ssize_t rc = fi_inject(ep_.get(), &cr, sizeof(cr), prev_);
    if (rc == -FI_EAGAIN) return false;  // the provider's queue is full: progress, then again
    check("fi_inject", rc);
    received_ = cr.done;
    credit_owed_ = 0;
    return true;
  }

  int rank_;
  std::size_t size_;
  bool write_;
  std::size_t max_msg_ = 0;
  std::size_t chunk_ = 0;
  std::size_t chunks_ = 0;
  std::uint32_t window_ = 0;
  std::string provider_;
  std::uint64_t messages_ = 0;
  std::uint64_t timed_from_ = 0;
  Clock::time_point arrived_from_{};
  Clock::time_point arrived_last_{};

  InfoPtr info_;
  FidPtr<fid_fabric> fabric_;
  FidPtr<fid_domain> domain_;
  FidPtr<fid_av> av_;
  FidPtr<fid_cq> cq_;
  FidPtr<fid_ep> ep_;
  FidPtr<fid_mr> mr_;
  Memory memory_;
  std::vector<Op> ops_;
  std::array<fi_cq_data_entry, 64> entries_{};
  fi_addr_t next_ = FI_ADDR_UNSPEC;  // written or sent to; credits come from it
  fi_addr_t prev_ = FI_ADDR_UNSPEC;  // received from; credits go to it
  int next_rank_ = 0;
  int prev_rank_ = 0;
  // --op write.
  Target target_;
  std::vector<Op> credit_ops_;
  std::size_t credit_bufs_ = 0;
  char* credits_in_ = nullptr;     // credit_bufs_ Credits, in memory_
  std::uint64_t run_ = 0;          // runs so far, this one included (credits name theirs)
  std::uint64_t credited_ = 0;     // this run: messages the next rank has checked
  std::uint64_t received_ = 0;     // this run: messages this rank has checked and credited
  std::uint64_t credit_owed_ = 0;  // checked, not yet credited
};

// ---- the two phases -------------------------------------------------------------------------

// Warm-up and timed messages as one stream, one direction and then both; appends a
// Measurement per direction. `Stream` is FabricStream or TcpStream. False when a rank failed.
template <class Stream>
bool measure(Bootstrap& boot, Stream& stream, const std::string& transport, const Args& args,
             int round, std::vector<Measurement>& out) {
  const int rank = boot.rank();
  const auto warmup = static_cast<std::uint64_t>(args.warmup);
  const auto iters = static_cast<std::uint64_t>(args.iters);
  for (const bool both : {false, true}) {
    const bool send = both || rank == 0;
    const bool recv = both || rank == 1;
    double seconds = 0;
    if (!all_ok(boot, [&] { seconds = stream.run(send, recv, warmup + iters, warmup); })) {
      return false;
    }
    Measurement m;
    m.transport = transport;
    m.direction = both ? "bidi" : "uni";
    m.round = round;
    m.seconds = max_over_ranks(boot, seconds);
    m.bytes = static_cast<std::uint64_t>(both ? boot.size() : 1) * iters * args.size;
    out.push_back(m);
  }
  return true;
}

// The endpoint of each rank, each knowing its ring neighbours'; nullptr (on every rank) when a
// rank failed.
std::unique_ptr<FabricStream> open_fabric(Bootstrap& boot, const Args& args, std::string& about) {
  std::unique_ptr<FabricStream> stream;
  std::vector<char> mine(kMaxName + sizeof(std::uint32_t));
  if (!all_ok(boot, [&] {
        stream = std::make_unique<FabricStream>(args, boot.rank());
        const std::vector<char> n = stream->name();
        const auto len = static_cast<std::uint32_t>(n.size());
        std::memcpy(mine.data(), &len, sizeof(len));
        std::memcpy(mine.data() + sizeof(len), n.data(), n.size());
      })) {
    return nullptr;
  }
  about = stream->describe();
  const int n = boot.size();
  const int next = (boot.rank() + 1) % n;
  const int prev = (boot.rank() + n - 1) % n;
  std::vector<char> all(static_cast<std::size_t>(n) * mine.size());
  boot.all_gather(mine.data(), mine.size(), all.data());
  const auto name_of = [&](int r) {
    return all.data() + static_cast<std::size_t>(r) * mine.size() + sizeof(std::uint32_t);
  };
  if (!all_ok(boot, [&] { stream->set_peers(next, name_of(next), prev, name_of(prev)); })) {
    return nullptr;
  }
  // Where to write (--op write; unused otherwise).
  const Target own = stream->target();
  std::vector<Target> targets(static_cast<std::size_t>(n));
  boot.all_gather(&own, sizeof(own), targets.data());
  stream->set_target(targets[static_cast<std::size_t>(next)]);
  return stream;
}

// The connection between the two ranks (more: the ring of connections); nullptr (on every rank)
// when a rank failed.
std::unique_ptr<TcpStream> open_tcp(Bootstrap& boot, const Args& args) {
  std::unique_ptr<TcpStream> stream;
  if (!all_ok(boot, [&] { stream = std::make_unique<TcpStream>(args.size, boot.rank()); })) {
    return nullptr;
  }
  const bool ok = boot.size() == 2 ? stream::connect_pair(boot, kTool, *stream)
                                   : stream::connect_ring(boot, kTool, *stream);
  if (!ok) return nullptr;
  return stream;
}

// GB/s of every round of one transport and direction, in round order.
std::vector<double> rates(const std::vector<Measurement>& rows, bool tcp, const char* direction) {
  std::vector<double> out;
  for (const Measurement& m : rows) {
    if ((m.transport == "tcp") == tcp && m.direction == direction) out.push_back(m.gbps());
  }
  return out;
}

void print_table(const Args& args, const std::string& provider,
                 const std::vector<Measurement>& rows) {
  std::printf("%-14s %-9s %12s %5s %10s %10s\n", "transport", "direction", "size", "round",
              "seconds", "GB/s");
  for (const Measurement& m : rows) {
    std::printf("%-14s %-9s %12llu %5d %10.4f %10.3f\n", m.transport.c_str(), m.direction.c_str(),
                static_cast<unsigned long long>(args.size), m.round, m.seconds, m.gbps());
  }
  // Ratios of the medians over rounds; with several rounds, each round's ratio too (the two
  // transports of one round ran next to each other, so they saw the same machine).
  for (const char* dir : {"uni", "bidi"}) {
    const std::vector<double> fab = rates(rows, false, dir);
    const std::vector<double> tcp = rates(rows, true, dir);
    if (fab.empty() || fab.size() != tcp.size() || median(tcp) <= 0) continue;
    std::printf("ratio %s/tcp %s: %.3f", provider.c_str(), dir, median(fab) / median(tcp));
    if (fab.size() > 1) {
      std::printf(" (median GB/s %.3f / %.3f; per round:", median(fab), median(tcp));
      for (std::size_t r = 0; r < fab.size(); ++r) {
        std::printf(" %.3f", tcp[r] > 0 ? fab[r] / tcp[r] : 0.0);
      }
      std::printf(")");
    }
    std::printf("\n");
  }
}

void write_json(const Args& args, int ranks, const std::string& about,
                const std::vector<Measurement>& rows) {
  nlohmann::json j;
  j["tool"] = "dear-fabric-stream";
  j["provider"] = args.provider;
  j["fabric"] = about;
  j["ranks"] = ranks;
  j["size"] = args.size;
  j["window"] = args.window;
  j["chunk"] = args.chunk;
  j["op"] = args.write ? "write" : "send";
  j["iters"] = args.iters;
  j["warmup"] = args.warmup;
  j["rounds"] = args.rounds;
  j["rows"] = nlohmann::json::array();
  for (const Measurement& m : rows) {
    j["rows"].push_back({{"transport", m.transport},
                         {"direction", m.direction},
                         {"round", m.round},
                         {"bytes", m.bytes},
                         {"seconds", m.seconds},
                         {"gbps", m.gbps()}});
  }
  std::ofstream f(args.json_path, std::ios::trunc);
  f << j.dump(2) << '\n';
  if (!f.flush()) throw Error(ErrorCode::kSystem, "--json: cannot write '" + args.json_path + "'");
}

int run(int argc, char** argv) {
  CLI::App app{
      "dear-fabric-stream: a libfabric provider's raw streaming rate between ranks (2: a pair, "
      "more: a ring), next to a TCP stream between the same ranks"};
  Args args;
  app.add_option("--provider", args.provider, "libfabric provider: tcp;ofi_rxm, shm, sockets, ...")
      ->capture_default_str();
  add_bytes_flag(app, "-s,--size", args.size, "Bytes per message (K/M/G suffixes)", true);
  app.add_option("--window", args.window, "Messages in flight per direction (fabric)")
      ->check(CLI::Range(1, 1024))
      ->capture_default_str();
  app.add_option("--iters", args.iters, "Timed messages per direction")
      ->check(CLI::Range(1, 1 << 24))
      ->capture_default_str();
  app.add_option("--warmup", args.warmup,
                 "Untimed messages before the timed ones (the clock starts when the last of "
                 "them has arrived)")
      ->check(CLI::Range(1, 1 << 24))
      ->capture_default_str();
  app.add_option("--rounds", args.rounds,
                 "Measure both transports this many times, alternating which goes first; "
                 "ratios are of the medians")
      ->check(CLI::Range(1, 1000))
      ->capture_default_str();
  add_bytes_flag(app, "--chunk", args.chunk,
                 "Bytes per fabric send: min(this, max_msg_size); tcp always moves 1 MiB per call",
                 true);
  std::string op = "send";
  app.add_option("--op", op,
                 "How fabric chunks move: send (into posted receives) or write (RMA writes with "
                 "remote CQ data into the receiver's registered slots, as the fabric transport's "
                 "default data path does where offered)")
      ->check(CLI::IsMember({"send", "write"}))
      ->capture_default_str();
  app.add_option("--json", args.json_path, "Also write the rows to this JSON file (rank 0)");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  args.write = op == "write";
  if (args.size < 2 * kStamp) {
    std::fprintf(stderr, "dear-fabric-stream: --size must be at least %zu bytes\n", 2 * kStamp);
    return 2;
  }

  auto boot = Bootstrap::from_env();
  if (boot->size() < 2) {
    if (boot->rank() == 0) {
      std::fprintf(stderr, "dear-fabric-stream: needs at least 2 ranks (got %d)\n", boot->size());
    }
    return 2;
  }
  std::string about;
  const std::unique_ptr<FabricStream> fabric = open_fabric(*boot, args, about);
  if (!fabric) return 1;
  const std::unique_ptr<TcpStream> tcp = open_tcp(*boot, args);
  if (!tcp) return 1;
  std::vector<Measurement> rows;
  for (int r = 0; r < args.rounds; ++r) {
    // Alternating the order cancels a drift of the machine's load within the run.
    const auto run_fabric = [&] {
      return measure(*boot, *fabric, fabric->provider(), args, r, rows);
    };
    const auto run_tcp = [&] { return measure(*boot, *tcp, "tcp", args, r, rows); };
    const bool ok = r % 2 == 0 ? run_fabric() && run_tcp() : run_tcp() && run_fabric();
    if (!ok) return 1;
  }
  if (boot->rank() == 0) {
    std::printf("# dear-fabric-stream: %s\n", about.c_str());
    std::printf(
        "# %d ranks, %llu-byte messages, window %d, %d timed after %d warm-up per "
        "direction, %d round(s); bidi = every rank to the next at once, summed over the ranks; "
        "GB = 1e9 bytes\n",
        boot->size(), static_cast<unsigned long long>(args.size), args.window, args.iters,
        args.warmup, args.rounds);
    print_table(args, fabric->provider(), rows);
    if (!args.json_path.empty()) write_json(args, boot->size(), about, rows);
  }
  boot->barrier();
  return 0;
}

}  // namespace
}  // namespace dear::bench

int main(int argc, char** argv) {
  return dear::bench::tool_main("dear-fabric-stream", dear::bench::run, argc, argv);
}
