// Gated delta rule (GDN, KDA): the token recurrence and the chunked WY kernel (delta_rule.h).
//
//   q, k [B, T, H, K] --GVA repeat--> [B, T, HV, K]; v [B, T, HV, V]; g [B, T, HV(, K)];
//   beta [B, T, HV]; state [B, HV, K, V]
//   chunked: pad T to N*C (g = 0, beta = 0, k = 0: padding leaves the state alone), view as
//   [B, HV, N, C, .], intra-chunk WY terms for all chunks at once, then the state passes through
//   the N chunks in order (two matmuls each), and the outputs of all chunks in one batch.
#include "hp/attention/delta_rule.h"

#include <cmath>
#include <limits>
#include <vector>

#include <ATen/ATen.h>

#include "hp/common/check.h"
#include "delta_rule_scan.h"

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

// Decayed products D[t, i] = sum_k x_t[k] k_i[k] exp(G_t[k] - G_i[k]) for every pair of one chunk
// (x, k [.., C, K]; G [.., C, K or 1] cumulative log-gates, non-increasing), lower triangle incl.
// the diagonal, upper triangle 0. Built from sub-blocks of s rows: a row block against earlier
// columns through the reference G at the row before the block (both factors <= 1); the block
// against itself through a reference at its middle row (factors within e^{s/2 * 10}).
at::Tensor decayed_products(const at::Tensor& x, const at::Tensor& k, const at::Tensor& G,
                            int64_t s) {
  const int64_t c = x.size(-2), nb = c / s;
  if (G.size(-1) == 1) {  // one gate per row (GDN): e^{G_t - G_i} <= 1 below the diagonal
    auto lower = at::ones({c, c}, x.options().dtype(at::kBool)).tril();
    auto expo = G - G.transpose(-1, -2);  // [.., C, C]
    const double neg_inf = -std::numeric_limits<double>::infinity();
    return at::matmul(x, k.transpose(-1, -2)) *
           at::exp(at::where(lower, expo, at::full({}, neg_inf, expo.options())));
  }
  auto lead = x.sizes().slice(0, x.dim() - 2).vec();
  auto blocks = [&](const at::Tensor& t) {  // [.., C, X] -> [.., nb, s, X]
    auto shape = lead;
    shape.insert(shape.end(), {nb, s, t.size(-1)});
    return t.reshape(shape);
  };
  auto xb = blocks(x), kb = blocks(k), Gb = blocks(G);
  // Within each row block: reference at its middle row.
  auto mid = Gb.narrow(-2, s / 2, 1);  // [.., nb, 1, Kg]
  // Its upper triangle multiplies the two large sides (e^{G_t - G_i}, t < i, can overflow):
  // dropped before anything else sees it.
  auto diag = at::matmul(xb * at::exp(Gb - mid), (kb * at::exp(mid - Gb)).transpose(-1, -2)).tril();
  auto eye = at::eye(nb, x.options()).view({nb, 1, nb, 1});
  auto full_shape = lead;
  full_shape.insert(full_shape.end(), {c, c});
  auto D = (diag.unsqueeze(-2) * eye).reshape(full_shape);  // block diagonal
  if (nb > 1) {
    // Row block a (a >= 1) against columns [0, a*s): reference G[a*s - 1].
    auto ref = Gb.narrow(-2, s - 1, 1).narrow(-3, 0, nb - 1);  // [.., nb-1, 1, Kg]
    auto rows = xb.narrow(-3, 1, nb - 1) * at::exp(Gb.narrow(-3, 1, nb - 1) - ref);
    auto cols = at::arange(c, x.options().dtype(at::kLong));
    auto limit = (at::arange(1, nb, x.options().dtype(at::kLong)) * s).view({nb - 1, 1, 1});
    auto before = cols.view({1, c, 1}).lt(limit);  // [nb-1, C, 1]
    auto expo = ref - G.unsqueeze(-3);             // [.., nb-1, C, Kg]
    const double neg_inf = -std::numeric_limits<double>::infinity();
    auto keys =
        k.unsqueeze(-3) * at::exp(at::where(before, expo, at::full({}, neg_inf, expo.options())));
    auto off = at::matmul(rows, keys.transpose(-1, -2));  // [.., nb-1, s, C]
    auto off_shape = lead;
    off_shape.insert(off_shape.end(), {(nb - 1) * s, c});
    D = D + at::constant_pad_nd(off.reshape(off_shape), {0, 0, s, 0});
  }
  return D.tril();
}

}  // namespace

