#include "hp_train_args.h"

#include <fstream>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "hp/common/check.h"
#include "hp/common/host_allocator.h"
#include "hp/cp/adapter.h"
#include "hp/cp/strategy.h"
#include "hp/model/family.h"
#include "hp/model/hf.h"

namespace hp_train {
namespace {

// --nproc, the parallel layout and the CP schedule.
void add_layout_options(CLI::App& app, Args& a) {
  auto& o = a.train;
  app.add_option("--nproc", a.nproc, "local rank processes to spawn")->check(CLI::Range(1, 64));
  app.add_option("--tp", o.tp, "tensor-parallel size");
  app.add_option("--cp", o.cp, "context-parallel size");
  app.add_option("--cp-algo", a.algo,
                 hp::cp::StrategyRegistry::builtin().names_list(" | ") + " | auto (cost model)");
  app.add_option("--ulysses-degree", a.degree,
                 "Ulysses degree (hybrid, usp: required; ulysses: the whole CP group)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--schedule", a.schedule, "sync | async");
  app.add_flag("--load-balance", a.load_balance,
               "head-tail load balance (all_gather, hybrid, ring, usp)");
  app.add_option("--kv-head-policy", a.kv_head_policy,
                 "error | repeat: K/V heads fewer than the Ulysses degree sent once and repeated "
                 "after the exchange");
  app.add_option("--ulysses-head-groups", a.head_groups,
                 "async ulysses, hybrid: head groups whose Q/K/V pieces and outputs (hybrid: and "
                 "co-group K/V gathers) fly while another group is attended; usp: its outputs; "
                 "all_gather: its K/V gathers (0: automatic, 1: none)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--ulysses-row-parts", a.row_parts,
                 "async ulysses: the last head group's output all-to-all in this many row parts, "
                 "each sent while the next is attended (0: automatic, 2 where each part keeps "
                 "2048 rows; 1: whole)")
      ->check(CLI::NonNegativeNumber);
  app.add_flag("--ring-keep-blocks", a.ring_keep_blocks,
               "ring, usp: keep the K/V blocks from forward, so backward sends only the dK/dV "
               "accumulators (all_gather's bytes and memory)");
  app.add_option("--ring-backward", a.ring_backward,
                 "ring, usp: what the backward passes around the ring: auto | blocks | queries");
  app.add_option("--dp-shard", o.dp_shard, "HSDP shard degree (shard group = dp-shard x cp)");
  app.add_option("--dp-replicate", o.dp_replicate, "HSDP replicas");
  app.add_option("--comm-fusion", a.fusion, "HSDP fused per-unit reduce-scatter: on | off");
  app.add_option("--grad-accum", o.grad_accum,
                 "micro-batches per step (the loss: the token mean over all of them)");
  app.add_flag("--recompute", o.model.recompute, "recompute each decoder layer in backward");
  app.add_option("--cp-mode", o.linear.mode,
                 "gdn/kda under CP: state_passing (each rank keeps its shard, states travel) | "
                 "ulysses (heads split over ranks)")
      ->capture_default_str();
  app.add_option("--state-exchange", o.linear.state_exchange,
                 "gdn/kda state_passing: all_gather | p2p | auto (cost model)")
      ->capture_default_str();
  app.add_option("--mla-cp", o.mla.strategy,
                 "mla under CP: latent_all_gather (the latent travels) | ulysses | all_gather "
                 "(expanded K/V travel)")
      ->capture_default_str();
}

// The task: sequence, batch, steps, model sizes, optimizer and data.
void add_task_options(CLI::App& app, Args& a) {
  auto& o = a.train;
  app.add_option("--seq-len", o.seq_len, "global sequence length");
  app.add_option("--batch", o.batch, "sequences per data-parallel rank and micro-batch");
  app.add_option("--steps", o.steps, "training steps");
  app.add_option("--layers", o.model.layers, "decoder layers");
  app.add_option("--hidden", o.model.hidden, "hidden size");
  app.add_option("--heads", o.model.heads, "query heads");
  app.add_option("--kv-heads", o.model.kv_heads, "key/value heads");
  app.add_option("--head-dim", o.model.head_dim, "head dim");
  app.add_option("--ffn", o.model.ffn, "MLP width");
  app.add_option("--vocab", o.model.vocab, "vocabulary (256 for text files)");
  app.add_option("--primitive", o.model.primitive, "math | blockwise | sdpa (LibTorch >= 2)");
  app.add_option("--mixer", o.model.mixer,
                 "token mixer of every layer: attention (softmax) | gdn (Gated DeltaNet) | kda "
                 "(Kimi Delta Attention)")
      ->capture_default_str();
  app.add_option("--value-heads", o.model.value_heads,
                 "gdn/kda: value heads, a multiple of --heads (default: --heads)");
  app.add_option("--attention", a.attention,
                 "softmax (default; --mixer attention) | mla (multi-head latent attention in "
                 "every layer: d_nope = d_v = --head-dim, d_rope = --head-dim / 2) | dsa (mla "
                 "with a lightning indexer and top-k sparse attention)")
      ->capture_default_str();
  app.add_option("--topk", o.model.topk, "dsa: keys each query attends")
      ->check(CLI::PositiveNumber);
  app.add_option("--index-loss", o.model.index_loss,
                 "dsa: sparse (over the selection) | dense (indexer warm-up: every visible key)");
  app.add_option("--index-loss-coef", o.index_loss_coef,
                 "dsa: the indexer loss's weight (a mean over every query token; it trains "
                 "only the indexer)");
  app.add_option("--kv-rank", o.model.kv_rank, "mla: latent width (default 2 x --head-dim)");
  app.add_option("--q-rank", o.model.q_rank, "mla: query low rank (default 3 x --head-dim)");
  app.add_option("--lr", o.lr, "peak learning rate");
  app.add_option("--data", o.data, "text file (bytes) or .bin of uint16 ids; default: copy task");
  app.add_option("--data-dtype", o.data_dtype, ".bin token width: uint16 | uint32");
  app.add_flag("--pack-documents", o.pack_documents,
               "packed documents: attention stays inside each document, positions restart "
               "(--data: documents end after --eod-id; copy task: several copy documents)");
  app.add_option("--copy-min-block", o.copy_min_block,
                 "copy task: each row copies a block of a random length in [this, S/2] after "
                 "unlabeled random tokens, so the copy distance varies (default 0: S/2)");
  app.add_option("--eod-id", o.eod_id, "end-of-document token id (--data with --pack-documents)");
  app.add_option("--seed", o.seed, "data seed");
}

// The model family: layer pattern, MoE MLP and expert parallelism.
void add_family_options(CLI::App& app, Args& a) {
  auto& o = a.train;
  std::string names;
  for (const auto& n : hp::model::family_names())
    names += (names.empty() ? "" : " | ") + n;
  app.add_option("--arch", a.arch,
                 names +
                     " (qwen3.5: 3 Gated DeltaNet : 1 gated attention; kimi-linear: 3 KDA : "
                     "1 MLA with MoE)")
      ->capture_default_str();
  app.add_option("--partial-rotary-factor", a.rotary_factor,
                 "softmax attention: the share of each head's channels RoPE rotates (default: "
                 "the family's; qwen3.5 0.25, else 1)");
  app.add_option("--layer-pattern", o.model.layer_pattern,
                 "each layer's mixer, repeating: A attention, G gated attention, L linear "
                 "(gdn for qwen3.5, kda for kimi-linear), M mla, D dsa; e.g. LLLA");
  app.add_option("--experts", o.model.experts, "MoE experts per layer (0: dense MLP)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--top-k", o.model.moe_top_k, "MoE: experts per token")
      ->check(CLI::PositiveNumber);
  app.add_option("--moe-ffn", o.model.moe_ffn, "MoE: each expert's width (default --ffn)");
  app.add_option("--moe-renormalize", a.moe_renormalize,
                 "MoE: divide the top-k weights by their sum: on | off | auto (on for --top-k "
                 "> 1; top-1 weighs by the probability, as renormalised it is always 1)")
      ->capture_default_str();
  app.add_option("--shared-expert-ffn", o.model.shared_expert_ffn,
                 "MoE: the shared expert's width (0: none)");
  app.add_option("--ep", o.ep,
                 "expert parallelism: ranks the experts are split over (divides "
                 "dp-shard x cp)");
  app.add_option("--aux-loss-coef", o.model.aux_loss_coef, "MoE load-balancing loss weight")
      ->capture_default_str();
  app.add_option("--z-loss-coef", o.model.z_loss_coef, "MoE router z-loss weight");
  app.add_option("--capacity-factor", o.model.capacity_factor,
                 "MoE: drop assignments past capacity_factor x T x k / E per expert (default 0: "
                 "none dropped)");
  app.add_option("--linear-cp-mode", o.linear.mode, "the same as --cp-mode (linear layers)");
  app.add_option("--init-from", o.init_from,
                 "a Hugging Face qwen3 / qwen3-moe directory (config.json + *.safetensors): the "
                 "model's sizes and weights; each rank reads only its slices");
  app.add_option("--init-weights", o.init_weights,
                 "an hp-train checkpoint (step_* directory, or a --checkpoint-dir: its newest "
                 "step) of the same layout and model: its weights start this run, with a fresh "
                 "optimizer at step 1 (--seq-len, --seed, --lr may differ)");
  app.add_option("--export-hf", o.export_hf,
                 "write the trained model here in the Hugging Face format (config.json + "
                 "model.safetensors)");
}

// Checks, outputs, checkpoints and the job.
void add_run_options(CLI::App& app, Args& a) {
  auto& o = a.train;
  app.add_flag("--validate", o.validate, "also run single-process and compare");
  app.add_option("--mode", a.mode, "production | validate (layouts checked at module boundaries)");
  app.add_option("--metrics-json", o.metrics_json, "write metrics here (rank 0)");
  app.add_option("--trace", o.trace, "Chrome trace of the run, one track per rank");
  app.add_option("--checkpoint-dir", o.checkpoint_dir, "sharded checkpoints");
  app.add_option("--checkpoint-every", o.checkpoint_every,
                 "steps between checkpoints (default 0: the last step only)");
  app.add_flag("--resume", o.resume, "continue from the latest checkpoint (an error if none)");
  app.add_flag("--resume-if-exists", o.resume_if_exists,
               "continue from the latest checkpoint if there is one, else start at step 1");
  app.add_option("--nan-policy", a.nan_policy,
                 "a step with a non-finite loss or gradient norm: error (stop; default) | "
                 "skip-step (skip its update and continue)");
  app.add_option("--memory-limit", a.memory_limit,
                 "memory the ranks on this machine may use together, e.g. 8G (default: "
                 "MemAvailable); layouts estimated above it are refused");
  app.add_option("--timeout", a.timeout_s, "per-group timeout in seconds")->capture_default_str();
  app.add_option("--max-restarts", a.max_restarts,
                 "with --nproc: restart all ranks from the last complete checkpoint when a rank "
                 "fails, up to N times")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--config", a.config_file, "JSON file of options (command line wins)");
  app.add_option("--host-allocator", a.host_allocator, hp::common::kHostAllocatorHelp)
      ->check(CLI::IsMember(hp::common::host_allocator_choices()));
}

}  // namespace

hp::train::TrainOptions embedded_task() {
  hp::train::TrainOptions o;
  o.model.vocab = 16;
  o.model.layers = 2;
  o.model.hidden = 64;
  o.model.heads = 4;
  o.model.kv_heads = 2;
  o.model.head_dim = 16;
  o.model.ffn = 128;
  o.seq_len = 256;
  o.steps = 200;
  o.batch = 4;
  o.lr = 1e-2;
  return o;
}

void add_options(CLI::App& app, Args& a) {
  add_layout_options(app, a);
  add_task_options(app, a);
  add_family_options(app, a);
  add_run_options(app, a);
}

void apply_config(CLI::App& app, const std::string& path) {
  std::ifstream f(path);
  HP_CHECK(f.good(), "hp-train: cannot open --config '", path, "'");
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(f);
  } catch (const nlohmann::json::exception& e) {
    HP_CHECK(false, "hp-train: cannot parse --config '", path, "': ", e.what());
  }
  HP_CHECK(j.is_object(), "hp-train: --config '", path,
           "' must hold a JSON object of options, e.g. {\"steps\": 100}");
  HP_CHECK(!j.contains("cp_mode") || !j.contains("linear_cp_mode"), "hp-train: --config '", path,
           "' sets both cp_mode and linear_cp_mode, the same option; keep one of them");
  for (const auto& [key, value] : j.items()) {
    std::string flag = "--" + key;
    for (auto& c : flag)
      c = c == '_' ? '-' : c;
    auto* opt = app.get_option_no_throw(flag);
    HP_CHECK(opt != nullptr, "hp-train: --config key '", key, "' is not an hp-train option");
    if (opt->count() > 0) continue;  // the command line wins
    // ... also over the other name of the same option.
    if (flag == "--cp-mode" && app.count("--linear-cp-mode") > 0) continue;
    if (flag == "--linear-cp-mode" && app.count("--cp-mode") > 0) continue;
    if (value.is_boolean()) {
      if (!value.get<bool>()) continue;  // false is every flag's default
      opt->add_result("true");
    } else {
      opt->add_result(value.is_string() ? value.get<std::string>() : value.dump());
    }
    opt->run_callback();
  }
}

