// One CP attention call:
//   validate(q, k, v)                      before any collective (shapes, the strategy's checks)
//   call = AttentionCall(options, inner)   the module's attention through the adapter
//   out  = strategy.run_sync(q, k, v, call)            sync schedule
//        | strategy.run_async(q, k, v, call, arrived)  async: the moved roles' collectives
//                                          started at their handoff points; `arrived` pops
//                                          their slots
//        | rank_local_attention(q, k, v, call)         nothing to move (strategy.skips_moves:
//                                          sync at the call, async at the announced handoffs)
#include "hp/cp/runtime.h"

#include <optional>

#include "hp/common/check.h"
#include "hp/common/shape.h"
#include "hp/cp/config.h"
#include "strategy_pieces.h"

namespace hp::cp {
CPRuntime::CPRuntime(std::shared_ptr<const CPAdapter> adapter,
                     std::shared_ptr<const CPStrategy> strategy,
                     std::shared_ptr<const CPTopology> topology, CPRuntimeOptions options)
    : adapter_(std::move(adapter)),
      strategy_(std::move(strategy)),
      ctx_{std::move(topology),         options.layout,
           options.load_balance,        options.load_balance_form,
           options.kv_head_policy,      0,
           options.ulysses_head_groups, options.async_always_local_first,
           options.ring_keep_blocks,    options.ring_backward,
           options.ulysses_row_parts},
      module_path_(std::move(options.module_path)),
      async_(options.async),
      state_(std::make_shared<CPRuntimeState>(module_path_)) {
  HP_INTERNAL_ASSERT(adapter_ && strategy_ && ctx_.topology);
  ctx_.layout.check(common::str_cat("module '", module_path_, "'"));
}

std::string CPRuntime::id() const {
  return common::str_cat("cp:", module_path_, ":", adapter_->name(), ":", strategy_->name(),
                         async_ ? "/async" : "", ctx_.load_balance ? "+lb:" : "",
                         ctx_.load_balance ? to_string(ctx_.load_balance_form) : "", ":",
                         ctx_.topology->id());
}

void CPRuntime::validate(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                         const attention::AttentionOptions& options) {
  const auto& l = ctx_.layout;
  const std::string who =
      common::str_cat("CP attention on module '", module_path_, "' (", strategy_->name(), ")");
  HP_CHECK(q.defined() && k.defined() && v.defined(), who, ": q, k and v must be defined");
  HP_CHECK(q.dim() == k.dim() && q.dim() == v.dim(), who, ": q, k, v ranks differ (", q.dim(), ", ",
           k.dim(), ", ", v.dim(), "); they must have the same rank");
  HP_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type() &&
               at::isFloatingType(q.scalar_type()),
           who, ": q, k, v dtypes are ", c10::toString(q.scalar_type()), ", ",
           c10::toString(k.scalar_type()), ", ", c10::toString(v.scalar_type()),
           "; they must share one floating dtype (cast them before the call)");
  const int64_t nd = q.dim();
  HP_CHECK(l.seq_dim < nd - 1 && l.heads_dim < nd - 1, who, ": cp_seq_dim=", l.seq_dim,
           " / cp_head_dim=", l.heads_dim, " are out of range for ", nd,
           "-d q/k/v (the last dim is the per-head feature size)");
  for (int64_t d = 0; d + 1 < nd; ++d) {
    HP_CHECK(k.size(d) == v.size(d), who, ": k ", common::shape_str(k.sizes()), " and v ",
             common::shape_str(v.sizes()),
             " must agree in every dim but the last (the per-head feature size may differ)");
  }
  for (int64_t d = 0; d + 1 < nd; ++d) {
    if (d == l.heads_dim) continue;
    HP_CHECK(q.size(d) == k.size(d), who, ": q ", common::shape_str(q.sizes()), " and k ",
             common::shape_str(k.sizes()), " differ in dim ", d,
             d == l.seq_dim ? " (the sequence)" : "",
             "; CP splits self-attention, so only the head dim may differ");
  }
  HP_CHECK(q.size(nd - 1) == k.size(nd - 1), who, ": q ", common::shape_str(q.sizes()), " and k ",
           common::shape_str(k.sizes()), " must share the per-head feature size (last dim)");
  const int64_t qh = q.size(l.heads_dim), kh = k.size(l.heads_dim);
  HP_CHECK(kh >= 1 && qh % kh == 0, who, ": query heads ", qh,
           " are not a multiple of key/value heads ", kh);
  check_heads_for_degree(strategy_->name(), ctx_.topology->ulysses_degree, qh, kh, 1,
                         ctx_.kv_head_policy);
  ctx_.kv_heads = kh;
  check_call_options(options, q.size(0), qh, q.size(l.seq_dim), who);
}

