// Async all_gather with the communication hidden behind attention (local chunks first):
//
//   rank r holds K/V chunk(s) L (one, or two under head-tail balance); its queries Q (same
//   positions). The gathers of K and V were launched at their handoff points.
//     1. for each query part: attention(Q_part, K[L ∩ visible]) per local chunk  -> (o, lse)
//     2. wait K, V (all_gather)                                   (they flew during step 1)
//     3. for each query part: attention(Q_part, K[gap]) per visible gap outside L  -> (o, lse)
//     4. out_part = Σ o_i · exp(lse_i − logsumexp_i lse_i)
//   Backward runs 3 before 2's inverse (dK, dV reduce-scatter) and 1 after it, so the
//   reduce-scatter flies while the local chunks' backward computes.
#include "overlap.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

#include "hp/common/check.h"
#include "strategy_pieces.h"

namespace hp::cp::detail {
namespace {

// A zero that depends on the gathered K and V: every rank's graph uses both (even a rank whose
// queries see no remote key), so every rank launches their inverse collectives, K and V from
// the same node and hence in the same order on every rank.
struct GatheredAnchor : torch::autograd::Function<GatheredAnchor> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& k,
                            const at::Tensor& v) {
    ctx->saved_data["k_sizes"] = k.sizes().vec();
    ctx->saved_data["v_sizes"] = v.sizes().vec();
    ctx->saved_data["dtype"] = static_cast<int64_t>(k.scalar_type());
    return at::zeros({}, k.options());
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list) {
    const auto dtype = static_cast<at::ScalarType>(ctx->saved_data["dtype"].toInt());
    return {at::zeros(ctx->saved_data["k_sizes"].toIntVector(), at::dtype(dtype)),
            at::zeros(ctx->saved_data["v_sizes"].toIntVector(), at::dtype(dtype))};
  }
};

struct Range {
  int64_t begin = 0, end = 0;  // global positions [begin, end)
};

// lse [B, N, S] (primitive frame) -> broadcastable against out in the module's layout.
at::Tensor lse_like_out(const at::Tensor& lse, const QKVLayout& l) {
  auto x = l.seq_dim == 2 ? lse : lse.transpose(1, 2);  // BNSD or BSHD
  return x.unsqueeze(-1);
}

at::Tensor merge(const std::vector<attention::AttentionResult>& parts, const QKVLayout& l) {
  if (parts.size() == 1) return parts[0].out;
  std::vector<at::Tensor> lses;
  for (const auto& p : parts) {
    HP_CHECK(p.lse.defined(), "async all_gather overlap: the attention returned no lse");
    lses.push_back(lse_like_out(p.lse, l).to(at::kFloat));
  }
  auto total = at::logsumexp(at::stack(lses), 0);
  at::Tensor out;
  for (size_t i = 0; i < parts.size(); ++i) {
    auto term = parts[i].out * at::exp(lses[i] - total).to(parts[i].out.scalar_type());
    out = out.defined() ? out + term : term;
  }
  return out;
}

}  // namespace

bool can_overlap(const CPStrategy& strategy, const CPRuntimeContext& ctx,
                 const attention::AttentionOptions& options) {
  const bool layout_ok = (ctx.layout.seq_dim == 2 && ctx.layout.head_dim == 1) ||
                         (ctx.layout.seq_dim == 1 && ctx.layout.head_dim == 2);
  return strategy.name() == "all_gather" && layout_ok && !options.mask.defined() &&
         !options.mask_fn &&
         (!ctx.load_balance || ctx.load_balance_form == LoadBalanceForm::kDataOrder) &&
         ctx.topology->cp_size > 1;
}

at::Tensor overlapped_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                const attention::AttentionOptions& options,
                                const attention::AttentionFn& inner, const CPAdapter& adapter,
                                const CPStrategy& strategy, const CPRuntimeContext& ctx,
                                const ConsumeFn& consume) {
  const int64_t seq = ctx.layout.seq_dim;
  const int64_t s_local = q.size(seq), total = s_local * ctx.topology->cp_size;
  // Query parts with their global ranges; the local K/V chunks sit at the same positions.
  std::vector<QueryPart> parts;
  if (ctx.load_balance) {
    parts = head_tail_parts(q, ctx, total);
  } else {
    QueryPart p{q, {}};
    p.state.local_seq = s_local;
    p.state.causal = {ctx.topology->cp_rank * s_local, s_local, total};
    parts.push_back(p);
  }
  std::vector<Range> local;
  std::vector<int64_t> local_offset;
  int64_t off = 0;
  for (const auto& p : parts) {
    local.push_back({p.state.causal.q_offset, p.state.causal.q_offset + p.q.size(seq)});
    local_offset.push_back(off);
    off += p.q.size(seq);
  }
  auto call = [&](const QueryPart& part, const at::Tensor& kk, const at::Tensor& vv,
                  int64_t key_begin) {
    CallState st = part.state;
    const int64_t q_begin = part.state.causal.q_offset;
    st.causal = {q_begin - key_begin, part.q.size(seq), kk.size(seq)};
    auto opts = adapter.rewrite(options, st, strategy);
    if (opts.causal && key_begin + kk.size(seq) <= q_begin + 1) {
      opts.causal = false;  // every key precedes (or is) the part's first query: no mask
      opts.causal_meta.reset();
    }
    return inner(part.q, kk, vv, opts);
  };
  std::vector<std::vector<attention::AttentionResult>> results(parts.size());
  auto visible_end = [&](const QueryPart& p) {
    return options.causal ? p.state.causal.q_offset + p.q.size(seq) : total;
  };
  // 1. Local chunks, while the all-gathers fly.
  for (size_t i = 0; i < parts.size(); ++i) {
    for (size_t c = 0; c < local.size(); ++c) {
      const int64_t end = std::min(local[c].end, visible_end(parts[i]));
      if (end <= local[c].begin) continue;
      const int64_t len = end - local[c].begin;
      results[i].push_back(call(parts[i], k.narrow(seq, local_offset[c], len),
                                v.narrow(seq, local_offset[c], len), local[c].begin));
    }
  }
  // 2. The gathered K/V (natural order).
  auto kg = consume(QKVRole::kK, k), vg = consume(QKVRole::kV, v);
  if (ctx.load_balance) {
    kg = natural_order(kg, ctx);
    vg = natural_order(vg, ctx);
  }
  // 3. The visible key ranges outside this rank's chunks.
  std::vector<Range> sorted = local;
  std::sort(sorted.begin(), sorted.end(),
            [](const Range& a, const Range& b) { return a.begin < b.begin; });
  for (size_t i = 0; i < parts.size(); ++i) {
    const int64_t vis = visible_end(parts[i]);
    int64_t at_pos = 0;
    auto gap = [&](int64_t b, int64_t e) {
      e = std::min(e, vis);
      if (e <= b) return;
      results[i].push_back(call(parts[i], kg.narrow(seq, b, e - b), vg.narrow(seq, b, e - b), b));
    };
    for (const auto& r : sorted) {
      gap(at_pos, r.begin);
      at_pos = r.end;
    }
    gap(at_pos, total);
  }
  // 4. Merge per part, then the strategy's output layout.
  std::vector<at::Tensor> outs;
  for (const auto& r : results)
    outs.push_back(merge(r, ctx.layout));
  outs[0] = outs[0] + GatheredAnchor::apply(kg, vg).to(outs[0].scalar_type());
  return ctx.load_balance ? head_tail_restore(outs, ctx) : outs[0];
}

}  // namespace hp::cp::detail
