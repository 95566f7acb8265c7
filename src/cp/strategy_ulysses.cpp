// ulysses: Q, K, V seq->head all-to-all, attention on the full sequence with local heads,
// output head->seq all-to-all.
//
//   q [B, N,   S/P, D]  -- A2A(split head, concat seq) --> [B, N/P,   S, D] --> attention
//   k [B, Nkv, S/P, D]  -- A2A ----------------------------> [B, Nkv/P, S, D]   (plain causal,
//   v [B, Nkv, S/P, Dv] -- A2A ----------------------------> [B, Nkv/P, S, Dv]  offset 0)
//   out [B, N/P, S, Dv] -- A2A(split seq, concat head) --> [B, N, S/P, Dv]
//   backward: the inverse all-to-alls. Needs Q and KV heads divisible by P, or K/V on the
//   repeat path (kv_head_policy=repeat, h < P heads, P % h == 0): each head repeated for its
//   P / h readers before the A2A, so every rank receives only the one head it reads; the
//   gradient back by the inverse A2A, its repeats summed.
//
// Async (run_async): the rank's own heads at its own positions are local before any
// all-to-all; their diagonal block is computed while Q, K, V travel, then the rest. The own
// heads run in G groups (cp_config.ulysses_head_groups), and Q, K, V travel in pieces of head
// groups (split_for_move: one all-to-all per group at each handoff):
//   q [B, N, S/P, D] -> G pieces [B, P*N/(P G), S/P, D] (every rank's heads of group g)
//                    -- A2A each --> group g [B, N/(P G), S, D]
//   (K/V on the repeat path: one piece each, [B, h, S/P, D], repeated to P heads as it is
//   sent -> this rank's one K/V head [B, 1, S, D], shared by every query group; its dK/dV
//   leave after the last group's backward, not group by group)
// Group g is attended as soon as its own pieces have arrived (the later groups' still travel);
// its output all-to-all starts as soon as it is done and flies while the next group is
// attended. The last group runs in row parts (cp_config.ulysses_row_parts; with two: rows
// [0, s/2) and [s/2, s) of every rank's chunk j, each its own all-to-all), so only the last
// part's all-to-all waits with nothing left to compute:
//   last group: rows [j*s, j*s + s/2) for every j -> A2A part 0 (flies while part 1 computes)
//               rows [j*s + s/2, (j+1)*s)         -> A2A part 1 -> rows put back together
// In backward the later groups' output gradients (part 1's first) and their dQ, dK, dV pieces
// fly while the earlier groups' attention backward runs.
//   queries [0, r*s)          x keys [0, r*s)   (causal)
//   queries [r*s, (r+1)*s)    x diagonal (local, first) + keys [0, r*s) (+ [(r+1)*s, S) dense)
//   queries [(r+1)*s, S)      x keys [0, S)     (causal, offset (r+1)*s)
// Packed documents that hide every other rank's keys from every rank's queries
// (rank_keys_hidden; hybrid and usp alike): no all-to-all at all, the runtime has each rank
// attend its own shard with every head (skips_moves; sync: decided at the call; async: at the
// first handoff, where the module announced the call's options).
#include <ATen/ATen.h>

#include "hp/comm/async_transfer.h"
#include "hp/comm/autograd_collectives.h"
#include "hp/comm/collectives.h"
#include "hp/common/check.h"
#include "hp/common/shape.h"
#include "strategy_pieces.h"

