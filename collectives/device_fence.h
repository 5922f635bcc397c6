// The edges of a device-resident operation (ops.h, OpFence) on CUDA streams; CUDA builds only.
//
// - Input: an event recorded on the caller's stream when the operation is issued (on the legacy
//   default stream without OpOptions::cuda_stream); the engine starts the operation once the
//   event has completed (cudaEventQuery, which never waits).
// - End: each operation has a ticket, in issue order. With a caller's stream, a wait for the
//   ticket goes on that stream at issue (cuda::HostSignal), so later work there waits for the
//   result without the host synchronising the stream. The signal is raised to the highest
//   ticket below which every operation has ended: a stream waits for its own operation and for
//   every device operation issued before it. A fence destroyed before done() (an operation
//   that failed its checks) ends its ticket all the same, so no stream waits for it forever.
#pragma once

#include <memory>

#include "collectives/ops.h"

namespace dear::collectives {

class DeviceTickets;

[[nodiscard]] std::shared_ptr<DeviceTickets> make_device_tickets(int rank);

// Caller's thread, with `device` current. Throws dear::Error naming the CUDA error.
[[nodiscard]] std::unique_ptr<OpFence> make_device_fence(
    const std::shared_ptr<DeviceTickets>& tickets, void* cuda_stream, int device, int rank);

}  // namespace dear::collectives