void CPRuntime::check_call_options(const attention::AttentionOptions& options, int64_t batch,
                                   int64_t q_heads, int64_t local_len,
                                   const std::string& who) const {
  const int64_t cp = ctx_.topology->cp_size, total = local_len * cp;
  if (options.causal_meta) {
    const auto& m = *options.causal_meta;
    HP_CHECK(m.q_offset == 0 && m.q_len == -1 && m.kv_len == -1, who,
             ": options.causal_meta is {q_offset=", m.q_offset, ", q_len=", m.q_len,
             ", kv_len=", m.kv_len,
             "}; under CP each rank's query and key positions are set from its place in the "
             "sequence, so leave causal_meta unset");
  }
  strategy_->check_options(options, who);
  if (options.mask.defined()) {
    const auto& m = options.mask;
    HP_CHECK(m.scalar_type() == at::kBool || at::isFloatingType(m.scalar_type()), who,
             ": mask dtype ", c10::toString(m.scalar_type()),
             " must be bool (true = attend) or floating point (additive)");
    HP_CHECK(!ctx_.load_balance, who,
             ": a tensor mask's rows follow this rank's queries in order, which head-tail load "
             "balance splits and reorders; express the mask as a mask function (mask_fn) or "
             "packed documents (both are re-based to global positions), or set "
             "load_balance=false");
    const int64_t nd = m.dim();
    const bool lead_ok =
        nd >= 2 && nd <= 4 && (nd < 4 || m.size(0) == 1 || m.size(0) == batch) &&
        (nd < 3 || q_heads < 0 || m.size(nd - 3) == 1 || m.size(nd - 3) == q_heads);
    HP_CHECK(lead_ok && m.size(-2) == local_len && m.size(-1) == total, who, ": mask ",
             common::shape_str(m.sizes()), " does not fit CP: its rows are this rank's ", local_len,
             " queries and its columns the ", total, " keys of the whole sequence (", local_len,
             " local positions x cp ", cp, "); give it shape [", local_len, ", ", total,
             "] or [B|1, Nq|1, ", local_len, ", ", total,
             "] (this rank's rows of the global mask)");
  }
  if (!options.documents) return;
  const auto& ids = options.documents->ids;
  HP_CHECK(ids.defined() && ids.dim() == 2 && ids.size(1) == total, who, ": documents.ids is ",
           ids.defined() ? common::shape_str(ids.sizes()) : std::string("undefined"),
           "; under CP it must hold the document id of every global position, [B|1, ", total, "] (",
           local_len, " local positions x cp ", ctx_.topology->cp_size,
           "): pass the whole sequence's ids (ShardedBatch::doc_ids), not this rank's "
           "(local_doc_ids)");
  attention::check_documents(*options.documents, batch, total, total, who.c_str());
}

attention::AttentionResult CPRuntime::intercept(const at::Tensor& q, const at::Tensor& k,
                                                const at::Tensor& v,
                                                const attention::AttentionOptions& options,
                                                const attention::AttentionFn& inner) {
  return intercept_with_stats(q, k, v, options, inner, nullptr);
}

