// Packed documents in the gated delta rule (MixerInputs::resets, run_by_documents): both kernels
// against a float64 token recurrence written here that zeroes the state at every reset (no
// library code), outputs, final state and every gradient (q, k, v, g, beta, initial state);
// documents that start at token 0, end at the last token, are one token long, and rows with
// none; the state summary's M and S; and the bad-input messages.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "hp/attention/delta_rule.h"
#include "rank_harness.h"

namespace hp::attention {
namespace {

using hp::testing::expect_close;

constexpr int64_t kB = 3, kT = 45, kH = 2, kHV = 4, kK = 8, kV = 6;

at::Tensor rnd(uint64_t seed, at::IntArrayRef shape) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  return at::randn(shape, gen, at::kDouble);
}

MixerInputs leaves(GateKind gate, const at::Tensor& resets) {
  MixerInputs in;
  auto leaf = [](at::Tensor t) { return t.detach().requires_grad_(true); };
  auto normed = [](const at::Tensor& t) { return t / t.norm(2, -1, true); };
  in.q = leaf(normed(rnd(1, {kB, kT, kH, kK})));
  in.k = leaf(normed(rnd(2, {kB, kT, kH, kK})));
  in.v = leaf(rnd(3, {kB, kT, kHV, kV}));
  auto gen = at::make_generator<at::CPUGeneratorImpl>(4);
  std::vector<int64_t> gs{kB, kT, kHV};
  if (gate == GateKind::kPerChannel) gs.push_back(kK);
  in.g = leaf(at::rand(gs, gen, at::kDouble) * -1.5);
  in.beta = leaf(at::sigmoid(rnd(5, {kB, kT, kHV})));
  in.initial_state = leaf(rnd(6, {kB, kHV, kK, kV}) * 0.5);
  in.resets = resets;
  return in;
}

// Row 0: documents [0, 9) [9, 10) [10, 30) [30, 45); row 1: a reset at token 0 (the initial
// state is dropped) and at 44 (a one-token document at the end); row 2: none.
at::Tensor resets_of_the_batch() {
  auto r = at::zeros({kB, kT}, at::kBool);
  for (int64_t t : {9, 10, 30})
    r[0][t] = true;
  r[1][0] = true;
  r[1][44] = true;
  return r;
}

// The recurrence of mixer.h, token by token, with S <- 0 before every reset token's update.
MixerResult reference(const MixerInputs& in, GateKind gate) {
  const double scale = 1.0 / std::sqrt(static_cast<double>(kK));
  std::vector<at::Tensor> outs;
  auto h = in.initial_state;  // [B, HV, K, V]
  auto keep = in.resets.logical_not().to(at::kDouble);
  for (int64_t t = 0; t < kT; ++t) {
    h = h * keep.select(1, t).view({kB, 1, 1, 1});
    auto q = in.q.select(1, t).repeat_interleave(kHV / kH, 1) * scale;  // [B, HV, K]
    auto k = in.k.select(1, t).repeat_interleave(kHV / kH, 1);
    auto decay = at::exp(in.g.select(1, t));  // [B, HV] or [B, HV, K]
    h = h * (gate == GateKind::kPerHead ? decay.view({kB, kHV, 1, 1}) : decay.unsqueeze(-1));
    auto kh = (k.unsqueeze(-1) * h).sum(2);  // S^T k [B, HV, V]
    auto delta = (in.v.select(1, t) - kh) * in.beta.select(1, t).unsqueeze(-1);
    h = h + k.unsqueeze(-1) * delta.unsqueeze(-2);
    outs.push_back((q.unsqueeze(-1) * h).sum(2));
  }
  return {at::stack(outs, 1), h};
}

std::vector<at::Tensor> grads_of(const MixerInputs& in, const MixerResult& r) {
  auto dout = rnd(91, r.out.sizes()), dfinal = rnd(92, r.final_state.sizes());
  ((r.out.to(at::kDouble) * dout).sum() + (r.final_state.to(at::kDouble) * dfinal).sum())
      .backward();
  return {
      r.out.detach(), r.final_state.detach(), in.q.grad(), in.k.grad(), in.v.grad(), in.g.grad(),
      in.beta.grad(), in.initial_state.grad()};
}

TEST(MixerDocuments, BothKernelsRestartTheStateAtEveryDocumentInFloat64) {
  const char* names[] = {"out", "final_state", "dq", "dk", "dv", "dg", "dbeta", "dinitial_state"};
  for (auto gate : {GateKind::kPerHead, GateKind::kPerChannel}) {
    auto ref_in = leaves(gate, resets_of_the_batch());
    auto ref = grads_of(ref_in, reference(ref_in, gate));
    // Row 1 drops its initial state at token 0: no gradient reaches it.
    EXPECT_EQ(ref[7].select(0, 1).abs().max().item<double>(), 0.0);
    for (bool chunked : {true, false}) {
      for (int64_t chunk : {16, 7}) {
        if (!chunked && chunk != 16) continue;
        auto in = leaves(gate, resets_of_the_batch());
        MixerOptions o;
        o.output_final_state = true;
        o.chunk_size = chunk;
        auto got = grads_of(
            in, chunked ? delta_rule_chunked(in, o, gate) : delta_rule_recurrent(in, o, gate));
        const std::string what = std::string(gate == GateKind::kPerHead ? "gdn " : "kda ") +
                                 (chunked ? "chunked C=" + std::to_string(chunk) : "recurrent");
        for (size_t i = 0; i < ref.size(); ++i)
          expect_close(got[i], ref[i], what + " " + names[i], 1e-9, 1e-9);
      }
    }
  }
}

TEST(MixerDocuments, WithoutResetsTheDocumentsDoNotMatter) {
  // The reference without resets is a different sequence: resets do change the result, and an
  // all-false resets tensor is the plain run.
  auto none = at::zeros({kB, kT}, at::kBool);
  auto in = leaves(GateKind::kPerHead, none);
  MixerOptions o;
  o.output_final_state = true;
  auto plain = in;
  plain.resets = at::Tensor();
  auto a = delta_rule_chunked(in, o, GateKind::kPerHead);
  auto b = delta_rule_chunked(plain, o, GateKind::kPerHead);
  EXPECT_TRUE(at::equal(a.out, b.out));
  auto packed = leaves(GateKind::kPerHead, resets_of_the_batch());
  auto c = delta_rule_chunked(packed, o, GateKind::kPerHead);
  EXPECT_GT((c.out - b.out).select(0, 0).narrow(0, 9, 36).abs().max().item<double>(), 1e-3);
  // Row 2 has no reset: the same as without documents.
  expect_close(c.out.select(0, 2), b.out.select(0, 2), "row without resets", 1e-12, 1e-12);
}

TEST(MixerDocuments, StateSummaryForgetsTheInitialStateOfRowsWithAReset) {
  for (auto gate : {GateKind::kPerHead, GateKind::kPerChannel}) {
    auto in = leaves(gate, resets_of_the_batch());
    in.g = in.g.detach() * 0.02;  // weak decay: row 2's M stays far from 0 over 45 tokens
    MixerOptions o;
    at::Tensor m, s;
    delta_rule_state_summary(in, o, gate, m, s);
    // final = M h + S for any h: check against the reference from two initial states.
    for (uint64_t seed : {7u, 8u}) {
      auto probe = in;
      probe.initial_state = rnd(seed, {kB, kHV, kK, kV});
      auto want = reference(probe, gate).final_state;
      expect_close(at::matmul(m, probe.initial_state) + s, want, "summary", 1e-9, 1e-9);
    }
    EXPECT_EQ(m.select(0, 0).abs().max().item<double>(), 0.0);
    EXPECT_EQ(m.select(0, 1).abs().max().item<double>(), 0.0);
    EXPECT_GT(m.select(0, 2).abs().max().item<double>(), 1e-2);
  }
}

TEST(MixerDocuments, BadResetsAreRefusedByName) {
  auto in = leaves(GateKind::kPerHead, at::zeros({kB, kT}, at::kLong));
  MixerOptions o;
  try {
    delta_rule_chunked(in, o, GateKind::kPerHead);
    ADD_FAILURE() << "int64 resets accepted";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("resets has dtype Long; it must be bool"),
              std::string::npos)
        << e.what();
  }
  in.resets = at::zeros({kB, kT + 1}, at::kBool);
  try {
    delta_rule_recurrent(in, o, GateKind::kPerHead);
    ADD_FAILURE() << "resets of the wrong length accepted";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("resets has shape"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace hp::attention
