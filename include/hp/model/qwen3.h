// A Qwen3-style decoder (DESIGN section 7): RMSNorm, RoPE from *global* position ids, GQA
// attention with QK-norm and handoff points after the final Q/K/V transforms, attention reached
// through the AttentionHost primitive dispatch (so sdpa_hf / flex_hf CP adapters serve it),
// SwiGLU MLP, LM head. Tensor parallel when given a TP group: column-parallel Q/K/V/gate/up,
// row-parallel O/down. Weights are built from seeded full tensors, so any TP/CP layout of the
// model starts identical to its single-process twin.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include "hp/attention/host.h"
#include "hp/comm/group.h"
#include "hp/model/linear_attention.h"
#include "hp/model/mla.h"
#include "hp/moe/moe.h"
#include "hp/plan/memory.h"
#include "hp/plan/plan.h"
#include "hp/tp/parallel_linear.h"

namespace hp::model {

struct Qwen3Config {
  int64_t vocab = 256;
  int64_t layers = 2;
  int64_t hidden = 64;
  int64_t heads = 4;
  int64_t kv_heads = 2;
  int64_t head_dim = 16;
  int64_t ffn = 128;
  double rope_theta = 1e6;
  // Softmax attention's partial RoPE: the first head_dim * partial_rotary_factor channels of
  // each query and key head rotate, the rest pass unchanged (position-free channels); 1: all
  // rotate (Qwen3). Hugging Face's partial_rotary_factor; Qwen3-Next / Qwen3.5 use 0.25 (the
  // qwen3.5 family's default). head_dim * factor must be a positive even integer.
  double partial_rotary_factor = 1.0;
  double rms_eps = 1e-6;
  bool tie_embeddings = false;
  uint64_t seed = 1234;
  std::string primitive = "blockwise";
  bool recompute = false;  // activation recompute of every decoder layer in backward
  // The token mixer of every layer: "attention" (softmax, above), or a linear-attention layer
  // "gdn" | "kda" (linear_attention.h: q/k heads = heads, value heads = value_heads, K = V =
  // head_dim, conv width 4; no TP). Mixed stacks come with the model families.
  // "mla": multi-head latent attention (mla.h): heads = heads, d_nope = d_v = head_dim,
  // d_rope = head_dim / 2, kv_rank and q_rank below; no TP. "dsa": the same, sparse.
  std::string mixer = "attention";
  int64_t value_heads = 0;  // linear mixers: HV, a multiple of heads (0: heads)
  int64_t kv_rank = 0;      // mla: the latent width (0: 2 * head_dim)
  int64_t q_rank = 0;       // mla: the query's low rank (0: 3 * head_dim)
  // "dsa": the MLA layer with its lightning indexer and top-k sparse attention (mla.h sparse).
  int64_t topk = 2048;
  std::string index_loss = "sparse";  // sparse | dense
  int64_t index_heads = 4;
  int64_t index_dim = 32;
  // Mixed stacks (the model families, family.h): layer i's mixer is layer_pattern[i % size]:
  // 'A' softmax attention, 'G' gated softmax attention (the attention output times the sigmoid
  // of a gate projection, before o_proj), 'L' linear attention of kind linear_kind, 'M' MLA,
  // 'D' DSA (either case). Empty: every layer is `mixer` ("gated_attention" is also a mixer).
  std::string layer_pattern;
  std::string linear_kind = "gdn";  // gdn | kda: what 'L' layers are
  // The MLP of every layer: an MoE (moe/moe.h) when experts > 0, else dense SwiGLU of width ffn.
  int64_t experts = 0;
  int64_t moe_top_k = 2;
  int64_t moe_ffn = 0;            // each expert's width (0: ffn)
  int64_t shared_expert_ffn = 0;  // 0: no shared expert
  bool moe_renormalize = true;    // top-k weights renormalised (Hugging Face norm_topk_prob)
  double aux_loss_coef = 0.01;
  double z_loss_coef = 0;
  double capacity_factor = 0;  // 0: no token is dropped
};

// The mixer of layer `layer`: attention | gated_attention | gdn | kda | mla | dsa.
std::string layer_mixer(const Qwen3Config& c, int64_t layer);
// Whether some layer's mixer is `mixer` / is one of the linear kinds (gdn, kda) / softmax
// attention (plain or gated) / MLA or DSA.
bool has_mixer(const Qwen3Config& c, const std::string& mixer);
bool has_linear(const Qwen3Config& c);
bool has_softmax_attention(const Qwen3Config& c);
bool has_mla(const Qwen3Config& c);

// The linear-attention layer config of a layer of kind `kind` (gdn | kda).
LinearAttentionConfig linear_config(const Qwen3Config& c, const std::string& kind);

// The MLA layer config (sparse: the DSA layer).
MLAConfig mla_config(const Qwen3Config& c, bool sparse);
// The MoE MLP config (experts > 0).
moe::MoEConfig moe_config(const Qwen3Config& c);
// Checks sizes against tp_size: heads, kv_heads and ffn must divide; names what to change.
void validate(const Qwen3Config& c, int64_t tp_size = 1);

// The model's parameters (HSDP units: the root, then one per layer; experts apart, split by
// EP) and the activations it keeps for backward, from the configuration alone: the planner's
// memory estimate before anything is built (plan::estimate_memory).
plan::ModelFootprint footprint(const Qwen3Config& c);

class RMSNormImpl : public torch::nn::Module {
 public:
  RMSNormImpl(int64_t dim, double eps);
  at::Tensor forward(const at::Tensor& x);
  at::Tensor weight;

