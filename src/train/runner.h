// Internal to train/: one training run of the model over a mesh's layout (trainer.cpp), also the
// single-process reference of --validate (validate.cpp: a mesh of one rank, no CP).
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>

#include <torch/optim/adamw.h>

#include "hp/comm/device_mesh.h"
#include "hp/cp/config.h"
#include "hp/hsdp/fully_shard.h"
#include "hp/model/qwen3.h"
#include "hp/plan/layout.h"
#include "hp/plan/plan.h"
#include "hp/train/checkpoint.h"
#include "hp/train/data.h"
#include "hp/train/options.h"

namespace hp::train {

// The learning rate of 1-based `step`: linear warm-up, then cosine decay to 10% of lr at
// lr_decay_steps.
double lr_at(const TrainOptions& o, int64_t step);

// The model (built with the mesh's TP group), its optimizer and one step's forward/backward and
// update. `options` and `mesh` must outlive the Runner.
struct Runner {
  Runner(const TrainOptions& options, comm::DeviceMesh& mesh,
         const std::optional<cp::ContextParallelConfig>& cp_config);

  // After the applier ran (HSDP replaces the parameters by shards): AdamW over `params`.
  void make_optimizer(hsdp::FullyShard* fully_shard);

  // Forward + backward of one step (grad_accum micro-batches of `corpus`, the Corpus::load of
  // the options); returns the global mean loss: the token mean over every micro-batch's rows,
  // what one batch of batch x grad_accum rows gives.
  // Each rank's loss is its token sum over the step's global token count, so the gradient is a
  // plain SUM over micro-batches, data-parallel and CP ranks (HSDP reduces with SUM; it runs on
  // every layout of more than one rank).
  double forward_backward(int64_t step, const Corpus& corpus);

  // The global gradient norm (TP shards summed, TP-replicated parameters counted once, HSDP
  // shards summed over the shard group, replicas once). Collective; the same on every rank.
  double grad_norm();
  // Global-norm clipping of the gradients whose norm is `norm`, then AdamW at step's rate.
  void clip_and_update(int64_t step, double norm);
  // grad_norm() then clip_and_update(); returns the norm before clipping.
  double clip_and_step(int64_t step);
  // A step whose loss or norm is not finite: its gradients are dropped, nothing is updated.
  void discard_grads();
  // Collective, after a non-finite step: the lowest world rank whose own loss (else its own
  // gradients) of the step was not finite; -1 when none saw it locally.
  int first_nonfinite_rank();

  // MoE models, the last step: the global aux loss (mean over micro-batches) and the
  // assignments dropped by the capacity (over every rank).
  double moe_aux_loss = 0;
  int64_t moe_dropped = 0;
  std::optional<double> index_loss;  // DSA models: StepMetrics::index_loss of the last step

  const TrainOptions& o;
  comm::DeviceMesh& mesh;
  model::Qwen3 model;
  std::unique_ptr<torch::optim::AdamW> opt;
  hsdp::FullyShard* fully_shard = nullptr;
  NamedTensors params;  // what the optimizer updates: parameters, or HSDP shards
  int64_t cp, cp_rank, tp_rank, dp, dp_rank;
  bool lb;

  const plan::ShardingPlan* plan = nullptr;       // TP placements (null: nothing is TP-sharded)
  std::map<std::string, at::Tensor> first_grads;  // --validate: full gradients of step 1
  plan::BoundaryChecker* checker = nullptr;       // validate mode
  plan::Layout input_layout;

 private:
  // This rank's own view of the step: its loss share and gradients were not finite.
  bool local_loss_nonfinite_ = false, local_grads_nonfinite_ = false;

  // One micro-batch's forward and backward (`batch`: every data-parallel rank's rows; this
  // rank takes its own); returns its share of the step's global mean loss, whose labelled
  // tokens over all micro-batches number `step_count`.
  // DSA's indexer losses are divided by `step_queries`, the step's query tokens (all of them).
  double micro_step(int64_t step, int64_t micro, const Batch& batch, double step_count,
                    double step_queries);
  // Experts split by EP: their gradients summed over the ranks holding the same experts.
  void reduce_expert_grads();
  bool is_expert(const std::string& name) const;
  // --validate: keeps the full gradients of the first step.
  void keep_first_grads();
};

}  // namespace hp::train
