// One CP attention call:
//   validate(q, k, v)                      before any collective
//   prepared = strategy.prepare_qkv(...)   communication (differentiable)
//   options  = adapter.rewrite(...)        causal offsets / mask functions for the new shapes
//   K/V beyond the causal prefix are cut off (never computed, not masked)
//   out      = inner(prepared q, k, v)     the module's own attention
//   out      = strategy.restore_output(out)
#include "hp/cp/runtime.h"

#include "hp/common/check.h"
#include "hp/common/shape.h"
#include "hp/cp/config.h"
#include "overlap.h"

namespace hp::cp {
CPRuntime::CPRuntime(std::shared_ptr<const CPAdapter> adapter,
                     std::shared_ptr<const CPStrategy> strategy,
                     std::shared_ptr<const CPTopology> topology, CPRuntimeOptions options)
    : adapter_(std::move(adapter)),
      strategy_(std::move(strategy)),
      ctx_{std::move(topology), options.layout, options.load_balance, options.load_balance_form},
      module_path_(std::move(options.module_path)),
      async_(options.async),
      state_(std::make_shared<CPRuntimeState>(module_path_)) {
  HP_INTERNAL_ASSERT(adapter_ && strategy_ && ctx_.topology);
  HP_CHECK(ctx_.layout.seq_dim != ctx_.layout.head_dim, "module '", module_path_,
           "': cp_seq_dim and cp_head_dim are both ", ctx_.layout.seq_dim,
           "; they must name different dims (BNSD: cp_seq_dim=2, cp_head_dim=1; BSHD: 1, 2)");
}

std::string CPRuntime::id() const {
  return common::str_cat("cp:", module_path_, ":", adapter_->name(), ":", strategy_->name(),
                         async_ ? "/async" : "", ctx_.load_balance ? "+lb:" : "",
                         ctx_.load_balance ? to_string(ctx_.load_balance_form) : "", ":",
                         ctx_.topology->id());
}

void CPRuntime::validate(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                         const attention::AttentionOptions& options) const {
  const auto& l = ctx_.layout;
  const std::string who =
      common::str_cat("CP attention on module '", module_path_, "' (", strategy_->name(), ")");
  HP_CHECK(q.defined() && k.defined() && v.defined(), who, ": q, k and v must be defined");
  HP_CHECK(q.dim() == k.dim() && q.dim() == v.dim(), who, ": q, k, v ranks differ (", q.dim(), ", ",
           k.dim(), ", ", v.dim(), "); they must have the same rank");
  const int64_t nd = q.dim();
  HP_CHECK(l.seq_dim >= 0 && l.seq_dim < nd && l.head_dim >= 0 && l.head_dim < nd, who,
           ": cp_seq_dim=", l.seq_dim, " / cp_head_dim=", l.head_dim, " are out of range for ", nd,
           "-d q/k/v");
  HP_CHECK(k.sizes() == v.sizes(), who, ": k ", common::shape_str(k.sizes()), " and v ",
           common::shape_str(v.sizes()), " must have the same shape");
  for (int64_t d = 0; d < nd; ++d) {
    if (d == l.head_dim) continue;
    HP_CHECK(q.size(d) == k.size(d), who, ": q ", common::shape_str(q.sizes()), " and k ",
             common::shape_str(k.sizes()), " differ in dim ", d,
             d == l.seq_dim ? " (the sequence)" : "",
             "; CP splits self-attention, so only the head dim may differ");
  }
  const int64_t qh = q.size(l.head_dim), kh = k.size(l.head_dim);
  HP_CHECK(kh >= 1 && qh % kh == 0, who, ": query heads ", qh,
           " are not a multiple of key/value heads ", kh);
  const auto& t = *ctx_.topology;
  if (t.ulysses_degree > 1) {
    ContextParallelConfig c;
    c.algorithm = t.colossal_degree == 1 ? CPAlgorithm::kUlysses : CPAlgorithm::kHybrid;
    c.ulysses_degree = t.ulysses_degree;
    check_heads(c, t.cp_size, qh, kh);
    HP_CHECK(!options.mask.defined(), who,
             ": a tensor mask cannot follow the Ulysses re-layout; express it as a mask "
             "function and use the flex_qkv or flex_hf adapter");
  }
}

attention::AttentionResult CPRuntime::intercept(const at::Tensor& q, const at::Tensor& k,
                                                const at::Tensor& v,
                                                const attention::AttentionOptions& options,
                                                const attention::AttentionFn& inner) {
  validate(q, k, v, options);
  ++calls_in_forward_;
  if (async_ && detail::can_overlap(*strategy_, ctx_, options)) {
    // all_gather / ulysses: attention on what is already local hides the collectives
    // (overlap.cpp).
    auto consume = [this](QKVRole role, const at::Tensor& x) { return state_->consume(role, x); };
    auto fn =
        strategy_->name() == "ulysses" ? detail::overlapped_ulysses : detail::overlapped_attention;
    return {fn(q, k, v, options, inner, *adapter_, *strategy_, ctx_, consume), at::Tensor()};
  }
  PreparedQKV prepared;
  if (async_) {
    // The moved roles' collectives started at their handoff points: wait for them here.
    at::Tensor moved[3] = {q, k, v};
    for (auto role : strategy_->moved_roles()) {
      auto& x = moved[static_cast<int>(role)];
      x = state_->consume(role, x);
    }
    prepared = strategy_->finish(q, moved[0], moved[1], moved[2], ctx_);
  } else {
    prepared = strategy_->prepare_qkv(q, k, v, ctx_);
  }
  const int64_t seq = ctx_.layout.seq_dim;
  std::vector<at::Tensor> outs;
  for (const auto& part : prepared.parts) {
    auto opts = adapter_->rewrite(options, part.state, *strategy_);
    auto pk = prepared.k, pv = prepared.v;
    if (opts.causal && opts.causal_meta) {
      // Keys past the part's last query position are invisible to all its queries: cut them
      // off. The narrow runs on every rank, even where it keeps everything, so all ranks build
      // the same autograd graph and issue their backward collectives in the same order (with
      // two groups in play, as in hybrid, a rank-dependent order could deadlock).
      auto& meta = *opts.causal_meta;
      const int64_t prefix = std::min(meta.kv_len, meta.q_offset + meta.q_len);
      pk = pk.narrow(seq, 0, prefix);
      pv = pv.narrow(seq, 0, prefix);
      if (opts.mask.defined()) opts.mask = opts.mask.narrow(-1, 0, prefix);
      meta.kv_len = prefix;
    }
    outs.push_back(inner(part.q, pk, pv, opts).out);
  }
  // The lse is in the post-strategy frame (other heads / rows than the caller's): not returned.
  return {strategy_->restore_output(outs, prepared, ctx_), at::Tensor()};
}

void CPRuntime::on_forward_begin() {
  in_forward_ = true;
  calls_in_forward_ = 0;
}

at::Tensor CPRuntime::on_handoff(QKVRole role, const std::string& handoff, const at::Tensor& x) {
  const auto& l = ctx_.layout;
  HP_CHECK(x.defined() && l.seq_dim < x.dim() && l.head_dim < x.dim(), "async CP on module '",
           module_path_, "': handoff '", handoff, "' emitted a tensor without the layout's seq ",
           "dim ", l.seq_dim, " and head dim ", l.head_dim);
  const auto& t = *ctx_.topology;
  HP_CHECK(x.size(l.head_dim) % t.ulysses_degree == 0, "async CP on module '", module_path_,
           "': ", role_name(role), " from handoff '", handoff, "' has ", x.size(l.head_dim),
           " heads, not divisible by the Ulysses degree ", t.ulysses_degree,
           "; use algorithm=all_gather or a smaller ulysses_degree");
  strategy_->check_inputs(x, ctx_);
  auto self = shared_from_this();
  return state_->produce(
      role, handoff, x,
      [self, role](const at::Tensor& t) {
        return self->strategy_->move_async(role, t, self->ctx_);
      },
      [self, role](const at::Tensor& g) {
        return self->strategy_->move_grad_async(role, g, self->ctx_);
      });
}

void CPRuntime::on_forward_end() {
  const bool reached = calls_in_forward_ > 0;
  in_forward_ = false;
  if (async_ && reached) state_->check_drained();
  HP_CHECK(reached, "CP adapter '", adapter_->name(), "' on module '", module_path_,
           "': the module's forward finished without reaching the attention primitive, so no "
           "CP communication ran and the result would be silently wrong (misfire). Route the "
           "module's attention through AttentionHost::call_primitive, or use the sdpa_qkv "
           "adapter if the module takes (q, k, v)");
}

}  // namespace hp::cp
