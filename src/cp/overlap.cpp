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
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, at::TensorList xs) {
    ctx->saved_data["n"] = static_cast<int64_t>(xs.size());
    for (size_t i = 0; i < xs.size(); ++i) {
      ctx->saved_data["sizes" + std::to_string(i)] = xs[i].sizes().vec();
      ctx->saved_data["dtype" + std::to_string(i)] = static_cast<int64_t>(xs[i].scalar_type());
    }
    return at::zeros({}, xs[0].options());
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list) {
    torch::autograd::variable_list out;
    for (int64_t i = 0; i < ctx->saved_data["n"].toInt(); ++i) {
      const auto dtype =
          static_cast<at::ScalarType>(ctx->saved_data["dtype" + std::to_string(i)].toInt());
      out.push_back(
          at::zeros(ctx->saved_data["sizes" + std::to_string(i)].toIntVector(), at::dtype(dtype)));
    }
    return out;
  }
};

at::Tensor anchored(const at::Tensor& out, std::vector<at::Tensor> gathered) {
  return out + GatheredAnchor::apply(at::TensorList(gathered)).to(out.scalar_type());
}

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

struct Env {
  const attention::AttentionOptions& options;
  const attention::AttentionFn& inner;
  const CPAdapter& adapter;
  const CPStrategy& strategy;
  int64_t seq;
};

// Attention of queries at global positions [q_begin, ..) against keys at [key_begin, ..).
attention::AttentionResult sub_call(const Env& e, CallState st, const at::Tensor& q,
                                    int64_t q_begin, const at::Tensor& k, const at::Tensor& v,
                                    int64_t key_begin) {
  st.causal = {q_begin - key_begin, q.size(e.seq), k.size(e.seq)};
  auto opts = e.adapter.rewrite(e.options, st, e.strategy);
  if (opts.causal && key_begin + k.size(e.seq) <= q_begin + 1) {
    opts.causal = false;  // every key precedes (or is) the first query: no mask
    opts.causal_meta.reset();
  }
  return e.inner(q, k, v, opts);
}

}  // namespace

bool can_overlap(const CPStrategy& strategy, const CPRuntimeContext& ctx,
                 const attention::AttentionOptions& options) {
  const bool layout_ok = (ctx.layout.seq_dim == 2 && ctx.layout.head_dim == 1) ||
                         (ctx.layout.seq_dim == 1 && ctx.layout.head_dim == 2);
  const bool strategy_ok = strategy.name() == "all_gather" || strategy.name() == "ulysses";
  return strategy_ok && layout_ok && !options.mask.defined() && !options.mask_fn &&
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
  const Env env{options, inner, adapter, strategy, seq};
  auto call = [&](const QueryPart& part, const at::Tensor& kk, const at::Tensor& vv,
                  int64_t key_begin) {
    return sub_call(env, part.state, part.q, part.state.causal.q_offset, kk, vv, key_begin);
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
  outs[0] = anchored(outs[0], {kg, vg});
  return ctx.load_balance ? head_tail_restore(outs, ctx) : outs[0];
}

// Ulysses: the rank's own head group at its own positions is local before any all-to-all;
// its diagonal block is computed while Q, K, V travel, then the rest of the sequence:
//   queries [0, r*s)          x keys [0, r*s)   (causal)
//   queries [r*s, (r+1)*s)    x diagonal (local, first) + keys [0, r*s) (+ [(r+1)*s, S) dense)
//   queries [(r+1)*s, S)      x keys [0, S)     (causal, offset (r+1)*s)
at::Tensor overlapped_ulysses(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                              const attention::AttentionOptions& options,
                              const attention::AttentionFn& inner, const CPAdapter& adapter,
                              const CPStrategy& strategy, const CPRuntimeContext& ctx,
                              const ConsumeFn& consume) {
  const auto& l = ctx.layout;
  const int64_t seq = l.seq_dim, p = ctx.topology->ulysses_degree, r = ctx.topology->ulysses_rank;
  const int64_t s = q.size(seq), total = s * p;
  const int64_t nq = q.size(l.head_dim) / p, nkv = k.size(l.head_dim) / p;
  const Env env{options, inner, adapter, strategy, seq};
  CallState st;
  st.local_seq = s;
  st.head_offset = r * nq;
  const int64_t own = r * s, own_end = own + s;
  // 1. The diagonal block of the own head group, from the local tensors.
  auto diag = sub_call(env, st, q.narrow(l.head_dim, r * nq, nq), own,
                       k.narrow(l.head_dim, r * nkv, nkv), v.narrow(l.head_dim, r * nkv, nkv), own);
  // 2. Q, K, V with the own head group over the whole sequence.
  auto qg = consume(QKVRole::kQ, q), kg = consume(QKVRole::kK, k), vg = consume(QKVRole::kV, v);
  auto keys = [&](int64_t b, int64_t e) {
    return std::make_pair(kg.narrow(seq, b, e - b), vg.narrow(seq, b, e - b));
  };
  // 3. The rest, as query segments in sequence order.
  std::vector<at::Tensor> segments;
  if (own > 0) {
    auto kv = keys(0, options.causal ? own : total);
    segments.push_back(sub_call(env, st, qg.narrow(seq, 0, own), 0, kv.first, kv.second, 0).out);
  }
  std::vector<attention::AttentionResult> own_parts{diag};
  auto q_own = qg.narrow(seq, own, s);
  if (own > 0) {
    auto kv = keys(0, own);
    own_parts.push_back(sub_call(env, st, q_own, own, kv.first, kv.second, 0));
  }
  if (!options.causal && own_end < total) {
    auto kv = keys(own_end, total);
    own_parts.push_back(sub_call(env, st, q_own, own, kv.first, kv.second, own_end));
  }
  segments.push_back(merge(own_parts, l));
  if (own_end < total) {
    auto kv = keys(0, total);
    segments.push_back(
        sub_call(env, st, qg.narrow(seq, own_end, total - own_end), own_end, kv.first, kv.second, 0)
            .out);
  }
  auto out = segments.size() == 1 ? segments[0] : at::cat(segments, seq);
  out = anchored(out, {qg, kg, vg});
  return strategy.restore_output({out}, PreparedQKV{}, ctx);
}

}  // namespace hp::cp::detail
