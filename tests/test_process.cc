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
#include "transport/listener_registry.h"

namespace {

using namespace std::chrono_literals;

std::string slurp(const std::string& path) {
  std::ifstream f(path);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

std::uint16_t free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a));
  socklen_t len = sizeof(a);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  ::close(fd);
  return ntohs(a.sin_port);
}

struct Proc {
  pid_t pid = -1;
  int status = 0;
  bool exited = false;
  std::string out_path;
};

// Starts argv with extra environment, stdout+stderr to a file.
Proc spawn(const std::vector<std::string>& argv, const std::vector<std::string>& env,
           const std::string& out_path) {
  Proc p;
  p.out_path = out_path;
  p.pid = ::fork();
  if (p.pid == 0) {
    for (const auto& kv : env) ::putenv(const_cast<char*>(kv.c_str()));
    std::FILE* f = std::fopen(out_path.c_str(), "w");
    ::dup2(::fileno(f), 1);
    ::dup2(::fileno(f), 2);
    std::vector<char*> args;
    for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    ::execv(args[0], args.data());
    ::_exit(127);
  }
  return p;
}

// Waits for every process until the deadline; kills what is left. True if all exited in time.
bool wait_all(std::vector<Proc>& procs, std::chrono::seconds limit) {
  const auto end = std::chrono::steady_clock::now() + limit;
  std::size_t left = procs.size();
  while (left > 0 && std::chrono::steady_clock::now() < end) {
    for (auto& p : procs) {
      if (p.exited) continue;
      if (::waitpid(p.pid, &p.status, WNOHANG) == p.pid) {
        p.exited = true;
        --left;
      }
    }
    std::this_thread::sleep_for(20ms);
  }
  for (auto& p : procs) {
    if (!p.exited) {
      ::kill(p.pid, SIGKILL);
      ::waitpid(p.pid, &p.status, 0);
    }
  }
  return left == 0;
}

std::string tmp_file(const std::string& name) {
  return ::testing::TempDir() + "dear_" + std::to_string(::getpid()) + "_" + name;
}

TEST(Processes, FourRanksThroughDearRun) {
  std::vector<Proc> procs{spawn({DEAR_RUN_PATH, "-n", "4", "--timeout", "120", DEAR_WORKER_PATH,
                                 "ring", "3"},
                                {}, tmp_file("run.out"))};
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
  dear::UniqueId id;
  id.host = "127.0.0.1";
  id.port = free_port();
  id.secret = dear::transport::random_secret();
  std::vector<Proc> procs;
  for (int r = 0; r < kRanks; ++r) {
    procs.push_back(spawn({DEAR_WORKER_PATH, "die", std::to_string(kVictim), "3"},
                          {"DEAR_UNIQUE_ID=" + id.to_string(), "DEAR_RANK=" + std::to_string(r),
                           "DEAR_WORLD_SIZE=" + std::to_string(kRanks), "DEAR_TIMEOUT=120"},
                          tmp_file("die" + std::to_string(r) + ".out")));
  }
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
    EXPECT_TRUE(WIFEXITED(p.status) && WEXITSTATUS(p.status) == 3)
        << "rank " << r << ": " << out;
    EXPECT_NE(out.find("peer=" + std::to_string(kVictim)), std::string::npos)
        << "rank " << r << " does not blame rank " << kVictim << ": " << out;
  }
}

TEST(Processes, DearRunReportsTheDeadRankAndFails) {
  std::vector<Proc> procs{spawn({DEAR_RUN_PATH, "-n", "3", "--timeout", "120", DEAR_WORKER_PATH,
                                 "die", "1", "2"},
                                {}, tmp_file("rundie.out"))};
  ASSERT_TRUE(wait_all(procs, 150s));
  const std::string out = slurp(procs[0].out_path);
  EXPECT_FALSE(WIFEXITED(procs[0].status) && WEXITSTATUS(procs[0].status) == 0) << out;
  EXPECT_NE(out.find("rank 1"), std::string::npos) << out;
}

}  // namespace
