// Internal to cp/: the pieces strategies are made of. The communication pieces exist once:
// hybrid composes the all-gather and Ulysses pieces over its sub-groups; all_gather and ulysses
// use one each over the whole CP group. The merge and the anchor serve every strategy whose
// attention step runs several calls per query block.
#pragma once

#include <functional>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>

#include "hp/attention/attention.h"
#include "hp/comm/async_transfer.h"
#include "hp/comm/group.h"
#include "hp/cp/strategy.h"

namespace hp::cp::detail {

// ---- all-gather piece (strategy_all_gather.cpp) ----
// K and V all-gathered along seq over `group` (rank order): [.., S/C, ..] -> [.., S, ..].
// Backward: reduce-scatter of dK, dV.
void gather_kv(at::Tensor& k, at::Tensor& v, const comm::GroupPtr& group, const QKVLayout& l);
at::Tensor gather_seq(const at::Tensor& x, const comm::GroupPtr& group, const QKVLayout& l);
comm::CommHandle gather_seq_async(const at::Tensor& x, const comm::GroupPtr& group,
                                  const QKVLayout& l);
comm::CommHandle gather_seq_grad_async(const at::Tensor& g, const comm::GroupPtr& group,
                                       const QKVLayout& l);  // reduce-scatter
// The async half: attention of query parts whose own K/V rows are here while the whole K/V
// travels. parts[i].state.causal.q_offset is part i's global position (total keys in all);
// k/v hold part i's keys, at the same positions, in the parts' order. Each part attends the
// local chunks it can see, then gathered() (waits; K/V of all `total` positions, natural
// order), then the visible ranges outside the local chunks; blocks packed documents hide are
// skipped. Backward runs the gathered blocks first, so the inverse collective started there
// flies while the local blocks' backward computes. One output per part; every rank's graph
// reaches the gathered tensors (anchored), so every rank runs their inverse collectives.
// An undefined `gathered` (nothing outside the local chunks is visible to any rank, see
// remote_keys_hidden) attends the local chunks only: no wait, no anchor.
// `landed` (optional), asked before each part: once it says the gathered K/V would not block,
// that part and the rest attend all their visible keys in one call each after the wait (as
// sync; split calls cost time and there is nothing left to hide).
using GatheredKV = std::function<std::pair<at::Tensor, at::Tensor>()>;
std::vector<at::Tensor> attend_local_first(const std::vector<QueryPart>& parts, const at::Tensor& k,
                                           const at::Tensor& v, int64_t total,
                                           const AttentionCall& call, const GatheredKV& gathered,
                                           const std::function<bool()>& landed = {});
// Whether the call's packed documents (and the causal rule) hide, from every one of the
// group's `size` ranks, every key outside the chunks that rank holds: its queries and keys are
// chunks `chunks(rank)` of the sequence cut into size * chunks(rank).size() equal chunks. All ranks
// decide the same from the global document ids, so all of them may skip the K/V collectives. False
// without documents.
bool remote_keys_hidden(const AttentionCall& call, int64_t size, int64_t total,
                        const std::function<std::vector<int64_t>(int64_t)>& chunks);
// remote_keys_hidden over the CP group with each rank's own shard (block r, or under data-order
// head-tail balance chunks 2r and 2P-2r-1): then no strategy needs to move anything, and each
// rank attends its own shard with every head (rank_local_attention). False on one rank, with
// the runtime-swap balance form (its shards hold other chunks) and for calls that cannot be
// split. all_gather, ulysses, hybrid and usp answer skips_moves with it, and the runtime then
// calls rank_local_attention instead of run_sync / run_async.
bool rank_keys_hidden(const AttentionCall& call, int64_t total, const CPRuntimeContext& ctx);
// The caller's query shard against its own K/V shard only, every head here, no collective
// (rank_keys_hidden holds): the shard's query parts at their global positions.
at::Tensor rank_local_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                const AttentionCall& call, const CPRuntimeContext& ctx);

