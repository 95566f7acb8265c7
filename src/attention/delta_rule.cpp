// Gated delta rule (GDN, KDA): the token recurrence and the chunked WY kernel (delta_rule.h).
//
//   q, k [B, T, H, K] --GVA repeat (none when HV == H)--> [B, T, HV, K]; v [B, T, HV, V];
//   g [B, T, HV(, K)]; beta [B, T, HV]; state [B, HV, K, V]
//   chunked: [B, T, HV, X] -> rows [B*HV, T, X] -> delta_rule_kernel.cpp (one autograd node:
//   rows in parallel, each padded to N*C tokens and viewed as [N, C, X]; intra-chunk terms of
//   all its chunks at once (delta_rule_chunks.cpp), then the state through its N chunks in
//   order) -> out [B*HV, T, V] -> [B, T, HV, V].
//   state summary: [B, HV, N, C, X] chunk terms by autograd-visible ops, folded chunk by chunk.
#include "hp/attention/delta_rule.h"

#include <cmath>
#include <limits>
#include <vector>

#include <ATen/ATen.h>

#include "delta_rule_chunks.h"
#include "delta_rule_kernel.h"
#include "hp/common/check.h"

namespace hp::attention {
namespace {

struct Prepared {
  MixerShape shape;
  at::ScalarType compute = at::kFloat;
  at::Tensor q, k, v, g, beta, h0;  // compute dtype; q scaled; q, k repeated to value heads
};

Prepared prepare(const MixerInputs& in, const MixerOptions& o, GateKind gate, const char* who) {
  HP_CHECK(gate != GateKind::kNone, who, ": the delta rule needs gates (GDN or KDA)");
  Prepared p;
  p.shape = validate_mixer_inputs(in, o, gate, /*uses_beta=*/true, who);
  p.compute = in.q.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  const int64_t r = p.shape.value_heads / p.shape.heads;
  auto to = [&](const at::Tensor& t) { return t.to(p.compute); };
  auto heads = [&](const at::Tensor& t) { return r == 1 ? t : t.repeat_interleave(r, 2); };
  p.q = heads(to(in.q)) * p.shape.scale;
  p.k = heads(to(in.k));
  p.v = to(in.v);
  p.g = gate == GateKind::kPerHead ? to(in.g).unsqueeze(-1) : to(in.g);  // [B, T, HV, K or 1]
  p.beta = to(in.beta);
  const auto& s = p.shape;
  p.h0 = in.initial_state.defined() ? to(in.initial_state)
                                    : at::zeros({s.batch, s.value_heads, s.key_dim, s.value_dim},
                                                in.q.options().dtype(p.compute));
  return p;
}

MixerResult finish(const MixerInputs& in, const MixerOptions& o, const at::Tensor& out,
                   const at::Tensor& state) {
  MixerResult r;
  r.out = out.to(in.q.scalar_type());
  if (o.output_final_state) r.final_state = state;
  return r;
}

// [B, Tp, HV, X] -> contiguous [B, HV, N, C, X]
at::Tensor chunked_view(const at::Tensor& x, int64_t n, int64_t c) {
  return x.reshape({x.size(0), n, c, x.size(2), x.size(3)}).permute({0, 3, 1, 2, 4}).contiguous();
}

}  // namespace

MixerResult delta_rule_recurrent(const MixerInputs& in, const MixerOptions& o, GateKind gate) {
  if (in.resets.defined()) {
    validate_mixer_inputs(in, o, gate, /*uses_beta=*/true, "delta rule (recurrent)");
    return run_by_documents(in, o, [gate](const MixerInputs& i, const MixerOptions& io) {
      return delta_rule_recurrent(i, io, gate);
    });
  }
  auto p = prepare(in, o, gate, "delta rule (recurrent)");
  auto h = p.h0;
  std::vector<at::Tensor> outs;
  for (int64_t t = 0; t < p.shape.tokens; ++t) {
    auto g = p.g.select(1, t);  // [B, HV, K or 1]
    auto kt = p.k.select(1, t), vt = p.v.select(1, t), qt = p.q.select(1, t);
    h = h * at::exp(g).unsqueeze(-1);
    auto predicted = at::matmul(kt.unsqueeze(-2), h).squeeze(-2);  // S^T k: [B, HV, V]
    auto delta = (vt - predicted) * p.beta.select(1, t).unsqueeze(-1);
    h = h + kt.unsqueeze(-1) * delta.unsqueeze(-2);
    outs.push_back(at::matmul(qt.unsqueeze(-2), h).squeeze(-2));
  }
  auto out = outs.empty() ? at::empty({p.shape.batch, 0, p.shape.value_heads, p.shape.value_dim},
                                      p.v.options())
                          : at::stack(outs, 1);
  return finish(in, o, out, h);
}

namespace {

// The intra-chunk terms of every chunk at once ([B, HV, N, C, .]), by autograd-visible ATen ops.
struct Chunks {
  int64_t n = 0, c = 0;
  detail::ChunkTerms t;
};

Chunks chunk_terms(const Prepared& p, const MixerOptions& o) {
  const auto& sh = p.shape;
  Chunks ch;
  ch.c = o.chunk_size;
  ch.n = (sh.tokens + ch.c - 1) / ch.c;
  const int64_t c = ch.c, n = ch.n, pad = n * c - sh.tokens;
  auto padded = [&](const at::Tensor& t) {              // zeros after the last token (dim 1)
    std::vector<int64_t> widths(2 * (t.dim() - 1), 0);  // last dim first; the last pair is dim 1
    widths.back() = pad;
    return pad > 0 ? at::constant_pad_nd(t, widths) : t;
  };
  auto q = chunked_view(padded(p.q), n, c), k = chunked_view(padded(p.k), n, c);
  auto v = chunked_view(padded(p.v), n, c);
  auto G = chunked_view(padded(p.g), n, c).cumsum(-2);           // [B, HV, N, C, K or 1]
  auto beta = chunked_view(padded(p.beta).unsqueeze(-1), n, c);  // [B, HV, N, C, 1]
  ch.t = detail::chunk_terms(q, k, v, G, beta);
  return ch;
}

}  // namespace

MixerResult delta_rule_chunked(const MixerInputs& in, const MixerOptions& o, GateKind gate) {
  if (in.resets.defined()) {
    validate_mixer_inputs(in, o, gate, /*uses_beta=*/true, "delta rule (chunked)");
    return run_by_documents(in, o, [gate](const MixerInputs& i, const MixerOptions& io) {
      return delta_rule_chunked(i, io, gate);
    });
  }
  auto p = prepare(in, o, gate, "delta rule (chunked)");
  const auto& sh = p.shape;
  const int64_t bh = sh.batch * sh.value_heads;
  auto rows = [&](const at::Tensor& t) {  // [B, T, HV, X] -> contiguous [B*HV, T, X]
    return t.transpose(1, 2).reshape({bh, sh.tokens, t.size(3)});
  };
  auto r = detail::delta_rule_chunked_kernel(
      rows(p.q), rows(p.k), rows(p.v), rows(p.g), rows(p.beta.unsqueeze(-1)).squeeze(-1),
      p.h0.reshape({bh, sh.key_dim, sh.value_dim}), o.chunk_size);
  auto out = r.out.view({sh.batch, sh.value_heads, sh.tokens, sh.value_dim}).transpose(1, 2);
  return finish(in, o, out, r.final_state.view(p.h0.sizes()));
}

void delta_rule_state_summary(const MixerInputs& in, const MixerOptions& o, GateKind gate,
                              at::Tensor& m, at::Tensor& s) {
  if (in.resets.defined()) {
    // A row with a reset forgets its initial state: m = 0, s = its final state from zeros.
    validate_mixer_inputs(in, o, gate, /*uses_beta=*/true, "delta rule (state summary)");
    auto plain = in;
    plain.resets = at::Tensor();
    plain.initial_state = at::Tensor();
    delta_rule_state_summary(plain, o, gate, m, s);
    auto from_zero = plain;
    from_zero.resets = in.resets;
    auto fo = o;
    fo.output_final_state = true;
    auto final_state = delta_rule_chunked(from_zero, fo, gate).final_state;
    auto forgets = in.resets.any(1).view({-1, 1, 1, 1}).to(m.device());
    m = at::where(forgets, at::zeros_like(m), m);
    s = at::where(forgets, final_state.to(s.scalar_type()), s);
    return;
  }
  auto p = prepare(in, o, gate, "delta rule (state summary)");
  auto ch = chunk_terms(p, o);
  const int64_t kd = p.shape.key_dim;
  // Chunk c maps h to M_c h + S_c with M_c = Diag(e^{G_C}) - K_end^T W and S_c = K_end^T U.
  auto ends = ch.t.k_end.transpose(-1, -2);  // [B, HV, N, K, C]
  auto decay = ch.t.decay_end.squeeze(-1);   // [B, HV, N, K or 1]
  auto mc = at::diag_embed(decay.expand({decay.size(0), decay.size(1), decay.size(2), kd})) -
            at::matmul(ends, ch.t.w);
  auto sc = at::matmul(ends, ch.t.u);
  // The chunks' maps composed as a tree: neighbours (earlier e, later l) pair up into
  // (M_l M_e, M_l S_e + S_l), all pairs of a level in one batched matmul, so log2(N) levels
  // instead of N dependent steps. An odd level gets an identity map appended.
  if (mc.size(2) == 0) {  // no tokens: the identity map
    m = at::eye(kd, p.q.options()).expand({p.shape.batch, p.shape.value_heads, kd, kd});
    s = at::zeros({p.shape.batch, p.shape.value_heads, kd, p.shape.value_dim}, p.q.options());
    return;
  }
  while (mc.size(2) > 1) {
    if (mc.size(2) % 2 == 1) {
      auto id = at::eye(kd, mc.options()).expand({mc.size(0), mc.size(1), 1, kd, kd});
      mc = at::cat({mc, id}, 2);
      sc = at::cat({sc, at::zeros_like(sc.narrow(2, 0, 1))}, 2);
    }
    const int64_t half = mc.size(2) / 2;
    auto mp = mc.unflatten(2, {half, 2}), sp = sc.unflatten(2, {half, 2});
    auto m_later = mp.select(3, 1);
    mc = at::matmul(m_later, mp.select(3, 0));
    sc = at::matmul(m_later, sp.select(3, 0)) + sp.select(3, 1);
  }
  m = mc.squeeze(2);
  s = sc.squeeze(2);
}

namespace {

class DeltaRuleMixer final : public StatefulMixer {
 public:
  DeltaRuleMixer(std::string name, GateKind gate, std::string kernel)
      : name_(std::move(name)), gate_(gate), kernel_(std::move(kernel)) {
    HP_CHECK(kernel_ == "chunked" || kernel_ == "recurrent", "mixer '", name_, "': kernel '",
             kernel_, "' is not valid; valid: chunked, recurrent");
  }
  std::string name() const override { return name_; }
  GateKind gate_kind() const override { return gate_; }
  bool uses_beta() const override { return true; }
  MixerResult forward(const MixerInputs& in, const MixerOptions& o) const override {
    return kernel_ == "chunked" ? delta_rule_chunked(in, o, gate_)
                                : delta_rule_recurrent(in, o, gate_);
  }

 private:
  std::string name_;
  GateKind gate_;
  std::string kernel_;
};

}  // namespace

std::unique_ptr<StatefulMixer> make_gated_delta_net(const std::string& kernel) {
  return std::make_unique<DeltaRuleMixer>("gdn", GateKind::kPerHead, kernel);
}

std::unique_ptr<StatefulMixer> make_kimi_delta_attention(const std::string& kernel) {
  return std::make_unique<DeltaRuleMixer>("kda", GateKind::kPerChannel, kernel);
}

}  // namespace hp::attention
