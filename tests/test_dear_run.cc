// dear-run end to end: the real binary, with small sh scripts as its ranks.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <poll.h>
#include <sched.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "dear/bootstrap.h"
#include "proc.h"

#ifndef DEAR_RUN_PATH
#error "DEAR_RUN_PATH must name the dear-run binary"
#endif

namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

struct Result {
  int status = 0;  // as from waitpid
  std::string out;
  std::string err;
  double seconds = 0;  // from start to exit

  [[nodiscard]] bool exited() const { return WIFEXITED(status); }
  [[nodiscard]] int code() const {
    return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  }
};

std::string describe(const Result& r) {
  return "status " + std::to_string(r.code()) + "\n--- stdout:\n" + r.out.substr(0, 4000) +
         "\n--- stderr:\n" + r.err.substr(0, 4000);
}

// One dear-run process with its stdout and stderr captured.
class DearRun {
 public:
  explicit DearRun(const std::vector<std::string>& args) : start_(Clock::now()) {
    int out[2];
    int err[2];
    if (::pipe2(out, O_CLOEXEC) != 0 || ::pipe2(err, O_CLOEXEC) != 0) std::exit(99);
    std::vector<std::string> argv = {DEAR_RUN_PATH};
    argv.insert(argv.end(), args.begin(), args.end());
    std::vector<char*> cargv;
    for (auto& a : argv) cargv.push_back(a.data());
    cargv.push_back(nullptr);
    pid_ = ::fork();
    if (pid_ == 0) {
      dear::test::default_termination_signals();
      ::dup2(out[1], STDOUT_FILENO);
      ::dup2(err[1], STDERR_FILENO);
      ::execv(cargv[0], cargv.data());
      ::_exit(98);
    }
    ::close(out[1]);
    ::close(err[1]);
    fds_[0] = out[0];
    fds_[1] = err[0];
    for (const int fd : fds_) ::fcntl(fd, F_SETFL, O_NONBLOCK);
  }
  DearRun(const DearRun&) = delete;
  DearRun& operator=(const DearRun&) = delete;

  // A test that failed half-way must not leave a job running: killing dear-run takes its
  // ranks with it.
  ~DearRun() {
    if (pid_ > 0) {
      ::kill(pid_, SIGKILL);
      int status = 0;
      ::waitpid(pid_, &status, 0);
    }
    for (const int fd : fds_) {
      if (fd >= 0) ::close(fd);
    }
  }

  [[nodiscard]] pid_t pid() const { return pid_; }
  void signal(int sig) const { ::kill(pid_, sig); }

  // Collects output until dear-run exits; fails the test if that takes longer than `limit`.
  Result wait(std::chrono::seconds limit = 20s) {
    Result r;
    const auto give_up = Clock::now() + limit;
    for (;;) {
      read_available(r);
      const pid_t done = ::waitpid(pid_, &r.status, WNOHANG);
      if (done == pid_) {
        r.seconds = std::chrono::duration<double>(Clock::now() - start_).count();
        pid_ = -1;
        read_available(r);
        return r;
      }
      if (Clock::now() > give_up) {
        ADD_FAILURE() << "dear-run did not exit within " << limit.count() << " s";
        ::kill(pid_, SIGKILL);
        ::waitpid(pid_, &r.status, 0);
        pid_ = -1;
        read_available(r);
        return r;
      }
      pollfd pfds[2] = {{fds_[0], POLLIN, 0}, {fds_[1], POLLIN, 0}};
      ::poll(pfds, 2, 20);
    }
  }

 private:
  void read_available(Result& r) {
    char buf[65536];
    for (int i = 0; i < 2; ++i) {
      std::string& sink = i == 0 ? r.out : r.err;
      for (;;) {
        const ssize_t n = ::read(fds_[i], buf, sizeof buf);
        if (n > 0) {
          sink.append(buf, static_cast<std::size_t>(n));
          continue;
        }
        if (n < 0 && errno == EINTR) continue;
        break;
      }
    }
  }

