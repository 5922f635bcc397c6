// The NCCL communicator (scheduler/nccl_comm.h). Without a CUDA device only its error path
// runs: making it must fail with a clear reason. With devices (one rank per device, ranks as
// threads): collectives on host buffers (staged) and device buffers against reference.h, and
// every policy's profile replay against the single-process SGD reference.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "cuda/device.h"
#include "dear/scheduler/replay.h"
#include "harness.h"
#include "reference.h"
#include "replay_reference.h"
#include "scheduler/nccl_comm.h"

namespace dear::testing {
namespace {

CommFactory nccl_factory() {
  return [](std::unique_ptr<Bootstrap>& boot, CommOptions options) {
    return scheduler::make_nccl_communicator(*boot, std::move(options));
  };
}

int ranks_here() { return std::min(cuda::device_count(), 4); }

#define DEAR_SKIP_WITHOUT_GPU()                                                \
  do {                                                                         \
    if (cuda::device_count() == 0) GTEST_SKIP() << cuda::unavailable_reason(); \
  } while (false)

TEST(NcclCommunicator, WithoutADeviceItSaysSo) {
  if (cuda::device_count() > 0) GTEST_SKIP() << "a CUDA device is present";
  const auto errors = run_ranks_collect(
      1, [](Communicator&) {}, {}, nccl_factory());
  ASSERT_TRUE(errors[0]);
  try {
    std::rethrow_exception(errors[0]);
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find("CUDA device"), std::string::npos) << e.what();
  }
}

TEST(NcclCommunicator, CollectivesOnHostAndDeviceBuffers) {
  DEAR_SKIP_WITHOUT_GPU();
  const int n = ranks_here();
  run_ranks(
      n,
      [&](Communicator& comm) {
        const int r = comm.rank();
        for (const auto t : {DataType::kFloat32, DataType::kInt32, DataType::kFloat16}) {
          for (const auto op : {ReduceOp::kSum, ReduceOp::kMax, ReduceOp::kAvg}) {
            for (const std::size_t count : {std::size_t{1}, std::size_t{1031}}) {
              const std::size_t bytes = count * dtype_size(t);
              std::vector<char> in(bytes);
              for (std::size_t i = 0; i < count; ++i)
                store(in.data(), i, t, input_value(r, i, t, op));
              // Host buffers (staged), then device buffers.
              std::vector<char> out(bytes, 0);
              comm.all_reduce(in.data(), out.data(), count, t, op).wait();
              void* dev = nullptr;
              ASSERT_EQ(cudaMalloc(&dev, bytes), cudaSuccess);
              ASSERT_EQ(cudaMemcpy(dev, in.data(), bytes, cudaMemcpyHostToDevice), cudaSuccess);
              comm.all_reduce(dev, dev, count, t, op).wait();
              std::vector<char> back(bytes, 0);
              ASSERT_EQ(cudaMemcpy(back.data(), dev, bytes, cudaMemcpyDeviceToHost), cudaSuccess);
              cudaFree(dev);
              for (std::size_t i = 0; i < count; ++i) {
                const double want = expected_reduce(i, comm.size(), t, op);
                ASSERT_TRUE(close_enough(load(out.data(), i, t), want, t)) << "host element " << i;
                ASSERT_TRUE(close_enough(load(back.data(), i, t), want, t))
                    << "device element " << i;
              }
            }
          }
        }
        // reduce_scatter in place and all_gather in place on host buffers.
        const std::size_t rc = 257;
        const auto nn = static_cast<std::size_t>(comm.size());
        std::vector<float> rs(rc * nn);
        for (std::size_t i = 0; i < rs.size(); ++i) {
          rs[i] = static_cast<float>(input_value(r, i, DataType::kFloat32, ReduceOp::kSum));
        }
        float* mine = rs.data() + static_cast<std::size_t>(r) * rc;
        comm.reduce_scatter(rs.data(), mine, rc, DataType::kFloat32, ReduceOp::kSum).wait();
        for (std::size_t i = 0; i < rc; ++i) {
          ASSERT_TRUE(close_enough(mine[i],
                                   expected_reduce(static_cast<std::size_t>(r) * rc + i,
                                                   comm.size(), DataType::kFloat32, ReduceOp::kSum),
                                   DataType::kFloat32));
        }
        std::vector<float> ag(rc * nn, 0);
        for (std::size_t i = 0; i < rc; ++i)
          ag[static_cast<std::size_t>(r) * rc + i] = static_cast<float>(r * 1000 + i);
        comm.all_gather(ag.data() + static_cast<std::size_t>(r) * rc, ag.data(), rc,
                        DataType::kFloat32)
            .wait();
        for (int src = 0; src < comm.size(); ++src) {
          for (std::size_t i = 0; i < rc; ++i) {
            ASSERT_EQ(ag[static_cast<std::size_t>(src) * rc + i],
                      static_cast<float>(src * 1000 + i));
          }
        }
        comm.barrier().wait();
      },
      {}, nccl_factory());
}

TEST(NcclCommunicator, ReplayedPoliciesMatchSingleProcessSgd) {
  DEAR_SKIP_WITHOUT_GPU();
  const int n = ranks_here();
  const scheduler::Model model = tiny_model(0, 0);
  scheduler::ReplayOptions opt;
  opt.warmup = 1;
  opt.iterations = 3;
  opt.compute = scheduler::ComputeMode::kNone;
  opt.learning_rate = 0.125F;
  opt.net = loopback_net();
  const auto ref =
      reference_params(model.params(), n, opt.warmup + opt.iterations, opt.learning_rate);
  run_ranks(
      n,
      [&](Communicator& comm) {
        for (const auto& policy : scheduler::policy_names()) {
          const auto r = scheduler::replay(comm, model, policy, opt);
          EXPECT_EQ(
              param_mismatches(r.params, ref, policy + " rank " + std::to_string(comm.rank())), 0);
        }
      },
      {}, nccl_factory());
}

}  // namespace
}  // namespace dear::testing
