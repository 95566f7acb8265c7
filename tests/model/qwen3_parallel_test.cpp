// The Qwen3-style model under TP x CP equals its single-process twin: logits, loss and every
// parameter gradient (TP-sharded parameters against the matching slice), for each CP algorithm
// and through the planner in production and validate modes.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "hp/comm/collectives.h"
#include "hp/comm/device_mesh.h"
#include "hp/common/check.h"
#include "hp/cp/apply.h"
#include "hp/cp/sequence.h"
#include "hp/model/qwen3.h"
#include "hp/plan/plan.h"
#include "hp/tp/parallel_linear.h"
#include "qwen3_test_util.h"
#include "rank_harness.h"

namespace hp::model {
namespace {

using hp::testing::expect_close;
using hp::testing::run_ranks;

Qwen3Config small(int64_t heads = 4, int64_t kv_heads = 2) {
  return testing::small_qwen3(heads, kv_heads);
}

constexpr int64_t kS = 32;

struct Batch {
  at::Tensor ids, labels;
};

Batch batch() {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(5);
  auto tokens = at::randint(0, 64, {1, kS + 1}, gen, at::kLong);
  return {tokens.narrow(1, 0, kS).contiguous(), tokens.narrow(1, 1, kS).contiguous()};
}

at::Tensor loss_sum(const at::Tensor& logits, const at::Tensor& labels) {
  return at::cross_entropy_loss(logits.reshape({-1, logits.size(-1)}), labels.reshape({-1}), {},
                                at::Reduction::Sum, -100);
}

struct Reference {
  double loss;
  std::map<std::string, at::Tensor> grads;
  at::Tensor logits;  // [1, kS, vocab]
};

Reference reference(const Qwen3Config& cfg) {
  Qwen3 m(cfg);
  for (auto& layer : m->layers)
    layer->self_attn->host().set_primitive("math");
  auto b = batch();
  auto pos = at::arange(kS).view({1, kS});
  auto logits = m->forward(b.ids, pos);
  auto loss = loss_sum(logits, b.labels) / kS;
  loss.backward();
  Reference r{loss.item<double>(), {}, logits.detach()};
  for (const auto& p : m->named_parameters())
    r.grads[p.key()] = p.value().grad();
  return r;
}

// The dim TP splits a parameter along, as the model's own layers say (never a name table).
int shard_dim(torch::nn::Module& model, const std::string& name) {
  return static_cast<int>(tp::tp_shard_dims(model).at(name));
}

void run_tp_cp(int64_t tp, int64_t cp, const std::string& algo, std::optional<int64_t> u,
               const Qwen3Config& model_cfg = small()) {
  auto ref = reference(model_cfg);
  run_ranks(static_cast<int>(tp * cp), [&](comm::World& w) {
    comm::DeviceMesh mesh(w, {{"cp", cp}, {"tp", tp}});
    auto tp_group = mesh.group_ptr({"tp"});
    Qwen3 m(model_cfg, tp_group);
    cp::ContextParallelConfig c;
    c.algorithm = cp::parse_algorithm(algo);
    c.ulysses_degree = u;
    auto cfg = *cp::normalize(c, cp);
    auto topo = cp::CPTopology::build(w, mesh.group_ptr({"cp"}), cfg);
    testing::apply_cp_to_attention(*m, cfg, topo);
    auto b = batch();
    const int64_t r = mesh.coordinate("cp");
    auto sharded = cp::shard_batch(b.ids, b.labels, r, cp, false);
    auto logits = m->forward(sharded.input_ids, sharded.position_ids);
    // Contiguous CP shards: gathered in rank order they are the full sequence's logits.
    expect_close(comm::all_gather(mesh.group("cp"), logits.detach(), 1), ref.logits,
                 algo + " tp=" + std::to_string(tp) + " logits", 1e-4, 1e-5);
    auto local = loss_sum(logits, sharded.labels);
    (local / kS).backward();
    auto global = comm::all_reduce(mesh.group("cp"), local.detach()).item<double>() / kS;
    EXPECT_NEAR(global, ref.loss, 1e-5);
    for (auto& p : m->tp_partial_grad_parameters()) {
      p.mutable_grad() = comm::all_reduce(*tp_group, p.grad());
    }
    const int64_t t = mesh.coordinate("tp");
    for (const auto& p : m->named_parameters()) {
      auto g = comm::all_reduce(mesh.group("cp"), p.value().grad());  // replicated over CP
      auto expect = ref.grads.at(p.key());
      const int dim = shard_dim(*m, p.key());
      if (dim >= 0) expect = expect.chunk(tp, dim)[t];
      expect_close(g, expect, algo + " tp=" + std::to_string(tp) + " " + p.key(), 1e-4, 1e-5);
    }
  });
}

// A model laid out by the planner against the single-process reference: gathered CP logits,
// global loss (`local_sum`: this rank's token sum) and every gradient, as the plan's HSDP left
// it (reduced over CP, and over TP for the TP-partial ones, with no reduction by the caller;
// TP-sharded against their slice).
void expect_like_reference(comm::DeviceMesh& mesh, Qwen3Impl& m, hsdp::FullyShard& fs,
                           const at::Tensor& logits, const at::Tensor& local_sum,
                           const Reference& ref, const std::string& what) {
  auto& cp = mesh.group("cp");
  expect_close(comm::all_gather(cp, logits.detach(), 1), ref.logits, what + " logits", 1e-4, 1e-5);
  EXPECT_NEAR(comm::all_reduce(cp, local_sum.detach()).item<double>() / kS, ref.loss, 1e-5) << what;
  const int64_t t = mesh.coordinate("tp"), tp_size = mesh.size("tp");
  auto named = m.named_parameters();
  EXPECT_EQ(named.size(), ref.grads.size()) << what;
  for (const auto& p : named) {
    auto g = fs.full_gradient(p.key()) / kS;  // collective over the shard group
    auto expect = ref.grads.at(p.key());
    const int dim = shard_dim(m, p.key());
    if (dim >= 0) expect = expect.chunk(tp_size, dim)[t];
    expect_close(g, expect, what + " " + p.key(), 1e-4, 1e-5);
  }
}

// The single-process twin every layout is compared with: finite logits of the right shape, the
// same with the blockwise kernel (what the parallel models run) as with the math reference
// (what reference() runs), and causal: a token changes no logit before its position.
// Partial RoPE (Qwen3.5's partial_rotary_factor): the channels past rotary_dim pass unchanged,
// the first rotary_dim are RoPE of that slice with its own frequencies, checked against the
// rotation written out per channel pair in float64; a query-key product of the rotated part
// depends only on the position difference.
TEST(Qwen3Rope, PartialRotaryRotatesOnlyTheLeadingChannels) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(11);
  const int64_t d = 16, r = 4, s = 6;
  const double theta = 1e6;
  auto x = at::randn({1, 2, s, d}, gen, at::kDouble);
  auto pos = at::arange(100, 100 + s, at::kLong).unsqueeze(0);
  auto y = apply_rope(x, pos, theta, r);
  EXPECT_TRUE(at::equal(y.narrow(-1, r, d - r), x.narrow(-1, r, d - r)));
  for (int64_t t = 0; t < s; ++t) {
    for (int64_t i = 0; i < r / 2; ++i) {
      const double a = (100 + t) * std::pow(theta, -2.0 * i / r);
      for (int64_t h = 0; h < 2; ++h) {
        const double x1 = x[0][h][t][i].item<double>(), x2 = x[0][h][t][i + r / 2].item<double>();
        EXPECT_NEAR(y[0][h][t][i].item<double>(), x1 * std::cos(a) - x2 * std::sin(a), 1e-12);
        EXPECT_NEAR(y[0][h][t][i + r / 2].item<double>(), x2 * std::cos(a) + x1 * std::sin(a),
                    1e-12);
      }
    }
  }
  // Shifting every position by the same amount leaves q . k unchanged.
  auto q = x.narrow(2, 0, 1), k = x.narrow(2, 1, 1);
  auto dot = [&](int64_t pq, int64_t pk) {
    auto rq = apply_rope(q, at::full({1, 1}, pq, at::kLong), theta, r);
    auto rk = apply_rope(k, at::full({1, 1}, pk, at::kLong), theta, r);
    return (rq * rk).sum().item<double>();
  };
  EXPECT_NEAR(dot(9, 3), dot(5009, 5003), 1e-9);
  EXPECT_GT(std::abs(dot(9, 3) - dot(9, 4)), 1e-6);  // but the difference itself matters
  // rotary_dim 0 and rotary_dim == D are the full rotation.
  EXPECT_TRUE(at::allclose(apply_rope(x, pos, theta, 0), apply_rope(x, pos, theta, d)));

