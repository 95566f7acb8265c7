// Sharded checkpoints (DESIGN section 10): one directory per step, step_XXXXXXXX/, holding
// each rank's tensors (rank<R>.model.pt: named tensors, i.e. its TP slices or HSDP shards) and
// optimizer state (rank<R>.optim.pt), plus rank 0's manifest.json. A step directory is written
// as <dir>.tmp and renamed when complete, so a crash never leaves a half-written step.
// The manifest records the step, the layout, the model and the data position (batches are a
// pure function of (seed, step)), and per rank ("ranks") every file's size and CRC-32 and the
// name, shape and dtype of every model tensor. --resume checks the manifest against the resuming
// run and each rank verifies its files against it before loading: a damaged, truncated or missing
// file, or a tensor this run does not expect, fails naming the file, the rank and what differed.
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

// What one rank wrote of a step (its part of the manifest).
struct FileRecord {
  std::string name;  // in the step directory, e.g. rank1.model.pt
  int64_t bytes = 0;
  uint32_t crc32 = 0;
};
struct TensorRecord {
  std::string name;
  std::vector<int64_t> shape;
  std::string dtype;  // "float32", ...
};
struct RankRecord {
  int rank = 0;
  std::vector<FileRecord> files;
  std::vector<TensorRecord> tensors;  // of the model file, in save order
};

std::string step_dir(const std::string& root, int64_t step);
// The newest complete step under `root` (one with a manifest), 0 when none.
int64_t latest_checkpoint(const std::string& root);

// Writes this rank's files into `dir`; returns what it wrote.
RankRecord save_rank(const std::string& dir, int rank, const NamedTensors& tensors,
                     torch::optim::Optimizer& optimizer);
// Copies the saved values into `tensors` and restores the optimizer. With a `record` (from the
// manifest) it first checks that `tensors` are the recorded names, shapes and dtypes and that
// every recorded file is there with its size and CRC-32; without one (a checkpoint written
// before manifests recorded them) only the names and shapes are checked. Every error names the
// file and the rank.
void load_rank(const std::string& dir, int rank, const NamedTensors& tensors,
               torch::optim::Optimizer& optimizer, const RankRecord* record = nullptr);

// Collective over `world`: writes step `step` of the run `options` (resolved plan `plan`) under
// options.checkpoint_dir: every rank's tensors and optimizer state, then rank 0's manifest, then
// the rename of the complete step directory. `data_fingerprint` identifies the --data corpus by
// its content ("N tokens, CRC-32 X"; empty for the copy task) for restore_latest to compare.
void save_step(const comm::World& world, const TrainOptions& options, const std::string& plan,
               int64_t step, const NamedTensors& tensors, torch::optim::Optimizer& optimizer,
               const std::string& data_fingerprint = "");

// --resume / --resume-if-exists: restores this rank's part of the newest complete step under
// options.checkpoint_dir (which must be set) after checking that its manifest has this run's
// world size, layout, model sizes, --seq-len and --seed (a changed --lr is a warning), and the
// corpus by its content where both this run and the checkpoint give a data_fingerprint (by its
// --data path otherwise).
// Collective: when a rank cannot restore its part, every rank fails with the first failed
// rank's reason (which names the file and the rank). Returns that step; 0 when there is none and
// options.resume_if_exists (nothing is restored); with options.resume alone, no checkpoint is an
// error.
int64_t restore_latest(const comm::World& world, const TrainOptions& options,
                       const NamedTensors& tensors, torch::optim::Optimizer& optimizer,
                       const std::string& data_fingerprint = "");

// --init-weights: copies this rank's model tensors of the checkpoint options.init_weights (a
// step_* directory, or a --checkpoint-dir whose newest complete step is taken) into `tensors`.
// The manifest must have this run's world size, layout and model sizes, and the files are
// verified as for --resume; --seq-len, --seed and --lr may differ. Nothing else is restored: the
// optimizer state, the step count and the data start fresh (a run at a longer --seq-len starts
// from the weights of a shorter one). Collective, like restore_latest. Returns the step
// directory read.
std::string load_weights(const comm::World& world, const TrainOptions& options,
                         const NamedTensors& tensors);

}  // namespace hp::train
