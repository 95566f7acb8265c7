// The defaults of CPStrategy (the move -> finish -> attend -> restore pipeline) and the
// AttentionCall every strategy's attention step goes through.
#include "hp/cp/strategy.h"

#include <algorithm>
#include <mutex>
#include <unordered_set>

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>

#include "hp/comm/group.h"
#include "hp/common/check.h"
#include "hp/cp/adapter.h"

namespace hp::cp {

const char* role_name(QKVRole role) {
  switch (role) {
    case QKVRole::kQ:
      return "q";
    case QKVRole::kK:
      return "k";
    case QKVRole::kV:
      return "v";
  }
  return "?";
}

void QKVLayout::check(const std::string& who) const {
  HP_CHECK(seq_dim != heads_dim, who, ": cp_seq_dim and cp_head_dim are both ", seq_dim,
           "; they must name different dims (BNSD: cp_seq_dim=2, cp_head_dim=1; BSHD: 1, 2)");
  HP_CHECK(seq_dim >= 0 && heads_dim >= 0, who, ": cp_seq_dim=", seq_dim,
           " and cp_head_dim=", heads_dim, " must be >= 0");
}

AttentionCall::AttentionCall(const attention::AttentionOptions& options,
                             const attention::AttentionFn& inner, const CPAdapter& adapter,
                             const CPStrategy& strategy, const CPRuntimeContext& ctx,
                             attention::StatsBackwardFn from_stats)
    : options_(options),
      inner_(inner),
      from_stats_(std::move(from_stats)),
      adapter_(adapter),
      strategy_(strategy),
      layout_(ctx.layout) {
  if (ctx.topology && ctx.topology->cp) {
    auto& comm_ctx = ctx.topology->cp->context();
    if (comm_ctx.tracer && comm_ctx.tracer->enabled()) {
      tracer_ = comm_ctx.tracer;
      rank_ = comm_ctx.world_rank;
    }
  }
}

namespace {

using torch::autograd::Node;
using torch::autograd::variable_list;

// One call's backward as an "attention_backward" event: from when the engine starts a node
// behind the call's outputs to when the last node that hands a gradient to one of its inputs
// has returned. That is the primitive's own node where its outputs come straight from it, and
// the whole subgraph otherwise (math's matmuls and softmax, a layout transpose around the
// kernel). Hooks only: the forward graph is the same with and without a tracer. A graph kept
// for a second backward records a second event; the mutex keeps concurrent runs whole.
class BackwardSpan {
 public:
  BackwardSpan(std::shared_ptr<common::Tracer> tracer, int rank, int ends)
      : tracer_(std::move(tracer)), rank_(rank), ends_(ends), left_(ends) {}
  void begin() {
    std::lock_guard<std::mutex> lock(mu_);
    if (begin_ < 0) begin_ = common::Tracer::now_us();
  }
  void end() {
    std::lock_guard<std::mutex> lock(mu_);
    if (--left_ > 0) return;
    if (begin_ >= 0) {
      tracer_->record(
          {"attention_backward", "compute", rank_, begin_, common::Tracer::now_us(), "", -1});
    }
    begin_ = -1;
    left_ = ends_;
  }

 private:
  std::mutex mu_;
  std::shared_ptr<common::Tracer> tracer_;
  int rank_;
  int ends_, left_;
  int64_t begin_ = -1;
};

struct SpanBegins : torch::autograd::FunctionPreHook {
  explicit SpanBegins(std::shared_ptr<BackwardSpan> span) : span_(std::move(span)) {}
  variable_list operator()(const variable_list& grads) override {
    span_->begin();
    return grads;
  }
  std::shared_ptr<BackwardSpan> span_;
};

struct SpanEnds : torch::autograd::FunctionPostHook {
  explicit SpanEnds(std::shared_ptr<BackwardSpan> span) : span_(std::move(span)) {}
  variable_list operator()(const variable_list& outputs, const variable_list& /*inputs*/) override {
    span_->end();
    return outputs;
  }
  std::shared_ptr<BackwardSpan> span_;
};

// The nodes between a call's outputs (`tops`) and its inputs: those with an edge into one of
// the inputs' own nodes (`inputs`). Empty where the walk passes `limit` nodes (the call's
// graph reaches past its inputs, through a tensor it was not given).
std::vector<Node*> nodes_feeding(const std::vector<Node*>& tops,
                                 const std::unordered_set<const Node*>& inputs, size_t limit) {
  std::vector<Node*> out, stack(tops.begin(), tops.end());
  std::unordered_set<const Node*> seen;
  while (!stack.empty()) {
    Node* n = stack.back();
    stack.pop_back();
    if (!seen.insert(n).second) continue;
    if (seen.size() > limit) return {};
    bool feeds = false;
    for (const auto& edge : n->next_edges()) {
      if (!edge.function) continue;
      if (inputs.count(edge.function.get()) != 0) {
        feeds = true;
      } else {
        stack.push_back(edge.function.get());
      }
    }
    if (feeds) out.push_back(n);
  }
  return out;
}

}  // namespace

void AttentionCall::trace_backward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                   const attention::AttentionResult& result) const {
  std::vector<Node*> tops;
  for (const auto* t : {&result.out, &result.lse}) {
    if (!t->defined() || !t->grad_fn()) continue;
    Node* n = t->grad_fn().get();
    if (std::find(tops.begin(), tops.end(), n) == tops.end()) tops.push_back(n);
  }
  if (tops.empty()) return;  // run without grad (the ring's own function records its blocks)
  std::unordered_set<const Node*> inputs;
  for (const auto* t : {&q, &k, &v}) {
    if (!t->defined()) continue;
    const auto edge = torch::autograd::impl::gradient_edge(*t);
    if (edge.function) inputs.insert(edge.function.get());
  }
  // The ends are counted from out's node only: every node below it runs once out has a
  // gradient, while a node only lse reaches runs only where lse is used (merges).
  constexpr size_t kLimit = 4096;  // a call's own graph is a few dozen nodes at most
  Node* out_node = result.out.defined() ? result.out.grad_fn().get() : nullptr;
  std::vector<Node*> ends;
  if (out_node != nullptr) ends = nodes_feeding({out_node}, inputs, kLimit);
  if (ends.empty()) ends = {out_node != nullptr ? out_node : tops.front()};  // unbounded
  auto span = std::make_shared<BackwardSpan>(tracer_, rank_, static_cast<int>(ends.size()));
  for (Node* n : tops)
    n->add_pre_hook(std::make_unique<SpanBegins>(span));
  for (Node* n : ends)
    n->add_post_hook(std::make_unique<SpanEnds>(span));
}

