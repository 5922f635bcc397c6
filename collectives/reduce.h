// CPU reduction kernels used by the ring algorithms on host buffers.
//
// Element-wise; dst may alias a or b exactly (not partially). Pointers must be aligned to the
// element size. fp16/bf16 are computed in fp32
// and rounded to nearest-even once per call. Integer sums and products wrap modulo 2^bits
// (two's complement), never undefined behaviour. kAvg is a sum whose result is divided by
// `nranks` in reduce_final(); reduce() treats kAvg as kSum (the partial sums of the ring).
#pragma once

#include <cstddef>

#include "dear/types.h"

namespace dear::collectives {

// dst[i] = a[i] op b[i] for i < n.
void reduce(void* dst, const void* a, const void* b, std::size_t n, DataType dtype, ReduceOp op);

// The last reduction of an operation: as reduce(), and for kAvg the result divided by
// `nranks` (integers: truncating division of the wrapped sum; floats: in the element's
// compute type, fp32 for fp16/bf16).
void reduce_final(void* dst, const void* a, const void* b, std::size_t n, DataType dtype,
                  ReduceOp op, int nranks);

// dst[i] = src[i] finished as the only contribution: a copy, divided by nranks for kAvg.
// Used for one-rank communicators.
void finish_single(void* dst, const void* src, std::size_t n, DataType dtype, ReduceOp op,
                   int nranks);

}  // namespace dear::collectives
