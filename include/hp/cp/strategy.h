// CP strategies: *what* is communicated around one attention call (DESIGN sections 5.2, 14).
// Adapters decide *how* attention is reached; any adapter works with any strategy.
//
// A strategy owns the whole CP attention step of one call:
//
//   sync:   out = strategy.run_sync(q, k, v, call, ctx)
//   async:  out = strategy.run_async(q, k, v, call, ctx, arrived)
//
// where `call` runs the module's own attention on one (query block, key block) with the
// options the adapter rewrote for that block's causal state, and returns {out, lse}. The
// defaults are the move -> finish -> attend -> restore pipeline:
//
//   prepared = prepare_qkv(q, k, v, ctx)         move each moved role (a differentiable
//                                                collective), then finish(): what attention
//                                                consumes, one or more query parts
//   outs[i]  = attend(prepared, call, ctx)[i]    one call per query part, K/V cut at the part's
//                                                causal prefix
//   out      = restore_output(outs, prepared, ctx)   -> the caller's local sequence shard
//
// A strategy that exchanges data *during* attention (ring: K/V blocks travel while each block is
// attended, partial results merged by their log-sum-exp) overrides run_sync; one that overlaps
// its collectives with attention on what is already local overrides run_async. Nothing outside
// the strategy's own file knows which strategy runs.
//
// Tensors are in the module's layout (ctx.layout: seq_dim / heads_dim, any 4-d layout with the
// per-head feature dim last; V may have another last dim than Q/K); every collective is
// differentiable (backward = inverse collective).
#pragma once

#include <array>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include <ATen/core/Tensor.h>

#include "hp/attention/host.h"
#include "hp/attention/masks.h"
#include "hp/comm/comm_handle.h"
#include "hp/comm/types.h"
#include "hp/common/registry.h"
#include "hp/common/trace.h"
#include "hp/cp/config.h"
#include "hp/cp/topology.h"
#include "hp/cp/volume.h"

namespace hp::cp {

class CPAdapter;
class CPStrategy;

// Where the sequence and the heads sit in q/k/v: indices of dims, not sizes.
struct QKVLayout {
  int64_t seq_dim = 2;  // BNSD default
  int64_t heads_dim = 1;
  // The one check that seq_dim and heads_dim name different dims; `who` names the module.
  void check(const std::string& who) const;
};

struct CPRuntimeContext {
  std::shared_ptr<const CPTopology> topology;
  QKVLayout layout;
  // Head-tail load balance (strategies that support it): whether, and in which of the two forms.
  bool load_balance = false;
  LoadBalanceForm load_balance_form = LoadBalanceForm::kDataOrder;
  KVHeadPolicy kv_head_policy = KVHeadPolicy::kError;
  // The module's K/V heads (this rank's, after TP) as they reach CP; set by the runtime before
  // any K/V is moved. With kv_head_policy=repeat and kv_heads % U != 0, K/V take the repeat path.
  int64_t kv_heads = 0;
  // Async ulysses, usp and all_gather: head groups (ContextParallelConfig::ulysses_head_groups;
  // 0: auto).
  int64_t ulysses_head_groups = 0;
  // Async all_gather and hybrid (ContextParallelConfig::async_always_local_first).
  bool async_always_local_first = false;
  // Ring and usp (ContextParallelConfig::ring_keep_blocks, ring_backward).
  bool ring_keep_blocks = false;
  RingBackward ring_backward = RingBackward::kAuto;
  // Async ulysses (ContextParallelConfig::ulysses_row_parts; 0: auto).
  int64_t ulysses_row_parts = 0;
  // Async schedule: the runtime skipped this call's moves at the handoff points, because the
  // options announced before the projections made them useless (CPStrategy::skips_moves).
  bool moves_skipped = false;
};

// Per-call state a strategy hands from finish() to the attention calls and restore_output.
struct CallState {
  attention::CausalMetadata causal;  // q_offset, q_len, kv_len of the tensors attention sees
  int64_t kv_start = 0;              // global position of the first key attention sees
                                     // (q's first row is at kv_start + causal.q_offset)
  int64_t head_offset = 0;           // global index of the first query head attention sees
  int64_t local_seq = 0;             // the caller's local sequence length
};

// One attention call of a prepared layer: a query block with its own causal state. Most
// strategies have one part; head-tail load balance one per chunk held (all_gather: 2).
struct QueryPart {
  at::Tensor q;
  CallState state;
};

struct PreparedQKV {
  at::Tensor k, v;
  std::vector<QueryPart> parts;
};

enum class QKVRole { kQ = 0, kK = 1, kV = 2 };
const char* role_name(QKVRole role);  // "q", "k", "v"

// The module's own attention, reached through the adapter. Built by the runtime for one
// intercepted call; strategies call it once per (query block, key block). Copyable and self-
// contained (options and the inner function are held by value), so a strategy may keep a copy
// for its backward. Each call is an "attention" event ("compute") on the CP group's tracer when
// there is one, and its backward, when the autograd engine runs it, an "attention_backward"
// event (the per-rank timeline shows what ran while collectives flew, in both passes).
class AttentionCall {
 public:
  // `from_stats`: the inner function's gradients from merged statistics, when the host offers
  // them (see grads_from_stats).
  AttentionCall(const attention::AttentionOptions& options, const attention::AttentionFn& inner,
                const CPAdapter& adapter, const CPStrategy& strategy, const CPRuntimeContext& ctx,
                attention::StatsBackwardFn from_stats = nullptr);

