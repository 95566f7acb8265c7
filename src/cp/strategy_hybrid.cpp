// hybrid (P = C * U): the Ulysses piece inside each Ulysses group, then the all-gather piece
// across the co group; nothing here is new communication code.
//
//   q [B, N, S/P, D]   -- A2A in cp_ulysses --> [B, N/U, S/C, D]                  --> attention
//   k [B, Nkv, S/P, D] -- A2A in cp_ulysses --> [B, Nkv/U, S/C, D]
//                      -- all_gather(seq) in cp_co --> [B, Nkv/U, S, D]          --> attention
//   (v as k)                                       causal offset co_rank * S/C
//   out [B, N/U, S/C, D] -- A2A in cp_ulysses --> [B, N, S/P, D]
//   backward in exact reverse (reduce-scatter in cp_co, inverse A2As in cp_ulysses).
//
// Head-tail balance (data-order shards, rank r: chunks 2r and 2P-2r-1 of S/2P): after the A2A
// co-rank c holds the chunks of ranks cU .. cU+U-1 in that order, one query part per chunk;
// the co-group gather delivers the P shards in rank order (natural_order puts them back).
//
// Async (run_async; the original system keeps the co-group gather synchronous): the A2As start
// at the handoff points; the co-group all-gathers of K and V start as soon as their A2As have
// arrived and fly while this rank's queries attend the K/V chunks it already holds
// (attend_local_first, the all-gather piece's async half):
//     1. each query part x the held chunks it can see        (the gathers fly)
//     2. wait K, V (all_gather in cp_co)
//     3. each query part x the visible ranges outside the held chunks
//     4. merge by lse, then the output A2A as in sync.
//   Backward runs 3 before the reduce-scatters of the gathered gradients and 1 after them, so
//   the reduce-scatters fly while the held chunks' backward computes.
//   A query part whose turn comes once both gathers have landed (nothing left to hide) skips 1
//   and attends all its visible keys in one call after the wait, as all_gather does
//   (async_always_local_first keeps the split).
#include <ATen/ATen.h>

#include "hp/comm/async_transfer.h"
#include "hp/common/check.h"
#include "hp/cp/sequence.h"
#include "strategy_pieces.h"

namespace hp::cp {
namespace {

class HybridStrategy final : public detail::UlyssesMoves {
 public:
  std::string name() const override { return "hybrid"; }
  std::string summary() const override {
    return "Ulysses inside groups of ulysses_degree ranks x K/V all-gather across them (heads "
           "divisible by the degree; head-tail load balance)";
  }
  void normalize(ContextParallelConfig& c, int64_t cp_size) const override {
    detail::check_sub_group_degree(c, cp_size, "hybrid", "all_gather");
    detail::check_data_order_balance(c, "hybrid");
  }
  bool supports_load_balance() const override { return true; }
  std::vector<comm::OpKind> required_ops() const override {
    return {comm::OpKind::kAllToAll, comm::OpKind::kAllGather, comm::OpKind::kReduceScatter};
  }
  PreparedQKV finish(const at::Tensor& q_local, const at::Tensor& q, const at::Tensor& k,
                     const at::Tensor& v, const CPRuntimeContext& ctx) const override {
    PreparedQKV p{k, v, {}};
    select_repeated_kv(p.k, p.v, ctx);
    detail::gather_kv(p.k, p.v, ctx.topology->co, ctx.layout);
    detail::natural_order_kv(p.k, p.v, ctx);
    p.parts = held_parts(q, q_local.size(ctx.layout.seq_dim), p.k.size(ctx.layout.seq_dim), ctx);
    return p;
  }

  // One output per held chunk, in the order they are held: the A2A's layout.
  at::Tensor restore_output(const std::vector<at::Tensor>& outs, const PreparedQKV& prepared,
                            const CPRuntimeContext& ctx) const override {
    auto out = outs.size() == 1 ? outs[0] : at::cat(outs, ctx.layout.seq_dim);
    return UlyssesMoves::restore_output({out}, prepared, ctx);
  }

  at::Tensor run_async(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                       const AttentionCall& call, const CPRuntimeContext& ctx,
                       const ArrivedFn& arrived) const override {
    if (!can_split_call(call) || ctx.topology->colossal_degree == 1) {
      return CPStrategy::run_async(q, k, v, call, ctx, arrived);
    }
    const auto& t = *ctx.topology;
    const int64_t seq = ctx.layout.seq_dim;
    // K, then V: each co-group gather starts the moment its A2A is here; Q last.
    auto ka = arrived(QKVRole::kK, k), va = arrived(QKVRole::kV, v);
    select_repeated_kv(ka, va, ctx);
    auto k_flight = comm::all_gather_start(ka, seq, t.co);
    auto v_flight = comm::all_gather_start(va, seq, t.co);
    auto qa = arrived(QKVRole::kQ, q);
    const int64_t total = qa.size(seq) * t.colossal_degree;
    auto gathered = [&] {
      auto kg = k_flight.wait(), vg = v_flight.wait();
      detail::natural_order_kv(kg, vg, ctx);
      return std::make_pair(kg, vg);
    };
    auto landed = [&] {
      if (ctx.async_always_local_first) return false;
      const bool k_landed = k_flight.landed();  // both asked: gloo's first query starts a watch
      const bool v_landed = v_flight.landed();
      return k_landed && v_landed;
    };
    auto outs =
        detail::attend_local_first(held_parts(qa, q.size(seq), total, ctx), k_flight.emitted(),
                                   v_flight.emitted(), total, call, gathered, landed);
    return restore_output(outs, PreparedQKV{}, ctx);
  }

 private:
  // The query parts of what this rank holds after the A2A (q [.., S/C, ..] of its N/U heads):
  // its co block at co_rank * S/C, or under head-tail balance one part per chunk of its
  // Ulysses group's members (rank cU+j: chunks 2r and 2P-2r-1), in the order they are held.
  static std::vector<QueryPart> held_parts(const at::Tensor& q, int64_t local_seq, int64_t kv_len,
                                           const CPRuntimeContext& ctx) {
    const auto& t = *ctx.topology;
    const int64_t seq = ctx.layout.seq_dim, held = q.size(seq);
    CallState base;
    base.local_seq = local_seq;
    base.head_offset = t.ulysses_rank * q.size(ctx.layout.heads_dim);
    if (!ctx.load_balance) {
      base.causal = {t.co_rank * held, held, kv_len};
      return {QueryPart{q, base}};
    }
    const int64_t u = t.ulysses_degree, chunk = held / (2 * u);
    std::vector<QueryPart> parts;
    for (int64_t j = 0; j < u; ++j) {
      const auto ids = load_balance_chunks(t.co_rank * u + j, t.cp_size);
      for (int64_t h = 0; h < 2; ++h) {
        QueryPart part{q.narrow(seq, (2 * j + h) * chunk, chunk), base};
        part.state.causal = {ids[h] * chunk, chunk, kv_len};
        parts.push_back(part);
      }
    }
    return parts;
  }
};

}  // namespace

std::shared_ptr<const CPStrategy> make_hybrid_strategy() {
  return std::make_shared<HybridStrategy>();
}

}  // namespace hp::cp