namespace hp::cp {

at::Tensor detail::scatter_heads(const at::Tensor& x, const comm::GroupPtr& group,
                                 const QKVLayout& l) {
  if (group->size() == 1) return x;
  return comm::ulysses_seq_to_head(x, l.seq_dim, l.heads_dim, group);
}

at::Tensor detail::gather_heads(const at::Tensor& x, const comm::GroupPtr& group,
                                const QKVLayout& l) {
  if (group->size() == 1) return x;
  return comm::ulysses_head_to_seq(x, l.seq_dim, l.heads_dim, group);
}

comm::CommHandle detail::scatter_heads_async(const at::Tensor& x, const comm::GroupPtr& group,
                                             const QKVLayout& l) {
  return comm::all_to_all_async(*group, x, l.heads_dim, l.seq_dim);
}

comm::CommHandle detail::scatter_heads_grad_async(const at::Tensor& g, const comm::GroupPtr& group,
                                                  const QKVLayout& l) {
  return comm::all_to_all_async(*group, g, l.seq_dim, l.heads_dim);
}

// parts[j] -> [B, T/P, P, Cg] in the parts' promoted dtype.
at::Tensor detail::pack_for_heads(const std::vector<std::vector<at::Tensor>>& parts,
                                  HeadPacking& how) {
  HP_INTERNAL_ASSERT(!parts.empty() && !parts[0].empty(), "ulysses_to_heads: no parts");
  how.first = parts[0];
  how.dtype = how.first[0].scalar_type();
  for (const auto& t : how.first) {
    how.dtype = c10::promoteTypes(how.dtype, t.scalar_type());
    how.widths.push_back(t.numel() / (t.size(0) * t.size(1)));
  }
  std::vector<at::Tensor> groups;
  groups.reserve(parts.size());
  for (const auto& dest : parts) {
    std::vector<at::Tensor> flat;
    flat.reserve(dest.size());
    for (const auto& t : dest)
      flat.push_back(t.reshape({t.size(0), t.size(1), -1}).to(how.dtype));
    groups.push_back(at::cat(flat, 2));
  }
  return at::stack(groups, 2);
}

// moved [B, T, 1, Cg] (after the seq->head all-to-all) -> the parts, [B, T, ...] each.
std::vector<at::Tensor> detail::unpack_heads(const at::Tensor& moved, const HeadPacking& how) {
  auto mine = moved.squeeze(2);
  std::vector<at::Tensor> out;
  int64_t offset = 0;
  for (size_t i = 0; i < how.first.size(); ++i) {
    auto shape = how.first[i].sizes().vec();
    shape[1] = mine.size(1);
    out.push_back(
        mine.narrow(2, offset, how.widths[i]).reshape(shape).to(how.first[i].scalar_type()));
    offset += how.widths[i];
  }
  return out;
}

std::vector<at::Tensor> detail::ulysses_to_heads(const std::vector<std::vector<at::Tensor>>& parts,
                                                 const comm::GroupPtr& group) {
  HeadPacking how;
  auto packed = pack_for_heads(parts, how);  // [B, T/P, P, Cg]
  return unpack_heads(comm::ulysses_seq_to_head(packed, 1, 2, group), how);
}

at::Tensor detail::ulysses_to_sequence(const at::Tensor& o, const comm::GroupPtr& group) {
  const int64_t p = group->size();
  auto back = comm::ulysses_head_to_seq(o.flatten(2).unsqueeze(2), 1, 2, group);  // [B, T/P, P, nX]
  return back.reshape({o.size(0), back.size(1), p * o.size(2), o.size(3)});
}

std::vector<QKVRole> detail::UlyssesMoves::moved_roles() const {
  return {QKVRole::kQ, QKVRole::kK, QKVRole::kV};
}

void detail::check_sub_group_degree(const ContextParallelConfig& c, int64_t cp_size,
                                    const std::string& algorithm, const std::string& degree_one) {
  HP_CHECK(c.ulysses_degree.has_value(), "algorithm=", algorithm,
           " needs cp_config.ulysses_degree, an integer in (1, cp_size=", cp_size,
           ") that divides ", cp_size);
  HP_CHECK(*c.ulysses_degree > 1 && *c.ulysses_degree < cp_size,
           "cp_config.ulysses_degree=", *c.ulysses_degree, " with algorithm=", algorithm,
           " must lie strictly between 1 and cp_size=", cp_size, "; degree 1 is ", degree_one,
           " and degree ", cp_size, " is ulysses");
  HP_CHECK(cp_size % *c.ulysses_degree == 0, "cp_size=", cp_size,
           " is not divisible by cp_config.ulysses_degree=", *c.ulysses_degree,
           "; choose a divisor of ", cp_size);
}

bool detail::UlyssesMoves::repeated_kv(const CPRuntimeContext& ctx) const {
  return repeats_kv(ctx.kv_head_policy, ctx.topology->ulysses_degree, ctx.kv_heads);
}

namespace {

// K and V on the repeat path (kv_head_policy=repeat, h < U heads; U % h == 0, checked): head j
// repeated for the U / h ranks that read it (ranks j U / h .. (j + 1) U / h - 1), so the
// seq -> head all-to-all hands every rank exactly its one head: (U - 1) S/P positions of one
// head leave a rank, not the h heads an all-gather would send. Its gradient comes back the
// same way and the repeats are summed (sum_repeats).
at::Tensor repeat_for_ranks(const at::Tensor& x, const CPRuntimeContext& ctx) {
  const int64_t hd = ctx.layout.heads_dim;
  return x.repeat_interleave(ctx.topology->ulysses_degree / x.size(hd), hd);
}

// The gradient of repeat_for_ranks' output [.., U, ..] -> [.., heads, ..].
at::Tensor sum_repeats(const at::Tensor& g, int64_t heads, int64_t hd) {
  auto shape = g.sizes().vec();
  shape[hd] = heads;
  shape.insert(shape.begin() + hd + 1, g.size(hd) / heads);
  return g.reshape(shape).sum(hd + 1);
}

}  // namespace

at::Tensor detail::UlyssesMoves::move(QKVRole role, const at::Tensor& x,
                                      const CPRuntimeContext& ctx) const {
  const bool repeat = role != QKVRole::kQ && repeated_kv(ctx);
  return scatter_heads(repeat ? repeat_for_ranks(x, ctx) : x, ctx.topology->ulysses, ctx.layout);
}

comm::CommHandle detail::UlyssesMoves::move_async(QKVRole role, const at::Tensor& x,
                                                  const CPRuntimeContext& ctx) const {
  const bool repeat = role != QKVRole::kQ && repeated_kv(ctx);
  return scatter_heads_async(repeat ? repeat_for_ranks(x.detach(), ctx) : x, ctx.topology->ulysses,
                             ctx.layout);
}

comm::CommHandle detail::UlyssesMoves::move_grad_async(QKVRole role, const at::Tensor& g,
                                                       const CPRuntimeContext& ctx) const {
  auto back = scatter_heads_grad_async(g, ctx.topology->ulysses, ctx.layout);
  if (role == QKVRole::kQ || !repeated_kv(ctx)) return back;
  return std::move(back).then(
      [heads = ctx.kv_heads, hd = ctx.layout.heads_dim](const at::Tensor& arrived) {
        return sum_repeats(arrived, heads, hd);
      });
}

at::Tensor detail::UlyssesMoves::join_moved(QKVRole, const std::vector<at::Tensor>& moved,
                                            const CPRuntimeContext& ctx) const {
  return at::cat(moved, ctx.layout.heads_dim);
}

std::vector<at::Tensor> detail::UlyssesMoves::split_head_groups(
    QKVRole role, const at::Tensor& x, const CPRuntimeContext& ctx,
    const CPAlgorithm& algorithm) const {
  const int64_t p = ctx.topology->ulysses_degree, hd = ctx.layout.heads_dim;
  if (p == 1) return {x};
  if (repeated_kv(ctx) && (role != QKVRole::kQ || algorithm.name() == CPAlgorithm::kUsp)) {
    return {x};
  }
  const int64_t n = x.size(hd) / p;
  const int64_t groups = head_groups(ctx, algorithm, n, n, x.size(ctx.layout.seq_dim));
  if (groups == 1) return {x};
  return split_groups(x, p, groups, hd);
}

bool detail::UlyssesMoves::skips_moves(const AttentionCall& call, int64_t total,
                                       const CPRuntimeContext& ctx) const {
  return rank_keys_hidden(call, total, ctx);
}

at::Tensor detail::UlyssesMoves::restore_output(const std::vector<at::Tensor>& outs,
                                                const PreparedQKV&,
                                                const CPRuntimeContext& ctx) const {
  return gather_heads(outs[0], ctx.topology->ulysses, ctx.layout);
}

void detail::UlyssesMoves::check_options(const attention::AttentionOptions& options,
                                         const std::string& who) const {
  HP_CHECK(!options.mask.defined(), who,
           ": a tensor mask cannot follow the Ulysses re-layout; express it as a mask "
           "function and use the flex_qkv or flex_hf adapter");
}

void detail::UlyssesMoves::check_inputs(const at::Tensor& x, const CPRuntimeContext& ctx,
                                        const std::string& who) const {
  if (ctx.load_balance) check_head_tail(x, ctx);  // hybrid, usp: balanced shards
  const int64_t u = ctx.topology->ulysses_degree;
  const int64_t heads = x.size(ctx.layout.heads_dim);
  if (ctx.kv_head_policy == KVHeadPolicy::kRepeat && heads < u && u % heads == 0) {
    // K/V on the repeat path: one head per rank, shared by the query groups (usp: one group).
    HP_CHECK(ctx.ulysses_head_groups <= 1 || name() != CPAlgorithm::kUsp, who,
             ": cp_config.ulysses_head_groups=", ctx.ulysses_head_groups,
             " with kv_head_policy=repeat (", heads, " key/value heads, Ulysses degree ", u,
             "): usp runs one head group on the repeat path (a ring per group); drop "
             "ulysses_head_groups or use algorithm=ulysses or hybrid");
    return;
  }
  HP_CHECK(heads % u == 0, who, " has ", heads, " heads, not divisible by the Ulysses degree ", u,
           "; use algorithm=all_gather or a smaller ulysses_degree (K/V heads: or "
           "kv_head_policy=repeat)");
  const int64_t g = ctx.ulysses_head_groups, per_rank = heads / u;
  HP_CHECK(g == 0 || per_rank % g == 0, who, ": cp_config.ulysses_head_groups=", g,
           " does not divide the ", per_rank, " heads of ", common::shape_str(x.sizes()),
           " each rank attends after the all-to-all; choose a "
           "common divisor of the query and key/value heads per rank, or 0 (automatic)");
}

int64_t detail::head_groups(const CPRuntimeContext& ctx, const CPAlgorithm& algorithm, int64_t nq,
                            int64_t nkv, int64_t local_seq) {
  ContextParallelConfig c;
  c.algorithm = algorithm;
  c.ulysses_head_groups = ctx.ulysses_head_groups;
  const int64_t g = ulysses_head_groups_of(c, nq, nkv, ctx.topology->cp_size, local_seq);
  HP_INTERNAL_ASSERT(nq % g == 0 && nkv % g == 0, "head groups: ", g, " for ", nq, " and ", nkv,
                     " heads");
  return g;
}

at::Tensor detail::interleave_groups(const std::vector<at::Tensor>& groups, int64_t degree,
                                     int64_t hd) {
  std::vector<at::Tensor> split;
  for (const auto& y : groups) {
    auto shape = y.sizes().vec();
    shape[hd] = y.size(hd) / degree;
    shape.insert(shape.begin() + hd, degree);
    split.push_back(y.reshape(shape));  // [.., U, h, ..]
  }
  return at::stack(split, hd + 1).flatten(hd, hd + 2);  // [.., U, G, h, ..] -> U*G*h heads
}

std::vector<at::Tensor> detail::split_groups(const at::Tensor& x, int64_t degree, int64_t groups,
                                             int64_t hd) {
  auto shape = x.sizes().vec();
  shape[hd] /= degree * groups;
  shape.insert(shape.begin() + hd, groups);
  shape.insert(shape.begin() + hd, degree);
  // A view (splitting one dim never copies), one node for all groups (its backward stacks
  // their gradients once); each group is copied once, by the flatten.
  std::vector<at::Tensor> out;
  for (const auto& g : x.view(shape).unbind(hd + 1))
    out.push_back(g.flatten(hd, hd + 1));  // [.., U, h, ..] -> U*h heads
  return out;
}

at::Tensor detail::heads_from_groups(std::vector<comm::InFlight>& moving, int64_t degree,
                                     const QKVLayout& l, int64_t last_group_parts) {
  HP_INTERNAL_ASSERT(
      last_group_parts >= 1 && static_cast<size_t>(last_group_parts) <= moving.size(),
      "heads_from_groups: ", last_group_parts, " row parts of ", moving.size(), " transfers");
  // Backward runs the last transfer first: its output gradient travels alone, and each earlier
  // one leaves once the later one's has arrived (flying while that part's backward runs).
  for (size_t g = 1; g < moving.size(); ++g)
    comm::chain_inverse(moving[g], moving[g - 1]);
  const size_t whole = moving.size() - static_cast<size_t>(last_group_parts);
  std::vector<at::Tensor> back, rows;
  for (size_t i = 0; i < moving.size(); ++i)
    (i < whole ? back : rows).push_back(moving[i].wait());
  back.push_back(rows.size() == 1 ? rows[0] : at::cat(rows, l.seq_dim));
  return interleave_groups(back, degree, l.heads_dim);
}

detail::GroupedArrival::GroupedArrival(std::vector<ArrivedFn::Piece> pieces, const at::Tensor& x,
                                       int64_t groups, int64_t degree, int64_t rank,
                                       int64_t heads_dim)
    : pieces_(std::move(pieces)),
      x_(x),
      moved_(pieces_.size()),
      groups_(groups),
      degree_(degree),
      rank_(rank),
      hd_(heads_dim) {}

at::Tensor detail::GroupedArrival::local(int64_t g) const {
  HP_INTERNAL_ASSERT(x_.size(hd_) % degree_ == 0, "GroupedArrival::local: ", x_.size(hd_),
                     " heads for a Ulysses degree of ", degree_,
                     " (K/V on the repeat path: take the local head directly)");
  if (!on_group_bounds()) {
    const int64_t h = x_.size(hd_) / (degree_ * groups_);
    return x_.narrow(hd_, (rank_ * groups_ + g) * h, h);
  }
  const size_t per = pieces_.size() / groups_;
  std::vector<at::Tensor> parts;
  for (size_t i = g * per; i < (g + 1) * per; ++i) {
    const auto& e = pieces_[i].emitted;  // [.., U*h, ..]: every rank's heads of this piece
    const int64_t h = e.size(hd_) / degree_;
    parts.push_back(e.narrow(hd_, rank_ * h, h));
  }
  return parts.size() == 1 ? parts[0] : at::cat(parts, hd_);
}

at::Tensor detail::GroupedArrival::piece(size_t i) {
  if (!moved_[i].defined()) moved_[i] = pieces_[i].wait();
  return moved_[i];
}

at::Tensor detail::GroupedArrival::moved(int64_t g) {
  if (on_group_bounds()) {
    const size_t per = pieces_.size() / groups_;
    std::vector<at::Tensor> parts;
    for (size_t i = g * per; i < (g + 1) * per; ++i)
      parts.push_back(piece(i));
    return parts.size() == 1 ? parts[0] : at::cat(parts, hd_);
  }
  if (!whole_.defined()) whole_ = at::cat(all(), hd_);
  const int64_t h = whole_.size(hd_) / groups_;
  return whole_.narrow(hd_, g * h, h);
}

std::vector<at::Tensor> detail::GroupedArrival::all() {
  for (size_t i = 0; i < pieces_.size(); ++i)
    piece(i);
  return moved_;
}

std::vector<at::Tensor> detail::GroupedArrival::all_of(GroupedArrival& q, GroupedArrival& k,
                                                       GroupedArrival& v) {
  std::vector<at::Tensor> out;
  for (auto* role : {&q, &k, &v}) {
    auto pieces = role->all();
    out.insert(out.end(), pieces.begin(), pieces.end());
  }
  return out;
}

namespace {

class UlyssesStrategy final : public detail::UlyssesMoves {
 public:
  std::string name() const override { return "ulysses"; }
  std::string summary() const override {
    return "Q/K/V seq->head all-to-all, attention on P-th of the heads over the whole sequence "
           "(heads divisible by cp)";
  }
  void normalize(ContextParallelConfig& c, int64_t cp_size) const override {
    if (!c.ulysses_degree) c.ulysses_degree = cp_size;
    HP_CHECK(*c.ulysses_degree >= 1 && cp_size % *c.ulysses_degree == 0, "cp_size=", cp_size,
             " is not divisible by cp_config.ulysses_degree=", *c.ulysses_degree,
             "; choose a divisor of ", cp_size);
    HP_CHECK(*c.ulysses_degree == cp_size, "cp_config.ulysses_degree=", *c.ulysses_degree,
             " with algorithm=ulysses must equal cp_size=", cp_size,
             "; use algorithm=hybrid for a smaller degree");
  }
  std::vector<comm::OpKind> required_ops() const override { return {comm::OpKind::kAllToAll}; }

