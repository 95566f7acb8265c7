#include "hp/model/mla.h"

#include <cmath>

#include <ATen/ATen.h>

#include "hp/common/check.h"
#include "hp/model/qwen3.h"

namespace hp::model {
namespace {

at::Tensor seeded(uint64_t seed, at::IntArrayRef shape, double std) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  return at::randn(shape, gen, at::kFloat) * std;
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  return x * at::rsqrt(x.pow(2).mean(-1, /*keepdim=*/true) + eps) * weight;
}

}  // namespace

void validate(const MLAConfig& c) {
  HP_CHECK(c.hidden > 0 && c.heads > 0 && c.q_rank > 0 && c.kv_rank > 0 && c.d_nope > 0 &&
               c.d_rope > 0 && c.d_v > 0,
           "MLAConfig: every size must be positive (hidden=", c.hidden, " heads=", c.heads,
           " q_rank=", c.q_rank, " kv_rank=", c.kv_rank, " d_nope=", c.d_nope, " d_rope=", c.d_rope,
           " d_v=", c.d_v, ")");
  HP_CHECK(c.d_rope % 2 == 0, "MLAConfig.d_rope=", c.d_rope, " must be even for RoPE");
  if (c.sparse) {
    HP_CHECK(c.index_heads > 0 && c.index_dim > 0, "MLAConfig: index_heads=", c.index_heads,
             " and index_dim=", c.index_dim, " must be positive");
    attention::DSAOptions o;
    o.topk = c.topk;
    o.loss = c.index_loss;
    o.check("MLAConfig (sparse)");
  }
}

int64_t mla_parameter_count(const MLAConfig& c) {
  const int64_t dq = c.d_nope + c.d_rope;
  const int64_t indexer =
      c.sparse ? c.index_heads * c.index_dim * c.q_rank + (c.index_dim + c.index_heads) * c.hidden
               : 0;
  return c.q_rank * c.hidden + c.q_rank + c.heads * dq * c.q_rank + c.kv_rank * c.hidden +
         c.kv_rank + c.d_rope * c.hidden + c.heads * (c.d_nope + c.d_v) * c.kv_rank +
         c.hidden * c.heads * c.d_v + indexer;
}

MLAAttentionImpl::MLAAttentionImpl(const MLAConfig& c, int64_t layer)
    : config_(c), host_(c.primitive) {
  validate(c);
  const uint64_t base = c.seed * 1000003ULL + static_cast<uint64_t>(layer) * 131ULL + 17;
  auto fan_in = [](int64_t n) { return 1.0 / std::sqrt(static_cast<double>(n)); };
  const int64_t dq = c.d_nope + c.d_rope;
  w_dq = register_parameter("w_dq", seeded(base + 1, {c.q_rank, c.hidden}, fan_in(c.hidden)));
  q_norm = register_parameter("q_norm", at::ones({c.q_rank}));
  w_uq = register_parameter("w_uq", seeded(base + 2, {c.heads * dq, c.q_rank}, fan_in(c.q_rank)));
  w_dkv = register_parameter("w_dkv", seeded(base + 3, {c.kv_rank, c.hidden}, fan_in(c.hidden)));
  kv_norm = register_parameter("kv_norm", at::ones({c.kv_rank}));
  w_kr = register_parameter("w_kr", seeded(base + 4, {c.d_rope, c.hidden}, fan_in(c.hidden)));
  w_ukv = register_parameter(
      "w_ukv", seeded(base + 5, {c.heads * (c.d_nope + c.d_v), c.kv_rank}, fan_in(c.kv_rank)));
  w_o = register_parameter("w_o",
                           seeded(base + 6, {c.hidden, c.heads * c.d_v}, fan_in(c.heads * c.d_v)));
  if (c.sparse) {
    w_iq = register_parameter(
        "w_iq", seeded(base + 7, {c.index_heads * c.index_dim, c.q_rank}, fan_in(c.q_rank)));
    w_ik = register_parameter("w_ik", seeded(base + 8, {c.index_dim, c.hidden}, fan_in(c.hidden)));
    w_iw =
        register_parameter("w_iw", seeded(base + 9, {c.index_heads, c.hidden}, fan_in(c.hidden)));
  }
}

