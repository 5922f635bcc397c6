// dear-run: starts the N ranks of a dear job on this host, as mpirun or torchrun would on one
// machine, and watches over them until the last one has ended.
//
//   dear-run -n 4 [options] [--] command args...
//
// The command line is read here; launcher.h does the starting, relaying and stopping.
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <array>
#include <cctype>
#include <cmath>
#include <csignal>
#include <cstdint>
#include <exception>
#include <iostream>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "dear/bootstrap.h"
#include "dear/error.h"
#include "tools/launcher.h"
#include "tools/output_relay.h"
#include "transport/listener_registry.h"
#include "transport/socket_util.h"

#ifndef DEAR_VERSION
#define DEAR_VERSION "unknown"
#endif

extern char** environ;

namespace dear::tools {
namespace {

constexpr int kExitUsage = 2;
constexpr int kMaxRanks = 4096;
// Ample for any job, small enough that a deadline computed from it cannot overflow.
constexpr double kMaxSeconds = 1e9;
constexpr std::string_view kSecretPlaceholder = "<secret>";

// What dear-run sets for every rank; inherited values are replaced and --env may not set them.
constexpr std::array<std::string_view, 12> kJobVariables = {
    "DEAR_RANK",   "DEAR_WORLD_SIZE", "DEAR_LOCAL_RANK", "DEAR_LOCAL_SIZE",  "DEAR_UNIQUE_ID",
    "RANK",        "WORLD_SIZE",      "LOCAL_RANK",      "LOCAL_WORLD_SIZE", "MASTER_ADDR",
    "MASTER_PORT", "DEAR_LISTEN_FD"};

constexpr const char* kFooter = R"(Every rank gets dear-run's environment plus:
  DEAR_RANK, DEAR_WORLD_SIZE, DEAR_LOCAL_RANK, DEAR_LOCAL_SIZE, DEAR_UNIQUE_ID (host:port:secret)
  RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT (as torchrun sets them)
and, when dear-run picks the port, rank 0 gets DEAR_LISTEN_FD: the port's listening socket,
held open from the moment the port is chosen so that no other program can take it.

Each rank runs in its own process group. SIGINT, SIGTERM, SIGHUP and SIGQUIT are forwarded to
every rank (a second SIGINT kills them). When a rank fails, the others get SIGTERM, and SIGKILL
after --kill-grace seconds. Processes that ranks leave behind are stopped the same way.

Exit status: 0 when every rank exited 0; the first failing rank's status (128+signal when it
was killed); 124 on --timeout; 127 when the command cannot be executed; 128+signal when
dear-run was told to stop; 1 when dear-run itself failed; 2 for a bad command line.)";

// CLI11's usage line cannot show a trailing command on its own.
class HelpFormatter : public CLI::Formatter {
 public:
  std::string make_usage(const CLI::App* /*app*/, std::string name) const override {
    return "Usage: " + name + " -n N [options] [--] command [args...]\n";
  }
};

struct Options {
  int ranks = 0;
  std::string host = "127.0.0.1";
  int port = 0;  // 0: a free one
  std::vector<std::string> env;
  bool no_prefix = false;
  double kill_grace = 5.0;
  double timeout = 0.0;
  bool dry_run = false;
  std::string link_delay;  // e.g. "25us"; empty: leave DEAR_LINK_DELAY_US as inherited
  std::string bind = "auto";
  std::vector<std::string> command;
};

using Variables = std::vector<std::pair<std::string, std::string>>;

bool is_job_variable(std::string_view key) {
  return std::find(kJobVariables.begin(), kJobVariables.end(), key) != kJobVariables.end();
}

// Rank 0's listening socket on a free port of `host`, opened here and handed to rank 0 as an
// open descriptor (DEAR_LISTEN_FD), so that the port is held from the moment it is chosen until
// rank 0 adopts it: no other program can take it in between, as it could were the port only
// found free here and bound again by rank 0.
transport::Fd listen_for_rank0(const std::string& host) {
  try {
    return transport::listen_on(transport::resolve(host, 0));
  } catch (const Error& e) {
    throw Error(e.code(), "--host " + host + ": " + e.cause());
  }
}

