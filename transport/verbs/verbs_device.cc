// Compiled, not run on RDMA hardware: see verbs_link.h.
#include "transport/verbs/verbs_device.h"

#include <fcntl.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstdio>
#include <cstring>

#include "transport/socket_util.h"

namespace dear::transport::verbs {
namespace {

constexpr int kMaxGids = 256;  // GID table entries looked at

struct DeviceListDeleter {
  void operator()(ibv_device** l) const { ibv_free_device_list(l); }
};
using DeviceList = std::unique_ptr<ibv_device*, DeviceListDeleter>;

LinkLayer link_of(const ibv_port_attr& a) {
  return a.link_layer == IBV_LINK_LAYER_ETHERNET ? LinkLayer::kEthernet : LinkLayer::kInfiniBand;
}

std::vector<GidEntry> gid_table(ibv_context* ctx, std::uint8_t port, int len) {
  std::vector<GidEntry> out;
  for (int i = 0; i < std::min(len, kMaxGids); ++i) {
    ibv_gid_entry e{};
    if (ibv_query_gid_ex(ctx, port, static_cast<std::uint32_t>(i), &e, 0) != 0) continue;
    GidEntry g;
    g.index = i;
    g.type = e.gid_type == IBV_GID_TYPE_ROCE_V2   ? GidType::kRoceV2
             : e.gid_type == IBV_GID_TYPE_ROCE_V1 ? GidType::kRoceV1
                                                  : GidType::kInfiniBand;
    std::memcpy(g.gid.data(), e.gid.raw, 16);
    if (std::all_of(g.gid.begin(), g.gid.end(), [](std::uint8_t b) { return b == 0; })) continue;
    out.push_back(g);
  }
  return out;
}

}  // namespace

std::string errno_text(int e) { return std::strerror(e); }

std::string hex(std::uint32_t v) {
  char buf[16];
  std::snprintf(buf, sizeof(buf), "%x", v);
  return buf;
}

[[noreturn]] void throw_sys(const std::string& call, int err, int rank, int peer) {
  throw Error(ErrorCode::kSystem, call + " failed: " + errno_text(err), rank, peer, "verbs setup");
}

std::uint32_t random_psn() { return static_cast<std::uint32_t>(random_u64() & 0xffffffU); }

void bring_up(ibv_qp* qp, const ConnectionPlan& p, const std::string& towards, int self, int peer) {
  ibv_qp_attr a{};
  a.qp_state = IBV_QPS_RTR;
  a.path_mtu = static_cast<ibv_mtu>(mtu_code(p.path_mtu));
  a.dest_qp_num = p.dest_qpn;
  a.rq_psn = p.rq_psn;
  a.max_dest_rd_atomic = p.max_dest_rd_atomic;
  a.min_rnr_timer = p.min_rnr_timer;
  a.ah_attr.dlid = p.dlid;
  a.ah_attr.sl = p.service_level;
  a.ah_attr.src_path_bits = 0;
  a.ah_attr.port_num = p.port;
  a.ah_attr.is_global = p.use_grh ? 1 : 0;
  if (p.use_grh) {
    std::memcpy(a.ah_attr.grh.dgid.raw, p.dgid.data(), 16);
    a.ah_attr.grh.sgid_index = p.sgid_index;
    a.ah_attr.grh.hop_limit = p.hop_limit;
    a.ah_attr.grh.traffic_class = p.traffic_class;
    a.ah_attr.grh.flow_label = 0;
  }
  if (ibv_modify_qp(qp, &a,
                    IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
                        IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER) != 0) {
    throw_sys("ibv_modify_qp(RTR) towards " + towards, errno, self, peer);
  }
  a = {};
  a.qp_state = IBV_QPS_RTS;
  a.timeout = p.timeout;
  a.retry_cnt = p.retry_count;
  a.rnr_retry = p.rnr_retry;
  a.sq_psn = p.sq_psn;
  a.max_rd_atomic = p.max_rd_atomic;
  if (ibv_modify_qp(qp, &a,
                    IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY |
                        IBV_QP_SQ_PSN | IBV_QP_MAX_QP_RD_ATOMIC) != 0) {
    throw_sys("ibv_modify_qp(RTS) towards " + towards, errno, self, peer);
  }
}

ibv_qp* create_rc_qp(ibv_pd* pd, ibv_cq* cq, std::uint32_t send_wr, std::uint32_t recv_wr,
                     std::uint32_t inline_bytes, std::uint32_t* inline_granted) {
  ibv_qp_init_attr qa{};
  qa.send_cq = cq;
  qa.recv_cq = cq;
  qa.qp_type = IBV_QPT_RC;
  qa.sq_sig_all = 0;
  qa.cap.max_send_wr = send_wr;
  qa.cap.max_recv_wr = recv_wr;
  qa.cap.max_send_sge = 1;
  qa.cap.max_recv_sge = 1;
  qa.cap.max_inline_data = inline_bytes;
  ibv_qp* qp = ibv_create_qp(pd, &qa);
  if (qp == nullptr && inline_bytes > 0) {
    qa.cap.max_inline_data = 0;
    qp = ibv_create_qp(pd, &qa);
  }
  *inline_granted = qa.cap.max_inline_data;
  return qp;
}

void to_init(ibv_qp* qp, std::uint8_t port, int self, int peer) {
  ibv_qp_attr a{};
  a.qp_state = IBV_QPS_INIT;
  a.pkey_index = 0;
  a.port_num = port;
  a.qp_access_flags = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ;
  if (ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS) !=
      0) {
    throw_sys("ibv_modify_qp(INIT)", errno, self, peer);
  }
}

