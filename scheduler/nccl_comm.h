// A dear::Communicator over NCCL, so that the scheduler's policies (profile replay, dear-train
// --backend nccl) run on NCCL exactly as on dear's engine and on MPI: the same schedule, side by
// side. Built when CUDA and NCCL are found; it needs one CUDA device per rank.
//
// Contract
// - Collective over the bootstrap's ranks: rank 0 makes the NCCL unique id and the bootstrap
//   hands it to every rank (one all_gather). Each rank uses device (local rank mod device
//   count), the local rank from DEAR_LOCAL_RANK or LOCAL_RANK (else the rank).
// - Every operation is one NCCL call on the communicator's stream, in submission order; NCCL
//   has neither priorities nor dear's algorithms, so OpOptions::priority and ::algorithm are
//   accepted and ignored (the policies then run whole operation by whole operation, as the
//   DeAR reference code does above NCCL). Buffers may be device or host memory: host buffers
//   are staged through device memory allocated on the stream, around the NCCL call.
// - Semantics as dear's, which are NCCL's conventions (in-place forms included); every dtype
//   and op (avg is ncclAvg).
// - Progress: one thread polls the operations' completion events and completes their Work.
//   An NCCL or CUDA error fails the Work with dear::Error naming the call and its error string;
//   an operation past its deadline aborts the NCCL communicator (ncclCommAbort) and fails with
//   kTimeout, and every later operation fails too.
//
// Compiled in builds with CUDA and NCCL. Run on one H200 with one rank (tests/test_nccl_comm.cc);
// CI has no GPU, and several ranks need several GPUs.
#pragma once

#include <memory>

#include "dear/bootstrap.h"
#include "dear/communicator.h"

namespace dear::scheduler {

// True when this build has the NCCL back-end.
[[nodiscard]] bool nccl_built() noexcept;

// Collective over `bootstrap`'s ranks. `options` supplies the timeout. Throws
// dear::Error(kInvalidArgument) without NCCL in the build or without a CUDA device, and
// kSystem when NCCL or CUDA fail (naming the call).
[[nodiscard]] std::unique_ptr<Communicator> make_nccl_communicator(Bootstrap& bootstrap,
                                                                   CommOptions options = {});

}  // namespace dear::scheduler
