// ring: K/V blocks travel around the CP group by point-to-point shifts while each rank attends
// its queries to the block it holds; partial results merged by log-sum-exp.
//
//   buffer = [k | v] of this rank's shard, one contiguous tensor per key chunk (head-tail
//     balance: two), each travelling on its own
//   routes (plan_routes): every chunk goes one way round, all in the direction with fewer hops
//     in all, and stops after the last member on its way that attends it; every member computes
//     the routes from the global positions. Causal, contiguous: to rank r+1, each block only to
//     the later members (half the bytes of a full pass). Causal, head-tail balance (data-order
//     chunks 2r and 2P-2r-1): a key chunk reaches only the members that hold a later query
//     chunk (chunk 2P-1, rank 0's second, never leaves; P = 4: 19 of 24 chunk hops, the query
//     bundles likewise). Not causal: every chunk to every member.
//   step i = 0 .. J (J: the longest route; rank r holds the chunks of rank r -/+ i), chunk by
//     chunk: wait for the chunk (not the whole block), pass it on where its route goes on
//     (async), then attend it (the step's other chunk still arriving meanwhile):
//       causal, key block after the query block: skipped (never computed)
//       causal, the diagonal: causal mask;  key block before: unmasked;  not causal: unmasked
//       packed documents: a block no document spans with the query chunk is skipped too, and
//       routes end where the documents do (no member attends a chunk: it never travels)
//     (each chunk's transfer overlaps the attention of the chunks before it)
//   out, lse merged by log-sum-exp as the blocks arrive (one custom autograd node)
//   head-tail balance (data-order shards: chunks 2r and 2P-2r-1): each of the two query chunks
//   against each of the two key chunks of the block, by their chunk ids.
//   backward: the chunks travel their routes again, each followed by a dK/dV accumulator that
//     goes home (one shift back) from the last member on the route:
//     where the primitive offers backward_from_stats (blockwise), each visible call's dQ, dK, dV
//     come straight from the merged (out, lse) and dO: nothing recomputed, no graph kept;
//     otherwise (the recomputing form) each step recomputes the visible calls of the chunk here
//     (attention's own autograd, seeded with dO and the lse gradient of the merge), adds its
//     dK/dV to the accumulator that arrives from the member before on the route and passes it
//     on. The own block's calls run half before the ring (hiding the first shift) and half
//     after it (hiding the accumulators' last hops); their dK/dV never travel.
//   ring_keep_blocks: forward keeps every chunk that arrived (at most the whole K/V, as
//     all_gather holds), so in backward only the accumulators travel (each flying while the
//     next kept chunk's gradients compute) and the own block's calls all run after the ring.
//   the queries travel instead (ring_backward=queries, or auto where that is fewer bytes:
//     volume.h, ring_moves_queries): this rank's [q | dout] and [lse | delta] (delta =
//     rowsum(dout * out)), one query chunk at a time on routes of their own (causal: to rank
//     r-1, the head chunk only to the members before it), each chunk's dQ accumulator following
//     it: each member attends them against its own K/V, keeps the dK/dV and adds the dQ; after
//     the last member on the route the accumulator goes home. dK/dV never leave their rank.
//     The own block's calls hide the first shift and the last hops, as above.
// Memory: the saved q, k, v, out, lse of this rank, and at most two K/V blocks (the one here and
// the one arriving) in forward and in backward (never the whole sequence). The own block's
// calls keep their autograd graph from forward (over one contiguous copy of each own key
// chunk, shared by the calls that read it): only the blocks that travelled are recomputed.
// From the statistics, forward keeps nothing beyond the saved q, k, v, out, lse.
// Bytes (volume.h: ring_chunk_counts; with documents at most these): forward the chunks on
// their routes; backward the chunks again and one accumulator per chunk that arrived, or the
// accumulators alone with ring_keep_blocks, or the query bundles and their dQ accumulators.
#include <limits>
#include <memory>
#include <utility>
#include <vector>

#include <ATen/ATen.h>

#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>

#include "hp/comm/async_transfer.h"
#include "hp/common/capsule.h"
#include "hp/common/check.h"
#include "hp/cp/sequence.h"
#include "hp/cp/volume.h"
#include "ring_plan.h"
#include "strategy_pieces.h"

