#include "tools/launcher.h"

#include <dirent.h>
#include <fcntl.h>
#include <poll.h>
#include <sched.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/signalfd.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cctype>
#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <optional>
#include <set>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "tools/output_relay.h"

namespace dear::tools {
namespace {

using Clock = std::chrono::steady_clock;

constexpr std::array kForwardedSignals{SIGINT, SIGTERM, SIGHUP, SIGQUIT};
constexpr std::size_t kReadChunk = 64 * 1024;
// Reading one rank's pipe in one go stops after this much, so that a rank that never stops
// writing cannot keep dear-run from its other duties.
constexpr int kMaxChunksPerDrain = 16;
// How often the end of a job looks for processes that ranks left behind in their groups.
constexpr auto kSweepInterval = std::chrono::milliseconds(50);
// SIGKILL cannot be refused, but a process in uninterruptible sleep takes its time to die;
// after this long dear-run says so and ends rather than wait forever.
constexpr auto kAfterKillPatience = std::chrono::seconds(5);
// Consequences listed one by one; the rest are counted.
constexpr std::size_t kMaxListed = 16;

enum Stream { kStdout = 0, kStderr = 1 };

// An owned file descriptor.
class Fd {
 public:
  Fd() = default;
  explicit Fd(int fd) : fd_(fd) {}
  Fd(Fd&& other) noexcept : fd_(std::exchange(other.fd_, -1)) {}
  Fd& operator=(Fd&& other) noexcept {
    if (this != &other) {
      reset();
      fd_ = std::exchange(other.fd_, -1);
    }
    return *this;
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  ~Fd() { reset(); }

  [[nodiscard]] int get() const { return fd_; }
  explicit operator bool() const { return fd_ >= 0; }
  // Not retried on EINTR: Linux releases the descriptor even then.
  void reset() {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }

 private:
  int fd_ = -1;
};

struct Pipe {
  Fd read;
  Fd write;
};

// Close-on-exec on both ends: the child keeps only what it dup2()s onto 1 and 2.
bool make_pipe(Pipe& pipe) {
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC) != 0) return false;
  pipe.read = Fd(fds[0]);
  pipe.write = Fd(fds[1]);
  return true;
}

std::string signal_name(int sig) {
  switch (sig) {
    case SIGINT: return "SIGINT";
    case SIGTERM: return "SIGTERM";
    case SIGHUP: return "SIGHUP";
    case SIGQUIT: return "SIGQUIT";
    case SIGKILL: return "SIGKILL";
    default: return "signal " + std::to_string(sig);
  }
}

std::string describe_exit(int code, int status) {
  if (code == CLD_EXITED) return "exited with status " + std::to_string(status);
  const char* text = ::strsignal(status);
  std::string s = "was killed by signal " + std::to_string(status) + " (" +
                  (text != nullptr ? text : "unknown") + ")";
  if (code == CLD_DUMPED) s += ", core dumped";
  return s;
}

std::string rank_list(const std::vector<int>& ranks) {
  std::string s = ranks.size() == 1 ? "rank" : "ranks";
  for (std::size_t i = 0; i < ranks.size(); ++i) {
    s += (i == 0 ? " " : ", ") + std::to_string(ranks[i]);
  }
  return s;
}

std::string seconds_text(std::chrono::duration<double> d) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g s", d.count());
  return buf;
}

// Process groups that hold a process that is not a zombie, read from /proc. Zombies do not
// count: they cannot run, and the ranks' own first processes stay zombies until the end.
std::set<pid_t> live_process_groups() {
  std::set<pid_t> groups;
  DIR* dir = ::opendir("/proc");
  if (dir == nullptr) return groups;
  while (const dirent* entry = ::readdir(dir)) {
    if (std::isdigit(static_cast<unsigned char>(entry->d_name[0])) == 0) continue;
    const std::string path = std::string("/proc/") + entry->d_name + "/stat";
    const Fd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
    if (!fd) continue;  // it ended meanwhile
    char buf[512];
    ssize_t n = 0;
    do {
      n = ::read(fd.get(), buf, sizeof buf - 1);
    } while (n < 0 && errno == EINTR);
    if (n <= 0) continue;
    buf[n] = '\0';
    // "pid (comm) state ppid pgrp ...": comm may hold anything, so parse after its last ')'.
    const char* after_comm = std::strrchr(buf, ')');
    char state = 0;
    int ppid = 0;
    int pgrp = 0;
    if (after_comm == nullptr ||
        std::sscanf(after_comm + 1, " %c %d %d", &state, &ppid, &pgrp) != 3) {
      continue;
    }
    if (state != 'Z' && state != 'X') groups.insert(pgrp);
  }
  ::closedir(dir);
  return groups;
}