  // Attention of `q` against `k`, `v` (in ctx.layout) for the block described by `state`:
  // state.causal.q_offset is the position of q's first row relative to k's first row. Under
  // causal masking, keys past the block's last query are cut off (never computed), and a
  // block whose keys all precede its first query runs unmasked. Returns {out, lse}; lse is
  // [B, N, Sq] in the primitive frame (see lse_like_out).
  attention::AttentionResult operator()(const at::Tensor& q, const at::Tensor& k,
                                        const at::Tensor& v, const CallState& state) const;

  // Whether the caller's packed documents hide every (query, key) pair of the block `state`
  // describes (its q_len queries at kv_start + q_offset, kv_len keys at kv_start): a strategy
  // skips such a block instead of computing it. False without documents.
  bool hidden(const CallState& state) const;

  // Whether grads_from_stats can run (the module's attention is a primitive that offers
  // backward_from_stats; see attention.h).
  bool offers_grads_from_stats() const { return static_cast<bool>(from_stats_); }
  // The gradients of one block's call (as operator() would run it for `state`) from the
  // merged `out` and `lse` (primitive frame, [B, N, Sq]) of all the blocks its queries attend,
  // and `dout`: no forward recomputed. `out` (in ctx.layout) may be given as rowsum(dout * out)
  // with its last dim summed away (what the ring sends when the queries travel). dk, dv cover
  // k's first rows only where the causal cut drops keys past the block's last query (their
  // gradient is zero): add them at row 0.
  attention::AttentionGrads grads_from_stats(const at::Tensor& q, const at::Tensor& k,
                                             const at::Tensor& v, const at::Tensor& out,
                                             const at::Tensor& lse, const at::Tensor& dout,
                                             const CallState& state) const;

  // The caller's options, before any rewrite (causal flag, masks).
  const attention::AttentionOptions& options() const { return options_; }
  const QKVLayout& layout() const { return layout_; }

