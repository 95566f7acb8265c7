// The CP cost model: legal candidates, the shape of its predictions on synthetic calibrations,
// and calibration files. The planner's --cp-algo auto and the K/V repeat candidates:
// cost_model_choice_test.cpp.
#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <set>
#include <string>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "cost_model_util.h"
#include "hp/model/qwen3.h"
#include "hp/plan/cost_model.h"
#include "hp/plan/plan.h"
#include "rank_harness.h"

namespace hp::plan {
namespace {

using namespace hp::plan::testing;  // NOLINT: synthetic calibrations, workloads, configs

// The ring with its blocks travelling again in backward (ring_backward=blocks).
cp::ContextParallelConfig ring_blocks() {
  auto c = config("ring", true);
  c.ring_backward = cp::RingBackward::kBlocks;
  return c;
}

TEST(CostModel, CollectiveLinesGoThroughTwoSizesOrThroughTheOriginWhenNoiseFlipsThem) {
  bool origin = true;
  // 1 MiB in 1.5 ms, 8 MiB in 8.5 ms: 1 ms per MiB, 0.5 ms latency.
  const double mib = 1 << 20;
  auto two = fit_collective_line(mib, 1.5e-3, 8 * mib, 8.5e-3, &origin);
  EXPECT_FALSE(origin);
  EXPECT_NEAR(two.seconds_per_byte, 1e-3 / mib, 1e-15);
  EXPECT_NEAR(two.latency_s, 0.5e-3, 1e-12);
  // The small size timed slower than the large one (a loaded machine): a zero slope would make
  // every byte free, so the line runs through the origin and the large point.
  auto flipped = fit_collective_line(mib, 9e-3, 8 * mib, 8e-3, &origin);
  EXPECT_TRUE(origin);
  EXPECT_EQ(flipped.latency_s, 0);
  EXPECT_NEAR(flipped.seconds_per_byte, 8e-3 / (8 * mib), 1e-15);
  EXPECT_GT(flipped.seconds_per_byte, 0);
  // Equal times are the same case; a steep small point clamps the latency at 0, not below.
  EXPECT_GT(fit_collective_line(mib, 8e-3, 8 * mib, 8e-3).seconds_per_byte, 0);
  auto steep = fit_collective_line(mib, 1e-4, 8 * mib, 16e-3, &origin);
  EXPECT_FALSE(origin);
  EXPECT_EQ(steep.latency_s, 0);
  EXPECT_THROW(fit_collective_line(8 * mib, 1e-3, mib, 2e-3), std::exception);
}

TEST(CostModel, LegalCandidatesFollowTheHeadChecks) {
  auto names = [](int64_t p, const CPWorkload& w) {
    std::vector<std::string> out;
    for (const auto& c : legal_cp_configs(p, w)) {
      out.push_back(std::string(cp::to_string(c.algorithm)) + (c.ring_keep_blocks ? "(kept)" : "") +
                    "/" + cp::to_string(c.schedule) +
                    (c.ulysses_degree ? "/U" + std::to_string(*c.ulysses_degree) : ""));
    }
    return out;
  };
  // kv_heads = 2 over 4 ranks: Ulysses is illegal, hybrid and usp with U=2 are legal.
  EXPECT_EQ(names(4, workload(8, 2)),
            (std::vector<std::string>{"all_gather/sync/U1", "all_gather/async/U1", "ring/sync/U1",
                                      "ring/async/U1", "ring(kept)/sync/U1", "ring(kept)/async/U1",
                                      "hybrid/sync/U2", "hybrid/async/U2", "usp/sync/U2",
                                      "usp/async/U2"}));
  EXPECT_EQ(names(2, workload()).size(), 8u);  // all_gather, ulysses, ring, ring(kept)
  EXPECT_TRUE(legal_cp_configs(1, workload()).empty());
}

TEST(CostModel, ComputeSharesFollowTheCausalLayout) {
  auto free_link = synthetic(0);
  auto w = workload();
  w.projections = false;
  const double contiguous = predict_cp_step(free_link, config("all_gather"), 2, w).compute_s;
  const double balanced = predict_cp_step(free_link, config("all_gather", true), 2, w).compute_s;
  const double ulysses = predict_cp_step(free_link, config("ulysses"), 2, w).compute_s;
  EXPECT_NEAR(contiguous / balanced, 1.5, 1e-9);  // (2P-1)/P^2 against 1/P
  EXPECT_NEAR(ulysses, balanced, 1e-12);
  // More ranks than cores: each rank runs at its share of a core.
  auto two_cores = synthetic(0, 2);
  EXPECT_NEAR(predict_cp_step(two_cores, config("ulysses"), 4, w).compute_s,
              2 * predict_cp_step(free_link, config("ulysses"), 4, w).compute_s, 1e-9);
}

TEST(CostModel, SlowLinksFavourUlyssesAndAsyncHidesBehindProjections) {
  auto slow = synthetic(1.0 / 125e6);  // ~1 Gbit/s
  auto w = workload();
  auto ag = predict_cp_step(slow, config("all_gather", true), 4, w);
  auto ul = predict_cp_step(slow, config("ulysses"), 4, w);
  EXPECT_LT(ul.comm_s, ag.comm_s);  // volume 1/P against (P-1)/P of K/V
  auto async = config("ulysses");
  async.schedule = cp::CPSchedule::kAsync;
  auto ua = predict_cp_step(slow, async, 4, w);
  EXPECT_LT(ua.exposed_comm_s, ul.exposed_comm_s);
  EXPECT_DOUBLE_EQ(ua.comm_s, ul.comm_s);
  auto ranked = rank_cp_configs(slow, 4, w);
  for (size_t i = 1; i < ranked.size(); ++i)
    EXPECT_LE(ranked[i - 1].step_s, ranked[i].step_s);
}

// Async hybrid in one head group hides its co-group gathers behind the co block it holds:
// with no projections to hide anything behind, sync hybrid exposes all its communication and
// async exposes less by exactly the gathers (here within 1/C of the forward's attention), with
// the same volume.
TEST(CostModel, AsyncHybridHidesItsCoGroupGathersBehindTheCoBlock) {
  auto slow = synthetic(1.0 / 125e6);
  auto w = workload();
  w.projections = false;
  auto sync = predict_cp_step(slow, config("hybrid", false, 2), 4, w);
  auto async_cfg = config("hybrid", false, 2);
  async_cfg.schedule = cp::CPSchedule::kAsync;
  async_cfg.ulysses_head_groups = 1;
  auto async = predict_cp_step(slow, async_cfg, 4, w);
  EXPECT_DOUBLE_EQ(async.comm_s, sync.comm_s);
  EXPECT_DOUBLE_EQ(sync.exposed_comm_s, sync.comm_s);
  // K/V after the all-to-all: S/P positions x h_kv per rank, gathered over C = 2.
  const double n = 4.0 * (w.seq / 4) * w.kv_heads * w.head_dim;
  const double gathers =
      2 * slow.fit("all_gather", 4).time(n) + 2 * slow.fit("reduce_scatter", 4).time(n);
  ASSERT_LT(gathers / 2, async.compute_s / 2 / 3.5);
  EXPECT_NEAR(sync.exposed_comm_s - async.exposed_comm_s, gathers, 1e-9 * gathers);
}

// Async hybrid in G head groups (P = 4, U = 2: 4 query and K/V heads per rank, automatic G =
// 4). Where the attention outlasts the link, each pass exposes only group 0's Q/K/V pieces and
// the last group's output all-to-all (forward; backward their inverses): 1/G of the
// all-to-alls. Where the link outlasts it, the attended share hides: the held chunks (1/C) and
// (G-1)/G of the rest (forward: half of that), against 1/C in one group.
TEST(CostModel, AsyncHybridInHeadGroupsExposesOneGroupsAllToAllsEachWay) {
  auto w = workload();
  w.projections = false;
  auto grouped = config("hybrid", false, 2);
  grouped.schedule = cp::CPSchedule::kAsync;
  EXPECT_EQ(cp::ulysses_head_groups_of(grouped, 4, 4, 4), 4);
  auto single = grouped;
  single.ulysses_head_groups = 1;
  auto fast = synthetic(1.0 / 125e6);
  const double t = fast.fit("all_to_all", 4).time(4.0 * (w.seq / 4) * 512 * 0.5);
  const auto a = predict_cp_step(fast, grouped, 4, w), one = predict_cp_step(fast, single, 4, w);
  EXPECT_NEAR(a.exposed_comm_s, 8 * t / 4, 1e-9 * t) << "Q, K, V and output, both ways, / G";
  EXPECT_NEAR(one.exposed_comm_s, 8 * t, 1e-9 * t);
  auto slow = synthetic(1.0 / 2e6);
  const auto sync = predict_cp_step(slow, config("hybrid", false, 2), 4, w);
  const auto b = predict_cp_step(slow, grouped, 4, w), b1 = predict_cp_step(slow, single, 4, w);
  const double attn = sync.compute_s;
  ASSERT_GT(sync.comm_s / 4, attn) << "the link must outlast both passes";
  const double fwd = 0.5 + 0.5 * 3 / 8, bwd = 0.5 + 0.5 * 3 / 4;
  EXPECT_NEAR(b.exposed_comm_s, sync.comm_s - (fwd / 3.5 + bwd * 2.5 / 3.5) * attn,
              1e-9 * sync.comm_s);
  EXPECT_NEAR(b1.exposed_comm_s, sync.comm_s - 0.5 * attn, 1e-9 * sync.comm_s);
}

// Async usp in G head groups (P = 4, U = 2: 4 query and K/V heads per rank, G = 4 asked;
// automatic 2): the output all-to-alls of G - 1 groups and their inverses fly while another
// group's ring runs, as async Ulysses' do, and so do (G-1)/G of the Q/K/V pieces, at three
// quarters of Ulysses' share (the link carries the ring's shifts meanwhile); one group hides
// none of them (nothing to hide behind without projections), and sync usp none either. The
// automatic count is 1 where a rank holds fewer than kUspMinRowsForHeadGroups tokens.
TEST(CostModel, AsyncUspHidesTheOutputAllToAllsOfAllGroupsButOne) {
  auto slow = synthetic(1.0 / 125e6);
  auto w = workload();
  w.projections = false;
  auto grouped = config("usp", false, 2), single = config("usp", false, 2);
  grouped.schedule = single.schedule = cp::CPSchedule::kAsync;
  EXPECT_EQ(cp::ulysses_head_groups_of(grouped, 4, 4), 2);
  EXPECT_EQ(cp::ulysses_head_groups_of(grouped, 3, 3), 1);
  grouped.ulysses_head_groups = 4;
  single.ulysses_head_groups = 1;
  const auto a = predict_cp_step(slow, grouped, 4, w), one = predict_cp_step(slow, single, 4, w);
  // Q, K, V and the output: [S/P positions x all heads] per rank each, (U-1)/U of it moved,
  // forward + backward.
  const double bytes = 4.0 * (w.seq / 4) * w.heads * w.head_dim / 2;
  const double t = slow.fit("all_to_all", 4).time(bytes);
  ASSERT_LT(8 * t, a.compute_s / 4);
  EXPECT_NEAR(one.exposed_comm_s - a.exposed_comm_s, 6 * t * 3 / 4 * 3 / 4 + 2 * t * 3 / 4,
              1e-9 * t);
  EXPECT_DOUBLE_EQ(a.comm_s, one.comm_s);
  EXPECT_DOUBLE_EQ(a.compute_s, one.compute_s);
  EXPECT_GE(predict_cp_step(slow, config("usp", false, 2), 4, w).exposed_comm_s,
            one.exposed_comm_s);
  // The automatic count: 2 groups with S/P = 4096 tokens per rank, one on shorter shards.
  auto automatic = grouped;
  automatic.ulysses_head_groups = 0;
  EXPECT_EQ(cp::ulysses_head_groups_of(automatic, 4, 4, 4, w.seq / 4), 2);
  EXPECT_LT(predict_cp_step(slow, automatic, 4, w).exposed_comm_s, one.exposed_comm_s);
  auto short_w = w;
  short_w.seq = 4 * (cp::kUspMinRowsForHeadGroups - 1);
  EXPECT_EQ(cp::ulysses_head_groups_of(automatic, 4, 4, 4, short_w.seq / 4), 1);
  EXPECT_DOUBLE_EQ(predict_cp_step(slow, automatic, 4, short_w).exposed_comm_s,
                   predict_cp_step(slow, single, 4, short_w).exposed_comm_s);
}

cp::ContextParallelConfig async_ulysses() {
  auto c = config("ulysses");
  c.schedule = cp::CPSchedule::kAsync;
  return c;
}

// Bytes one Ulysses all-to-all of a width-H*D tensor sends per rank at P = 4: the local
// positions, (U-1)/U of them moved.
double ulysses_a2a_bytes(const CPWorkload& w) {
  return 4.0 * (w.seq / 4) * w.heads * w.head_dim * 3 / 4;
}

// Async ulysses in G head groups (P = 4, 2 heads per rank: G = 2): Q, K and V travel in one
// all-to-all per group, so besides the output all-to-alls of all groups but one, the later
// groups' Q, K, V pieces (forward) and dQ, dK, dV (backward) hide behind the earlier groups'
// attention: (G-1)/G of the forward input plus (G-1)/G of its backward inverse.
TEST(CostModel, AsyncUlyssesHidesTheLaterGroupsPiecesAndOutputs) {
  // A link slow enough that the own diagonal blocks cannot hide the input all-to-alls.
  auto slow = synthetic(1.0 / 25e6);
  auto w = workload();
  auto grouped = async_ulysses(), single = async_ulysses();
  single.ulysses_head_groups = 1;
  grouped.ulysses_row_parts = single.ulysses_row_parts = 1;  // the next test adds them
  EXPECT_EQ(cp::ulysses_head_groups_of(grouped, 2, 2), 2);
  const auto a = predict_cp_step(slow, grouped, 4, w), one = predict_cp_step(slow, single, 4, w);
  const double bytes = ulysses_a2a_bytes(w);
  const auto& a2a = slow.fit("all_to_all", 4);
  const double forward_in = 3 * a2a.time(bytes), output = 2 * a2a.time(bytes);
  const double pieces = forward_in * 2 / 2;
  ASSERT_LT(pieces + output / 2, a.compute_s / 2);
  ASSERT_GT(one.exposed_comm_s, 2 * forward_in - pieces);
  EXPECT_NEAR(one.exposed_comm_s - a.exposed_comm_s, pieces + output / 2, 1e-9 * forward_in);
  EXPECT_DOUBLE_EQ(a.comm_s, one.comm_s);
  EXPECT_DOUBLE_EQ(a.compute_s, one.compute_s);
}

// Async ulysses sends its last head group's output in R row parts (automatic: 2 where each
// keeps 2048 of the rank's rows), each flying while the next is attended: of the G R sends all
// but one hide, so 2 parts with 2 groups hide 3/4 of the output all-to-alls instead of 1/2.
TEST(CostModel, AsyncUlyssesHidesAllRowPartsOfTheLastGroupButOne) {
  auto slow = synthetic(1.0 / 25e6);
  auto w = workload();
  auto parts = async_ulysses(), whole = async_ulysses();
  whole.ulysses_row_parts = 1;
  EXPECT_EQ(cp::ulysses_row_parts_of(parts, w.seq / 4), 2) << "4096 rows per rank";
  EXPECT_EQ(cp::ulysses_row_parts_of(parts, 4095), 1) << "parts under 2048 rows";
  EXPECT_EQ(cp::ulysses_row_parts_of(whole, w.seq / 4), 1);
  auto many = parts;
  many.ulysses_row_parts = 9;
  EXPECT_EQ(cp::ulysses_row_parts_of(many, 5), 5) << "at most one part per row";
  const auto a = predict_cp_step(slow, parts, 4, w), one = predict_cp_step(slow, whole, 4, w);
  const double output = 2 * slow.fit("all_to_all", 4).time(ulysses_a2a_bytes(w));
  EXPECT_NEAR(one.exposed_comm_s - a.exposed_comm_s, output / 4, 1e-9 * output);
  EXPECT_DOUBLE_EQ(a.compute_s, one.compute_s);
  // Only ulysses: the other strategies refuse the field (normalize) and ignore the count here.
  auto usp = config("usp", false, 2);
  usp.schedule = cp::CPSchedule::kAsync;
  const auto u1 = predict_cp_step(slow, usp, 4, w);
  usp.ulysses_row_parts = 4;
  EXPECT_DOUBLE_EQ(predict_cp_step(slow, usp, 4, w).exposed_comm_s, u1.exposed_comm_s);
}

// Async all_gather in G head groups (8 K/V heads: G = 8 automatic; P = 4, no projections): the
// K/V gathers (half of the bytes) hide only behind forward attention (1 of its 3.5 units) and
// the dK/dV reduce-scatters only behind backward attention (2.5 units), each within the held
// chunks (1/C) and every group's remote keys but the last group's. On a link slow enough that
// both halves outlast their pass, that is exactly what is hidden; one group hides only behind
// the held chunks.
TEST(CostModel, AsyncAllGatherInHeadGroupsHidesEachHalfBehindItsOwnPass) {
  auto slow = synthetic(1.0 / 5e6);
  auto w = workload();
  w.projections = false;
  const auto sync = predict_cp_step(slow, config("all_gather"), 4, w);
  auto grouped = config("all_gather");
  grouped.schedule = cp::CPSchedule::kAsync;
  EXPECT_EQ(cp::ulysses_head_groups_of(grouped, 8, 8, 4), 8);
  EXPECT_EQ(cp::ulysses_head_groups_of(grouped, 8, 8, 2), 4) << "P = 2: at most 4 groups";
  EXPECT_EQ(cp::ulysses_head_groups_of(grouped, 6, 6, 2), 3) << "the largest divisor up to 4";
  auto single = grouped;
  single.ulysses_head_groups = 1;
  const auto a = predict_cp_step(slow, grouped, 4, w), one = predict_cp_step(slow, single, 4, w);
  const double attn = sync.compute_s, attended = 0.25 + 0.75 * 7 / 8;
  ASSERT_GT(sync.comm_s / 2, attended * attn * 2.5 / 3.5) << "the link must outlast both passes";
  EXPECT_DOUBLE_EQ(a.comm_s, sync.comm_s);
  EXPECT_NEAR(a.exposed_comm_s, sync.comm_s - attended * attn, 1e-9 * sync.comm_s);
  EXPECT_NEAR(one.exposed_comm_s, sync.comm_s - attn / 4, 1e-9 * sync.comm_s);
}

// The async schedule's own cost: async all_gather pays async_seconds_per_token per local token
// on top of the sync compute, so on a fast link (little to hide) sync ranks first and on a slow
// one async still does; the ring's async schedule is its sync one and pays nothing. Without
// the overhead async never ranks below sync. Async Ulysses pays its own fit.
TEST(CostModel, AsyncPaysItsOverheadAndSyncWinsWhereLittleIsHidden) {
  auto w = workload();
  w.load_balance = true;
  auto async_cfg = config("all_gather", true);
  async_cfg.schedule = cp::CPSchedule::kAsync;
  auto fast = synthetic(1.0 / 100e9), slow = synthetic(1.0 / 125e6);
  for (auto* cal : {&fast, &slow}) {
    const auto sync = predict_cp_step(*cal, config("all_gather", true), 2, w);
    const auto free_async = predict_cp_step(*cal, async_cfg, 2, w);
    EXPECT_LE(free_async.step_s, sync.step_s);
    cal->async_seconds_per_token = 5e-5;
    const auto async = predict_cp_step(*cal, async_cfg, 2, w);
    EXPECT_NEAR(async.compute_s - free_async.compute_s, 5e-5 * (w.seq / 2), 1e-9);
    EXPECT_DOUBLE_EQ(async.exposed_comm_s, free_async.exposed_comm_s);
    auto ulysses_async = config("ulysses");
    ulysses_async.schedule = cp::CPSchedule::kAsync;
    cal->ulysses_async_seconds_per_token = 0;
    const auto free_ulysses = predict_cp_step(*cal, ulysses_async, 2, w);
    cal->ulysses_async_seconds_per_token = 2e-5;
    const auto paying_ulysses = predict_cp_step(*cal, ulysses_async, 2, w);
    EXPECT_NEAR(paying_ulysses.compute_s - free_ulysses.compute_s, 2e-5 * (w.seq / 2), 1e-9);
    // usp's early collectives are Ulysses' all-to-alls: it pays Ulysses' fit, not all_gather's.
    auto usp_async = config("usp", false, 2);
    usp_async.schedule = cp::CPSchedule::kAsync;
    const auto paying_usp = predict_cp_step(*cal, usp_async, 4, w);
    cal->ulysses_async_seconds_per_token = 0;
    const auto free_usp = predict_cp_step(*cal, usp_async, 4, w);
    EXPECT_NEAR(paying_usp.compute_s - free_usp.compute_s, 2e-5 * (w.seq / 4), 1e-9);
    cal->ulysses_async_seconds_per_token = 2e-5;
    EXPECT_DOUBLE_EQ(predict_cp_step(*cal, async_cfg, 2, w).step_s, async.step_s);
    auto ring_async = config("ring", true);
    ring_async.schedule = cp::CPSchedule::kAsync;
    EXPECT_DOUBLE_EQ(predict_cp_step(*cal, ring_async, 2, w).step_s,
                     predict_cp_step(*cal, config("ring", true), 2, w).step_s);
  }
  const auto choice = [&](const Calibration& cal) {
    std::vector<std::string> names;
    for (const auto& r : rank_cp_configs(cal, 2, w))
      if (r.config.algorithm == cp::CPAlgorithm::kAllGather) names.push_back(r.name);
    return names;
  };
  EXPECT_EQ(choice(fast), (std::vector<std::string>{"all_gather/sync", "all_gather/async"}));
  EXPECT_EQ(choice(slow), (std::vector<std::string>{"all_gather/async", "all_gather/sync"}));
}

// A balanced workload gives head-tail balance to every strategy that has it (data-order shards
// for all but all_gather) and none to ulysses; hybrid and usp are among the candidates.
TEST(CostModel, BalancedWorkloadsBalanceEveryStrategyThatCan) {
  auto w = workload();
  w.load_balance = true;
  std::set<std::string> seen;
  for (const auto& c : legal_cp_configs(4, w)) {
    const std::string name = cp::to_string(c.algorithm);
    seen.insert(name);
    EXPECT_EQ(c.load_balance, c.algorithm != cp::CPAlgorithm::kUlysses) << name;
    if (c.load_balance && c.algorithm != cp::CPAlgorithm::kAllGather) {
      EXPECT_EQ(c.load_balance_form, cp::LoadBalanceForm::kDataOrder) << name;
    }
  }
  EXPECT_EQ(seen, (std::set<std::string>{"all_gather", "hybrid", "ring", "ulysses", "usp"}));
}

// A causal layer's ring chunks travel only as far as they are attended: at P = 4 with
// data-order head-tail chunks, 19 of the 24 chunk hops of a full pass, the [k | v] chunks and
// the query bundles alike (cp/volume.h: ring_chunk_counts;
// RingSchedule.ChunkCountsFollowTheRoutes).
constexpr double kRingShare = 19.0 / 24.0;

// The ring hides its shifts behind the block it attends, in either schedule: on a slow link its
// exposed time is below synchronous all_gather's, its compute is all_gather's (the blockwise
// primitive's backward from the merged statistics: nothing recomputed), and it sends 3(P-1)
// blocks' worth of its routes' share per step.
TEST(CostModel, TheRingHidesItsShiftsBehindItsBlocks) {
  auto slow = synthetic(1.0 / 125e6);
  auto w = workload();
  w.projections = false;
  auto ring = predict_cp_step(slow, ring_blocks(), 4, w);
  auto ring_async = ring_blocks();
  ring_async.schedule = cp::CPSchedule::kAsync;
  EXPECT_DOUBLE_EQ(predict_cp_step(slow, ring_async, 4, w).step_s, ring.step_s);
  auto ag = predict_cp_step(slow, config("all_gather", true), 4, w);
  EXPECT_LT(ring.exposed_comm_s, ag.exposed_comm_s);
  EXPECT_DOUBLE_EQ(ring.compute_s, ag.compute_s);
  EXPECT_GE(ring.exposed_comm_s, 0);
  const double block = 4.0 * (w.seq / 4) * 2 * w.kv_heads * w.head_dim * kRingShare;
  const auto& fit = slow.fit("all_to_all", 4);
  EXPECT_NEAR(ring.comm_s, 9 * fit.time(block), 1e-9 * ring.comm_s);
  // Kept blocks (ring_keep_blocks): only the accumulators travel in backward, 2(P-1) blocks in
  // all, all_gather's bytes; each backward shift is one block behind a step's attention, so on
  // a link slow enough for the ring to expose time, less is exposed; the compute is the same.
  auto kept_cfg = ring_blocks();
  kept_cfg.ring_keep_blocks = true;
  EXPECT_EQ(predict_cp_step(slow, kept_cfg, 4, w).name, "ring(kept)/sync");
  EXPECT_NEAR(predict_cp_step(slow, kept_cfg, 4, w).comm_s, 6 * fit.time(block),
              1e-9 * ring.comm_s);
  auto slower = synthetic(1.0 / 10e6);
  const auto ring_slower = predict_cp_step(slower, ring_blocks(), 4, w);
  const auto kept = predict_cp_step(slower, kept_cfg, 4, w);
  const double shift = slower.fit("all_to_all", 4).time(block);
  const double fwd_step = ag.compute_s / 3.5 / 4;  // one step's forward attention
  ASSERT_GT(shift, 2.5 * fwd_step);                // both forms expose time on this link
  EXPECT_DOUBLE_EQ(kept.compute_s, ring_slower.compute_s);
  EXPECT_NEAR(kept.exposed_comm_s, 3 * (shift - fwd_step) + 3 * (shift - 2.5 * fwd_step),
              1e-9 * kept.comm_s);
  EXPECT_NEAR(ring_slower.exposed_comm_s - kept.exposed_comm_s, 3 * shift, 1e-9 * kept.comm_s);
}

// On a link fast enough for every ring shift to hide, the ring and the kept ring, sync and async,
// all predict the same step; the ranking puts the kept ring first (fewer bytes: 2(P-1) blocks
// against the ring's), so a busier link than the calibrated one slows auto's choice least.
TEST(CostModel, EqualStepsRankTheChoiceWithLessLinkTimeFirst) {
  auto fast = synthetic(1.0 / 100e9);
  auto w = workload();
  w.load_balance = true;
  const auto ranked = rank_cp_configs(fast, 2, w);
  const auto first_ring = std::find_if(ranked.begin(), ranked.end(), [](const CPPrediction& x) {
    return x.config.algorithm == cp::CPAlgorithm::kRing;
  });
  ASSERT_NE(first_ring, ranked.end());
  int rings = 0;
  for (const auto& x : ranked) {
    if (x.config.algorithm != cp::CPAlgorithm::kRing) continue;
    ++rings;
    EXPECT_DOUBLE_EQ(x.step_s, first_ring->step_s) << x.name;
    EXPECT_LE(first_ring->comm_s, x.comm_s) << x.name;
  }
  EXPECT_EQ(rings, 4);
  EXPECT_TRUE(first_ring->config.ring_keep_blocks) << first_ring->name;
  for (size_t i = 1; i < ranked.size(); ++i) {
    EXPECT_LE(ranked[i - 1].step_s, ranked[i].step_s);
    if (ranked[i - 1].step_s == ranked[i].step_s) {
      EXPECT_LE(ranked[i - 1].comm_s, ranked[i].comm_s) << ranked[i].name;
    }
  }
}

// Multi-head (8 / 8 at D = 64): ring_backward auto sends the queries in backward, per step
// [q | dout], [lse | delta] and the dQ accumulator (3D + 2 floats per head and position against
// the blocks' 4D): fewer bytes and, on a link slow enough to expose them, less exposed; the same
// compute. With GQA (8 / 2) the blocks are fewer bytes and auto keeps them.
TEST(CostModel, TheRingsBackwardSendsTheQueriesWhereThatIsFewerBytes) {
  auto slower = synthetic(1.0 / 10e6);
  auto w = workload();
  w.projections = false;
  const auto queries = predict_cp_step(slower, config("ring", true), 4, w);
  const auto blocks = predict_cp_step(slower, ring_blocks(), 4, w);
  const auto& fit = slower.fit("all_to_all", 4);
  const double local = w.seq / 4.0 * kRingShare, h = 8.0 * 64, e = 4;
  const double block = e * local * 2 * h;
  EXPECT_NEAR(queries.comm_s,
              3 * fit.time(block) + 3 * (fit.time(e * local * 2 * h) + fit.time(e * local * 2 * 8) +
                                         fit.time(e * local * h)),
              1e-9 * queries.comm_s);
  EXPECT_NEAR(blocks.comm_s, 9 * fit.time(block), 1e-9 * blocks.comm_s);
  EXPECT_LT(queries.exposed_comm_s, blocks.exposed_comm_s);
  EXPECT_DOUBLE_EQ(queries.compute_s, blocks.compute_s);
  const auto gqa = workload(8, 2);
  EXPECT_DOUBLE_EQ(predict_cp_step(slower, config("ring", true), 4, gqa).comm_s,
                   predict_cp_step(slower, ring_blocks(), 4, gqa).comm_s);
}

// Where the primitive offers no backward from statistics (ring_recomputes), the ring's compute
// is one fwd + bwd of its blocks plus the forward of the C-1 blocks that travelled again (1 of
// 3.5 units on (C-1)/C of the work), plus its measured cost per local token per step over C-1
// steps (usp at P = 4, U = 2 rings over C = 2); the shifts it hides behind one block's forward
// do not change with that cost.
TEST(CostModel, TheRingPaysItsRecomputeAndItsMeasuredCostPerStep) {
  auto base = synthetic(1.0 / 10e6, /*cores=*/2);
  auto w = workload();
  w.load_balance = true;
  w.projections = false;
  w.ring_recomputes = true;
  const double local = w.seq / 4.0, share = 0.5;  // 4 ranks on 2 cores
  const auto ag = predict_cp_step(base, config("all_gather", true), 4, w);
  const auto r_base = predict_cp_step(base, config("ring", true), 4, w);
  EXPECT_NEAR(r_base.compute_s, ag.compute_s * (1 + 3.0 / 14.0), 1e-9 * ag.compute_s);
  const auto hybrid = predict_cp_step(base, config("hybrid", true, 2), 4, w);
  EXPECT_NEAR(predict_cp_step(base, config("usp", true, 2), 4, w).compute_s,
              hybrid.compute_s * (1 + 1.0 / 7.0), 1e-9 * hybrid.compute_s);
  auto measured = base;
  measured.ring_seconds_per_token_step = 1e-4;
  const auto r = predict_cp_step(measured, config("ring", true), 4, w);
  EXPECT_NEAR(r.compute_s - r_base.compute_s, 1e-4 * local * 3 / share, 1e-12);
  EXPECT_NEAR(predict_cp_step(measured, config("usp", true, 2), 4, w).compute_s -
                  predict_cp_step(base, config("usp", true, 2), 4, w).compute_s,
              1e-4 * local * 1 / share, 1e-12);
  EXPECT_GT(r_base.exposed_comm_s, 0);  // a slow link: the shifts outlast the forward blocks
  EXPECT_DOUBLE_EQ(r.exposed_comm_s, r_base.exposed_comm_s);
  for (const auto& other : {config("all_gather", true), config("ulysses")}) {  // unchanged
    EXPECT_DOUBLE_EQ(predict_cp_step(measured, other, 4, w).step_s,
                     predict_cp_step(base, other, 4, w).step_s);
  }
  // From the statistics: no recompute, and each backward step's attention is 2.5 forward
  // units instead of 3.5, so less of the backward's shifts hides behind it.
  auto stats = w;
  stats.ring_recomputes = false;
  const auto r_stats = predict_cp_step(base, config("ring", true), 4, stats);
  EXPECT_NEAR(r_stats.compute_s, ag.compute_s, 1e-9 * ag.compute_s);
  EXPECT_NEAR(predict_cp_step(base, config("usp", true, 2), 4, stats).compute_s, hybrid.compute_s,
              1e-9 * hybrid.compute_s);
  EXPECT_GT(r_stats.exposed_comm_s, r_base.exposed_comm_s);
  EXPECT_DOUBLE_EQ(r_stats.comm_s, r_base.comm_s);
  for (const auto& other :
       {config("all_gather", true), config("ulysses"), config("hybrid", true, 2)})
    EXPECT_DOUBLE_EQ(predict_cp_step(base, other, 4, stats).step_s,
                     predict_cp_step(base, other, 4, w).step_s);
}

// The ring's measured attention factor lengthens the attention of ring and usp (and the work
// their shifts hide behind); the measured exposure scale for the ring's size multiplies what
// the shifts leave exposed (the nearest measured size where it is absent; usp at P = 4, U = 2
// runs rings of two). Neither touches the other strategies.
TEST(CostModel, TheRingsAttentionFactorAndExposureScaleApplyToTheRingsOnly) {
  auto base = synthetic(1.0 / 10e6, /*cores=*/2);
  auto w = workload();
  w.load_balance = true;
  w.projections = false;
  const auto ring = config("ring", true), usp = config("usp", false, 2);
  const auto r0 = predict_cp_step(base, ring, 4, w);
  const auto u0 = predict_cp_step(base, usp, 4, w);
  ASSERT_GT(r0.exposed_comm_s, 0);
  auto slow = base;
  slow.ring_attention_factor = 1.25;
  const auto r1 = predict_cp_step(slow, ring, 4, w);
  EXPECT_NEAR(r1.compute_s, 1.25 * r0.compute_s, 1e-9 * r0.compute_s);
  EXPECT_NEAR(predict_cp_step(slow, usp, 4, w).compute_s, 1.25 * u0.compute_s, 1e-9 * u0.compute_s);
  EXPECT_LT(r1.exposed_comm_s, r0.exposed_comm_s);  // longer blocks hide more of each shift
  EXPECT_DOUBLE_EQ(r1.comm_s, r0.comm_s);
  auto scaled = base;
  scaled.ring_exposed_scale = {{2, 0.5}, {4, 0.8}};
  EXPECT_DOUBLE_EQ(scaled.ring_exposed_scale_at(4), 0.8);
  EXPECT_DOUBLE_EQ(scaled.ring_exposed_scale_at(3), 0.5);  // nearest (2 and 4 tie: the lower)
  EXPECT_DOUBLE_EQ(scaled.ring_exposed_scale_at(8), 0.8);
  EXPECT_DOUBLE_EQ(base.ring_exposed_scale_at(4), 1.0);  // none measured
  const auto r2 = predict_cp_step(scaled, ring, 4, w);
  EXPECT_NEAR(r2.exposed_comm_s, 0.8 * r0.exposed_comm_s, 1e-12);
  EXPECT_DOUBLE_EQ(r2.compute_s, r0.compute_s);
  // usp's exposed time is its all-to-alls' and its rings' (of two members): only the latter
  // scale, by the scale for two.
  auto none = base;
  none.ring_exposed_scale = {{2, 0.0}};
  const double usp_rings = u0.exposed_comm_s - predict_cp_step(none, usp, 4, w).exposed_comm_s;
  ASSERT_GT(usp_rings, 0);
  EXPECT_NEAR(predict_cp_step(scaled, usp, 4, w).exposed_comm_s,
              u0.exposed_comm_s - 0.5 * usp_rings, 1e-12);
  for (const auto& other :
       {config("all_gather", true), config("ulysses"), config("hybrid", false, 2)}) {
    for (const auto* cal : {&slow, &scaled})
      EXPECT_DOUBLE_EQ(predict_cp_step(*cal, other, 4, w).step_s,
                       predict_cp_step(base, other, 4, w).step_s);
  }
}

TEST(CostModel, CalibrationFilesRoundTripAndMissingOnesNameTheCommand) {
  auto c = synthetic(2e-9);
  c.inputs_json = R"({"comm":[{"command":"hp-bench comm --nproc 2"}]})";
  c.async_seconds_per_token = 3e-5;
  c.ulysses_async_seconds_per_token = 1.5e-5;
  c.ring_seconds_per_token_step = 1.1e-4;
  c.ring_attention_factor = 1.12;
  c.ring_exposed_scale = {{2, 0.7}, {4, 0.9}};
  const std::string path = ::testing::TempDir() + "/hp_cal/calibration-test.json";
  save_calibration(path, c);
  auto back = load_calibration(path);
  EXPECT_EQ(back.link, "test");
  EXPECT_DOUBLE_EQ(back.async_seconds_per_token, 3e-5);
  EXPECT_DOUBLE_EQ(back.ulysses_async_seconds_per_token, 1.5e-5);
  // A file from before the Ulysses fit: Ulysses pays the general one.
  auto j = nlohmann::json::parse(to_json(c));
  j.erase("ulysses_async_seconds_per_token");
  EXPECT_DOUBLE_EQ(calibration_from_json(j.dump()).ulysses_async_seconds_per_token, 3e-5);
  EXPECT_DOUBLE_EQ(back.ring_seconds_per_token_step, 1.1e-4);
  EXPECT_DOUBLE_EQ(back.ring_attention_factor, 1.12);
  EXPECT_EQ(back.ring_exposed_scale, c.ring_exposed_scale);
  // A file from before the ring's fits: factor 1, no scale.
  j = nlohmann::json::parse(to_json(c));
  j.erase("ring_attention_factor");
  j.erase("ring_exposed_scale");
  const auto old_file = calibration_from_json(j.dump());
  EXPECT_DOUBLE_EQ(old_file.ring_attention_factor, 1.0);
  EXPECT_TRUE(old_file.ring_exposed_scale.empty());
  EXPECT_DOUBLE_EQ(back.fit("all_to_all", 4).seconds_per_byte, 2e-9);
  EXPECT_DOUBLE_EQ(back.fit("all_to_all", 8).seconds_per_byte, 2e-9);  // nearest measured P
  EXPECT_NE(back.inputs_json.find("hp-bench comm --nproc 2"), std::string::npos);
  HP_EXPECT_ERROR(load_calibration(path + ".missing"),
                  "run `hp-bench calibrate [--link-rate RATE]` once on this machine and link");
}

}  // namespace
}  // namespace hp::plan
