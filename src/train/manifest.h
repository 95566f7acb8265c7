// Internal to train/: a checkpoint step's manifest.json (checkpoint.h): what save_step writes
// beside the rank files (the layout, the model, the run's settings, each rank's files with size
// and CRC-32 and its tensors) and how a reading run is checked against it before any file is
// loaded.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "hp/train/checkpoint.h"
#include "hp/train/options.h"

namespace hp::train {

nlohmann::json to_json(const RankRecord& r);
RankRecord rank_record(const nlohmann::json& j);

// The manifest of step `step`, written by a run of `o` on `world_size` ranks with `plan`.
nlohmann::json manifest(const TrainOptions& o, int world_size, const std::string& plan,
                        int64_t step, const std::vector<RankRecord>& ranks,
                        const std::string& data_fingerprint);

// How a checkpoint is read: by --resume (everything; the run continues) or by --init-weights (the
// model tensors only; a new run starts from them). `who` prefixes every message.
struct Reading {
  std::string who;
  bool weights_only = false;
};
inline const Reading kResume{"hp-train --resume", false};
inline const Reading kInitWeights{"hp-train --init-weights", true};

// The manifest of checkpoint `dir`, checked against this run: world size, layout and model
// (errors); for --resume also what the batches and the model's function depend on (errors) and
// the learning rate and loss weights (warnings on rank 0). Each message names every setting that
// differs with both values. Returns this rank's record; nullopt for a checkpoint written before
// manifests recorded files.
std::optional<RankRecord> check_manifest(const std::string& dir, int world_size, int rank,
                                         const TrainOptions& o, const Reading& how,
                                         const std::string& data_fingerprint = "");

}  // namespace hp::train
