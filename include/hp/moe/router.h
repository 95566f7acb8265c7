// The MoE router (Qwen3-MoE style): logits = x W_r^T -> softmax over E experts -> top-k, the
// chosen probabilities renormalised over the k (optional), an optional capacity that drops the
// assignments past it, and the router's two auxiliary losses.
//
// Losses are returned as this rank's *share*: the shares of all ranks that hold different
// tokens of one step sum to the loss over all their tokens, and the gradient of the sum is the
// gradient of the global loss. The load counts behind them are global (all-reduced over the
// stats group, not differentiated):
//   aux  = E * sum_i f_i * P_i,  f_i = (assignments to expert i) / (T k)  (before dropping),
//          P_i = mean router probability of expert i over the T tokens; 1 when perfectly
//          balanced (DeepSeek-V3's normalisation; Hugging Face's load_balancing_loss_func is k
//          times this value)
//   z    = mean over tokens of logsumexp(logits)^2                           (ST-MoE)
#pragma once

#include <cstdint>
#include <vector>

#include <ATen/core/Tensor.h>

#include "hp/comm/group.h"

namespace hp::moe {

struct RouterOptions {
  int64_t experts = 8;
  int64_t top_k = 2;
  bool renormalize = true;  // weights = top-k probabilities / their sum
  // 0: no dropping. Else each expert takes at most ceil(capacity_factor * T * k / E)
  // assignments of this call's T tokens (a rank's tokens form one group), first come first
  // served in (token, slot) order; the rest are dropped (their weight is lost) and counted.
  double capacity_factor = 0;
};

// Checks experts >= 1, 1 <= top_k <= experts, capacity_factor >= 0; names the field and the fix.
void validate(const RouterOptions& o);

struct Routing {
  at::Tensor probs;    // [T, E] softmax of the logits (differentiable)
  at::Tensor experts;  // [T, k] int64, the chosen experts, most probable first
  at::Tensor weights;  // [T, k] combine weights (differentiable)
  at::Tensor kept;     // [T, k] bool: false where the capacity dropped the assignment
  int64_t dropped = 0;
};

// logits [T, E] (float32 or float64; lower precisions are routed in float32).
Routing route(const at::Tensor& logits, const RouterOptions& o);

// Assignments per expert before dropping: [E] int64.
at::Tensor expert_counts(const Routing& r, int64_t experts);

// The global load: assignments per expert and tokens over every rank of `stats_group` (one
// all-reduce of E + 1 doubles), or this rank's own when stats_group is null.
struct Load {
  at::Tensor counts;  // [E] double
  double tokens = 0;
};
Load global_load(const Routing& r, int64_t experts, const comm::GroupPtr& stats_group);

// This rank's shares of the two losses (scalars in the graph of `logits` / r.probs).
at::Tensor aux_loss_share(const Routing& r, const Load& load, int64_t top_k);
at::Tensor z_loss_share(const at::Tensor& logits, const Load& load);

}  // namespace hp::moe
