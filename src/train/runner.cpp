#include "runner.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include <ATen/ATen.h>

#include "hp/comm/collectives.h"
#include "hp/common/check.h"
#include "hp/cp/sequence.h"

namespace hp::train {
namespace {

at::Tensor loss_sum(const at::Tensor& logits, const at::Tensor& labels) {
  return at::cross_entropy_loss(logits.reshape({-1, logits.size(-1)}), labels.reshape({-1}), {},
                                at::Reduction::Sum, -100);
}

}  // namespace

double lr_at(const TrainOptions& o, int64_t step) {
  const int64_t warmup = std::max<int64_t>(1, o.lr_warmup);
  if (step <= warmup) return o.lr * static_cast<double>(step) / static_cast<double>(warmup);
  const double t =
      static_cast<double>(step - warmup) / std::max<int64_t>(1, o.lr_decay_steps - warmup);
  return o.lr * (0.1 + 0.9 * 0.5 * (1.0 + std::cos(M_PI * std::min(1.0, t))));
}

Runner::Runner(const TrainOptions& opts, comm::DeviceMesh& m,
               const std::optional<cp::ContextParallelConfig>& cfg)
    : o(opts), mesh(m), model(opts.model, m.size("tp") > 1 ? m.group_ptr({"tp"}) : nullptr) {
  cp = m.size("cp");
  cp_rank = m.coordinate("cp");
  tp_rank = m.coordinate("tp");
  dp = m.size("dp_replicate") * m.size("dp_shard");
  dp_rank = m.coordinate("dp_replicate") * m.size("dp_shard") + m.coordinate("dp_shard");
  lb = cfg && cfg->load_balance;
}

void Runner::make_optimizer(hsdp::FullyShard* shard) {
  fully_shard = shard;
  // HSDP's drain reduces every gradient over dp_shard x cp and dp_replicate, and the TP-partial
  // ones over TP: it runs on every layout of more than one rank (plan::hsdp_applies).
  HP_INTERNAL_ASSERT(shard != nullptr || mesh.world().size() == 1,
                     "hp-train: a run of more than one rank without HSDP reduces no gradients");
  params.clear();
  if (fully_shard != nullptr) {
    params = fully_shard->sharded_parameters();
    // Experts split by EP stay outside HSDP: the optimizer updates them as they are.
    if (plan != nullptr)
      params.insert(params.end(), plan->expert_params.begin(), plan->expert_params.end());
  } else {
    for (const auto& p : model->named_parameters())
      params.emplace_back(p.key(), p.value());
  }
  std::vector<at::Tensor> ps;
  for (auto& [n, p] : params)
    ps.push_back(p);
  opt = std::make_unique<torch::optim::AdamW>(
      ps, torch::optim::AdamWOptions(o.lr).weight_decay(o.weight_decay));
}

bool Runner::is_expert(const std::string& name) const {
  return plan != nullptr && plan->is_expert_param(name);
}

double Runner::forward_backward(int64_t step, const Corpus& corpus) {
  local_loss_nonfinite_ = local_grads_nonfinite_ = false;
  moe_aux_loss = 0;
  moe_dropped = 0;
  index_loss.reset();
  // Every rank builds the union of every data-parallel rank's rows, so the step's labelled-token
  // count (over all micro-batches) is known here without communication. Each micro-batch's
  // token sum is divided by it: the step's loss is the token mean over the whole step, as one
  // batch of batch x grad_accum rows would give, not a mean of the micro-batches' means (which
  // weighs the tokens of a micro-batch with fewer labels more).
  TrainOptions global = o;
  global.batch = o.batch * dp;
  std::vector<Batch> micros;
  double count = 0;
  for (int64_t micro = 0; micro < o.grad_accum; ++micro) {
    micros.push_back(make_batch(global, corpus, step, micro));
    count += static_cast<double>(micros.back().labels.ne(-100).sum().item<int64_t>());
  }
  HP_CHECK(count > 0, "hp-train: step ", step,
           " has no labelled tokens in any micro-batch; use longer documents or --seq-len");
  // The indexer loss is a mean over every query token of the step (labelled or not: the
  // indexer learns to rank keys for every query), so its weight does not depend on how many
  // tokens the task labels.
  const double queries = static_cast<double>(global.batch * o.seq_len * o.grad_accum);
  double loss = 0;
  for (int64_t micro = 0; micro < o.grad_accum; ++micro)
    loss += micro_step(step, micro, micros[micro], count, queries);
  reduce_expert_grads();
  if (o.validate && first_grads.empty()) keep_first_grads();
  return loss;
}

double Runner::micro_step(int64_t step, int64_t micro, const Batch& batch, double step_count,
                          double step_queries) {
  const double tp = static_cast<double>(mesh.size("tp"));
  auto rows = [&](const at::Tensor& t) {
    return t.defined() ? t.narrow(0, dp_rank * o.batch, o.batch) : t;
  };
  auto b =
      cp::shard_batch(rows(batch.ids), rows(batch.labels), cp_rank, cp, lb, rows(batch.doc_ids));
  if (checker != nullptr) checker->set(b.input_ids, input_layout);
  if (fully_shard != nullptr) fully_shard->set_requires_all_reduce(micro == o.grad_accum - 1);
  auto logits = model->forward(b.input_ids, b.position_ids, b.doc_ids);
  auto local_sum = loss_sum(logits, b.labels);
  // DSA layers' indexer losses (sums over this rank's queries): a mean over the step's queries,
  // apart from the language-model loss.
  const auto aux = model->aux_loss();
  if (o.test_nan_step == step && mesh.world().rank() == o.test_nan_rank) {
    local_sum = local_sum * std::numeric_limits<double>::quiet_NaN();  // the test hook
  }
  if (!std::isfinite(local_sum.detach().item<double>())) local_loss_nonfinite_ = true;
  const auto moe = model->moe_step();
  // Summed over the world: every TP rank holds the same tokens.
  auto stats = comm::all_reduce(
      mesh.world().group(),
      at::stack(
          {local_sum.detach().to(at::kDouble), at::scalar_tensor(moe.aux_loss, at::kDouble),
           at::scalar_tensor(static_cast<double>(moe.dropped), at::kDouble),
           aux.defined() ? aux.detach().to(at::kDouble).reshape({}) : at::zeros({}, at::kDouble)}));
  moe_aux_loss += stats[1].item<double>() / tp / static_cast<double>(o.grad_accum);
  moe_dropped += std::llround(stats[2].item<double>() / tp);
  auto objective = local_sum / step_count;
  if (aux.defined()) {
    index_loss = index_loss.value_or(0) + stats[3].item<double>() / tp / step_queries;
    objective = objective + aux * (o.index_loss_coef / step_queries);
  }
  // MoE layers' aux and z losses: already this rank's share of the global value. Every TP rank
  // computes the same share; the gradients it feeds are not summed over TP.
  if (const auto moe = model->moe_loss(); moe.defined()) {
    objective = objective + moe / static_cast<double>(o.grad_accum);
  }
  objective.backward();
  return stats[0].item<double>() / tp / step_count;
}

void Runner::reduce_expert_grads() {
  if (plan == nullptr || !plan->expert_replicas || plan->expert_replicas->size() == 1) return;
  for (auto& [n, p] : plan->expert_params) {
    if (p.grad().defined()) p.mutable_grad() = comm::all_reduce(*plan->expert_replicas, p.grad());
  }
}

void Runner::keep_first_grads() {
  // The gathers below are the check's, not the step's: the step's traffic counts stay as they
  // were (the metrics report them).
  auto& counters = mesh.world().context().counters;
  const auto step_traffic = counters.snapshot();
  const int64_t tp = mesh.size("tp");
  for (auto& [n, p] : params) {
    at::Tensor g;
    if (is_expert(n) && p.grad().defined()) {
      // Every expert's gradient: the EP group holds them all (collective over it).
      g = comm::all_gather(*plan->ep_group, p.grad(), 0);
    } else if (fully_shard != nullptr) {
      g = fully_shard->full_gradient(n);  // collective over the shard group
    } else if (p.grad().defined()) {
      g = p.grad().clone();
    }
    // Every TP slice too (collective over TP), so --validate compares whole gradients.
    if (g.defined() && tp > 1 && plan != nullptr) {
      if (auto d = plan->tp_shard_dim(n))
        g = comm::all_gather(mesh.group("tp"), g.contiguous(), *d);
    }
    if (g.defined()) first_grads[n] = g;
  }
  counters.restore(step_traffic);
}

double Runner::grad_norm() {
  double local = 0, expert = 0;
  for (auto& [n, p] : params) {
    if (!p.grad().defined()) continue;
    const bool tp_sharded = plan != nullptr && plan->tp_shard_dim(n).has_value();
    if (!tp_sharded && tp_rank != 0) continue;
    (is_expert(n) ? expert : local) += p.grad().pow(2).sum().item<double>();
  }
  if (!std::isfinite(local) || !std::isfinite(expert)) local_grads_nonfinite_ = true;
  // Ranks holding the same values: HSDP replicas (one rank runs without HSDP); experts split by
  // EP, the ranks holding the same experts.
  const double copies =
      fully_shard != nullptr ? static_cast<double>(mesh.size("dp_replicate")) : 1.0;
  const double expert_copies =
      plan != nullptr && plan->expert_replicas ? plan->expert_replicas->size() : 1.0;
  double total = local + expert;
  if (mesh.world().size() > 1) {
    auto sums = comm::all_reduce(mesh.world().group(), at::tensor({local, expert}, at::kDouble));
    total = sums[0].item<double>() / copies + sums[1].item<double>() / expert_copies;
  }
  return std::sqrt(total);
}

void Runner::clip_and_update(int64_t step, double norm) {
  if (o.clip > 0 && norm > o.clip) {
    for (auto& [n, p] : params) {
      if (p.grad().defined()) p.mutable_grad().mul_(o.clip / (norm + 1e-6));
    }
  }
  const double lr = lr_at(o, step);
  for (auto& g : opt->param_groups()) {
    static_cast<torch::optim::AdamWOptions&>(g.options()).lr(lr);
  }
  opt->step();
  opt->zero_grad();
}

double Runner::clip_and_step(int64_t step) {
  const double norm = grad_norm();
  clip_and_update(step, norm);
  return norm;
}

void Runner::discard_grads() {
  opt->zero_grad();
}

int Runner::first_nonfinite_rank() {
  const auto& world = mesh.world();
  auto seen = at::zeros({2, world.size()}, at::kDouble);
  seen[0][world.rank()] = local_loss_nonfinite_ ? 1.0 : 0.0;
  seen[1][world.rank()] = local_grads_nonfinite_ ? 1.0 : 0.0;
  if (world.size() > 1) seen = comm::all_reduce(world.group(), seen);
  for (int what = 0; what < 2; ++what) {
    for (int r = 0; r < world.size(); ++r) {
      if (seen[what][r].item<double>() > 0) return r;
    }
  }
  return -1;
}

}  // namespace hp::train
