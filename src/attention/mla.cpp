#include "hp/attention/mla.h"

#include <cmath>

#include <ATen/ATen.h>

#include "hp/common/check.h"

namespace hp::attention {

void MLAShape::check(const std::string& who) const {
  HP_CHECK(heads > 0 && d_nope > 0 && d_rope > 0 && d_v > 0 && kv_rank > 0, who,
           ": MLA sizes must be positive, got heads=", heads, " d_nope=", d_nope,
           " d_rope=", d_rope, " d_v=", d_v, " kv_rank=", kv_rank);
}

MLAShape MLAShape::of(const at::Tensor& q, const at::Tensor& latent, const at::Tensor& k_rope,
                      const at::Tensor& w_ukv, int64_t d_v, const std::string& who) {
  HP_CHECK(q.defined() && latent.defined() && k_rope.defined() && w_ukv.defined(), who,
           ": q, latent, k_rope and w_ukv are all required");
  HP_CHECK(q.dim() == 4, who, ": q ", q.sizes(), " must be [B, S, H, d_nope + d_rope] (BSHD)");
  HP_CHECK(latent.dim() == 3 && latent.size(0) == q.size(0), who, ": latent ", latent.sizes(),
           " must be [B=", q.size(0), ", S, kv_rank]");
  HP_CHECK(k_rope.dim() == 3 && k_rope.size(0) == q.size(0) && k_rope.size(1) == latent.size(1),
           who, ": k_rope ", k_rope.sizes(), " must be [B=", q.size(0), ", S=", latent.size(1),
           ", d_rope]");
  MLAShape s;
  s.heads = q.size(2);
  s.d_rope = k_rope.size(2);
  s.d_nope = q.size(3) - s.d_rope;
  s.d_v = d_v;
  s.kv_rank = latent.size(2);
  HP_CHECK(s.d_nope > 0, who, ": q's last dim ", q.size(3), " must exceed d_rope=", s.d_rope,
           " (q = [q_nope | q_rope])");
  HP_CHECK(w_ukv.dim() == 2 && w_ukv.size(1) == s.kv_rank && w_ukv.size(0) % s.heads == 0 &&
               w_ukv.size(0) / s.heads > s.d_nope,
           who, ": w_ukv ", w_ukv.sizes(), " must be [H * (d_nope + d_v), kv_rank] = [", s.heads,
           " * (", s.d_nope, " + d_v), ", s.kv_rank, "]");
  if (s.d_v <= 0) s.d_v = w_ukv.size(0) / s.heads - s.d_nope;
  HP_CHECK(w_ukv.size(0) == s.heads * (s.d_nope + s.d_v), who, ": w_ukv has ", w_ukv.size(0),
           " rows; H * (d_nope + d_v) = ", s.heads * (s.d_nope + s.d_v));
  s.check(who);
  return s;
}

MLAKeys mla_expand(const at::Tensor& latent, const at::Tensor& k_rope, const at::Tensor& w_ukv,
                   const MLAShape& shape, int64_t first_head, int64_t num_heads) {
  const int64_t per_head = shape.d_nope + shape.d_v;
  const int64_t b = latent.size(0), s = latent.size(1);
  auto w = w_ukv.narrow(0, first_head * per_head, num_heads * per_head);
  auto kv = at::matmul(latent, w.t()).view({b, s, num_heads, per_head}).transpose(1, 2);
  auto k_nope = kv.narrow(-1, 0, shape.d_nope);
  auto rope = k_rope.unsqueeze(1).expand({b, num_heads, s, shape.d_rope});
  return {at::cat({k_nope, rope}, -1), kv.narrow(-1, shape.d_nope, shape.d_v)};
}

AttentionResult mla_attend(const at::Tensor& q, const MLAKeys& keys, const MLAShape& shape,
                           bool causal, int64_t q_offset, const AttentionPrimitive& primitive,
                           const std::optional<Documents>& documents) {
  AttentionOptions o;
  o.documents = documents;
  o.causal = causal;
  if (causal) o.causal_meta = CausalMetadata{q_offset, -1, -1};
  o.scale = 1.0 / std::sqrt(static_cast<double>(shape.qk_dim()));
  return primitive.forward(q.transpose(1, 2), keys.k, keys.v, o);
}

at::Tensor mla_attention(const at::Tensor& q, const at::Tensor& latent, const at::Tensor& k_rope,
                         const at::Tensor& w_ukv, const MLAShape& shape,
                         const std::string& primitive, const at::Tensor& doc_ids) {
  auto keys = mla_expand(latent, k_rope, w_ukv, shape, 0, shape.heads);
  std::optional<Documents> docs;
  if (doc_ids.defined()) docs = Documents{doc_ids};
  auto res = mla_attend(q, keys, shape, true, 0, AttentionRegistry::builtin().get(primitive), docs);
  return res.out.transpose(1, 2);
}

void MLAHost::install(std::shared_ptr<MLAInterceptor> interceptor) {
  HP_CHECK(interceptor != nullptr, "MLAHost::install: interceptor is null");
  if (interceptor_) {
    HP_CHECK(interceptor_->id() == interceptor->id(),
             "a different CP strategy is already installed on this MLA layer: installed '",
             interceptor_->id(), "', new '", interceptor->id(),
             "'. Apply context parallelism once per layer (re-applying the same plan is fine)");
    return;
  }
  interceptor_ = std::move(interceptor);
}

at::Tensor MLAHost::attend(const MLAQueries& queries, const at::Tensor& latent,
                           const at::Tensor& k_rope, const at::Tensor& w_ukv, const MLAShape& shape,
                           const at::Tensor& doc_ids) {
  if (interceptor_) return interceptor_->attend(queries, latent, k_rope, w_ukv, shape, doc_ids);
  return mla_attention(queries(), latent, k_rope, w_ukv, shape, primitive_, doc_ids);
}

}  // namespace hp::attention
