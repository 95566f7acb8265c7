// Gated delta rule (GDN, KDA): the chunked kernel against the token recurrence in float64 —
// outputs, final state and every gradient (q, k, v, g, beta, initial state, with a nonzero
// gradient of the final state) — for lengths that are not a multiple of the chunk, GVA, and the
// split-sequence property state-passing CP relies on.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "hp/attention/delta_rule.h"
#include "rank_harness.h"

namespace hp::attention {
namespace {

using hp::testing::expect_close;

struct Case {
  GateKind gate = GateKind::kPerHead;
  int64_t batch = 2, tokens = 100, heads = 2, value_heads = 4, key_dim = 16, value_dim = 12;
  bool initial_state = true;
  double min_gate = -2.0;  // log-gates uniform in [min_gate, 0]
  at::ScalarType dtype = at::kDouble;
};

at::Tensor rnd(uint64_t seed, at::IntArrayRef shape) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  return at::randn(shape, gen, at::kDouble);
}

// Leaves (requires_grad) in the case's dtype; q and k L2-normalised as the layers do.
MixerInputs inputs(const Case& c, uint64_t seed = 1) {
  MixerInputs in;
  auto leaf = [&](at::Tensor t) { return t.to(c.dtype).detach().requires_grad_(true); };
  auto normed = [](const at::Tensor& t) { return t / t.norm(2, -1, true); };
  in.q = leaf(normed(rnd(seed, {c.batch, c.tokens, c.heads, c.key_dim})));
  in.k = leaf(normed(rnd(seed + 1, {c.batch, c.tokens, c.heads, c.key_dim})));
  in.v = leaf(rnd(seed + 2, {c.batch, c.tokens, c.value_heads, c.value_dim}));
  std::vector<int64_t> gshape{c.batch, c.tokens, c.value_heads};
  if (c.gate == GateKind::kPerChannel) gshape.push_back(c.key_dim);
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed + 3);
  in.g = leaf(at::rand(gshape, gen, at::kDouble) * c.min_gate);
  in.beta = leaf(at::sigmoid(rnd(seed + 4, {c.batch, c.tokens, c.value_heads})));
  if (c.initial_state) {
    in.initial_state = leaf(rnd(seed + 5, {c.batch, c.value_heads, c.key_dim, c.value_dim}) * 0.5);
  }
  return in;
}

struct Grads {
  at::Tensor out, final_state, dq, dk, dv, dg, dbeta, dh0;
};

Grads run(const MixerInputs& in, const Case& c, bool chunked, int64_t chunk = 64) {
  MixerOptions o;
  o.output_final_state = true;
  o.chunk_size = chunk;
  auto r = chunked ? delta_rule_chunked(in, o, c.gate) : delta_rule_recurrent(in, o, c.gate);
  auto dout = rnd(91, r.out.sizes()).to(r.out.scalar_type());
  auto dfinal = rnd(92, r.final_state.sizes()).to(r.final_state.scalar_type());
  ((r.out * dout).sum() + (r.final_state * dfinal).sum()).backward();
  Grads g{r.out.detach(), r.final_state.detach(), in.q.grad(), in.k.grad(), in.v.grad(),
          in.g.grad(),    in.beta.grad(),         at::Tensor()};
  if (in.initial_state.defined()) g.dh0 = in.initial_state.grad();
  return g;
}

void expect_same(const Grads& a, const Grads& b, const std::string& what, double tol) {
  expect_close(a.out, b.out, what + " out", tol, tol);
  expect_close(a.final_state, b.final_state, what + " final_state", tol, tol);
  expect_close(a.dq, b.dq, what + " dq", tol, tol);
  expect_close(a.dk, b.dk, what + " dk", tol, tol);
  expect_close(a.dv, b.dv, what + " dv", tol, tol);
  expect_close(a.dg, b.dg, what + " dg", tol, tol);
  expect_close(a.dbeta, b.dbeta, what + " dbeta", tol, tol);
  if (b.dh0.defined()) expect_close(a.dh0, b.dh0, what + " dinitial_state", tol, tol);
}

const char* gate_name(GateKind g) {
  return g == GateKind::kPerHead ? "gdn" : "kda";
}

