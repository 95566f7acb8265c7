// FullyShard: sharding at construction, the forward side (gather with prefetch, reshard) and
// the autograd hooks that drive the backward side.
//
//   forward_root:  gather root ------------------------------------------------> out
//                    \-> prefetch unit 1        (RootPreBackward on out: queue drain,
//   forward_unit i: wait gather i, prefetch i+1,  fn(x), free i  prefetch last unit)
//                                                (PreBackward on y: gather i, prefetch i-1)
//   backward:      AccumulateGrad post hooks count unit i's gradients; the last one runs
//                  post_backward(i) (grad_pipeline.cpp); the queued drain runs once at the
//                  end of the outermost backward.
#include "hp/hsdp/fully_shard.h"

#include <algorithm>
#include <map>
#include <set>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include "hp/comm/collectives.h"
#include "hp/common/capsule.h"
#include "hp/common/check.h"
#include "hp/common/recompute.h"
#include "state.h"

namespace hp::hsdp {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
using Impl = FullyShard::Impl;

// The FullyShard state travels in the autograd context as a capsule; it does not own the state
// (the FullyShard outlives every backward of its forwards).
Impl* impl_of(AutogradContext* ctx) {
  return common::from_capsule<Impl*>(ctx->saved_data["impl"]);
}

// Identity whose backward gathers unit `u` before its backward runs and prefetches u - 1.
struct PreBackward : torch::autograd::Function<PreBackward> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, Impl* impl, int64_t u) {
    ctx->saved_data["impl"] = common::to_capsule(impl);
    ctx->saved_data["unit"] = u;
    return x;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    impl_of(ctx)->pre_backward(static_cast<size_t>(ctx->saved_data["unit"].toInt()));
    return {grads[0], at::Tensor(), at::Tensor()};
  }
};

// Identity on the root's output: the first backward through it queues the drain. The node
// keeps `graph` alive (Impl::root_graph watches it).
struct RootPreBackward : torch::autograd::Function<RootPreBackward> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, Impl* impl,
                            std::shared_ptr<void> graph) {
    ctx->saved_data["impl"] = common::to_capsule(impl);
    ctx->saved_data["graph"] = common::to_capsule(std::move(graph));
    return x;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    impl_of(ctx)->root_pre_backward();
    return {grads[0], at::Tensor(), at::Tensor()};
  }
};

// Runs after a parameter's AccumulateGrad wrote its .grad.
struct GradReadyHook : torch::autograd::FunctionPostHook {
  GradReadyHook(Impl* impl, size_t unit) : impl_(impl), unit_(unit) {}
  variable_list operator()(const variable_list& outputs, const variable_list& /*inputs*/) override {
    impl_->on_grad_ready(unit_);
    return outputs;
  }
  Impl* impl_;
  size_t unit_;
};

}  // namespace

void Impl::record(const char* what, const std::string& unit) {
  if (!options.record_schedule) return;
  events.push_back(unit.empty() ? std::string(what) : std::string(what) + " " + unit);
}

at::Tensor Impl::timed_wait(comm::CommHandle& h) {
  const auto t0 = std::chrono::steady_clock::now();
  auto out = h.wait();
  stats.exposed_s += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return out;
}

void Impl::issue_gather(size_t u) {
  auto& unit = units[u];
  HP_INTERNAL_ASSERT(unit.state == detail::Unit::State::kSharded, "gather of a gathered unit");
  std::map<at::ScalarType, detail::GatherBucket> by_dtype;
  std::map<at::ScalarType, std::vector<at::Tensor>> flat;
  for (size_t i : unit.params) {
    auto& p = params[i];
    auto& b = by_dtype[p.shard.scalar_type()];
    b.params.push_back(i);
    b.offsets.push_back(b.numel);
    b.numel += p.shard_numel();
    flat[p.shard.scalar_type()].push_back(p.shard.detach().reshape({-1}));
  }
  record("issue AG", unit.name);
  unit.gathering.clear();
  for (auto& [dtype, b] : by_dtype) {
    b.handle = comm::all_gather_async(*groups.shard, at::cat(flat[dtype]).view({1, -1}), 0);
    unit.gathering.push_back(std::move(b));
  }
  unit.state = detail::Unit::State::kGathering;
}

void Impl::unshard(size_t u) {
  auto& unit = units[u];
  if (unit.state == detail::Unit::State::kGathered) return;
  if (unit.state == detail::Unit::State::kSharded) issue_gather(u);
  record("wait AG", unit.name);
  at::NoGradGuard no_grad;
  for (auto& b : unit.gathering) {
    auto gathered = timed_wait(b.handle);  // [Sd, numel]
    for (size_t k = 0; k < b.params.size(); ++k)
      detail::copy_in(params[b.params[k]], gathered, b.offsets[k]);
  }
  unit.gathering.clear();
  unit.state = detail::Unit::State::kGathered;
}

