// ring: K/V blocks travel around the CP group by point-to-point shifts while each rank attends
// its queries to the block it holds; partial results merged by log-sum-exp.
//
//   buffer = [k | v] of this rank's shard, one contiguous tensor per key chunk (head-tail
//     balance: two), each travelling on its own
//   step i = 0 .. P-1 (the block of rank (r - i) mod P is here), chunk by chunk:
//     wait for the chunk (not the whole block), start its shift to rank r+1 (async), then
//     attend it (the step's other chunk still arriving meanwhile):
//       causal, key block after the query block: skipped (never computed)
//       causal, the diagonal: causal mask;  key block before: unmasked;  not causal: unmasked
//       packed documents: a block no document spans with the query chunk is skipped too
//     (each chunk's transfer overlaps the attention of the chunks before it)
//   packed documents: the ring stops after the last step J whose block some rank attends (every
//     rank computes J from the global document ids): blocks no rank sees never travel (J = 0:
//     nothing moves). Without documents J = P-1.
//   out, lse merged by log-sum-exp as the blocks arrive (one custom autograd node)
//   head-tail balance (data-order shards: chunks 2r and 2P-2r-1): each of the two query chunks
//   against each of the two key chunks of the block, by their chunk ids.
//   backward: the blocks travel the same way again (whole), each followed by a dK/dV
//     accumulator:
//     where the primitive offers backward_from_stats (blockwise), each visible call's dQ, dK, dV
//     come straight from the merged (out, lse) and dO: nothing recomputed, no graph kept;
//     otherwise (the recomputing form)
//     step i = 1 .. P-1 recomputes the visible calls of the block here (attention's own autograd,
//     seeded with dO and the lse gradient of the merge), adds its dK/dV to the accumulator that
//     arrives from rank r-1 (none at step 1) and shifts it on; after step J it goes home
//     (a shift by P-J: the ring's next hop when J = P-1).
//     The own block's calls run half before the ring (hiding the first shift) and half after
//     it (hiding the accumulator's last hop); their dK/dV never travel.
//   ring_keep_blocks: forward keeps every block that arrived (the whole K/V, as all_gather
//     holds), so in backward only the accumulators travel (each flying while the next kept
//     block's gradients compute) and the own block's calls all run after the ring, hiding the
//     last hop.
//   the queries travel instead (ring_backward=queries, or auto where that is fewer bytes:
//     volume.h, ring_moves_queries): this rank's [q | dout] and [lse | delta] (delta =
//     rowsum(dout * out)) go the other way round, to rank r-1, one query chunk at a time
//     (as the blocks above; each chunk's dQ accumulator follows it):
//     step i = 1 .. J, the bundle of rank r+i is here (shifted on while it is used): its calls
//       against this rank's own K/V add dK/dV here and dQ to an accumulator that arrives from
//       rank r+1 (none at step 1) and follows the bundle; after step J it goes home (a shift
//       by J). dK/dV never leave their rank. The own block's calls hide the first shift and the
//       last hop, as above.
// Memory: the saved q, k, v, out, lse of this rank, and at most two K/V blocks (the one here and
// the one arriving) in forward and in backward (never the whole sequence). The own block's
// calls keep their autograd graph from forward (over one contiguous copy of each own key
// chunk, shared by the calls that read it): only the blocks that travelled are recomputed.
// From the statistics, forward keeps nothing beyond the saved q, k, v, out, lse.
// Bytes: forward P-1 blocks; backward P-1 blocks and P-1 accumulators of the same size, or the
// accumulators alone with ring_keep_blocks, or P-1 query bundles and dQ accumulators (with
// documents J instead of P-1: the formula is their upper bound).
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
#include "ring_plan.h"
#include "strategy_pieces.h"

