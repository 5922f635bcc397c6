#include "cuda/stream.h"

#include <cuda.h>  // types and flags only: the functions come from the runtime's entry points

#include <atomic>
#include <cstdlib>
#include <limits>
#include <string_view>

#include "cuda/driver.h"
#include "cuda/error.h"
#include "cuda/memory.h"

namespace dear::cuda {
namespace {

using StreamValue64 = CUresult (*)(CUstream, CUdeviceptr, cuuint64_t, unsigned int);
using DeviceAttribute = CUresult (*)(int*, CUdevice_attribute, CUdevice);

// The driver's stream memory operations, with DEAR_CUDA_MEMOPS=1 where the device has them:
// a wait on a value in mapped memory is then done by the GPU's front end, with no kernel
// occupying the device (a spinning kernel keeps its context busy, which the time-sliced
// contexts of other processes on the same GPU pay for: on one H200 with two processes, an 8-byte
// all_reduce took 0.39 ms with them against 2.7 ms with the kernels). Not the default: with four
// ranks as threads of one process, one rank's copy never ran while the others' streams waited
// (twice; presumably a wait holds up a hardware queue it shares with other streams), and the
// kernels never hung.
struct MemOps {
  StreamValue64 wait = nullptr;
  StreamValue64 write = nullptr;
};

MemOps find_memops() {
  const char* env = std::getenv("DEAR_CUDA_MEMOPS");
  if (env == nullptr || std::string_view(env) != "1") return {};
  auto* attribute = reinterpret_cast<DeviceAttribute>(driver_entry_point("cuDeviceGetAttribute"));
  int device = 0;
  int usable = 0;
  if (attribute == nullptr || cudaGetDevice(&device) != cudaSuccess ||
      attribute(&usable, CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS, device) !=
          CUDA_SUCCESS ||
      usable == 0) {
    (void)cudaGetLastError();
    return {};
  }
  MemOps ops;
  ops.wait = reinterpret_cast<StreamValue64>(driver_entry_point("cuStreamWaitValue64"));
  ops.write = reinterpret_cast<StreamValue64>(driver_entry_point("cuStreamWriteValue64"));
  if (ops.wait == nullptr || ops.write == nullptr) return {};
  return ops;
}

const MemOps& memops() {
  static const MemOps ops = find_memops();
  return ops;
}

// Calls a stream memory operation `fn` on `addr`; false (nothing enqueued) when the driver's
// operations are not in use.
bool stream_memop(StreamValue64 fn, cudaStream_t stream, const void* addr, std::uint64_t value,
                  unsigned flags, const char* what) {
  if (fn == nullptr) return false;
  const CUresult rc =
      fn(reinterpret_cast<CUstream>(stream), reinterpret_cast<CUdeviceptr>(addr), value, flags);
  if (rc != CUDA_SUCCESS) {
    throw Error(ErrorCode::kSystem,
                std::string(what) + " failed with CUDA driver error " + std::to_string(rc));
  }
  return true;
}

}  // namespace

bool uses_stream_memops() { return memops().wait != nullptr; }

void set_flag(unsigned long long* device_flag, unsigned long long value, cudaStream_t stream) {
  // The default flags order the write after every earlier write of the stream.
  if (!stream_memop(memops().write, stream, device_flag, value, CU_STREAM_WRITE_VALUE_DEFAULT,
                    "cuStreamWriteValue64")) {
    enqueue_set_flag(device_flag, value, stream);
  }
}

HostSignal::HostSignal() {
  const MappedMemory m = alloc_mapped(sizeof(unsigned long long), "the stream signal");
  host_ = static_cast<unsigned long long*>(m.host);
  *host_ = 0;
  device_ = static_cast<unsigned long long*>(m.device);
}

HostSignal::~HostSignal() {
  // The largest value every wait accepts: the driver compares (int64_t)(counter - target).
  publish(static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max()));
  // A kernel may still be polling; let every stream see the final value before the memory goes.
  (void)cudaDeviceSynchronize();
  (void)cudaFreeHost(host_);
}

void HostSignal::enqueue_wait(cudaStream_t stream, std::uint64_t target) {
  if (!stream_memop(memops().wait, stream, device_, target, CU_STREAM_WAIT_VALUE_GEQ,
                    "cuStreamWaitValue64")) {
    enqueue_wait_counter(device_, target, stream);
  }
}

void HostSignal::publish(std::uint64_t value) noexcept {
  // Everything the host wrote before (staged results already copied to the device) happens
  // before a stream that sees the value runs on.
  std::atomic_ref<unsigned long long>(*host_).store(value, std::memory_order_release);
}

}  // namespace dear::cuda
