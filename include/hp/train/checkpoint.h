// Sharded checkpoints (DESIGN section 10): one directory per step, step_XXXXXXXX/, holding
// each rank's tensors (rank<R>.model.pt: named tensors, i.e. its TP slices or HSDP shards) and
// optimizer state (rank<R>.optim.pt), plus rank 0's manifest.json. A step directory is written
// as <dir>.tmp and renamed when complete, so a crash never leaves a half-written step.
// The manifest records the step, the layout, the model and the data position (batches are a
// pure function of (seed, step)); --resume checks it against the resuming run.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>

#include "hp/train/options.h"

namespace torch::optim {
class Optimizer;
}

namespace hp::comm {
class World;
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

// Collective over `world`: writes step `step` of the run `options` (resolved plan `plan`) under
// options.checkpoint_dir: every rank's tensors and optimizer state, then rank 0's manifest, then
// the rename of the complete step directory.
void save_step(const comm::World& world, const TrainOptions& options, const std::string& plan,
               int64_t step, const NamedTensors& tensors, torch::optim::Optimizer& optimizer);

// --resume: restores this rank's part of the newest complete step under options.checkpoint_dir
// (which must be set) after checking that its manifest has this run's world size, layout and
// model sizes. Returns that step; 0 when there is none (nothing is restored).
int64_t restore_latest(const comm::World& world, const TrainOptions& options,
                       const NamedTensors& tensors, torch::optim::Optimizer& optimizer);

}  // namespace hp::train
