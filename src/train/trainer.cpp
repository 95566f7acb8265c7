#include "hp/train/trainer.h"

#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>

#include <ATen/ATen.h>
#include <torch/optim/adamw.h>
#include <torch/serialize.h>
#include <nlohmann/json.hpp>

#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include "hp/comm/collectives.h"
#include "hp/comm/device_mesh.h"
#include "hp/common/check.h"
#include "hp/common/trace.h"
#include "hp/cp/sequence.h"
#include "hp/plan/plan.h"
#include "hp/train/checkpoint.h"

namespace hp::train {
namespace {

namespace fs = std::filesystem;

at::Tensor load_tokens(const std::string& path, const std::string& dtype) {
  std::ifstream f(path, std::ios::binary);
  HP_CHECK(f.good(), "hp-train: cannot open --data '", path, "'");
  std::vector<char> bytes(std::istreambuf_iterator<char>(f), {});
  HP_CHECK(!bytes.empty(), "hp-train: --data '", path, "' is empty");
  if (path.size() > 4 && path.substr(path.size() - 4) == ".bin") {
    HP_CHECK(dtype == "uint16" || dtype == "uint32", "hp-train: --data-dtype '", dtype,
             "' is not valid; valid: uint16, uint32");
    const size_t width = dtype == "uint16" ? 2 : 4;
    HP_CHECK(bytes.size() % width == 0, "hp-train: '", path, "' is not a whole number of ", dtype,
             " ids (", bytes.size(), " bytes)");
    auto t =
        at::empty({static_cast<int64_t>(bytes.size() / width)}, width == 2 ? at::kShort : at::kInt);
    std::memcpy(t.data_ptr(), bytes.data(), bytes.size());
    const int64_t mask = width == 2 ? int64_t{0xFFFF} : int64_t{0xFFFFFFFF};
    return t.to(at::kLong).bitwise_and(mask);  // the ids are unsigned
  }
  auto t = at::empty({static_cast<int64_t>(bytes.size())}, at::kByte);
  std::memcpy(t.data_ptr(), bytes.data(), bytes.size());
  return t.to(at::kLong);  // byte-level tokens
}

double lr_at(const TrainOptions& o, int64_t step) {  // step is 1-based
  const int64_t warmup = std::max<int64_t>(1, o.lr_warmup);
  if (step <= warmup) return o.lr * static_cast<double>(step) / static_cast<double>(warmup);
  const double t =
      static_cast<double>(step - warmup) / std::max<int64_t>(1, o.lr_decay_steps - warmup);
  return o.lr * (0.1 + 0.9 * 0.5 * (1.0 + std::cos(M_PI * std::min(1.0, t))));
}

int64_t peak_rss() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return static_cast<int64_t>(u.ru_maxrss) * 1024;
}

at::Tensor loss_sum(const at::Tensor& logits, const at::Tensor& labels) {
  return at::cross_entropy_loss(logits.reshape({-1, logits.size(-1)}), labels.reshape({-1}), {},
                                at::Reduction::Sum, -100);
}

// One training run of `model` over `world`'s layout; also used for the single-process
// reference of --validate (world of one rank, no CP).
struct Runner {
  const TrainOptions& o;
  comm::DeviceMesh& mesh;
  model::Qwen3 model;
  std::unique_ptr<torch::optim::AdamW> opt;
  hsdp::FullyShard* fs = nullptr;
  NamedTensors params;  // what the optimizer updates: parameters, or HSDP shards
  int64_t cp, cp_rank, tp_rank, dp, dp_rank;
  bool lb;

  const plan::ShardingPlan* plan = nullptr;  // TP placements (null: nothing is TP-sharded)

  Runner(const TrainOptions& opts, comm::DeviceMesh& m,
         const std::optional<cp::ContextParallelConfig>& cfg)
      : o(opts), mesh(m), model(opts.model, m.size("tp") > 1 ? m.group_ptr({"tp"}) : nullptr) {
    cp = m.size("cp");
    cp_rank = m.coordinate("cp");
    tp_rank = m.coordinate("tp");
    dp = m.size("dp_replicate") * m.size("dp_shard");
    dp_rank = m.coordinate("dp_replicate") * m.size("dp_shard") + m.coordinate("dp_shard");
    lb = cfg && cfg->load_balance;
  }

