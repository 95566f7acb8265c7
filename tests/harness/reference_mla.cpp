#include "reference_mla.h"

#include <cmath>
#include <limits>
#include <vector>

#include <ATen/ATen.h>

namespace hp::testing {

namespace {

// Per head h: the explicit scores [B, S, S] and values [B, S, dv] of MLA.
void mla_scores(const at::Tensor& q, const at::Tensor& latent, const at::Tensor& k_rope,
                const at::Tensor& w, int64_t d_v, int64_t h, at::Tensor& scores, at::Tensor& v) {
  const int64_t dr = k_rope.size(2), dn = q.size(3) - dr;
  const double scale = 1.0 / std::sqrt(static_cast<double>(dn + dr));
  const int64_t base = h * (dn + d_v);
  auto wk = w.slice(0, base, base + dn), wv = w.slice(0, base + dn, base + dn + d_v);
  auto k = at::cat({at::einsum("bjr,dr->bjd", {latent, wk}), k_rope}, -1);
  v = at::einsum("bjr,dr->bjd", {latent, wv});
  scores = at::einsum("bid,bjd->bij", {q.select(2, h), k}) * scale;
}

}  // namespace

at::Tensor reference_mla(const at::Tensor& q_in, const at::Tensor& latent_in,
                         const at::Tensor& k_rope_in, const at::Tensor& w_in, int64_t d_v) {
  auto q = q_in.to(at::kDouble), latent = latent_in.to(at::kDouble);
  auto k_rope = k_rope_in.to(at::kDouble), w = w_in.to(at::kDouble);
  const int64_t s = q.size(1);
  auto hidden = at::arange(s).unsqueeze(0).gt(at::arange(s).unsqueeze(1));  // key after query
  std::vector<at::Tensor> outs;
  for (int64_t h = 0; h < q.size(2); ++h) {
    at::Tensor scores, v;
    mla_scores(q, latent, k_rope, w, d_v, h, scores, v);
    scores = scores.masked_fill(hidden, -std::numeric_limits<double>::infinity());
    outs.push_back(at::einsum("bij,bjd->bid", {at::softmax(scores, -1), v}));
  }
  return at::stack(outs, 2);
}

ReferenceDSA reference_dsa(const at::Tensor& q_in, const at::Tensor& latent_in,
                           const at::Tensor& k_rope_in, const at::Tensor& w_in, int64_t d_v,
                           const at::Tensor& q_index, const at::Tensor& w_index,
                           const at::Tensor& k_index, int64_t topk, const std::string& loss) {
  auto q = q_in.to(at::kDouble), latent = latent_in.to(at::kDouble);
  auto k_rope = k_rope_in.to(at::kDouble), w = w_in.to(at::kDouble);
  auto qi = q_index.to(at::kDouble), wi = w_index.to(at::kDouble), ki = k_index.to(at::kDouble);
  const int64_t batch = q.size(0), s = q.size(1), heads = q.size(2);
  const double inf = std::numeric_limits<double>::infinity();
  auto causal = at::arange(s).unsqueeze(0).le(at::arange(s).unsqueeze(1));  // [S, S]: j <= i
  // I[b, t, s] = sum_j w[b, t, j] relu(q_I[b, t, j] . k_I[b, s])
  auto index = at::zeros({batch, s, s}, at::kDouble);
  for (int64_t j = 0; j < qi.size(2); ++j) {
    index = index + wi.select(2, j).unsqueeze(-1) *
                        at::relu(at::einsum("btd,bsd->bts", {qi.select(2, j), ki}));
  }
  // Top-k by a stable descending sort of each row's visible scores.
  auto selected = at::zeros({batch, s, s}, at::kBool);
  {
    at::NoGradGuard no_grad;
    for (int64_t b = 0; b < batch; ++b) {
      for (int64_t t = 0; t < s; ++t) {
        auto row = index[b][t].slice(0, 0, t + 1);
        auto order = std::get<1>(at::sort(row, /*stable=*/true, /*dim=*/0, /*descending=*/true));
        auto keep = order.slice(0, 0, std::min<int64_t>(topk, t + 1));
        selected[b][t].index_fill_(0, keep, true);
      }
    }
  }
  auto allowed = loss == "dense" ? causal.unsqueeze(0).expand({batch, s, s}) : selected;
  std::vector<at::Tensor> outs;
  at::Tensor p_sum = at::zeros({batch, s, s}, at::kDouble);
  for (int64_t h = 0; h < heads; ++h) {
    at::Tensor scores, v;
    mla_scores(q, latent, k_rope, w, d_v, h, scores, v);
    auto p = at::softmax(scores.masked_fill(allowed.logical_not(), -inf), -1);
    outs.push_back(at::einsum("bij,bjd->bid", {p, v}));
    p_sum = p_sum + p.detach();
  }
  auto target = p_sum / p_sum.sum(-1, /*keepdim=*/true);
  auto log_q = at::log_softmax(index.masked_fill(allowed.logical_not(), -inf), -1);
  auto zero = at::zeros_like(target);
  auto kl = at::where(allowed, at::xlogy(target, target) - target * log_q, zero);
  return {at::stack(outs, 2), kl.sum(), selected};
}

}  // namespace hp::testing
