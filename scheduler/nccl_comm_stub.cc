// Builds without CUDA or NCCL: the NCCL communicator reports itself unavailable.
#include "dear/error.h"
#include "scheduler/nccl_comm.h"

namespace dear::scheduler {

bool nccl_built() noexcept { return false; }

std::unique_ptr<Communicator> make_nccl_communicator(Bootstrap& bootstrap,
                                                     CommOptions /*options*/) {
  throw Error(ErrorCode::kInvalidArgument,
              "this build of dear has no NCCL support (CUDA or NCCL was not found at configure "
              "time)",
              bootstrap.rank());
}

}  // namespace dear::scheduler
