// The planner knows no model by name: a model that is not Qwen3 (other module paths, other
// parameter names, its own handoff points and adapter) plans and applies from what it reports.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/module.h>

#include "hp/attention/host.h"
#include "hp/comm/device_mesh.h"
#include "hp/common/check.h"
#include "hp/plan/plan.h"
#include "hp/tp/parallel_linear.h"
#include "rank_harness.h"

namespace hp::plan {
namespace {

using hp::testing::run_ranks;

// One block: mixer.w_in (column-parallel), mixer.w_out (row-parallel), a replicated gain; its
// attention slot is reached through the primitive call and emits q/k/v from points named
// "emit_q", "emit_k", "emit_v".
class ToyNet : public torch::nn::Module, public Plannable {
 public:
  explicit ToyNet(const comm::GroupPtr& tp = nullptr) {
    w_in = register_module(
        "w_in", std::make_shared<tp::ColumnParallelLinearImpl>(16, 48, tp, tp::LinearInit{1, 0.1}));
    w_out = register_module(
        "w_out", std::make_shared<tp::RowParallelLinearImpl>(48, 16, tp, tp::LinearInit{2, 0.1}));
    gain = register_parameter("gain", at::ones({16}));
    for (auto* h : {&emit_q, &emit_k, &emit_v})
      host.add_handoff(h);
  }
  std::vector<ModuleInfo> plan_modules() override {
    AttentionSlotInfo slot;
    slot.heads = 6;
    slot.kv_heads = 3;
    slot.head_dim = 8;
    slot.hidden = 16;
    slot.host = &host;
    slot.adapter = "flex_hf";
    slot.handoffs = {{"q", "emit_q"}, {"k", "emit_k"}, {"v", "emit_v"}};
    return {{"blocks.0", {}, std::nullopt, std::nullopt, std::nullopt, std::nullopt},
            {"blocks.0.mixer", tp::tp_shard_dims(*this), slot, std::nullopt, std::nullopt,
             std::nullopt}};
  }
  void check_tp(int64_t tp_size) const override {
    HP_CHECK(6 % tp_size == 0 && 3 % tp_size == 0, "ToyNet: heads 6/3 over tp_size=", tp_size);
  }
  void set_validation(BoundaryChecker*, const std::map<std::string, ModuleShardingSpec>*) override {
  }
  std::vector<hsdp::UnitSpec> fully_shard_units() override { return {}; }
  void set_fully_shard(hsdp::FullyShard*) override {}

  std::shared_ptr<tp::ColumnParallelLinearImpl> w_in;
  std::shared_ptr<tp::RowParallelLinearImpl> w_out;
  at::Tensor gain;
  attention::AttentionHost host;
  attention::HandoffPoint emit_q{"emit_q"}, emit_k{"emit_k"}, emit_v{"emit_v"};
};

TEST(Planner, PlansAModelItHasNeverSeenFromWhatItReports) {
  ToyNet net;
  PlanOptions o;
  o.tp_size = 3;
  o.cp_size = 2;
  auto plan = ShardingPlanner().plan(net, 6, o);
  ASSERT_EQ(plan.modules.size(), 2u);
  const auto& mixer = plan.modules.at("blocks.0.mixer");
  EXPECT_TRUE(mixer.is_attention);
  EXPECT_EQ(mixer.param_placements,
            (std::map<std::string, std::string>{
                {"w_in.weight", "Shard(0)"}, {"w_out.weight", "Shard(1)"}, {"gain", "Replicate"}}));
  EXPECT_EQ(mixer.cp.inner_wrapper, "flex_hf");
  EXPECT_EQ(mixer.cp.cp_handoff_targets.at("k"), "emit_k");
  EXPECT_FALSE(plan.modules.at("blocks.0").is_attention);
  EXPECT_EQ(plan.tp_shard_dim("blocks.0.mixer.w_in.weight"), 0);
  EXPECT_EQ(plan.tp_shard_dim("blocks.0.mixer.w_out.weight"), 1);
  EXPECT_EQ(plan.tp_shard_dim("blocks.0.mixer.gain"), std::nullopt);
  EXPECT_EQ(plan.tp_shard_dim("blocks.0.mixer.nothing"), std::nullopt);
  // Without TP everything is replicated.
  o.tp_size = 1;
  o.cp_size = 6;
  auto flat = ShardingPlanner().plan(net, 6, o);
  EXPECT_EQ(flat.modules.at("blocks.0.mixer").param_placements.at("w_in.weight"), "Replicate");
  EXPECT_EQ(flat.tp_shard_dim("blocks.0.mixer.w_in.weight"), std::nullopt);
  // The model's own checks and the head checks run on what it reports.
  o.tp_size = 2;
  o.cp_size = 3;
  HP_EXPECT_ERROR(ShardingPlanner().plan(net, 6, o), "ToyNet: heads 6/3 over tp_size=2");
  o.tp_size = 1;
  o.cp_size = 6;
  o.cp_config = cp::ContextParallelConfig{};
  o.cp_config->algorithm = cp::CPAlgorithm::kUlysses;
  HP_EXPECT_ERROR(ShardingPlanner().plan(net, 6, o),
                  "algorithm=ulysses: key/value heads = 3 are not divisible by the Ulysses "
                  "degree 6");
}

TEST(Planner, ApplyRefusesAMeshOtherThanThePlans) {
  run_ranks(2, [](comm::World& w) {
    ToyNet net;
    PlanOptions o;
    o.cp_size = 2;
    auto plan = ShardingPlanner().plan(net, 2, o);
    comm::DeviceMesh mesh(w, {{"dp_replicate", 1}, {"dp_shard", 2}, {"cp", 1}, {"tp", 1}});
    w.context().counters.reset();
    HP_EXPECT_ERROR(ShardingApplier().apply(net, plan, mesh),
                    "apply: the plan was made for dp_shard=1, but the mesh has dp_shard=2; build "
                    "the mesh from the plan");
    EXPECT_EQ(w.context().counters.total_bytes(), 0) << "refused before any collective";
  });
}

TEST(Planner, AppliesCPAndAsyncHandoffsToTheReportedSlot) {
  run_ranks(2, [](comm::World& w) {
    ToyNet net;
    PlanOptions o;
    o.cp_size = 2;
    o.cp_config = cp::ContextParallelConfig{};
    o.cp_config->schedule = cp::CPSchedule::kAsync;
    auto plan = ShardingPlanner().plan(net, 2, o);
    comm::DeviceMesh mesh(w, plan.mesh_dims, plan.mesh_options());
    auto lines = ShardingApplier().apply(net, plan, mesh);
    ASSERT_EQ(lines.size(), 2u);
    EXPECT_EQ(lines[1],
              "fully_shard: none (the model reports no units): its gradients are not reduced "
              "over cp=2 x tp=1");
    EXPECT_NE(lines[0].find("module=blocks.0.mixer adapter=flex_hf strategy=all_gather "
                            "schedule=async"),
              std::string::npos)
        << lines[0];
    EXPECT_TRUE(net.emit_k.hooked());
    EXPECT_TRUE(net.emit_v.hooked());
    EXPECT_EQ(plan.modules.at("blocks.0.mixer").cp.resolved_schedule, "async");
  });
}

}  // namespace
}  // namespace hp::plan
