// The seams: a strategy and an adapter added from outside cp/ (one class each, registered in a
// copy of the built-in registries) plan, apply and run like the built-in ones. The strategy is
// a small ring (K/V blocks travel one rank per step while each rank attends its queries to the
// block it holds; partials merged by log-sum-exp; causal blocks above the diagonal skipped):
// the shape the ring issue's strategy takes, written against the public strategy step only.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "cp_test_util.h"
#include "hp/attention/core_attention.h"
#include "hp/comm/autograd_collectives.h"
#include "hp/comm/device_mesh.h"
#include "hp/common/check.h"
#include "hp/cp/adapter.h"
#include "hp/cp/config.h"
#include "hp/cp/strategy.h"
#include "hp/cp/volume.h"
#include "rank_harness.h"

namespace hp::cp {
namespace {

using hp::cp::testing::quiet;
using hp::cp::testing::seeded;
using hp::cp::testing::shard;
using hp::testing::expect_close;
using hp::testing::run_ranks;

// ---- the example strategy: everything a new strategy needs ----
class ToyRing final : public CPStrategy {
 public:
  std::string name() const override { return "toy_ring"; }
  std::string summary() const override { return "K/V blocks passed around the CP ring"; }
  void normalize(ContextParallelConfig& c, int64_t) const override { c.ulysses_degree = 1; }
  int64_t forward_bytes_per_rank(const ContextParallelConfig&, int64_t p, const AttentionShape& s,
                                 int64_t) const override {
    return (p - 1) * (s.seq / p) * s.kv_heads * (s.qk_dim + s.v_dim_or_qk()) * s.batch *
           s.element_size;
  }
  std::vector<comm::OpKind> required_ops() const override {
    return {comm::OpKind::kSend, comm::OpKind::kRecv};
  }
  std::vector<QKVRole> moved_roles() const override { return {}; }

