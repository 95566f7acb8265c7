#include "hp/model/qwen3.h"

#include <algorithm>
#include <cmath>

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

void validate(const Qwen3Config& c, int64_t tp) {
  HP_CHECK(c.vocab > 0 && c.layers > 0 && c.hidden > 0 && c.heads > 0 && c.kv_heads > 0 &&
               c.head_dim > 0 && c.ffn > 0,
           "Qwen3Config: every size must be positive");
  HP_CHECK(c.head_dim % 2 == 0, "Qwen3Config.head_dim=", c.head_dim, " must be even for RoPE");
  HP_CHECK(c.heads % c.kv_heads == 0, "Qwen3Config.heads=", c.heads,
           " is not a multiple of kv_heads=", c.kv_heads);
  HP_CHECK(c.heads % tp == 0 && c.kv_heads % tp == 0, "Qwen3Config: heads=", c.heads,
           " and kv_heads=", c.kv_heads, " must both be divisible by tp_size=", tp,
           "; choose a tp_size that divides ", c.kv_heads);
  HP_CHECK(c.ffn % tp == 0, "Qwen3Config.ffn=", c.ffn, " is not divisible by tp_size=", tp);
  HP_CHECK(c.mixer == "attention" || c.mixer == "gdn" || c.mixer == "kda" || c.mixer == "mla" ||
               c.mixer == "dsa",
           "Qwen3Config.mixer='", c.mixer, "' is not valid; valid: attention, gdn, kda, mla, dsa");
  if (c.mixer == "mla" || c.mixer == "dsa") {
    HP_CHECK(tp == 1, "Qwen3Config.mixer=", c.mixer,
             ": MLA layers have no tensor parallelism here; use tp_size=1 (got ", tp,
             ") and split the sequence with cp instead");
    HP_CHECK(c.head_dim % 4 == 0, "Qwen3Config.head_dim=", c.head_dim,
             " must be a multiple of 4 with mixer=", c.mixer,
             " (d_rope = head_dim / 2 must be even)");
    validate(mla_config(c));
  } else if (c.mixer != "attention") {
    HP_CHECK(tp == 1, "Qwen3Config.mixer=", c.mixer,
             ": linear-attention layers have no tensor "
             "parallelism; use tp_size=1 (got ",
             tp, ") and split the sequence with cp instead");
    validate(linear_config(c));
  }
}

LinearAttentionConfig linear_config(const Qwen3Config& c) {
  LinearAttentionConfig l;
  l.mixer = c.mixer;
  l.hidden = c.hidden;
  l.heads = c.heads;
  l.value_heads = c.value_heads > 0 ? c.value_heads : c.heads;
  l.key_dim = l.value_dim = c.head_dim;
  l.gate_rank = c.head_dim;
  l.rms_eps = c.rms_eps;
  l.seed = c.seed;
  return l;
}

MLAConfig mla_config(const Qwen3Config& c) {
  MLAConfig m;
  m.hidden = c.hidden;
  m.heads = c.heads;
  m.d_nope = m.d_v = c.head_dim;
  m.d_rope = c.head_dim / 2;
  m.kv_rank = c.kv_rank > 0 ? c.kv_rank : 2 * c.head_dim;
  m.q_rank = c.q_rank > 0 ? c.q_rank : 3 * c.head_dim;
  m.rope_theta = c.rope_theta;
  m.rms_eps = c.rms_eps;
  m.primitive = c.primitive;
  m.seed = c.seed;
  m.sparse = c.mixer == "dsa";
  m.topk = c.topk;
  m.index_loss = c.index_loss;
  m.index_heads = c.index_heads;
  m.index_dim = c.index_dim;
  return m;
}