// Descriptors 0-2 closed by whoever started dear-run would be reused by its pipes, and a
// rank's dup2() onto them would then be a no-op that leaves them close-on-exec.
void ensure_standard_fds() {
  for (int fd = 0; fd <= 2; ++fd) {
    if (::fcntl(fd, F_GETFD) < 0 && errno == EBADF) {
      const int null_fd = ::open("/dev/null", O_RDWR);
      if (null_fd >= 0 && null_fd != fd) ::close(null_fd);
    }
  }
}

// Each rank costs dear-run two descriptors; big jobs need more than the usual soft limit.
void raise_fd_limit(std::size_t ranks) {
  rlimit limit{};
  if (::getrlimit(RLIMIT_NOFILE, &limit) != 0) return;
  const rlim_t wanted = static_cast<rlim_t>(2 * ranks + 64);
  if (limit.rlim_cur >= wanted) return;
  limit.rlim_cur = limit.rlim_max == RLIM_INFINITY ? wanted : std::min(wanted, limit.rlim_max);
  ::setrlimit(RLIMIT_NOFILE, &limit);
}

std::vector<char*> c_strings(const std::vector<std::string>& strings) {
  std::vector<char*> out;
  out.reserve(strings.size() + 1);
  for (const auto& s : strings) out.push_back(const_cast<char*>(s.c_str()));
  out.push_back(nullptr);
  return out;
}

// What a freshly forked rank needs, prepared before fork() so that the child only makes
// system calls until it executes the command.
struct ChildSetup {
  pid_t parent = -1;
  int stdin_fd = -1;   // -1: keep dear-run's stdin
  int stdout_fd = -1;  // -1: write to dear-run's stdout directly
  int stderr_fd = -1;
  int status_fd = -1;  // receives errno when the command cannot be executed
  char** argv = nullptr;
  char** envp = nullptr;
  const cpu_set_t* cpus = nullptr;  // null: keep dear-run's
  int inherit_fd = -1;              // kept open across exec
  const sigset_t* mask = nullptr;
  const struct sigaction* sigpipe_action = nullptr;
};

[[noreturn]] void exec_rank(const ChildSetup& c) {
  // A group of its own lets one kill() reach everything the rank starts, and keeps the
  // terminal's Ctrl-C for dear-run, which forwards it.
  ::setpgid(0, 0);
  // Should dear-run die without cleaning up (SIGKILL, a crash), take the rank with it. The
  // check after closes the window in which dear-run died before the request took hold.
  ::prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (::getppid() != c.parent) ::_exit(kExitLaunchError);

  int err = 0;
  // A failed binding is told apart from a failed exec by its sign.
  if (c.cpus != nullptr && ::sched_setaffinity(0, sizeof(cpu_set_t), c.cpus) != 0) err = -errno;
  if (c.stdin_fd >= 0 && ::dup2(c.stdin_fd, STDIN_FILENO) < 0) err = errno;
  if (c.stdout_fd >= 0 && ::dup2(c.stdout_fd, STDOUT_FILENO) < 0) err = errno;
  if (c.stderr_fd >= 0 && ::dup2(c.stderr_fd, STDERR_FILENO) < 0) err = errno;
  if (c.inherit_fd >= 0 && ::fcntl(c.inherit_fd, F_SETFD, 0) != 0) err = errno;
  // dear-run ignores SIGPIPE and blocks the signals it handles; the command must not inherit
  // either, or it would neither die of a broken pipe nor see a forwarded SIGTERM.
  ::sigaction(SIGPIPE, c.sigpipe_action, nullptr);
  ::sigprocmask(SIG_SETMASK, c.mask, nullptr);
  if (err == 0) {
    ::execvpe(c.argv[0], c.argv, c.envp);
    err = errno;
  }
  if (::write(c.status_fd, &err, sizeof err) < 0) {
    // Nothing left to tell it with; the exit status still says it.
  }
  ::_exit(kExitNotExecutable);
}