TEST(DeltaRule, ChunkedEqualsTheRecurrenceInFloat64) {
  for (auto gate : {GateKind::kPerHead, GateKind::kPerChannel}) {
    for (int64_t chunk : {64, 16, 5}) {
      for (bool h0 : {true, false}) {
        Case c;
        c.gate = gate;
        c.initial_state = h0;
        const std::string what =
            std::string(gate_name(gate)) + " C=" + std::to_string(chunk) + (h0 ? " h0" : " no-h0");
        auto ref = run(inputs(c), c, false);
        auto got = run(inputs(c), c, true, chunk);
        expect_same(got, ref, what, 1e-9);
      }
    }
  }
}

TEST(DeltaRule, ChunkedHoldsAtTheStrongestGates) {
  // Log-gates down to kMinLogGate per token and far below (KDA, per channel), chunks that are a
  // multiple of 16 rows and chunks that are not: the decayed products stay finite in float32
  // (their sub-blocks shrink where the gates are steep) and equal the float64 recurrence. Before,
  // chunk 24 at g = -10 and chunk 64 at g = -12 gave NaN everywhere.
  auto f64 = [](Grads g) {
    for (auto* t : {&g.out, &g.final_state, &g.dq, &g.dk, &g.dv, &g.dg, &g.dbeta, &g.dh0})
      *t = t->to(at::kDouble);
    return g;
  };
  for (double min_gate : {kMinLogGate, -20.0, -300.0}) {
    Case c;
    c.gate = GateKind::kPerChannel;
    c.min_gate = min_gate;
    c.tokens = 70;
    auto ref = run(inputs(c), c, false);
    for (int64_t chunk : {64, 24, 40, 100}) {
      const std::string what =
          "kda C=" + std::to_string(chunk) + " g >= " + std::to_string(static_cast<int>(min_gate));
      c.dtype = at::kDouble;
      expect_same(run(inputs(c), c, true, chunk), ref, "float64 " + what, 1e-9);
      c.dtype = at::kFloat;
      auto got = run(inputs(c), c, true, chunk);
      EXPECT_TRUE(got.out.isfinite().all().item<bool>()) << what;
      EXPECT_TRUE(got.dg.isfinite().all().item<bool>()) << what;
      // (At g = -300 float32 keeps 1e-3 of the gradients: e^g underflows, the rows decouple.)
      expect_same(f64(got), ref, "float32 " + what, min_gate < -20 ? 5e-3 : 2e-4);
    }
  }
}

TEST(DeltaRule, GdnChunkedHoldsAtTheStrongestGates) {
  // GDN's decayed products are one C x C gate matrix masked before its exp: finite at g = -10.
  Case c;
  c.gate = GateKind::kPerHead;
  c.min_gate = kMinLogGate;
  c.tokens = 70;
  auto ref = run(inputs(c), c, false);
  expect_same(run(inputs(c), c, true), ref, "float64 at g = -10", 1e-9);
  c.dtype = at::kFloat;
  auto got = run(inputs(c), c, true);
  EXPECT_TRUE(got.out.isfinite().all().item<bool>());
  EXPECT_TRUE(got.dg.isfinite().all().item<bool>());
  auto f64 = [](Grads g) {
    for (auto* t : {&g.out, &g.final_state, &g.dq, &g.dk, &g.dv, &g.dg, &g.dbeta, &g.dh0})
      *t = t->to(at::kDouble);
    return g;
  };
  expect_same(f64(got), ref, "gdn float32 at g = -10", 2e-4);
}

TEST(DeltaRule, ChunkedBackwardWithoutTheFinalState) {
  // The state pass's hand-written backward when only the outputs reach the loss (no gradient
  // of the final state), without an initial state and with HV == H: the recurrence's gradients.
  for (auto gate : {GateKind::kPerHead, GateKind::kPerChannel}) {
    Case c;
    c.gate = gate;
    c.tokens = 77;
    c.initial_state = false;
    c.value_heads = c.heads;  // no GVA repeat
    MixerOptions o;
    o.chunk_size = 16;
    auto grads = [&](bool chunked) {
      auto in = inputs(c);
      auto r = chunked ? delta_rule_chunked(in, o, gate) : delta_rule_recurrent(in, o, gate);
      EXPECT_FALSE(r.final_state.defined());
      (r.out * rnd(95, r.out.sizes())).sum().backward();
      return std::vector<at::Tensor>{r.out.detach(), in.q.grad(), in.k.grad(),
                                     in.v.grad(),    in.g.grad(), in.beta.grad()};
    };
    auto got = grads(true), ref = grads(false);
    const char* names[] = {"out", "dq", "dk", "dv", "dg", "dbeta"};
    for (size_t i = 0; i < got.size(); ++i) {
      expect_close(got[i], ref[i], std::string(gate_name(gate)) + " no final state " + names[i],
                   1e-9, 1e-9);
    }
  }
}

