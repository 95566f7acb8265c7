// A tensor mask under CP: all_gather attends each rank's rows of the global mask ([S/P, S]: its
// queries' rows, every key's column) and matches the float64 single-process reference, sync and
// async, outputs and every gradient. What cannot follow a mask tensor (a frame other than
// [S/P, S], head-tail load balance, the Ulysses re-layout, the ring's key blocks) and a caller's
// causal_meta (CP places queries and keys itself) are refused before any collective.
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "cp_direct.h"
#include "cp_test_util.h"
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

// [S, S] masks: a bool mask that hides about a third of the pairs (never a query's own key, so
// no row is empty), and an additive one with -inf where the bool mask hides and finite biases
// elsewhere.
at::Tensor bool_mask() {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(11);
  auto keep = at::rand({kS, kS}, gen, at::kDouble) > 0.33;
  return keep.logical_or(at::eye(kS, at::kBool));
}

at::Tensor additive_mask() {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(12);
  auto bias = at::randn({kS, kS}, gen, at::kDouble);
  return bias.masked_fill(bool_mask().logical_not(), -std::numeric_limits<double>::infinity());
}

// This rank's rows of a global [.., S, S] mask (contiguous shards).
at::Tensor my_rows(const at::Tensor& mask, int64_t r, int64_t p) {
  return mask.narrow(-2, r * (kS / p), kS / p).contiguous();
}

TEST(TensorMaskUnderCP, AllGatherMatchesTheReference) {
  const auto q = f64(1, {1, kNq, kS, kDqk}), k = f64(2, {1, kNkv, kS, kDqk}),
             v = f64(3, {1, kNkv, kS, kDv});
  for (const bool async : {false, true}) {
    for (const bool causal : {false, true}) {
      for (const bool additive : {false, true}) {
        for (const int p : {2, 3}) {
          SCOPED_TRACE(std::string(async ? "async" : "sync") + (causal ? ", causal" : "") +
                       (additive ? ", additive" : ", bool") + ", P=" + std::to_string(p));
          const auto mask = additive ? additive_mask() : bool_mask();
          attention::AttentionOptions ref_opts;
          ref_opts.causal = causal;
          ref_opts.mask = mask;
          auto rq = q.clone().requires_grad_(true), rk = k.clone().requires_grad_(true),
               rv = v.clone().requires_grad_(true);
          auto ref = hp::testing::reference_attention(rq, rk, rv, ref_opts).out;
          ref.sum().backward();
          ContextParallelConfig cfg;
          cfg.algorithm = "all_gather";
          if (async) cfg.schedule = CPSchedule::kAsync;
          const auto norm = *normalize(cfg, p);
          std::vector<at::Tensor> outs(p), dqs(p), dks(p), dvs(p);
          run_ranks(p, [&](comm::World& w) {
            Direct m(causal);
            apply_cp(m, w, norm, /*handoffs=*/async);
            const int64_t r = w.rank();
            auto mine = [&](const at::Tensor& full) {
              return shard_sequence(full, 2, r, p, false).requires_grad_(true);
            };
            auto lq = mine(q), lk = mine(k), lv = mine(v);
            auto opts = m.core.options().attention;
            opts.mask = my_rows(mask, r, p);
            auto out = m.core.forward(m.hq(lq), m.hk(lk), m.hv(lv), opts);
            out.sum().backward();
            EXPECT_FALSE(w.context().recorder->records().empty());
            outs[r] = out.detach();
            dqs[r] = lq.grad();
            dks[r] = lk.grad();
            dvs[r] = lv.grad();
          });
          auto whole = [&](const std::vector<at::Tensor>& parts) {
            return unshard_sequence(parts, 2, false);
          };
          expect_close(whole(outs), ref.detach(), "out", 1e-10, 1e-10);
          expect_close(whole(dqs), rq.grad(), "dq", 1e-10, 1e-10);
          expect_close(whole(dks), rk.grad(), "dk", 1e-10, 1e-10);
          expect_close(whole(dvs), rv.grad(), "dv", 1e-10, 1e-10);
        }
      }
    }
  }
}