struct Rank {
  int index = 0;
  // Also the id of the rank's process group. The process is left a zombie (waited for with
  // WNOWAIT) until the job ends, so that the id cannot be reused while dear-run may still
  // signal the group.
  pid_t pid = -1;
  bool exited = false;
  int exit_code = 0;         // CLD_EXITED, CLD_KILLED or CLD_DUMPED
  int exit_status = 0;       // the exit status, or the signal that killed it
  int exec_errno = 0;        // why the command could not be executed, or 0
  std::array<Fd, 2> output;  // read ends of its stdout and stderr pipes
  std::array<LineRelay, 2> relays;

  [[nodiscard]] bool failed() const {
    return exited && !(exit_code == CLD_EXITED && exit_status == 0);
  }
  [[nodiscard]] int shell_status() const {
    return exit_code == CLD_EXITED ? exit_status : 128 + exit_status;
  }
  [[nodiscard]] std::string describe() const {
    return "rank " + std::to_string(index) + " (pid " + std::to_string(pid) + ") " +
           describe_exit(exit_code, exit_status);
  }
};

class Job {
 public:
  explicit Job(const JobSpec& spec) : spec_(spec), buffer_(kReadChunk) {}
  Job(const Job&) = delete;
  Job& operator=(const Job&) = delete;
  ~Job();

  JobOutcome run();

 private:
  // Why the job is ending early; the first one set is the one reported.
  enum class Cause { kNone, kRankFailed, kTimeout, kSignal, kNotExecutable, kLaunchError };

  bool setup();
  void start_ranks();
  bool start_rank(Rank& rank);
  void loop();
  [[nodiscard]] int poll_timeout_ms(Clock::time_point now) const;
  void read_signals(Clock::time_point now);
  void on_stop_signal(int sig, Clock::time_point now);
  void check_ranks(Clock::time_point now);
  void check_deadlines(Clock::time_point now);
  [[nodiscard]] bool leftovers_gone(Clock::time_point now);
  void relay(Rank& rank, int stream);
  void drain(Rank& rank);
  void flush_output();
  void stop(int sig, Clock::time_point now);
  void signal_groups(int sig);
  void kill_all(Clock::time_point now);
  void reap_all();
  void report(const std::string& line);
  void report_consequences();
  [[nodiscard]] bool all_exited() const;
  [[nodiscard]] JobOutcome outcome() const;

  const JobSpec& spec_;
  std::vector<Rank> ranks_;
  std::vector<char> buffer_;
  OutputSink stdout_{STDOUT_FILENO};
  OutputSink stderr_{STDERR_FILENO};
  // Output gathered in one turn of the loop, written at its end in one go per stream.
  std::array<std::string, 2> batches_;

  Fd signal_fd_;
  Fd dev_null_;
  sigset_t old_mask_{};
  struct sigaction old_sigpipe_ {};
  bool signals_changed_ = false;

  Cause cause_ = Cause::kNone;
  int cause_rank_ = -1;
  int cause_signal_ = 0;
  std::vector<int> consequences_;  // ranks that failed after the cause, in order

  std::optional<Clock::time_point> deadline_;       // --timeout
  std::optional<Clock::time_point> kill_deadline_;  // SIGKILL when this passes
  std::optional<Clock::time_point> killed_at_;      // SIGKILL was sent
  int stop_signal_ = SIGTERM;                       // what started the grace period
  Clock::time_point next_sweep_{};
  bool got_sigint_ = false;
  bool leftovers_stopped_ = false;
};

Job::~Job() {
  if (!signals_changed_) return;
  ::sigaction(SIGPIPE, &old_sigpipe_, nullptr);
  ::sigprocmask(SIG_SETMASK, &old_mask_, nullptr);
}

