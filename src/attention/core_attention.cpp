#include "hp/attention/core_attention.h"

#include <ATen/ATen.h>

#include "hp/common/check.h"

namespace hp::attention {

CoreAttention::CoreAttention(CoreAttentionOptions options)
    : options_(std::move(options)), host_(options_.primitive) {
  const bool bnsd = options_.seq_dim == 2 && options_.heads_dim == 1;
  const bool bshd = options_.seq_dim == 1 && options_.heads_dim == 2;
  HP_CHECK(bnsd || bshd, "CoreAttention: seq_dim=", options_.seq_dim,
           " heads_dim=", options_.heads_dim, " is neither BNSD (2, 1) nor BSHD (1, 2)");
}

at::Tensor CoreAttention::forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  return forward(q, k, v, options_.attention);
}

at::Tensor CoreAttention::forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                  const AttentionOptions& options) {
  const bool bshd = options_.seq_dim == 1;
  AttentionFn inner = [this, bshd](const at::Tensor& q2, const at::Tensor& k2, const at::Tensor& v2,
                                   const AttentionOptions& o) {
    if (!bshd) return host_.call_primitive(q2, k2, v2, o);
    auto r = host_.call_primitive(q2.transpose(1, 2), k2.transpose(1, 2), v2.transpose(1, 2), o);
    return AttentionResult{r.out.transpose(1, 2), r.lse};
  };
  // From the primitive's statistics only where `inner` reaches the primitive itself: an
  // interceptor in the primitive-call slot would be bypassed.
  StatsBackwardFn from_stats;
  auto direct = host_.installed(AttentionHost::Slot::kPrimitiveCall) == nullptr
                    ? host_.primitive_stats_backward()
                    : nullptr;
  if (direct) {
    from_stats = [direct, bshd](const at::Tensor& q2, const at::Tensor& k2, const at::Tensor& v2,
                                const at::Tensor& o2, const at::Tensor& lse, const at::Tensor& d2,
                                const AttentionOptions& o) {
      if (!bshd) return direct(q2, k2, v2, o2, lse, d2, o);
      auto t = [](const at::Tensor& x) { return x.transpose(1, 2); };
      auto g = direct(t(q2), t(k2), t(v2), t(o2), lse, t(d2), o);
      return AttentionGrads{t(g.dq), t(g.dk), t(g.dv)};
    };
  }
  return host_.run_boundary(q, k, v, options, inner, from_stats).out;
}

}  // namespace hp::attention
