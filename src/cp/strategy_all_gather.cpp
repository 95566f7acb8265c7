// all_gather (Colossal): K/V all-gathered along the sequence, Q and the output stay local.
//
//   q [B, N,   S/P, D]  ----------------------------------------> attention q (offset r*S/P)
//   k [B, Nkv, S/P, D]  -- all_gather(seq, cp) --> [B, Nkv, S, D] --> attention k
//   v [B, Nkv, S/P, Dv] -- all_gather(seq, cp) --> [B, Nkv, S, Dv] -> attention v
//   out [B, N, S/P, Dv] stays local
//   backward: dK, dV reduce-scatter(seq, cp); dQ local. No head constraint.
//   head-tail load balance: two query parts (see load_balance.cpp), K/V as above (put back in
//   natural order for data-order shards).
//
// Async (run_async): the gathers were launched at the K/V handoff points; attention on what is
// already local hides them:
//   rank r holds K/V chunk(s) L (one, or two under head-tail balance); its queries Q (same
//   positions).
//     1. for each query part: attention(Q_part, K[L ∩ visible]) per local chunk  -> (o, lse)
//     2. wait K, V (all_gather)                                   (they flew during step 1)
//     3. for each query part: attention(Q_part, K[gap]) per visible gap outside L  -> (o, lse)
//     4. out_part = Σ o_i · exp(lse_i − logsumexp_i lse_i)
//   A part whose turn comes once the K/V have landed (nothing left to hide) skips 1 and attends
//   all its visible keys in one call after 2, as sync (unless async_always_local_first).
//   Backward runs 3 before 2's inverse (dK, dV reduce-scatter) and 1 after it, so the
//   reduce-scatter flies while the local chunks' backward computes. Key blocks that packed
//   documents hide entirely are skipped (attend_local_first, shared with hybrid).
//
// Packed documents that hide every other rank's keys from every rank's queries
// (remote_keys_hidden, decided alike by all ranks from the global ids): no all-gather, no
// reduce-scatter; each rank attends its own chunks. Sync decides at the call; async at its
// first K/V handoff, when the module announced the call's documents before its projections
// (AttentionHost::announce), and otherwise gathers at the handoffs as usual.
#include <algorithm>

#include <ATen/ATen.h>

#include "hp/comm/autograd_collectives.h"
#include "hp/comm/collectives.h"
#include "hp/common/check.h"
#include "hp/common/shape.h"
#include "hp/cp/sequence.h"
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

struct Range {
  int64_t begin = 0, end = 0;  // global positions [begin, end)
};

// The ranges of [0, end) outside the chunks `own` (any order), in position order.
std::vector<Range> gaps_outside(std::vector<Range> own, int64_t end) {
  std::sort(own.begin(), own.end(),
            [](const Range& a, const Range& b) { return a.begin < b.begin; });
  std::vector<Range> out;
  int64_t at_pos = 0;
  auto add = [&](int64_t b, int64_t e) {
    e = std::min(e, end);
    if (b < e) out.push_back({b, e});
  };
  for (const auto& r : own) {
    add(at_pos, r.begin);
    at_pos = r.end;
  }
  add(at_pos, end);
  return out;
}

// `base` for queries at global [q_begin, ..) against keys at global [key_begin, +key_len).
CallState block_state(CallState base, int64_t q_begin, int64_t q_len, int64_t key_begin,
                      int64_t key_len) {
  base.causal = {q_begin - key_begin, q_len, key_len};
  base.kv_start = key_begin;
  return base;
}

}  // namespace

