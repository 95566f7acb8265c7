#include "reference_mla.h"

#include <cmath>
#include <vector>

#include <ATen/ATen.h>

namespace hp::testing {

at::Tensor reference_mla(const at::Tensor& q_in, const at::Tensor& latent_in,
                         const at::Tensor& k_rope_in, const at::Tensor& w_in, int64_t d_v) {
  auto q = q_in.to(at::kDouble), latent = latent_in.to(at::kDouble);
  auto k_rope = k_rope_in.to(at::kDouble), w = w_in.to(at::kDouble);
  const int64_t s = q.size(1), heads = q.size(2), dr = k_rope.size(2);
  const int64_t dn = q.size(3) - dr;
  const double scale = 1.0 / std::sqrt(static_cast<double>(dn + dr));
  auto row = at::arange(s, at::kLong).unsqueeze(1), col = at::arange(s, at::kLong).unsqueeze(0);
  auto hidden = col > row;  // [S, S]: key after query
  std::vector<at::Tensor> outs;
  for (int64_t h = 0; h < heads; ++h) {
    const int64_t base = h * (dn + d_v);
    auto wk = w.slice(0, base, base + dn), wv = w.slice(0, base + dn, base + dn + d_v);
    auto k = at::cat({at::einsum("bjr,dr->bjd", {latent, wk}), k_rope}, -1);  // [B, S, dn+dr]
    auto v = at::einsum("bjr,dr->bjd", {latent, wv});                          // [B, S, dv]
    auto scores = at::einsum("bid,bjd->bij", {q.select(2, h), k}) * scale;
    scores = scores.masked_fill(hidden, -std::numeric_limits<double>::infinity());
    outs.push_back(at::einsum("bij,bjd->bid", {at::softmax(scores, -1), v}));
  }
  return at::stack(outs, 2);
}

}  // namespace hp::testing
