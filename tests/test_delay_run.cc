// dear-run --link-delay: the shorthand sets DEAR_LINK_DELAY_US for every rank, in whole
// microseconds, and refuses what it cannot read.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cstdio>
#include <string>
#include <utility>

namespace {

struct Result {
  int status = -1;
  std::string output;
};

Result dear_run(const std::string& args) {
  const std::string cmd = std::string(DEAR_RUN_PATH) + " " + args + " 2>&1";
  Result r;
  std::FILE* p = ::popen(cmd.c_str(), "r");
  if (p == nullptr) return r;
  char buf[4096];
  std::size_t n = 0;
  while ((n = std::fread(buf, 1, sizeof(buf), p)) > 0) r.output.append(buf, n);
  const int status = ::pclose(p);
  if (WIFEXITED(status)) r.status = WEXITSTATUS(status);
  return r;
}

TEST(DearRunLinkDelay, SetsTheVariableForEveryRank) {
  for (const auto& [text, us] :
       {std::pair{"25us", "25"}, std::pair{"1ms", "1000"}, std::pair{"2.5ms", "2500"},
        std::pair{"40", "40"}, std::pair{"0", "0"}}) {
    const Result r = dear_run(std::string("-n 2 --dry-run --link-delay ") + text + " -- true");
    ASSERT_EQ(r.status, 0) << r.output;
    const std::string want = std::string("DEAR_LINK_DELAY_US=") + us + " ";
    const auto first = r.output.find(want);
    ASSERT_NE(first, std::string::npos) << text << ": " << r.output;
    EXPECT_NE(r.output.find(want, first + 1), std::string::npos) << "only one rank: " << r.output;
  }
}

TEST(DearRunLinkDelay, RefusesWhatItCannotRead) {
  for (const char* bad :
       {"25xs", "-5us", "1.5us", "fast", "11s", "--env DEAR_LINK_DELAY_US=3 --link-delay 3us"}) {
    const std::string args = std::string(bad).rfind("--", 0) == 0
                                 ? std::string(bad)
                                 : std::string("--link-delay ") + bad;
    const Result r = dear_run("-n 2 --dry-run " + args + " -- true");
    EXPECT_EQ(r.status, 2) << bad << ": " << r.output;
  }
}

}  // namespace
