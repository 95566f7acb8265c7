// hp-bench moe end to end: the all-to-all bytes each rank counts equal the formula from its
// routing, the all-local baseline runs in the same invocation, bad sizes are refused.
#include <string>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "rank_harness.h"

namespace {

TEST(MoEBench, CountedBytesEqualTheRoutingFormulaAtEp2And4) {
  for (int ep : {2, 4}) {
    auto r = hp::testing::run_command(std::string(HP_BENCH_BINARY) +
                                      " moe --experts 8 --top-k 2 --ep " + std::to_string(ep) +
                                      " --tokens 256 --hidden 64 --expert-ffn 32 --iters 1 --json");
    ASSERT_EQ(r.rc, 0) << r.out;
    const auto j = nlohmann::json::parse(r.out.substr(r.out.find('{')));
    ASSERT_EQ(j["a2a_bytes_per_rank"].size(), static_cast<size_t>(ep));
    for (int k = 0; k < ep; ++k) {
      EXPECT_GT(j["a2a_bytes_per_rank"][k].get<int64_t>(), 0);
      EXPECT_EQ(j["a2a_bytes_per_rank"][k], j["formula_bytes_per_rank"][k]) << j;
    }
    EXPECT_GT(j["ep_tokens_per_s"].get<double>(), 0);
    EXPECT_GT(j["local_tokens_per_s"].get<double>(), 0);
    EXPECT_GE(j["exposed_dispatch_combine_s"].get<double>(), 0);
  }
  auto bad = hp::testing::run_command(std::string(HP_BENCH_BINARY) +
                                      " moe --experts 6 --ep 4 --tokens 64 --hidden 16");
  EXPECT_NE(bad.rc, 0);
  EXPECT_NE(bad.out.find("--experts 6 is not divisible by --ep 4"), std::string::npos) << bad.out;
}

}  // namespace