  PreparedQKV finish(const at::Tensor& q_local, const at::Tensor& q, const at::Tensor& k_moved,
                     const at::Tensor& v_moved, const CPRuntimeContext& ctx) const override {
    const auto& l = ctx.layout;
    const auto &k = k_moved, &v = v_moved;
    QueryPart part{q, {}};
    part.state.local_seq = q_local.size(l.seq_dim);
    part.state.causal = {0, q.size(l.seq_dim), k.size(l.seq_dim)};
    part.state.head_offset = ctx.topology->ulysses_rank * q.size(l.heads_dim);
    return PreparedQKV{k, v, {part}};
  }

  // One piece per head group (head_groups of the role's own heads per rank): group g is
  // attended once its Q, K and V pieces have arrived, and its dQ, dK, dV leave as soon as its
  // backward is done.
  // On the repeat path K and V travel whole (one head per rank, read by every query group).
  std::vector<at::Tensor> split_for_move(QKVRole role, const at::Tensor& x,
                                         const CPRuntimeContext& ctx) const override {
    return split_head_groups(role, x, ctx, CPAlgorithm::kUlysses);
  }

  at::Tensor run_async(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                       const AttentionCall& call, const CPRuntimeContext& ctx,
                       const ArrivedFn& arrived) const override {
    if (!can_split_call(call) || ctx.topology->cp_size == 1) {
      return CPStrategy::run_async(q, k, v, call, ctx, arrived);
    }
    return overlapped(q, k, v, call, ctx, arrived);
  }