plan::ModelFootprint footprint(const Qwen3Config& c) {
  const int64_t h = c.hidden, q = c.heads * c.head_dim, kv = c.kv_heads * c.head_dim, f = c.ffn,
                v = c.vocab;
  plan::ModelFootprint m;
  m.units.push_back({0, (c.tie_embeddings ? 1 : 2) * v * h + h});  // embeddings, head, norm
  m.layers = c.layers;
  m.head_act = 3 * h + 4 * v;  // the final norm, the logits, their log-softmax and both gradients
  m.recompute = c.recompute;
  if (c.mixer == "mla" || c.mixer == "dsa") {
    const auto a = mla_config(c);
    const int64_t dq = a.d_nope + a.d_rope, q = a.heads * dq, kv = a.heads * (dq + a.d_v);
    for (int64_t i = 0; i < c.layers; ++i)
      m.units.push_back({mla_parameter_count(a) + 3 * h * f, 2 * h});
    m.largest_param = std::max({v * h, q * a.q_rank, kv * a.kv_rank, h * f});
    // Per token: the query path (low rank, norm, up-projection, RoPE: 6 tensors of q), the
    // latent and its norm, the rotated key, the output and its projection input; the MLP; ten
    // hidden-size tensors. The K/V each rank expands from the gathered latent count as gathered
    // K/V (kv_per_token over the whole sequence).
    m.layer_act =
        6 * q + 3 * a.q_rank + 4 * a.kv_rank + 3 * a.d_rope + 3 * a.heads * a.d_v + 10 * h + 4 * f;
    if (a.sparse) {
      // The indexer's inputs and outputs, and the selection: int64 indices and the selected
      // keys' probabilities per query (kept for backward).
      m.layer_act += 3 * a.q_rank + 2 * a.index_heads * a.index_dim + 2 * a.index_dim +
                     a.index_heads + 3 * a.topk;
    }
    m.layer_input = h;
    m.q_per_token = q;
    m.kv_per_token = kv;
    return m;
  }
  if (c.mixer != "attention") {
    const auto l = linear_config(c);
    const int64_t hv = l.value_heads, conv = 2 * l.heads * l.key_dim + hv * l.value_dim;
    const int64_t gates = c.mixer == "kda" ? hv * l.key_dim : hv;
    const int64_t gate_proj = c.mixer == "kda" ? l.gate_rank * h + gates * l.gate_rank : hv * h;
    const int64_t mixer = conv * h + conv * l.conv_width + hv * h + gate_proj +
                          2 * hv * l.value_dim * h + hv + gates + l.value_dim;
    for (int64_t i = 0; i < c.layers; ++i)
      m.units.push_back({mixer + 3 * h * f, 2 * h});
    m.largest_param = std::max({v * h, conv * h, h * f});
    // Per token: projections, convolution and SiLU, normalised q/k, gates; the chunked
    // kernel's per-chunk C x C products (three per value head) and states (one [K, V] per head
    // per chunk); the gated norm and the output; the MLP and the hidden-size tensors as above.
    m.layer_act = 10 * h + 4 * conv + 3 * gates + 10 * hv * l.value_dim + 3 * l.chunk_size * hv +
                  2 * hv * l.key_dim * l.value_dim / l.chunk_size + 4 * f;
    m.layer_input = h;
    return m;
  }
  for (int64_t i = 0; i < c.layers; ++i) {
    // Q/K/V/O and gate/up/down are split by TP; the norms (and QK-norms) are not.
    m.units.push_back({h * q + 2 * h * kv + q * h + 3 * h * f, 2 * h + 2 * c.head_dim});
  }
  m.largest_param = std::max({v * h, h * q, h * f});
  // Per token, what autograd keeps of one layer (forward() above): Q through QK-norm and RoPE
  // (7 tensors), K likewise, V, the attention output and its [B, S, H*D] copy; gate, SiLU, up
  // and their product; and ten hidden-size tensors (two RMSNorms of three, residuals, outputs).
  m.layer_act_tp = 9 * q + 8 * kv + 4 * f;
  m.layer_act = 10 * h;
  m.layer_input = h;
  m.q_per_token = q;
  m.kv_per_token = 2 * kv;
  return m;
}

RMSNormImpl::RMSNormImpl(int64_t dim, double eps) : eps_(eps) {
  weight = register_parameter("weight", at::ones({dim}));
}

at::Tensor RMSNormImpl::forward(const at::Tensor& x) {
  return x * at::rsqrt(x.pow(2).mean(-1, /*keepdim=*/true) + eps_) * weight;
}

at::Tensor apply_rope(const at::Tensor& x, const at::Tensor& position_ids, double theta) {
  const int64_t d = x.size(-1);
  auto inv_freq = at::pow(theta, -at::arange(0, d, 2, at::kDouble) / static_cast<double>(d));
  auto angles = position_ids.to(at::kDouble).unsqueeze(-1) * inv_freq;  // [B, S, D/2]
  auto emb = at::cat({angles, angles}, -1).unsqueeze(1);                // [B, 1, S, D]
  auto cos = emb.cos().to(x.scalar_type()), sin = emb.sin().to(x.scalar_type());
  auto halves = x.chunk(2, -1);
  auto rotated = at::cat({-halves[1], halves[0]}, -1);
  return x * cos + rotated * sin;
}

Qwen3AttentionImpl::Qwen3AttentionImpl(const Qwen3Config& c, int64_t layer, comm::GroupPtr tp)
    : heads_(tp::tp_local(c.heads, tp, "heads")),
      kv_heads_(tp::tp_local(c.kv_heads, tp, "kv_heads")),
      head_dim_(c.head_dim),
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
  q_norm = register_module("q_norm", RMSNorm(c.head_dim, c.rms_eps));
  k_norm = register_module("k_norm", RMSNorm(c.head_dim, c.rms_eps));
  for (auto* h : {&q_handoff, &k_handoff, &v_handoff})
    host_.add_handoff(h);
}

