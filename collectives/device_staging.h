// Collectives on CUDA device buffers and on callers' CUDA streams, for transports that can
// only touch host memory (tcp today).
//
// Communicator::create() passes every communicator through with_device_support(). In a build
// with CUDA it returns a wrapper that, per operation:
// - finds where `in` and `out` live (cudaPointerGetAttributes); host buffers without a stream
//   go straight to the wrapped communicator, at the cost of that one query;
// - otherwise queues the operation to one staging thread per communicator, which runs the
//   queued operations one after the other, in issue order: it waits (on the device) for the
//   work already on OpOptions::cuda_stream, stages the operation through pinned host memory,
//   completes the Work and releases the caller's stream. Operations issued while staged ones
//   are queued (host ones included) are queued behind them, so every rank hands the same
//   order to the engine.
// - Staging is pipelined (staging_pieces.h). An all_reduce, reduce_scatter, all_gather or
//   broadcast with at least PieceOptions::min_split_bytes of per-rank data, and a device
//   buffer on this rank, is split into pieces of about PieceOptions::piece_bytes per rank,
//   each a host collective of its own on its part of two pinned regions (input, output; out
//   of place even when the operation is in place; reduce_scatter's input and all_gather's
//   output staged with strided 2-D copies). All copy-ins (device -> pinned) are enqueued at
//   once on a copy-in stream, with an event after each piece; piece i is issued to the wrapped
//   communicator as soon as its event completes, so the network works on piece i while piece
//   i+1 is copied in; when piece i's host collective completes, its copy-out
//   (pinned -> device) is enqueued on a separate copy-out stream, overlapping the later
//   pieces. The Work completes, and the caller's stream is released, when the last copy-out
//   has finished. A failed piece fails the operation with that piece's error (code, peer,
//   sequence; the piece and the operation named), after every issued piece and copy has
//   drained; a rank that cannot issue all its pieces aborts the wrapped communicator, so the
//   peers fail too rather than wait. Smaller operations are one piece, staged as
//   staging_plan.h lays them out. Pieces of one operation overlap each other; operations do
//   not overlap each other.
// - The split depends only on the operation, its count, the element size and PieceOptions,
//   and on whether this rank passes device memory: every rank must pass device memory for a
//   large staged operation, or every rank host memory (a mix hands the engines different
//   sequences, which they report as a mismatch), and every rank must use the same
//   PieceOptions.
// - Status: compiled, and the piece arithmetic simulated on the CPU (tests/test_staging.cc),
//   but this pipelined CUDA path has not yet been run on a GPU; tests/test_cuda.cc holds the
//   device tests that validate it.
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
