#include "cuda/stream.h"

#include <cuda.h>  // types and flags only: the functions come from the runtime's entry points

#include <atomic>
#include <cstdlib>
#include <limits>
#include <string_view>

#include "cuda/error.h"

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

void* entry_point(const char* symbol) {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult found{};
  if (cudaGetDriverEntryPointByVersion(symbol, &fn, 12000, cudaEnableDefault, &found) !=
          cudaSuccess ||
      found != cudaDriverEntryPointSuccess) {
    (void)cudaGetLastError();
    return nullptr;
  }
  return fn;
}

MemOps find_memops() {
  const char* env = std::getenv("DEAR_CUDA_MEMOPS");
  if (env == nullptr || std::string_view(env) != "1") return {};
  auto* attribute = reinterpret_cast<DeviceAttribute>(entry_point("cuDeviceGetAttribute"));
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
  ops.wait = reinterpret_cast<StreamValue64>(entry_point("cuStreamWaitValue64"));
  ops.write = reinterpret_cast<StreamValue64>(entry_point("cuStreamWriteValue64"));
  if (ops.wait == nullptr || ops.write == nullptr) return {};
  return ops;
}

const MemOps& memops() {
  static const MemOps ops = find_memops();
  return ops;
}

void check_driver(CUresult rc, const char* what) {
  if (rc == CUDA_SUCCESS) return;
  throw Error(ErrorCode::kSystem,
              std::string(what) + " failed with CUDA driver error " + std::to_string(rc));
}

}  // namespace

bool uses_stream_memops() { return memops().wait != nullptr; }

void set_flag(unsigned long long* device_flag, unsigned long long value, cudaStream_t stream) {
  if (const MemOps& ops = memops(); ops.write != nullptr) {
    // The default flags order the write after every earlier write of the stream.
    check_driver(ops.write(reinterpret_cast<CUstream>(stream),
                           reinterpret_cast<CUdeviceptr>(device_flag), value,
                           CU_STREAM_WRITE_VALUE_DEFAULT),
                 "cuStreamWriteValue64");
    return;
  }
  enqueue_set_flag(device_flag, value, stream);
}

HostSignal::HostSignal() {
  void* p = nullptr;
  check(cudaHostAlloc(&p, sizeof(unsigned long long), cudaHostAllocMapped | cudaHostAllocPortable),
        "cudaHostAlloc of the stream signal");
  host_ = static_cast<unsigned long long*>(p);
  *host_ = 0;
  void* d = nullptr;
  const cudaError_t rc = cudaHostGetDevicePointer(&d, p, 0);
  if (rc != cudaSuccess) {
    (void)cudaFreeHost(p);
    check(rc, "cudaHostGetDevicePointer of the stream signal");
  }
  device_ = static_cast<unsigned long long*>(d);
}

HostSignal::~HostSignal() {
  // The largest value every wait accepts: the driver compares (int64_t)(counter - target).
  publish(static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max()));
  // A kernel may still be polling; let every stream see the final value before the memory goes.
  (void)cudaDeviceSynchronize();
  (void)cudaFreeHost(host_);
}

void HostSignal::enqueue_wait(cudaStream_t stream, std::uint64_t target) {
  if (const MemOps& ops = memops(); ops.wait != nullptr) {
    check_driver(ops.wait(reinterpret_cast<CUstream>(stream),
                          reinterpret_cast<CUdeviceptr>(device_), target,
                          CU_STREAM_WAIT_VALUE_GEQ),
                 "cuStreamWaitValue64");
    return;
  }
  enqueue_wait_counter(device_, target, stream);
}

void HostSignal::publish(std::uint64_t value) noexcept {
  // Everything the host wrote before (staged results already copied to the device) happens
  // before a stream that sees the value runs on.
  std::atomic_ref<unsigned long long>(*host_).store(value, std::memory_order_release);
}

}  // namespace dear::cuda
