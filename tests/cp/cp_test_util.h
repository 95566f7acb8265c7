// Shared pieces of the CP tests: seeded tensors, the single-process reference, and a small
// attention module with projections that reaches attention through its host's primitive call
// (what the *_hf adapters intercept).
#pragma once

#include <string>
#include <vector>

#include <ATen/ATen.h>

#include "hp/attention/host.h"
#include "hp/cp/apply.h"
#include "hp/cp/topology.h"

namespace hp::cp::testing {

inline at::Tensor seeded(uint64_t seed, at::IntArrayRef shape) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  return at::randn(shape, gen, at::kFloat);
}

// Contiguous shard r of P along dim.
inline at::Tensor shard(const at::Tensor& full, int64_t dim, int64_t r, int64_t p) {
  return full.chunk(p, dim)[r].contiguous();
}

// x [B, S_l, hidden] -> q/k/v projections -> attention via host.call_primitive -> wo.
class ProjAttention {
 public:
  ProjAttention(int64_t hidden, int64_t heads, int64_t kv_heads, int64_t head_dim,
                const attention::AttentionOptions& options)
      : heads_(heads),
        kv_heads_(kv_heads),
        head_dim_(head_dim),
        options_(options),
        host_("blockwise") {
    wq = (seeded(901, {hidden, heads * head_dim}) * 0.2).requires_grad_(true);
    wk = (seeded(902, {hidden, kv_heads * head_dim}) * 0.2).requires_grad_(true);
    wv = (seeded(903, {hidden, kv_heads * head_dim}) * 0.2).requires_grad_(true);
    wo = (seeded(904, {heads * head_dim, hidden}) * 0.2).requires_grad_(true);
  }

  at::Tensor forward(const at::Tensor& x) {
    auto scope = host_.forward_scope();
    const int64_t b = x.size(0), s = x.size(1);
    auto q = at::matmul(x, wq).view({b, s, heads_, head_dim_}).transpose(1, 2);
    auto k = at::matmul(x, wk).view({b, s, kv_heads_, head_dim_}).transpose(1, 2);
    auto v = at::matmul(x, wv).view({b, s, kv_heads_, head_dim_}).transpose(1, 2);
    auto out = reach_primitive_ ? host_.call_primitive(q, k, v, options_).out : q;
    auto y = at::matmul(out.transpose(1, 2).reshape({b, s, heads_ * head_dim_}), wo);
    scope.end();
    return y;
  }

  attention::AttentionHost& host() { return host_; }
  void set_reach_primitive(bool on) { reach_primitive_ = on; }  // misfire tests
  std::vector<at::Tensor> params() const { return {wq, wk, wv, wo}; }

  at::Tensor wq, wk, wv, wo;

 private:
  int64_t heads_, kv_heads_, head_dim_;
  attention::AttentionOptions options_;
  attention::AttentionHost host_;
  bool reach_primitive_ = true;
};

// Swallows apply log lines in tests.
inline CPApplyOptions quiet() {
  CPApplyOptions o;
  o.log = [](const std::string&) {};
  return o;
}

}  // namespace hp::cp::testing