// ---- Ulysses piece (strategy_ulysses.cpp) ----
// seq -> head all-to-all over `group` of size U: [.., S_l, .., N, ..] -> [.., U*S_l, .., N/U, ..].
at::Tensor scatter_heads(const at::Tensor& x, const comm::GroupPtr& group, const QKVLayout& l);
// Inverse: [.., U*S_l, .., N/U, ..] -> [.., S_l, .., N, ..].
at::Tensor gather_heads(const at::Tensor& x, const comm::GroupPtr& group, const QKVLayout& l);
comm::CommHandle scatter_heads_async(const at::Tensor& x, const comm::GroupPtr& group,
                                     const QKVLayout& l);
comm::CommHandle scatter_heads_grad_async(const at::Tensor& g, const comm::GroupPtr& group,
                                          const QKVLayout& l);  // the inverse all-to-all

// Packed seq->head all-to-all of several tensors (BSHD-like, sequence at dim 1): parts[j]
// lists the tensors [B, T/P, ...] bound for rank j (the same shapes for every j).
// pack_for_heads -> [B, T/P, P, Cg] in the parts' promoted dtype; after the all-to-all
// (split dim 2, concat dim 1) unpack_heads gives this rank's part i from every rank in sequence
// order, [B, T, ...] each, in its own dtype. ulysses_to_heads is the two around one
// differentiable all-to-all (linear-attention and MLA CP modes share it).
struct HeadPacking {
  std::vector<at::Tensor> first;  // parts[0]: the shapes and dtypes to restore
  std::vector<int64_t> widths;    // channels per token of each part
  at::ScalarType dtype = at::kFloat;
};
at::Tensor pack_for_heads(const std::vector<std::vector<at::Tensor>>& parts, HeadPacking& how);
std::vector<at::Tensor> unpack_heads(const at::Tensor& moved, const HeadPacking& how);
std::vector<at::Tensor> ulysses_to_heads(const std::vector<std::vector<at::Tensor>>& parts,
                                         const comm::GroupPtr& group);
// The head->seq all-to-all back: o [B, T, n, X] (this rank's n heads, every token) ->
// [B, T/P, P*n, X] (this rank's tokens, every head, in rank order).
at::Tensor ulysses_to_sequence(const at::Tensor& o, const comm::GroupPtr& group);

// Async head groups (ulysses, hybrid, usp): the number G of groups `algorithm` runs this rank's nq
// query and nkv K/V heads (after the all-to-all) in (ulysses_head_groups_of with
// ctx.ulysses_head_groups and the rank's local_seq tokens before the all-to-all; it divides
// both), and the groups' outputs put back together.
// moving[g] is group g's output [.., U*S_l, .., gq, ..] started on its head->seq all-to-all in
// the Ulysses group of `degree` ranks; waited in order, (rank j, group g, head i) is global head
// j*G*gq + g*gq + i: [.., S_l, .., N, ..]. The last `last_group_parts` transfers are the last
// group in row parts (part m: rows [a_m, a_m + n_m) of every rank's S_l, in row order), put
// back together along seq. In backward each transfer's output gradient launches once the next
// one's has arrived (comm::chain_inverse), the last one's first.
int64_t head_groups(const CPRuntimeContext& ctx, const CPAlgorithm& algorithm, int64_t nq,
                    int64_t nkv, int64_t local_seq = 0);
at::Tensor heads_from_groups(std::vector<comm::InFlight>& moving, int64_t degree,
                             const QKVLayout& l, int64_t last_group_parts = 1);
// The same from tensors: groups[g] [.., U*h, ..] holds head i of rank j's group g at j*h + i ->
// [.., U*G*h, ..] with it at j*G*h + g*h + i (heads dim `hd`). Its inverse, x's heads as G
// such groups: split_groups.
at::Tensor interleave_groups(const std::vector<at::Tensor>& groups, int64_t degree, int64_t hd);
std::vector<at::Tensor> split_groups(const at::Tensor& x, int64_t degree, int64_t groups,
                                     int64_t hd);