// "--link-delay 25us" -> 25: a number with a unit of us, ms or s (a bare number is us), in
// whole microseconds; nullopt when malformed, negative or beyond DEAR_LINK_DELAY_US's range.
std::optional<long long> parse_delay_us(const std::string& text) {
  constexpr long long kMaxDelayUs = 10'000'000;  // what DEAR_LINK_DELAY_US accepts
  std::size_t end = 0;
  double value = 0;
  try {
    value = std::stod(text, &end);
  } catch (const std::exception&) {
    return std::nullopt;
  }
  const std::string unit = text.substr(end);
  double scale = 0;
  if (unit.empty() || unit == "us") {
    scale = 1;
  } else if (unit == "ms") {
    scale = 1e3;
  } else if (unit == "s") {
    scale = 1e6;
  } else {
    return std::nullopt;
  }
  const double us = value * scale;
  if (!(us >= 0) || us > static_cast<double>(kMaxDelayUs) || us != std::floor(us)) {
    return std::nullopt;
  }
  return static_cast<long long>(us);
}

// `listen_fd`: rank 0's listening socket, or -1 when rank 0 binds the port itself.
Variables job_variables(int rank, int world_size, const UniqueId& id, const std::string& id_text,
                        int listen_fd) {
  const std::string r = std::to_string(rank);
  const std::string n = std::to_string(world_size);
  // One host: local rank and size are the global ones.
  Variables v{{"DEAR_RANK", r},
              {"DEAR_WORLD_SIZE", n},
              {"DEAR_LOCAL_RANK", r},
              {"DEAR_LOCAL_SIZE", n},
              {"DEAR_UNIQUE_ID", id_text},
              {"RANK", r},
              {"WORLD_SIZE", n},
              {"LOCAL_RANK", r},
              {"LOCAL_WORLD_SIZE", n},
              {"MASTER_ADDR", id.host},
              {"MASTER_PORT", std::to_string(id.port)}};
  if (rank == 0 && listen_fd >= 0) v.emplace_back("DEAR_LISTEN_FD", std::to_string(listen_fd));
  return v;
}

// dear-run's environment without what --env or the job variables replace, then --env.
std::vector<std::string> base_environment(const Variables& extra) {
  std::vector<std::string> env;
  for (char** entry = environ; *entry != nullptr; ++entry) {
    const std::string_view text(*entry);
    const std::string_view key = text.substr(0, text.find('='));
    const bool replaced =
        is_job_variable(key) ||
        std::any_of(extra.begin(), extra.end(), [&](const auto& kv) { return kv.first == key; });
    if (!replaced) env.emplace_back(text);
  }
  for (const auto& [key, value] : extra) env.push_back(key + "=" + value);
  return env;
}

std::string shell_quote(const std::string& word) {
  const bool plain = !word.empty() && std::all_of(word.begin(), word.end(), [](char c) {
    return std::isalnum(static_cast<unsigned char>(c)) != 0 ||
           std::string_view("_-+=:,./@%").find(c) != std::string_view::npos;
  });
  if (plain) return word;
  std::string quoted = "'";
  for (const char c : word) {
    if (c == '\'') {
      quoted += "'\\''";
    } else {
      quoted += c;
    }
  }
  return quoted + "'";
}

std::string command_text(const std::vector<std::string>& command) {
  std::string text;
  for (const auto& word : command) {
    if (!text.empty()) text += ' ';
    text += shell_quote(word);
  }
  return text;
}