attention::AttentionResult AttentionCall::operator()(const at::Tensor& q, const at::Tensor& k,
                                                     const at::Tensor& v,
                                                     const CallState& state) const {
  const int64_t begin = tracer_ != nullptr ? common::Tracer::now_us() : 0;
  auto result = run(q, k, v, state);
  if (tracer_ != nullptr) {
    tracer_->record({"attention", "compute", rank_, begin, common::Tracer::now_us(), "", -1});
    trace_backward(q, k, v, result);
  }
  return result;
}

bool AttentionCall::hidden(const CallState& s) const {
  if (!options_.documents) return false;
  const auto& d = *options_.documents;
  const int64_t q0 = d.q_start + s.kv_start + s.causal.q_offset, k0 = d.kv_start + s.kv_start;
  return attention::documents_hide_block(d, q0, q0 + s.causal.q_len, k0, k0 + s.causal.kv_len);
}

AttentionCall::Prepared AttentionCall::prepare(const at::Tensor& k, const at::Tensor& v,
                                               const CallState& state) const {
  Prepared p{adapter_.rewrite(options_, state, strategy_), k, v};
  if (!p.options.causal || !p.options.causal_meta) return p;
  auto& meta = *p.options.causal_meta;
  const int64_t seq = layout_.seq_dim;
  // Keys past the block's last query are invisible to all its queries: cut them off. The
  // narrow runs on every rank, even where it keeps everything, so all ranks build the same
  // autograd graph and issue their backward collectives in the same order (with two groups in
  // play, as in hybrid, a rank-dependent order could deadlock).
  const int64_t prefix = std::min(meta.kv_len, meta.q_offset + meta.q_len);
  p.k = k.narrow(seq, 0, prefix);
  p.v = v.narrow(seq, 0, prefix);
  if (p.options.mask.defined()) p.options.mask = p.options.mask.narrow(-1, 0, prefix);
  meta.kv_len = prefix;
  if (meta.q_offset + 1 >= prefix) {
    p.options.causal = false;  // every key precedes (or is) the first query: nothing to mask
    p.options.causal_meta.reset();
  }
  return p;
}

attention::AttentionResult AttentionCall::run(const at::Tensor& q, const at::Tensor& k,
                                              const at::Tensor& v, const CallState& state) const {
  auto p = prepare(k, v, state);
  return inner_(q, p.k, p.v, p.options);
}

attention::AttentionGrads AttentionCall::grads_from_stats(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
    const at::Tensor& lse, const at::Tensor& dout, const CallState& state) const {
  HP_INTERNAL_ASSERT(from_stats_ != nullptr,
                     "grads_from_stats: the call offers none (ask offers_grads_from_stats)");
  const int64_t begin = tracer_ != nullptr ? common::Tracer::now_us() : 0;
  auto p = prepare(k, v, state);
  auto g = from_stats_(q, p.k, p.v, out, lse, dout, p.options);
  if (tracer_ != nullptr) {
    tracer_->record(
        {"attention_backward", "compute", rank_, begin, common::Tracer::now_us(), "", -1});
  }
  return g;
}

// ---- the default pipeline ----