std::vector<at::Tensor> detail::attend_local_first(const std::vector<QueryPart>& parts,
                                                   const at::Tensor& k, const at::Tensor& v,
                                                   int64_t total, const AttentionCall& call,
                                                   const GatheredKV& gathered,
                                                   const std::function<bool()>& landed) {
  const int64_t seq = call.layout().seq_dim;
  // Part i's keys sit in k/v rows [local_offset[i], ..), at the part's own global positions.
  std::vector<Range> local;
  std::vector<int64_t> local_offset;
  int64_t off = 0;
  for (const auto& p : parts) {
    local.push_back({p.state.causal.q_offset, p.state.causal.q_offset + p.q.size(seq)});
    local_offset.push_back(off);
    off += p.q.size(seq);
  }
  // Attention of a part against keys at global positions [key_begin, ..).
  auto state = [&](const QueryPart& part, const at::Tensor& kk, int64_t key_begin) {
    return block_state(part.state, part.state.causal.q_offset, part.q.size(seq), key_begin,
                       kk.size(seq));
  };
  auto visible_end = [&](const QueryPart& p) {
    return call.options().causal ? p.state.causal.q_offset + p.q.size(seq) : total;
  };
  std::vector<std::vector<attention::AttentionResult>> results(parts.size());
  // 1. Local chunks, while the rest travels (a part's own chunk always: never empty). Parts
  //    from `whole` on attend everything in one call after the wait: the K/V had landed.
  size_t whole = parts.size();
  for (size_t i = 0; i < parts.size(); ++i) {
    if (gathered && landed && landed()) {
      whole = i;
      break;
    }
    for (size_t c = 0; c < local.size(); ++c) {
      const int64_t end = std::min(local[c].end, visible_end(parts[i]));
      if (end <= local[c].begin) continue;
      const int64_t len = end - local[c].begin;
      auto kk = k.narrow(seq, local_offset[c], len), vv = v.narrow(seq, local_offset[c], len);
      const auto st = state(parts[i], kk, local[c].begin);
      if (c != i && call.hidden(st)) continue;
      results[i].push_back(call(parts[i].q, kk, vv, st));
    }
  }
  if (!gathered) {  // nothing outside the local chunks is visible
    std::vector<at::Tensor> outs;
    for (const auto& r : results)
      outs.push_back(merge_by_lse(r, call.layout()));
    return outs;
  }
  // 2. The whole K/V (natural order).
  auto [kg, vg] = gathered();
  // 3. The visible key ranges outside the local chunks (blocks documents hide: skipped); a
  //    part from `whole` on: all its visible keys.
  for (size_t i = 0; i < parts.size(); ++i) {
    if (i >= whole) {
      const int64_t end = visible_end(parts[i]);
      auto kk = kg.narrow(seq, 0, end), vv = vg.narrow(seq, 0, end);
      results[i].push_back(call(parts[i].q, kk, vv, state(parts[i], kk, 0)));
      continue;
    }
    for (const auto& g : gaps_outside(local, visible_end(parts[i]))) {
      auto kk = kg.narrow(seq, g.begin, g.end - g.begin);
      auto vv = vg.narrow(seq, g.begin, g.end - g.begin);
      const auto st = state(parts[i], kk, g.begin);
      if (!call.hidden(st)) results[i].push_back(call(parts[i].q, kk, vv, st));
    }
  }
  // 4. Merge per part; every rank's graph reaches the gathered K/V (anchored).
  std::vector<at::Tensor> outs;
  for (const auto& r : results)
    outs.push_back(merge_by_lse(r, call.layout()));
  outs[0] = anchored(outs[0], {kg, vg});
  return outs;
}

bool detail::remote_keys_hidden(const AttentionCall& call, int64_t size, int64_t total,
                                const std::function<std::vector<int64_t>(int64_t)>& chunks) {
  if (!call.options().documents) return false;
  const bool causal = call.options().causal;
  for (int64_t r = 0; r < size; ++r) {
    const auto ids = chunks(r);
    const int64_t len = total / (size * static_cast<int64_t>(ids.size()));
    std::vector<Range> own;
    for (int64_t id : ids)
      own.push_back({id * len, (id + 1) * len});
    for (const auto& q : own) {
      for (const auto& g : gaps_outside(own, causal ? q.end : total)) {
        const auto st = block_state({}, q.begin, q.end - q.begin, g.begin, g.end - g.begin);
        if (!call.hidden(st)) return false;
      }
    }
  }
  return true;
}

namespace {

// The caller's contiguous shard: queries at r * s_local, keys over `kv_len` positions.
QueryPart local_part(const at::Tensor& q, const CPRuntimeContext& ctx, int64_t kv_len) {
  const int64_t s_local = q.size(ctx.layout.seq_dim);
  QueryPart part{q, {}};
  part.state.local_seq = s_local;
  part.state.causal = {ctx.topology->cp_rank * s_local, s_local, kv_len};
  return part;
}

// The query parts of the caller's shard, at their global positions in `total`.
std::vector<QueryPart> shard_parts(const at::Tensor& q, const CPRuntimeContext& ctx,
                                   int64_t total) {
  return ctx.load_balance ? detail::head_tail_parts(q, ctx, total)
                          : std::vector{local_part(q, ctx, total)};
}

}  // namespace

bool detail::rank_keys_hidden(const AttentionCall& call, int64_t total,
                              const CPRuntimeContext& ctx) {
  const auto& t = *ctx.topology;
  const bool runtime_swap =
      ctx.load_balance && ctx.load_balance_form == LoadBalanceForm::kRuntimeSwap;
  if (t.cp_size == 1 || runtime_swap || !can_split_call(call)) return false;
  const auto chunks = [&](int64_t r) {
    return ctx.load_balance ? load_balance_chunks(r, t.cp_size) : std::vector<int64_t>{r};
  };
  return remote_keys_hidden(call, t.cp_size, total, chunks);
}

