// Collectives on CUDA device buffers and on callers' CUDA streams, for transports that can
// only touch host memory (tcp today).
//
// Communicator::create() passes every communicator through with_device_support(). In a build
// with CUDA it returns a wrapper that, per operation:
// - finds where `in` and `out` live (cudaPointerGetAttributes); host buffers without a stream
//   go straight to the wrapped communicator, at the cost of that one query;
// - otherwise puts the whole operation on a CUDA stream at once, in the caller's thread:
//   OpOptions::cuda_stream, or without one the communicator's own stream, made to wait for the
//   work already on the legacy default stream (later work there does not wait for it). On the
//   stream go, per piece, the copy of its input into pinned host memory and a flag; then, per
//   piece, a wait for a ticket and the copy of its result out; then a last flag. Flags and
//   waits are one-thread kernels on mapped pinned memory (DEAR_CUDA_MEMOPS=1: the driver's
//   stream memory operations, see cuda/stream.cc).
// - One staging thread per communicator takes the queued operations in issue order (host ones
//   queued behind staged ones too, so every rank hands the same order to the engine): it hands
//   piece i to the wrapped communicator once its flag is set, publishes piece i's ticket once
//   its host collective completes (the stream then copies it out while later pieces are on the
//   network), and completes the Work when the last flag is set. That thread makes no CUDA call:
//   an operation in flight never depends on a CUDA call that could wait for the device, so a
//   cudaFree elsewhere in the process only waits for it to finish.
// - Staging is pipelined (staging_pieces.h). An all_reduce, reduce_scatter, all_gather or
//   broadcast with at least PieceOptions::min_split_bytes of per-rank data, and a device
//   buffer on this rank, is split into pieces of about PieceOptions::piece_bytes per rank,
//   each a host collective of its own on its part of two pinned regions (input, output; out
//   of place even when the operation is in place; reduce_scatter's input and all_gather's
//   output staged with strided 2-D copies). Smaller operations are one piece, staged as
//   staging_plan.h lays them out. Pieces of one operation overlap each other; operations on
//   one stream do not overlap each other.
// - Pinned memory comes from a pool per communicator: a block serves one operation and is
//   reused once its last flag is set; blocks are freed with the communicator.
// - A failed piece fails the operation with that piece's error (code, peer, sequence; the
//   piece and the operation named), after every issued piece has completed; the stream is
//   released all the same (its copies out then carry no result), and the block is not reused.
//   A rank that cannot issue all its pieces aborts the wrapped communicator, so the peers fail
//   too rather than wait.
// - The split depends only on the operation, its count, the element size and PieceOptions,
//   and on whether this rank passes device memory: every rank must pass device memory for a
//   large staged operation, or every rank host memory (a mix hands the engines different
//   sequences, which they report as a mismatch), and every rank must use the same
//   PieceOptions.
// - Ranks as threads of one process sharing a GPU: a CUDA call that waits for the device
//   (cudaMalloc, cudaFree, a copy to pageable memory) in one rank's thread can wait for another
//   rank's operation, which may need this rank to issue its part first. Such ranks allocate and
//   free only while no operation is in flight (tests/test_cuda.cc does). One rank per process
//   has no such hazard.
// - Status: run on a GPU (one H200, ranks as threads and as processes; tests/test_cuda.cc).
// Without CUDA it returns `comm` unchanged.
#pragma once

#include <memory>

#include "collectives/staging_pieces.h"
#include "dear/communicator.h"

namespace dear::collectives {

// `pieces`: how large staged operations are split (must be the same on every rank).
[[nodiscard]] std::unique_ptr<Communicator> with_device_support(std::unique_ptr<Communicator> comm,
                                                                const PieceOptions& pieces = {});

// True when `p` is CUDA device memory (always false in a build without CUDA, or without a
// device). Pinned, managed and ordinary host memory are all "not device".
[[nodiscard]] bool is_device_pointer(const void* p) noexcept;

}  // namespace dear::collectives
