// ibverbs back-end of the link contract (transport/link.h): RC queue pairs on InfiniBand or
// RoCE. Compiled wherever rdma-core's headers are found; it has NOT been run on RDMA hardware
// (the machines it was written on have no RDMA device). scripts/verbs-check.sh is what a user
// with an InfiniBand or RoCE cluster runs to validate it.
//
// Each channel is one reliable-connected (RC) queue pair, so channels never wait behind each
// other; the queue pairs of one connect (verbs::connect() makes a communicator's ring and mesh
// links at once) complete on one completion queue, which an engine turn polls once, each
// completion going to the channel of its queue pair (verbs_device.h, CompletionQueue). Setup: the
// device and port are chosen (VerbsOptions), the queue pair is created, its connection data (LID,
// GID, QPN, PSN, and the address and key of its receive slots) is exchanged over the bootstrap, and
// it is moved INIT -> RTR -> RTS with the attributes plan_connection() (qp_plan.h) chooses.
//
// Data path: the slot/credit protocol of transport/rma/slot_window.h. The receiver registers
// `slots` data slots of `slot_bytes` each for remote writes and tells the sender where they
// are. The sender copies each fragment (32-byte prefix, the FrameHeader on a message's first
// fragment, payload) into a registered staging buffer and writes it into slot `seq % slots`
// with RDMA WRITE WITH IMMEDIATE (immediate = seq), spending one credit; the receiver's
// completion names the slot. Credits come back piggybacked on the receiver's own fragments or,
// once half the slots are owed, in a 32-byte control message sent inline (IBV_SEND_INLINE) with
// SEND. A closing message carries the number of fragments sent before it. Work requests are
// posted as one chain per progress() call; only every kSignalEvery-th and the chain's last are
// signalled (RC completes in order, so a signalled completion retires everything before it).
// Messages are reported sent once their last fragment is copied to staging.
//
// Direct messages (VerbsOptions::direct_bytes), the protocol of the fabric link's write path
// (rma/fragments.h, DirectInfo): where the receiver opened a window on a message's destination
// (Channel::open_window registers it for remote writes, the registration cached by address
// range in rma::WindowRegistrations) and the sender names it (try_send_to), the message is its
// first fragment alone (FrameHeader and DirectInfo, into a slot), then its payload in RDMA
// WRITE WITH IMMEDIATE requests from the caller's memory (registered through a cache of its
// own) straight into the window, each spending a credit and a sequence number like a
// fragment. The receiver checks each write's length and that its sink places the message
// exactly where it was written. Such a message is reported sent once its last write has
// completed.
//
// GPUDirect RDMA (compiled, NOT run: needs a GPU and an RDMA NIC): a window may be CUDA device
// memory (Channel::open_device_window, registered through register_gpu_memory() below), and so
// may a direct message's source (Channel::register_device_source, registered once and never
// evicted). Before the last write of a message into a device window is placed, the receiver
// reads one byte of the window back with RDMA READ through a queue pair connected to itself
// (one per device and port, made with the first device window) and tells its sink only once
// that read completed: the adapter completes it after the writes before it reached the GPU's
// memory. A device window takes messages of any size (try_send_direct); a message from
// registered device memory that would go through slots (try_send, or try_send_to below the
// direct size) is refused with kInvalidArgument, as the CPU cannot copy it. The engine's device
// operations use both (docs/architecture.md, "Device memory over RDMA links").
//
// Completion is polled from progress() (polled() is true); wait_spec() returns the completion
// channel's descriptor, armed with ibv_req_notify_cq, so an idle engine may sleep on it.
//
// Errors: a failed work completion is thrown from progress() as dear::Error(kPeerFailed)
// naming the peer and ibv_wc_status_str(); setup failures name the verbs call, the device and
// errno's text.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "dear/bootstrap.h"
#include "transport/link.h"

struct ibv_pd;
struct ibv_mr;