namespace hp::cp {
namespace {

// The ring's heads of a shape.
RingHeads heads_of(const AttentionShape& s) {
  return {s.q_heads, s.kv_heads, s.qk_dim, s.v_dim_or_qk(), s.element_size};
}

class RingStrategy final : public CPStrategy {
 public:
  std::string name() const override { return "ring"; }
  std::string summary() const override {
    return "K/V blocks passed around the CP ring by point-to-point shifts, each attended while "
           "the next travels (any head count; head-tail load balance, data order)";
  }
  void normalize(ContextParallelConfig& c, int64_t cp_size) const override {
    HP_CHECK(!c.ulysses_degree || *c.ulysses_degree == 1,
             "cp_config.ulysses_degree=", c.ulysses_degree.value_or(0),
             " with algorithm=ring: ring uses no Ulysses groups; drop ulysses_degree (cp_size=",
             cp_size, ")");
    c.ulysses_degree = 1;
    detail::check_data_order_balance(c, "ring");
  }
  bool supports_load_balance() const override { return true; }
  // The chunks this rank sends on their routes (volume.h: ring_chunk_counts); backward the
  // chunks again and their accumulators, the accumulators alone where forward kept the blocks,
  // or the query bundles and their dQ accumulators.
  int64_t forward_bytes_per_rank(const ContextParallelConfig& c, int64_t p, const AttentionShape& s,
                                 int64_t rank) const override {
    return ring_forward_bytes(ring_member_chunks(p, 1, c.load_balance && p > 1), rank,
                              (s.seq / p) * s.batch, heads_of(s), s.causal);
  }
  int64_t backward_bytes_per_rank(const ContextParallelConfig& c, int64_t p,
                                  const AttentionShape& s, int64_t rank) const override {
    return ring_backward_bytes(c.ring_backward, c.ring_keep_blocks,
                               ring_member_chunks(p, 1, c.load_balance && p > 1), rank,
                               (s.seq / p) * s.batch, heads_of(s), s.causal);
  }
  std::vector<comm::OpKind> required_ops() const override {
    return {comm::OpKind::kSend, comm::OpKind::kRecv};
  }
  std::vector<QKVRole> moved_roles() const override { return {}; }
  void check_options(const attention::AttentionOptions& options,
                     const std::string& who) const override {
    HP_CHECK(!options.mask.defined(), who,
             ": a tensor mask cannot be split into the ring's key blocks (the blocks are merged "
             "by log-sum-exp); express it as a mask function or packed documents, or use "
             "algorithm=all_gather");
  }

  at::Tensor run_sync(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                      const AttentionCall& call, const CPRuntimeContext& ctx) const override {
    const auto& t = *ctx.topology;
    const bool balanced = ctx.load_balance && t.cp_size > 1;
    if (balanced) detail::check_head_tail(q, ctx);
    detail::RingGroup ring{
        t.cp, t.cp_rank, t.cp_size, 0, {}, 0, ctx.ring_keep_blocks, ctx.ring_backward};
    const int64_t s = q.size(ctx.layout.seq_dim);
    ring.chunks = ring_member_chunks(t.cp_size, 1, balanced);
    ring.chunk_len = balanced ? s / 2 : s;
    return detail::ring_attend(q, k, v, call, ctx.layout, ring);
  }

