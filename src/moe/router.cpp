#include "hp/moe/router.h"

#include <algorithm>
#include <cmath>

#include <ATen/ATen.h>

#include "hp/comm/collectives.h"
#include "hp/common/check.h"

namespace hp::moe {

void validate(const RouterOptions& o) {
  HP_CHECK(o.experts >= 1, "RouterOptions.experts=", o.experts, " must be at least 1");
  HP_CHECK(o.top_k >= 1 && o.top_k <= o.experts, "RouterOptions.top_k=", o.top_k,
           " must be between 1 and experts=", o.experts, "; choose --top-k <= --experts");
  HP_CHECK(o.capacity_factor >= 0 && std::isfinite(o.capacity_factor),
           "RouterOptions.capacity_factor=", o.capacity_factor, " must be >= 0 (0: no dropping)");
}

Routing route(const at::Tensor& logits, const RouterOptions& o) {
  validate(o);
  HP_CHECK(logits.dim() == 2 && logits.size(1) == o.experts,
           "route: logits must be [T, E=", o.experts, "], got ", logits.sizes());
  const bool low = logits.scalar_type() != at::kDouble && logits.scalar_type() != at::kFloat;
  Routing r;
  r.probs = at::softmax(low ? logits.to(at::kFloat) : logits, -1);
  auto top = at::topk(r.probs, o.top_k, -1, /*largest=*/true, /*sorted=*/true);
  r.experts = std::get<1>(top);
  auto chosen = std::get<0>(top);
  r.weights = o.renormalize ? chosen / chosen.sum(-1, /*keepdim=*/true) : chosen;
  const int64_t t = logits.size(0);
  if (o.capacity_factor <= 0 || t == 0) {
    r.kept = at::ones_like(r.experts, at::kBool);
    return r;
  }
  // At most every assignment (a huge factor must not overflow the cast and drop everything).
  const double assignments = static_cast<double>(t * o.top_k);
  const auto capacity = static_cast<int64_t>(std::min(
      assignments, std::ceil(o.capacity_factor * assignments / static_cast<double>(o.experts))));
  // Each assignment's place in its expert's queue, in (token, slot) order.
  auto flat = r.experts.reshape({-1});
  auto queue = at::one_hot(flat, o.experts).cumsum(0).gather(1, flat.unsqueeze(1)).squeeze(1) - 1;
  r.kept = queue.lt(capacity).reshape(r.experts.sizes());
  r.dropped = r.kept.numel() - r.kept.sum().item<int64_t>();
  return r;
}

at::Tensor expert_counts(const Routing& r, int64_t experts) {
  return at::bincount(r.experts.reshape({-1}), {}, experts);
}

Load global_load(const Routing& r, int64_t experts, const comm::GroupPtr& stats_group) {
  auto stats = at::cat({expert_counts(r, experts).to(at::kDouble),
                        at::full({1}, static_cast<double>(r.experts.size(0)), at::kDouble)});
  if (stats_group && stats_group->size() > 1) stats = comm::all_reduce(*stats_group, stats);
  Load load;
  load.tokens = stats[experts].item<double>();
  load.counts = stats.narrow(0, 0, experts);
  return load;
}

at::Tensor aux_loss_share(const Routing& r, const Load& load, int64_t top_k) {
  const int64_t e = r.probs.size(1);
  if (load.tokens <= 0) return r.probs.sum() * 0;
  auto f = (load.counts / (load.tokens * static_cast<double>(top_k))).to(r.probs.scalar_type());
  auto p_share = r.probs.sum(0) / load.tokens;  // this rank's part of the mean probability
  return static_cast<double>(e) * (f * p_share).sum();
}

at::Tensor z_loss_share(const at::Tensor& logits, const Load& load) {
  if (load.tokens <= 0) return logits.sum() * 0;
  return at::logsumexp(logits, {-1}).pow(2).sum() / load.tokens;
}

}  // namespace hp::moe
