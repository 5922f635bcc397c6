// Ranks on emulated hosts (scripts/netns-cluster.sh): network namespaces joined by shaped
// veth links, one rank in each, the rendezvous at rank 0's namespace address. Checks that
// collectives give the right results across the namespaces with the link delay the script
// passes on, that dear-bench produces a row there, that teardown leaves nothing behind, and
// that a cut link is survived when restored within the deadline and named when it is not.
// Skips when not root or when this machine cannot make namespaces.
#include <gtest/gtest.h>
#include <signal.h>
#include <stdlib.h>
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
#include "transport/listener_registry.h"

namespace {

using namespace std::chrono_literals;

constexpr int kUnsupported = 77;  // netns-cluster.sh: this machine cannot build namespaces

struct Result {
  int status = -1;  // exit status, or -1 when killed or not exited in time
  std::string output;
};

// Runs argv with `env` added, stdout and stderr captured, for at most `limit`.
Result run(const std::vector<std::string>& argv, const std::vector<std::string>& env,
           std::chrono::seconds limit) {
  const std::string out_path = ::testing::TempDir() + "dear_netns_" + std::to_string(::getpid()) +
                               "_" + std::to_string(std::rand()) + ".out";
  const pid_t pid = ::fork();
  if (pid == 0) {
    for (const auto& kv : env) ::putenv(const_cast<char*>(kv.c_str()));
    std::FILE* f = std::fopen(out_path.c_str(), "w");
    if (f == nullptr) ::_exit(127);
    ::dup2(::fileno(f), 1);
    ::dup2(::fileno(f), 2);
    ::setpgid(0, 0);  // so that a timeout can stop the command and what it started
    std::vector<char*> args;
    for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    ::execvp(args[0], args.data());
    ::_exit(127);
  }
  Result r;
  const auto end = std::chrono::steady_clock::now() + limit;
  int status = 0;
  bool exited = false;
  while (std::chrono::steady_clock::now() < end) {
    if (::waitpid(pid, &status, WNOHANG) == pid) {
      exited = true;
      break;
    }
    std::this_thread::sleep_for(20ms);
  }
  if (!exited) {
    ::kill(-pid, SIGKILL);
    ::waitpid(pid, &status, 0);
  } else if (WIFEXITED(status)) {
    r.status = WEXITSTATUS(status);
  }
  std::ifstream f(out_path);
  std::stringstream s;
  s << f.rdbuf();
  r.output = s.str();
  ::unlink(out_path.c_str());
  return r;
}

// One emulated cluster for the test's lifetime; torn down however the test ends.
class Cluster {
 public:
  Cluster() : prefix_("dt" + std::to_string(::getpid())) {}
  ~Cluster() {
    if (up_) (void)script({"down"});
  }
  Result script(std::vector<std::string> args) {
    args.insert(args.begin(), {"bash", DEAR_NETNS_SCRIPT});
    return run(args, {"DEAR_NETNS_PREFIX=" + prefix_}, 30s);
  }
  Result up(const std::vector<std::string>& args) {
    std::vector<std::string> a{"up"};
    a.insert(a.end(), args.begin(), args.end());
    Result r = script(a);
    up_ = r.status == 0;
    return r;
  }
  Result down() {
    up_ = false;
    return script({"down"});
  }
  const std::string& prefix() const { return prefix_; }

 private:
  std::string prefix_;
  bool up_ = false;
};

// Starts one process per rank, rank r on host r, and waits for all of them.
std::vector<Result> run_ranks(Cluster& cluster, int n, const std::vector<std::string>& command,
                              int timeout_s = 20) {
  dear::UniqueId id;
  id.host = "10.77.0.1";  // host 0, where rank 0 listens
  id.port = 29500;        // a fresh namespace has every port free
  id.secret = dear::transport::random_secret();
  std::vector<std::thread> threads;
  std::vector<Result> results(static_cast<std::size_t>(n));
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      std::vector<std::string> argv{"bash", DEAR_NETNS_SCRIPT, "exec", std::to_string(r)};
      argv.insert(argv.end(), command.begin(), command.end());
      results[static_cast<std::size_t>(r)] =
          run(argv,
              {"DEAR_NETNS_PREFIX=" + cluster.prefix(), "DEAR_UNIQUE_ID=" + id.to_string(),
               "DEAR_RANK=" + std::to_string(r), "DEAR_WORLD_SIZE=" + std::to_string(n),
               "DEAR_TIMEOUT=" + std::to_string(timeout_s)},
              std::chrono::seconds(timeout_s + 15));
    });
  }
  for (auto& t : threads) t.join();
  return results;
}

