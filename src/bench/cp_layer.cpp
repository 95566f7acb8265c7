#include "hp/bench/cp_layer.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/autograd.h>

#include "hp/common/check.h"
#include "hp/cp/topology.h"

namespace hp::bench {

// A core-attention module for the *_qkv adapters, or a module that reaches the primitive from
// inside its forward (BNSD, like SDPA) for the *_hf adapters.
class CPAttentionLayer::Module {
 public:
  Module(const CPLayerOptions& o, bool primitive_style)
      : primitive_style_(primitive_style), bshd_(o.bshd), core_(core_options(o)) {}

  at::Tensor forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
    if (!primitive_style_) return core_.forward(q, k, v);
    auto& host = core_.host();
    auto scope = host.forward_scope();
    auto t = [&](const at::Tensor& x) { return bshd_ ? x.transpose(1, 2) : x; };
    auto out = t(host.call_primitive(t(q), t(k), t(v), core_.options().attention).out);
    scope.end();
    return out;
  }
  attention::AttentionHost& host() { return core_.host(); }

 private:
  static attention::CoreAttentionOptions core_options(const CPLayerOptions& o) {
    attention::CoreAttentionOptions c;
    c.attention.causal = o.causal;
    c.primitive = o.primitive;
    if (o.bshd) {
      c.seq_dim = 1;
      c.head_dim = 2;
    }
    return c;
  }
  bool primitive_style_;
  bool bshd_;
  attention::CoreAttention core_;
};

CPAttentionLayer::CPAttentionLayer(const comm::World& world, const comm::GroupPtr& cp_group,
                                   const CPLayerOptions& o) {
  const bool primitive_style = o.adapter.find("_hf") != std::string::npos;
  module_ = std::make_unique<Module>(o, primitive_style);
  spec_.module_path = "attention";
  spec_.inner_wrapper = o.adapter;
  // The *_hf adapters see the primitive's BNSD tensors whatever the caller's layout.
  if (o.bshd && !primitive_style) {
    spec_.cp_seq_dim = 1;
    spec_.cp_head_dim = 2;
  }
  auto topology = cp::CPTopology::build(world, cp_group, o.config);
  cp::CPApplyOptions ao;
  ao.log = [this](const std::string& line) { log_ = line; };
  cp::apply_context_parallel(module_->host(), spec_, o.config, topology, ao);
}

CPAttentionLayer::~CPAttentionLayer() = default;

CPLayerResult CPAttentionLayer::run(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                    const at::Tensor& dout) {
  auto q1 = q.detach().requires_grad_(true);
  auto k1 = k.detach().requires_grad_(true);
  auto v1 = v.detach().requires_grad_(true);
  auto out = module_->forward(q1, k1, v1);
  torch::autograd::backward({out}, {dout});
  return {out.detach(), q1.grad(), k1.grad(), v1.grad()};
}

}  // namespace hp::bench