  at::Tensor run_sync(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                      const AttentionCall& call, const CPRuntimeContext& ctx) const override {
    const auto& t = *ctx.topology;
    const int64_t seq = ctx.layout.seq_dim, s = q.size(seq), dk = k.size(-1);
    auto kv = at::cat({k, v}, -1);  // one buffer travels: one backward chain on every rank
    std::vector<at::Tensor> travelled;
    std::vector<attention::AttentionResult> parts;
    for (int64_t step = 0; step < t.cp_size; ++step) {
      const int64_t src = (t.cp_rank - step + t.cp_size) % t.cp_size;  // whose block is here
      if (!call.options().causal || src <= t.cp_rank) {
        CallState st;
        st.local_seq = s;
        st.causal = {(t.cp_rank - src) * s, s, s};
        parts.push_back(call(q, kv.narrow(-1, 0, dk), kv.narrow(-1, dk, kv.size(-1) - dk), st));
      }
      if (step + 1 < t.cp_size) travelled.push_back(kv = comm::ring_shift(kv, 1, t.cp));
    }
    auto out = merge_by_lse(parts, ctx.layout);
    return travelled.empty() ? out : anchored(out, travelled);
  }
};
// ---- end of the example strategy ----

// An adapter with its own name: sdpa's rewrite at the module boundary.
class ToyAdapter final : public CPAdapter {
 public:
  std::string name() const override { return "toy_qkv"; }
  attention::AttentionHost::Slot slot() const override {
    return attention::AttentionHost::Slot::kModuleBoundary;
  }
  attention::AttentionOptions rewrite(const attention::AttentionOptions& o, const CallState& s,
                                      const CPStrategy& strategy) const override {
    return detail::rewrite_positions(o, s, strategy);
  }
};

struct Registries {
  StrategyRegistry strategies = StrategyRegistry::builtin();
  AdapterRegistry adapters = AdapterRegistry::builtin();
  Registries() {
    strategies.add(std::make_shared<ToyRing>());
    adapters.add(std::make_shared<ToyAdapter>());
  }
};

TEST(CPExtension, RegistriesDeriveNamesAndErrors) {
  Registries r;
  EXPECT_EQ(r.strategies.names(), (std::vector<std::string>{"all_gather", "ulysses", "hybrid",
                                                            "ring", "usp", "toy_ring"}));
  EXPECT_EQ(parse_algorithm("toy_ring", &r.strategies), CPAlgorithm("toy_ring"));
  HP_EXPECT_ERROR(parse_algorithm("toy_ring"),
                  "cp algorithm 'toy_ring' is not valid; valid: all_gather, ulysses, hybrid, ring, "
                  "usp");
  HP_EXPECT_ERROR(parse_algorithm("rong", &r.strategies),
                  "valid: all_gather, ulysses, hybrid, ring, usp, toy_ring");
  HP_EXPECT_ERROR(r.strategies.add(std::make_shared<ToyRing>()),
                  "a CP strategy named 'toy_ring' is already registered");
  HP_EXPECT_ERROR(
      r.adapters.get("nope"),
      "unknown CP adapter 'nope'; valid: sdpa_qkv, sdpa_hf, flex_qkv, flex_hf, toy_qkv");
  ContextParallelConfig c;
  c.algorithm = "toy_ring";
  auto n = normalize(c, 4, &r.strategies);
  EXPECT_EQ(*n->ulysses_degree, 1);
  c.load_balance = true;
  HP_EXPECT_ERROR(
      normalize(c, 4, &r.strategies),
      "cp_config.load_balance=true requires algorithm=all_gather or hybrid or ring or usp (got "
      "toy_ring)");
  const AttentionShape shape{64, 4, 2, 16, 1, 4, 8};
  EXPECT_EQ(forward_bytes_per_rank(*n, 4, shape, 0, &r.strategies), 3 * 16 * 2 * (16 + 8) * 4);
  // The built-in registry is untouched.
  EXPECT_FALSE(StrategyRegistry::builtin().contains("toy_ring"));
}

void run_toy_ring(int p, bool causal, int64_t nq, int64_t nkv, int64_t dv) {
  constexpr int64_t kB = 1, kS = 24, kD = 16;
  auto q = seeded(11, {kB, nq, kS, kD}), k = seeded(12, {kB, nkv, kS, kD}),
       v = seeded(13, {kB, nkv, kS, dv}), dout = seeded(14, {kB, nq, kS, dv});
  attention::AttentionOptions o;
  o.causal = causal;
  o.block_q = o.block_kv = 4;
  auto rq = q.clone().requires_grad_(true), rk = k.clone().requires_grad_(true),
       rv = v.clone().requires_grad_(true);
  auto ref = attention::AttentionRegistry::builtin().get("math").forward(rq, rk, rv, o).out;
  ref.backward(dout);
  std::vector<std::string> lines(p);
  run_ranks(p, [&](comm::World& w) {
    Registries r;
    ContextParallelConfig c;
    c.algorithm = "toy_ring";
    auto cfg = *normalize(c, p, &r.strategies);
    comm::DeviceMesh mesh(w, {{"cp", p}});
    auto topo = CPTopology::build(w, mesh.group_ptr({"cp"}), cfg);
    attention::CoreAttentionOptions co;
    co.attention = o;
    attention::CoreAttention core(co);
    CPModuleSpec spec;
    spec.module_path = "attn";
    spec.inner_wrapper = "toy_qkv";
    auto ao = quiet();
    ao.strategies = &r.strategies;
    ao.adapters = &r.adapters;
    lines[w.rank()] = apply_context_parallel(core.host(), spec, cfg, topo, ao);
    const int64_t rank = w.rank();
    auto lq = shard(q, 2, rank, p).requires_grad_(true);
    auto lk = shard(k, 2, rank, p).requires_grad_(true);
    auto lv = shard(v, 2, rank, p).requires_grad_(true);
    auto out = core.forward(lq, lk, lv);
    out.backward(shard(dout, 2, rank, p));
    const std::string tag = "rank " + std::to_string(rank);
    expect_close(out, shard(ref, 2, rank, p), tag + " out");
    expect_close(lq.grad(), shard(rq.grad(), 2, rank, p), tag + " dq");
    expect_close(lk.grad(), shard(rk.grad(), 2, rank, p), tag + " dk");
    expect_close(lv.grad(), shard(rv.grad(), 2, rank, p), tag + " dv");
    // Only point-to-point traffic: P-1 forward sends and P-1 backward sends per rank.
    const auto& counters = w.context().counters;
    EXPECT_EQ(counters.calls(comm::OpKind::kSend), 2 * (p - 1)) << tag;
    EXPECT_EQ(counters.bytes(comm::OpKind::kAllGather), 0) << tag;
  });
  EXPECT_NE(lines[0].find("adapter=toy_qkv strategy=toy_ring schedule=sync"), std::string::npos)
      << lines[0];
}

TEST(CPExtension, ToyRingEqualsTheReference) {
  for (int p : {2, 3, 4}) {
    for (bool causal : {false, true}) {
      SCOPED_TRACE("P=" + std::to_string(p) + (causal ? " causal" : " dense"));
      run_toy_ring(p, causal, 4, 2, 16);
    }
  }
  run_toy_ring(3, true, 4, 2, 8);  // a value head dim of its own
}

}  // namespace
}  // namespace hp::cp
