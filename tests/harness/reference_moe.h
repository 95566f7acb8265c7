// A float64 token-by-token reference of the MoE MLP, sharing no code with src/moe: per token the
// router scores are written out, softmaxed by hand, the top-k picked by a sort on
// (probability desc, expert asc), each chosen expert's SwiGLU evaluated on that token alone, and
// the aux and z losses summed from their definitions. Differentiable in every tensor input
// (plain LibTorch ops on float64).
//
//   p[t, i]   = exp(l[t, i] - max_j l[t, j]) / sum_j exp(...),  l[t] = W_r x[t]
//   chosen    = the k largest p[t, .] (ties: the lower expert), w = p / sum over chosen (renorm)
//   capacity  = ceil(cf * T * k / E) per expert, taken in (token, slot) order (cf > 0)
//   y[t]      = sum over kept chosen i of w_i * W_d,i (silu(W_g,i x[t]) * W_u,i x[t])
//               + shared expert (when given)
//   aux       = E * sum_i (count_i / (T k)) * (sum_t p[t, i] / T)
//   z         = (1 / T) sum_t (log sum_i exp l[t, i])^2
#pragma once

#include <cstdint>

#include <ATen/core/Tensor.h>

namespace hp::testing {

struct ReferenceMoEWeights {
  at::Tensor router;                               // [E, H]
  at::Tensor gate, up, down;                       // [E, F, H], [E, F, H], [E, H, F]
  at::Tensor shared_gate, shared_up, shared_down;  // undefined: no shared expert
};

struct ReferenceMoE {
  at::Tensor out;  // [T, H]
  at::Tensor aux;  // scalar
  at::Tensor z;    // scalar
  int64_t dropped = 0;
  at::Tensor counts;  // [E] int64, assignments per expert before dropping
};

ReferenceMoE reference_moe(const at::Tensor& x, const ReferenceMoEWeights& w, int64_t top_k,
                           bool renormalize, double capacity_factor);

}  // namespace hp::testing
