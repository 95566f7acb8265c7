// What packed documents let all_gather and the Ulysses family skip: with documents that
// hide every other rank's keys from every rank's queries, no collective runs, forward or backward;
// sync decides at the call, async at its first K/V handoff when the module announced the call's
// options before its projections (AttentionHost::announce). Results equal the float64
// single-process reference.
#include <functional>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "cp_direct.h"
#include "cp_test_util.h"
#include "hp/attention/masks.h"
#include "hp/comm/collectives.h"
#include "hp/common/check.h"
#include "hp/cp/config.h"
#include "hp/cp/sequence.h"
#include "rank_harness.h"
#include "reference_attention.h"

namespace hp::cp {
namespace {

using namespace hp::cp::testing;  // NOLINT: the float64 tests' module, inputs and shapes
using hp::testing::expect_close;
using hp::testing::run_ranks;

// How the call's schedule learns of the documents.
enum class When { kSync, kAsyncAnnounced, kAsyncUnannounced };

const char* when_name(When w) {
  return w == When::kSync             ? "sync"
         : w == When::kAsyncAnnounced ? "async, announced"
                                      : "async, not announced";
}

// Runs the float64 layer over `p` ranks under `cfg` (the async schedule unless `when` is sync)
// with the documents `cu` (announced before the call where `when` says so), hands each rank's
// issued collectives to `check`, and compares the outputs and every gradient with the
// single-process reference.
void run_against_reference(
    ContextParallelConfig cfg, int p, When when, const std::vector<int64_t>& cu,
    const std::function<void(const std::vector<comm::CollectiveRecord>&)>& check) {
  const auto q = f64(1, {1, kNq, kS, kDqk}), k = f64(2, {1, kNkv, kS, kDqk}),
             v = f64(3, {1, kNkv, kS, kDv});
  if (when != When::kSync) cfg.schedule = CPSchedule::kAsync;
  const auto norm = *normalize(cfg, p);
  const bool balanced = cfg.load_balance;
  auto ids = attention::document_ids_from_cu_seqlens(cu, kS);
  Direct ref(true, ids);
  auto rq = q.clone().requires_grad_(true), rk = k.clone().requires_grad_(true),
       rv = v.clone().requires_grad_(true);
  auto ref_out = ref.forward(rq, rk, rv);
  ref_out.sum().backward();
  std::vector<at::Tensor> outs(p), dqs(p), dks(p), dvs(p);
  run_ranks(p, [&](comm::World& w) {
    Direct m(true, ids);
    apply_cp(m, w, norm, /*handoffs=*/when != When::kSync);
    const int64_t r = w.rank();
    auto mine = [&](const at::Tensor& full) {
      return shard_sequence(full, 2, r, p, balanced).requires_grad_(true);
    };
    auto lq = mine(q), lk = mine(k), lv = mine(v);
    auto& rec = *w.context().recorder;
    rec.clear();
    if (when == When::kAsyncAnnounced) m.core.host().announce(m.core.options().attention);
    auto out = m.forward(lq, lk, lv);
    out.sum().backward();
    check(rec.records());
    outs[r] = out.detach();
    dqs[r] = lq.grad();
    dks[r] = lk.grad();
    dvs[r] = lv.grad();
  });
  auto whole = [&](const std::vector<at::Tensor>& parts) {
    return unshard_sequence(parts, 2, balanced);
  };
  expect_close(whole(outs), ref_out.detach(), "out", 1e-10, 1e-10);
  expect_close(whole(dqs), rq.grad(), "dq", 1e-10, 1e-10);
  expect_close(whole(dks), rk.grad(), "dk", 1e-10, 1e-10);
  expect_close(whole(dvs), rv.grad(), "dv", 1e-10, 1e-10);
}

// Documents = the chunks each rank holds (contiguous at P=3, head-tail at P=2): no collective
// at all, sync or async-announced; async without the announcement gathers as before (the
// handoffs start before the call). Documents {0..19}, {20..47} at P=3 need the gathers in
// every schedule.
TEST(AllGatherSchedule, NoGatherWhenDocumentsHideEveryOtherRanksKeys) {
  struct Run {
    int p;
    bool balanced;
    std::vector<int64_t> cu;
    bool hidden;  // the documents hide every other rank's keys
  };
  for (const auto& run :
       {Run{3, false, {0, 16, 32, kS}, true}, Run{2, true, {0, 12, 24, 36, kS}, true},
        Run{3, false, {0, 20, kS}, false}}) {
    for (When when : {When::kSync, When::kAsyncAnnounced, When::kAsyncUnannounced}) {
      SCOPED_TRACE("P=" + std::to_string(run.p) + (run.balanced ? " balanced " : " ") +
                   when_name(when));
      ContextParallelConfig cfg;
      cfg.algorithm = "all_gather";
      cfg.load_balance = run.balanced;
      const bool skipped = run.hidden && when != When::kAsyncUnannounced;
      run_against_reference(cfg, run.p, when, run.cu, [&](const auto& records) {
        EXPECT_EQ(records.empty(), skipped) << records.size() << " collectives";
      });
    }
  }
}

// The Ulysses family (ulysses at P = 2, hybrid and usp at P = 4, U = 2): documents that hide every
// other rank's keys from every rank's queries move nothing (sync, and async where the call was
// announced; unannounced, the A2As started at the handoffs and run); documents that hide only every
// other co-group's keys (from the chunks a co-rank holds after the A2A) skip hybrid's co-group
// gathers and usp's ring shifts. Contiguous shards of 24 at P = 2 and 12 at P = 4; balanced (data
// order, chunks 2r and 2P-2r-1 of 6): rank 0 chunks 0, 7, rank 1 2, 5, rank 2 4, 3, rank 3 6, 1, so
// only chunks 3 and 4 may share a document. Documents {0..19}, {20..47} need every collective.
TEST(UlyssesFamilySchedule, NothingMovesThatTheDocumentsHide) {
  const std::vector<int64_t> per_co{0, 10, 24, kS}, per_chunk{0, 6, 12, 18, 30, 36, 42, kS},
      across{0, 20, kS};
  struct Run {
    std::string algorithm;
    int p;
    int64_t u;
    bool balanced;
    std::vector<int64_t> cu;
    bool rank_hidden, co_hidden;  // every other rank's / co-group's keys hidden
  };
  for (const auto& run :
       {Run{"ulysses", 2, 2, false, per_co, true, true},
        Run{"ulysses", 2, 2, false, across, false, true},
        Run{"hybrid", 4, 2, false, per_co, false, true},
        Run{"hybrid", 4, 2, true, per_chunk, true, true},
        Run{"hybrid", 4, 2, false, across, false, false},
        Run{"usp", 4, 2, true, per_chunk, true, true}, Run{"usp", 4, 2, false, per_co, false, true},
        Run{"usp", 4, 2, false, across, false, false}}) {
    for (When when : {When::kSync, When::kAsyncAnnounced, When::kAsyncUnannounced}) {
      SCOPED_TRACE(run.algorithm + (run.balanced ? " balanced, " : ", ") + when_name(when) +
                   ", documents " + std::to_string(run.cu.size() - 1));
      ContextParallelConfig cfg;
      cfg.algorithm = run.algorithm;
      cfg.ulysses_degree = run.u;
      cfg.load_balance = run.balanced;
      const bool nothing = run.rank_hidden && when != When::kAsyncUnannounced;
      run_against_reference(cfg, run.p, when, run.cu, [&](const auto& records) {
        int64_t a2a = 0, co = 0;
        for (const auto& c : records)
          (c.op == comm::OpKind::kAllToAll ? a2a : co) += 1;
        EXPECT_EQ(a2a == 0, nothing) << a2a << " all-to-alls";
        EXPECT_EQ(co == 0, run.co_hidden) << co << " co-group collectives";
      });
    }
  }
}

// An announcement is the call's promise: when it let the handoffs skip the gathers and the
// call then needs them (here: it passes no documents), the call fails with both named. A
// later call without an announcement gathers as usual.
TEST(AllGatherSchedule, AnAnnouncementTheCallBreaksIsRefused) {
  const int p = 3;
  ContextParallelConfig cfg;
  cfg.algorithm = "all_gather";
  cfg.schedule = CPSchedule::kAsync;
  const auto norm = *normalize(cfg, p);
  const auto q = f64(1, {1, kNq, kS, kDqk}), k = f64(2, {1, kNkv, kS, kDqk}),
             v = f64(3, {1, kNkv, kS, kDv});
  auto ids = attention::document_ids_from_cu_seqlens({0, 16, 32, kS}, kS);
  run_ranks(p, [&](comm::World& w) {
    Direct m(true);  // the call passes no documents
    apply_cp(m, w, norm);
    auto mine = [&](const at::Tensor& full) {
      return shard_sequence(full, 2, w.rank(), p, false).requires_grad_(true);
    };
    auto announced = Direct::options(true, ids).attention;
    m.core.host().announce(announced);
    HP_EXPECT_ERROR(m.forward(mine(q), mine(k), mine(v)),
                    "the options announced before the projections (packed documents, causal=1) "
                    "let the handoffs skip the K/V collectives, but this call's options (no "
                    "documents, causal=1) need them");
    auto& rec = *w.context().recorder;
    rec.clear();
    auto out = m.forward(mine(q), mine(k), mine(v));
    EXPECT_FALSE(rec.schedule().empty());
    EXPECT_TRUE(out.isfinite().all().item<bool>());
  });
}

// Document ids of this rank's shard instead of the global sequence (ShardedBatch::local_doc_ids
// for doc_ids): refused before any collective, sync and async (announced), on every strategy.
// The strategies' block skipping used to read them past their end, so ranks could disagree on
// skipping a gather (a hang) or all skip it (a silently wrong result).
TEST(DocumentsUnderCP, LocalIdsAreRefusedBeforeAnyCollective) {
  const int p = 2;
  const auto q = f64(1, {1, kNq, kS, kDqk}), k = f64(2, {1, kNkv, kS, kDqk}),
             v = f64(3, {1, kNkv, kS, kDv});
  auto ids = attention::document_ids_from_cu_seqlens({0, 16, 32, kS}, kS);
  for (const char* algo : {"all_gather", "ulysses", "ring"}) {
    for (When when : {When::kSync, When::kAsyncAnnounced}) {
      ContextParallelConfig cfg;
      cfg.algorithm = algo;
      if (when != When::kSync) cfg.schedule = CPSchedule::kAsync;
      const auto norm = *normalize(cfg, p);
      run_ranks(p, [&](comm::World& w) {
        auto local = shard_sequence(ids, 1, w.rank(), p, false);
        Direct m(true, local);
        apply_cp(m, w, norm, /*handoffs=*/when != When::kSync);
        auto mine = [&](const at::Tensor& full) {
          return shard_sequence(full, 2, w.rank(), p, false).requires_grad_(true);
        };
        auto& rec = *w.context().recorder;
        rec.clear();
        if (when == When::kAsyncAnnounced) m.core.host().announce(m.core.options().attention);
        HP_EXPECT_ERROR(m.forward(mine(q), mine(k), mine(v)),
                        "must hold the document id of every global position, [B|1, " +
                            std::to_string(kS) + "]");
        EXPECT_TRUE(rec.records().empty()) << algo << ", " << when_name(when);
      });
    }
  }
}

}  // namespace
}  // namespace hp::cp
