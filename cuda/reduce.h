// Reduction kernels on device memory: the GPU counterparts of collectives/reduce.h.
//
// Contract
// - Element-wise, with the functors of common/reduce_ops.h, so that every element is
//   bit-identical to the CPU kernels' result for the same inputs (fp16/bf16 computed in fp32
//   and rounded once, integer sums and products wrapping, IEEE minimum/maximum).
// - dst may alias a or b exactly, never partially. Pointers are device pointers aligned to the
//   element size; 16-byte vector loads are used when dst, a and b share their offset modulo
//   16, scalar loads for the unaligned head and tail and otherwise.
// - Asynchronous: the kernel is launched on `stream` and the call returns. A launch failure
//   (or an earlier sticky error) throws dear::Error(kSystem) naming the CUDA error; invalid
//   arguments throw dear::Error(kInvalidArgument) naming the argument.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>

#include "dear/types.h"

namespace dear::cuda {

// dst[i] = a[i] op b[i]; kAvg reduces as kSum (a partial sum of the ring).
void reduce(void* dst, const void* a, const void* b, std::size_t n, DataType dtype, ReduceOp op,
            cudaStream_t stream);

// The last reduction of an operation: as reduce(), and for kAvg divided by `nranks`
// (as collectives::reduce_final).
void reduce_final(void* dst, const void* a, const void* b, std::size_t n, DataType dtype,
                  ReduceOp op, int nranks, cudaStream_t stream);

}  // namespace dear::cuda
