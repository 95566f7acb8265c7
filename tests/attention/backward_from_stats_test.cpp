// AttentionPrimitive::backward_from_stats (blockwise): the gradients of a call whose keys are
// split into pieces, each piece's taken from the whole call's merged out/lse alone, summed
// (dq) and placed (dk, dv), equal the float64 reference's autograd gradients of the whole
// call. Causal pieces with their offsets (the ring's shapes: one piece fully before the
// queries, one on the diagonal), GQA, tiles that do not divide the pieces; float32 against
// the float64 reference; the same with the merged output given as its row sums against dout
// (what the ring sends when the queries travel); primitives that offer none refuse with a
// message.
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "hp/attention/attention.h"
#include "hp/common/check.h"
#include "rank_harness.h"
#include "reference_attention.h"

namespace {

using hp::attention::AttentionOptions;
using hp::attention::AttentionRegistry;
using hp::attention::CausalMetadata;
using hp::testing::expect_close;

at::Tensor rnd(uint64_t seed, at::IntArrayRef shape, at::ScalarType dtype) {
  auto g = at::make_generator<at::CPUGeneratorImpl>(seed);
  return at::randn(shape, g, at::TensorOptions().dtype(at::kDouble)).to(dtype);
}

struct Piece {
  int64_t begin, end;  // key rows
};

// Queries at key positions [q_at, q_at + Sq) of a key sequence of `skv`, causal or not, the
// keys cut into `pieces`.
void check(at::ScalarType dtype, bool causal, int64_t q_at, int64_t skv,
           const std::vector<Piece>& pieces, double tol, bool by_delta = false) {
  const int64_t sq = skv - q_at;
  auto q = rnd(1, {2, 4, sq, 8}, dtype), k = rnd(2, {2, 2, skv, 8}, dtype),
       v = rnd(3, {2, 2, skv, 6}, dtype), dout = rnd(4, {2, 4, sq, 6}, dtype);
  AttentionOptions whole;
  whole.causal = causal;
  if (causal) whole.causal_meta = CausalMetadata{q_at, sq, skv};
  auto rq = q.to(at::kDouble).requires_grad_(true), rk = k.to(at::kDouble).requires_grad_(true),
       rv = v.to(at::kDouble).requires_grad_(true);
  auto ref = hp::testing::reference_attention(rq, rk, rv, whole);
  ref.out.backward(dout.to(at::kDouble));

  const auto& prim = AttentionRegistry::builtin().get("blockwise");
  ASSERT_TRUE(prim.offers_backward_from_stats());
  auto stats = prim.forward(q, k, v, whole);  // the merged statistics the pieces share
  // rowsum(dout * out) [B, Nq, Sq], in the statistics' dtype, in place of the output.
  auto out =
      by_delta
          ? (dout.to(at::kDouble) * stats.out.to(at::kDouble)).sum(-1).to(stats.lse.scalar_type())
          : stats.out;
  auto dq = at::zeros_like(q);
  std::vector<at::Tensor> dk, dv;
  for (const auto& p : pieces) {
    AttentionOptions o;
    o.causal = causal;
    if (causal) o.causal_meta = CausalMetadata{q_at - p.begin, sq, p.end - p.begin};
    o.block_q = 5;  // tiles that do not divide the pieces
    o.block_kv = 7;
    auto g = prim.backward_from_stats(q, k.slice(2, p.begin, p.end), v.slice(2, p.begin, p.end),
                                      out, stats.lse, dout, o);
    ASSERT_EQ(g.dq.scalar_type(), dtype);
    ASSERT_EQ(g.dk.sizes(), k.slice(2, p.begin, p.end).sizes());
    dq += g.dq;
    dk.push_back(g.dk);
    dv.push_back(g.dv);
  }
  const std::string what = std::string(causal ? "causal" : "dense") + " " + c10::toString(dtype) +
                           " q_at=" + std::to_string(q_at) + (by_delta ? " from delta" : "");
  expect_close(dq.to(at::kDouble), rq.grad(), what + " dq", tol, tol);
  expect_close(at::cat(dk, 2).to(at::kDouble), rk.grad(), what + " dk", tol, tol);
  expect_close(at::cat(dv, 2).to(at::kDouble), rv.grad(), what + " dv", tol, tol);
}

TEST(BackwardFromStats, PiecesSumToTheWholeCallsGradients) {
  // Causal, queries at [24, 64): keys [0, 24) all precede them, [24, 64) is the diagonal.
  check(at::kDouble, true, 24, 64, {{0, 24}, {24, 64}}, 1e-10);
  // Three pieces, the last one straddling the queries' start (pieces start at or before the
  // first query: causal_meta.q_offset >= 0).
  check(at::kDouble, true, 24, 64, {{0, 5}, {5, 11}, {11, 64}}, 1e-10);
  check(at::kDouble, false, 0, 50, {{0, 17}, {17, 50}}, 1e-10);
  check(at::kFloat, true, 24, 64, {{0, 24}, {24, 64}}, 2e-4);
}

TEST(BackwardFromStats, TheOutputsRowSumsAgainstDoutServeInItsPlace) {
  check(at::kDouble, true, 24, 64, {{0, 5}, {5, 11}, {11, 64}}, 1e-10, /*by_delta=*/true);
  check(at::kDouble, false, 0, 50, {{0, 17}, {17, 50}}, 1e-10, /*by_delta=*/true);
  check(at::kFloat, true, 24, 64, {{0, 24}, {24, 64}}, 2e-4, /*by_delta=*/true);
}

TEST(BackwardFromStats, RefusedWhereNotOfferedAndOnWrongStatistics) {
  const auto& math = AttentionRegistry::builtin().get("math");
  EXPECT_FALSE(math.offers_backward_from_stats());
  auto q = rnd(1, {1, 2, 8, 4}, at::kFloat), k = rnd(2, {1, 2, 8, 4}, at::kFloat);
  auto out = at::zeros({1, 2, 8, 4}), lse = at::zeros({1, 2, 8});
  try {
    math.backward_from_stats(q, k, k, out, lse, out, {});
    FAIL() << "math offers no backward_from_stats";
  } catch (const hp::Error& e) {
    EXPECT_NE(std::string(e.what()).find("offers_backward_from_stats"), std::string::npos)
        << e.what();
  }
  const auto& blockwise = AttentionRegistry::builtin().get("blockwise");
  try {
    blockwise.backward_from_stats(q, k, k, out, at::zeros({1, 2, 7}), out, {});
    FAIL() << "an lse of the wrong shape must be refused";
  } catch (const hp::Error& e) {
    EXPECT_NE(std::string(e.what()).find("lse"), std::string::npos) << e.what();
  }
}

}  // namespace