  Qwen3Config c = small();
  c.head_dim = 16;
  EXPECT_EQ(rotary_dim(c), 16);
  c.partial_rotary_factor = 0.25;
  EXPECT_EQ(rotary_dim(c), 4);
  EXPECT_NO_THROW(validate(c));
  c.partial_rotary_factor = 0.3;  // 4.8 channels
  try {
    validate(c);
    ADD_FAILURE() << "partial_rotary_factor 0.3 with head_dim 16 was accepted";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("Qwen3Config.partial_rotary_factor=0.3 with head_dim=16"),
              std::string::npos)
        << e.what();
  }
}

TEST(Qwen3Parallel, SingleProcessModelIsCausalAndKernelIndependent) {
  Qwen3 blockwise(small());
  Qwen3 math(small());
  for (auto& layer : math->layers)
    layer->self_attn->host().set_primitive("math");
  ASSERT_EQ(blockwise->layers[0]->self_attn->host().primitive_name(), "blockwise");
  auto b = batch();
  auto pos = at::arange(kS).view({1, kS});
  auto lb = blockwise->forward(b.ids, pos);
  auto lm = math->forward(b.ids, pos);
  EXPECT_EQ(lb.sizes(), (std::vector<int64_t>{1, kS, 64}));
  EXPECT_TRUE(at::isfinite(lb).all().item<bool>());
  expect_close(lb, lm, "blockwise vs math logits", 1e-4, 1e-5);
  loss_sum(lb, b.labels).backward();
  loss_sum(lm, b.labels).backward();
  auto mp = math->named_parameters();
  for (const auto& p : blockwise->named_parameters())
    expect_close(p.value().grad(), mp[p.key()].grad(), "blockwise vs math " + p.key(), 1e-4, 1e-5);

  const int64_t t = kS / 2;
  auto ids = b.ids.clone();
  ids[0][t] = (ids[0][t].item<int64_t>() + 1) % 64;
  at::NoGradGuard no_grad;
  auto changed = blockwise->forward(ids, pos);
  expect_close(changed.narrow(1, 0, t), lb.detach().narrow(1, 0, t), "logits before the change", 0,
               1e-6);
  EXPECT_GT(
      (changed.narrow(1, t, kS - t) - lb.detach().narrow(1, t, kS - t)).abs().max().item<double>(),
      1e-3)
      << "changing token " << t << " must change the logits from position " << t << " on";
}

