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
  const int64_t p = plan.ring.size, r = plan.ring.rank, last = plan.last_step;
  const int64_t dqk = q.size(-1);
  // One call's gradients: dq into `dq_to`'s query rows; dK/dV into this rank's own chunks
  // (from the statistics they cover the chunk's first rows only: added at row 0).
  auto place = [&](const Pair& pair, const attention::AttentionGrads& g, const at::Tensor& dq_to) {
    if (g.dq.defined()) query_rows(plan, dq_to, pair).add_(g.dq);
    if (g.dk.defined())
      plan.chunk(dk, pair.kc).narrow(l.seq_dim, 0, g.dk.size(l.seq_dim)).add_(g.dk);
    if (g.dv.defined())
      plan.chunk(dv, pair.kc).narrow(l.seq_dim, 0, g.dv.size(l.seq_dim)).add_(g.dv);
  };
  // One call of a member's queries against the own K/V: its q, dout and statistics (lse,
  // delta; [..., 1] in the output's frame) are this rank's or a bundle's views.
  struct Queries {
    at::Tensor q, dout, lse, delta;
  };
  auto attend = [&](const Pair& pair, const Queries& x, const at::Tensor& dq_to) {
    auto qi = query_rows(plan, x.q, pair), d_o = query_rows(plan, x.dout, pair);
    auto big_l = query_rows(plan, x.lse, pair), dl = query_rows(plan, x.delta, pair);
    auto kc = plan.chunk(k, pair.kc), vc = plan.chunk(v, pair.kc);
    if (plan.from_stats) {
      place(pair,
            plan.call->grads_from_stats(qi, kc, vc, dl.squeeze(-1), lse_to_primitive(big_l, l), d_o,
                                        pair.st),
            dq_to);
      return;
    }
    at::AutoGradMode grad_on(true);
    auto qx = qi.detach().requires_grad_(true), kx = kc.detach().requires_grad_(true),
         vx = vc.detach().requires_grad_(true);
    auto res = (*plan.call)(qx, kx, vx, pair.st);
    place(pair, seeded_grad(plan, qx, kx, vx, res, big_l, dl, d_o), dq_to);
  };
  // A bundle as it travels: [q | dout] and [lse | delta].
  auto unpack = [&](const at::Tensor& qd, const at::Tensor& st) {
    return Queries{qd.narrow(-1, 0, dqk), qd.narrow(-1, dqk, qd.size(-1) - dqk),
                   st.narrow(-1, 0, 1), st.narrow(-1, 1, 1)};
  };
  const Queries own{q, dout, m, delta};
  auto own_half = [&](int half) {
    if (plan.from_stats) {
      for (const auto& pair : pairs_for(plan, r, half))
        attend(pair, own, dq);
      return;
    }
    for (auto& c : kept) {  // graphs kept from forward: no recompute
      if (c.half != half) continue;
      place(c.pair,
            seeded_grad(plan, c.qi, c.kc, c.vc, c.r, query_rows(plan, m, c.pair),
                        query_rows(plan, delta, c.pair), query_rows(plan, dout, c.pair)),
            dq);
      c = KeptCall{};  // its graph is spent: free it now
    }
  };
  // Both parts of the bundle travel to rank r-1; the Pendings hold them until they land.
  auto shift_bundle = [&](const at::Tensor& a, const at::Tensor& b) {
    auto first = comm::shift_async(*plan.ring.group, a, -1);  // in this order on every rank
    return std::make_pair(std::move(first), comm::shift_async(*plan.ring.group, b, -1));
  };
  std::pair<comm::Pending, comm::Pending> next;
  if (last >= 1) {  // the own bundle: a copy alive only until its shift has landed
    next = shift_bundle(at::cat({q, dout.to(q.scalar_type())}, -1).contiguous(),
                        at::cat({m, delta}, -1).contiguous());
  }
  own_half(0);             // hides the first shift
  comm::Pending arriving;  // the dQ accumulator of the bundle here, from rank r+1
  for (int64_t step = 1; step <= last; ++step) {
    auto here_qd = next.first(), here_st = next.second();  // the queries of rank r + step
    if (step < last) next = shift_bundle(here_qd, here_st);
    auto acc = at::zeros_like(q);
    const auto here = unpack(here_qd, here_st);
    for (const auto& pair : pairs_between(plan, (r + step) % p, r))
      attend(pair, here, acc);
    if (arriving) acc.add_(arriving());
    // On to rank r-1 with the bundle; after the last step home to rank r + last.
    arriving = comm::shift_async(*plan.ring.group, acc, step < last ? -1 : static_cast<int>(last));
  }
  own_half(1);  // hides the accumulator's last hop
  if (arriving) dq += arriving();
  return {dq, dk, dv, at::Tensor(), at::Tensor()};
}

}  // namespace hp::cp::detail::ring
