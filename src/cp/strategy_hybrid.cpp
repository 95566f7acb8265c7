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
//     4. merge by lse, then the output A2A.
//   Backward runs 3 before the reduce-scatters of the gathered gradients and 1 after them, so
//   the reduce-scatters fly while the held chunks' backward computes.
//   A query part whose turn comes once both gathers have landed (nothing left to hide) skips 1
//   and attends all its visible keys in one call after the wait, as all_gather does
//   (async_always_local_first keeps the split).
// In G head groups (cp_config.ulysses_head_groups; automatic as ulysses) Q, K, V travel as
// ulysses' do, one A2A per group at each handoff (split_for_move), and 1-4 run per group:
//   group g: wait its K, V pieces -> co-gathers of group g start -> wait its Q piece
//            -> 1 -> 2 (first starting group g+1's co-gathers: they fly while g's remote keys
//            and g+1's held chunks are attended) -> 3 -> its output A2A starts and flies on
//   the outputs come back as heads (heads_from_groups). Backward runs the last group first;
//   each group's reduce-scatters and dQ, dK, dV pieces leave as soon as its backward is done.
//   K/V on the repeat path (kv_head_policy=repeat): the query heads alone in groups; each
//   rank's one K/V head travels whole, is co-gathered once (with group 0) and read by every
//   group (its reduce-scatter after the last group's backward).
// Packed documents that hide every other co-rank's keys from the queries each co-rank holds
// after the A2A (co_keys_hidden, decided alike by all ranks from the global ids): no co-group
// all-gather and no reduce-scatter, in either schedule; each rank attends the chunks it holds
// (the A2As still run: the heads must move whatever the documents).
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
  at::Tensor run_sync(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                      const AttentionCall& call, const CPRuntimeContext& ctx) const override {
    const int64_t total = q.size(ctx.layout.seq_dim) * ctx.topology->cp_size;
    if (!co_keys_hidden(call, total, ctx)) return CPStrategy::run_sync(q, k, v, call, ctx);
    auto moved = move_qkv(q, k, v, ctx);
    const int64_t head_offset = ctx.topology->ulysses_rank * moved[0].size(ctx.layout.heads_dim);
    return held_only(held_parts(moved[0], q.size(ctx.layout.seq_dim), total, head_offset, ctx),
                     moved[1], moved[2], total, call, ctx);
  }

  PreparedQKV finish(const at::Tensor& q_local, const at::Tensor& q, const at::Tensor& k,
                     const at::Tensor& v, const CPRuntimeContext& ctx) const override {
    PreparedQKV p{k, v, {}};
    detail::gather_kv(p.k, p.v, ctx.topology->co, ctx.layout);
    detail::natural_order_kv(p.k, p.v, ctx);
    p.parts = held_parts(q, q_local.size(ctx.layout.seq_dim), p.k.size(ctx.layout.seq_dim),
                         ctx.topology->ulysses_rank * q.size(ctx.layout.heads_dim), ctx);
    return p;
  }

  // One output per held chunk, in the order they are held: the A2A's layout.
  at::Tensor restore_output(const std::vector<at::Tensor>& outs, const PreparedQKV& prepared,
                            const CPRuntimeContext& ctx) const override {
    auto out = outs.size() == 1 ? outs[0] : at::cat(outs, ctx.layout.seq_dim);
    return UlyssesMoves::restore_output({out}, prepared, ctx);
  }

  // One piece per head group, as ulysses (K/V that take the repeat path travel whole).
  std::vector<at::Tensor> split_for_move(QKVRole role, const at::Tensor& x,
                                         const CPRuntimeContext& ctx) const override {
    return split_head_groups(role, x, ctx, CPAlgorithm::kHybrid);
  }

  at::Tensor run_async(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                       const AttentionCall& call, const CPRuntimeContext& ctx,
                       const ArrivedFn& arrived) const override {
    if (!can_split_call(call) || ctx.topology->colossal_degree == 1) {
      return CPStrategy::run_async(q, k, v, call, ctx, arrived);
    }
    const auto& t = *ctx.topology;
    const auto& l = ctx.layout;
    const int64_t seq = l.seq_dim, hd = l.heads_dim, u = t.ulysses_degree;
    const int64_t total = q.size(seq) * t.cp_size;
    const int64_t nq = q.size(hd) / u;
    // The repeat path: each rank's one K/V head travels whole and is gathered once, shared by
    // every query group (kv_of(g) = 0).
    const bool repeated = repeated_kv(ctx);
    const int64_t groups =
        detail::head_groups(ctx, CPAlgorithm::kHybrid, nq, repeated ? nq : k.size(hd) / u);
    const int64_t gq = nq / groups, kv_groups = repeated ? 1 : groups;
    auto kv_of = [&](int64_t g) { return repeated ? int64_t(0) : g; };
    const bool co_hidden = co_keys_hidden(call, total, ctx);
    detail::GroupedArrival qa(arrived.pieces(QKVRole::kQ, q), q, groups, u, t.ulysses_rank, hd),
        ka(arrived.pieces(QKVRole::kK, k), k, kv_groups, u, t.ulysses_rank, hd),
        va(arrived.pieces(QKVRole::kV, v), v, kv_groups, u, t.ulysses_rank, hd);
    // K/V group j's co-group gathers, started once its K, V pieces are here, in group order on
    // every rank; what they delivered, kept for the query groups that share them.
    std::vector<std::pair<comm::InFlight, comm::InFlight>> flights;
    std::vector<std::pair<at::Tensor, at::Tensor>> gathered_kv(kv_groups);
    flights.reserve(kv_groups);
    auto launch = [&](int64_t j) {
      auto kg = ka.moved(j), vg = va.moved(j);
      auto k_flight = comm::all_gather_start(kg, seq, t.co);  // K first, then V
      flights.emplace_back(std::move(k_flight), comm::all_gather_start(vg, seq, t.co));
    };
    std::vector<comm::InFlight> moving;
    for (int64_t g = 0; g < groups; ++g) {
      const auto parts =
          held_parts(qa.moved(g), q.size(seq), total, t.ulysses_rank * nq + g * gq, ctx);
      if (co_hidden) {
        auto kg = ka.moved(kv_of(g)), vg = va.moved(kv_of(g));
        auto out = held_only(parts, kg, vg, total, call, ctx, /*restore=*/groups == 1);
        if (groups == 1) return out;
        moving.push_back(comm::all_to_all_start(out.contiguous(), seq, hd, t.ulysses));
        continue;
      }
      const int64_t j = kv_of(g);
      if (static_cast<int64_t>(flights.size()) == j) launch(j);
      auto& [k_flight, v_flight] = flights[j];
      auto gathered = [&, g, j] {
        if (g + 1 < groups && static_cast<int64_t>(flights.size()) == kv_of(g + 1))
          launch(kv_of(g + 1));
        if (!gathered_kv[j].first.defined()) {
          auto& [kf, vf] = flights[j];
          auto kg = kf.wait(), vg = vf.wait();
          detail::natural_order_kv(kg, vg, ctx);
          gathered_kv[j] = {kg, vg};
        }
        return gathered_kv[j];
      };
      auto landed = [&, j] {
        if (ctx.async_always_local_first) return false;
        auto& [kf, vf] = flights[j];
        const bool k_landed = kf.landed();  // both asked: gloo's first query starts a watch
        const bool v_landed = vf.landed();
        return k_landed && v_landed;
      };
      auto outs = detail::attend_local_first(parts, k_flight.emitted(), v_flight.emitted(), total,
                                             call, gathered, landed);
      auto out = outs.size() == 1 ? outs[0] : at::cat(outs, seq);
      if (groups == 1) return UlyssesMoves::restore_output({out}, PreparedQKV{}, ctx);
      moving.push_back(comm::all_to_all_start(out.contiguous(), seq, hd, t.ulysses));
    }
    // Group g came back as heads (rank j, head i) -> global head j*nq + g*gq + i.
    return detail::heads_from_groups(moving, u, l);
  }

 private:
  // Whether the call's packed documents hide, from the queries every co-rank holds after the
  // A2A, every key the other co-ranks hold: then the co-group collectives are not needed.
  // Co-rank c holds the chunks of ranks cU .. cU+U-1 (balanced) or block c of S/C.
  static bool co_keys_hidden(const AttentionCall& call, int64_t total,
                             const CPRuntimeContext& ctx) {
    const auto& t = *ctx.topology;
    if (t.colossal_degree == 1 || !can_split_call(call)) return false;
    const auto chunks = [&](int64_t c) {
      if (!ctx.load_balance) return std::vector<int64_t>{c};
      std::vector<int64_t> ids;
      for (int64_t j = 0; j < t.ulysses_degree; ++j) {
        for (int64_t id : load_balance_chunks(c * t.ulysses_degree + j, t.cp_size))
          ids.push_back(id);
      }
      return ids;
    };
    return detail::remote_keys_hidden(call, t.colossal_degree, total, chunks);
  }

  // The held query parts against the held K/V chunks only (co_keys_hidden holds); `restore`:
  // the output's A2A back to the caller's shard, else the held output (a head group's).
  at::Tensor held_only(const std::vector<QueryPart>& parts, const at::Tensor& k,
                       const at::Tensor& v, int64_t total, const AttentionCall& call,
                       const CPRuntimeContext& ctx, bool restore = true) const {
    auto outs = detail::attend_local_first(parts, k, v, total, call, {});
    auto out = outs.size() == 1 ? outs[0] : at::cat(outs, ctx.layout.seq_dim);
    return restore ? UlyssesMoves::restore_output({out}, PreparedQKV{}, ctx) : out;
  }

  // The query parts of what this rank holds after the A2A (q [.., S/C, ..] of its N/U heads):
  // its co block at co_rank * S/C, or under head-tail balance one part per chunk of its
  // Ulysses group's members (rank cU+j: chunks 2r and 2P-2r-1), in the order they are held.
  // head_offset: the global index of q's first head (masks per head).
  static std::vector<QueryPart> held_parts(const at::Tensor& q, int64_t local_seq, int64_t kv_len,
                                           int64_t head_offset, const CPRuntimeContext& ctx) {
    const auto& t = *ctx.topology;
    const int64_t seq = ctx.layout.seq_dim, held = q.size(seq);
    CallState base;
    base.local_seq = local_seq;
    base.head_offset = head_offset;
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