bool Job::setup() {
  ensure_standard_fds();
  raise_fd_limit(spec_.environments.size());

  // Children are waited for by pid; an inherited SIG_IGN would make the kernel reap them
  // behind dear-run's back.
  struct sigaction child_default {};
  child_default.sa_handler = SIG_DFL;
  sigemptyset(&child_default.sa_mask);
  ::sigaction(SIGCHLD, &child_default, nullptr);

  // The signals dear-run acts on arrive through a signalfd, in the same poll() as the ranks'
  // output, so that no handler runs in the middle of the loop.
  // A signal dear-run was started with ignored (nohup, a background job of a script) stays
  // ignored: whoever started it meant that signal not to stop the job.
  sigset_t handled;
  sigemptyset(&handled);
  sigaddset(&handled, SIGCHLD);
  for (const int sig : kForwardedSignals) {
    struct sigaction current {};
    if (::sigaction(sig, nullptr, &current) == 0 && current.sa_handler == SIG_IGN) continue;
    sigaddset(&handled, sig);
  }
  if (::sigprocmask(SIG_BLOCK, &handled, &old_mask_) != 0) {
    report(std::string("cannot block signals: ") + std::strerror(errno));
    return false;
  }
  struct sigaction ignore {};
  ignore.sa_handler = SIG_IGN;
  sigemptyset(&ignore.sa_mask);
  ::sigaction(SIGPIPE, &ignore, &old_sigpipe_);
  signals_changed_ = true;

  signal_fd_ = Fd(::signalfd(-1, &handled, SFD_NONBLOCK | SFD_CLOEXEC));
  if (!signal_fd_) {
    report(std::string("cannot create a signalfd: ") + std::strerror(errno));
    return false;
  }
  dev_null_ = Fd(::open("/dev/null", O_RDONLY | O_CLOEXEC));
  return true;
}

JobOutcome Job::run() {
  if (!setup()) return {kExitLaunchError, 0};
  if (spec_.timeout.count() > 0) {
    deadline_ = Clock::now() + std::chrono::duration_cast<Clock::duration>(spec_.timeout);
  }
  start_ranks();
  loop();
  reap_all();
  report_consequences();
  return outcome();
}

void Job::start_ranks() {
  const int world_size = static_cast<int>(spec_.environments.size());
  ranks_.resize(spec_.environments.size());
  for (int i = 0; i < world_size; ++i) {
    Rank& rank = ranks_[static_cast<std::size_t>(i)];
    rank.index = i;
    const std::string prefix = rank_prefix(i, world_size);
    rank.relays = {LineRelay(prefix), LineRelay(prefix)};
  }
  for (Rank& rank : ranks_) {
    const bool started = start_rank(rank);
    // Rank 0 holds its own copy now; the other ranks must not inherit it.
    if (rank.index == 0 && spec_.rank0_fd >= 0) ::close(spec_.rank0_fd);
    if (!started) {
      cause_ = Cause::kLaunchError;
      break;
    }
    if (rank.exec_errno != 0 && cause_ == Cause::kNone) cause_ = Cause::kNotExecutable;
  }
  if (cause_ != Cause::kNone) stop(SIGTERM, Clock::now());
}

bool Job::start_rank(Rank& rank) {
  const auto fail = [&](const char* call) {
    const int err = errno;
    report("cannot start rank " + std::to_string(rank.index) + ": " + call + ": " +
           std::strerror(err));
    return false;
  };
  std::array<Pipe, 2> output;
  if (spec_.prefix_output) {
    for (Pipe& pipe : output) {
      if (!make_pipe(pipe)) return fail("pipe");
    }
  }
  Pipe status;
  if (!make_pipe(status)) return fail("pipe");

  std::vector<char*> argv = c_strings(spec_.command);
  std::vector<char*> envp = c_strings(spec_.environments[static_cast<std::size_t>(rank.index)]);
  ChildSetup child;
  child.parent = ::getpid();
  // Only rank 0 may read dear-run's stdin, and not from a terminal: ranks run in background
  // process groups, where reading the terminal would stop them.
  const bool share_stdin = rank.index == 0 && ::isatty(STDIN_FILENO) == 0;
  child.stdin_fd = share_stdin ? -1 : dev_null_.get();
  child.stdout_fd = output[kStdout].write.get();
  child.stderr_fd = output[kStderr].write.get();
  child.status_fd = status.write.get();
  child.argv = argv.data();
  child.envp = envp.data();
  cpu_set_t cpus;
  CPU_ZERO(&cpus);
  const auto index = static_cast<std::size_t>(rank.index);
  if (index < spec_.cpus.size()) {
    for (const int cpu : spec_.cpus[index]) CPU_SET(cpu, &cpus);
    child.cpus = &cpus;
  }
  if (rank.index == 0) child.inherit_fd = spec_.rank0_fd;
  child.mask = &old_mask_;
  child.sigpipe_action = &old_sigpipe_;

  const pid_t pid = ::fork();
  if (pid < 0) return fail("fork");
  if (pid == 0) exec_rank(child);

  rank.pid = pid;
  // Also done by the child: whichever runs first, the group exists before either goes on.
  ::setpgid(pid, pid);
  for (int s : {kStdout, kStderr}) {
    output[static_cast<std::size_t>(s)].write.reset();
    Fd& read_end = output[static_cast<std::size_t>(s)].read;
    if (read_end) ::fcntl(read_end.get(), F_SETFL, O_NONBLOCK);
    rank.output[static_cast<std::size_t>(s)] = std::move(read_end);
  }
  status.write.reset();

  // The status pipe closes on a successful exec, or first carries the errno of a failed one.
  int err = 0;
  std::size_t got = 0;
  while (got < sizeof err) {
    const ssize_t n =
        ::read(status.read.get(), reinterpret_cast<char*>(&err) + got, sizeof err - got);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    got += static_cast<std::size_t>(n);
  }
  if (got == sizeof err && err < 0) {
    rank.exec_errno = -err;
    report("rank " + std::to_string(rank.index) + ": cannot bind it to CPUs " +
           cpu_list_text(spec_.cpus[index]) + ": " + std::strerror(rank.exec_errno));
  } else if (got == sizeof err) {
    rank.exec_errno = err != 0 ? err : EINVAL;
    report("rank " + std::to_string(rank.index) + ": cannot execute '" + spec_.command[0] +
           "': " + std::strerror(rank.exec_errno));
  }
  return true;
}

