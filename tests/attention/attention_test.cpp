// blockwise vs math (out, lse, dq, dk, dv) over lengths, head dims, GQA, causal offsets and
// masks; math vs LibTorch autograd of the plain formula; block skipping; bad input.
#include <cmath>
#include <limits>

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>

#include "hp/attention/attention.h"
#include "hp/common/check.h"
#include "rank_harness.h"
#include "reference_attention.h"

namespace hp::attention {
namespace {

using hp::testing::expect_close;

constexpr double kInf = std::numeric_limits<double>::infinity();

struct Grads {
  at::Tensor out, lse, dq, dk, dv;
};

at::Tensor rnd(uint64_t seed, at::IntArrayRef shape) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  return at::randn(shape, gen, at::kFloat);
}

// Runs `prim` and backpropagates <out, dout> + <lse, dlse> (dlse only on finite lse).
Grads run(const AttentionPrimitive& prim, const at::Tensor& q0, const at::Tensor& k0,
          const at::Tensor& v0, const AttentionOptions& o, bool with_dlse = true) {
  auto q = q0.clone().requires_grad_(true);
  auto k = k0.clone().requires_grad_(true);
  auto v = v0.clone().requires_grad_(true);
  auto r = prim.forward(q, k, v, o);
  auto dout = rnd(77, r.out.sizes());
  auto loss = (r.out * dout).sum();
  if (with_dlse) {
    auto finite = r.lse.isfinite();
    auto dlse = rnd(78, r.lse.sizes()).to(r.lse.scalar_type());
    loss = loss + at::where(finite, r.lse, at::zeros_like(r.lse)).mul(dlse).sum();
  }
  loss.backward();
  // An input the result does not depend on (everything masked) has no grad: that is zero.
  auto grad = [](const at::Tensor& x) { return x.grad().defined() ? x.grad() : at::zeros_like(x); };
  return {r.out.detach(), r.lse.detach(), grad(q), grad(k), grad(v)};
}

void compare(const Grads& a, const Grads& b, const std::string& what, double tol = 1e-5) {
  expect_close(a.out, b.out, what + " out", tol, tol);
  // lse: -inf exactly where the reference has -inf, close elsewhere.
  ASSERT_TRUE(at::equal(a.lse.isneginf(), b.lse.isneginf())) << what << " lse -inf pattern";
  auto fin = b.lse.isfinite();
  expect_close(a.lse.masked_fill(~fin, 0), b.lse.masked_fill(~fin, 0), what + " lse", tol, tol);
  EXPECT_FALSE(a.out.isnan().any().item<bool>()) << what << " out has NaN";
  expect_close(a.dq, b.dq, what + " dq", tol, tol);
  expect_close(a.dk, b.dk, what + " dk", tol, tol);
  expect_close(a.dv, b.dv, what + " dv", tol, tol);
}

enum class Case {
  kDense,         // no mask, odd length
  kCausal,        // causal, q_offset 0
  kCausalOffset,  // causal, q_offset > 0 and q_len < kv_len (a CP shard)
  kBoolMask,      // bool mask, some rows fully masked
  kBoolMaskCausal,
  kAdditive,  // additive mask with -inf entries
  kAdditiveCausal,
  kSlidingWindow,   // mask function
  kDocumentCausal,  // mask function (packed sequences) + causal
};

const char* case_name(Case c) {
  switch (c) {
    case Case::kDense:
      return "Dense";
    case Case::kCausal:
      return "Causal";
    case Case::kCausalOffset:
      return "CausalOffset";
    case Case::kBoolMask:
      return "BoolMask";
    case Case::kBoolMaskCausal:
      return "BoolMaskCausal";
    case Case::kAdditive:
      return "Additive";
    case Case::kAdditiveCausal:
      return "AdditiveCausal";
    case Case::kSlidingWindow:
      return "SlidingWindow";
    case Case::kDocumentCausal:
      return "DocumentCausal";
  }
  return "?";
}

struct Setup {
  at::Tensor q, k, v;
  AttentionOptions opts;
};

Setup make_setup(Case c, int64_t d, int64_t nq, int64_t nkv) {
  const int64_t b = 2;
  int64_t sq = 67, skv = 67;  // odd, not a multiple of the blocks below
  if (c == Case::kCausal || c == Case::kDocumentCausal) sq = skv = 64;
  if (c == Case::kCausalOffset) {
    sq = 24;  // rank 2 of 4 over S = 96: its queries start at 48, keys up to its prefix
    skv = 72;
  }
  Setup s;
  s.q = rnd(1, {b, nq, sq, d});
  s.k = rnd(2, {b, nkv, skv, d});
  s.v = rnd(3, {b, nkv, skv, d});
  s.opts.block_q = 16;
  s.opts.block_kv = 24;
  switch (c) {
    case Case::kDense:
      break;
    case Case::kCausal:
      s.opts.causal = true;
      break;
    case Case::kCausalOffset:
      s.opts.causal = true;
      s.opts.causal_meta = CausalMetadata{48, sq, skv};
      break;
    case Case::kBoolMask:
    case Case::kBoolMaskCausal: {
      auto m = rnd(4, {b, 1, sq, skv}).gt(-0.5);
      m.select(2, 5).fill_(false);  // a fully masked query row
      m.select(2, 40).fill_(false);
      s.opts.mask = m;
      s.opts.causal = c == Case::kBoolMaskCausal;
      break;
    }
    case Case::kAdditive:
    case Case::kAdditiveCausal: {
      auto m = rnd(5, {1, nq, sq, skv}) * 0.5;
      m.masked_fill_(rnd(6, {1, nq, sq, skv}).lt(-1.0), -kInf);
      m.select(2, 7).fill_(-kInf);  // fully masked row
      s.opts.mask = m;
      s.opts.causal = c == Case::kAdditiveCausal;
      break;
    }
    case Case::kSlidingWindow:
      s.opts.mask_fn = sliding_window_mask(9);
      break;
    case Case::kDocumentCausal: {
      auto ids = at::cat(
          {at::zeros({20}, at::kLong), at::ones({30}, at::kLong), at::full({14}, 2, at::kLong)});
      s.opts.mask_fn = document_mask(ids);
      s.opts.causal = true;
      break;
    }
  }
  return s;
}

using Param = std::tuple<Case, int64_t, std::pair<int64_t, int64_t>>;
class BlockwiseVsMath : public ::testing::TestWithParam<Param> {};

TEST_P(BlockwiseVsMath, OutLseAndGradients) {
  auto [c, d, heads] = GetParam();
  auto s = make_setup(c, d, heads.first, heads.second);
  const auto& reg = AttentionRegistry::builtin();
  auto ref = run(reg.get("math"), s.q, s.k, s.v, s.opts);
  auto got = run(reg.get("blockwise"), s.q, s.k, s.v, s.opts);
  compare(got, ref, case_name(c));
}

INSTANTIATE_TEST_SUITE_P(
    Grid, BlockwiseVsMath,
    ::testing::Combine(::testing::Values(Case::kDense, Case::kCausal, Case::kCausalOffset,
                                         Case::kBoolMask, Case::kBoolMaskCausal, Case::kAdditive,
                                         Case::kAdditiveCausal, Case::kSlidingWindow,
                                         Case::kDocumentCausal),
                       ::testing::Values(32, 64, 128),
                       ::testing::Values(std::make_pair<int64_t, int64_t>(8, 8),
                                         std::make_pair<int64_t, int64_t>(8, 2),
                                         std::make_pair<int64_t, int64_t>(8, 1))),
    [](const auto& info) {
      const auto& h = std::get<2>(info.param);
      return std::string(case_name(std::get<0>(info.param))) + "_D" +
             std::to_string(std::get<1>(info.param)) + "_H" + std::to_string(h.first) + "x" +
             std::to_string(h.second);
    });

TEST(Blockwise, EvenLengthsAndDefaultBlocks) {
  for (int64_t sq : {64, 300, 1000}) {
    auto q = rnd(11, {1, 4, sq, 64}), k = rnd(12, {1, 2, sq, 64}), v = rnd(13, {1, 2, sq, 64});
    AttentionOptions o;
    o.causal = true;
    const auto& reg = AttentionRegistry::builtin();
    compare(run(reg.get("blockwise"), q, k, v, o), run(reg.get("math"), q, k, v, o),
            "S=" + std::to_string(sq), 2e-5);
  }
}

TEST(Blockwise, CausalTilesAboveTheDiagonalAreSkippedNotMasked) {
  // Queries 0..15 see keys 0..15 only (q_offset 0); keys 16.. are NaN. A kernel that computed
  // and then masked those tiles would turn p @ V into NaN.
  auto q = rnd(21, {1, 2, 16, 32});
  auto k = rnd(22, {1, 2, 64, 32});
  auto v = rnd(23, {1, 2, 64, 32});
  k.slice(2, 16).fill_(std::nan(""));
  v.slice(2, 16).fill_(std::nan(""));
  AttentionOptions o;
  o.causal = true;
  o.block_q = 16;
  o.block_kv = 16;
  auto r = AttentionRegistry::builtin().get("blockwise").forward(q, k, v, o);
  EXPECT_FALSE(r.out.isnan().any().item<bool>());
  auto ref =
      AttentionRegistry::builtin().get("math").forward(q, k.slice(2, 0, 16), v.slice(2, 0, 16), o);
  expect_close(r.out, ref.out, "skipped tiles");
}

TEST(Blockwise, TilesHiddenByAMaskFunctionAreSkipped) {
  auto q = rnd(31, {1, 2, 64, 32});
  auto k = rnd(32, {1, 2, 64, 32});
  auto v = rnd(33, {1, 2, 64, 32});
  // Window 8 with 16-row tiles: tile (3, 0) (queries 48..63, keys 0..15) is wholly hidden.
  k.slice(2, 0, 16).fill_(std::nan(""));
  v.slice(2, 0, 16).fill_(std::nan(""));
  AttentionOptions o;
  o.mask_fn = sliding_window_mask(8);
  o.block_q = 16;
  o.block_kv = 16;
  auto r = AttentionRegistry::builtin().get("blockwise").forward(q, k, v, o);
  EXPECT_FALSE(r.out.slice(2, 48).isnan().any().item<bool>());
}

// Packed documents: one call over the packed batch equals every document run alone
// (float64 reference), outputs and gradients, for both primitives, GQA, causal and not, a
// different packing per batch row, and documents shorter than a tile.
TEST(Documents, PackedCallEqualsEachDocumentAlone) {
  auto f64 = [](uint64_t seed, at::IntArrayRef shape) { return rnd(seed, shape).to(at::kDouble); };
  const int64_t s = 40;
  auto ids = at::cat({document_ids_from_cu_seqlens({0, 3, 17, 18, 33}, s),
                      document_ids_from_cu_seqlens({0, 21, s}, s)});
  auto q0 = f64(51, {2, 4, s, 8}), k0 = f64(52, {2, 2, s, 8}), v0 = f64(53, {2, 2, s, 6});
  auto dout = f64(54, {2, 4, s, 6});
  for (const char* prim : {"math", "blockwise"}) {
    for (bool causal : {true, false}) {
      const std::string what = std::string(prim) + (causal ? " causal" : " dense");
      auto rq = q0.clone().requires_grad_(true), rk = k0.clone().requires_grad_(true),
           rv = v0.clone().requires_grad_(true);
      hp::testing::reference_packed_attention(rq, rk, rv, ids, causal).backward(dout);
      auto q = q0.clone().requires_grad_(true), k = k0.clone().requires_grad_(true),
           v = v0.clone().requires_grad_(true);
      AttentionOptions o;
      o.causal = causal;
      o.documents = Documents{ids};
      o.block_q = 6;
      o.block_kv = 7;
      auto r = AttentionRegistry::builtin().get(prim).forward(q, k, v, o);
      r.out.backward(dout);
      expect_close(r.out, hp::testing::reference_packed_attention(q0, k0, v0, ids, causal),
                   what + " out", 1e-12, 1e-12);
      expect_close(q.grad(), rq.grad(), what + " dq", 1e-12, 1e-12);
      expect_close(k.grad(), rk.grad(), what + " dk", 1e-12, 1e-12);
      expect_close(v.grad(), rv.grad(), what + " dv", 1e-12, 1e-12);
    }
  }
  // A block of the packed sequence (queries 18..39 against keys 4..39) placed by q_start and
  // kv_start gives the same rows.
  AttentionOptions o;
  o.documents = Documents{ids, 18, 4};
  auto part = AttentionRegistry::builtin()
                  .get("blockwise")
                  .forward(q0.slice(2, 18), k0.slice(2, 4), v0.slice(2, 4), o);
  AttentionOptions whole;
  whole.documents = Documents{ids};
  auto full = AttentionRegistry::builtin().get("math").forward(q0, k0, v0, whole);
  // Batch row 0: every document of queries 18.. starts at or after key 4 (row 1's first
  // document starts at 0, so its rows differ).
  expect_close(part.out.narrow(0, 0, 1), full.out.narrow(0, 0, 1).slice(2, 18), "q_start/kv_start",
               1e-12, 1e-12);
}

TEST(Documents, TilesNoDocumentSpansAreSkippedAndBadIdsAreRefused) {
  // Two documents of 32 with 16-row tiles: the tiles across them are never computed (NaN keys
  // of the first document cannot reach the second's queries).
  auto q = rnd(61, {1, 2, 64, 16}), k = rnd(62, {1, 2, 64, 16}), v = rnd(63, {1, 2, 64, 16});
  k.slice(2, 0, 32).fill_(std::nan(""));
  v.slice(2, 0, 32).fill_(std::nan(""));
  AttentionOptions o;
  o.documents = Documents{document_ids_from_cu_seqlens({0, 32, 64}, 64)};
  o.block_q = 16;
  o.block_kv = 16;
  auto r = AttentionRegistry::builtin().get("blockwise").forward(q, k, v, o);
  EXPECT_FALSE(r.out.slice(2, 32).isnan().any().item<bool>());
  auto decreasing = at::tensor({0, 0, 1, 0}, at::kLong).view({1, 4});
  auto small = rnd(64, {1, 1, 4, 8});
  o.documents = Documents{decreasing};
  HP_EXPECT_ERROR(AttentionRegistry::builtin().get("blockwise").forward(small, small, small, o),
                  "documents.ids decrease along the sequence");
  o.documents = Documents{at::zeros({1, 3}, at::kLong)};
  HP_EXPECT_ERROR(AttentionRegistry::builtin().get("math").forward(small, small, small, o),
                  "reaches past the 3 positions of documents.ids");
  o.documents = Documents{at::zeros({1, 4}, at::kLong)};
  if (AttentionRegistry::builtin().contains("sdpa")) {
    HP_EXPECT_ERROR(AttentionRegistry::builtin().get("sdpa").forward(small, small, small, o),
                    "attention 'sdpa' takes no documents");
  }
  HP_EXPECT_ERROR(document_ids_from_cu_seqlens({0, 5, 5, 8}, 8), "cu_seqlens must increase");
  // A zero or negative scale (uniform weights, or the softmax inverted) is refused.
  o.documents.reset();
  for (double bad : {0.0, -0.5}) {
    o.scale = bad;
    HP_EXPECT_ERROR(AttentionRegistry::builtin().get("blockwise").forward(small, small, small, o),
                    "must be finite and > 0 (leave it unset for 1/sqrt(head_dim))");
  }
  EXPECT_TRUE(at::equal(document_positions(document_ids_from_cu_seqlens({0, 2, 5}, 6)),
                        at::tensor({0, 1, 0, 1, 2, 0}, at::kLong).view({1, 6})));
}

TEST(BlockMask, DerivedFromTheMaskFunction) {
  // Window 8 over 64 positions in 16x16 tiles: the diagonal is partial, the tile left of it
  // partial (keys 8 back), everything else empty; causal adds nothing here.
  auto bm = block_mask(sliding_window_mask(8), 1, 1, 64, 64, 16, 16);
  auto expect = at::zeros({4, 4}, at::kByte);
  for (int i = 0; i < 4; ++i) {
    expect[i][i] = 1;
    if (i > 0) expect[i][i - 1] = 1;
  }
  EXPECT_TRUE(at::equal(bm, expect)) << bm;
  // Document mask (two documents of 32) with causal: off-diagonal tiles inside a document are
  // fully visible, tiles across documents are skipped.
  auto ids = at::cat({at::zeros({32}, at::kLong), at::ones({32}, at::kLong)});
  auto dm = block_mask(document_mask(ids), 1, 1, 64, 64, 16, 16, /*causal=*/true);
  EXPECT_EQ(dm[1][0].item<int>(), 2);
  EXPECT_EQ(dm[2][1].item<int>(), 0);
  EXPECT_EQ(dm[3][2].item<int>(), 2);
  EXPECT_EQ(dm[0][1].item<int>(), 0);
  EXPECT_EQ(dm[2][2].item<int>(), 1);
}

TEST(Math, MatchesAutogradOfThePlainFormula) {
  for (auto [nq, nkv] : {std::pair<int64_t, int64_t>{8, 8}, {8, 2}, {8, 1}}) {
    auto q0 = rnd(41, {2, nq, 33, 32}), k0 = rnd(42, {2, nkv, 40, 32}),
         v0 = rnd(43, {2, nkv, 40, 32});
    auto mask = rnd(44, {33, 40}).gt(-1.0);
    AttentionOptions o;
    o.causal = true;
    o.causal_meta = CausalMetadata{7, 33, 40};
    o.mask = mask;
    auto got = run(AttentionRegistry::builtin().get("math"), q0, k0, v0, o, false);
    // Plain formula, K/V repeated the obvious way, everything through LibTorch autograd.
    auto q = q0.clone().requires_grad_(true), k = k0.clone().requires_grad_(true),
         v = v0.clone().requires_grad_(true);
    auto kr = k.repeat_interleave(nq / nkv, 1), vr = v.repeat_interleave(nq / nkv, 1);
    auto scores = at::matmul(q, kr.transpose(-2, -1)) / std::sqrt(32.0);
    auto causal = at::arange(40).view({1, -1}).le(at::arange(33).view({-1, 1}) + 7);
    auto out = at::matmul(at::softmax(scores.masked_fill(~(causal & mask), -kInf), -1), vr);
    (out * rnd(77, out.sizes())).sum().backward();
    expect_close(got.out, out.detach(), "math out");
    expect_close(got.dq, q.grad(), "math dq");
    expect_close(got.dk, k.grad(), "math dk");
    expect_close(got.dv, v.grad(), "math dv");
  }
}

TEST(Attention, FullyMaskedRowsGiveZerosAndMinusInfinityNotNaN) {
  auto q = rnd(51, {1, 2, 8, 16}), k = rnd(52, {1, 2, 8, 16}), v = rnd(53, {1, 2, 8, 16});
  AttentionOptions o;
  o.mask = at::zeros({8, 8}, at::kBool);
  for (const auto& name : {"math", "blockwise"}) {
    auto g = run(AttentionRegistry::builtin().get(name), q, k, v, o);
    EXPECT_TRUE(at::equal(g.out, at::zeros_like(g.out))) << name;
    EXPECT_TRUE(g.lse.isneginf().all().item<bool>()) << name;
    EXPECT_TRUE(at::equal(g.dq, at::zeros_like(g.dq))) << name;
    EXPECT_FALSE(g.dk.isnan().any().item<bool>()) << name;
  }
}

TEST(Attention, DoubleInputsStayDouble) {
  auto q = rnd(61, {1, 2, 20, 16}).to(at::kDouble), k = rnd(62, {1, 2, 20, 16}).to(at::kDouble),
       v = rnd(63, {1, 2, 20, 16}).to(at::kDouble);
  AttentionOptions o;
  o.causal = true;
  o.block_q = 8;
  o.block_kv = 8;
  const auto& reg = AttentionRegistry::builtin();
  auto a = run(reg.get("blockwise"), q, k, v, o), b = run(reg.get("math"), q, k, v, o);
  EXPECT_EQ(a.out.scalar_type(), at::kDouble);
  compare(a, b, "double", 1e-10);
}

std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const hp::Error& e) {
    return e.what();
  }
  return "";
}

