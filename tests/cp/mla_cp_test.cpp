// MLA (attention/mla.h) and its CP strategies (cp/mla.h) against the float64 explicit-score
// reference (harness/reference_mla.h): outputs and the gradients of q, latent, k_rope and w_ukv,
// for latent_all_gather and ulysses, sync and async, with and without head-tail load balance,
// P in {2, 3, 4}, packed documents against each document run alone; the schedules from the
// recording group; the byte counters against the formula; the fail-fast checks.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "hp/attention/masks.h"
#include "hp/attention/mla.h"
#include "hp/comm/collectives.h"
#include "hp/comm/device_mesh.h"
#include "hp/common/check.h"
#include "hp/cp/mla.h"
#include "hp/cp/sequence.h"
#include "rank_harness.h"
#include "reference_mla.h"

namespace hp::cp {
namespace {

using hp::testing::expect_close;
using hp::testing::run_ranks;

constexpr int64_t kB = 2, kS = 24;

attention::MLAShape small_shape() {
  attention::MLAShape s;
  s.heads = 12;
  s.d_nope = 8;
  s.d_rope = 4;
  s.d_v = 6;
  s.kv_rank = 10;
  return s;
}

struct Inputs {
  at::Tensor q, latent, k_rope, w_ukv, dout;
};

Inputs inputs(const attention::MLAShape& s, at::ScalarType dtype) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(29);
  auto r = [&](std::vector<int64_t> shape) { return at::randn(shape, gen, dtype); };
  return {r({kB, kS, s.heads, s.qk_dim()}), r({kB, kS, s.kv_rank}), r({kB, kS, s.d_rope}),
          r({s.heads * (s.d_nope + s.d_v), s.kv_rank}) * 0.3, r({kB, kS, s.heads, s.d_v})};
}

struct Grads {
  at::Tensor out, dq, dlatent, dk_rope, dw;
};

template <typename Fn>
Grads run_and_grad(const Inputs& in, Fn fn) {
  auto q = in.q.clone().requires_grad_(true), latent = in.latent.clone().requires_grad_(true);
  auto k_rope = in.k_rope.clone().requires_grad_(true), w = in.w_ukv.clone().requires_grad_(true);
  auto out = fn(q, latent, k_rope, w);
  (out * in.dout.to(out.scalar_type())).sum().backward();
  return {out.detach(), q.grad(), latent.grad(), k_rope.grad(), w.grad()};
}

TEST(MLA, SingleProcessEqualsExplicitScores) {
  const auto s = small_shape();
  auto in = inputs(s, at::kDouble);
  auto ref = run_and_grad(in, [&](auto q, auto l, auto r, auto w) {
    return hp::testing::reference_mla(q, l, r, w, s.d_v);
  });
  for (const std::string prim : {"math", "blockwise"}) {
    auto got = run_and_grad(in, [&](auto q, auto l, auto r, auto w) {
      return attention::mla_attention(q, l, r, w, s, prim);
    });
    expect_close(got.out, ref.out, prim + " out", 1e-10, 1e-10);
    expect_close(got.dq, ref.dq, prim + " dq", 1e-10, 1e-10);
    expect_close(got.dlatent, ref.dlatent, prim + " dlatent", 1e-10, 1e-10);
    expect_close(got.dk_rope, ref.dk_rope, prim + " dk_rope", 1e-10, 1e-10);
    expect_close(got.dw, ref.dw, prim + " dw_ukv", 1e-10, 1e-10);
  }
}

// Packed documents, a different split per batch row: documents that span rank boundaries,
// documents of one token, documents shorter than a shard.
at::Tensor packed_ids() {
  return at::cat({attention::document_ids_from_cu_seqlens({0, 5, 6, 17, 24}, kS),
                  attention::document_ids_from_cu_seqlens({0, 1, 11, 13, 24}, kS)});
}

// The reference of packed rows: each document of each row alone through reference_mla,
// concatenated back (no document mask involved).
at::Tensor reference_packed(const at::Tensor& q, const at::Tensor& l, const at::Tensor& r,
                            const at::Tensor& w, int64_t d_v, const at::Tensor& ids) {
  std::vector<at::Tensor> rows;
  for (int64_t b = 0; b < q.size(0); ++b) {
    std::vector<at::Tensor> docs;
    auto row = ids[ids.size(0) == 1 ? 0 : b];
    for (int64_t start = 0; start < kS;) {
      int64_t end = start;
      while (end < kS && row[end].item<int64_t>() == row[start].item<int64_t>())
        ++end;
      auto cut = [&](const at::Tensor& t) {
        return t.narrow(0, b, 1).narrow(1, start, end - start);
      };
      docs.push_back(hp::testing::reference_mla(cut(q), cut(l), cut(r), w, d_v));
      start = end;
    }
    rows.push_back(at::cat(docs, 1));
  }
  return at::cat(rows, 0);
}

void run_cp(int p, const MLACPOptions& o, const at::Tensor& doc_ids = {}) {
  const auto s = small_shape();
  auto in = inputs(s, at::kDouble);
  auto ref = run_and_grad(in, [&](auto q, auto l, auto r, auto w) {
    if (doc_ids.defined()) return reference_packed(q, l, r, w, s.d_v, doc_ids);
    return hp::testing::reference_mla(q, l, r, w, s.d_v);
  });
  run_ranks(p, [&](comm::World& w) {
    comm::DeviceMesh mesh(w, {{"cp", p}});
    auto topo = CPTopology::build(w, mesh.group_ptr({"cp"}), *normalize(std::nullopt, p));
    const int64_t r = w.rank();
    auto shard = [&](const at::Tensor& t) {
      return shard_sequence(t, 1, r, p, o.load_balance).contiguous();
    };
    Inputs local{shard(in.q), shard(in.latent), shard(in.k_rope), in.w_ukv, shard(in.dout)};
    int calls = 0;
    auto got = run_and_grad(local, [&](auto q, auto l, auto kr, auto wu) {
      return mla_attention_cp(
          [&] {
            ++calls;
            return q;
          },
          l, kr, wu, s, o, *topo, doc_ids);
    });
    EXPECT_EQ(calls, 1);
    const std::string what = o.strategy + (o.load_balance ? " lb " : " ") + to_string(o.schedule) +
                             (doc_ids.defined() ? " packed" : "") + " P=" + std::to_string(p) +
                             " rank " + std::to_string(r);
    expect_close(got.out, shard(ref.out), what + " out", 1e-10, 1e-10);
    expect_close(got.dq, shard(ref.dq), what + " dq", 1e-10, 1e-10);
    expect_close(got.dlatent, shard(ref.dlatent), what + " dlatent", 1e-10, 1e-10);
    expect_close(got.dk_rope, shard(ref.dk_rope), what + " dk_rope", 1e-10, 1e-10);
    auto dw = comm::all_reduce(mesh.group("cp"), got.dw);  // replicated: summed over CP
    expect_close(dw, ref.dw, what + " dw_ukv", 1e-10, 1e-10);
  });
}

TEST(MLACP, LatentAllGatherEqualsTheReference) {
  for (auto schedule : {CPSchedule::kSync, CPSchedule::kAsync})
    for (bool lb : {false, true})
      for (int p : {2, 3, 4}) {
        MLACPOptions o;
        o.schedule = schedule;
        o.load_balance = lb;
        run_cp(p, o);
      }
}

// The comparison strategy: expanded K/V all-gathered.
TEST(MLACP, ExpandedAllGatherEqualsTheReference) {
  for (auto schedule : {CPSchedule::kSync, CPSchedule::kAsync})
    for (bool lb : {false, true}) {
      MLACPOptions o;
      o.strategy = "all_gather";
      o.schedule = schedule;
      o.load_balance = lb;
      run_cp(3, o);
    }
}

TEST(MLACP, UlyssesEqualsTheReference) {
  for (auto schedule : {CPSchedule::kSync, CPSchedule::kAsync})
    for (int p : {2, 3, 4}) {
      MLACPOptions o;
      o.strategy = "ulysses";
      o.schedule = schedule;
      run_cp(p, o);
    }
}

// Packed documents under every strategy, sync and async, balanced and not: each rank's output
// and every gradient equal each document run alone. The single-process core with the ids too.
TEST(MLACP, PackedDocumentsEqualEachDocumentAlone) {
  const auto s = small_shape();
  const auto ids = packed_ids();
  auto in = inputs(s, at::kDouble);
  auto ref = run_and_grad(
      in, [&](auto q, auto l, auto r, auto w) { return reference_packed(q, l, r, w, s.d_v, ids); });
  auto single = run_and_grad(in, [&](auto q, auto l, auto r, auto w) {
    return attention::mla_attention(q, l, r, w, s, "blockwise", ids);
  });
  expect_close(single.out, ref.out, "single out", 1e-10, 1e-10);
  expect_close(single.dlatent, ref.dlatent, "single dlatent", 1e-10, 1e-10);
  expect_close(single.dw, ref.dw, "single dw_ukv", 1e-10, 1e-10);
  for (auto schedule : {CPSchedule::kSync, CPSchedule::kAsync}) {
    for (const std::string strategy : {"latent_all_gather", "all_gather"})
      for (bool lb : {false, true})
        for (int p : {2, 4}) {
          MLACPOptions o;
          o.strategy = strategy;
          o.schedule = schedule;
          o.load_balance = lb;
          // P=4 takes one row of ids for both batch rows (Bd = 1): its rank 1's documents start
          // at its first query, so async skips the earlier keys altogether.
          run_cp(p, o, p == 4 ? ids.narrow(0, 0, 1) : ids);
        }
    MLACPOptions o;
    o.strategy = "ulysses";
    o.schedule = schedule;
    run_cp(3, o, ids);
  }
}

// What travels: the latent strategy one all-gather of [latent | k_rope] and its reduce-scatter;
// ulysses one packed all-to-all each way (two in async: K/V first, then q). Counted bytes equal
// the formula of cp/mla.h.
TEST(MLACP, SchedulesAndBytes) {
  const auto s = small_shape();
  run_ranks(2, [&](comm::World& w) {
    comm::DeviceMesh mesh(w, {{"cp", 2}});
    auto topo = CPTopology::build(w, mesh.group_ptr({"cp"}), *normalize(std::nullopt, 2));
    auto in = inputs(s, at::kFloat);
    Inputs local{shard_sequence(in.q, 1, w.rank(), 2, false),
                 shard_sequence(in.latent, 1, w.rank(), 2, false),
                 shard_sequence(in.k_rope, 1, w.rank(), 2, false), in.w_ukv,
                 shard_sequence(in.dout, 1, w.rank(), 2, false)};
    auto& rec = *w.context().recorder;
    auto& counters = w.context().counters;
    struct Seen {
      std::vector<std::string> fwd, bwd;
      int64_t fwd_bytes = 0;
    };
    auto observe = [&](const MLACPOptions& o) {
      Seen seen;
      rec.clear();
      counters.reset();
      auto q = local.q.clone().requires_grad_(true), l = local.latent.clone().requires_grad_(true);
      auto out = mla_attention_cp([&] { return q; }, l, local.k_rope, local.w_ukv, s, o, *topo);
      seen.fwd = rec.schedule();
      seen.fwd_bytes = counters.total_bytes();
      rec.clear();
      (out * local.dout).sum().backward();
      seen.bwd = rec.schedule();
      return seen;
    };
    using V = std::vector<std::string>;
    MLACPOptions o;
    auto latent = observe(o);
    EXPECT_EQ(latent.fwd, (V{"all_gather(cp)[2,12,14]"}));  // [B, S/P, R + dr]
    EXPECT_EQ(latent.bwd, (V{"reduce_scatter(cp)[2,24,14]"}));
    EXPECT_EQ(latent.fwd_bytes, mla_forward_bytes_per_rank("latent_all_gather", s, kB, kS, 2, 4));
    o.strategy = "ulysses";
    auto uly = observe(o);
    // [B, S/P, P, H/P * (2 dq + dv)] = [2, 12, 2, 6 * 30]; back: [B, S, 1, H/P * dv]
    EXPECT_EQ(uly.fwd, (V{"all_to_all(cp)[2,12,2,180]", "all_to_all(cp)[2,24,1,36]"}));
    EXPECT_EQ(uly.fwd_bytes, mla_forward_bytes_per_rank("ulysses", s, kB, kS, 2, 4));
    o.schedule = CPSchedule::kAsync;
    auto uly_async = observe(o);
    EXPECT_EQ(uly_async.fwd, (V{"all_to_all(cp)[2,12,2,108]", "all_to_all(cp)[2,12,2,72]",
                                "all_to_all(cp)[2,24,1,36]"}));
    EXPECT_EQ(uly_async.fwd_bytes, uly.fwd_bytes);
    // The latent form sends (R + dr) per token instead of H (dq + dv).
    o = MLACPOptions{};
    o.strategy = "all_gather";
    auto expanded = observe(o);
    EXPECT_EQ(expanded.fwd, (V{"all_gather(cp)[2,12,216]"}));  // H * (dq + dv) = 12 * 18
    EXPECT_EQ(expanded.fwd_bytes, mla_expanded_gather_bytes_per_rank(s, kB, kS, 2, 4));
    EXPECT_EQ(expanded.fwd_bytes,
              latent.fwd_bytes * s.heads * (s.qk_dim() + s.d_v) / (s.kv_rank + s.d_rope));
  });
}

// The layer's queries are projected at the handoff point: async has its first transfer on its
// way when they are computed (latent_all_gather and all_gather their gather, ulysses its K/V
// all-to-all), sync computes them before any collective and refuses a wrong-shaped q before
// any collective too.
TEST(MLACP, AsyncLaunchesItsFirstTransferBeforeTheQueriesAreProjected) {
  const auto s = small_shape();
  const auto in = inputs(s, at::kDouble);
  run_ranks(2, [&](comm::World& w) {
    comm::DeviceMesh mesh(w, {{"cp", 2}});
    auto topo = CPTopology::build(w, mesh.group_ptr({"cp"}), *normalize(std::nullopt, 2));
    auto shard = [&](const at::Tensor& t) { return shard_sequence(t, 1, w.rank(), 2, false); };
    auto& rec = *w.context().recorder;
    for (const std::string strategy : {"latent_all_gather", "all_gather", "ulysses"}) {
      for (auto schedule : {CPSchedule::kSync, CPSchedule::kAsync}) {
        const std::string what = strategy + " " + to_string(schedule);
        MLACPOptions o;
        o.strategy = strategy;
        o.schedule = schedule;
        size_t launched = 99;
        rec.clear();
        auto out = mla_attention_cp(
            [&] {
              launched = rec.schedule().size();
              return shard(in.q);
            },
            shard(in.latent), shard(in.k_rope), in.w_ukv, s, o, *topo);
        EXPECT_EQ(launched, schedule == CPSchedule::kAsync ? 1u : 0u) << what;
        EXPECT_EQ(out.sizes(), shard(in.dout).sizes()) << what;
        if (schedule == CPSchedule::kAsync) continue;
        rec.clear();
        HP_EXPECT_ERROR(mla_attention_cp([&] { return shard(in.q).flatten(2); }, shard(in.latent),
                                         shard(in.k_rope), in.w_ukv, s, o, *topo),
                        "): q [2, 12, 144] must be [B, S/P=12, H=12, d_nope + d_rope=12]");
        EXPECT_TRUE(rec.schedule().empty()) << what << ": a collective ran before the refusal";
      }
    }
  });
}

TEST(MLACP, FailFast) {
  auto s = small_shape();
  MLACPOptions o;
  o.strategy = "ring";
  HP_EXPECT_ERROR(check_mla_cp("m", o, s, 8, 2),
                  "MLA CP strategy='ring' is not valid; valid: latent_all_gather, ulysses, "
                  "all_gather");
  o.strategy = "ulysses";
  s.heads = 6;
  HP_EXPECT_ERROR(check_mla_cp("m", o, s, 8, 4),
                  "MLA heads must be divisible by TP x CP: heads=6, cp_size=4");
  o.load_balance = true;
  HP_EXPECT_ERROR(check_mla_cp("m", o, s, 8, 2),
                  "load_balance applies to "
                  "strategy=latent_all_gather");
  o.strategy = "latent_all_gather";
  HP_EXPECT_ERROR(check_mla_cp("m", o, s, 7, 2),
                  "head-tail load balance needs an even local sequence length, got 7");
  o.primitive = "flash9";
  HP_EXPECT_ERROR(check_mla_cp("m", o, s, 8, 2), "flash9");
  s.d_v = 0;
  o.primitive = "blockwise";
  HP_EXPECT_ERROR(check_mla_cp("m", o, s, 8, 2), "MLA sizes must be positive");
}

// Document ids of a shard instead of the whole sequence, or ids that decrease, are refused
// before any collective (a single rank runs: a collective would hang).
TEST(MLACP, PackedDocumentIdsAreCheckedBeforeAnyCollective) {
  const auto s = small_shape();
  auto in = inputs(s, at::kDouble);
  run_ranks(2, [&](comm::World& w) {
    comm::DeviceMesh mesh(w, {{"cp", 2}});
    auto topo = CPTopology::build(w, mesh.group_ptr({"cp"}), *normalize(std::nullopt, 2));
    if (w.rank() != 0) return;
    auto local = [&](const at::Tensor& t) { return shard_sequence(t, 1, 0, 2, false); };
    auto call = [&](const at::Tensor& ids) {
      mla_attention_cp([&] { return local(in.q); }, local(in.latent), local(in.k_rope), in.w_ukv, s,
                       MLACPOptions{}, *topo, ids);
    };
    HP_EXPECT_ERROR(call(packed_ids().narrow(1, 0, kS / 2)),
                    "must be the global [B|1, S=24] document ids of the whole sequence");
    HP_EXPECT_ERROR(call(packed_ids().flip({1})), "documents.ids decrease along the sequence");
  });
}

}  // namespace
}  // namespace hp::cp
