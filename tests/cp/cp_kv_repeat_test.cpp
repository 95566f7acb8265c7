// kv_head_policy=repeat, what travels: each K/V head repeated for the ranks that read it and
// the all-to-all handing every rank only that head (sync); async Ulysses and hybrid with the
// query heads in groups and the one K/V head travelling (and co-gathered) once; the refusals
// of the policy and of the head-group counts. The numerics: CPFloat64.*RepeatsKVHeads.
#include <algorithm>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "cp_direct.h"
#include "cp_test_util.h"
#include "hp/comm/device_mesh.h"
#include "hp/common/check.h"
#include "hp/cp/config.h"
#include "hp/cp/sequence.h"
#include "hp/cp/volume.h"
#include "rank_harness.h"

namespace hp::cp {
namespace {

using namespace hp::cp::testing;  // NOLINT: the float64 tests' module, inputs and shapes
using hp::testing::run_ranks;

// What kv_head_policy=repeat sends: Q and the output by all-to-all, K and V with each head
// repeated for its readers by an all-to-all that hands every rank only its head; counted bytes
// equal the formula. Without the option the error names it.
TEST(KVHeadPolicy, RepeatHandsEachRankOnlyTheHeadItReadsAndTheDefaultRefuses) {
  const int p = 4;
  ContextParallelConfig cfg;
  cfg.algorithm = "ulysses";
  HP_EXPECT_ERROR(check_heads(*normalize(cfg, p), p, kNq, 2),
                  "key/value heads = 2 are not divisible by the Ulysses degree 4; K/V heads are "
                  "never repeated silently: set kv_head_policy=repeat");
  cfg.kv_head_policy = KVHeadPolicy::kRepeat;
  HP_EXPECT_ERROR(check_heads(*normalize(cfg, p), p, kNq, 3),
                  "kv_head_policy=repeat needs the Ulysses degree 4 to be a multiple of the "
                  "key/value heads = 3");
  EXPECT_EQ(parse_kv_head_policy("repeat"), KVHeadPolicy::kRepeat);
  HP_EXPECT_ERROR(parse_kv_head_policy("copy"), "kv_head_policy 'copy' is not valid");
  const auto norm = *normalize(cfg, p);
  run_ranks(p, [&](comm::World& w) {
    Direct m(true);
    std::vector<std::string> lines;
    CPApplyOptions o;
    o.log = [&](const std::string& l) { lines.push_back(l); };
    apply_cp(m, w, norm, /*handoffs=*/false, o);
    ASSERT_FALSE(lines.empty());
    EXPECT_NE(lines[0].find("kv_head_policy=repeat"), std::string::npos) << lines[0];
    auto mine = [&](const at::Tensor& full) { return shard_sequence(full, 2, w.rank(), p, false); };
    auto q = mine(f64(1, {1, kNq, kS, kDqk})), k = mine(f64(2, {1, 2, kS, kDqk})),
         v = mine(f64(3, {1, 2, kS, kDv}));
    auto& rec = *w.context().recorder;
    rec.clear();
    w.context().counters.reset();
    m.forward(q, k, v);
    // q [1, 12, S/P, D] by all-to-all; k and v [1, 2, S/P, .] with each head repeated for its
    // two readers, [1, 4, S/P, .], so the all-to-all hands every rank only its one head; the
    // output back.
    EXPECT_EQ(rec.schedule(),
              (std::vector<std::string>{"all_to_all(cp)[1,12,12,8]", "all_to_all(cp)[1,4,12,8]",
                                        "all_to_all(cp)[1,4,12,6]", "all_to_all(cp)[1,3,48,6]"}));
    const AttentionShape shape{kS, kNq, 2, kDqk, 1, 8, kDv};
    // Q and the output: 3 of 4 quarters of 12 heads x 12 positions (D 8, Dv 6, 8 bytes); K
    // and V: one head's 12 positions to each of the 3 other ranks (the repeated heads' all-to-all).
    EXPECT_EQ(w.context().counters.total_bytes(),
              (12 * 8 + 12 * 6) * 12 * 8 / 4 * 3 + (8 + 6) * 12 * 8 * 3);
    EXPECT_EQ(w.context().counters.total_bytes(), forward_bytes_per_rank(norm, p, shape));
  });
  // Async: K and V travel whole (each rank reads one head, shared by its 3 query heads), the
  // queries in 3 head groups of one head per rank ([1, 4, 12, 8]: every rank's head of the
  // group), and each group's output on its own ([1, 1, 48, 6]); the same bytes as sync. The
  // numerics: CPFloat64.UlyssesRepeatsKVHeads.
  auto async_cfg = cfg;
  async_cfg.schedule = CPSchedule::kAsync;
  const auto async_norm = *normalize(async_cfg, p);
  // The group count divides the query heads alone; usp runs one group there.
  async_cfg.ulysses_head_groups = 2;
  HP_EXPECT_ERROR(check_heads(*normalize(async_cfg, p), p, kNq, 2),
                  "cp_config.ulysses_head_groups=2 does not divide the 3 query heads each rank "
                  "attends after the all-to-all (its one repeated key/value head is shared by "
                  "every group)");
  async_cfg.ulysses_head_groups = 3;
  check_heads(*normalize(async_cfg, p), p, kNq, 2);
  auto usp = async_cfg;
  usp.algorithm = "usp";
  usp.ulysses_degree = 2;
  HP_EXPECT_ERROR(check_heads(*normalize(usp, p), p, kNq, 1),
                  "cp_config.ulysses_head_groups=3 with kv_head_policy=repeat (1 key/value "
                  "heads, Ulysses degree 2): usp runs one head group on the repeat path");
  // The runtime refuses it too, at the handoff that brings the repeated K/V (a host that
  // applies CP without the planner's check).
  const auto usp_norm = *normalize(usp, p);
  run_ranks(p, [&](comm::World& w) {
    Direct m(true);
    apply_cp(m, w, usp_norm);
    auto mine = [&](const at::Tensor& full) { return shard_sequence(full, 2, w.rank(), p, false); };
    HP_EXPECT_ERROR(m.forward(mine(f64(1, {1, kNq, kS, kDqk})), mine(f64(2, {1, 1, kS, kDqk})),
                              mine(f64(3, {1, 1, kS, kDv}))),
                    "cp_config.ulysses_head_groups=3 with kv_head_policy=repeat (1 key/value "
                    "heads, Ulysses degree 2): usp runs one head group on the repeat path");
  });
  auto hybrid = usp;
  hybrid.algorithm = "hybrid";
  hybrid.ulysses_head_groups = 0;
  check_heads(*normalize(hybrid, p), p, kNq, 1);
  // Hybrid (U = 2, one K/V head, repeated for both Ulysses ranks: [1, 2, 12, .]): the queries
  // in 3 groups (6 heads per rank; [1, 4, 12, 8]: both ranks' 2 heads of the group), the one
  // K/V head co-gathered once ([1, 1, 24, .] from each co-rank) and read by every group, each
  // group's output on its own; backward one reduce-scatter each for K and V. Counted bytes
  // equal the formula both ways.
  const auto hybrid_norm = *normalize(hybrid, p);
  run_ranks(p, [&](comm::World& w) {
    Direct m(true);
    comm::DeviceMesh mesh(w, {{"cp", p}});
    auto topo = CPTopology::build(w, mesh.group_ptr({"cp"}), hybrid_norm);
    CPModuleSpec spec;
    spec.module_path = "attn";
    spec.inner_wrapper = "sdpa_qkv";
    spec.cp_handoff_targets = {{"q", "hq"}, {"k", "hk"}, {"v", "hv"}};
    apply_context_parallel(m.core.host(), spec, hybrid_norm, topo, quiet());
    auto mine = [&](const at::Tensor& full) {
      return shard_sequence(full, 2, w.rank(), p, false).requires_grad_(true);
    };
    auto q = mine(f64(1, {1, kNq, kS, kDqk})), k = mine(f64(2, {1, 1, kS, kDqk})),
         v = mine(f64(3, {1, 1, kS, kDv}));
    auto& rec = *w.context().recorder;
    rec.clear();
    w.context().counters.reset();
    auto out = m.forward(q, k, v);
    const std::string qp = "all_to_all(cp_ulysses)[1,4,12,8]",
                      op = "all_to_all(cp_ulysses)[1,2,24,6]";
    EXPECT_EQ(rec.schedule(),
              (std::vector<std::string>{
                  "all_to_all(cp_ulysses)[1,2,12,6]", "all_to_all(cp_ulysses)[1,2,12,8]", qp, qp,
                  qp, "all_gather(cp_co)[1,1,24,8]", "all_gather(cp_co)[1,1,24,6]", op, op, op}));
    const AttentionShape shape{kS, kNq, 1, kDqk, 1, 8, kDv};
    EXPECT_EQ(w.context().counters.total_bytes(), forward_bytes_per_rank(hybrid_norm, p, shape));
    rec.clear();
    w.context().counters.reset();
    out.sum().backward();
    EXPECT_EQ(w.context().counters.total_bytes(), backward_bytes_per_rank(hybrid_norm, p, shape));
    auto bwd = rec.schedule();
    EXPECT_EQ(std::count_if(bwd.begin(), bwd.end(),
                            [](const std::string& x) { return x.rfind("reduce_scatter", 0) == 0; }),
              2)
        << ::testing::PrintToString(bwd);
    EXPECT_EQ(bwd.size(), 10u) << ::testing::PrintToString(bwd);
  });
  run_ranks(p, [&](comm::World& w) {
    Direct m(true);
    apply_cp(m, w, async_norm);
    auto mine = [&](const at::Tensor& full) {
      return shard_sequence(full, 2, w.rank(), p, false).requires_grad_(true);
    };
    auto q = mine(f64(1, {1, kNq, kS, kDqk})), k = mine(f64(2, {1, 2, kS, kDqk})),
         v = mine(f64(3, {1, 2, kS, kDv}));
    auto& rec = *w.context().recorder;
    rec.clear();
    w.context().counters.reset();
    auto out = m.forward(q, k, v);
    const std::string q_piece = "all_to_all(cp)[1,4,12,8]", out_piece = "all_to_all(cp)[1,1,48,6]";
    EXPECT_EQ(rec.schedule(), (std::vector<std::string>{
                                  "all_to_all(cp)[1,4,12,6]", "all_to_all(cp)[1,4,12,8]", q_piece,
                                  q_piece, q_piece, out_piece, out_piece, out_piece}));
    const AttentionShape shape{kS, kNq, 2, kDqk, 1, 8, kDv};
    EXPECT_EQ(w.context().counters.total_bytes(), forward_bytes_per_rank(async_norm, p, shape));
    EXPECT_EQ(w.context().counters.total_bytes(), forward_bytes_per_rank(norm, p, shape));
    rec.clear();
    w.context().counters.reset();
    out.sum().backward();
    auto bwd = rec.schedule();
    std::sort(bwd.begin(), bwd.end());
    // Back: the 3 groups' output gradients, then dQ of each group and dK ([1, 1, 48, 8]: the
    // rank's head over the whole sequence) and dV, whose repeats are summed after arriving.
    const std::string dq_piece = "all_to_all(cp)[1,1,48,8]",
                      dout_piece = "all_to_all(cp)[1,4,12,6]";
    EXPECT_EQ(bwd,
              (std::vector<std::string>{"all_to_all(cp)[1,1,48,6]", dq_piece, dq_piece, dq_piece,
                                        dq_piece, dout_piece, dout_piece, dout_piece}));
    EXPECT_EQ(w.context().counters.total_bytes(), backward_bytes_per_rank(async_norm, p, shape));
  });
}

}  // namespace
}  // namespace hp::cp
