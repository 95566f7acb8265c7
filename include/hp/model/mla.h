// The MLA attention layer (DeepSeek-V3 multi-head latent attention) over attention/mla.h:
//
//   x [B, S, hidden]
//     q      = W_uq(RMSNorm(W_dq x))  [B, S, H, d_nope + d_rope], RoPE on the last d_rope
//     latent = RMSNorm(W_dkv x)       [B, S, kv_rank]
//     k_rope = RoPE(W_kr x)           [B, S, d_rope]  (one rotated key part for every head)
//     o      = host.attend(q, latent, k_rope, W_ukv)  [B, S, H, d_v]  (causal; CP installs
//              its strategy into the host: cp/mla.h)
//     out    = W_o o                  [B, S, hidden]
// RoPE at the global positions `position_ids` [B, S] (what CP shards with the tokens).
// Packed documents: `doc_ids` [Bd, S_total] (global ids, masks.h) keep attention inside each
// document (position_ids then restart per document); the sparse (DSA) form refuses them.
//
// sparse (DSA, DeepSeek-V3.2): the same layer with a lightning indexer on inputs detached from
// the main model (it learns only from its KL loss): q_I = W_iq c_q [B, S, H_I, d_I] (c_q the
// query's normed low-rank latent), k_I = W_ik x [B, S, d_I], w = W_iw x / sqrt(H_I); attention
// runs over each query's top-k keys (attention/dsa.h) through the DSA host (cp/dsa.h installs
// CP into it); index_loss() is the indexer's loss of the last forward, summed over its queries.
// Weights are seeded, so every layout starts identical to its single-process twin.
#pragma once

#include <cstdint>
#include <string>

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include "hp/attention/dsa.h"
#include "hp/attention/mla.h"

namespace hp::model {

struct MLAConfig {
  int64_t hidden = 64;
  int64_t heads = 4;
  int64_t q_rank = 96;
  int64_t kv_rank = 64;
  int64_t d_nope = 32;
  int64_t d_rope = 16;
  int64_t d_v = 32;
  double rope_theta = 1e6;
  double rms_eps = 1e-6;
  std::string primitive = "blockwise";
  uint64_t seed = 7;
  bool sparse = false;  // DSA
  int64_t index_heads = 4;
  int64_t index_dim = 32;
  int64_t topk = 2048;
  std::string index_loss = "sparse";  // sparse | dense (indexer warm-up)
};

// Checks the config (names the field, the value and the fix).
void validate(const MLAConfig& c);

class MLAAttentionImpl : public torch::nn::Module {
 public:
  explicit MLAAttentionImpl(const MLAConfig& c, int64_t layer = 0);

  at::Tensor forward(const at::Tensor& x, const at::Tensor& position_ids,
                     const at::Tensor& doc_ids = {});
  // The stages forward runs (public for tests): q, and the latent with the rotated key part.
  at::Tensor queries(const at::Tensor& x, const at::Tensor& position_ids) const;
  void latent_and_rope(const at::Tensor& x, const at::Tensor& position_ids, at::Tensor& latent,
                       at::Tensor& k_rope) const;

  attention::MLAShape shape() const;
  attention::MLAHost& host() { return host_; }
  attention::DSAHost& dsa_host() { return dsa_host_; }
  // sparse: the indexer loss of the last forward (a scalar in the graph); undefined otherwise.
  const at::Tensor& index_loss() const { return index_loss_; }
  const MLAConfig& config() const { return config_; }

  at::Tensor w_dq, q_norm, w_uq;    // [q_rank, hidden], [q_rank], [H * dq, q_rank]
  at::Tensor w_dkv, kv_norm, w_kr;  // [kv_rank, hidden], [kv_rank], [d_rope, hidden]
  at::Tensor w_ukv, w_o;            // [H * (d_nope + d_v), kv_rank], [hidden, H * d_v]
  at::Tensor w_iq, w_ik, w_iw;      // sparse: [H_I * d_I, q_rank], [d_I, hidden], [H_I, hidden]

 private:
  at::Tensor forward_sparse(const at::Tensor& x, const at::Tensor& position_ids,
                            const at::Tensor& latent, const at::Tensor& k_rope);
  MLAConfig config_;
  attention::MLAHost host_;
  attention::DSAHost dsa_host_;
  at::Tensor index_loss_;
};
TORCH_MODULE(MLAAttention);

// Parameters of one MLA layer (the memory estimate's count).
int64_t mla_parameter_count(const MLAConfig& c);

}  // namespace hp::model
