// train(): plan -> mesh -> apply -> (resume) -> steps (metrics, progress, checkpoints) ->
// (--validate) -> summary. One step's work is the Runner's (runner.cpp); the data is data.cpp's,
// the checkpoints checkpoint.cpp's, the single-process comparison validate.cpp's.
#include "hp/train/trainer.h"

#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include <ATen/ATen.h>

#include "agree.h"
#include "hf_io.h"
#include "hp/comm/collectives.h"
#include "hp/comm/device_mesh.h"
#include "hp/common/check.h"
#include "hp/plan/plan.h"
#include "hp/train/checkpoint.h"
#include "hp/train/data.h"
#include "hp/train/preflight.h"
#include "runner.h"
#include "validate.h"

namespace hp::train {
namespace {

// The tokens one step trains on over the whole job: every data-parallel rank's micro-batches
// (CP ranks share their sequences; TP ranks their tokens).
int64_t tokens_per_step(const TrainOptions& o) {
  return o.batch * o.grad_accum * o.dp_shard * o.dp_replicate * o.seq_len;
}

int64_t peak_rss() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return static_cast<int64_t>(u.ru_maxrss) * 1024;
}

// Installs `plan` into the runner's model (CP, then HSDP) and builds the optimizer over what it
// left to update; returns the apply log.
std::vector<std::string> apply_plan(Runner& run, plan::ShardingPlan& plan,
                                    const comm::DeviceMesh& mesh) {
  run.plan = &plan;
  auto log = plan::ShardingApplier().apply(
      *run.model, plan, mesh,
      run.o.validate_mode ? plan::Mode::kValidate : plan::Mode::kProduction);
  run.make_optimizer(plan.fully_shard.get());
  run.checker = plan.checker.get();
  run.input_layout = plan.activation_layout();
  return log;
}

void print_plan(const TrainOptions& o, const TrainResult& result, const plan::ShardingPlan& plan,
                const std::vector<std::string>& apply_log) {
  std::printf("hp-train: plan %s (%s mode)\n", result.plan.c_str(),
              o.validate_mode ? "validate" : "production");
  for (const auto& l : plan.log)
    std::printf("  %s\n", l.c_str());
  for (const auto& l : apply_log)
    std::printf("  %s\n", l.c_str());
  std::printf("  memory: about %s per rank (estimate)\n", estimate_memory(o).describe().c_str());
  std::fflush(stdout);
}

// The first step to run: 1, or the one after the checkpoint --resume restored (past o.steps
// when the run is finished).
int64_t first_step(const comm::World& world, Runner& run, const std::string& data_fingerprint) {
  const TrainOptions& o = run.o;
  if (!o.resume && !o.resume_if_exists) return 1;
  const int64_t last = restore_latest(world, o, run.params, *run.opt, data_fingerprint);
  if (last == 0) return 1;
  if (world.rank() == 0) {
    if (last >= o.steps) {
      std::printf(
          "hp-train: the run in '%s' is finished: its last checkpoint is step %lld of --steps "
          "%lld; nothing to do (raise --steps to train on)\n",
          o.checkpoint_dir.c_str(), static_cast<long long>(last), static_cast<long long>(o.steps));
    } else {
      std::printf("hp-train: resumed from %s\n", step_dir(o.checkpoint_dir, last).c_str());
    }
    std::fflush(stdout);
  }
  return last + 1;
}

// One optimizer step, timed (the traffic counters count this step only).
StepMetrics run_step(const comm::World& world, Runner& run, const Corpus& corpus, int64_t step) {
  world.context().counters.reset();
  auto t0 = std::chrono::steady_clock::now();
  StepMetrics m;
  m.step = step;
  m.loss = run.forward_backward(step, corpus);
  m.moe_aux_loss = run.moe_aux_loss;
  m.moe_dropped = run.moe_dropped;
  m.index_loss = run.index_loss;
  m.grad_norm = run.grad_norm();
  // Loss and norm are global values, the same on every rank: all ranks take the same branch.
  if (std::isfinite(m.loss) && std::isfinite(m.grad_norm)) {
    run.clip_and_update(step, m.grad_norm);
  } else {
    m.skipped = true;
    m.first_nonfinite_rank = run.first_nonfinite_rank();
    run.discard_grads();
    run.first_grads.clear();  // --validate compares the first step that updated instead
  }
  m.lr = lr_at(run.o, step);
  m.step_time_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  m.tokens_per_s = static_cast<double>(tokens_per_step(run.o)) / m.step_time_s;
  return m;
}

// Rank 0's progress: one rewritten line on a terminal, else a line every progress_every steps.
void print_progress(const TrainOptions& o, const StepMetrics& m, int64_t first, bool tty) {
  const int64_t step = m.step;
  const double eta = m.step_time_s * static_cast<double>(o.steps - step);
  if (tty) {
    std::printf("\r  step %lld/%lld  loss %.4f  %.0f tok/s  ETA %.0fs  peak %.0f MiB   ",
                (long long)step, (long long)o.steps, m.loss, m.tokens_per_s, eta,
                peak_rss() / 1048576.0);
    if (step == o.steps) std::printf("\n");
  } else if (step == first || step == o.steps || step % std::max(1, o.progress_every) == 0) {
    const std::string moe = o.model.experts > 0 ? common::str_cat(" moe aux ", m.moe_aux_loss,
                                                                  " dropped ", m.moe_dropped)
                                                : std::string();
    std::printf("  step %lld/%lld loss %.4f %.0f tok/s ETA %.0fs peak %.0f MiB%s\n",
                (long long)step, (long long)o.steps, m.loss, m.tokens_per_s, eta,
                peak_rss() / 1048576.0, moe.c_str());
  }
  std::fflush(stdout);
}

// Every checkpoint_every steps, and the last step whenever there is a checkpoint directory.
bool checkpoint_due(const TrainOptions& o, int64_t step) {
  return !o.checkpoint_dir.empty() &&
         (step == o.steps || (o.checkpoint_every > 0 && step % o.checkpoint_every == 0));
}

std::string value_text(double v) {
  return std::isnan(v) ? "nan" : (v > 0 ? "inf" : "-inf");
}

// A step whose loss or gradient norm was not finite (its update was skipped): an error under
// --nan-policy error (naming the step, the first rank and the last checkpoint, which is kept),
// else a line on rank 0.
void on_nonfinite(const comm::World& world, const TrainOptions& o, const StepMetrics& m) {
  const std::string what = std::isfinite(m.loss)
                               ? "non-finite gradient norm (" + value_text(m.grad_norm) + ")"
                               : "non-finite loss (" + value_text(m.loss) + ")";
  const std::string who = m.first_nonfinite_rank >= 0 ? common::str_cat(" (first seen on rank ",
                                                                        m.first_nonfinite_rank, ")")
                                                      : std::string();
  if (o.nan_policy == NanPolicy::kError) {
    std::string kept = "; no checkpoint directory was given";
    if (!o.checkpoint_dir.empty()) {
      const int64_t last = latest_checkpoint(o.checkpoint_dir);
      kept = last > 0 ? common::str_cat("; the last checkpoint is '",
                                        step_dir(o.checkpoint_dir, last), "' (kept)")
                      : "; no checkpoint was written before it";
    }
    HP_CHECK(false, "hp-train: ", what, " at step ", m.step, who,
             "; stopped before updating the model (--nan-policy error; --nan-policy skip-step "
             "skips such steps)",
             kept);
  }
  if (world.rank() == 0) {
    std::printf("hp-train: step %lld: %s%s; skipped its optimizer step (--nan-policy skip-step)\n",
                static_cast<long long>(m.step), what.c_str(), who.c_str());
    std::fflush(stdout);
  }
}

// Steps `first`..o.steps: their metrics into `result` (the bytes of the first one as the
// per-step traffic), progress lines and checkpoints.
void run_steps(const comm::World& world, Runner& run, const Corpus& corpus,
               const std::string& data_fingerprint, int64_t first, TrainResult& result) {
  const TrainOptions& o = run.o;
  const bool rank0 = world.rank() == 0;
  const bool tty = rank0 && isatty(STDOUT_FILENO);
  for (int64_t step = first; step <= o.steps; ++step) {
    const StepMetrics m = run_step(world, run, corpus, step);
    if (m.skipped) on_nonfinite(world, o, m);
    if (result.comm_bytes_per_step.empty()) {
      for (auto op : {comm::OpKind::kAllGather, comm::OpKind::kAllToAll,
                      comm::OpKind::kReduceScatter, comm::OpKind::kAllReduce}) {
        result.comm_bytes_per_step[comm::op_name(op)] = world.context().counters.bytes(op);
      }
      for (const auto& [key, entry] : world.context().counters.snapshot()) {
        result.comm_bytes_per_step_by_group[key.second][comm::op_name(key.first)] =
            entry.bytes_sent;
      }
    }
    result.steps.push_back(m);
    if (rank0) print_progress(o, m, first, tty);
    if (checkpoint_due(o, step)) {
      save_step(world, o, result.plan, step, run.params, *run.opt, data_fingerprint);
    }
  }
}

// Median step time, throughput, final loss and the peak RSS over ranks (collective).
void summarize(const comm::World& world, const TrainOptions& o, TrainResult& result) {
  std::vector<double> times;
  for (const auto& s : result.steps)
    times.push_back(s.step_time_s);
  std::sort(times.begin(), times.end());
  result.median_step_time_s = times.empty() ? 0 : times[times.size() / 2];
  result.tokens_per_s = result.median_step_time_s > 0
                            ? static_cast<double>(tokens_per_step(o)) / result.median_step_time_s
                            : 0;
  result.final_loss = result.steps.empty() ? 0 : result.steps.back().loss;
  result.peak_rss_bytes_max_rank = static_cast<int64_t>(
      comm::all_reduce(world.group(), at::full({1}, static_cast<double>(peak_rss()), at::kDouble),
                       comm::ReduceOp::kMax)
          .item<double>());
}

}  // namespace

