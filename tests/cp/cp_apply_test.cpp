// Apply-time behaviour: resolution, the log line, resolved fields, runtime installation rules,
// legacy wrappers, misfire detection, backend support, and call-time input checks.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "cp_test_util.h"
#include "hp/attention/core_attention.h"
#include "hp/comm/device_mesh.h"
#include "hp/common/check.h"
#include "hp/cp/config.h"
#include "rank_harness.h"

namespace hp::cp {
namespace {

using hp::cp::testing::ProjAttention;
using hp::cp::testing::quiet;
using hp::testing::run_ranks;

ContextParallelConfig hybrid(int64_t u, int64_t p) {
  ContextParallelConfig c;
  c.algorithm = CPAlgorithm::kHybrid;
  c.ulysses_degree = u;
  return *normalize(c, p);
}

// A fake world: apply-time logic without any communication.
struct FakeCP {
  explicit FakeCP(const ContextParallelConfig& c, int64_t p = 4)
      : world(comm::World::fake(0, static_cast<int>(p), opts())),
        mesh(world, {{"cp", p}}),
        topo(CPTopology::build(world, mesh.group_ptr({"cp"}), c)),
        config(c) {}
  static comm::WorldOptions opts() {
    comm::WorldOptions o;
    o.recorder = std::make_shared<comm::CollectiveRecorder>();
    return o;
  }
  comm::World world;
  comm::DeviceMesh mesh;
  std::shared_ptr<const CPTopology> topo;
  ContextParallelConfig config;
};

TEST(CPApply, LogLineAndResolvedFields) {
  FakeCP f(hybrid(2, 4));
  ProjAttention m(16, 4, 4, 4, {});
  CPModuleSpec spec;
  spec.module_path = "layers.0.self_attn";
  spec.inner_wrapper = "sdpa_hf";
  std::string logged;
  CPApplyOptions o;
  o.log = [&](const std::string& l) { logged = l; };
  auto line = apply_context_parallel(m.host(), spec, f.config, f.topo, o);
  EXPECT_EQ(line,
            "CP inner-wrap: module=layers.0.self_attn adapter=sdpa_hf strategy=hybrid "
            "schedule=sync cp_size=4 ulysses_degree=2 colossal_degree=2 handoff={} fallback=none");
  EXPECT_EQ(logged, line);
  EXPECT_EQ(spec.resolved_inner_wrapper, "sdpa_hf");
  EXPECT_EQ(spec.resolved_cp_strategy, "hybrid");
  EXPECT_NE(m.host().installed(attention::AttentionHost::Slot::kPrimitiveCall), nullptr);
  EXPECT_EQ(m.host().installed(attention::AttentionHost::Slot::kModuleBoundary), nullptr);
}

TEST(CPApply, SameRuntimeTwiceIsIdempotentADifferentOneIsAnError) {
  FakeCP f(*normalize(std::nullopt, 4));
  attention::CoreAttention core;
  CPModuleSpec spec;
  spec.module_path = "attn";
  spec.inner_wrapper = "sdpa_qkv";
  apply_context_parallel(core.host(), spec, f.config, f.topo, quiet());
  EXPECT_NO_THROW(apply_context_parallel(core.host(), spec, f.config, f.topo, quiet()));
  FakeCP g(hybrid(2, 4));
  HP_EXPECT_ERROR(apply_context_parallel(core.host(), spec, g.config, g.topo, quiet()),
                  "a different CP runtime is already installed on this attention module's module "
                  "boundary (q, k, v): installed 'cp:attn:sdpa_qkv:all_gather");
}

// A config that normalize() would refuse is refused at apply too, normalised or not: Ulysses
// with load balance would leave head-tail shards under a natural-order causal mask.
TEST(CPApply, ChecksTheConfigItWasGiven) {
  ContextParallelConfig c;
  c.algorithm = "ulysses";
  c.ulysses_degree = 4;
  c.load_balance = true;
  FakeCP f(c);
  attention::CoreAttention core;
  CPModuleSpec spec;
  spec.module_path = "attn";
  spec.inner_wrapper = "sdpa_qkv";
  HP_EXPECT_ERROR(apply_context_parallel(core.host(), spec, f.config, f.topo, quiet()),
                  "cp_config.load_balance=true requires algorithm=all_gather or hybrid or ring or "
                  "usp (got ulysses)");
}

TEST(CPApply, UnknownWrapperListsTheValidNames) {
  FakeCP f(*normalize(std::nullopt, 4));
  attention::CoreAttention core;
  LegacyWrapperRegistry legacy;
  legacy.add("my_wrapper", [](attention::AttentionHost&, const comm::GroupPtr&) {});
  CPModuleSpec spec;
  spec.inner_wrapper = "sdpa";
  CPApplyOptions o = quiet();
  o.legacy = &legacy;
  HP_EXPECT_ERROR(apply_context_parallel(core.host(), spec, f.config, f.topo, o),
                  "inner_wrapper 'sdpa' is neither a CP adapter nor a registered legacy wrapper; "
                  "valid: sdpa_qkv, sdpa_hf, flex_qkv, flex_hf, my_wrapper");
}

TEST(CPApply, LegacyWrapperOnlyWithAllGatherSync) {
  LegacyWrapperRegistry legacy;
  int calls = 0;
  legacy.add("old_cp", [&](attention::AttentionHost&, const comm::GroupPtr& g) {
    ++calls;
    EXPECT_EQ(g->size(), 4);
  });
  CPModuleSpec spec;
  spec.module_path = "attn";
  spec.inner_wrapper = "old_cp";
  CPApplyOptions o = quiet();
  o.legacy = &legacy;
  attention::CoreAttention core;
  FakeCP ag(*normalize(std::nullopt, 4));
  apply_context_parallel(core.host(), spec, ag.config, ag.topo, o);
  EXPECT_EQ(calls, 1);
  EXPECT_EQ(spec.resolved_inner_wrapper, "legacy:old_cp");
  FakeCP hy(hybrid(2, 4));
  attention::CoreAttention core2;
  HP_EXPECT_ERROR(
      apply_context_parallel(core2.host(), spec, hy.config, hy.topo, o),
      "legacy wrapper 'old_cp' implements only all_gather + sync, but the plan asks for "
      "algorithm=hybrid schedule=sync; use an adapter (sdpa_qkv, sdpa_hf, flex_qkv, flex_hf) or "
      "all_gather + sync");
  EXPECT_EQ(calls, 1);
  HP_EXPECT_ERROR(legacy.add("sdpa_hf", [](attention::AttentionHost&, const comm::GroupPtr&) {}),
                  "is taken by a built-in adapter");
}

TEST(CPApply, LayoutAndScheduleChecks) {
  FakeCP f(*normalize(std::nullopt, 4));
  attention::CoreAttention core;
  CPModuleSpec spec;
  spec.module_path = "attn";
  spec.inner_wrapper = "sdpa_qkv";
  spec.cp_seq_dim = 1;
  spec.cp_head_dim = 1;
  HP_EXPECT_ERROR(apply_context_parallel(core.host(), spec, f.config, f.topo, quiet()),
                  "module 'attn': cp_seq_dim and cp_head_dim are both 1; they must name different "
                  "dims");
  spec.cp_head_dim = 2;
  auto async = f.config;
  async.schedule = CPSchedule::kAsync;
  HP_EXPECT_ERROR(
      apply_context_parallel(core.host(), spec, async, f.topo, quiet()),
      "module 'attn': schedule=async with strategy all_gather needs a handoff point for "
      "each of its moved tensors; missing: k (no cp_handoff_targets entry), v (no "
      "cp_handoff_targets entry). Handoff points on this module: none. Set "
      "cp_handoff_targets");
}

TEST(CPApply, MisfireIsAnError) {
  run_ranks(2, [](comm::World& w) {
    comm::DeviceMesh mesh(w, {{"cp", 2}});
    auto cfg = *normalize(std::nullopt, 2);
    auto topo = CPTopology::build(w, mesh.group_ptr({"cp"}), cfg);
    ProjAttention m(16, 4, 4, 4, {});
    CPModuleSpec spec;
    spec.module_path = "layers.3.attn";
    spec.inner_wrapper = "sdpa_hf";
    apply_context_parallel(m.host(), spec, cfg, topo, quiet());
    m.set_reach_primitive(false);
    HP_EXPECT_ERROR(m.forward(at::randn({1, 4, 16})),
                    "CP adapter 'sdpa_hf' on module 'layers.3.attn': the module's forward finished "
                    "without reaching the attention primitive");
    m.set_reach_primitive(true);
    EXPECT_NO_THROW(m.forward(at::randn({1, 4, 16})));
  });
}

// A transport without all_to_all (a backend that cannot run Ulysses).
class NoAllToAll : public comm::Transport {
 public:
  explicit NoAllToAll(int p) : inner_(comm::make_fake_transport(p)) {}
  std::string backend_name() const override { return "no_a2a"; }
  bool supports(comm::OpKind op) const override { return op != comm::OpKind::kAllToAll; }
  bool reduces_dtype(at::ScalarType t) const override { return inner_->reduces_dtype(t); }
  bool moves_dtype(at::ScalarType t) const override { return inner_->moves_dtype(t); }
  std::unique_ptr<comm::PendingOp> all_gather(at::Tensor o, at::Tensor i) override {
    return inner_->all_gather(o, i);
  }
  std::unique_ptr<comm::PendingOp> all_to_all(at::Tensor o, at::Tensor i) override {
    return inner_->all_to_all(o, i);
  }
  std::unique_ptr<comm::PendingOp> all_reduce(at::Tensor t, comm::ReduceOp op) override {
    return inner_->all_reduce(t, op);
  }
  std::unique_ptr<comm::PendingOp> send(at::Tensor t, int d, int g) override {
    return inner_->send(t, d, g);
  }
  std::unique_ptr<comm::PendingOp> recv(at::Tensor t, int s, int g) override {
    return inner_->recv(t, s, g);
  }
  std::unique_ptr<comm::PendingOp> barrier() override { return inner_->barrier(); }