  pid_t pid_ = -1;
  int fds_[2] = {-1, -1};
  Clock::time_point start_;
};

Result run(const std::vector<std::string>& args, std::chrono::seconds limit = 20s) {
  DearRun job(args);
  return job.wait(limit);
}

std::vector<std::string> lines_of(const std::string& text) {
  std::vector<std::string> lines;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  return lines;
}

// A directory of its own for files the ranks write; removed with what is in it.
class TempDir {
 public:
  TempDir() {
    std::string pattern = ::testing::TempDir() + "dear_run_XXXXXX";
    if (::mkdtemp(pattern.data()) == nullptr) std::exit(97);
    path_ = pattern;
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  ~TempDir() { std::system(("rm -rf '" + path_ + "'").c_str()); }
  [[nodiscard]] std::string file(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

std::vector<pid_t> read_pids(const std::string& path) {
  std::vector<pid_t> pids;
  std::ifstream in(path);
  for (long pid = 0; in >> pid;) pids.push_back(static_cast<pid_t>(pid));
  return pids;
}

// Waits until `path` lists `count` pids (the ranks are up and have said who they are).
std::vector<pid_t> await_pids(const std::string& path, std::size_t count) {
  const auto give_up = Clock::now() + 10s;
  std::vector<pid_t> pids;
  while ((pids = read_pids(path)).size() < count && Clock::now() < give_up) {
    std::this_thread::sleep_for(20ms);
  }
  return pids;
}

// A zombie counts as gone: it no longer runs, and whether the init process of a container
// reaps orphans is not dear-run's doing.
bool is_running(pid_t pid) {
  if (::kill(pid, 0) != 0) return errno != ESRCH;
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string text;
  std::getline(stat, text);
  const auto close = text.rfind(')');
  if (close == std::string::npos || close + 2 >= text.size()) return false;
  return text[close + 2] != 'Z' && text[close + 2] != 'X';
}

// Processes die a moment after the signal; give them that moment.
bool all_gone(const std::vector<pid_t>& pids) {
  const auto give_up = Clock::now() + 3s;
  for (;;) {
    if (std::none_of(pids.begin(), pids.end(), is_running)) return true;
    if (Clock::now() > give_up) return false;
    std::this_thread::sleep_for(20ms);
  }
}

// "[ 3] text" -> 3 and "text", for a prefix `width` digits wide.
bool split_prefix(const std::string& line, std::size_t width, int& rank, std::string& text) {
  if (line.size() < width + 3 || line[0] != '[' || line.compare(width + 1, 2, "] ") != 0) {
    return false;
  }
  const std::string digits = line.substr(1, width);
  const auto first = digits.find_first_not_of(' ');
  if (first == std::string::npos ||
      digits.find_first_not_of("0123456789", first) != std::string::npos) {
    return false;
  }
  rank = std::stoi(digits.substr(first));
  text = line.substr(width + 3);
  return true;
}

bool has_hex_run(const std::string& text, std::size_t length) {
  std::size_t run = 0;
  for (const char c : text) {
    run = std::isxdigit(static_cast<unsigned char>(c)) != 0 ? run + 1 : 0;
    if (run >= length) return true;
  }
  return false;
}

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

TEST(DearRun, EveryRankGetsItsEnvironment) {
  const Result r = run({"-n", "4", "sh", "-c",
                        "echo $DEAR_RANK $DEAR_WORLD_SIZE $DEAR_LOCAL_RANK $DEAR_LOCAL_SIZE "
                        "$RANK $WORLD_SIZE $LOCAL_RANK $LOCAL_WORLD_SIZE $MASTER_ADDR "
                        "$MASTER_PORT $DEAR_UNIQUE_ID"});
  ASSERT_EQ(r.code(), 0) << describe(r);
  const auto lines = lines_of(r.out);
  ASSERT_EQ(lines.size(), 4u) << describe(r);
  std::set<int> ranks;
  std::set<std::string> ids;
  for (const auto& line : lines) {
    std::istringstream in(line);
    std::string prefix;
    int rank = -1, world = -1, local_rank = -1, local_size = -1;
    int t_rank = -1, t_world = -1, t_local_rank = -1, t_local_world = -1;
    std::string addr, port, id;
    in >> prefix >> rank >> world >> local_rank >> local_size >> t_rank >> t_world >>
        t_local_rank >> t_local_world >> addr >> port >> id;
    ASSERT_FALSE(in.fail()) << line;
    EXPECT_EQ(prefix, "[" + std::to_string(rank) + "]");
    EXPECT_EQ(world, 4);
    EXPECT_EQ(local_rank, rank);
    EXPECT_EQ(local_size, 4);
    EXPECT_EQ(t_rank, rank);
    EXPECT_EQ(t_world, 4);
    EXPECT_EQ(t_local_rank, rank);
    EXPECT_EQ(t_local_world, 4);
    const dear::UniqueId parsed = dear::UniqueId::parse(id);
    EXPECT_EQ(parsed.host, "127.0.0.1");
    EXPECT_EQ(parsed.host, addr);
    EXPECT_EQ(std::to_string(parsed.port), port);
    EXPECT_NE(parsed.secret, decltype(parsed.secret){});
    ranks.insert(rank);
    ids.insert(id);
  }
  EXPECT_EQ(ranks, (std::set<int>{0, 1, 2, 3}));
  EXPECT_EQ(ids.size(), 1u) << "every rank must see the same DEAR_UNIQUE_ID";
}

TEST(DearRun, EachJobGetsItsOwnSecret) {
  const std::vector<std::string> args = {"-n", "1", "sh", "-c", "echo $DEAR_UNIQUE_ID"};
  const Result a = run(args);
  const Result b = run(args);
  ASSERT_EQ(a.code(), 0) << describe(a);
  ASSERT_EQ(b.code(), 0) << describe(b);
  EXPECT_NE(a.out, b.out);
}

TEST(DearRun, EnvHostAndPortOptions) {
  const Result r =
      run({"-n", "2", "--env", "FOO=bar baz", "--env", "EMPTY=", "--host", "127.0.0.1", "--port",
           "23456", "--", "sh", "-c", "echo \"$FOO|${EMPTY-unset}|$MASTER_PORT\""});
  ASSERT_EQ(r.code(), 0) << describe(r);
  auto lines = lines_of(r.out);
  std::sort(lines.begin(), lines.end());  // ranks run side by side
  EXPECT_EQ(lines, (std::vector<std::string>{"[0] bar baz||23456", "[1] bar baz||23456"}))
      << describe(r);
}

// Where dear-run picks the port, rank 0 alone inherits the listening socket on it, open in its
// own table of descriptors; where --port names one, rank 0 binds it itself and nobody gets a
// descriptor.
TEST(DearRun, RankZeroAloneInheritsTheListenerOfAPickedPort) {
  const std::string script =
      "fd=${DEAR_LISTEN_FD-none}; open=no; [ \"$fd\" != none ] && [ -e /proc/$$/fd/$fd ] && "
      "open=yes; echo \"$fd|$open\"";
  const Result picked = run({"-n", "3", "--", "sh", "-c", script});
  ASSERT_EQ(picked.code(), 0) << describe(picked);
  auto lines = lines_of(picked.out);
  std::sort(lines.begin(), lines.end());
  ASSERT_EQ(lines.size(), 3U) << describe(picked);
  EXPECT_TRUE(lines[0].starts_with("[0] ") && lines[0].ends_with("|yes") &&
              lines[0].find("none") == std::string::npos)
      << describe(picked);
  EXPECT_EQ(lines[1], "[1] none|no") << describe(picked);
  EXPECT_EQ(lines[2], "[2] none|no") << describe(picked);

  const Result named = run({"-n", "2", "--port", "23457", "--", "sh", "-c", script});
  ASSERT_EQ(named.code(), 0) << describe(named);
  lines = lines_of(named.out);
  std::sort(lines.begin(), lines.end());
  EXPECT_EQ(lines, (std::vector<std::string>{"[0] none|no", "[1] none|no"})) << describe(named);
}

TEST(DearRun, PrefixedLinesAreWholeAndInOrder) {
  // Lines longer than a pipe's atomic write, from 12 ranks at once, on both streams; each
  // rank ends with a line that has no newline.
  constexpr int kRanks = 12;
  constexpr int kLines = 40;
  constexpr int kWidth = 6000;
  const std::string script =
      "i=0; while [ $i -lt " + std::to_string(kLines) + " ]; do printf \"r%s i%s %0" +
      std::to_string(kWidth) +
      "d\\n\" $DEAR_RANK $i 0; printf \"e%s i%s\\n\" $DEAR_RANK $i >&2; i=$((i+1)); done; "
      "printf tail$DEAR_RANK";
  const Result r = run({"-n", std::to_string(kRanks), "sh", "-c", script});
  ASSERT_EQ(r.code(), 0) << describe(r);

  std::map<int, int> next;  // rank -> next line number expected
  std::set<int> tails;
  for (const auto& line : lines_of(r.out)) {
    int rank = -1;
    std::string text;
    ASSERT_TRUE(split_prefix(line, 2, rank, text)) << "unprefixed: " << line.substr(0, 200);
    int from = -1;
    int number = -1;
    int zeros_at = 0;
    if (std::sscanf(text.c_str(), "tail%d", &from) == 1) {
      EXPECT_EQ(rank, from) << line;
      EXPECT_EQ(next[rank], kLines) << "tail before the last line of its rank";
      tails.insert(rank);
      continue;
    }
    ASSERT_EQ(std::sscanf(text.c_str(), "r%d i%d %n", &from, &number, &zeros_at), 2)
        << "mixed line: " << line.substr(0, 200);
    const std::string zeros = text.substr(static_cast<std::size_t>(zeros_at));
    EXPECT_EQ(rank, from) << "line of one rank under the prefix of another";
    EXPECT_EQ(number, next[rank]++) << "lines of rank " << rank << " out of order";
    EXPECT_EQ(zeros, std::string(kWidth, '0')) << "line cut or mixed: " << line.substr(0, 200);
  }
  EXPECT_EQ(tails.size(), static_cast<std::size_t>(kRanks));
  for (int rank = 0; rank < kRanks; ++rank) EXPECT_EQ(next[rank], kLines) << "rank " << rank;

  std::map<int, int> next_err;
  for (const auto& line : lines_of(r.err)) {
    int rank = -1;
    std::string text;
    ASSERT_TRUE(split_prefix(line, 2, rank, text)) << "unprefixed: " << line;
    int from = -1;
    int number = -1;
    ASSERT_EQ(std::sscanf(text.c_str(), "e%d i%d", &from, &number), 2) << line;
    EXPECT_EQ(rank, from) << line;
    EXPECT_EQ(number, next_err[rank]++) << line;
  }
  for (int rank = 0; rank < kRanks; ++rank) EXPECT_EQ(next_err[rank], kLines);
}

TEST(DearRun, NoPrefixPassesOutputThrough) {
  const Result r = run({"-n", "2", "--no-prefix", "sh", "-c", "echo hello; echo oops >&2"});
  ASSERT_EQ(r.code(), 0) << describe(r);
  EXPECT_EQ(lines_of(r.out), (std::vector<std::string>{"hello", "hello"}));
  EXPECT_EQ(lines_of(r.err), (std::vector<std::string>{"oops", "oops"}));
}

TEST(DearRun, ExitsZeroWhenEveryRankDoes) {
  const Result r = run({"-n", "3", "true"});
  EXPECT_EQ(r.code(), 0) << describe(r);
  EXPECT_EQ(r.err, "");
}

TEST(DearRun, FailingRankStopsTheOthers) {
  const Result r = run(
      {"-n", "3", "sh", "-c", "if [ $DEAR_RANK = 1 ]; then sleep 0.2; exit 3; fi; exec sleep 100"});
  EXPECT_EQ(r.code(), 3) << describe(r);
  EXPECT_LT(r.seconds, 5.0);
  EXPECT_TRUE(contains(r.err, "dear-run: rank 1 (pid ")) << describe(r);
  EXPECT_TRUE(contains(r.err, "exited with status 3")) << describe(r);
  // The ranks stopped because of it are consequences, not the cause.
  const auto err = lines_of(r.err);
  ASSERT_FALSE(err.empty());
  EXPECT_TRUE(contains(err.front(), "rank 1 ")) << describe(r);
  EXPECT_TRUE(contains(r.err, "rank 0 (pid ")) << describe(r);
  EXPECT_TRUE(contains(r.err, "rank 2 (pid ")) << describe(r);
  EXPECT_TRUE(contains(r.err, "killed by signal 15")) << describe(r);
}

TEST(DearRun, NamesTheSignalThatKilledARank) {
  const Result r =
      run({"-n", "2", "sh", "-c", "if [ $DEAR_RANK = 0 ]; then kill -9 $$; fi; exec sleep 100"});
  EXPECT_EQ(r.code(), 128 + 9) << describe(r);
  EXPECT_LT(r.seconds, 5.0);
  EXPECT_TRUE(contains(r.err, "rank 0 (pid ")) << describe(r);
  EXPECT_TRUE(contains(r.err, "was killed by signal 9 (Killed)")) << describe(r);
}

TEST(DearRun, KillsRanksThatIgnoreSigterm) {
  // Rank 1 fails only after rank 0 has had time to install its trap; otherwise SIGTERM could
  // arrive first and the SIGKILL path would go untested.
  const Result r = run({"-n", "2", "--kill-grace", "0.5", "sh", "-c",
                        "trap '' TERM; if [ $DEAR_RANK = 1 ]; then sleep 0.5; exit 1; fi; "
                        "sleep 100"});
  EXPECT_EQ(r.code(), 1) << describe(r);
  EXPECT_LT(r.seconds, 5.0);
  EXPECT_TRUE(contains(r.err, "SIGKILL")) << describe(r);
}

TEST(DearRun, SigtermLeavesNoProcessBehind) {
  const TempDir dir;
  const std::string pids = dir.file("pids");
  DearRun job({"-n", "3", "sh", "-c",
               "echo $$ >> " + pids + "; sleep 100 & echo $! >> " + pids + "; wait"});
  const auto started = await_pids(pids, 6);
  ASSERT_EQ(started.size(), 6u);
  job.signal(SIGTERM);
  const Result r = job.wait();
  EXPECT_TRUE(WIFSIGNALED(r.status) && WTERMSIG(r.status) == SIGTERM) << describe(r);
  EXPECT_TRUE(contains(r.err, "received SIGTERM")) << describe(r);
  EXPECT_TRUE(all_gone(started));
}

TEST(DearRun, SecondSigintKills) {
  const TempDir dir;
  const std::string pids = dir.file("pids");
  DearRun job({"-n", "2", "--kill-grace", "60", "sh", "-c",
               "trap '' INT; echo $$ >> " + pids + "; exec sleep 100"});
  const auto started = await_pids(pids, 2);
  ASSERT_EQ(started.size(), 2u);
  job.signal(SIGINT);
  std::this_thread::sleep_for(300ms);
  job.signal(SIGINT);
  const Result r = job.wait();
  EXPECT_TRUE(WIFSIGNALED(r.status) && WTERMSIG(r.status) == SIGINT) << describe(r);
  EXPECT_LT(r.seconds, 10.0);
  EXPECT_TRUE(contains(r.err, "second SIGINT")) << describe(r);
  EXPECT_TRUE(all_gone(started));
}

TEST(DearRun, StopsWhatFinishedRanksLeftBehind) {
  const TempDir dir;
  const std::string pids = dir.file("pids");
  const Result r = run({"-n", "1", "sh", "-c", "sleep 100 >/dev/null 2>&1 & echo $! > " + pids});
  EXPECT_EQ(r.code(), 0) << describe(r);
  EXPECT_LT(r.seconds, 5.0);
  EXPECT_TRUE(contains(r.err, "left processes running")) << describe(r);
  const auto left = read_pids(pids);
  ASSERT_EQ(left.size(), 1u);
  EXPECT_TRUE(all_gone(left));
}

TEST(DearRun, Timeout) {
  const Result r = run({"-n", "2", "--timeout", "1", "sleep", "100"});
  EXPECT_EQ(r.code(), 124) << describe(r);
  EXPECT_GE(r.seconds, 0.9);
  EXPECT_LT(r.seconds, 5.0);
  EXPECT_TRUE(contains(r.err, "timeout")) << describe(r);
}

TEST(DearRun, MissingCommandExits127) {
  const Result r = run({"-n", "2", "dear-run-test-no-such-command"});
  EXPECT_EQ(r.code(), 127) << describe(r);
  EXPECT_TRUE(contains(r.err, "rank 0: cannot execute 'dear-run-test-no-such-command'"))
      << describe(r);
  EXPECT_TRUE(contains(r.err, "rank 1: cannot execute")) << describe(r);
  EXPECT_TRUE(contains(r.err, "No such file or directory")) << describe(r);
}

TEST(DearRun, DryRunStartsNothingAndHidesTheSecret) {
  const TempDir dir;
  const std::string marker = dir.file("marker");
  const Result r = run({"-n", "2", "--dry-run", "--env", "FOO=bar", "touch", marker});
  ASSERT_EQ(r.code(), 0) << describe(r);
  EXPECT_NE(::access(marker.c_str(), F_OK), 0) << "--dry-run ran the command";
  EXPECT_TRUE(contains(r.out, "[0] DEAR_RANK=0 ")) << r.out;
  EXPECT_TRUE(contains(r.out, "[1] DEAR_RANK=1 ")) << r.out;
  EXPECT_TRUE(contains(r.out, "FOO=bar")) << r.out;
  EXPECT_TRUE(contains(r.out, "<secret>")) << r.out;
  EXPECT_FALSE(has_hex_run(r.out, 32)) << "the secret was printed: " << r.out;
}

// The CPUs this process may run on, ascending.
std::vector<int> own_cpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  EXPECT_EQ(::sched_getaffinity(0, sizeof set, &set), 0);
  std::vector<int> out;
  for (int cpu = 0; cpu < CPU_SETSIZE; ++cpu) {
    if (CPU_ISSET(cpu, &set)) out.push_back(cpu);
  }
  return out;
}

// "0,2-3" as /proc/self/status writes Cpus_allowed_list.
std::vector<int> parse_cpu_list(const std::string& text) {
  std::vector<int> out;
  std::istringstream in(text);
  std::string part;
  while (std::getline(in, part, ',')) {
    const auto dash = part.find('-');
    const int lo = std::stoi(part.substr(0, dash));
    const int hi = dash == std::string::npos ? lo : std::stoi(part.substr(dash + 1));
    for (int cpu = lo; cpu <= hi; ++cpu) out.push_back(cpu);
  }
  return out;
}

// Each rank's Cpus_allowed_list, by rank.
std::map<int, std::vector<int>> allowed_cpus_by_rank(const std::vector<std::string>& options,
                                                     int ranks) {
  std::vector<std::string> args = {"-n", std::to_string(ranks)};
  args.insert(args.end(), options.begin(), options.end());
  args.insert(args.end(), {"sh", "-c",
                           "echo $DEAR_RANK $(grep Cpus_allowed_list: "
                           "/proc/self/status | cut -f2)"});
  const Result r = run(args);
  EXPECT_EQ(r.code(), 0) << describe(r);
  std::map<int, std::vector<int>> out;
  for (const auto& line : lines_of(r.out)) {
    std::istringstream in(line);
    std::string prefix, list;
    int rank = -1;
    in >> prefix >> rank >> list;
    EXPECT_FALSE(in.fail()) << line;
    out[rank] = parse_cpu_list(list);
  }
  EXPECT_EQ(out.size(), static_cast<std::size_t>(ranks)) << describe(r);
  return out;
}

TEST(DearRun, SpreadBindsEachRankToItsShareOfTheCpus) {
  const std::vector<int> cpus = own_cpus();
  ASSERT_FALSE(cpus.empty());
  const auto n = static_cast<int>(cpus.size());
  // Fewer ranks than CPUs (when there are several), as many, and more: round robin then.
  for (const int ranks : {std::max(1, n / 2), n, n + 1, 2 * n + 1}) {
    const auto got = allowed_cpus_by_rank({"--bind", "spread"}, ranks);
    const int each = std::max(1, n / ranks);
    for (int r = 0; r < ranks; ++r) {
      std::vector<int> want;
      for (int i = 0; i < each; ++i) {
        const int at = n >= ranks ? r * each + i : r % n;
        want.push_back(cpus[static_cast<std::size_t>(at)]);
      }
      const auto it = got.find(r);
      ASSERT_NE(it, got.end()) << "rank " << r << " of " << ranks;
      EXPECT_EQ(it->second, want) << "rank " << r << " of " << ranks;
    }
  }
}

// auto (the default) binds as spread while every rank can have a CPU of its own, and not at
// all beyond that.
TEST(DearRun, AutoBindsOnlyWhenTheCpusSuffice) {
  const std::vector<int> cpus = own_cpus();
  const auto n = static_cast<int>(cpus.size());
  EXPECT_EQ(allowed_cpus_by_rank({}, n), allowed_cpus_by_rank({"--bind", "spread"}, n));
  EXPECT_EQ(allowed_cpus_by_rank({"--bind", "auto"}, n), allowed_cpus_by_rank({}, n));
  for (const auto& [rank, list] : allowed_cpus_by_rank({}, n + 1)) {
    EXPECT_EQ(list, cpus) << "rank " << rank << " of " << n + 1 << " on " << n << " CPUs";
  }
}

TEST(DearRun, BindNoneLeavesEveryRankOnAllCpus) {
  const std::vector<int> cpus = own_cpus();
  for (const auto& [rank, list] : allowed_cpus_by_rank({"--bind", "none"}, 3)) {
    EXPECT_EQ(list, cpus) << "rank " << rank;
  }
}

TEST(DearRun, DryRunShowsTheBinding) {
  const std::vector<int> cpus = own_cpus();
  const Result r = run({"-n", "1", "--dry-run", "--bind", "spread", "true"});
  ASSERT_EQ(r.code(), 0) << describe(r);
  // One rank gets every CPU; the list is written as ranges, so check its ends.
  EXPECT_TRUE(contains(r.out, "# CPUs " + std::to_string(cpus.front()))) << r.out;
  const Result none = run({"-n", "1", "--dry-run", "--bind", "none", "true"});
  EXPECT_FALSE(contains(none.out, "# CPUs")) << none.out;
}

TEST(DearRun, CommandLine) {
  const Result version = run({"--version"});
  EXPECT_EQ(version.code(), 0);
  EXPECT_TRUE(contains(version.out, "dear-run")) << describe(version);
  const Result help = run({"--help"});
  EXPECT_EQ(help.code(), 0);
  EXPECT_TRUE(contains(help.out, "--kill-grace")) << describe(help);
  EXPECT_EQ(run({"true"}).code(), 2) << "-n is required";
  EXPECT_EQ(run({"-n", "0", "true"}).code(), 2);
  EXPECT_EQ(run({"-n", "2"}).code(), 2) << "a command is required";
  EXPECT_EQ(run({"-n", "2", "--bogus", "true"}).code(), 2);
  EXPECT_EQ(run({"-n", "2", "--env", "DEAR_RANK=5", "true"}).code(), 2);
  EXPECT_EQ(run({"-n", "2", "--env", "NOVALUE", "true"}).code(), 2);
  const Result bind = run({"-n", "2", "--bind", "socket", "true"});
  EXPECT_EQ(bind.code(), 2);
  EXPECT_TRUE(contains(bind.err, "--bind")) << describe(bind);
  // After --, a command may start with '-'; this one does not exist.
  EXPECT_EQ(run({"-n", "1", "--", "-no-such-command"}).code(), 127);
}

}  // namespace
