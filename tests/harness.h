// Runs N ranks as threads of this process over TCP loopback: the fast, debuggable way to test
// every collective. Each rank gets its own Bootstrap and Communicator, exactly as separate
// processes would.
#pragma once

#include <cstdio>
#include <cstdlib>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "dear/bootstrap.h"
#include "dear/communicator.h"
#if defined(DEAR_TEST_SUITE_CONFIG)
#include <optional>

#include "suite_config.h"
#include "transport/transport.h"
#endif

namespace dear::testing {

// The transport a suite runs over. The conformance suite (test_collectives.cc) is compiled
// once with DEAR_TEST_SUITE_CONFIG and linked into one binary per transport, whose
// suite_config() names it (suite_config.h); every other test runs over TCP.
inline void use_suite_transport([[maybe_unused]] CommOptions& options) {
#if defined(DEAR_TEST_SUITE_CONFIG)
  const SuiteConfig c = suite_config();
  if (!c.transport.empty()) options.transport = c.transport;
  if (!c.fabric_provider.empty()) options.fabric_provider = c.fabric_provider;
  if (!c.fabric_data_path.empty()) options.fabric_data_path = c.fabric_data_path;
  if (!c.executor.empty()) options.executor = c.executor;
#endif
}

#if defined(DEAR_TEST_SUITE_CONFIG)
// Why the suite's transport cannot run on this host (its tests then skip), or nullopt.
inline std::optional<std::string> suite_transport_unavailable() {
  const SuiteConfig c = suite_config();
  if (c.transport.empty()) return std::nullopt;
  for (const transport::Transport* t : transport::transports()) {
    if (t->name() != c.transport) continue;
    if (auto why = t->missing()) return why;
    transport::TransportOptions o;
    o.fabric_provider = c.fabric_provider;
    if (!c.fabric_data_path.empty()) o.fabric_data_path = c.fabric_data_path;
    return t->unavailable(o);
  }
  return "transport '" + c.transport + "' is not registered";
}
#define DEAR_SKIP_UNLESS_SUITE_TRANSPORT()                           \
  do {                                                               \
    if (auto why = ::dear::testing::suite_transport_unavailable()) { \
      GTEST_SKIP() << *why;                                          \
    }                                                                \
  } while (false)
#else
#define DEAR_SKIP_UNLESS_SUITE_TRANSPORT() \
  do {                                     \
  } while (false)
#endif

// How a rank's communicator is made from its bootstrap; unset: Communicator::create.
using CommFactory =
    std::function<std::unique_ptr<Communicator>(std::unique_ptr<Bootstrap>&, CommOptions)>;

// Calls fn(bootstrap) on each of n ranks (threads) joined by one fresh unique id; fn may take
// the bootstrap over. Returns each rank's failure (null where fn returned).
inline std::vector<std::exception_ptr> run_bootstraps_owned(
    int n, const std::function<void(std::unique_ptr<Bootstrap>&)>& fn) {
  const UniqueId id = UniqueId::create("127.0.0.1");
  std::vector<std::exception_ptr> errors(static_cast<std::size_t>(n));
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      try {
        auto boot = Bootstrap::create(id, r, n);
        fn(boot);
      } catch (...) {
        errors[static_cast<std::size_t>(r)] = std::current_exception();
      }
    });
  }
  for (auto& t : threads) t.join();
  return errors;
}

// As run_bootstraps_owned, for tests below the communicator (transports).
inline std::vector<std::exception_ptr> run_bootstraps(int n,
                                                      const std::function<void(Bootstrap&)>& fn) {
  return run_bootstraps_owned(n, [&](std::unique_ptr<Bootstrap>& boot) { fn(*boot); });
}

// Calls fn(comm) on each of n ranks (threads); returns each rank's failure (null where the
// rank succeeded). Ranks that fail leave their communicator, so peers see the failure too.
inline std::vector<std::exception_ptr> run_ranks_collect(
    int n, const std::function<void(Communicator&)>& fn, CommOptions options = {},
    const CommFactory& make = {}) {
  if (const char* t = std::getenv("DEAR_TEST_TIMEOUT_MS")) {
    options.timeout = std::chrono::milliseconds(std::atoi(t));
  }
  use_suite_transport(options);
  return run_bootstraps_owned(n, [&](std::unique_ptr<Bootstrap>& boot) {
    auto comm = make ? make(boot, options) : Communicator::create(std::move(boot), options);
    fn(*comm);
  });
}

// The text of a failure run_ranks_collect or run_bootstraps returned; "" for none.
inline std::string what_of(const std::exception_ptr& e) {
  if (!e) return "";
  try {
    std::rethrow_exception(e);
  } catch (const std::exception& x) {
    return x.what();
  } catch (...) {
    return "an exception that is no std::exception";
  }
}

// The code of a dear::Error failure; kInternal for any other exception or none.
inline ErrorCode code_of(const std::exception_ptr& e) {
  if (!e) return ErrorCode::kInternal;
  try {
    std::rethrow_exception(e);
  } catch (const Error& x) {
    return x.code();
  } catch (...) {
    return ErrorCode::kInternal;
  }
}

// As run_ranks_collect, but prints every rank's failure (the first one thrown is not always
// the cause) and rethrows the lowest rank's.
inline void run_ranks(int n, const std::function<void(Communicator&)>& fn, CommOptions options = {},
                      const CommFactory& make = {}) {
  const auto errors = run_ranks_collect(n, fn, std::move(options), make);
  std::exception_ptr first;
  for (int r = 0; r < n; ++r) {
    const auto& e = errors[static_cast<std::size_t>(r)];
    if (!e) continue;
    if (!first) first = e;
    try {
      std::rethrow_exception(e);
    } catch (const std::exception& x) {
      std::fprintf(stderr, "rank %d failed: %s\n", r, x.what());
    }
  }
  if (first) std::rethrow_exception(first);
}

}  // namespace dear::testing
