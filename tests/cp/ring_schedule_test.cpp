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
std::string recv(int64_t peer, const std::string& shape);
std::string send(int64_t peer, const std::string& shape);

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

// The ring's schedule, causal, contiguous shards, P = 3: a block travels forward only to the
// later ranks (they alone attend it), so rank 0's block goes to ranks 1 and 2, rank 1's to rank
// 2, and rank 2's nowhere. Backward passes the blocks the same way again, each followed by its
// dK/dV accumulator (the same shape), which goes home from the last rank on the route (rank 1's
// from rank 2 at step 1, rank 0's from rank 2 at step 2, two ranks on). With ring_keep_blocks
// forward is the same and backward sends only the accumulators. Counted bytes equal the forward
// and backward formulas on every rank, and the gradients the float64 reference (CPFloat64.Ring,
// CPFloat64.RingKeepBlocks). Kept blocks apply to ring and usp only. A second backward through
// the same graph is refused.
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

// "recv(cp,peer=N)<shape>" / "send(...)": one recorded transfer.
std::string recv(int64_t peer, const std::string& shape) {
  return "recv(cp,peer=" + std::to_string(peer) + ")" + shape;
}
std::string send(int64_t peer, const std::string& shape) {
  return "send(cp,peer=" + std::to_string(peer) + ")" + shape;
}

void run_ring_schedule(bool keep) {
  const int p = 3;
  const auto norm = ring_config(p, keep, RingBackward::kAuto);
  run_ranks(p, [&](comm::World& w) {
    Direct m(true);
    apply_cp(m, w, norm, /*handoffs=*/false);
    const int64_t r = w.rank();
    auto [q, k, v] = shards_of(r, p);
    auto& rec = *w.context().recorder;
    rec.clear();
    w.context().counters.reset();
    auto out = m.forward(q, k, v);
    const std::string b = "[1,6,16,14]";  // [k | v]: Dqk 8 + Dv 6, and its accumulator
    const std::vector<std::vector<std::string>> fwd{
        {send(1, b)},                          // step 0: the own block on
        {recv(0, b), send(2, b), send(2, b)},  // step 0: rank 0's in, the own on; step 1
        {recv(1, b), recv(1, b)}};             // rank 1's, then rank 0's
    const std::vector<std::vector<std::string>> bwd{
        {send(1, b), recv(2, b)},  // the own block again; its accumulator home at step 2
        // step 0 as forward; step 1: rank 0's block on, its accumulator on, the own one home
        {recv(0, b), send(2, b), send(2, b), send(2, b), recv(2, b)},
        // rank 1's block, then rank 0's and its accumulator; rank 1's accumulator home,
        // rank 0's home at step 2
        {recv(1, b), recv(1, b), recv(1, b), send(1, b), send(0, b)}};
    const std::vector<std::vector<std::string>> kept_bwd{
        {recv(2, b)}, {send(2, b), recv(2, b)}, {recv(1, b), send(1, b), send(0, b)}};
    EXPECT_EQ(rec.schedule(), fwd[r]);
    AttentionShape shape{kS, kNq, kNkv, kDqk, 1, 8, kDv};
    shape.causal = true;
    EXPECT_EQ(w.context().counters.total_bytes(), forward_bytes_per_rank(norm, p, shape, r));
    EXPECT_EQ(forward_bytes_per_rank(norm, p, shape, r), (r < 2 ? r + 1 : 0) * 16 * 14 * 6 * 8);
    rec.clear();
    w.context().counters.reset();
    out.sum().backward({}, /*retain_graph=*/true);
    EXPECT_EQ(rec.schedule(), keep ? kept_bwd[r] : bwd[r]);
    EXPECT_EQ(w.context().counters.total_bytes(), backward_bytes_per_rank(norm, p, shape, r));
    // Its backward freed what it kept: a second one is refused before it communicates.
    rec.clear();
    HP_EXPECT_ERROR(out.sum().backward(), "ring attention: this call's backward already ran");
    EXPECT_TRUE(rec.schedule().empty());
  });
}

