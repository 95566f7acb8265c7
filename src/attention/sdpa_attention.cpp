// `sdpa`: LibTorch's at::scaled_dot_product_attention (LibTorch >= 2), registered only where
// the found LibTorch has it (compat::kHasSdpa). It returns no lse, so the lse is recomputed
// with one pass of scores per 512-row query block (no [Sq, Skv] tensor). GQA: Nq must equal
// Nkv here (older LibTorch 2.x sdpa has no GQA mapping and we never repeat K/V). v may have its
// own last dim Dv (out [B, N, Sq, Dv]; at::scaled_dot_product_attention allows it); the lse
// needs only q and k.
#include <limits>

#include <ATen/ATen.h>

#include "hp/attention/attention.h"
#include "hp/common/check.h"
#include "hp/common/torch_compat.h"
#include "problem.h"

namespace hp::attention {
namespace {

class SdpaAttention final : public AttentionPrimitive {
 public:
  std::string name() const override { return "sdpa"; }

  AttentionResult forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                          const AttentionOptions& options) const override {
    auto p = detail::validate(q, k, v, options, "attention 'sdpa'");
    HP_CHECK(p.group == 1, "attention 'sdpa': Nq=", p.q_heads, " != Nkv=", p.kv_heads,
             "; use the 'blockwise' primitive for GQA/MQA");
    HP_CHECK(!p.mask_fn, "attention 'sdpa' takes no mask_fn; use 'blockwise' for flex masks");
    HP_CHECK(!p.docs,
             "attention 'sdpa' takes no documents (packed sequences); use 'blockwise', "
             "which skips the tiles no document spans");
    HP_CHECK(!p.causal || p.q_offset == 0, "attention 'sdpa': causal q_offset=", p.q_offset,
             " is not supported; use 'blockwise' under context parallelism");
    // One bool/additive mask carrying every rule, so sdpa and the lse agree exactly.
    at::Tensor mask = p.mask;
    if (p.causal) {
      auto causal = at::ones({p.q_len, p.kv_len}, at::kBool).tril();
      if (!mask.defined()) {
        mask = causal;
      } else if (p.mask_is_bool) {
        mask = at::logical_and(mask, causal);
      } else {
        mask = mask.masked_fill(causal.logical_not(), -std::numeric_limits<double>::infinity());
      }
    }
    auto out = compat::sdpa(q, k, v, mask, p.scale);
    auto scores = at::matmul(q.to(p.compute_dtype), k.to(p.compute_dtype).transpose(-2, -1));
    scores.mul_(p.scale);
    if (mask.defined()) {
      if (mask.scalar_type() == at::kBool) {
        scores.masked_fill_(mask.logical_not(), -std::numeric_limits<double>::infinity());
      } else {
        scores.add_(mask);
      }
    }
    auto lse = at::logsumexp(scores, -1).detach();
    return {out, lse};
  }
};

}  // namespace

std::unique_ptr<AttentionPrimitive> make_sdpa_attention() {
  return std::make_unique<SdpaAttention>();
}

}  // namespace hp::attention
