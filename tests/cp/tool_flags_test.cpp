// The tools refuse, before any rank starts, what would not run: CP flags with one rank on the MLA,
// DSA and linear-attention paths (the softmax paths already refused them), a negative Ulysses
// degree (silently dropped), and an hp-bench report grid that a child would refuse deep into the
// run (after the calibration, losing every measurement before it).
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "rank_harness.h"

namespace {

struct Refusal {
  std::string cmd, text;
};

void expect_refused(const std::vector<Refusal>& cases) {
  for (const auto& c : cases) {
    auto r = hp::testing::run_command(c.cmd);
    EXPECT_NE(r.rc, 0) << c.cmd << "\n" << r.out;
    EXPECT_NE(r.out.find(c.text), std::string::npos) << c.cmd << "\n" << r.out;
    EXPECT_EQ(r.out.find("rank 0"), std::string::npos) << "no rank may start: " << r.out;
  }
}

TEST(ToolFlags, CPFlagsWithOneRankAreRefusedOnEveryPath) {
  const std::string bench = HP_BENCH_BINARY, run = HP_CP_RUN_BINARY;
  const std::string files = " --input /nonexistent/in.pt --output /nonexistent/out.pt";
  expect_refused({
      {bench + " cp --attention mla --cp 1 --seq 64 --schedule async",
       "hp-bench cp --attention mla: --schedule async configures context parallelism, but --cp "
       "is 1 (the plain layer runs); drop it or set --cp > 1"},
      {bench + " cp --attention dsa --cp 1 --seq 64 --load-balance",
       "--load-balance configures context parallelism, but --cp is 1"},
      {bench + " linear --cp 1 --cp-mode ulysses --state-exchange all_gather",
       "hp-bench linear: --cp-mode ulysses, --state-exchange all_gather configure context "
       "parallelism, but --cp is 1 (the plain mixer runs)"},
      {run + files + " --cp 1 --attention mla --cp-algo ulysses --schedule async",
       "hp-cp-run: --cp-algo ulysses, --schedule async configure context parallelism, but --cp "
       "is 1 (the plain layer runs on the whole sequence)"},
      {run + files + " --cp 1 --mixer gdn --cp-mode ulysses",
       "hp-cp-run: --cp-mode ulysses configures context parallelism, but --cp is 1 (the plain "
       "mixer runs on the whole sequence)"},
  });
}

TEST(ToolFlags, ANegativeUlyssesDegreeIsRefused) {
  const std::string bench = HP_BENCH_BINARY, run = HP_CP_RUN_BINARY;
  for (const std::string& cmd :
       {bench + " cp --cp 2 --seq 64 --cp-algo ulysses --ulysses-degree=-2",
        run + " --input /nonexistent/in.pt --output /nonexistent/out.pt --cp 2 --cp-algo ulysses "
              "--ulysses-degree=-2"}) {
    auto r = hp::testing::run_command(cmd);
    EXPECT_NE(r.rc, 0) << cmd << "\n" << r.out;
    EXPECT_NE(r.out.find("--ulysses-degree"), std::string::npos) << cmd << "\n" << r.out;
    EXPECT_EQ(r.out.find("rank 0"), std::string::npos) << r.out;
  }
}

TEST(ToolFlags, AReportGridThatCannotRunIsRefusedBeforeTheCalibration) {
  const std::string report =
      std::string(HP_BENCH_BINARY) + " report --out " + hp::testing::scratch_dir() + "/report_grid";
  expect_refused({
      {report + " --ranks 3",
       "--ranks 3 cannot run the whole grid: P must be in [2, 64], even "
       "from 4 (hybrid and usp run with Ulysses degree 2), and divide"},
      {report + " --ranks 1", "--ranks 1 cannot run the whole grid"},
      {report + " --ranks 2 --seqs 4096 4098",
       "--seqs 4098 is not a multiple of 2 x P = 4 (head-tail load balance splits the sequence "
       "into 2P chunks at --ranks 2)"},
      {report + " --iters 0", "--iters 0 must be in [1, 1000]"},
  });
  for (const char* args : {" --ranks 3", " --iters 0"}) {
    auto r = hp::testing::run_command(report + args);
    EXPECT_EQ(r.out.find("calibrate"), std::string::npos) << "nothing may run: " << r.out;
  }
}

}  // namespace