 private:
  attention::AttentionResult run(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                 const CallState& state) const;
  // The options a block's call passes, and its keys/values after the causal cut.
  struct Prepared {
    attention::AttentionOptions options;
    at::Tensor k, v;
  };
  Prepared prepare(const at::Tensor& k, const at::Tensor& v, const CallState& state) const;
  // Hooks that record the backward of the call that took q, k, v and returned `result`.
  void trace_backward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                      const attention::AttentionResult& result) const;
  // Copies: a strategy may keep the call for its backward (the ring recomputes its blocks
  // there). The adapter and the strategy are registry objects that outlive every call.
  attention::AttentionOptions options_;
  attention::AttentionFn inner_;
  attention::StatsBackwardFn from_stats_;
  const CPAdapter& adapter_;
  const CPStrategy& strategy_;
  QKVLayout layout_;
  std::shared_ptr<common::Tracer> tracer_;  // the CP group's, when enabled
  int rank_ = 0;
};

// arrived(role, x) waits for the collective `role` started at its handoff point and returns the
// moved tensor (differentiably); `x` is the tensor that reached attention for that role. When
// the handoff moved `role` in pieces (CPStrategy::split_for_move), it waits for every piece and
// joins them (join_moved).
// arrived.pieces(role, x): the pieces, each with what its handoff emitted (local data: no
// wait), one wait for it moved (called once, in any order) and whether that wait would not
// block now, so a strategy can attend what has arrived while the rest travels; one piece (x, a
// wait of the whole) when no pieces function was given.
// arrived.landed(role): whether that wait would not block now (false when it cannot tell).
// Pieces after each handoff's first launch once every first piece has been waited for, unless
// the strategy called arrived.defer_later_pieces() before that: then piece i of every handoff
// launches at the strategy's i-th arrived.release_next_pieces() (usp: once the previous head
// group's first ring shift has landed, so the two do not share the link), every held piece at
// arrived.release_later_pieces(), and pieces up to i when piece i is waited for, whichever
// comes first. Every rank must call them at the same points of its program. No-ops without
// pieces.
class ArrivedFn {
 public:
  using Wait = std::function<at::Tensor(QKVRole role, const at::Tensor& x)>;
  struct Piece {
    at::Tensor emitted;
    std::function<at::Tensor()> wait;
    std::function<bool()> landed;  // whether wait would not block now (null: cannot tell)
  };
  using Pieces = std::function<std::vector<Piece>(QKVRole role, const at::Tensor& x)>;
  using Landed = std::function<bool(QKVRole role)>;
  enum class Later { kDefer, kReleaseNext, kReleaseAll };
  using LaterPieces = std::function<void(Later)>;
  template <class F, class = std::enable_if_t<!std::is_same_v<std::decay_t<F>, ArrivedFn> &&
                                              std::is_constructible_v<Wait, F>>>
  ArrivedFn(F wait, Landed landed = nullptr,  // NOLINT: implicit from a wait function
            Pieces pieces = nullptr, LaterPieces later = nullptr)
      : wait_(std::move(wait)),
        landed_(std::move(landed)),
        pieces_(std::move(pieces)),
        later_(std::move(later)) {}
  at::Tensor operator()(QKVRole role, const at::Tensor& x) const { return wait_(role, x); }
  std::vector<Piece> pieces(QKVRole role, const at::Tensor& x) const {
    if (pieces_ != nullptr) return pieces_(role, x);
    return {{x, [wait = wait_, role, x] { return wait(role, x); },
             [landed = landed_, role] { return landed != nullptr && landed(role); }}};
  }
  bool landed(QKVRole role) const { return landed_ != nullptr && landed_(role); }
  void defer_later_pieces() const {
    if (later_ != nullptr) later_(Later::kDefer);
  }
  void release_next_pieces() const {
    if (later_ != nullptr) later_(Later::kReleaseNext);
  }
  void release_later_pieces() const {
    if (later_ != nullptr) later_(Later::kReleaseAll);
  }

 private:
  Wait wait_;
  Landed landed_;
  Pieces pieces_;
  LaterPieces later_;
};

class CPStrategy {
 public:
  virtual ~CPStrategy() = default;
  virtual std::string name() const = 0;
  // One line for help texts and listings.
  virtual std::string summary() const = 0;

