// What one conformance binary runs over. tests/test_collectives.cc is compiled once and linked
// into a binary per transport; each binary's tests/suite_config.cc, compiled with that
// transport's DEAR_TEST_* definitions (tests/CMakeLists.txt), says which.
#pragma once

#include <string>
#include <vector>

namespace dear::testing {

struct SuiteConfig {
  std::string transport;  // "" (TCP, the default), "fabric" or "verbs"
  std::string fabric_provider;
  std::string fabric_data_path;
  std::string executor;    // "" (host, the default), "deferred" or "deferred_bounce"
  std::vector<int> ranks;  // the rank counts every test runs on
};

// This binary's configuration (built on each call: safe during static initialisation).
SuiteConfig suite_config();

}  // namespace dear::testing
