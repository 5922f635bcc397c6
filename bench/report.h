// Result tables shared by dear-bench and the peer benchmarks (mpi-bench, gloo-bench).
//
// Every benchmark parses the same nccl-tests flags, sweeps the same sizes, times the same way
// and prints the same rows, so that numbers from different libraries can be put side by side
// without translation. The conventions that make results comparable:
//   - size is the total bytes of the operation; for reduce_scatter, all_gather, gather,
//     scatter and all_to_all the per-rank count x ranks x element size, for all_reduce, reduce and
//     broadcast the buffer size;
//   - GB = 1e9 bytes; algbw = size / time; busbw = algbw x bus_factor(collective, ranks);
//   - time is the mean over the timed iterations, then the maximum of that mean over ranks;
//     p50/p99 are nearest-rank percentiles of rank 0's per-iteration times;
//   - #wrong is the number of wrong result elements summed over ranks (N/A when unchecked); a
//     reduce's or gather's result is the root's only, so only the root's output is checked.
//
// Nothing here talks to the network: benchmarks do the cross-rank reductions themselves and
// only rank 0 prints.
#pragma once

#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "dear/types.h"

namespace CLI {
class App;
class Option;
}  // namespace CLI

namespace dear::bench {

enum class Collective : std::uint8_t {
  kAllReduce,
  kReduceScatter,
  kAllGather,
  kBroadcast,
  kReduce,
  kGather,
  kScatter,
  kAllToAll,
  kSendRecv,  // nccl-tests' sendrecv: every rank sends to rank + 1 and receives from rank - 1
  // Rank 2k sends to rank 2k + 1, which sends the message back (an echo): one message in
  // flight per pair, its time one way (half the round trip), as a latency benchmark reports.
  kPingPong
};
inline constexpr std::array<Collective, 10> kAllCollectives{
    Collective::kAllReduce, Collective::kReduceScatter, Collective::kAllGather,
    Collective::kBroadcast, Collective::kReduce,        Collective::kGather,
    Collective::kScatter,   Collective::kAllToAll,      Collective::kSendRecv,
    Collective::kPingPong};

// all_reduce reduce_scatter all_gather broadcast reduce gather scatter all_to_all send_recv
// ping_pong
[[nodiscard]] std::string_view to_string(Collective c) noexcept;
// Accepts the names above, also with '-' for '_' (all-reduce) and without it (allreduce).
[[nodiscard]] std::optional<Collective> parse_collective(std::string_view name) noexcept;
// Whether the collective applies a reduction operator (and so has a meaningful redop).
[[nodiscard]] bool has_reduction(Collective c) noexcept;
// Whether the collective has a root rank (printed as -1 otherwise, like nccl-tests).
[[nodiscard]] bool has_root(Collective c) noexcept;
// How many times one run moves its message across a link one after another: 2 for ping_pong
// (there and back), 1 otherwise. The driver reports a run's time divided by it.
[[nodiscard]] int hops_per_run(Collective c) noexcept;

// ---------------------------------------------------------------------------------------------
// Command line: nccl-tests' flags with their meaning, so a command line works for every tool.

// Upper bound on the iterations --min_time_ms may ask for at one size.
inline constexpr int kMaxAutoIters = 100000;

struct BenchArgs {
  Collective collective = Collective::kAllReduce;  // positional COLLECTIVE
  std::uint64_t min_bytes = 8;                     // -b/--minbytes
  std::uint64_t max_bytes = 64ULL << 20;           // -e/--maxbytes
  std::uint64_t step_factor = 2;                   // -f/--stepfactor (used when step_bytes == 0)
  std::uint64_t step_bytes = 0;                    // -i/--stepbytes (additive step when > 0)
  int iters = 20;                                  // -n/--iters (timed iterations per size)
  int warmup_iters = 5;                            // -w/--warmup_iters
  // -m/--agg_iters: operations issued back to back per timed iteration, then waited for
  // together; the time reported is per operation (nccl-tests' convention).
  int agg_iters = 1;
  double min_time_ms = 0;  // --min_time_ms: more iterations where -n would take less (0: off)
  int check = 1;           // -c/--check (0: no checked iteration)
  DataType dtype = DataType::kFloat32;  // -d/--datatype
  ReduceOp op = ReduceOp::kSum;         // -o/--op
  int root = 0;                         // -r/--root (broadcast, reduce, gather, scatter)
  std::string json_path;                // --json FILE
  std::string csv_path;                 // --csv FILE
  std::string samples_path;             // --samples FILE (every timed iteration, rank 0)
  // --placement: which placements are timed; the other's columns print N/A.
  bool out_of_place = true;
  bool in_place = true;
};

// A benchmark program's main(): runs `run`, and reports what it throws as "`tool`: what" on
// stderr with exit status 1 (on every rank alike: a failure reaches the others through the
// communicator or the bootstrap, and each says why).
int tool_main(const char* tool, int (*run)(int, char**), int argc, char** argv);

// A size flag: K/M/G suffixes (powers of 1024), written into `target` (which must outlive
// parsing), its current value shown as the default. With `positive`, 0 is refused too.
CLI::Option* add_bytes_flag(CLI::App& app, const std::string& names, std::uint64_t& target,
                            const std::string& help, bool positive = false);

// Registers the flags above on `app`, writing into `args` (which must outlive parsing). Sizes
// take K/M/G suffixes (powers of 1024); datatype and op take nccl-tests' names.
void add_bench_flags(CLI::App& app, BenchArgs& args);

// Checks what the flags alone cannot: max >= min, a step that grows, root < nranks.
// Throws dear::Error(kInvalidArgument) naming the flag.
void validate(const BenchArgs& args, int nranks);
// validate() for a tool's main: false after printing what it refused ("TOOL: rank R: ...") on
// stderr. Every rank prints its own copy: a launcher that stops the job when its first rank
// exits (dear-run, mpirun) could stop rank 0 before a copy printed there alone appeared.
[[nodiscard]] bool flags_valid(std::string_view tool, const BenchArgs& args, int nranks, int rank);

// ---------------------------------------------------------------------------------------------
// Sizes and bandwidth.

struct SizePoint {
  std::uint64_t bytes = 0;       // total bytes, the "size" column
  std::uint64_t count = 0;       // total elements, the "count" column
  std::uint64_t rank_count = 0;  // elements each rank passes to the call (NCCL's count)
};

// The point for a requested size: all_reduce/broadcast round down to whole elements;
// reduce_scatter/all_gather round down to a multiple of element size x ranks.
[[nodiscard]] SizePoint size_point(std::uint64_t bytes, Collective c, DataType t, int nranks);

// min_bytes, then x step_factor (or + step_bytes) up to max_bytes. Points that round to zero
// elements are dropped except the first, and so are repeats of the previous point.
[[nodiscard]] std::vector<SizePoint> size_sweep(const BenchArgs& args, Collective c, DataType t,
                                                int nranks);

// busbw / algbw: 2(n-1)/n for all_reduce, (n-1)/n for reduce_scatter and all_gather, 1 for
// broadcast; what a ring moves through each rank's link relative to the user's buffer.
[[nodiscard]] double bus_factor(Collective c, int nranks) noexcept;
// Bytes per microsecond / 1e3 = GB/s with GB = 1e9; 0 when time is not positive.
[[nodiscard]] double algbw_gbps(std::uint64_t bytes, double time_us) noexcept;

// ---------------------------------------------------------------------------------------------
// Timing.

// Per-iteration durations of one size and placement, in microseconds.
class Samples {
 public:
  void reserve(std::size_t n) { values_.reserve(n); }
  void add(double us) { values_.push_back(us); }
  void clear() noexcept { values_.clear(); }
  [[nodiscard]] std::size_t size() const noexcept { return values_.size(); }
  [[nodiscard]] bool empty() const noexcept { return values_.empty(); }
  [[nodiscard]] const std::vector<double>& values() const noexcept { return values_; }

