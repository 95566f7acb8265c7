#include "hp/train/preflight.h"

#include <cmath>
#include <filesystem>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

#include "hp/common/check.h"
#include "hp/common/paths.h"
#include "hp/common/strings.h"
#include "hp/model/qwen3.h"
#include "hp/plan/memory.h"
#include "hp/train/checkpoint.h"
#include "hp/train/data.h"

namespace hp::train {
namespace {

void check_file(const char* flag, const std::string& path) {
  if (path.empty()) return;
  const auto why = common::why_file_unwritable(path);
  HP_CHECK(why.empty(), "hp-train: cannot write ", flag, " '", path, "': ", why);
}

void check_dir(const char* flag, const std::string& path) {
  if (path.empty()) return;
  const auto why = common::why_dir_unwritable(path);
  HP_CHECK(why.empty(), "hp-train: cannot write ", flag, " '", path, "': ", why);
}

}  // namespace

void check_options(const TrainOptions& o) {
  const auto& m = o.model;
  HP_CHECK(!o.validate || !o.resume,
           "hp-train: --validate compares a whole run from step 1; "
           "drop it or --resume (--resume-if-exists resumes only where a checkpoint exists)");
  // What the batches need, checked here too so that no rank starts (and no restart repeats it).
  if (o.data.empty()) {
    HP_CHECK(o.seq_len % 2 == 0, "hp-train: --seq-len ", o.seq_len,
             " must be even for the copy task");
    HP_CHECK(m.vocab >= 2, "hp-train: --vocab ", m.vocab,
             " must be >= 2 for the copy task (its tokens are 1 .. vocab - 1)");
    HP_CHECK(!o.pack_documents || o.seq_len >= 16,
             "hp-train: --pack-documents with the copy task needs --seq-len >= 16 (two "
             "documents of at least 8 tokens), got ",
             o.seq_len);
  }
  HP_CHECK(o.data_dtype == "uint16" || o.data_dtype == "uint32", "hp-train: --data-dtype '",
           o.data_dtype, "' is not valid; valid: uint16, uint32");
  // --steps 0 converts a checkpoint (--init-from to --export-hf) without training.
  const bool convert = o.steps == 0 && !o.init_from.empty() && !o.export_hf.empty();
  HP_CHECK(o.steps >= 1 || convert, "hp-train: --steps ", o.steps,
           " must be >= 1 (0 only with --init-from and --export-hf: convert without training)");
  HP_CHECK(!(convert && o.validate),
           "hp-train: --validate compares training steps; with --steps 0 "
           "there are none: drop --validate");
  for (const auto& [flag, value] : {std::pair<const char*, int64_t>{"--batch", o.batch},
                                    {"--grad-accum", o.grad_accum},
                                    {"--tp", o.tp},
                                    {"--cp", o.cp},
                                    {"--dp-shard", o.dp_shard},
                                    {"--dp-replicate", o.dp_replicate},
                                    {"--layers", m.layers},
                                    {"--hidden", m.hidden},
                                    {"--heads", m.heads},
                                    {"--kv-heads", m.kv_heads},
                                    {"--head-dim", m.head_dim},
                                    {"--ffn", m.ffn},
                                    {"--vocab", m.vocab}}) {
    HP_CHECK(value >= 1, "hp-train: ", flag, " ", value, " must be >= 1");
  }
  HP_CHECK(o.seq_len >= 2, "hp-train: --seq-len ", o.seq_len, " must be >= 2");
  HP_CHECK(o.init_from.empty() || o.init_weights.empty(), "hp-train: --init-from '", o.init_from,
           "' and --init-weights '", o.init_weights, "' both give the starting weights; keep one");
  HP_CHECK(o.init_weights.empty() || !o.validate,
           "hp-train: --validate compares against a single-process run from the same weights, "
           "which --init-weights '",
           o.init_weights, "' holds only as this layout's shards; drop --validate");
  HP_CHECK(std::isfinite(o.lr) && o.lr > 0, "hp-train: --lr ", o.lr,
           " must be a finite number > 0 (the peak learning rate, e.g. 3e-3)");
  HP_CHECK(std::isfinite(o.weight_decay) && o.weight_decay >= 0, "hp-train: weight_decay ",
           o.weight_decay, " must be a finite number >= 0");
  HP_CHECK(std::isfinite(o.clip) && o.clip >= 0, "hp-train: clip ", o.clip,
           " must be a finite number >= 0 (0: no clipping)");
  HP_CHECK(o.lr_warmup >= 0 && o.lr_decay_steps >= 1, "hp-train: lr_warmup ", o.lr_warmup,
           " must be >= 0 and lr_decay_steps ", o.lr_decay_steps, " >= 1");
  HP_CHECK(std::isfinite(o.index_loss_coef) && o.index_loss_coef >= 0,
           "hp-train: --index-loss-coef ", o.index_loss_coef,
           " must be a finite number >= 0 (the weight of the DSA indexer's loss)");
  HP_CHECK(o.checkpoint_every >= 0, "hp-train: --checkpoint-every ", o.checkpoint_every,
           " must be >= 0 (0: save at the end of the run only)");
  HP_CHECK(!(o.resume || o.resume_if_exists) || !o.checkpoint_dir.empty(),
           "hp-train: ", o.resume ? "--resume" : "--resume-if-exists", " needs --checkpoint-dir");
  HP_CHECK(o.memory_limit >= 0, "hp-train: --memory-limit must be >= 0");
  HP_CHECK(!o.validate || o.model.capacity_factor == 0 || o.cp * o.dp_shard * o.dp_replicate == 1,
           "hp-train: --validate compares with one process, but --capacity-factor ",
           o.model.capacity_factor,
           " drops tokens per rank (each rank's tokens form one capacity group), so the runs "
           "differ by design; drop --capacity-factor or --validate");
  HP_CHECK(o.copy_min_block == 0 || (o.copy_min_block >= 2 && o.copy_min_block <= o.seq_len / 2),
           "hp-train: --copy-min-block ", o.copy_min_block,
           " must be in [2, --seq-len / 2 = ", o.seq_len / 2,
           "] (0: the whole row, --seq-len / 2)");
  HP_CHECK(o.copy_min_block == 0 || (o.data.empty() && !o.pack_documents),
           "hp-train: --copy-min-block ", o.copy_min_block,
           " varies the copy task's block in one document per row; drop it with --data or "
           "--pack-documents");
  if (o.pack_documents) {
    for (int64_t i = 0; i < o.model.layers; ++i) {
      const auto kind = model::layer_mixer(o.model, i);
      HP_CHECK(kind != "dsa",
               "hp-train: --pack-documents needs softmax, MLA or linear attention layers (--mixer "
               "attention|mla|gdn|kda); the dsa mixer does not take document boundaries yet");
    }
    HP_CHECK(o.model.primitive != "sdpa",
             "hp-train: --pack-documents needs --primitive "
             "blockwise or math (sdpa takes no document masks)");
    HP_CHECK(o.data.empty() || (o.eod_id >= 0 && o.eod_id < o.model.vocab),
             "hp-train: --pack-documents with --data needs --eod-id, the end-of-document token id "
             "(in [0, --vocab ",
             o.model.vocab, ")), got ", o.eod_id);
  }
  HP_CHECK(o.eod_id < 0 || (o.pack_documents && !o.data.empty()), "hp-train: --eod-id ", o.eod_id,
           " is used only with --pack-documents and --data; "
           "add them or drop --eod-id");
}

void check_output_paths(const TrainOptions& o, int rank) {
  check_dir("--checkpoint-dir", o.checkpoint_dir);
  if (!o.checkpoint_dir.empty() && !o.resume && !o.resume_if_exists) {
    // A new run there would replace the older run's steps one by one, and a restart (which
    // adds --resume) or a later --resume could continue the older run's newest step.
    const int64_t last = latest_checkpoint(o.checkpoint_dir);
    HP_CHECK(last == 0, "hp-train: --checkpoint-dir '", o.checkpoint_dir,
             "' already holds the checkpoints of a run (the newest is '",
             step_dir(o.checkpoint_dir, last),
             "'); add --resume to continue that run, or give an empty or new --checkpoint-dir to "
             "start a new one");
  }
  check_file("--trace", o.trace);  // every rank writes <trace>.rank<r> beside it
  if (rank == 0) {
    check_file("--metrics-json", o.metrics_json);
    check_dir("--export-hf", o.export_hf);  // before the steps, not after them
  }
}

plan::PlanOptions plan_options(const TrainOptions& o) {
  plan::PlanOptions po;
  po.tp_size = o.tp;
  po.cp_size = o.cp;
  po.cp_config = o.cp_config;
  po.seq_len = o.seq_len;
  po.dp_shard = o.dp_shard;
  po.dp_replicate = o.dp_replicate;
  po.ep_size = o.ep;
  po.comm_fusion = o.comm_fusion;
  po.reduce_op = hsdp::ReduceOp::kSum;  // losses are normalised by the global token count
  po.batch = o.batch;
  po.linear = o.linear;
  po.mla = o.mla;
  return po;
}

plan::ShardingPlan plan_layout(const TrainOptions& o, int64_t world_size) {
  auto po = plan_options(o);
  const bool exchange_auto = model::has_linear(o.model) && o.linear.mode == "state_passing" &&
                             o.linear.state_exchange == "auto";
  if (o.cp > 1 && (o.cp_auto || exchange_auto)) {
    po.cp_auto = o.cp_auto;
    po.calibration = plan::load_calibration(plan::default_calibration_path(plan::current_link()));
  }
  model::Qwen3 probe(o.model);  // sizes only (cheap at these sizes)
  return plan::ShardingPlanner().plan(*probe, world_size, po);
}

plan::MemoryEstimate estimate_memory(const TrainOptions& o) {
  return plan::estimate_memory(model::footprint(o.model), plan_options(o));
}

void check_memory(const TrainOptions& o, int ranks_on_machine) {
  const auto per_rank = estimate_memory(o);
  int64_t extra = 0;
  if (o.validate) {  // rank 0 also trains the single-process reference on every rank's rows
    TrainOptions ref = o;
    ref.tp = ref.cp = ref.dp_shard = ref.dp_replicate = 1;
    ref.cp_config.reset();
    ref.batch = o.batch * o.dp_shard * o.dp_replicate;
    extra = estimate_memory(ref).total() - plan::kRuntimeBytes;
  }
  // Every rank holds --data's tokens once, at the file's width (Corpus).
  std::vector<std::string> what;
  if (extra > 0) what.push_back("the reference");
  std::error_code ec;
  if (!o.data.empty()) {
    const auto size = std::filesystem::file_size(o.data, ec);
    if (!ec && size > 0) {
      extra += static_cast<int64_t>(size) * ranks_on_machine;
      what.push_back(common::str_cat("--data's tokens (", ranks_on_machine, " x ",
                                     plan::format_bytes(static_cast<int64_t>(size)), ")"));
    }
  }
  const auto machine =
      o.memory_limit > 0
          ? plan::MachineMemory{o.memory_limit, "--memory-limit " + size_option(o.memory_limit)}
          : plan::machine_memory();
  plan::check_memory(per_rank, ranks_on_machine, machine, "hp-train", extra,
                     common::str_join(what, " and "));
}

void preflight(const TrainOptions& o, int rank, int ranks_on_machine) {
  check_options(o);
  check_data_path(o.data);
  check_memory(o, ranks_on_machine);
  check_output_paths(o, rank);
}

int64_t parse_size(const std::string& text) {
  size_t used = 0;
  double value = -1;
  try {
    value = std::stod(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  std::string suffix = text.substr(used);
  if (suffix.size() > 1 && (suffix.back() == 'B' || suffix.back() == 'b')) suffix.pop_back();
  if (suffix.size() == 2 && (suffix[1] == 'i' || suffix[1] == 'I')) suffix.pop_back();
  double scale = -1;
  if (suffix.empty() || suffix == "B" || suffix == "b") scale = 1;
  if (suffix == "K" || suffix == "k") scale = 1024.0;
  if (suffix == "M" || suffix == "m") scale = 1024.0 * 1024;
  if (suffix == "G" || suffix == "g") scale = 1024.0 * 1024 * 1024;
  if (suffix == "T" || suffix == "t") scale = 1024.0 * 1024 * 1024 * 1024;
  HP_CHECK(used > 0 && scale > 0 && std::isfinite(value) && value >= 0,
           "hp-train: --memory-limit '", text,
           "' is not a size; give bytes or a number with K, M, G or T (e.g. 512M, 8G)");
  HP_CHECK(value * scale >= 1, "hp-train: --memory-limit '", text,
           "' is less than one byte; give a size like 8G, or drop --memory-limit for the "
           "machine's available memory");
  return static_cast<int64_t>(value * scale);
}

std::string size_option(int64_t bytes) {
  for (const auto& [unit, scale] : {std::pair<const char*, int64_t>{"T", int64_t{1} << 40},
                                    {"G", int64_t{1} << 30},
                                    {"M", int64_t{1} << 20},
                                    {"K", int64_t{1} << 10}}) {
    if (bytes >= scale && bytes % scale == 0) return common::str_cat(bytes / scale, unit);
  }
  return std::to_string(bytes);
}

}  // namespace hp::train
