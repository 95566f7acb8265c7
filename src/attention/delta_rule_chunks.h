// The intra-chunk terms of the chunked delta rule (private to src/attention): everything about a
// chunk that does not depend on the state entering it, for any number of leading dims.
#pragma once

#include <ATen/core/Tensor.h>

namespace hp::attention::detail {

// All [.., C or K, .] for chunks of C tokens, independent of the state:
//   u, w       [.., C, V], [.., C, K]  WY form: the chunk's corrected values are v_new = u - w h
//   qk         [.., C, C]              tril((q e^G)(k e^-G)^T): intra-chunk output weights
//   q_decayed  [.., C, K]              q e^G: what reads the entering state
//   k_end      [.., C, K]              k e^{G_C - G}: what the chunk writes into the leaving state
//   decay_end  [.., K or 1, 1]         e^{G_C}
struct ChunkTerms {
  at::Tensor u, w, qk, q_decayed, k_end, decay_end;
};

// q, k [.., C, K] (q scaled), v [.., C, V], G [.., C, K or 1] the cumulative log-gates within each
// chunk, beta [.., C, 1]. ATen ops only: differentiable by autograd in every input. The C x C
// decayed products stay in the dtype's range for any per-token log-gate (KDA's sub-blocks shrink
// where the gates are steep; one host read of the gates' widest step per call).
ChunkTerms chunk_terms(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                       const at::Tensor& G, const at::Tensor& beta);

}  // namespace hp::attention::detail