void model_from_checkpoint(const CLI::App& app, Args& a) {
  auto& o = a.train;
  if (o.init_from.empty()) return;
  for (const char* flag :
       {"--vocab", "--layers", "--hidden", "--heads", "--kv-heads", "--head-dim", "--ffn",
        "--experts", "--top-k", "--moe-ffn", "--arch", "--mixer", "--attention", "--layer-pattern",
        "--init-weights", "--partial-rotary-factor", "--moe-renormalize"}) {
    HP_CHECK(app.count(flag) == 0, "hp-train: ", flag, " and --init-from both set the model; ",
             "its sizes come from ", o.init_from, "/config.json: drop ", flag);
  }
  const auto hf = hp::model::read_hf_config(o.init_from);
  auto& m = o.model;
  const auto& h = hf.config;
  m.vocab = h.vocab;
  m.layers = h.layers;
  m.hidden = h.hidden;
  m.heads = h.heads;
  m.kv_heads = h.kv_heads;
  m.head_dim = h.head_dim;
  m.ffn = h.ffn;
  m.rms_eps = h.rms_eps;
  m.rope_theta = h.rope_theta;
  m.tie_embeddings = h.tie_embeddings;
  m.experts = h.experts;
  m.moe_top_k = h.moe_top_k;
  m.moe_ffn = h.moe_ffn;
  m.moe_renormalize = h.moe_renormalize;
  if (app.count("--aux-loss-coef") == 0) m.aux_loss_coef = h.aux_loss_coef;
  a.arch = hf.arch;
}

}  // namespace hp_train
