// The conformance suite's transport for one binary, from the DEAR_TEST_* definitions its
// target is compiled with (none: TCP and the host executor on 1, 2, 3, 4, 5 and 8 ranks).
#include "suite_config.h"

namespace dear::testing {

SuiteConfig suite_config() {
  SuiteConfig c;
#if defined(DEAR_TEST_TRANSPORT)
  c.transport = DEAR_TEST_TRANSPORT;
#endif
#if defined(DEAR_TEST_FABRIC_PROVIDER)
  c.fabric_provider = DEAR_TEST_FABRIC_PROVIDER;
#endif
#if defined(DEAR_TEST_FABRIC_DATA_PATH)
  c.fabric_data_path = DEAR_TEST_FABRIC_DATA_PATH;
#endif
#if defined(DEAR_TEST_EXECUTOR)
  c.executor = DEAR_TEST_EXECUTOR;
#endif
#if defined(DEAR_TEST_RANKS)
  c.ranks = {DEAR_TEST_RANKS};
#else
  c.ranks = {1, 2, 3, 4, 5, 8};
#endif
  return c;
}

}  // namespace dear::testing
