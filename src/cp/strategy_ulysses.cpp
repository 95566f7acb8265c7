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

namespace {

class UlyssesStrategy final : public CPStrategy {
 public:
  std::string name() const override { return "ulysses"; }
  std::vector<comm::OpKind> required_ops() const override { return {comm::OpKind::kAllToAll}; }

  PreparedQKV prepare_qkv(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                          const CPRuntimeContext& ctx) const override {
    const auto& t = *ctx.topology;
    const auto& l = ctx.layout;
    // Q first, then K, V: the same A2A order on every rank.
    QueryPart part{detail::scatter_heads(q, t.ulysses, l), {}};
    PreparedQKV p{
        detail::scatter_heads(k, t.ulysses, l), detail::scatter_heads(v, t.ulysses, l), {}};
    part.state.local_seq = q.size(l.seq_dim);
    part.state.causal = {0, part.q.size(l.seq_dim), p.k.size(l.seq_dim)};
    part.state.head_offset = t.ulysses_rank * part.q.size(l.head_dim);
    p.parts.push_back(part);
    return p;
  }

  at::Tensor restore_output(const std::vector<at::Tensor>& outs, const PreparedQKV&,
                            const CPRuntimeContext& ctx) const override {
    return detail::gather_heads(outs[0], ctx.topology->ulysses, ctx.layout);
  }
};

}  // namespace

std::shared_ptr<const CPStrategy> make_ulysses_strategy() {
  return std::make_shared<UlyssesStrategy>();
}

}  // namespace hp::cp