// A role moved in pieces (ArrivedFn::pieces of `x`, the tensor that reached attention) read as
// `groups` consecutive head groups, for rank `rank` of the Ulysses group of `degree`:
// local(g) is its own heads of group g at its own positions, from what the handoffs emitted
// (no wait); moved(g) is group g over the whole sequence and waits only for the pieces it needs
// (one per group when the counts agree, several when the pieces are finer, every piece
// otherwise).
class GroupedArrival {
 public:
  GroupedArrival(std::vector<ArrivedFn::Piece> pieces, const at::Tensor& x, int64_t groups,
                 int64_t degree, int64_t rank, int64_t heads_dim);
  at::Tensor local(int64_t g) const;
  at::Tensor moved(int64_t g);
  // Every piece, waited (the tensors an output is anchored to).
  std::vector<at::Tensor> all();
  // Every piece of the three roles, waited, in Q, K, V order.
  static std::vector<at::Tensor> all_of(GroupedArrival& q, GroupedArrival& k, GroupedArrival& v);

 private:
  bool on_group_bounds() const { return pieces_.size() % groups_ == 0; }
  at::Tensor piece(size_t i);
  std::vector<ArrivedFn::Piece> pieces_;
  at::Tensor x_;
  std::vector<at::Tensor> moved_;
  at::Tensor whole_;  // the pieces joined, when they do not fall on group bounds
  int64_t groups_, degree_, rank_, hd_;
};

// Strategies of Ulysses sub-groups x something across them (hybrid, usp): ulysses_degree set,
// strictly between 1 and cp_size (degree 1 is `degree_one`, cp_size is ulysses), dividing it.
void check_sub_group_degree(const ContextParallelConfig& c, int64_t cp_size,
                            const std::string& algorithm, const std::string& degree_one);

// The Ulysses way of moving q, k and v (seq -> head all-to-all in the Ulysses group): what the
// ulysses and hybrid strategies share.
class UlyssesMoves : public CPStrategy {
 public:
  std::vector<QKVRole> moved_roles() const override;
  at::Tensor move(QKVRole role, const at::Tensor& x, const CPRuntimeContext& ctx) const override;
  comm::CommHandle move_async(QKVRole role, const at::Tensor& x,
                              const CPRuntimeContext& ctx) const override;
  comm::CommHandle move_grad_async(QKVRole role, const at::Tensor& grad,
                                   const CPRuntimeContext& ctx) const override;
  // Pieces of heads (used by ulysses' async schedule): piece i of m holds, for every rank j of
  // the Ulysses group, its heads' group i; moved, it is this rank's head group i.
  at::Tensor join_moved(QKVRole role, const std::vector<at::Tensor>& moved,
                        const CPRuntimeContext& ctx) const override;
  // The output's way back: head -> seq all-to-all in the Ulysses group.
  at::Tensor restore_output(const std::vector<at::Tensor>& outs, const PreparedQKV& prepared,
                            const CPRuntimeContext& ctx) const override;
  // A tensor mask cannot follow the head re-layout.
  void check_options(const attention::AttentionOptions& options,
                     const std::string& who) const override;
  // Heads divisible by the Ulysses degree, before the all-to-all (K/V fewer than U: only with
  // kv_head_policy=repeat); balanced shards (hybrid, usp) of an even length; a configured
  // head-group count (async ulysses, usp) dividing the heads per rank.
  void check_inputs(const at::Tensor& x, const CPRuntimeContext& ctx,
                    const std::string& who) const override;
  // Packed documents that hide every other rank's keys from every rank's queries
  // (rank_keys_hidden): the heads need not move at all.
  bool skips_moves(const AttentionCall& call, int64_t total,
                   const CPRuntimeContext& ctx) const override;

