// The network cost model: every ring step costs alpha + beta * bytes on each link.
//
// A ring reduce-scatter or all-gather of E elements on N ranks takes N-1 steps, an all-reduce
// 2(N-1); each step moves one chunk of ceil(E/N) elements over every link at once. Because
// the ring is symmetric, the simulator follows one representative link.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace dear::scheduler {

struct NetModel {
  std::string name;
  double alpha_s = 0;          // per ring step: software + wire latency before data moves on
  double beta_s_per_byte = 0;  // 1 / sustained payload bandwidth of one link
  // The part of alpha that occupies the sender (per-message CPU and NIC work): dear's engine
  // pays it for every slice and cannot fill it with other operations' slices, while the
  // rest of alpha is flight time that other operations' slices may use.
  double gap_s = 0;
  // Software cost of one operation beyond its steps: from issue until its first step may
  // start (submission, the engine taking it up, the waiter seeing it end). Measured on the
  // job's ranks by calibrate_network() as a one-element all_reduce's time beyond its
  // 2(N-1) alphas; 0 for the built-in networks, whose alpha already holds their software.
  double op_overhead_s = 0;
  // A worker that blocked waiting for an operation goes on this long after the operation
  // ended: its thread wakes up, and the operation it issues next cannot move before the last
  // rank has issued it too. Measured by calibrate_network() as the period of a chain of
  // dependent all-gathers (each issued when the previous one's wait returns, as a forward
  // pass issues them) beyond the same all-gather's time alone; 0 for the built-in networks.
  double wake_s = 0;
  std::int64_t slice_bytes = 512 * 1024;  // engine pipelining unit (CommOptions default)
};

// 10 Gb/s Ethernet with TCP: 9.4 Gb/s of payload after Ethernet/IP/TCP framing; 50 us per
// step for the kernel socket path and a proxy thread on each side of a hop, of which 10 us
// keep the sender busy.
[[nodiscard]] NetModel net_10gbe();
// 100 Gb/s InfiniBand EDR with RDMA: about 11.5 GB/s of payload as NCCL reaches on EDR;
// 6 us per step (verbs latency plus the engine's turn-around), 1.5 us of it sender work.
[[nodiscard]] NetModel net_100gib();
// "10gbe" or "100gib"; nullopt otherwise.
[[nodiscard]] std::optional<NetModel> net_by_name(std::string_view name);

enum class OpKind : std::uint8_t { kReduceScatter, kAllGather, kAllReduce };
[[nodiscard]] const char* to_string(OpKind kind) noexcept;

[[nodiscard]] int ring_steps(OpKind kind, int ranks);
// Bytes one step moves over one link.
[[nodiscard]] std::int64_t ring_chunk_bytes(std::int64_t elements, int ranks, int element_bytes);
// Time of one operation alone on an idle link (op_overhead_s included).
[[nodiscard]] double op_time(const NetModel& net, OpKind kind, std::int64_t elements, int ranks,
                             int element_bytes);

}  // namespace dear::scheduler