 private:
  std::unique_ptr<comm::Transport> inner_;
};

TEST(CPApply, BackendWithoutANeededCollective) {
  auto ctx = std::make_shared<comm::CommContext>();
  auto group = std::make_shared<comm::Group>("cp", std::vector<int>{0, 1}, 0,
                                             std::make_unique<NoAllToAll>(2), ctx,
                                             std::chrono::milliseconds(1000));
  auto t = std::make_shared<CPTopology>();
  t->cp_size = 2;
  t->ulysses_degree = 2;
  t->cp = t->ulysses = group;
  t->co = std::make_shared<comm::Group>("self", std::vector<int>{0}, 0, comm::make_self_transport(),
                                        ctx, std::chrono::milliseconds(1000));
  ContextParallelConfig u;
  u.algorithm = CPAlgorithm::kUlysses;
  attention::CoreAttention core;
  CPModuleSpec spec;
  spec.inner_wrapper = "sdpa_qkv";
  HP_EXPECT_ERROR(apply_context_parallel(core.host(), spec, *normalize(u, 2), t, quiet()),
                  "CP strategy 'ulysses' needs all_to_all on group 'cp', which backend 'no_a2a' "
                  "does not provide");
  t->ulysses_degree = 1;
  t->co = group;
  EXPECT_NO_THROW(
      apply_context_parallel(core.host(), spec, *normalize(std::nullopt, 2), t, quiet()));
}

TEST(CPApply, BadInputsFailBeforeAnyCollective) {
  FakeCP f(hybrid(2, 4));
  auto check = [&](const std::string& wrapper,
                   const std::function<void(attention::CoreAttention&)>& call,
                   const std::string& text) {
    attention::CoreAttention core;
    CPModuleSpec spec;
    spec.module_path = "attn";
    spec.inner_wrapper = wrapper;
    apply_context_parallel(core.host(), spec, f.config, f.topo, quiet());
    f.world.context().recorder->clear();
    HP_EXPECT_ERROR(call(core), text);
    EXPECT_TRUE(f.world.context().recorder->records().empty()) << text;
  };
  auto q = at::randn({1, 4, 8, 16}), kv = at::randn({1, 4, 8, 16});
  check(
      "sdpa_qkv", [&](attention::CoreAttention& c) { c.forward(q, kv, kv.squeeze(0)); },
      "q, k, v ranks differ (4, 4, 3)");
  check(
      "sdpa_qkv",
      [&](attention::CoreAttention& c) {
        c.forward(q, at::randn({1, 4, 6, 16}), at::randn({1, 4, 6, 16}));
      },
      "differ in dim 2 (the sequence)");
  check(
      "sdpa_qkv",
      [&](attention::CoreAttention& c) {
        c.forward(q, kv, at::randn({1, 4, 6, 16}));
      },
      "must agree in every dim but the last");
  check(
      "sdpa_qkv",
      [&](attention::CoreAttention& c) {
        c.forward(q, at::randn({1, 4, 8, 8}), at::randn({1, 4, 8, 8}));
      },
      "must share the per-head feature size (last dim)");
  check(
      "sdpa_qkv",
      [&](attention::CoreAttention& c) {
        c.forward(at::randn({1, 6, 8, 16}), at::randn({1, 3, 8, 16}), at::randn({1, 3, 8, 16}));
      },
      "algorithm=hybrid: key/value heads = 3 are not divisible by the Ulysses degree 2");
  check(
      "sdpa_qkv", [&](attention::CoreAttention& c) { c.forward(q, kv.to(at::kDouble), kv); },
      "q, k, v dtypes are Float, Double, Float; they must share one floating dtype");
}

TEST(CPApply, MasksThatCannotFollowTheStrategy) {
  FakeCP f(hybrid(2, 4));
  attention::CoreAttentionOptions with_mask;
  with_mask.attention.mask = at::ones({8, 8}, at::kBool);
  attention::CoreAttention core(with_mask);
  CPModuleSpec spec;
  spec.inner_wrapper = "sdpa_qkv";
  apply_context_parallel(core.host(), spec, f.config, f.topo, quiet());
  auto x = at::randn({1, 4, 8, 16});
  HP_EXPECT_ERROR(core.forward(x, x, x), "a tensor mask cannot follow the Ulysses re-layout");
  attention::CoreAttentionOptions with_fn;
  with_fn.attention.mask_fn = attention::sliding_window_mask(4);
  attention::CoreAttention core2(with_fn);
  apply_context_parallel(core2.host(), spec, f.config, f.topo, quiet());
  HP_EXPECT_ERROR(core2.forward(x, x, x),
                  "CP adapter 'sdpa_qkv' got a mask function; mask "
                  "functions need a flex adapter");
}

}  // namespace
}  // namespace hp::cp
