// The async CP tests' block: x -> q/k/v projections -> RMS-style norm on q and k -> handoff
// points -> attention -> wo, with the CP spec that names its handoffs and a config maker (used
// by cp_async_test.cpp and cp_async_overlap_test.cpp).
#pragma once

#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <ATen/ATen.h>

#include "cp_test_util.h"
#include "hp/attention/core_attention.h"
#include "hp/common/check.h"
#include "hp/common/trace.h"
#include "hp/cp/apply.h"
#include "hp/cp/config.h"

namespace hp::cp::async_testing {

using hp::cp::testing::seeded;

constexpr int64_t kHidden = 32, kNq = 4, kNkv = 4, kD = 8, kS = 32;

// x -> q/k/v projections -> RMS-style norm on q, k -> handoff points -> attention -> wo.
// With `qkv_style` attention is a CoreAttention (boundary slot), else the primitive call.
class BlockWithHandoffs {
 public:
  BlockWithHandoffs(bool qkv_style, std::shared_ptr<common::Tracer> tracer = nullptr)
      : qkv_style_(qkv_style), tracer_(std::move(tracer)), core_(core_options()) {
    wq = (seeded(901, {kHidden, kNq * kD}) * 0.2).requires_grad_(true);
    wk = (seeded(902, {kHidden, kNkv * kD}) * 0.2).requires_grad_(true);
    wv = (seeded(903, {kHidden, kNkv * kD}) * 0.2).requires_grad_(true);
    wo = (seeded(904, {kNq * kD, kHidden}) * 0.2).requires_grad_(true);
    for (auto* h : {&q_handoff, &k_handoff, &v_handoff})
      core_.host().add_handoff(h);
  }

  at::Tensor forward(const at::Tensor& x) {
    auto& host = core_.host();
    std::optional<attention::AttentionHost::ForwardScope> scope;
    if (scoped_) scope.emplace(host.forward_scope());
    if (announce_) host.announce(*announce_);
    const int64_t b = x.size(0), s = x.size(1);
    auto heads = [&](const at::Tensor& t, int64_t n) {
      return t.view({b, s, n, kD}).transpose(1, 2);
    };
    auto norm = [](const at::Tensor& t) { return t * at::rsqrt(t.pow(2).mean(-1, true) + 1e-6); };
    auto q = q_handoff(norm(heads(at::matmul(x, wq), kNq)));
    auto k = k_handoff(norm(heads(at::matmul(x, wk), kNkv)));
    HP_CHECK(fail_ != Fail::kAfterK, "injected failure after k's handoff");
    const int64_t t0 = common::Tracer::now_us();
    auto vp = at::matmul(x, wv);  // compute while K's collective is in flight
    if (tracer_) tracer_->record({"v_proj", "compute", 0, t0, common::Tracer::now_us(), "", -1});
    if (transform_after_handoff_) k = k * 1.0;
    auto v = v_handoff(heads(vp, kNkv));
    if (pause_before_attention_ms_ > 0) {
      std::this_thread::sleep_for(std::chrono::milliseconds(pause_before_attention_ms_));
    }
    HP_CHECK(fail_ != Fail::kBeforeAttention, "injected failure");
    at::Tensor out;
    if (skip_attention_) {
      out = q;
    } else if (qkv_style_) {
      out = core_.forward(q, k, v);
    } else {
      out = host.call_primitive(q, k, v, core_.options().attention).out;
    }
    auto y = at::matmul(out.transpose(1, 2).reshape({b, s, kNq * kD}), wo);
    if (scope) scope->end();
    return y;
  }

  attention::AttentionHost& host() { return core_.host(); }
  std::vector<at::Tensor> params() const { return {wq, wk, wv, wo}; }
  // Where the forward throws (a failure on every rank at the same point of the program).
  enum class Fail { kNone, kAfterK, kBeforeAttention };
  Fail fail_ = Fail::kNone;
  bool scoped_ = true;  // the forward opens AttentionHost::forward_scope
  std::optional<attention::AttentionOptions> announce_;  // announced after the scope opens
  void zero_grad() {
    for (auto& p : params()) {
      if (p.grad().defined()) p.mutable_grad().zero_();
    }
  }
  bool skip_attention_ = false;
  bool transform_after_handoff_ = false;
  int pause_before_attention_ms_ = 0;  // after the handoffs: the collectives land meanwhile
  at::Tensor wq, wk, wv, wo;
  attention::HandoffPoint q_handoff{"q_handoff"}, k_handoff{"k_handoff"}, v_handoff{"v_handoff"};

 private:
  static attention::CoreAttentionOptions core_options() {
    attention::CoreAttentionOptions o;
    o.attention.causal = true;
    o.attention.block_q = 4;
    o.attention.block_kv = 4;
    return o;
  }
  bool qkv_style_;
  std::shared_ptr<common::Tracer> tracer_;
  attention::CoreAttention core_;
};

inline CPModuleSpec spec_for(const std::string& adapter) {
  CPModuleSpec s;
  s.module_path = "block.attn";
  s.inner_wrapper = adapter;
  s.cp_handoff_targets = {{"q", "q_handoff"}, {"k", "k_handoff"}, {"v", "v_handoff"}};
  return s;
}

inline ContextParallelConfig make(const std::string& algo, int64_t p, CPSchedule schedule) {
  ContextParallelConfig c;
  c.algorithm = parse_algorithm(algo);
  if (c.algorithm == CPAlgorithm::kHybrid) c.ulysses_degree = 2;
  c.schedule = schedule;
  return *normalize(c, p);
}

}  // namespace hp::cp::async_testing
