// Float64 explicit-score references for MLA and (later) DSA, sharing no code with
// src/attention/mla.cpp or the attention primitives: per head, the keys and values are built
// from the latent with their own matmuls, the scores are written out, masked and softmaxed.
//
//   reference_mla(q, latent, k_rope, w_ukv, d_v) -> out [B, S, H, d_v] float64
//     k_h[j] = [W_ukv rows (h*(dn+dv) .. +dn) . latent[j] | k_rope[j]]
//     v_h[j] = W_ukv rows (h*(dn+dv)+dn .. +dv) . latent[j]
//     s[i, j] = <q_h[i], k_h[j]> / sqrt(dn + dr) for j <= i (causal), softmax over j, out = p v
// Differentiable in every input (plain LibTorch ops on float64 copies).
#pragma once

#include <cstdint>

#include <ATen/core/Tensor.h>

namespace hp::testing {

at::Tensor reference_mla(const at::Tensor& q, const at::Tensor& latent, const at::Tensor& k_rope,
                         const at::Tensor& w_ukv, int64_t d_v);

}  // namespace hp::testing
