// hp-train: trains the built-in Qwen3-style decoder with any legal TP x CP layout.
//   hp-train [--nproc N] [--tp T] [--cp C] [--cp-algo all_gather|ulysses|hybrid|ring|usp|auto]
//     [--dp-shard Sd] [--dp-replicate R] [--comm-fusion on|off] [--grad-accum K] [--recompute]
//     [--ulysses-degree U] [--schedule sync|async] [--load-balance] [--seq-len S] [--batch B]
//     [--steps K] [--layers L --hidden H --heads NH --kv-heads NKV --head-dim D --ffn F]
//     [--vocab V] [--primitive math|blockwise|sdpa] [--data FILE] [--seed X] [--validate]
//     [--mixer attention|gdn|kda] [--value-heads HV] [--cp-mode state_passing|ulysses]
//     [--state-exchange all_gather|p2p|auto]
//     [--attention softmax|mla] [--mla-cp latent_all_gather|ulysses|all_gather] [--kv-rank R]
//     [--arch qwen3|qwen3-moe|qwen3.5|kimi-linear] [--layer-pattern LLLG] [--experts E]
//     [--top-k K] [--ep EP] [--aux-loss-coef C] [--capacity-factor F] [--linear-cp-mode M]
//     [--init-from HF_DIR] [--export-hf DIR] [--init-weights CHECKPOINT]
//     [--metrics-json FILE] [--checkpoint-dir DIR] [--checkpoint-every K] [--resume]
//     [--resume-if-exists] [--nan-policy error|skip-step] [--memory-limit SIZE]
//     [--timeout SECONDS] [--max-restarts N] [--config FILE.json]
// With --nproc N it spawns N local ranks (and, with --max-restarts N, restarts them from the
// last complete checkpoint when one fails); without, it joins a torchrun / mpirun / Slurm job.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "hp/comm/launch_env.h"
#include "hp/comm/launcher.h"
#include "hp/comm/world.h"
#include "hp/common/check.h"
#include "hp/common/host_allocator.h"
#include "hp/common/strings.h"
#include "hp/common/threads.h"
#include "hp/common/trace.h"
#include "hp/cp/adapter.h"
#include "hp/cp/strategy.h"
#include "hp/model/family.h"
#include "hp/model/hf.h"
#include "hp/plan/plan.h"
#include "hp/train/checkpoint.h"
#include "hp/train/preflight.h"
#include "hp/train/trainer.h"
#include "hp_train_args.h"

