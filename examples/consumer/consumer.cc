// A program built against an installed dear (find_package or pkg-config; see README.md here):
// run under dear-run on N ranks, it all-reduces a vector whose every element is known on each
// rank, checks each element of the sum, and says which copy of the library it ran against.
#include <dear/communicator.h>
#include <dear/version.h>

#include <cstdio>
#include <cstring>
#include <exception>
#include <vector>

int main() {
  try {
    auto comm = dear::Communicator::create_from_env(dear::Bootstrap::from_env());
    const int rank = comm->rank();
    const int size = comm->size();
    constexpr std::size_t kCount = 1 << 16;
    std::vector<float> data(kCount);
    for (std::size_t i = 0; i < kCount; ++i) {
      data[i] = static_cast<float>((rank + 1) * static_cast<int>(i % 97));
    }
    comm->all_reduce(data.data(), data.data(), kCount, dear::DataType::kFloat32,
                     dear::ReduceOp::kSum)
        .wait();
    // Sum over ranks r of (r + 1) * (i % 97) = size * (size + 1) / 2 * (i % 97).
    const int ranks_sum = size * (size + 1) / 2;
    std::size_t wrong = 0;
    for (std::size_t i = 0; i < kCount; ++i) {
      if (data[i] != static_cast<float>(ranks_sum * static_cast<int>(i % 97))) ++wrong;
    }
    const bool same_version = std::strcmp(dear::library_version(), DEAR_VERSION_STRING) == 0;
    std::printf("rank %d of %d: all_reduce of %zu floats, %zu wrong; library %s, headers %s\n",
                rank, size, kCount, wrong, dear::library_version(), DEAR_VERSION_STRING);
    return wrong == 0 && same_version ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "consumer: %s\n", e.what());
    return 1;
  }
}