attention::AttentionResult CPRuntime::intercept_with_stats(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const attention::AttentionOptions& options, const attention::AttentionFn& inner,
    const attention::StatsBackwardFn& from_stats) {
  // The announcement and the handoffs' decision belong to this call only.
  struct Clear {
    CPRuntime& r;
    ~Clear() {
      r.announced_.reset();
      r.skip_moves_.reset();
      r.ctx_.moves_skipped = false;
    }
  } clear{*this};
  validate(q, k, v, options);
  ++calls_in_forward_;
  AttentionCall call(options, inner, *adapter_, *strategy_, ctx_, from_stats);
  const int64_t total = q.size(ctx_.layout.seq_dim) * ctx_.topology->cp_size;
  if (ctx_.moves_skipped) {
    HP_CHECK(strategy_->skips_moves(call, total, ctx_), "async CP on module '", module_path_, "' (",
             strategy_->name(), "): the options announced before the projections (",
             announced_ && announced_->documents ? "packed documents" : "no documents",
             ", causal=", announced_ && announced_->causal,
             ") let the handoffs skip the K/V collectives, but this call's options (",
             options.documents ? "packed documents" : "no documents", ", causal=", options.causal,
             ") need them; announce the options the call passes (AttentionHost::announce), or "
             "announce nothing");
  }
  at::Tensor out;
  if (async_ ? ctx_.moves_skipped : strategy_->skips_moves(call, total, ctx_)) {
    strategy_->check_inputs(q, ctx_, common::str_cat("CP strategy '", strategy_->name(), "': q"));
    out = detail::rank_local_attention(q, k, v, call, ctx_);
  } else if (async_) {
    ArrivedFn arrived(
        [this](QKVRole role, const at::Tensor& x) {
          auto pieces = state_->consume(role, x);
          if (pieces.size() == 1) return pieces[0].wait();
          state_->release_held();
          std::vector<at::Tensor> moved;
          for (auto& p : pieces)
            moved.push_back(p.wait());
          return strategy_->join_moved(role, moved, ctx_);
        },
        [this](QKVRole role) { return state_->arrived(role); },
        [this](QKVRole role, const at::Tensor& x) {
          std::vector<ArrivedFn::Piece> pieces;
          auto in_flight = state_->consume(role, x);
          const bool several = in_flight.size() > 1;
          for (size_t i = 0; i < in_flight.size(); ++i) {
            // Dropped once waited: the emitted piece is not kept alive by the wait.
            auto emitted = in_flight[i].emitted();
            // Shared by the wait and the landed test; empty once waited.
            auto piece = std::make_shared<std::optional<comm::InFlight>>(std::move(in_flight[i]));
            pieces.push_back({emitted,
                              [this, i, several, piece] {
                                HP_INTERNAL_ASSERT(piece->has_value(),
                                                   "a piece of a moved role waited twice");
                                if (several && i > 0) state_->release_through(i);
                                auto moved = (*piece)->wait();
                                piece->reset();
                                if (several && i == 0) state_->first_piece_waited();
                                return moved;
                              },
                              [piece] { return !piece->has_value() || (*piece)->landed(); }});
          }
          return pieces;
        },
        [this](ArrivedFn::Later op) {
          if (op == ArrivedFn::Later::kDefer) state_->defer_release();
          if (op == ArrivedFn::Later::kReleaseNext) state_->release_next();
          if (op == ArrivedFn::Later::kReleaseAll) state_->release_held();
        });
    out = strategy_->run_async(q, k, v, call, ctx_, arrived);
  } else {
    out = strategy_->run_sync(q, k, v, call, ctx_);
  }
  // The lse is in the strategy's frame (other heads / rows than the caller's): not returned.
  return {out, at::Tensor()};
}

void CPRuntime::on_forward_begin() {
  calls_in_forward_ = 0;
  // Pending slots here belong to a forward that failed between its handoffs and its attention
  // (a finished one drained its own at its end): dropped, so this forward starts clean.
  if (async_) state_->discard_pending();
  // So is an announcement it made (the module announces after its scope opens).
  announced_.reset();
  skip_moves_.reset();
  ctx_.moves_skipped = false;
}

