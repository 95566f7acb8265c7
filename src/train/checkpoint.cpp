#include "hp/train/checkpoint.h"

#include <cstdio>
#include <filesystem>

#include <ATen/ATen.h>
#include <torch/optim/optimizer.h>
#include <torch/serialize.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

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

}  // namespace hp::train
