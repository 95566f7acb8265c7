// Internal to the ring (strategy_ring.cpp, ring_queries_backward.cpp): the plan its forward
// and both backward forms share, the pairs of chunks a step attends, and the backward in which
// the queries travel (ring_backward; the sketch atop strategy_ring.cpp).
#pragma once

#include <memory>
#include <vector>

#include <ATen/ATen.h>

#include "hp/attention/attention.h"
#include "ring_routes.h"
#include "strategy_pieces.h"

namespace hp::cp::detail::ring {

// What a receive of a chunk shaped like `x` needs (its sizes and options), without keeping x's
// memory: a view of one element.
inline at::Tensor shape_like(const at::Tensor& x) {
  return at::zeros({}, x.options()).expand(x.sizes());
}

// What forward and backward share: the call (a copy), where the ring runs and the chunking.
struct RingPlan {
  std::shared_ptr<const AttentionCall> call;
  QKVLayout layout;
  RingGroup ring;
  int64_t s = 0;            // local sequence length
  int64_t len = 0;          // rows per chunk (ring.chunk_len)
  int64_t dk = 0;           // last dim of k (the [k | v] buffer splits there)
  Routes keys;              // the [k | v] chunks (forward; the blocks backward)
  Routes bundles;           // the query bundles (plan.queries)
  bool from_stats = false;  // backward from the merged out/lse (call.offers_grads_from_stats)
  bool queries = false;     // backward: the queries travel (ring_moves_queries), not the blocks

  // Chunk ids (of the global sequence cut into `len`-row chunks) of the rows `rank` holds.
  const std::vector<int64_t>& chunk_ids(int64_t rank) const { return ring.chunks[rank]; }
  at::Tensor chunk(const at::Tensor& x, size_t i) const {
    return x.narrow(layout.seq_dim, static_cast<int64_t>(i) * len, len);
  }
};

// One attention call of a step: query chunk `qi` of this rank against key chunk `kc` of the
// block here.
struct Pair {
  size_t qi = 0, kc = 0;
  int64_t row0 = 0, rows = 0;  // the query rows of chunk qi the call takes
  CallState st;
};

// Rows [row0, row0 + rows) of query chunk qi of x.
inline at::Tensor query_rows(const RingPlan& plan, const at::Tensor& x, const Pair& pair) {
  return plan.chunk(x, pair.qi).narrow(plan.layout.seq_dim, pair.row0, pair.rows);
}

// The calls of ring member `dst`'s queries against the block of member `src`: causal blocks
// above the diagonal and blocks no packed document spans are left out (never computed). `half`
// 0 / 1 keeps the first / second half of every query chunk's rows (-1: all rows). Positions are
// global, so any member can tell what any other attends.
std::vector<Pair> pairs_between(const RingPlan& plan, int64_t dst, int64_t src, int half = -1);

// The routes of the K/V chunks (`queries` false: a member's chunk goes where that member's
// keys are attended) or of the query bundles (true: where its queries attend): for each
// direction the hops every chunk needs, and the direction with fewer in all (ties: `preferred`).
// Every member computes the same routes from the global positions, without communication.
Routes plan_routes(const RingPlan& plan, bool queries, int preferred);

// This rank's calls at the step that holds the block of member `src`.
inline std::vector<Pair> pairs_for(const RingPlan& plan, int64_t src, int half = -1) {
  return pairs_between(plan, plan.ring.rank, src, half);
}

// One call of the own block whose autograd graph is kept from forward: its K/V are this rank's
// inputs (one contiguous copy per key chunk, shared), so keeping it costs little more than its
// partial output, and its backward needs no recompute. `half` 0 / 1: the half of the own block's
// calls run before / after the ring.
struct KeptCall {
  Pair pair;
  int half = 0;
  at::Tensor qi, kc, vc;  // the leaves the call ran on
  attention::AttentionResult r;
};

// One call's gradients from its graph: with O = sum_b w_b o_b, w_b = exp(lse_b - L),
//   dO/do_b = w_b,   d<dO, O>/dlse_b = w_b (<dO, o_b> - delta),  delta = <dO, O>   (per row)
// handed to the call's own autograd. `big_l`, `delta` (statistics' frame and dtype) and `d_o`
// are the rows of the call's queries; {dq, dk, dv} as the leaves qi, kc, vc (undefined where
// the graph does not reach one).
attention::AttentionGrads seeded_grad(const RingPlan& plan, const at::Tensor& qi,
                                      const at::Tensor& kc, const at::Tensor& vc,
                                      const attention::AttentionResult& r, const at::Tensor& big_l,
                                      const at::Tensor& delta, const at::Tensor& d_o);

// The backward with the queries travelling (plan.queries; the sketch atop strategy_ring.cpp):
// this rank's [q | dout] and [lse | delta] travel their routes (plan.bundles), each member on
// the way attends them against its own K/V (from the statistics, or recomputed where the
// primitive offers none), keeps the dK/dV and adds the dQ to the accumulator that follows them
// and goes home from the route's last member. `saved`: the
// forward's q, k, v, out, lse (output frame); `delta` = rowsum(dout * out) in lse's frame and
// dtype; `kept`: the own block's calls with their graphs (recomputing form; spent here).
// Returns the ring node's gradients {dq, dk, dv, {}, {}}.
std::vector<at::Tensor> queries_backward(const RingPlan& plan, const std::vector<at::Tensor>& saved,
                                         const at::Tensor& dout, const at::Tensor& delta,
                                         std::vector<KeptCall>& kept);

}  // namespace hp::cp::detail::ring
