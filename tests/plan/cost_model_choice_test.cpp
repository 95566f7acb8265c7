// The planner's --cp-algo auto (choice and log), and the candidates that may repeat K/V heads
// (kv_head_policy=repeat): which are legal, and what their collectives are predicted to move.
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "cost_model_util.h"
#include "hp/model/qwen3.h"
#include "hp/plan/cost_model.h"
#include "hp/plan/plan.h"
#include "rank_harness.h"

namespace hp::plan {
namespace {

using namespace hp::plan::testing;  // NOLINT: synthetic calibrations, workloads, configs

// An 8-head Qwen3 (head dim 16, width 128) with `kv_heads` K/V heads.
model::Qwen3 small_qwen3(int64_t kv_heads) {
  model::Qwen3Config mc;
  mc.heads = 8;
  mc.kv_heads = kv_heads;
  mc.head_dim = 16;
  mc.hidden = 128;
  return model::Qwen3(mc);
}

// --cp-algo auto over 4 ranks at S = 4096 (no calibration yet).
PlanOptions auto_over_four() {
  PlanOptions po;
  po.cp_size = 4;
  po.seq_len = 4096;
  po.cp_auto = true;
  return po;
}

TEST(CostModel, PlannerAutoChoosesAndLogsEveryCandidate) {
  auto m = small_qwen3(8);
  auto po = auto_over_four();
  HP_EXPECT_ERROR(ShardingPlanner().plan(*m, 4, po), "run `hp-bench calibrate");
  po.calibration = synthetic(1.0 / 125e6);
  auto p = ShardingPlanner().plan(*m, 4, po);
  ASSERT_TRUE(p.cp_config.has_value());
  CPWorkload w;
  w.seq = 4096;
  w.heads = 8;
  w.kv_heads = 8;
  w.head_dim = 16;
  w.hidden = 128;
  w.ranks_on_node = 4;
  auto ranked = rank_cp_configs(*po.calibration, 4, w);
  EXPECT_EQ(p.cp_config->algorithm, ranked.front().config.algorithm);
  EXPECT_EQ(p.cp_config->schedule, ranked.front().config.schedule);
  size_t predicted = 0;
  for (const auto& l : p.log)
    predicted += l.find("predicted ") != std::string::npos;
  EXPECT_EQ(predicted, ranked.size());
  EXPECT_EQ(p.log.back(), "cp auto: chose " + ranked.front().name);
}

// One K/V head over 4 ranks: without the repeat policy only all_gather and the rings are legal;
// with it the Ulysses family joins (ulysses U = 4, hybrid and usp U = 2), each candidate with
// the policy set where it repeats, all_gather and the rings without it.
TEST(CostModel, TheRepeatPolicyAddsTheUlyssesFamilyWhereKVHeadsAreTooFew) {
  auto w = workload(8, 1);
  std::vector<std::string> plain;
  for (const auto& c : legal_cp_configs(4, w))
    plain.push_back(cp::to_string(c.algorithm));
  EXPECT_EQ(plain,
            (std::vector<std::string>{"all_gather", "all_gather", "ring", "ring", "ring", "ring"}));
  w.kv_head_policy = cp::KVHeadPolicy::kRepeat;
  std::vector<std::string> with_repeat;
  for (const auto& c : legal_cp_configs(4, w)) {
    const std::string name = cp::to_string(c.algorithm);
    with_repeat.push_back(name);
    const bool moves_whole = name == "all_gather" || name == "ring";
    EXPECT_EQ(c.kv_head_policy, moves_whole ? cp::KVHeadPolicy::kError : cp::KVHeadPolicy::kRepeat)
        << name;
  }
  // Two K/V heads: hybrid and usp (U = 2) divide them and repeat nothing; ulysses (U = 4)
  // repeats.
  auto two = workload(8, 2);
  two.kv_head_policy = cp::KVHeadPolicy::kRepeat;
  for (const auto& c : legal_cp_configs(4, two)) {
    EXPECT_EQ(c.kv_head_policy, c.algorithm == cp::CPAlgorithm::kUlysses ? cp::KVHeadPolicy::kRepeat
                                                                         : cp::KVHeadPolicy::kError)
        << cp::to_string(c.algorithm);
  }
  EXPECT_EQ(with_repeat,
            (std::vector<std::string>{"all_gather", "all_gather", "ulysses", "ulysses", "ring",
                                      "ring", "ring", "ring", "hybrid", "hybrid", "usp", "usp"}));
}

// On the repeat path each Ulysses rank receives the one K/V head it reads: the collectives
// move what they would for U K/V heads (cp/volume.h), while the projections stay those of the
// model's own heads. So ulysses with one K/V head repeated over 4 ranks is predicted the link
// time of 4 K/V heads and less compute than with 4; hybrid and usp (U = 2) that of 2.
TEST(CostModel, RepeatedKVHeadsMoveAsIfThereWereUlyssesDegreeHeads) {
  const auto slow = synthetic(1.0 / 125e6);
  auto repeat = config("ulysses");
  repeat.kv_head_policy = cp::KVHeadPolicy::kRepeat;
  const auto one = predict_cp_step(slow, repeat, 4, workload(8, 1));
  const auto four = predict_cp_step(slow, config("ulysses"), 4, workload(8, 4));
  EXPECT_DOUBLE_EQ(one.comm_s, four.comm_s);
  EXPECT_LT(one.compute_s, four.compute_s);
  auto hybrid = config("hybrid", false, 2);
  hybrid.kv_head_policy = cp::KVHeadPolicy::kRepeat;
  EXPECT_DOUBLE_EQ(predict_cp_step(slow, hybrid, 4, workload(8, 1)).comm_s,
                   predict_cp_step(slow, config("hybrid", false, 2), 4, workload(8, 2)).comm_s);
  auto usp = config("usp", false, 2);
  usp.kv_head_policy = cp::KVHeadPolicy::kRepeat;
  EXPECT_DOUBLE_EQ(predict_cp_step(slow, usp, 4, workload(8, 1)).comm_s,
                   predict_cp_step(slow, config("usp", false, 2), 4, workload(8, 2)).comm_s);
}

// Async on the repeat path: the K/V travel whole before group 0, so only the queries' pieces
// hide behind an earlier group (ulysses), and usp runs one head group there. With the same
// bytes (one K/V head repeated over 4 ranks against 4 K/V heads in 2 explicit groups) and no
// projections, the repeat path exposes more.
TEST(CostModel, AsyncRepeatedKVHeadsHideOnlyTheQueriesPiecesBehindEarlierGroups) {
  const auto link = synthetic(1.0 / 30e6);  // the pieces between 1/8 and all of attention
  auto w1 = workload(8, 1), w4 = workload(8, 4);
  w1.projections = w4.projections = false;
  auto repeat = config("ulysses");
  repeat.schedule = cp::CPSchedule::kAsync;
  repeat.kv_head_policy = cp::KVHeadPolicy::kRepeat;
  repeat.ulysses_head_groups = 2;
  auto plain = config("ulysses");
  plain.schedule = cp::CPSchedule::kAsync;
  plain.ulysses_head_groups = 2;
  const auto r = predict_cp_step(link, repeat, 4, w1), q = predict_cp_step(link, plain, 4, w4);
  EXPECT_DOUBLE_EQ(r.comm_s, q.comm_s);
  EXPECT_GT(r.exposed_comm_s, q.exposed_comm_s);
  auto usp = config("usp", false, 2);
  usp.schedule = cp::CPSchedule::kAsync;
  usp.kv_head_policy = cp::KVHeadPolicy::kRepeat;
  auto usp_one = usp;
  usp_one.ulysses_head_groups = 1;
  EXPECT_DOUBLE_EQ(predict_cp_step(link, usp, 4, w1).exposed_comm_s,
                   predict_cp_step(link, usp_one, 4, w1).exposed_comm_s);
}

// The planner passes the model config's policy to the candidates: a model with one K/V head
// over 4 ranks and --kv-head-policy repeat ranks the Ulysses family too, and what it chose
// carries the policy only where it repeats.
TEST(CostModel, PlannerAutoTakesTheRepeatPolicy) {
  auto m = small_qwen3(1);
  auto po = auto_over_four();
  po.calibration = synthetic(1.0 / 125e6);
  cp::ContextParallelConfig user;
  user.kv_head_policy = cp::KVHeadPolicy::kRepeat;
  po.cp_config = user;
  auto p = ShardingPlanner().plan(*m, 4, po);
  ASSERT_TRUE(p.cp_config.has_value());
  size_t ulysses_family = 0;
  for (const auto& l : p.log) {
    ulysses_family +=
        l.find("predicted ") != std::string::npos &&
        (l.find("ulysses/") != std::string::npos || l.find("hybrid(") != std::string::npos ||
         l.find("usp(") != std::string::npos);
  }
  EXPECT_EQ(ulysses_family, 6u);
  const std::string chosen = cp::to_string(p.cp_config->algorithm);
  EXPECT_EQ(p.cp_config->kv_head_policy == cp::KVHeadPolicy::kRepeat,
            chosen != "all_gather" && chosen != "ring")
      << chosen;
}

}  // namespace
}  // namespace hp::plan
