// The decoder's configuration: per-layer mixers (the family's layer pattern), the sub-configs
// of each layer type, the checks before anything is built, and the memory footprint.
#include <algorithm>
#include <cctype>
#include <cmath>
#include <set>
#include <utility>

#include "hp/common/check.h"
#include "hp/model/qwen3.h"

namespace hp::model {
namespace {

const std::set<std::string>& mixer_names() {
  static const std::set<std::string> names{"attention", "gated_attention", "gdn", "kda", "mla",
                                           "dsa"};
  return names;
}

std::set<std::string> mixers_of(const Qwen3Config& c) {
  std::set<std::string> kinds;
  const int64_t n = c.layer_pattern.empty() ? 1 : static_cast<int64_t>(c.layer_pattern.size());
  for (int64_t i = 0; i < std::min(n, std::max<int64_t>(c.layers, 1)); ++i)
    kinds.insert(layer_mixer(c, i));
  return kinds;
}

// One layer's share of the footprint: parameters, activations per token, CP volumes.
struct LayerCost {
  plan::ParamGroup params;
  int64_t act_tp = 0, act = 0, q = 0, kv = 0, largest = 0;
};

LayerCost mixer_cost(const Qwen3Config& c, const std::string& kind) {
  const int64_t h = c.hidden;
  LayerCost l;
  if (kind == "mla" || kind == "dsa") {
    const auto a = mla_config(c, kind == "dsa");
    const int64_t dq = a.d_nope + a.d_rope, q = a.heads * dq, kv = a.heads * (dq + a.d_v);
    l.params = {mla_parameter_count(a), 0};
    l.largest = std::max(q * a.q_rank, kv * a.kv_rank);
    // Per token: the query path (low rank, norm, up-projection, RoPE: 6 tensors of q), the
    // latent and its norm, the rotated key, the output and its projection input; ten
    // hidden-size tensors. The K/V each rank expands from the gathered latent count as gathered
    // K/V (kv_per_token over the whole sequence).
    l.act = 6 * q + 3 * a.q_rank + 4 * a.kv_rank + 3 * a.d_rope + 3 * a.heads * a.d_v + 10 * h;
    if (a.sparse) {
      // The indexer's inputs and outputs, and the selection: int64 indices and the selected
      // keys' probabilities per query (kept for backward).
      l.act += 3 * a.q_rank + 2 * a.index_heads * a.index_dim + 2 * a.index_dim + a.index_heads +
               3 * a.topk;
    }
    l.q = q;
    l.kv = kv;
    return l;
  }
  if (kind == "gdn" || kind == "kda") {
    const auto lc = linear_config(c, kind);
    const int64_t hv = lc.value_heads, conv = 2 * lc.heads * lc.key_dim + hv * lc.value_dim;
    const int64_t gates = kind == "kda" ? hv * lc.key_dim : hv;
    const int64_t gate_proj = kind == "kda" ? lc.gate_rank * h + gates * lc.gate_rank : hv * h;
    l.params = {conv * h + conv * lc.conv_width + hv * h + gate_proj + 2 * hv * lc.value_dim * h +
                    hv + gates + lc.value_dim,
                0};
    l.largest = conv * h;
    // Per token: projections, convolution and SiLU, normalised q/k, gates; the chunked
    // kernel's per-chunk C x C products (three per value head) and states (one [K, V] per head
    // per chunk); the gated norm and the output; the hidden-size tensors as above.
    l.act = 10 * h + 4 * conv + 3 * gates + 10 * hv * lc.value_dim + 3 * lc.chunk_size * hv +
            2 * hv * lc.key_dim * lc.value_dim / lc.chunk_size;
    return l;
  }
  const int64_t q = c.heads * c.head_dim, kv = c.kv_heads * c.head_dim;
  const bool gated = kind == "gated_attention";
  // Q/K/V/O (and the gate) are split by TP; the QK-norms are not.
  l.params = {h * q + 2 * h * kv + q * h + (gated ? h * q : 0), 2 * c.head_dim};
  l.largest = h * q;
  // Per token, what autograd keeps (Qwen3AttentionImpl::forward): Q through QK-norm and RoPE
  // (7 tensors), K likewise, V, the attention output and its [B, S, H*D] copy (and the gate,
  // its sigmoid and the gated output); ten hidden-size tensors (two RMSNorms of three,
  // residuals, outputs).
  l.act_tp = 9 * q + 8 * kv + (gated ? 3 * q : 0);
  l.act = 10 * h;
  l.q = q;
  l.kv = 2 * kv;
  return l;
}

LayerCost mlp_cost(const Qwen3Config& c) {
  const int64_t h = c.hidden;
  LayerCost l;
  if (c.experts == 0) {
    l.params = {3 * h * c.ffn, 0};
    l.largest = h * c.ffn;
    l.act_tp = 4 * c.ffn;  // gate, SiLU, up and their product
    return l;
  }
  const auto m = moe_config(c);
  const int64_t e = m.router.experts, k = m.router.top_k, f = m.expert_ffn, s = m.shared_ffn;
  l.params.replicated = e * h + 3 * h * s;
  l.params.expert = 3 * e * f * h;
  l.largest = e * f * h;  // one stacked kind, built whole before EP keeps its slice
  // Per token: router logits and probabilities; per routed copy (k) the row, the expert's
  // gate/SiLU/up/product and its output twice (gathered and weighted); the shared expert.
  l.act = 3 * e + k * (3 * h + 4 * f) + 4 * s;
  return l;
}

}  // namespace

std::string layer_mixer(const Qwen3Config& c, int64_t layer) {
  if (c.layer_pattern.empty()) return c.mixer;
  const char ch = static_cast<char>(std::tolower(static_cast<unsigned char>(
      c.layer_pattern[static_cast<size_t>(layer) % c.layer_pattern.size()])));
  switch (ch) {
    case 'a':
      return "attention";
    case 'g':
      return "gated_attention";
    case 'l':
      return c.linear_kind;
    case 'm':
      return "mla";
    case 'd':
      return "dsa";
    default:
      break;
  }
  HP_CHECK(false, "Qwen3Config.layer_pattern='", c.layer_pattern, "' has '", std::string(1, ch),
           "'; valid letters: A (attention), G (gated attention), L (linear: linear_kind), M "
           "(MLA), D (DSA)");
}

bool has_mixer(const Qwen3Config& c, const std::string& mixer) {
  return mixers_of(c).count(mixer) > 0;
}
bool has_linear(const Qwen3Config& c) {
  return has_mixer(c, "gdn") || has_mixer(c, "kda");
}
bool has_softmax_attention(const Qwen3Config& c) {
  return has_mixer(c, "attention") || has_mixer(c, "gated_attention");
}
bool has_mla(const Qwen3Config& c) {
  return has_mixer(c, "mla") || has_mixer(c, "dsa");
}

int64_t rotary_dim(const Qwen3Config& c) {
  return static_cast<int64_t>(std::llround(c.head_dim * c.partial_rotary_factor));
}

void validate(const Qwen3Config& c, int64_t tp) {
  for (const auto& [field, value] : {std::pair<const char*, int64_t>{"vocab", c.vocab},
                                     {"layers", c.layers},
                                     {"hidden", c.hidden},
                                     {"heads", c.heads},
                                     {"kv_heads", c.kv_heads},
                                     {"head_dim", c.head_dim},
                                     {"ffn", c.ffn}}) {
    HP_CHECK(value > 0, "Qwen3Config.", field, "=", value, " must be positive");
  }
  HP_CHECK(c.head_dim % 2 == 0, "Qwen3Config.head_dim=", c.head_dim, " must be even for RoPE");
  // A pattern repeats over the layers; cut short it would drop its later kinds (qwen3.5's G).
  HP_CHECK(c.layer_pattern.size() <= static_cast<size_t>(c.layers), "Qwen3Config.layers=", c.layers,
           " is shorter than layer_pattern=", c.layer_pattern, " (", c.layer_pattern.size(),
           " layers, from --arch or --layer-pattern), so its last ",
           static_cast<int64_t>(c.layer_pattern.size()) - c.layers,
           " would never be built; use --layers ", c.layer_pattern.size(), " or more");
  {
    const double r = c.head_dim * c.partial_rotary_factor;
    const int64_t ri = rotary_dim(c);
    HP_CHECK(c.partial_rotary_factor > 0 && c.partial_rotary_factor <= 1 &&
                 std::abs(r - static_cast<double>(ri)) < 1e-9 && ri % 2 == 0 && ri > 0,
             "Qwen3Config.partial_rotary_factor=", c.partial_rotary_factor,
             " with head_dim=", c.head_dim, " rotates ", r,
             " channels; the factor must be in (0, 1] and head_dim * factor a positive even "
             "integer (e.g. 0.25 with head_dim a multiple of 8)");
  }
  HP_CHECK(c.heads % c.kv_heads == 0, "Qwen3Config.heads=", c.heads,
           " is not a multiple of kv_heads=", c.kv_heads);
  HP_CHECK(c.heads % tp == 0 && c.kv_heads % tp == 0, "Qwen3Config: heads=", c.heads,
           " and kv_heads=", c.kv_heads, " must both be divisible by tp_size=", tp,
           "; choose a tp_size that divides ", c.kv_heads);
  // The dense MLP's width splits over TP; MoE experts are not split (moe/), so with experts
  // ffn only sizes experts (where moe_ffn is 0).
  HP_CHECK(c.experts > 0 || c.ffn % tp == 0, "Qwen3Config.ffn=", c.ffn,
           " is not divisible by tp_size=", tp);
  for (const auto& [field, value] : {std::pair<const char*, int64_t>{"kv_rank", c.kv_rank},
                                     {"q_rank", c.q_rank},
                                     {"value_heads", c.value_heads}}) {
    HP_CHECK(value >= 0, "Qwen3Config.", field, "=", value,
             " must be >= 0 (0: the default derived from head_dim / heads)");
  }
  HP_CHECK(c.moe_ffn >= 0, "Qwen3Config.moe_ffn=", c.moe_ffn,
           " must be >= 0 (0: each expert as wide as ffn)");
  HP_CHECK(mixer_names().count(c.mixer) == 1, "Qwen3Config.mixer='", c.mixer,
           "' is not valid; valid: attention, gated_attention, gdn, kda, mla, dsa");
  HP_CHECK(c.linear_kind == "gdn" || c.linear_kind == "kda", "Qwen3Config.linear_kind='",
           c.linear_kind, "' is not valid; valid: gdn, kda");
  HP_CHECK(c.experts >= 0, "Qwen3Config.experts=", c.experts, " must be >= 0 (0: dense MLP)");
  if (c.experts > 0) moe::validate(moe_config(c));
  for (const auto& kind : mixers_of(c)) {
    if (kind == "mla" || kind == "dsa") {
      HP_CHECK(tp == 1, "Qwen3Config.mixer=", kind, ": MLA",
               " layers have no tensor parallelism here; use tp_size=1 (got ", tp,
               ") and split the sequence with cp instead");
      HP_CHECK(c.head_dim % 4 == 0, "Qwen3Config.head_dim=", c.head_dim,
               " must be a multiple of 4 with mixer=", kind,
               " (d_rope = head_dim / 2 must be even)");
      validate(mla_config(c, kind == "dsa"));
    } else if (kind == "gdn" || kind == "kda") {
      HP_CHECK(tp == 1, "Qwen3Config: ", kind,
               " linear-attention layers have no tensor parallelism; use tp_size=1 (got ", tp,
               ") and split the sequence with cp instead");
      validate(linear_config(c, kind));
    }
  }
}

LinearAttentionConfig linear_config(const Qwen3Config& c, const std::string& kind) {
  LinearAttentionConfig l;
  l.mixer = kind;
  l.hidden = c.hidden;
  l.heads = c.heads;
  l.value_heads = c.value_heads > 0 ? c.value_heads : c.heads;
  l.key_dim = l.value_dim = c.head_dim;
  l.gate_rank = c.head_dim;
  l.rms_eps = c.rms_eps;
  l.seed = c.seed;
  return l;
}

MLAConfig mla_config(const Qwen3Config& c, bool sparse) {
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
  m.sparse = sparse;
  m.topk = c.topk;
  m.index_loss = c.index_loss;
  m.index_heads = c.index_heads;
  m.index_dim = c.index_dim;
  return m;
}

moe::MoEConfig moe_config(const Qwen3Config& c) {
  moe::MoEConfig m;
  m.hidden = c.hidden;
  m.expert_ffn = c.moe_ffn > 0 ? c.moe_ffn : c.ffn;
  m.shared_ffn = c.shared_expert_ffn;
  m.router.experts = c.experts;
  m.router.top_k = c.moe_top_k;
  m.router.capacity_factor = c.capacity_factor;
  m.router.renormalize = c.moe_renormalize;
  m.aux_loss_coef = c.aux_loss_coef;
  m.z_loss_coef = c.z_loss_coef;
  m.seed = c.seed;
  return m;
}

plan::ModelFootprint footprint(const Qwen3Config& c) {
  const int64_t h = c.hidden, v = c.vocab;
  plan::ModelFootprint m;
  m.units.push_back({0, (c.tie_embeddings ? 1 : 2) * v * h + h});  // embeddings, head, norm
  m.layers = c.layers;
  m.head_act = 3 * h + 4 * v;  // the final norm, the logits, their log-softmax and both gradients
  m.recompute = c.recompute;
  m.largest_param = v * h;
  const auto mlp = mlp_cost(c);
  for (int64_t i = 0; i < c.layers; ++i) {
    const auto mix = mixer_cost(c, layer_mixer(c, i));
    plan::ParamGroup unit;
    unit.tp_sharded = mix.params.tp_sharded + mlp.params.tp_sharded;
    unit.replicated = mix.params.replicated + mlp.params.replicated + 2 * h;  // + two RMSNorms
    unit.expert = mlp.params.expert;
    m.units.push_back(unit);
    // The heaviest layer type sets the per-layer figures (an upper bound for mixed stacks).
    m.layer_act_tp = std::max(m.layer_act_tp, mix.act_tp + mlp.act_tp);
    m.layer_act = std::max(m.layer_act, mix.act + mlp.act);
    m.q_per_token = std::max(m.q_per_token, mix.q);
    m.kv_per_token = std::max(m.kv_per_token, mix.kv);
    m.largest_param = std::max({m.largest_param, mix.largest, mlp.largest});
  }
  m.layer_input = h;
  return m;
}

}  // namespace hp::model