namespace hp::cp {
namespace {

// One rank's [k | v] block.
int64_t block_bytes(int64_t p, const AttentionShape& s) {
  return (s.seq / p) * s.kv_heads * (s.qk_dim + s.v_dim_or_qk()) * s.batch * s.element_size;
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
  int64_t forward_bytes_per_rank(const ContextParallelConfig&, int64_t p, const AttentionShape& s,
                                 int64_t) const override {
    return (p - 1) * block_bytes(p, s);  // P-1 shifts of the [k | v] block
  }
  int64_t backward_bytes_per_rank(const ContextParallelConfig& c, int64_t p,
                                  const AttentionShape& s, int64_t) const override {
    // P-1 steps: the blocks again and their accumulators (the accumulators alone where forward
    // kept the blocks), or the queries' bundles and their dQ accumulators.
    const RingHeads h{s.q_heads, s.kv_heads, s.qk_dim, s.v_dim_or_qk(), s.element_size};
    return (p - 1) * (s.seq / p) * s.batch *
           ring_backward_bytes_per_position(c.ring_backward, c.ring_keep_blocks, h);
  }
  std::vector<comm::OpKind> required_ops() const override {
    return {comm::OpKind::kSend, comm::OpKind::kRecv};
  }
  std::vector<QKVRole> moved_roles() const override { return {}; }

  at::Tensor run_sync(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                      const AttentionCall& call, const CPRuntimeContext& ctx) const override {
    const auto& t = *ctx.topology;
    const bool balanced = ctx.load_balance && t.cp_size > 1;
    if (balanced) detail::check_head_tail(q, ctx);
    detail::RingGroup ring{
        t.cp, t.cp_rank, t.cp_size, 0, {}, 0, ctx.ring_keep_blocks, ctx.ring_backward};
    const int64_t s = q.size(ctx.layout.seq_dim);
    for (int64_t r = 0; r < t.cp_size; ++r) {
      ring.chunks.push_back(balanced ? load_balance_chunks(r, t.cp_size) : std::vector{r});
    }
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
using detail::ring::queries_backward;
using detail::ring::query_rows;
using detail::ring::RingPlan;
using detail::ring::seeded_grad;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// J: P-1, or with packed documents the last ring step whose block some member attends (step j
// brings member d the block of member d - j). Every member computes the same J from the global
// positions, without communication.
int64_t last_needed_step(const RingPlan& plan) {
  const int64_t p = plan.ring.size;
  if (p == 1 || !plan.call->options().documents) return p - 1;
  for (int64_t j = p - 1; j >= 1; --j) {
    for (int64_t d = 0; d < p; ++d) {
      if (!pairs_between(plan, d, (d - j + p) % p).empty()) return j;
    }
  }
  return 0;
}

at::Tensor key_part(const RingPlan& plan, const at::Tensor& kv, size_t kc) {
  return plan.chunk(kv, kc).narrow(-1, 0, plan.dk);
}
at::Tensor value_part(const RingPlan& plan, const at::Tensor& kv, size_t kc) {
  auto c = plan.chunk(kv, kc);
  return c.narrow(-1, plan.dk, c.size(-1) - plan.dk);
}

using KeptCalls = std::shared_ptr<std::vector<KeptCall>>;

// The [k | v] block of each backward step 1..J: kept from forward (ring_keep_blocks; each
// handed out once, so its memory goes as the backward passes it) or passed around the ring
// again, each shift flying while the block here is used.
class BackwardBlocks {
 public:
  // `kept`: [step] -> block, empty when the blocks travel again.
  BackwardBlocks(const RingPlan& plan, std::shared_ptr<std::vector<at::Tensor>> kept)
      : plan_(plan), kept_(std::move(kept)) {}
  bool travel() const { return kept_->empty(); }
  // Travelling blocks (travel()): the first shift, of this rank's own [k | v].
  void start(const at::Tensor& own_kv) {
    if (plan_.last_step >= 1) next_ = comm::shift_async(*plan_.ring.group, own_kv, 1);
  }
  // The block of rank r - step, step = 1 .. J in order.
  at::Tensor take(int64_t step) {
    if (!travel()) return std::exchange((*kept_)[static_cast<size_t>(step)], at::Tensor());
    auto kv = next_();
    next_ = step < plan_.last_step ? comm::shift_async(*plan_.ring.group, kv, 1) : comm::Pending();
    return kv;
  }

 private:
  const RingPlan& plan_;
  std::shared_ptr<std::vector<at::Tensor>> kept_;
  comm::Pending next_;
};

struct RingAttentionFn : torch::autograd::Function<RingAttentionFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k,
                            const at::Tensor& v, std::shared_ptr<const RingPlan> plan,
                            const std::function<void()>& after_first_step) {
    at::NoGradGuard no_grad;
    const auto& l = plan->layout;
    const size_t nq = plan->chunk_ids(plan->ring.rank).size();
    // Running (out, lse) per query chunk; lse in the output's frame, -inf = nothing seen yet.
    std::vector<at::Tensor> out(nq), lse(nq);
    // Merges one call's result into the rows of its query chunk it covers.
    auto add = [&](const Pair& pair, const attention::AttentionResult& r) {
      auto part_lse = detail::lse_like_out(r.lse, l);
      if (!out[pair.qi].defined()) {
        auto shape = r.out.sizes().vec(), lshape = part_lse.sizes().vec();
        shape[l.seq_dim] = lshape[l.seq_dim] = plan->len;
        out[pair.qi] = at::zeros(shape, r.out.options());
        lse[pair.qi] =
            at::full(lshape, -std::numeric_limits<double>::infinity(), part_lse.options());
      }
      auto o_rows = out[pair.qi].narrow(l.seq_dim, pair.row0, pair.rows);
      auto l_rows = lse[pair.qi].narrow(l.seq_dim, pair.row0, pair.rows);
      auto merged_o = o_rows, merged_l = l_rows;
      merge_into(merged_o, merged_l, r.out, part_lse);
      o_rows.copy_(merged_o);
      l_rows.copy_(merged_l);
    };
    auto kept = std::make_shared<std::vector<KeptCall>>();
    const bool grad = q.requires_grad() || k.requires_grad() || v.requires_grad();
    const bool keep = !plan->from_stats && grad;
    // ring_keep_blocks: [step] -> the block that arrived for it (step 0, the own one, unused).
    auto blocks = std::make_shared<std::vector<at::Tensor>>();
    if (plan->ring.keep_blocks && grad && plan->last_step >= 1)
      blocks->resize(static_cast<size_t>(plan->last_step + 1));
    // The block here, one contiguous [k | v] per key chunk (head-tail balance: two). Each
    // chunk travels on its own: a step waits only for the chunk its next calls read, forwards
    // it at once and attends it while the step's other chunk still arrives.
    const size_t nk = plan->chunk_ids(plan->ring.rank).size();
    std::vector<at::Tensor> held(nk);
    {
      auto own = at::cat({k, v}, -1);
      for (size_t kc = 0; kc < nk; ++kc)
        held[kc] = plan->chunk(own, kc).contiguous();
    }
    std::vector<comm::Pending> arriving(nk);
    for (int64_t step = 0; step <= plan->last_step; ++step) {
      const int64_t src = (plan->ring.rank - step + plan->ring.size) % plan->ring.size;
      std::vector<comm::Pending> next(nk);
      const auto pairs = pairs_for(*plan, src);
      for (size_t kc = 0; kc < nk; ++kc) {
        if (step > 0) held[kc] = arriving[kc]();  // at most two blocks alive unless kept
        // The first shift has landed (all its chunks): usp launches its next group's pieces.
        if (step == 1 && kc + 1 == nk && after_first_step) after_first_step();
        if (step < plan->last_step) next[kc] = comm::shift_async(*plan->ring.group, held[kc], 1);
        if (step == 0 && keep) continue;  // below, all chunks at once
        for (const auto& pair : pairs) {
          if (pair.kc != kc) continue;
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
        std::vector<at::Tensor> k_leaf(plan->chunk_ids(src).size()), v_leaf(k_leaf.size());
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
      if (step >= 1 && !blocks->empty())
        (*blocks)[static_cast<size_t>(step)] = nk == 1 ? held[0] : at::cat(held, l.seq_dim);
      arriving = std::move(next);
      if (step == 0 && plan->last_step == 0 && after_first_step) after_first_step();
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
    BackwardBlocks blocks(*plan, common::from_capsule<std::shared_ptr<std::vector<at::Tensor>>>(
                                     ctx->saved_data["blocks"]));
    auto saved = ctx->get_saved_variables();
    const auto &q = saved[0], &o = saved[3], &m = saved[4];
    auto dout = grads[0].defined() ? grads[0] : at::zeros_like(o);
    // delta = rowsum(dout * out) in the statistics' frame and dtype (what the primitive's
    // backward reads of the output).
    auto delta = [&] { return (dout.to(m.scalar_type()) * o.to(m.scalar_type())).sum(-1, true); };
    if (plan->queries) return queries_backward(*plan, saved, dout, delta(), *kept);
    if (plan->from_stats) return stats_backward(*plan, saved, dout, blocks);
    const auto delta_rows = delta();
    auto dq = at::zeros_like(q);
    const int64_t p = plan->ring.size, r = plan->ring.rank;
    auto block_shape = saved[1].sizes().vec();
    block_shape.back() += saved[2].size(-1);
    // This rank's block: its own queries' share of dK/dV stays here.
    auto dkv = at::zeros(block_shape, saved[1].options());
    // One call's gradients: dq into its query rows, dK/dV into `to` (a [k | v] block).
    auto place = [&](const Pair& pair, const attention::AttentionGrads& g, at::Tensor& to) {
      if (g.dq.defined()) query_rows(*plan, dq, pair).add_(g.dq);
      auto slot = plan->chunk(to, pair.kc);
      if (g.dk.defined()) slot.narrow(-1, 0, plan->dk).add_(g.dk);
      if (g.dv.defined()) slot.narrow(-1, plan->dk, slot.size(-1) - plan->dk).add_(g.dv);
    };
    auto compute = [&](const at::Tensor& kv, int64_t src, at::Tensor& dkv_out) {
      for (const auto& pair : pairs_for(*plan, src)) {
        at::AutoGradMode grad_on(true);  // recomputed: the block travelled
        auto qi = query_rows(*plan, q, pair).detach().requires_grad_(true);
        auto kc = key_part(*plan, kv, pair.kc).detach().requires_grad_(true);
        auto vc = value_part(*plan, kv, pair.kc).detach().requires_grad_(true);
        auto res = (*plan->call)(qi, kc, vc, pair.st);
        place(pair,
              seeded_grad(*plan, qi, kc, vc, res, query_rows(*plan, m, pair),
                          query_rows(*plan, delta_rows, pair), query_rows(*plan, dout, pair)),
              dkv_out);
      }
    };
    auto own_half = [&](int half) {  // the kept calls: no recompute
      for (auto& c : *kept) {
        if (c.half != half) continue;
        place(c.pair,
              seeded_grad(*plan, c.qi, c.kc, c.vc, c.r, query_rows(*plan, m, c.pair),
                          query_rows(*plan, delta_rows, c.pair), query_rows(*plan, dout, c.pair)),
              dkv);
        c = KeptCall{};  // its graph is spent: free it now
      }
    };
    const int64_t last = plan->last_step;
    // The own [k | v] again, alive only until the first shift has landed (its Pending holds it).
    if (blocks.travel()) {
      blocks.start(at::cat({saved[1], saved[2]}, -1));
      own_half(0);  // the first half of the own block hides the first shift
    }
    comm::Pending arriving;  // the accumulator of the block here, from the previous rank
    for (int64_t step = 1; step <= last; ++step) {
      auto kv = blocks.take(step);  // the block of rank r - step
      auto acc = at::zeros_like(kv);
      compute(kv, (r - step + p) % p, acc);
      // The accumulator follows its block to rank r+1; after the last step it goes home (rank
      // r - last, a shift by p - last). Added in place: no third block-sized buffer.
      if (arriving) acc.add_(arriving());
      arriving = comm::shift_async(*plan->ring.group, acc, step < last ? 1 : p - last);
    }
    if (!blocks.travel()) own_half(0);
    own_half(1);  // the second half hides the accumulator's last hop
    if (arriving) dkv += arriving();

    return {dq, dkv.narrow(-1, 0, plan->dk), dkv.narrow(-1, plan->dk, dkv.size(-1) - plan->dk),
            at::Tensor(), at::Tensor()};
  }

 private:
  // The backward from the merged statistics: every call's gradients straight from (out, lse,
  // dout) of the whole ring, with no forward recomputed and no graph kept from forward. The
  // blocks and accumulators travel as in the recomputing backward below.
  static variable_list stats_backward(const RingPlan& plan, const variable_list& saved,
                                      const at::Tensor& dout, BackwardBlocks& blocks) {
    const auto &q = saved[0], &k = saved[1], &v = saved[2], &o = saved[3], &m = saved[4];
    const auto& l = plan.layout;
    auto dq = at::zeros_like(q), dk = at::zeros_like(k), dv = at::zeros_like(v);
    const int64_t p = plan.ring.size, r = plan.ring.rank, last = plan.last_step;
    // One call's gradients: dq into its query rows, dk/dv into `dk_to` / `dv_to` (key chunk).
    auto grad = [&](const Pair& pair, const at::Tensor& kk, const at::Tensor& vv,
                    const at::Tensor& dk_to, const at::Tensor& dv_to) {
      auto g =
          plan.call->grads_from_stats(query_rows(plan, q, pair), kk, vv, query_rows(plan, o, pair),
                                      detail::lse_to_primitive(query_rows(plan, m, pair), l),
                                      query_rows(plan, dout, pair), pair.st);
      query_rows(plan, dq, pair).add_(g.dq);
      dk_to.narrow(l.seq_dim, 0, g.dk.size(l.seq_dim)).add_(g.dk);
      dv_to.narrow(l.seq_dim, 0, g.dv.size(l.seq_dim)).add_(g.dv);
    };
    auto own_half = [&](int half) {
      for (const auto& pair : pairs_for(plan, r, half)) {
        grad(pair, plan.chunk(k, pair.kc), plan.chunk(v, pair.kc), plan.chunk(dk, pair.kc),
             plan.chunk(dv, pair.kc));
      }
    };
    if (blocks.travel()) {
      blocks.start(at::cat({k, v}, -1));
      own_half(0);  // hides the first shift
    }
    comm::Pending arriving;
    for (int64_t step = 1; step <= last; ++step) {
      auto kv = blocks.take(step);  // the block of rank r - step
      auto acc = at::zeros_like(kv);
      for (const auto& pair : pairs_for(plan, (r - step + p) % p)) {
        auto slot = plan.chunk(acc, pair.kc);
        grad(pair, key_part(plan, kv, pair.kc), value_part(plan, kv, pair.kc),
             slot.narrow(-1, 0, plan.dk), slot.narrow(-1, plan.dk, slot.size(-1) - plan.dk));
      }
      if (arriving) acc.add_(arriving());
      arriving = comm::shift_async(*plan.ring.group, acc, step < last ? 1 : p - last);
    }
    if (!blocks.travel()) own_half(0);
    own_half(1);  // hides the accumulator's last hop
    if (arriving) {
      auto home = arriving();
      dk += home.narrow(-1, 0, plan.dk);
      dv += home.narrow(-1, plan.dk, home.size(-1) - plan.dk);
    }
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
  plan->last_step = last_needed_step(*plan);
  plan->from_stats = call.offers_grads_from_stats();
  plan->queries =
      ring.size > 1 && ring_moves_queries(ring.backward, ring.keep_blocks,
                                          RingHeads{q.size(l.heads_dim), k.size(l.heads_dim),
                                                    q.size(-1), v.size(-1), q.element_size()});
  return RingAttentionFn::apply(q, k, v, std::shared_ptr<const RingPlan>(std::move(plan)),
                                after_first_step);
}

std::shared_ptr<const CPStrategy> make_ring_strategy() {
  return std::make_shared<RingStrategy>();
}

}  // namespace hp::cp