at::Tensor Qwen3AttentionImpl::forward(const at::Tensor& x, const at::Tensor& position_ids,
                                       const at::Tensor& doc_ids) {
  auto scope = host_.forward_scope();
  const int64_t b = x.size(0), s = x.size(1);
  auto heads = [&](const at::Tensor& t, int64_t n) {
    return t.view({b, s, n, head_dim_}).transpose(1, 2);  // BNSD
  };
  auto q = q_handoff(apply_rope(q_norm(heads(q_proj->forward(x), heads_)), position_ids, theta_));
  auto k =
      k_handoff(apply_rope(k_norm(heads(k_proj->forward(x), kv_heads_)), position_ids, theta_));
  auto v = v_handoff(heads(v_proj->forward(x), kv_heads_));
  attention::AttentionOptions o;
  o.causal = true;
  if (doc_ids.defined()) o.documents = attention::Documents{doc_ids};
  auto out = host_.call_primitive(q, k, v, o).out;
  auto y = o_proj->forward(out.transpose(1, 2).reshape({b, s, heads_ * head_dim_}));
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
  if (c.mixer == "attention") {
    self_attn = register_module("self_attn", Qwen3Attention(c, layer, tp));
  } else if (c.mixer == "mla" || c.mixer == "dsa") {
    mla_attn = register_module("mla_attn", MLAAttention(mla_config(c), layer));
  } else {
    linear_attn = register_module("linear_attn", LinearAttention(linear_config(c), layer));
  }
  post_attention_layernorm =
      register_module("post_attention_layernorm", RMSNorm(c.hidden, c.rms_eps));
  mlp = register_module("mlp", Qwen3MLP(c, layer, tp));
}

at::Tensor Qwen3DecoderLayerImpl::mix(const at::Tensor& x, const at::Tensor& position_ids,
                                      const at::Tensor& doc_ids) {
  if (self_attn) return self_attn->forward(x, position_ids, doc_ids);
  HP_CHECK(!doc_ids.defined(), "packed documents reach softmax attention layers only; the ",
           mla_attn ? "MLA/DSA" : "linear-attention",
           " mixer does not take document boundaries yet: train it without --pack-documents");
  if (mla_attn) return mla_attn->forward(x, position_ids);
  return linear_attn->forward(x);
}

at::Tensor Qwen3DecoderLayerImpl::forward(const at::Tensor& x, const at::Tensor& position_ids,
                                          const at::Tensor& doc_ids) {
  auto* v = validation.checker;
  if (v == nullptr) {  // production: the same kernels, no bookkeeping
    auto h = x + mix(input_layernorm->forward(x), position_ids, doc_ids);
    return h + mlp->forward(post_attention_layernorm->forward(h));
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
  auto m = mlp->forward(m_in);
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
  for (size_t i = 0; i < layers.size(); ++i) {
    // By value: a recomputing backward runs fn after this call (and a default argument) ended.
    auto fn = [this, i, position_ids, doc_ids](const at::Tensor& in) {
      return layers[i]->forward(in, position_ids, doc_ids);
    };
    if (fully_shard_ != nullptr) {
      x = fully_shard_->forward_unit(i + 1, x, fn, config_.recompute);
    } else if (config_.recompute && at::GradMode::is_enabled()) {
      auto block = [fn](const std::vector<at::Tensor>& in) { return std::vector{fn(in[0])}; };
      x = common::checkpoint(block, {x})[0];
    } else {
      x = fn(x);
    }
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
    for (const auto& p : layers[i]->named_parameters()) {
      // QK-norm weights act on this rank's heads: partial gradients under TP.
      const bool partial = tp_ && (p.key().find("q_norm") != std::string::npos ||
                                   p.key().find("k_norm") != std::string::npos);
      units[i + 1].params.push_back({base + "." + p.key(), p.value(), partial});
    }
  }
  return units;
}

std::vector<plan::ModuleInfo> Qwen3Impl::plan_modules() {
  std::vector<plan::ModuleInfo> out;
  for (size_t i = 0; i < layers.size(); ++i) {
    const std::string base = common::str_cat("layers.", i);
    auto& attn = layers[i]->self_attn;
    out.push_back({base, {}, std::nullopt, std::nullopt});
    if (auto& mla = layers[i]->mla_attn) {
      plan::ModuleInfo info{base + ".mla_attn", tp::tp_shard_dims(*mla), std::nullopt,
                            std::nullopt};
      info.mla = plan::MLASlotInfo{mla->shape(), &mla->host(),
                                   mla->config().sparse ? &mla->dsa_host() : nullptr};
      out.push_back(std::move(info));
      out.push_back(
          {base + ".mlp", tp::tp_shard_dims(*layers[i]->mlp), std::nullopt, std::nullopt});
      continue;
    }
    if (!attn) {
      auto& lin = layers[i]->linear_attn;
      plan::LinearSlotInfo slot{lin->shape(), &lin->host()};
      out.push_back({base + ".linear_attn", tp::tp_shard_dims(*lin), std::nullopt, slot});
      out.push_back(
          {base + ".mlp", tp::tp_shard_dims(*layers[i]->mlp), std::nullopt, std::nullopt});
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
    out.push_back({base + ".self_attn", tp::tp_shard_dims(*attn), slot, std::nullopt});
    out.push_back({base + ".mlp", tp::tp_shard_dims(*layers[i]->mlp), std::nullopt, std::nullopt});
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
  for (const auto& layer : layers) {
    if (!layer->mla_attn || !layer->mla_attn->index_loss().defined()) continue;
    const auto& l = layer->mla_attn->index_loss();
    total = total.defined() ? total + l : l;
  }
  return total;
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
