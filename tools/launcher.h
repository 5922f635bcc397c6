// Starting, watching and stopping the processes of one job on this host: the engine behind
// dear-run, kept apart from its command line.
//
// Contract of run_job():
// - Every rank runs `command` in a process group of its own, with the environment given for
//   it, stdin from /dev/null (rank 0 keeps dear-run's stdin when that is not a terminal).
// - SIGINT, SIGTERM, SIGHUP and SIGQUIT sent to dear-run are forwarded to every rank's group
//   (unless dear-run was started with them ignored); a second SIGINT kills them with SIGKILL.
//   Any rank that fails (non-zero exit or death by a signal), the timeout, or a forwarded
//   signal stops the job: SIGTERM (or the forwarded signal) to every group, SIGKILL to what is
//   left after `kill_grace`. Should dear-run itself be killed, the ranks are killed too.
// - It returns only after every rank has exited and no live process is left in the ranks'
//   process groups (leftovers of ranks that exited are stopped the same way).
// - Reports go to stderr, one line each, starting "dear-run: ". The first failure is named as
//   the cause; ranks that fail after it are listed as consequences at the end.
#pragma once

#include <chrono>
#include <string>
#include <vector>

namespace dear::tools {

struct JobSpec {
  // The argv of every rank; command[0] is searched for in PATH unless it contains a '/'.
  std::vector<std::string> command;
  // One complete environment ("KEY=VALUE" entries) per rank; its size is the number of ranks.
  std::vector<std::vector<std::string>> environments;
  // Prefix each line of output with "[rank] "; otherwise ranks write to dear-run's own fds.
  bool prefix_output = true;
  // Between SIGTERM and SIGKILL when the job is being stopped.
  std::chrono::duration<double> kill_grace{5.0};
  // Stop the whole job after this long; zero means never.
  std::chrono::duration<double> timeout{0.0};
  // The CPUs each rank may run on (sched_setaffinity before the command starts), one list per
  // rank; empty: every rank inherits dear-run's own.
  std::vector<std::vector<int>> cpus;
  // A descriptor rank 0 inherits (its close-on-exec flag cleared in rank 0 alone), or -1;
  // run_job() closes it once rank 0 has started (or failed to).
  int rank0_fd = -1;
};

// The CPUs of each of `ranks` ranks under dear-run --bind spread: this process's own (its
// affinity mask, ascending) cut into groups of cpus / ranks, rank i taking the i-th; with
// fewer CPUs than ranks, rank i gets CPU i mod cpus (mpirun --bind-to core places ranks the
// same way, round robin when oversubscribed). Throws std::runtime_error when the mask cannot
// be read.
[[nodiscard]] std::vector<std::vector<int>> spread_cpus(int ranks);
// This process's CPUs (its affinity mask), ascending. Throws std::runtime_error.
[[nodiscard]] std::vector<int> own_cpus();

// "0,2-3": a CPU list as Linux writes it.
[[nodiscard]] std::string cpu_list_text(const std::vector<int>& cpus);

// Exit statuses of dear-run besides those of a failed rank.
inline constexpr int kExitLaunchError = 1;
inline constexpr int kExitTimeout = 124;
inline constexpr int kExitNotExecutable = 127;

struct JobOutcome {
  // 0 when every rank exited 0; otherwise the failing rank's exit status (128 + signal when it
  // was killed), kExitTimeout, kExitNotExecutable, kExitLaunchError, or 128 + the signal that
  // told dear-run to stop.
  int exit_status = 0;
  // The signal that told dear-run to stop the job, or 0. Shells expect a program stopped by
  // SIGINT to end by SIGINT itself (that is how they know to stop a script's loop).
  int stopped_by_signal = 0;
};

// Runs the job to its end.
[[nodiscard]] JobOutcome run_job(const JobSpec& spec);

}  // namespace dear::tools