TEST(Qwen3Parallel, CP2AllGather) {
  run_tp_cp(1, 2, "all_gather", std::nullopt);
}
TEST(Qwen3Parallel, TP2CP2AllGather) {
  run_tp_cp(2, 2, "all_gather", std::nullopt);
}
TEST(Qwen3Parallel, TP2CP2Ulysses) {
  run_tp_cp(2, 2, "ulysses", std::nullopt, small(8, 4));
}
TEST(Qwen3Parallel, TP2CP2Hybrid) {
  run_tp_cp(2, 4, "hybrid", 2, small(8, 4));
}

TEST(Qwen3Parallel, UlyssesHeadChecksUseLocalHeadsAfterTP) {
  // kv_heads = 2 over TP = 2 leaves one local KV head: Ulysses over 2 ranks must refuse.
  try {
    run_tp_cp(2, 2, "ulysses", std::nullopt, small(4, 2));
    ADD_FAILURE() << "expected an error";
  } catch (const hp::Error& e) {
    EXPECT_NE(std::string(e.what()).find("key/value heads = 1 are not divisible by the Ulysses "
                                         "degree 2"),
              std::string::npos)
        << e.what();
  }
}
TEST(Qwen3Parallel, TP1CP4Hybrid) {
  run_tp_cp(1, 4, "hybrid", 2);
}

