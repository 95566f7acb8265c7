// hp-bench hsdp end to end: both modes run, measured bytes equal the formula, parameters per
// rank are 1/Sd of the model, and a bad layout fails before any rank starts.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "rank_harness.h"

namespace {

TEST(HsdpBench, ReportsBothModesWithBytesEqualToTheFormula) {
  auto r =
      hp::testing::run_command(std::string(HP_BENCH_BINARY) +
                               " hsdp --nproc 4 --dp-shard 2 --dp-replicate 2 --comm-fusion "
                               "on --layers 2 --hidden 64 --ffn 128 --seq 64 --iters 1 --json");
  ASSERT_EQ(r.rc, 0) << r.out;
  auto j = nlohmann::json::parse(r.out.substr(r.out.find('{')));
  ASSERT_EQ(j["results"].size(), 2u);
  EXPECT_EQ(j["results"][0]["mode"], "baseline");
  EXPECT_EQ(j["results"][1]["mode"], "pipelined");
  for (const auto& m : j["results"]) {
    for (const char* op : {"all_gather", "reduce_scatter", "all_reduce"}) {
      EXPECT_EQ(m["bytes_per_rank"][op], m["formula_bytes_per_rank"][op]) << op;
      EXPECT_GT(m["bytes_per_rank"][op].get<int64_t>(), 0) << op;
    }
    EXPECT_GT(m["backward_s"].get<double>(), 0);
    // Every parameter's rows divide by 2 here: exactly half.
    EXPECT_EQ(m["param_bytes_per_rank"].get<int64_t>() * 2, m["full_param_bytes"].get<int64_t>());
  }
  auto bad = hp::testing::run_command(std::string(HP_BENCH_BINARY) +
                                      " hsdp --nproc 4 --dp-shard 3 --dp-replicate 1");
  EXPECT_NE(bad.rc, 0);
  EXPECT_NE(bad.out.find("--dp-shard 3 x --dp-replicate 1 = 3 but --nproc is 4"), std::string::npos)
      << bad.out;
}

// Without --dp-shard the ranks --dp-replicate leaves are the shard degree (the default of 1
// refused the default --nproc 2: "1 x 1 = 1 but --nproc is 2").
TEST(HsdpBench, TheShardDegreeDefaultsToTheRanksLeft) {
  const std::string bench = std::string(HP_BENCH_BINARY) +
                            " hsdp --layers 1 --hidden 32 --ffn 64 --seq 16 --iters 1 --json";
  auto r = hp::testing::run_command(bench);
  ASSERT_EQ(r.rc, 0) << r.out;
  auto j = nlohmann::json::parse(r.out.substr(r.out.find('{')));
  EXPECT_EQ(j["nproc"], 2);
  EXPECT_EQ(j["dp_shard"], 2);
  EXPECT_EQ(j["dp_replicate"], 1);
  auto odd = hp::testing::run_command(bench + " --nproc 3 --dp-replicate 2");
  EXPECT_NE(odd.rc, 0);
  EXPECT_NE(odd.out.find("--dp-replicate 2 does not divide --nproc 3"), std::string::npos)
      << odd.out;
}

}  // namespace