void Job::loop() {
  std::vector<pollfd> fds;
  std::vector<std::pair<Rank*, int>> owners;
  for (;;) {
    Clock::time_point now = Clock::now();
    check_deadlines(now);
    if (all_exited() && leftovers_gone(now)) break;

    fds.clear();
    owners.clear();
    fds.push_back({signal_fd_.get(), POLLIN, 0});
    owners.emplace_back(nullptr, 0);
    for (Rank& rank : ranks_) {
      for (int s : {kStdout, kStderr}) {
        const Fd& fd = rank.output[static_cast<std::size_t>(s)];
        if (!fd) continue;
        fds.push_back({fd.get(), POLLIN, 0});
        owners.emplace_back(&rank, s);
      }
    }
    const int n = ::poll(fds.data(), fds.size(), poll_timeout_ms(now));
    if (n < 0) {
      if (errno == EINTR) continue;
      report(std::string("poll failed: ") + std::strerror(errno) + "; killing all ranks");
      kill_all(Clock::now());
      break;
    }
    now = Clock::now();
    for (std::size_t i = 1; i < fds.size(); ++i) {
      if (fds[i].revents != 0) relay(*owners[i].first, owners[i].second);
    }
    // Signals after output, so that a rank's last lines come before the news of its end.
    if (fds[0].revents != 0) read_signals(now);
    flush_output();
  }
  for (Rank& rank : ranks_) drain(rank);
  flush_output();
}

