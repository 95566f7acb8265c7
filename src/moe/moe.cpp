#include "hp/moe/moe.h"

#include <cmath>

#include <ATen/ATen.h>

#include "hp/common/check.h"
#include "hp/moe/dispatch.h"

namespace hp::moe {
namespace {

// A distinct seed per (model seed, layer, weight kind, expert).
uint64_t seed_of(const MoEConfig& c, int64_t layer, int64_t kind, int64_t expert) {
  uint64_t s = c.seed * 0x9E3779B97F4A7C15ULL + static_cast<uint64_t>(layer) * 1000003ULL;
  s ^= static_cast<uint64_t>(kind) * 0xBF58476D1CE4E5B9ULL + static_cast<uint64_t>(expert + 1);
  return s;
}

at::Tensor seeded(uint64_t seed, at::IntArrayRef shape, int64_t fan_in) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  return at::randn(shape, gen, at::kFloat) / std::sqrt(static_cast<double>(fan_in));
}

at::Tensor swiglu(const at::Tensor& x, const at::Tensor& gate, const at::Tensor& up,
                  const at::Tensor& down) {
  return at::matmul(at::silu(at::matmul(x, gate.t())) * at::matmul(x, up.t()), down.t());
}

}  // namespace

void validate(const MoEConfig& c) {
  HP_CHECK(c.hidden > 0 && c.expert_ffn > 0 && c.shared_ffn >= 0, "MoEConfig: hidden=", c.hidden,
           ", expert_ffn=", c.expert_ffn, " must be positive and shared_ffn=", c.shared_ffn,
           " >= 0");
  validate(c.router);
  HP_CHECK(c.aux_loss_coef >= 0 && c.z_loss_coef >= 0 && std::isfinite(c.aux_loss_coef) &&
               std::isfinite(c.z_loss_coef),
           "MoEConfig: aux_loss_coef=", c.aux_loss_coef, " and z_loss_coef=", c.z_loss_coef,
           " must be finite and >= 0 (--aux-loss-coef, --z-loss-coef)");
}

int64_t parameter_count(const MoEConfig& c) {
  return c.router.experts * c.hidden * (1 + 3 * c.expert_ffn) + 3 * c.hidden * c.shared_ffn;
}

MoEImpl::MoEImpl(const MoEConfig& c, int64_t layer) : config_(c) {
  validate(c);
  const int64_t e = c.router.experts, h = c.hidden, f = c.expert_ffn;
  router = register_parameter("router", seeded(seed_of(c, layer, 0, -1), {e, h}, h));
  std::vector<at::Tensor> gate, up, down;
  for (int64_t i = 0; i < e; ++i) {
    gate.push_back(seeded(seed_of(c, layer, 1, i), {f, h}, h));
    up.push_back(seeded(seed_of(c, layer, 2, i), {f, h}, h));
    down.push_back(seeded(seed_of(c, layer, 3, i), {h, f}, f));
  }
  gate_proj = register_parameter("gate_proj", at::stack(gate));
  up_proj = register_parameter("up_proj", at::stack(up));
  down_proj = register_parameter("down_proj", at::stack(down));
  if (c.shared_ffn > 0) {
    const int64_t s = c.shared_ffn;
    shared_gate = register_parameter("shared_gate", seeded(seed_of(c, layer, 4, -1), {s, h}, h));
    shared_up = register_parameter("shared_up", seeded(seed_of(c, layer, 5, -1), {s, h}, h));
    shared_down = register_parameter("shared_down", seeded(seed_of(c, layer, 6, -1), {h, s}, s));
  }
}