// --dry-run: what each rank would be started with; the secret is left out.
void print_dry_run(const Options& o, const UniqueId& id, const Variables& extra,
                   const std::vector<std::vector<int>>& cpus) {
  std::string out = "dear-run: dry run: would start " + std::to_string(o.ranks) +
                    (o.ranks == 1 ? " rank" : " ranks") + " of: " + command_text(o.command) + "\n";
  const std::string id_text = id.address() + ":" + std::string(kSecretPlaceholder);
  for (int rank = 0; rank < o.ranks; ++rank) {
    out += rank_prefix(rank, o.ranks);
    for (const auto& [key, value] : job_variables(rank, o.ranks, id, id_text, -1)) {
      out += shell_quote(key + "=" + value) + " ";
    }
    for (const auto& [key, value] : extra) out += shell_quote(key + "=" + value) + " ";
    out += command_text(o.command);
    if (static_cast<std::size_t>(rank) < cpus.size()) {
      out += "  # CPUs " + cpu_list_text(cpus[static_cast<std::size_t>(rank)]);
    }
    out += "\n";
  }
  std::cout << out << std::flush;
}

// Ends dear-run by `sig`, as a program that was stopped by it should; the exit status is the
// fallback should the signal somehow not end it.
int end_by_signal(int sig) {
  std::signal(sig, SIG_DFL);
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, sig);
  ::sigprocmask(SIG_UNBLOCK, &set, nullptr);
  ::raise(sig);
  return 128 + sig;
}

