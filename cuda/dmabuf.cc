#include "cuda/dmabuf.h"

#include <cuda.h>  // types and flags only: the functions come from the runtime's entry points
#include <unistd.h>

#include "cuda/driver.h"
#include "cuda/memory.h"

namespace dear::cuda {
namespace {

using GetHandle = CUresult (*)(void*, CUdeviceptr, std::size_t, CUmemRangeHandleType,
                               unsigned long long);
using DeviceAttribute = CUresult (*)(int*, CUdevice_attribute, CUdevice);

}  // namespace

DmaBuf export_dmabuf(const void* p, std::size_t bytes) noexcept {
  DmaBuf out;
  if (p == nullptr || bytes == 0) {
    out.why = "nothing to export (null address or zero bytes)";
    return out;
  }
  const Location where = locate(p);
  if (where.kind != MemoryKind::kDevice) {
    out.why = "not CUDA device memory";
    return out;
  }
  auto* attribute = reinterpret_cast<DeviceAttribute>(driver_entry_point("cuDeviceGetAttribute"));
  auto* get_handle =
      reinterpret_cast<GetHandle>(driver_entry_point("cuMemGetHandleForAddressRange"));
  if (attribute == nullptr || get_handle == nullptr) {
    out.why = "the CUDA driver has no cuMemGetHandleForAddressRange";
    return out;
  }
  int supported = 0;
  if (attribute(&supported, CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED, where.device) != CUDA_SUCCESS ||
      supported == 0) {
    out.why = "device " + std::to_string(where.device) +
              " does not export dma-bufs (CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED is 0: the "
              "driver's open kernel modules are needed)";
    return out;
  }
  const auto page = static_cast<std::uintptr_t>(::sysconf(_SC_PAGESIZE));
  const auto at = reinterpret_cast<std::uintptr_t>(p);
  const std::uintptr_t begin = at / page * page;
  const std::uintptr_t end = (at + bytes + page - 1) / page * page;
  int fd = -1;
  const CUresult rc = get_handle(&fd, static_cast<CUdeviceptr>(begin), end - begin,
                                 CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD, 0);
  if (rc != CUDA_SUCCESS || fd < 0) {
    out.why = "cuMemGetHandleForAddressRange failed with CUDA driver error " + std::to_string(rc);
    return out;
  }
  out.fd = fd;
  out.offset = at - begin;
  return out;
}

}  // namespace dear::cuda