int64_t CPStrategy::forward_bytes_per_rank(const ContextParallelConfig& config, int64_t p,
                                           const AttentionShape& s, int64_t /*cp_rank*/) const {
  const int64_t e = s.element_size * s.batch;
  const int64_t h = s.q_heads * s.qk_dim, ho = s.q_heads * s.v_dim_or_qk();  // Q, the output
  const int64_t hk = s.kv_heads * s.qk_dim, hv = s.kv_heads * s.v_dim_or_qk();
  const int64_t u = ulysses_degree_of(config, p), c = p / u;
  if (repeats_kv(config.kv_head_policy, u, s.kv_heads)) {
    // Q and the output by all-to-all; K/V by an all-to-all that hands each of the U - 1 other
    // ranks of the Ulysses group the one head it reads (D + Dv per position), then that head
    // gathered across the C groups.
    const int64_t a2a = (h + ho) * (s.seq / p) * e / u * (u - 1);
    const int64_t in_group = (s.qk_dim + s.v_dim_or_qk()) * (s.seq / p) * e * (u - 1);
    const int64_t across = c > 1 ? (s.qk_dim + s.v_dim_or_qk()) * (s.seq / c) * e * (c - 1) : 0;
    return a2a + in_group + across;
  }
  // Per-rank chunk sizes first, then the fraction that leaves the rank: exact in integers.
  const int64_t a2a = u > 1 ? (h + ho + hk + hv) * (s.seq / p) * e / u * (u - 1) : 0;
  // After the A2A each rank holds S/C positions of h_kv/U: (S/P) * h_kv elements per tensor.
  const int64_t gather = c > 1 ? (hk + hv) * (s.seq / p) * e * (c - 1) : 0;
  return a2a + gather;
}

at::Tensor CPStrategy::move(QKVRole role, const at::Tensor&, const CPRuntimeContext&) const {
  HP_INTERNAL_ASSERT(false, "strategy '", name(), "' moves ", role_name(role),
                     " but does not implement move()");
}

comm::CommHandle CPStrategy::move_async(QKVRole role, const at::Tensor&,
                                        const CPRuntimeContext&) const {
  HP_INTERNAL_ASSERT(false, "strategy '", name(), "' moves ", role_name(role),
                     " but does not implement move_async()");
}

comm::CommHandle CPStrategy::move_grad_async(QKVRole role, const at::Tensor&,
                                             const CPRuntimeContext&) const {
  HP_INTERNAL_ASSERT(false, "strategy '", name(), "' moves ", role_name(role),
                     " but does not implement move_grad_async()");
}

at::Tensor CPStrategy::join_moved(QKVRole role, const std::vector<at::Tensor>&,
                                  const CPRuntimeContext&) const {
  HP_INTERNAL_ASSERT(false, "strategy '", name(), "' splits ", role_name(role),
                     " into pieces but does not implement join_moved()");
}

PreparedQKV CPStrategy::finish(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                               const at::Tensor&, const CPRuntimeContext&) const {
  HP_INTERNAL_ASSERT(false, "strategy '", name(),
                     "' runs the default pipeline but does not implement finish()");
}

at::Tensor CPStrategy::restore_output(const std::vector<at::Tensor>& outs, const PreparedQKV&,
                                      const CPRuntimeContext&) const {
  HP_INTERNAL_ASSERT(outs.size() == 1, "strategy '", name(), "' has ", outs.size(),
                     " query parts but does not implement restore_output()");
  return outs[0];
}

std::array<at::Tensor, 3> CPStrategy::move_qkv(const at::Tensor& q, const at::Tensor& k,
                                               const at::Tensor& v,
                                               const CPRuntimeContext& ctx) const {
  check_inputs(q, ctx, common::str_cat("CP strategy '", name(), "': q"));
  std::array<at::Tensor, 3> moved{q, k, v};
  for (auto role : moved_roles()) {
    auto& x = moved[static_cast<int>(role)];
    x = move(role, x, ctx);
  }
  return moved;
}

PreparedQKV CPStrategy::prepare_qkv(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                    const CPRuntimeContext& ctx) const {
  auto moved = move_qkv(q, k, v, ctx);
  return finish(q, moved[0], moved[1], moved[2], ctx);
}

std::vector<at::Tensor> CPStrategy::attend(const PreparedQKV& prepared, const AttentionCall& call,
                                           const CPRuntimeContext&) const {
  std::vector<at::Tensor> outs;
  for (const auto& part : prepared.parts)
    outs.push_back(call(part.q, prepared.k, prepared.v, part.state).out);
  return outs;
}

at::Tensor CPStrategy::run_sync(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                const AttentionCall& call, const CPRuntimeContext& ctx) const {
  auto prepared = prepare_qkv(q, k, v, ctx);
  return restore_output(attend(prepared, call, ctx), prepared, ctx);
}

at::Tensor CPStrategy::run_async(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                 const AttentionCall& call, const CPRuntimeContext& ctx,
                                 const ArrivedFn& arrived) const {
  at::Tensor moved[3] = {q, k, v};
  for (auto role : moved_roles()) {
    auto& x = moved[static_cast<int>(role)];
    x = arrived(role, x);
  }
  auto prepared = finish(q, moved[0], moved[1], moved[2], ctx);
  return restore_output(attend(prepared, call, ctx), prepared, ctx);
}

}  // namespace hp::cp