TEST(DeltaRule, SplitSequenceWithStatePassingEqualsTheWhole) {
  // The bug the source design describes: a forward that uses the initial state and a backward
  // that drops its gradient. Two halves, the first's final state as the second's initial state,
  // must equal the whole in outputs and in every gradient, including dinitial_state.
  for (auto gate : {GateKind::kPerHead, GateKind::kPerChannel}) {
    Case c;
    c.gate = gate;
    c.tokens = 90;
    auto whole_in = inputs(c);
    auto whole = run(whole_in, c, true, 16);
    auto split_in = inputs(c);
    MixerOptions o;
    o.output_final_state = true;
    o.chunk_size = 16;
    // Tokens [b, b + n) of the split inputs, from `state`.
    auto part = [&](int64_t b, int64_t n, const at::Tensor& state) {
      MixerInputs p;
      p.q = split_in.q.narrow(1, b, n);
      p.k = split_in.k.narrow(1, b, n);
      p.v = split_in.v.narrow(1, b, n);
      p.g = split_in.g.narrow(1, b, n);
      p.beta = split_in.beta.narrow(1, b, n);
      p.initial_state = state;
      return p;
    };
    auto r1 = delta_rule_chunked(part(0, 37, split_in.initial_state), o, gate);
    auto second = part(37, 53, r1.final_state);
    auto r2 = delta_rule_chunked(second, o, gate);
    auto out = at::cat({r1.out, r2.out}, 1);
    auto dout = rnd(91, out.sizes()), dfinal = rnd(92, r2.final_state.sizes());
    ((out * dout).sum() + (r2.final_state * dfinal).sum()).backward();
    Grads split{out.detach(),         r2.final_state.detach(),
                split_in.q.grad(),    split_in.k.grad(),
                split_in.v.grad(),    split_in.g.grad(),
                split_in.beta.grad(), split_in.initial_state.grad()};
    expect_same(split, whole, std::string(gate_name(gate)) + " split at 37", 1e-9);
  }
}

TEST(DeltaRule, StateSummaryIsTheAffineMapOfTheInitialState) {
  for (auto gate : {GateKind::kPerHead, GateKind::kPerChannel}) {
    Case c;
    c.gate = gate;
    c.tokens = 45;
    auto in = inputs(c);
    MixerOptions o;
    o.chunk_size = 16;
    o.output_final_state = true;
    at::Tensor m, s;
    delta_rule_state_summary(in, o, gate, m, s);
    auto with_h0 = delta_rule_recurrent(in, o, gate).final_state;
    expect_close(at::matmul(m, in.initial_state) + s, with_h0,
                 std::string(gate_name(gate)) + " M h0 + S", 1e-9, 1e-9);
    // Differentiable: the summary's gradient through M h0 + S equals the recurrence's.
    auto dfinal = rnd(93, with_h0.sizes());
    (with_h0 * dfinal).sum().backward();
    auto dk_ref = in.k.grad().clone(), dg_ref = in.g.grad().clone();
    in.k.grad().zero_();
    in.g.grad().zero_();
    ((at::matmul(m, in.initial_state.detach()) + s) * dfinal).sum().backward();
    expect_close(in.k.grad(), dk_ref, std::string(gate_name(gate)) + " summary dk", 1e-9, 1e-9);
    expect_close(in.g.grad(), dg_ref, std::string(gate_name(gate)) + " summary dg", 1e-9, 1e-9);
  }
}

TEST(DeltaRule, MixersRunTheirKernelAndCheckInputs) {
  Case c;
  c.gate = GateKind::kPerChannel;
  auto in = inputs(c);
  MixerOptions o;
  auto kda = make_kimi_delta_attention();
  EXPECT_EQ(kda->name(), "kda");
  EXPECT_EQ(kda->gate_kind(), GateKind::kPerChannel);
  auto a = kda->forward(in, o).out;
  auto b = make_kimi_delta_attention("recurrent")->forward(in, o).out;
  expect_close(a, b, "kda mixer chunked vs recurrent", 1e-9, 1e-9);
  HP_EXPECT_ERROR(make_gated_delta_net()->forward(in, o), "g has shape");
  HP_EXPECT_ERROR(make_gated_delta_net("fused"), "kernel 'fused' is not valid");
}

}  // namespace
}  // namespace hp::attention
