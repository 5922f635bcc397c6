// dma-buf export of CUDA device memory, for GPUDirect RDMA: an RDMA adapter registers device
// memory through the dma-buf (ibv_reg_dmabuf_mr; transport::DeviceMemory carries it to a link).
// Compiled everywhere CUDA is; run where a GPU is (tests/test_cuda.cc).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace dear::cuda {

struct DmaBuf {
  int fd = -1;               // the dma-buf's descriptor (the caller closes it); -1: none
  std::uint64_t offset = 0;  // where the memory asked for starts within the dma-buf
  std::string why;           // fd -1: what the driver answered
};

// Exports the device memory [p, p + bytes) (bytes > 0) as a dma-buf through the driver's
// cuMemGetHandleForAddressRange(CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD), the range widened to
// whole host pages, as the driver requires; `offset` is p's distance from the first of them.
// Needs a device with dma-buf support (CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED: on Linux, the
// driver's open kernel modules) and memory from one allocation. fd -1 with the reason
// otherwise (host memory, no driver, no support). Never throws.
[[nodiscard]] DmaBuf export_dmabuf(const void* p, std::size_t bytes) noexcept;

}  // namespace dear::cuda
