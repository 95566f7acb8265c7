// The GDN and KDA layers: the chunked kernel against the token recurrence through the whole layer
// (float64: output, dx and every parameter gradient), and the staged form state-passing CP is
// built from — two halves, the second with the first's conv halo and final state — equal to the
// whole sequence, forward and backward.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "hp/common/check.h"
#include "hp/model/linear_attention.h"
#include "rank_harness.h"

namespace hp::model {
namespace {

using hp::testing::expect_close;

LinearAttentionConfig config(const std::string& mixer, const std::string& kernel) {
  LinearAttentionConfig c;
  c.mixer = mixer;
  c.kernel = kernel;
  c.hidden = 24;
  c.heads = 2;
  c.value_heads = 4;
  c.key_dim = 8;
  c.value_dim = 6;
  c.gate_rank = 5;
  c.chunk_size = 16;
  return c;
}

at::Tensor input(int64_t s) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(5);
  return at::randn({2, s, 24}, gen, at::kDouble);
}

struct Result {
  at::Tensor y, dx;
  std::map<std::string, at::Tensor> grads;
};

Result collect(LinearAttention& m, const at::Tensor& y, const at::Tensor& x) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(6);
  (y * at::randn(y.sizes(), gen, at::kDouble)).sum().backward();
  Result r{y.detach(), x.grad(), {}};
  for (const auto& p : m->named_parameters())
    r.grads[p.key()] = p.value().grad();
  return r;
}

void expect_same(const Result& a, const Result& b, const std::string& what, double tol) {
  expect_close(a.y, b.y, what + " y", tol, tol);
  expect_close(a.dx, b.dx, what + " dx", tol, tol);
  ASSERT_EQ(a.grads.size(), b.grads.size());
  for (const auto& [name, g] : b.grads) {
    ASSERT_TRUE(a.grads.at(name).defined()) << what << " " << name;
    expect_close(a.grads.at(name), g, what + " d" + name, tol, tol);
  }
}

Result run_whole(const std::string& mixer, const std::string& kernel, int64_t s) {
  LinearAttention m(config(mixer, kernel));
  m->to(at::kDouble);
  auto x = input(s).requires_grad_(true);
  return collect(m, m->forward(x), x);
}

TEST(LinearAttentionLayer, ChunkedEqualsTheRecurrenceThroughTheLayer) {
  for (const std::string mixer : {"gdn", "kda"}) {
    auto ref = run_whole(mixer, "recurrent", 40);
    auto got = run_whole(mixer, "chunked", 40);
    expect_same(got, ref, mixer, 1e-9);
    EXPECT_EQ(got.grads.count("w_gate_b"), mixer == "kda" ? 1u : 0u);
  }
}

TEST(LinearAttentionLayer, TwoHalvesWithHaloAndStateEqualTheWhole) {
  for (const std::string mixer : {"gdn", "kda"}) {
    auto whole = run_whole(mixer, "chunked", 40);
    LinearAttention m(config(mixer, "chunked"));
    m->to(at::kDouble);
    auto x = input(40).requires_grad_(true);
    const int64_t split = 17, w = m->config().conv_width;
    auto p1 = m->project(x.narrow(1, 0, split));
    auto p2 = m->project(x.narrow(1, split, 40 - split));
    auto in1 = m->mixer_inputs(m->convolve(p1.qkv), p1.beta_logit, p1.gate_in);
    auto r1 = m->mix(in1, /*output_final_state=*/true);
    auto halo = p1.qkv.narrow(1, split - (w - 1), w - 1);  // the previous rank's last rows
    auto in2 = m->mixer_inputs(m->convolve(p2.qkv, halo), p2.beta_logit, p2.gate_in);
    in2.initial_state = r1.final_state;
    auto r2 = m->mix(in2);
    auto y = at::cat({m->output(r1.out, m->project_out_gate(x.narrow(1, 0, split))),
                      m->output(r2.out, m->project_out_gate(x.narrow(1, split, 40 - split)))},
                     1);
    expect_same(collect(m, y, x), whole, mixer + " halves", 1e-9);
  }
}

