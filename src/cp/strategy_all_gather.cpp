// all_gather (Colossal): K/V all-gathered along the sequence, Q and the output stay local.
//
//   q [B, N,   S/P, D]  ----------------------------------------> attention q (offset r*S/P)
//   k [B, Nkv, S/P, D]  -- all_gather(seq, cp) --> [B, Nkv, S, D] --> attention k
//   v [B, Nkv, S/P, D]  -- all_gather(seq, cp) --> [B, Nkv, S, D] --> attention v
//   out [B, N, S/P, D]  stays local
//   backward: dK, dV reduce-scatter(seq, cp); dQ local. No head constraint.
//   head-tail load balance: two query parts (see load_balance.cpp), K/V as above (put back in
//   natural order for data-order shards).
#include <ATen/ATen.h>

#include "hp/comm/autograd_collectives.h"
#include "hp/comm/collectives.h"
#include "hp/common/check.h"
#include "strategy_pieces.h"

namespace hp::cp {

at::Tensor detail::gather_seq(const at::Tensor& x, const comm::GroupPtr& group,
                              const QKVLayout& l) {
  if (group->size() == 1) return x;
  return comm::all_gather_autograd(x, l.seq_dim, group);
}

void detail::gather_kv(at::Tensor& k, at::Tensor& v, const comm::GroupPtr& group,
                       const QKVLayout& l) {
  k = gather_seq(k, group, l);
  v = gather_seq(v, group, l);
}

comm::CommHandle detail::gather_seq_async(const at::Tensor& x, const comm::GroupPtr& group,
                                          const QKVLayout& l) {
  return comm::all_gather_async(*group, x, l.seq_dim);
}

comm::CommHandle detail::gather_seq_grad_async(const at::Tensor& g, const comm::GroupPtr& group,
                                               const QKVLayout& l) {
  return comm::reduce_scatter_async(*group, g, l.seq_dim);
}

namespace {

class AllGatherStrategy final : public CPStrategy {
 public:
  std::string name() const override { return "all_gather"; }
  std::vector<comm::OpKind> required_ops() const override {
    return {comm::OpKind::kAllGather, comm::OpKind::kReduceScatter};
  }
  std::vector<QKVRole> moved_roles() const override { return {QKVRole::kK, QKVRole::kV}; }

  at::Tensor move(QKVRole role, const at::Tensor& x, const CPRuntimeContext& ctx) const override {
    HP_INTERNAL_ASSERT(role != QKVRole::kQ);
    return detail::gather_seq(x, ctx.topology->cp, ctx.layout);
  }
  comm::CommHandle move_async(QKVRole, const at::Tensor& x,
                              const CPRuntimeContext& ctx) const override {
    return detail::gather_seq_async(x, ctx.topology->cp, ctx.layout);
  }
  comm::CommHandle move_grad_async(QKVRole, const at::Tensor& g,
                                   const CPRuntimeContext& ctx) const override {
    return detail::gather_seq_grad_async(g, ctx.topology->cp, ctx.layout);
  }
  void check_inputs(const at::Tensor& q, const CPRuntimeContext& ctx) const override {
    if (ctx.load_balance) detail::check_head_tail(q, ctx);
  }

  PreparedQKV finish(const at::Tensor& q_local, const at::Tensor& q, const at::Tensor& k,
                     const at::Tensor& v, const CPRuntimeContext& ctx) const override {
    const auto& t = *ctx.topology;
    const int64_t seq = ctx.layout.seq_dim;
    PreparedQKV p{k, v, {}};
    const int64_t kv_len = p.k.size(seq);
    if (ctx.load_balance) {
      if (ctx.load_balance_form == LoadBalanceForm::kDataOrder) {
        p.k = detail::natural_order(p.k, ctx);
        p.v = detail::natural_order(p.v, ctx);
      }
      p.parts = detail::head_tail_parts(q, ctx, kv_len);
      return p;
    }
    const int64_t s_local = q_local.size(seq);
    QueryPart part{q, {}};
    part.state.local_seq = s_local;
    part.state.causal = {t.cp_rank * s_local, s_local, kv_len};
    p.parts.push_back(part);
    return p;
  }

  at::Tensor restore_output(const std::vector<at::Tensor>& outs, const PreparedQKV&,
                            const CPRuntimeContext& ctx) const override {
    return ctx.load_balance ? detail::head_tail_restore(outs, ctx) : outs[0];
  }
};

}  // namespace

std::shared_ptr<const CPStrategy> make_all_gather_strategy() {
  return std::make_shared<AllGatherStrategy>();
}

}  // namespace hp::cp