 private:
  double eps_;
};
TORCH_MODULE(RMSNorm);

// RoPE (rotate-half form) of x [B, N, S, D] at global positions [B, S]: over the first
// rotary_dim channels (even; 0: all D, with frequencies theta^(-2i / rotary_dim)), the rest
// returned as they are.
at::Tensor apply_rope(const at::Tensor& x, const at::Tensor& position_ids, double theta,
                      int64_t rotary_dim = 0);
// The rotated channels of a softmax-attention head: head_dim * partial_rotary_factor.
int64_t rotary_dim(const Qwen3Config& c);

class Qwen3AttentionImpl : public torch::nn::Module {
 public:
  // gated: the output is multiplied by sigmoid(g_proj(x)) per head and channel before o_proj.
  Qwen3AttentionImpl(const Qwen3Config& c, int64_t layer, comm::GroupPtr tp, bool gated = false);
  // doc_ids: packed documents of the whole global sequence [B|1, S_global] (attention stays
  // inside each document), or undefined.
  at::Tensor forward(const at::Tensor& x, const at::Tensor& position_ids,
                     const at::Tensor& doc_ids = {});
  attention::AttentionHost& host() { return host_; }
  int64_t local_heads() const { return heads_; }
  int64_t local_kv_heads() const { return kv_heads_; }

  std::shared_ptr<tp::ColumnParallelLinearImpl> q_proj, k_proj, v_proj;
  std::shared_ptr<tp::ColumnParallelLinearImpl> g_proj;  // gated attention only, else null
  std::shared_ptr<tp::RowParallelLinearImpl> o_proj;
  RMSNorm q_norm{nullptr}, k_norm{nullptr};
  attention::HandoffPoint q_handoff{"q_handoff"}, k_handoff{"k_handoff"}, v_handoff{"v_handoff"};