  // After the applier ran (HSDP replaces the parameters by shards).
  void make_optimizer(hsdp::FullyShard* fully_shard) {
    fs = fully_shard;
    params.clear();
    if (fs != nullptr) {
      params = fs->sharded_parameters();
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

  std::map<std::string, at::Tensor> first_grads;  // --validate: full gradients of step 1
  plan::BoundaryChecker* checker = nullptr;       // validate mode
  plan::Layout input_layout;

  // Forward + backward of one step (grad_accum micro-batches); returns the global mean loss.
  // Each rank's loss is its token sum over the global token count, so the gradient is a plain
  // SUM over data-parallel and CP ranks (HSDP reduces with SUM; without HSDP the CP all-reduce).
  double forward_backward(int64_t step) {
    const double tp = static_cast<double>(mesh.size("tp"));
    auto& world = mesh.world().group();
    double loss = 0;
    for (int64_t micro = 0; micro < o.grad_accum; ++micro) {
      TrainOptions global = o;
      global.batch = o.batch * dp;  // the union of every data-parallel rank's rows
      at::Tensor ids, labels;
      make_batch(global, step, ids, labels, micro);
      ids = ids.narrow(0, dp_rank * o.batch, o.batch);
      labels = labels.narrow(0, dp_rank * o.batch, o.batch);
      auto b = cp::shard_batch(ids, labels, cp_rank, cp, lb);
      if (checker != nullptr) checker->set(b.input_ids, input_layout);
      if (fs != nullptr) fs->set_requires_all_reduce(micro == o.grad_accum - 1);
      auto logits = model->forward(b.input_ids, b.position_ids);
      auto local_sum = loss_sum(logits, b.labels);
      auto count = b.labels.ne(-100).sum().to(at::kDouble);
      // Summed over the world: every TP rank holds the same tokens.
      auto stats = comm::all_reduce(world, at::stack({count, local_sum.detach().to(at::kDouble)}));
      const double global_count = stats[0].item<double>() / tp;
      HP_CHECK(global_count > 0, "hp-train: a batch has no labelled tokens");
      (local_sum / (global_count * static_cast<double>(o.grad_accum))).backward();
      loss += stats[1].item<double>() / tp / global_count / static_cast<double>(o.grad_accum);
    }
    if (fs == nullptr) {  // HSDP's drain did both reductions
      for (auto& [n, p] : params) {
        if (p.grad().defined() && cp > 1)
          p.mutable_grad() = comm::all_reduce(mesh.group("cp"), p.grad());
      }
      if (mesh.size("tp") > 1) {
        for (auto& p : model->tp_partial_grad_parameters()) {
          p.mutable_grad() = comm::all_reduce(mesh.group("tp"), p.grad());
        }
      }
    }
    if (o.validate && first_grads.empty()) {
      for (auto& [n, p] : params) {
        if (fs != nullptr) {
          first_grads[n] = fs->full_gradient(n);  // collective over the shard group
        } else if (p.grad().defined()) {
          first_grads[n] = p.grad().clone();
        }
      }
    }
    return loss;
  }

  // Global-norm clipping (TP shards summed, TP-replicated parameters counted once, HSDP shards
  // summed over the shard group, replicas once), then AdamW.
  double clip_and_step(int64_t step) {
    double local = 0;
    for (auto& [n, p] : params) {
      if (!p.grad().defined()) continue;
      const bool tp_sharded = plan != nullptr && plan->tp_shard_dim(n).has_value();
      if (tp_sharded || tp_rank == 0) local += p.grad().pow(2).sum().item<double>();
    }
    // Ranks holding the same values: HSDP replicas; without HSDP, every CP rank.
    const double copies =
        fs != nullptr ? static_cast<double>(mesh.size("dp_replicate")) : static_cast<double>(cp);
    double total = local;
    if (mesh.world().size() > 1) {
      total =
          comm::all_reduce(mesh.world().group(), at::full({1}, local, at::kDouble)).item<double>() /
          copies;
    }
    const double norm = std::sqrt(total);
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
    return norm;
  }
};

}  // namespace

void make_batch(const TrainOptions& o, int64_t step, at::Tensor& ids, at::Tensor& labels,
                int64_t micro) {
  const int64_t s = o.seq_len;
  uint64_t seed = o.seed * 7919ULL + static_cast<uint64_t>(step);
  if (micro > 0) seed = seed * 1000003ULL + static_cast<uint64_t>(micro);
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  if (o.data.empty()) {
    HP_CHECK(s % 2 == 0, "hp-train: --seq-len ", s, " must be even for the copy task");
    const int64_t half = s / 2;
    auto block = at::randint(1, o.model.vocab, {o.batch, half}, gen, at::kLong);
    auto tokens = at::cat({block, block}, 1);
    ids = tokens;
    // Predict token t+1 from position t; only the second copy is learnable.
    labels = at::full({o.batch, s}, -100, at::kLong);
    labels.narrow(1, half, half - 1).copy_(tokens.narrow(1, half + 1, half - 1));
    labels.narrow(1, half - 1, 1).copy_(tokens.narrow(1, half, 1));
    return;
  }
  static thread_local std::string loaded_path;
  static thread_local at::Tensor corpus;
  if (loaded_path != o.data) {
    corpus = load_tokens(o.data, o.data_dtype);
    loaded_path = o.data;
  }
  HP_CHECK(corpus.size(0) > s + 1, "hp-train: --data has ", corpus.size(0),
           " tokens, fewer than --seq-len + 1 = ", s + 1);
  HP_CHECK(corpus.max().item<int64_t>() < o.model.vocab, "hp-train: --data holds token ids up to ",
           corpus.max().item<int64_t>(), " but --vocab is ", o.model.vocab,
           "; raise --vocab (text files need 256)");
  auto starts = at::randint(0, corpus.size(0) - s - 1, {o.batch}, gen, at::kLong);
  std::vector<at::Tensor> rows_in, rows_out;
  for (int64_t b = 0; b < o.batch; ++b) {
    const int64_t st = starts[b].item<int64_t>();
    rows_in.push_back(corpus.narrow(0, st, s));
    rows_out.push_back(corpus.narrow(0, st + 1, s));
  }
  ids = at::stack(rows_in);
  labels = at::stack(rows_out);
}

TrainResult train(const comm::World& world, const TrainOptions& o) {
  // Every static check before the first collective.
  plan::PlanOptions po;
  po.tp_size = o.tp;
  po.cp_size = o.cp;
  po.cp_config = o.cp_config;
  po.seq_len = o.seq_len;
  po.dp_shard = o.dp_shard;
  po.dp_replicate = o.dp_replicate;
  po.comm_fusion = o.comm_fusion;
  po.reduce_op = hsdp::ReduceOp::kSum;  // losses are normalised by the global token count
  po.batch = o.batch;
  if (o.cp_auto && o.cp > 1) {
    po.cp_auto = true;
    po.calibration = plan::load_calibration(plan::default_calibration_path(plan::current_link()));
  }
  HP_CHECK(o.steps >= 1 && o.batch >= 1 && o.seq_len >= 2 && o.grad_accum >= 1,
           "hp-train: --steps, --batch and --grad-accum must be >= 1 and --seq-len >= 2");
  model::Qwen3 probe(o.model);  // sizes only (cheap at these sizes)
  auto plan = plan::ShardingPlanner().plan(*probe, world.size(), po);
  comm::DeviceMesh mesh(world, plan.mesh_dims, plan.mesh_options());
  Runner run(o, mesh, plan.cp_config);
  run.plan = &plan;
  auto apply_log = plan::ShardingApplier().apply(
      *run.model, plan, mesh, o.validate_mode ? plan::Mode::kValidate : plan::Mode::kProduction);
  run.make_optimizer(plan.fully_shard.get());
  run.checker = plan.checker.get();
  run.input_layout = plan.activation_layout();

  TrainResult result;
  result.plan = plan.describe();
  const bool rank0 = world.rank() == 0;
  if (rank0) {
    std::printf("hp-train: plan %s (%s mode)\n", result.plan.c_str(),
                o.validate_mode ? "validate" : "production");
    for (const auto& l : plan.log)
      std::printf("  %s\n", l.c_str());
    for (const auto& l : apply_log)
      std::printf("  %s\n", l.c_str());
    std::fflush(stdout);
  }
  int64_t first = 1;
  if (o.resume) {
    HP_CHECK(!o.checkpoint_dir.empty(), "hp-train: --resume needs --checkpoint-dir");
    const int64_t last = latest_checkpoint(o.checkpoint_dir);
    if (last > 0) {
      const auto dir = step_dir(o.checkpoint_dir, last);
      std::ifstream mf(fs::path(dir) / "manifest.json");
      auto manifest = nlohmann::json::parse(mf);
      HP_CHECK(manifest["world_size"] == world.size() && manifest["tp"] == o.tp &&
                   manifest["cp"] == o.cp && manifest.value("dp_shard", 1) == o.dp_shard &&
                   manifest.value("dp_replicate", 1) == o.dp_replicate &&
                   manifest["model"]["layers"] == o.model.layers &&
                   manifest["model"]["hidden"] == o.model.hidden,
               "hp-train --resume: checkpoint '", dir, "' was written by another layout or model (",
               manifest["plan"].get<std::string>(),
               "); resume with the same --nproc/--tp/--cp/--dp-shard/--dp-replicate and model "
               "sizes");
      load_rank(dir, world.rank(), run.params, *run.opt);
      first = last + 1;
      if (rank0) std::printf("hp-train: resumed from %s\n", dir.c_str());
    }
  }
  const bool tty = rank0 && isatty(STDOUT_FILENO);
  auto& counters = world.context().counters;
  const int64_t tokens_per_step = o.batch * o.seq_len;
  std::map<std::string, int64_t> bytes_first_step;
  for (int64_t step = first; step <= o.steps; ++step) {
    counters.reset();
    auto t0 = std::chrono::steady_clock::now();
    StepMetrics m;
    m.step = step;
    m.loss = run.forward_backward(step);
    m.grad_norm = run.clip_and_step(step);
    m.lr = lr_at(o, step);
    m.step_time_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    m.tokens_per_s = tokens_per_step / m.step_time_s;
    if (bytes_first_step.empty()) {
      for (auto op : {comm::OpKind::kAllGather, comm::OpKind::kAllToAll,
                      comm::OpKind::kReduceScatter, comm::OpKind::kAllReduce}) {
        bytes_first_step[comm::op_name(op)] = counters.bytes(op);
      }
    }
    result.steps.push_back(m);
    if (rank0) {
      const double eta = m.step_time_s * static_cast<double>(o.steps - step);
      if (tty) {
        std::printf("\r  step %lld/%lld  loss %.4f  %.0f tok/s  ETA %.0fs  peak %.0f MiB   ",
                    (long long)step, (long long)o.steps, m.loss, m.tokens_per_s, eta,
                    peak_rss() / 1048576.0);
        if (step == o.steps) std::printf("\n");
      } else if (step == first || step == o.steps || step % std::max(1, o.progress_every) == 0) {
        std::printf("  step %lld/%lld loss %.4f %.0f tok/s ETA %.0fs peak %.0f MiB\n",
                    (long long)step, (long long)o.steps, m.loss, m.tokens_per_s, eta,
                    peak_rss() / 1048576.0);
      }
      std::fflush(stdout);
    }
    if (!o.checkpoint_dir.empty() && o.checkpoint_every > 0 &&
        (step % o.checkpoint_every == 0 || step == o.steps)) {
      const auto dir = step_dir(o.checkpoint_dir, step);
      const auto tmp = dir + ".tmp";
      if (rank0) fs::create_directories(tmp);
      comm::barrier(world.group());
      // Each rank writes its part into the temporary directory; rank 0 renames it once all are
      // there (temp + rename: a crash never leaves a half-written step behind).
      save_rank(tmp, world.rank(), run.params, *run.opt);
      comm::barrier(world.group());
      if (rank0) {
        const auto& mc = o.model;
        nlohmann::json manifest = {
            {"step", step},
            {"data_position", step},  // batches are a pure function of (seed, step)
            {"rng", {{"data_seed", o.seed}, {"model_seed", mc.seed}}},
            {"world_size", world.size()},
            {"tp", o.tp},
            {"cp", o.cp},
            {"dp_shard", o.dp_shard},
            {"dp_replicate", o.dp_replicate},
            {"grad_accum", o.grad_accum},
            {"plan", result.plan},
            {"model",
             {{"vocab", mc.vocab},
              {"layers", mc.layers},
              {"hidden", mc.hidden},
              {"heads", mc.heads},
              {"kv_heads", mc.kv_heads},
              {"head_dim", mc.head_dim},
              {"ffn", mc.ffn}}},
            {"train",
             {{"seq_len", o.seq_len},
              {"batch", o.batch},
              {"lr", o.lr},
              {"lr_warmup", o.lr_warmup},
              {"lr_decay_steps", o.lr_decay_steps},
              {"data", o.data}}}};
        std::ofstream(fs::path(tmp) / "manifest.json") << manifest.dump(2) << "\n";
        fs::remove_all(dir);
        fs::rename(tmp, dir);
      }
      comm::barrier(world.group());
    }
  }
  if (o.validate) {
    HP_CHECK(first == 1,
             "hp-train: --validate compares a whole run from step 1; do not combine "
             "it with --resume");
    // The same model, init and data, single-process on the full sequence (rank 0; the others
    // wait). Same kernels; only the layout differs.
    double max_loss = 0, max_rel = 0;
    if (rank0) {
      auto store = c10::make_intrusive<c10d::HashStore>();
      auto solo = comm::World::in_process(0, 1, store);
      comm::DeviceMesh solo_mesh(solo,
                                 {{"dp_replicate", 1}, {"dp_shard", 1}, {"cp", 1}, {"tp", 1}});
      TrainOptions ro = o;
      ro.validate = true;
      ro.batch = o.batch * o.dp_shard * o.dp_replicate;  // the union of the data-parallel rows
      ro.dp_shard = ro.dp_replicate = 1;
      Runner ref(ro, solo_mesh, std::nullopt);
      ref.make_optimizer(nullptr);
      for (int64_t step = 1; step <= o.steps; ++step) {
        const double loss = ref.forward_backward(step);
        ref.clip_and_step(step);
        max_loss = std::max(max_loss, std::abs(loss - result.steps[step - 1].loss));
      }
      for (const auto& [n, g] : run.first_grads) {
        auto r = ref.first_grads.at(n);
        if (auto dim = plan.tp_shard_dim(n); dim && r.sizes() != g.sizes()) {
          r = r.narrow(*dim, 0, g.size(*dim));  // this rank (TP rank 0) holds the first slice
        }
        const double rel = ((g - r).norm() / (r.norm() + 1e-12)).item<double>();
        max_rel = std::max(max_rel, rel);
      }
      std::printf(
          "hp-train: validate: max |loss - reference| over %lld steps = %.3g; max "
          "relative gradient difference after step 1 = %.3g\n",
          (long long)o.steps, max_loss, max_rel);
    }
    comm::barrier(world.group());
    result.max_abs_loss_diff = max_loss;
    result.max_rel_grad_diff = max_rel;
  }
  std::vector<double> times;
  for (const auto& s : result.steps)
    times.push_back(s.step_time_s);
  std::sort(times.begin(), times.end());
  result.median_step_time_s = times.empty() ? 0 : times[times.size() / 2];
  result.tokens_per_s =
      result.median_step_time_s > 0 ? tokens_per_step / result.median_step_time_s : 0;
  result.final_loss = result.steps.empty() ? 0 : result.steps.back().loss;
  result.comm_bytes_per_step = bytes_first_step;
  result.peak_rss_bytes_max_rank = static_cast<int64_t>(
      comm::all_reduce(world.group(), at::full({1}, static_cast<double>(peak_rss()), at::kDouble),
                       comm::ReduceOp::kMax)
          .item<double>());
  return result;
}

}  // namespace hp::train
