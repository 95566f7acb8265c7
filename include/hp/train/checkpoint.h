// Sharded checkpoints (DESIGN section 10): one directory per step, step_XXXXXXXX/, holding
// each rank's tensors (rank<R>.model.pt: named tensors, i.e. its TP slices or HSDP shards) and
// optimizer state (rank<R>.optim.pt), plus rank 0's manifest.json. A step directory is written
// as <dir>.tmp and renamed when complete, so a crash never leaves a half-written step.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>

namespace torch::optim {
class Optimizer;
}

namespace hp::train {

using NamedTensors = std::vector<std::pair<std::string, at::Tensor>>;

std::string step_dir(const std::string& root, int64_t step);
// The newest complete step under `root` (one with a manifest), 0 when none.
int64_t latest_checkpoint(const std::string& root);

void save_rank(const std::string& dir, int rank, const NamedTensors& tensors,
               torch::optim::Optimizer& optimizer);
// Copies the saved values into `tensors` (same names and shapes) and restores the optimizer.
void load_rank(const std::string& dir, int rank, const NamedTensors& tensors,
               torch::optim::Optimizer& optimizer);

}  // namespace hp::train