  // Nothing moves before attention: the async schedule is the ring itself (each block's
  // transfer already overlaps the previous block's attention).
  at::Tensor run_async(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                       const AttentionCall& call, const CPRuntimeContext& ctx,
                       const ArrivedFn&) const override {
    return run_sync(q, k, v, call, ctx);
  }
};

}  // namespace

namespace {

using detail::ring::KeptCall;
using detail::ring::Pair;
using detail::ring::pairs_between;
using detail::ring::pairs_for;
using detail::ring::plan_routes;
using detail::ring::queries_backward;
using detail::ring::query_rows;
using detail::ring::RingPlan;
using detail::ring::seeded_grad;
using detail::ring::shape_like;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

using KeptCalls = std::shared_ptr<std::vector<KeptCall>>;
// ring_keep_blocks: [step][key chunk] -> the [k | v] chunk that arrived (undefined where none
// came: its route ended before this rank).
using KeptBlocks = std::shared_ptr<std::vector<std::vector<at::Tensor>>>;

struct RingAttentionFn : torch::autograd::Function<RingAttentionFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k,
                            const at::Tensor& v, std::shared_ptr<const RingPlan> plan,
                            const std::function<void()>& after_first_step) {
    at::NoGradGuard no_grad;
    const auto& l = plan->layout;
    const auto& route = plan->keys;
    const int64_t r = plan->ring.rank;
    const size_t nq = plan->chunk_ids(r).size();
    // Running (out, lse) per query chunk; lse in the output's frame, -inf = nothing seen yet.
    std::vector<at::Tensor> out(nq), lse(nq);
    // Merges one call's result into the rows of its query chunk it covers.
    auto add = [&](const Pair& pair, const attention::AttentionResult& res) {
      auto part_lse = detail::lse_like_out(res.lse, l);
      if (!out[pair.qi].defined()) {
        auto shape = res.out.sizes().vec(), lshape = part_lse.sizes().vec();
        shape[l.seq_dim] = lshape[l.seq_dim] = plan->len;
        out[pair.qi] = at::zeros(shape, res.out.options());
        lse[pair.qi] =
            at::full(lshape, -std::numeric_limits<double>::infinity(), part_lse.options());
      }
      auto o_rows = out[pair.qi].narrow(l.seq_dim, pair.row0, pair.rows);
      auto l_rows = lse[pair.qi].narrow(l.seq_dim, pair.row0, pair.rows);
      auto merged_o = o_rows, merged_l = l_rows;
      merge_into(merged_o, merged_l, res.out, part_lse);
      o_rows.copy_(merged_o);
      l_rows.copy_(merged_l);
    };
    auto kept = std::make_shared<std::vector<KeptCall>>();
    const bool grad = q.requires_grad() || k.requires_grad() || v.requires_grad();
    const bool keep = !plan->from_stats && grad;
    auto blocks = std::make_shared<std::vector<std::vector<at::Tensor>>>();
    if (plan->ring.keep_blocks && grad && route.last >= 1)
      blocks->resize(static_cast<size_t>(route.last + 1));
    // The block here, one contiguous [k | v] per key chunk (head-tail balance: two). Each
    // chunk travels on its own route: a step waits only for the chunk its next calls read,
    // forwards it at once (where its route goes on) and attends it while the step's other
    // chunk still arrives.
    const size_t nk = plan->chunk_ids(r).size();
    std::vector<at::Tensor> held(nk), like(nk);  // like: the shapes that arrive
    {
      auto kv = at::cat({k, v}, -1);
      for (size_t kc = 0; kc < nk; ++kc) {
        held[kc] = plan->chunk(kv, kc).contiguous();
        like[kc] = shape_like(held[kc]);
      }
    }
    std::vector<comm::Pending> arriving(nk);
    for (int64_t step = 0; step <= route.last; ++step) {
      const int64_t src = route.origin_at(r, step);
      std::vector<comm::Pending> next(nk);
      const auto pairs = pairs_for(*plan, src);
      for (size_t kc = 0; kc < nk; ++kc) {
        if (step > 0) held[kc] = arriving[kc]();  // at most two blocks alive unless kept
        // The first shift has landed (all its chunks): usp launches its next group's pieces.
        if (step == 1 && kc + 1 == nk && after_first_step) after_first_step();
        if (step < route.last) {
          next[kc] = comm::shift_legs_async(
              *plan->ring.group, route.moves_on(r, step, kc) ? held[kc] : at::Tensor(),
              route.here(r, step + 1, kc) ? like[kc] : at::Tensor(), route.dir);
        }
        if (step == 0 && keep) continue;  // below, all chunks at once
        for (const auto& pair : pairs) {
          if (pair.kc != kc) continue;
          HP_INTERNAL_ASSERT(held[kc].defined(), "ring: chunk ", kc, " of member ", src,
                             " is attended at step ", step, " but its route ended before");
          add(pair,
              (*plan->call)(query_rows(*plan, q, pair), held[kc].narrow(-1, 0, plan->dk),
                            held[kc].narrow(-1, plan->dk, held[kc].size(-1) - plan->dk), pair.st));
        }
      }
      if (step == 0 && keep) {
        // The own block, in the two halves its backward runs in, with autograd on. Each key
        // chunk's K and V leaves are made contiguous once and shared by the calls that read
        // them (the primitive saves what it is given; a strided slice it would copy per call).
        at::AutoGradMode grad_on(true);
        std::vector<at::Tensor> k_leaf(nk), v_leaf(nk);
        auto leaf = [&](std::vector<at::Tensor>& leaves, const at::Tensor& x, size_t kc) {
          if (!leaves[kc].defined())
            leaves[kc] = plan->chunk(x, kc).detach().contiguous().requires_grad_(true);
          return leaves[kc];
        };
        for (int half : {0, 1}) {
          for (const auto& pair : pairs_for(*plan, src, half)) {
            KeptCall c{pair,
                       half,
                       query_rows(*plan, q, pair).detach().contiguous().requires_grad_(true),
                       leaf(k_leaf, k, pair.kc),
                       leaf(v_leaf, v, pair.kc),
                       {}};
            c.r = (*plan->call)(c.qi, c.kc, c.vc, pair.st);
            add(pair, {c.r.out.detach(), c.r.lse.detach()});
            kept->push_back(std::move(c));
          }
        }
      }
      if (step >= 1 && !blocks->empty()) (*blocks)[static_cast<size_t>(step)] = held;
      arriving = std::move(next);
      if (step == 0 && route.last == 0 && after_first_step) after_first_step();
    }
    for (size_t i = 0; i < nq; ++i) {  // every query chunk meets its own keys (never hidden)
      HP_INTERNAL_ASSERT(out[i].defined(), "ring: query chunk ", i, " attended no block");
    }
    auto o = at::cat(out, l.seq_dim), m = at::cat(lse, l.seq_dim);
    ctx->save_for_backward({q, k, v, o, m});
    ctx->saved_data["plan"] = common::to_capsule(std::move(plan));
    ctx->saved_data["kept"] = common::to_capsule(std::move(kept));
    ctx->saved_data["blocks"] = common::to_capsule(std::move(blocks));
    return o;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    // The backward frees the kept blocks and calls as it passes them: it runs once.
    HP_CHECK(ctx->saved_data.find("spent") == ctx->saved_data.end(),
             "ring attention: this call's backward already ran and freed its kept blocks; a "
             "second backward through it (retain_graph) is not supported: run the forward again");
    ctx->saved_data["spent"] = true;
    auto plan = common::from_capsule<std::shared_ptr<const RingPlan>>(ctx->saved_data["plan"]);
    auto kept = common::from_capsule<KeptCalls>(ctx->saved_data["kept"]);
    auto blocks = common::from_capsule<KeptBlocks>(ctx->saved_data["blocks"]);
    auto saved = ctx->get_saved_variables();
    const auto &o = saved[3], &m = saved[4];
    auto dout = grads[0].defined() ? grads[0] : at::zeros_like(o);
    // delta = rowsum(dout * out) in the statistics' frame and dtype (what the primitive's
    // backward reads of the output).
    auto delta = (dout.to(m.scalar_type()) * o.to(m.scalar_type())).sum(-1, true);
    if (plan->queries) return queries_backward(*plan, saved, dout, delta, *kept);
    return blocks_backward(*plan, saved, dout, delta, *kept, *blocks);
  }

