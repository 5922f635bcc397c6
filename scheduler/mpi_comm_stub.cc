// Builds without MPI: the MPI communicator reports itself unavailable.
#include "dear/error.h"
#include "scheduler/mpi_comm.h"

namespace dear::scheduler {

bool mpi_built() noexcept { return false; }

std::unique_ptr<Communicator> make_mpi_communicator(CommOptions /*options*/) {
  throw Error(ErrorCode::kInvalidArgument,
              "this build of dear has no MPI support (MPI was not found at configure time)");
}

}  // namespace dear::scheduler