 private:
  at::Tensor overlapped(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                        const AttentionCall& call, const CPRuntimeContext& ctx,
                        const ArrivedFn& arrived) const {
    const auto& l = ctx.layout;
    const int64_t seq = l.seq_dim, hd = l.heads_dim, p = ctx.topology->ulysses_degree;
    const int64_t r = ctx.topology->ulysses_rank;
    const int64_t s = q.size(seq), total = s * p;
    // The repeat path (h K/V heads < P): each rank reads the one K/V head r h / P, which all
    // its query groups share; it travels whole (split_for_move).
    const bool repeat = repeated_kv(ctx);
    const int64_t nq = q.size(hd) / p, nkv = repeat ? nq : k.size(hd) / p;
    const int64_t groups = detail::head_groups(ctx, CPAlgorithm::kUlysses, nq, nkv),
                  gq = nq / groups, kv_groups = repeat ? 1 : groups;
    const bool causal = call.options().causal;
    const int64_t own = r * s, own_end = own + s;
    // Queries at global [q_begin, ..) against keys at [key_begin, ..), heads of group g.
    auto block = [&](int64_t g, const at::Tensor& qq, int64_t q_begin, const at::Tensor& kk,
                     const at::Tensor& vv, int64_t key_begin) {
      CallState b;
      b.local_seq = s;
      b.head_offset = r * nq + g * gq;
      b.causal = {q_begin - key_begin, qq.size(seq), kk.size(seq)};
      b.kv_start = key_begin;
      return call(qq, kk, vv, b);
    };
    // Q, K, V with the own heads over the whole sequence, in pieces of heads: group g waits
    // only for its own (the later groups' pieces still travel).
    detail::GroupedArrival qa(arrived.pieces(QKVRole::kQ, q), q, groups, p, r, hd),
        ka(arrived.pieces(QKVRole::kK, k), k, kv_groups, p, r, hd),
        va(arrived.pieces(QKVRole::kV, v), v, kv_groups, p, r, hd);
    auto kv_local = [&](detail::GroupedArrival& a, const at::Tensor& x, int64_t g) {
      return repeat ? x.narrow(hd, r * x.size(hd) / p, 1) : a.local(g);
    };
    // 1. The diagonal blocks of the own heads, from what the handoffs emitted, group by group.
    std::vector<attention::AttentionResult> diag;
    for (int64_t g = 0; g < groups; ++g)
      diag.push_back(block(g, qa.local(g), own, kv_local(ka, k, g), kv_local(va, v, g), own));
    // 3. Per group the rest, as query segments in sequence order; its output's head->seq
    //    all-to-all starts at once and flies while the next group is attended. The last group
    //    goes in row parts (rows [a, a + n) of every chunk, one all-to-all each), so only its
    //    last part's all-to-all (forward) and inverse (backward) wait with nothing to compute.
    ContextParallelConfig rows;
    rows.ulysses_row_parts = ctx.ulysses_row_parts;
    const int64_t parts = ulysses_row_parts_of(rows, s);
    std::vector<comm::InFlight> moving;
    for (int64_t g = 0; g < groups; ++g) {
      // 2. Group g's Q, K, V over the whole sequence, once its pieces have arrived.
      auto qg = qa.moved(g), kg = ka.moved(repeat ? 0 : g), vg = va.moved(repeat ? 0 : g);
      auto keys = [&](int64_t b, int64_t e) {
        return std::make_pair(kg.narrow(seq, b, e - b), vg.narrow(seq, b, e - b));
      };
      // The own queries' rows [a, a + n): the diagonal block's rows merged with the other keys.
      auto own_rows = [&](int64_t a, int64_t n) {
        const auto& d = diag[g];
        std::vector<attention::AttentionResult> own_parts{
            {d.out.narrow(seq, a, n), d.lse.defined() ? d.lse.narrow(2, a, n) : at::Tensor()}};
        auto qq = qg.narrow(seq, own + a, n);
        if (own > 0) {
          auto kv = keys(0, own);
          own_parts.push_back(block(g, qq, own + a, kv.first, kv.second, 0));
        }
        if (!causal && own_end < total) {
          auto kv = keys(own_end, total);
          own_parts.push_back(block(g, qq, own + a, kv.first, kv.second, own_end));
        }
        return merge_by_lse(own_parts, l);
      };
      auto send = [&](const at::Tensor& out) {
        moving.push_back(comm::all_to_all_start(out.contiguous(), seq, hd, ctx.topology->ulysses));
      };
      if (g + 1 < groups || parts == 1) {
        std::vector<at::Tensor> segments;
        if (own > 0) {
          auto kv = keys(0, causal ? own : total);
          segments.push_back(block(g, qg.narrow(seq, 0, own), 0, kv.first, kv.second, 0).out);
        }
        segments.push_back(own_rows(0, s));
        if (own_end < total) {
          auto kv = keys(0, total);
          segments.push_back(
              block(g, qg.narrow(seq, own_end, total - own_end), own_end, kv.first, kv.second, 0)
                  .out);
        }
        send(segments.size() == 1 ? segments[0] : at::cat(segments, seq));
        continue;
      }
      for (int64_t m = 0; m < parts; ++m) {
        const int64_t a = m * s / parts, n = (m + 1) * s / parts - a;
        std::vector<at::Tensor> chunks;
        for (int64_t j = 0; j < p; ++j) {
          if (j == r) {
            chunks.push_back(own_rows(a, n));
            continue;
          }
          const int64_t q_begin = j * s + a;
          auto kv = keys(0, causal ? q_begin + n : total);
          chunks.push_back(
              block(g, qg.narrow(seq, q_begin, n), q_begin, kv.first, kv.second, 0).out);
        }
        send(at::cat(chunks, seq));
      }
    }
    const auto moved = detail::GroupedArrival::all_of(qa, ka, va);
    // 4. Group g came back as heads (rank j, head i) -> global head j*nq + g*gq + i.
    return anchored(detail::heads_from_groups(moving, p, l, parts), moved);
  }
};

}  // namespace

std::shared_ptr<const CPStrategy> make_ulysses_strategy() {
  return std::make_shared<UlyssesStrategy>();
}

}  // namespace hp::cp
