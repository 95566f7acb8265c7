// The recorded collective schedule of each strategy (op, group, order; forward and backward),
// measured bytes against the DESIGN section 5.2 formulas, and the default config.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "cp_test_util.h"
#include "hp/attention/core_attention.h"
#include "hp/comm/device_mesh.h"
#include "hp/cp/config.h"
#include "hp/cp/volume.h"
#include "rank_harness.h"

namespace hp::cp {
namespace {

using hp::cp::testing::quiet;
using hp::cp::testing::seeded;
using hp::cp::testing::shard;
using hp::testing::run_ranks;

constexpr int64_t kB = 1, kNq = 8, kNkv = 4, kS = 32, kD = 16;

struct Observed {
  std::vector<std::string> forward, backward;
  std::map<comm::OpKind, int64_t> forward_bytes;
  int64_t total_forward = 0, total_backward = 0;
  at::Tensor out;
};

// One causal sdpa_qkv attention call on rank `w`, recording forward and backward separately.
Observed observe(comm::World& w, const ContextParallelConfig& cfg, int64_t p) {
  comm::DeviceMesh mesh(w, {{"cp", p}});
  auto topo = CPTopology::build(w, mesh.group_ptr({"cp"}), cfg);
  attention::CoreAttentionOptions co;
  co.attention.causal = true;
  attention::CoreAttention core(co);
  CPModuleSpec spec;
  spec.inner_wrapper = "sdpa_qkv";
  apply_context_parallel(core.host(), spec, cfg, topo, quiet());
  const int64_t r = topo->cp_rank;
  auto q = shard(seeded(1, {kB, kNq, kS, kD}), 2, r, p).requires_grad_(true);
  auto k = shard(seeded(2, {kB, kNkv, kS, kD}), 2, r, p).requires_grad_(true);
  auto v = shard(seeded(3, {kB, kNkv, kS, kD}), 2, r, p).requires_grad_(true);
  auto& rec = *w.context().recorder;
  auto& counters = w.context().counters;
  rec.clear();
  counters.reset();
  Observed o;
  o.out = core.forward(q, k, v);
  o.forward = rec.schedule();
  for (auto op : {comm::OpKind::kAllGather, comm::OpKind::kAllToAll}) {
    o.forward_bytes[op] = counters.bytes(op);
  }
  o.total_forward = counters.total_bytes();
  rec.clear();
  counters.reset();
  o.out.sum().backward();
  o.backward = rec.schedule();
  o.total_backward = counters.total_bytes();
  // The volume formula the benches report against.
  const AttentionShape shape{kS, kNq, kNkv, kD, kB, 4};
  EXPECT_EQ(o.total_forward, forward_bytes_per_rank(cfg, p, shape));
  EXPECT_EQ(o.total_backward, backward_bytes_per_rank(cfg, p, shape));
  return o;
}

ContextParallelConfig config(const std::string& algo, std::optional<int64_t> u, int64_t p) {
  ContextParallelConfig c;
  c.algorithm = parse_algorithm(algo);
  c.ulysses_degree = u;
  return *normalize(c, p);
}

TEST(CPSchedule, AllGather) {
  run_ranks(4, [](comm::World& w) {
    auto o = observe(w, config("all_gather", std::nullopt, 4), 4);
    EXPECT_EQ(o.forward,
              (std::vector<std::string>{"all_gather(cp)[1,4,8,16]", "all_gather(cp)[1,4,8,16]"}));
    EXPECT_EQ(o.backward, (std::vector<std::string>{"reduce_scatter(cp)[1,4,32,16]",
                                                    "reduce_scatter(cp)[1,4,32,16]"}));
    // 2 * S * h_kv * e * (P-1)/P
    EXPECT_EQ(o.forward_bytes[comm::OpKind::kAllGather], 2 * kS * kNkv * kD * 4 * 3 / 4);
    EXPECT_EQ(o.forward_bytes[comm::OpKind::kAllToAll], 0);
  });
}

TEST(CPSchedule, Ulysses) {
  run_ranks(4, [](comm::World& w) {
    auto o = observe(w, config("ulysses", std::nullopt, 4), 4);
    EXPECT_EQ(o.forward,
              (std::vector<std::string>{"all_to_all(cp)[1,8,8,16]", "all_to_all(cp)[1,4,8,16]",
                                        "all_to_all(cp)[1,4,8,16]", "all_to_all(cp)[1,2,32,16]"}));
    // Backward: the output's inverse first, then V, K, Q (reverse creation order).
    EXPECT_EQ(o.backward,
              (std::vector<std::string>{"all_to_all(cp)[1,8,8,16]", "all_to_all(cp)[1,1,32,16]",
                                        "all_to_all(cp)[1,1,32,16]", "all_to_all(cp)[1,2,32,16]"}));
    // (2h + 2h_kv) * (S/P) * e * (P-1)/P
    EXPECT_EQ(o.forward_bytes[comm::OpKind::kAllToAll],
              (2 * kNq * kD + 2 * kNkv * kD) * (kS / 4) * 4 * 3 / 4);
    EXPECT_EQ(o.forward_bytes[comm::OpKind::kAllGather], 0);
  });
}

TEST(CPSchedule, HybridComposesUlyssesThenAllGather) {
  run_ranks(4, [](comm::World& w) {
    auto o = observe(w, config("hybrid", 2, 4), 4);
    EXPECT_EQ(o.forward, (std::vector<std::string>{
                             "all_to_all(cp_ulysses)[1,8,8,16]", "all_to_all(cp_ulysses)[1,4,8,16]",
                             "all_to_all(cp_ulysses)[1,4,8,16]", "all_gather(cp_co)[1,2,16,16]",
                             "all_gather(cp_co)[1,2,16,16]", "all_to_all(cp_ulysses)[1,4,16,16]"}));
    // The same order on every rank (two groups are in play: a rank-dependent interleaving could
    // deadlock): output A2A, both K/V reduce-scatters, then the K, V, Q inverse A2As.
    EXPECT_EQ(o.backward,
              (std::vector<std::string>{
                  "all_to_all(cp_ulysses)[1,8,8,16]", "reduce_scatter(cp_co)[1,2,32,16]",
                  "reduce_scatter(cp_co)[1,2,32,16]", "all_to_all(cp_ulysses)[1,2,16,16]",
                  "all_to_all(cp_ulysses)[1,2,16,16]", "all_to_all(cp_ulysses)[1,4,16,16]"}));
    // A2A part over U = 2, all-gather part shrunk by U: 2 * S * h_kv * e * (C-1) / (C*U).
    const int64_t u = 2, c = 2;
    EXPECT_EQ(o.forward_bytes[comm::OpKind::kAllToAll],
              (2 * kNq * kD + 2 * kNkv * kD) * (kS / 4) * 4 * (u - 1) / u);
    EXPECT_EQ(o.forward_bytes[comm::OpKind::kAllGather],
              2 * kS * kNkv * kD * 4 * (c - 1) / (c * u));
  });
}

TEST(CPSchedule, DefaultConfigIsAllGatherSync) {
  auto c = normalize(std::nullopt, 4);
  ASSERT_TRUE(c.has_value());
  EXPECT_EQ(c->algorithm, CPAlgorithm::kAllGather);
  EXPECT_EQ(c->schedule, CPSchedule::kSync);
  EXPECT_FALSE(normalize(std::nullopt, 1).has_value());
  run_ranks(2, [](comm::World& w) {
    auto by_default = observe(w, *normalize(std::nullopt, 2), 2);
    auto explicit_ag = observe(w, config("all_gather", std::nullopt, 2), 2);
    EXPECT_TRUE(at::equal(by_default.out, explicit_ag.out));
    EXPECT_EQ(by_default.forward, explicit_ag.forward);
    EXPECT_EQ(by_default.backward, explicit_ag.backward);
  });
}

}  // namespace
}  // namespace hp::cp
