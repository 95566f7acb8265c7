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
//   accumulators with ring_keep_blocks; or each co-rank's queries the other way with their dQ
//   accumulators, ring_backward), then the inverse all-to-alls.
//   Async: the all-to-alls start at the handoff points; the ring overlaps itself. With
//   cp_config.ulysses_head_groups = G > 1 (automatic: 2 where it divides the heads and each
//   rank holds at least kUspMinRowsForHeadGroups tokens) the heads
//   run in G groups: Q, K, V travel in one all-to-all per group (split_for_move, as ulysses),
//   group g's ring runs once its own pieces are here (group g+1's launch once group g's first
//   ring shift has landed, and travel while group g's ring goes on), and its
//   output all-to-all starts as soon as it is done and flies while the next group's ring runs;
//   in backward the later groups' inverse all-to-alls fly while the earlier rings run back.
//   Packed documents: the ring stops after the last step some co-rank needs (none travel when
//   the documents keep every co-rank's queries to its own keys); where they keep every rank's
//   queries to its own shard, nothing moves at all (rank_keys_hidden, as ulysses).
#include <ATen/ATen.h>

#include "hp/common/check.h"
#include "hp/cp/sequence.h"
#include "hp/cp/volume.h"
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
  // The default composition counts the ring's C-1 shifts as an all-gather across the groups
  // would move them; the routes send a causal layer's chunks only where they are attended
  // (volume.h: ring_forward_bytes over the ring's heads, co-rank cp_rank / U). Backward: the
  // inverse all-to-alls, and the ring's backward in place of its forward.
  int64_t forward_bytes_per_rank(const ContextParallelConfig& c, int64_t p, const AttentionShape& s,
                                 int64_t cp_rank) const override {
    const auto r = ring_part(c, p, s, cp_rank);
    return CPStrategy::forward_bytes_per_rank(c, p, s, cp_rank) -
           ring_forward_bytes(r.chunks, r.member, r.positions, r.heads, false) +
           ring_forward_bytes(r.chunks, r.member, r.positions, r.heads, s.causal);
  }
  int64_t backward_bytes_per_rank(const ContextParallelConfig& c, int64_t p,
                                  const AttentionShape& s, int64_t cp_rank) const override {
    const auto r = ring_part(c, p, s, cp_rank);
    return CPStrategy::forward_bytes_per_rank(c, p, s, cp_rank) -
           ring_forward_bytes(r.chunks, r.member, r.positions, r.heads, false) +
           ring_backward_bytes(c.ring_backward, c.ring_keep_blocks, r.chunks, r.member, r.positions,
                               r.heads, s.causal);
  }

  at::Tensor run_sync(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                      const AttentionCall& call, const CPRuntimeContext& ctx) const override {
    check_inputs(q, ctx, "usp");
    return attend_moved(move(QKVRole::kQ, q, ctx), move(QKVRole::kK, k, ctx),
                        move(QKVRole::kV, v, ctx), call, ctx);
  }

  // One piece per head group (as ulysses; usp's automatic count is at most 2).
  std::vector<at::Tensor> split_for_move(QKVRole role, const at::Tensor& x,
                                         const CPRuntimeContext& ctx) const override {
    return split_head_groups(role, x, ctx, CPAlgorithm::kUsp);
  }

  at::Tensor run_async(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                       const AttentionCall& call, const CPRuntimeContext& ctx,
                       const ArrivedFn& arrived) const override {
    const auto& t = *ctx.topology;
    const auto& l = ctx.layout;
    const int64_t hd = l.heads_dim, u = t.ulysses_degree, nq = q.size(hd) / u;
    // usp's automatic count is at most 2, and 1 on short shards (ulysses_head_groups_of): each
    // group costs a ring. (split_for_move counted the same local rows.)
    const int64_t groups =
        repeated_kv(ctx)
            ? 1
            : detail::head_groups(ctx, CPAlgorithm::kUsp, nq, k.size(hd) / u, q.size(l.seq_dim));
    if (groups == 1) {
      return attend_moved(arrived(QKVRole::kQ, q), arrived(QKVRole::kK, k), arrived(QKVRole::kV, v),
                          call, ctx);
    }
    // Group g's ring starts once its own pieces are here (the later groups' still travel).
    // Group g+1's pieces launch once group g's first ring shift has landed: launched with group
    // 0's pieces waited (the default), the later groups' shared the link with that shift,
    // which had only the own block's attention to hide behind.
    arrived.defer_later_pieces();
    detail::GroupedArrival qa(arrived.pieces(QKVRole::kQ, q), q, groups, u, t.ulysses_rank, hd),
        ka(arrived.pieces(QKVRole::kK, k), k, groups, u, t.ulysses_rank, hd),
        va(arrived.pieces(QKVRole::kV, v), v, groups, u, t.ulysses_rank, hd);
    const int64_t gq = nq / groups;
    auto ring = ring_of(q.size(l.seq_dim) * u, ctx);
    std::vector<comm::InFlight> moving;
    const auto release_next = [&arrived] { arrived.release_next_pieces(); };
    for (int64_t g = 0; g < groups; ++g) {
      ring.head_offset = t.ulysses_rank * nq + g * gq;
      auto out = detail::ring_attend(qa.moved(g), ka.moved(g), va.moved(g), call, l, ring,
                                     g + 1 < groups ? release_next : std::function<void()>());
      moving.push_back(comm::all_to_all_start(out.contiguous(), l.seq_dim, hd, t.ulysses));
    }
    arrived.release_later_pieces();  // (launched by now; clears the deferral)
    return anchored(detail::heads_from_groups(moving, u, l),
                    detail::GroupedArrival::all_of(qa, ka, va));
  }

 private:
  at::Tensor attend_moved(const at::Tensor& q, at::Tensor k, at::Tensor v,
                          const AttentionCall& call, const CPRuntimeContext& ctx) const {
    auto ring = ring_of(q.size(ctx.layout.seq_dim), ctx);
    ring.head_offset = ctx.topology->ulysses_rank * q.size(ctx.layout.heads_dim);
    auto out = detail::ring_attend(q, k, v, call, ctx.layout, ring);
    return restore_output({out}, PreparedQKV{}, ctx);
  }

  // The ring across the C groups as the byte formulas see it.
  struct RingPart {
    std::vector<std::vector<int64_t>> chunks;
    int64_t member = 0, positions = 0;
    RingHeads heads;
  };
  static RingPart ring_part(const ContextParallelConfig& c, int64_t p, const AttentionShape& s,
                            int64_t cp_rank) {
    const int64_t u = ulysses_degree_of(c, p), groups = p / u;
    const int64_t kv = repeats_kv(c.kv_head_policy, u, s.kv_heads) ? 1 : s.kv_heads / u;
    return {ring_member_chunks(p, u, c.load_balance && groups > 1),
            cp_rank / u,
            (s.seq / groups) * s.batch,
            {s.q_heads / u, kv, s.qk_dim, s.v_dim_or_qk(), s.element_size}};
  }

  // The ring over the co group for `held` positions per rank after the all-to-all (S/C); the
  // caller sets head_offset.
  static detail::RingGroup ring_of(int64_t held, const CPRuntimeContext& ctx) {
    const auto& t = *ctx.topology;
    detail::RingGroup ring{t.co, t.co_rank, t.colossal_degree,    0,
                           {},   0,         ctx.ring_keep_blocks, ctx.ring_backward};
    // After the all-to-all a co-rank holds its Ulysses group's shards in rank order: the
    // contiguous range c of C, or (head-tail balance) the two chunks of each member.
    const int64_t u = t.ulysses_degree;
    ring.chunks = ring_member_chunks(t.cp_size, u, ctx.load_balance);
    ring.chunk_len = ctx.load_balance ? held / (2 * u) : held;
    return ring;
  }
};

}  // namespace

std::shared_ptr<const CPStrategy> make_usp_strategy() {
  return std::make_shared<UspStrategy>();
}

}  // namespace hp::cp