void MoEImpl::set_expert_parallel(comm::GroupPtr ep, comm::GroupPtr stats) {
  HP_CHECK(ep != nullptr, "MoE.set_expert_parallel: the EP group is null");
  HP_CHECK(!ep_, "MoE.set_expert_parallel: expert parallelism is already set");
  const int64_t e = config_.router.experts, p = ep->size();
  HP_CHECK(e % p == 0, "MoE: experts=", e, " is not divisible by ep=", p,
           "; choose --ep dividing the number of experts");
  const int64_t local = e / p;
  first_expert_ = ep->rank() * local;
  for (auto* w : {&gate_proj, &up_proj, &down_proj}) {
    w->set_data(w->detach().narrow(0, first_expert_, local).clone());
  }
  ep_ = std::move(ep);
  stats_ = std::move(stats);
}

at::Tensor MoEImpl::run_experts(const at::Tensor& x, const std::vector<int64_t>& rows) const {
  // One unbind per stacked weight: its backward stacks the experts' gradients once (indexing
  // the stack per expert would build a zero-filled full-size gradient for every expert).
  const auto gate = gate_proj.unbind(0), up = up_proj.unbind(0), down = down_proj.unbind(0);
  std::vector<at::Tensor> outs;
  int64_t offset = 0;
  for (size_t j = 0; j < rows.size(); ++j) {
    outs.push_back(swiglu(x.narrow(0, offset, rows[j]), gate[j], up[j], down[j]));
    offset += rows[j];
  }
  return at::cat(outs);
}

at::Tensor MoEImpl::forward(const at::Tensor& x) {
  const int64_t h = config_.hidden, e = config_.router.experts, k = config_.router.top_k;
  HP_CHECK(x.size(-1) == h, "MoE: the input's last dim is ", x.size(-1), ", expected hidden=", h);
  auto rows = x.reshape({-1, h});
  const int64_t t = rows.size(0);
  auto logits = at::matmul(rows, router.t());
  auto r = route(logits, config_.router);
  const auto load = global_load(r, e, stats_);
  auto aux = aux_loss_share(r, load, k);
  auto z = z_loss_share(
      r.probs.scalar_type() == logits.scalar_type() ? logits : logits.to(r.probs.scalar_type()),
      load);
  loss_ = aux * config_.aux_loss_coef + z * config_.z_loss_coef;

  // The kept assignments, sorted by expert (stable: token, then slot order).
  auto kept = r.kept.reshape({-1});
  auto expert = r.experts.reshape({-1}).masked_select(kept);
  auto token = at::arange(t, at::kLong).repeat_interleave(k).masked_select(kept);
  auto order = std::get<1>(at::sort(expert, /*stable=*/true, 0, /*descending=*/false));
  auto sorted_token = token.index_select(0, order);
  auto weight = r.weights.reshape({-1}).masked_select(kept.to(x.device())).index_select(0, order);
  auto counts_t = at::bincount(expert, {}, e);
  std::vector<int64_t> counts(counts_t.data_ptr<int64_t>(), counts_t.data_ptr<int64_t>() + e);

  auto routed = rows.index_select(0, sorted_token.to(x.device()));
  at::Tensor out_rows;
  if (ep_ && ep_->size() > 1) {
    const auto plan = plan_dispatch(counts, *ep_);
    auto mine = dispatch(routed, plan, ep_);
    out_rows = combine(run_experts(mine, plan.rows_per_expert), plan, ep_);
  } else {
    out_rows = run_experts(routed, counts);
  }
  auto y = at::zeros_like(rows).index_add(
      0, sorted_token.to(x.device()), out_rows * weight.to(out_rows.scalar_type()).unsqueeze(1));
  if (shared_gate.defined()) y = y + swiglu(rows, shared_gate, shared_up, shared_down);

  stats_last_ = MoEStats{};
  stats_last_.tokens = t;
  stats_last_.dropped = r.dropped;
  auto per = expert_counts(r, e);
  stats_last_.per_expert.assign(per.data_ptr<int64_t>(), per.data_ptr<int64_t>() + e);
  stats_last_.aux_loss = aux.item<double>();
  stats_last_.z_loss = z.item<double>();
  return y.reshape(x.sizes());
}

}  // namespace hp::moe
