#include "reference_moe.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include <ATen/ATen.h>

namespace hp::testing {

ReferenceMoE reference_moe(const at::Tensor& x, const ReferenceMoEWeights& w, int64_t top_k,
                           bool renormalize, double capacity_factor) {
  const int64_t t_count = x.size(0), e = w.router.size(0);
  const auto capacity =
      capacity_factor > 0
          ? static_cast<int64_t>(std::ceil(capacity_factor * static_cast<double>(t_count * top_k) /
                                           static_cast<double>(e)))
          : t_count * top_k;
  std::vector<int64_t> taken(e, 0), counts(e, 0);
  std::vector<at::Tensor> outs, probs;
  at::Tensor z_sum = at::zeros({}, at::kDouble);
  ReferenceMoE r;
  for (int64_t t = 0; t < t_count; ++t) {
    auto xt = x[t];
    std::vector<at::Tensor> logit;
    for (int64_t i = 0; i < e; ++i)
      logit.push_back((w.router[i] * xt).sum());
    auto l = at::stack(logit);
    auto m = l.detach().max();
    auto ex = (l - m).exp();
    auto p = ex / ex.sum();
    z_sum = z_sum + (m + ex.sum().log()).pow(2);
    probs.push_back(p);
    std::vector<int64_t> idx(e);
    std::iota(idx.begin(), idx.end(), 0);
    auto pv = p.detach();
    std::sort(idx.begin(), idx.end(), [&](int64_t a, int64_t b) {
      const double pa = pv[a].item<double>(), pb = pv[b].item<double>();
      return pa != pb ? pa > pb : a < b;
    });
    at::Tensor chosen_sum = at::zeros({}, at::kDouble);
    for (int64_t j = 0; j < top_k; ++j)
      chosen_sum = chosen_sum + p[idx[j]];
    at::Tensor y = at::zeros_like(xt);
    for (int64_t j = 0; j < top_k; ++j) {
      const int64_t i = idx[j];
      ++counts[i];
      if (taken[i] >= capacity) {
        ++r.dropped;
        continue;
      }
      ++taken[i];
      auto weight = renormalize ? p[i] / chosen_sum : p[i];
      auto hidden = at::silu(at::mv(w.gate[i], xt)) * at::mv(w.up[i], xt);
      y = y + weight * at::mv(w.down[i], hidden);
    }
    if (w.shared_gate.defined()) {
      auto hidden = at::silu(at::mv(w.shared_gate, xt)) * at::mv(w.shared_up, xt);
      y = y + at::mv(w.shared_down, hidden);
    }
    outs.push_back(y);
  }
  r.out = at::stack(outs);
  auto p_all = at::stack(probs);
  const double tokens = static_cast<double>(t_count);
  at::Tensor aux = at::zeros({}, at::kDouble);
  for (int64_t i = 0; i < e; ++i) {
    const double f = static_cast<double>(counts[i]) / (tokens * static_cast<double>(top_k));
    aux = aux + f * p_all.select(1, i).sum() / tokens;
  }
  r.aux = aux * static_cast<double>(e);
  r.z = z_sum / tokens;
  r.counts = at::tensor(counts, at::kLong);
  return r;
}

}  // namespace hp::testing
