// The state pass of the chunked delta rule (private to src/attention): given every chunk's
// intra-chunk terms it runs the state through the chunks in order and returns every output.
#pragma once

#include <ATen/core/Tensor.h>

namespace hp::attention::detail {

// Intra-chunk terms, all [B, HV, N, C or K, .] (N chunks of C tokens), independent of the state:
//   u, w       [.., C, V], [.., C, K]  WY form: the chunk's corrected values are v_new = u - w h
//   qk         [.., C, C]              tril((q e^G)(k e^-G)^T): intra-chunk output weights
//   q_decayed  [.., C, K]              q e^G: what reads the entering state
//   k_end      [.., C, K]              k e^{G_C - G}: what the chunk writes into the leaving state
//   decay_end  [.., K or 1, 1]         e^{G_C}
struct ChunkTerms {
  at::Tensor u, w, qk, q_decayed, k_end, decay_end;
};

struct ScanResult {
  at::Tensor out;          // [B, HV, N, C, V]
  at::Tensor final_state;  // [B, HV, K, V]
};

// h_{i+1} = decay_end_i h_i + k_end_i^T (u_i - w_i h_i), out_i = q_decayed_i h_i + qk_i (u_i - w_i
// h_i), from h_0 = h0 [B, HV, K, V]. Differentiable in every term and h0 through a hand-written
// backward (the state gradient runs back through the chunks with two matmuls each; everything
// else is one batched matmul over all chunks), so autograd never sees the N-step loop.
ScanResult delta_rule_scan(const ChunkTerms& terms, const at::Tensor& h0);

}  // namespace hp::attention::detail