  // ---- plan level (before any communication) ----
  // Fills c.ulysses_degree for this strategy (1 when it uses no Ulysses groups) and checks
  // every field only this strategy constrains; messages name field, value and fix.
  virtual void normalize(ContextParallelConfig& c, int64_t cp_size) const = 0;
  // Whether head-tail load balance applies (config.load_balance).
  virtual bool supports_load_balance() const { return false; }
  // Forward bytes one CP rank sends in one attention layer (the formula the benches and
  // hp-cp-run report beside the counted bytes). The default is the Ulysses x all-gather
  // composition by the config's degrees: (2h + 2h_kv)(S/P)e(U-1)/U + 2 S h_kv e (C-1)/(C U)
  // (and the kv_head_policy=repeat form, cp/volume.h).
  virtual int64_t forward_bytes_per_rank(const ContextParallelConfig& c, int64_t cp_size,
                                         const AttentionShape& shape, int64_t cp_rank) const;
  // Backward bytes: the inverse collectives move what forward moved (the default); a strategy
  // whose backward sends more (ring: the blocks again and their dK/dV accumulators) says so.
  virtual int64_t backward_bytes_per_rank(const ContextParallelConfig& c, int64_t cp_size,
                                          const AttentionShape& shape, int64_t cp_rank) const {
    return forward_bytes_per_rank(c, cp_size, shape, cp_rank);
  }
  // Collectives the strategy issues (checked against the backend at apply time).
  virtual std::vector<comm::OpKind> required_ops() const = 0;

  // ---- call level ----
  // Checks of one call's options that must pass before any collective (e.g. a tensor mask
  // cannot follow a head re-layout). `who` starts the message.
  virtual void check_options(const attention::AttentionOptions& /*options*/,
                             const std::string& /*who*/) const {}
  // Checks of one input tensor (q in the sync schedule; each role's tensor at its handoff in
  // the async schedule) that must pass before its collective. `who` starts the message.
  virtual void check_inputs(const at::Tensor& /*x*/, const CPRuntimeContext& /*ctx*/,
                            const std::string& /*who*/) const {}

  // Roles that go through a collective before attention (all_gather: k, v; ulysses and
  // hybrid: q, k, v), in the order they are moved. Empty for a strategy that moves nothing
  // before attention (ring). The async schedule needs a handoff point for each.
  virtual std::vector<QKVRole> moved_roles() const = 0;
  virtual at::Tensor move(QKVRole role, const at::Tensor& x, const CPRuntimeContext& ctx) const;
  virtual comm::CommHandle move_async(QKVRole role, const at::Tensor& x,
                                      const CPRuntimeContext& ctx) const;
  // The inverse collective of a gradient of the moved tensor.
  virtual comm::CommHandle move_grad_async(QKVRole role, const at::Tensor& grad,
                                           const CPRuntimeContext& ctx) const;
  // Async schedule: the pieces the handoff of `role` moves `x` in, each by its own move_async
  // (default: one piece, x itself; ulysses: one per head group, so a group is attended once its
  // pieces have arrived and its gradients leave as soon as its backward is done). A re-layout
  // of x's elements (each element in exactly one piece), applied alike to x's gradient: the
  // model continues with x, whose gradient reaches the pieces split the same way.
  // join_moved puts the moved pieces together as move_async of x would have returned them
  // (called only with more than one piece).
  virtual std::vector<at::Tensor> split_for_move(QKVRole /*role*/, const at::Tensor& x,
                                                 const CPRuntimeContext& /*ctx*/) const {
    return {x};
  }
  virtual at::Tensor join_moved(QKVRole role, const std::vector<at::Tensor>& moved,
                                const CPRuntimeContext& ctx) const;
  // From the moved q/k/v (roles that are not moved are passed as given) to what attention
  // consumes. `q_local` is the caller's query shard.
  virtual PreparedQKV finish(const at::Tensor& q_local, const at::Tensor& q, const at::Tensor& k,
                             const at::Tensor& v, const CPRuntimeContext& ctx) const;
  // `outs[i]` is the attention output of prepared.parts[i].
  virtual at::Tensor restore_output(const std::vector<at::Tensor>& outs,
                                    const PreparedQKV& prepared, const CPRuntimeContext& ctx) const;
  virtual attention::CausalMetadata causal_metadata(const CallState& state) const {
    return state.causal;
  }

