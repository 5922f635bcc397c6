// The shared benchmark report: sizes, bandwidth factors, percentiles, the result checker and
// the machine-readable outputs that compare-peers.sh reads back.
#include <gtest/gtest.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>
#include <tuple>
#include <vector>

#include "dear/error.h"
#include "proc.h"
#include "report.h"

namespace dear::bench {
namespace {

std::vector<std::uint64_t> bytes_of(const std::vector<SizePoint>& points) {
  std::vector<std::uint64_t> out;
  for (const auto& p : points) out.push_back(p.bytes);
  return out;
}

TEST(SizeSweep, AllReduceDefaultsCoverEightBytesToSixtyFourMiB) {
  BenchArgs args;
  const auto points = size_sweep(args, Collective::kAllReduce, DataType::kFloat32, 4);
  ASSERT_EQ(points.size(), 24U);
  EXPECT_EQ(points.front().bytes, 8U);
  EXPECT_EQ(points.front().count, 2U);
  EXPECT_EQ(points.front().rank_count, 2U);
  EXPECT_EQ(points.back().bytes, 64ULL << 20);
  EXPECT_EQ(points.back().count, 16ULL << 20);
}

TEST(SizeSweep, BroadcastCountsLikeAllReduce) {
  BenchArgs args;
  args.min_bytes = 6;
  args.max_bytes = 48;
  const auto points = size_sweep(args, Collective::kBroadcast, DataType::kFloat32, 3);
  EXPECT_EQ(bytes_of(points), (std::vector<std::uint64_t>{4, 12, 24, 48}));
  EXPECT_EQ(points[1].rank_count, 3U);
}

TEST(SizeSweep, ReduceScatterAndAllGatherRoundToWholeRankBlocks) {
  BenchArgs args;
  args.min_bytes = 8;
  args.max_bytes = 128;
  for (const Collective c : {Collective::kReduceScatter, Collective::kAllGather}) {
    const auto points = size_sweep(args, c, DataType::kFloat32, 3);
    // 8 B holds no 3-rank block but is kept as the first point; 16 -> 12, 32 -> 24, ...
    EXPECT_EQ(bytes_of(points), (std::vector<std::uint64_t>{0, 12, 24, 60, 120})) << to_string(c);
    EXPECT_EQ(points[0].count, 0U);
    EXPECT_EQ(points[2].rank_count, 2U);
    EXPECT_EQ(points[2].count, 6U);
  }
}

TEST(SizeSweep, DropsLaterEmptyPointsAndRepeats) {
  BenchArgs args;
  args.min_bytes = 8;
  args.max_bytes = 64;
  const auto ag = size_sweep(args, Collective::kAllGather, DataType::kFloat64, 4);
  EXPECT_EQ(bytes_of(ag), (std::vector<std::uint64_t>{0, 32, 64}));

  args.step_bytes = 8;
  args.max_bytes = 32;
  const auto rs = size_sweep(args, Collective::kReduceScatter, DataType::kFloat32, 3);
  EXPECT_EQ(bytes_of(rs), (std::vector<std::uint64_t>{0, 12, 24}));
}

TEST(SizeSweep, SinglePointWhenMinEqualsMax) {
  BenchArgs args;
  args.min_bytes = args.max_bytes = 1 << 20;
  EXPECT_EQ(size_sweep(args, Collective::kAllReduce, DataType::kInt8, 2).size(), 1U);
}

TEST(Validate, RejectsSweepsThatCannotWork) {
  BenchArgs args;
  EXPECT_NO_THROW(validate(args, 4));
  args.max_bytes = 4;
  EXPECT_THROW(validate(args, 4), Error);
  args = BenchArgs{};
  args.step_factor = 1;
  EXPECT_THROW(validate(args, 4), Error);
  args = BenchArgs{};
  args.collective = Collective::kBroadcast;
  args.root = 4;
  EXPECT_THROW(validate(args, 4), Error);
}

TEST(BusFactor, MatchesNcclTests) {
  EXPECT_DOUBLE_EQ(bus_factor(Collective::kAllReduce, 4), 1.5);
  EXPECT_DOUBLE_EQ(bus_factor(Collective::kReduceScatter, 4), 0.75);
  EXPECT_DOUBLE_EQ(bus_factor(Collective::kAllGather, 8), 0.875);
  EXPECT_DOUBLE_EQ(bus_factor(Collective::kBroadcast, 8), 1.0);
  EXPECT_DOUBLE_EQ(bus_factor(Collective::kReduce, 8), 1.0);
  EXPECT_DOUBLE_EQ(bus_factor(Collective::kGather, 4), 0.75);
  EXPECT_DOUBLE_EQ(bus_factor(Collective::kAllReduce, 1), 0.0);
  EXPECT_DOUBLE_EQ(algbw_gbps(1000000, 1000.0), 1.0);  // 1 MB in 1 ms = 1 GB/s

  const SizePoint p = size_point(4000000, Collective::kAllReduce, DataType::kFloat32, 4);
  const Result r = make_result(p, Collective::kAllReduce, 4, 2000.0, 1900.0, 2500.0, 0);
  EXPECT_DOUBLE_EQ(r.algbw, 2.0);
  EXPECT_DOUBLE_EQ(r.busbw, 3.0);
  EXPECT_TRUE(r.valid);
}

TEST(Samples, NearestRankPercentiles) {
  Samples s;
  EXPECT_EQ(s.mean(), 0.0);
  EXPECT_EQ(s.p50(), 0.0);
  for (int i = 100; i >= 1; --i) s.add(i);
  EXPECT_DOUBLE_EQ(s.mean(), 50.5);
  EXPECT_DOUBLE_EQ(s.p50(), 50.0);
  EXPECT_DOUBLE_EQ(s.p99(), 99.0);
  EXPECT_DOUBLE_EQ(s.percentile(100.0), 100.0);
  EXPECT_DOUBLE_EQ(s.min(), 1.0);
  EXPECT_DOUBLE_EQ(s.max(), 100.0);
  EXPECT_THROW((void)s.percentile(0.0), Error);

  Samples few;
  for (const double v : {30.0, 10.0, 20.0}) few.add(v);
  EXPECT_DOUBLE_EQ(few.p50(), 20.0);  // ceil(1.5) = 2nd smallest
  EXPECT_DOUBLE_EQ(few.p99(), 30.0);  // ceil(2.97) = 3rd
}

TEST(Elements, HalfAndBfloat16RoundTrip) {
  std::vector<std::uint16_t> buf(1);
  const struct {
    double in, half, bf16;
  } cases[] = {
      {1.0, 1.0, 1.0},
      {80.0, 80.0, 80.0},
      {65504.0, 65504.0, 65536.0},
      {257.0, 257.0, 256.0},  // bf16 keeps 8 significant bits
      {1.0 / 3.0, 0.333251953125, 0.333984375},
      {std::ldexp(1.0, -24), std::ldexp(1.0, -24), std::ldexp(1.0, -24)},  // fp16 subnormal
      {-2.5, -2.5, -2.5},
  };
  for (const auto& c : cases) {
    store_value(buf.data(), 0, DataType::kFloat16, c.in);
    EXPECT_EQ(load_value(buf.data(), 0, DataType::kFloat16), c.half) << c.in;
    store_value(buf.data(), 0, DataType::kBFloat16, c.in);
    EXPECT_EQ(load_value(buf.data(), 0, DataType::kBFloat16), c.bf16) << c.in;
  }
  store_value(buf.data(), 0, DataType::kFloat16, 1e6);
  EXPECT_TRUE(std::isinf(load_value(buf.data(), 0, DataType::kFloat16)));
}

// Reduces the ranks' inputs the way a library would, element by element in the element type
// (through double only for the 16-bit floats, which hold these small integers exactly).
std::vector<unsigned char> reduce_inputs(const std::vector<std::vector<unsigned char>>& inputs,
                                         std::uint64_t count, DataType t, ReduceOp op, int nranks) {
  std::vector<unsigned char> out(inputs[0]);
  for (std::uint64_t i = 0; i < count; ++i) {
    double acc = load_value(inputs[0].data(), i, t);
    for (int r = 1; r < nranks; ++r) {
      const double v = load_value(inputs[static_cast<std::size_t>(r)].data(), i, t);
      switch (op) {
        case ReduceOp::kSum:
        case ReduceOp::kAvg: acc += v; break;
        case ReduceOp::kProd: acc *= v; break;
        case ReduceOp::kMin: acc = std::min(acc, v); break;
        case ReduceOp::kMax: acc = std::max(acc, v); break;
      }
      // Integer libraries wrap at every step; storing does the same.
      store_value(out.data(), i, t, acc);
      acc = load_value(out.data(), i, t);
    }
    if (op == ReduceOp::kAvg) acc = is_floating(t) ? acc / nranks : std::trunc(acc / nranks);
    store_value(out.data(), i, t, acc);
  }
  return out;
}

// A check of `c` on `nranks` ranks (rank 0; the tests set each rank in turn).
CheckSpec spec_of(Collective c, DataType t, int nranks, std::uint64_t rank_count,
                  std::uint64_t seed) {
  CheckSpec spec;
  spec.collective = c;
  spec.dtype = t;
  spec.nranks = nranks;
  spec.rank_count = rank_count;
  spec.seed = seed;
  return spec;
}

std::vector<std::vector<unsigned char>> make_inputs(CheckSpec spec) {
  std::vector<std::vector<unsigned char>> inputs;
  for (int r = 0; r < spec.nranks; ++r) {
    spec.rank = r;
    inputs.emplace_back(input_count(spec) * dtype_size(spec.dtype));
    fill_input(inputs.back().data(), spec);
  }
  return inputs;
}

class AllReduceCheck : public ::testing::TestWithParam<std::tuple<DataType, ReduceOp, int>> {};

TEST_P(AllReduceCheck, CorrectBufferHasNoWrongElementsAndCorruptionIsCounted) {
  const auto [t, op, nranks] = GetParam();
  CheckSpec spec;
  spec.collective = Collective::kAllReduce;
  spec.dtype = t;
  spec.op = op;
  spec.nranks = nranks;
  spec.rank_count = 1000;
  spec.seed = 5;
  const auto inputs = make_inputs(spec);
  auto out = reduce_inputs(inputs, spec.rank_count, t, op, nranks);
  EXPECT_EQ(count_wrong(out.data(), spec), 0) << to_string(t) << " " << to_string(op);

  // Every value is at least 1, so a corrupted element is far outside any tolerance.
  store_value(out.data(), 17, t, load_value(out.data(), 17, t) + 7.0);
  store_value(out.data(), 999, t, 0.0);
  EXPECT_EQ(count_wrong(out.data(), spec), 2) << to_string(t) << " " << to_string(op);

  std::fill(out.begin(), out.end(), 0);
  EXPECT_EQ(count_wrong(out.data(), spec), 1000);
}

INSTANTIATE_TEST_SUITE_P(
    EveryTypeAndOp, AllReduceCheck,
    ::testing::Combine(::testing::Values(DataType::kInt8, DataType::kUint8, DataType::kInt32,
                                         DataType::kInt64, DataType::kFloat16, DataType::kBFloat16,
                                         DataType::kFloat32, DataType::kFloat64),
                       ::testing::Values(ReduceOp::kSum, ReduceOp::kProd, ReduceOp::kMin,
                                         ReduceOp::kMax, ReduceOp::kAvg),
                       ::testing::Values(2, 3, 16)));

TEST(Checker, PatternStaysExactAtTheDocumentedBound) {
  // 24 ranks: sums reach at most 120 and products 64, both inside int8.
  CheckSpec spec;
  spec.nranks = 24;
  double max_sum = 0.0;
  double max_prod = 0.0;
  for (std::uint64_t i = 0; i < kPatternPeriod; ++i) {
    double sum = 0.0;
    double prod = 1.0;
    for (int r = 0; r < spec.nranks; ++r) {
      sum += pattern_value(ReduceOp::kSum, r, i, 0);
      prod *= pattern_value(ReduceOp::kProd, r, i, 0);
    }
    max_sum = std::max(max_sum, sum);
    max_prod = std::max(max_prod, prod);
  }
  EXPECT_LE(max_sum, 127.0);
  EXPECT_LE(max_prod, 127.0);
  for (int r = 0; r < 5; ++r) {
    // No rank contributes a constant.
    EXPECT_NE(pattern_value(ReduceOp::kSum, r, 0, 0), pattern_value(ReduceOp::kSum, r, 1, 0));
  }
}

TEST(Checker, ReduceScatterAllGatherAndBroadcast) {
  const int nranks = 4;
  CheckSpec spec;
  spec.dtype = DataType::kFloat32;
  spec.op = ReduceOp::kSum;
  spec.nranks = nranks;
  spec.rank_count = 50;
  spec.seed = 3;

  // reduce_scatter: rank r's result is block r of the elementwise sum.
  spec.collective = Collective::kReduceScatter;
  const auto rs_inputs = make_inputs(spec);
  const auto total =
      reduce_inputs(rs_inputs, spec.rank_count * nranks, spec.dtype, spec.op, nranks);
  for (int r = 0; r < nranks; ++r) {
    spec.rank = r;
    const unsigned char* block = total.data() + r * spec.rank_count * sizeof(float);
    EXPECT_EQ(count_wrong(block, spec), 0) << "rank " << r;
    if (r > 0) {
      const unsigned char* other = total.data();
      EXPECT_GT(count_wrong(other, spec), 0) << "block 0 is not rank " << r << "'s result";
    }
  }

  // all_gather: every rank ends with the inputs in rank order.
  spec.collective = Collective::kAllGather;
  const auto ag_inputs = make_inputs(spec);
  std::vector<unsigned char> gathered;
  for (const auto& in : ag_inputs) gathered.insert(gathered.end(), in.begin(), in.end());
  for (int r = 0; r < nranks; ++r) {
    spec.rank = r;
    EXPECT_EQ(count_wrong(gathered.data(), spec), 0);
  }
  // Blocks swapped between ranks are caught: element 0 (rank 0's) and 50 (rank 1's) differ.
  const double first = load_value(gathered.data(), 0, spec.dtype);
  const double second = load_value(gathered.data(), spec.rank_count, spec.dtype);
  ASSERT_NE(first, second);
  store_value(gathered.data(), 0, spec.dtype, second);
  store_value(gathered.data(), spec.rank_count, spec.dtype, first);
  EXPECT_EQ(count_wrong(gathered.data(), spec), 2);

  // broadcast: every rank ends with the root's input; a non-root keeping its own is caught.
  spec.collective = Collective::kBroadcast;
  spec.root = 2;
  const auto bc_inputs = make_inputs(spec);
  spec.rank = 1;
  EXPECT_EQ(count_wrong(bc_inputs[2].data(), spec), 0);
  EXPECT_GT(count_wrong(bc_inputs[1].data(), spec), 0);
  EXPECT_DOUBLE_EQ(expected_value(spec, 7), pattern_value(ReduceOp::kSum, 2, 7, 3));
}

TEST(Checker, AllToAllBlocksComeFromEveryRank) {
  // Built by hand from the inputs: rank r's block j is block r of rank j's input.
  const int nranks = 4;
  CheckSpec spec = spec_of(Collective::kAllToAll, DataType::kInt32, nranks, 9, 5);
  const auto inputs = make_inputs(spec);
  const std::size_t block = spec.rank_count * sizeof(std::int32_t);
  for (int r = 0; r < nranks; ++r) {
    spec.rank = r;
    std::vector<unsigned char> out;
    for (int j = 0; j < nranks; ++j) {
      const unsigned char* from = inputs[static_cast<std::size_t>(j)].data() + r * block;
      out.insert(out.end(), from, from + block);
    }
    EXPECT_EQ(count_wrong(out.data(), spec), 0) << "rank " << r;
    // Its own input unexchanged is wrong wherever a block came from another rank.
    EXPECT_GT(count_wrong(inputs[static_cast<std::size_t>(r)].data(), spec), 0) << "rank " << r;
  }
}

TEST(Checker, PingPongEchoesRankTwoKsMessage) {
  // Rank 2k gets its own input back, rank 2k + 1 keeps rank 2k's; a pair's other input is wrong.
  const int nranks = 4;
  CheckSpec spec = spec_of(Collective::kPingPong, DataType::kFloat32, nranks, 11, 2);
  const auto inputs = make_inputs(spec);
  for (int r = 0; r < nranks; ++r) {
    spec.rank = r;
    const auto& sent = inputs[static_cast<std::size_t>(r - r % 2)];
    const auto& other = inputs[static_cast<std::size_t>(r - r % 2 + 1)];
    EXPECT_EQ(count_wrong(sent.data(), spec), 0) << "rank " << r;
    EXPECT_GT(count_wrong(other.data(), spec), 0) << "rank " << r;
  }
  // One run is a message there and back: its time is halved, as a latency benchmark reports.
  EXPECT_EQ(hops_per_run(Collective::kPingPong), 2);
  EXPECT_EQ(hops_per_run(Collective::kSendRecv), 1);
  EXPECT_DOUBLE_EQ(bus_factor(Collective::kPingPong, 2), 1.0);
  BenchArgs args;
  args.collective = Collective::kPingPong;
  EXPECT_NO_THROW(validate(args, 2));
  EXPECT_THROW(validate(args, 3), Error);
}

TEST(Checker, StaleDataFromAnotherSeedIsCaught) {
  CheckSpec spec;
  spec.nranks = 2;
  spec.rank_count = 100;
  const auto inputs = make_inputs(spec);
  const auto out = reduce_inputs(inputs, 100, spec.dtype, spec.op, 2);
  spec.seed = 1;
  EXPECT_GT(count_wrong(out.data(), spec), 50);
}

RunReport sample_report() {
  RunReport report;
  report.info.library = "mpi";
  report.info.collective = Collective::kAllGather;
  report.info.nranks = 4;
  report.info.dtype = DataType::kBFloat16;
  report.info.op = ReduceOp::kMax;
  report.info.transport = "tcp lo";
  report.info.meta = {{"algo", "ring"}, {"chunks", 3}};
  for (const std::uint64_t bytes : {0ULL, 1024ULL, 1ULL << 20}) {
    const SizePoint p = size_point(bytes, Collective::kAllGather, DataType::kBFloat16, 4);
    Row row = make_row(p, Collective::kAllGather, DataType::kBFloat16, ReduceOp::kMax, 0);
    row.oop = make_result(p, Collective::kAllGather, 4, 12.5 + static_cast<double>(bytes), 12.0,
                          30.25, 0);
    if (bytes != 1024) row.ip = make_result(p, Collective::kAllGather, 4, 11.0, 10.0, 20.0);
    report.rows.push_back(row);
  }
  return report;
}

TEST(Json, RoundTripsThroughText) {
  const RunReport report = sample_report();
  const nlohmann::json doc = nlohmann::json::parse(to_json(report).dump());
  EXPECT_EQ(doc.at("library"), "mpi");
  EXPECT_EQ(doc.at("collective"), "all_gather");
  EXPECT_EQ(doc.at("dtype"), "bfloat16");
  EXPECT_EQ(doc.at("meta").at("chunks"), 3);
  EXPECT_TRUE(doc.at("rows").at(1).at("ip").is_null());
  EXPECT_TRUE(doc.at("rows").at(0).at("ip").at("wrong").is_null());
  EXPECT_EQ(doc.at("rows").at(2).at("redop"), "none");

  const RunReport back = report_from_json(doc);
  EXPECT_EQ(back.info.library, report.info.library);
  EXPECT_EQ(back.info.collective, report.info.collective);
  EXPECT_EQ(back.info.nranks, 4);
  EXPECT_EQ(back.info.dtype, DataType::kBFloat16);
  EXPECT_EQ(back.info.op, ReduceOp::kMax);
  EXPECT_EQ(back.info.transport, "tcp lo");
  EXPECT_EQ(back.info.meta, report.info.meta);
  ASSERT_EQ(back.rows.size(), report.rows.size());
  for (std::size_t i = 0; i < back.rows.size(); ++i) {
    const Row& a = report.rows[i];
    const Row& b = back.rows[i];
    EXPECT_EQ(b.point.bytes, a.point.bytes);
    EXPECT_EQ(b.point.count, a.point.count);
    EXPECT_EQ(b.point.rank_count, a.point.rank_count);
    EXPECT_EQ(b.type, a.type);
    EXPECT_EQ(b.redop, a.redop);
    EXPECT_EQ(b.root, a.root);
    for (const auto& [x, y] : {std::pair{&a.oop, &b.oop}, std::pair{&a.ip, &b.ip}}) {
      EXPECT_EQ(y->valid, x->valid);
      EXPECT_DOUBLE_EQ(y->time_us, x->time_us);
      EXPECT_DOUBLE_EQ(y->busbw, x->busbw);
      EXPECT_DOUBLE_EQ(y->p99_us, x->p99_us);
      EXPECT_EQ(y->wrong, x->wrong);
    }
  }
  EXPECT_EQ(to_json(back), to_json(report));
  EXPECT_THROW((void)report_from_json(nlohmann::json{{"library", "x"}}), Error);
}

TEST(Csv, OneLinePerRowWithEmptyFieldsForNA) {
  const RunReport report = sample_report();
  const std::string header = csv_header();
  const auto columns = std::count(header.begin(), header.end(), ',');
  for (const Row& row : report.rows) {
    const std::string line = csv_line(report.info, row);
    EXPECT_EQ(std::count(line.begin(), line.end(), ','), columns) << line;
  }
  EXPECT_NE(csv_line(report.info, report.rows[1]).find(",,,,,"), std::string::npos);
}

TEST(SampleLog, RankZeroWritesEveryIterationInOrder) {
  const std::string path = ::testing::TempDir() + "dear_sample_log.csv";
  {
    SampleLog log(path, 0);
    EXPECT_TRUE(log.active());
    Samples oop;
    oop.add(12.5);
    oop.add(3.25);
    Samples ip;
    ip.add(1000.0);
    log.add(1048576, false, oop);
    log.add(1048576, true, ip);
    log.add(8, true, Samples{});  // a placement with no iterations adds nothing
  }
  EXPECT_EQ(test::slurp(path),
            "size,placement,iteration,us\n"
            "1048576,oop,0,12.500\n"
            "1048576,oop,1,3.250\n"
            "1048576,ip,0,1000.000\n");
  std::remove(path.c_str());
}

TEST(SampleLog, InactiveOnOtherRanksAndWithoutAPath) {
  const std::string path = ::testing::TempDir() + "dear_sample_log_rank1.csv";
  std::remove(path.c_str());
  SampleLog other(path, 1);
  EXPECT_FALSE(other.active());
  Samples s;
  s.add(1.0);
  other.add(8, false, s);
  EXPECT_FALSE(std::filesystem::exists(path));
  SampleLog none("", 0);
  EXPECT_FALSE(none.active());
}

TEST(SampleLog, UnwritablePathNamesTheFlag) {
  try {
    SampleLog log("/nonexistent-dir/samples.csv", 0);
    FAIL() << "opened a file in a directory that does not exist";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("--samples"), std::string::npos) << e.what();
  }
}

TEST(Table, RowsLineUpWithTheHeader) {
  const RunReport report = sample_report();
  const std::string a = format_row(report.rows[0]);
  const std::string b = format_row(report.rows[1]);
  EXPECT_EQ(a.size(), b.size());
  EXPECT_NE(b.find("N/A"), std::string::npos);
  EXPECT_EQ(a.substr(0, 12), "           0");
  // Root is -1 and redop "none" for collectives without them.
  EXPECT_NE(a.find("  none      -1"), std::string::npos) << a;

  std::FILE* f = std::tmpfile();
  ASSERT_NE(f, nullptr);
  print_header(f);
  print_footer(f, report.rows);
  std::rewind(f);
  std::vector<std::string> lines;
  char buf[512];
  while (std::fgets(buf, sizeof buf, f) != nullptr) lines.emplace_back(buf);
  std::fclose(f);
  ASSERT_GE(lines.size(), 5U);
  EXPECT_EQ(lines[1].size() - 1, a.size()) << lines[1];  // column names line, minus '\n'
  EXPECT_NE(lines[1].find("#wrong"), std::string::npos);
  EXPECT_NE(lines[2].find("(GB/s)"), std::string::npos);
  EXPECT_EQ(lines[3], "# Out of bounds values : 0 OK\n");
  EXPECT_EQ(lines[4].rfind("# Avg bus bandwidth    : ", 0), 0U);
}

TEST(Flags, ParseTheNcclTestsSpelling) {
  CLI::App app;
  BenchArgs args;
  add_bench_flags(app, args);
  app.parse("-b 1K -e 64M -f 4 -n 7 -w 0 -c 0 -d half -o max -r 1 --json out.json all_gather",
            false);
  EXPECT_EQ(args.min_bytes, 1024U);
  EXPECT_EQ(args.max_bytes, 64ULL << 20);
  EXPECT_EQ(args.step_factor, 4U);
  EXPECT_EQ(args.iters, 7);
  EXPECT_EQ(args.warmup_iters, 0);
  EXPECT_EQ(args.check, 0);
  EXPECT_EQ(args.dtype, DataType::kFloat16);
  EXPECT_EQ(args.op, ReduceOp::kMax);
  EXPECT_EQ(args.root, 1);
  EXPECT_EQ(args.json_path, "out.json");
  EXPECT_EQ(args.collective, Collective::kAllGather);
  EXPECT_TRUE(args.out_of_place && args.in_place) << "both placements by default";

  for (const auto& [value, out, in] :
       {std::tuple{"out", true, false}, std::tuple{"in", false, true},
        std::tuple{"both", true, true}}) {
    CLI::App one;
    BenchArgs placed;
    add_bench_flags(one, placed);
    one.parse(std::string("--placement ") + value + " all_reduce", false);
    EXPECT_EQ(placed.out_of_place, out) << value;
    EXPECT_EQ(placed.in_place, in) << value;
  }

  CLI::App bad;
  BenchArgs ignored;
  add_bench_flags(bad, ignored);
  EXPECT_THROW(bad.parse("-d complex all_reduce", false), CLI::ParseError);
  EXPECT_THROW(bad.parse("-b 12Q all_reduce", false), CLI::ParseError);
  EXPECT_THROW(bad.parse("-b 8", false), CLI::ParseError);  // no collective
  EXPECT_THROW(bad.parse("--placement sideways all_reduce", false), CLI::ParseError);
}

TEST(Collectives, NamesParseBack) {
  for (const Collective c : kAllCollectives) EXPECT_EQ(parse_collective(to_string(c)), c);
  EXPECT_EQ(parse_collective("allreduce"), Collective::kAllReduce);
  EXPECT_EQ(parse_collective("reduce-scatter"), Collective::kReduceScatter);
  EXPECT_EQ(parse_collective("gather"), Collective::kGather);
  EXPECT_EQ(parse_collective("scatter"), Collective::kScatter);
  EXPECT_EQ(parse_collective("alltoall"), Collective::kAllToAll);
  EXPECT_EQ(parse_collective("all-to-all"), Collective::kAllToAll);
  EXPECT_EQ(parse_collective("alltoallv"), std::nullopt);
}

}  // namespace
}  // namespace dear::bench