at::Tensor detail::rank_local_attention(const at::Tensor& q, const at::Tensor& k,
                                        const at::Tensor& v, const AttentionCall& call,
                                        const CPRuntimeContext& ctx) {
  const int64_t total = q.size(ctx.layout.seq_dim) * ctx.topology->cp_size;
  auto outs = attend_local_first(shard_parts(q, ctx, total), k, v, total, call, {});
  return ctx.load_balance ? head_tail_restore(outs, ctx) : outs[0];
}

namespace {

class AllGatherStrategy final : public CPStrategy {
 public:
  std::string name() const override { return "all_gather"; }
  std::string summary() const override {
    return "K/V all-gathered along the sequence; Q and the output stay local (any head count; "
           "head-tail load balance)";
  }
  void normalize(ContextParallelConfig& c, int64_t cp_size) const override {
    HP_CHECK(!c.ulysses_degree || *c.ulysses_degree == 1,
             "cp_config.ulysses_degree=", c.ulysses_degree.value_or(0),
             " with algorithm=all_gather: all_gather uses no Ulysses groups; drop "
             "ulysses_degree, or choose algorithm=hybrid (1 < degree < cp_size=",
             cp_size, ") or ulysses (degree == cp_size)");
    c.ulysses_degree = 1;
  }
  bool supports_load_balance() const override { return true; }
  int64_t forward_bytes_per_rank(const ContextParallelConfig& c, int64_t p, const AttentionShape& s,
                                 int64_t cp_rank) const override {
    const int64_t gathered = CPStrategy::forward_bytes_per_rank(c, p, s, cp_rank);
    const bool swaps = c.load_balance && c.load_balance_form == LoadBalanceForm::kRuntimeSwap &&
                       p - 1 - cp_rank != cp_rank;
    // The query tail goes to the mirror rank, the output tail comes back.
    const int64_t tail = (s.seq / (2 * p)) * s.q_heads * s.element_size * s.batch;
    return gathered + (swaps ? tail * (s.qk_dim + s.v_dim_or_qk()) : 0);
  }
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
  // Async: K and V travel in one all-gather per head group (consecutive heads), so group g's
  // remote keys are attended once its pieces have arrived while the later groups' still
  // travel, and its dK, dV reduce-scatters leave as soon as its backward is done.
  std::vector<at::Tensor> split_for_move(QKVRole, const at::Tensor& x,
                                         const CPRuntimeContext& ctx) const override {
    const int64_t groups = head_groups(x.size(ctx.layout.heads_dim), ctx);
    if (groups == 1) return {x};
    return x.chunk(groups, ctx.layout.heads_dim);
  }
  at::Tensor join_moved(QKVRole, const std::vector<at::Tensor>& moved,
                        const CPRuntimeContext& ctx) const override {
    return at::cat(moved, ctx.layout.heads_dim);
  }
  void check_inputs(const at::Tensor& x, const CPRuntimeContext& ctx,
                    const std::string& who) const override {
    if (ctx.load_balance) detail::check_head_tail(x, ctx);
    const int64_t g = ctx.ulysses_head_groups, heads = x.size(ctx.layout.heads_dim);
    HP_CHECK(g == 0 || heads % g == 0, who, ": cp_config.ulysses_head_groups=", g,
             " does not divide the ", heads, " heads of ", common::shape_str(x.sizes()),
             "; choose a divisor of the key/value heads, or 0 (automatic)");
  }

  PreparedQKV finish(const at::Tensor& q_local, const at::Tensor& q, const at::Tensor& k,
                     const at::Tensor& v, const CPRuntimeContext& ctx) const override {
    PreparedQKV p{k, v, {}};
    const int64_t kv_len = p.k.size(ctx.layout.seq_dim);
    if (ctx.load_balance) {
      detail::natural_order_kv(p.k, p.v, ctx);  // data_order only; runtime_swap keeps its order
      p.parts = detail::head_tail_parts(q, ctx, kv_len);
      return p;
    }
    p.parts.push_back(local_part(q_local, ctx, kv_len));
    return p;
  }

  at::Tensor restore_output(const std::vector<at::Tensor>& outs, const PreparedQKV&,
                            const CPRuntimeContext& ctx) const override {
    return ctx.load_balance ? detail::head_tail_restore(outs, ctx) : outs[0];
  }