  // Whether `call` (over a sequence of `total` tokens) needs none of the moves: the caller's
  // query shard attends only its own K/V shard (all_gather, ulysses, hybrid and usp with packed
  // documents that hide every other rank's keys: the heads need not move either). Decided alike
  // on every rank, from global facts only. Where it holds, the runtime runs neither run_sync nor
  // run_async: each rank attends its own shard with every head (rank_local_attention, internal
  // to cp/). Sync asks at the call; async at the first handoff, for announced options
  // (AttentionHost::announce), and then starts no collective (ctx.moves_skipped).
  virtual bool skips_moves(const AttentionCall& /*call*/, int64_t /*total*/,
                           const CPRuntimeContext& /*ctx*/) const {
    return false;
  }

  // The attention step over prepared tensors: one call per query part over the prepared K/V.
  virtual std::vector<at::Tensor> attend(const PreparedQKV& prepared, const AttentionCall& call,
                                         const CPRuntimeContext& ctx) const;
  // Sync schedule: check_inputs(q), move every moved role, finish, attend, restore_output.
  virtual at::Tensor run_sync(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                              const AttentionCall& call, const CPRuntimeContext& ctx) const;
  // Async schedule: the moved roles' collectives started at their handoff points; `arrived`
  // waits for each. Default: wait for every moved role, then finish, attend, restore_output.
  virtual at::Tensor run_async(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               const AttentionCall& call, const CPRuntimeContext& ctx,
                               const ArrivedFn& arrived) const;

  // check_inputs(q), then every moved role moved: {q, k, v} as attention's inputs before finish.
  std::array<at::Tensor, 3> move_qkv(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                     const CPRuntimeContext& ctx) const;
  // move_qkv, then finish (the sync half of run_sync).
  PreparedQKV prepare_qkv(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                          const CPRuntimeContext& ctx) const;
};

// ---- pieces for strategies whose attention step runs several calls per query block ----
// Whether a call may be split into blocks merged by lse: BNSD or BSHD (the merge broadcasts the
// lse against the output) and no tensor mask (its frame starts at key 0 of the whole call; mask
// functions and documents are re-based per block through CallState.kv_start).
bool can_split_call(const AttentionCall& call);
// Partial results of one query block over disjoint key ranges -> the block's output:
// out = sum_i out_i * exp(lse_i - logsumexp_i lse_i), differentiable (through out and lse).
at::Tensor merge_by_lse(const std::vector<attention::AttentionResult>& parts,
                        const QKVLayout& layout);
// `out` plus a zero that depends on every tensor of `moved`: every rank's graph then uses all
// of them (even a rank whose queries read none), so every rank runs their inverse collectives
// in backward, from one node and hence in the same order on every rank.
at::Tensor anchored(const at::Tensor& out, const std::vector<at::Tensor>& moved);

// Name -> strategy. builtin() holds all_gather, ulysses, hybrid, ring and usp and is immutable; to
// add a strategy, copy it (or start empty), add(), and hand the registry to normalize / apply
// through their options. Adding a strategy is one file pair plus one add().
class StrategyRegistry : public common::NamedRegistry<CPStrategy> {
 public:
  StrategyRegistry() : NamedRegistry("CP strategy") {}
  static const StrategyRegistry& builtin();
};

std::shared_ptr<const CPStrategy> make_all_gather_strategy();
std::shared_ptr<const CPStrategy> make_ulysses_strategy();
std::shared_ptr<const CPStrategy> make_hybrid_strategy();
std::shared_ptr<const CPStrategy> make_ring_strategy();
std::shared_ptr<const CPStrategy> make_usp_strategy();

}  // namespace hp::cp
