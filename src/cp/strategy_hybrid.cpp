// hybrid (P = C * U): the Ulysses piece inside each Ulysses group, then the all-gather piece
// across the co group; nothing here is new communication code.
//
//   q [B, N, S/P, D]   -- A2A in cp_ulysses --> [B, N/U, S/C, D]                  --> attention
//   k [B, Nkv, S/P, D] -- A2A in cp_ulysses --> [B, Nkv/U, S/C, D]
//                      -- all_gather(seq) in cp_co --> [B, Nkv/U, S, D]          --> attention
//   (v as k)                                       causal offset co_rank * S/C
//   out [B, N/U, S/C, D] -- A2A in cp_ulysses --> [B, N, S/P, D]
//   backward in exact reverse (reduce-scatter in cp_co, inverse A2As in cp_ulysses).
//   Async schedule: the A2As start at the handoff points; the co-group K/V all-gather stays
//   synchronous (as in the original system).
#include <ATen/ATen.h>

#include "hp/common/check.h"
#include "strategy_pieces.h"

namespace hp::cp {
namespace {

class HybridStrategy final : public detail::UlyssesMoves {
 public:
  std::string name() const override { return "hybrid"; }
  std::string summary() const override {
    return "Ulysses inside groups of ulysses_degree ranks x K/V all-gather across them (heads "
           "divisible by the degree)";
  }
  void normalize(ContextParallelConfig& c, int64_t cp_size) const override {
    detail::check_sub_group_degree(c, cp_size, "hybrid", "all_gather");
  }
  std::vector<comm::OpKind> required_ops() const override {
    return {comm::OpKind::kAllToAll, comm::OpKind::kAllGather, comm::OpKind::kReduceScatter};
  }

  PreparedQKV finish(const at::Tensor& q_local, const at::Tensor& q, const at::Tensor& k,
                     const at::Tensor& v, const CPRuntimeContext& ctx) const override {
    const auto& t = *ctx.topology;
    const auto& l = ctx.layout;
    PreparedQKV p{k, v, {}};
    select_repeated_kv(p.k, p.v, ctx);
    detail::gather_kv(p.k, p.v, t.co, l);
    QueryPart part{q, {}};
    const int64_t s_block = q.size(l.seq_dim);  // S / C
    part.state.local_seq = q_local.size(l.seq_dim);
    part.state.causal = {t.co_rank * s_block, s_block, p.k.size(l.seq_dim)};
    part.state.head_offset = t.ulysses_rank * q.size(l.heads_dim);
    p.parts.push_back(part);
    return p;
  }
};

}  // namespace

std::shared_ptr<const CPStrategy> make_hybrid_strategy() {
  return std::make_shared<HybridStrategy>();
}

}  // namespace hp::cp
