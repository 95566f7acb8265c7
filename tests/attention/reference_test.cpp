// The `math` and `blockwise` primitives against the float64 plain-formula reference
// (tests/harness/reference_attention.h), which shares no mask or tiling code with them: out, lse,
// dq, dk, dv over causal offsets (q_len < kv_len), bool / additive masks, mask functions (per
// head / per batch, index offsets, sliding windows, documents), fully masked rows, GQA / MQA,
// Dv != Dqk and block sizes that do not divide the lengths; float64 inputs to 1e-12, float32
// inputs to 1e-5. Then the reference itself against hand-computed values.
#include <cmath>
#include <functional>
#include <limits>
#include <string>
#include <utility>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "hp/attention/attention.h"
#include "rank_harness.h"
#include "reference_attention.h"

namespace hp::attention {
namespace {

using hp::testing::expect_close;
using hp::testing::reference_attention;

constexpr double kInf = std::numeric_limits<double>::infinity();

at::Tensor rnd(uint64_t seed, at::IntArrayRef shape) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  return at::randn(shape, gen, at::kDouble);
}

struct Grads {
  at::Tensor out, lse, dq, dk, dv;
};

using Forward = std::function<std::pair<at::Tensor, at::Tensor>(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v)>;

// Backpropagates <out, dout> + <lse, dlse> (dlse only where lse is finite, and only
// `with_dlse`). dout and dlse are fixed by seed and rounded to `grad_dtype`, so a float32 run and
// its float64 reference get the same values.
Grads run(const Forward& fwd, const at::Tensor& q0, const at::Tensor& k0, const at::Tensor& v0,
          at::ScalarType grad_dtype, bool with_dlse) {
  auto q = q0.detach().clone().requires_grad_(true);
  auto k = k0.detach().clone().requires_grad_(true);
  auto v = v0.detach().clone().requires_grad_(true);
  auto [out, lse] = fwd(q, k, v);
  auto dout = rnd(101, out.sizes()).to(grad_dtype).to(out.scalar_type());
  auto dlse = rnd(102, lse.sizes()).to(grad_dtype).to(lse.scalar_type());
  auto loss = (out * dout).sum();
  if (with_dlse) loss = loss + at::where(lse.isfinite(), lse, at::zeros_like(lse)).mul(dlse).sum();
  loss.backward();
  // An input the result does not depend on (everything masked) has no grad: that is zero.
  auto grad = [](const at::Tensor& x) { return x.grad().defined() ? x.grad() : at::zeros_like(x); };
  return {out.detach(), lse.detach(), grad(q), grad(k), grad(v)};
}

Grads run_primitive(const std::string& name, const at::Tensor& q, const at::Tensor& k,
                    const at::Tensor& v, const AttentionOptions& o, bool with_dlse = true) {
  const auto& prim = AttentionRegistry::builtin().get(name);
  return run(
      [&](const at::Tensor& q1, const at::Tensor& k1, const at::Tensor& v1) {
        auto r = prim.forward(q1, k1, v1, o);
        return std::make_pair(r.out, r.lse);
      },
      q, k, v, q.scalar_type(), with_dlse);
}

// The reference on the same values in float64.
Grads run_reference(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                    const AttentionOptions& o, bool with_dlse = true) {
  return run(
      [&](const at::Tensor& q1, const at::Tensor& k1, const at::Tensor& v1) {
        auto r = reference_attention(q1, k1, v1, o);
        return std::make_pair(r.out, r.lse);
      },
      q.to(at::kDouble), k.to(at::kDouble), v.to(at::kDouble), q.scalar_type(), with_dlse);
}

void compare(const Grads& got, const Grads& ref, const std::string& what, double tol) {
  EXPECT_EQ(got.out.sizes(), ref.out.sizes()) << what << " out shape";
  expect_close(got.out, ref.out, what + " out", tol, tol);
  // lse: -inf exactly where the reference has -inf (rows with no visible key), close elsewhere.
  ASSERT_TRUE(at::equal(got.lse.isneginf(), ref.lse.isneginf())) << what << " lse -inf pattern";
  auto fin = ref.lse.isfinite();
  expect_close(got.lse.masked_fill(~fin, 0), ref.lse.masked_fill(~fin, 0), what + " lse", tol, tol);
  expect_close(got.dq, ref.dq, what + " dq", tol, tol);
  expect_close(got.dk, ref.dk, what + " dk", tol, tol);
  expect_close(got.dv, ref.dv, what + " dv", tol, tol);
}

enum class Case {
  kNonCausal,     // no mask, Sq != Skv
  kCausal,        // causal, q_offset 0, Sq == Skv
  kCausalOffset,  // causal, q_offset > 0 and q_len < kv_len (a CP shard)
  kBoolMask,      // bool mask [B, 1, Sq, Skv] AND causal with q_offset; two fully masked rows
  kAdditive,      // per-head additive mask [1, Nq, Sq, Skv] with -inf entries; one fully masked row
  kMaskFn,        // mask function per batch and per head, index offsets, causal with q_offset
  kSlidingWindow,  // sliding_window_mask
  kDocuments,      // document_mask + causal (packed sequences)
  kSmallBlocks,    // causal + bool mask with 5 x 7 tiles
  kLargeTiles,     // causal, q_offset 40, 200 x 150 tiles (the blockwise kernel cuts diagonal
                   // tiles into 64-row pieces; some pieces see no key of their tile) + documents
};

const char* case_name(Case c) {
  switch (c) {
    case Case::kNonCausal:
      return "NonCausal";
    case Case::kCausal:
      return "Causal";
    case Case::kCausalOffset:
      return "CausalOffset";
    case Case::kBoolMask:
      return "BoolMask";
    case Case::kAdditive:
      return "Additive";
    case Case::kMaskFn:
      return "MaskFn";
    case Case::kSlidingWindow:
      return "SlidingWindow";
    case Case::kDocuments:
      return "Documents";
    case Case::kSmallBlocks:
      return "SmallBlocks";
    case Case::kLargeTiles:
      return "LargeTiles";
  }
  return "?";
}

// Whether the case has query rows that see no key at all.
bool has_fully_masked_rows(Case c) {
  return c == Case::kBoolMask || c == Case::kAdditive || c == Case::kMaskFn ||
         c == Case::kSmallBlocks;
}

struct Setup {
  at::Tensor q, k, v;  // float64
  AttentionOptions opts;
};

// Depends on b and h (per_batch, per_head) and on global indices (the offsets are applied):
// hides every fifth (b, h, q, kv) and all of global query 51 (local row 11).
MaskFunction hashed_mask() {
  MaskFunction m;
  m.fn = [](const at::Tensor& b, const at::Tensor& h, const at::Tensor& q, const at::Tensor& kv) {
    auto keep = (q * 3 + kv * 2 + h * 7 + b * 11).remainder(5).ne(0);
    return at::logical_and(keep, q.ne(51));
  };
  m.per_batch = true;
  m.per_head = true;
  m.q_index_offset = 40;
  m.kv_index_offset = 26;
  m.head_index_offset = 6;
  return m;
}

Setup make_setup(Case c, int64_t nq, int64_t nkv, int64_t dqk, int64_t dv) {
  const int64_t b = 2;
  int64_t sq = 37, skv = 53;  // neither a multiple of the 16 x 24 tiles below
  switch (c) {
    case Case::kCausal:
    case Case::kSlidingWindow:
      sq = skv = 61;
      break;
    case Case::kCausalOffset:
      sq = 25;  // queries 48..72 of a 73-long sequence, keys 0..72
      skv = 73;
      break;
    case Case::kBoolMask:
      skv = 42;  // q_offset 5: the last query sees every key
      break;
    case Case::kMaskFn:
      sq = 33;  // q_offset 14: the last query sees every key
      skv = 47;
      break;
    case Case::kDocuments:
      sq = skv = 64;
      break;
    case Case::kSmallBlocks:
      sq = 23;
      skv = 31;
      break;
    case Case::kLargeTiles:
      sq = 300;  // queries 40..339, keys 0..339
      skv = 340;
      break;
    default:
      break;
  }
  Setup s;
  s.q = rnd(1, {b, nq, sq, dqk});
  s.k = rnd(2, {b, nkv, skv, dqk});
  s.v = rnd(3, {b, nkv, skv, dv});
  s.opts.block_q = 16;
  s.opts.block_kv = 24;
  switch (c) {
    case Case::kNonCausal:
      break;
    case Case::kCausal:
      s.opts.causal = true;
      break;
    case Case::kCausalOffset:
      s.opts.causal = true;
      s.opts.causal_meta = CausalMetadata{48, sq, skv};
      break;
    case Case::kBoolMask: {
      auto m = rnd(4, {b, 1, sq, skv}).gt(-0.5);
      m.select(2, 5).fill_(false);  // fully masked query rows
      m.select(2, 20).fill_(false);
      s.opts.mask = m;
      s.opts.causal = true;
      s.opts.causal_meta = CausalMetadata{5, -1, -1};
      break;
    }
    case Case::kAdditive: {
      auto m = rnd(5, {1, nq, sq, skv}) * 0.5;
      m.masked_fill_(rnd(6, {1, nq, sq, skv}).lt(-1.0), -kInf);
      m.select(2, 7).fill_(-kInf);  // a fully masked row
      s.opts.mask = m;
      break;
    }
    case Case::kMaskFn:
      s.opts.mask_fn = hashed_mask();
      s.opts.causal = true;
      s.opts.causal_meta = CausalMetadata{14, sq, skv};
      break;
    case Case::kSlidingWindow:
      s.opts.mask_fn = sliding_window_mask(9);
      break;
    case Case::kDocuments: {
      auto ids = at::cat(
          {at::zeros({20}, at::kLong), at::ones({30}, at::kLong), at::full({14}, 2, at::kLong)});
      s.opts.mask_fn = document_mask(ids);
      s.opts.causal = true;
      break;
    }
    case Case::kSmallBlocks: {
      auto m = rnd(7, {sq, skv}).gt(-0.8);
      m.select(0, 13).fill_(false);
      s.opts.mask = m;
      s.opts.causal = true;
      s.opts.causal_meta = CausalMetadata{8, sq, skv};
      s.opts.block_q = 5;
      s.opts.block_kv = 7;
      break;
    }
    case Case::kLargeTiles: {
      // Documents 0..169 and 170..339: tile (q block 1, kv block 2) is causal only, with rows
      // that see none of its keys; the tiles of q block 0 are cut by the document boundary.
      auto ids = at::cat({at::zeros({170}, at::kLong), at::ones({170}, at::kLong)});
      s.opts.mask_fn = document_mask(ids);
      s.opts.mask_fn->q_index_offset = 40;
      s.opts.causal = true;
      s.opts.causal_meta = CausalMetadata{40, sq, skv};
      s.opts.block_q = 200;
      s.opts.block_kv = 150;
      break;
    }
  }
  return s;
}

using Heads = std::pair<int64_t, int64_t>;  // Nq, Nkv
using Dims = std::pair<int64_t, int64_t>;   // Dqk, Dv
using Param = std::tuple<Case, Heads, Dims, at::ScalarType>;
class KernelVsReference : public ::testing::TestWithParam<Param> {};

TEST_P(KernelVsReference, OutLseAndGradients) {
  auto [c, heads, dims, dtype] = GetParam();
  auto s = make_setup(c, heads.first, heads.second, dims.first, dims.second);
  auto q = s.q.to(dtype), k = s.k.to(dtype), v = s.v.to(dtype);
  auto ref = run_reference(q, k, v, s.opts);
  // The case is what it claims to be.
  EXPECT_EQ(ref.lse.isneginf().any().item<bool>(), has_fully_masked_rows(c));
  EXPECT_FALSE(ref.dq.isnan().any().item<bool>() || ref.dk.isnan().any().item<bool>() ||
               ref.dv.isnan().any().item<bool>());
  const double tol = dtype == at::kDouble ? 1e-12 : 1e-5;
  for (const std::string name : {"math", "blockwise"}) {
    SCOPED_TRACE(name);
    auto got = run_primitive(name, q, k, v, s.opts);
    EXPECT_EQ(got.out.scalar_type(), dtype);
    compare(got, ref, name + " " + case_name(c), tol);
  }
}

INSTANTIATE_TEST_SUITE_P(
    Grid, KernelVsReference,
    ::testing::Combine(::testing::Values(Case::kNonCausal, Case::kCausal, Case::kCausalOffset,
                                         Case::kBoolMask, Case::kAdditive, Case::kMaskFn,
                                         Case::kSlidingWindow, Case::kDocuments, Case::kSmallBlocks,
                                         Case::kLargeTiles),
                       ::testing::Values(Heads{4, 4}, Heads{6, 2}, Heads{3, 1}),
                       ::testing::Values(Dims{48, 32}, Dims{24, 40}),
                       ::testing::Values(at::kDouble, at::kFloat)),
    [](const auto& info) {
      // (no structured binding here: its commas would split the macro arguments)
      const auto& heads = std::get<1>(info.param);
      const auto& dims = std::get<2>(info.param);
      return std::string(case_name(std::get<0>(info.param))) + "_H" + std::to_string(heads.first) +
             "x" + std::to_string(heads.second) + "_Dqk" + std::to_string(dims.first) + "_Dv" +
             std::to_string(dims.second) +
             (std::get<3>(info.param) == at::kDouble ? "_f64" : "_f32");
    });

// --- The reference itself -----------------------------------------------------------------

TEST(Reference, MatchesHandComputedValues) {
  // One head, Dqk 2, Dv 1, scale 0.5, causal with q_offset 1: query 0 sees keys 0 and 1,
  // query 1 sees keys 0, 1 and 2.
  auto q = at::tensor({1.0, 0.0, 0.0, 1.0}, at::kDouble).view({1, 1, 2, 2});
  auto k = at::tensor({1.0, 0.0, 0.0, 2.0, 1.0, 1.0}, at::kDouble).view({1, 1, 3, 2});
  auto v = at::tensor({1.0, 2.0, 4.0}, at::kDouble).view({1, 1, 3, 1});
  AttentionOptions o;
  o.scale = 0.5;
  o.causal = true;
  o.causal_meta = CausalMetadata{1, 2, 3};
  auto r = reference_attention(q, k, v, o);
  // Scores: row 0 = [0.5, 0, (0.5 hidden)], row 1 = [0, 1, 0.5].
  const double z0 = std::exp(0.5) + 1.0;
  const double z1 = 1.0 + std::exp(1.0) + std::exp(0.5);
  auto expect_out = at::tensor({(std::exp(0.5) * 1 + 2.0) / z0,
                                (1.0 + std::exp(1.0) * 2 + std::exp(0.5) * 4) / z1},
                               at::kDouble)
                        .view({1, 1, 2, 1});
  auto expect_lse = at::tensor({std::log(z0), std::log(z1)}, at::kDouble).view({1, 1, 2});
  expect_close(r.out, expect_out, "out", 1e-14, 1e-14);
  expect_close(r.lse, expect_lse, "lse", 1e-14, 1e-14);
  auto expect_vis = at::tensor({1, 1, 0, 1, 1, 1}, at::kInt).to(at::kBool).view({1, 1, 2, 3});
  EXPECT_TRUE(at::equal(r.visible, expect_vis)) << r.visible;
}

TEST(Reference, QueryHeadReadsKvHeadHOverGroup) {
  // Nq 6, Nkv 2: query heads 0..2 read kv head 0, heads 3..5 read kv head 1.
  auto q = rnd(11, {1, 6, 5, 8}), k = rnd(12, {1, 2, 7, 8}), v = rnd(13, {1, 2, 7, 3});
  AttentionOptions o;
  auto full = reference_attention(q, k, v, o);
  for (int64_t h = 0; h < 6; ++h) {
    const int64_t kvh = h / 3;
    auto one = reference_attention(q.slice(1, h, h + 1), k.slice(1, kvh, kvh + 1),
                                   v.slice(1, kvh, kvh + 1), o);
    expect_close(full.out.slice(1, h, h + 1), one.out, "head " + std::to_string(h), 1e-14, 1e-14);
  }
}

TEST(Reference, MaskFunctionGetsEveryIndexWithItsOffsets) {
  at::Tensor seen_b, seen_h, seen_q, seen_kv;
  MaskFunction m;
  m.fn = [&](const at::Tensor& b, const at::Tensor& h, const at::Tensor& q, const at::Tensor& kv) {
    seen_b = b;
    seen_h = h;
    seen_q = q;
    seen_kv = kv;
    return kv.le(q);
  };
  m.q_index_offset = 10;
  m.kv_index_offset = 3;
  m.head_index_offset = 4;
  AttentionOptions o;
  o.mask_fn = m;
  auto r =
      reference_attention(rnd(21, {2, 3, 4, 8}), rnd(22, {2, 3, 12, 8}), rnd(23, {2, 3, 12, 8}), o);
  auto l = at::TensorOptions().dtype(at::kLong);
  EXPECT_TRUE(at::equal(seen_b, at::arange(2, l).view({2, 1, 1, 1}))) << seen_b;
  EXPECT_TRUE(at::equal(seen_h, at::arange(4, 7, l).view({1, 3, 1, 1}))) << seen_h;
  EXPECT_TRUE(at::equal(seen_q, at::arange(10, 14, l).view({1, 1, 4, 1}))) << seen_q;
  EXPECT_TRUE(at::equal(seen_kv, at::arange(3, 15, l).view({1, 1, 1, 12}))) << seen_kv;
  // Local query i sees local keys j with j + 3 <= i + 10.
  EXPECT_TRUE(r.visible[1][2][0][7].item<bool>());
  EXPECT_FALSE(r.visible[1][2][0][8].item<bool>());
}

TEST(Reference, FullyMaskedRowsGiveZeroMinusInfinityAndFiniteGradients) {
  auto mask = at::ones({6, 9}, at::kBool);
  mask.select(0, 2).fill_(false);
  AttentionOptions o;
  o.mask = mask;
  auto g = run_reference(rnd(31, {1, 2, 6, 8}), rnd(32, {1, 2, 9, 8}), rnd(33, {1, 2, 9, 5}), o);
  EXPECT_TRUE(at::equal(g.out.select(2, 2), at::zeros({1, 2, 5}, at::kDouble)));
  EXPECT_TRUE(g.lse.select(2, 2).isneginf().all().item<bool>());
  EXPECT_TRUE(g.lse.select(2, 3).isfinite().all().item<bool>());
  EXPECT_TRUE(at::equal(g.dq.select(2, 2), at::zeros({1, 2, 8}, at::kDouble)));
  EXPECT_TRUE(g.dq.isfinite().all().item<bool>());
  EXPECT_TRUE(g.dk.isfinite().all().item<bool>());
  EXPECT_TRUE(g.dv.isfinite().all().item<bool>());
}

// Every registered primitive (sdpa too, where LibTorch has it) accepts Dv != Dqk. No dlse:
// sdpa's lse is not differentiable.
TEST(Reference, EveryPrimitiveTakesItsOwnValueDim) {
  auto q = rnd(41, {2, 4, 19, 48}).to(at::kFloat), k = rnd(42, {2, 4, 26, 48}).to(at::kFloat),
       v = rnd(43, {2, 4, 26, 32}).to(at::kFloat);
  AttentionOptions o;
  o.causal = true;
  o.block_q = 8;
  o.block_kv = 8;
  auto ref = run_reference(q, k, v, o, /*with_dlse=*/false);
  for (const auto& name : AttentionRegistry::builtin().names()) {
    SCOPED_TRACE(name);
    auto got = run_primitive(name, q, k, v, o, /*with_dlse=*/false);
    EXPECT_EQ(got.out.sizes(), (std::vector<int64_t>{2, 4, 19, 32}));
    compare(got, ref, name, 1e-5);
  }
}

}  // namespace
}  // namespace hp::attention