void Impl::prefetch(size_t u) {
  if (!options.prefetch || !options.pipeline || u >= units.size()) return;
  if (units[u].state == detail::Unit::State::kSharded) issue_gather(u);
}

void Impl::reshard(size_t u) {
  auto& unit = units[u];
  if (unit.state == detail::Unit::State::kSharded) return;
  if (unit.state == detail::Unit::State::kGathering) unshard(u);  // never free under the wire
  for (size_t i : unit.params)
    detail::release(params[i].full);
  unit.state = detail::Unit::State::kSharded;
}

void Impl::arm(size_t u) {
  auto& unit = units[u];
  if (!at::GradMode::is_enabled()) return;
  HP_CHECK(!unit.armed, "fully_shard: unit '", unit.name,
           "' ran forward twice without a backward in between; run backward after each "
           "forward (several micro-batches in flight are not supported under HSDP)");
  unit.armed = true;
  unit.reduced = false;
  unit.pending_grads = static_cast<int64_t>(unit.params.size());
}

void Impl::forget_abandoned_forward() {
  const bool armed =
      std::any_of(units.begin(), units.end(), [](const detail::Unit& u) { return u.armed; });
  if (!armed || drain_queued || !root_graph.expired()) return;
  record("forget abandoned forward", "");
  for (size_t u = 0; u < units.size(); ++u) {
    units[u].armed = false;
    units[u].reduced = false;
    units[u].pending_grads = 0;
    reshard(u);  // a gathered copy would go stale once the optimizer updates the shards
  }
}

void Impl::pre_backward(size_t u) {
  queue_drain();
  record("pre-backward", units[u].name);
  unshard(u);
  if (u > 1) prefetch(u - 1);  // the root (0) stays gathered through the backward
}

void Impl::queue_drain() {
  if (drain_queued) return;
  drain_queued = true;
  // Runs when the backward that reached a unit's output (the outermost one: unit outputs are
  // never inside a recompute) finishes; a recompute's inner backward cannot drain early.
  torch::autograd::Engine::get_default_engine().queue_callback([this] { drain(); });
}

void Impl::root_pre_backward() {
  queue_drain();
  unshard(0);  // a second backward through the same graph needs the root again
  if (units.size() > 1) prefetch(units.size() - 1);
}

void Impl::on_grad_ready(size_t u) {
  auto& unit = units[u];
  if (!unit.armed || unit.reduced) return;
  if (--unit.pending_grads == 0) post_backward(u);
}

FullyShard::FullyShard(std::vector<UnitSpec> units, HsdpGroups groups, HsdpOptions options)
    : impl_(std::make_unique<Impl>()) {
  HP_CHECK(groups.shard, "fully_shard: HsdpGroups.shard is null; pass the (dp_shard, cp) group");
  HP_CHECK(groups.replicate,
           "fully_shard: HsdpGroups.replicate is null; pass the dp_replicate "
           "group (a group of one rank when R = 1)");
  HP_CHECK(!units.empty(), "fully_shard: no units; pass the root unit first");
  HP_CHECK(!options.reduce_dtype || at::isFloatingType(*options.reduce_dtype),
           "fully_shard: HsdpOptions.reduce_dtype=", c10::toString(*options.reduce_dtype),
           " is not a floating type (the gradients would be truncated); use float32, bfloat16, "
           "float16 or float64, or leave it unset to reduce in each parameter's dtype");
  auto& s = *impl_;
  s.groups = std::move(groups);
  s.options = options;
  s.sd = s.groups.shard->size();
  s.r = s.groups.replicate->size();
  s.shard_rank = s.groups.shard->rank();
  // Every check before anything is sharded: a refusal leaves the model's weights as they were.
  std::map<const void*, std::string> owner;
  std::set<std::string> names;
  for (const auto& unit : units) {
    for (const auto& up : unit.params) {
      detail::check_shardable(up.name, up.param);
      HP_CHECK(names.insert(up.name).second, "fully_shard: parameter '", up.name,
               "' is listed twice; each parameter belongs to exactly one unit");
      HP_CHECK(!up.tp_partial_grad || s.groups.tp, "fully_shard: parameter '", up.name,
               "' has tp_partial_grad=true (its gradient is summed over TP), but HsdpGroups.tp "
               "is null; pass the TP group");
      const void* key = up.param.storage().unsafeGetStorageImpl();
      auto [it, fresh] = owner.emplace(key, up.name);
      HP_CHECK(fresh, "fully_shard: parameter '", up.name, "' shares its memory with '", it->second,
               "' (a tied parameter); list it once");
    }
  }
  for (size_t u = 0; u < units.size(); ++u) {
    detail::Unit unit;
    unit.name = units[u].name;
    unit.reshard_after_forward = u > 0 && options.reshard_after_forward;
    for (auto& up : units[u].params) {
      s.by_name[up.name] = s.params.size();
      unit.params.push_back(s.params.size());
      s.params.push_back(
          detail::make_sharded(up.name, up.param, s.shard_rank, s.sd, up.tp_partial_grad));
      auto& p = s.params.back();
      p.accumulator = torch::autograd::impl::grad_accumulator(p.full);
      p.accumulator->add_post_hook(std::make_unique<GradReadyHook>(&s, u));
      s.stats.shard_numel += p.shard_numel();
      s.stats.full_numel += p.full_numel();
    }
    s.units.push_back(std::move(unit));
  }
}

