#include "hp/train/checkpoint.h"

#include <cstdio>
#include <filesystem>
#include <fstream>

#include <ATen/ATen.h>
#include <torch/optim/optimizer.h>
#include <torch/serialize.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>
#include <nlohmann/json.hpp>

#include "hp/comm/collectives.h"
#include "hp/comm/world.h"
#include "hp/common/check.h"

namespace hp::train {
namespace fs = std::filesystem;

std::string step_dir(const std::string& root, int64_t step) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "step_%08lld", static_cast<long long>(step));
  return (fs::path(root) / buf).string();
}

int64_t latest_checkpoint(const std::string& root) {
  int64_t best = 0;
  if (!fs::exists(root)) return 0;
  for (const auto& e : fs::directory_iterator(root)) {
    const auto name = e.path().filename().string();
    if (name.rfind("step_", 0) != 0 || !fs::exists(e.path() / "manifest.json")) continue;
    if (name.find('.') != std::string::npos) continue;  // a .tmp left by a crash
    best = std::max<int64_t>(best, std::stoll(name.substr(5)));
  }
  return best;
}

namespace {

std::string file(const std::string& dir, int rank, const char* what) {
  return (fs::path(dir) / common::str_cat("rank", rank, ".", what, ".pt")).string();
}

nlohmann::json manifest(const TrainOptions& o, int world_size, const std::string& plan,
                        int64_t step) {
  const auto& mc = o.model;
  return {{"step", step},
          {"data_position", step},  // batches are a pure function of (seed, step)
          {"rng", {{"data_seed", o.seed}, {"model_seed", mc.seed}}},
          {"world_size", world_size},
          {"tp", o.tp},
          {"cp", o.cp},
          {"dp_shard", o.dp_shard},
          {"dp_replicate", o.dp_replicate},
          {"grad_accum", o.grad_accum},
          {"plan", plan},
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
}

// The manifest of checkpoint `dir` against the resuming run's world size, layout and model.
void check_manifest(const std::string& dir, int world_size, const TrainOptions& o) {
  std::ifstream mf(fs::path(dir) / "manifest.json");
  auto m = nlohmann::json::parse(mf);
  HP_CHECK(m["world_size"] == world_size && m["tp"] == o.tp && m["cp"] == o.cp &&
               m.value("dp_shard", 1) == o.dp_shard &&
               m.value("dp_replicate", 1) == o.dp_replicate &&
               m["model"]["layers"] == o.model.layers && m["model"]["hidden"] == o.model.hidden,
           "hp-train --resume: checkpoint '", dir, "' was written by another layout or model (",
           m["plan"].get<std::string>(),
           "); resume with the same --nproc/--tp/--cp/--dp-shard/--dp-replicate and model "
           "sizes");
}

}  // namespace

void save_rank(const std::string& dir, int rank, const NamedTensors& tensors,
               torch::optim::Optimizer& optimizer) {
  torch::serialize::OutputArchive archive;
  for (const auto& [name, t] : tensors)
    archive.write(name, t.detach());
  archive.save_to(file(dir, rank, "model"));
  torch::save(optimizer, file(dir, rank, "optim"));
}

void load_rank(const std::string& dir, int rank, const NamedTensors& tensors,
               torch::optim::Optimizer& optimizer) {
  const auto path = file(dir, rank, "model");
  HP_CHECK(fs::exists(path), "hp-train --resume: '", path,
           "' is missing; resume with the layout that wrote the checkpoint");
  torch::serialize::InputArchive archive;
  archive.load_from(path);
  at::NoGradGuard no_grad;
  for (const auto& [name, t] : tensors) {
    at::Tensor saved;
    HP_CHECK(archive.try_read(name, saved), "hp-train --resume: '", path, "' has no tensor '", name,
             "'; it was written by another model or layout");
    HP_CHECK(saved.sizes() == t.sizes(), "hp-train --resume: '", name, "' in '", path,
             "' has shape ", saved.sizes(), " but this layout expects ", t.sizes());
    t.detach().copy_(saved);
  }
  torch::load(optimizer, file(dir, rank, "optim"));
}

void save_step(const comm::World& world, const TrainOptions& o, const std::string& plan,
               int64_t step, const NamedTensors& tensors, torch::optim::Optimizer& optimizer) {
  const bool rank0 = world.rank() == 0;
  const auto dir = step_dir(o.checkpoint_dir, step);
  const auto tmp = dir + ".tmp";
  if (rank0) fs::create_directories(tmp);
  comm::barrier(world.group());
  // Each rank writes its part into the temporary directory; rank 0 renames it once all are
  // there (temp + rename: a crash never leaves a half-written step behind).
  save_rank(tmp, world.rank(), tensors, optimizer);
  comm::barrier(world.group());
  if (rank0) {
    std::ofstream(fs::path(tmp) / "manifest.json")
        << manifest(o, world.size(), plan, step).dump(2) << "\n";
    fs::remove_all(dir);
    fs::rename(tmp, dir);
  }
  comm::barrier(world.group());
}

int64_t restore_latest(const comm::World& world, const TrainOptions& o, const NamedTensors& tensors,
                       torch::optim::Optimizer& optimizer) {
  HP_CHECK(!o.checkpoint_dir.empty(), "hp-train: --resume needs --checkpoint-dir");
  const int64_t last = latest_checkpoint(o.checkpoint_dir);
  if (last == 0) return 0;
  const auto dir = step_dir(o.checkpoint_dir, last);
  check_manifest(dir, world.size(), o);
  load_rank(dir, world.rank(), tensors, optimizer);
  return last;
}

}  // namespace hp::train