// ring_backward=queries, causal, contiguous shards, P = 3: forward as above; backward each
// rank's [q | dout] ([1,12,16,14]: Dqk 8 + Dv 6) and [lse | delta] ([1,12,16,2]) travel the
// other way, to the previous rank, and only as far as a rank attends them: rank 2's queries to
// ranks 1 and 0, rank 1's to rank 0, rank 0's nowhere. Each bundle's dQ accumulator
// ([1,12,16,8]) follows it and goes home from the last rank on the route (rank 1's from rank 0
// at step 1, rank 2's from rank 0 at step 2). Counted bytes equal the formula on every rank
// (queries: 12 heads x ((2 x 8 + 6) x 8 + 2 x 8) bytes per position and step, 2304 against the
// blocks' 1344 at these GQA shapes, which auto keeps). ring_backward applies to ring and usp
// only, and is refused beside kept blocks.
TEST(RingSchedule, QueriesTravelTheOtherWayWithTheirDQAccumulators) {
  const int p = 3;
  const auto norm = ring_config(p, false, RingBackward::kQueries);
  const AttentionShape dense{kS, kNq, kNkv, kDqk, 1, 8, kDv};  // every bundle to every rank
  EXPECT_EQ(backward_bytes_per_rank(norm, p, dense), 2 * 16 * 2304);
  auto blocks = norm;
  blocks.ring_backward = RingBackward::kAuto;
  EXPECT_EQ(backward_bytes_per_rank(blocks, p, dense), 2 * 16 * 1344);
  auto shape = dense;
  shape.causal = true;
  run_ranks(p, [&](comm::World& w) {
    Direct m(true);
    apply_cp(m, w, norm, /*handoffs=*/false);
    const int64_t r = w.rank();
    auto [q, k, v] = shards_of(r, p);
    auto& rec = *w.context().recorder;
    auto out = m.forward(q, k, v);
    rec.clear();
    w.context().counters.reset();
    out.sum().backward();
    const std::string qd = "[1,12,16,14]", st = "[1,12,16,2]", dq = "[1,12,16,8]";
    const std::vector<std::vector<std::string>> bwd{
        // rank 1's bundle in; step 1: rank 2's in, rank 1's accumulator home (to rank 1),
        // rank 2's on its way; step 2: rank 2's accumulator home
        {recv(1, qd), recv(1, st), recv(1, qd), recv(1, st), recv(1, dq), send(1, dq), send(2, dq)},
        // the own bundle on, rank 2's in; step 1: rank 2's on with its accumulator, the own
        // accumulator home
        {recv(2, qd), send(0, qd), recv(2, st), send(0, st), send(0, qd), send(0, st), send(0, dq),
         recv(0, dq)},
        // the own bundle on; step 2: its accumulator home
        {send(1, qd), send(1, st), recv(0, dq)}};
    EXPECT_EQ(rec.schedule(), bwd[r]);
    EXPECT_EQ(w.context().counters.total_bytes(), backward_bytes_per_rank(norm, p, shape, r));
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
// its own route, so a step waits only for the chunk its next calls read and forwards it at once.
// P = 3, data-order chunks of 8 rows (rank 0: 0 and 5, rank 1: 2 and 3, rank 2: 4 and 1),
// causal: chunk 5 (rank 0's second) is attended by no other rank and never leaves, chunk 4
// only by rank 0 (one hop forward), every other chunk by both other ranks: the keys go forward
// (9 chunk hops against 10 the other way; 12 for a full pass). The queries backward (its
// routes forward too: query chunk 0 attends no other rank, chunk 1 only rank 0's keys) sends
// each chunk's [q | dout] and [lse | delta] first, then per step, chunk by chunk, that chunk's
// bundle on where its route goes on, its dQ accumulator on, or home after the route's last
// rank. Counted bytes equal the formulas on every rank; the numerics: CPFloat64.Ring and
// CPFloat64.RingQueriesTravel (balanced, P = 2, 3, 4).
TEST(RingSchedule, BalancedChunksTravelOneAtATime) {
  const int p = 3;
  auto cfg = ring_config(p, false, RingBackward::kQueries);
  cfg.load_balance = true;
  cfg.load_balance_form = LoadBalanceForm::kDataOrder;
  const auto norm = *normalize(cfg, p);
  AttentionShape shape{kS, kNq, kNkv, kDqk, 1, 8, kDv};
  shape.causal = true;
  run_ranks(p, [&](comm::World& w) {
    Direct m(true);
    apply_cp(m, w, norm, /*handoffs=*/false);
    const int64_t r = w.rank();
    auto mine = [&](const at::Tensor& full) {
      return shard_sequence(full, 2, r, p, true).requires_grad_(true);
    };
    auto q = mine(f64(1, {1, kNq, kS, kDqk})), k = mine(f64(2, {1, kNkv, kS, kDqk})),
         v = mine(f64(3, {1, kNkv, kS, kDv}));
    auto& rec = *w.context().recorder;
    rec.clear();
    w.context().counters.reset();
    auto out = m.forward(q, k, v);
    const std::string c = "[1,6,8,14]";
    const std::vector<std::vector<std::string>> fwd{
        // step 0: chunk 0 on, rank 2's chunks in (chunk 5 stays); step 1: rank 1's in,
        // rank 2's chunk 1 on (its chunk 4 ends here)
        {recv(2, c), send(1, c), recv(2, c), recv(2, c), recv(2, c), send(1, c)},
        // step 0: both own chunks on, rank 0's chunk 0 in; step 1: it goes on, rank 2's
        // chunk 1 arrives (its chunk 4 ended at rank 0)
        {recv(0, c), send(2, c), send(2, c), send(2, c), recv(0, c)},
        // step 0 and 1: every chunk that comes in goes on (rank 0's chunk 5 never comes)
        {recv(1, c), send(0, c), recv(1, c), send(0, c), recv(1, c), send(0, c), send(0, c)}};
    EXPECT_EQ(rec.schedule(), fwd[r]);
    EXPECT_EQ(w.context().counters.total_bytes(), forward_bytes_per_rank(norm, p, shape, r));
    rec.clear();
    w.context().counters.reset();
    out.sum().backward();
    if (r == 0) {
      const std::string qd = "[1,12,8,14]", st = "[1,12,8,2]", dq = "[1,12,8,8]";
      EXPECT_EQ(rec.schedule(),
                (std::vector<std::string>{
                    // the own bundle: chunk 0 stays (rank 2's chunk 4 comes in), chunk 5 on
                    recv(2, qd), recv(2, st), recv(2, qd), send(1, qd), recv(2, st), send(1, st),
                    // step 1, rank 2's chunk 4: on, rank 1's in; its accumulator on
                    recv(2, qd), send(1, qd), recv(2, st), send(1, st), recv(2, dq), send(1, dq),
                    // rank 2's chunk 1 (its last rank): rank 1's in, its accumulator home
                    recv(2, qd), recv(2, st), recv(2, dq), send(2, dq),
                    // step 2: rank 1's chunks' accumulators home; chunk 5's comes home
                    send(1, dq), recv(2, dq), send(1, dq)}));
    }
    EXPECT_EQ(w.context().counters.total_bytes(), backward_bytes_per_rank(norm, p, shape, r));
  });
}

// With packed documents a block travels only as far as a rank attends it (every rank computes
// the routes from the global document ids): documents that are the shards move nothing;
// documents {0..19}, {20..47} at P=3 (causal, shards of 16): rank 1 sees rank 0's keys, rank 2
// only rank 1's, so forward each of those blocks goes one rank on, and backward they go again
// and their accumulators come straight back. Outputs and gradients equal the single-process
// reference (CPFloat64.PackedDocumentsEqualEachDocumentAlone covers routes of every length at
// P=4 as well).
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
      const std::string b = "[1,6,16,14]";  // [k | v]: Dqk 8 + Dv 6
      std::vector<std::string> fwd, bwd;
      if (one_step) {
        fwd = std::vector<std::vector<std::string>>{
            {send(1, b)}, {recv(0, b), send(2, b)}, {recv(1, b)}}[r];
        bwd =
            std::vector<std::vector<std::string>>{{send(1, b), recv(1, b)},
                                                  {recv(0, b), send(2, b), recv(2, b), send(0, b)},
                                                  {recv(1, b), send(1, b)}}[r];
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

// The byte formulas' chunk counts (volume.h), by hand at P = 4. Causal, data-order head-tail
// chunks (rank 0: 0 and 7, rank 1: 2 and 5, rank 2: 4 and 3, rank 3: 6 and 1): chunk 7 reaches
// no rank, chunk 6 only rank 0 (one hop forward), every other key chunk the three others, so
// 19 hops in all (the other way round 20); rank 3 relays the most. Contiguous, causal: the keys
// go forward to the later ranks, the queries back to the earlier ones. Not causal: everything
// everywhere. The float64 grids (CPFloat64.Ring*, Usp*) check every rank's counted bytes
// against the formulas built on these.
TEST(RingSchedule, ChunkCountsFollowTheRoutes) {
  auto counts = [](bool causal, bool balanced, bool queries) {
    std::vector<std::pair<int64_t, int64_t>> out;
    const auto chunks = ring_member_chunks(4, 1, balanced);
    for (int64_t r = 0; r < 4; ++r) {
      const auto n = ring_chunk_counts(chunks, r, causal, queries);
      out.emplace_back(n.sends, n.arrivals);
    }
    return out;
  };
  using Counts = std::vector<std::pair<int64_t, int64_t>>;
  EXPECT_EQ(ring_member_chunks(4, 1, true),
            (std::vector<std::vector<int64_t>>{{0, 7}, {2, 5}, {4, 3}, {6, 1}}));
  EXPECT_EQ(ring_member_chunks(4, 2, true),
            (std::vector<std::vector<int64_t>>{{0, 7, 2, 5}, {4, 3, 6, 1}}));
  EXPECT_EQ(counts(true, true, false), (Counts{{4, 6}, {4, 4}, {5, 4}, {6, 5}}));
  EXPECT_EQ(counts(true, false, false), (Counts{{1, 0}, {2, 1}, {3, 2}, {0, 3}}));
  EXPECT_EQ(counts(true, false, true), (Counts{{0, 3}, {3, 2}, {2, 1}, {1, 0}}));
  EXPECT_EQ(counts(false, true, false), (Counts(4, {6, 6})));
  EXPECT_EQ(counts(false, false, true), (Counts(4, {3, 3})));
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
