#include "hp/model/qwen3.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <string>
#include <utility>

#include <ATen/ATen.h>
#include <torch/nn/modules/container/modulelist.h>

#include "hp/common/check.h"
#include "hp/common/recompute.h"

namespace hp::model {
namespace {

// A distinct, deterministic seed per weight: (model seed, layer, slot).
tp::LinearInit init_for(const Qwen3Config& c, int64_t layer, int64_t slot, int64_t fan_in) {
  return {c.seed * 1000003ULL + static_cast<uint64_t>(layer) * 101ULL + static_cast<uint64_t>(slot),
          1.0 / std::sqrt(static_cast<double>(fan_in))};
}

}  // namespace

RMSNormImpl::RMSNormImpl(int64_t dim, double eps) : eps_(eps) {
  weight = register_parameter("weight", at::ones({dim}));
}

at::Tensor RMSNormImpl::forward(const at::Tensor& x) {
  return x * at::rsqrt(x.pow(2).mean(-1, /*keepdim=*/true) + eps_) * weight;
}

at::Tensor apply_rope(const at::Tensor& x, const at::Tensor& position_ids, double theta,
                      int64_t rotary_dim) {
  if (rotary_dim > 0 && rotary_dim < x.size(-1)) {
    return at::cat({apply_rope(x.narrow(-1, 0, rotary_dim), position_ids, theta),
                    x.narrow(-1, rotary_dim, x.size(-1) - rotary_dim)},
                   -1);
  }
  const int64_t d = x.size(-1);
  auto inv_freq = at::pow(theta, -at::arange(0, d, 2, at::kDouble) / static_cast<double>(d));
  auto angles = position_ids.to(at::kDouble).unsqueeze(-1) * inv_freq;  // [B, S, D/2]
  auto emb = at::cat({angles, angles}, -1).unsqueeze(1);                // [B, 1, S, D]
  auto cos = emb.cos().to(x.scalar_type()), sin = emb.sin().to(x.scalar_type());
  auto halves = x.chunk(2, -1);
  auto rotated = at::cat({-halves[1], halves[0]}, -1);
  return x * cos + rotated * sin;
}

Qwen3AttentionImpl::Qwen3AttentionImpl(const Qwen3Config& c, int64_t layer, comm::GroupPtr tp,
                                       bool gated)
    : heads_(tp::tp_local(c.heads, tp, "heads")),
      kv_heads_(tp::tp_local(c.kv_heads, tp, "kv_heads")),
      head_dim_(c.head_dim),
      rotary_dim_(rotary_dim(c)),
      theta_(c.rope_theta),
      host_(c.primitive) {
  q_proj = register_module(
      "q_proj", std::make_shared<tp::ColumnParallelLinearImpl>(c.hidden, c.heads * c.head_dim, tp,
                                                               init_for(c, layer, 1, c.hidden)));
  k_proj = register_module(
      "k_proj", std::make_shared<tp::ColumnParallelLinearImpl>(
                    c.hidden, c.kv_heads * c.head_dim, tp, init_for(c, layer, 2, c.hidden)));
  v_proj = register_module(
      "v_proj", std::make_shared<tp::ColumnParallelLinearImpl>(
                    c.hidden, c.kv_heads * c.head_dim, tp, init_for(c, layer, 3, c.hidden)));
  o_proj = register_module("o_proj", std::make_shared<tp::RowParallelLinearImpl>(
                                         c.heads * c.head_dim, c.hidden, tp,
                                         init_for(c, layer, 4, c.heads * c.head_dim)));
  if (gated) {
    g_proj = register_module(
        "g_proj", std::make_shared<tp::ColumnParallelLinearImpl>(c.hidden, c.heads * c.head_dim, tp,
                                                                 init_for(c, layer, 8, c.hidden)));
  }
  q_norm = register_module("q_norm", RMSNorm(c.head_dim, c.rms_eps));
  k_norm = register_module("k_norm", RMSNorm(c.head_dim, c.rms_eps));
  for (auto* h : {&q_handoff, &k_handoff, &v_handoff})
    host_.add_handoff(h);
}

at::Tensor Qwen3AttentionImpl::forward(const at::Tensor& x, const at::Tensor& position_ids,
                                       const at::Tensor& doc_ids) {
  auto scope = host_.forward_scope();
  attention::AttentionOptions o;
  o.causal = true;
  if (doc_ids.defined()) o.documents = attention::Documents{doc_ids};
  host_.announce(o);  // before the projections: async CP may skip moves the documents hide
  const int64_t b = x.size(0), s = x.size(1);
  auto heads = [&](const at::Tensor& t, int64_t n) {
    return t.view({b, s, n, head_dim_}).transpose(1, 2);  // BNSD
  };
  auto rope = [&](const at::Tensor& t) { return apply_rope(t, position_ids, theta_, rotary_dim_); };
  auto q = q_handoff(rope(q_norm(heads(q_proj->forward(x), heads_))));
  auto k = k_handoff(rope(k_norm(heads(k_proj->forward(x), kv_heads_))));
  auto v = v_handoff(heads(v_proj->forward(x), kv_heads_));
  auto out =
      host_.call_primitive(q, k, v, o).out.transpose(1, 2).reshape({b, s, heads_ * head_dim_});
  if (g_proj) out = out * at::sigmoid(g_proj->forward(x));
  auto y = o_proj->forward(out);
  scope.end();
  return y;
}

Qwen3MLPImpl::Qwen3MLPImpl(const Qwen3Config& c, int64_t layer, comm::GroupPtr tp) {
  gate_proj =
      register_module("gate_proj", std::make_shared<tp::ColumnParallelLinearImpl>(
                                       c.hidden, c.ffn, tp, init_for(c, layer, 5, c.hidden)));
  up_proj = register_module("up_proj", std::make_shared<tp::ColumnParallelLinearImpl>(
                                           c.hidden, c.ffn, tp, init_for(c, layer, 6, c.hidden)));
  down_proj = register_module("down_proj", std::make_shared<tp::RowParallelLinearImpl>(
                                               c.ffn, c.hidden, tp, init_for(c, layer, 7, c.ffn)));
}

at::Tensor Qwen3MLPImpl::forward(const at::Tensor& x) {
  return down_proj->forward(at::silu(gate_proj->forward(x)) * up_proj->forward(x));
}

Qwen3DecoderLayerImpl::Qwen3DecoderLayerImpl(const Qwen3Config& c, int64_t layer,
                                             comm::GroupPtr tp) {
  input_layernorm = register_module("input_layernorm", RMSNorm(c.hidden, c.rms_eps));
  const std::string kind = layer_mixer(c, layer);
  if (kind == "attention" || kind == "gated_attention") {
    self_attn =
        register_module("self_attn", Qwen3Attention(c, layer, tp, kind == "gated_attention"));
  } else if (kind == "mla" || kind == "dsa") {
    mla_attn = register_module("mla_attn", MLAAttention(mla_config(c, kind == "dsa"), layer));
  } else {
    linear_attn = register_module("linear_attn", LinearAttention(linear_config(c, kind), layer));
  }
  post_attention_layernorm =
      register_module("post_attention_layernorm", RMSNorm(c.hidden, c.rms_eps));
  if (c.experts > 0) {
    moe = register_module("mlp", moe::MoE(moe_config(c), layer));
  } else {
    mlp = register_module("mlp", Qwen3MLP(c, layer, tp));
  }
}

at::Tensor Qwen3DecoderLayerImpl::mlp_forward(const at::Tensor& x) {
  return moe ? moe->forward(x) : mlp->forward(x);
}

at::Tensor Qwen3DecoderLayerImpl::mix(const at::Tensor& x, const at::Tensor& position_ids,
                                      const at::Tensor& doc_ids) {
  if (self_attn) return self_attn->forward(x, position_ids, doc_ids);
  if (linear_attn) return linear_attn->forward(x, doc_ids);
  return mla_attn->forward(x, position_ids, doc_ids);
}

at::Tensor Qwen3DecoderLayerImpl::forward(const at::Tensor& x, const at::Tensor& position_ids,
                                          const at::Tensor& doc_ids) {
  auto* v = validation.checker;
  if (v == nullptr) {  // production: the same kernels, no bookkeeping
    auto h = x + mix(input_layernorm->forward(x), position_ids, doc_ids);
    return h + mlp_forward(post_attention_layernorm->forward(h));
  }
  const auto& L = *validation.layer;
  const auto& A = *validation.attn;
  const auto& M = *validation.mlp;
  v->check_input(L.path, x, L.in_layout);
  auto a_in = input_layernorm->forward(x);  // elementwise: keeps the layout
  v->set_output(L.path + ".input_layernorm", a_in, L.in_layout);
  v->check_input(A.path, a_in, A.in_layout);
  auto a = mix(a_in, position_ids, doc_ids);
  v->set_output(A.path, a, A.out_layout);
  auto h = x + a;
  v->set_output(L.path + ".residual", h, L.in_layout);
  auto m_in = post_attention_layernorm->forward(h);
  v->set_output(L.path + ".post_attention_layernorm", m_in, L.in_layout);
  v->check_input(M.path, m_in, M.in_layout);
  auto m = mlp_forward(m_in);
  v->set_output(M.path, m, M.out_layout);
  auto y = h + m;
  v->set_output(L.path, y, L.out_layout);
  return y;
}

Qwen3Impl::Qwen3Impl(const Qwen3Config& c, comm::GroupPtr tp)
    : config_(c), tp_(tp && tp->size() > 1) {
  validate(c, tp ? tp->size() : 1);
  auto gen = at::make_generator<at::CPUGeneratorImpl>(c.seed);
  embed_tokens =
      register_parameter("embed_tokens", at::randn({c.vocab, c.hidden}, gen, at::kFloat));
  auto list = register_module("layers", torch::nn::ModuleList());  // names "layers.<i>...."
  for (int64_t i = 0; i < c.layers; ++i) {
    layers.push_back(Qwen3DecoderLayer(c, i, tp));
    list->push_back(layers.back());
  }
  norm = register_module("norm", RMSNorm(c.hidden, c.rms_eps));
  if (c.tie_embeddings) {
    lm_head = embed_tokens;
  } else {
    lm_head = register_parameter("lm_head", at::randn({c.vocab, c.hidden}, gen, at::kFloat) /
                                                std::sqrt(static_cast<double>(c.hidden)));
  }
}

at::Tensor Qwen3Impl::forward(const at::Tensor& input_ids, const at::Tensor& position_ids,
                              const at::Tensor& doc_ids) {
  HP_CHECK(input_ids.dim() == 2 && position_ids.sizes() == input_ids.sizes(),
           "Qwen3: input_ids and position_ids must both be [B, S_local]");
  auto body = [&] {
    auto x = at::embedding(embed_tokens, input_ids);
    if (checker_ != nullptr) {
      // The ids entered with their layout (the caller registered it); the embedding keeps it.
      checker_->check_input("embed_tokens", input_ids, first_layer_->in_layout);
      checker_->set_output("embed_tokens", x, first_layer_->in_layout);
    }
    return head(run_layers(x, position_ids, doc_ids));
  };
  return fully_shard_ != nullptr ? fully_shard_->forward_root(body) : body();
}

at::Tensor Qwen3Impl::run_layers(at::Tensor x, const at::Tensor& position_ids,
                                 const at::Tensor& doc_ids) {
  // A layer's auxiliary losses (MoE, DSA index) leave it as outputs of their own: with recompute
  // its forward keeps no graph, and their gradients are recomputed with the block.
  layer_losses_.clear();
  const bool recompute = config_.recompute && at::GradMode::is_enabled();
  for (size_t i = 0; i < layers.size(); ++i) {
    // By value: a recomputing backward runs it after this call (and a default argument) ended.
    auto with_losses = [this, i, position_ids, doc_ids](const at::Tensor& in) {
      auto y = layers[i]->forward(in, position_ids, doc_ids);
      auto zero = at::zeros({}, y.options());
      const auto& moe = layers[i]->moe;
      const auto& mla = layers[i]->mla_attn;
      auto moe_loss = moe && moe->loss().defined() ? moe->loss() : zero;
      auto index_loss = mla && mla->index_loss().defined() ? mla->index_loss() : zero;
      return std::vector<at::Tensor>{y, moe_loss, index_loss};
    };
    // Validate mode: a recomputed block's input is a detached copy of x; it carries x's layout
    // (x is kept alive with it, the same storage the recompute keeps).
    auto block_of = [this, with_losses, x](const at::Tensor& in) {
      if (checker_ != nullptr && !in.is_same(x)) checker_->carry(x, in);
      return with_losses(in);
    };
    std::vector<at::Tensor> outs;
    if (fully_shard_ != nullptr) {
      outs = fully_shard_->forward_unit_outputs(i + 1, x, block_of, recompute);
    } else if (recompute) {
      auto block = [block_of](const std::vector<at::Tensor>& in) { return block_of(in[0]); };
      outs = common::checkpoint(block, {x});
    } else {
      outs = with_losses(x);
    }
    x = outs[0];
    // HSDP's unit wrapper and the recompute block hand the layer's output back as a new tensor
    // (the same values): it keeps the layer's output layout for the next layer's check.
    if (checker_ != nullptr && layers[i]->validation.layer != nullptr) {
      const auto& out = *layers[i]->validation.layer;
      checker_->set_output(out.path, x, out.out_layout);
    }
    layer_losses_.push_back({outs[1], outs[2]});
  }
  return x;
}

at::Tensor Qwen3Impl::head(const at::Tensor& x) {
  return at::matmul(norm->forward(x), lm_head.t());
}

std::vector<hsdp::UnitSpec> Qwen3Impl::fully_shard_units() {
  std::vector<hsdp::UnitSpec> units(1 + layers.size());
  units[0].name = "root";
  units[0].params.push_back({"embed_tokens", embed_tokens});
  units[0].params.push_back({"norm.weight", norm->weight});
  if (!config_.tie_embeddings) units[0].params.push_back({"lm_head", lm_head});
  for (size_t i = 0; i < layers.size(); ++i) {
    const std::string base = common::str_cat("layers.", i);
    units[i + 1].name = base;
    const auto& moe = layers[i]->moe;
    for (const auto& p : layers[i]->named_parameters()) {
      // Experts split by EP are not sharded again by HSDP (the trainer reduces them).
      if (moe && moe->ep_size() > 1 &&
          (p.key() == "mlp.gate_proj" || p.key() == "mlp.up_proj" || p.key() == "mlp.down_proj")) {
        continue;
      }
      // QK-norm weights act on this rank's heads: partial gradients under TP.
      const bool partial = tp_ && (p.key().find("q_norm") != std::string::npos ||
                                   p.key().find("k_norm") != std::string::npos);
      units[i + 1].params.push_back({base + "." + p.key(), p.value(), partial});
    }
  }
  return units;
}

namespace {

// A module of the plan at `path` with its parameters' TP dims, no slot set.
plan::ModuleInfo module_info(std::string path, std::map<std::string, int64_t> tp_dims = {}) {
  plan::ModuleInfo info;
  info.path = std::move(path);
  info.tp_shard_dims = std::move(tp_dims);
  return info;
}

// The MLP slot of a layer: dense (TP dims from its linears) or MoE (expert parallelism).
plan::ModuleInfo mlp_info(const std::string& base, Qwen3DecoderLayerImpl& layer) {
  if (layer.moe) {
    auto info = module_info(base + ".mlp", tp::tp_shard_dims(*layer.moe));
    const auto& r = layer.moe->config().router;
    info.moe = plan::MoESlotInfo{r.experts, r.top_k, layer.moe.get()};
    return info;
  }
  return module_info(base + ".mlp", tp::tp_shard_dims(*layer.mlp));
}

}  // namespace

std::vector<plan::ModuleInfo> Qwen3Impl::plan_modules() {
  std::vector<plan::ModuleInfo> out;
  for (size_t i = 0; i < layers.size(); ++i) {
    const std::string base = common::str_cat("layers.", i);
    auto& attn = layers[i]->self_attn;
    out.push_back(module_info(base));
    if (auto& mla = layers[i]->mla_attn) {
      auto info = module_info(base + ".mla_attn", tp::tp_shard_dims(*mla));
      info.mla = plan::MLASlotInfo{mla->shape(), &mla->host(),
                                   mla->config().sparse ? &mla->dsa_host() : nullptr};
      out.push_back(std::move(info));
      out.push_back(mlp_info(base, *layers[i]));
      continue;
    }
    if (!attn) {
      auto& lin = layers[i]->linear_attn;
      plan::LinearSlotInfo slot{lin->shape(), &lin->host()};
      auto info = module_info(base + ".linear_attn", tp::tp_shard_dims(*lin));
      info.linear = slot;
      out.push_back(std::move(info));
      out.push_back(mlp_info(base, *layers[i]));
      continue;
    }
    plan::AttentionSlotInfo slot;
    slot.heads = config_.heads;
    slot.kv_heads = config_.kv_heads;
    slot.head_dim = config_.head_dim;
    slot.hidden = config_.hidden;
    slot.host = &attn->host();
    slot.adapter = "sdpa_hf";
    slot.handoffs = {{"q", attn->q_handoff.name()},
                     {"k", attn->k_handoff.name()},
                     {"v", attn->v_handoff.name()}};
    auto info = module_info(base + ".self_attn", tp::tp_shard_dims(*attn));
    info.attention = slot;
    out.push_back(std::move(info));
    out.push_back(mlp_info(base, *layers[i]));
  }
  return out;
}

void Qwen3Impl::set_validation(plan::BoundaryChecker* checker,
                               const std::map<std::string, plan::ModuleShardingSpec>* specs) {
  checker_ = checker;
  first_layer_ = nullptr;
  for (size_t i = 0; i < layers.size(); ++i) {
    auto& v = layers[i]->validation;
    v = LayerValidation{};
    if (checker == nullptr) continue;
    const std::string base = common::str_cat("layers.", i);
    auto find = [&](const std::string& path) {
      auto it = specs->find(path);
      HP_CHECK(it != specs->end(), "validate: the plan has no spec for module '", path, "'");
      return &it->second;
    };
    const char* mixer = layers[i]->self_attn  ? ".self_attn"
                        : layers[i]->mla_attn ? ".mla_attn"
                                              : ".linear_attn";
    v = {checker, find(base), find(base + mixer), find(base + ".mlp")};
    if (i == 0) first_layer_ = v.layer;
  }
}

at::Tensor Qwen3Impl::aux_loss() const {
  at::Tensor total;
  for (size_t i = 0; i < layer_losses_.size(); ++i) {
    const auto& mla = layers[i]->mla_attn;
    if (!mla || !mla->index_loss().defined()) continue;
    const auto& l = layer_losses_[i].second;
    total = total.defined() ? total + l : l;
  }
  return total;
}

at::Tensor Qwen3Impl::moe_loss() const {
  at::Tensor total;
  for (size_t i = 0; i < layer_losses_.size(); ++i) {
    if (!layers[i]->moe) continue;
    const auto& l = layer_losses_[i].first;
    total = total.defined() ? total + l : l;
  }
  return total;
}

Qwen3Impl::MoEStep Qwen3Impl::moe_step() const {
  MoEStep s;
  for (const auto& layer : layers) {
    if (!layer->moe) continue;
    s.dropped += layer->moe->stats().dropped;
    s.aux_loss += layer->moe->stats().aux_loss;
  }
  return s;
}

std::vector<at::Tensor> Qwen3Impl::tp_partial_grad_parameters() const {
  std::vector<at::Tensor> out;
  for (const auto& layer : layers) {
    if (!layer->self_attn) continue;  // linear-attention layers have no TP
    out.push_back(layer->self_attn->q_norm->weight);
    out.push_back(layer->self_attn->k_norm->weight);
  }
  return out;
}

}  // namespace hp::model
