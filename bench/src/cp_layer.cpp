#include "hp/bench/cp_layer.h"

#include <cmath>

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
      : primitive_style_(primitive_style), bshd_(o.bshd), core_(core_options(o)) {
    for (auto* h : {&q_handoff_, &k_handoff_, &v_handoff_})
      core_.host().add_handoff(h);
    if (o.projections) {
      const int64_t hidden = o.heads * o.head_dim;
      auto gen = at::make_generator<at::CPUGeneratorImpl>(77);
      auto w = [&](int64_t in, int64_t out) {
        return (at::randn({in, out}, gen, at::kFloat) / std::sqrt(static_cast<double>(in)))
            .requires_grad_(true);
      };
      wq_ = w(hidden, o.heads * o.head_dim);
      wk_ = w(hidden, o.kv_heads * o.head_dim);
      wv_ = w(hidden, o.kv_heads * o.head_dim);
      wo_ = w(o.heads * o.head_dim, hidden);
      heads_ = o.heads;
      kv_heads_ = o.kv_heads;
      head_dim_ = o.head_dim;
    }
  }

  // q, k, v in the caller's layout; each passes its handoff point right before attention.
  at::Tensor forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
    auto& host = core_.host();
    auto scope = host.forward_scope();         // before the handoffs and the announcement
    host.announce(core_.options().attention);  // async CP may skip moves the documents hide
    at::Tensor out;
    if (primitive_style_) {
      auto t = [&](const at::Tensor& x) { return bshd_ ? x.transpose(1, 2) : x; };
      out = t(host.call_primitive(q_handoff_(t(q)), k_handoff_(t(k)), v_handoff_(t(v)),
                                  core_.options().attention)
                  .out);
    } else {
      out = core_.forward(q_handoff_(q), k_handoff_(k), v_handoff_(v));
    }
    scope.end();
    return out;
  }

  // x [B, S_local, hidden] -> Q/K/V projections -> attention -> output projection. The K and V
  // projections run while Q's (and K's) collectives are in flight under the async schedule.
  at::Tensor forward_block(const at::Tensor& x) {
    const int64_t b = x.size(0), s = x.size(1);
    auto heads = [&](const at::Tensor& t, int64_t n) {
      return t.view({b, s, n, head_dim_}).transpose(1, 2);
    };
    auto& host = core_.host();
    auto scope = host.forward_scope();
    host.announce(core_.options().attention);  // before the projections
    auto q = q_handoff_(heads(at::matmul(x, wq_), heads_));
    auto k = k_handoff_(heads(at::matmul(x, wk_), kv_heads_));
    auto v = v_handoff_(heads(at::matmul(x, wv_), kv_heads_));
    auto out = primitive_style_ ? host.call_primitive(q, k, v, core_.options().attention).out
                                : core_.forward(q, k, v);
    auto y = at::matmul(out.transpose(1, 2).reshape({b, s, heads_ * head_dim_}), wo_);
    scope.end();
    return y;
  }

  attention::AttentionHost& host() { return core_.host(); }

 private:
  static attention::CoreAttentionOptions core_options(const CPLayerOptions& o) {
    attention::CoreAttentionOptions c;
    c.attention.causal = o.causal;
    if (o.doc_ids.defined()) c.attention.documents = attention::Documents{o.doc_ids};
    c.primitive = o.primitive;
    if (o.bshd) {
      c.seq_dim = 1;
      c.heads_dim = 2;
    }
    return c;
  }
  bool primitive_style_;
  bool bshd_;
  attention::CoreAttention core_;
  attention::HandoffPoint q_handoff_{"q_handoff"}, k_handoff_{"k_handoff"}, v_handoff_{"v_handoff"};
  at::Tensor wq_, wk_, wv_, wo_;
  int64_t heads_ = 0, kv_heads_ = 0, head_dim_ = 0;
};

CPAttentionLayer::CPAttentionLayer(const comm::World& world, const comm::GroupPtr& cp_group,
                                   const CPLayerOptions& o) {
  const bool primitive_style = o.adapter.find("_hf") != std::string::npos;
  module_ = std::make_unique<Module>(o, primitive_style);
  spec_.module_path = "attention";
  spec_.inner_wrapper = o.adapter;
  spec_.cp_handoff_targets = {{"q", "q_handoff"}, {"k", "k_handoff"}, {"v", "v_handoff"}};
  HP_CHECK(!o.projections || !o.bshd, "CP layer: projections use the BNSD layout");
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

at::Tensor CPAttentionLayer::run_block(const at::Tensor& x, const at::Tensor& dy) {
  auto x1 = x.detach().requires_grad_(true);
  auto y = module_->forward_block(x1);
  torch::autograd::backward({y}, {dy});
  return x1.grad();
}

}  // namespace hp::bench