  // All return 0 when empty.
  [[nodiscard]] double mean() const noexcept;
  [[nodiscard]] double min() const noexcept;
  [[nodiscard]] double max() const noexcept;
  // Nearest-rank percentile: the ceil(p/100 x N)-th smallest sample, p in (0, 100].
  [[nodiscard]] double percentile(double p) const;
  [[nodiscard]] double p50() const { return percentile(50.0); }
  [[nodiscard]] double p99() const { return percentile(99.0); }

 private:
  std::vector<double> values_;
};

// Monotonic stopwatch for one iteration.
class Stopwatch {
 public:
  Stopwatch() noexcept : start_(Clock::now()) {}
  void restart() noexcept { start_ = Clock::now(); }
  [[nodiscard]] double elapsed_us() const noexcept {
    return std::chrono::duration<double, std::micro>(Clock::now() - start_).count();
  }

 private:
  using Clock = std::chrono::steady_clock;
  Clock::time_point start_;
};

// ---------------------------------------------------------------------------------------------
// Rows.

inline constexpr long long kNotChecked = -1;

struct Result {
  double time_us = 0.0;           // mean over iterations, max over ranks
  double algbw = 0.0;             // GB/s
  double busbw = 0.0;             // GB/s
  double p50_us = 0.0;            // rank 0
  double p99_us = 0.0;            // rank 0
  long long wrong = kNotChecked;  // sum over ranks; kNotChecked prints N/A
  bool valid = false;             // false: the library has no such placement; prints N/A
};

// A valid Result with bandwidths derived from the point's bytes.
[[nodiscard]] Result make_result(const SizePoint& point, Collective c, int nranks, double time_us,
                                 double p50_us, double p99_us, long long wrong = kNotChecked);

struct Row {
  SizePoint point;
  std::string type;   // nccl-tests dtype name
  std::string redop;  // op name, "none" for all_gather and broadcast
  int root = -1;      // -1 for collectives without a root
  Result oop;         // out-of-place
  Result ip;          // in-place
};

// A Row with type, redop and root filled the nccl-tests way and both results invalid.
[[nodiscard]] Row make_row(const SizePoint& point, Collective c, DataType t, ReduceOp op, int root);

// ---------------------------------------------------------------------------------------------
// Output.

struct RunInfo {
  std::string library;  // "dear", "mpi", "gloo", ...
  Collective collective = Collective::kAllReduce;
  int nranks = 1;
  DataType dtype = DataType::kFloat32;
  ReduceOp op = ReduceOp::kSum;
  int root = 0;
  std::string transport;                           // free text, e.g. "tcp 127.0.0.1"
  nlohmann::json meta = nlohmann::json::object();  // library-specific settings
};

struct RunReport {
  RunInfo info;
  std::vector<Row> rows;
};

// Table pieces, nccl-tests layout plus p50/p99 columns per placement.
void print_preamble(std::FILE* out, const RunInfo& info, const BenchArgs& args);
void print_header(std::FILE* out);
void print_row(std::FILE* out, const Row& row);
// "# Out of bounds values : N OK|FAILED" and "# Avg bus bandwidth    : X".
void print_footer(std::FILE* out, const std::vector<Row>& rows);
[[nodiscard]] std::string format_row(const Row& row);

// Mean busbw over every valid result (both placements), as nccl-tests averages.
[[nodiscard]] double average_busbw(const std::vector<Row>& rows) noexcept;
// Sum of #wrong over checked valid results.
[[nodiscard]] long long total_wrong(const std::vector<Row>& rows) noexcept;

// {"library","collective","nranks","dtype","op","root","transport","meta","rows":[...]}, each
// row {"size","count","rank_count","type","redop","root","oop":{...}|null,"ip":{...}|null},
// each result {"time_us","algbw","busbw","p50_us","p99_us","wrong"} with wrong null if
// unchecked.
[[nodiscard]] nlohmann::json to_json(const RunReport& report);
// Inverse of to_json; throws dear::Error(kInvalidArgument) on a malformed document.
[[nodiscard]] RunReport report_from_json(const nlohmann::json& doc);
[[nodiscard]] std::string csv_header();
// One line per row, no newline; empty fields for an invalid placement or N/A.
[[nodiscard]] std::string csv_line(const RunInfo& info, const Row& row);
// Throw dear::Error(kSystem) naming the path when it cannot be written.
void write_json_file(const std::string& path, const RunReport& report);
void write_csv_file(const std::string& path, const RunReport& report);

// Collects rows; on rank 0 prints them as they complete and, at finish(), the footer and the
// --json/--csv files. On other ranks every call is a no-op, so benchmarks need no `if`.
class Reporter {
 public:
  Reporter(RunInfo info, const BenchArgs& args, int rank, std::FILE* out = stdout);
  // Preamble and column header.
  void begin();
  void add(Row row);
  // Footer and files; returns total_wrong() so the caller can choose its exit status.
  long long finish();
  [[nodiscard]] const RunReport& report() const noexcept { return report_; }

