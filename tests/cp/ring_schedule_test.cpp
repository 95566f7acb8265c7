// The ring's schedules, from the recording transport: what each rank shifts and in which order
// (forward, and each form of the backward), that counted bytes equal the formulas, that blocks no
// rank attends never travel, and that blocks above the diagonal or across documents are never
// computed. The numerics of every form: cp_float64_test.cpp.
#include <array>
#include <limits>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "cp_direct.h"
#include "hp/attention/masks.h"
#include "hp/comm/world.h"
#include "hp/common/check.h"
#include "hp/cp/config.h"
#include "hp/cp/sequence.h"
#include "hp/cp/volume.h"
#include "rank_harness.h"

namespace hp::cp {
namespace {

using namespace hp::cp::testing;  // NOLINT: the float64 tests' module, inputs and shapes
using hp::testing::expect_close;
using hp::testing::run_ranks;

void run_ring_schedule(bool keep);

ContextParallelConfig ring_config(int p, bool keep_blocks, RingBackward backward) {
  ContextParallelConfig cfg;
  cfg.algorithm = "ring";
  cfg.ring_keep_blocks = keep_blocks;
  cfg.ring_backward = backward;
  return *normalize(cfg, p);
}

// Rank r's shards (contiguous, P ranks, batch 1) of the schedule tests' q, k, v, as leaves.
std::array<at::Tensor, 3> shards_of(int64_t r, int p) {
  auto mine = [&](const at::Tensor& full) {
    return shard_sequence(full, 2, r, p, false).requires_grad_(true);
  };
  return {mine(f64(1, {1, kNq, kS, kDqk})), mine(f64(2, {1, kNkv, kS, kDqk})),
          mine(f64(3, {1, kNkv, kS, kDv}))};
}

// The ring's schedule: P-1 shifts of this rank's [k | v] block forward (receive from the previous
// rank, send to the next). Backward passes the blocks the same way again: the first shift,
// then per step the next block's shift and the dK/dV accumulator's (the same shape), the last
// step only the accumulator's, which brings it home: 2(P-1) shifts. With ring_keep_blocks
// forward is the same and backward shifts only the P-1 accumulators (all_gather's bytes).
// Counted bytes equal the forward and backward formulas, and the gradients the float64
// reference (CPFloat64.Ring, CPFloat64.RingKeepBlocks). Kept blocks apply to ring and usp only.
// A second backward through the same graph is refused.
TEST(RingSchedule, ForwardShiftsBlocksBackwardShiftsBlocksAndAccumulators) {
  for (bool keep : {false, true}) {
    SCOPED_TRACE(keep ? "ring_keep_blocks" : "blocks travel again");
    run_ring_schedule(keep);
  }
  ContextParallelConfig cfg;
  cfg.ring_keep_blocks = true;
  HP_EXPECT_ERROR(normalize(cfg, 2),
                  "cp_config.ring_keep_blocks=true applies to algorithm=ring or usp (got "
                  "all_gather); drop it or use ring or usp");
}

void run_ring_schedule(bool keep) {
  const int p = 3;
  const auto norm = ring_config(p, keep, RingBackward::kAuto);
  run_ranks(p, [&](comm::World& w) {
    Direct m(true);
    apply_cp(m, w, norm, /*handoffs=*/false);
    const int64_t r = w.rank(), prev = (r + p - 1) % p, next = (r + 1) % p;
    auto [q, k, v] = shards_of(r, p);
    auto& rec = *w.context().recorder;
    rec.clear();
    w.context().counters.reset();
    auto out = m.forward(q, k, v);
    const std::string block = "[1,6,16,14]";  // [k | v]: Dqk 8 + Dv 6
    std::vector<std::string> step{"recv(cp,peer=" + std::to_string(prev) + ")" + block,
                                  "send(cp,peer=" + std::to_string(next) + ")" + block};
    std::vector<std::string> fwd, bwd;
    for (int i = 0; i < p - 1; ++i)
      fwd.insert(fwd.end(), step.begin(), step.end());
    for (int i = 0; i < (keep ? 1 : 2) * (p - 1); ++i)
      bwd.insert(bwd.end(), step.begin(), step.end());
    EXPECT_EQ(rec.schedule(), fwd);
    const AttentionShape shape{kS, kNq, kNkv, kDqk, 1, 8, kDv};
    EXPECT_EQ(w.context().counters.total_bytes(), forward_bytes_per_rank(norm, p, shape));
    rec.clear();
    w.context().counters.reset();
    out.sum().backward({}, /*retain_graph=*/true);
    EXPECT_EQ(rec.schedule(), bwd);
    EXPECT_EQ(w.context().counters.total_bytes(), backward_bytes_per_rank(norm, p, shape));
    // Its backward freed what it kept: a second one is refused before it communicates.
    rec.clear();
    HP_EXPECT_ERROR(out.sum().backward(), "ring attention: this call's backward already ran");
    EXPECT_TRUE(rec.schedule().empty());
  });
}

// ring_backward=queries: forward as above; backward shifts this rank's [q | dout] ([1,12,16,14]:
// Dqk 8 + Dv 6) and [lse | delta] ([1,12,16,2]) the other way (receive from the next rank, send
// to the previous), first before the ring, then per step the next bundle's and the dQ
// accumulator's ([1,12,16,8]); at the last step only the accumulator's, home (a shift by P-1,
// here P = 3: to the previous rank again). Counted bytes equal the formula (queries: 12 heads x
// ((2 x 8 + 6) x 8 + 2 x 8) bytes per position and step, 2304 against the blocks' 1344 at these
// GQA shapes, which auto keeps). ring_backward applies to ring and usp only, and is refused
// beside kept blocks.
TEST(RingSchedule, QueriesTravelTheOtherWayWithTheirDQAccumulators) {
  const int p = 3;
  const auto norm = ring_config(p, false, RingBackward::kQueries);
  const AttentionShape shape{kS, kNq, kNkv, kDqk, 1, 8, kDv};
  EXPECT_EQ(backward_bytes_per_rank(norm, p, shape), 2 * 16 * 2304);
  auto blocks = norm;
  blocks.ring_backward = RingBackward::kAuto;
  EXPECT_EQ(backward_bytes_per_rank(blocks, p, shape), 2 * 16 * 1344);
  run_ranks(p, [&](comm::World& w) {
    Direct m(true);
    apply_cp(m, w, norm, /*handoffs=*/false);
    const int64_t r = w.rank(), prev = (r + p - 1) % p, next = (r + 1) % p;
    auto [q, k, v] = shards_of(r, p);
    auto& rec = *w.context().recorder;
    auto out = m.forward(q, k, v);
    rec.clear();
    w.context().counters.reset();
    out.sum().backward();
    auto back = [&](const std::string& shape_text) {
      return std::vector<std::string>{"recv(cp,peer=" + std::to_string(next) + ")" + shape_text,
                                      "send(cp,peer=" + std::to_string(prev) + ")" + shape_text};
    };
    std::vector<std::string> bwd;
    auto add = [&](const std::vector<std::string>& x) {
      bwd.insert(bwd.end(), x.begin(), x.end());
    };
    add(back("[1,12,16,14]"));  // the first shift of the own bundle
    add(back("[1,12,16,2]"));
    add(back("[1,12,16,14]"));  // step 1: the bundle of rank r+1 on, its dQ accumulator
    add(back("[1,12,16,2]"));
    add(back("[1,12,16,8]"));
    add(back("[1,12,16,8]"));  // step 2: the accumulator home
    EXPECT_EQ(rec.schedule(), bwd);
    EXPECT_EQ(w.context().counters.total_bytes(), backward_bytes_per_rank(norm, p, shape));
  });
  ContextParallelConfig bad;
  bad.ring_backward = RingBackward::kQueries;
  HP_EXPECT_ERROR(normalize(bad, 2),
                  "cp_config.ring_backward=queries applies to algorithm=ring or usp (got "
                  "all_gather); drop it or use ring or usp");
  bad.algorithm = "ring";
  bad.ring_keep_blocks = true;
  HP_EXPECT_ERROR(normalize(bad, 2),
                  "cp_config.ring_backward=queries with ring_keep_blocks=true: kept blocks send "
                  "only the dK/dV accumulators");
  HP_EXPECT_ERROR(parse_ring_backward("kv"),
                  "ring_backward 'kv' is not valid; valid: auto, blocks, queries");
}

// With head-tail balance every block and every query bundle is two chunks, and each travels on
// its own, so a step waits only for the chunk its next calls read and forwards it at once. P=3
// (chunks of 8 rows): forward shifts [k | v] chunk 0 then chunk 1 at each of the two steps;
// the queries backward shifts each chunk's [q | dout] and [lse | delta] first, then per step,
// chunk by chunk, that chunk's bundle on (not at the last step) and its dQ accumulator.
// Counted bytes equal the formulas (the same bytes as whole blocks); the numerics:
// CPFloat64.Ring and CPFloat64.RingQueriesTravel (balanced, P = 2, 3, 4).
TEST(RingSchedule, BalancedChunksTravelOneAtATime) {
  const int p = 3;
  auto cfg = ring_config(p, false, RingBackward::kQueries);
  cfg.load_balance = true;
  cfg.load_balance_form = LoadBalanceForm::kDataOrder;
  const auto norm = *normalize(cfg, p);
  const AttentionShape shape{kS, kNq, kNkv, kDqk, 1, 8, kDv};
  run_ranks(p, [&](comm::World& w) {
    Direct m(true);
    apply_cp(m, w, norm, /*handoffs=*/false);
    const int64_t r = w.rank(), prev = (r + p - 1) % p, next = (r + 1) % p;
    auto mine = [&](const at::Tensor& full) {
      return shard_sequence(full, 2, r, p, true).requires_grad_(true);
    };
    auto q = mine(f64(1, {1, kNq, kS, kDqk})), k = mine(f64(2, {1, kNkv, kS, kDqk})),
         v = mine(f64(3, {1, kNkv, kS, kDv}));
    auto& rec = *w.context().recorder;
    rec.clear();
    w.context().counters.reset();
    auto out = m.forward(q, k, v);
    auto shift = [&](int64_t from, int64_t to, const std::string& shape_text) {
      return std::vector<std::string>{"recv(cp,peer=" + std::to_string(from) + ")" + shape_text,
                                      "send(cp,peer=" + std::to_string(to) + ")" + shape_text};
    };
    std::vector<std::string> fwd, bwd;
    auto add = [](std::vector<std::string>& to, const std::vector<std::string>& x) {
      to.insert(to.end(), x.begin(), x.end());
    };
    for (int i = 0; i < 2 * (p - 1); ++i)  // two steps, two chunks each
      add(fwd, shift(prev, next, "[1,6,8,14]"));
    EXPECT_EQ(rec.schedule(), fwd);
    EXPECT_EQ(w.context().counters.total_bytes(), forward_bytes_per_rank(norm, p, shape));
    rec.clear();
    w.context().counters.reset();
    out.sum().backward();
    for (int c = 0; c < 2; ++c) {  // the own bundle, chunk by chunk
      add(bwd, shift(next, prev, "[1,12,8,14]"));
      add(bwd, shift(next, prev, "[1,12,8,2]"));
    }
    for (int c = 0; c < 2; ++c) {  // step 1: each chunk on, then its accumulator
      add(bwd, shift(next, prev, "[1,12,8,14]"));
      add(bwd, shift(next, prev, "[1,12,8,2]"));
      add(bwd, shift(next, prev, "[1,12,8,8]"));
    }
    for (int c = 0; c < 2; ++c)  // step 2: the accumulators home (P-1 on: the previous rank)
      add(bwd, shift(next, prev, "[1,12,8,8]"));
    EXPECT_EQ(rec.schedule(), bwd);
    EXPECT_EQ(w.context().counters.total_bytes(), backward_bytes_per_rank(norm, p, shape));
  });
}

// With packed documents the ring stops after the last step whose block some rank attends (every
// rank computes it from the global document ids): documents that are the shards move nothing;
// documents {0..19}, {20..47} at P=3 (causal, shards of 16) need one step (rank 1 sees rank 0's
// keys, rank 2 only rank 1's), so forward shifts one block, and backward shifts it again and sends
// its accumulator straight home (two ranks back: a shift by 2). Outputs and gradients equal the
// single-process reference (CPFloat64.PackedDocumentsEqualEachDocumentAlone covers J between 0
// and P-1 at P=4 as well).
TEST(RingSchedule, BlocksNoRankAttendsNeverTravel) {
  const int p = 3;
  ContextParallelConfig cfg;
  cfg.algorithm = "ring";
  const auto norm = *normalize(cfg, p);
  const auto q = f64(1, {1, kNq, kS, kDqk}), k = f64(2, {1, kNkv, kS, kDqk}),
             v = f64(3, {1, kNkv, kS, kDv});
  for (const std::vector<int64_t>& cu : {std::vector<int64_t>{0, 16, 32, kS}, {0, 20, kS}}) {
    const bool one_step = cu.size() == 3;
    auto ids = attention::document_ids_from_cu_seqlens(cu, kS);
    Direct ref(true, ids);
    auto rq = q.clone().requires_grad_(true), rk = k.clone().requires_grad_(true),
         rv = v.clone().requires_grad_(true);
    auto ref_out = ref.forward(rq, rk, rv);
    ref_out.sum().backward();
    std::vector<at::Tensor> outs(p), dqs(p), dks(p);
    run_ranks(p, [&](comm::World& w) {
      Direct m(true, ids);
      apply_cp(m, w, norm, /*handoffs=*/false);
      const int64_t r = w.rank();
      auto mine = [&](const at::Tensor& full) {
        return shard_sequence(full, 2, r, p, false).requires_grad_(true);
      };
      auto lq = mine(q), lk = mine(k), lv = mine(v);
      auto& rec = *w.context().recorder;
      rec.clear();
      auto out = m.forward(lq, lk, lv);
      const std::string block = "[1,6,16,14]";  // [k | v]: Dqk 8 + Dv 6
      auto shift = [&](int by) {
        return std::vector<std::string>{
            "recv(cp,peer=" + std::to_string((r + p - by) % p) + ")" + block,
            "send(cp,peer=" + std::to_string((r + by) % p) + ")" + block};
      };
      std::vector<std::string> fwd, bwd;
      if (one_step) {
        auto s1 = shift(1), s2 = shift(2);
        fwd.insert(fwd.end(), s1.begin(), s1.end());
        bwd.insert(bwd.end(), s1.begin(), s1.end());
        bwd.insert(bwd.end(), s2.begin(), s2.end());
      }
      EXPECT_EQ(rec.schedule(), fwd) << "documents " << cu.size() - 1;
      rec.clear();
      out.sum().backward();
      EXPECT_EQ(rec.schedule(), bwd) << "documents " << cu.size() - 1;
      outs[r] = out.detach();
      dqs[r] = lq.grad();
      dks[r] = lk.grad();
    });
    expect_close(unshard_sequence(outs, 2, false), ref_out.detach(), "out", 1e-10, 1e-10);
    expect_close(unshard_sequence(dqs, 2, false), rq.grad(), "dq", 1e-10, 1e-10);
    expect_close(unshard_sequence(dks, 2, false), rk.grad(), "dk", 1e-10, 1e-10);
  }
}

// Skipped, not masked: blocks above the causal diagonal and blocks no document spans are never
// computed. Keys and values there are NaN; a ring that computed and then masked them would turn
// the output (or dq) of the queries that cannot see them into NaN.
TEST(RingSchedule, BlocksAboveTheDiagonalAndAcrossDocumentsAreNeverComputed) {
  const int p = 3;
  ContextParallelConfig cfg;
  cfg.algorithm = "ring";
  const auto norm = *normalize(cfg, p);
  // causal: rank 0 (positions 0..15) must not touch ranks 1, 2; documents {0..31}, {32..47}
  // (not causal): rank 2 must not touch ranks 0, 1.
  for (bool causal : {true, false}) {
    auto ids = attention::document_ids_from_cu_seqlens({0, 32, kS}, kS);
    const int64_t clean_rank = causal ? 0 : 2;
    auto k = f64(2, {1, kNkv, kS, kDqk}), v = f64(3, {1, kNkv, kS, kDv});
    auto poison = [&](at::Tensor& t) {
      auto nan = std::numeric_limits<double>::quiet_NaN();
      (causal ? t.slice(2, 16) : t.slice(2, 0, 32)).fill_(nan);
    };
    poison(k);
    poison(v);
    run_ranks(p, [&](comm::World& w) {
      Direct m(causal, causal ? at::Tensor() : ids);
      apply_cp(m, w, norm, /*handoffs=*/false);
      auto mine = [&](const at::Tensor& full) {
        return shard_sequence(full, 2, w.rank(), p, false).requires_grad_(true);
      };
      auto q = mine(f64(1, {1, kNq, kS, kDqk}));
      auto out = m.forward(q, mine(k), mine(v));
      out.sum().backward();
      if (w.rank() == clean_rank) {
        EXPECT_FALSE(out.isnan().any().item<bool>()) << (causal ? "causal" : "documents");
        EXPECT_FALSE(q.grad().isnan().any().item<bool>()) << (causal ? "causal" : "documents");
      }
    });
  }
}

}  // namespace
}  // namespace hp::cp
