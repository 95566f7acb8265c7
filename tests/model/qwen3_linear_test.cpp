// The decoder built of linear-attention layers (Qwen3Config::mixer gdn | kda), laid out by the
// planner and applier under CP, equals its single-process twin: logits, loss and every parameter
// gradient, for both linear CP modes and both state exchanges at P = 2, 3, 4; the planner's
// fail-fast checks and the state-exchange cost model.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <map>
#include <string>

#include "hp/comm/collectives.h"
#include "hp/comm/device_mesh.h"
#include "hp/common/check.h"
#include "hp/cp/sequence.h"
#include "hp/model/qwen3.h"
#include "hp/plan/cost_model.h"
#include "hp/plan/plan.h"
#include "rank_harness.h"

namespace hp::model {
namespace {

using hp::testing::expect_close;
using hp::testing::run_ranks;

constexpr int64_t kS = 48;  // divisible by 2, 3 and 4; 16 tokens per rank at P=3

Qwen3Config linear_model(const std::string& mixer) {
  Qwen3Config c;
  c.mixer = mixer;
  c.vocab = 64;
  c.layers = 2;
  c.hidden = 32;
  c.heads = 4;
  c.kv_heads = 4;
  c.value_heads = 4;
  c.head_dim = 8;
  c.ffn = 48;
  return c;
}

struct Batch {
  at::Tensor ids, labels;
};

Batch batch() {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(11);
  auto tokens = at::randint(0, 64, {1, kS + 1}, gen, at::kLong);
  return {tokens.narrow(1, 0, kS).contiguous(), tokens.narrow(1, 1, kS).contiguous()};
}

at::Tensor loss_sum(const at::Tensor& logits, const at::Tensor& labels) {
  return at::cross_entropy_loss(logits.reshape({-1, logits.size(-1)}), labels.reshape({-1}), {},
                                at::Reduction::Sum, -100);
}

struct Reference {
  double loss = 0;
  std::map<std::string, at::Tensor> grads;
  at::Tensor logits;
};

Reference reference(const Qwen3Config& cfg) {
  Qwen3 m(cfg);
  auto b = batch();
  auto logits = m->forward(b.ids, at::arange(kS).view({1, kS}));
  auto loss = loss_sum(logits, b.labels) / kS;
  loss.backward();
  Reference r{loss.item<double>(), {}, logits.detach()};
  for (const auto& p : m->named_parameters())
    r.grads[p.key()] = p.value().grad();
  return r;
}

// Through the planner and applier, as hp-train lays the model out.
void expect_cp_like_single_process(const std::string& mixer, int64_t p, const std::string& mode,
                                   const std::string& exchange) {
  const auto cfg = linear_model(mixer);
  const auto ref = reference(cfg);
  const std::string what = mixer + " P=" + std::to_string(p) + " " + mode + "/" + exchange;
  run_ranks(static_cast<int>(p), [&](comm::World& w) {
    Qwen3 m(cfg);
    plan::PlanOptions po;
    po.cp_size = p;
    po.seq_len = kS;
    po.linear.mode = mode;
    po.linear.state_exchange = exchange;
    po.reduce_op = hsdp::ReduceOp::kSum;  // each rank's loss is its share of the whole
    auto plan = plan::ShardingPlanner().plan(*m, w.size(), po);
    EXPECT_NE(plan.describe().find("linear: mode=" + mode), std::string::npos) << plan.describe();
    comm::DeviceMesh mesh(w, plan.mesh_dims, plan.mesh_options());
    auto lines = plan::ShardingApplier().apply(*m, plan, mesh);
    ASSERT_EQ(lines.size(), 3u) << what;  // one linear CP line per layer, then HSDP's
    EXPECT_NE(lines[0].find("linear CP: module=layers.0.linear_attn mode=" + mode),
              std::string::npos)
        << lines[0];
    auto b = batch();
    const int64_t r = mesh.coordinate("cp");
    auto sharded = cp::shard_batch(b.ids, b.labels, r, p, false);
    auto logits = m->forward(sharded.input_ids, sharded.position_ids);
    auto& group = mesh.group("cp");
    expect_close(comm::all_gather(group, logits.detach(), 1), ref.logits, what + " logits", 1e-4,
                 1e-5);
    auto local = loss_sum(logits, sharded.labels);
    (local / kS).backward();
    EXPECT_NEAR(comm::all_reduce(group, local.detach()).item<double>() / kS, ref.loss, 1e-5)
        << what;
    for (const auto& param : m->named_parameters()) {  // reduced over CP by the plan's HSDP
      auto g = plan.fully_shard->full_gradient(param.key());
      ASSERT_TRUE(g.defined()) << what << " " << param.key();
      expect_close(g, ref.grads.at(param.key()), what + " " + param.key(), 1e-4, 1e-5);
    }
  });
}

TEST(Qwen3Linear, GdnStatePassingAllGatherP2to4) {
  for (int64_t p : {2, 3, 4})
    expect_cp_like_single_process("gdn", p, "state_passing", "all_gather");
}
TEST(Qwen3Linear, KdaStatePassingP2pP2to4) {
  for (int64_t p : {2, 3, 4})
    expect_cp_like_single_process("kda", p, "state_passing", "p2p");
}
TEST(Qwen3Linear, UlyssesP2and4) {
  for (int64_t p : {2, 4}) {
    expect_cp_like_single_process("gdn", p, "ulysses", "all_gather");
    expect_cp_like_single_process("kda", p, "ulysses", "all_gather");
  }
}

TEST(Qwen3Linear, ModelReportsLinearSlotsAndNoAttention) {
  Qwen3 m(linear_model("kda"));
  EXPECT_TRUE(plan::attention_modules(*m).empty());
  auto lins = plan::linear_modules(*m);
  ASSERT_EQ(lins.size(), 2u);
  EXPECT_EQ(lins[1].path, "layers.1.linear_attn");
  EXPECT_EQ(lins[1].linear->shape.value_heads, 4);
  EXPECT_EQ(lins[1].linear->shape.gate_width, 8);  // KDA: a gate per key channel
  // The footprint counts the parameters the model builds.
  int64_t built = 0;
  for (const auto& p : m->parameters())
    built += p.numel();
  int64_t counted = 0;
  for (const auto& u : footprint(linear_model("kda")).units)
    counted += u.tp_sharded + u.replicated;
  EXPECT_EQ(counted, built);
  int64_t built_gdn = 0;
  for (const auto& p : Qwen3(linear_model("gdn"))->parameters())
    built_gdn += p.numel();
  int64_t counted_gdn = 0;
  for (const auto& u : footprint(linear_model("gdn")).units)
    counted_gdn += u.tp_sharded + u.replicated;
  EXPECT_EQ(counted_gdn, built_gdn);
}

// Every check before any collective, naming the option, the value and the fix.
TEST(Qwen3Linear, PlannerRefusesWhatCannotWork) {
  Qwen3 m(linear_model("gdn"));
  auto plan_with = [&](int64_t cp, int64_t seq, const std::string& mode,
                       const std::string& exchange) {
    plan::PlanOptions po;
    po.cp_size = cp;
    po.seq_len = seq;
    po.linear.mode = mode;
    po.linear.state_exchange = exchange;
    return plan::ShardingPlanner().plan(*m, cp, po);
  };
  HP_EXPECT_ERROR(plan_with(3, 48, "ulysses", "all_gather"),
                  "linear CP mode ulysses needs its q/k heads (4) and value heads (4) divisible "
                  "by cp=3");
  HP_EXPECT_ERROR(plan_with(4, 8, "state_passing", "all_gather"),
                  "each rank's 2 tokens (seq_len 8 / cp 4) are fewer than the conv halo of 3");
  HP_EXPECT_ERROR(plan_with(2, 48, "ring", "all_gather"), "linear CP mode 'ring' is not valid");
  HP_EXPECT_ERROR(plan_with(2, 48, "state_passing", "bus"), "state_exchange 'bus' is not valid");
  HP_EXPECT_ERROR(plan_with(2, 48, "state_passing", "auto"),
                  "state_exchange auto needs a calibration");
  auto cfg = linear_model("gdn");
  HP_EXPECT_ERROR(validate(cfg, 2), "linear-attention layers have no tensor parallelism");
  cfg.mixer = "mamba";
  HP_EXPECT_ERROR(validate(cfg, 1), "Qwen3Config.mixer='mamba' is not valid");
}

plan::Calibration calibration(double latency_s) {
  plan::Calibration c;
  c.matmul_gflops = 50;
  for (const char* kind : {"all_gather", "all_to_all"}) {
    for (int64_t p : {2, 4, 8})
      c.collectives[kind][p] = {latency_s, 1e-9};  // 1 GB/s
  }
  return c;
}

TEST(StateExchangeCostModel, PicksByLatencyAndVolume) {
  plan::StateExchangeWorkload w;
  w.value_heads = 8;
  w.key_dim = w.value_dim = 128;
  // Two ranks: one message either way, and p2p sends the state without M.
  auto two = plan::rank_state_exchanges(calibration(1e-4), 2, w);
  EXPECT_EQ(two.front().name, "p2p") << plan::describe(two.front());
  // Eight ranks on a high-latency link: seven serial steps lose to one all-gather.
  auto eight = plan::rank_state_exchanges(calibration(5e-3), 8, w);
  EXPECT_EQ(eight.front().name, "all_gather") << plan::describe(eight.front());
  EXPECT_LT(eight[0].step_s, eight[1].step_s);
  // The planner resolves auto with a calibration and logs its reasons.
  Qwen3 m(linear_model("gdn"));
  plan::PlanOptions po;
  po.cp_size = 8;
  po.seq_len = 64;
  po.linear.state_exchange = "auto";
  po.calibration = calibration(5e-3);
  auto plan = plan::ShardingPlanner().plan(*m, 8, po);
  EXPECT_EQ(plan.linear.state_exchange, "all_gather");
  ASSERT_FALSE(plan.log.empty());
  EXPECT_EQ(plan.log.back(), "linear CP auto: chose state_exchange=all_gather");
}

}  // namespace
}  // namespace hp::model
