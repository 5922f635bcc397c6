// Ranks as separate processes: started through dear-run, and started by hand so that one can
// be killed mid-collective while the survivors are watched.
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "dear/bootstrap.h"
#include "hand_started.h"
#include "proc.h"
#include "transport/listener_registry.h"

namespace {

using namespace std::chrono_literals;
using dear::test::HeldPort;
using dear::test::Proc;
using dear::test::slurp;
using dear::test::spawn;
using dear::test::start_by_hand;
using dear::test::tmp_file;
using dear::test::wait_all;

TEST(Processes, FourRanksThroughDearRun) {
  std::vector<Proc> procs{
      spawn({DEAR_RUN_PATH, "-n", "4", "--timeout", "120", DEAR_WORKER_PATH, "ring", "3"}, {},
            tmp_file("run.out"))};
  ASSERT_TRUE(wait_all(procs, 150s));
  const std::string out = slurp(procs[0].out_path);
  EXPECT_TRUE(WIFEXITED(procs[0].status) && WEXITSTATUS(procs[0].status) == 0) << out;
  for (int r = 0; r < 4; ++r) {
    EXPECT_NE(out.find("ok rank " + std::to_string(r)), std::string::npos) << out;
  }
}

TEST(Processes, KilledRankFailsEverySurvivorNamingIt) {
  constexpr int kRanks = 4;
  constexpr int kVictim = 2;
  const HeldPort held;
  std::vector<Proc> procs =
      start_by_hand(held, {DEAR_WORKER_PATH, "die", std::to_string(kVictim), "3"}, "die", kRanks);
  const auto start = std::chrono::steady_clock::now();
  // The deadline is 120 s; the survivors must learn of the death long before it.
  ASSERT_TRUE(wait_all(procs, 60s)) << "a survivor hung";
  EXPECT_LT(std::chrono::steady_clock::now() - start, 30s);
  for (int r = 0; r < kRanks; ++r) {
    const Proc& p = procs[static_cast<std::size_t>(r)];
    const std::string out = slurp(p.out_path);
    if (r == kVictim) {
      EXPECT_TRUE(WIFSIGNALED(p.status) && WTERMSIG(p.status) == SIGKILL) << out;
      continue;
    }
    EXPECT_TRUE(WIFEXITED(p.status) && WEXITSTATUS(p.status) == 3) << "rank " << r << ": " << out;
    EXPECT_NE(out.find("peer=" + std::to_string(kVictim)), std::string::npos)
        << "rank " << r << " does not blame rank " << kVictim << ": " << out;
  }
}

TEST(Processes, DearRunReportsTheDeadRankAndFails) {
  std::vector<Proc> procs{
      spawn({DEAR_RUN_PATH, "-n", "3", "--timeout", "120", DEAR_WORKER_PATH, "die", "1", "2"}, {},
            tmp_file("rundie.out"))};
  ASSERT_TRUE(wait_all(procs, 150s));
  const std::string out = slurp(procs[0].out_path);
  EXPECT_FALSE(WIFEXITED(procs[0].status) && WEXITSTATUS(procs[0].status) == 0) << out;
  EXPECT_NE(out.find("rank 1"), std::string::npos) << out;
}

// A rank 0 told of a listener it did not inherit (a program between the launcher and it closed
// the descriptor), whose port is therefore still held, fails saying so and what to do; its
// peer fails too, within the deadline.
TEST(Processes, RankZeroWithoutTheListenerItWasHandedSaysWhy) {
  const HeldPort held;
  // Rank 1 waits in the test's backlog for a rank 0 that never comes, until the deadline.
  // Not handed over, the descriptor number names nothing in rank 0.
  std::vector<Proc> procs =
      start_by_hand(held, {DEAR_WORKER_PATH, "ring", "1"}, "unadopted", 2, 5, {}, false);
  ASSERT_TRUE(wait_all(procs, 60s)) << "a rank hung";
  const std::string out0 = slurp(procs[0].out_path);
  EXPECT_FALSE(WIFEXITED(procs[0].status) && WEXITSTATUS(procs[0].status) == 0) << out0;
  EXPECT_NE(out0.find("cannot listen on 127.0.0.1:" + std::to_string(held.port)), std::string::npos)
      << out0;
  EXPECT_NE(out0.find(held.env() + ", the socket a launcher opened"), std::string::npos) << out0;
  EXPECT_NE(out0.find("pass_fds"), std::string::npos) << out0;
  const std::string out1 = slurp(procs[1].out_path);
  EXPECT_FALSE(WIFEXITED(procs[1].status) && WEXITSTATUS(procs[1].status) == 0) << out1;
}

// SIGINT and SIGTERM end a rank the default way, as they would any program, while its engine
// threads run; no library loaded with dear turns them into exit() (which, racing those
// threads, can hang or crash the process).
TEST(Processes, TerminationSignalsEndARankByThatSignal) {
  for (const int sig : {SIGTERM, SIGINT}) {
    const HeldPort held;
    std::vector<Proc> procs =
        start_by_hand(held, {DEAR_WORKER_PATH, "slow", "100000", "5"}, "sig" + std::to_string(sig));
    ASSERT_TRUE(dear::test::wait_ready(procs, 60s))
        << slurp(procs[0].out_path) << slurp(procs[1].out_path);
    std::this_thread::sleep_for(100ms);  // mid-run: operations in flight
    for (const Proc& p : procs) ::kill(p.pid, sig);
    ASSERT_TRUE(wait_all(procs, 30s)) << "signal " << sig << " did not end a rank";
    for (const Proc& p : procs) {
      EXPECT_TRUE(WIFSIGNALED(p.status) && WTERMSIG(p.status) == sig)
          << "signal " << sig << ": status " << p.status << ": " << slurp(p.out_path);
    }
  }
}

}  // namespace
