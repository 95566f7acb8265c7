// The MLA layer (model/mla.h) under CP: every strategy x schedule (x head-tail balance for the
// gathers), P in {2, 3, 4}: output, dx and every parameter gradient (summed over CP) equal the
// single-process layer; the layer's core equals the explicit-score reference; the planner and
// applier install the strategy into a Qwen3 stack of MLA layers.
#include <algorithm>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "hp/attention/masks.h"
#include "hp/comm/collectives.h"
#include "hp/comm/device_mesh.h"
#include "hp/common/check.h"
#include "hp/cp/mla.h"
#include "hp/cp/sequence.h"
#include "hp/model/mla.h"
#include "hp/model/qwen3.h"
#include "rank_harness.h"
#include "reference_mla.h"

namespace hp::model {
namespace {

using hp::testing::expect_close;
using hp::testing::run_ranks;

constexpr int64_t kB = 2, kS = 24;

MLAConfig config() {
  MLAConfig c;
  c.hidden = 20;
  c.heads = 12;
  c.q_rank = 10;
  c.kv_rank = 9;
  c.d_nope = 6;
  c.d_rope = 4;
  c.d_v = 5;
  return c;
}

at::Tensor positions() {
  return at::arange(kS, at::kLong).unsqueeze(0).expand({kB, kS});
}

TEST(MLALayer, CoreEqualsTheExplicitScoreReference) {
  MLAAttention m(config());
  m->to(at::kDouble);
  auto x = at::randn({kB, kS, 20}, at::kDouble);
  at::Tensor latent, k_rope;
  m->latent_and_rope(x, positions(), latent, k_rope);
  auto q = m->queries(x, positions());
  auto want = hp::testing::reference_mla(q, latent, k_rope, m->w_ukv, 5);
  auto got = m->host().attend([&] { return q; }, latent, k_rope, m->w_ukv, m->shape());
  expect_close(got, want, "MLA layer core", 1e-10, 1e-10);
}

// Packed documents: the layer on a packed row (positions restarting per document) equals the
// layer on each document alone, concatenated; the sparse (DSA) layer refuses documents.
TEST(MLALayer, PackedDocumentsEqualEachDocumentAlone) {
  MLAAttention m(config());
  m->to(at::kDouble);
  auto x = at::randn({1, kS, 20}, at::kDouble);
  const std::vector<int64_t> cu{0, 7, 8, 19, kS};
  auto ids = attention::document_ids_from_cu_seqlens(cu, kS);
  auto pos = attention::document_positions(ids);
  auto got = m->forward(x, pos, ids);
  std::vector<at::Tensor> docs;
  for (size_t i = 0; i + 1 < cu.size(); ++i) {
    const int64_t n = cu[i + 1] - cu[i];
    docs.push_back(m->forward(x.narrow(1, cu[i], n), at::arange(n, at::kLong).unsqueeze(0)));
  }
  expect_close(got, at::cat(docs, 1), "packed MLA layer", 1e-10, 1e-10);
  EXPECT_FALSE(at::allclose(got, m->forward(x, positions().narrow(0, 0, 1))));
  auto c = config();
  c.sparse = true;
  MLAAttention dsa(c);
  HP_EXPECT_ERROR(dsa->forward(x.to(at::kFloat), pos, ids),
                  "packed documents are not supported by the DSA indexer yet");
}

// The DSA layer's indexer learns only from its loss, and its loss moves only the indexer: the
// index loss alone leaves every other parameter and the input without a gradient (the indexer
// reads x and the query's low rank detached), and the output alone leaves the indexer's three
// weights without one.
TEST(DSALayer, TheIndexerLearnsOnlyFromItsLossAndItsLossMovesOnlyTheIndexer) {
  auto c = config();
  c.sparse = true;
  c.topk = 5;
  MLAAttention m(c);
  m->to(at::kDouble);
  const std::vector<std::string> indexer{"w_iq", "w_ik", "w_iw"};
  auto is_indexer = [&](const std::string& name) {
    return std::find(indexer.begin(), indexer.end(), name) != indexer.end();
  };
  for (bool loss_only : {true, false}) {
    m->zero_grad();
    auto x = at::randn({kB, kS, 20}, at::kDouble).requires_grad_(true);
    auto y = m->forward(x, positions());
    ASSERT_TRUE(m->index_loss().defined());
    (loss_only ? m->index_loss() : y.sum()).backward();
    const std::string what = loss_only ? "the index loss alone" : "the output alone";
    int moved = 0;
    for (const auto& par : m->named_parameters()) {
      const auto& g = par.value().grad();
      const bool nonzero = g.defined() && g.abs().max().item<double>() > 0;
      moved += nonzero;
      EXPECT_EQ(nonzero, loss_only == is_indexer(par.key())) << what << ": " << par.key();
    }
    EXPECT_EQ(moved, loss_only ? 3 : static_cast<int>(m->named_parameters().size()) - 3) << what;
    const bool dx = x.grad().defined() && x.grad().abs().max().item<double>() > 0;
    EXPECT_EQ(dx, !loss_only) << what << ": x";
  }
}

void run_layer(int p, const cp::MLACPOptions& o) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(5);
  auto x = at::randn({kB, kS, 20}, gen, at::kDouble);
  auto dy = at::randn({kB, kS, 20}, gen, at::kDouble);
  MLAAttention ref(config());
  ref->to(at::kDouble);
  auto xr = x.clone().requires_grad_(true);
  auto y = ref->forward(xr, positions());
  y.backward(dy);
  run_ranks(p, [&](comm::World& w) {
    comm::DeviceMesh mesh(w, {{"cp", p}});
    auto topo = cp::CPTopology::build(w, mesh.group_ptr({"cp"}), *cp::normalize(std::nullopt, p));
    MLAAttention m(config());
    m->to(at::kDouble);
    auto line = cp::apply_mla_cp(m->host(), m->shape(), "layers.0.mla_attn", o, topo);
    EXPECT_NE(line.find("strategy=" + o.strategy), std::string::npos) << line;
    const int64_t r = w.rank();
    auto shard = [&](const at::Tensor& t) {
      return cp::shard_sequence(t, 1, r, p, o.load_balance).contiguous();
    };
    auto xs = shard(x).requires_grad_(true);
    auto ys = m->forward(xs, shard(positions()));
    ys.backward(shard(dy));
    const std::string what = o.strategy + (o.load_balance ? " lb " : " ") +
                             cp::to_string(o.schedule) + " P=" + std::to_string(p) + " rank " +
                             std::to_string(r);
    expect_close(ys, shard(y.detach()), what + " y", 1e-10, 1e-10);
    expect_close(xs.grad(), shard(xr.grad()), what + " dx", 1e-10, 1e-10);
    auto refs = ref->named_parameters();
    for (const auto& par : m->named_parameters()) {
      auto g = comm::all_reduce(mesh.group("cp"), par.value().grad());
      expect_close(g, refs[par.key()].grad(), what + " d" + par.key(), 1e-10, 1e-10);
    }
  });
}

TEST(MLALayer, EveryStrategyEqualsTheSingleProcessLayer) {
  for (const std::string strategy : {"latent_all_gather", "ulysses", "all_gather"})
    for (auto schedule : {cp::CPSchedule::kSync, cp::CPSchedule::kAsync})
      for (bool lb : {false, true}) {
        if (lb && strategy == "ulysses") continue;
        for (int p : {2, 3, 4}) {
          cp::MLACPOptions o;
          o.strategy = strategy;
          o.schedule = schedule;
          o.load_balance = lb;
          run_layer(p, o);
        }
      }
}

TEST(MLALayer, AppliedTwiceWithAnotherStrategyIsRefused) {
  run_ranks(2, [](comm::World& w) {
    comm::DeviceMesh mesh(w, {{"cp", 2}});
    auto topo = cp::CPTopology::build(w, mesh.group_ptr({"cp"}), *cp::normalize(std::nullopt, 2));
    MLAAttention m(config());
    cp::MLACPOptions o;
    cp::apply_mla_cp(m->host(), m->shape(), "l", o, topo);
    cp::apply_mla_cp(m->host(), m->shape(), "l", o, topo);  // the same again: a no-op
    o.strategy = "ulysses";
    HP_EXPECT_ERROR(cp::apply_mla_cp(m->host(), m->shape(), "l", o, topo),
                    "a different CP strategy is already installed on this MLA layer");
    o.strategy = "ring";
    HP_EXPECT_ERROR(cp::apply_mla_cp(m->host(), m->shape(), "l", o, topo),
                    "MLA CP strategy='ring' is not valid");
  });
}

// A Qwen3 stack of MLA layers: the planner reports and checks the MLA slots, the applier
// installs the strategy, and the CP run's logits and gradients equal the single-process model.
TEST(MLALayer, Qwen3StackPlansAndAppliesMLA) {
  Qwen3Config c;
  c.layers = 2;
  c.hidden = 32;
  c.heads = 4;
  c.head_dim = 8;
  c.ffn = 48;
  c.mixer = "mla";
  Qwen3 ref(c);
  auto gen = at::make_generator<at::CPUGeneratorImpl>(3);
  auto ids = at::randint(0, c.vocab, {1, 16}, gen, at::kLong);
  auto pos = at::arange(16, at::kLong).unsqueeze(0);
  auto logits = ref->forward(ids, pos);
  logits.pow(2).mean().backward();
  auto refs = ref->named_parameters();
  run_ranks(2, [&](comm::World& w) {
    Qwen3 m(c);
    plan::PlanOptions po;
    po.cp_size = 2;
    po.seq_len = 16;
    po.reduce_op = hsdp::ReduceOp::kSum;  // each rank's loss is its share of the whole
    cp::ContextParallelConfig cc;
    cc.schedule = cp::CPSchedule::kAsync;
    cc.load_balance = true;
    po.cp_config = cc;
    po.mla.strategy = "latent_all_gather";
    auto plan = plan::ShardingPlanner().plan(*m, 2, po, {});
    EXPECT_NE(plan.describe().find("mla: strategy=latent_all_gather schedule=async load_balance"),
              std::string::npos)
        << plan.describe();
    comm::DeviceMesh mesh(w, plan.mesh_dims, plan.mesh_options());
    auto lines = plan::ShardingApplier().apply(*m, plan, mesh);
    ASSERT_FALSE(lines.empty());
    EXPECT_NE(lines[0].find("MLA CP: module=layers.0.mla_attn strategy=latent_all_gather"),
              std::string::npos)
        << lines[0];
    const int64_t r = w.rank();
    auto shard = [&](const at::Tensor& t) { return cp::shard_sequence(t, 1, r, 2, true); };
    auto out = m->forward(shard(ids), shard(pos));
    expect_close(out, shard(logits.detach()), "logits rank " + std::to_string(r), 1e-4, 1e-5);
    // The loss over all tokens: each rank's share of the mean.
    (out.pow(2).sum() / logits.numel()).backward();
    for (const auto& par : m->named_parameters()) {  // reduced over CP by the plan's HSDP
      auto g = plan.fully_shard->full_gradient(par.key());
      expect_close(g, refs[par.key()].grad(), "d" + par.key(), 1e-4, 1e-6);
    }
  });
  // Fail fast before any collective: ulysses needs heads divisible by cp.
  Qwen3 m(c);
  plan::PlanOptions po;
  po.cp_size = 3;
  po.seq_len = 18;
  po.mla.strategy = "ulysses";
  HP_EXPECT_ERROR(plan::ShardingPlanner().plan(*m, 3, po, {}),
                  "MLA heads must be divisible by TP x CP: heads=4, cp_size=3");
  c.head_dim = 6;
  HP_EXPECT_ERROR(validate(c), "must be a multiple of 4 with mixer=mla");
}

// A Qwen3 stack of DSA layers in float64: under CP (async, balanced) the logits, the indexer
// loss (summed over ranks) and every gradient (the indexer's from its loss) equal the
// single-process model; the planner refuses an MLA strategy for DSA layers.
TEST(DSALayer, Qwen3StackUnderCPEqualsTheSingleProcessModel) {
  Qwen3Config c;
  c.layers = 2;
  c.hidden = 32;
  c.heads = 4;
  c.head_dim = 8;
  c.ffn = 48;
  c.mixer = "dsa";
  c.topk = 5;
  Qwen3 ref(c);
  ref->to(at::kDouble);
  auto gen = at::make_generator<at::CPUGeneratorImpl>(3);
  auto ids = at::randint(0, c.vocab, {1, 16}, gen, at::kLong);
  auto pos = at::arange(16, at::kLong).unsqueeze(0);
  auto logits = ref->forward(ids, pos);
  auto ref_aux = ref->aux_loss();
  ASSERT_TRUE(ref_aux.defined());
  (logits.pow(2).mean() + ref_aux).backward();
  auto refs = ref->named_parameters();
  EXPECT_TRUE(refs["layers.0.mla_attn.w_iq"].grad().abs().sum().item<double>() > 0);
  run_ranks(2, [&](comm::World& w) {
    Qwen3 m(c);
    m->to(at::kDouble);
    plan::PlanOptions po;
    po.cp_size = 2;
    po.seq_len = 16;
    po.reduce_op = hsdp::ReduceOp::kSum;  // each rank's loss is its share of the whole
    cp::ContextParallelConfig cc;
    cc.schedule = cp::CPSchedule::kAsync;
    cc.load_balance = true;
    po.cp_config = cc;
    auto plan = plan::ShardingPlanner().plan(*m, 2, po, {});
    EXPECT_NE(plan.describe().find("dsa: strategy=all_gather schedule=async load_balance"),
              std::string::npos)
        << plan.describe();
    comm::DeviceMesh mesh(w, plan.mesh_dims, plan.mesh_options());
    auto lines = plan::ShardingApplier().apply(*m, plan, mesh);
    EXPECT_NE(lines[0].find("DSA CP: module=layers.0.mla_attn strategy=all_gather"),
              std::string::npos)
        << lines[0];
    const int64_t r = w.rank();
    auto shard = [&](const at::Tensor& t) { return cp::shard_sequence(t, 1, r, 2, true); };
    auto out = m->forward(shard(ids), shard(pos));
    expect_close(out, shard(logits.detach()), "logits rank " + std::to_string(r), 1e-10, 1e-10);
    auto aux = m->aux_loss();
    auto total = comm::all_reduce(mesh.group("cp"), aux.detach().reshape({1}));
    expect_close(total.squeeze(), ref_aux.detach(), "index loss", 1e-10, 1e-10);
    (out.pow(2).sum() / logits.numel() + aux).backward();
    for (const auto& par : m->named_parameters()) {  // reduced over CP by the plan's HSDP
      auto g = plan.fully_shard->full_gradient(par.key());
      expect_close(g, refs[par.key()].grad(), "d" + par.key(), 1e-9, 1e-10);
    }
  });
  Qwen3 m(c);
  plan::PlanOptions po;
  po.cp_size = 2;
  po.seq_len = 16;
  po.mla.strategy = "ulysses";
  HP_EXPECT_ERROR(plan::ShardingPlanner().plan(*m, 2, po, {}),
                  "is a DSA layer: its CP is the all-gather family");
}

}  // namespace
}  // namespace hp::model