TEST(Attention, BadInputGetsAClearError) {
  const auto& prim = AttentionRegistry::builtin().get("blockwise");
  AttentionOptions o;
  auto q = at::zeros({1, 8, 16, 32}), kv = at::zeros({1, 2, 16, 32});
  EXPECT_NE(error_of([&] {
              prim.forward(q.squeeze(0), kv, kv, o);
            }).find("q, k, v must be 4-d BNSD [B, N, S, D]; got q [8,16,32]"),
            std::string::npos);
  auto k3 = at::zeros({1, 3, 16, 32});
  EXPECT_NE(error_of([&] { prim.forward(q, k3, k3, o); }).find("Nq=8 is not a multiple of Nkv=3"),
            std::string::npos);
  auto k64 = at::zeros({1, 2, 16, 64});
  EXPECT_NE(error_of([&] {
              prim.forward(q, k64, k64, o);
            }).find("last dim of q (32) and k (64) differ; q and k must share Dqk"),
            std::string::npos);
  // v may have its own last dim, but not its own heads or length.
  EXPECT_EQ(error_of([&] { prim.forward(q, kv, k64, o); }), "");
  auto v15 = at::zeros({1, 2, 15, 48});
  EXPECT_NE(error_of([&] {
              prim.forward(q, kv, v15, o);
            }).find("v [1,2,15,48] must match k [1,2,16,32] in Nkv and Skv"),
            std::string::npos);
  AttentionOptions bad_mask;
  bad_mask.mask = at::ones({16, 15}, at::kBool);
  EXPECT_NE(error_of([&] {
              prim.forward(q, kv, kv, bad_mask);
            }).find("mask [16,15] is not broadcastable to [B, Nq, Sq, Skv] = [1,8,16,16]"),
            std::string::npos);
  AttentionOptions meta;
  meta.causal = true;
  meta.causal_meta = CausalMetadata{0, 8, 16};
  EXPECT_NE(error_of([&] {
              prim.forward(q, kv, kv, meta);
            }).find("causal_meta.q_len=8 but q has 16 positions"),
            std::string::npos);
  EXPECT_NE(error_of([] {
              AttentionRegistry::builtin().get("flash3");
            }).find("unknown attention primitive 'flash3'; valid: math, blockwise"),
            std::string::npos);
}

}  // namespace
}  // namespace hp::attention
