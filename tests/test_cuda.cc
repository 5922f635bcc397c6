// GPU tests: the reduction kernels against the CPU kernels for every dtype x op, collectives
// on device buffers with ranks as threads sharing one GPU, and stream ordering. Every test
// skips with "no CUDA device" where none is present.
#include <cuda_runtime_api.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <barrier>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <random>
#include <thread>
#include <tuple>
#include <vector>

#include "channel_exchange.h"
#include "collectives/device_staging.h"
#include "collectives/ops.h"
#include "collectives/reduce.h"
#include "collectives/staging_pieces.h"
#include "cuda/device.h"
#include "cuda/dmabuf.h"
#include "cuda/error.h"
#include "cuda/reduce.h"
#include "harness.h"
#include "reference.h"
#include "transport/fabric/fabric_link.h"
#include "transport/verbs/verbs_link.h"

namespace dear {
namespace {

using dear::testing::expected_reduce;
using dear::testing::input_value;

void ck(cudaError_t rc, const char* what) { cuda::check(rc, what); }

class DeviceBuffer {
 public:
  explicit DeviceBuffer(std::size_t bytes) {
    ck(cudaMalloc(&p_, std::max<std::size_t>(bytes, 1)), "cudaMalloc");
  }
  ~DeviceBuffer() { (void)cudaFree(p_); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  [[nodiscard]] std::byte* get() const { return static_cast<std::byte*>(p_); }

 private:
  void* p_ = nullptr;
};

class Gpu : public ::testing::Test {
 protected:
  void SetUp() override {
    if (cuda::device_count() == 0) {
      GTEST_SKIP() << "no CUDA device (" << cuda::unavailable_reason() << ")";
    }
  }
};

// Ranks here are threads of one process sharing one GPU. CUDA's allocation calls may wait for
// the whole device, a stream's wait for another rank's operation included, so every rank
// allocates before its fence is built and frees after it is gone: in between, no rank
// allocates or frees while another has an operation in flight.
class RankFence {
 public:
  explicit RankFence(std::barrier<>& b) : b_(b) { b_.arrive_and_wait(); }
  ~RankFence() { b_.arrive_and_wait(); }
  RankFence(const RankFence&) = delete;
  RankFence& operator=(const RankFence&) = delete;

 private:
  std::barrier<>& b_;
};

// Equal bytes; for floating types also two NaNs, whose payload IEEE 754 leaves to the
// hardware (the GPU returns its canonical NaN where the CPU keeps an input's payload).
bool same_element(const std::byte* want, const std::byte* got, DataType t) {
  if (std::memcmp(want, got, dtype_size(t)) == 0) return true;
  const bool floating = t == DataType::kFloat16 || t == DataType::kBFloat16 ||
                        t == DataType::kFloat32 || t == DataType::kFloat64;
  return floating && std::isnan(dear::testing::load(want, 0, t)) &&
         std::isnan(dear::testing::load(got, 0, t));
}

constexpr DataType kTypes[] = {DataType::kInt8,    DataType::kUint8,   DataType::kInt32,
                               DataType::kInt64,   DataType::kFloat16, DataType::kBFloat16,
                               DataType::kFloat32, DataType::kFloat64};
constexpr ReduceOp kOps[] = {ReduceOp::kSum, ReduceOp::kProd, ReduceOp::kMin, ReduceOp::kMax,
                             ReduceOp::kAvg};

// ---- kernels ----------------------------------------------------------------------------------

TEST_F(Gpu, KernelsMatchTheCpuKernelsBitForBit) {
  std::mt19937_64 rng(3);
  // Sizes around the vector width; offsets that keep, break and shift the 16-byte alignment.
  const std::size_t sizes[] = {1, 7, 31, 4096 + 5, 1000003};
  struct Offsets {
    std::size_t d, a, b;
  };
  const Offsets offsets[] = {{0, 0, 0}, {1, 1, 1}, {0, 1, 2}, {3, 0, 0}};
  for (const DataType t : kTypes) {
    const std::size_t el = dtype_size(t);
    for (const std::size_t n : sizes) {
      const std::size_t pad = 4 * el;
      std::vector<std::byte> a(n * el + pad), b(n * el + pad);
      for (auto& x : a) x = static_cast<std::byte>(rng());
      for (auto& x : b) x = static_cast<std::byte>(rng());
      DeviceBuffer da(a.size()), db(b.size()), dd(a.size());
      ck(cudaMemcpy(da.get(), a.data(), a.size(), cudaMemcpyHostToDevice), "copy a");
      ck(cudaMemcpy(db.get(), b.data(), b.size(), cudaMemcpyHostToDevice), "copy b");
      for (const ReduceOp op : kOps) {
        for (const Offsets& o : offsets) {
          const int nranks = 3;
          std::vector<std::byte> want(n * el), got(n * el);
          collectives::reduce_final(want.data(), a.data() + o.a * el, b.data() + o.b * el, n, t, op,
                                    nranks);
          cuda::reduce_final(dd.get() + o.d * el, da.get() + o.a * el, db.get() + o.b * el, n, t,
                             op, nranks, nullptr);
          ck(cudaDeviceSynchronize(), "reduce_final kernel");
          ck(cudaMemcpy(got.data(), dd.get() + o.d * el, got.size(), cudaMemcpyDeviceToHost),
             "copy result");
          for (std::size_t i = 0; i < n; ++i) {
            ASSERT_TRUE(same_element(want.data() + i * el, got.data() + i * el, t))
                << to_string(t) << " " << to_string(op) << " n=" << n << " offsets " << o.d << ","
                << o.a << "," << o.b << " element " << i;
          }
        }
        // Partial sums (reduce): kAvg is a plain sum; dst aliasing a.
        std::vector<std::byte> want(n * el), got(n * el);
        collectives::reduce(want.data(), a.data(), b.data(), n, t, op);
        DeviceBuffer alias(n * el);
        ck(cudaMemcpy(alias.get(), a.data(), n * el, cudaMemcpyHostToDevice), "copy a");
        cuda::reduce(alias.get(), alias.get(), db.get(), n, t, op, nullptr);
        ck(cudaMemcpy(got.data(), alias.get(), n * el, cudaMemcpyDeviceToHost), "copy result");
        for (std::size_t i = 0; i < n; ++i) {
          ASSERT_TRUE(same_element(want.data() + i * el, got.data() + i * el, t))
              << to_string(t) << " " << to_string(op) << " in place, n=" << n << " element " << i;
        }
      }
    }
  }
}

TEST_F(Gpu, KernelArgumentErrorsNameTheArgument) {
  try {
    cuda::reduce(nullptr, nullptr, nullptr, 4, DataType::kFloat32, ReduceOp::kSum, nullptr);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find("dst"), std::string::npos);
  }
  EXPECT_NO_THROW(
      cuda::reduce(nullptr, nullptr, nullptr, 0, DataType::kFloat32, ReduceOp::kSum, nullptr));
}

// ---- collectives on device buffers -------------------------------------------------------------

void fill_device(std::byte* dev, std::size_t n, int rank, DataType t, ReduceOp op, int salt) {
  std::vector<std::byte> host(n * dtype_size(t));
  for (std::size_t i = 0; i < n; ++i) {
    dear::testing::store(host.data(), i, t, input_value(rank, i, t, op, salt));
  }
  ck(cudaMemcpy(dev, host.data(), host.size(), cudaMemcpyHostToDevice), "fill input");
}

std::vector<std::byte> to_host(const std::byte* dev, std::size_t bytes) {
  std::vector<std::byte> host(bytes);
  ck(cudaMemcpy(host.data(), dev, bytes, cudaMemcpyDeviceToHost), "read result");
  return host;
}

// An input that arrives late on a stream: a host function sleeps `delay_ms`, then writes
// rank + i % period into pinned `staged`, which is then copied to the device, all on `stream`.
// Lives until the stream has run it.
struct LateInput {
  float* staged;
  std::size_t n;
  int rank;
  int period;
  int delay_ms;

