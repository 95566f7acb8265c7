// The whole CP path in float64 against the plain-formula reference (tests/harness, no code
// shared with the kernels): every built-in strategy (all_gather plain and with both head-tail
// forms, ulysses, hybrid plain and head-tail), sync and async, causal and not, P in {2, 3, 4}, GQA,
// and a value head dim that differs from the query/key one (Dqk 8, Dv 6, as MLA's 192 / 128).
#include <algorithm>
#include <array>
#include <limits>
#include <map>
#include <optional>
#include <set>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "cp_direct.h"
#include "cp_test_util.h"
#include "hp/attention/core_attention.h"
#include "hp/comm/collectives.h"
#include "hp/comm/device_mesh.h"
#include "hp/common/check.h"
#include "hp/common/trace.h"
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
  std::string name() const {
    std::string n = algorithm + (degree ? "(U=" + std::to_string(*degree) + ")" : "");
    if (primitive != "blockwise") n += " primitive=" + primitive;
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
    Direct m(causal, doc_ids, c.primitive);
    ASSERT_EQ(apply_cp(m, w, cfg), to_string(schedule));
    const int64_t r = w.rank();
    auto mine = [&](const at::Tensor& full) { return shard_sequence(full, 2, r, p, data_order); };
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

// An async config of `algorithm` in `groups` head groups (0: automatic), with Ulysses degree
// `u` where given.
ContextParallelConfig grouped_config(const char* algorithm, int64_t groups,
                                     std::optional<int64_t> u = std::nullopt) {
  ContextParallelConfig cfg;
  cfg.algorithm = algorithm;
  cfg.ulysses_degree = u;
  cfg.schedule = CPSchedule::kAsync;
  cfg.ulysses_head_groups = groups;
  return cfg;
}

// One async forward (and, with `backward`, its backward) of `norm` over p ranks (causal,
// contiguous shards): every rank's recorded collectives in order, and rank 0's all-to-all
// launches, waits and attention starts (sorted), split at the end of its forward.
struct GroupedForward {
  std::vector<std::vector<std::string>> schedules;  // [rank]
  std::vector<int64_t> a2a_launch, a2a_wait, attention_begin;
  std::vector<int64_t> gather_launch, gather_wait, scatter_launch;  // all_gather, reduce_scatter
  std::vector<int64_t> shift_wait;  // the ring's shifts (rank 0's causal blocks only leave)
  int64_t forward_end = 0;          // rank 0
};
GroupedForward grouped_forward(const ContextParallelConfig& norm, int p, bool backward = false,
                               int64_t nkv = kNkv) {
  GroupedForward f;
  f.schedules.resize(p);
  auto tracer = std::make_shared<common::Tracer>();
  hp::testing::RankOptions ro;
  ro.tracer = tracer;
  run_ranks(
      p,
      [&](comm::World& w) {
        Direct m(true);
        apply_cp(m, w, norm);
        auto mine = [&](const at::Tensor& full) {
          return shard_sequence(full, 2, w.rank(), p, false).requires_grad_(backward);
        };
        auto& rec = *w.context().recorder;
        rec.clear();
        auto out = m.forward(mine(f64(1, {1, kNq, kS, kDqk})), mine(f64(2, {1, nkv, kS, kDqk})),
                             mine(f64(3, {1, nkv, kS, kDv})));
        if (w.rank() == 0) f.forward_end = common::Tracer::now_us();
        if (backward) out.sum().backward();
        f.schedules[w.rank()] = rec.schedule();
      },
      ro);
  for (const auto& e : tracer->events()) {
    if (e.rank != 0) continue;
    if (e.category == "comm" && e.name == "all_to_all") f.a2a_launch.push_back(e.begin_us);
    if (e.category == "comm_wait" && e.name == "wait all_to_all") f.a2a_wait.push_back(e.begin_us);
    if (e.name == "attention") f.attention_begin.push_back(e.begin_us);
    if (e.category == "comm" && e.name == "all_gather") f.gather_launch.push_back(e.begin_us);
    if (e.category == "comm_wait" && e.name == "wait all_gather")
      f.gather_wait.push_back(e.begin_us);
    if (e.category == "comm" && e.name == "reduce_scatter") f.scatter_launch.push_back(e.begin_us);
    if (e.category == "comm_wait" && (e.name == "wait recv" || e.name == "wait send"))
      f.shift_wait.push_back(e.begin_us);
  }
  for (auto* v : {&f.a2a_launch, &f.a2a_wait, &f.attention_begin, &f.gather_launch, &f.gather_wait,
                  &f.scatter_launch, &f.shift_wait})
    std::sort(v->begin(), v->end());
  return f;
}

// A call's backward on the tracer spans the nodes between its outputs and its inputs, not only
// the node behind its output: with the math primitive that node is a reshape, and the matmuls
// and softmax of its backward run after it. Sync all_gather, P = 2, one call per rank. The
// event begins as the engine takes the call's first node (with the hook on `out`, which runs
// just before that node; within 1 ms, or a quarter of the span on a loaded machine), ends before
// the last of q, k, v has its gradient, and covers most of the time from the output's gradient to
// q's (the rank's q is used by that call only).
TEST(CPTrace, EachCallsBackwardSpansItsWholeGraph) {
  for (const std::string primitive : {"math", "blockwise"}) {
    auto tracer = std::make_shared<common::Tracer>();
    hp::testing::RankOptions ro;
    ro.tracer = tracer;
    // Per rank: when out's, q's, k's and v's gradients were computed.
    std::vector<std::array<int64_t, 4>> grad_at(2, {-1, -1, -1, -1});
    ContextParallelConfig cfg;
    cfg.algorithm = "all_gather";
    run_ranks(
        2,
        [&](comm::World& w) {
          Direct m(true, {}, primitive);
          apply_cp(m, w, *normalize(cfg, 2));
          auto gen = at::make_generator<at::CPUGeneratorImpl>(7 + w.rank());
          auto& at_ = grad_at[w.rank()];
          auto stamp = [&at_](int i) {
            return [&at_, i](const at::Tensor&) { at_[i] = common::Tracer::now_us(); };
          };
          std::vector<at::Tensor> qkv;
          for (int i = 1; i <= 3; ++i) {
            qkv.push_back(at::randn({1, 4, 192, 32}, gen).requires_grad_(true));
            qkv.back().register_hook(stamp(i));
          }
          auto out = m.forward(qkv[0], qkv[1], qkv[2]);
          out.register_hook(stamp(0));
          out.sum().backward();
        },
        ro);
    for (int rank : {0, 1}) {
      std::vector<common::TraceEvent> forward, backward;
      for (const auto& e : tracer->events()) {
        if (e.rank != rank || e.category != "compute") continue;
        (e.name == "attention" ? forward : backward).push_back(e);
      }
      ASSERT_EQ(forward.size(), 1u) << primitive << " rank " << rank;
      ASSERT_EQ(backward.size(), 1u) << primitive << " rank " << rank;
      const auto& e = backward[0];
      const auto& t = grad_at[rank];
      EXPECT_EQ(e.name, "attention_backward");
      ASSERT_TRUE(t[0] > 0 && t[1] > t[0]) << primitive << " rank " << rank;
      // Begins with the call's first node: within 1 ms of out's hook, or a quarter of the
      // backward's span where a loaded machine (ASan in CI) stretches it (2.3 ms seen once).
      const int64_t slack = std::max<int64_t>(1000, (t[1] - t[0]) / 4);
      EXPECT_LE(std::abs(e.begin_us - t[0]), slack) << primitive << " rank " << rank;
      EXPECT_LE(e.end_us, std::max({t[1], t[2], t[3]})) << primitive << " rank " << rank;
      EXPECT_GE(e.end_us - e.begin_us, (t[1] - t[0]) / 2)
          << primitive << " rank " << rank << ": the event covers " << e.end_us - e.begin_us
          << " us of the " << t[1] - t[0] << " us from out's gradient to q's";
    }
  }
}

// How many of `times` lie in [from, to).
int64_t count_between(const std::vector<int64_t>& times, int64_t from, int64_t to) {
  return std::count_if(times.begin(), times.end(), [&](int64_t t) { return t >= from && t < to; });
}

// Async ulysses in head groups (P=2: 6 query and 3 K/V heads per rank, 3 groups). Q, K and V
// each travel in one all-to-all per group ([1, 4, 24, 8], [1, 2, 24, 8], [1, 2, 24, 6]: the
// group's heads for both ranks, the local positions), launched group by group (Q0 K0 V0 Q1
// ...: the later groups' pieces are held until group 0's have been waited for, so these have
// the wire to themselves), and each group's output in one
// ([1, 2, 48, 6]: 2 heads of the group, the whole sequence), the last group's in two row parts
// ([1, 2, 24, 6]: rows 0-11 of both ranks' chunks, then rows 12-23). Rank 0 waits for group 0's
// three pieces, attends group 0 and starts its output all-to-all before it waits for group 1's
// pieces, the first group's output flies while a later group is attended, and the last group's
// first part while its second is attended. In backward the second part's output gradient
// leaves first and each earlier one only once the later one's has arrived; the gradients of the
// last group's pieces leave before rank 0 waits for the second group's output gradient, i.e.
// while the earlier groups' backward is still to run. A count that does
// not divide the heads per rank, or one given to another schedule or strategy, is refused
// before any collective.
TEST(UlyssesHeadGroups, EachGroupsPiecesAndOutputTravelWhileOtherGroupsAreAttended) {
  const int p = 2;
  auto cfg = grouped_config("ulysses", 3);
  cfg.ulysses_row_parts = 2;
  const auto f = grouped_forward(*normalize(cfg, p), p, /*backward=*/true);
  const std::vector<std::string> pieces = {"all_to_all(cp)[1,4,24,8]", "all_to_all(cp)[1,2,24,8]",
                                           "all_to_all(cp)[1,2,24,6]"};
  for (const auto& sched : f.schedules) {
    ASSERT_EQ(sched.size(), 26u) << ::testing::PrintToString(sched);
    // Group by group on the wire, the roles in handoff order (this module's is V, K, Q): the
    // first three are one piece of each role, and the next groups repeat them.
    EXPECT_EQ(std::set<std::string>(sched.begin(), sched.begin() + 3),
              std::set<std::string>(pieces.begin(), pieces.end()))
        << ::testing::PrintToString(sched);
    for (size_t i = 3; i < 9; ++i)
      EXPECT_EQ(sched[i], sched[i % 3]) << i << " in " << ::testing::PrintToString(sched);
    for (size_t i = 9; i < 13; ++i)
      EXPECT_EQ(sched[i], i < 11 ? "all_to_all(cp)[1,2,48,6]" : "all_to_all(cp)[1,2,24,6]");
    EXPECT_EQ(sched[13], "all_to_all(cp)[1,4,12,6]");  // part 1's output gradient first
    EXPECT_EQ(sched[14], "all_to_all(cp)[1,4,12,6]");
    EXPECT_EQ(sched[15], "all_to_all(cp)[1,4,24,6]");
  }
  // Forward: 13 launches and waits; backward: 13 launches (the last group's second part's
  // output gradient, then each earlier one once the later one's has arrived, the pieces'
  // gradients as their group's backward ends), 13 waits (4 output gradients, then the pieces'
  // at the projections).
  const size_t b = 13;
  ASSERT_EQ(count_between(f.a2a_launch, 0, f.forward_end), 13);
  ASSERT_EQ(count_between(f.a2a_wait, 0, f.forward_end), 13);
  ASSERT_EQ(f.a2a_launch.size(), 26u);
  ASSERT_EQ(f.a2a_wait.size(), 26u);
  EXPECT_GE(f.a2a_launch[3], f.a2a_wait[2])
      << "the later groups' pieces must be held until group 0's have been waited for";
  EXPECT_LT(f.a2a_launch[8], f.attention_begin.back())
      << "the later groups' pieces must fly while group 0 is attended";
  EXPECT_GT(count_between(f.attention_begin, f.a2a_wait[2], f.a2a_wait[3]), 0)
      << "group 0 must be attended between the waits for its pieces and group 1's";
  EXPECT_LE(f.a2a_launch[9], f.a2a_wait[3])
      << "group 0's output all-to-all must start before group 1's pieces are waited for";
  EXPECT_LT(f.a2a_launch[9], f.attention_begin.back())
      << "the first group's output all-to-all must fly while a later group is attended";
  EXPECT_LT(f.a2a_launch[11], f.attention_begin.back())
      << "the last group's first row part must fly while its second is attended";
  for (size_t i = 1; i < 3; ++i) {
    EXPECT_GE(f.a2a_launch[b + i], f.a2a_wait[b + i - 1])
        << "output gradient " << i << " must leave only once the one before has arrived";
  }
  EXPECT_LE(f.a2a_launch[b + 3], f.a2a_wait[b + 2])
      << "the last group's gradients must leave before the second group's output gradient is "
         "awaited";

  cfg.ulysses_row_parts = -1;
  HP_EXPECT_ERROR(normalize(cfg, p), "cp_config.ulysses_row_parts=-1 must be >= 0");
  cfg.ulysses_row_parts = 2;
  cfg.ulysses_head_groups = 4;
  HP_EXPECT_ERROR(check_heads(*normalize(cfg, p), p, kNq, kNkv),
                  "cp_config.ulysses_head_groups=4 does not divide the 6 query and 3 key/value "
                  "heads each rank attends");
  cfg.schedule = CPSchedule::kSync;
  HP_EXPECT_ERROR(normalize(cfg, p),
                  "cp_config.ulysses_head_groups=4 applies to "
                  "algorithm=ulysses, hybrid, usp or all_gather with schedule=async (got ulysses, "
                  "sync)");
  cfg.algorithm = "ring";
  cfg.ulysses_degree.reset();
  cfg.schedule = CPSchedule::kAsync;
  HP_EXPECT_ERROR(normalize(cfg, 4),
                  "applies to algorithm=ulysses, hybrid, usp or all_gather with schedule=async "
                  "(got ring, async)");
  // Row parts belong to async ulysses alone.
  cfg.ulysses_head_groups = 0;
  cfg.algorithm = "hybrid";
  cfg.ulysses_degree = 2;
  HP_EXPECT_ERROR(normalize(cfg, 4),
                  "cp_config.ulysses_row_parts=2 applies to algorithm=ulysses with "
                  "schedule=async (got hybrid, async); drop it or use the async ulysses schedule");
  cfg.algorithm = "ulysses";
  cfg.ulysses_degree.reset();
  cfg.schedule = CPSchedule::kSync;
  HP_EXPECT_ERROR(normalize(cfg, p), "(got ulysses, sync)");
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

// Async all_gather in head groups (P=2, 3 groups of 2 K/V heads): K and V each travel in one
// all-gather per group ([1, 2, 24, 8] and [1, 2, 24, 6]: the group's heads, the local
// positions), launched group by group in handoff order (this module's is V, K): the later
// groups' pieces are held until group 0's have been waited for, then fly while group 0 is
// attended. In backward each piece's gradient is reduce-scattered on its own (six of the
// group's shape over the whole sequence). A count that does not divide the K/V heads is
// refused before any collective.
TEST(AllGatherHeadGroups, LaterGroupsKVTravelWhileGroupZeroIsAttended) {
  const int p = 2;
  auto cfg = grouped_config("all_gather", 3);
  const auto f = grouped_forward(*normalize(cfg, p), p, /*backward=*/true);
  for (const auto& sched : f.schedules) {
    ASSERT_EQ(sched.size(), 12u) << ::testing::PrintToString(sched);
    EXPECT_EQ(std::set<std::string>(sched.begin(), sched.begin() + 2),
              (std::set<std::string>{"all_gather(cp)[1,2,24,8]", "all_gather(cp)[1,2,24,6]"}))
        << ::testing::PrintToString(sched);
    for (size_t i = 2; i < 6; ++i)
      EXPECT_EQ(sched[i], sched[i % 2]) << i << " in " << ::testing::PrintToString(sched);
    std::multiset<std::string> back(sched.begin() + 6, sched.end());
    EXPECT_EQ(back.count("reduce_scatter(cp)[1,2,48,8]"), 3u) << ::testing::PrintToString(sched);
    EXPECT_EQ(back.count("reduce_scatter(cp)[1,2,48,6]"), 3u) << ::testing::PrintToString(sched);
  }
  ASSERT_EQ(count_between(f.gather_launch, 0, f.forward_end), 6);
  ASSERT_EQ(count_between(f.gather_wait, 0, f.forward_end), 6);
  ASSERT_EQ(f.scatter_launch.size(), 6u);
  EXPECT_GE(f.gather_launch[2], f.gather_wait[1])
      << "the later groups' pieces must be held until group 0's have been waited for";
  EXPECT_LT(f.gather_launch[5], f.attention_begin.back())
      << "the later groups' pieces must fly while group 0 is attended";
  // Rank 0's causal queries see no remote key: group 1's first call comes after group 0's
  // waits and before group 2's.
  EXPECT_GT(count_between(f.attention_begin, f.gather_wait[1], f.gather_wait[4]), 0)
      << "group 1 must be attended before group 2's pieces are waited for";

  cfg.ulysses_head_groups = 4;
  HP_EXPECT_ERROR(check_heads(*normalize(cfg, p), p, kNq, kNkv),
                  "cp_config.ulysses_head_groups=4 does not divide the 12 query and 6 key/value "
                  "heads");
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

// Async hybrid in head groups (P=4, U=2, 3 groups): Q, K and V travel in one all-to-all per
// group in the Ulysses group, each group's K and V in one co-group all-gather of the group's
// K/V head at S/C = 24 positions ([1,1,24,8] and [1,1,24,6]), and each group's output in one
// all-to-all ([1,2,24,6]); backward reduce-scatters each group's dK and dV on its own. Rank 0
// starts group 1's co-gathers before it waits for group 0's (they fly while group 0's remote
// keys and group 1's held chunks are attended) and launches group 0's output all-to-all
// before its last attention call.
TEST(HybridHeadGroups, EachGroupsCoGathersAndOutputTravelWhileAnotherGroupIsAttended) {
  const int p = 4;
  const auto cfg = grouped_config("hybrid", 3, 2);
  const auto f = grouped_forward(*normalize(cfg, p), p, /*backward=*/true);
  for (const auto& sched : f.schedules) {
    std::vector<std::string> gathers, a2a;
    std::multiset<std::string> scatters;
    for (const auto& op : sched) {
      if (op.rfind("all_gather(", 0) == 0) gathers.push_back(op);
      if (op.rfind("all_to_all(", 0) == 0) a2a.push_back(op);
      if (op.rfind("reduce_scatter(", 0) == 0) scatters.insert(op);
    }
    ASSERT_EQ(gathers.size(), 6u) << ::testing::PrintToString(sched);
    for (size_t i = 0; i < 6; ++i) {
      EXPECT_NE(gathers[i].find(i % 2 == 0 ? "[1,1,24,8]" : "[1,1,24,6]"), std::string::npos)
          << i << " in " << ::testing::PrintToString(sched);
    }
    // Forward: 9 pieces and 3 outputs; backward: 3 output gradients and 9 piece gradients.
    ASSERT_EQ(a2a.size(), 24u) << ::testing::PrintToString(sched);
    for (size_t i = 9; i < 12; ++i)
      EXPECT_NE(a2a[i].find("[1,2,24,6]"), std::string::npos) << a2a[i];
    EXPECT_EQ(scatters.size(), 6u) << ::testing::PrintToString(sched);
  }
  ASSERT_EQ(count_between(f.gather_launch, 0, f.forward_end), 6);
  ASSERT_EQ(count_between(f.gather_wait, 0, f.forward_end), 6);
  EXPECT_LE(f.gather_launch[3], f.gather_wait[0])
      << "group 1's co-gathers must start before group 0's are waited for";
  ASSERT_GE(f.a2a_launch.size(), 12u);
  EXPECT_LT(f.a2a_launch[9], f.attention_begin.back())
      << "group 0's output all-to-all must fly while a later group is attended";
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

// Async usp: Q, K and V travel in one all-to-all per head group, each group's ring runs once
// its own pieces are here, and the group's output all-to-all starts as soon as it is done. Group
// g+1's pieces launch once group g's first ring shift has landed (so the two do not share the
// link): every rank (P=4, U=2, 3 groups) puts on the wire the pieces of groups 0 and 1
// ([1,4,12,8], [1,2,12,8], [1,2,12,6]: the group's heads of both ranks, S/P = 12 positions),
// group 0's output (2 heads, S/C = 24 positions), group 2's pieces, then the other two outputs.
// Rank 0 waits for group 0's pieces before the later groups' and launches the first output
// before its last attention call.
TEST(UspHeadGroups, EachGroupsOutputTravelsWhileTheNextRingRuns) {
  const int p = 4;
  const auto cfg = grouped_config("usp", 3, 2);
  const auto f = grouped_forward(*normalize(cfg, p), p);
  for (const auto& sched : f.schedules) {
    std::vector<std::string> a2a;
    for (const auto& op : sched) {
      if (op.rfind("all_to_all(", 0) == 0) a2a.push_back(op);
    }
    ASSERT_EQ(a2a.size(), 12u) << ::testing::PrintToString(sched);
    const std::multiset<std::string> one_group = {"all_to_all(cp_ulysses)[1,4,12,8]",
                                                  "all_to_all(cp_ulysses)[1,2,12,8]",
                                                  "all_to_all(cp_ulysses)[1,2,12,6]"};
    auto two_groups = one_group;
    two_groups.insert(one_group.begin(), one_group.end());
    EXPECT_EQ(std::multiset<std::string>(a2a.begin(), a2a.begin() + 6), two_groups)
        << ::testing::PrintToString(sched);
    EXPECT_EQ(std::multiset<std::string>(a2a.begin() + 7, a2a.begin() + 10), one_group)
        << ::testing::PrintToString(sched);
    for (size_t i : {6, 10, 11})
      EXPECT_NE(a2a[i].find("[1,2,24,6]"), std::string::npos) << a2a[i];
  }
  ASSERT_EQ(f.a2a_launch.size(), 12u);
  ASSERT_FALSE(f.attention_begin.empty());
  ASSERT_FALSE(f.shift_wait.empty());
  ASSERT_GE(f.shift_wait.size(), 2u);  // one shift per group's ring (C = 2)
  EXPECT_GE(f.a2a_launch[3], f.shift_wait[0])
      << "group 1's pieces must be held until group 0's first ring shift has landed";
  EXPECT_LT(f.a2a_launch[5], f.shift_wait[1]) << "group 1's pieces must fly during group 0's ring";
  EXPECT_GE(f.a2a_launch[7], f.shift_wait[1])
      << "group 2's pieces must be held until group 1's first ring shift has landed";
  EXPECT_GT(count_between(f.attention_begin, f.a2a_wait[2], f.a2a_launch[3]), 0)
      << "group 0's own block must be attended before the later groups' pieces launch";
  EXPECT_LT(f.a2a_wait[2], f.attention_begin.front())
      << "group 0's ring must start once its own pieces are here";
  EXPECT_GT(count_between(f.attention_begin, f.a2a_wait[2], f.a2a_wait[3]), 0)
      << "group 0's ring must run before the later groups' pieces are waited for";
  EXPECT_LT(f.a2a_launch[6], f.attention_begin.back())
      << "the first group's output all-to-all must fly while a later group's ring runs";
}

// Async usp on short shards (automatic head groups, P=4, U=2: 6 query and 2 K/V heads per
// rank, which 2 divides, but 12 positions per rank, under kUspMinRowsForHeadGroups): one group,
// so Q, K and V travel in one all-to-all each, one ring runs, and one output all-to-all goes
// back; the same with 2 groups asked sends them twice.
TEST(UspHeadGroups, ShortShardsRunOneGroup) {
  const int p = 4;
  auto cfg = grouped_config("usp", 0, 2);
  ASSERT_LT(kS / p, kUspMinRowsForHeadGroups);
  EXPECT_EQ(ulysses_head_groups_of(*normalize(cfg, p), 6, 2, p, kS / p), 1);
  EXPECT_EQ(ulysses_head_groups_of(*normalize(cfg, p), 6, 2, p, kUspMinRowsForHeadGroups), 2);
  // Every rank's all-to-alls in its forward (the same count on every rank).
  auto a2a_count = [&](int64_t groups) {
    cfg.ulysses_head_groups = groups;
    const auto f = grouped_forward(*normalize(cfg, p), p, false, /*nkv=*/4);
    std::set<int64_t> counts;
    for (const auto& sched : f.schedules) {
      counts.insert(std::count_if(sched.begin(), sched.end(), [](const std::string& op) {
        return op.rfind("all_to_all(", 0) == 0;
      }));
    }
    EXPECT_EQ(counts.size(), 1u) << "groups=" << groups;
    return counts.empty() ? int64_t{-1} : *counts.begin();
  };
  EXPECT_EQ(a2a_count(0), 4) << "automatic: Q, K, V and the output, once each";
  EXPECT_EQ(a2a_count(2), 8) << "2 groups asked: each of them per group";
}

// kv_head_policy=repeat: fewer K/V heads than the Ulysses degree; each is sent once (gathered
// in the Ulysses group) and every rank keeps the one its query heads read.
TEST(CPFloat64, UlyssesRepeatsKVHeads) {
  Case c{"ulysses", std::nullopt};
  c.kv_policy = KVHeadPolicy::kRepeat;
  c.kv_heads = 2;
  run_grid(c, {4});
  c.kv_heads = 1;
  run_grid(c, {2, 3});
}
TEST(CPFloat64, HybridRepeatsKVHeads) {
  Case c{"hybrid", 2};
  c.kv_policy = KVHeadPolicy::kRepeat;
  c.kv_heads = 1;
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
      {{"usp", 2, true, LoadBalanceForm::kDataOrder}, {4}}};
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

// What kv_head_policy=repeat sends: Q and the output by all-to-all, K and V once each by an
// all-gather in the Ulysses group; counted bytes equal the formula. Without the option the
// error names it.
TEST(KVHeadPolicy, RepeatSendsEachHeadOnceAndTheDefaultRefuses) {
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
    // q [1, 12, S/P, D] by all-to-all; k and v [1, 2, S/P, .] gathered; the output back.
    EXPECT_EQ(rec.schedule(),
              (std::vector<std::string>{"all_to_all(cp)[1,12,12,8]", "all_gather(cp)[1,2,12,8]",
                                        "all_gather(cp)[1,2,12,6]", "all_to_all(cp)[1,3,48,6]"}));
    const AttentionShape shape{kS, kNq, 2, kDqk, 1, 8, kDv};
    EXPECT_EQ(w.context().counters.total_bytes(), forward_bytes_per_rank(norm, p, shape));
  });
}

}  // namespace
}  // namespace hp::cp