FullyShard::~FullyShard() {
  if (!impl_) return;
  for (auto& p : impl_->params) {  // the hooks point at impl_: take them off
    if (!p.accumulator) continue;
    auto& hooks = p.accumulator->post_hooks();
    hooks.erase(std::remove_if(hooks.begin(), hooks.end(),
                               [&](const auto& h) {
                                 auto* g = dynamic_cast<GradReadyHook*>(h.get());
                                 return g != nullptr && g->impl_ == impl_.get();
                               }),
                hooks.end());
  }
}

at::Tensor FullyShard::forward_root(const std::function<at::Tensor()>& fn) {
  auto& s = *impl_;
  HP_CHECK(!s.drain_queued && s.rs_in_flight.empty() && s.ar_in_flight.empty(),
           "fully_shard: forward started while the previous backward's gradients are still in "
           "flight: that backward did not finish (it failed, or never reached a unit's output, "
           "so the drain never ran); run the backward of the loss built from forward_root's "
           "output");
  s.forget_abandoned_forward();
  s.unshard(0);
  s.arm(0);
  s.prefetch(1);
  auto out = fn();
  if (!at::GradMode::is_enabled() || !out.requires_grad()) {
    // No backward follows: free everything now, so no gathered copy can go stale after the
    // optimizer updates the shards.
    // Units armed by an earlier forward keep their state for that forward's backward.
    for (size_t u = 0; u < s.units.size(); ++u) {
      if (!s.units[u].armed) s.reshard(u);
    }
    return out;
  }
  auto graph = std::make_shared<int>(0);
  s.root_graph = graph;
  return RootPreBackward::apply(out, &s, std::shared_ptr<void>(std::move(graph)));
}

at::Tensor FullyShard::forward_unit(size_t index, const at::Tensor& x,
                                    const std::function<at::Tensor(const at::Tensor&)>& fn,
                                    bool recompute) {
  return forward_unit_outputs(
      index, x, [fn](const at::Tensor& in) { return std::vector<at::Tensor>{fn(in)}; },
      recompute)[0];
}

std::vector<at::Tensor> FullyShard::forward_unit_outputs(
    size_t index, const at::Tensor& x,
    const std::function<std::vector<at::Tensor>(const at::Tensor&)>& fn, bool recompute) {
  auto& s = *impl_;
  HP_CHECK(index >= 1 && index < s.units.size(), "fully_shard: forward_unit(", index,
           ") is out of range; units 1..", s.units.size() - 1, " (0 is the root)");
  s.unshard(index);
  s.arm(index);
  s.prefetch(index + 1);
  std::vector<at::Tensor> outs;
  if (recompute && at::GradMode::is_enabled()) {
    auto block = [fn](const std::vector<at::Tensor>& in) { return fn(in[0]); };
    outs = common::checkpoint(block, {x});
  } else {
    outs = fn(x);
  }
  if (s.units[index].reshard_after_forward) {
    s.record("reshard", s.units[index].name);
    s.reshard(index);
  }
  auto& y = outs[0];
  if (!at::GradMode::is_enabled() || !y.requires_grad()) return outs;
  y = PreBackward::apply(y, &s, static_cast<int64_t>(index));
  return outs;
}

void FullyShard::set_requires_all_reduce(bool value) {
  impl_->requires_all_reduce = value;
}

std::vector<std::pair<std::string, at::Tensor>> FullyShard::sharded_parameters() const {
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (const auto& p : impl_->params)
    out.emplace_back(p.name, p.shard);
  return out;
}

namespace {
const detail::ShardedParam& find(const Impl& s, const std::string& name) {
  auto it = s.by_name.find(name);
  HP_CHECK(it != s.by_name.end(), "fully_shard: no parameter named '", name, "'");
  return s.params[it->second];
}
}  // namespace

