// hybrid (P = C * U): the Ulysses piece inside each Ulysses group, then the all-gather piece
// across the co group; nothing here is new communication code.
//
//   q [B, N, S/P, D]   -- A2A in cp_ulysses --> [B, N/U, S/C, D]                  --> attention
//   k [B, Nkv, S/P, D] -- A2A in cp_ulysses --> [B, Nkv/U, S/C, D]
//                      -- all_gather(seq) in cp_co --> [B, Nkv/U, S, D]          --> attention
//   (v as k)                                       causal offset co_rank * S/C
//   out [B, N/U, S/C, D] -- A2A in cp_ulysses --> [B, N, S/P, D]
//   backward in exact reverse (reduce-scatter in cp_co, inverse A2As in cp_ulysses).
#include <ATen/ATen.h>

#include "strategy_pieces.h"

namespace hp::cp {
namespace {

class HybridStrategy final : public CPStrategy {
 public:
  std::string name() const override { return "hybrid"; }
  std::vector<comm::OpKind> required_ops() const override {
    return {comm::OpKind::kAllToAll, comm::OpKind::kAllGather, comm::OpKind::kReduceScatter};
  }

  PreparedQKV prepare_qkv(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                          const CPRuntimeContext& ctx) const override {
    const auto& t = *ctx.topology;
    const auto& l = ctx.layout;
    QueryPart part{detail::scatter_heads(q, t.ulysses, l), {}};
    PreparedQKV p{
        detail::scatter_heads(k, t.ulysses, l), detail::scatter_heads(v, t.ulysses, l), {}};
    detail::gather_kv(p.k, p.v, t.co, l);
    const int64_t s_block = part.q.size(l.seq_dim);  // S / C
    part.state.local_seq = q.size(l.seq_dim);
    part.state.causal = {t.co_rank * s_block, s_block, p.k.size(l.seq_dim)};
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

std::shared_ptr<const CPStrategy> make_hybrid_strategy() {
  return std::make_shared<HybridStrategy>();
}

}  // namespace hp::cp