 private:
  RunReport report_;
  BenchArgs args_;
  int rank_;
  std::FILE* out_;
};

// --samples FILE: every timed iteration's time on rank 0, one CSV line each, written as each
// size and placement completes (a long sweep leaves what it measured so far):
//   size,placement,iteration,us        placement: oop or ip; us per operation (with -m k, / k)
// The rows' time is the slowest rank's mean and p50/p99 are rank 0's, so these are the samples
// behind p50/p99. Inactive (every call a no-op) on other ranks or without a path.
class SampleLog {
 public:
  // Opens and truncates `path` on rank 0; throws dear::Error naming --samples when it cannot.
  SampleLog(const std::string& path, int rank);
  void add(std::uint64_t bytes, bool in_place, const Samples& samples);
  [[nodiscard]] bool active() const noexcept { return out_.is_open(); }

 private:
  std::string path_;
  std::ofstream out_;  // open on rank 0 with a path only
};

// One stderr line per completed size, on rank 0 only:
//   [TOOL] all_reduce 1048576 B done (5/24)
void print_progress(std::string_view tool, Collective c, std::uint64_t bytes, std::size_t done,
                    std::size_t total, int rank);

// ---------------------------------------------------------------------------------------------
// Checking results.
//
// Rank r's input element at global index i is a small integer that every dtype represents
// exactly, a function of (r, (i + seed) mod kPatternPeriod):
//   prod:        2 when (i + seed + r) % 4 == 0, else 1 - so a product over n ranks is at most
//                2^ceil(n/4);
//   other ops:   ((i + seed) % 7 + 3r) % 5 + 1, in [1, 5] - so a sum over n ranks is at most 5n.
// Results are then exact for n <= 24 ranks in every dtype (int8 is the tightest: 5n <= 127 and
// 2^6 <= 127); floating types stay exact far beyond (bf16 sums to 51 ranks, fp16 to 409).
// Integer types past that bound wrap, and the expected value wraps the same way (C++20
// modular conversion), except for avg. avg is compared with the real quotient sum/n: integer
// results must lie within less than 1 of it (truncated or rounded), floating results within
// n x machine epsilon relative (divided before or after the sum). expected_value reports the
// truncated quotient for integer types.
// Outputs should be zeroed before a checked run; no pattern value is 0, so an element the
// library never wrote counts as wrong.

inline constexpr std::uint64_t kPatternPeriod = 28;

struct CheckSpec {
  Collective collective = Collective::kAllReduce;
  DataType dtype = DataType::kFloat32;
  ReduceOp op = ReduceOp::kSum;
  int rank = 0;
  int nranks = 1;
  int root = 0;                  // broadcast, reduce, gather, scatter
  std::uint64_t rank_count = 0;  // SizePoint::rank_count
  std::uint64_t seed = 0;        // vary per run so stale data from a previous run is caught
};

// Elements a rank contributes: rank_count x nranks for reduce_scatter, else rank_count.
[[nodiscard]] std::uint64_t input_count(const CheckSpec& spec) noexcept;
// Elements of a rank's result: rank_count x nranks for all_gather, else rank_count.
[[nodiscard]] std::uint64_t output_count(const CheckSpec& spec) noexcept;

// Rank `rank`'s input value at global element index `index`.
[[nodiscard]] double pattern_value(ReduceOp op, int rank, std::uint64_t index,
                                   std::uint64_t seed) noexcept;
// Writes pattern_value(op, rank, first_index + k, seed) for k in [0, count) as `dtype`.
void fill_pattern(void* buf, std::uint64_t count, DataType dtype, ReduceOp op, int rank,
                  std::uint64_t seed, std::uint64_t first_index = 0);
// This rank's input for the collective: input_count(spec) elements. For reduce_scatter the
// global index runs over the whole input, so rank r's result block is indices r x rank_count...
void fill_input(void* buf, const CheckSpec& spec);
// The value this rank's output element `out_index` must hold, computed from the pattern.
[[nodiscard]] double expected_value(const CheckSpec& spec, std::uint64_t out_index);
// Number of the output_count(spec) elements of `out` that differ from expected_value.
[[nodiscard]] long long count_wrong(const void* out, const CheckSpec& spec);

// Element access in any dtype (fp16/bf16 converted with round-to-nearest-even).
void store_value(void* buf, std::uint64_t index, DataType dtype, double value);
[[nodiscard]] double load_value(const void* buf, std::uint64_t index, DataType dtype);

}  // namespace dear::bench
