// A dear::Communicator over MPI, so that the scheduler's policies (and anything else written
// against the Communicator interface: profile replay, dear-train) run on MPI exactly as they
// run on dear's engine: the same schedule, side by side. Built when MPI is found.
//
// Contract
// - Collective over MPI_COMM_WORLD (duplicated): make_mpi_communicator() initialises MPI
//   (MPI_THREAD_SERIALIZED) unless the program already did, and finalises it when the last
//   communicator it made is destroyed.
// - Every operation becomes one MPI-3 non-blocking collective (MPI_Iallreduce,
//   MPI_Ireduce_scatter_block, MPI_Iallgather, MPI_Ibcast, MPI_Ibarrier), started at once in
//   submission order on the calling thread. MPI has neither priorities nor dear's algorithms:
//   OpOptions::priority and ::algorithm are accepted and ignored, which is what running a
//   policy "above" a library whole operation by whole operation means.
// - Semantics as dear's (NCCL's conventions, in place forms, every dtype and op): fp16 and
//   bf16 reduce with dear's CPU kernels through user-defined MPI operations; avg is a sum
//   divided by the rank count when the operation completes.
// - Progress: one thread per communicator tests the outstanding requests (MPI progresses
//   non-blocking collectives only inside MPI calls) and completes their Work; it sleeps when
//   nothing is outstanding. All MPI calls are serialised by one mutex.
// - Failures: MPI errors are returned, not fatal (MPI_ERRORS_RETURN), and fail the Work with
//   dear::Error naming the MPI call and its error string. An operation past its deadline
//   (OpOptions::timeout, else CommOptions::timeout) fails with kTimeout; MPI cannot cancel a
//   collective, so the communicator then fails every later operation too.
#pragma once

#include <memory>

#include "dear/communicator.h"

namespace dear::scheduler {

// True when this build has MPI support.
[[nodiscard]] bool mpi_built() noexcept;

// The communicator of all MPI ranks (MPI_COMM_WORLD). `options` supplies the timeout (other
// fields do not apply). Throws dear::Error(kInvalidArgument) in a build without MPI.
[[nodiscard]] std::unique_ptr<Communicator> make_mpi_communicator(CommOptions options = {});

}  // namespace dear::scheduler
