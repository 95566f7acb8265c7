// all_gather (Colossal): K/V all-gathered along the sequence, Q and the output stay local.
//
//   q [B, N,   S/P, D]  ----------------------------------------> attention q (offset r*S/P)
//   k [B, Nkv, S/P, D]  -- all_gather(seq, cp) --> [B, Nkv, S, D] --> attention k
//   v [B, Nkv, S/P, D]  -- all_gather(seq, cp) --> [B, Nkv, S, D] --> attention v
//   out [B, N, S/P, D]  stays local
//   backward: dK, dV reduce-scatter(seq, cp); dQ local. No head constraint.
#include <ATen/ATen.h>

#include "hp/comm/autograd_collectives.h"
#include "strategy_pieces.h"

namespace hp::cp {

void detail::gather_kv(at::Tensor& k, at::Tensor& v, const comm::GroupPtr& group,
                       const QKVLayout& l) {
  if (group->size() == 1) return;
  k = comm::all_gather_autograd(k, l.seq_dim, group);
  v = comm::all_gather_autograd(v, l.seq_dim, group);
}

namespace {

class AllGatherStrategy final : public CPStrategy {
 public:
  std::string name() const override { return "all_gather"; }
  std::vector<comm::OpKind> required_ops() const override {
    return {comm::OpKind::kAllGather, comm::OpKind::kReduceScatter};
  }

  PreparedQKV prepare_qkv(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                          const CPRuntimeContext& ctx) const override {
    const auto& t = *ctx.topology;
    PreparedQKV p{q, k, v, {}};
    detail::gather_kv(p.k, p.v, t.cp, ctx.layout);
    const int64_t s_local = q.size(ctx.layout.seq_dim);
    p.state.local_seq = s_local;
    p.state.causal = {t.cp_rank * s_local, s_local, p.k.size(ctx.layout.seq_dim)};
    return p;
  }

  at::Tensor restore_output(const at::Tensor& out, const CallState&,
                            const CPRuntimeContext&) const override {
    return out;
  }
};

}  // namespace

std::shared_ptr<const CPStrategy> make_all_gather_strategy() {
  return std::make_shared<AllGatherStrategy>();
}

}  // namespace hp::cp
