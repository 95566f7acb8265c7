// A core-attention module: forward(q, k, v) -> out, through its AttentionHost's boundary slot
// (what sdpa_qkv / flex_qkv intercept). Layout configurable (BNSD or BSHD); the primitive
// always sees BNSD.
#pragma once

#include <ATen/core/Tensor.h>

#include "hp/attention/host.h"

namespace hp::attention {

struct CoreAttentionOptions {
  AttentionOptions attention;  // causal, scale, masks, block sizes
  // Dim *indices* (not sizes) of the sequence and the heads: BNSD [B, N, S, D] is seq_dim 2,
  // heads_dim 1; BSHD [B, S, N, D] is seq_dim 1, heads_dim 2.
  int64_t seq_dim = 2;
  int64_t heads_dim = 1;
  std::string primitive = "blockwise";
};

class CoreAttention {
 public:
  explicit CoreAttention(CoreAttentionOptions options = {});
  at::Tensor forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v);
  // With this call's own attention options in place of options().attention (e.g. the documents
  // of this batch); the layout and the primitive stay the module's.
  at::Tensor forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                     const AttentionOptions& options);
  AttentionHost& host() { return host_; }
  const CoreAttentionOptions& options() const { return options_; }

 private:
  CoreAttentionOptions options_;
  AttentionHost host_;
};

}  // namespace hp::attention