std::vector<std::string> device_names() {
  int n = 0;
  DeviceList list(ibv_get_device_list(&n));
  std::vector<std::string> out;
  for (int i = 0; list && i < n; ++i) out.emplace_back(ibv_get_device_name(list.get()[i]));
  return out;
}

std::string join(const std::vector<std::string>& v) {
  std::string s;
  for (const auto& x : v) s += (s.empty() ? "" : ", ") + ("'" + x + "'");
  return s.empty() ? "none" : s;
}

std::shared_ptr<Context> open_context(const VerbsOptions& o, int rank) {
  const DeviceSpec spec = parse_device_spec(o.device, rank);
  int n = 0;
  errno = 0;
  DeviceList list(ibv_get_device_list(&n));
  if (!list) {
    const int e = errno;
    throw Error(ErrorCode::kInvalidArgument,
                "no RDMA device found (ibv_get_device_list failed: " + errno_text(e) + ")", rank);
  }
  if (n == 0) {
    throw Error(ErrorCode::kInvalidArgument,
                "no RDMA device found (ibv_get_device_list returned 0 devices)", rank);
  }
  std::string tried;
  for (int i = 0; i < n; ++i) {
    ibv_device* dev = list.get()[i];
    const std::string name = ibv_get_device_name(dev);
    if (!spec.name.empty() && name != spec.name) continue;
    auto c = std::make_shared<Context>();
    c->ctx = ibv_open_device(dev);
    if (c->ctx == nullptr) {
      tried += (tried.empty() ? "" : "; ") + name + ": ibv_open_device: " + errno_text(errno);
      continue;
    }
    ibv_device_attr da{};
    if (ibv_query_device(c->ctx, &da) != 0) {
      tried += (tried.empty() ? "" : "; ") + name + ": ibv_query_device: " + errno_text(errno);
      continue;
    }
    for (int port = 1; port <= da.phys_port_cnt; ++port) {
      if (spec.port != 0 && port != spec.port) continue;
      ibv_port_attr pa{};
      if (ibv_query_port(c->ctx, static_cast<std::uint8_t>(port), &pa) != 0) continue;
      if (pa.state != IBV_PORT_ACTIVE) {
        tried += (tried.empty() ? "" : "; ") + name + ":" + std::to_string(port) + " is " +
                 ibv_port_state_str(pa.state);
        continue;
      }
      c->device = name;
      c->port = static_cast<std::uint8_t>(port);
      c->link = link_of(pa);
      c->lid = pa.lid;
      c->mtu = mtu_bytes(static_cast<int>(pa.active_mtu));
      c->max_msg = pa.max_msg_sz;
      const auto table = gid_table(c->ctx, c->port, pa.gid_tbl_len);
      c->gid_index = choose_gid_index(table, c->link, o.gid_index, rank);
      ibv_gid g{};
      if (ibv_query_gid(c->ctx, c->port, c->gid_index, &g) == 0) {
        std::memcpy(c->gid.data(), g.raw, 16);
      }
      c->pd = ibv_alloc_pd(c->ctx);
      if (c->pd == nullptr) throw_sys("ibv_alloc_pd(" + name + ")", errno, rank);
      c->rank = rank;
      c->options = o;
      return c;
    }
    if (spec.port != 0 && spec.port > da.phys_port_cnt) {
      tried += (tried.empty() ? "" : "; ") + name + " has " + std::to_string(da.phys_port_cnt) +
               " port(s), not port " + std::to_string(spec.port);
    }
  }
  const std::string asked = o.device.empty() ? "any device" : "device '" + o.device + "'";
  throw Error(ErrorCode::kInvalidArgument,
              "verbs: no active port on " + asked + " (" + (tried.empty() ? "not found" : tried) +
                  "); devices: " + join(device_names()) +
                  " (set CommOptions::ib_device or DEAR_IB_DEVICE)",
              rank);
}

std::vector<std::string> devices() { return device_names(); }

std::optional<std::string> unavailable_reason(const VerbsOptions& options) {
  try {
    auto ctx = open_context(options, Error::kNone);
  } catch (const Error& e) {
    return e.cause();
  }
  return std::nullopt;
}

