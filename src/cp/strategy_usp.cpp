// usp (P = C * U): the Ulysses piece inside each Ulysses group, then the ring piece across the
// co group; composed from both, no communication code of its own.
//
//   q [B, N, S/P, D]   -- A2A in cp_ulysses --> [B, N/U, S/C, D]
//   k, v               -- A2A in cp_ulysses --> [B, Nkv/U, S/C, .]   (kv_head_policy=repeat:
//                                              gathered in the group, one head kept)
//   ring_attend over cp_co: the [k | v] blocks of the C co-ranks travel by shifts while each
//   is attended (causal blocks above the diagonal skipped; offsets in units of S/C)
//   head-tail balance (data-order shards, rank r: chunks 2r and 2P-2r-1 of S/2P): after the
//   all-to-all co-rank c holds the chunks of ranks cU .. cU+U-1 in that order, and the ring
//   pairs chunks by their ids: every rank does the same causal work
//   out [B, N/U, S/C, Dv] -- A2A in cp_ulysses --> [B, N, S/P, Dv]
//   backward: the ring's backward (blocks again, each with its dK/dV accumulator; only the
//   accumulators with ring_keep_blocks), then the inverse all-to-alls.
//   Async: the all-to-alls start at the handoff points; the ring overlaps itself. With
//   cp_config.ulysses_head_groups = G > 1 (default 1 for usp) the heads run in G groups: a ring
//   per group, whose output all-to-all starts as soon as it is done and flies while the next
//   group's ring runs; in backward the later groups' inverse all-to-alls fly while the earlier
//   rings run back.
#include <ATen/ATen.h>

#include "hp/common/check.h"
#include "hp/cp/sequence.h"
#include "strategy_pieces.h"

namespace hp::cp {
namespace {

class UspStrategy final : public detail::UlyssesMoves {
 public:
  std::string name() const override { return "usp"; }
  std::string summary() const override {
    return "Ulysses inside groups of ulysses_degree ranks x ring across them (heads divisible by "
           "the degree)";
  }
  void normalize(ContextParallelConfig& c, int64_t cp_size) const override {
    detail::check_sub_group_degree(c, cp_size, "usp", "ring");
    detail::check_data_order_balance(c, "usp");
  }
  bool supports_load_balance() const override { return true; }
  std::vector<comm::OpKind> required_ops() const override {
    return {comm::OpKind::kAllToAll, comm::OpKind::kSend, comm::OpKind::kRecv};
  }
  // Forward: the default composition (the ring's C-1 shifts move what an all-gather across the
  // groups would). Backward: the same (the inverse all-to-alls and the C-1 accumulator shifts,
  // one block each), plus the blocks again unless the ring keeps them (ring_keep_blocks).
  int64_t backward_bytes_per_rank(const ContextParallelConfig& c, int64_t p,
                                  const AttentionShape& s, int64_t cp_rank) const override {
    const int64_t u = ulysses_degree_of(c, p), groups = p / u;
    const int64_t heads = repeats_kv(c.kv_head_policy, u, s.kv_heads) ? 1 : s.kv_heads / u;
    const int64_t block =
        (s.seq / groups) * heads * (s.qk_dim + s.v_dim_or_qk()) * s.batch * s.element_size;
    return forward_bytes_per_rank(c, p, s, cp_rank) + (c.ring_keep_blocks ? 0 : groups - 1) * block;
  }

  at::Tensor run_sync(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                      const AttentionCall& call, const CPRuntimeContext& ctx) const override {
    check_inputs(q, ctx, "usp");
    return attend_moved(move(QKVRole::kQ, q, ctx), move(QKVRole::kK, k, ctx),
                        move(QKVRole::kV, v, ctx), call, ctx);
  }

  at::Tensor run_async(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                       const AttentionCall& call, const CPRuntimeContext& ctx,
                       const ArrivedFn& arrived) const override {
    return attend_moved(arrived(QKVRole::kQ, q), arrived(QKVRole::kK, k), arrived(QKVRole::kV, v),
                        call, ctx, /*grouped=*/true);
  }

 private:
  at::Tensor attend_moved(const at::Tensor& q, at::Tensor k, at::Tensor v,
                          const AttentionCall& call, const CPRuntimeContext& ctx,
                          bool grouped = false) const {
    const auto& t = *ctx.topology;
    select_repeated_kv(k, v, ctx);
    detail::RingGroup ring{
        t.co, t.co_rank, t.colossal_degree,   t.ulysses_rank * q.size(ctx.layout.heads_dim),
        {},   0,         ctx.ring_keep_blocks};
    // After the all-to-all a co-rank holds its Ulysses group's shards in rank order: the
    // contiguous range c of C, or (head-tail balance) the two chunks of each member.
    const int64_t s = q.size(ctx.layout.seq_dim), u = t.ulysses_degree, p = t.cp_size;
    for (int64_t c = 0; c < t.colossal_degree; ++c) {
      std::vector<int64_t> ids;
      for (int64_t j = 0; ctx.load_balance && j < u; ++j) {
        for (int64_t id : load_balance_chunks(c * u + j, p))
          ids.push_back(id);
      }
      ring.chunks.push_back(ctx.load_balance ? ids : std::vector{c});
    }
    ring.chunk_len = ctx.load_balance ? s / (2 * u) : s;
    const int64_t hd = ctx.layout.heads_dim, nq = q.size(hd), nkv = k.size(hd);
    // usp's automatic count is 1 (ulysses_head_groups_of): each group costs a ring of its own.
    const int64_t groups =
        grouped && !repeated_kv(ctx) ? detail::head_groups(ctx, CPAlgorithm::kUsp, nq, nkv) : 1;
    if (groups == 1) {
      auto out = detail::ring_attend(q, k, v, call, ctx.layout, ring);
      return restore_output({out}, PreparedQKV{}, ctx);
    }
    const int64_t gq = nq / groups, gkv = nkv / groups;
    std::vector<comm::InFlight> moving;
    for (int64_t g = 0; g < groups; ++g) {
      auto group_ring = ring;
      group_ring.head_offset += g * gq;
      auto out = detail::ring_attend(q.narrow(hd, g * gq, gq), k.narrow(hd, g * gkv, gkv),
                                     v.narrow(hd, g * gkv, gkv), call, ctx.layout, group_ring);
      moving.push_back(comm::all_to_all_start(out.contiguous(), ctx.layout.seq_dim, hd, t.ulysses));
    }
    return anchored(detail::heads_from_groups(moving, u, ctx.layout), {q, k, v});
  }
};

}  // namespace

std::shared_ptr<const CPStrategy> make_usp_strategy() {
  return std::make_shared<UspStrategy>();
}

}  // namespace hp::cp