TrainResult train(const comm::World& world, const TrainOptions& o) {
  // Before anything is allocated; every rank reads the machine's memory before any allocates.
  run_agreed(world, [&] { preflight(o, world.rank(), world.local_size()); });
  auto plan = plan_layout(o, world.size());
  // Each rank plans alone; --cp-algo auto ranks with the rank's own calibration, which a
  // multi-machine job may not share. Ranks that disagree would issue different collectives.
  check_same_on_every_rank(world, plan.describe(), "hp-train: the planned layout",
                           "With --cp-algo auto each rank ranks the strategies with its own "
                           "calibration (HP_CALIBRATION, HP_LINK_RATE): give every machine the "
                           "same, or name the strategy with --cp-algo");
  comm::DeviceMesh mesh(world, plan.mesh_dims, plan.mesh_options());
  Runner run(o, mesh, plan.cp_config);
  const auto apply_log = apply_plan(run, plan, mesh);
  TrainResult result;
  result.plan = plan.describe();
  result.cp_config = plan.cp_config;
  result.memory_estimate_bytes_per_rank = estimate_memory(o).total();
  if (world.rank() == 0) print_plan(o, result, plan, apply_log);
  if (!o.init_from.empty()) {
    // Agreed: a rank whose part is missing or mismatched fails every rank with its message. A
    // --resume checkpoint then replaces these weights.
    run_agreed(world, [&] { load_hf_checkpoint(run, &plan, o.init_from); });
    if (world.rank() == 0) std::printf("hp-train: initialised from %s\n", o.init_from.c_str());
  }
  if (!o.init_weights.empty()) {
    const auto dir = load_weights(world, o, run.params);  // a --resume checkpoint replaces them
    if (world.rank() == 0) std::printf("hp-train: weights from %s\n", dir.c_str());
  }
  // Read once, shared by every step. Agreed, and the same on every rank: a rank that cannot read
  // it fails every rank, and ranks that read different files (copies on other machines) would
  // build different global batches, each normalising the loss by its own token count.
  Corpus corpus;
  run_agreed(world, [&] { corpus = Corpus::load(o); });
  std::string data_fingerprint;  // recorded in checkpoints, compared on resume
  if (!corpus.empty()) {
    data_fingerprint = corpus.fingerprint();
    check_same_on_every_rank(world, data_fingerprint, "hp-train: --data '" + o.data + "'",
                             "Every rank must read the same file: give each machine the same copy");
  }
  const int64_t first = first_step(world, run, data_fingerprint);
  // Before any step: a resumed run has no whole run to compare (checked after the steps, it
  // trained and wrote checkpoints first).
  HP_CHECK(!o.validate || first == 1,
           "hp-train: --validate compares a whole run from step 1, but this run resumes at step ",
           first,
           "; drop --validate, or --resume / --resume-if-exists (or start in an empty "
           "--checkpoint-dir)");
  if (first > o.steps && o.steps > 0) {
    result.already_finished = true;
    // The finished run's weights, just restored (a restart after a failed export, or a rerun
    // that asks for the export).
    if (!o.export_hf.empty()) export_hf_checkpoint(world, run, plan, o.export_hf);
    return result;
  }
  run_steps(world, run, corpus, data_fingerprint, first, result);
  if (o.validate) {
    const auto v = validate_against_reference(world, run, corpus, result.steps);
    result.max_abs_loss_diff = v.max_abs_loss_diff;
    result.max_rel_grad_diff = v.max_rel_grad_diff;
  }
  if (!o.export_hf.empty()) export_hf_checkpoint(world, run, plan, o.export_hf);
  summarize(world, o, result);
  return result;
}

}  // namespace hp::train