int Job::poll_timeout_ms(Clock::time_point now) const {
  std::optional<Clock::time_point> wake;
  const auto consider = [&](const std::optional<Clock::time_point>& t) {
    if (t && (!wake || *t < *wake)) wake = t;
  };
  consider(deadline_);
  consider(kill_deadline_);
  if (all_exited()) consider(next_sweep_);
  if (!wake) return -1;
  if (*wake <= now) return 0;
  const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(*wake - now).count();
  return static_cast<int>(std::min<long long>(ms + 1, 60'000));
}

void Job::read_signals(Clock::time_point now) {
  bool child_changed = false;
  for (;;) {
    signalfd_siginfo info{};
    const ssize_t n = ::read(signal_fd_.get(), &info, sizeof info);
    if (n < 0 && errno == EINTR) continue;
    if (n != static_cast<ssize_t>(sizeof info)) break;
    const int sig = static_cast<int>(info.ssi_signo);
    if (sig == SIGCHLD) {
      child_changed = true;
    } else {
      on_stop_signal(sig, now);
    }
  }
  if (child_changed) check_ranks(now);
}

void Job::on_stop_signal(int sig, Clock::time_point now) {
  if (sig == SIGINT && got_sigint_) {
    report("second SIGINT: killing all ranks (SIGKILL)");
    kill_all(now);
    return;
  }
  if (sig == SIGINT) got_sigint_ = true;
  report("received " + signal_name(sig) + "; forwarding it to all ranks");
  if (cause_ == Cause::kNone) {
    cause_ = Cause::kSignal;
    cause_signal_ = sig;
  }
  stop(sig, now);
}

void Job::check_ranks(Clock::time_point now) {
  for (Rank& rank : ranks_) {
    if (rank.exited || rank.pid <= 0) continue;
    siginfo_t info{};
    int rc = 0;
    do {
      rc = ::waitid(P_PID, static_cast<id_t>(rank.pid), &info, WEXITED | WNOHANG | WNOWAIT);
    } while (rc < 0 && errno == EINTR);
    if (rc < 0 || info.si_pid == 0) continue;
    rank.exited = true;
    rank.exit_code = info.si_code;
    rank.exit_status = info.si_status;
    if (rank.exec_errno != 0 || !rank.failed()) continue;
    if (cause_ == Cause::kNone) {
      cause_ = Cause::kRankFailed;
      cause_rank_ = rank.index;
      drain(rank);
      report(rank.describe() + "; stopping the other ranks");
      stop(SIGTERM, now);
    } else {
      consequences_.push_back(rank.index);
    }
  }
}

void Job::check_deadlines(Clock::time_point now) {
  if (deadline_ && now >= *deadline_) {
    deadline_.reset();
    if (!all_exited()) {
      if (cause_ == Cause::kNone) {
        cause_ = Cause::kTimeout;
        report("the job ran past its timeout of " + seconds_text(spec_.timeout) +
               "; stopping all ranks");
      }
      stop(SIGTERM, now);
    }
  }
  if (kill_deadline_ && now >= *kill_deadline_) {
    std::vector<int> running;
    for (const Rank& rank : ranks_) {
      if (!rank.exited && rank.pid > 0) running.push_back(rank.index);
    }
    if (!running.empty()) {
      report(rank_list(running) + " still running " + seconds_text(spec_.kill_grace) + " after " +
             signal_name(stop_signal_) + "; killing them (SIGKILL)");
    }
    kill_all(now);
  }
}

// Once every rank has exited, whatever is still alive in their groups was left behind (a
// background job, a daemon); it is stopped like a rank, so that nothing outlives dear-run.
bool Job::leftovers_gone(Clock::time_point now) {
  if (now < next_sweep_) return false;
  next_sweep_ = now + kSweepInterval;
  const std::set<pid_t> live = live_process_groups();
  std::vector<int> left;
  for (const Rank& rank : ranks_) {
    if (rank.pid > 0 && live.count(rank.pid) != 0) left.push_back(rank.index);
  }
  if (left.empty()) return true;
  if (killed_at_ && now - *killed_at_ > kAfterKillPatience) {
    report("processes left by " + rank_list(left) +
           " did not end after SIGKILL; giving up on them");
    return true;
  }
  if (!leftovers_stopped_) {
    leftovers_stopped_ = true;
    if (cause_ == Cause::kNone) {
      report(rank_list(left) + " exited but left processes running; stopping them");
    }
    for (const int r : left) ::kill(-ranks_[static_cast<std::size_t>(r)].pid, SIGTERM);
    if (!kill_deadline_ && !killed_at_) {
      stop_signal_ = SIGTERM;
      kill_deadline_ = now + std::chrono::duration_cast<Clock::duration>(spec_.kill_grace);
    }
  }
  return false;
}

void Job::relay(Rank& rank, int stream) {
  const auto s = static_cast<std::size_t>(stream);
  Fd& fd = rank.output[s];
  if (!fd) return;
  const ssize_t n = ::read(fd.get(), buffer_.data(), buffer_.size());
  if (n > 0) {
    rank.relays[s].feed(std::string_view(buffer_.data(), static_cast<std::size_t>(n)), batches_[s]);
    return;
  }
  if (n < 0 && (errno == EINTR || errno == EAGAIN)) return;
  // End of the stream (or an error that makes it one): the last partial line goes out now.
  rank.relays[s].finish(batches_[s]);
  fd.reset();
}

void Job::drain(Rank& rank) {
  for (int s : {kStdout, kStderr}) {
    const auto i = static_cast<std::size_t>(s);
    for (int chunk = 0; chunk < kMaxChunksPerDrain && rank.output[i]; ++chunk) {
      const ssize_t n = ::read(rank.output[i].get(), buffer_.data(), buffer_.size());
      if (n > 0) {
        rank.relays[i].feed(std::string_view(buffer_.data(), static_cast<std::size_t>(n)),
                            batches_[i]);
        continue;
      }
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && errno == EAGAIN) break;
      rank.relays[i].finish(batches_[i]);
      rank.output[i].reset();
    }
  }
}

void Job::flush_output() {
  stdout_.write(batches_[kStdout]);
  batches_[kStdout].clear();
  stderr_.write(batches_[kStderr]);
  batches_[kStderr].clear();
}

void Job::stop(int sig, Clock::time_point now) {
  signal_groups(sig);
  if (!kill_deadline_ && !killed_at_) {
    stop_signal_ = sig;
    kill_deadline_ = now + std::chrono::duration_cast<Clock::duration>(spec_.kill_grace);
  }
}

void Job::signal_groups(int sig) {
  // Safe even for ranks that have exited: their zombies keep the group ids reserved.
  for (const Rank& rank : ranks_) {
    if (rank.pid > 0) ::kill(-rank.pid, sig);
  }
}

void Job::kill_all(Clock::time_point now) {
  signal_groups(SIGKILL);
  kill_deadline_.reset();
  killed_at_ = now;
}

void Job::reap_all() {
  for (Rank& rank : ranks_) {
    if (rank.pid <= 0) continue;
    int status = 0;
    while (::waitpid(rank.pid, &status, 0) < 0 && errno == EINTR) {
    }
  }
}

void Job::report(const std::string& line) {
  // Rank output gathered so far goes first, so that the report lands where it happened.
  flush_output();
  stderr_.write("dear-run: " + line + "\n");
}

void Job::report_consequences() {
  if (consequences_.empty()) return;
  std::string line = "then, as the job was stopped: ";
  for (std::size_t i = 0; i < consequences_.size() && i < kMaxListed; ++i) {
    if (i > 0) line += "; ";
    line += ranks_[static_cast<std::size_t>(consequences_[i])].describe();
  }
  if (consequences_.size() > kMaxListed) {
    line += "; and " + std::to_string(consequences_.size() - kMaxListed) + " more ranks";
  }
  report(line);
}

bool Job::all_exited() const {
  return std::all_of(ranks_.begin(), ranks_.end(),
                     [](const Rank& rank) { return rank.exited || rank.pid <= 0; });
}

JobOutcome Job::outcome() const {
  switch (cause_) {
    case Cause::kNone: return {0, 0};
    case Cause::kRankFailed:
      return {ranks_[static_cast<std::size_t>(cause_rank_)].shell_status(), 0};
    case Cause::kTimeout: return {kExitTimeout, 0};
    case Cause::kSignal: return {128 + cause_signal_, cause_signal_};
    case Cause::kNotExecutable: return {kExitNotExecutable, 0};
    case Cause::kLaunchError: return {kExitLaunchError, 0};
  }
  return {kExitLaunchError, 0};
}

}  // namespace