MixerResult delta_rule_recurrent(const MixerInputs& in, const MixerOptions& o, GateKind gate) {
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

// The intra-chunk terms of every chunk at once ([B, HV, N, C, .]); the state enters afterwards.
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
  const int64_t s = c % 16 == 0 ? 16 : c;               // sub-block rows of the decayed products
  auto padded = [&](const at::Tensor& t) {              // zeros after the last token (dim 1)
    std::vector<int64_t> widths(2 * (t.dim() - 1), 0);  // last dim first; the last pair is dim 1
    widths.back() = pad;
    return pad > 0 ? at::constant_pad_nd(t, widths) : t;
  };
  auto q = chunked_view(padded(p.q), n, c), k = chunked_view(padded(p.k), n, c);
  auto v = chunked_view(padded(p.v), n, c);
  auto G = chunked_view(padded(p.g), n, c).cumsum(-2);           // [B, HV, N, C, K or 1]
  auto beta = chunked_view(padded(p.beta).unsqueeze(-1), n, c);  // [B, HV, N, C, 1]
  // WY: (I + tril_-1(diag(beta) KK_dec)) [U, W] = diag(beta) [V, K e^G], one triangular solve.
  auto kk = decayed_products(k, k, G, s).tril(-1);
  auto eye = at::eye(c, q.options());
  auto k_decayed = k * at::exp(G);
  auto sol = at::linalg_solve_triangular(eye + beta * kk, beta * at::cat({v, k_decayed}, -1),
                                         /*upper=*/false, /*left=*/true, /*unitriangular=*/true);
  const int64_t vd = v.size(-1), kd = k.size(-1);
  ch.t.u = sol.narrow(-1, 0, vd);
  ch.t.w = sol.narrow(-1, vd, kd);
  ch.t.qk = decayed_products(q, k, G, s);
  ch.t.q_decayed = q * at::exp(G);
  auto g_end = G.narrow(-2, c - 1, 1);  // [B, HV, N, 1, K or 1]
  ch.t.k_end = k * at::exp(g_end - G);
  ch.t.decay_end = at::exp(g_end).transpose(-1, -2);
  return ch;
}

}  // namespace

MixerResult delta_rule_chunked(const MixerInputs& in, const MixerOptions& o, GateKind gate) {
  auto p = prepare(in, o, gate, "delta rule (chunked)");
  const auto& sh = p.shape;
  auto ch = chunk_terms(p, o);
  // The state through the chunks in order (one autograd node, delta_rule_scan.h).
  auto r = detail::delta_rule_scan(ch.t, p.h0);  // out [B, HV, N, C, V]
  auto out =
      r.out.permute({0, 2, 3, 1, 4}).reshape({sh.batch, ch.n * ch.c, sh.value_heads, sh.value_dim});
  return finish(in, o, out.narrow(1, 0, sh.tokens), r.final_state);
}

void delta_rule_state_summary(const MixerInputs& in, const MixerOptions& o, GateKind gate,
                              at::Tensor& m, at::Tensor& s) {
  auto p = prepare(in, o, gate, "delta rule (state summary)");
  auto ch = chunk_terms(p, o);
  const int64_t kd = p.shape.key_dim;
  // Chunk c maps h to M_c h + S_c with M_c = Diag(e^{G_C}) - K_end^T W and S_c = K_end^T U.
  auto ends = ch.t.k_end.transpose(-1, -2);  // [B, HV, N, K, C]
  auto decay = ch.t.decay_end.squeeze(-1);   // [B, HV, N, K or 1]
  auto mc = at::diag_embed(decay.expand({decay.size(0), decay.size(1), decay.size(2), kd})) -
            at::matmul(ends, ch.t.w);
  auto sc = at::matmul(ends, ch.t.u);
  auto ms = mc.unbind(2), ss = sc.unbind(2);
  m = at::eye(kd, p.q.options()).expand({p.shape.batch, p.shape.value_heads, kd, kd});
  s = at::zeros({p.shape.batch, p.shape.value_heads, kd, p.shape.value_dim}, p.q.options());
  for (int64_t i = 0; i < ch.n; ++i) {
    m = at::matmul(ms[i], m);
    s = at::matmul(ms[i], s) + ss[i];
  }
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