 protected:
  // kv_head_policy=repeat with K/V heads fewer than U: move() sends every rank only the one
  // head its query heads read, so the moved K/V hold one head.
  bool repeated_kv(const CPRuntimeContext& ctx) const;
  // split_for_move in head groups (async ulysses, hybrid, usp): x's heads per rank in
  // head_groups(ctx, algorithm) pieces, piece g holding every rank's group g; x whole for one
  // group, a Ulysses degree of 1 or K/V on the repeat path (each rank reads one K/V head,
  // shared by all its query groups). On the repeat path ulysses and hybrid split the queries
  // (usp runs one group there).
  std::vector<at::Tensor> split_head_groups(QKVRole role, const at::Tensor& x,
                                            const CPRuntimeContext& ctx,
                                            const CPAlgorithm& algorithm) const;
};

// ---- lse frames (strategy_pieces.cpp) ----
// lse [B, N, S] (primitive frame) -> broadcastable against out in the module's layout (BNSD or
// BSHD), and back.
at::Tensor lse_like_out(const at::Tensor& lse, const QKVLayout& l);
at::Tensor lse_to_primitive(const at::Tensor& lse_out_frame, const QKVLayout& l);

// ---- ring piece (strategy_ring.cpp) ----
// The group K/V blocks travel around, this rank's place in it, the global index of the first
// query head the calls see (masks per head), and what each member's block holds: the global
// ids of its chunks of `chunk_len` positions, in the order they sit in the block (this rank's
// queries are its own block's chunks).
struct RingGroup {
  comm::GroupPtr group;
  int64_t rank = 0, size = 1;
  int64_t head_offset = 0;
  std::vector<std::vector<int64_t>> chunks;  // [member] -> chunk ids
  int64_t chunk_len = 0;
  bool keep_blocks = false;                     // ContextParallelConfig::ring_keep_blocks
  RingBackward backward = RingBackward::kAuto;  // ContextParallelConfig::ring_backward
};
// Attention of q against the K/V blocks of every member of `ring`, each block shifted on while
// the one here is attended; merged by log-sum-exp. Its backward passes the blocks around again
// with their dK/dV accumulators, so no rank ever holds more than two K/V blocks, or (where
// ring_moves_queries) each member's queries, output gradient and statistics the other way with
// their dQ accumulators; with keep_blocks, forward keeps the blocks that arrived and only the
// accumulators travel in backward. The ring strategy runs it over the CP group, usp over the
// co-groups after its Ulysses all-to-all. `after_first_step` (optional) runs once in forward,
// when the block of the next member has landed, every chunk of it (usp launches its later
// groups' pieces there, so they do not share the link with the first shift).
at::Tensor ring_attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                       const AttentionCall& call, const QKVLayout& layout, const RingGroup& ring,
                       const std::function<void()>& after_first_step = nullptr);

// ---- head-tail load balance (load_balance.cpp) ----
// The two query parts of this rank with their global offsets (swapping the tail with the mirror
// rank in the runtime form), the inverse for the outputs, and the gathered K/V of data-order
// shards put back in natural order.
void check_head_tail(const at::Tensor& q, const CPRuntimeContext& ctx);  // before any collective
std::vector<QueryPart> head_tail_parts(const at::Tensor& q, const CPRuntimeContext& ctx,
                                       int64_t kv_len);
at::Tensor head_tail_restore(const std::vector<at::Tensor>& outs, const CPRuntimeContext& ctx);
// `gathered` holds P data-order shards along seq_dim (rank r: chunks 2r and 2P-2r-1).
at::Tensor natural_order(const at::Tensor& gathered, int64_t cp_size, int64_t seq_dim);
// Gathered K and V of data-order balanced shards (ctx.load_balance, data_order form) put back
// in natural order over ctx.layout's seq dim; unchanged otherwise.
void natural_order_kv(at::Tensor& k, at::Tensor& v, const CPRuntimeContext& ctx);
// Strategies that balance data-order shards only (hybrid, ring, usp): refuses runtime_swap.
void check_data_order_balance(const ContextParallelConfig& c, const std::string& algorithm);

}  // namespace hp::cp::detail