// Production and validate modes run the same kernels: identical losses and gradients, both equal
// to the single-process model's; validate checks every boundary and names module, expected and
// actual layout on a mismatch.
TEST(Qwen3Parallel, ValidateModeEqualsProductionAndCatchesPlacementMismatches) {
  const auto ref = reference(small(8, 4));
  run_ranks(4, [&](comm::World& w) {
    comm::MeshOptions mo;
    mo.flattened.push_back({"dp_shard", "cp"});  // HSDP's shard group (plan.mesh_options())
    comm::DeviceMesh mesh(w, {{"dp_replicate", 1}, {"dp_shard", 1}, {"cp", 2}, {"tp", 2}}, mo);
    auto run_mode = [&](plan::Mode mode, bool break_plan) {
      Qwen3 m(small(8, 4), mesh.group_ptr({"tp"}));
      plan::PlanOptions po;
      po.tp_size = 2;
      po.cp_size = 2;
      po.seq_len = kS;
      po.reduce_op = hsdp::ReduceOp::kSum;  // the loss below is this rank's token sum
      auto p = plan::ShardingPlanner().plan(*m, w.size(), po);
      if (break_plan) {
        p.modules.at("layers.1.mlp").in_layout = plan::Layout{
            {{"cp", plan::Placement::replicate()}, {"tp", plan::Placement::replicate()}}};
      }
      const auto lines = plan::ShardingApplier().apply(*m, p, mesh, mode);
      // No data parallelism, yet HSDP runs: it is what reduces the gradients over CP and TP.
      EXPECT_NE(lines.back().find("fully_shard: HSDP (R=1"), std::string::npos) << lines.back();
      auto b = batch();
      auto sb = cp::shard_batch(b.ids, b.labels, mesh.coordinate("cp"), 2, false);
      // Validate mode installs the boundary checker; production runs without one.
      EXPECT_EQ(p.checker != nullptr, mode == plan::Mode::kValidate);
      if (p.checker) p.checker->set(sb.input_ids, p.activation_layout());
      auto logits = m->forward(sb.input_ids, sb.position_ids);
      auto loss = loss_sum(logits, sb.labels);
      loss.backward();
      std::vector<at::Tensor> grads{loss.detach()};
      for (auto& par : p.fully_shard->sharded_parameters())
        grads.push_back(par.second.grad());
      if (p.checker) {
        EXPECT_EQ(p.checker->checks(), 1 + 3 * 2);  // embedding + 3 per layer
      }
      if (!break_plan) {
        expect_like_reference(mesh, *m, *p.fully_shard, logits, loss, ref,
                              mode == plan::Mode::kValidate ? "validate" : "production");
      }
      return grads;
    };
    auto prod = run_mode(plan::Mode::kProduction, false);
    auto val = run_mode(plan::Mode::kValidate, false);
    ASSERT_EQ(prod.size(), val.size());
    for (size_t i = 0; i < prod.size(); ++i)
      EXPECT_TRUE(at::equal(prod[i], val[i])) << i;
    HP_EXPECT_ERROR(run_mode(plan::Mode::kValidate, true),
                    "validate: placement mismatch at module 'layers.1.mlp': expected (cp: "
                    "Replicate, tp: Replicate), actual (cp: Shard(1), tp: Replicate)");
  });
}

TEST(Qwen3Parallel, BadConfigsFailClearly) {
  auto c = small();
  HP_EXPECT_ERROR(validate(c, 4), "heads=4 and kv_heads=2 must both be divisible by tp_size=4");
  c.heads = 5;
  HP_EXPECT_ERROR(validate(c, 1), "heads=5 is not a multiple of kv_heads=2");
}

}  // namespace
}  // namespace hp::model
