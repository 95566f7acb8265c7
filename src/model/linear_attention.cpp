#include "hp/model/linear_attention.h"

#include <cmath>

#include <ATen/ATen.h>

#include "hp/attention/delta_rule.h"
#include "hp/common/check.h"

namespace hp::model {
namespace {

at::Tensor seeded(uint64_t seed, at::IntArrayRef shape, double std) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  return at::randn(shape, gen, at::kFloat) * std;
}

at::Tensor l2_normalize(const at::Tensor& x) {
  return x * at::rsqrt(x.pow(2).sum(-1, /*keepdim=*/true) + 1e-6);
}

}  // namespace

void validate(const LinearAttentionConfig& c) {
  HP_CHECK(c.mixer == "gdn" || c.mixer == "kda", "LinearAttentionConfig.mixer='", c.mixer,
           "' is not valid; valid: gdn, kda");
  HP_CHECK(c.hidden > 0 && c.heads > 0 && c.value_heads > 0 && c.key_dim > 0 && c.value_dim > 0 &&
               c.gate_rank > 0 && c.chunk_size > 0,
           "LinearAttentionConfig: every size must be positive");
  HP_CHECK(c.value_heads % c.heads == 0, "LinearAttentionConfig.value_heads=", c.value_heads,
           " must be a multiple of heads=", c.heads, " (GVA)");
  HP_CHECK(c.conv_width >= 1, "LinearAttentionConfig.conv_width=", c.conv_width, " must be >= 1");
}

LinearAttentionImpl::LinearAttentionImpl(const LinearAttentionConfig& c, int64_t layer)
    : config_(c),
      mixer_(c.mixer == "kda" ? attention::make_kimi_delta_attention(c.kernel)
                              : attention::make_gated_delta_net(c.kernel)) {
  validate(c);
  const uint64_t base = c.seed * 1000003ULL + static_cast<uint64_t>(layer) * 101ULL;
  const double in_std = 1.0 / std::sqrt(static_cast<double>(c.hidden));
  const int64_t hv = c.value_heads;
  w_qkv = register_parameter("w_qkv", seeded(base + 1, {qkv_channels(), c.hidden}, in_std));
  w_beta = register_parameter("w_beta", seeded(base + 2, {hv, c.hidden}, in_std));
  if (c.mixer == "kda") {
    w_gate_a = register_parameter("w_gate_a", seeded(base + 3, {c.gate_rank, c.hidden}, in_std));
    w_gate_b = register_parameter("w_gate_b", seeded(base + 4, {hv * c.key_dim, c.gate_rank},
                                                     1.0 / std::sqrt(double(c.gate_rank))));
  } else {
    w_gate_a = register_parameter("w_gate_a", seeded(base + 3, {hv, c.hidden}, in_std));
  }
  w_out_gate =
      register_parameter("w_out_gate", seeded(base + 5, {hv * c.value_dim, c.hidden}, in_std));
  w_out = register_parameter("w_out", seeded(base + 6, {c.hidden, hv * c.value_dim},
                                             1.0 / std::sqrt(double(hv * c.value_dim))));
  conv_weight = register_parameter("conv_weight", seeded(base + 7, {qkv_channels(), c.conv_width},
                                                         1.0 / std::sqrt(double(c.conv_width))));
  // Decay rates between 1 and 16 (A_log) and time steps in [1e-3, 1e-1] (dt_bias, through the
  // inverse softplus), as the reference implementations initialise them.
  auto gen = at::make_generator<at::CPUGeneratorImpl>(base + 8);
  a_log = register_parameter("a_log", at::log(at::rand({hv}, gen) * 15 + 1));
  const int64_t gates = c.mixer == "kda" ? hv * c.key_dim : hv;
  auto dt = at::exp(at::rand({gates}, gen) * (std::log(0.1) - std::log(1e-3)) + std::log(1e-3));
  dt_bias = register_parameter("dt_bias", dt + at::log(-at::expm1(-dt)));
  norm_weight = register_parameter("norm_weight", at::ones({c.value_dim}));
}

int64_t LinearAttentionImpl::qkv_channels() const {
  const auto& c = config_;
  return 2 * c.heads * c.key_dim + c.value_heads * c.value_dim;
}

at::Tensor LinearAttentionImpl::head_channels(int64_t h0, int64_t nh) const {
  const auto& c = config_;
  HP_CHECK(h0 >= 0 && nh >= 1 && h0 + nh <= c.heads, "linear attention: heads [", h0, ", ", h0 + nh,
           ") are outside the layer's ", c.heads, " q/k heads");
  const int64_t r = c.value_heads / c.heads, hk = c.heads * c.key_dim;
  auto opts = at::TensorOptions().dtype(at::kLong);
  return at::cat(
      {at::arange(h0 * c.key_dim, (h0 + nh) * c.key_dim, opts),
       at::arange(hk + h0 * c.key_dim, hk + (h0 + nh) * c.key_dim, opts),
       at::arange(2 * hk + h0 * r * c.value_dim, 2 * hk + (h0 + nh) * r * c.value_dim, opts)});
}

attention::LinearLayerShape LinearAttentionImpl::shape() const {
  const auto& c = config_;
  return {c.heads,     c.value_heads, c.key_dim,
          c.value_dim, c.conv_width,  c.mixer == "kda" ? c.key_dim : 1};
}

