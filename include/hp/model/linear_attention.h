// Linear-attention layers (DESIGN section 14): Gated DeltaNet (Qwen3-Next / Qwen3.5 style) and
// Kimi Delta Attention (Kimi Linear style), over the gated delta-rule mixers of
// attention/delta_rule.h.
//
//   x [B, S, hidden]
//     project   qkv = [x Wq | x Wk | x Wv]      [B, S, 2HK + HV*V]   (pre-convolution channels)
//               b = x Wb [B, S, HV];  gate input a = x Wa [B, S, HV] (GDN) or
//               f = (x Wfa) Wfb [B, S, HV*K] (KDA, low rank);  output gate z = x Wz [B, S, HV*V]
//     convolve  depthwise causal conv of width w over the sequence, SiLU      (CP: a halo of the
//               previous w-1 pre-convolution rows arrives from the previous rank)
//     inputs    q, k [B, S, H, K] L2-normalised; v [B, S, HV, V]; beta = sigmoid(b);
//               g = -exp(A_log) * softplus(a + dt_bias) (GDN, per head; KDA, per channel)
//     mix       the delta rule (from an initial state under state-passing CP)
//     output    GDN: RMSNorm(o) * w * silu(z);  KDA: RMSNorm(o) * w * sigmoid(z);  then Wo
// The stages are public so the CP modes (cp/linear) can put communication between them; forward()
// runs them in order on one rank. Weights are seeded, so every layout starts identical.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include "hp/attention/linear_host.h"
#include "hp/attention/mixer.h"

namespace hp::model {

struct LinearAttentionConfig {
  std::string mixer = "gdn";  // gdn | kda
  int64_t hidden = 64;
  int64_t heads = 2;        // q/k heads H
  int64_t value_heads = 4;  // HV (a multiple of H)
  int64_t key_dim = 16;     // K
  int64_t value_dim = 16;   // V
  int64_t conv_width = 4;
  int64_t gate_rank = 16;  // KDA: rank of the per-channel gate projection
  double rms_eps = 1e-6;
  std::string kernel = "chunked";  // chunked | recurrent
  int64_t chunk_size = 64;
  uint64_t seed = 7;
};

// Checks the config (names the field, the value and the fix).
void validate(const LinearAttentionConfig& c);

class LinearAttentionImpl : public torch::nn::Module, public attention::LinearLayerStages {
 public:
  explicit LinearAttentionImpl(const LinearAttentionConfig& c, int64_t layer = 0);

  attention::LinearLayerShape shape() const override;
  // qkv [B, S, 2HK + HV*V] before the convolution; beta_logit [B, S, HV]; gate_in [B, S, HV]
  // (GDN) or [B, S, HV*K] (KDA).
  attention::LinearTokens project(const at::Tensor& x) const override;
  at::Tensor project_out_gate(const at::Tensor& x) const override;  // [B, S, HV*V]
  // silu(depthwise causal conv) of qkv [B, S, C] over the sequence; `halo` [B, w-1, C] is what
  // precedes the first row (undefined: zeros, the start of the sequence). `channels`
  // (optional) selects a subset of the conv channels (a head slice under Ulysses CP): then qkv
  // holds only those channels. `taps` (packed documents, attention::LinearDocuments::taps):
  // the inputs each row may read; the conv never crosses a document boundary.
  at::Tensor convolve(const at::Tensor& qkv, const at::Tensor& halo = {},
                      const at::Tensor& channels = {}, const at::Tensor& taps = {}) const override;
  // q, k, v, g, beta of the convolved channels; `heads` / `value_heads` select a head range of
  // the layer (Ulysses CP) by their first index; defaults: all heads.
  attention::MixerInputs mixer_inputs(const at::Tensor& conv, const at::Tensor& beta_logit,
                                      const at::Tensor& gate_in, int64_t first_head = 0,
                                      int64_t num_heads = -1) const override;
  attention::MixerResult mix(const attention::MixerInputs& in,
                             bool output_final_state = false) const override;
  void state_summary(const attention::MixerInputs& in, at::Tensor& m, at::Tensor& s) const override;
  at::Tensor output(const at::Tensor& mixed, const at::Tensor& out_gate) const override;
  // Through host(): the stages in order, or a CP mode's interceptor. doc_ids: packed documents
  // of the whole global sequence [B|1, S] (int64), or undefined; the state and the conv restart
  // at every document.
  at::Tensor forward(const at::Tensor& x, const at::Tensor& doc_ids = {});
  attention::LinearHost& host() { return host_; }

  const LinearAttentionConfig& config() const { return config_; }
  const attention::StatefulMixer& mixer() const { return *mixer_; }
  int64_t qkv_channels() const;
  // The conv channels (indices into qkv) of q/k heads [h0, h0 + nh) and their value heads.
  at::Tensor head_channels(int64_t first_head, int64_t num_heads) const override;

  at::Tensor w_qkv, w_beta, w_gate_a, w_gate_b, w_out_gate, w_out;  // [out, in]
  at::Tensor conv_weight;                                           // [C, w]
  at::Tensor a_log, dt_bias, norm_weight;

 private:
  LinearAttentionConfig config_;
  std::unique_ptr<attention::StatefulMixer> mixer_;
  attention::LinearHost host_;
};
TORCH_MODULE(LinearAttention);

}  // namespace hp::model