attention::MLAShape MLAAttentionImpl::shape() const {
  attention::MLAShape s;
  s.heads = config_.heads;
  s.d_nope = config_.d_nope;
  s.d_rope = config_.d_rope;
  s.d_v = config_.d_v;
  s.kv_rank = config_.kv_rank;
  return s;
}

at::Tensor MLAAttentionImpl::queries(const at::Tensor& x, const at::Tensor& position_ids) const {
  const auto& c = config_;
  const int64_t b = x.size(0), s = x.size(1), dq = c.d_nope + c.d_rope;
  auto q = at::matmul(rms_norm(at::matmul(x, w_dq.t()), q_norm, c.rms_eps), w_uq.t())
               .view({b, s, c.heads, dq});
  auto rope =
      apply_rope(q.narrow(-1, c.d_nope, c.d_rope).transpose(1, 2), position_ids, c.rope_theta)
          .transpose(1, 2);
  return at::cat({q.narrow(-1, 0, c.d_nope), rope}, -1);
}

void MLAAttentionImpl::latent_and_rope(const at::Tensor& x, const at::Tensor& position_ids,
                                       at::Tensor& latent, at::Tensor& k_rope) const {
  const auto& c = config_;
  latent = rms_norm(at::matmul(x, w_dkv.t()), kv_norm, c.rms_eps);
  k_rope = apply_rope(at::matmul(x, w_kr.t()).unsqueeze(1), position_ids, c.rope_theta).squeeze(1);
}

at::Tensor MLAAttentionImpl::forward(const at::Tensor& x, const at::Tensor& position_ids,
                                     const at::Tensor& doc_ids) {
  HP_CHECK(x.dim() == 3 && x.size(2) == config_.hidden, "MLA layer: x ", x.sizes(),
           " must be [B, S, hidden=", config_.hidden, "]");
  HP_CHECK(!config_.sparse || !doc_ids.defined(),
           "MLA layer (sparse, DSA): packed documents are not supported by the DSA indexer "
           "yet; train DSA layers without --pack-documents or use --mixer mla");
  at::Tensor latent, k_rope;
  latent_and_rope(x, position_ids, latent, k_rope);
  if (config_.sparse) return forward_sparse(x, position_ids, latent, k_rope);
  auto o = host_.attend([&] { return queries(x, position_ids); }, latent, k_rope, w_ukv, shape(),
                        doc_ids);
  return at::matmul(o.flatten(2), w_o.t());
}

at::Tensor MLAAttentionImpl::forward_sparse(const at::Tensor& x, const at::Tensor& position_ids,
                                            const at::Tensor& latent, const at::Tensor& k_rope) {
  const auto& c = config_;
  const int64_t b = x.size(0), s = x.size(1);
  // The indexer reads detached inputs: only its loss trains it, and it trains nothing else.
  auto xd = x.detach();
  auto index_k = at::matmul(xd, w_ik.t());
  attention::DSAOptions o;
  o.topk = c.topk;
  o.loss = c.index_loss;
  // The keys first (the latent, k_rope, the index keys): the host computes the queries after
  // handing them over, so async CP gathers them while these projections run.
  auto project = [&] {
    auto c_q = rms_norm(at::matmul(xd, w_dq.t().detach()), q_norm.detach(), c.rms_eps);
    return attention::DSAQueries{
        queries(x, position_ids),
        at::matmul(c_q, w_iq.t()).view({b, s, c.index_heads, c.index_dim}),
        at::matmul(xd, w_iw.t()) / std::sqrt(static_cast<double>(c.index_heads))};
  };
  auto res = dsa_host_.attend(project, latent, k_rope, w_ukv, shape(), index_k, o);
  index_loss_ = res.loss;
  return at::matmul(res.out.flatten(2), w_o.t());
}

}  // namespace hp::model