  void enqueue(cudaStream_t stream, std::byte* dev) {
    ck(cudaLaunchHostFunc(
           stream,
           [](void* arg) {
             const auto* in = static_cast<const LateInput*>(arg);
             std::this_thread::sleep_for(std::chrono::milliseconds(in->delay_ms));
             for (std::size_t i = 0; i < in->n; ++i) {
               in->staged[i] = static_cast<float>(in->rank + static_cast<int>(i % in->period));
             }
           },
           this),
       "cudaLaunchHostFunc");
    ck(cudaMemcpyAsync(dev, staged, n * sizeof(float), cudaMemcpyHostToDevice, stream), "copy in");
  }
};

// Every device test runs twice: device-resident (the default: the engine reduces on the device
// slice by slice) and staged (CommOptions::cuda_staging: whole operations through host memory).
class GpuRanks : public Gpu, public ::testing::WithParamInterface<std::tuple<int, bool>> {
 protected:
  [[nodiscard]] int ranks() const { return std::get<0>(GetParam()); }
  [[nodiscard]] CommOptions comm_options() const {
    CommOptions o;
    o.cuda_staging = std::get<1>(GetParam());
    return o;
  }
};

TEST_P(GpuRanks, AllReduceOnDeviceBuffers) {
  const int n = ranks();
  std::barrier<> sync(n);
  dear::testing::run_ranks(
      n,
      [&](Communicator& comm) {
        ck(cudaSetDevice(0), "cudaSetDevice");
        constexpr std::size_t kMaxCount = 300000;
        DeviceBuffer in(kMaxCount * 8), out(kMaxCount * 8);
        const RankFence fence(sync);
        for (const DataType t : kTypes) {
          for (const ReduceOp op : kOps) {
            for (const std::size_t count : {std::size_t{1}, std::size_t{1000}, kMaxCount}) {
              const std::size_t bytes = count * dtype_size(t);
              fill_device(in.get(), count, comm.rank(), t, op, 1);
              comm.all_reduce(in.get(), out.get(), count, t, op).wait();
              const auto got = to_host(out.get(), bytes);
              for (std::size_t i = 0; i < count; ++i) {
                const double want = expected_reduce(i, n, t, op, 1);
                const double g = dear::testing::load(got.data(), i, t);
                ASSERT_TRUE(dear::testing::close_enough(g, want, t))
                    << to_string(t) << " " << to_string(op) << " count " << count << " element "
                    << i << ": got " << g << " want " << want;
              }
              // In place.
              comm.all_reduce(in.get(), in.get(), count, t, op).wait();
              const auto again = to_host(in.get(), bytes);
              ASSERT_EQ(std::memcmp(again.data(), got.data(), bytes), 0) << "in place differs";
            }
          }
        }
      },
      comm_options());
}

TEST_P(GpuRanks, ReduceScatterAllGatherBroadcastOnDeviceBuffers) {
  const int n = ranks();
  std::barrier<> sync(n);
  dear::testing::run_ranks(
      n,
      [&](Communicator& comm) {
        ck(cudaSetDevice(0), "cudaSetDevice");
        const DataType t = DataType::kFloat32;
        const std::size_t block = 50001;
        const auto nn = static_cast<std::size_t>(n);
        const auto r = static_cast<std::size_t>(comm.rank());
        DeviceBuffer big(block * nn * 4), small(block * 4);
        const RankFence fence(sync);
        // reduce_scatter, out of place then in place.
        fill_device(big.get(), block * nn, comm.rank(), t, ReduceOp::kSum, 2);
        comm.reduce_scatter(big.get(), small.get(), block, t, ReduceOp::kSum).wait();
        auto got = to_host(small.get(), block * 4);
        for (std::size_t i = 0; i < block; ++i) {
          ASSERT_EQ(dear::testing::load(got.data(), i, t),
                    expected_reduce(r * block + i, n, t, ReduceOp::kSum, 2))
              << "reduce_scatter element " << i;
        }
        comm.reduce_scatter(big.get(), big.get() + r * block * 4, block, t, ReduceOp::kSum).wait();
        const auto in_place = to_host(big.get() + r * block * 4, block * 4);
        ASSERT_EQ(std::memcmp(in_place.data(), got.data(), block * 4), 0);
        // all_gather: rank q contributes input_value(q, i).
        fill_device(small.get(), block, comm.rank(), t, ReduceOp::kSum, 3);
        comm.all_gather(small.get(), big.get(), block, t).wait();
        got = to_host(big.get(), block * nn * 4);
        for (int q = 0; q < n; ++q) {
          for (std::size_t i = 0; i < block; ++i) {
            ASSERT_EQ(dear::testing::load(got.data(), static_cast<std::size_t>(q) * block + i, t),
                      input_value(q, i, t, ReduceOp::kSum, 3))
                << "all_gather block " << q << " element " << i;
          }
        }
        // broadcast from the last rank, device in and out.
        fill_device(small.get(), block, comm.rank(), t, ReduceOp::kSum, 4);
        comm.broadcast(small.get(), big.get(), block, t, n - 1).wait();
        got = to_host(big.get(), block * 4);
        for (std::size_t i = 0; i < block; ++i) {
          ASSERT_EQ(dear::testing::load(got.data(), i, t),
                    input_value(n - 1, i, t, ReduceOp::kSum, 4));
        }
      },
      comm_options());
}

// Large operations are split into pieces pipelined through pinned memory (staging_pieces.h):
// about 9 MiB per rank with the default 4 MiB pieces makes three uneven pieces, each a host
// collective of its own; reduce_scatter's input and all_gather's output go through strided
// copies. Out of place and in place, then on a stream.
TEST_F(Gpu, LargeOperationsArePipelinedInPieces) {
  const int n = 2;
  std::barrier<> sync(n);
  CommOptions staged;
  staged.cuda_staging = true;  // the pieces are the staging path's
  dear::testing::run_ranks(
      n,
      [&](Communicator& comm) {
        ck(cudaSetDevice(0), "cudaSetDevice");
        const DataType t = DataType::kFloat32;
        const std::size_t count = (9u << 20) / 4 + 5;  // per rank: not a multiple of the pieces
        ASSERT_EQ(collectives::piece_count(collectives::StagedKind::kAllReduce, count, 4, {}), 3u);
        const auto nn = static_cast<std::size_t>(n);
        const auto r = static_cast<std::size_t>(comm.rank());
        const std::size_t bytes = count * 4;
        DeviceBuffer big(bytes * nn), small(bytes);
        cudaStream_t stream = nullptr;
        ck(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
        // Pinned, so that the read on the stream below does not block this thread inside CUDA
        // (a copy to pageable memory does, and the other rank's next CUDA call would wait for it).
        std::byte* read_back = nullptr;
        ck(cudaMallocHost(reinterpret_cast<void**>(&read_back), bytes), "cudaMallocHost");
        std::optional<RankFence> fence(std::in_place, sync);
        const auto check_reduced = [&](const std::vector<std::byte>& got, std::size_t first,
                                       int salt, const char* what) {
          for (std::size_t i = 0; i < count; ++i) {
            ASSERT_EQ(dear::testing::load(got.data(), i, t),
                      expected_reduce(first + i, n, t, ReduceOp::kSum, salt))
                << what << " element " << i;
          }
        };
        // all_reduce, out of place and in place.
        fill_device(small.get(), count, comm.rank(), t, ReduceOp::kSum, 5);
        comm.all_reduce(small.get(), big.get(), count, t, ReduceOp::kSum).wait();
        check_reduced(to_host(big.get(), bytes), 0, 5, "all_reduce");
        comm.all_reduce(small.get(), small.get(), count, t, ReduceOp::kSum).wait();
        check_reduced(to_host(small.get(), bytes), 0, 5, "in-place all_reduce");
        // reduce_scatter, out of place and in place.
        fill_device(big.get(), count * nn, comm.rank(), t, ReduceOp::kSum, 6);
        comm.reduce_scatter(big.get(), small.get(), count, t, ReduceOp::kSum).wait();
        check_reduced(to_host(small.get(), bytes), r * count, 6, "reduce_scatter");
        comm.reduce_scatter(big.get(), big.get() + r * bytes, count, t, ReduceOp::kSum).wait();
        check_reduced(to_host(big.get() + r * bytes, bytes), r * count, 6,
                      "in-place reduce_scatter");
        // all_gather, out of place and in place: rank q contributes input_value(q, i).
        const auto check_gathered = [&](const std::vector<std::byte>& got, const char* what) {
          for (int q = 0; q < n; ++q) {
            for (std::size_t i = 0; i < count; ++i) {
              ASSERT_EQ(dear::testing::load(got.data(), static_cast<std::size_t>(q) * count + i, t),
                        input_value(q, i, t, ReduceOp::kSum, 7))
                  << what << " block " << q << " element " << i;
            }
          }
        };
        fill_device(small.get(), count, comm.rank(), t, ReduceOp::kSum, 7);
        ck(cudaMemset(big.get(), 0xff, bytes * nn), "poison out");
        comm.all_gather(small.get(), big.get(), count, t).wait();
        check_gathered(to_host(big.get(), bytes * nn), "all_gather");
        ck(cudaMemset(big.get(), 0xff, bytes * nn), "poison out");
        fill_device(big.get() + r * bytes, count, comm.rank(), t, ReduceOp::kSum, 7);
        comm.all_gather(big.get() + r * bytes, big.get(), count, t).wait();
        check_gathered(to_host(big.get(), bytes * nn), "in-place all_gather");
        // broadcast from rank 1, then an all_reduce ordered on a stream.
        fill_device(small.get(), count, comm.rank(), t, ReduceOp::kSum, 8);
        comm.broadcast(small.get(), small.get(), count, t, 1).wait();
        const auto b = to_host(small.get(), bytes);
        for (std::size_t i = 0; i < count; ++i) {
          ASSERT_EQ(dear::testing::load(b.data(), i, t), input_value(1, i, t, ReduceOp::kSum, 8))
              << "broadcast element " << i;
        }
        fill_device(small.get(), count, comm.rank(), t, ReduceOp::kSum, 9);
        ck(cudaMemsetAsync(big.get(), 0xff, bytes, stream), "poison out on the stream");
        OpOptions o;
        o.cuda_stream = stream;
        Work w = comm.all_reduce(small.get(), big.get(), count, t, ReduceOp::kSum, o);
        ck(cudaMemcpyAsync(read_back, big.get(), bytes, cudaMemcpyDeviceToHost, stream),
           "read the result on the stream");
        ck(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
        check_reduced(std::vector<std::byte>(read_back, read_back + bytes), 0, 9,
                      "all_reduce on a stream");
        EXPECT_TRUE(w.wait(std::chrono::seconds(30)));
        fence.reset();
        (void)cudaFreeHost(read_back);
        (void)cudaStreamDestroy(stream);
      },
      staged);
}

// all_to_all and scatter keep their exchanges in host memory: device buffers are staged in
// pieces, each covering the same range of every block (collectives/staging_pieces.h). Three
// ranks, blocks not a multiple of the pieces, out of place and in place, every element checked.
TEST_F(Gpu, AllToAllAndScatterArePipelinedInPieces) {
  const int n = 3;
  std::barrier<> sync(n);
  dear::testing::run_ranks(n, [&](Communicator& comm) {
    ck(cudaSetDevice(0), "cudaSetDevice");
    const DataType t = DataType::kFloat32;
    const std::size_t count = (9u << 20) / 4 + 5;  // per block
    ASSERT_EQ(collectives::piece_count(collectives::StagedKind::kAllToAll, count, 4, {}), 3u);
    const auto nn = static_cast<std::size_t>(n);
    const auto r = static_cast<std::size_t>(comm.rank());
    const std::size_t block = count * 4;
    DeviceBuffer in(block * nn), out(block * nn);
    const RankFence fence(sync);
    // Block q of rank r's result is block r of rank q's input: element i of rank q's input is
    // input_value(q, i).
    const auto check_exchanged = [&](const std::vector<std::byte>& got, const char* what) {
      for (std::size_t q = 0; q < nn; ++q) {
        for (std::size_t i = 0; i < count; ++i) {
          ASSERT_EQ(dear::testing::load(got.data(), q * count + i, t),
                    input_value(static_cast<int>(q), r * count + i, t, ReduceOp::kSum, 11))
              << what << " block " << q << " element " << i;
        }
      }
    };
    fill_device(in.get(), count * nn, comm.rank(), t, ReduceOp::kSum, 11);
    ck(cudaMemset(out.get(), 0xff, block * nn), "poison out");
    comm.all_to_all(in.get(), out.get(), count, t).wait();
    check_exchanged(to_host(out.get(), block * nn), "all_to_all");
    comm.all_to_all(in.get(), in.get(), count, t).wait();
    check_exchanged(to_host(in.get(), block * nn), "in-place all_to_all");
    // scatter from rank 1, out of place and in place (the root's own block inside its input).
    const int root = 1;
    for (const bool in_place : {false, true}) {
      fill_device(in.get(), count * nn, comm.rank(), t, ReduceOp::kSum, 12);
      ck(cudaMemset(out.get(), 0xff, block * nn), "poison out");
      std::byte* dst = in_place && comm.rank() == root ? in.get() + r * block : out.get();
      comm.scatter(in.get(), dst, count, t, root).wait();
      const auto got = to_host(dst, block);
      for (std::size_t i = 0; i < count; ++i) {
        ASSERT_EQ(dear::testing::load(got.data(), i, t),
                  input_value(root, r * count + i, t, ReduceOp::kSum, 12))
            << (in_place ? "in-place scatter" : "scatter") << " element " << i;
      }
    }
  });
}

// The operation must read its input only after the work before it on the stream, and work
// after it on the stream must see its result, with no host synchronisation in between. The
// input is written by a host function that sleeps first, then copied in on the stream.
TEST_P(GpuRanks, StreamOrdering) {
  const int n = ranks();
  std::barrier<> sync(n);
  dear::testing::run_ranks(
      n,
      [&](Communicator& comm) {
        ck(cudaSetDevice(0), "cudaSetDevice");
        const std::size_t count = 1 << 20;
        const std::size_t bytes = count * 4;
        cudaStream_t stream = nullptr;
        ck(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
        float* staged_in = nullptr;
        float* result = nullptr;
        ck(cudaMallocHost(reinterpret_cast<void**>(&staged_in), bytes), "cudaMallocHost");
        ck(cudaMallocHost(reinterpret_cast<void**>(&result), bytes), "cudaMallocHost");
        DeviceBuffer in(bytes), out(bytes);
        ck(cudaMemset(in.get(), 0xff, bytes), "poison in");  // NaNs if read too early
        ck(cudaMemset(out.get(), 0xff, bytes), "poison out");
        std::memset(result, 0, bytes);
        std::optional<RankFence> fence(std::in_place, sync);
        LateInput late{staged_in, count, comm.rank(), 7, 200};
        late.enqueue(stream, in.get());
        OpOptions o;
        o.cuda_stream = stream;
        Work w = comm.all_reduce(in.get(), out.get(), count, DataType::kFloat32, ReduceOp::kSum, o);
        ck(cudaMemcpyAsync(result, out.get(), bytes, cudaMemcpyDeviceToHost, stream), "copy out");
        ck(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
        const float ranks_sum = static_cast<float>(n * (n - 1) / 2);
        for (std::size_t i = 0; i < count; ++i) {
          ASSERT_EQ(result[i], ranks_sum + static_cast<float>(n) * static_cast<float>(i % 7))
              << "element " << i;
        }
        EXPECT_TRUE(w.wait(std::chrono::seconds(30)));  // the host handle completes too
        // A host operation issued after a stream one keeps the order on every rank.
        float h = 1;
        Work w2 =
            comm.all_reduce(in.get(), out.get(), count, DataType::kFloat32, ReduceOp::kMax, o);
        comm.all_reduce(&h, &h, 1, DataType::kFloat32, ReduceOp::kSum).wait();
        EXPECT_EQ(h, static_cast<float>(n));
        w2.wait();
        ck(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
        fence.reset();
        (void)cudaFreeHost(staged_in);
        (void)cudaFreeHost(result);
        (void)cudaStreamDestroy(stream);
      },
      comm_options());
}

// Without a stream, an operation comes after the work already on the legacy default stream:
// here the input is copied in there only after a host function that sleeps, so an operation
// that read it any earlier would reduce the poison (NaNs) instead.
TEST_P(GpuRanks, WithoutAStreamTheDefaultStreamComesFirst) {
  const int n = ranks();
  std::barrier<> sync(n);
  dear::testing::run_ranks(
      n,
      [&](Communicator& comm) {
        ck(cudaSetDevice(0), "cudaSetDevice");
        const std::size_t count = 4096;  // small: one piece
        const std::size_t bytes = count * 4;
        float* staged_in = nullptr;
        ck(cudaMallocHost(reinterpret_cast<void**>(&staged_in), bytes), "cudaMallocHost");
        DeviceBuffer in(bytes), out(bytes);
        ck(cudaMemset(in.get(), 0xff, bytes), "poison in");
        std::optional<RankFence> fence(std::in_place, sync);
        LateInput late{staged_in, count, comm.rank(), 5, 100};
        late.enqueue(nullptr, in.get());  // the legacy default stream
        comm.all_reduce(in.get(), out.get(), count, DataType::kFloat32, ReduceOp::kSum).wait();
        const auto got = to_host(out.get(), bytes);
        const float ranks_sum = static_cast<float>(n * (n - 1) / 2);
        for (std::size_t i = 0; i < count; ++i) {
          ASSERT_EQ(dear::testing::load(got.data(), i, DataType::kFloat32),
                    ranks_sum + static_cast<float>(n) * static_cast<float>(i % 5))
              << "element " << i;
        }
        fence.reset();
        (void)cudaFreeHost(staged_in);
      },
      comm_options());
}

INSTANTIATE_TEST_SUITE_P(Ranks, GpuRanks,
                         ::testing::Combine(::testing::Values(1, 2, 3, 4), ::testing::Bool()),
                         [](const auto& p) {
                           return std::to_string(std::get<0>(p.param)) + "ranks" +
                                  (std::get<1>(p.param) ? "_staged" : "_resident");
                         });

// ---- device-resident collectives ----------------------------------------------------------------

// Every collective, dtype and op on device buffers, many slices each (small slices), in place
// and out of place: the engine lands each slice in pinned memory and the device reduces it.
TEST_F(Gpu, ResidentEveryCollectiveTypeAndOp) {
  for (const int n : {2, 3}) {
    std::barrier<> sync(n);
    dear::testing::run_ranks(n, [&](Communicator& comm) {
      ck(cudaSetDevice(0), "cudaSetDevice");
      const auto nn = static_cast<std::size_t>(n);
      const auto r = static_cast<std::size_t>(comm.rank());
      constexpr std::size_t kCount = 4099;  // per rank: uneven chunks and slices
      DeviceBuffer big(kCount * nn * 8), big_out(kCount * nn * 8), small(kCount * 8);
      const RankFence fence(sync);
      OpOptions o;
      o.slice_bytes = 1024;
      // The ring's slices (small operations on log-step schedules: the next test).
      OpOptions ring = o;
      ring.algorithm = Algorithm::kRing;
      for (const DataType t : kTypes) {
        const std::size_t el = dtype_size(t);
        for (const ReduceOp op : kOps) {
          for (const bool in_place : {false, true}) {
            const std::string what = std::string(to_string(t)) + " " + std::string(to_string(op)) +
                                     (in_place ? " in place" : " out of place");
            // all_reduce of kCount * n elements.
            fill_device(big.get(), kCount * nn, comm.rank(), t, op, 5);
            std::byte* ar_out = in_place ? big.get() : big_out.get();
            comm.all_reduce(big.get(), ar_out, kCount * nn, t, op, ring).wait();
            auto got = to_host(ar_out, kCount * nn * el);
            for (std::size_t i = 0; i < kCount * nn; ++i) {
              const double want = expected_reduce(i, n, t, op, 5);
              ASSERT_TRUE(
                  dear::testing::close_enough(dear::testing::load(got.data(), i, t), want, t))
                  << "all_reduce " << what << " element " << i;
            }
            // reduce_scatter.
            fill_device(big.get(), kCount * nn, comm.rank(), t, op, 6);
            std::byte* rs_out = in_place ? big.get() + r * kCount * el : small.get();
            comm.reduce_scatter(big.get(), rs_out, kCount, t, op, ring).wait();
            got = to_host(rs_out, kCount * el);
            for (std::size_t i = 0; i < kCount; ++i) {
              const double want = expected_reduce(r * kCount + i, n, t, op, 6);
              ASSERT_TRUE(
                  dear::testing::close_enough(dear::testing::load(got.data(), i, t), want, t))
                  << "reduce_scatter " << what << " element " << i;
            }
          }
        }
        for (const bool in_place : {false, true}) {
          // all_gather: rank q's block is input_value(q, i).
          std::byte* ag_in = in_place ? big.get() + r * kCount * el : small.get();
          fill_device(ag_in, kCount, comm.rank(), t, ReduceOp::kSum, 7);
          comm.all_gather(ag_in, big.get(), kCount, t, ring).wait();
          auto got = to_host(big.get(), kCount * nn * el);
          for (int q = 0; q < n; ++q) {
            for (std::size_t i = 0; i < kCount; ++i) {
              ASSERT_EQ(
                  dear::testing::load(got.data(), static_cast<std::size_t>(q) * kCount + i, t),
                  input_value(q, i, t, ReduceOp::kSum, 7))
                  << "all_gather " << to_string(t) << " block " << q << " element " << i;
            }
          }
          // broadcast from every root.
          for (int root = 0; root < n; ++root) {
            fill_device(small.get(), kCount, comm.rank(), t, ReduceOp::kSum, 8);
            std::byte* bc_out = in_place ? small.get() : big.get();
            comm.broadcast(small.get(), bc_out, kCount, t, root, o).wait();
            got = to_host(bc_out, kCount * el);
            for (std::size_t i = 0; i < kCount; ++i) {
              ASSERT_EQ(dear::testing::load(got.data(), i, t),
                        input_value(root, i, t, ReduceOp::kSum, 8))
                  << "broadcast " << to_string(t) << " root " << root << " element " << i;
            }
          }
        }
      }
    });
  }
}

// Small device operations on the log-step schedules (recursive doubling, halving-doubling, the
// binomial tree, the gather's direct round, the all-to-alls): their steps run in host memory,
// the device executor copying the input in and the result back (Op::shadow). In place and out
// of place, rooted ones to every root, all_to_all_v and the _v gathers with uneven parts, and
// many in flight at once (they may run ahead of their receivers, as host ones do).
TEST_F(Gpu, ResidentSmallOperationsOnLogStepSchedules) {
  for (const int n : {2, 3, 4}) {
    std::barrier<> sync(n);
    dear::testing::run_ranks(n, [&](Communicator& comm) {
      ck(cudaSetDevice(0), "cudaSetDevice");
      const auto nn = static_cast<std::size_t>(n);
      const auto r = static_cast<std::size_t>(comm.rank());
      constexpr std::size_t kCount = 1031;
      DeviceBuffer big(kCount * nn * 8), big_out(kCount * nn * 8), small(kCount * 8);
      constexpr int kBatch = 16;
      DeviceBuffer batch(kBatch * kCount * 4);
      const RankFence fence(sync);
      auto check_reduced = [&](const std::byte* dev, std::size_t count, std::size_t first,
                               DataType t, ReduceOp op, int seed, const std::string& what) {
        const auto got = to_host(dev, count * dtype_size(t));
        for (std::size_t i = 0; i < count; ++i) {
          const double want = expected_reduce(first + i, n, t, op, seed);
          ASSERT_TRUE(dear::testing::close_enough(dear::testing::load(got.data(), i, t), want, t))
              << what << " element " << i;
        }
      };
      auto check_gathered = [&](const std::byte* dev, DataType t, int seed,
                                const std::string& what) {
        const auto got = to_host(dev, kCount * nn * dtype_size(t));
        for (int q = 0; q < n; ++q) {
          for (std::size_t i = 0; i < kCount; ++i) {
            ASSERT_EQ(dear::testing::load(got.data(), static_cast<std::size_t>(q) * kCount + i, t),
                      input_value(q, i, t, ReduceOp::kSum, seed))
                << what << " block " << q << " element " << i;
          }
        }
      };
      for (const DataType t : {DataType::kFloat16, DataType::kInt32, DataType::kFloat64}) {
        const std::size_t el = dtype_size(t);
        for (const ReduceOp op : kOps) {
          for (const bool in_place : {false, true}) {
            const std::string how = std::string(to_string(t)) + " " + std::string(to_string(op)) +
                                    (in_place ? " in place" : " out of place");
            for (const Algorithm a :
                 {Algorithm::kRecursiveDoubling, Algorithm::kHalvingDoubling, Algorithm::kTree}) {
              OpOptions o;
              o.algorithm = a;
              const std::string what = "all_reduce " + how + " " + to_string(a);
              fill_device(big.get(), kCount, comm.rank(), t, op, 21);
              std::byte* out = in_place ? big.get() : big_out.get();
              comm.all_reduce(big.get(), out, kCount, t, op, o).wait();
              check_reduced(out, kCount, 0, t, op, 21, what);
            }
            OpOptions hd;
            hd.algorithm = Algorithm::kHalvingDoubling;
            fill_device(big.get(), kCount * nn, comm.rank(), t, op, 22);
            std::byte* rs_out = in_place ? big.get() + r * kCount * el : small.get();
            comm.reduce_scatter(big.get(), rs_out, kCount, t, op, hd).wait();
            check_reduced(rs_out, kCount, r * kCount, t, op, 22, "reduce_scatter " + how);
            OpOptions tree;
            tree.algorithm = Algorithm::kTree;
            for (int root = 0; root < n; ++root) {
              fill_device(big.get(), kCount, comm.rank(), t, op, 23);
              std::byte* out = in_place ? big.get() : big_out.get();
              comm.reduce(big.get(), out, kCount, t, op, root, tree).wait();
              if (comm.rank() == root) {
                check_reduced(out, kCount, 0, t, op, 23,
                              "reduce " + how + " to root " + std::to_string(root));
              }
            }
          }
        }
        for (const bool in_place : {false, true}) {
          for (const Algorithm a : {Algorithm::kRecursiveDoubling, Algorithm::kHalvingDoubling}) {
            OpOptions o;
            o.algorithm = a;
            std::byte* in = in_place ? big.get() + r * kCount * el : small.get();
            fill_device(in, kCount, comm.rank(), t, ReduceOp::kSum, 24);
            comm.all_gather(in, big.get(), kCount, t, o).wait();
            check_gathered(big.get(), t, 24,
                           std::string("all_gather ") + std::string(to_string(t)) + " " +
                               to_string(a) + (in_place ? " in place" : ""));
          }
          for (const Algorithm a : {Algorithm::kTree, Algorithm::kScattered}) {
            OpOptions o;
            o.algorithm = a;
            for (int root = 0; root < n; ++root) {
              const bool own = in_place && comm.rank() == root;
              std::byte* in = own ? big.get() + r * kCount * el : small.get();
              fill_device(in, kCount, comm.rank(), t, ReduceOp::kSum, 25);
              comm.gather(in, big.get(), kCount, t, root, o).wait();
              if (comm.rank() == root) {
                check_gathered(big.get(), t, 25,
                               std::string("gather ") + std::string(to_string(t)) + " " +
                                   to_string(a) + " to root " + std::to_string(root));
              }
            }
          }
        }
      }
      // The all-to-alls and scatter (log-step schedules only), and the _v forms, which run in
      // host memory whole; parts of uneven sizes with gaps between them, which stay untouched.
      {
        const DataType t = DataType::kFloat32;
        std::vector<Work> no;
        fill_device(big.get(), kCount * nn, comm.rank(), t, ReduceOp::kSum, 26);
        for (const bool in_place : {false, true}) {
          if (in_place) fill_device(big_out.get(), kCount * nn, comm.rank(), t, ReduceOp::kSum, 26);
          std::byte* out = big_out.get();
          comm.all_to_all(in_place ? out : big.get(), out, kCount, t).wait();
          const auto got = to_host(out, kCount * nn * 4);
          for (int q = 0; q < n; ++q) {
            for (std::size_t i = 0; i < kCount; ++i) {
              ASSERT_EQ(
                  dear::testing::load(got.data(), static_cast<std::size_t>(q) * kCount + i, t),
                  input_value(q, r * kCount + i, t, ReduceOp::kSum, 26))
                  << "all_to_all" << (in_place ? " in place" : "") << " block " << q << " element "
                  << i;
            }
          }
        }
        for (int root = 0; root < n; ++root) {
          fill_device(big.get(), kCount * nn, comm.rank(), t, ReduceOp::kSum, 27);
          std::byte* out = comm.rank() == root ? big.get() + r * kCount * 4 : small.get();
          comm.scatter(big.get(), out, kCount, t, root).wait();
          const auto got = to_host(out, kCount * 4);
          for (std::size_t i = 0; i < kCount; ++i) {
            ASSERT_EQ(dear::testing::load(got.data(), i, t),
                      input_value(root, r * kCount + i, t, ReduceOp::kSum, 27))
                << "scatter from root " << root << " element " << i;
          }
        }
        // all_to_all_v: rank q sends part(q, p) = 1 + (q + 2p) % 7 elements to rank p.
        const auto part = [](int q, int p) { return std::size_t{1} + (q + 2 * p) % 7; };
        std::vector<std::size_t> sc(nn), sd(nn), rc(nn), rd(nn);
        std::size_t at_s = 0;
        std::size_t at_r = 0;
        for (int p = 0; p < n; ++p) {
          const auto pi = static_cast<std::size_t>(p);
          sc[pi] = part(comm.rank(), p);
          sd[pi] = at_s;
          at_s += sc[pi];
          rc[pi] = part(p, comm.rank());
          rd[pi] = at_r + 1;  // a gap of one element before each part
          at_r = rd[pi] + rc[pi];
        }
        fill_device(big.get(), at_s, comm.rank(), t, ReduceOp::kSum, 28);
        ck(cudaMemset(big_out.get(), 0x5a, (at_r + 1) * 4), "cudaMemset");
        comm.all_to_all_v(big.get(), sc, sd, big_out.get(), rc, rd, t).wait();
        auto got = to_host(big_out.get(), (at_r + 1) * 4);
        for (int q = 0; q < n; ++q) {
          const auto qi = static_cast<std::size_t>(q);
          std::size_t from = 0;  // where rank q's part for this rank starts in its input
          for (int p = 0; p < comm.rank(); ++p) from += part(q, p);
          for (std::size_t i = 0; i < rc[qi]; ++i) {
            ASSERT_EQ(dear::testing::load(got.data(), rd[qi] + i, t),
                      input_value(q, from + i, t, ReduceOp::kSum, 28))
                << "all_to_all_v part from rank " << q << " element " << i;
          }
          ASSERT_EQ(std::to_integer<int>(got[(rd[qi] - 1) * 4]), 0x5a)
              << "all_to_all_v wrote the gap before rank " << q << "'s part";
        }
        // all_gather_v and gather_v: rank q gives 1 + 3q elements.
        std::vector<std::size_t> gc(nn), gd(nn);
        std::size_t total = 0;
        for (std::size_t q = 0; q < nn; ++q) {
          gc[q] = 1 + 3 * q;
          gd[q] = total;
          total += gc[q];
        }
        fill_device(small.get(), gc[r], comm.rank(), t, ReduceOp::kSum, 29);
        for (int root = -1; root < n; ++root) {
          ck(cudaMemset(big_out.get(), 0, total * 4), "cudaMemset");
          if (root < 0) {
            comm.all_gather_v(small.get(), gc[r], big_out.get(), gc, gd, t).wait();
          } else {
            comm.gather_v(small.get(), gc[r], big_out.get(), gc, gd, t, root).wait();
          }
          if (root >= 0 && comm.rank() != root) continue;
          got = to_host(big_out.get(), total * 4);
          for (std::size_t q = 0; q < nn; ++q) {
            for (std::size_t i = 0; i < gc[q]; ++i) {
              ASSERT_EQ(dear::testing::load(got.data(), gd[q] + i, t),
                        input_value(static_cast<int>(q), i, t, ReduceOp::kSum, 29))
                  << (root < 0 ? "all_gather_v" : "gather_v to root " + std::to_string(root))
                  << " block " << q << " element " << i;
            }
          }
        }
      }
      // Many small all_reduces in flight, waited for at the end.
      const DataType t = DataType::kFloat32;
      for (int k = 0; k < kBatch; ++k) {
        fill_device(batch.get() + static_cast<std::size_t>(k) * kCount * 4, kCount, comm.rank(), t,
                    ReduceOp::kSum, 30 + k);
      }
      OpOptions rd;
      rd.algorithm = Algorithm::kRecursiveDoubling;
      std::vector<Work> works;
      for (int k = 0; k < kBatch; ++k) {
        std::byte* p = batch.get() + static_cast<std::size_t>(k) * kCount * 4;
        works.push_back(comm.all_reduce(p, p, kCount, t, ReduceOp::kSum, rd));
      }
      for (const Work& w : works) w.wait();
      for (int k = 0; k < kBatch; ++k) {
        check_reduced(batch.get() + static_cast<std::size_t>(k) * kCount * 4, kCount, 0, t,
                      ReduceOp::kSum, 30 + k, "all_reduce " + std::to_string(k) + " of a batch");
      }
    });
  }
}

// send and recv of device buffers: the engine sends from, and receives into, host memory of its
// own, the device executor copying; small (eager) and large (asked for) messages, several in
// flight in both directions, and a device send met by a host receive (the frames are alike).
TEST_F(Gpu, ResidentSendRecvThroughHostMemory) {
  const int n = 2;
  std::barrier<> sync(n);
  dear::testing::run_ranks(n, [&](Communicator& comm) {
    ck(cudaSetDevice(0), "cudaSetDevice");
    const DataType t = DataType::kFloat32;
    const int other = 1 - comm.rank();
    const std::vector<std::size_t> counts = {1, 4099, (std::size_t{1} << 20) + 3};
    std::vector<std::unique_ptr<DeviceBuffer>> outs, ins;
    for (const std::size_t c : counts) {
      outs.push_back(std::make_unique<DeviceBuffer>(c * 4));
      ins.push_back(std::make_unique<DeviceBuffer>(c * 4));
      fill_device(outs.back()->get(), c, comm.rank(), t, ReduceOp::kSum, 40);
    }
    std::vector<float> host(counts.back());
    const RankFence fence(sync);
    std::vector<Work> works;
    for (std::size_t k = 0; k < counts.size(); ++k) {
      works.push_back(comm.send(outs[k]->get(), counts[k], t, other));
      works.push_back(comm.recv(ins[k]->get(), counts[k], t, other));
    }
    for (const Work& w : works) w.wait();
    for (std::size_t k = 0; k < counts.size(); ++k) {
      const auto got = to_host(ins[k]->get(), counts[k] * 4);
      for (std::size_t i = 0; i < counts[k]; ++i) {
        ASSERT_EQ(dear::testing::load(got.data(), i, t),
                  input_value(other, i, t, ReduceOp::kSum, 40))
            << "message " << k << " (" << counts[k] << " floats) element " << i;
      }
    }
    // Rank 0 sends from device memory, rank 1 receives into host memory.
    const std::size_t c = counts.back();
    if (comm.rank() == 0) {
      comm.send(outs.back()->get(), c, t, 1).wait();
    } else {
      comm.recv(host.data(), c, t, 0).wait();
      for (std::size_t i = 0; i < c; ++i) {
        ASSERT_EQ(host[i], input_value(0, i, t, ReduceOp::kSum, 40)) << "element " << i;
      }
    }
  });
}

// A device send whose stream never lets it start within its timeout fails naming that wait,
// not the peer: the send is held until the caller's stream has done the work queued before it,
// and the send behind it to the same rank waits too (its timeout says so).
TEST_F(Gpu, HeldDeviceSendTimesOutNamingTheStream) {
  const int n = 2;
  const auto errors = dear::testing::run_ranks_collect(n, [&](Communicator& comm) {
    ck(cudaSetDevice(0), "cudaSetDevice");
    const std::size_t count = 4096;
    DeviceBuffer buf(count * 4);
    if (comm.rank() == 1) {
      std::vector<float> host(count);
      comm.recv(host.data(), count, DataType::kFloat32, 0).wait();
      return;
    }
    cudaStream_t stream = nullptr;
    ck(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
    float* staged = nullptr;
    ck(cudaMallocHost(reinterpret_cast<void**>(&staged), count * 4), "cudaMallocHost");
    LateInput late{staged, count, 0, 3, 3000};  // the stream is busy for 3 s
    late.enqueue(stream, buf.get());
    OpOptions o;
    o.cuda_stream = stream;
    o.timeout = std::chrono::milliseconds(300);
    Work w = comm.send(buf.get(), count, DataType::kFloat32, 1, o);
    const auto done = [&] {
      (void)cudaStreamSynchronize(stream);
      (void)cudaFreeHost(staged);
      (void)cudaStreamDestroy(stream);
    };
    try {
      w.wait();
    } catch (...) {
      done();
      throw;
    }
    done();
  });
  ASSERT_TRUE(errors[0]) << "the held send did not time out";
  const std::string text = dear::testing::what_of(errors[0]);
  EXPECT_NE(text.find("timed out"), std::string::npos) << text;
  EXPECT_NE(text.find("CUDA stream has not finished"), std::string::npos) << text;
  EXPECT_TRUE(errors[1]) << "rank 1 was not told";
}

// Device operations in flight together with different priorities, and host ones among them:
// each completes with its own result.
TEST_F(Gpu, ResidentConcurrentOperationsWithPriorities) {
  const int n = 3;
  std::barrier<> sync(n);
  dear::testing::run_ranks(n, [&](Communicator& comm) {
    ck(cudaSetDevice(0), "cudaSetDevice");
    constexpr int kOpsInFlight = 8;
    constexpr std::size_t kCount = 200003;
    const DataType t = DataType::kFloat32;
    std::vector<std::unique_ptr<DeviceBuffer>> bufs;
    for (int k = 0; k < kOpsInFlight; ++k) {
      bufs.push_back(std::make_unique<DeviceBuffer>(kCount * 4));
      fill_device(bufs.back()->get(), kCount, comm.rank(), t, ReduceOp::kSum, 10 + k);
    }
    std::vector<std::byte> host_in(kCount * 4), host_out(kCount * 4);
    for (std::size_t i = 0; i < kCount; ++i) {
      dear::testing::store(host_in.data(), i, t, input_value(comm.rank(), i, t, ReduceOp::kSum, 9));
    }
    const RankFence fence(sync);
    std::vector<Work> works;
    for (int k = 0; k < kOpsInFlight; ++k) {
      OpOptions o;
      o.priority = k % 3;
      o.slice_bytes = 64 * 1024;
      works.push_back(comm.all_reduce(bufs[static_cast<std::size_t>(k)]->get(),
                                      bufs[static_cast<std::size_t>(k)]->get(), kCount, t,
                                      ReduceOp::kSum, o));
      if (k == kOpsInFlight / 2) {
        works.push_back(
            comm.all_reduce(host_in.data(), host_out.data(), kCount, t, ReduceOp::kSum));
      }
    }
    for (const Work& w : works) w.wait();
    for (int k = 0; k < kOpsInFlight; ++k) {
      const auto got = to_host(bufs[static_cast<std::size_t>(k)]->get(), kCount * 4);
      for (std::size_t i = 0; i < kCount; i += 7) {
        ASSERT_EQ(dear::testing::load(got.data(), i, t),
                  expected_reduce(i, n, t, ReduceOp::kSum, 10 + k))
            << "operation " << k << " element " << i;
      }
    }
    for (std::size_t i = 0; i < kCount; i += 7) {
      ASSERT_EQ(dear::testing::load(host_out.data(), i, t),
                expected_reduce(i, n, t, ReduceOp::kSum, 9))
          << "host operation element " << i;
    }
  });
}

// The pinned memory a device operation holds is its landing slots, whatever its size: a
// 256 MiB all_reduce on 2 ranks stays within links x channels x (send + receive slots) x the
// largest device slice, with a slot per channel to spare for what a transport had buffered.
TEST_F(Gpu, ResidentPinnedMemoryIsBoundedBySlots) {
  const int n = 2;
  std::barrier<> sync(n);
  CommOptions options;
  options.channels = 2;
  dear::testing::run_ranks(
      n,
      [&](Communicator& comm) {
        ck(cudaSetDevice(0), "cudaSetDevice");
        constexpr std::size_t kCount = std::size_t{64} << 20;  // floats: 256 MiB
        DeviceBuffer buf(kCount * 4);
        fill_device(buf.get(), kCount, comm.rank(), DataType::kFloat32, ReduceOp::kSum, 11);
        const RankFence fence(sync);
        comm.all_reduce(buf.get(), buf.get(), kCount, DataType::kFloat32, ReduceOp::kSum).wait();
        const std::size_t slots = 2 * static_cast<std::size_t>(options.channels) *
                                  (2 * static_cast<std::size_t>(options.landing_slots) + 1);
        const std::size_t bound = slots * collectives::kDeviceSliceBytes;
        const std::size_t peak = comm.engine_stats().peak_landing_bytes;
        std::printf(
            "rank %d: 256 MiB device all_reduce held %zu bytes of landing slots (bound %zu)\n",
            comm.rank(), peak, bound);
        EXPECT_GT(peak, 0U) << "the operation did not go through landing slots";
        EXPECT_LE(peak, bound);
        const auto got = to_host(buf.get(), 4096 * 4);
        for (std::size_t i = 0; i < 4096; ++i) {
          ASSERT_EQ(dear::testing::load(got.data(), i, DataType::kFloat32),
                    expected_reduce(i, n, DataType::kFloat32, ReduceOp::kSum, 11));
        }
      },
      options);
}

// Device operations over libfabric's write data path with FI_HMEM asked for: where the provider
// registers CUDA memory, each slice is written straight into the receiver's device window (no
// pinned memory on the way); where it cannot, the operation takes landing slots. Either way
// every element is checked; the messages that came through device windows are printed.
TEST_F(Gpu, ResidentOverFabricWithDeviceWindowsWhereOffered) {
  const int n = 3;
  for (const std::string provider : {"tcp;ofi_rxm", "shm"}) {
    if (auto why = transport::fabric::write_unavailable_reason(provider)) {
      std::printf("%s: %s\n", provider.c_str(), why->c_str());
      continue;
    }
    SCOPED_TRACE(provider);
    std::barrier<> sync(n);
    CommOptions o;
    o.transport = "fabric";
    o.fabric_provider = provider;
    o.fabric_data_path = "write";
    o.fabric_hmem = "on";
    dear::testing::run_ranks(
        n,
        [&](Communicator& comm) {
          ck(cudaSetDevice(0), "cudaSetDevice");
          const DataType t = DataType::kFloat32;
          const std::size_t block = 400000;  // N blocks of 1.6 MB: the ring, not a log-step
          const auto nn = static_cast<std::size_t>(n);
          const auto r = static_cast<std::size_t>(comm.rank());
          DeviceBuffer big(block * nn * 4), small(block * 4), out(block * nn * 4);
          const RankFence fence(sync);
          fill_device(big.get(), block * nn, comm.rank(), t, ReduceOp::kSum, 5);
          comm.all_reduce(big.get(), out.get(), block * nn, t, ReduceOp::kSum).wait();
          auto got = to_host(out.get(), block * nn * 4);
          for (std::size_t i = 0; i < block * nn; ++i) {
            ASSERT_EQ(dear::testing::load(got.data(), i, t),
                      expected_reduce(i, n, t, ReduceOp::kSum, 5))
                << "all_reduce element " << i;
          }
          comm.all_reduce(big.get(), big.get(), block * nn, t, ReduceOp::kSum).wait();
          ASSERT_EQ(
              std::memcmp(to_host(big.get(), block * nn * 4).data(), got.data(), block * nn * 4), 0)
              << "in-place all_reduce differs";
          fill_device(big.get(), block * nn, comm.rank(), t, ReduceOp::kSum, 6);
          comm.reduce_scatter(big.get(), small.get(), block, t, ReduceOp::kSum).wait();
          got = to_host(small.get(), block * 4);
          for (std::size_t i = 0; i < block; ++i) {
            ASSERT_EQ(dear::testing::load(got.data(), i, t),
                      expected_reduce(r * block + i, n, t, ReduceOp::kSum, 6))
                << "reduce_scatter element " << i;
          }
          fill_device(small.get(), block, comm.rank(), t, ReduceOp::kSum, 7);
          comm.all_gather(small.get(), out.get(), block, t).wait();
          got = to_host(out.get(), block * nn * 4);
          for (int q = 0; q < n; ++q) {
            for (std::size_t i = 0; i < block; ++i) {
              ASSERT_EQ(dear::testing::load(got.data(), static_cast<std::size_t>(q) * block + i, t),
                        input_value(q, i, t, ReduceOp::kSum, 7))
                  << "all_gather block " << q << " element " << i;
            }
          }
          comm.broadcast(big.get(), out.get(), block * nn, t, 1).wait();
          got = to_host(out.get(), block * nn * 4);
          for (std::size_t i = 0; i < block * nn; ++i) {
            ASSERT_EQ(dear::testing::load(got.data(), i, t),
                      input_value(1, i, t, ReduceOp::kSum, 6))
                << "broadcast element " << i;
          }
          const auto stats = comm.engine_stats();
          std::printf("%s rank %d: %llu messages through device windows (ring of %zu bytes)\n",
                      provider.c_str(), comm.rank(),
                      static_cast<unsigned long long>(stats.device_window_messages),
                      stats.device_window_bytes);
          if (stats.device_window_messages > 0) {
            EXPECT_LE(stats.device_window_bytes, std::size_t{4} << 20) << "bounded by the slots";
          }
        },
        o);
  }
}

// One rank on device memory, the other on host memory for the same operation: both fail, and
// the error says which memory each rank used.
TEST_F(Gpu, ResidentAndHostRanksDisagreeWithAClearError) {
  const int n = 2;
  std::barrier<> sync(n);
  CommOptions options;
  options.timeout = std::chrono::seconds(20);
  const auto errors = dear::testing::run_ranks_collect(
      n,
      [&](Communicator& comm) {
        ck(cudaSetDevice(0), "cudaSetDevice");
        constexpr std::size_t kCount = 1 << 20;
        DeviceBuffer dev(kCount * 4);
        std::vector<std::byte> host(kCount * 4);
        const RankFence fence(sync);
        void* p = comm.rank() == 0 ? static_cast<void*>(dev.get()) : host.data();
        comm.all_reduce(p, p, kCount, DataType::kFloat32, ReduceOp::kSum).wait();
      },
      options);
  bool named = false;
  for (int r = 0; r < n; ++r) {
    ASSERT_TRUE(errors[static_cast<std::size_t>(r)]) << "rank " << r << " did not fail";
    named = named ||
            dear::testing::what_of(errors[static_cast<std::size_t>(r)]).find("memory=device") !=
                std::string::npos;
  }
  EXPECT_TRUE(named) << dear::testing::what_of(errors[0]) << " / "
                     << dear::testing::what_of(errors[1]);
}

TEST_F(Gpu, DevicePointersAreDetected) {
  DeviceBuffer d(64);
  EXPECT_TRUE(collectives::is_device_pointer(d.get()));
  float host = 0;
  EXPECT_FALSE(collectives::is_device_pointer(&host));
}

// GPUDirect RDMA's first step: the driver exports device memory as a dma-buf whose offset
// leads to the address asked for, and refuses host memory with a reason.
TEST_F(Gpu, DeviceMemoryIsExportedAsADmaBuf) {
  constexpr std::size_t kBytes = 4 << 20;
  DeviceBuffer buf(kBytes);
  const std::byte* p = buf.get() + 5000;
  const cuda::DmaBuf d = cuda::export_dmabuf(p, 100000);
  if (d.fd < 0 && d.why.find("does not export dma-bufs") != std::string::npos) {
    GTEST_SKIP() << d.why;
  }
  ASSERT_GE(d.fd, 0) << d.why;
  const auto page = static_cast<std::uint64_t>(::sysconf(_SC_PAGESIZE));
  EXPECT_EQ(d.offset, reinterpret_cast<std::uintptr_t>(p) % page);
  EXPECT_GE(::fcntl(d.fd, F_GETFD), 0) << "the descriptor is open";
  // A dma-buf's size is its end: it holds the whole range asked for.
  EXPECT_GE(::lseek(d.fd, 0, SEEK_END), static_cast<off_t>(d.offset + 100000));
  ::close(d.fd);

  std::vector<char> host(4096);
  const cuda::DmaBuf h = cuda::export_dmabuf(host.data(), host.size());
  EXPECT_EQ(h.fd, -1);
  EXPECT_NE(h.why.find("not CUDA device memory"), std::string::npos) << h.why;
}

// GPUDirect RDMA over ibverbs (needs a GPU and an RDMA device; ranks as threads through the
// first active port): a 1 MiB message from device memory written straight into a window on
// device memory in four writes, then the GPU flush, and every byte of the window read back
// (tests/channel_exchange.h, the check the host windows pass).
TEST_F(Gpu, GpuDirectWritesLandInDeviceMemory) {
  if (auto why = transport::verbs::unavailable_reason()) GTEST_SKIP() << *why;
  {
    // Without a dma-buf and without the peer-memory module the adapter cannot reach device
    // memory at all: that host has no GPUDirect RDMA to check.
    DeviceBuffer probe(1 << 20);
    const cuda::DmaBuf d = cuda::export_dmabuf(probe.get(), 1 << 20);
    if (d.fd >= 0) ::close(d.fd);
    if (d.fd < 0 && ::access("/sys/module/nvidia_peermem", F_OK) != 0) {
      GTEST_SKIP() << "no GPUDirect RDMA path on this host: " << d.why
                   << ", and the nvidia_peermem module is not loaded";
    }
  }
  testing::WindowMemory m;
  m.make = [](const std::vector<char>& bytes) {
    void* p = nullptr;
    ck(cudaMalloc(&p, bytes.size()), "cudaMalloc");
    ck(cudaMemcpy(p, bytes.data(), bytes.size(), cudaMemcpyHostToDevice), "cudaMemcpy");
    return std::shared_ptr<char>(static_cast<char*>(p), [](char* q) { (void)cudaFree(q); });
  };
  m.read = [](const char* p, std::size_t n) {
    std::vector<char> out(n);
    ck(cudaMemcpy(out.data(), p, n, cudaMemcpyDeviceToHost), "cudaMemcpy");
    return out;
  };
  // The registration holds the dma-buf; its descriptor is closed once it is made.
  const auto device_memory = [](const char* p, std::size_t n, auto&& use) {
    const cuda::DmaBuf d = cuda::export_dmabuf(p, n);
    const auto result = use(transport::DeviceMemory{d.fd, d.offset});
    if (d.fd >= 0) ::close(d.fd);
    return result;
  };
  m.open = [&](transport::Channel& ch, char* base, std::size_t bytes, std::size_t message) {
    return device_memory(base, bytes, [&](const transport::DeviceMemory& dm) {
      return ch.open_device_window(base, bytes, message, dm);
    });
  };
  m.source = [&](transport::Channel& ch, const char* p, std::size_t n) {
    return device_memory(p, n, [&](const transport::DeviceMemory& dm) {
      return ch.register_device_source(p, n, dm);
    });
  };
  m.small = false;
  const auto failures = testing::write_into_window(
      [](Bootstrap& bs, const std::vector<int>& peers) {
        transport::verbs::VerbsOptions o;
        o.direct_bytes = 4096;
        o.direct_write_bytes = 256 * 1024;
        return transport::verbs::connect_peers(bs, peers, o);
      },
      1 << 20, m);
  for (std::size_t r = 0; r < failures.size(); ++r) EXPECT_EQ(failures[r], "") << "rank " << r;
}

}  // namespace
}  // namespace dear