int run(int argc, char** argv) {
  Options o;
  CLI::App app{"Starts N processes of a command on this host as the ranks of one dear job.",
               "dear-run"};
  app.prefix_command();
  app.formatter(std::make_shared<HelpFormatter>());
  app.footer(kFooter);
  app.set_version_flag("--version", std::string("dear-run (dear) ") + DEAR_VERSION);
  app.add_option("-n,--np,--nproc", o.ranks, "Number of ranks to start")
      ->type_name("N")
      ->required()
      ->check(CLI::Range(1, kMaxRanks));
  app.add_option("--host", o.host, "Address rank 0 listens on (DEAR_UNIQUE_ID, MASTER_ADDR)")
      ->type_name("HOST")
      ->capture_default_str();
  app.add_option("--port", o.port, "Port rank 0 listens on; 0 picks a free one")
      ->type_name("PORT")
      ->capture_default_str()
      ->check(CLI::Range(0, 65535));
  app.add_option("--env", o.env, "Set KEY=VALUE for every rank (repeatable)")
      ->type_name("KEY=VALUE")
      ->allow_extra_args(false);
  app.add_flag("--no-prefix", o.no_prefix,
               "Let ranks write to dear-run's stdout and stderr directly, without \"[rank] \"");
  app.add_option("--kill-grace", o.kill_grace,
                 "Seconds between SIGTERM and SIGKILL when the job is stopped")
      ->type_name("SECONDS")
      ->capture_default_str()
      ->check(CLI::Range(0.0, kMaxSeconds));
  app.add_option("--timeout", o.timeout, "Stop the job after this many seconds; 0: never")
      ->type_name("SECONDS")
      ->capture_default_str()
      ->check(CLI::Range(0.0, kMaxSeconds));
  app.add_flag("--dry-run", o.dry_run, "Print what would be started, and exit");
  app.add_option("--link-delay", o.link_delay,
                 "Emulated one-way delay added to every link, e.g. 25us or 1ms (sets "
                 "DEAR_LINK_DELAY_US for every rank)")
      ->type_name("DELAY");
  app.add_option("--bind", o.bind,
                 "Where ranks run: spread (each rank bound to its own share of dear-run's "
                 "CPUs, round robin when ranks outnumber them, as mpirun --bind-to core), "
                 "none (anywhere), or auto (spread when there are at least as many CPUs as "
                 "ranks, else none, as mpirun binds only when not oversubscribed)")
      ->type_name("MODE")
      ->capture_default_str();
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : kExitUsage;
  }

  const auto usage_error = [](const std::string& what) {
    std::cerr << "dear-run: " << what << "\nRun with --help for more information.\n";
    return kExitUsage;
  };
  o.command = app.remaining();
  if (!o.command.empty() && o.command.front() == "--") {
    o.command.erase(o.command.begin());
  } else if (!o.command.empty() && o.command.front().size() > 1 &&
             o.command.front().front() == '-') {
    return usage_error("unknown option " + o.command.front() +
                       " (put -- before a command that starts with '-')");
  }
  if (o.command.empty()) return usage_error("no command given");
  if (o.bind != "auto" && o.bind != "spread" && o.bind != "none") {
    return usage_error("--bind " + o.bind + ": expected auto, spread or none");
  }

  Variables extra;
  for (const auto& entry : o.env) {
    const auto eq = entry.find('=');
    if (eq == 0 || eq == std::string::npos) {
      return usage_error("--env " + entry + ": expected KEY=VALUE");
    }
    std::string key = entry.substr(0, eq);
    if (is_job_variable(key)) return usage_error("--env " + key + ": dear-run sets it itself");
    extra.emplace_back(std::move(key), entry.substr(eq + 1));
  }

  if (!o.link_delay.empty()) {
    const auto us = parse_delay_us(o.link_delay);
    if (!us) {
      return usage_error("--link-delay " + o.link_delay +
                         ": expected a delay such as 25us, 1ms or 0 (at most 10s, whole us)");
    }
    if (std::any_of(extra.begin(), extra.end(),
                    [](const auto& kv) { return kv.first == "DEAR_LINK_DELAY_US"; })) {
      return usage_error("--link-delay and --env DEAR_LINK_DELAY_US: give one of them");
    }
    extra.emplace_back("DEAR_LINK_DELAY_US", std::to_string(*us));
  }

  UniqueId id;
  id.host = o.host;
  // Held until rank 0 starts with a copy of it, which it adopts.
  transport::Fd listener = o.port != 0 ? transport::Fd() : listen_for_rank0(o.host);
  id.port = o.port != 0 ? static_cast<std::uint16_t>(o.port)
                        : transport::local_address(listener.get()).port();
  const std::vector<std::vector<int>> cpus =
      o.bind == "spread" || (o.bind == "auto" && o.ranks <= static_cast<int>(own_cpus().size()))
          ? spread_cpus(o.ranks)
          : std::vector<std::vector<int>>{};
  if (o.dry_run) {
    print_dry_run(o, id, extra, cpus);
    return 0;
  }
  id.secret = transport::random_secret();
  const std::string id_text = id.to_string();

  JobSpec spec;
  spec.command = o.command;
  spec.prefix_output = !o.no_prefix;
  spec.kill_grace = std::chrono::duration<double>(o.kill_grace);
  spec.timeout = std::chrono::duration<double>(o.timeout);
  spec.cpus = cpus;
  const std::vector<std::string> base = base_environment(extra);
  for (int rank = 0; rank < o.ranks; ++rank) {
    std::vector<std::string> env = base;
    for (const auto& [key, value] : job_variables(rank, o.ranks, id, id_text, listener.get())) {
      env.push_back(key + "=" + value);
    }
    spec.environments.push_back(std::move(env));
  }
  spec.rank0_fd = listener.release();

  const JobOutcome outcome = run_job(spec);
  // SIGQUIT is left out: ending by it would dump a core of dear-run.
  const int sig = outcome.stopped_by_signal;
  if (sig == SIGINT || sig == SIGTERM || sig == SIGHUP) return end_by_signal(sig);
  return outcome.exit_status;
}

}  // namespace
}  // namespace dear::tools

int main(int argc, char** argv) {
  try {
    return dear::tools::run(argc, argv);
  } catch (const dear::Error& e) {
    std::cerr << "dear-run: " << e.cause() << "\n";
    return e.code() == dear::ErrorCode::kInvalidArgument ? dear::tools::kExitUsage
                                                         : dear::tools::kExitLaunchError;
  } catch (const std::exception& e) {
    std::cerr << "dear-run: " << e.what() << "\n";
    return dear::tools::kExitLaunchError;
  }
}