std::vector<int> own_cpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (::sched_getaffinity(0, sizeof set, &set) != 0) {
    throw std::runtime_error(std::string("cannot read this process's CPUs: ") +
                             std::strerror(errno));
  }
  std::vector<int> mine;
  for (int cpu = 0; cpu < CPU_SETSIZE; ++cpu) {
    if (CPU_ISSET(cpu, &set)) mine.push_back(cpu);
  }
  return mine;
}

std::vector<std::vector<int>> spread_cpus(int ranks) {
  const std::vector<int> mine = own_cpus();
  const auto n = static_cast<int>(mine.size());
  if (n == 0) return {};
  std::vector<std::vector<int>> out(static_cast<std::size_t>(ranks));
  const int each = std::max(1, n / ranks);
  for (int r = 0; r < ranks; ++r) {
    const int first = n >= ranks ? r * each : r % n;
    for (int i = 0; i < each; ++i) {
      out[static_cast<std::size_t>(r)].push_back(mine[static_cast<std::size_t>(first + i)]);
    }
  }
  return out;
}

std::string cpu_list_text(const std::vector<int>& cpus) {
  std::string out;
  for (std::size_t i = 0; i < cpus.size();) {
    std::size_t j = i;
    while (j + 1 < cpus.size() && cpus[j + 1] == cpus[j] + 1) ++j;
    if (!out.empty()) out += ',';
    out += std::to_string(cpus[i]);
    if (j > i) out += '-' + std::to_string(cpus[j]);
    i = j + 1;
  }
  return out;
}

JobOutcome run_job(const JobSpec& spec) {
  Job job(spec);
  return job.run();
}

}  // namespace dear::tools
