// The Qwen3-style model under HSDP (planner + applier, threads as ranks) equals the
// single-process model on the union of every data-parallel rank's sequences: loss and full
// (gathered) gradients, for (R, Sd) in {(1,4), (2,2), (4,1)}, fusion on and off, with CP = 2
// inside the shard dimension, with TP = 2, and with activation recompute.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "hp/comm/collectives.h"
#include "hp/comm/device_mesh.h"
#include "hp/cp/sequence.h"
#include "hp/model/qwen3.h"
#include "hp/plan/plan.h"
#include "hp/tp/parallel_linear.h"
#include "rank_harness.h"

namespace hp::model {
namespace {

using hp::testing::expect_close;
using hp::testing::run_ranks;

constexpr int64_t kS = 32, kRowsPerRank = 1;

Qwen3Config small(bool recompute = false) {
  Qwen3Config c;
  c.vocab = 64;
  c.layers = 2;
  c.hidden = 30;  // 30 rows over 4 shards: padded, not refused
  c.heads = 4;
  c.kv_heads = 2;
  c.head_dim = 8;
  c.ffn = 44;
  c.recompute = recompute;
  return c;
}

struct Batch {
  at::Tensor ids, labels;
};

Batch batch(int64_t rows) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(5);
  auto tokens = at::randint(0, 64, {rows, kS + 1}, gen, at::kLong);
  return {tokens.narrow(1, 0, kS).contiguous(), tokens.narrow(1, 1, kS).contiguous()};
}

at::Tensor loss_sum(const at::Tensor& logits, const at::Tensor& labels) {
  return at::cross_entropy_loss(logits.reshape({-1, logits.size(-1)}), labels.reshape({-1}), {},
                                at::Reduction::Sum, -100);
}

struct Case {
  int64_t r = 1, dp_shard = 1, cp = 1, tp = 1;
  bool fusion = false, recompute = false;
  std::string algo = "all_gather", schedule = "sync";
};

void run_case(const Case& k) {
  const int64_t dp = k.r * k.dp_shard, rows = dp * kRowsPerRank;
  const double tokens = static_cast<double>(rows * kS);
  Qwen3 ref(small());
  auto all = batch(rows);
  auto ref_loss =
      loss_sum(ref->forward(all.ids, at::arange(kS).expand({rows, kS})), all.labels) / tokens;
  ref_loss.backward();
  const std::string what = "R=" + std::to_string(k.r) + " dp_shard=" + std::to_string(k.dp_shard) +
                           " cp=" + std::to_string(k.cp) + " tp=" + std::to_string(k.tp) +
                           (k.fusion ? " fused" : " unfused");
  run_ranks(static_cast<int>(dp * k.cp * k.tp), [&](comm::World& w) {
    plan::PlanOptions po;
    po.dp_replicate = k.r;
    po.dp_shard = k.dp_shard;
    po.cp_size = k.cp;
    po.tp_size = k.tp;
    po.seq_len = kS;
    po.comm_fusion = k.fusion;
    po.reduce_op = hsdp::ReduceOp::kSum;
    if (k.cp > 1) {
      cp::ContextParallelConfig c;
      c.algorithm = cp::parse_algorithm(k.algo);
      c.schedule = cp::parse_schedule(k.schedule);
      po.cp_config = c;
    }
    Qwen3 probe(small());
    auto p = plan::ShardingPlanner().plan(*probe, w.size(), po);
    comm::DeviceMesh mesh(w, p.mesh_dims, p.mesh_options());
    Qwen3 m(small(k.recompute), k.tp > 1 ? mesh.group_ptr({"tp"}) : nullptr);
    auto log = plan::ShardingApplier().apply(*m, p, mesh);
    ASSERT_TRUE(p.fully_shard);
    EXPECT_NE(log.back().find("fully_shard: HSDP (R=" + std::to_string(k.r) +
                              ", Sd=" + std::to_string(k.dp_shard * k.cp) + ")"),
              std::string::npos)
        << log.back();
    const int64_t d = mesh.coordinate("dp_replicate") * k.dp_shard + mesh.coordinate("dp_shard");
    auto ids = all.ids.narrow(0, d * kRowsPerRank, kRowsPerRank);
    auto labels = all.labels.narrow(0, d * kRowsPerRank, kRowsPerRank);
    auto sb = cp::shard_batch(ids, labels, mesh.coordinate("cp"), k.cp, false);
    auto local = loss_sum(m->forward(sb.input_ids, sb.position_ids), sb.labels);
    (local / tokens).backward();
    auto total = comm::all_reduce(w.group(), local.detach()).item<double>() / tokens / k.tp;
    EXPECT_NEAR(total, ref_loss.item<double>(), 1e-5) << what;
    auto& fs = *p.fully_shard;
    EXPECT_EQ(fs.stats().backwards, 1);
    EXPECT_EQ(fs.stats().resident_unsharded_numel, 0) << what;
    const int64_t t = mesh.coordinate("tp");
    const auto dims = tp::tp_shard_dims(*m);  // what TP splits, as the layers say
    for (const auto& rp : ref->named_parameters()) {
      auto expect = rp.value().grad();
      if (const int64_t dim = dims.at(rp.key()); dim >= 0) expect = expect.chunk(k.tp, dim)[t];
      expect_close(fs.full_gradient(rp.key()), expect, what + " " + rp.key(), 1e-4, 1e-5);
    }
  });
}

TEST(Qwen3Hsdp, DataMeshesFusedAndUnfused) {
  for (auto [r, sd] : {std::pair<int64_t, int64_t>{1, 4}, {2, 2}, {4, 1}}) {
    for (bool fusion : {false, true}) {
      Case k;
      k.r = r;
      k.dp_shard = sd;
      k.fusion = fusion;
      run_case(k);
    }
  }
}

TEST(Qwen3Hsdp, ContextParallelInsideTheShardDimension) {
  for (bool fusion : {false, true}) {
    Case k;  // shard group = dp_shard 2 x cp 2
    k.dp_shard = 2;
    k.cp = 2;
    k.fusion = fusion;
    run_case(k);
    k.dp_shard = 1;  // R = 2 replicas of a CP-2 shard group, Ulysses async
    k.r = 2;
    k.algo = "ulysses";
    k.schedule = "async";
    run_case(k);
  }
}

TEST(Qwen3Hsdp, TensorParallelAndRecompute) {
  Case k;
  k.dp_shard = 2;
  k.tp = 2;  // QK-norm partial gradients all-reduced over TP at the drain
  run_case(k);
  k.tp = 1;
  k.r = 2;
  k.recompute = true;
  k.fusion = true;
  run_case(k);
}

TEST(Qwen3Hsdp, PlannerNamesTheMeshProduct) {
  Qwen3 m(small());
  plan::PlanOptions po;
  po.dp_shard = 3;
  po.dp_replicate = 2;
  HP_EXPECT_ERROR(plan::ShardingPlanner().plan(*m, 4, po),
                  "dp_replicate=2 x dp_shard=3 x cp=1 x tp=1 = 6 but the world has 4 ranks");
}

}  // namespace
}  // namespace hp::model
