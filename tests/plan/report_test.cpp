// hp-bench calibrate / cp --cp-algo auto / report end to end on plain loopback, with the
// calibration cache redirected (HP_CALIBRATION) so the user's cache is never touched.
#include <filesystem>
#include <fstream>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "rank_harness.h"

namespace {

namespace fs = std::filesystem;

std::string with_cache(const std::string& cal, const std::string& args) {
  return "HP_CALIBRATION=" + cal + " " + std::string(HP_BENCH_BINARY) + " " + args;
}

TEST(Report, CalibrateAutoAndReport) {
  const std::string dir = ::testing::TempDir() + "/hp_report";
  fs::remove_all(dir);
  fs::create_directories(dir);
  const std::string cal = dir + "/calibration.json";
  // Without a calibration, auto names the command that makes one.
  auto missing = hp::testing::run_command(with_cache(
      cal, "cp --cp 2 --seq 512 --heads 4 --kv-heads 4 --head-dim 16 --cp-algo auto --iters 1"));
  EXPECT_NE(missing.rc, 0);
  EXPECT_NE(missing.out.find("run `hp-bench calibrate"), std::string::npos) << missing.out;

  auto c = hp::testing::run_command(with_cache(cal, "calibrate"));
  ASSERT_EQ(c.rc, 0) << c.out;
  auto calibration = nlohmann::json::parse(std::ifstream(cal));
  EXPECT_EQ(calibration["link"], "loopback");
  EXPECT_GT(calibration["attention_gflops"].get<double>(), 0);
  EXPECT_GT(calibration["collectives"]["all_to_all"]["2"]["seconds_per_byte"].get<double>(), 0);
  EXPECT_EQ(calibration["inputs"]["comm"].size(), 4u);  // P in {2, 4} x two sizes

  auto a = hp::testing::run_command(
      with_cache(cal,
                 "cp --cp 2 --seq 512 --heads 4 --kv-heads 4 --head-dim 16 --causal --projections "
                 "--cp-algo auto --iters 1"));
  ASSERT_EQ(a.rc, 0) << a.out;
  for (const char* choice : {"predicted all_gather/sync", "predicted all_gather/async",
                             "predicted ulysses/sync", "predicted ulysses/async", "chosen: "}) {
    EXPECT_NE(a.out.find(choice), std::string::npos) << choice << "\n" << a.out;
  }

  auto r = hp::testing::run_command(
      with_cache(cal, "report --seqs 512 --ranks 2 --iters 1 --out " + dir + "/out"));
  ASSERT_EQ(r.rc, 0) << r.out;
  auto j = nlohmann::json::parse(std::ifstream(dir + "/out/results.json"));
  // all_gather (balanced) and ulysses x sync/async, plus contiguous all_gather.
  EXPECT_EQ(j["measurements"].size(), 5u);
  for (const auto& m : j["measurements"]) {
    EXPECT_GT(m["step_time_s"].get<double>(), 0);
    EXPECT_GT(m["predicted_step_time_s"].get<double>(), 0);
    EXPECT_EQ(m["comm_bytes_per_rank"], m["comm_bytes_theory"]);
  }
  EXPECT_TRUE(j["cost_model"].contains("max_rel_error"));
  ASSERT_EQ(j["auto_selection"].size(), 1u);
  for (const char* key :
       {"case", "auto_choice", "auto_step_time_s", "best_choice", "best_step_time_s"}) {
    EXPECT_TRUE(j["auto_selection"][0].contains(key)) << key;
  }
  for (const char* f : {"results.md", "chart.svg", "timeline.svg"}) {
    EXPECT_TRUE(fs::exists(dir + "/out/" + f)) << f;
  }
  std::ifstream svg(dir + "/out/chart.svg");
  std::string text((std::istreambuf_iterator<char>(svg)), {});
  EXPECT_NE(text.find("<svg"), std::string::npos);
  EXPECT_NE(text.find("exposed communication"), std::string::npos);
}

}  // namespace
