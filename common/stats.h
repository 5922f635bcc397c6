// Small statistics shared by the layers, the benchmarks and the tools.
#pragma once

#include <algorithm>
#include <vector>

namespace dear {

// The median of `v`: its middle value, or the mean of the middle two for an even count; 0 for
// an empty `v`.
[[nodiscard]] inline double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const std::size_t h = v.size() / 2;
  return v.size() % 2 == 1 ? v[h] : (v[h - 1] + v[h]) / 2;
}

}  // namespace dear