namespace {

using hp_train::apply_config;
using hp_train::Args;
using hp_train::model_from_checkpoint;

// The CP tuning flags set away from their defaults (Ulysses degree, K/V head policy, head
// groups, row parts, the ring's options), as the command line spells them.
std::vector<std::string> cp_tuning_given(const Args& a) {
  std::vector<std::string> given;
  if (a.degree != 0) given.push_back("--ulysses-degree " + std::to_string(a.degree));
  if (a.kv_head_policy != "error") given.push_back("--kv-head-policy " + a.kv_head_policy);
  if (a.head_groups != 0) given.push_back("--ulysses-head-groups " + std::to_string(a.head_groups));
  if (a.row_parts != 0) given.push_back("--ulysses-row-parts " + std::to_string(a.row_parts));
  if (a.ring_keep_blocks) given.push_back("--ring-keep-blocks");
  if (a.ring_backward != "auto") given.push_back("--ring-backward " + a.ring_backward);
  return given;
}

// The checked flags into the trainer's options: mode, comm fusion and the CP configuration.
void resolve(Args& a) {
  auto& o = a.train;
  HP_CHECK(a.mode == "production" || a.mode == "validate", "hp-train: --mode '", a.mode,
           "' is not valid; valid: production, validate");
  o.validate_mode = a.mode == "validate";
  HP_CHECK(a.fusion == "on" || a.fusion == "off", "hp-train: --comm-fusion '", a.fusion,
           "' is not valid; valid: on, off");
  o.comm_fusion = a.fusion == "on";
  HP_CHECK(!o.comm_fusion || hp::plan::hsdp_applies(o.dp_shard, o.dp_replicate, o.cp, o.tp),
           "hp-train: --comm-fusion on fuses HSDP's gradient reduce-scatters, but --dp-shard ",
           o.dp_shard, " x --dp-replicate ", o.dp_replicate, " x --cp ", o.cp, " x --tp ", o.tp,
           " = 1 rank runs no HSDP; drop it or use more ranks");
  HP_CHECK(o.checkpoint_every == 0 || !o.checkpoint_dir.empty(), "hp-train: --checkpoint-every ",
           o.checkpoint_every, " needs --checkpoint-dir DIR (where the checkpoints go)");
  {
    const hp::train::TrainOptions train_defaults;
    const bool bin = o.data.size() > 4 && o.data.compare(o.data.size() - 4, 4, ".bin") == 0;
    HP_CHECK(bin || o.data_dtype == train_defaults.data_dtype, "hp-train: --data-dtype ",
             o.data_dtype, " is the token width of a .bin --data file, but --data is ",
             o.data.empty() ? std::string("not given (the embedded task)") : "'" + o.data + "'",
             "; drop it");
  }
  HP_CHECK(a.nan_policy == "error" || a.nan_policy == "skip-step", "hp-train: --nan-policy '",
           a.nan_policy, "' is not valid; valid: error, skip-step");
  o.nan_policy =
      a.nan_policy == "error" ? hp::train::NanPolicy::kError : hp::train::NanPolicy::kSkipStep;
  if (!a.memory_limit.empty()) o.memory_limit = hp::train::parse_size(a.memory_limit);
  // The fault hook of the tests (a NaN loss at one step on one rank).
  if (const char* step = std::getenv("HP_TEST_NAN_AT_STEP")) o.test_nan_step = std::atoll(step);
  if (const char* rank = std::getenv("HP_TEST_NAN_RANK")) o.test_nan_rank = std::atoi(rank);
  HP_CHECK(a.attention == "softmax" || a.attention == "mla" || a.attention == "dsa",
           "hp-train: --attention '", a.attention, "' is not valid; valid: softmax, mla, dsa");
  if (a.attention != "softmax") {
    HP_CHECK(o.model.mixer == "attention", "hp-train: --attention ", a.attention, " and --mixer ",
             o.model.mixer, " both choose the token mixer; give one of them");
    o.model.mixer = a.attention;
  }
  const std::string pattern_given = o.model.layer_pattern;
  hp::model::apply_family(o.model, a.arch, {a.experts_given, a.layers_given});
  if (a.rotary_given) o.model.partial_rotary_factor = a.rotary_factor;
  HP_CHECK(o.model.layer_pattern.empty() || o.model.mixer == "attention",
           "hp-train: the layer pattern (",
           pattern_given.empty() ? "--arch " + a.arch : "--layer-pattern",
           ") chooses every layer's mixer; drop --mixer / --attention ", o.model.mixer);
  const auto& m = o.model;
  const bool softmax = hp::model::has_softmax_attention(m), linear = hp::model::has_linear(m),
             mla = hp::model::has_mixer(m, "mla"), dsa = hp::model::has_mixer(m, "dsa");
  // What the layers are, for messages: "--attention mla", "--mixer gdn", "the layer pattern".
  const std::string what = !m.layer_pattern.empty() ? "layer pattern " + m.layer_pattern
                           : (mla || dsa)           ? "--attention " + m.mixer
                                                    : "--mixer " + m.mixer;
  {
    const hp::model::Qwen3Config model_defaults;
    const hp::train::TrainOptions train_defaults;
    HP_CHECK(dsa || (m.topk == model_defaults.topk && m.index_loss == model_defaults.index_loss &&
                     o.index_loss_coef == train_defaults.index_loss_coef),
             "hp-train: --topk, --index-loss and --index-loss-coef apply to --attention dsa");
    // The sizes of one kind of layer, given to a model without that kind.
    HP_CHECK(linear || m.value_heads == model_defaults.value_heads, "hp-train: --value-heads ",
             m.value_heads,
             " sizes linear-attention layers (--mixer gdn|kda, or L in a layer "
             "pattern), but with ",
             what, " there are none; drop it");
    HP_CHECK(
        mla || dsa || (m.kv_rank == model_defaults.kv_rank && m.q_rank == model_defaults.q_rank),
        "hp-train: --kv-rank and --q-rank size MLA/DSA layers (--attention mla|dsa, or M/D "
        "in a layer pattern), but with ",
        what, " there are none; drop them");
    HP_CHECK(softmax || !a.rotary_given, "hp-train: --partial-rotary-factor ", a.rotary_factor,
             " applies to softmax attention layers, but with ", what, " there are none; drop it");
    HP_CHECK(m.experts > 0 ||
                 (o.ep == 1 && m.moe_top_k == model_defaults.moe_top_k && m.moe_ffn == 0 &&
                  m.shared_expert_ffn == 0 && m.aux_loss_coef == model_defaults.aux_loss_coef &&
                  m.z_loss_coef == 0 && m.capacity_factor == 0 && a.moe_renormalize == "auto"),
             "hp-train: --ep, --top-k, --moe-ffn, --shared-expert-ffn, --aux-loss-coef, "
             "--z-loss-coef, --capacity-factor and --moe-renormalize apply to MoE models "
             "(--experts N or --arch qwen3-moe | kimi-linear)");
  }
  if (dsa && m.topk > o.seq_len) {
    std::fprintf(stderr,
                 "hp-train: --topk %lld exceeds --seq-len %lld; clamped (every visible key is "
                 "selected)\n",
                 (long long)m.topk, (long long)o.seq_len);
  }
  const hp::plan::MLAPlanOptions mla_defaults;
  HP_CHECK(mla || o.mla.strategy == mla_defaults.strategy,
           "hp-train: --mla-cp applies to --attention mla (DSA's CP is the all-gather family)");
  if (!softmax && (mla || dsa)) {
    HP_CHECK(a.algo == "all_gather" && a.degree == 0,
             "hp-train: --cp-algo and --ulysses-degree choose softmax attention's CP; with ", what,
             mla ? " choose --mla-cp latent_all_gather|ulysses|all_gather (and --schedule, "
                   "--load-balance)"
                 : " CP gathers the index keys and the latent (--schedule, --load-balance "
                   "apply)");
  }
  if (!softmax && linear && !mla && !dsa) {
    HP_CHECK(a.algo == "all_gather" && !a.load_balance && a.degree == 0,
             "hp-train: --cp-algo, --ulysses-degree and --load-balance choose softmax "
             "attention's CP; with ",
             what,
             " choose --cp-mode state_passing|ulysses, --state-exchange all_gather|p2p|auto "
             "(and --schedule sync|async)");
  }
  if (!softmax) {  // no softmax attention layer: its CP tuning would not run
    const auto given = cp_tuning_given(a);
    HP_CHECK(given.empty(), "hp-train: ", hp::common::str_join(given), " tune",
             given.size() == 1 ? "s" : "", " softmax attention's CP, but with ", what,
             " no layer has softmax attention; drop ", given.size() == 1 ? "it" : "them");
  }
  if (!linear) {
    const hp::plan::LinearPlanOptions defaults;
    HP_CHECK(o.linear.mode == defaults.mode && o.linear.state_exchange == defaults.state_exchange,
             "hp-train: --cp-mode and --state-exchange apply to --mixer gdn|kda; with ", what,
             " choose --cp-algo (and --ulysses-degree, --schedule)");
  }
  if (o.cp == 1) {  // no CP runs: its flags would do nothing
    Args named = a;
    if (named.algo == "auto") named.algo = "all_gather";  // refused below: auto needs --cp > 1
    auto given = hp::cp::settings_given(hp::cp::parse_flags(named));
    // The linear and MLA layers' CP choices.
    const hp::plan::LinearPlanOptions linear_defaults;
    const hp::plan::MLAPlanOptions mla_defaults;
    if (o.linear.mode != linear_defaults.mode) given.push_back("--cp-mode " + o.linear.mode);
    if (o.linear.state_exchange != linear_defaults.state_exchange)
      given.push_back("--state-exchange " + o.linear.state_exchange);
    if (o.mla.strategy != mla_defaults.strategy) given.push_back("--mla-cp " + o.mla.strategy);
    hp::cp::check_nothing_given_without_cp("hp-train", given, "no CP runs");
  }
  o.cp_auto = a.algo == "auto";
  if (o.cp_auto) {
    HP_CHECK(o.cp > 1, "hp-train: --cp-algo auto needs --cp > 1");
    // The cost model ranks every legal strategy, schedule and Ulysses degree with each
    // strategy's defaults: a choice made for it would not run.
    // The K/V head policy is a permission the candidates take (Ulysses ones may repeat).
    auto given = cp_tuning_given(a);
    given.erase(
        std::remove_if(given.begin(), given.end(),
                       [](const std::string& f) { return f.rfind("--kv-head-policy", 0) == 0; }),
        given.end());
    if (a.schedule_given) given.insert(given.begin(), "--schedule " + a.schedule);
    HP_CHECK(given.empty(),
             "hp-train: --cp-algo auto chooses the strategy, its schedule and its "
             "Ulysses degree with each strategy's defaults, so ",
             hp::common::str_join(given), " would not run; drop ",
             given.size() == 1 ? "it" : "them", " or name the strategy with --cp-algo");
    a.algo = "all_gather";  // placeholder: the planner replaces it (load_balance is kept)
    a.auto_algo = true;
  }
  if (o.cp > 1 || a.algo != "all_gather" || a.schedule != "sync" || a.load_balance ||
      a.kv_head_policy != "error" || a.head_groups != 0 || a.row_parts != 0 || a.ring_keep_blocks ||
      a.ring_backward != "auto") {
    o.cp_config = hp::cp::parse_flags(a);
  }
}

// The metrics file: the run's configuration, every step and the summary.
nlohmann::json metrics_json(const hp::comm::World& world, const Args& a,
                            const hp::train::TrainResult& r) {
  const auto& o = a.train;
  const auto& ran = r.cp_config;  // what ran: --cp-algo auto's choice, or the flags
  nlohmann::json steps = nlohmann::json::array();
  for (const auto& s : r.steps) {
    steps.push_back({{"step", s.step},
                     {"loss", s.loss},
                     {"step_time_s", s.step_time_s},
                     {"tokens_per_s", s.tokens_per_s},
                     {"grad_norm", s.grad_norm},
                     {"lr", s.lr},
                     {"skipped", s.skipped}});
    if (o.model.experts > 0) {
      steps.back()["moe_aux_loss"] = s.moe_aux_loss;
      steps.back()["moe_dropped"] = s.moe_dropped;
    }
    if (s.index_loss) steps.back()["index_loss"] = *s.index_loss;
  }
  nlohmann::json j = {
      {"config",
       {{"nproc", world.size()},
        {"tp", o.tp},
        {"cp", o.cp},
        {"dp_shard", o.dp_shard},
        {"dp_replicate", o.dp_replicate},
        {"comm_fusion", a.fusion},
        {"grad_accum", o.grad_accum},
        {"recompute", o.model.recompute},
        {"cp_algo", a.auto_algo ? std::string("auto") : a.algo},
        {"cp_strategy", ran ? hp::cp::to_string(ran->algorithm) : a.algo},
        {"ulysses_degree", ran ? hp::cp::ulysses_degree_of(*ran, o.cp) : a.degree},
        {"schedule", ran ? hp::cp::to_string(ran->schedule) : a.schedule},
        {"load_balance", ran ? ran->load_balance : a.load_balance},
        {"kv_head_policy", ran ? hp::cp::to_string(ran->kv_head_policy) : a.kv_head_policy},
        {"seq_len", o.seq_len},
        {"batch", o.batch},
        {"steps", o.steps},
        {"layers", o.model.layers},
        {"hidden", o.model.hidden},
        {"heads", o.model.heads},
        {"kv_heads", o.model.kv_heads},
        {"head_dim", o.model.head_dim},
        {"partial_rotary_factor", o.model.partial_rotary_factor},
        {"ffn", o.model.ffn},
        {"vocab", o.model.vocab},
        {"primitive", o.model.primitive},
        {"mixer", o.model.mixer},
        {"arch", a.arch},
        {"layer_pattern", o.model.layer_pattern},
        {"experts", o.model.experts},
        {"top_k", o.model.moe_top_k},
        {"ep", o.ep},
        {"init_from", o.init_from},
        {"init_weights", o.init_weights},
        {"export_hf", o.export_hf},
        {"value_heads", o.model.value_heads},
        {"cp_mode", o.linear.mode},
        {"state_exchange", o.linear.state_exchange},
        {"mla_cp", o.mla.strategy},
        {"topk", o.model.topk},
        {"index_loss", o.model.index_loss},
        {"data", o.data},
        {"pack_documents", o.pack_documents},
        {"copy_min_block", o.copy_min_block},
        {"data_dtype", o.data_dtype},
        {"eod_id", o.eod_id},
        {"seed", o.seed},
        {"lr", o.lr},
        {"lr_warmup", o.lr_warmup},
        {"lr_decay_steps", o.lr_decay_steps},
        {"nan_policy", a.nan_policy},
        {"mode", a.mode},
        {"moe_ffn", o.model.moe_ffn},
        {"shared_expert_ffn", o.model.shared_expert_ffn},
        {"capacity_factor", o.model.capacity_factor},
        {"aux_loss_coef", o.model.aux_loss_coef},
        {"z_loss_coef", o.model.z_loss_coef},
        {"kv_rank", o.model.kv_rank},
        {"q_rank", o.model.q_rank},
        {"index_loss_coef", o.index_loss_coef},
        {"plan", r.plan}}},
      {"steps", steps},
      {"final_loss", r.final_loss},
      {"median_step_time_s", r.median_step_time_s},
      {"tokens_per_s", r.tokens_per_s},
      {"peak_rss_bytes_max_rank", r.peak_rss_bytes_max_rank},
      {"memory_estimate_bytes_per_rank", r.memory_estimate_bytes_per_rank},
      {"comm_bytes_per_step", r.comm_bytes_per_step},
      {"comm_bytes_per_step_by_group", r.comm_bytes_per_step_by_group}};
  if (r.max_abs_loss_diff) {
    j["validate"] = {{"max_abs_loss_diff", *r.max_abs_loss_diff},
                     {"max_rel_grad_diff", *r.max_rel_grad_diff}};
  }
  return j;
}

// Rank 0: the summary line and the metrics file (nothing when --resume found the run finished).
void report(const hp::comm::World& world, const Args& a, const hp::train::TrainResult& r) {
  if (r.already_finished) return;
  if (r.steps.empty()) {
    std::printf("hp-train: done: no training steps (--steps 0)\n");
    return;
  }
  std::printf(
      "hp-train: done: loss %.4f -> %.4f over %lld steps, median step %.3f s, %.0f "
      "tokens/s, peak RSS %.0f MiB (max rank)\n",
      r.steps.empty() ? 0.0 : r.steps.front().loss, r.final_loss, (long long)r.steps.size(),
      r.median_step_time_s, r.tokens_per_s, r.peak_rss_bytes_max_rank / 1048576.0);
  if (!a.train.metrics_json.empty()) {
    std::ofstream f(a.train.metrics_json);
    f << metrics_json(world, a, r).dump(2) << "\n";
    f.close();
    HP_CHECK(!f.fail(), "hp-train: writing --metrics-json '", a.train.metrics_json, "' failed");
  }
}

// One rank of the job (of the launcher's variables in `env`, else a world of one): train, write
// the trace, report.
int train_rank(const std::optional<hp::comm::LaunchEnv>& env, const Args& a) {
  const auto& o = a.train;
  hp::comm::WorldOptions wo;
  wo.timeout = hp::comm::timeout_from_seconds(a.timeout_s);
  if (!o.trace.empty()) wo.tracer = std::make_shared<hp::common::Tracer>();
  auto world = env ? hp::comm::World::from_launch_env(*env, wo)
                   : hp::comm::World::from_launch_env(hp::comm::LaunchEnv{}, wo);
  hp::common::configure_threads(hp::common::threads_per_rank(world.local_size()));
  auto r = hp::train::train(world, o);
  if (!o.trace.empty() && !r.already_finished) hp::comm::write_world_trace(world, o.trace);
  if (world.rank() == 0) report(world, a, r);
  return 0;
}

// N local ranks of this command line. With --max-restarts, a restart after a failure adds
// --resume once the checkpoint directory holds a complete checkpoint (else it starts over).
int launch_ranks(const Args& a, const std::vector<std::string>& argv) {
  hp::comm::LaunchOptions lo;
  lo.nproc = a.nproc;
  lo.argv = argv;
  lo.max_restarts = a.max_restarts;
  if (a.max_restarts > 0) {
    lo.argv_for_attempt = [argv, dir = a.train.checkpoint_dir](int attempt) {
      auto out = argv;
      if (attempt == 0) return out;
      const int64_t last = hp::train::latest_checkpoint(dir);
      if (last > 0) {
        std::fprintf(stderr, "hp-train: restart %d resumes from %s\n", attempt,
                     hp::train::step_dir(dir, last).c_str());
        if (std::find(out.begin(), out.end(), "--resume") == out.end())
          out.emplace_back("--resume");
      } else {
        std::fprintf(stderr, "hp-train: restart %d starts over: no complete checkpoint in %s yet\n",
                     attempt, dir.c_str());
      }
      return out;
    };
  }
  return hp::comm::relaunch_as_local_ranks(std::move(lo), "hp-train");
}

// Whether this process prints the job's warnings, once per job: hp-train's own launcher (not
// its ranks), or rank 0 under an external launcher, or a single process.
bool says_warnings(const std::optional<hp::comm::LaunchEnv>& env) {
  return !env || (!env->store_on_launcher && env->rank == 0);
}

// --config and the checks, then N local ranks of this command (--nproc N outside a job) or
// this process's rank.
int run(CLI::App& app, Args& a, const std::vector<std::string>& argv) {
  HP_CHECK(app.count("--cp-mode") == 0 || app.count("--linear-cp-mode") == 0,
           "hp-train: --cp-mode and --linear-cp-mode are the same option; give one of them");
  if (!a.config_file.empty()) apply_config(app, a.config_file);
  hp::common::apply_host_allocator_choice(a.host_allocator);  // before the first tensor
  hp::comm::timeout_from_seconds(a.timeout_s);                // checked before any rank starts
  model_from_checkpoint(app, a);
  // Top-1 routing renormalised is a weight of exactly 1, whose gradient is zero: the router
  // would learn only from the aux and z losses, never from the language model's. Without a
  // Hugging Face config (whose norm_topk_prob decides), top-1 weighs by the probability itself,
  // as Switch does; top-k > 1 renormalises, as Qwen3-MoE does.
  auto& model = a.train.model;
  HP_CHECK(a.moe_renormalize == "auto" || a.moe_renormalize == "on" || a.moe_renormalize == "off",
           "hp-train: --moe-renormalize '", a.moe_renormalize,
           "' is not valid; valid: on, off, auto");
  if (a.moe_renormalize != "auto") {
    model.moe_renormalize = a.moe_renormalize == "on";
  } else if (a.train.init_from.empty()) {
    model.moe_renormalize = model.moe_top_k > 1;
  } else if (model.experts > 0 && model.moe_top_k == 1 && model.moe_renormalize &&
             says_warnings(hp::comm::parse_launch_env(hp::comm::process_env()))) {
    std::fprintf(stderr,
                 "hp-train: warning: %s/config.json routes each token to 1 expert with "
                 "norm_topk_prob true: its weight is always 1, so the router learns only from "
                 "the aux and z losses\n",
                 a.train.init_from.c_str());
  }
  a.schedule_given = app.count("--schedule") > 0;
  a.rotary_given = app.count("--partial-rotary-factor") > 0;
  a.experts_given = app.count("--experts") > 0 || !a.train.init_from.empty();
  a.layers_given = app.count("--layers") > 0 || !a.train.init_from.empty();
  resolve(a);
  if (!a.train.export_hf.empty()) hp::model::check_hf_compatible(a.train.model);
  auto env = hp::comm::parse_launch_env(hp::comm::process_env());
  if (a.max_restarts > 0) {
    HP_CHECK(!a.train.checkpoint_dir.empty() && a.train.checkpoint_every > 0,
             "hp-train: --max-restarts ", a.max_restarts,
             " needs --checkpoint-dir and --checkpoint-every (a restart resumes from the last "
             "complete checkpoint)");
    HP_CHECK(!a.train.validate, "hp-train: --max-restarts ", a.max_restarts,
             " resumes a failed run from its last checkpoint, but --validate compares a whole "
             "run from step 1; drop one of them");
    HP_CHECK(env || a.nproc > 1, "hp-train: --max-restarts ", a.max_restarts,
             " needs --nproc N > 1 (the local launcher restarts its ranks); under torchrun, use "
             "torchrun's own --max-restarts");
  }
  // Under torchrun, mpirun or Slurm (not hp-train's own local ranks) the launcher owns the
  // processes: the local launcher's options would do nothing.
  if (env && !env->store_on_launcher) {
    HP_CHECK(a.max_restarts == 0, "hp-train: --max-restarts ", a.max_restarts,
             " restarts the ranks hp-train launches itself (--nproc N), but this process was "
             "started by an external launcher (RANK/WORLD_SIZE set); use its own restarts (e.g. "
             "torchrun --max-restarts) and drop --max-restarts");
    HP_CHECK(a.nproc == 1, "hp-train: --nproc ", a.nproc,
             " spawns local ranks, but this process was started by an external launcher "
             "(RANK/WORLD_SIZE set, world size ",
             env->world_size, "); set the ranks there and drop --nproc");
  }
  if (!env && a.nproc > 1) {
    const auto& o = a.train;
    // Before any rank starts: the options, the memory of nproc ranks, the output paths.
    hp::train::preflight(o, /*rank=*/0, a.nproc);
    const int64_t used = o.dp_replicate * o.dp_shard * o.cp * o.tp;
    HP_CHECK(a.nproc == used, "hp-train: --nproc ", a.nproc, " but --dp-replicate ", o.dp_replicate,
             " x --dp-shard ", o.dp_shard, " x --cp ", o.cp, " x --tp ", o.tp, " = ", used,
             "; the layout must use every rank");
    hp::train::plan_layout(o, a.nproc);  // layout errors once, before any rank starts
    return launch_ranks(a, argv);
  }
  return train_rank(env, a);
}

}  // namespace

int main(int argc, char** argv) {
  const std::vector<std::string> argv_copy(argv, argv + argc);
  CLI::App app{"hp-train: train the Qwen3-style decoder with TP x CP"};
  Args a;
  hp_train::add_options(app, a);
  CLI11_PARSE(app, argc, argv);
  try {
    return run(app, a, argv_copy);
  } catch (const std::exception& e) {
    // Messages that already name the tool are printed as they are.
    const std::string what = e.what();
    std::cerr << (what.rfind("hp-train", 0) == 0 ? "" : "hp-train: ") << what << std::endl;
    hp::comm::report_rank_error(e);
    return 1;
  }
}