at::Tensor CPRuntime::on_handoff(QKVRole role, const std::string& handoff, const at::Tensor& x) {
  const auto& l = ctx_.layout;
  HP_CHECK(x.defined() && l.seq_dim < x.dim() && l.heads_dim < x.dim(), "async CP on module '",
           module_path_, "': handoff '", handoff, "' emitted a tensor without the layout's seq ",
           "dim ", l.seq_dim, " and head dim ", l.heads_dim);
  strategy_->check_inputs(x, ctx_,
                          common::str_cat("async CP on module '", module_path_,
                                          "': ", role_name(role), " from handoff '", handoff, "'"));
  if (role != QKVRole::kQ) ctx_.kv_heads = x.size(l.heads_dim);  // before its collective starts
  if (announced_ && !skip_moves_) {
    check_call_options(
        *announced_, x.size(0), role == QKVRole::kQ ? x.size(l.heads_dim) : -1, x.size(l.seq_dim),
        common::str_cat("async CP on module '", module_path_, "': the announced options"));
    // Asked once per call, at its first handoff: the attention itself is never run here.
    const attention::AttentionFn never =
        [](const at::Tensor&, const at::Tensor&, const at::Tensor&,
           const attention::AttentionOptions&) -> attention::AttentionResult {
      HP_INTERNAL_ASSERT(false, "the announced call is never run");
      return {};
    };
    AttentionCall call(*announced_, never, *adapter_, *strategy_, ctx_);
    skip_moves_ = strategy_->skips_moves(call, x.size(l.seq_dim) * ctx_.topology->cp_size, ctx_);
  }
  if (skip_moves_ && *skip_moves_) {
    ctx_.moves_skipped = true;
    return x;  // no collective, no slot: run_async attends the local K/V
  }
  // The slot outlives this call inside the autograd graph and the runtime's own queue: it holds
  // the runtime weakly (a strong reference would be a cycle runtime -> queue -> slot -> runtime).
  std::weak_ptr<CPRuntime> weak = shared_from_this();
  const std::string module = module_path_;
  return state_->produce(
      role, handoff, x,
      // Kept by the graph for the gradient's split: copies, not the runtime.
      [strategy = strategy_, ctx = ctx_, role](const at::Tensor& t) {
        return strategy->split_for_move(role, t, ctx);
      },
      // A later piece may launch at another handoff (CPRuntimeState): this handoff's context.
      [strategy = strategy_, ctx = ctx_, role](const at::Tensor& t) {
        return strategy->move_async(role, t, ctx);
      },
      [weak, role, module](const at::Tensor& g) {
        auto self = weak.lock();
        HP_CHECK(self != nullptr, "async CP on module '", module,
                 "': backward reached a handoff after its CP runtime was destroyed; keep the "
                 "module alive until its backward has run");
        return self->strategy_->move_grad_async(role, g, self->ctx_);
      });
}

void CPRuntime::on_announce(const attention::AttentionOptions& options) {
  if (!async_) return;  // the sync schedule decides at the call
  announced_ = options;
  skip_moves_.reset();
}

void CPRuntime::on_forward_end() {
  const bool reached = calls_in_forward_ > 0;
  if (async_ && reached) state_->check_drained();
  const bool boundary = adapter_->slot() == attention::AttentionHost::Slot::kModuleBoundary;
  HP_CHECK(reached, "CP adapter '", adapter_->name(), "' on module '", module_path_,
           "': the module's forward finished without reaching the attention ",
           boundary ? "module" : "primitive",
           ", so no CP communication ran and the result would be silently wrong (misfire). ",
           boundary ? "Route the module's attention through its core-attention module "
                      "(AttentionHost::run_boundary), or use the sdpa_hf adapter if the module "
                      "calls the attention primitive from inside its forward"
                    : "Route the module's attention through AttentionHost::call_primitive, or "
                      "use the sdpa_qkv adapter if the module takes (q, k, v)");
}

}  // namespace hp::cp
