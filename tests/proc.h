// Helpers for tests that run ranks as separate processes: start a program with extra
// environment and its output in a file, wait for a group with a time limit, read the output.
#pragma once

#include <fcntl.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace dear::test {

inline std::string slurp(const std::string& path) {
  std::ifstream f(path);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

// In a forked child before exec: the default action for the termination signals, whatever
// the test inherited (a shell starts background jobs with SIGINT ignored, and exec keeps
// ignored signals), so that tests that signal their children see what a user would.
inline void default_termination_signals() {
  ::signal(SIGINT, SIG_DFL);
  ::signal(SIGTERM, SIG_DFL);
}

struct Proc {
  pid_t pid = -1;
  int status = 0;
  bool exited = false;
  std::string out_path;
};

// Starts argv with extra environment, stdout+stderr to a file; `inherit_fd` stays open in it.
inline Proc spawn(const std::vector<std::string>& argv, const std::vector<std::string>& env,
                  const std::string& out_path, int inherit_fd = -1) {
  Proc p;
  p.out_path = out_path;
  p.pid = ::fork();
  if (p.pid == 0) {
    default_termination_signals();
    if (inherit_fd >= 0) ::fcntl(inherit_fd, F_SETFD, 0);
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
inline bool wait_all(std::vector<Proc>& procs, std::chrono::seconds limit) {
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
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  for (auto& p : procs) {
    if (!p.exited) {
      ::kill(p.pid, SIGKILL);
      ::waitpid(p.pid, &p.status, 0);
    }
  }
  return left == 0;
}

// Waits until every process has printed "ready rank" (connected), and gives up early when one
// ended without it: its output then says why, at once instead of after the limit. Records the
// exits it sees (wait_all skips them). True when all are ready.
inline bool wait_ready(std::vector<Proc>& procs, std::chrono::seconds limit) {
  const auto end = std::chrono::steady_clock::now() + limit;
  while (std::chrono::steady_clock::now() < end) {
    bool all = true;
    for (auto& p : procs) {
      const bool ready = slurp(p.out_path).find("ready rank") != std::string::npos;
      if (!p.exited && ::waitpid(p.pid, &p.status, WNOHANG) == p.pid) p.exited = true;
      // Read before the exit was seen: a rank that printed and then ended is not mistaken.
      if (!ready && p.exited && slurp(p.out_path).find("ready rank") == std::string::npos) {
        return false;
      }
      all = all && ready;
    }
    if (all) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return false;
}

inline std::string tmp_file(const std::string& name) {
  return ::testing::TempDir() + "dear_" + std::to_string(::getpid()) + "_" + name;
}

}  // namespace dear::test
