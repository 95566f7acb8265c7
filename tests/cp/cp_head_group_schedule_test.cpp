// The async schedules in head groups, recorded: which collectives every rank puts on the wire, in
// which order, and when rank 0 launches, waits and attends (threads-as-ranks with a tracer), for
// async ulysses, all_gather, hybrid and usp; and a call's backward span on the tracer. Their
// numerics are checked against the float64 reference in cp_float64_test.cpp.
#include <algorithm>
#include <array>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "cp_direct.h"
#include "cp_test_util.h"
#include "hp/comm/collectives.h"
#include "hp/comm/device_mesh.h"
#include "hp/common/check.h"
#include "hp/common/trace.h"
#include "hp/cp/config.h"
#include "hp/cp/sequence.h"
#include "rank_harness.h"

namespace hp::cp {
namespace {

using namespace hp::cp::testing;  // NOLINT: the float64 tests' module, inputs and shapes
using hp::testing::run_ranks;

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

}  // namespace
}  // namespace hp::cp
