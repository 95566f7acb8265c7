// DSA (attention/dsa.h) and its CP form (cp/dsa.h) against the float64 explicit reference
// (harness/reference_mla.h: explicit indexer scores, sort-based top-k, masked dense MLA,
// explicit KL): outputs, the indexer loss, the selection (as sets), the gradients of q, latent,
// k_rope and w_ukv (from the output) and of q_I, w_I, k_I (from the loss), sparse and dense,
// with ties in the indexer scores; under CP sync/async x load balance x P in {2, 3, 4}.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "hp/attention/dsa.h"
#include "hp/comm/collectives.h"
#include "hp/comm/device_mesh.h"
#include "hp/common/check.h"
#include "hp/cp/dsa.h"
#include "hp/cp/sequence.h"
#include "rank_harness.h"
#include "reference_mla.h"

namespace hp::cp {
namespace {

using hp::testing::expect_close;
using hp::testing::run_ranks;

constexpr int64_t kB = 2, kS = 24, kHI = 3, kDI = 5, kTopk = 5;

attention::MLAShape shape() {
  attention::MLAShape s;
  s.heads = 4;
  s.d_nope = 6;
  s.d_rope = 4;
  s.d_v = 5;
  s.kv_rank = 7;
  return s;
}

struct Inputs {
  at::Tensor q, latent, k_rope, w_ukv, qi, wi, ki, dout;
};

Inputs inputs() {
  const auto s = shape();
  auto gen = at::make_generator<at::CPUGeneratorImpl>(77);
  auto r = [&](std::vector<int64_t> sh) { return at::randn(sh, gen, at::kDouble); };
  Inputs in{r({kB, kS, s.heads, s.qk_dim()}),
            r({kB, kS, s.kv_rank}),
            r({kB, kS, s.d_rope}),
            r({s.heads * (s.d_nope + s.d_v), s.kv_rank}) * 0.4,
            r({kB, kS, kHI, kDI}),
            r({kB, kS, kHI}).abs(),
            r({kB, kS, kDI}),
            r({kB, kS, s.heads, s.d_v})};
  // Ties: keys 3, 9 and 15 are the same index key, so every query scores them equally (the
  // lower position must win a place at the top-k boundary).
  in.ki.select(1, 9).copy_(in.ki.select(1, 3));
  in.ki.select(1, 15).copy_(in.ki.select(1, 3));
  return in;
}

struct Got {
  at::Tensor out, loss, indices, dq, dlatent, dk_rope, dw, dqi, dwi, dki;
};

template <typename Fn>
Got run_and_grad(const Inputs& in, const std::function<at::Tensor(const at::Tensor&)>& shard,
                 Fn fn) {
  auto leaf = [&](const at::Tensor& t) { return shard(t).clone().requires_grad_(true); };
  auto q = leaf(in.q), latent = leaf(in.latent), k_rope = leaf(in.k_rope);
  auto w = in.w_ukv.clone().requires_grad_(true);
  auto qi = leaf(in.qi), wi = leaf(in.wi), ki = leaf(in.ki);
  attention::DSAResult r = fn(q, latent, k_rope, w, qi, wi, ki);
  ((r.out * shard(in.dout)).sum() + r.loss).backward();
  return {r.out.detach(), r.loss.detach(), r.indices, q.grad(),  latent.grad(),
          k_rope.grad(),  w.grad(),        qi.grad(), wi.grad(), ki.grad()};
}

// The selection as a [B, S, S] mask from indices (-1 = none).
at::Tensor as_mask(const at::Tensor& indices, int64_t s) {
  auto mask = at::zeros({indices.size(0), indices.size(1), s + 1}, at::kBool);
  auto idx = indices.clamp_min(-1) + 1;  // -1 -> column 0, dropped below
  mask.scatter_(2, idx, true);
  return mask.narrow(2, 1, s);
}

void expect_grads(const Got& got, const Got& ref, const std::string& what, bool summed_w) {
  expect_close(got.out, ref.out, what + " out", 1e-10, 1e-10);
  expect_close(got.dq, ref.dq, what + " dq", 1e-9, 1e-10);
  expect_close(got.dlatent, ref.dlatent, what + " dlatent", 1e-9, 1e-10);
  expect_close(got.dk_rope, ref.dk_rope, what + " dk_rope", 1e-9, 1e-10);
  if (!summed_w) expect_close(got.dw, ref.dw, what + " dw_ukv", 1e-9, 1e-10);
  expect_close(got.dqi, ref.dqi, what + " dq_index", 1e-9, 1e-10);
  expect_close(got.dwi, ref.dwi, what + " dw_index", 1e-9, 1e-10);
  expect_close(got.dki, ref.dki, what + " dk_index", 1e-9, 1e-10);
}

Got reference(const Inputs& in, const std::string& loss, at::Tensor& selected) {
  auto id = [](const at::Tensor& t) { return t; };
  return run_and_grad(in, id, [&](auto q, auto l, auto kr, auto w, auto qi, auto wi, auto ki) {
    auto r = hp::testing::reference_dsa(q, l, kr, w, shape().d_v, qi, wi, ki, kTopk, loss);
    selected = r.selected;
    return attention::DSAResult{r.out, r.loss, at::Tensor()};
  });
}

TEST(DSA, SingleProcessEqualsTheExplicitReference) {
  const auto in = inputs();
  for (const std::string loss : {"sparse", "dense"}) {
    at::Tensor selected;
    auto ref = reference(in, loss, selected);
    auto id = [](const at::Tensor& t) { return t; };
    attention::DSAOptions o;
    o.topk = kTopk;
    o.loss = loss;
    o.block_q = 7;  // blocks that do not divide S
    auto got =
        run_and_grad(in, id, [&](auto q, auto l, auto kr, auto w, auto qi, auto wi, auto ki) {
          return attention::dsa_attention(q, l, kr, w, shape(), {qi, wi, ki}, 0, o);
        });
    EXPECT_TRUE(at::equal(as_mask(got.indices, kS), selected)) << loss << ": the selection";
    EXPECT_EQ(got.indices.size(2), kTopk);
    EXPECT_EQ(got.indices[0][0][1].item<int64_t>(), -1) << "query 0 sees one key";
    expect_close(got.loss, ref.loss, loss + " index loss", 1e-10, 1e-10);
    expect_grads(got, ref, "dsa " + loss, false);
  }
}

// The sparse kernel's vector paths (four 32-byte vectors per step, then single vectors, then
// scalar columns) and its head groups of four need wider rows and a head count that is not a
// multiple of four: H = 5, row width R + d_rope = 45, value width 37. float64 to 1e-10, float32
// (the AVX2 build where the CPU has it) to float32 accuracy; the dense variant in float32 so
// that the selection cannot differ by rounding.
TEST(DSA, WideRowsInFloat64AndFloat32) {
  attention::MLAShape sh;
  sh.heads = 5;
  sh.d_nope = 9;
  sh.d_rope = 8;
  sh.d_v = 6;
  sh.kv_rank = 37;
  const int64_t b = 1, s = 40, hi = 2, di = 6, topk = 11;
  auto gen = at::make_generator<at::CPUGeneratorImpl>(5);
  auto r = [&](std::vector<int64_t> size) { return at::randn(size, gen, at::kDouble); };
  const std::vector<at::Tensor> in = {r({b, s, sh.heads, sh.qk_dim()}),
                                      r({b, s, sh.kv_rank}),
                                      r({b, s, sh.d_rope}),
                                      r({sh.heads * (sh.d_nope + sh.d_v), sh.kv_rank}) * 0.3,
                                      r({b, s, hi, di}),
                                      r({b, s, hi}).abs(),
                                      r({b, s, di}),
                                      r({b, s, sh.heads, sh.d_v})};
  for (auto dtype : {at::kDouble, at::kFloat}) {
    for (const std::string loss : {"sparse", "dense"}) {
      if (dtype == at::kFloat && loss == "sparse") continue;
      auto run = [&](bool reference) {
        std::vector<at::Tensor> x;
        for (size_t i = 0; i + 1 < in.size(); ++i)
          x.push_back(in[i].to(reference ? at::kDouble : dtype).clone().requires_grad_(true));
        at::Tensor out, index_loss;
        if (reference) {
          auto ref = hp::testing::reference_dsa(x[0], x[1], x[2], x[3], sh.d_v, x[4], x[5], x[6],
                                                topk, loss);
          out = ref.out;
          index_loss = ref.loss;
        } else {
          attention::DSAOptions o;
          o.topk = topk;
          o.loss = loss;
          o.block_q = 3;
          auto got = attention::dsa_attention(x[0], x[1], x[2], x[3], sh, {x[4], x[5], x[6]}, 0, o);
          out = got.out;
          index_loss = got.loss;
        }
        ((out * in.back().to(out.scalar_type())).sum() + index_loss).backward();
        std::vector<at::Tensor> res = {out.detach().to(at::kDouble),
                                       index_loss.detach().to(at::kDouble)};
        for (const auto& t : x)
          res.push_back(t.grad().to(at::kDouble));
        return res;
      };
      const auto ref = run(true), got = run(false);
      const double tol = dtype == at::kDouble ? 1e-10 : 2e-4;
      const char* names[] = {"out",    "index loss", "dq",       "dlatent", "dk_rope",
                             "dw_ukv", "dq_index",   "dw_index", "dk_index"};
      for (size_t i = 0; i < ref.size(); ++i) {
        expect_close(got[i], ref[i],
                     std::string(c10::toString(dtype)) + " " + loss + " " + names[i], tol, tol);
      }
    }
  }
}

// Long rows take the sampled-threshold path of the selection (4096 or more visible keys): the
// selected set must still be exactly the top-k by (score desc, position asc), ties included.
// One index head of width 1 with q = w = 1 makes every query's scores relu(k_I[s]); k_I takes
// 40 values, so every row has many ties at its k-th score.
TEST(DSA, LongRowSelectionEqualsSortedTopK) {
  const int64_t s = 4400;
  auto gen = at::make_generator<at::CPUGeneratorImpl>(11);
  auto k_index = at::randint(-5, 35, {1, s, 1}, gen, at::kDouble);
  attention::DSAIndexer index{at::ones({1, s, 1, 1}, at::kDouble), at::ones({1, s, 1}, at::kDouble),
                              k_index};
  auto scores = k_index.view({s}).clamp_min(0);
  for (int64_t topk : {7, 300, 2500}) {
    auto got = attention::dsa_select(index, 0, topk, 16);
    for (int64_t t : {int64_t{4095}, int64_t{4200}, s - 1}) {
      // Sort-based reference: descending score, ascending position; the first topk, ascending.
      auto visible = scores.narrow(0, 0, t + 1);
      auto order = at::arange(t + 1, at::kLong);
      auto key = visible * (t + 2) - order.to(at::kDouble);  // ties -> lower position first
      auto top = std::get<1>(key.sort(0, /*descending=*/true)).narrow(0, 0, topk);
      auto want = std::get<0>(top.sort());
      EXPECT_TRUE(at::equal(got[0][t], want)) << "topk " << topk << ", query " << t;
    }
  }
}

void run_cp(int p, const std::string& loss, const DSACPOptions& co) {
  const auto in = inputs();
  at::Tensor selected;
  auto ref = reference(in, loss, selected);
  run_ranks(p, [&](comm::World& w) {
    comm::DeviceMesh mesh(w, {{"cp", p}});
    auto topo = CPTopology::build(w, mesh.group_ptr({"cp"}), *normalize(std::nullopt, p));
    const int64_t r = w.rank();
    auto shard = [&](const at::Tensor& t) { return shard_sequence(t, 1, r, p, co.load_balance); };
    attention::DSAOptions o;
    o.topk = kTopk;
    o.loss = loss;
    o.block_q = 4;
    auto got =
        run_and_grad(in, shard, [&](auto q, auto l, auto kr, auto wu, auto qi, auto wi, auto ki) {
          return dsa_attention_cp(q, l, kr, wu, shape(), {qi, wi, ki}, o, co, *topo);
        });
    const std::string what = loss + (co.load_balance ? " lb " : " ") + to_string(co.schedule) +
                             " P=" + std::to_string(p) + " rank " + std::to_string(r);
    EXPECT_TRUE(at::equal(as_mask(got.indices, kS), shard(selected))) << what << ": selection";
    auto total = comm::all_reduce(mesh.group("cp"), got.loss.reshape({1}));
    expect_close(total.squeeze(), ref.loss, what + " loss (sum over ranks)", 1e-10, 1e-10);
    Got ref_shard{shard(ref.out),     ref.loss, at::Tensor(),   shard(ref.dq),  shard(ref.dlatent),
                  shard(ref.dk_rope), ref.dw,   shard(ref.dqi), shard(ref.dwi), shard(ref.dki)};
    expect_grads(got, ref_shard, what, true);
    auto dw = comm::all_reduce(mesh.group("cp"), got.dw);
    expect_close(dw, ref.dw, what + " dw_ukv", 1e-9, 1e-10);
  });
}

TEST(DSACP, AllGatherFamilyEqualsTheReference) {
  for (const std::string loss : {"sparse", "dense"})
    for (auto schedule : {CPSchedule::kSync, CPSchedule::kAsync})
      for (bool lb : {false, true})
        for (int p : {2, 3, 4}) {
          DSACPOptions co;
          co.schedule = schedule;
          co.load_balance = lb;
          run_cp(p, loss, co);
        }
}

// BNSD (q, q_I, w and the output with the heads before the sequence) equals BSND: outputs, the
// loss, the selection and every gradient, single-process and under CP (P = 2, sync and async,
// balanced and not).
TEST(DSACP, BNSDEqualsBSND) {
  const auto in = inputs();
  attention::DSAOptions o;
  o.topk = kTopk;
  o.block_q = 4;
  auto bnsd = o;
  bnsd.layout = "BNSD";
  // The call sees BNSD tensors; the transposes carry the gradients back to the BSND leaves.
  auto via_bnsd = [](auto call) {
    return [call](auto q, auto l, auto kr, auto w, auto qi, auto wi, auto ki) {
      auto r = call(q.transpose(1, 2), l, kr, w, qi.transpose(1, 2), wi.transpose(1, 2), ki);
      EXPECT_EQ(r.out.size(1), shape().heads) << "BNSD output";
      r.out = r.out.transpose(1, 2);
      return r;
    };
  };
  auto expect_same = [](const Got& got, const Got& ref, const std::string& what) {
    EXPECT_TRUE(at::equal(got.indices, ref.indices)) << what << ": selection";
    expect_close(got.loss, ref.loss, what + " loss", 1e-12, 1e-12);
    expect_close(got.dw, ref.dw, what + " dw_ukv", 1e-12, 1e-12);
    expect_grads(got, ref, what, true);
  };
  auto id = [](const at::Tensor& t) { return t; };
  auto single = [&](const attention::DSAOptions& opt) {
    return [&, opt](auto q, auto l, auto kr, auto w, auto qi, auto wi, auto ki) {
      return attention::dsa_attention(q, l, kr, w, shape(), {qi, wi, ki}, 0, opt);
    };
  };
  expect_same(run_and_grad(in, id, via_bnsd(single(bnsd))), run_and_grad(in, id, single(o)),
              "single process");
  for (auto schedule : {CPSchedule::kSync, CPSchedule::kAsync}) {
    for (bool lb : {false, true}) {
      DSACPOptions co;
      co.schedule = schedule;
      co.load_balance = lb;
      run_ranks(2, [&](comm::World& w) {
        comm::DeviceMesh mesh(w, {{"cp", 2}});
        auto topo = CPTopology::build(w, mesh.group_ptr({"cp"}), *normalize(std::nullopt, 2));
        auto shard = [&](const at::Tensor& t) { return shard_sequence(t, 1, w.rank(), 2, lb); };
        auto cp = [&](const attention::DSAOptions& opt) {
          return [&, opt](auto q, auto l, auto kr, auto wu, auto qi, auto wi, auto ki) {
            return dsa_attention_cp(q, l, kr, wu, shape(), {qi, wi, ki}, opt, co, *topo);
          };
        };
        expect_same(run_and_grad(in, shard, via_bnsd(cp(bnsd))), run_and_grad(in, shard, cp(o)),
                    std::string(to_string(schedule)) + (lb ? " lb" : "") + " rank " +
                        std::to_string(w.rank()));
      });
    }
  }
}

// The host's form: the queries are computed by the layer once the keys are handed over. Async
// has both gathers on their way when the layer projects its queries (its handoff point); sync
// projects them before any collective. Either way the results equal the tensor form's.
TEST(DSACP, AsyncGathersTheKeysWhileTheLayerProjectsItsQueries) {
  const auto in = inputs();
  for (auto schedule : {CPSchedule::kSync, CPSchedule::kAsync}) {
    run_ranks(2, [&](comm::World& w) {
      comm::DeviceMesh mesh(w, {{"cp", 2}});
      auto topo = CPTopology::build(w, mesh.group_ptr({"cp"}), *normalize(std::nullopt, 2));
      auto shard = [&](const at::Tensor& t) { return shard_sequence(t, 1, w.rank(), 2, true); };
      DSACPOptions co;
      co.schedule = schedule;
      co.load_balance = true;
      attention::DSAOptions o;
      o.topk = kTopk;
      auto& rec = *w.context().recorder;
      size_t launched_before_queries = 99;
      auto lazy =
          run_and_grad(in, shard, [&](auto q, auto l, auto kr, auto wu, auto qi, auto wi, auto ki) {
            rec.clear();
            auto queries = [&] {
              launched_before_queries = rec.schedule().size();
              return attention::DSAQueries{q, qi, wi};
            };
            return dsa_attention_cp(queries, l, kr, wu, shape(), ki, o, co, *topo);
          });
      const std::string what =
          std::string(to_string(schedule)) + " rank " + std::to_string(w.rank());
      EXPECT_EQ(launched_before_queries, schedule == CPSchedule::kAsync ? 2u : 0u) << what;
      auto eager =
          run_and_grad(in, shard, [&](auto q, auto l, auto kr, auto wu, auto qi, auto wi, auto ki) {
            return dsa_attention_cp(q, l, kr, wu, shape(), {qi, wi, ki}, o, co, *topo);
          });
      EXPECT_TRUE(at::equal(lazy.indices, eager.indices)) << what;
      expect_close(lazy.loss, eager.loss, what + " loss", 1e-12, 1e-12);
      expect_close(lazy.dw, eager.dw, what + " dw_ukv", 1e-12, 1e-12);
      expect_grads(lazy, eager, what, true);
    });
  }
}

// Two gathers forward (k_I, then [latent | k_rope]), their two reduce-scatters backward;
// counted bytes equal the formula.
TEST(DSACP, ScheduleAndBytes) {
  const auto in = inputs();
  run_ranks(2, [&](comm::World& w) {
    comm::DeviceMesh mesh(w, {{"cp", 2}});
    auto topo = CPTopology::build(w, mesh.group_ptr({"cp"}), *normalize(std::nullopt, 2));
    auto shard = [&](const at::Tensor& t) {
      return shard_sequence(t.to(at::kFloat), 1, w.rank(), 2, false)
          .contiguous()
          .requires_grad_(true);
    };
    auto q = shard(in.q), l = shard(in.latent), kr = shard(in.k_rope);
    auto qi = shard(in.qi), wi = shard(in.wi), ki = shard(in.ki);
    attention::DSAOptions o;
    o.topk = kTopk;
    auto& rec = *w.context().recorder;
    rec.clear();
    w.context().counters.reset();
    auto r =
        dsa_attention_cp(q, l, kr, in.w_ukv.to(at::kFloat), shape(), {qi, wi, ki}, o, {}, *topo);
    EXPECT_EQ(rec.schedule(),
              (std::vector<std::string>{"all_gather(cp)[2,12,5]", "all_gather(cp)[2,12,11]"}));
    EXPECT_EQ(w.context().counters.total_bytes(),
              dsa_forward_bytes_per_rank(shape(), kDI, kB, kS, 2, 4));
    rec.clear();
    (r.out.sum() + r.loss).backward();
    auto bwd = rec.schedule();
    std::sort(bwd.begin(), bwd.end());
    EXPECT_EQ(bwd, (std::vector<std::string>{"reduce_scatter(cp)[2,24,11]",
                                             "reduce_scatter(cp)[2,24,5]"}));
  });
}

TEST(DSACP, FailFast) {
  const auto in = inputs();
  attention::DSAOptions o;
  o.loss = "entropy";
  HP_EXPECT_ERROR(check_dsa_cp("dsa", o, {}, in.q, in.latent, in.k_rope, {in.qi, in.wi, in.ki}, 2),
                  "DSA index loss 'entropy' is not valid; valid: sparse, dense");
  o = attention::DSAOptions{};
  HP_EXPECT_ERROR(
      check_dsa_cp("dsa", o, {}, in.q.flatten(2), in.latent, in.k_rope, {in.qi, in.wi, in.ki}, 2),
      "DSA takes 4-D queries in its layout BSND: q must be [B, S, H, d_nope + d_rope], got "
      "[2, 24, 40]");
  o.layout = "SBND";
  HP_EXPECT_ERROR(check_dsa_cp("dsa", o, {}, in.q, in.latent, in.k_rope, {in.qi, in.wi, in.ki}, 2),
                  "dsa: DSA layout 'SBND' is not valid; valid: BSND (q [B, S, H, dq]), BNSD");
  o.layout = "BNSD";  // a BSND q read as BNSD: the sequence is 4 (the heads), not 24
  HP_EXPECT_ERROR(check_dsa_cp("dsa", o, {}, in.q, in.latent, in.k_rope, {in.qi, in.wi, in.ki}, 2),
                  "dsa (BNSD read as BSND): latent [2, 24, 7] must be [B=2, S=4, kv_rank]");
  o.layout = "BSND";
  HP_EXPECT_ERROR(check_dsa_cp("dsa", o, {}, in.q, in.latent, in.k_rope,
                               {in.qi, in.wi, in.ki.narrow(2, 0, 2)}, 2),
                  "k_index [2, 24, 2] must be [B=2, S=24, d_I=5]");
  // The fused kernels read rows by index: a bad index is refused, never read.
  at::Tensor out, p_mean;
  auto kv = at::cat({in.latent, in.k_rope}, -1);
  auto q_abs = attention::dsa_absorb_queries(in.q, in.w_ukv, shape());
  auto bad = at::zeros({kB, kS, 2}, at::kLong);
  bad[1][3][1] = kS;
  HP_EXPECT_ERROR(attention::dsa_sparse_mqa(q_abs, kv, bad, shape().kv_rank, 1.0, 4, out, p_mean),
                  "dsa_sparse_mqa: index 24 is past the 24 keys");
  bad[1][3][1] = -2;
  HP_EXPECT_ERROR(attention::dsa_sparse_mqa(q_abs, kv, bad, shape().kv_rank, 1.0, 4, out, p_mean),
                  "dsa_sparse_mqa: index -2 is not a key position");
  HP_EXPECT_ERROR(attention::dsa_sparse_mqa(q_abs, kv.to(at::kFloat), bad.clamp_min(0),
                                            shape().kv_rank, 1.0, 4, out, p_mean),
                  "queries and keys must both be float32 or both float64");
  DSACPOptions lb;
  lb.load_balance = true;
  HP_EXPECT_ERROR(
      check_dsa_cp("dsa", o, lb, in.q.narrow(1, 0, 5), in.latent.narrow(1, 0, 5),
                   in.k_rope.narrow(1, 0, 5),
                   {in.qi.narrow(1, 0, 5), in.wi.narrow(1, 0, 5), in.ki.narrow(1, 0, 5)}, 2),
      "head-tail load balance needs an even local sequence length, got 5");
}

}  // namespace
}  // namespace hp::cp