// Each case: the algorithm, whether load balance is on, the options' change, and a piece of the
// expected message. None issues a collective, sync or async (the options announced before the
// projections, so the check runs at the first handoff, before its collective starts).
TEST(TensorMaskUnderCP, WhatCannotFollowIsRefusedBeforeAnyCollective) {
  const int p = 2;
  const int64_t local = kS / p;
  struct Case {
    std::string name, algorithm;
    bool balanced;
    std::function<void(attention::AttentionOptions&)> change;
    std::string message;
    bool async_too = true;  // false: q's head count is first known at the call, after the K/V
                            // handoffs have started their collectives
  };
  const std::string frame = "give it shape [" + std::to_string(local) + ", " + std::to_string(kS) +
                            "] or [B|1, Nq|1, " + std::to_string(local) + ", " +
                            std::to_string(kS) + "]";
  const std::vector<Case> cases{
      {"a local [S/P, S/P] frame", "all_gather", false,
       [&](auto& o) {
         o.mask = at::ones({local, local}, at::kBool);
       },
       frame},
      {"the whole [S, S] mask", "all_gather", false,
       [&](auto& o) {
         o.mask = at::ones({kS, kS}, at::kBool);
       },
       frame},
      {"a head dim that is not Nq or 1", "all_gather", false,
       [&](auto& o) {
         o.mask = at::ones({5, local, kS}, at::kBool);
       },
       frame, false},
      {"an integer mask", "all_gather", false,
       [&](auto& o) {
         o.mask = at::ones({local, kS}, at::kLong);
       },
       "must be bool (true = attend) or floating point"},
      {"load balance", "all_gather", true,
       [&](auto& o) {
         o.mask = at::ones({local, kS}, at::kBool);
       },
       "which head-tail load balance splits and reorders"},
      {"ulysses", "ulysses", false,
       [&](auto& o) {
         o.mask = at::ones({local, kS}, at::kBool);
       },
       "a tensor mask cannot follow the Ulysses re-layout"},
      {"ring", "ring", false,
       [&](auto& o) {
         o.mask = at::ones({local, kS}, at::kBool);
       },
       "a tensor mask cannot be split into the ring's key blocks"},
      {"a caller's causal_meta", "all_gather", false,
       [&](auto& o) {
         o.causal_meta = attention::CausalMetadata{3, -1, -1};
       },
       "options.causal_meta is {q_offset=3, q_len=-1, kv_len=-1}; under CP"},
  };
  const auto q = f64(1, {1, kNq, kS, kDqk}), k = f64(2, {1, kNkv, kS, kDqk}),
             v = f64(3, {1, kNkv, kS, kDv});
  for (const auto& c : cases) {
    for (const bool async : {false, true}) {
      if (async && !c.async_too) continue;
      SCOPED_TRACE(c.name + (async ? ", async" : ", sync"));
      ContextParallelConfig cfg;
      cfg.algorithm = c.algorithm;
      cfg.load_balance = c.balanced;
      if (async) cfg.schedule = CPSchedule::kAsync;
      const auto norm = *normalize(cfg, p);
      run_ranks(p, [&](comm::World& w) {
        Direct m(true);
        apply_cp(m, w, norm, /*handoffs=*/async);
        auto mine = [&](const at::Tensor& full) {
          return shard_sequence(full, 2, w.rank(), p, c.balanced).requires_grad_(true);
        };
        auto opts = m.core.options().attention;
        c.change(opts);
        auto& rec = *w.context().recorder;
        rec.clear();
        if (async) m.core.host().announce(opts);
        HP_EXPECT_ERROR(m.core.forward(m.hq(mine(q)), m.hk(mine(k)), m.hv(mine(v)), opts),
                        c.message);
        EXPECT_TRUE(rec.records().empty()) << rec.records().size() << " collectives";
      });
    }
  }
}

// The neutral causal_meta ({0, -1, -1}, what unset means) passes and changes nothing.
TEST(TensorMaskUnderCP, NeutralCausalMetaIsAccepted) {
  const int p = 2;
  const auto q = f64(1, {1, kNq, kS, kDqk}), k = f64(2, {1, kNkv, kS, kDqk}),
             v = f64(3, {1, kNkv, kS, kDv});
  ContextParallelConfig cfg;
  const auto norm = *normalize(cfg, p);
  run_ranks(p, [&](comm::World& w) {
    Direct m(true);
    apply_cp(m, w, norm, /*handoffs=*/false);
    auto mine = [&](const at::Tensor& full) { return shard_sequence(full, 2, w.rank(), p, false); };
    auto opts = m.core.options().attention;
    opts.causal_meta = attention::CausalMetadata{};
    auto with = m.core.forward(mine(q), mine(k), mine(v), opts);
    auto without = m.forward(mine(q), mine(k), mine(v));
    expect_close(with, without, "out", 0, 0);
  });
}

}  // namespace
}  // namespace hp::cp
