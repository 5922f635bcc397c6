// Faults survived, with ranks as processes: a rank killed with SIGKILL at random points
// (before joining the rendezvous, after joining it, in the middle of an operation, between
// operations), and a rank stalled with SIGSTOP, resumed before the deadline or not. Every
// survivor must fail within the deadline with an error naming the rank at fault, or complete
// correctly when the stalled rank comes back in time.
#include <gtest/gtest.h>
#include <signal.h>

#include <chrono>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "dear/bootstrap.h"
#include "hand_started.h"
#include "proc.h"
#include "transport/listener_registry.h"

namespace {

using namespace std::chrono_literals;
using dear::test::Proc;
using dear::test::slurp;
using dear::test::spawn;
using dear::test::tmp_file;
using dear::test::wait_all;
using dear::test::wait_ready;

// The transport the ranks use: TCP, or the one this binary was built for (test_faults_shm).
#if defined(DEAR_TEST_FAULTS_TRANSPORT)
constexpr const char* kTransport = DEAR_TEST_FAULTS_TRANSPORT;
#else
constexpr const char* kTransport = "tcp";
#endif

std::vector<Proc> start_ranks(int nranks, const std::vector<std::string>& args, int timeout_s,
                              const std::string& tag) {
  std::vector<std::string> argv{DEAR_WORKER_PATH};
  argv.insert(argv.end(), args.begin(), args.end());
  // Rank 0 keeps the port held once it has inherited the socket.
  const dear::test::HeldPort held;
  return dear::test::start_by_hand(held, argv, tag, nranks, timeout_s,
                                   {std::string("DEAR_TRANSPORT=") + kTransport});
}

// Survivors must exit with the worker's error status, naming `culprit` as the failed peer.
void expect_survivors_blame(const std::vector<Proc>& procs, int culprit) {
  for (std::size_t r = 0; r < procs.size(); ++r) {
    if (static_cast<int>(r) == culprit) continue;
    const std::string out = slurp(procs[r].out_path);
    EXPECT_TRUE(WIFEXITED(procs[r].status) && WEXITSTATUS(procs[r].status) == 3)
        << "rank " << r << ": " << out;
    EXPECT_NE(out.find("peer=" + std::to_string(culprit) + " "), std::string::npos)
        << "rank " << r << " does not name rank " << culprit << ": " << out;
  }
}

// Fifty trials over TCP; twenty over shm, whose own part (a dead rank's rings stop, its control
// sockets close) is the same at every point of the engine's.
TEST(Faults, KillsAtRandomPointsEverySurvivorNamesTheDeadRank) {
  constexpr int kRanks = 3;
#if defined(DEAR_TEST_FAULTS_TRANSPORT)
  constexpr int kTrials = 20;
#else
  constexpr int kTrials = 50;
#endif
  constexpr int kDeadlineS = 3;
  const char* const kPoints[] = {"boot", "link", "mid", "between"};
  std::mt19937 rng(20261129);
  for (int t = 0; t < kTrials; ++t) {
    const int victim = static_cast<int>(rng() % kRanks);
    const std::string point = kPoints[rng() % 4];
    const int iters = 1 + static_cast<int>(rng() % 3);
    SCOPED_TRACE("trial " + std::to_string(t) + ": rank " + std::to_string(victim) + " killed at " +
                 point + " of iteration " + std::to_string(iters));
    const auto start = std::chrono::steady_clock::now();
    std::vector<Proc> procs =
        start_ranks(kRanks, {"kill", std::to_string(victim), point, std::to_string(iters)},
                    kDeadlineS, "kill" + std::to_string(t));
    ASSERT_TRUE(wait_all(procs, 30s)) << "a survivor hung";
    // Within the deadline, plus the time to start the processes on a busy machine.
    EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(kDeadlineS) + 5s);
    const Proc& dead = procs[static_cast<std::size_t>(victim)];
    EXPECT_TRUE(WIFSIGNALED(dead.status) && WTERMSIG(dead.status) == SIGKILL)
        << slurp(dead.out_path);
    expect_survivors_blame(procs, victim);
    if (::testing::Test::HasFailure()) return;  // one trial's output is enough to debug
  }
}

TEST(Faults, StalledRankResumedBeforeTheDeadlineCompletes) {
  constexpr int kVictim = 1;
  // A deadline ten times the stall: a loaded machine's slower operations stay well inside it.
  std::vector<Proc> procs = start_ranks(3, {"slow", "40", "10"}, 15, "stall_ok");
  ASSERT_TRUE(wait_ready(procs, 30s)) << slurp(procs[0].out_path);
  std::this_thread::sleep_for(100ms);
  ::kill(procs[kVictim].pid, SIGSTOP);
  std::this_thread::sleep_for(1500ms);
  ::kill(procs[kVictim].pid, SIGCONT);
  ASSERT_TRUE(wait_all(procs, 60s)) << "a rank hung after the stalled one resumed";
  for (std::size_t r = 0; r < procs.size(); ++r) {
    const std::string out = slurp(procs[r].out_path);
    EXPECT_TRUE(WIFEXITED(procs[r].status) && WEXITSTATUS(procs[r].status) == 0)
        << "rank " << r << ": " << out;
    EXPECT_NE(out.find("ok rank " + std::to_string(r)), std::string::npos) << out;
  }
}

TEST(Faults, StalledRankPastTheDeadlineIsNamedByEverySurvivor) {
  constexpr int kVictim = 1;
  constexpr int kDeadlineS = 2;
  std::vector<Proc> procs = start_ranks(3, {"slow", "100000", "1"}, kDeadlineS, "stall_dead");
  ASSERT_TRUE(wait_ready(procs, 30s)) << slurp(procs[0].out_path);
  std::this_thread::sleep_for(100ms);
  ::kill(procs[kVictim].pid, SIGSTOP);
  const auto stopped = std::chrono::steady_clock::now();
  std::vector<Proc> survivors;
  for (std::size_t r = 0; r < procs.size(); ++r) {
    if (static_cast<int>(r) != kVictim) survivors.push_back(procs[r]);
  }
  const bool in_time = wait_all(survivors, 30s);
  const auto took = std::chrono::steady_clock::now() - stopped;
  ::kill(procs[kVictim].pid, SIGKILL);
  ::kill(procs[kVictim].pid, SIGCONT);
  ::waitpid(procs[kVictim].pid, &procs[kVictim].status, 0);
  ASSERT_TRUE(in_time) << "a survivor hung";
  EXPECT_LT(took, std::chrono::seconds(kDeadlineS) + 4s);
  std::size_t s = 0;
  for (std::size_t r = 0; r < procs.size(); ++r) {
    if (static_cast<int>(r) != kVictim) procs[r] = survivors[s++];
  }
  expect_survivors_blame(procs, kVictim);
}

}  // namespace
