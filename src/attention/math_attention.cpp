// The reference primitive: explicit [B, Nkv, G*Sq, Skv] scores, fp32 softmax, LibTorch
// autograd for the backward. GQA by viewing q as [B, Nkv, G*Sq, Dqk] against k [B, Nkv, Skv, Dqk];
// probs [B, Nkv, G*Sq, Skv] @ v [B, Nkv, Skv, Dv] -> out [B, Nq, Sq, Dv].
#include <limits>

#include <ATen/ATen.h>

#include "hp/attention/attention.h"
#include "problem.h"

namespace hp::attention {
namespace {

class MathAttention final : public AttentionPrimitive {
 public:
  std::string name() const override { return "math"; }

  AttentionResult forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                          const AttentionOptions& options) const override {
    auto p = detail::validate(q, k, v, options, "attention 'math'");
    const auto in_dtype = q.scalar_type();
    const auto ct = p.compute_dtype;
    auto qg = q.to(ct).reshape({p.batch, p.kv_heads, p.group * p.q_len, p.qk_dim});
    auto scores = at::matmul(qg, k.to(ct).transpose(-2, -1)) * p.scale;
    if (p.q_len > 0 && p.kv_len > 0) {
      // One tile covering everything: the same masking code as the blockwise kernel.
      detail::TileMask tiles(p, p.q_len, p.kv_len);
      if (tiles.kind(0, 0) == detail::BlockKind::kEmpty) {
        scores = at::full_like(scores, -std::numeric_limits<double>::infinity());
      } else if (tiles.kind(0, 0) == detail::BlockKind::kPartial) {
        scores = scores.clone();
        tiles.apply(scores, 0, 0);
      }
    }
    // Rows with no visible key: softmax over zeros, then zeroed, so no NaN in out or grads.
    auto dead = scores.isneginf().all(-1, /*keepdim=*/true);
    auto safe = at::where(dead, at::zeros({}, scores.options()), scores);
    auto probs = at::where(dead, at::zeros({}, scores.options()), at::softmax(safe, -1));
    auto lse =
        at::where(dead, at::full({}, -std::numeric_limits<double>::infinity(), scores.options()),
                  at::logsumexp(safe, -1, /*keepdim=*/true));
    auto out = at::matmul(probs, v.to(ct));
    AttentionResult r;
    r.out = out.reshape({p.batch, p.q_heads, p.q_len, p.v_dim}).to(in_dtype);
    r.lse = lse.reshape({p.batch, p.q_heads, p.q_len});
    return r;
  }
};

}  // namespace

std::unique_ptr<AttentionPrimitive> make_math_attention() {
  return std::make_unique<MathAttention>();
}

}  // namespace hp::attention