int64_t FullyShard::shard_first_row(const std::string& name) const {
  return impl_->shard_rank * find(*impl_, name).chunk_rows;
}

int64_t FullyShard::shard_valid_rows(const std::string& name) const {
  return find(*impl_, name).valid_rows(impl_->shard_rank);
}

at::Tensor FullyShard::full_gradient(const std::string& name) {
  const auto& p = find(*impl_, name);
  auto g = p.shard.grad().defined() ? p.shard.grad() : at::zeros_like(p.shard);
  return comm::all_gather(*impl_->groups.shard, g, 0).narrow(0, 0, p.rows);
}

at::Tensor FullyShard::full_parameter(const std::string& name) {
  const auto& p = find(*impl_, name);
  return comm::all_gather(*impl_->groups.shard, p.shard.detach(), 0).narrow(0, 0, p.rows);
}

const std::vector<std::string>& FullyShard::schedule() const {
  return impl_->events;
}

void FullyShard::clear_schedule() {
  impl_->events.clear();
}

HsdpStats FullyShard::stats() const {
  auto st = impl_->stats;
  st.resident_unsharded_numel = 0;
  for (const auto& p : impl_->params) {
    if (detail::is_allocated(p.full)) st.resident_unsharded_numel += p.full_numel();
  }
  return st;
}

ByteFormula FullyShard::bytes_per_step() const {
  const auto& s = *impl_;
  using comm::OpKind;
  ByteFormula f;
  int64_t tp_bytes = 0;  // TP-partial gradient slices, all-reduced across TP at the drain
  for (const auto& unit : s.units) {
    // Bytes of this unit's shard per gather dtype and per reduce dtype (one bucket each).
    std::map<at::ScalarType, int64_t> gather_bytes, reduce_bytes;
    for (size_t i : unit.params) {
      const auto& p = s.params[i];
      gather_bytes[p.shard.scalar_type()] += p.shard_numel() * p.shard.element_size();
      const auto rd = s.options.reduce_dtype.value_or(p.full.scalar_type());
      const int64_t bytes = p.shard_numel() * static_cast<int64_t>(c10::elementSize(rd));
      reduce_bytes[rd] += bytes;
      if (!s.options.comm_fusion) {  // one RS per parameter
        f.reduce_scatter += comm::theory_bytes_per_rank(OpKind::kReduceScatter, bytes * s.sd,
                                                        static_cast<int>(s.sd));
      }
    }
    const int64_t gathers = unit.reshard_after_forward ? 2 : 1;  // the backward gathers again
    for (const auto& [dtype, bytes] : gather_bytes) {
      f.all_gather +=
          gathers * comm::theory_bytes_per_rank(OpKind::kAllGather, bytes, static_cast<int>(s.sd));
    }
    int64_t tp_partial_bytes = 0;
    for (size_t i : unit.params) {
      const auto& p = s.params[i];
      if (p.tp_partial_grad) {
        const auto rd = s.options.reduce_dtype.value_or(p.full.scalar_type());
        tp_partial_bytes += p.shard_numel() * static_cast<int64_t>(c10::elementSize(rd));
      }
    }
    tp_bytes += tp_partial_bytes;
    for (const auto& [dtype, bytes] : reduce_bytes) {
      if (s.options.comm_fusion) {
        f.reduce_scatter += comm::theory_bytes_per_rank(OpKind::kReduceScatter, bytes * s.sd,
                                                        static_cast<int>(s.sd));
      }
      if (s.r > 1) {
        f.all_reduce +=
            comm::theory_bytes_per_rank(OpKind::kAllReduce, bytes, static_cast<int>(s.r));
      }
    }
  }
  if (s.groups.tp && s.groups.tp->size() > 1 && tp_bytes > 0) {
    f.all_reduce += comm::theory_bytes_per_rank(OpKind::kAllReduce, tp_bytes, s.groups.tp->size());
  }
  return f;
}

std::string FullyShard::describe() const {
  const auto& s = *impl_;
  return common::str_cat(
      "HSDP (R=", s.r, ", Sd=", s.sd, "): ", s.units.size(), " units, ", s.params.size(),
      " parameters, ", s.stats.shard_numel, " of ", s.stats.full_numel,
      " elements on this rank, comm_fusion=", s.options.comm_fusion ? "on" : "off",
      ", reshard_after_forward=", s.options.reshard_after_forward ? "on" : "off",
      ", reduce=", s.options.reduce_op == ReduceOp::kAvg ? "avg" : "sum");
}

}  // namespace hp::hsdp
