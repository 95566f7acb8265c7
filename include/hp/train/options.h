// What one hp-train run is told (DESIGN section 10): model, layout, schedule, data,
// checkpoints. Shared by the trainer, its data source and its checkpoints.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "hp/cp/config.h"
#include "hp/model/qwen3.h"

namespace hp::train {

// What a step with a non-finite (NaN or Inf) loss or gradient norm does: stop the run with an
// error (no update, no checkpoint), or skip that step's optimizer update and continue.
enum class NanPolicy { kError, kSkipStep };

struct TrainOptions {
  model::Qwen3Config model;
  int64_t tp = 1;
  int64_t cp = 1;
  int64_t dp_shard = 1;      // HSDP shard degree (the shard group is dp_shard x cp)
  int64_t dp_replicate = 1;  // HSDP replicas
  // Expert parallelism (MoE models): experts split over ep ranks of the dp_shard x cp group.
  int64_t ep = 1;
  bool comm_fusion = false;  // HSDP: fused per-unit reduce-scatter buckets
  int64_t grad_accum = 1;    // micro-batches per step (HSDP: replicate all-reduce on the last)
  std::optional<cp::ContextParallelConfig> cp_config;
  bool cp_auto = false;  // --cp-algo auto: the cost model chooses (calibration of this link)
  // Linear-attention layers (model.mixer gdn | kda): --cp-mode, --state-exchange.
  plan::LinearPlanOptions linear;
  // MLA layers (model.mixer mla): --mla-cp.
  plan::MLAPlanOptions mla;
  // DSA layers (model.mixer dsa): the indexer loss's weight in the objective (it trains only
  // the indexer, whose inputs are detached from the main model).
  double index_loss_coef = 1.0;
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
  // Packed documents: attention never crosses a document, positions restart in every document
  // and no token is predicted across a boundary. With --data a document ends after each eod_id
  // token; the copy task packs several copy documents into every sequence.
  bool pack_documents = false;
  int64_t eod_id = -1;  // the end-of-document token id (--data with pack_documents)
  // The copy task's shortest copied block (0: seq_len / 2, the whole row). Below seq_len / 2 each
  // row copies a block of a random length L in [copy_min_block, seq_len / 2] after
  // seq_len - 2L unlabeled random tokens: the copy distance varies, so only matching the
  // content (not a fixed offset) solves it.
  int64_t copy_min_block = 0;
  bool validate = false;       // also run single-process and compare
  bool validate_mode = false;  // apply in plan::Mode::kValidate (layouts checked at boundaries)
  std::string metrics_json;
  std::string trace;
  // Hugging Face checkpoints (qwen3, qwen3-moe): the weights to start from (each rank reads its
  // slices; the model's sizes come from the directory's config.json), and where the trained
  // model is written at the end.
  std::string init_from;
  std::string export_hf;
  // An hp-train checkpoint (a step_* directory, or a checkpoint_dir: its newest step) whose model
  // weights start this run, of the same layout and model; the optimizer, the step count and the
  // data start fresh, and seq_len, seed and lr may differ (a longer run from a shorter one's
  // weights). A --resume checkpoint, when there is one, replaces it.
  std::string init_weights;
  std::string checkpoint_dir;
  // Steps between checkpoints (>= 0); the last step is always saved when checkpoint_dir is set.
  int64_t checkpoint_every = 0;
  bool resume = false;            // an error when there is no checkpoint to resume
  bool resume_if_exists = false;  // resume when there is a checkpoint, else start at step 1
  NanPolicy nan_policy = NanPolicy::kError;
  // Bytes the ranks on this machine may use together (the memory check before anything is
  // allocated); 0: the machine's available memory (MemAvailable, or a cgroup limit below it).
  int64_t memory_limit = 0;
  int progress_every = 10;  // plain progress lines when stdout is not a terminal
  // Test hook (hp-train reads HP_TEST_NAN_AT_STEP and HP_TEST_NAN_RANK): the loss of this step
  // (0: none) on this world rank is made NaN, to exercise nan_policy.
  int64_t test_nan_step = 0;
  int test_nan_rank = 0;
};

}  // namespace hp::train