TEST(EmulatedHosts, TwoRanksInTwoNamespacesWithLinkDelay) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to make network namespaces";
  Cluster cluster;
  const Result up = cluster.up({"2", "--rate", "1gbit", "--delay-us", "100"});
  if (up.status == kUnsupported) GTEST_SKIP() << up.output;
  ASSERT_EQ(up.status, 0) << up.output;

  // all_reduce, reduce_scatter, all_gather, broadcast and barrier, each result checked.
  const auto ranks = run_ranks(cluster, 2, {DEAR_WORKER_PATH, "ring", "2"});
  for (int r = 0; r < 2; ++r) {
    const Result& res = ranks[static_cast<std::size_t>(r)];
    EXPECT_EQ(res.status, 0) << "rank " << r << ": " << res.output;
    EXPECT_NE(res.output.find("ok rank " + std::to_string(r)), std::string::npos) << res.output;
  }

#ifdef DEAR_BENCH_PATH
  // One dear-bench row: 8-byte all_reduce, validated; it crosses one delayed link per step.
  const auto bench = run_ranks(
      cluster, 2,
      {DEAR_BENCH_PATH, "all_reduce", "-b", "8", "-e", "8", "-c", "1", "-n", "20", "-w", "5"});
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(bench[static_cast<std::size_t>(r)].status, 0)
        << "rank " << r << ": " << bench[static_cast<std::size_t>(r)].output;
  }
  std::printf("%s", bench[0].output.c_str());
  EXPECT_NE(bench[0].output.find("Out of bounds values : 0 OK"), std::string::npos)
      << bench[0].output;
#endif

  const Result down = cluster.down();
  EXPECT_EQ(down.status, 0) << down.output;
  const Result left = run({"ip", "netns", "list"}, {}, 10s);
  EXPECT_EQ(left.output.find(cluster.prefix() + "-"), std::string::npos)
      << "namespaces left behind: " << left.output;
}

// Takes host i's link at the switch down (a cut cable: no reset, no FIN) or back up.
Result set_link(Cluster& cluster, int i, bool up) {
  return run({"ip", "-n", cluster.prefix() + "-br", "link", "set", "p" + std::to_string(i),
              up ? "up" : "down"},
             {}, 10s);
}

TEST(EmulatedHosts, ALinkCutAndRestoredWithinTheDeadlineLetsTheJobFinish) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to make network namespaces";
  Cluster cluster;
  const Result up = cluster.up({"3"});
  if (up.status == kUnsupported) GTEST_SKIP() << up.output;
  ASSERT_EQ(up.status, 0) << up.output;
  std::vector<Result> ranks;
  std::thread job([&] { ranks = run_ranks(cluster, 3, {DEAR_WORKER_PATH, "slow", "300", "10"}); });
  std::this_thread::sleep_for(1500ms);
  const Result cut = set_link(cluster, 1, false);
  std::this_thread::sleep_for(1000ms);
  const Result restored = set_link(cluster, 1, true);
  job.join();
  EXPECT_EQ(cut.status, 0) << cut.output;
  EXPECT_EQ(restored.status, 0) << restored.output;
  for (int r = 0; r < 3; ++r) {
    const Result& res = ranks[static_cast<std::size_t>(r)];
    EXPECT_EQ(res.status, 0) << "rank " << r << ": " << res.output;
    EXPECT_NE(res.output.find("ok rank " + std::to_string(r)), std::string::npos) << res.output;
  }
}

TEST(EmulatedHosts, ACutLinkIsNamedByTheRanksOnTheOtherSide) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to make network namespaces";
  Cluster cluster;
  const Result up = cluster.up({"3"});
  if (up.status == kUnsupported) GTEST_SKIP() << up.output;
  ASSERT_EQ(up.status, 0) << up.output;
  constexpr int kDeadlineS = 4;
  std::vector<Result> ranks;
  const auto start = std::chrono::steady_clock::now();
  std::thread job([&] {
    ranks = run_ranks(cluster, 3, {DEAR_WORKER_PATH, "slow", "100000", "1"}, kDeadlineS);
  });
  std::this_thread::sleep_for(1500ms);
  const Result cut = set_link(cluster, 1, false);
  const auto cut_at = std::chrono::steady_clock::now();
  job.join();
  const auto took = std::chrono::steady_clock::now() - cut_at;
  EXPECT_EQ(cut.status, 0) << cut.output;
  EXPECT_LT(took, std::chrono::seconds(kDeadlineS) + 5s)
      << "after the cut, "
      << std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() -
                                                               start)
             .count()
      << " ms in all";
  // Host 1 is cut off; ranks 0 and 2 still reach each other and must both name rank 1.
  for (int r : {0, 2}) {
    const Result& res = ranks[static_cast<std::size_t>(r)];
    EXPECT_EQ(res.status, 3) << "rank " << r << ": " << res.output;
    EXPECT_NE(res.output.find("peer=1 "), std::string::npos)
        << "rank " << r << " does not name rank 1: " << res.output;
  }
  EXPECT_EQ(ranks[1].status, 3) << "rank 1: " << ranks[1].output;
}

}  // namespace
