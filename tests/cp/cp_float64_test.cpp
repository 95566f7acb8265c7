// The whole CP path in float64 against the plain-formula reference (tests/harness, no code
// shared with the kernels): every built-in strategy (all_gather plain and with both head-tail
// forms, ulysses, hybrid plain and head-tail, ring, usp), sync and async, causal and not, P in
// {2, 3, 4}, GQA, BNSD and BSHD modules, and a value head dim that differs from the query/key
// one (Dqk 8, Dv 6, as MLA's 192 / 128).
#include <algorithm>
#include <limits>
#include <optional>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "cp_direct.h"
#include "cp_test_util.h"
#include "hp/attention/core_attention.h"
#include "hp/comm/collectives.h"
#include "hp/comm/device_mesh.h"
#include "hp/common/check.h"
#include "hp/cp/config.h"
#include "hp/cp/sequence.h"
#include "hp/cp/volume.h"
#include "rank_harness.h"
#include "reference_attention.h"

namespace hp::cp {
namespace {

using namespace hp::cp::testing;  // NOLINT: the float64 tests' module, inputs and shapes
using hp::testing::expect_close;
using hp::testing::run_ranks;

constexpr int64_t kB = 2;

struct Case {
  std::string algorithm;
  std::optional<int64_t> degree;
  bool load_balance = false;
  LoadBalanceForm form = LoadBalanceForm::kDataOrder;
  int64_t kv_heads = kNkv;
  KVHeadPolicy kv_policy = KVHeadPolicy::kError;
  int64_t head_groups = 0;                           // async ulysses, usp (0: automatic)
  int64_t row_parts = 0;                             // async ulysses (0: automatic)
  bool always_local_first = false;                   // async all_gather and hybrid
  bool keep_blocks = false;                          // ring, usp
  RingBackward ring_backward = RingBackward::kAuto;  // ring, usp
  std::string primitive = "blockwise";
  bool bshd = false;  // q/k/v [B, S, N, D] (else [B, N, S, D])
  std::string name() const {
    std::string n = algorithm + (degree ? "(U=" + std::to_string(*degree) + ")" : "");
    if (primitive != "blockwise") n += " primitive=" + primitive;
    if (bshd) n += " BSHD";
    if (always_local_first) n += " always_local_first";
    if (keep_blocks) n += " keep_blocks";
    if (ring_backward != RingBackward::kAuto)
      n += std::string(" ring_backward=") + to_string(ring_backward);
    if (kv_heads != kNkv && kv_policy != KVHeadPolicy::kRepeat)
      n += " kv_heads=" + std::to_string(kv_heads);
    if (head_groups > 0) n += " head_groups=" + std::to_string(head_groups);
    if (row_parts > 0) n += " row_parts=" + std::to_string(row_parts);
    if (load_balance) n += std::string("+lb:") + to_string(form);
    if (kv_policy == KVHeadPolicy::kRepeat)
      n += " kv_heads=" + std::to_string(kv_heads) + " repeat";
    return n;
  }
};

ContextParallelConfig config_for(const Case& c, int p, CPSchedule schedule) {
  ContextParallelConfig cfg;
  cfg.algorithm = c.algorithm;
  cfg.ulysses_degree = c.degree;
  cfg.schedule = schedule;
  cfg.load_balance = c.load_balance;
  cfg.load_balance_form = c.form;
  cfg.kv_head_policy = c.kv_policy;
  if (schedule == CPSchedule::kAsync) cfg.ulysses_head_groups = c.head_groups;
  if (schedule == CPSchedule::kAsync) cfg.ulysses_row_parts = c.row_parts;
  cfg.async_always_local_first = c.always_local_first;
  cfg.ring_keep_blocks = c.keep_blocks;
  cfg.ring_backward = c.ring_backward;
  return *normalize(cfg, p);
}

// doc_ids [B, S]: the packed case, checked against every document run alone.
void run_case(const Case& c, int p, CPSchedule schedule, bool causal,
              const at::Tensor& doc_ids = {}) {
  auto q = f64(1, {kB, kNq, kS, kDqk}), k = f64(2, {kB, c.kv_heads, kS, kDqk}),
       v = f64(3, {kB, c.kv_heads, kS, kDv}), dout = f64(4, {kB, kNq, kS, kDv});
  auto rq = q.clone().requires_grad_(true), rk = k.clone().requires_grad_(true),
       rv = v.clone().requires_grad_(true);
  auto ref =
      doc_ids.defined()
          ? hp::testing::reference_packed_attention(rq, rk, rv, doc_ids, causal)
          : hp::testing::reference_attention(rq, rk, rv, Direct::options(causal).attention).out;
  ref.backward(dout);
  const auto cfg = config_for(c, p, schedule);
  // Data-order head-tail shards hold chunks {2r, 2P-2r-1}; every other case contiguous shards.
  const bool data_order = c.load_balance && c.form == LoadBalanceForm::kDataOrder;
  run_ranks(p, [&](comm::World& w) {
    Direct m(causal, doc_ids, c.primitive, c.bshd);
    ASSERT_EQ(apply_cp(m, w, cfg), to_string(schedule));
    const int64_t r = w.rank();
    // This rank's shard of a global BNSD tensor, in the module's layout.
    auto mine = [&](const at::Tensor& full) {
      auto s = shard_sequence(full, 2, r, p, data_order);
      return c.bshd ? s.transpose(1, 2).contiguous() : s;
    };
    auto lq = mine(q).requires_grad_(true), lk = mine(k).requires_grad_(true),
         lv = mine(v).requires_grad_(true);
    const std::string what = c.name() + " " + to_string(schedule) +
                             (causal ? " causal" : " dense") +
                             (doc_ids.defined() ? " packed" : "") + " P=" + std::to_string(p) +
                             " rank " + std::to_string(r);
    // The ring's routes (ring, usp): each rank's counted bytes equal the formula, which counts
    // the chunks a causal layer sends only where they are attended (volume.h).
    auto& counters = w.context().counters;
    const bool ring = c.algorithm == "ring" || c.algorithm == "usp";
    AttentionShape shape{kS, kNq, c.kv_heads, kDqk, kB, 8, kDv};
    shape.causal = causal;
    counters.reset();
    auto out = m.forward(lq, lk, lv);
    if (ring && !doc_ids.defined()) {
      EXPECT_EQ(counters.total_bytes(), forward_bytes_per_rank(cfg, p, shape, r)) << what;
    }
    counters.reset();
    out.backward(mine(dout));
    if (ring && !doc_ids.defined()) {
      EXPECT_EQ(counters.total_bytes(), backward_bytes_per_rank(cfg, p, shape, r)) << what;
    }
    ASSERT_EQ(out.scalar_type(), at::kDouble) << what;
    ASSERT_EQ(out.size(-1), kDv) << what;
    expect_close(out, mine(ref.detach()), what + " out", 1e-10, 1e-10);
    expect_close(lq.grad(), mine(rq.grad()), what + " dq", 1e-10, 1e-10);
    expect_close(lk.grad(), mine(rk.grad()), what + " dk", 1e-10, 1e-10);
    expect_close(lv.grad(), mine(rv.grad()), what + " dv", 1e-10, 1e-10);
  });
}

void run_grid(const Case& c, std::vector<int> ps) {
  for (int p : ps) {
    for (auto schedule : {CPSchedule::kSync, CPSchedule::kAsync}) {
      for (bool causal : {true, false}) {
        SCOPED_TRACE(c.name() + " P=" + std::to_string(p));
        run_case(c, p, schedule, causal);
      }
    }
  }
}

TEST(CPFloat64, AllGather) {
  run_grid({"all_gather", std::nullopt}, {2, 3, 4});
}
TEST(CPFloat64, AllGatherHeadTailDataOrder) {
  run_grid({"all_gather", std::nullopt, true, LoadBalanceForm::kDataOrder}, {2, 3, 4});
}
// Async all_gather attends each part in one call once the K/V have landed (threads-as-ranks:
// mostly so); async_always_local_first keeps the local-first split for every part.
TEST(CPFloat64, AllGatherAlwaysLocalFirst) {
  for (bool lb : {false, true}) {
    Case c{"all_gather", std::nullopt, lb};
    c.always_local_first = true;
    for (int p : {2, 3, 4}) {
      for (bool causal : {true, false})
        run_case(c, p, CPSchedule::kAsync, causal);
    }
  }
}
TEST(CPFloat64, AllGatherHeadTailRuntimeSwap) {
  run_grid({"all_gather", std::nullopt, true, LoadBalanceForm::kRuntimeSwap}, {2, 3, 4});
}
TEST(CPFloat64, Ulysses) {
  run_grid({"ulysses", std::nullopt}, {2, 3});
}
TEST(CPFloat64, HybridU2) {
  run_grid({"hybrid", 2}, {4});
}
TEST(CPFloat64, HybridU3) {
  run_grid({"hybrid", 3}, {6});
}
// Data-order head-tail shards: after the all-to-all a co-rank holds its Ulysses group's
// chunks, one query part each; the co-group gather brings the P shards in rank order.
TEST(CPFloat64, HybridHeadTailDataOrder) {
  run_grid({"hybrid", 2, true, LoadBalanceForm::kDataOrder}, {4, 6});
  run_grid({"hybrid", 3, true, LoadBalanceForm::kDataOrder}, {6});
}
// Async hybrid's local-first split for every part (the default drops it once the co-group
// gathers have landed, which threads-as-ranks mostly reach after the first part).
TEST(CPFloat64, HybridAlwaysLocalFirst) {
  for (bool lb : {false, true}) {
    Case c{"hybrid", 2, lb, LoadBalanceForm::kDataOrder};
    c.always_local_first = true;
    for (bool causal : {true, false})
      run_case(c, 4, CPSchedule::kAsync, causal);
  }
}
TEST(CPFloat64, Ring) {
  run_grid({"ring", std::nullopt}, {2, 3, 4});
}
TEST(CPFloat64, UspU2) {
  run_grid({"usp", 2}, {4, 6});
}
TEST(CPFloat64, UspHeadTailDataOrder) {
  run_grid({"usp", 2, true, LoadBalanceForm::kDataOrder}, {4, 6});
  run_grid({"usp", 3, true, LoadBalanceForm::kDataOrder}, {6});
}
TEST(CPFloat64, UspU3) {
  run_grid({"usp", 3}, {6});
}
TEST(CPFloat64, UspRepeatsKVHeads) {
  Case c{"usp", 2};
  c.kv_policy = KVHeadPolicy::kRepeat;
  c.kv_heads = 1;
  run_grid(c, {4});
}
TEST(CPFloat64, RingHeadTailDataOrder) {
  run_grid({"ring", std::nullopt, true, LoadBalanceForm::kDataOrder}, {2, 3, 4});
}
// BSHD modules (q/k/v [B, S, N, D], the sequence in dim 1): the ring's chunks, merges and
// statistics, usp's all-to-alls and rings, and the other strategies, balanced and not.
TEST(CPFloat64, RingAndUspBSHD) {
  for (bool lb : {false, true}) {
    Case ring{"ring", std::nullopt, lb, LoadBalanceForm::kDataOrder};
    ring.bshd = true;
    run_grid(ring, {2, 3, 4});
    Case usp{"usp", 2, lb, LoadBalanceForm::kDataOrder};
    usp.bshd = true;
    run_grid(usp, {4});
  }
  Case queries{"ring", std::nullopt, true, LoadBalanceForm::kDataOrder};
  queries.bshd = true;
  queries.ring_backward = RingBackward::kQueries;
  run_grid(queries, {3});
  Case kept{"ring", std::nullopt, true, LoadBalanceForm::kDataOrder};
  kept.bshd = true;
  kept.keep_blocks = true;
  run_grid(kept, {3});
}
TEST(CPFloat64, AllGatherUlyssesHybridBSHD) {
  for (bool lb : {false, true}) {
    for (Case c : {Case{"all_gather", std::nullopt, lb}, Case{"ulysses", std::nullopt},
                   Case{"hybrid", 2, lb}}) {
      if (lb && c.algorithm == "ulysses") continue;
      c.bshd = true;
      run_grid(c, {c.algorithm == "hybrid" ? 4 : 3});
    }
  }
}
// ring_keep_blocks: forward keeps the blocks that arrived and backward sends only the
// accumulators; the same gradients from the merged statistics (blockwise) and from the
// recomputing backward (math), balanced and not, and through usp's rings.
TEST(CPFloat64, RingKeepBlocks) {
  for (bool lb : {false, true}) {
    Case c{"ring", std::nullopt, lb, LoadBalanceForm::kDataOrder};
    c.keep_blocks = true;
    run_grid(c, {2, 3, 4});
    c.primitive = "math";
    run_grid(c, {3});
  }
  Case u{"usp", 2, true, LoadBalanceForm::kDataOrder};
  u.keep_blocks = true;
  run_grid(u, {4});
}
// The ring's recomputing backward: the math primitive offers no backward_from_stats, so each
// travelled block's calls are recomputed and the own block's graphs kept from forward (the
// blockwise cases above take every gradient from the merged out/lse).
TEST(CPFloat64, RingRecomputesWhereThePrimitiveOffersNoStatsBackward) {
  for (bool lb : {false, true}) {
    Case c{"ring", std::nullopt, lb, LoadBalanceForm::kDataOrder};
    c.primitive = "math";
    run_grid(c, {2, 3});
  }
  Case u{"usp", 2};
  u.primitive = "math";
  run_grid(u, {4});
}
// ring_backward=queries: each rank's [q | dout] and [lse | delta] travel the other way with
// their dQ accumulators, dK/dV stay home; from the merged statistics (blockwise) and recomputed
// (math, the own block's graphs kept from forward), balanced and not, GQA (the test's 12 / 6
// heads, where auto keeps the blocks) and multi-head (12 / 12, where auto takes the queries), and
// through usp's rings. ring_backward=blocks on multi-head keeps the blocks travelling.
TEST(CPFloat64, RingQueriesTravel) {
  for (bool lb : {false, true}) {
    Case c{"ring", std::nullopt, lb, LoadBalanceForm::kDataOrder};
    c.ring_backward = RingBackward::kQueries;
    run_grid(c, {2, 3, 4});
    c.primitive = "math";
    run_grid(c, {3});
    Case mha{"ring", std::nullopt, lb, LoadBalanceForm::kDataOrder};
    mha.kv_heads = kNq;
    run_grid(mha, {2, 4});
    mha.ring_backward = RingBackward::kBlocks;
    run_grid(mha, {3});
  }
  Case u{"usp", 2, true, LoadBalanceForm::kDataOrder};
  u.ring_backward = RingBackward::kQueries;
  run_grid(u, {4});
  u.primitive = "math";
  run_grid(u, {4});
}
// Async ulysses in head groups (P=2: 6 query and 3 K/V heads per rank; automatic = 3 groups),
// against the reference; the sync half of the grid ignores the field. Q, K and V travel in one
// piece per group of their own heads (automatic: 3 of 6 or 3 heads, 4 of 4, 2 of 2), so with
// GQA the pieces need not fall on the attention's groups: P=3 with 4 query and 2 K/V heads
// per rank attends 2 groups, each from two query pieces; P=2 with 6 and 2 attends 2 groups
// from three query pieces (joined, then cut).
TEST(CPFloat64, UlyssesHeadGroups) {
  for (int64_t g : {1, 3}) {
    Case c{"ulysses", std::nullopt};
    c.head_groups = g;
    run_grid(c, {2});
  }
  Case gqa{"ulysses", std::nullopt};
  gqa.kv_heads = 6;
  run_grid(gqa, {3});
  gqa.kv_heads = 4;
  gqa.head_groups = 2;
  run_grid(gqa, {2});
  gqa.head_groups = 0;
  run_grid(gqa, {2});
}

// Async ulysses sends its last head group's output in row parts (automatic: one at these
// sizes, each rank holding 12-24 rows): 2 parts, 5 (uneven: 4 and 5 rows of each rank's 24 at
// P = 2; 2 and 3 of 12 at P = 4) and more parts than rows (clamped to one row each: 16 of the
// 16 rows at P = 3), with one head group and three, GQA, causal and dense, against the
// reference (the sync half of the grid ignores the field).
TEST(CPFloat64, UlyssesRowParts) {
  for (int64_t parts : {2, 5}) {
    for (int64_t g : {1, 3}) {
      Case c{"ulysses", std::nullopt};
      c.head_groups = g;
      c.row_parts = parts;
      run_grid(c, {2});
    }
    Case gqa{"ulysses", std::nullopt};
    gqa.kv_heads = 3;
    gqa.row_parts = parts;
    run_grid(gqa, {3});
  }
  Case p4{"ulysses", std::nullopt};
  p4.kv_heads = 4;
  p4.row_parts = 5;
  run_grid(p4, {4});
  Case clamped{"ulysses", std::nullopt};
  clamped.kv_heads = 3;
  clamped.row_parts = 40;
  run_grid(clamped, {3});
  // Documents across the parts' rows and the rank boundaries.
  Case packed{"ulysses", std::nullopt};
  packed.row_parts = 3;
  auto ids = at::cat({attention::document_ids_from_cu_seqlens({0, 5, 19, 29, 33}, kS),
                      attention::document_ids_from_cu_seqlens({0, 30, kS}, kS)});
  for (int p : {2, 3}) {
    for (bool causal : {true, false}) {
      SCOPED_TRACE(packed.name() + " packed P=" + std::to_string(p));
      run_case(packed, p, CPSchedule::kAsync, causal, ids);
    }
  }
}

// Async all_gather in head groups (12 query and 6 K/V heads; automatic = 6 groups, which the
// all_gather grids above run): 2 and 3 groups, balanced and not, and GQA with 2 K/V heads
// (automatic = 2), against the reference; the sync half of the grid ignores the field.
TEST(CPFloat64, AllGatherHeadGroups) {
  for (int64_t g : {2, 3}) {
    for (bool lb : {false, true}) {
      Case c{"all_gather", std::nullopt, lb, LoadBalanceForm::kDataOrder};
      c.head_groups = g;
      run_grid(c, {2, 4});
    }
  }
  Case gqa{"all_gather", std::nullopt, true, LoadBalanceForm::kDataOrder};
  gqa.kv_heads = 2;
  run_grid(gqa, {3});
}

// Async hybrid in head groups (P=4, U=2: 6 query and 3 K/V heads per rank after the
// all-to-all; automatic = 3, which the hybrid grids above run): one group (the whole heads) and
// 3, balanced and not, local first for every part, and GQA whose pieces do not fall on the
// attention's groups (4 K/V heads: 3 query pieces of 2 heads, 2 K/V pieces of 1, attended in
// 2 groups), against the reference; the sync half of the grid ignores the field.
TEST(CPFloat64, HybridHeadGroups) {
  for (int64_t g : {1, 3}) {
    for (bool lb : {false, true}) {
      Case c{"hybrid", 2, lb, LoadBalanceForm::kDataOrder};
      c.head_groups = g;
      run_grid(c, {4});
      c.always_local_first = true;
      run_case(c, 4, CPSchedule::kAsync, true);
    }
  }
  Case gqa{"hybrid", 2, true, LoadBalanceForm::kDataOrder};
  gqa.kv_heads = 4;
  run_grid(gqa, {4});
}

// Async usp in head groups (P=4, U=2: 6 query and 3 K/V heads per rank; automatic = 3
// groups, a ring each), against the reference, balanced and not.
TEST(CPFloat64, UspHeadGroups) {
  for (int64_t g : {1, 3}) {
    for (bool lb : {false, true}) {
      Case c{"usp", 2, lb, LoadBalanceForm::kDataOrder};
      c.head_groups = g;
      for (bool causal : {true, false})
        run_case(c, 4, CPSchedule::kAsync, causal);
    }
  }
}

// kv_head_policy=repeat: fewer K/V heads than the Ulysses degree; each is repeated for its
// readers and the all-to-all hands every rank only the one its query heads read.
// Async: the query heads in groups (automatic: 3 at P = 4, 3 at P = 2, 4 at P = 3; one; and 3
// with two row parts), each rank's one repeated K/V head shared by every group; BSHD too.
TEST(CPFloat64, UlyssesRepeatsKVHeads) {
  Case c{"ulysses", std::nullopt};
  c.kv_policy = KVHeadPolicy::kRepeat;
  c.kv_heads = 2;
  run_grid(c, {4});
  c.head_groups = 1;
  run_grid(c, {4});
  c.head_groups = 3;
  c.row_parts = 2;
  run_grid(c, {4});
  c = Case{"ulysses", std::nullopt};
  c.kv_policy = KVHeadPolicy::kRepeat;
  c.kv_heads = 1;
  run_grid(c, {2, 3});
  c.bshd = true;
  run_grid(c, {2, 3});
}
// Async: the query heads in groups (automatic 3: 6 per rank), each rank's one K/V head
// co-gathered once and read by every group; one group; balanced, and with the local-first
// split for every group.
TEST(CPFloat64, HybridRepeatsKVHeads) {
  Case c{"hybrid", 2};
  c.kv_policy = KVHeadPolicy::kRepeat;
  c.kv_heads = 1;
  run_grid(c, {4});
  c.head_groups = 1;
  run_grid(c, {4});
  c.head_groups = 2;
  c.load_balance = true;
  run_grid(c, {4});
  c.always_local_first = true;  // the later groups split against the cached gathered K/V
  run_grid(c, {4});
}

// Packed documents through every strategy, sync and async, causal and not, balanced where the
// strategy balances: the packed batch equals every document run alone (outputs and gradients).
// Row 0: documents of 3, 14, 1, 15 and 15 positions (shorter than a shard, one token, and
// spanning shard boundaries for every P); row 1: two documents of 21 and 27.
TEST(CPFloat64, PackedDocumentsEqualEachDocumentAlone) {
  auto ids = at::cat({attention::document_ids_from_cu_seqlens({0, 3, 17, 18, 33}, kS),
                      attention::document_ids_from_cu_seqlens({0, 21, kS}, kS)});
  auto local_first = [](Case c) {
    c.always_local_first = true;
    return c;
  };
  auto kept = [](Case c) {
    c.keep_blocks = true;
    return c;
  };
  auto repeated = [](Case c) {  // one K/V head: the repeat path
    c.kv_heads = 1;
    c.kv_policy = KVHeadPolicy::kRepeat;
    return c;
  };
  const std::vector<std::pair<Case, std::vector<int>>> grid = {
      {local_first({"all_gather", std::nullopt}), {3}},
      {local_first({"all_gather", std::nullopt, true}), {2, 4}},
      {{"all_gather", std::nullopt}, {2, 3}},
      {{"all_gather", std::nullopt, true, LoadBalanceForm::kDataOrder}, {2, 4}},
      {{"all_gather", std::nullopt, true, LoadBalanceForm::kRuntimeSwap}, {3}},
      {{"ulysses", std::nullopt}, {2, 3}},
      {{"hybrid", 2}, {4}},
      {{"hybrid", 2, true, LoadBalanceForm::kDataOrder}, {4}},
      {local_first({"hybrid", 2, true, LoadBalanceForm::kDataOrder}), {4}},
      {{"ring", std::nullopt}, {2, 3, 4}},
      {{"ring", std::nullopt, true, LoadBalanceForm::kDataOrder}, {2, 3}},
      {kept({"ring", std::nullopt}), {3, 4}},
      {{"usp", 2}, {4}},
      {{"usp", 2, true, LoadBalanceForm::kDataOrder}, {4}},
      {repeated({"ulysses", std::nullopt}), {2}},
      {repeated({"hybrid", 2, true, LoadBalanceForm::kDataOrder}), {4}}};
  for (const auto& [c, ps] : grid) {
    for (int p : ps) {
      for (auto schedule : {CPSchedule::kSync, CPSchedule::kAsync}) {
        for (bool causal : {true, false}) {
          SCOPED_TRACE(c.name() + " packed P=" + std::to_string(p));
          run_case(c, p, schedule, causal, ids);
        }
      }
    }
  }
}

// NaN in, NaN out through every strategy and schedule: one NaN query (token 13 of head 5) gives
// exactly that (token, head) row of the output NaN, never a silent zero.
TEST(CPNaN, NanQueryRowStaysNanThroughEveryStrategy) {
  for (const auto& [c, p] : {std::pair<Case, int>{{"all_gather", std::nullopt}, 2},
                             {{"all_gather", std::nullopt, true}, 2},
                             {{"ulysses", std::nullopt}, 2},
                             {{"hybrid", 2}, 4}}) {
    for (auto schedule : {CPSchedule::kSync, CPSchedule::kAsync}) {
      auto q = f64(1, {1, kNq, kS, kDqk}), k = f64(2, {1, kNkv, kS, kDqk}),
           v = f64(3, {1, kNkv, kS, kDv});
      q[0][5][13].fill_(std::numeric_limits<double>::quiet_NaN());
      const auto cfg = config_for(c, p, schedule);
      std::vector<at::Tensor> outs(p);
      run_ranks(p, [&](comm::World& w) {
        Direct m(true);
        apply_cp(m, w, cfg);
        auto mine = [&](const at::Tensor& full) {
          return shard_sequence(full, 2, w.rank(), p, c.load_balance);
        };
        outs[w.rank()] = m.forward(mine(q), mine(k), mine(v)).detach();
      });
      auto out = unshard_sequence(outs, 2, c.load_balance);
      const std::string what = c.name() + " " + to_string(schedule);
      EXPECT_TRUE(out[0][5][13].isnan().all().item<bool>()) << what;
      EXPECT_EQ(out.isnan().any(-1).sum().item<int64_t>(), 1) << what;
    }
  }
}

}  // namespace
}  // namespace hp::cp
