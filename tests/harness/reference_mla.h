// Float64 explicit-score references for MLA and DSA, sharing no code with
// src/attention/mla.cpp, dsa.cpp or the attention primitives: per head, the keys and values are
// built from the latent with their own matmuls, the scores are written out, masked and softmaxed.
//
//   reference_mla(q, latent, k_rope, w_ukv, d_v) -> out [B, S, H, d_v] float64
//     k_h[j] = [W_ukv rows (h*(dn+dv) .. +dn) . latent[j] | k_rope[j]]
//     v_h[j] = W_ukv rows (h*(dn+dv)+dn .. +dv) . latent[j]
//     s[i, j] = <q_h[i], k_h[j]> / sqrt(dn + dr) for j <= i (causal), softmax over j, out = p v
// Differentiable in every input (plain LibTorch ops on float64 copies).
#pragma once

#include <cstdint>
#include <string>

#include <ATen/core/Tensor.h>

namespace hp::testing {

at::Tensor reference_mla(const at::Tensor& q, const at::Tensor& latent, const at::Tensor& k_rope,
                         const at::Tensor& w_ukv, int64_t d_v);

// DSA: explicit indexer scores I [B, S, S] (causal), top-k per query by a stable descending
// sort (ties to the lower position), MLA scores as above masked to the selection ("sparse") or
// to every visible key ("dense"), and the KL of the head-summed, normalised attention
// distribution (detached) against softmax(I) over the same keys, summed over queries.
struct ReferenceDSA {
  at::Tensor out;       // [B, S, H, d_v] float64
  at::Tensor loss;      // scalar float64
  at::Tensor selected;  // [B, S, S] bool: the top-k selection
};
ReferenceDSA reference_dsa(const at::Tensor& q, const at::Tensor& latent, const at::Tensor& k_rope,
                           const at::Tensor& w_ukv, int64_t d_v, const at::Tensor& q_index,
                           const at::Tensor& w_index, const at::Tensor& k_index, int64_t topk,
                           const std::string& loss);

}  // namespace hp::testing
