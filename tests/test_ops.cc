// An operation's life (collectives/ops.h, OpState): the engine's path through it is allowed,
// and any other move throws an internal error that names the rank, the operation and both
// states instead of carrying on with a record that has gone wrong.
#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "collectives/ops.h"
#include "dear/error.h"

namespace dear::collectives {
namespace {

constexpr OpState kAll[] = {OpState::kQueued,    OpState::kStarting, OpState::kRunning,
                            OpState::kFinishing, OpState::kDone,     OpState::kFailed};

TEST(OpStates, TheEnginesPathIsAllowed) {
  Op op;
  EXPECT_EQ(op.life(), OpState::kQueued);
  for (OpState s : {OpState::kStarting, OpState::kRunning, OpState::kFinishing, OpState::kDone}) {
    op.transition(s);
    EXPECT_EQ(op.life(), s);
  }
}

TEST(OpStates, EveryStateButTheFinalOnesMayFail) {
  for (OpState from : kAll) {
    const bool final = from == OpState::kDone || from == OpState::kFailed;
    EXPECT_EQ(transition_allowed(from, OpState::kFailed), !final) << to_string(from);
  }
}

TEST(OpStates, OnlyTheNextStateOrFailureIsAllowed) {
  const std::vector<std::pair<OpState, OpState>> allowed = {
      {OpState::kQueued, OpState::kStarting},   {OpState::kStarting, OpState::kRunning},
      {OpState::kRunning, OpState::kFinishing}, {OpState::kFinishing, OpState::kDone},
      {OpState::kQueued, OpState::kFailed},     {OpState::kStarting, OpState::kFailed},
      {OpState::kRunning, OpState::kFailed},    {OpState::kFinishing, OpState::kFailed}};
  for (OpState from : kAll) {
    for (OpState to : kAll) {
      const bool want =
          std::find(allowed.begin(), allowed.end(), std::make_pair(from, to)) != allowed.end();
      EXPECT_EQ(transition_allowed(from, to), want) << to_string(from) << " -> " << to_string(to);
    }
  }
}

TEST(OpStates, AMoveNotAllowedNamesRankOperationAndBothStates) {
  Op op;
  op.kind = OpKind::kReduceScatter;
  op.rank = 3;
  op.seq = 17;
  op.transition(OpState::kStarting);
  try {
    op.transition(OpState::kDone);
    FAIL() << "starting -> done was allowed";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInternal);
    EXPECT_EQ(e.rank(), 3);
    EXPECT_EQ(e.op(), "reduce_scatter");
    EXPECT_EQ(e.seq(), 17);
    const std::string what = e.what();
    EXPECT_NE(what.find("starting"), std::string::npos) << what;
    EXPECT_NE(what.find("done"), std::string::npos) << what;
    EXPECT_NE(what.find("#17"), std::string::npos) << what;
  }
  EXPECT_EQ(op.life(), OpState::kStarting) << "a refused move leaves the state as it was";
}

}  // namespace
}  // namespace dear::collectives
