// The log-step schedules (collectives/steps.h) executed by a simulator, all ranks in memory,
// under random interleavings, and checked against an independent reference.
//
// The simulator keeps the engine's rules: a send reads the sender's work buffer when it is
// delivered (not when queued), so a step that overwrites what an in-flight send still reads
// shows up as a wrong result unless the step says wait_send; a copy lands in the receiver's work
// buffer as soon as it arrives, even before its step, as the engine places it; a reduce operand
// waits until its step. Each element carries (sum, number of final reductions), so the test also
// checks that every element of the result was finalised exactly once (where avg divides).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <random>
#include <set>
#include <tuple>
#include <vector>

#include "collectives/ops.h"
#include "collectives/steps.h"

namespace dear::collectives {
namespace {

struct Elem {
  std::int64_t sum;
  std::int64_t finals;
};
constexpr std::size_t kEl = sizeof(Elem);

struct InFlight {
  int src;
  int dst;
  int tag;
  std::size_t src_step;
};

struct RankState {
  StepPlan plan;
  std::vector<Elem> work;
  std::vector<Elem> stage;
  std::vector<Elem> input;  // what steps with send_input read (all_to_all)
  std::size_t next = 0;
  std::vector<bool> sent, delivered, received;
};

std::int64_t input(int rank, std::size_t i) {
  return static_cast<std::int64_t>(rank) * 1000 + static_cast<std::int64_t>(i) + 1;
}

Elem* at(std::vector<Elem>& v, std::size_t byte_offset) { return v.data() + byte_offset / kEl; }

// Runs one collective on n simulated ranks; returns every rank's final work buffer.
std::vector<std::vector<Elem>> simulate(OpKind kind, Schedule s, int n, std::size_t count,
                                        std::mt19937& rng, int root = -1) {
  std::vector<RankState> ranks(static_cast<std::size_t>(n));
  for (int r = 0; r < n; ++r) {
    auto& st = ranks[static_cast<std::size_t>(r)];
    st.plan = plan_steps(kind, s, r, n, count, kEl, root);
    const std::size_t elems = st.plan.work_bytes / kEl;
    st.work.assign(elems, Elem{0, 0});
    st.stage.assign(st.plan.stage_bytes / kEl, Elem{-1, -1});
    // Initial contents, as start_local() leaves them.
    if (kind == OpKind::kAllGather) {
      for (std::size_t i = 0; i < count; ++i) {
        st.work[static_cast<std::size_t>(r) * count + i] = {input(r, i), 0};
      }
    } else if (kind == OpKind::kAllToAll) {
      // The output: the own block copied from the input, the rest not yet written.
      for (std::size_t i = 0; i < elems; ++i) st.input.push_back({input(r, i), 0});
      st.work.assign(elems, Elem{-1, -1});
      for (std::size_t i = 0; i < count; ++i) {
        const std::size_t g = static_cast<std::size_t>(r) * count + i;
        st.work[g] = st.input[g];
      }
    } else {
      for (std::size_t i = 0; i < elems; ++i) st.work[i] = {input(r, i), 0};
    }
    if (kind != OpKind::kAllToAll) {
      // A rooted kScattered's senders read their input (count elements).
      for (std::size_t i = 0; i < count; ++i) st.input.push_back({input(r, i), 0});
    }
    const std::size_t k = st.plan.steps.size();
    st.sent.assign(k, false);
    st.delivered.assign(k, false);
    st.received.assign(k, false);
    for (const Step& step : st.plan.steps) {
      // Every peer a schedule uses is a mesh peer, in both directions.
      for (int p : {step.send_peer, step.recv_peer}) {
        if (p < 0) continue;
        const auto peers = step_peers(r, n);
        EXPECT_TRUE(std::binary_search(peers.begin(), peers.end(), p))
            << "rank " << r << " -> " << p;
        const auto back = step_peers(p, n);
        EXPECT_TRUE(std::binary_search(back.begin(), back.end(), r)) << "rank " << p << " -> " << r;
      }
    }
  }
  std::vector<InFlight> flight;
  const auto find_recv = [&](int dst, int src, int tag) -> std::size_t {
    const auto& steps = ranks[static_cast<std::size_t>(dst)].plan.steps;
    for (std::size_t k = 0; k < steps.size(); ++k) {
      if (steps[k].recv_peer == src && steps[k].tag == tag) return k;
    }
    ADD_FAILURE() << "rank " << dst << " expects no message " << tag << " from rank " << src;
    return steps.size();
  };
  const auto deliver = [&](std::size_t i) {
    const InFlight m = flight[i];
    flight.erase(flight.begin() + static_cast<std::ptrdiff_t>(i));
    auto& from = ranks[static_cast<std::size_t>(m.src)];
    auto& to = ranks[static_cast<std::size_t>(m.dst)];
    const Step& ss = from.plan.steps[m.src_step];
    const std::size_t k = find_recv(m.dst, m.src, m.tag);
    if (k >= to.plan.steps.size()) return;
    const Step& rs = to.plan.steps[k];
    ASSERT_EQ(ss.send_bytes, rs.recv_bytes) << "message " << m.tag << " " << m.src << "->" << m.dst;
    ASSERT_FALSE(to.received[k]) << "message " << m.tag << " delivered twice";
    // The sender's memory is read now: what it holds at delivery time.
    // (Bruck's messages were packed into the staging area as they left.)
    const Elem* src = !ss.send_pieces.empty() ? at(from.stage, ss.pack_offset)
                      : ss.send_input         ? at(from.input, ss.send_offset)
                                              : at(from.work, ss.send_offset);
    Elem* dst = rs.reduce || !rs.recv_pieces.empty() ? at(to.stage, rs.stage_offset)
                                                     : at(to.work, rs.recv_offset);
    std::memcpy(dst, src, rs.recv_bytes);
    from.delivered[m.src_step] = true;
    to.received[k] = true;
  };
  const auto advance = [&](int r) {
    auto& st = ranks[static_cast<std::size_t>(r)];
    bool moved = false;
    while (st.next < st.plan.steps.size()) {
      const std::size_t k = st.next;
      const Step& step = st.plan.steps[k];
      if (step.send_peer >= 0 && !st.sent[k]) {
        std::size_t packed = step.pack_offset;
        for (const StepPiece& p : step.send_pieces) {
          std::memcpy(at(st.stage, packed),
                      p.input ? at(st.input, p.offset) : at(st.work, p.offset), p.bytes);
          packed += p.bytes;
        }
        flight.push_back({r, step.send_peer, step.tag, k});
        st.sent[k] = true;
        moved = true;
      }
      if (step.recv_peer >= 0) {
        if (!st.received[k]) break;
        if (step.wait_send && !st.delivered[k]) break;
        std::size_t landed = step.stage_offset;
        for (const StepPiece& p : step.recv_pieces) {
          std::memcpy(at(st.work, p.offset), at(st.stage, landed), p.bytes);
          landed += p.bytes;
        }
        if (step.reduce) {
          Elem* dst = at(st.work, step.recv_offset);
          const Elem* op = at(st.stage, step.stage_offset);
          for (std::size_t i = 0; i < step.recv_bytes / kEl; ++i) {
            dst[i].sum += op[i].sum;
            dst[i].finals += op[i].finals + (step.final ? 1 : 0);
          }
        }
      }
      ++st.next;
      moved = true;
    }
    return moved;
  };
  for (int guard = 0; guard < 100000; ++guard) {
    bool moved = false;
    // A random rank advances, or a random message is delivered.
    std::uniform_int_distribution<int> pick(0, n + static_cast<int>(flight.size()) - 1);
    const int choice = pick(rng);
    if (choice < n) {
      moved = advance(choice);
    } else {
      deliver(static_cast<std::size_t>(choice - n));
      moved = true;
    }
    if (::testing::Test::HasFatalFailure()) return {};
    if (!moved) {
      bool done = flight.empty();
      for (int r = 0; r < n && done; ++r) {
        done = ranks[static_cast<std::size_t>(r)].next ==
               ranks[static_cast<std::size_t>(r)].plan.steps.size();
      }
      if (done) break;
      // Nothing here could move: make sure some rank or message still can.
      bool any = !flight.empty();
      for (int r = 0; r < n && !any; ++r) any = advance(r);
      if (!any) {
        ADD_FAILURE() << "deadlock: no rank can advance and no message is in flight";
        return {};
      }
    }
  }
  std::vector<std::vector<Elem>> out;
  for (auto& st : ranks) {
    EXPECT_EQ(st.next, st.plan.steps.size()) << "a rank did not finish";
    out.push_back(st.work);
  }
  return out;
}

void check(OpKind kind, Schedule s, int n, std::size_t count, std::uint32_t seed, int root = -1) {
  std::mt19937 rng(seed);
  const auto work = simulate(kind, s, n, count, rng, root);
  if (::testing::Test::HasFailure()) return;
  const auto total = [&](std::size_t i) {
    std::int64_t t = 0;
    for (int r = 0; r < n; ++r) t += input(r, i);
    return t;
  };
  const std::string what = std::string(to_string(kind)) + " " + to_string(s) +
                           " n=" + std::to_string(n) + " count=" + std::to_string(count) +
                           " seed=" + std::to_string(seed) + " root=" + std::to_string(root);
  for (int r = 0; r < n; ++r) {
    const auto& w = work[static_cast<std::size_t>(r)];
    if (is_scatter(kind, root)) {
      // Every rank's own block, from the root's input: at its place in the tree's scratch
      // (and the root's input), at the start of a scattered scatter's output.
      const bool at_start = s == Schedule::kScattered && r != root;
      for (std::size_t i = 0; i < count; ++i) {
        const std::size_t g = static_cast<std::size_t>(r) * count + i;
        ASSERT_EQ(w[at_start ? i : g].sum, input(root, g))
            << what << " rank " << r << " element " << i;
      }
      continue;
    }
    if (kind == OpKind::kAllToAll) {
      // Block src came from rank src's block r.
      for (int src = 0; src < n; ++src) {
        for (std::size_t i = 0; i < count; ++i) {
          ASSERT_EQ(w[static_cast<std::size_t>(src) * count + i].sum,
                    input(src, static_cast<std::size_t>(r) * count + i))
              << what << " rank " << r << " block " << src << " element " << i;
        }
      }
      continue;
    }
    if (root >= 0 && r != root) continue;  // reduce, gather: only the root's result is defined
    switch (kind) {
      case OpKind::kAllReduce:
        for (std::size_t i = 0; i < count; ++i) {
          ASSERT_EQ(w[i].sum, total(i)) << what << " rank " << r << " element " << i;
          ASSERT_EQ(w[i].finals, 1) << what << " rank " << r << " element " << i;
        }
        break;
      case OpKind::kReduceScatter:
        for (std::size_t i = 0; i < count; ++i) {
          const std::size_t g = static_cast<std::size_t>(r) * count + i;
          ASSERT_EQ(w[g].sum, total(g)) << what << " rank " << r << " element " << i;
          ASSERT_EQ(w[g].finals, 1) << what << " rank " << r << " element " << i;
        }
        break;
      default:
        for (int src = 0; src < n; ++src) {
          for (std::size_t i = 0; i < count; ++i) {
            ASSERT_EQ(w[static_cast<std::size_t>(src) * count + i].sum, input(src, i))
                << what << " rank " << r << " block " << src << " element " << i;
          }
        }
        break;
    }
  }
}

TEST(LogStepSchedules, EveryKindRankCountAndSizeUnderRandomInterleavings) {
  const std::vector<std::pair<OpKind, Schedule>> cases{
      {OpKind::kAllReduce, Schedule::kRecursiveDoubling},
      {OpKind::kAllReduce, Schedule::kHalvingDoubling},
      {OpKind::kAllReduce, Schedule::kTree},
      {OpKind::kReduceScatter, Schedule::kHalvingDoubling},
      {OpKind::kAllGather, Schedule::kRecursiveDoubling},
      {OpKind::kAllGather, Schedule::kHalvingDoubling},
      {OpKind::kAllToAll, Schedule::kPairwise},
      {OpKind::kAllToAll, Schedule::kScattered},
      {OpKind::kAllToAll, Schedule::kBruck},
  };
  for (const auto& [kind, s] : cases) {
    for (int n = 2; n <= 17; ++n) {
      for (std::size_t count : {std::size_t{0}, std::size_t{1}, std::size_t{3}, std::size_t{37}}) {
        for (std::uint32_t seed = 1; seed <= 4; ++seed) {
          check(kind, s, n, count, seed * 7919U + static_cast<std::uint32_t>(n));
          if (HasFailure()) return;
        }
      }
    }
  }
}

TEST(LogStepSchedules, ReduceTreeReachesEveryRootOverMeshLinks) {
  // The tree to rank 0, then the path of one-bit hops to the root: every root of every rank
  // count, each element reduced from every rank and finalised once, only on mesh links
  // (simulate() checks each step's peers against step_peers()).
  for (int n = 2; n <= 17; ++n) {
    for (int root = 0; root < n; ++root) {
      for (std::size_t count : {std::size_t{0}, std::size_t{1}, std::size_t{37}}) {
        for (std::uint32_t seed = 1; seed <= 3; ++seed) {
          check(OpKind::kAllReduce, Schedule::kTree, n, count,
                seed * 104729U + static_cast<std::uint32_t>(n * 31 + root), root);
          if (HasFailure()) return;
        }
      }
    }
  }
  // 6 ranks, root 5 = 101: the tree to rank 0, then the path 0 -> 4 -> 5. Rank 4 reduces 5's
  // part, sends it up, and later passes the result on; rank 3 is off the path and only sends.
  EXPECT_EQ(plan_steps(OpKind::kAllReduce, Schedule::kTree, 0, 6, 4, 4, 5).steps.size(),
            4U);  // three receives, the first hop
  EXPECT_EQ(plan_steps(OpKind::kAllReduce, Schedule::kTree, 5, 6, 4, 4, 5).steps.size(), 2U);
  EXPECT_EQ(plan_steps(OpKind::kAllReduce, Schedule::kTree, 4, 6, 4, 4, 5).steps.size(), 4U);
  EXPECT_EQ(plan_steps(OpKind::kAllReduce, Schedule::kTree, 3, 6, 4, 4, 5).steps.size(), 1U);
  // 8 ranks: the tree is rooted at the root itself, no path. Root 7 receives from 6, 5 and 3
  // (7 ^ 2^k) and finalises; rank 0 only sends.
  const StepPlan root7 = plan_steps(OpKind::kAllReduce, Schedule::kTree, 7, 8, 4, 4, 7);
  ASSERT_EQ(root7.steps.size(), 3U);
  EXPECT_EQ(root7.steps[0].recv_peer, 6);
  EXPECT_EQ(root7.steps[2].recv_peer, 3);
  EXPECT_TRUE(root7.steps[2].final);
  EXPECT_EQ(plan_steps(OpKind::kAllReduce, Schedule::kTree, 0, 8, 4, 4, 7).steps.size(), 1U);
  EXPECT_THROW((void)plan_steps(OpKind::kAllReduce, Schedule::kTree, 0, 4, 1, 4, 4),
               std::invalid_argument);
}

TEST(LogStepSchedules, GatherTreeReachesEveryRootOverMeshLinks) {
  // Every block reaches the root, whatever the root and rank count, over mesh links only.
  for (int n = 2; n <= 17; ++n) {
    for (int root = 0; root < n; ++root) {
      for (std::size_t count : {std::size_t{0}, std::size_t{1}, std::size_t{5}}) {
        for (std::uint32_t seed = 1; seed <= 3; ++seed) {
          check(OpKind::kAllGather, Schedule::kTree, n, count,
                seed * 7927U + static_cast<std::uint32_t>(n * 37 + root), root);
          if (HasFailure()) return;
        }
      }
    }
  }
  // 6 ranks, root 5 = 101: the tree to rank 0, then the path 0 -> 4 -> 5. Rank 4 holds blocks
  // 4..5 and receives 0..3; rank 5 holds 5 and receives 0..4 (nothing lies above it).
  const std::size_t block = 4 * 4;
  const StepPlan p4 = plan_steps(OpKind::kAllGather, Schedule::kTree, 4, 6, 4, 4, 5);
  ASSERT_EQ(p4.steps.size(), 4U);  // from 5, to 0, from 0, to 5
  EXPECT_EQ(p4.steps[2].recv_peer, 0);
  EXPECT_EQ(p4.steps[2].recv_bytes, 4 * block);
  const StepPlan p5 = plan_steps(OpKind::kAllGather, Schedule::kTree, 5, 6, 4, 4, 5);
  ASSERT_EQ(p5.steps.size(), 2U);  // to 4, from 4
  EXPECT_EQ(p5.steps[1].recv_peer, 4);
  EXPECT_EQ(p5.steps[1].recv_offset, 0U);
  EXPECT_EQ(p5.steps[1].recv_bytes, 5 * block);
  // 8 ranks, root 6: the tree is rooted at 6 itself. It receives block 7 from 7, blocks 4..5
  // from 4 and blocks 0..3 from 2: seven blocks in three messages, no path.
  const StepPlan p6 = plan_steps(OpKind::kAllGather, Schedule::kTree, 6, 8, 4, 4, 6);
  ASSERT_EQ(p6.steps.size(), 3U);
  EXPECT_EQ(p6.steps[0].recv_peer, 7);
  EXPECT_EQ(p6.steps[0].recv_offset, 7 * block);
  EXPECT_EQ(p6.steps[1].recv_peer, 4);
  EXPECT_EQ(p6.steps[1].recv_offset, 4 * block);
  EXPECT_EQ(p6.steps[1].recv_bytes, 2 * block);
  EXPECT_EQ(p6.steps[2].recv_peer, 2);
  EXPECT_EQ(p6.steps[2].recv_offset, 0U);
  EXPECT_EQ(p6.steps[2].recv_bytes, 4 * block);
  // Without a root the all_gather has no tree; a root beyond the ranks is refused.
  EXPECT_THROW((void)plan_steps(OpKind::kAllGather, Schedule::kTree, 0, 4, 1, 4),
               std::invalid_argument);
  EXPECT_THROW((void)plan_steps(OpKind::kAllGather, Schedule::kTree, 0, 4, 1, 4, 4),
               std::invalid_argument);
}

TEST(LogStepSchedules, ScatterTreeReachesEveryRankFromEveryRootOverMeshLinks) {
  for (int n = 2; n <= 17; ++n) {
    for (int root = 0; root < n; ++root) {
      for (std::size_t count : {std::size_t{0}, std::size_t{1}, std::size_t{5}}) {
        for (std::uint32_t seed = 1; seed <= 3; ++seed) {
          check(OpKind::kReduceScatter, Schedule::kTree, n, count,
                seed * 7933U + static_cast<std::uint32_t>(n * 41 + root), root);
          if (HasFailure()) return;
        }
      }
    }
  }
  // 8 ranks, root 6: 6 sends blocks 0..3 to 2, 4..5 to 4, 7 to 7 and receives nothing.
  const std::size_t block = 4 * 4;
  const StepPlan p6 = plan_steps(OpKind::kReduceScatter, Schedule::kTree, 6, 8, 4, 4, 6);
  ASSERT_EQ(p6.steps.size(), 3U);
  EXPECT_EQ(p6.steps[0].send_peer, 2);
  EXPECT_EQ(p6.steps[0].send_bytes, 4 * block);
  EXPECT_EQ(p6.steps[2].send_peer, 7);
  EXPECT_FALSE(p6.work_is_scratch);  // the root sends from its input
  // 6 ranks, root 5: the path 5 -> 4 -> 0 first. 5 sends 0..4 to 4; 4 sends 0..3 to 0 and
  // nothing down to 5; 0 hands 1, 2..3 on.
  const StepPlan p5 = plan_steps(OpKind::kReduceScatter, Schedule::kTree, 5, 6, 4, 4, 5);
  ASSERT_EQ(p5.steps.size(), 1U);
  EXPECT_EQ(p5.steps[0].send_peer, 4);
  EXPECT_EQ(p5.steps[0].send_bytes, 5 * block);
  const StepPlan p4 = plan_steps(OpKind::kReduceScatter, Schedule::kTree, 4, 6, 4, 4, 5);
  ASSERT_EQ(p4.steps.size(), 2U);  // from 5, to 0
  EXPECT_EQ(p4.steps[1].send_peer, 0);
  EXPECT_EQ(p4.steps[1].send_bytes, 4 * block);
  EXPECT_TRUE(p4.work_is_scratch);
}

TEST(LogStepSchedules, ScatteredReduceGatherAndScatterGoStraightToAndFromTheRoot) {
  for (int n = 2; n <= 17; ++n) {
    for (int root = 0; root < n; ++root) {
      for (std::size_t count : {std::size_t{0}, std::size_t{1}, std::size_t{5}}) {
        for (std::uint32_t seed = 1; seed <= 2; ++seed) {
          const auto salt = seed * 7919U + static_cast<std::uint32_t>(n * 43 + root);
          check(OpKind::kAllReduce, Schedule::kScattered, n, count, salt, root);
          check(OpKind::kAllGather, Schedule::kScattered, n, count, salt, root);
          check(OpKind::kReduceScatter, Schedule::kScattered, n, count, salt, root);
          if (HasFailure()) return;
        }
      }
    }
  }
  // 5 ranks, root 3: the root receives from 4, 0, 1, 2 and finalises the last; the others send
  // their input once.
  const StepPlan reduce3 = plan_steps(OpKind::kAllReduce, Schedule::kScattered, 3, 5, 4, 4, 3);
  ASSERT_EQ(reduce3.steps.size(), 4U);
  EXPECT_EQ(reduce3.steps[0].recv_peer, 4);
  EXPECT_EQ(reduce3.steps[3].recv_peer, 2);
  EXPECT_TRUE(reduce3.steps[3].final);
  EXPECT_FALSE(reduce3.steps[2].final);
  const StepPlan gather1 = plan_steps(OpKind::kAllGather, Schedule::kScattered, 1, 5, 4, 4, 3);
  ASSERT_EQ(gather1.steps.size(), 1U);
  EXPECT_EQ(gather1.steps[0].send_peer, 3);
  EXPECT_TRUE(gather1.steps[0].send_input);
  const StepPlan scatter1 = plan_steps(OpKind::kReduceScatter, Schedule::kScattered, 1, 5, 4, 4, 3);
  ASSERT_EQ(scatter1.steps.size(), 1U);
  EXPECT_EQ(scatter1.steps[0].recv_peer, 3);
  EXPECT_EQ(scatter1.steps[0].recv_offset, 0U);
  EXPECT_FALSE(scatter1.work_is_scratch);
  // Without a root there is no scattered reduce, gather or scatter.
  EXPECT_THROW((void)plan_steps(OpKind::kAllReduce, Schedule::kScattered, 0, 4, 1, 4),
               std::invalid_argument);
}

// An out-of-place log-step all_reduce reads its input where the work buffer (its output) has
// not been written yet, and copies in only the gaps of a range it reads in part.
TEST(LogStepWorkBuffer, StartsAsTheInputWithoutACopy) {
  std::vector<char> in(64);
  for (std::size_t i = 0; i < in.size(); ++i) in[i] = static_cast<char>(i + 1);
  std::vector<char> out(64, 0);
  Op op;
  op.kind = OpKind::kAllReduce;
  op.in = in.data();
  op.out = out.data();
  op.work = out.data();
  op.log_step.input_in_place = true;

  EXPECT_EQ(work_source(op, 0, 16), in.data()) << "nothing written: read the input";
  EXPECT_EQ(work_source(op, 16, 0), out.data() + 16) << "an empty range";
  EXPECT_TRUE(op.log_step.written.empty());
  EXPECT_TRUE(std::all_of(out.begin(), out.end(), [](char c) { return c == 0; }));

  std::fill(out.begin() + 8, out.begin() + 16, static_cast<char>(-1));  // a step wrote these
  work_written(op, 8, 8);
  EXPECT_EQ(work_source(op, 8, 8), out.data() + 8) << "all written: read the work buffer";
  EXPECT_EQ(work_source(op, 0, 32), out.data()) << "in part: fill the gaps, then the buffer";
  for (std::size_t i = 0; i < 32; ++i) {
    const char want = i >= 8 && i < 16 ? static_cast<char>(-1) : in[i];
    EXPECT_EQ(out[i], want) << "byte " << i;
  }
  EXPECT_EQ(out[32], 0) << "beyond the range: untouched";
  using Ranges = std::vector<std::pair<std::size_t, std::size_t>>;
  EXPECT_EQ(op.log_step.written, (Ranges{{0, 32}}));

  work_written(op, 48, 8);
  work_written(op, 40, 8);  // touches [48, 56): merged
  EXPECT_EQ(op.log_step.written, (Ranges{{0, 32}, {40, 56}}));
  work_written(op, 60, 2);
  work_written(op, 30, 12);  // overlaps two ranges: one
  EXPECT_EQ(op.log_step.written, (Ranges{{0, 56}, {60, 62}}));

  Op plain;
  plain.in = in.data();
  plain.work = out.data();
  EXPECT_EQ(work_source(plain, 4, 4), out.data() + 4) << "without input_in_place";
  work_written(plain, 0, 8);
  EXPECT_TRUE(plain.log_step.written.empty());
}

TEST(LogStepSchedules, StepCountsAreLogarithmic) {
  for (int n : {2, 4, 8, 16, 64, 1024}) {
    const int lg = std::countr_zero(static_cast<unsigned>(n));
    EXPECT_EQ(step_cost(OpKind::kAllReduce, Schedule::kRecursiveDoubling, n, 1, 4).steps, lg);
    EXPECT_EQ(step_cost(OpKind::kAllReduce, Schedule::kHalvingDoubling, n, 1024, 4).steps, 2 * lg);
    EXPECT_EQ(step_cost(OpKind::kAllReduce, Schedule::kTree, n, 1, 4).steps, 2 * lg);
    EXPECT_EQ(step_cost(OpKind::kAllGather, Schedule::kRecursiveDoubling, n, 1, 4).steps, lg);
  }
  // Folding adds one step before and one after the core.
  EXPECT_EQ(step_cost(OpKind::kAllReduce, Schedule::kRecursiveDoubling, 6, 1, 4).steps, 2 + 2);
  // Rabenseifner moves 2 (N-1)/N of the vector per rank; recursive doubling log2(N) vectors.
  EXPECT_EQ(step_cost(OpKind::kAllReduce, Schedule::kHalvingDoubling, 8, 800, 4).wire_bytes,
            2U * 7U * 400U);
  EXPECT_EQ(step_cost(OpKind::kAllReduce, Schedule::kRecursiveDoubling, 8, 800, 4).wire_bytes,
            3U * 3200U);
}

TEST(LogStepSchedules, PeersAreEveryRankUpToTheFullMeshThenFewAndSymmetric) {
  std::vector<int> sizes;
  for (int n = 1; n <= kFullMeshMaxRanks + 3; ++n) sizes.push_back(n);
  sizes.insert(sizes.end(), {100, 128, 200});
  for (int n : sizes) {
    for (int r = 0; r < n; ++r) {
      const auto peers = step_peers(r, n);
      if (n <= kFullMeshMaxRanks) {
        // all_to_all's schedules exchange with every rank.
        ASSERT_EQ(peers.size(), static_cast<std::size_t>(n - 1)) << n << ": " << r;
      } else {
        EXPECT_LE(peers.size(),
                  2U * static_cast<std::size_t>(std::bit_width(static_cast<unsigned>(n))));
      }
      for (int p : peers) {
        EXPECT_NE(p, r);
        const auto back = step_peers(p, n);
        EXPECT_TRUE(std::binary_search(back.begin(), back.end(), r)) << n << ": " << r << "," << p;
      }
    }
  }
}

TEST(LogStepSchedules, RejectsWhatItDoesNotRun) {
  EXPECT_THROW((void)plan_steps(OpKind::kReduceScatter, Schedule::kTree, 0, 4, 1, 4),
               std::invalid_argument);
  EXPECT_THROW((void)plan_steps(OpKind::kBroadcast, Schedule::kRecursiveDoubling, 0, 4, 1, 4),
               std::invalid_argument);
  EXPECT_THROW((void)plan_steps(OpKind::kAllReduce, Schedule::kTree, 4, 4, 1, 4),
               std::invalid_argument);
  EXPECT_THROW((void)plan_steps(OpKind::kAllReduce, Schedule::kPairwise, 0, 4, 1, 4),
               std::invalid_argument);
  EXPECT_THROW((void)plan_steps(OpKind::kAllToAll, Schedule::kTree, 0, 4, 1, 4),
               std::invalid_argument);
  EXPECT_FALSE(is_log_step(Schedule::kRing));
  EXPECT_TRUE(log_step_supports(OpKind::kAllGather, Schedule::kRecursiveDoubling));
}

TEST(LogStepSchedules, AllToAllShiftsOneBlockPerPeer) {
  // 5 ranks, rank 1, 3 elements of 4 bytes per block: pairwise step k sends block 1 + k of the
  // input to rank 1 + k and receives block 1 - k of the output from rank 1 - k, tag k.
  const std::size_t block = 3 * 4;
  const StepPlan pw = plan_steps(OpKind::kAllToAll, Schedule::kPairwise, 1, 5, 3, 4);
  ASSERT_EQ(pw.steps.size(), 4U);
  for (int k = 1; k <= 4; ++k) {
    const Step& st = pw.steps[static_cast<std::size_t>(k - 1)];
    const int to = (1 + k) % 5;
    const int from = (1 - k + 5) % 5;
    EXPECT_EQ(st.tag, k);
    EXPECT_EQ(st.send_peer, to);
    EXPECT_TRUE(st.send_input);
    EXPECT_EQ(st.send_offset, static_cast<std::size_t>(to) * block);
    EXPECT_EQ(st.recv_peer, from);
    EXPECT_EQ(st.recv_offset, static_cast<std::size_t>(from) * block);
    EXPECT_FALSE(st.reduce);
  }
  EXPECT_EQ(pw.work_bytes, 5 * block);
  EXPECT_EQ(pw.stage_bytes, 0U);
  // Scattered: the four sends first, then the four receives.
  const StepPlan sc = plan_steps(OpKind::kAllToAll, Schedule::kScattered, 1, 5, 3, 4);
  ASSERT_EQ(sc.steps.size(), 8U);
  for (std::size_t i = 0; i < 4; ++i) {
    EXPECT_GE(sc.steps[i].send_peer, 0);
    EXPECT_LT(sc.steps[i].recv_peer, 0);
    EXPECT_LT(sc.steps[i + 4].send_peer, 0);
    EXPECT_GE(sc.steps[i + 4].recv_peer, 0);
  }
  // Nothing to move: no steps.
  EXPECT_TRUE(plan_steps(OpKind::kAllToAll, Schedule::kPairwise, 0, 4, 0, 4).steps.empty());
}

// gather_v's messages (an all_to_all_v layout with a root): on every rank count of 2-7 and every
// root, each other rank sends its one part to the root, under the tag the root's receive from
// it carries, and the root receives N-1 parts; nothing else travels (all_to_all_v would send
// N(N-1) messages, most of them empty), and every message is kept when empty, so that sizes
// that disagree still meet.
TEST(LogStepSchedules, GatherVSendsOnlyToTheRoot) {
  for (int n = 2; n <= 7; ++n) {
    for (int root = 0; root < n; ++root) {
      // tag -> (sender, bytes), from the senders' plans; then matched against the root's.
      std::map<int, std::pair<int, std::size_t>> sent;
      for (int r = 0; r < n; ++r) {
        AllToAllLayout l;
        l.root = root;
        const auto u = static_cast<std::size_t>(n);
        l.send_bytes.assign(u, 0);
        l.send_offset.assign(u, 0);
        l.recv_bytes.assign(u, 0);
        l.recv_offset.assign(u, 0);
        l.send_bytes[static_cast<std::size_t>(root)] = static_cast<std::size_t>(r) * 8;
        if (r == root) {
          for (int j = 0; j < n; ++j) {
            l.recv_bytes[static_cast<std::size_t>(j)] = static_cast<std::size_t>(j) * 8;
            l.recv_offset[static_cast<std::size_t>(j)] = static_cast<std::size_t>(j) * 64;
          }
        }
        for (const Schedule s : {Schedule::kPairwise, Schedule::kScattered}) {
          const StepPlan p = plan_all_to_all_v(s, r, n, l);
          if (r != root) {
            ASSERT_EQ(p.steps.size(), 1U) << "n=" << n << " root=" << root << " rank=" << r;
            const Step& st = p.steps[0];
            EXPECT_EQ(st.send_peer, root);
            EXPECT_LT(st.recv_peer, 0);
            EXPECT_EQ(st.send_bytes, static_cast<std::size_t>(r) * 8);
            EXPECT_EQ(st.tag, (root - r + n) % n);
            sent[st.tag] = {r, st.send_bytes};
            continue;
          }
          ASSERT_EQ(p.steps.size(), static_cast<std::size_t>(n - 1)) << "n=" << n;
          std::set<int> from;
          for (const Step& st : p.steps) {
            EXPECT_LT(st.send_peer, 0);
            ASSERT_GE(st.recv_peer, 0);
            from.insert(st.recv_peer);
            EXPECT_EQ(st.recv_bytes, static_cast<std::size_t>(st.recv_peer) * 8);
            EXPECT_EQ(st.recv_offset, static_cast<std::size_t>(st.recv_peer) * 64);
            EXPECT_EQ(st.tag, (root - st.recv_peer + n) % n);
          }
          EXPECT_EQ(from.size(), static_cast<std::size_t>(n - 1));
          EXPECT_EQ(from.count(root), 0U);
        }
      }
      EXPECT_EQ(sent.size(), static_cast<std::size_t>(n - 1)) << "tags collide, n=" << n;
    }
  }
}

}  // namespace
}  // namespace dear::collectives
