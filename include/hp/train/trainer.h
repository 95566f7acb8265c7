// The training loop behind hp-train (DESIGN section 10): data -> shard_sequence -> forward ->
// loss on local tokens (global token mean over CP) -> backward -> CP/TP gradient reduction ->
// global-norm clipping -> AdamW with warm-up + cosine LR -> metrics, checkpoints.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "hp/comm/world.h"
#include "hp/train/options.h"

namespace hp::train {

struct StepMetrics {
  int64_t step = 0;
  double loss = 0;
  double step_time_s = 0;
  double tokens_per_s = 0;
  double grad_norm = 0;
  double lr = 0;
  // The loss or the gradient norm was not finite: no update (--nan-policy skip-step).
  bool skipped = false;
  int first_nonfinite_rank = -1;  // of a skipped step: the first rank that saw it, -1 if none
  // MoE models: the load-balancing loss over the global batch (summed over layers, averaged
  // over micro-batches; without its coefficient) and the assignments the capacity dropped.
  double moe_aux_loss = 0;
  int64_t moe_dropped = 0;
  // DSA models: the indexer loss, a mean over every query token of the step (summed over
  // layers, without its coefficient); what the indexer trains on.
  std::optional<double> index_loss;
};

struct TrainResult {
  std::vector<StepMetrics> steps;
  double final_loss = 0;
  double median_step_time_s = 0;
  double tokens_per_s = 0;
  int64_t peak_rss_bytes_max_rank = 0;
  int64_t memory_estimate_bytes_per_rank = 0;  // the planner's estimate (plan::estimate_memory)
  // --resume found the run finished (its last checkpoint at or past --steps): nothing ran.
  bool already_finished = false;
  std::map<std::string, int64_t> comm_bytes_per_step;  // op -> bytes this rank sent, step 1
  // The same by group, then op (e.g. "cp" -> "all_gather"; HSDP's "dp_shard+cp").
  std::map<std::string, std::map<std::string, int64_t>> comm_bytes_per_step_by_group;
  std::optional<double> max_abs_loss_diff, max_rel_grad_diff;  // --validate
  std::string plan;                                            // the resolved plan
  // The CP layout that ran (--cp-algo auto: the cost model's choice); none at cp = 1.
  std::optional<cp::ContextParallelConfig> cp_config;
};

// Collective over the world: one rank's part of the job. Rank 0's result carries the metrics.
// Runs preflight() first (options, memory, output paths: before anything is allocated). A
// non-finite loss or gradient norm with NanPolicy::kError throws (on every rank) naming the step
// and the first rank that saw it, before that step updates the model or writes a checkpoint.
TrainResult train(const comm::World& world, const TrainOptions& options);

}  // namespace hp::train