TEST(LinearAttentionLayer, PackedDocumentsEqualEachDocumentAlone) {
  // Row 0: documents [0, 2) [2, 15) [15, 16) [16, 40) (one shorter than the conv, one token
  // long); row 1: one document. Both kernels; output, dx and every parameter gradient.
  auto ids = at::zeros({2, 40}, at::kLong);
  ids[0].narrow(0, 2, 38).fill_(1);
  ids[0].narrow(0, 15, 25).fill_(2);
  ids[0].narrow(0, 16, 24).fill_(3);
  const std::vector<std::pair<int64_t, int64_t>> row0{{0, 2}, {2, 13}, {15, 1}, {16, 24}};
  for (const std::string kernel : {"chunked", "recurrent"}) {
    for (const std::string mixer : {"gdn", "kda"}) {
      LinearAttention packed(config(mixer, kernel));
      packed->to(at::kDouble);
      auto x = input(40).requires_grad_(true);
      auto got = collect(packed, packed->forward(x, ids), x);
      // The same layer on each document alone (a fresh sequence each), concatenated.
      LinearAttention alone(config(mixer, kernel));
      alone->to(at::kDouble);
      auto xa = input(40).requires_grad_(true);
      std::vector<at::Tensor> parts;
      for (const auto& [start, len] : row0)
        parts.push_back(alone->forward(xa.narrow(0, 0, 1).narrow(1, start, len)));
      auto y = at::cat({at::cat(parts, 1), alone->forward(xa.narrow(0, 1, 1))}, 0);
      const std::string what = mixer + " " + kernel + " packed";
      expect_same(got, collect(alone, y, xa), what, 1e-9);
      // Documents matter: the packed row 0 differs from the unpacked layer after token 2.
      auto plain = packed->forward(input(40));
      EXPECT_GT((plain - got.y).select(0, 0).narrow(0, 2, 38).abs().max().item<double>(), 1e-4)
          << what;
    }
  }
}

TEST(LinearAttentionLayer, DocumentViewsOfAShard) {
  // Tokens [4, 10) of a sequence with documents starting at 0, 5 and 6 (conv width 4).
  auto ids = at::tensor({0, 0, 0, 0, 0, 1, 2, 2, 2, 2, 2, 2}, at::kLong).unsqueeze(0);
  auto d = attention::linear_documents(ids, 4, 6, 4);
  EXPECT_TRUE(
      at::equal(d.resets, at::tensor({0, 1, 1, 0, 0, 0}, at::kLong).to(at::kBool).view({1, 6})));
  // Row t's taps read tokens 4+t-3 .. 4+t (oldest first).
  auto want = at::tensor({1, 1, 1, 1,   // token 4 (doc 0): tokens 1..4
                          0, 0, 0, 1,   // token 5 (doc 1): 2..5
                          0, 0, 0, 1,   // token 6 (doc 2): 3..6
                          0, 0, 1, 1,   // token 7: 4..7
                          0, 1, 1, 1,   // token 8: 5..8
                          1, 1, 1, 1},  // token 9: 6..9
                         at::kLong);
  EXPECT_TRUE(at::equal(d.taps, want.to(at::kBool).view({1, 6, 4}))) << d.taps;
  // At the start of the sequence: no reset at token 0, the taps before it (the zero halo) kept.
  auto first = attention::linear_documents(ids, 0, 2, 4);
  EXPECT_FALSE(first.resets.any().item<bool>());
  EXPECT_TRUE(first.taps.all().item<bool>());
  HP_EXPECT_ERROR(attention::linear_documents(ids, 8, 6, 4),
                  "tokens [8, 14) are not inside the 12-token sequence doc_ids describes");
  HP_EXPECT_ERROR(attention::linear_documents(ids, 0, 2, 4, 16),
                  "doc_ids describe 12 tokens but the global sequence has 16");
  HP_EXPECT_ERROR(attention::linear_documents(ids.to(at::kInt), 0, 2, 4),
                  "doc_ids must be int64 [B|1, S]");
  // An id that comes back after another document: token 4 starts a document, yet its conv taps
  // kept tokens 1 and 2 of the first one (same id). Refused, as softmax attention refuses it.
  auto back = at::tensor({0, 0, 0, 1, 0, 0, 0, 0}, at::kLong).unsqueeze(0);
  HP_EXPECT_ERROR(attention::linear_documents(back, 4, 4, 4),
                  "doc_ids decrease along the sequence; packed documents need non-decreasing ids");
  EXPECT_FALSE(attention::linear_documents(at::Tensor(), 0, 2, 4).resets.defined());
}

TEST(LinearAttentionLayer, BadConfigsFailClearly) {
  auto c = config("gdn", "chunked");
  c.value_heads = 3;
  HP_EXPECT_ERROR(validate(c), "value_heads=3 must be a multiple of heads=2");
  c = config("mamba", "chunked");
  HP_EXPECT_ERROR(validate(c), "mixer='mamba' is not valid; valid: gdn, kda");
}

}  // namespace
}  // namespace hp::model