namespace dear::transport::verbs {

struct VerbsOptions {
  // Device, optionally with its port: "mlx5_0" or "mlx5_0:1" (the DEAR_IB_DEVICE override of
  // the communicator). Empty = the first device (in ibv_get_device_list order) with an active
  // port.
  std::string device;
  // GID table index: -1 = automatic (on RoCE a RoCE v2 GID holding an IPv4 address, else
  // RoCE v2, else RoCE v1; on InfiniBand index 0). Set it where the fabric's administrators
  // say so (NCCL_IB_GID_INDEX's equivalent).
  int gid_index = -1;
  // Connection attributes; defaults as NCCL's and documented in qp_plan.h.
  // Local ACK timeout exponent: 4.096 us * 2^timeout (18 = about 1.07 s).
  std::uint8_t timeout = 18;
  // Retransmissions after a timeout (0-7).
  std::uint8_t retry_count = 7;
  // Retries after "receiver not ready" (0-7; 7 = without limit).
  std::uint8_t rnr_retry = 7;
  // Minimum RNR NAK timer field (12 = 0.64 ms).
  std::uint8_t min_rnr_timer = 12;
  // Path MTU in bytes (256, 512, 1024, 2048, 4096); 0 = the port's active MTU, lowered to the
  // peer's.
  std::uint32_t mtu = 0;
  // Service level (InfiniBand) and traffic class (RoCE: DSCP << 2).
  std::uint8_t service_level = 0;
  std::uint8_t traffic_class = 0;
  // Bytes per data slot (prefix included) and data slots per channel and direction.
  std::size_t slot_bytes = 128 * 1024;
  std::uint32_t slots = 8;
  // Messages of at least this many payload bytes whose destination the peer opened as a window
  // (Channel::open_window, try_send_to) are written straight into it with RDMA WRITE from the
  // caller's memory, which saves the sender's copy into staging and the receiver's copy out of
  // its slot; 0: never. The fabric link's default (measured there, not on RDMA hardware).
  std::size_t direct_bytes = 384 * 1024;
  // A direct message's payload goes in writes of at most this many bytes (each spends one of
  // the peer's credits, as a fragment does), and of at most the port's message size.
  std::size_t direct_write_bytes = 4 << 20;
  // Setup must finish by then (it only waits on the bootstrap, whose own timeout also
  // applies).
  std::chrono::steady_clock::time_point deadline = std::chrono::steady_clock::time_point::max();
};

// True when this build has the ibverbs back-end (rdma-core found at configure time).
[[nodiscard]] bool built();

// Names of the RDMA devices this host has ("mlx5_0", ...); empty when none or not built.
[[nodiscard]] std::vector<std::string> devices();

// Why verbs cannot be used here with `options` (no build, no device, the named device or port
// missing or down), or nullopt when it can. With no device: "no RDMA device found
// (ibv_get_device_list returned 0 devices)".
[[nodiscard]] std::optional<std::string> unavailable_reason(const VerbsOptions& options = {});
[[nodiscard]] inline bool available(const VerbsOptions& options = {}) {
  return !unavailable_reason(options).has_value();
}

// Builds `channels` channels to the next and from the previous rank of the ring. Collective
// over the bootstrap (one all_gather of connection records). Throws dear::Error:
// kInvalidArgument (bad options, no usable device: names it and the devices there are),
// kMismatch (ranks chose different channel counts or slot sizes), kSystem (a verbs call
// failed: names it and errno's text).
[[nodiscard]] RingLinks connect_ring(Bootstrap& bootstrap, int channels,
                                     const VerbsOptions& options);

// One channel to each rank in `peers`, in the order of `peers` (channel i reports itself to a
// RecvSink as channel i). Peers are distinct and never this rank; the lists are symmetric (if
// rank a lists b, b lists a). Collective over the bootstrap, each rank with its own list; pairs
// are matched by rank (transport/peer_exchange.h). Throws as connect_ring, plus
// kInvalidArgument for a bad list and kMismatch for a peer that does not list this rank.
[[nodiscard]] std::vector<std::unique_ptr<Channel>> connect_peers(Bootstrap& bootstrap,
                                                                  const std::vector<int>& peers,
                                                                  const VerbsOptions& options);

// A communicator's links: connect_ring() and connect_peers() at once, every queue pair on one
// protection domain and one completion queue (verbs_device.h, CompletionQueue), which each
// engine turn polls once. Collective over the bootstrap, as the two are; throws as they do.
struct Connected {
  RingLinks ring;
  std::vector<std::unique_ptr<Channel>> mesh;
};
[[nodiscard]] Connected connect(Bootstrap& bootstrap, int channels, const std::vector<int>& peers,
                                const VerbsOptions& options);

// ---- GPUDirect RDMA registration (compiled, NOT run: needs a GPU and an RDMA NIC) ----------

enum class GpuPath : std::uint8_t {
  kDmaBuf,       // ibv_reg_dmabuf_mr on a dma-buf exported by the CUDA driver
  kPeerMemory,   // ibv_reg_mr on the device pointer (nvidia-peermem / nv_peer_mem loaded)
  kHostStaging,  // neither works: copy through pinned host memory (cuda/ staging)
};

struct GpuRegistration {
  GpuPath path = GpuPath::kHostStaging;
  ibv_mr* mr = nullptr;  // kDmaBuf, kPeerMemory: release with deregister()
  std::string why;       // kHostStaging: what each attempt answered
};

// Registers `bytes` of CUDA device memory at `addr` for local and remote access on `pd`:
// through `dmabuf_fd` (>= 0, from cuMemGetHandleForAddressRange(CU_MEM_RANGE_HANDLE_TYPE_
// DMA_BUF_FD), `offset` into it) when given, else or when that fails through ibv_reg_mr on
// the device pointer; when both fail the answer is kHostStaging with the reasons. Never
// throws for a failed registration.
[[nodiscard]] GpuRegistration register_gpu_memory(ibv_pd* pd, void* addr, std::size_t bytes,
                                                  int dmabuf_fd = -1, std::uint64_t offset = 0);
// Releases what register_gpu_memory() registered (no-op for kHostStaging).
void deregister(GpuRegistration& registration);

}  // namespace dear::transport::verbs
