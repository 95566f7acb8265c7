// ulysses: Q, K, V seq->head all-to-all, attention on the full sequence with local heads,
// output head->seq all-to-all.
//
//   q [B, N,   S/P, D] -- A2A(split head, concat seq) --> [B, N/P,   S, D] --> attention
//   k [B, Nkv, S/P, D] -- A2A ----------------------------> [B, Nkv/P, S, D]   (plain causal,
//   v [B, Nkv, S/P, D] -- A2A ----------------------------> [B, Nkv/P, S, D]    offset 0)
//   out [B, N/P, S, D] -- A2A(split seq, concat head) --> [B, N, S/P, D]
//   backward: the inverse all-to-alls. Needs Q and KV heads divisible by P.
#include <ATen/ATen.h>

#include "hp/comm/autograd_collectives.h"
#include "hp/comm/collectives.h"
#include "strategy_pieces.h"

namespace hp::cp {

at::Tensor detail::scatter_heads(const at::Tensor& x, const comm::GroupPtr& group,
                                 const QKVLayout& l) {
  if (group->size() == 1) return x;
  return comm::ulysses_seq_to_head(x, l.seq_dim, l.head_dim, group);
}

at::Tensor detail::gather_heads(const at::Tensor& x, const comm::GroupPtr& group,
                                const QKVLayout& l) {
  if (group->size() == 1) return x;
  return comm::ulysses_head_to_seq(x, l.seq_dim, l.head_dim, group);
}

comm::CommHandle detail::scatter_heads_async(const at::Tensor& x, const comm::GroupPtr& group,
                                             const QKVLayout& l) {
  return comm::all_to_all_async(*group, x, l.head_dim, l.seq_dim);
}

comm::CommHandle detail::scatter_heads_grad_async(const at::Tensor& g, const comm::GroupPtr& group,
                                                  const QKVLayout& l) {
  return comm::all_to_all_async(*group, g, l.seq_dim, l.head_dim);
}

std::vector<QKVRole> detail::UlyssesMoves::moved_roles() const {
  return {QKVRole::kQ, QKVRole::kK, QKVRole::kV};
}

at::Tensor detail::UlyssesMoves::move(QKVRole, const at::Tensor& x,
                                      const CPRuntimeContext& ctx) const {
  return scatter_heads(x, ctx.topology->ulysses, ctx.layout);
}

comm::CommHandle detail::UlyssesMoves::move_async(QKVRole, const at::Tensor& x,
                                                  const CPRuntimeContext& ctx) const {
  return scatter_heads_async(x, ctx.topology->ulysses, ctx.layout);
}

comm::CommHandle detail::UlyssesMoves::move_grad_async(QKVRole, const at::Tensor& g,
                                                       const CPRuntimeContext& ctx) const {
  return scatter_heads_grad_async(g, ctx.topology->ulysses, ctx.layout);
}

at::Tensor detail::UlyssesMoves::restore_output(const std::vector<at::Tensor>& outs,
                                                const PreparedQKV&,
                                                const CPRuntimeContext& ctx) const {
  return gather_heads(outs[0], ctx.topology->ulysses, ctx.layout);
}

namespace {

class UlyssesStrategy final : public detail::UlyssesMoves {
 public:
  std::string name() const override { return "ulysses"; }
  std::vector<comm::OpKind> required_ops() const override { return {comm::OpKind::kAllToAll}; }

  PreparedQKV finish(const at::Tensor& q_local, const at::Tensor& q, const at::Tensor& k,
                     const at::Tensor& v, const CPRuntimeContext& ctx) const override {
    const auto& l = ctx.layout;
    QueryPart part{q, {}};
    part.state.local_seq = q_local.size(l.seq_dim);
    part.state.causal = {0, q.size(l.seq_dim), k.size(l.seq_dim)};
    part.state.head_offset = ctx.topology->ulysses_rank * q.size(l.head_dim);
    return PreparedQKV{k, v, {part}};
  }
};

}  // namespace

std::shared_ptr<const CPStrategy> make_ulysses_strategy() {
  return std::make_shared<UlyssesStrategy>();
}

}  // namespace hp::cp