 private:
  int64_t heads_, kv_heads_, head_dim_, rotary_dim_;
  double theta_;
  attention::AttentionHost host_;
};
TORCH_MODULE(Qwen3Attention);

class Qwen3MLPImpl : public torch::nn::Module {
 public:
  Qwen3MLPImpl(const Qwen3Config& c, int64_t layer, comm::GroupPtr tp);
  at::Tensor forward(const at::Tensor& x);
  std::shared_ptr<tp::ColumnParallelLinearImpl> gate_proj, up_proj;
  std::shared_ptr<tp::RowParallelLinearImpl> down_proj;
};
TORCH_MODULE(Qwen3MLP);

// Validate-mode hooks of one decoder layer (null checker: production).
struct LayerValidation {
  plan::BoundaryChecker* checker = nullptr;
  const plan::ModuleShardingSpec* layer = nullptr;
  const plan::ModuleShardingSpec* attn = nullptr;
  const plan::ModuleShardingSpec* mlp = nullptr;
};

class Qwen3DecoderLayerImpl : public torch::nn::Module {
 public:
  Qwen3DecoderLayerImpl(const Qwen3Config& c, int64_t layer, comm::GroupPtr tp);
  at::Tensor forward(const at::Tensor& x, const at::Tensor& position_ids,
                     const at::Tensor& doc_ids = {});
  // The token mixer. Packed documents (doc_ids) reach softmax and linear attention (whose state
  // and conv restart at each document); the MLA/DSA mixers refuse them with a clear error.
  at::Tensor mix(const at::Tensor& x, const at::Tensor& position_ids,
                 const at::Tensor& doc_ids = {});
  LayerValidation validation;
  RMSNorm input_layernorm{nullptr}, post_attention_layernorm{nullptr};
  Qwen3Attention self_attn{nullptr};     // mixer "attention"
  LinearAttention linear_attn{nullptr};  // mixer "gdn" | "kda"
  MLAAttention mla_attn{nullptr};        // mixer "mla" | "dsa"
  Qwen3MLP mlp{nullptr};                 // dense MLP (experts == 0), registered as "mlp"
  moe::MoE moe{nullptr};                 // MoE MLP (experts > 0), registered as "mlp"
  // The MLP (dense or MoE) on x.
  at::Tensor mlp_forward(const at::Tensor& x);
};
TORCH_MODULE(Qwen3DecoderLayer);

class Qwen3Impl : public torch::nn::Module, public plan::Plannable {
 public:
  explicit Qwen3Impl(const Qwen3Config& c, comm::GroupPtr tp = nullptr);
  // Per decoder layer: the layer, its self_attn (the attention slot, handoffs q/k/v_handoff,
  // reached through the primitive call: sdpa_hf) or its linear_attn (a linear slot) and its
  // mlp; TP dims from the linear types.
  std::vector<plan::ModuleInfo> plan_modules() override;
  void check_tp(int64_t tp_size) const override { validate(config_, tp_size); }
  void set_validation(plan::BoundaryChecker* checker,
                      const std::map<std::string, plan::ModuleShardingSpec>* specs) override;
  // HSDP units: root = embed_tokens, norm, lm_head; then one per decoder layer.
  std::vector<hsdp::UnitSpec> fully_shard_units() override;
  void set_fully_shard(hsdp::FullyShard* fs) override { fully_shard_ = fs; }
  // input_ids, position_ids [B, S_local] (global positions, or positions within each document
  // for packed documents) -> logits [B, S_local, vocab]. doc_ids: packed documents, the ids of
  // the whole global sequence [B, S_global] (cp::ShardedBatch::doc_ids), or undefined.
  at::Tensor forward(const at::Tensor& input_ids, const at::Tensor& position_ids,
                     const at::Tensor& doc_ids = {});
  const Qwen3Config& config() const { return config_; }
  // Parameters replicated over TP whose gradient is a partial sum per TP rank (QK-norm weights
  // act on the rank's own heads): their gradients must be all-reduced over TP.
  std::vector<at::Tensor> tp_partial_grad_parameters() const;
  // The auxiliary losses of the last forward (DSA layers' indexer losses, summed over this
  // rank's queries and the layers): a scalar in the graph, undefined when there are none. The
  // trainer adds it (times its coefficient) to the objective.
  at::Tensor aux_loss() const;
  // The MoE layers' losses of the last forward (aux and z, coefficients applied, each already
  // this rank's share of the global value): add as is. Undefined without MoE layers.
  at::Tensor moe_loss() const;
  // The MoE layers of the last forward together: assignments dropped by the capacity, and the
  // aux loss shares summed over the layers (sum over ranks: the global value).
  struct MoEStep {
    int64_t dropped = 0;
    double aux_loss = 0;
  };
  MoEStep moe_step() const;

  at::Tensor embed_tokens;  // [vocab, hidden], replicated
  std::vector<Qwen3DecoderLayer> layers;
  RMSNorm norm{nullptr};
  at::Tensor lm_head;  // [vocab, hidden] (the embedding itself when tied)

 private:
  Qwen3Config config_;
  at::Tensor run_layers(at::Tensor x, const at::Tensor& position_ids, const at::Tensor& doc_ids);
  at::Tensor head(const at::Tensor& x);

  plan::BoundaryChecker* checker_ = nullptr;
  const plan::ModuleShardingSpec* first_layer_ = nullptr;
  hsdp::FullyShard* fully_shard_ = nullptr;
  bool tp_ = false;
  // Each layer's (MoE loss, DSA index loss) of the last forward, as outputs of the layer (of its
  // recomputed block with recompute); zeros where the layer has none.
  std::vector<std::pair<at::Tensor, at::Tensor>> layer_losses_;
};
TORCH_MODULE(Qwen3);

}  // namespace hp::model