attention::LinearTokens LinearAttentionImpl::project(const at::Tensor& x) const {
  HP_CHECK(x.dim() == 3 && x.size(2) == config_.hidden, "linear attention: x ", x.sizes(),
           " must be [B, S, hidden=", config_.hidden, "]");
  attention::LinearTokens p;
  p.qkv = at::matmul(x, w_qkv.t());
  p.beta_logit = at::matmul(x, w_beta.t());
  p.gate_in = config_.mixer == "kda" ? at::matmul(at::matmul(x, w_gate_a.t()), w_gate_b.t())
                                     : at::matmul(x, w_gate_a.t());
  return p;
}

at::Tensor LinearAttentionImpl::project_out_gate(const at::Tensor& x) const {
  return at::matmul(x, w_out_gate.t());
}

at::Tensor LinearAttentionImpl::convolve(const at::Tensor& qkv, const at::Tensor& halo,
                                         const at::Tensor& channels, const at::Tensor& taps) const {
  const int64_t w = config_.conv_width, ch = qkv.size(2);
  auto weight = channels.defined() ? conv_weight.index_select(0, channels) : conv_weight;
  HP_CHECK(weight.size(0) == ch, "linear attention: qkv has ", ch, " channels, the conv ",
           weight.size(0));
  at::Tensor before = halo;
  if (!before.defined()) before = at::zeros({qkv.size(0), w - 1, ch}, qkv.options());
  HP_CHECK(before.dim() == 3 && before.size(1) == w - 1 && before.size(2) == ch,
           "linear attention: the conv halo ", before.sizes(), " must be [B, ", w - 1, ", ", ch,
           "]");
  if (taps.defined()) {  // packed documents: each row reads only its own document's inputs
    HP_CHECK(taps.dim() == 3 && taps.size(1) == qkv.size(1) && taps.size(2) == w &&
                 (taps.size(0) == 1 || taps.size(0) == qkv.size(0)),
             "linear attention: the conv taps ", taps.sizes(), " must be [B|1, ", qkv.size(1), ", ",
             w, "] (LinearDocuments::taps of these rows)");
    auto windows = at::cat({before, qkv}, 1).unfold(1, w, 1);  // [B, S, C, w], oldest first
    auto kept = taps.unsqueeze(2).to(windows.scalar_type());   // [B|1, S, 1, w]
    return at::silu((windows * kept * weight.unsqueeze(0).unsqueeze(0)).sum(-1));
  }
  auto seq = at::cat({before, qkv}, 1).transpose(1, 2);  // [B, C, w-1 + S]
  auto out = at::conv1d(seq, weight.unsqueeze(1), at::Tensor(), at::IntArrayRef{1},
                        at::IntArrayRef{0}, at::IntArrayRef{1}, ch);
  return at::silu(out.transpose(1, 2));
}

attention::MixerInputs LinearAttentionImpl::mixer_inputs(const at::Tensor& conv,
                                                         const at::Tensor& beta_logit,
                                                         const at::Tensor& gate_in,
                                                         int64_t first_head,
                                                         int64_t num_heads) const {
  const auto& c = config_;
  const int64_t nh = num_heads < 0 ? c.heads : num_heads, r = c.value_heads / c.heads;
  const int64_t nv = nh * r, b = conv.size(0), s = conv.size(1);
  const int64_t qk = nh * c.key_dim;
  attention::MixerInputs in;
  in.q = l2_normalize(conv.narrow(2, 0, qk).reshape({b, s, nh, c.key_dim}));
  in.k = l2_normalize(conv.narrow(2, qk, qk).reshape({b, s, nh, c.key_dim}));
  in.v = conv.narrow(2, 2 * qk, nv * c.value_dim).reshape({b, s, nv, c.value_dim});
  in.beta = at::sigmoid(beta_logit);
  auto decay_rate = at::exp(a_log.narrow(0, first_head * r, nv));
  if (c.mixer == "kda") {
    auto dt = dt_bias.narrow(0, first_head * r * c.key_dim, nv * c.key_dim);
    auto g =
        -decay_rate.unsqueeze(-1) * at::softplus((gate_in + dt).reshape({b, s, nv, c.key_dim}));
    in.g = at::clamp_min(g, attention::kMinLogGate);
  } else {
    auto g = -decay_rate * at::softplus(gate_in + dt_bias.narrow(0, first_head * r, nv));
    in.g = at::clamp_min(g, attention::kMinLogGate);
  }
  return in;
}

attention::MixerResult LinearAttentionImpl::mix(const attention::MixerInputs& in,
                                                bool output_final_state) const {
  attention::MixerOptions o;
  o.output_final_state = output_final_state;
  o.chunk_size = config_.chunk_size;
  return mixer_->forward(in, o);
}

void LinearAttentionImpl::state_summary(const attention::MixerInputs& in, at::Tensor& m,
                                        at::Tensor& s) const {
  attention::MixerOptions o;
  o.chunk_size = config_.chunk_size;
  attention::delta_rule_state_summary(in, o, mixer_->gate_kind(), m, s);
}

at::Tensor LinearAttentionImpl::output(const at::Tensor& mixed, const at::Tensor& out_gate) const {
  const auto& c = config_;
  auto normed =
      mixed * at::rsqrt(mixed.pow(2).mean(-1, /*keepdim=*/true) + c.rms_eps) * norm_weight;
  auto gate = out_gate.reshape(mixed.sizes());
  gate = c.mixer == "kda" ? at::sigmoid(gate) : at::silu(gate);
  auto flat = (normed * gate).flatten(2);  // [B, S, HV*V]
  return at::matmul(flat, w_out.t());
}

at::Tensor LinearAttentionImpl::forward(const at::Tensor& x, const at::Tensor& doc_ids) {
  return host_.forward(x, *this, doc_ids);
}

}  // namespace hp::model