 private:
  // The backward with the blocks travelling again on the forward's routes (or kept from
  // forward: ring_keep_blocks), each key chunk followed by its dK/dV accumulator, which goes
  // home from the last member on the route. Each call's gradients come from the merged (out,
  // lse) and dO where the primitive offers that (nothing recomputed, no graph kept), else from
  // its recomputed forward seeded with dO and the merge's lse gradient (the own block's calls
  // from the graphs forward kept).
  static variable_list blocks_backward(const RingPlan& plan, const variable_list& saved,
                                       const at::Tensor& dout, const at::Tensor& delta,
                                       std::vector<KeptCall>& kept,
                                       std::vector<std::vector<at::Tensor>>& kept_blocks) {
    const auto &q = saved[0], &k = saved[1], &v = saved[2], &o = saved[3], &m = saved[4];
    const auto& l = plan.layout;
    const auto& route = plan.keys;
    auto& group = *plan.ring.group;
    auto dq = at::zeros_like(q), dk = at::zeros_like(k), dv = at::zeros_like(v);
    const int64_t r = plan.ring.rank;
    auto k_part = [&](const at::Tensor& kv) { return kv.narrow(-1, 0, plan.dk); };
    auto v_part = [&](const at::Tensor& kv) {
      return kv.narrow(-1, plan.dk, kv.size(-1) - plan.dk);
    };
    // One call's gradients: dq into its query rows, dK/dV into `dk_to` / `dv_to` (a key
    // chunk; from the statistics they may cover its first rows only: added at row 0).
    auto place = [&](const Pair& pair, const attention::AttentionGrads& g, const at::Tensor& dk_to,
                     const at::Tensor& dv_to) {
      if (g.dq.defined()) query_rows(plan, dq, pair).add_(g.dq);
      if (g.dk.defined()) dk_to.narrow(l.seq_dim, 0, g.dk.size(l.seq_dim)).add_(g.dk);
      if (g.dv.defined()) dv_to.narrow(l.seq_dim, 0, g.dv.size(l.seq_dim)).add_(g.dv);
    };
    // The gradients of one call against the key chunk kk, vv.
    auto grads = [&](const Pair& pair, const at::Tensor& kk, const at::Tensor& vv) {
      if (plan.from_stats) {
        return plan.call->grads_from_stats(query_rows(plan, q, pair), kk, vv,
                                           query_rows(plan, o, pair),
                                           detail::lse_to_primitive(query_rows(plan, m, pair), l),
                                           query_rows(plan, dout, pair), pair.st);
      }
      at::AutoGradMode grad_on(true);  // recomputed: the block travelled
      auto qi = query_rows(plan, q, pair).detach().requires_grad_(true);
      auto kx = kk.detach().requires_grad_(true), vx = vv.detach().requires_grad_(true);
      auto res = (*plan.call)(qi, kx, vx, pair.st);
      return seeded_grad(plan, qi, kx, vx, res, query_rows(plan, m, pair),
                         query_rows(plan, delta, pair), query_rows(plan, dout, pair));
    };
    auto own_half = [&](int half) {  // its dK/dV never travel
      if (plan.from_stats) {
        for (const auto& pair : pairs_for(plan, r, half)) {
          place(pair, grads(pair, plan.chunk(k, pair.kc), plan.chunk(v, pair.kc)),
                plan.chunk(dk, pair.kc), plan.chunk(dv, pair.kc));
        }
        return;
      }
      for (auto& c : kept) {  // graphs kept from forward: no recompute
        if (c.half != half) continue;
        place(c.pair,
              seeded_grad(plan, c.qi, c.kc, c.vc, c.r, query_rows(plan, m, c.pair),
                          query_rows(plan, delta, c.pair), query_rows(plan, dout, c.pair)),
              plan.chunk(dk, c.pair.kc), plan.chunk(dv, c.pair.kc));
        c = KeptCall{};  // its graph is spent: free it now
      }
    };
    const bool travel = kept_blocks.empty();
    const size_t nk = plan.chunk_ids(r).size();
    // The shapes of the [k | v] chunks that arrive, and of their accumulators.
    std::vector<at::Tensor> like(nk);
    for (size_t kc = 0; kc < nk; ++kc) {
      auto shape = plan.chunk(k, kc).sizes().vec();
      shape.back() += v.size(-1);
      like[kc] = at::zeros({}, k.options()).expand(shape);
    }
    std::vector<comm::Pending> next(nk);  // the chunks travelling again
    auto shift_on = [&](int64_t step, size_t kc, const at::Tensor& kv) {
      next[kc] =
          comm::shift_legs_async(group, route.moves_on(r, step, kc) ? kv : at::Tensor(),
                                 route.here(r, step + 1, kc) ? like[kc] : at::Tensor(), route.dir);
    };
    if (travel && route.last >= 1) {
      auto kv = at::cat({k, v}, -1);  // the own chunks again, alive until their shifts land
      for (size_t kc = 0; kc < nk; ++kc)
        shift_on(0, kc, plan.chunk(kv, kc).contiguous());
      own_half(0);  // the first half of the own block hides the first shift
    }
    // The dK/dV accumulators: from the member before on the route; home to this rank; sent home.
    std::vector<comm::Pending> acc_in(nk), home(nk), homeward;
    for (int64_t step = 1; step <= route.last; ++step) {
      const auto pairs = pairs_for(plan, route.origin_at(r, step));
      for (size_t kc = 0; kc < nk; ++kc) {
        // The chunk here (undefined where its route ended before this rank).
        auto kv = travel ? next[kc]()
                         : std::exchange(kept_blocks[static_cast<size_t>(step)][kc], at::Tensor());
        const bool on = route.moves_on(r, step, kc);
        if (travel && step < route.last) shift_on(step, kc, kv);
        at::Tensor acc;
        if (kv.defined()) {
          acc = at::zeros_like(kv);
          for (const auto& pair : pairs) {
            if (pair.kc != kc) continue;
            place(pair, grads(pair, k_part(kv), v_part(kv)), k_part(acc), v_part(acc));
          }
        }
        auto before = acc_in[kc] ? acc_in[kc]() : at::Tensor();
        if (before.defined()) acc.add_(before);  // in place: no third block-sized buffer
        // On with its chunk, or home (a shift back by `step`) after the last member it meets.
        if (step < route.last) {
          acc_in[kc] = comm::shift_legs_async(group, on ? acc : at::Tensor(),
                                              route.here(r, step + 1, kc) ? like[kc] : at::Tensor(),
                                              route.dir);
        }
        auto back = comm::shift_legs_async(group, acc.defined() && !on ? acc : at::Tensor(),
                                           route.hops_of(r, kc) == step ? like[kc] : at::Tensor(),
                                           -route.dir * static_cast<int>(step));
        (route.hops_of(r, kc) == step ? home[kc] : homeward.emplace_back()) = std::move(back);
      }
    }
    if (!travel || route.last == 0) own_half(0);
    own_half(1);  // the second half hides the accumulators' last hop
    for (size_t kc = 0; kc < nk; ++kc) {
      if (!home[kc]) continue;
      auto back = home[kc]();
      plan.chunk(dk, kc).add_(k_part(back));
      plan.chunk(dv, kc).add_(v_part(back));
    }
    for (auto& sent : homeward)
      sent();
    return {dq, dk, dv, at::Tensor(), at::Tensor()};
  }