GpuRegistration register_gpu_memory(ibv_pd* pd, void* addr, std::size_t bytes, int dmabuf_fd,
                                    std::uint64_t offset) {
  GpuRegistration r;
  const int access = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ;
  if (pd == nullptr || addr == nullptr || bytes == 0) {
    r.why = "nothing to register (no protection domain, address or length)";
    return r;
  }
  if (dmabuf_fd >= 0) {
    r.mr = ibv_reg_dmabuf_mr(pd, offset, bytes, reinterpret_cast<std::uintptr_t>(addr), dmabuf_fd,
                             access);
    if (r.mr != nullptr) {
      r.path = GpuPath::kDmaBuf;
      return r;
    }
    r.why = "ibv_reg_dmabuf_mr: " + errno_text(errno);
  } else {
    r.why = "no dma-buf descriptor given";
  }
  // Peer memory: works where the nvidia-peermem module lets the NIC driver pin GPU pages.
  r.mr = ibv_reg_mr(pd, addr, bytes, access);
  if (r.mr != nullptr) {
    r.path = GpuPath::kPeerMemory;
    r.why.clear();
    return r;
  }
  r.why += "; ibv_reg_mr on the device pointer: " + errno_text(errno) +
           " (is nvidia-peermem loaded?); using host staging";
  r.path = GpuPath::kHostStaging;
  return r;
}

void deregister(GpuRegistration& registration) {
  if (registration.mr != nullptr) ibv_dereg_mr(registration.mr);
  registration = {};
}

CompletionQueue::CompletionQueue(ibv_context* ctx, std::size_t entries, int rank) : rank_(rank) {
  cc_ = ibv_create_comp_channel(ctx);
  if (cc_ == nullptr) throw_sys("ibv_create_comp_channel", errno, rank_);
  const int fl = ::fcntl(cc_->fd, F_GETFL);
  if (fl < 0 || ::fcntl(cc_->fd, F_SETFL, fl | O_NONBLOCK) != 0) {
    const int e = errno;
    ibv_destroy_comp_channel(cc_);
    throw_sys("fcntl(O_NONBLOCK)", e, rank_);
  }
  cq_ = ibv_create_cq(ctx, static_cast<int>(std::max<std::size_t>(entries, 64)), nullptr, cc_, 0);
  if (cq_ == nullptr) {
    const int e = errno;
    ibv_destroy_comp_channel(cc_);
    throw_sys("ibv_create_cq(" + std::to_string(entries) + " entries)", e, rank_);
  }
}

CompletionQueue::~CompletionQueue() {
  // Events taken from the channel were acknowledged one by one in arm().
  ibv_destroy_cq(cq_);
  ibv_destroy_comp_channel(cc_);
}

std::uint32_t CompletionQueue::join(std::uint32_t qpn) {
  members_.push_back({qpn, true, {}});
  return static_cast<std::uint32_t>(members_.size() - 1);
}

void CompletionQueue::leave(std::uint32_t m) {
  members_[m].live = false;
  members_[m].inbox.clear();
}

std::string CompletionQueue::arm() {
  ibv_cq* ev_cq = nullptr;
  void* ev_ctx = nullptr;
  while (ibv_get_cq_event(cc_, &ev_cq, &ev_ctx) == 0) {
    ibv_ack_cq_events(ev_cq, 1);
    armed_ = false;
  }
  if (!armed_) {
    if (ibv_req_notify_cq(cq_, 0) != 0) {
      return "ibv_req_notify_cq failed: " + std::string(std::strerror(errno));
    }
    armed_ = true;
  }
  return {};
}

std::string CompletionQueue::poll() {
  ++polls_;
  // Not cleared: this runs every engine turn, and ibv_poll_cq fills the first n entries, the
  // only ones read.
  std::array<ibv_wc, 16> wc;
  for (int batch = 0; batch < 64; ++batch) {
    const int n = ibv_poll_cq(cq_, static_cast<int>(wc.size()), wc.data());
    if (n < 0) return "ibv_poll_cq failed";
    for (int i = 0; i < n; ++i) {
      const ibv_wc& c = wc[static_cast<std::size_t>(i)];
      // A linear search: a communicator's queue pairs are few, and most turns find nothing.
      // Only live members: a queue pair made after another was destroyed may reuse its number.
      for (Member& m : members_) {
        if (m.live && m.qpn == c.qp_num) {
          m.inbox.push_back(c);
          break;
        }
      }
    }
    if (static_cast<std::size_t>(n) < wc.size()) break;
  }
  return {};
}

std::string CompletionQueue::take(std::uint32_t m, std::uint64_t& seen, std::vector<ibv_wc>& out) {
  std::string failed;
  if (seen == polls_) failed = poll();
  seen = polls_;
  out.clear();
  out.swap(members_[m].inbox);
  return failed;
}

}  // namespace dear::transport::verbs
