// The chunked delta rule as one autograd node (private to src/attention).
#pragma once

#include <cstdint>

#include <ATen/core/Tensor.h>

namespace hp::attention::detail {

struct KernelResult {
  at::Tensor out;          // [BH, T, V]
  at::Tensor final_state;  // [BH, K, V]
};

// Head-major inputs, one row per (batch, value head): q (scaled), k [BH, T, K], v [BH, T, V],
// g [BH, T, K or 1] per-token log-gates, beta [BH, T], h0 [BH, K, V]; chunks of `chunk` tokens.
// Differentiable in q, k, v, g, beta and h0 through a hand-written backward that accepts a
// gradient of the final state; not twice differentiable.
KernelResult delta_rule_chunked_kernel(const at::Tensor& q, const at::Tensor& k,
                                       const at::Tensor& v, const at::Tensor& g,
                                       const at::Tensor& beta, const at::Tensor& h0, int64_t chunk);

}  // namespace hp::attention::detail