  // (out, lse) += (o, l) by log-sum-exp, rows that saw nothing yet (-inf) taking the new part.
  static void merge_into(at::Tensor& out, at::Tensor& lse, const at::Tensor& o,
                         const at::Tensor& l) {
    auto total = at::logaddexp(lse, l);
    auto weight = [&](const at::Tensor& x) {
      auto w = at::exp(x - total);
      return at::where(total.isneginf(), at::zeros_like(w), w).to(o.scalar_type());
    };
    out = out * weight(lse) + o * weight(l);
    lse = total;
  }
};

}  // namespace

at::Tensor detail::ring_attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               const AttentionCall& call, const QKVLayout& l, const RingGroup& ring,
                               const std::function<void()>& after_first_step) {
  HP_CHECK(ring.size == 1 || can_split_call(call),
           "the ring merges partial results by log-sum-exp: it needs BNSD or BSHD q/k/v and no "
           "tensor mask; use algorithm=all_gather for this call");
  auto plan = std::make_shared<RingPlan>();
  plan->call = std::make_shared<const AttentionCall>(call);
  plan->layout = l;
  plan->ring = ring;
  plan->s = q.size(l.seq_dim);
  plan->len = ring.chunk_len;
  HP_INTERNAL_ASSERT(static_cast<int64_t>(ring.chunks.size()) == ring.size &&
                         plan->len * static_cast<int64_t>(ring.chunks[ring.rank].size()) == plan->s,
                     "ring: the chunk table does not cover the local sequence");
  plan->dk = k.size(-1);
  plan->from_stats = call.offers_grads_from_stats();
  plan->queries =
      ring.size > 1 && ring_moves_queries(ring.backward, ring.keep_blocks,
                                          RingHeads{q.size(l.heads_dim), k.size(l.heads_dim),
                                                    q.size(-1), v.size(-1), q.element_size()});
  plan->keys = plan_routes(*plan, /*queries=*/false, /*preferred=*/1);
  if (plan->queries) plan->bundles = plan_routes(*plan, /*queries=*/true, /*preferred=*/-1);
  return RingAttentionFn::apply(q, k, v, std::shared_ptr<const RingPlan>(std::move(plan)),
                                after_first_step);
}

std::shared_ptr<const CPStrategy> make_ring_strategy() {
  return std::make_shared<RingStrategy>();
}

}  // namespace hp::cp
