// Builds without rdma-core: the verbs transport reports itself unavailable.
#include "dear/error.h"
#include "transport/verbs/verbs_link.h"

namespace dear::transport::verbs {
namespace {
constexpr const char* kWhy =
    "this build of dear has no ibverbs transport (libibverbs was not found when it was "
    "configured; install libibverbs-dev (rdma-core) and reconfigure)";
}  // namespace

bool built() { return false; }

std::vector<std::string> devices() { return {}; }

std::optional<std::string> unavailable_reason(const VerbsOptions&) { return std::string(kWhy); }

RingLinks connect_ring(Bootstrap& bootstrap, int, const VerbsOptions&) {
  throw Error(ErrorCode::kInvalidArgument, kWhy, bootstrap.rank());
}

std::vector<std::unique_ptr<Channel>> connect_peers(Bootstrap& bootstrap, const std::vector<int>&,
                                                    const VerbsOptions&) {
  throw Error(ErrorCode::kInvalidArgument, kWhy, bootstrap.rank());
}

Connected connect(Bootstrap& bootstrap, int, const std::vector<int>&, const VerbsOptions&) {
  throw Error(ErrorCode::kInvalidArgument, kWhy, bootstrap.rank());
}

GpuRegistration register_gpu_memory(ibv_pd*, void*, std::size_t, int, std::uint64_t) {
  GpuRegistration r;
  r.why = kWhy;
  return r;
}

void deregister(GpuRegistration& registration) { registration = {}; }

}  // namespace dear::transport::verbs
