// A float64 plain-formula attention reference for tests (DESIGN section 11). It shares no code
// with the kernels in src/attention (no Problem, TileMask, block_mask or tiling): visibility is
// rebuilt here from the per-(i, j) rules of the contract in hp/attention/attention.h.
//
//   reference_attention(q, k, v, options) -> {out, lse}
//
// q [B, Nq, Sq, Dqk], k [B, Nkv, Skv, Dqk], v [B, Nkv, Skv, Dv] (BNSD, any floating dtype; they
// are converted to float64, differentiably). out [B, Nq, Sq, Dv] and lse [B, Nq, Sq], both
// float64:
//
//   s[b,h,i,j]  = scale * <q[b,h,i,:], k[b,h / (Nq/Nkv),j,:]> + additive[b,h,i,j]
//   visible     = causal (j <= q_offset + i) AND bool mask AND mask_fn AND additive != -inf
//   lse[b,h,i]  = log sum_{visible j} exp(s[b,h,i,j])
//   out[b,h,i]  = sum_{visible j} exp(s[b,h,i,j] - lse[b,h,i]) v[b,h / (Nq/Nkv),j,:]
//
// A row with no visible key gives out 0 and lse -inf, and zero (never NaN) gradients. It is
// plain LibTorch ops, so autograd gives dq, dk, dv (and the gradient of a dlse term).
// The mask function is called once, for every (b, h, i, j) at once: b = arange(B),
// h = arange(Nq) + head_index_offset, q_idx = arange(Sq) + q_index_offset,
// kv_idx = arange(Skv) + kv_index_offset, shaped [B,1,1,1], [1,Nq,1,1], [1,1,Sq,1], [1,1,1,Skv].
// per_batch / per_head are promises a kernel may exploit; the reference does not need them.
// Only what a correct caller gives is checked (4-d tensors, GQA multiple); options.block_q and
// block_kv are ignored.
#pragma once

#include <ATen/core/Tensor.h>

#include "hp/attention/attention.h"

namespace hp::testing {

struct ReferenceAttention {
  at::Tensor out;      // [B, Nq, Sq, Dv] float64
  at::Tensor lse;      // [B, Nq, Sq] float64
  at::Tensor visible;  // [B, Nq, Sq, Skv] bool: the visibility the formula used
};

// options.documents is refused here: packed sequences go through reference_packed_attention.
ReferenceAttention reference_attention(const at::Tensor& q, const at::Tensor& k,
                                       const at::Tensor& v,
                                       const attention::AttentionOptions& options);

// Packed sequences the way their definition reads: every document of every batch row run
// alone through reference_attention (causal or not, offset 0), the outputs concatenated.
// doc_ids [B|1, S] (one row per batch row, or one for all); a document is a maximal run of
// equal ids. Returns out [B, Nq, S, Dv] float64, differentiable in q, k, v.
at::Tensor reference_packed_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                      const at::Tensor& doc_ids, bool causal);

}  // namespace hp::testing