  // Packed documents that hide every other rank's keys from every rank's queries: no K/V
  // all-gather and no reduce-scatter are needed (each rank attends its own chunks).
  bool skips_moves(const AttentionCall& call, int64_t total,
                   const CPRuntimeContext& ctx) const override {
    return detail::rank_keys_hidden(call, total, ctx);
  }

  at::Tensor run_async(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                       const AttentionCall& call, const CPRuntimeContext& ctx,
                       const ArrivedFn& arrived) const override {
    const bool runtime_swap =
        ctx.load_balance && ctx.load_balance_form == LoadBalanceForm::kRuntimeSwap;
    if (!can_split_call(call) || runtime_swap || ctx.topology->cp_size == 1) {
      return CPStrategy::run_async(q, k, v, call, ctx, arrived);
    }
    return overlapped(q, k, v, call, ctx, arrived);
  }

 private:
  at::Tensor overlapped(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                        const AttentionCall& call, const CPRuntimeContext& ctx,
                        const ArrivedFn& arrived) const {
    const int64_t total = q.size(ctx.layout.seq_dim) * ctx.topology->cp_size;
    // Query parts with their global ranges; the local K/V chunks sit at the same positions.
    const auto parts = shard_parts(q, ctx, total);
    const int64_t hd = ctx.layout.heads_dim;
    return overlapped_in_groups(parts, q, k, v, total, head_groups(k.size(hd), ctx), call, ctx,
                                arrived);
  }

  // The async head groups (split_for_move): K/V heads [g*n/G, (g+1)*n/G) with the query heads
  // that read them. The split pays only where something is hidden: not with the runtime swap
  // (it waits for whole K/V) or on one rank.
  static int64_t head_groups(int64_t kv_heads, const CPRuntimeContext& ctx) {
    const bool runtime_swap =
        ctx.load_balance && ctx.load_balance_form == LoadBalanceForm::kRuntimeSwap;
    if (ctx.topology->cp_size == 1 || runtime_swap) return 1;
    return detail::head_groups(ctx, CPAlgorithm::kAllGather, kv_heads, kv_heads);
  }

  // Group by group (one group: the whole K/V): the local chunks of group g, its K/V pieces waited
  // for (the first wait releases the later groups' pieces, which then fly while the groups before
  // them are attended), its remote keys; the groups' outputs joined along the heads per part.
  static at::Tensor overlapped_in_groups(const std::vector<QueryPart>& parts, const at::Tensor& q,
                                         const at::Tensor& k, const at::Tensor& v, int64_t total,
                                         int64_t groups, const AttentionCall& call,
                                         const CPRuntimeContext& ctx, const ArrivedFn& arrived) {
    const int64_t hd = ctx.layout.heads_dim, gq = q.size(hd) / groups;
    auto kp = arrived.pieces(QKVRole::kK, k), vp = arrived.pieces(QKVRole::kV, v);
    HP_INTERNAL_ASSERT(
        static_cast<int64_t>(kp.size()) == groups && static_cast<int64_t>(vp.size()) == groups,
        "all_gather head groups: ", kp.size(), " K and ", vp.size(), " V pieces for ", groups,
        " groups");
    std::vector<std::vector<at::Tensor>> outs(parts.size());  // [part][group]
    for (int64_t g = 0; g < groups; ++g) {
      std::vector<QueryPart> group_parts;
      for (const auto& p : parts) {
        QueryPart gp{p.q.narrow(hd, g * gq, gq), p.state};
        gp.state.head_offset += g * gq;
        group_parts.push_back(std::move(gp));
      }
      auto gathered = [&] {
        auto kg = kp[g].wait(), vg = vp[g].wait();
        detail::natural_order_kv(kg, vg, ctx);
        return std::make_pair(kg, vg);
      };
      auto landed = [&] {
        if (ctx.async_always_local_first) return false;
        // Both asked every time: a first query may only start what tells (comm/transport.h).
        const bool k_landed = kp[g].landed(), v_landed = vp[g].landed();
        return k_landed && v_landed;
      };
      auto group_outs = detail::attend_local_first(group_parts, kp[g].emitted, vp[g].emitted, total,
                                                   call, gathered, landed);
      for (size_t i = 0; i < parts.size(); ++i)
        outs[i].push_back(group_outs[i]);
    }
    std::vector<at::Tensor> joined;
    for (const auto& o : outs)
      joined.push_back(o.size() == 1 ? o[0] : at::cat(o, hd));
    return ctx.load_balance ? detail::head_tail_restore(joined, ctx) : joined[0];
  }
};

}  // namespace

std::shared_ptr<const CPStrategy> make_all_gather_strategy() {
  return std::make_shared<AllGatherStrategy>();
}

}  // namespace hp::cp
