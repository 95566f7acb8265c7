// The ring's plan pieces that both backward forms use (the pairs of chunks a step attends, the
// seeded gradients of one call), and the backward with the queries travelling (ring_plan.h; the
// data movement is sketched atop strategy_ring.cpp).
#include "ring_plan.h"

#include <utility>

#include <ATen/ATen.h>

#include <torch/csrc/autograd/autograd.h>

#include "hp/comm/async_transfer.h"

namespace hp::cp::detail::ring {

std::vector<Pair> pairs_between(const RingPlan& plan, int64_t dst, int64_t src, int half) {
  const bool causal = plan.call->options().causal;
  const auto &queries = plan.chunk_ids(dst), &keys = plan.chunk_ids(src);
  std::vector<Pair> out;
  for (size_t kc = 0; kc < keys.size(); ++kc) {
    for (size_t qi = 0; qi < queries.size(); ++qi) {
      if (causal && keys[kc] > queries[qi]) continue;
      const int64_t first = plan.len / 2;
      Pair pair{qi,
                kc,
                half == 1 ? first : 0,
                half < 0    ? plan.len
                : half == 0 ? first
                            : plan.len - first,
                {}};
      if (pair.rows == 0) continue;
      pair.st.local_seq = plan.s;
      pair.st.head_offset = plan.ring.head_offset;
      pair.st.causal = {(queries[qi] - keys[kc]) * plan.len + pair.row0, pair.rows, plan.len};
      pair.st.kv_start = keys[kc] * plan.len;
      if (plan.call->hidden(pair.st)) continue;
      out.push_back(pair);
    }
  }
  return out;
}

Routes plan_routes(const RingPlan& plan, bool queries, int preferred) {
  std::vector<size_t> chunks;
  for (int64_t o = 0; o < plan.ring.size; ++o)
    chunks.push_back(plan.chunk_ids(o).size());
  // Whether member d attends chunk c of member o (its keys; or its queries, against d's keys).
  auto needs = [&](int64_t d, int64_t o, size_t c) {
    for (const auto& pair : queries ? pairs_between(plan, o, d) : pairs_between(plan, d, o)) {
      if ((queries ? pair.qi : pair.kc) == c) return true;
    }
    return false;
  };
  return route_chunks(chunks, needs, preferred);
}

attention::AttentionGrads seeded_grad(const RingPlan& plan, const at::Tensor& qi,
                                      const at::Tensor& kc, const at::Tensor& vc,
                                      const attention::AttentionResult& r, const at::Tensor& big_l,
                                      const at::Tensor& delta, const at::Tensor& d_o) {
  const auto& l = plan.layout;
  at::AutoGradMode grad_on(true);
  auto w = at::exp(lse_like_out(r.lse.detach(), l) - big_l);
  w = at::where(big_l.isneginf(), at::zeros_like(w), w);
  auto g_out = d_o * w.to(d_o.scalar_type());
  auto dot = (d_o.to(w.scalar_type()) * r.out.detach().to(w.scalar_type())).sum(-1, true);
  auto g_lse = w * (dot - delta);
  auto g = torch::autograd::grad({r.out, r.lse}, {qi, kc, vc}, {g_out, lse_to_primitive(g_lse, l)},
                                 /*retain_graph=*/false, /*create_graph=*/false,
                                 /*allow_unused=*/true);
  return {g[0], g[1], g[2]};
}

std::vector<at::Tensor> queries_backward(const RingPlan& plan, const std::vector<at::Tensor>& saved,
                                         const at::Tensor& dout, const at::Tensor& delta,
                                         std::vector<KeptCall>& kept) {
  const auto &q = saved[0], &k = saved[1], &v = saved[2], &m = saved[4];
  const auto& l = plan.layout;
  auto dq = at::zeros_like(q), dk = at::zeros_like(k), dv = at::zeros_like(v);
  const int64_t r = plan.ring.rank;
  const int64_t dqk = q.size(-1);
  // One call's gradients: dq into `dq_rows`, dK/dV into this rank's own chunks (from the
  // statistics they cover the chunk's first rows only: added at row 0).
  auto place = [&](const Pair& pair, const attention::AttentionGrads& g,
                   const at::Tensor& dq_rows) {
    if (g.dq.defined()) dq_rows.add_(g.dq);
    if (g.dk.defined())
      plan.chunk(dk, pair.kc).narrow(l.seq_dim, 0, g.dk.size(l.seq_dim)).add_(g.dk);
    if (g.dv.defined())
      plan.chunk(dv, pair.kc).narrow(l.seq_dim, 0, g.dv.size(l.seq_dim)).add_(g.dv);
  };
  // One call of a member's queries against the own K/V, given the call's rows of q, dout and
  // the statistics (lse, delta; [..., 1] in the output's frame).
  auto attend = [&](const Pair& pair, const at::Tensor& qi, const at::Tensor& d_o,
                    const at::Tensor& big_l, const at::Tensor& dl, const at::Tensor& dq_rows) {
    auto kc = plan.chunk(k, pair.kc), vc = plan.chunk(v, pair.kc);
    attention::AttentionGrads g;
    if (plan.from_stats) {
      g = plan.call->grads_from_stats(qi, kc, vc, dl.squeeze(-1), lse_to_primitive(big_l, l), d_o,
                                      pair.st);
    } else {
      at::AutoGradMode grad_on(true);
      auto qx = qi.detach().requires_grad_(true), kx = kc.detach().requires_grad_(true),
           vx = vc.detach().requires_grad_(true);
      auto res = (*plan.call)(qx, kx, vx, pair.st);
      g = seeded_grad(plan, qx, kx, vx, res, big_l, dl, d_o);
    }
    place(pair, g, dq_rows);
  };
  auto own_half = [&](int half) {
    if (plan.from_stats) {
      for (const auto& pair : pairs_for(plan, r, half)) {
        attend(pair, query_rows(plan, q, pair), query_rows(plan, dout, pair),
               query_rows(plan, m, pair), query_rows(plan, delta, pair),
               query_rows(plan, dq, pair));
      }
      return;
    }
    for (auto& c : kept) {  // graphs kept from forward: no recompute
      if (c.half != half) continue;
      place(c.pair,
            seeded_grad(plan, c.qi, c.kc, c.vc, c.r, query_rows(plan, m, c.pair),
                        query_rows(plan, delta, c.pair), query_rows(plan, dout, c.pair)),
            query_rows(plan, dq, c.pair));
      c = KeptCall{};  // its graph is spent: free it now
    }
  };
  // A bundle travels one query chunk at a time (head-tail balance: two), each as [q | dout]
  // and [lse | delta], so a step waits only for the chunk its next calls read and forwards it
  // at once; each chunk's dQ accumulator follows it, and goes home from the last member on its
  // route (plan.bundles). Pair::row0 and rows index within a chunk.
  const auto& route = plan.bundles;
  auto& group = *plan.ring.group;
  const size_t nq = plan.chunk_ids(r).size();
  auto rows = [&](const at::Tensor& chunk, const Pair& pair, int64_t from, int64_t width) {
    return chunk.narrow(l.seq_dim, pair.row0, pair.rows).narrow(-1, from, width);
  };
  // The shapes of the bundles' parts that arrive and of their dQ accumulators.
  std::vector<at::Tensor> qd_like(nq), st_like(nq), dq_like(nq);
  for (size_t qi = 0; qi < nq; ++qi) {
    auto shape = plan.chunk(q, qi).sizes().vec();
    dq_like[qi] = shape_like(plan.chunk(q, qi));
    shape.back() += dout.size(-1);
    qd_like[qi] = at::zeros({}, q.options()).expand(shape);
    shape.back() = 2;
    st_like[qi] = at::zeros({}, m.options()).expand(shape);
  }
  // Chunk qi's two parts in flight to this rank, each leg only where the route runs.
  std::vector<std::pair<comm::Pending, comm::Pending>> next(nq);
  auto shift_on = [&](int64_t step, size_t qi, const at::Tensor& qd, const at::Tensor& st) {
    const bool on = route.moves_on(r, step, qi), in = route.here(r, step + 1, qi);
    next[qi].first = comm::shift_legs_async(group, on ? qd : at::Tensor(),
                                            in ? qd_like[qi] : at::Tensor(), route.dir);
    next[qi].second = comm::shift_legs_async(group, on ? st : at::Tensor(),
                                             in ? st_like[qi] : at::Tensor(), route.dir);
  };
  // The own bundle, alive only until its first shifts land; this order on every rank.
  if (route.last >= 1) {
    for (size_t qi = 0; qi < nq; ++qi) {
      shift_on(
          0, qi,
          at::cat({plan.chunk(q, qi), plan.chunk(dout, qi).to(q.scalar_type())}, -1).contiguous(),
          at::cat({plan.chunk(m, qi), plan.chunk(delta, qi)}, -1).contiguous());
    }
  }
  own_half(0);  // hides the first shift
  // The dQ accumulators: from the member before on the route; home to this rank; sent home.
  std::vector<comm::Pending> acc_in(nq), home(nq), homeward;
  for (int64_t step = 1; step <= route.last; ++step) {
    const int64_t from = route.origin_at(r, step);  // the queries of that member are here
    const auto pairs = pairs_between(plan, from, r);
    for (size_t qi = 0; qi < nq; ++qi) {
      auto qd = next[qi].first(), st = next[qi].second();  // undefined where not routed here
      const bool on = route.moves_on(r, step, qi);
      if (step < route.last) shift_on(step, qi, qd, st);
      at::Tensor acc;
      if (qd.defined()) {
        acc = at::zeros(dq_like[qi].sizes(), dq_like[qi].options());
        for (const auto& pair : pairs) {
          if (pair.qi != qi) continue;
          attend(pair, rows(qd, pair, 0, dqk), rows(qd, pair, dqk, qd.size(-1) - dqk),
                 rows(st, pair, 0, 1), rows(st, pair, 1, 1), rows(acc, pair, 0, dqk));
        }
      }
      auto before = acc_in[qi] ? acc_in[qi]() : at::Tensor();
      if (before.defined()) acc.add_(before);
      // On with its chunk, or home (a shift back by `step`) after the last member it meets.
      if (step < route.last) {
        acc_in[qi] = comm::shift_legs_async(
            group, on ? acc : at::Tensor(),
            route.here(r, step + 1, qi) ? dq_like[qi] : at::Tensor(), route.dir);
      }
      auto back = comm::shift_legs_async(group, acc.defined() && !on ? acc : at::Tensor(),
                                         route.hops_of(r, qi) == step ? dq_like[qi] : at::Tensor(),
                                         -route.dir * static_cast<int>(step));
      (route.hops_of(r, qi) == step ? home[qi] : homeward.emplace_back()) = std::move(back);
    }
  }
  own_half(1);  // hides the accumulators' last hop
  for (size_t qi = 0; qi < nq; ++qi) {
    if (home[qi]) plan.chunk(dq, qi).add_(home[qi]());
  }
  for (auto& sent : homeward)
    sent();
  return {dq, dk, dv, at::Tensor(), at::Tensor()};
}

}  // namespace hp::cp::detail::ring
