// The training loop behind hp-train (DESIGN section 10): data -> shard_sequence -> forward ->
// loss on local tokens (global token mean over CP) -> backward -> CP/TP gradient reduction ->
// global-norm clipping -> AdamW with warm-up + cosine LR -> metrics, checkpoints.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "hp/comm/world.h"
#include "hp/cp/config.h"
#include "hp/model/qwen3.h"

namespace hp::train {

struct TrainOptions {
  model::Qwen3Config model;
  int64_t tp = 1;
  int64_t cp = 1;
  int64_t dp_shard = 1;      // HSDP shard degree (the shard group is dp_shard x cp)
  int64_t dp_replicate = 1;  // HSDP replicas
  bool comm_fusion = false;  // HSDP: fused per-unit reduce-scatter buckets
  int64_t grad_accum = 1;    // micro-batches per step (HSDP: replicate all-reduce on the last)
  std::optional<cp::ContextParallelConfig> cp_config;
  bool cp_auto = false;  // --cp-algo auto: the cost model chooses (calibration of this link)
  int64_t seq_len = 512;
  int64_t batch = 1;  // sequences per data-parallel rank and micro-batch
  int64_t steps = 50;
  double lr = 3e-3;
  // Warm-up then cosine decay to 10% of lr at lr_decay_steps; independent of `steps`, so a run
  // of K steps resumed to 2K follows the 2K run exactly.
  int64_t lr_warmup = 20;
  int64_t lr_decay_steps = 2000;
  double weight_decay = 0.01;
  double clip = 1.0;
  uint64_t seed = 0;
  std::string data;  // empty: the embedded copy task; else a text file or a .bin of uint16 ids
  std::string data_dtype = "uint16";  // .bin files: uint16 or uint32
  bool validate = false;              // also run single-process and compare
  bool validate_mode = false;  // apply in plan::Mode::kValidate (layouts checked at boundaries)
  std::string metrics_json;
  std::string trace;
  std::string checkpoint_dir;
  int64_t checkpoint_every = 0;
  bool resume = false;
  int progress_every = 10;  // plain progress lines when stdout is not a terminal
};

struct StepMetrics {
  int64_t step = 0;
  double loss = 0;
  double step_time_s = 0;
  double tokens_per_s = 0;
  double grad_norm = 0;
  double lr = 0;
};

struct TrainResult {
  std::vector<StepMetrics> steps;
  double final_loss = 0;
  double median_step_time_s = 0;
  double tokens_per_s = 0;
  int64_t peak_rss_bytes_max_rank = 0;
  std::map<std::string, int64_t> comm_bytes_per_step;
  std::optional<double> max_abs_loss_diff, max_rel_grad_diff;  // --validate
  std::string plan;                                            // the resolved plan
};

// The embedded long-range task: a random block of tokens, then the same block again; the loss
// counts only the second half, so it can fall only if attention reaches S/2 tokens back (across
// CP shards). Deterministic in (seed, step).
// `micro` > 0 selects another micro-batch of the same step.
void make_batch(const TrainOptions& o, int64_t step, at::Tensor& ids, at::Tensor& labels,
                int64_t micro = 0);

// Collective over the world: one rank's part of the job. Rank 0's result carries the metrics.
TrainResult train(const comm::World& world, const TrainOptions& options);

}  // namespace hp::train
